"""Layout search: the fastest layout each system can take, found with the simulator.

A system's throughput depends as much on its layout (LLM tp/pp/cp/ep, microbatches, virtual
stages, recomputation per module; encoder tp/sp; for noncolocated how many ranks the encoders get)
as on its design, so comparing systems at one hand-picked layout compares layouts. `tune` searches
each system's own space:

1. **Enumerate** the layouts the system can take under the layout rules (`search_space`): tp
   divides the LLM's heads and kv heads and fits in a node; tp*cp divides the kv heads (Ulysses
   splits heads); pp at most the LLM's depth, temporal only pp 1; tp*pp*cp divides the ranks the
   LLM gets; ep only for mixture-of-experts models (dividing experts and dp*cp); every microbatch
   count of {1, 2, 4} at pp 1 and {pp, 2pp, 4pp} with pipelining, plus the system's own default
   count; virtual stages 2 where pp >= 2 divides the depth evenly (refused by a planner that does
   not interleave yet: recorded, not simulated); encoder tp for the systems that give encoders a
   layout of their own, encoder sp for omni, the encoders' share of ranks for noncolocated, the
   encoders' quota for spatial (whose space is temporal's).
   Recomputation is searched per module (`recompute_modes`: none, selective, full, and the LLM at
   none, selective or full under every set of encoders recomputed in full, one name per choice;
   an encoder that is frozen or has no work in the batch is no choice).
2. **Prune analytically** before simulating anything (`memory_estimate`): per rank, the training
   state of its parameter shard (costs.training_state_bytes, with the same HSDP shard groups the
   planners resolve) plus the activations of the microbatches 1F1B keeps in flight
   (costs.*_activation_bytes at the mean tokens per data rank): a lower bound on what the
   simulator will count. A layout over the device's memory under every recompute mode is dropped;
   otherwise only its fastest fitting recompute mode (by the analytic time) is kept. The survivors
   are ordered by an analytic step time (compute at the datasheet's achievable rate, the 1F1B
   bubble (pp-1)/(m+pp-1), tp/cp exchanges over NVLink).
3. **Simulate** `budget` of them, the system's default layout always among them; by default the
   budget is a fraction of the layouts left after pruning (`BUDGET_FRACTION`, at least
   `MIN_BUDGET`), so a 9-layout space and a 138-layout one are searched alike. Which ones: the
   first wave spans the levels (the analytically fastest layout of each pipeline depth and of each
   tp x cp split), each later wave the layouts whose analytic time, corrected by what the
   simulations so far say about their levels (`_Search.correction`), is smallest: the analytic
   time knows neither each system's balancing nor what omni's joint pipeline hides, and in plain
   analytic order omni's best layout at 256 GPUs sat 56th of 108. The simulator's memory estimate
   is the final word: a layout that does not fit there is tried again with the next recompute mode
   that holds less, and the smallest simulated/bound ratio seen per mode scales the bound for the
   layouts still to come; then, around the best, the encoder knobs; last, the neighbour descent
   (`neighbour_layouts`): from the best, every layout one change away (tp, pp, cp, microbatches halved
   or doubled, the other cp kind, interleaving, every recompute mode, the encoder knobs, the
   data-parallel modes where the user fixed none), then around the fastest of them, until none is
   faster: a search by levels can stop one change short of a faster layout (another recompute split,
   ZeRO-1 instead of FSDP, one stage fewer). Simulations run in waves of
   `WAVE` layouts through a `Sweep` (every core, or Ray): what one wave learns applies from the
   next, so the answer is the same whatever the number of workers.
4. **Converged?** (`tune_converged`) The search again at twice the budget, reusing every layout
   already simulated: the best step time may move by at most `CONVERGED` (2%); while it moves more,
   the budget doubles again (at most `MAX_DOUBLINGS` times), and the last doubling is reported.
   A search compared with itself can "converge" away from a layout its first wave missed, so a
   search may be **seeded** (`Seed`) with the layouts that won for the same system elsewhere (other
   workloads, sizes, grid cells): they join its first wave and are simulated whatever the budget,
   and the convergence also says how far the answer beat its fastest seed (0: it found nothing
   faster than a seed). An answer that is a seed is settled only after one more doubling.

`batches` may hold several steps (each layout is timed on all, and fits only if it fits every
one); `regime_batches` picks them from a window by how bursty they are (the calmest, the median,
the burstiest, ...), so a layout tuned on calm batches is not the answer when a burst will come.
The picks are a proxy: with `guard_batches` (the whole window a layout will be kept for) the answer
is also simulated on every other step of it, and one that cannot run some step is ruled out for
the next fastest simulated layout (`_guarded`), so what `tune` returns runs the whole window. The
window then decides between that answer and the layouts within `WINDOW_MARGIN` of it on the tuned
steps (at most `WINDOW_CONTENDERS`): each runs every step, and the fastest over the window
(`Trial.window_s`, its mean step) is the answer (`_Search.contend`): a layout slower on a few regime
steps can be faster over a drifting window.

The package, one module per part of the search, each name re-exported here (`from omnibench.tune
import X` is the way in):
- `space.py`: the layouts (`Candidate`, `search_space`, `recompute_modes`, `encoder_variants`,
  `neighbour_layouts`): step 1 and the descents' neighbours;
- `estimates.py`: the analytic memory bound and step time of step 2 (`memory_estimate`, `time_estimate`);
- `budget.py`: how much is simulated (`resolve_budget`, `WAVE`, the descents' rounds);
- `seeds.py`: where a search starts beside its own picks (`Prior`, `Seed`);
- `results.py`: what it answers (`Trial`, `TuneResult`);
- `search.py`: the search of step 3 (`_Search`: waves, levels and correction, the descents);
- `guard.py`: the batches it is tuned on and the window it is checked on (`regime_batches`, `_guarded`);
- `tuner.py`: `tune`, one search from start to end;
- `converge.py`: step 4 (`tune_converged`, `Convergence`).
The package's own code reads `tune`, `tune_converged` and GUARD_ROUNDS through the package
(guard._package), so a patch of one of them here takes effect; any other name is read in the module
that defines it, where a patch must go.

No torch here (planners and the simulator only).
"""

from __future__ import annotations

from omnibench.tune.budget import (
    BUDGET_FRACTION,
    DEFAULT_BUDGET,
    DESCENT_ROUNDS,
    ENCODER_ROUNDS,
    MIN_BUDGET,
    WAVE,
    resolve_budget,
)
from omnibench.tune.converge import CONVERGED, MAX_DOUBLINGS, Convergence, tune_converged
from omnibench.tune.estimates import (
    _batch_flops,
    _dp_state,
    _first_stage,
    _largest,
    _mean_loads,
    _per_batch,
    _per_candidate,
    _Rules,
    _rules,
    _state,
    _train_flops,
    memory_estimate,
    time_estimate,
)
from omnibench.tune.guard import GUARD_ROUNDS, _guarded, regime_batches
from omnibench.tune.results import Trial, TuneResult
from omnibench.tune.search import _dp_fields, _Search
from omnibench.tune.seeds import Prior, Seed, _scaled, _seeded
from omnibench.tune.space import (
    CP_KINDS_SEARCHED,
    ENCODER_DP_MODES,
    NEIGHBOUR_DP_MODES,
    RECOMPUTE_ORDER,
    SPATIAL_QUOTAS,
    SYSTEMS_WITH_ENCODER_LAYOUT,
    ULYSSES_SYSTEMS,
    Candidate,
    _divisors,
    _pow2,
    default_candidate,
    default_microbatches,
    encoder_variants,
    llm_ranks,
    llm_ranks_safe,
    microbatch_counts,
    neighbour_layouts,
    recompute_modes,
    search_space,
)
from omnibench.tune.tuner import _tune_once, tune

__all__ = [
    "BUDGET_FRACTION",
    "CONVERGED",
    "CP_KINDS_SEARCHED",
    "Candidate",
    "Convergence",
    "DEFAULT_BUDGET",
    "DESCENT_ROUNDS",
    "ENCODER_DP_MODES",
    "ENCODER_ROUNDS",
    "GUARD_ROUNDS",
    "MAX_DOUBLINGS",
    "MIN_BUDGET",
    "NEIGHBOUR_DP_MODES",
    "Prior",
    "RECOMPUTE_ORDER",
    "SPATIAL_QUOTAS",
    "SYSTEMS_WITH_ENCODER_LAYOUT",
    "Seed",
    "Trial",
    "TuneResult",
    "ULYSSES_SYSTEMS",
    "WAVE",
    "_Rules",
    "_Search",
    "_batch_flops",
    "_divisors",
    "_dp_fields",
    "_dp_state",
    "_first_stage",
    "_guarded",
    "_largest",
    "_mean_loads",
    "_per_batch",
    "_per_candidate",
    "_pow2",
    "_rules",
    "_scaled",
    "_seeded",
    "_state",
    "_train_flops",
    "_tune_once",
    "default_candidate",
    "default_microbatches",
    "encoder_variants",
    "llm_ranks",
    "llm_ranks_safe",
    "memory_estimate",
    "microbatch_counts",
    "neighbour_layouts",
    "recompute_modes",
    "regime_batches",
    "resolve_budget",
    "search_space",
    "time_estimate",
    "tune",
    "tune_converged",
]

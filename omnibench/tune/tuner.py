"""`tune`: one search of a system's layouts from start to end (`_tune_once`: enumerate and prune the
space, the first wave with the default layout, the prior's and the seeds', the LLM-layout phase, the
encoder knobs, the neighbour descent), inside the guard when given a window (`_guarded`)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from omnibench.specs.model import MultimodalSpec
from omnibench.tune.budget import BUDGET_FRACTION, DEFAULT_BUDGET, ENCODER_ROUNDS, WAVE, resolve_budget
from omnibench.tune.guard import _guarded
from omnibench.tune.results import Trial, TuneResult
from omnibench.tune.search import _dp_fields, _Search
from omnibench.tune.seeds import Prior, Seed, _scaled, _seeded
from omnibench.tune.space import CP_KINDS_SEARCHED, Candidate, default_candidate, search_space


def tune(system: str, model: MultimodalSpec, batches: list, cluster, *, profile=None, budget: int = DEFAULT_BUDGET,
         fraction: float = BUDGET_FRACTION, options: dict | None = None, encoder_search: bool = True, log=None,
         sweep=None, use_cache: bool = True, known: dict | None = None, prior: Prior | None = None,
         stack: str = "eager", dp_mode: str | None = None, default: Candidate | None = None,
         memory_error: float = 0.0, seeds: list[Seed] | None = None, guard_batches: list | None = None,
         mixed_precision: str = "autocast", cp_kinds: tuple[str, ...] = CP_KINDS_SEARCHED,
         freeze: tuple[str, ...] = (), descent: bool = True) -> TuneResult:
    """Search `system`'s layouts on `batches` (a step's samples each) on `cluster`, starting from
    `default` (omnibench/resolve.py's layout; default: `default_candidate`); every layout simulated with
    the `stack`'s kernels (eager | fused) and, when given, the data-parallel mode `dp_mode` (and how
    replicated modules hold their weights, `mixed_precision`: autocast | master), context parallelism
    of the `cp_kinds` given (an ablation: `("ulysses",)` is the space before all-gathered K/V); what fits
    decided with the memory estimates assumed `memory_error` off (SimOptions.memory_error); `freeze`: the
    modules no layout trains (ParallelSpec.freeze), passed to every layout tried and its memory bound.

    `budget`: layouts simulated in the LLM phase (0: `fraction` of the pruned space); `sweep`: the
    `omnibench.sweep.Sweep` the simulations go through (default: this process); `known`: trials of
    an earlier search with the same inputs (`TuneResult.evaluated`), reused instead of simulated;
    `prior`: a smaller cluster's answer (`TuneResult.prior()`), its layouts in the first wave;
    `seeds`: layouts that won for this system elsewhere (`Seed`: other workloads, sizes, grid cells),
    in the first wave after the default and the prior's, and simulated whatever the budget (those of
    other systems are ignored): the answer is never slower than a seed that fits here.

    `guard_batches`: the window the answer will be kept for (every step a static deployment runs);
    the answer then runs every one of them, and is the fastest over the window of the guard's answer,
    the layouts nearly as fast on `batches` and every fitting seed (`_guarded`, `_Search.contend`).
    None: the search's own answer on `batches`.
    `descent`: end with the neighbour descent around the best layout (`_Search.neighbour_descent`), with the
    encoder knobs' search (`encoder_search`) the search around the best."""
    kw = dict(descent=descent, profile=profile, budget=budget, fraction=fraction, options=options, encoder_search=encoder_search,
              log=log, sweep=sweep, use_cache=use_cache, known=known, prior=prior, stack=stack, dp_mode=dp_mode,
              default=default, memory_error=memory_error, seeds=seeds, mixed_precision=mixed_precision,
              cp_kinds=tuple(cp_kinds), freeze=tuple(freeze))
    if guard_batches:
        return _guarded(_tune_once, system, model, batches, cluster, guard_batches, kw)
    return _tune_once(system, model, batches, cluster, **kw)


def _tune_once(system: str, model: MultimodalSpec, batches: list, cluster, *, profile, budget: int, fraction: float,
               options: dict | None, encoder_search: bool, log, sweep, use_cache: bool, known: dict | None,
               prior: Prior | None, stack: str, dp_mode: str | None, default: Candidate | None, memory_error: float,
               seeds: list[Seed] | None, mixed_precision: str = "autocast",
               cp_kinds: tuple[str, ...] = CP_KINDS_SEARCHED, freeze: tuple[str, ...] = (),
               descent: bool = True) -> TuneResult:
    """`tune` without a guard: the search on `batches` alone."""
    from omnibench.sweep import Sweep
    from systems import get_planner

    get_planner(system)  # one-line error for an unknown system
    if budget < 0 or not 0 < fraction <= 1:
        raise ValueError(f"budget must be >= 0 (0: a fraction of the space) and fraction in (0, 1]; got "
                         f"{budget}, {fraction}")
    t0 = time.perf_counter()
    own = sweep is None
    sweep = sweep or Sweep(workers=1)
    try:
        dp_fields = _dp_fields(dp_mode, mixed_precision, freeze)
        search = _Search(system, model, batches, cluster, profile, options, sweep, use_cache, log, known, prior,
                         stack, dp_fields, memory_error, tuple(cp_kinds))
        world, gpn = search.world, search.gpn
        unknown = [k for k in cp_kinds if k not in CP_KINDS_SEARCHED]
        if unknown or not cp_kinds:
            raise ValueError(f"cp_kinds must be one or more of {', '.join(CP_KINDS_SEARCHED)}; got "
                             f"{', '.join(cp_kinds) or 'none'}")
        space = search_space(system, model, world, gpn, tuple(cp_kinds))
        keep: list[Trial] = []
        pruned = refused = 0
        notes: list[str] = []
        for c in space:
            tr, why = search.settle(c)
            if tr is not None:
                keep.append(tr)
            elif why == "memory":
                pruned += 1
            else:
                refused += 1
                notes.append(why)
        keep.sort(key=lambda tr: (tr.estimate_s, tr.candidate.label()))
        n_budget = resolve_budget(budget, fraction, len(keep))
        start = default or default_candidate(system, model, world, gpn, search.per_batch, search.capacity)
        default = search.settle(start)[0] or Trial(replace(start, recompute="full"))
        first = [default.candidate]
        settled = {search.llm_key(tr.candidate): tr.candidate for tr in keep}
        for c in (prior.top if prior is not None else []):
            mapped = _scaled(c, prior.world, world, settled)
            if mapped is not None and mapped not in first:
                first.append(mapped)
        mine = [sd for sd in (seeds or []) if sd.candidate.system == system]
        seeded = [(sd, _seeded(sd, search, settled)) for sd in mine]
        # a seed's layout also in the mode this search settles for it: a seed carries the recompute
        # that fitted where it won (H100), which shadowed a lighter mode that fits here (H200)
        companions = [settled[k] for _, c in seeded if c is not None
                      and (k := search.llm_key(c)) in settled and settled[k] != c]
        for c in [c for _, c in seeded if c is not None] + companions:
            if c not in first:
                first.append(c)
        search.llm_phase(keep, n_budget, first)
        # timed whatever the budget (a no-op when the phase did): the default, every seed and its companion
        search.run([default.candidate] + [c for _, c in seeded if c is not None] + companions)
        if encoder_search:
            # around the best LLM layouts: more of them as the budget grows (twice the budget also
            # searches the encoder knobs of more layouts)
            rounds = max(ENCODER_ROUNDS, math.ceil(n_budget / (2 * WAVE)))
            ranked = sorted((t for t in search.done.values() if t.fits), key=lambda t: (t.step_s, t.candidate.label()))
            bases: list[Trial] = []
            for t in ranked:
                if len(bases) < rounds and all(search.llm_key(t.candidate) != search.llm_key(b.candidate)
                                               for b in bases):
                    bases.append(t)
            for base in bases:
                search.encoder_descent(base, notes)
        fitting = sorted((t for t in search.done.values() if t.fits and t.simulated),
                         key=lambda t: (t.step_s, t.candidate.label()))
        if fitting and descent and encoder_search:
            search.neighbour_descent(fitting[0], notes)
        d = search.final(default.candidate)
        seeded = [(sd, search.final(c) if c is not None else None) for sd, c in seeded]
    finally:
        if own:
            sweep.close()
    sims = [t for t in search.done.values() if t.simulated]
    sims.sort(key=lambda t: (not t.fits, t.step_s, t.candidate.label()))
    for t in search.done.values():
        if not t.simulated and t.note:
            notes.append(f"{t.candidate.label()}: {t.note}")
    for sd, tr in seeded:
        if tr is None:
            notes.append(f"seed {sd.candidate.label()} ({sd.source}): outside this search's space "
                         "(a layout rule, or over the memory bound in every recompute mode)")
    res = TuneResult(system, world, len(space), pruned, refused, len(sims), sims, d, time.perf_counter() - t0,
                     notes, budget=n_budget, space=len(keep), steps=[b.step for b in batches],
                     evaluated=dict(search.done), ratio=dict(search.ratio), seeds=list(mine), seeded=seeded)
    if (note := res.seed_note()) is not None:
        notes.append(note)
    return res

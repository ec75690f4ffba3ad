"""One place resolves the layout a command runs from the layout flags, each system's default layout
and memory: `plan`, `run`, `simulate` and `tune` all call `resolve_layout`.

1. tp, pp, cp: flags given win, the ones not given are 1; none given, the system's default layout,
   its anchor's usual one (systems/defaults.py), checked by planning the first batch (with the
   caller's `check`, e.g. the runtime's limits) and falling back with a note where it cannot plan.
2. recompute: a mode given is kept; `auto` takes the cheapest activation recomputation that fits:
   every choice of modules to recompute in full (the LLM and each encoder the model has), cheapest
   first by the FLOPs it adds to the first batch, so `vision=full,audio=full` (encoders only: four
   patches per LLM token make theirs the largest activations, their forward the cheapest to redo)
   comes before `full`. "Fits" is the simulator's own per-rank memory estimate (what `simulate`
   reports and `run` checks) of the first ESTIMATE_STEPS batches under the caller's budget. When
   no mode fits, `full` is kept and the result says by how much; the caller refuses or reports it.

No torch here: planners and the simulator only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from workloads.sample import Batch

AUTO = "auto"
ESTIMATE_STEPS = 4  # batches the memory estimate looks at: the largest sample of a few steps sets the peak
GiB = 2**30


@dataclass(frozen=True)
class Resolved:
    """What `resolve_layout` settled, and why."""

    parallel: ParallelSpec  # tp, pp, cp and recompute settled
    layout_note: str  # where tp/pp/cp came from
    encoder_chunk_tokens: int = 0
    peak_bytes: float = 0.0  # the memory estimate of the settled mode (0: not estimated)
    peak_rank: int = 0
    budget_bytes: float = 0.0
    fits: bool = True
    chosen: bool = False  # recompute was `auto` and settled here

    @property
    def recompute(self) -> str:
        return self.parallel.recompute

    def memory_note(self) -> str:
        """One line: the mode and its estimate against the budget ("" when not estimated)."""
        if not self.peak_bytes:
            return ""
        chunks = f", encoder chunks of {self.encoder_chunk_tokens} tokens" if self.encoder_chunk_tokens else ""
        how = " (auto: the cheapest that fits)" if self.chosen and self.fits else ""
        verdict = "" if self.fits else f"; does not fit even so, over the {self.budget_bytes / GiB:.1f} GiB budget"
        return (f"recompute={self.recompute}{how}{chunks}: estimated {self.peak_bytes / GiB:.1f} GiB on rank "
                f"{self.peak_rank}{verdict}")


def model_for_workload(model: str, workload) -> tuple[str, str]:
    """The model a command trains on `workload` (a WorkloadSpec): `model` less every encoder that no sample
    of the workload feeds (`NAME@no-audio`), and a note saying so ("" when none is left out). Such an
    encoder never runs, so it holds no activations, gets no gradients and no optimizer state, and
    constrains no layout (e.g. temporal's one Ulysses degree would otherwise have to divide its heads
    too). Every system gets the same model. Raises SpecError for an unknown model."""
    from omnibench.specs.presets import get_model
    from workloads.modules import encoders_used

    spec = get_model(model)
    idle = [m for m in spec.encoders if m not in encoders_used(workload)]
    if not idle:
        return model, ""
    name = model + "".join(f"@no-{m}" for m in idle)
    return name, (f"model: {name} ({workload.name} feeds no {' and no '.join(idle)} encoder, so "
                  f"{'it is' if len(idle) == 1 else 'they are'} left out of {model})")


def recompute_modes(model: MultimodalSpec, samples: Sequence = (), frozen: Sequence[str] = ()) -> list[str]:
    """The recompute modes `auto` tries, cheapest first: each set of the model's modules recomputed in
    full (none, then e.g. audio, vision, both encoders, ..., all), ordered by the forward FLOPs the
    recomputation adds to `samples`; a module with no work in them is left out (recomputing it saves
    nothing), and so is a `frozen` encoder (it runs no backward). Without samples: by how many
    modules, encoders first."""
    from simulator.flops import model_train_flops

    present = [m for m in ("vision", "audio") if m in model.encoders] + ["llm"]
    base = model_train_flops(model, samples) if samples else 0.0

    def added(subset: tuple[str, ...]) -> float:
        if not samples or not subset:
            return 0.0
        return model_train_flops(model, samples, ",".join(f"{m}=full" for m in subset)) - base

    working = [m for m in present if (m == "llm" or m not in frozen) and (not samples or added((m,)) > 0)] or ["llm"]

    def label(subset: tuple[str, ...]) -> str:
        if not subset:
            return "none"
        # "full" would name a frozen encoder too, which has no backward to recompute for
        whole = len(subset) == len(working) and not any(m in frozen for m in present if m != "llm")
        return "full" if whole else ",".join(f"{m}=full" for m in subset)

    subsets = [s for k in range(len(working) + 1) for s in combinations(working, k)]
    return [label(s) for s in sorted(subsets, key=lambda s: (added(s), len(s), [present.index(m) for m in s]))]


def default_layout(system: str, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch,
                   tp: int = 0, pp: int = 0, cp: int = 0, memory_bytes: float | None = None,
                   check: Callable | None = None) -> tuple[ParallelSpec, str]:
    """Step 1: `parallel` with tp, pp, cp from the flags (0: not given), or the system's default."""
    if (tp, pp, cp) != (0, 0, 0):
        given = replace(parallel, tp=tp or 1, pp=pp or 1, cp=cp or 1)
        return given, "given: " + ", ".join(f"{k} {v}" for k, v in (("tp", given.tp), ("pp", given.pp),
                                                                       ("cp", given.cp)))
    from systems.defaults import DEVICE_BYTES, with_default_layout

    return with_default_layout(system, model, parallel, batch, memory_bytes or DEVICE_BYTES, check=check)


def peak_memory(system: str, model: MultimodalSpec, parallel: ParallelSpec, batches: Sequence[Batch], cluster,
                encoder_chunk_tokens: int = 0, over: float = math.inf, stack: str = "eager",
                software: dict | None = None) -> tuple[float, int]:
    """(bytes, rank): the most loaded rank's peak over `batches`, as the simulator counts it for
    `parallel` (its recompute mode) on `cluster` under the software `stack` (`Engine.peak_needed`: the
    step's programs, not its play). `over`: where some rank needs more, that rank's need (the layout does
    not fit `over`; the rest is not looked at). `software`: SimOptions fields of a named software stack
    (simulator/stacks.py), over `stack`."""
    from simulator.engine import Engine, SimOptions, drop_spare_engine, offer_engine
    from systems import get_planner, offer_plan

    drop_spare_engine()  # an engine offered for an earlier check is not held while this one builds its own
    planner = get_planner(system)
    options = SimOptions(recompute=parallel.recompute, check_memory=False, encoder_chunk_tokens=encoder_chunk_tokens,
                         mixed_precision=parallel.mixed_precision, **{"stack": stack, **(software or {})})
    tops: dict[int, tuple[float, int]] = {}
    # the first batch last: its plan (and the programs built for it) is then offered to the caller,
    # which plans and simulates that step next
    for k in [*range(1, len(batches)), 0][:len(batches)]:
        plan = planner.plan(model, parallel, batches[k])
        engine = Engine(plan, model, cluster, options=options)
        tops[k] = engine.peak_needed(over)
        if k == 0:  # (a planner that does not read the recompute mode plans the next mode's step with it too)
            offer_plan(planner, model, parallel, batches[0], plan)
        if tops[k][0] > over:
            return tops[k]
        if k == 0:
            offer_engine(engine)
        del plan, engine
    worst, rank = 0.0, 0
    for k in range(len(batches)):
        if tops[k][0] > worst:
            worst, rank = tops[k]
    return worst, rank


def resolve_layout(system: str, model: MultimodalSpec, parallel: ParallelSpec, batches: Sequence[Batch], cluster,
                   *, tp: int = 0, pp: int = 0, cp: int = 0, recompute: str | None = None,
                   budget_bytes: float | None = None, encoder_chunk_tokens: int = 0,
                   chunk_options: Callable[[str], Sequence[int]] | None = None, check: Callable | None = None,
                   estimate: bool | None = None, stack: str = "eager", software: dict | None = None) -> Resolved:
    """The layout `system` runs with (module docstring). `parallel` carries every other field;
    `batches` are the first batches of the run (the first ESTIMATE_STEPS are estimated); `cluster`
    is what the memory is estimated on, `budget_bytes` what must hold (default: its GPU's memory).
    `recompute` (default: `parallel.recompute`) `auto` is settled here; a given mode is estimated only
    when `estimate` is true. `chunk_options(mode)`: encoder chunk budgets to try with each mode, in
    order (default: `encoder_chunk_tokens` only). `stack`: the software stack the simulator's memory
    estimate counts (SimOptions.stack: this runtime's eager one, or `simulate --stack fused`). Raises what
    the planner or layout rules raise for a layout that cannot plan (SpecError, PlanError, ValueError), in
    one line."""
    mode = recompute or parallel.recompute
    memory = cluster.gpu.memory_bytes
    if estimate is None:
        estimate = mode == AUTO
    # the layout is checked with the recompute mode the step runs with where that is settled already
    # (omni's plan depends on it), so that the plan checked is the plan the caller plans next
    # (systems.offer_plan hands it over instead of planning the step twice)
    settled = mode if mode != AUTO else parallel.recompute if estimate else "none"
    laid, note = default_layout(system, model, replace(parallel, recompute=settled), batches[0], tp, pp, cp,
                                memory, check)
    budget = budget_bytes if budget_bytes is not None else memory
    if not estimate:
        return Resolved(replace(laid, recompute="none" if mode == AUTO else mode), note,
                        encoder_chunk_tokens=encoder_chunk_tokens)
    first = list(batches[:ESTIMATE_STEPS])
    modes = recompute_modes(model, [x for b in first for x in b.samples], laid.freeze) if mode == AUTO else [mode]
    trials = [(m, chunk) for m in modes for chunk in (chunk_options(m) if chunk_options else (encoder_chunk_tokens,))]
    # the one trial whose estimate is answered when none fits (auto: the last, the most recomputation;
    # a given mode: its first); every other one only has to be found over the budget, which its first
    # rank over it shows
    reported = len(trials) - 1 if mode == AUTO else 0
    tried = None
    for i, (m, chunk) in enumerate(trials):
        trial = replace(laid, recompute=m)
        trial.validate(model)
        peak, rank = peak_memory(system, model, trial, first, cluster, chunk, math.inf if i == reported else budget,
                                 stack, software)
        got = Resolved(trial, note, chunk, peak, rank, budget, peak <= budget, chosen=mode == AUTO)
        if got.fits:
            return got
        tried = tried or got
    if mode == AUTO:  # nothing fits: the most recomputation, and how far over it is
        return replace(got, fits=False)
    return tried

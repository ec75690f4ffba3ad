"""Spatial: temporal's layout, with the encoders and the LLM running side by side on every GPU.

Stands for Apollo (Wang et al., "Mosaic: Towards Efficient Training of Multimodal Models with Spatial
Resource Multiplexing", arXiv 2605.18710): a single module of a multimodal model often cannot use a
whole GPU, so instead of running one module at a time (temporal multiplexing, `temporal`) modules are
colocated on a GPU and run at once under resource quotas (temporal-spatial multiplexing), reported up
to 1.31x faster than temporal multiplexing.

The layout is temporal's (VeOmni's): every module FSDP-sharded over all ranks, encoders at tp 1 with
the LLM's cp group as their Ulysses group, pp 1. What changes is the order within a rank. A step of
m microbatches runs in m + 2 phases:

    encoders forward of mb 0                                    (the whole device)
    for i in 0 .. m-1:
        LLM forward of mb i   beside  encoders forward of mb i+1    (quotas 1 - q, q)
        LLM backward of mb i  beside  encoders backward of mb i-1
    encoders backward of mb m-1                                 (the whole device)

A forward beside a forward and a backward beside a backward: each pass's share of a module's work is
about the same for encoders and LLM, so the lanes of a phase are as long as the microbatches are
alike. Each phase's two lanes are one concurrency group (`Action.concurrent`): they start together and the
phase ends when both have, so the dependencies (the LLM's microbatch after its encoders' forward, the
encoders' backward after the LLM's) always lie in earlier phases; the boundary exchanges of a phase's
microbatches run between phases. A phase with one lane empty runs it on the whole device: with one
microbatch the step is temporal's.

The quota q (the encoders' share of the device: a GPU's SMs, a CPU's intra-op threads) is
`--option quota=Q` (0 < Q < 1) for every phase, or `auto` (the default), per phase: the encoders'
share of the phase's work (the two microbatches' samples) by the planner's balancer (the analytic
FLOP estimate every system balances with), which makes the lanes equally long if both scale linearly
with their share. Apollo derives its quotas from a performance model of
each module under an allocation; here `tune` searches the quota with the simulator, as it searches
every system's layout (`omnibench/tune/`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from omnibench.plan import BACKWARD, BOUNDARY, CONCURRENCY_OPTION, FORWARD, Action, Plan, PlanError, lane_of
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems import QUOTA_OPTION
from systems.common import _cost_model, data_rank, finish, plan_encoders_in_stage0, weigh_of
from systems.temporal import check_veomni_layout
from workloads.sample import Batch

# microbatches when none are given: two, the fewest that put two modules side by side (one runs temporal's step)
SPATIAL_MICROBATCHES = 2
# the auto quota stays inside these: neither lane is starved by a phase whose estimate says it has little to do
MIN_SHARE, MAX_SHARE = 0.05, 0.95


def parse_quota(options: dict) -> float:
    """The encoders' quota `options` ask for: a share in (0, 1), or 0.0 for `auto`. Other systems' keys are
    theirs: the CLI refuses a key no system knows (systems/omni/options.py `OmniOptions.parse`)."""
    raw = (options or {}).get(QUOTA_OPTION, "auto")
    if str(raw) == "auto":
        return 0.0
    try:
        q = float(raw)
    except (TypeError, ValueError):
        raise PlanError(f"options.{QUOTA_OPTION} must be auto or a share in (0, 1), got {raw!r}") from None
    if not 0.0 < q < 1.0:
        raise PlanError(f"options.{QUOTA_OPTION} must be auto or a share in (0, 1), got {raw!r}")
    return q


def _shares(model: MultimodalSpec, parallel: ParallelSpec, plan: Plan) -> Callable[[int], Callable]:
    """rank -> its phases' `auto` quotas: the encoders' share of a phase's work, the encoders' microbatch
    priced against the LLM's by the planner's balancer (under tokens, which prices no module apart, the
    analytic FLOP estimate). A rank's encoder microbatch j holds its share of its LLM data group's
    microbatch j, as its LLM microbatch does: the group's microbatches give the ratio."""
    weigh = weigh_of(model, parallel, with_encoders=True)
    name, hardware = ("analytic", "") if weigh[0] == "tokens" else (weigh[0], weigh[3])
    cm = _cost_model(name, model, hardware)
    llm = plan.layouts["llm"]
    priced: dict[int, tuple[list[float], list[float]]] = {}

    def of(rank: int) -> Callable[[str, int, int], float]:
        d = data_rank(llm, rank)
        if d not in priced:
            mbs = [[plan.sample(i) for i in mb] for mb in plan.assignment["llm"].get(d, [])]
            priced[d] = ([sum(cm.encoders(s) for s in mb) for mb in mbs], [sum(cm.llm(s) for s in mb) for mb in mbs])
        enc, lm = priced[d]

        def share(_: str, i: int, j: int) -> float:
            total = enc[j] + lm[i]
            return round(min(MAX_SHARE, max(MIN_SHARE, enc[j] / total if total > 0 else 0.5)), 4)

        return share

    return of


def spatial_order(actions: list[Action], quota: Callable[[str, int, int], float]) -> list[Action]:
    """One rank's temporal order (encoders' forward and boundary, LLM forward, LLM backward, boundary
    and encoders' backward, per microbatch; then the tail) in spatial phases (module docstring);
    `quota(pass, llm microbatch, encoder microbatch)`: the encoders' share in that phase."""
    head: list[Action] = []
    tail: list[Action] = []
    lanes: dict[tuple[str, str, int], list[Action]] = {}  # (lane, pass, microbatch) -> its compute actions
    boundary: dict[tuple[str, int], list[Action]] = {}  # ("act" | "grad", microbatch) -> its exchanges
    for a in actions:
        if a.kind == BOUNDARY:
            boundary.setdefault((a.what, a.microbatch), []).append(a)
        elif a.kind in (FORWARD, BACKWARD):
            lanes.setdefault((lane_of(a), a.kind, a.microbatch), []).append(a)
        elif not lanes:
            head.append(a)
        else:
            tail.append(a)
    m = max([j for _, _, j in lanes] + [-1]) + 1
    out = list(head)
    group = 0

    def phase(kind: str, i: int, j: int) -> None:
        """The LLM's `kind` pass of microbatch i beside the encoders' of microbatch j."""
        nonlocal group
        llm, enc = lanes.get(("llm", kind, i), []), lanes.get(("encoders", kind, j), [])
        if llm and enc:
            q = quota(kind, i, j)
            out.extend(_in_group(a, group, round(1.0 - q, 4)) for a in llm)
            out.extend(_in_group(a, group, q) for a in enc)
            group += 1
        else:
            out.extend(llm or enc)

    phase(FORWARD, -1, 0)
    out += boundary.get(("act", 0), [])
    for i in range(m):
        phase(FORWARD, i, i + 1)
        out += boundary.get(("act", i + 1), [])
        phase(BACKWARD, i, i - 1)
        out += boundary.get(("grad", i), [])
    phase(BACKWARD, m, m - 1)
    return out + tail


def _in_group(a: Action, group: int, quota: float) -> Action:
    return replace(a, concurrent=group, quota=round(quota, 4))


class SpatialPlanner:
    name = "spatial"
    reads_recompute = False  # its plans are the same for every recompute mode (systems.offer_plan)

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan:
        quota = parse_quota(parallel.options)
        check_veomni_layout(self.name, parallel, "runs temporal's layout, which has no pipeline")
        parallel = replace(parallel, microbatches=parallel.microbatches or SPATIAL_MICROBATCHES)
        plan = plan_encoders_in_stage0(self.name, model, parallel, batch, encoder_tp=1, encoder_sp=parallel.cp)
        if quota:
            plan.actions = {r: spatial_order(acts, lambda *_: quota) for r, acts in plan.actions.items()}
            plan.options[CONCURRENCY_OPTION] = {"quota": "given", "encoder_quota": quota}
        else:
            shares = _shares(model, parallel, plan)
            plan.actions = {r: spatial_order(acts, shares(r)) for r, acts in plan.actions.items()}
            plan.options[CONCURRENCY_OPTION] = {"quota": "auto: per phase, the encoders' share of its work by the balancer"}
        return finish(plan, parallel, order=True)

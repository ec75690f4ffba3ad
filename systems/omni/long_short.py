"""Which encoder samples run sequence-parallel, and where: the encoder SP scheme of one step.

A sample's encoder work can run on one rank (data-parallel, *short*) or over a fixed group of `k`
consecutive encoder data ranks with Ulysses sequence parallelism (each member embeds 1/k of the
positions; two all-to-alls per layer give every member the whole sequence for 1/k of the heads;
the members end with the whole output). Three schemes, chosen per step and per encoder:

- **long_short**: a sample whose encoder cost exceeds the balanced per-rank share of the step (the
  module's total over its data ranks) is *long*: no placement of it on one rank keeps that rank
  off the critical path, so it runs over a group; everything else stays short;
- **all**: every sample runs over a group (VeOmni's scheme, temporal's, as a special case: with
  groups equal to the LLM's cp groups every consumer holds its outputs and nothing crosses the
  boundary). Spreading each sample over k ranks makes the units to balance k times finer;
- **none**: every sample short.

`auto` (the default) places the step under each scheme and each group size (every size that divides
the encoder's heads and a node: layout.sp_sizes) and keeps the placement whose most loaded rank
finishes first, counting each group's all-to-alls and output gather (`GroupCosts`); ties go to less
parallelism. When omni plans with the simulator's compute model (`--hardware`), samples are priced
per group size with coefficients fitted to that model, a microbatch pays its fixed cost, and the
most loaded ranks of each placement are checked at per-microbatch prices before one is kept
(`checked_finish`): the additive per-sample estimate misses kernel effects a whole microbatch shows.
The groups a step names are built by the runtime when first named (omnibench/runtime/long_short.py).

Placement, for a scheme: short samples first, each onto the least loaded encoder rank of its
loader's data group (no raw input crosses the network); then the group samples, costliest first,
onto the group whose most loaded member ends earliest once it has taken the sample (members run a
group microbatch together, so each member's load grows by the sample's share). A group sample
prefers its `prefer` group (under long_short its loader's, whose reorder counted it; under all its
LLM consumer's, whose members then need no boundary transfer) whenever that costs at most `SLACK`
of a balanced share. Loads start from minus the pipeline bubble each rank has to fill.

Group samples are packed per group: the samples of one group that feed the same LLM microbatch run
as one microbatch (one packed row, one set of all-to-alls), not one microbatch per sample.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, reduce
from operator import add as add_

SCHEMES = ("none", "long_short", "all")  # in order of preference when they tie (less parallelism first)
SLACK = 0.02  # of a balanced per-rank share: how much imbalance locality may buy (as in reshard.py)


@dataclass(frozen=True)
class LongShortSplit:
    threshold: float  # cost above which a sample is long (balanced per-rank share)
    long: tuple[int, ...]  # sample ids on the long (sequence-parallel) path, costliest first
    short: tuple[int, ...]


def split_long_short(cost: dict[int, float], ranks: int, sp: int, enabled: bool) -> LongShortSplit:
    total = sum(cost.values())
    share = total / ranks if ranks else 0.0
    if not enabled or sp <= 1:
        return LongShortSplit(share, (), tuple(sorted(cost)))
    long = tuple(i for i, c in sorted(cost.items(), key=lambda x: (-x[1], x[0])) if c > share)
    on_long = set(long)
    return LongShortSplit(share, long, tuple(sorted(i for i in cost if i not in on_long)))


def split_for(scheme: str, cost: dict[int, float], ranks: int, sp: int) -> LongShortSplit:
    """The samples each scheme runs over a group (`long`) and alone (`short`)."""
    if scheme == "all" and sp > 1:
        share = sum(cost.values()) / ranks if ranks else 0.0
        return LongShortSplit(share, tuple(i for i, _ in sorted(cost.items(), key=lambda x: (-x[1], x[0]))), ())
    return split_long_short(cost, ranks, sp, scheme == "long_short")


def place_short(short: Sequence[int], cost: dict[int, float], home: dict[int, Sequence[int]],
                loads: dict[int, float], due: dict[int, int] | None = None, fixed: float = 0.0) -> dict[int, list[int]]:
    """Short samples onto one encoder rank each, among the ranks of their home group; updates `loads`.
    `fixed`: what a rank's microbatch costs beyond its samples (launches, per-layer overheads), paid
    once per (rank, LLM microbatch `due[i]`) the rank encodes for."""
    out: dict[int, list[int]] = {r: [] for r in loads}
    heaps: dict[tuple[int, ...], list[tuple[float, int]]] = {}  # one per home group (loaders share them)
    opened: set[tuple[int, int]] = set()
    for i in sorted(short, key=lambda i: (-cost[i], i)):
        key = tuple(home[i])
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = [(loads[r], r) for r in key]
            heapq.heapify(heap)
        _, r = heapq.heappop(heap)
        out[r].append(i)
        loads[r] += cost[i]
        if fixed and (r, (due or {}).get(i, 0)) not in opened:
            opened.add((r, (due or {}).get(i, 0)))
            loads[r] += fixed
        heapq.heappush(heap, (loads[r], r))
    return out


def place_on_groups(samples: Sequence[int], cost: dict[int, float], groups: list[tuple[int, ...]],
                    loads: dict[int, float], exchange: Callable[[int], float] | None = None,
                    prefer: dict[int, int] | None = None, slack: float = 0.0,
                    due: dict[int, int] | None = None, fixed: float = 0.0) -> dict[int, list[int]]:
    """Samples onto sequence-parallel groups (index -> sample ids, costliest first); updates `loads`.
    `exchange(i)`: a member's all-to-all seconds for sample i; `prefer[i]`: a group to keep it on
    while that costs at most `slack` seconds over the best (`cost[i]` / k is a member's share);
    `fixed`: a member's cost of a group microbatch beyond its samples, once per (group, LLM
    microbatch `due[i]`)."""
    out: dict[int, list[int]] = {g: [] for g in range(len(groups))}
    if not groups:
        return out
    top = [max(loads[r] for r in grp) for grp in groups]  # a group finishes with its most loaded member
    opened: set[tuple[int, int]] = set()
    heap = [(top[g], g) for g in range(len(groups))]
    heapq.heapify(heap)
    for i in sorted(samples, key=lambda i: (-cost[i], i)):
        while True:  # lazy heap: every placement pushes its group's new top, so a stale entry just goes
            t, g = heap[0]
            if t == top[g]:
                break
            heapq.heappop(heap)
        p = (prefer or {}).get(i, -1)
        if p >= 0 and top[p] <= top[g] + slack:
            g = p
        out[g].append(i)
        add = cost[i] / len(groups[g]) + (exchange(i) if exchange else 0.0)
        if fixed and (g, (due or {}).get(i, 0)) not in opened:
            opened.add((g, (due or {}).get(i, 0)))
            add += fixed
        for r in groups[g]:
            loads[r] += add
        top[g] += add  # every member takes the same share
        heapq.heappush(heap, (top[g], g))
    return out


@dataclass
class ModulePlacement:
    """One encoder's placement under one scheme."""

    scheme: str
    split: LongShortSplit
    on_rank: dict[int, list[int]]  # short samples per encoder data rank
    on_group: dict[int, list[int]]  # group samples per group index
    loads: dict[int, float]  # estimated seconds per encoder data rank, from the start loads
    groups: list[tuple[int, ...]] = field(default_factory=list)  # the groups `on_group` indexes

    @property
    def finish(self) -> float:
        return max(self.loads.values()) if self.loads else 0.0


def place_module(scheme: str, cost: dict[int, float], ranks: Sequence[int], groups: list[tuple[int, ...]],
                 home: dict[int, Sequence[int]], start: dict[int, float], exchange: Callable[[int], float],
                 prefer: dict[int, int], due: dict[int, int] | None = None,
                 fixed: tuple[float, float] = (0.0, 0.0), alone: dict[int, float] | None = None,
                 member: dict[int, float] | None = None) -> ModulePlacement:
    """Short samples, then group samples (module docstring), from `start` loads. `cost` decides
    which samples are long; placement prices a sample at `alone[i]` on one rank and at `member[i]`
    per member of a group (GroupCosts.cost; default `cost` and `cost` / k); `fixed`: a
    microbatch's cost beyond its samples alone and as a group member (GroupCosts.fixed).
    One candidate of `Candidates`, which weighs many sharing their work."""
    cands = Candidates(cost, ranks, home, due or {}, alone, fixed[0])
    cands.add(scheme, groups, exchange, prefer, member, fixed[1])
    return cands.place(start)[0]


class Candidates:
    """Every candidate placement (scheme, group size) of one encoder's samples in one step, placed
    as `place_module` places one, sharing their work: each split (which samples run over a group:
    the same for every group size of a scheme), the samples' orders, every group sample's share,
    exchange and preferred group are worked out once, for every start the candidates are placed from
    (the even and the bubble-aware placements); the short samples' placement once per start and
    split (long_short's is the same at every group size). The placements are those `place_module`
    makes one candidate at a time, float for float: the same sums in the same order."""

    def __init__(self, cost: dict[int, float], ranks: Sequence[int], home: dict[int, Sequence[int]],
                 due: dict[int, int], alone: dict[int, float] | None = None, fixed_alone: float = 0.0):
        self.cost, self.ranks, self.home, self.due = cost, ranks, home, due
        self.alone = alone or cost
        self.fixed_alone = fixed_alone
        self.total = sum(cost.values())
        self.slack = SLACK * self.total / max(1, len(ranks))
        self._by_cost = [i for i, _ in sorted(cost.items(), key=lambda x: (-x[1], x[0]))]  # split_for's order
        self._splits: dict[str, LongShortSplit] = {}
        self._short: dict[str, tuple[list[int], list[tuple[int, ...]], list[int]]] = {}
        self._heap_key: dict[int, tuple[int, ...]] = {}  # per home list: loaders with one home share a heap
        self._cands: list[tuple] = []

    def _split(self, scheme: str, k: int) -> tuple[str, LongShortSplit]:
        """split_for(scheme, cost, ranks, k), kept per what it depends on (all / long_short over a
        group, or none)."""
        kind = scheme if scheme in ("all", "long_short") and k > 1 else "none"
        got = self._splits.get(kind)
        if got is None:
            cost, share = self.cost, self.total / len(self.ranks) if self.ranks else 0.0
            if kind == "all":
                got = LongShortSplit(share, tuple(self._by_cost), ())
            elif kind == "long_short":
                long = tuple(i for i in self._by_cost if cost[i] > share)
                on_long = set(long)
                got = LongShortSplit(share, long, tuple(sorted(i for i in cost if i not in on_long)))
            else:
                got = LongShortSplit(share, (), tuple(sorted(cost)))
            self._splits[kind] = got
        return kind, got

    def _short_order(self, kind: str, split: LongShortSplit):
        """place_short's order (costliest alone first) of a split's short samples, with each one's
        heap (its home group) and LLM microbatch."""
        got = self._short.get(kind)
        if got is None:
            alone, due, keys = self.alone, self.due, self._heap_key
            order = sorted(split.short, key=lambda i: (-alone[i], i))
            heaps = []
            for i in order:
                h = self.home[i]
                key = keys.get(id(h))
                if key is None:
                    key = keys[id(h)] = tuple(h)
                heaps.append(key)
            got = self._short[kind] = (order, heaps, [due.get(i, 0) for i in order])
        return got

    def add(self, scheme: str, groups: list[tuple[int, ...]], exchange: Callable[[int], float] | None,
            prefer: dict[int, int] | None, member: dict[int, float] | None = None, fixed_member: float = 0.0) -> None:
        """One more candidate: `scheme` over `groups` (all of one size), as place_module's arguments."""
        k = len(groups[0]) if groups else 1
        if any(len(g) != k for g in groups):
            raise ValueError(f"groups: a candidate's sequence-parallel groups are all of one size, got "
                             f"{sorted({len(g) for g in groups})}")
        kind, split = self._split(scheme, k)
        self._short_order(kind, split)
        on_groups = None
        if split.long:
            per_member = member if member is not None else {i: self.cost[i] / k for i in split.long}
            priced = {i: per_member[i] * k for i in split.long}
            order = sorted(split.long, key=lambda i: (-priced[i], i))
            prefer, due = prefer or {}, self.due
            # a member's share of each sample in place_on_groups' order: its price over the group, its exchange
            adds = [priced[i] / k + (exchange(i) if exchange else 0.0) for i in order]
            on_groups = (order, adds, [prefer.get(i, -1) for i in order], [due.get(i, 0) for i in order])
        self._cands.append((scheme, kind, split, list(groups), on_groups, fixed_member))

    def place(self, start: dict[int, float]) -> list[ModulePlacement]:
        """Every candidate, in the order added, each from loads `start`. Candidates with the same
        split share one `on_rank` (read it, do not change it)."""
        shorts: dict[str, tuple[dict[int, list[int]], dict[int, float]]] = {}
        out = []
        for scheme, kind, split, groups, on_groups, fixed_member in self._cands:
            if kind not in shorts:
                loads = dict(start)
                order, heaps, dues = self._short[kind]
                shorts[kind] = (_place_short(order, heaps, dues, self.alone, loads, self.fixed_alone), loads)
            on_rank, after_short = shorts[kind]
            loads = dict(after_short)
            placed = (_place_on_groups(*on_groups, groups, loads, self.slack, fixed_member)
                      if on_groups is not None else {})
            out.append(ModulePlacement(scheme, split, on_rank, placed, loads, groups))
        return out


def _place_short(order: list[int], heaps: list[tuple[int, ...]], dues: list[int], cost: dict[int, float],
                 loads: dict[int, float], fixed: float) -> dict[int, list[int]]:
    """place_short over samples already in its order, each with its home group and LLM microbatch."""
    out: dict[int, list[int]] = {r: [] for r in loads}
    by_home: dict[tuple[int, ...], list[tuple[float, int]]] = {}
    opened: set[tuple[int, int]] = set()
    pop, push = heapq.heappop, heapq.heappush
    for i, key, j in zip(order, heaps, dues, strict=True):
        heap = by_home.get(key)
        if heap is None:
            heap = by_home[key] = [(loads[r], r) for r in key]
            heapq.heapify(heap)
        _, r = pop(heap)
        out[r].append(i)
        load = loads[r] + cost[i]
        if fixed and (r, j) not in opened:
            opened.add((r, j))
            load += fixed
        loads[r] = load
        push(heap, (load, r))
    return out


def _place_on_groups(order: list[int], adds: list[float], prefer: list[int], dues: list[int],
                     groups: list[tuple[int, ...]], loads: dict[int, float], slack: float,
                     fixed: float) -> dict[int, list[int]]:
    """place_on_groups over samples already in its order, with each one's share of a member's
    load, preferred group (-1: none) and LLM microbatch. Every member of a group takes the same
    shares in the same order, so each member's load is summed once the group's shares are known:
    the same additions, in the same order, as adding them one by one."""
    out: dict[int, list[int]] = {g: [] for g in range(len(groups))}
    if not groups:
        return out
    top = [max(loads[r] for r in grp) for grp in groups]  # a group finishes with its most loaded member
    shares: list[list[float]] = [[] for _ in groups]
    opened: set[tuple[int, int]] = set()
    heap = [(top[g], g) for g in range(len(groups))]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    for i, add, p, j in zip(order, adds, prefer, dues, strict=True):
        while True:  # lazy heap: every placement pushes its group's new top, so a stale entry just goes
            t, g = heap[0]
            if t == top[g]:
                break
            pop(heap)
        if p >= 0 and top[p] <= top[g] + slack:
            g = p
        out[g].append(i)
        if fixed and (g, j) not in opened:
            opened.add((g, j))
            add += fixed
        shares[g].append(add)
        top[g] += add  # every member takes the same share
        push(heap, (top[g], g))
    for g, grp in enumerate(groups):
        if shares[g]:
            for r in grp:
                loads[r] = reduce(add_, shares[g], loads[r])  # ((load + a1) + a2) + ..., as one by one
    return out


def choose(candidates: list[ModulePlacement], finish: Callable[[ModulePlacement], float] | None = None
           ) -> ModulePlacement:
    """The placement whose most loaded rank finishes first (by `finish`, else the placement's own
    estimate); ties to the less parallel one (scheme, then group size)."""
    return min(candidates, key=lambda c: (round(finish(c) if finish else c.finish, 12), SCHEMES.index(c.scheme),
                                          len(c.groups[0]) if c.groups else 1))


CHECKED_RANKS = 8  # the most loaded ranks or groups (by the additive estimate) a placement is checked on


def checked_finish(pm: ModulePlacement, due: dict[int, int], start: dict[int, float], sample,
                   seconds: Callable[[Sequence, int], float]) -> float:
    """The finish of a placement's most loaded ranks with each of their microbatches priced whole
    (`seconds(samples, k)`: per-microbatch costs and kernel effects the additive per-sample estimate
    misses): the max over the CHECKED_RANKS ranks the estimate loads most, a group whose members carry
    nothing else counted once."""
    member = {r: g for g, grp in enumerate(pm.groups) for r in grp}
    k = len(pm.groups[0]) if pm.groups else 1
    group_s: dict[int, float] = {}
    out, seen = float("-inf"), set()
    loads = pm.loads
    # the first CHECKED_RANKS units lie within the CHECKED_RANKS * k most loaded ranks (a unit holds at
    # most k of them): those alone, in sorted order (nsmallest is sorted(...)[:n]; the keys are distinct)
    for r in heapq.nsmallest(CHECKED_RANKS * k, loads, key=lambda r: (-loads[r], r)):
        g = member.get(r)
        unit = ("group", g) if g is not None and not pm.on_rank.get(r) else ("rank", r)
        if unit in seen:  # a group's members with no work of their own finish together
            continue
        seen.add(unit)
        t = start[r] + sum(seconds([sample(i) for i in mb], 1) for mb in pack_by_due(pm.on_rank.get(r, []), due))
        if g is not None:
            if g not in group_s:
                group_s[g] = sum(seconds([sample(i) for i in mb], k) for mb in pack_by_due(pm.on_group.get(g, []), due))
            t += group_s[g]
        out = max(out, t)
        if len(seen) >= CHECKED_RANKS:
            break
    return out


def pack_by_due(samples: Sequence[int], due: dict[int, int]) -> list[tuple[int, ...]]:
    """A group's samples as microbatches: those feeding the same LLM microbatch packed together, in
    the order the LLM needs them."""
    by_due: dict[int, list[int]] = {}
    for i in samples:
        by_due.setdefault(due[i], []).append(i)
    return [tuple(sorted(by_due[j])) for j in sorted(by_due)]


# ------------------------------------------------------------------------------ exchange cost


class GroupCosts:
    """What running a sample over a group of k costs a member beyond 1/k of its cost alone, in the
    cost model's seconds:

    - `seconds`: its Ulysses all-to-alls (forward and backward: one exchange per layer each, of
      q/k/v in and the output back, 4 x positions/k x hidden in bf16, as the simulator counts them:
      simulator/flops.py `seq_bytes`) and the all-gather of the outputs after the blocks, priced by
      the simulator's collective model for the hardware preset (a group of k consecutive ranks inside
      one node);
    - `cost`: a sample's seconds per member (1/k of the positions with 1/k of the heads: attention
      kernels at fewer heads over longer sequences, matmuls at fewer rows), `fixed`: a microbatch's
      cost beyond its samples, and `microbatch_seconds`: a whole microbatch, from the simulator's
      compute model when the cost model is that model (`hardware` given: `measured`);

    A cost model on other hardware (the analytic default, a CPU calibration) gets the exchange scaled
    by the ratio of its compute speed to the preset's."""

    def __init__(self, model, cost_model, hardware: str = "", recompute: dict[str, str] | None = None,
                 master: bool = False, measured: bool | None = None):
        self.model = model
        self.master = master  # `--mixed-precision master`: every module's weights bf16 (no per-forward casts)
        self.recompute = recompute or {}  # per module, as costs.recompute_policy reads the run's
        self.hardware = hardware or "h100"
        # `measured` False with a hardware given: the analytic balancer on known hardware (its collectives
        # priced there, its compute seconds scaled to the preset's speed)
        self.measured = bool(hardware) if measured is None else measured and bool(hardware)
        self.scale = 1.0 if self.measured else _speed_ratio(model, cost_model, self.hardware)
        self._fixed: dict[tuple, float] = {}  # per (module, k)
        # A plan asks for these per sample and per candidate placement (hundreds of thousands of
        # times at 131,072 GPUs): each answer kept for the plan, the same values recomputed no more.
        self._seconds: dict[tuple, float] = {}  # per (module, positions, k)
        self._coefficients: dict[tuple, object] = {}  # per (module, k, bf16)
        self._sequences: dict[tuple, tuple] = {}  # per (module, sample): (sample, its attention sequences)
        # per (module, k, bf16, attention sequences): a step's samples share a few hundred sets of
        # sequences (images of a few sizes, videos of a few grids) among tens of thousands
        self._priced: dict[tuple, float] = {}
        # per (module, inputs, input elements, k, stack): a whole microbatch's compute, which checking a
        # placement asks for again per candidate and per bubble pass
        self._microbatch: dict[tuple, float] = {}

    def seconds(self, module: str, positions: int, k: int) -> float:
        key = (module, positions, k)
        got = self._seconds.get(key)
        if got is None:
            got = self._seconds[key] = self._exchange_seconds(module, positions, k)
        return got

    def _exchange_seconds(self, module: str, positions: int, k: int) -> float:
        if k <= 1 or positions <= 0:
            return 0.0
        enc = self.model.encoders[module]
        per_layer = _all_to_all(self.hardware, 4 * positions / k * enc.hidden * 2, k)
        # the members' outputs all-gathered after the blocks, reduce-scattered back in the backward
        # (simulator/program.py `_sp_output_bytes`: the vision merger's tokens at the LLM's width, the
        # audio blocks' hidden states)
        out = (positions / enc.merge**2 * (enc.out_hidden or self.model.llm.hidden) if module == "vision"
               else positions * enc.hidden) * 2
        gather = 2 * _all_gather(self.hardware, out, k)
        return self.scale * (2 * enc.layers * per_layer + gather)  # one call per layer, forward and backward

    def fixed(self, module: str, k: int, layout=None) -> float:
        """A rank's cost of one more microbatch beyond its samples (kernel launches and per-layer work
        that do not grow with the samples), alone (k = 1) or as a member of a group of k: two small
        inputs as two microbatches against one, at the simulator's prices. 0 unless `measured`."""
        if not self.measured:
            return 0.0
        key = ("fixed", module, k)
        if key not in self._fixed:
            from workloads.sample import Sample, Segment

            seg = (Segment("image", 64, 256, grid_thw=(1, 16, 16)) if module == "vision"
                   else Segment("audio", 125, 250, mel_frames=500))
            a, b = (Sample(-1, "probe", (seg,)), Sample(-2, "probe", (seg,)))
            one = self.microbatch_seconds(module, [a], k, layout)
            two = self.microbatch_seconds(module, [a, b], k, layout)
            self._fixed[key] = max(0.0, 2 * one - two)
        return self._fixed[key]

    def cost(self, module: str, sample, k: int, layout=None) -> float:
        """A rank's seconds for `sample` in a microbatch of its own (k = 1) or as a member of a group
        of k: linear + quadratic + per-sequence coefficients fitted, per k, to the simulator's compute
        model the way the cost model is fitted at k = 1 (omnibench/specs/cost_model.py
        `from_simulator`), under the run's recompute mode and the stack the layout implies. Only when
        `measured`."""
        from omnibench.specs.cost_model import attention_sequences

        bf16 = _holds_bf16(layout, self.master)
        c = self._coefficients.get((module, k, bf16))
        if c is None:
            c = self._coefficients[(module, k, bf16)] = _member_coefficients(
                self.model, self.hardware, module, k, self.recompute.get(module, "none"), bf16)
        got = self._sequences.get((module, id(sample)))
        if got is None or got[0] is not sample:
            got = self._sequences[(module, id(sample))] = (
                sample, tuple(attention_sequences(sample, module, self.model)))
        key = (module, k, bf16, got[1])
        out = self._priced.get(key)
        if out is None:
            out = self._priced[key] = sum(c.sequence(n) for n in got[1])
        return out

    def microbatch_seconds(self, module: str, samples: Sequence, k: int = 1, layout=None) -> float:
        """A rank's seconds for one encoder microbatch of `samples` (forward with its inputs, backward)
        run alone (k = 1) or as a member of a group of k, with the group's exchange: the simulator's
        compute model, so a placement can be checked against what the simulator will charge. Only
        when `measured` (the cost model is that compute model); `layout`: the encoder's (how the
        runtime holds its weights decides the kernels' casts)."""
        from simulator.flops import audio_work, input_elements, vision_work

        inputs = [seg.grid_thw if module == "vision" else seg.mel_frames
                  for s in samples for seg in s.segments if seg.encoder == module]
        if not inputs:
            return 0.0
        from simulator.work import eager_stack

        stack = eager_stack(self.model, module, layout, self.master) if layout is not None else None
        elements = float(sum(input_elements(s, self.model) for s in samples))
        key = (module, tuple(inputs), elements, k, stack)
        t = self._microbatch.get(key)
        if t is None:
            make = vision_work if module == "vision" else audio_work
            rc = self.recompute.get(module, "none")
            w = make(getattr(self.model, module), inputs, 1, k, rc)
            if stack is not None and w.shape is not None:  # as the simulator's eager stack runs it
                from dataclasses import replace

                w = replace(w, shape=replace(w.shape, stack=stack))
            comp = _compute(self.hardware)
            t = self._microbatch[key] = (comp.action_time(w, "forward", module=module, inputs=elements)
                                         + comp.action_time(w, "backward", rc, module=module))
            # this model lives as long as the process and its kernel times are kept by the identity of
            # shapes made here and nowhere else: bounded, or a long tune's planning grows it without end
            comp.trim_kernel_times(KERNEL_TIMES_KEPT)
        positions = sum(seg.encoder_seq_len for s in samples for seg in s.segments if seg.encoder == module)
        return t + self.seconds(module, positions, k)


def _holds_bf16(layout, master: bool = False) -> bool:
    """Whether the runtime holds `layout`'s weights in bf16 (simulator/work.py `eager_stack`): FSDP or
    ZeRO over more than one rank, or any module under `--mixed-precision master`."""
    return layout is not None and (master or ((layout.fsdp or layout.zero > 0) and layout.fsdp_size > 1))


@lru_cache(maxsize=256)
def _member_coefficients(model, hardware: str, module: str, k: int, recompute: str, bf16: bool):
    from dataclasses import replace

    from omnibench.plan import Layout
    from omnibench.specs.cost_model import FIT_LENGTHS, Coefficients, _least_squares
    from simulator.flops import audio_work, vision_work
    from simulator.work import eager_stack

    enc = getattr(model, module)
    # a layout standing for how the runtime holds the weights (eager_stack reads fsdp / zero / size)
    lay = Layout(module, (0, 1), dp=2, fsdp=False, zero=2 if bf16 else 0)
    comp = _compute(hardware)
    rows = []
    for n in FIT_LENGTHS:
        # what one more sequence adds to a microbatch, at k ranks (the pass's fixed cost cancels)
        if module == "vision":
            m = enc.merge
            x = max(m, n // m // m * m)
            works = [vision_work(enc, [(1, m, x)] * j, 1, k, recompute) for j in (1, 2)]
            n = m * x
        else:
            n = min(n, enc.max_positions)
            works = [audio_work(enc, [2 * n] * j, 1, k, recompute) for j in (1, 2)]
        t = []
        for w in works:
            if w.shape is not None:
                w = replace(w, shape=replace(w.shape, stack=eager_stack(model, module, lay)))
            t.append(comp.action_time(w, "forward", module=module) + comp.action_time(w, "backward", recompute, module=module))
        rows.append((n, float(n) * n, t[1] - t[0]))
    return Coefficients(*_least_squares(rows))


KERNEL_TIMES_KEPT = 1 << 16  # kernel times `_compute`'s models keep (~1 KB each with its shape)


@lru_cache(maxsize=8)
def _compute(hardware: str):
    from simulator.compute import ComputeModel  # torch-free
    from simulator.hardware import load_cluster

    return ComputeModel(load_cluster(hardware, 8))


@lru_cache(maxsize=4096)
def _all_to_all(hardware: str, nbytes: float, k: int) -> float:
    return _collectives(hardware).all_to_all(nbytes, tuple(range(k)))[0]


@lru_cache(maxsize=4096)
def _all_gather(hardware: str, nbytes: float, k: int) -> float:
    return _collectives(hardware).all_gather(nbytes, tuple(range(k)))[0]


@lru_cache(maxsize=8)
def _collectives(hardware: str):
    from simulator.collectives import CollectiveModel  # torch-free
    from simulator.hardware import load_cluster

    return CollectiveModel(load_cluster(hardware, 8))


REFERENCE_POSITIONS = 1024  # a typical attention sequence (an image at ~1,000 px square) to compare speeds on


def _speed_ratio(model, cost_model, hardware: str) -> float:
    """The cost model's seconds over the simulator model's on `hardware`, for one reference
    sequence through every encoder."""
    ref = _simulator_model(model, hardware)
    mods = [m for m in model.encoders if m in cost_model.coefficients and m in ref.coefficients]
    mine = sum(cost_model.encoder_sequence(m, [REFERENCE_POSITIONS]) for m in mods)
    theirs = sum(ref.encoder_sequence(m, [REFERENCE_POSITIONS]) for m in mods)
    return mine / theirs if mine > 0 and theirs > 0 else 1.0


@lru_cache(maxsize=8)
def _simulator_model(model, hardware: str):
    from omnibench.specs.cost_model import CostModel

    return CostModel.from_simulator(model, hardware)

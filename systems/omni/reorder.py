"""Decentralized grouped reordering in the data loaders.

Each LLM data rank's loader starts with the samples a distributed sampler deals it (round robin
over the step's index list: position k goes to loader k mod dp). Loaders are split into groups of
`group_size` consecutive data ranks. A loader reads only its own samples' headers and turns them
into cost metadata (`metadata`: position, sample id, encoder cost per encoder, LLM cost: a few
numbers per sample); the group all-gathers that metadata and every member runs the same
deterministic assignment over it (`decide`), so they agree without a coordinator and no metadata
leaves the group. Samples never move between groups. Each loader then loads the samples it was
given by id.

Everything a loader knows before it looks at a sample (layout-derived shares, the per-loader
sample floor, the switches) is a `LoaderSpec`. `in_process_loading` runs the same exchange and
decisions in one process: what the simulator and `omnibench plan` see, and what the runtime's
real exchange (omnibench/runtime/loading.py) must reproduce.

The assignment is a longest-processing-time greedy with a floor on the number of samples per
loader (every data rank needs enough samples for its pipeline microbatches). Its objective is what
the loader's data group will run for the sample: its encoder work spread over the group's encoder
ranks (a long sample too: it runs over the sequence-parallel group by its loader's ranks unless
another group is clearly less loaded) plus, when resharding will not redistribute it later, the
LLM work.

With `split="global"` (omni's `loading=global`, reorder off) the loaders skip the sampler's shards:
every loader gathers every loader's metadata and all run the split the baselines make of the same batch
(systems/common.py `balance` over each sample's LLM plus encoder cost, the weights of the systems whose
data ranks run both), so that an ablation can give omni the baselines' loading and measure what
decoupling itself buys.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from omnibench.plan import PlanError
from systems.common import balance
from workloads.sample import Sample

SPLITS = ("sampler", "global")  # where the loaders' shards start (options.py LOADINGS)


def loader_groups(loaders: int, group_size: int) -> list[list[int]]:
    g = max(1, min(group_size, loaders))
    return [list(range(i, min(i + g, loaders))) for i in range(0, loaders, g)]


def lpt_with_floor(items: Sequence[tuple[int, float]], bins: int, floor: int,
                   start: Sequence[float] | None = None) -> list[list[int]]:
    """Greedy split of (id, cost) into `bins`, largest first onto the least loaded bin, while
    keeping enough items back that every bin can still reach `floor` items. Deterministic: ties
    break on id and bin index. Ids in each bin come out ascending."""
    order = sorted(items, key=lambda x: (-x[1], x[0]))
    if floor * bins > len(order):
        floor = len(order) // bins
    loads = list(start) if start is not None else [0.0] * bins
    counts = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    heap = [(loads[b], b) for b in range(bins)]
    heapq.heapify(heap)
    left = len(order)
    deficit = floor * bins
    for i, cost in order:
        if left <= deficit:
            # Only as many items remain as bins still need: feed the short bins, least loaded first.
            b = min((b for b in range(bins) if counts[b] < floor), key=lambda b: (loads[b], b))
        else:
            while True:
                load, b = heapq.heappop(heap)
                if load == loads[b]:
                    break
        if counts[b] < floor:
            deficit -= 1
        counts[b] += 1
        loads[b] += cost
        out[b].append(i)
        heapq.heappush(heap, (loads[b], b))
        left -= 1
    return [sorted(x) for x in out]


@dataclass(frozen=True)
class EncoderShare:
    module: str
    ranks_per_loader: int  # encoder data ranks inside one loader's data group (short work spreads over them)
    data_ranks: int  # the encoder's data-parallel degree


@dataclass(frozen=True)
class LoaderSpec:
    """What every loader knows before it reads a sample: from the layouts, the options and the
    sampler's global sample count."""

    loaders: int  # LLM data ranks
    group_size: int
    reorder: bool
    count_llm: bool  # the objective includes LLM cost (no resharding will redistribute it)
    floor: int  # samples every loader must keep (its pipeline microbatches); 0 with resharding
    encoders: tuple[EncoderShare, ...]
    split: str = "sampler"  # SPLITS: the sampler's round robin, or one global split (reorder off)

    def __post_init__(self):
        if self.split not in SPLITS:
            raise PlanError(f"loading must be one of {', '.join(SPLITS)}; got {self.split!r}")
        if self.split == "global" and self.reorder:
            raise PlanError("loading=global splits the whole batch before any loader reorders: give reorder=false")

    def groups(self) -> list[list[int]]:
        if self.split == "global":  # one exchange over every loader
            return [list(range(self.loaders))]
        return loader_groups(self.loaders, self.group_size if self.reorder else 1)

    def group_of(self, loader: int) -> list[int]:
        return next(g for g in self.groups() if loader in g)

    @property
    def entry_width(self) -> int:
        return 3 + len(self.encoders)


# One sample's metadata: (position, sample id, encoder cost per spec.encoders entry..., LLM cost).
Entry = tuple[float, ...]


def metadata(spec: LoaderSpec, cost_model, shard: Sequence[tuple[int, Sample]]) -> list[Entry]:
    """A loader's metadata for the (position, sample) pairs it was dealt: costs from the shared
    cost model (`cost_model.encoder(sample, module)`, `cost_model.llm(sample)`)."""
    out = []
    for k, s in shard:
        enc = [cost_model.encoder(s, e.module) if s.encoder_seq_lens(e.module) else 0.0 for e in spec.encoders]
        out.append((float(k), float(s.sample_id), *enc, cost_model.llm(s)))
    return out


@dataclass(frozen=True)
class GroupDecision:
    shards: dict[int, list[int]]  # loader -> sample ids after reordering (ascending when reordered)
    positions: dict[int, int]  # sample id -> position in the step's index list (every id of the group)
    before: dict[int, float]  # loader -> objective before / after
    after: dict[int, float]
    traffic: dict  # what the group exchanged and moved


def decide(spec: LoaderSpec, members: Sequence[int], gathered: Sequence[Sequence[Entry]]) -> GroupDecision:
    """The assignment every member of a group computes from the group's gathered metadata alone
    (`gathered[j]`: the entries of loader `members[j]`, in its sampler order)."""
    entries = [e for part in gathered for e in part]
    ne = len(spec.encoders)

    def objective(x: Entry) -> float:
        # every sample's encoder work, long ones too: a long sample runs over the sequence-parallel
        # group by its loader's ranks whenever that keeps the step balanced (long_short.py), so
        # counting it free would pile short work onto the very ranks that carry it
        c = sum(x[2 + j] / e.ranks_per_loader for j, e in enumerate(spec.encoders))
        return c + (x[2 + ne] if spec.count_llm else 0.0)

    cost = {int(x[1]): objective(x) for x in entries}
    before_ids = {r: [int(x[1]) for x in part] for r, part in zip(members, gathered, strict=True)}
    if spec.split == "global":
        if list(members) != list(range(spec.loaders)):
            raise PlanError(f"loading=global: a global split needs every loader's metadata (loaders 0.."
                            f"{spec.loaders - 1} in one exchange); got loaders {list(members)}")
        # Summed as systems/common.py `_weights` sums cost_model.llm + cost_model.encoders: the same floats,
        # so `balance` ties break alike and every loader gets the very samples a baseline's data rank gets
        weight = {int(x[1]): x[2 + ne] + sum(x[2:2 + ne]) for x in entries}
        shards = dict(zip(members, balance(weight.items(), len(members)), strict=True))
    elif spec.reorder and len(members) > 1:
        parts = lpt_with_floor(list(cost.items()), len(members), spec.floor)
        shards = dict(zip(members, parts, strict=True))
    else:
        shards = before_ids
    moved = sum(len(set(shards[r]) - set(before_ids[r])) for r in members)
    return GroupDecision(
        shards=shards,
        positions={int(x[1]): int(x[0]) for x in entries},
        before={r: sum(cost[i] for i in before_ids[r]) for r in members},
        after={r: sum(cost[i] for i in shards[r]) for r in members},
        traffic={"loaders": [members[0], members[-1]], "metadata_entries": len(entries), "moved": moved},
    )


@dataclass(frozen=True)
class Loading:
    """Every loader's samples after reordering, as the whole step sees them."""

    shards: list[list[int]]  # sample ids per loader (LLM data rank index)
    before: list[float]  # loader objective before / after reordering
    after: list[float]
    traffic: list[dict]  # per reorder group

    @staticmethod
    def merge(spec: LoaderSpec, decisions: Sequence[GroupDecision]) -> Loading:
        shards, before, after = [[] for _ in range(spec.loaders)], [0.0] * spec.loaders, [0.0] * spec.loaders
        for d in decisions:
            for r, ids in d.shards.items():
                shards[r], before[r], after[r] = list(ids), d.before[r], d.after[r]
        exchanged = (spec.reorder or spec.split == "global") and spec.loaders > 1
        traffic = [d.traffic for d in decisions] if exchanged else []
        return Loading(shards, before, after, traffic)


def dealt(n_samples: int, loader: int, loaders: int) -> range:
    """Positions a distributed sampler deals one loader."""
    return range(loader, n_samples, loaders)


def in_process_loading(spec: LoaderSpec, cost_model, samples: Sequence[Sample]) -> Loading:
    """The loaders' exchange and every group's decision (one group of every loader under a global
    split), run in one process."""
    decisions = []
    for group in spec.groups():
        gathered = [metadata(spec, cost_model, [(k, samples[k]) for k in dealt(len(samples), r, spec.loaders)])
                    for r in group]
        decisions.append(decide(spec, group, gathered))
    return Loading.merge(spec, decisions)


def header_bytes(sample: Sample) -> int:
    """Bytes of a sample's header in the "plan" exchange: id, source and per segment its modality,
    token counts and raw size (ten 8-byte fields), plus framing."""
    return 32 + len(sample.source) + 80 * len(sample.segments)


def max_over_mean(loads: Sequence[float]) -> float:
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0

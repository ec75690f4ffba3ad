"""Long-short sequence parallelism for the encoders.

A sample whose encoder cost exceeds the balanced per-rank share of the step (the module's total
encoder cost over its data ranks, from the cost model) is *long*: no placement of it on a single
rank can keep that rank off the critical path. Long inputs are split over a fixed group of `k`
ranks with Ulysses sequence parallelism (each rank embeds 1/k of the positions; two all-to-alls
per layer give every rank the whole sequence for 1/k of the heads), everything else is *short* and
runs data-parallel, one rank per sample.

Placement: long samples go to the sequence-parallel groups by longest-first greedy on the groups'
loads; short samples are encoded inside the data group of the loader that holds them (no raw
inputs cross the network), longest first onto the least loaded of that group's encoder ranks,
whose loads start from the long work they already carry and minus the pipeline bubble they have
to fill (ranks on later pipeline stages idle in warm-up and cool-down).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


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


def place_long(long: Sequence[int], cost: dict[int, float], groups: list[tuple[int, ...]],
               loads: dict[int, float]) -> dict[int, list[int]]:
    """Long samples onto sequence-parallel groups (index -> sample ids in order); updates `loads`."""
    out: dict[int, list[int]] = {g: [] for g in range(len(groups))}
    heap = [(sum(loads[r] for r in grp) / len(grp), g) for g, grp in enumerate(groups)]
    heapq.heapify(heap)
    for i in long:
        load, g = heapq.heappop(heap)
        out[g].append(i)
        share = cost[i] / len(groups[g])
        for r in groups[g]:
            loads[r] += share
        heapq.heappush(heap, (load + share, g))
    return out


def place_short(short: Sequence[int], cost: dict[int, float], home: dict[int, Sequence[int]],
                loads: dict[int, float]) -> dict[int, list[int]]:
    """Short samples onto one encoder rank each, among the ranks of their home group."""
    out: dict[int, list[int]] = {r: [] for r in loads}
    for i in sorted(short, key=lambda i: (-cost[i], i)):
        r = min(home[i], key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += cost[i]
    return out

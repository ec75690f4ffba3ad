"""Decentralized grouped reordering in the data loaders.

Each LLM data rank's loader starts with the samples a distributed sampler deals it (round robin
over the global batch: sample k goes to loader k mod dp). Loaders are split into groups of
`group_size` consecutive ranks; inside a group the loaders exchange only cost metadata
(sample id, estimated encoder and LLM cost: a few numbers per sample) and every member runs the
same deterministic assignment over the group's samples, so they agree without a coordinator and
no metadata leaves the group. Samples never move between groups.

The assignment is a longest-processing-time greedy with a floor on the number of samples per
loader (every data rank needs enough samples for its pipeline microbatches).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def loader_shards(sample_ids: Sequence[int], loaders: int) -> list[list[int]]:
    """What a distributed sampler gives each loader: round robin in batch order."""
    return [list(sample_ids[i::loaders]) for i in range(loaders)]


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


def grouped_reorder(shards: list[list[int]], cost: dict[int, float], group_size: int,
                    floor: int) -> tuple[list[list[int]], list[dict]]:
    """Rebalance each group's samples by `cost`; returns new shards and per-group metadata traffic."""
    out = [list(s) for s in shards]
    traffic = []
    for group in loader_groups(len(shards), group_size):
        pool = [i for r in group for i in shards[r]]
        parts = lpt_with_floor([(i, cost[i]) for i in pool], len(group), floor)
        for r, part in zip(group, parts, strict=True):
            out[r] = part
        moved = sum(len(set(part) - set(shards[r])) for r, part in zip(group, parts, strict=True))
        traffic.append({"loaders": [group[0], group[-1]], "metadata_entries": len(pool), "moved": moved})
    return out, traffic


def max_over_mean(loads: Sequence[float]) -> float:
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0

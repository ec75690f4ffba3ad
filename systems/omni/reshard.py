"""Adaptive resharding from encoder ranks to LLM data ranks.

Where a sample was encoded (and loaded) says nothing about which LLM data rank should consume it:
the loaders balanced encoder work, long videos were split over groups, so the LLM token load per
data rank is uneven. Resharding decides the LLM assignment afresh: longest-first greedy on the
LLM cost (tokens, with the causal attention term) onto the least loaded data rank, preferring the
sample's home rank (its loader's) whenever that costs at most `slack` of a balanced share, so only
the samples that must move to even the load cross the network. Encoder outputs then travel along
`Plan.routes` (an all-to-all of embeddings) to wherever their sample landed.

Without resharding, every sample is consumed by its loader's data rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SLACK = 0.02  # of a balanced per-rank share: how much imbalance locality may buy


def reshard(sample_ids: Sequence[int], cost: dict[int, float], home: dict[int, int], dp: int,
            floor: int, start: Sequence[float] | None = None) -> list[list[int]]:
    """`start`: load each data rank already carries (omni's long LLM samples, llm_long_short.py)."""
    order = sorted(sample_ids, key=lambda i: (-cost[i], i))
    if floor * dp > len(order):
        floor = len(order) // dp
    tol = SLACK * (sum(cost[i] for i in order) + sum(start or ())) / dp
    loads = list(start) if start is not None else [0.0] * dp
    counts = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    heap = [(loads[b], b) for b in range(dp)]
    heapq.heapify(heap)
    left, deficit = len(order), floor * dp
    for i in order:
        if left <= deficit:
            short = [b for b in range(dp) if counts[b] < floor]
            b = home[i] if home[i] in short else min(short, key=lambda b: (loads[b], b))
        else:
            while True:
                load, b = heapq.heappop(heap)
                if load == loads[b]:
                    heapq.heappush(heap, (load, b))
                    break
            h = home[i]
            if loads[h] <= loads[b] + tol and (counts[h] < floor or left - 1 >= deficit):
                b = h
        if counts[b] < floor:
            deficit -= 1
        counts[b] += 1
        loads[b] += cost[i]
        out[b].append(i)
        heapq.heappush(heap, (loads[b], b))
        left -= 1
    return [sorted(x) for x in out]

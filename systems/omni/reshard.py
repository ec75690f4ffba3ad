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
    short = None  # the ranks still under the floor, least loaded first (stale entries skipped)
    for i in order:
        if left <= deficit:
            # from here on every sample goes to a rank under the floor: its home if it is one, else the
            # least loaded of them (a heap: a scan of every rank per sample was quadratic at scale)
            if short is None:
                short = [(loads[b], b) for b in range(dp) if counts[b] < floor]
                heapq.heapify(short)
            b = home[i]
            if counts[b] >= floor:
                while True:
                    load, b = short[0]
                    if load == loads[b] and counts[b] < floor:
                        break
                    heapq.heappop(short)
        else:
            while True:  # the least loaded rank, read in place (stale entries, left by loads since grown, go)
                load, b = heap[0]
                if load == loads[b]:
                    break
                heapq.heappop(heap)
            h = home[i]
            if loads[h] <= loads[b] + tol and (counts[h] < floor or left - 1 >= deficit):
                b = h
        if counts[b] < floor:
            deficit -= 1
        counts[b] += 1
        loads[b] += cost[i]
        out[b].append(i)
        heapq.heappush(heap, (loads[b], b))
        if short is not None and counts[b] < floor:
            heapq.heappush(short, (loads[b], b))
        left -= 1
    return [sorted(x) for x in out]


def level_microbatches(mbs: list[list[tuple[int, ...]]], cost: dict[int, float], tokens: dict[int, int],
                       lock_groups: list[list[int]]) -> list[list[tuple[int, ...]]]:
    """Microbatches of data ranks whose microbatch j runs in lock-step (FSDP gathers every layer of
    it from the whole shard group), so the step pays, per j, the slowest rank's: for j in order, the
    level is the group's costliest microbatch j, and every other rank pulls samples from its later
    microbatches into j (costliest first) while it stays within the level and within the group's
    largest microbatch j in tokens (activation memory grows with tokens, not cost). A rank that
    holds a sample far above the others' share then sets the level, and the rest of the group does
    its work alongside instead of after it."""
    out = [[list(mb) for mb in rank] for rank in mbs]
    for group in lock_groups:
        m = min(len(out[d]) for d in group)
        for j in range(m - 1):
            level = max(sum(cost[i] for i in out[d][j]) for d in group)
            cap = max(sum(tokens[i] for i in out[d][j]) for d in group)
            for d in group:
                c = sum(cost[i] for i in out[d][j])
                t = sum(tokens[i] for i in out[d][j])
                later = sorted(((cost[i], i, jj) for jj in range(j + 1, m) for i in out[d][jj]), key=lambda x: (-x[0], x[1]))
                for ci, i, jj in later:
                    if c + ci <= level and t + tokens[i] <= cap:
                        out[d][jj].remove(i)
                        out[d][j].append(i)
                        c, t = c + ci, t + tokens[i]
    return [[tuple(sorted(mb)) for mb in rank] for rank in out]

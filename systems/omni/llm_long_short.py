"""Long-short split on the LLM side: long samples over a context-parallel group, short ones data-parallel.

Without pipelining the step is set by the LLM data rank that holds the longest sample: no
assignment can split one sample's LLM sequence, so resharding cannot help once a sample's LLM
cost exceeds the balanced per-rank share (docs/architecture.md, "Why omni splits long LLM
samples"). omni therefore treats such a sample as *long*, the LLM analogue of the encoders'
long-short split (long_short.py): it runs on a fixed
group of `k` consecutive LLM data ranks with Ulysses context parallelism (each member holds a
contiguous 1/k of the packed row with all heads; two all-to-alls per layer give every member the
whole row for 1/k of the heads; omnibench.runtime.parallelize.UlyssesAttention), and everything
else stays data-parallel.

Plan shape (so both executors see it without a new action kind):
- every data rank runs the same number of LLM microbatches (FSDP locks a module's forward and
  backward calls across the data-parallel group): a member of group g runs its group's long
  samples first, one microbatch each, at the same index on every member, then its short samples
  balanced over the remaining microbatches (which may be empty: the runtime then runs a
  loss-free one-token row so the collectives stay in step);
- `Plan.assignment["llm"]` lists a long sample on every member of its group (the only samples
  allowed on more than one data rank); `plan.options["long_short"]` names the groups (module
  "llm", one group per tp coordinate), each rank's long microbatches, and each long sample's
  *leader* (the group's first data rank), the only consumer whose boundary route carries the
  encoder gradient back (the members' embedding gradients are summed over the group first).

At any pp and cp: with the layout's own cp, a group is the k data groups' cp ranks together (k x cp
ranks per tp coordinate, each holding 1/(k cp) of the row); with pipeline stages, every stage's ranks
of those data groups form that stage's group (the pipeline passes each member's chunk to the same
member of the next stage's group). A long sample is the bottleneck microbatch on every stage, so
pipelining does not make the split unnecessary.

How the group attends. Ulysses needs k x cp to divide the heads and the kv heads each tp rank holds;
a GQA model with few kv heads (omni-7b: 4 of 28, so cp 4 leaves no k > 1) has no such group. There
the group all-gathers K/V instead (Llama 3's context parallelism, sec. 3.3.2;
omnibench.runtime.parallelize.AllGatherKVAttention): each member keeps two opposite chunks of the
row (1/2k of it each, so the causal work is even), gathers the whole row's K/V before each attention
and reduce-scatters their gradients in the backward. Its bytes are the K/V's alone (4 of 28 heads
for omni-7b: 2 x 4 / (28 + 4 + 4 + 28) of Ulysses' q, k, v and output), and it has no head rule,
so only the node bounds k.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from omnibench.plan import Layout
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec


def llm_group_size(model: MultimodalSpec, parallel: ParallelSpec, llm: Layout) -> tuple[int, str, str]:
    """(k, how the group attends, why k is 1): data ranks a long LLM sample is split over and the
    group's context-parallel kind. Ulysses ("ulysses") where some k > 1 has k x cp dividing the heads
    and kv heads each tp rank holds (it splits heads); else all-gathered K/V ("allgather"), which has
    no head rule. Either way the largest k that divides the LLM's data ranks and keeps the group's
    k x cp x tp ranks inside a node (consecutive ranks: the group's exchanges run over NVLink)."""
    heads, kv = model.llm.heads // llm.tp, model.llm.kv_heads // llm.tp
    limit = min(llm.dp, max(1, parallel.gpus_per_node // (llm.tp * llm.cp)))
    fits = [x for x in range(1, limit + 1) if llm.dp % x == 0]
    k = max((x for x in fits if heads % (x * llm.cp) == 0 and kv % (x * llm.cp) == 0), default=1)
    if k > 1:
        return k, "ulysses", ""
    k = max(fits)
    if k > 1:
        return k, "allgather", ""
    return 1, "", (f"no group of k > 1 data ranks divides dp={llm.dp} with k x cp={llm.cp} x tp={llm.tp} "
                   f"ranks inside a node of {parallel.gpus_per_node}")


def place_llm_long(long: Sequence[int], cost: dict[int, float], groups: int, k: int) -> list[list[int]]:
    """Long samples onto groups, longest first onto the least loaded (by count, then load: every
    long sample adds one microbatch to all ranks, so the most loaded group sets the count)."""
    heap = [(0, 0.0, g) for g in range(groups)]
    out: list[list[int]] = [[] for _ in range(groups)]
    for i in long:
        n, load, g = heapq.heappop(heap)
        out[g].append(i)
        heapq.heappush(heap, (n + 1, load + cost[i] / k, g))
    return out

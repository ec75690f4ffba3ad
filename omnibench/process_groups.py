"""The process groups a Plan's layouts need, torch-free: what the runtime creates
(omnibench/runtime/groups.py, one `new_group` each, in this order on every rank) and what the
simulator counts per rank, since each group a rank belongs to is an NCCL communicator holding GPU
memory outside the caching allocator (simulator/memory.py `communicators`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np

from omnibench.plan import Layout


def process_groups(layouts: dict[str, Layout]) -> Iterator[tuple[tuple[str, str], tuple[int, ...]]]:
    """((module, dimension), member ranks) of every group, in the order the runtime creates them."""
    for name in sorted(layouts):
        lay = layouts[name]
        if name == "llm":
            for key, ranks_list in llm_groups(lay).items():
                for ranks in ranks_list:
                    yield ("llm", key), tuple(ranks)
        else:
            # "dp": the gradient (FSDP) group, dp x sp; "sp": Ulysses groups (temporal's encoders).
            for ranks in lay.fsdp_groups():
                yield (name, "dp"), tuple(ranks)
            for ranks in lay.groups("tp"):
                yield (name, "tp"), tuple(ranks)
            if lay.sp > 1:
                for ranks in lay.groups("sp"):
                    yield (name, "sp"), tuple(ranks)
            if lay.hybrid:  # HSDP, or hybrid ZeRO (omni's hzero2 encoders)
                for key, ranks_list in hsdp_groups(lay, lay.fsdp_groups()).items():
                    for ranks in ranks_list:
                        yield (name, key), tuple(ranks)


def llm_groups(lay: Layout) -> dict[str, list[tuple[int, ...]]]:
    out: dict[str, list[tuple[int, ...]]] = {"tp": lay.groups("tp"), "cp": lay.groups("cp"), "dpcp": [], "ep": [], "edp": []}
    for p in range(lay.pp):
        for t in range(lay.tp):
            flat = [lay.rank_at(pp=p, dp=d, cp=c, tp=t) for d in range(lay.dp) for c in range(lay.cp)]
            out["dpcp"].append(tuple(flat))
            ep = lay.ep
            out["ep"] += [tuple(flat[i : i + ep]) for i in range(0, len(flat), ep)]
            out["edp"] += [tuple(flat[i::ep]) for i in range(ep)]
    if lay.hsdp:
        out.update(hsdp_groups(lay, out["dpcp"]))
    return out


def hsdp_groups(lay: Layout, fsdp_groups: list[tuple[int, ...]]) -> dict[str, list[tuple[int, ...]]]:
    """HSDP or hybrid ZeRO (Layout.dp_shard): each FSDP group split into shard groups of `shard_size` consecutive
    members, the replicate groups across them (members holding the same shard), and, with
    experts split over ep, the members of a shard group holding the same experts."""
    s, ep = lay.shard_size, lay.ep if lay.module == "llm" else 1
    out: dict[str, list[tuple[int, ...]]] = {"dp_shard": [], "dp_replicate": [], "edp_shard": []}
    for flat in fsdp_groups:
        chunks = [flat[i : i + s] for i in range(0, len(flat), s)]
        out["dp_shard"] += chunks
        out["dp_replicate"] += [flat[j::s] for j in range(s)]
        if ep > 1:
            out["edp_shard"] += [c[i::ep] for c in chunks for i in range(ep)]
    return out


def kinds(name: str, lay: Layout) -> int:
    """How many of `process_groups`' groups each rank of `lay` belongs to: every kind (tp, cp, dpcp, ...)
    partitions the layout's ranks, so a member is in exactly one group of each kind that has any."""
    if name == "llm":
        n = 5  # tp, cp, dpcp, ep, edp
        if lay.hsdp:
            n += 2 + (lay.ep > 1)  # dp_shard, dp_replicate, edp_shard (experts split over ep only)
        return n
    return 2 + (lay.sp > 1) + (2 if lay.hybrid else 0)  # dp, tp; sp; dp_shard, dp_replicate


def groups_of_rank(layouts: dict[str, Layout], rank: int, extra: list[tuple[int, ...]] = ()) -> int:
    """How many of the layouts' groups (and of `extra` groups, e.g. omni's sequence-parallel groups of
    a step) `rank` belongs to; the world group is not counted."""
    return (sum(kinds(name, lay) for name, lay in layouts.items() if rank in _members(lay))
            + sum(rank in g for g in extra))


def fewest_groups(layouts: dict[str, Layout], world: int) -> int:
    """The least any rank of a world of `world` belongs to (a lower bound for every rank).

    Each rank's membership pattern (which layouts hold it) as a bit mask over the world, and the
    least count over the patterns present: tune asks once per candidate, and asking rank by rank
    cost more at 8,192 GPUs than the rest of the memory estimate."""
    counts = [kinds(name, lay) for name, lay in layouts.items()]
    pattern = np.zeros(world, dtype=np.int64)
    for bit, lay in enumerate(layouts.values()):
        ranks = np.fromiter(lay.ranks, dtype=np.int64, count=len(lay.ranks))
        pattern[ranks[ranks < world]] |= 1 << bit
    present = np.flatnonzero(np.bincount(pattern, minlength=1))
    return min((sum(n for bit, n in enumerate(counts) if p >> bit & 1) for p in present), default=0)


def _members(lay: Layout) -> frozenset:
    got = _MEMBERS.get(id(lay))
    if got is None or got[0] is not lay:
        got = (lay, frozenset(lay.ranks))
        if len(_MEMBERS) > 64:
            _MEMBERS.clear()
        _MEMBERS[id(lay)] = got
    return got[1]


_MEMBERS: dict[int, tuple] = {}


def group_counts(layouts: dict[str, Layout], extra: list[tuple[int, ...]] = ()) -> Counter:
    """rank -> how many groups it belongs to, by enumerating them (what `groups_of_rank` computes
    without enumerating; the tests hold the two equal)."""
    counts: Counter = Counter()
    for _, ranks in process_groups(layouts):
        counts.update(ranks)
    for ranks in extra:
        counts.update(ranks)
    return counts


# -- omni's long-input groups: fixed groups of consecutive ranks, one family per size ------------------
def sp_groups(enc: Layout, k: int) -> list[tuple[int, ...]]:
    """An encoder's sequence-parallel groups of size k: k consecutive data ranks (tp leaders), the same
    every step (systems/omni/long_short.py)."""
    leaders = [enc.rank_at(dp=d, sp=0, tp=0) for d in range(enc.dp)]
    return [tuple(leaders[i : i + k]) for i in range(0, len(leaders), k)]


def long_llm_groups(llm: Layout, k: int) -> list[tuple[int, ...]]:
    """The LLM's long-sample groups (systems/omni/llm_long_short.py): per pipeline stage and tp
    coordinate, k consecutive data indices with all their cp ranks, data-major (member c * cp + cp
    coordinate holds that chunk of the row)."""
    out = []
    for p in range(llm.pp):
        for g in range(llm.dp // k):
            for t in range(llm.tp):
                out.append(tuple(llm.rank_at(pp=p, dp=g * k + c, cp=cc, tp=t) for c in range(k) for cc in range(llm.cp)))
    return out


def pool_groups(layouts: dict[str, Layout], pool: dict[str, list[int]]) -> list[tuple[int, ...]]:
    """Every group of a plan's group pool (`plan.options["long_short"]["pool"]`: module -> sizes), each
    once (a group is its ranks, whichever module names it), in one order every rank computes alike: what
    the runtime builds at start-up (omnibench/runtime/long_short.py) and the simulator counts."""
    out: dict[tuple[int, ...], None] = {}
    for module in sorted(pool):
        for k in pool[module]:
            lay = layouts[module]
            out.update(dict.fromkeys(long_llm_groups(lay, k) if module == "llm" else sp_groups(lay, k)))
    return list(out)

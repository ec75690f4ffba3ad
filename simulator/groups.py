"""Rank groups and collapsing: which ranks a rank synchronises with, and which ranks are the same.

Collapsing. Ranks are grouped into classes by colour refinement: a rank's first colour is its action
list with the cost-relevant data of each action (sequence lengths, not sample ids); then, until
stable, a rank's colour also takes the colours of its send/recv peers, its boundary peers and the
groups it synchronises with (gradient groups, and omni's loader groups for the metadata all-gathers:
left out, two ranks of different loader groups could share a class whose lock then waits forever). TP
peers and replicas that got identically-shaped data end in one class and are simulated once; DP
replicas that got different data stay distinct. Classes are exact under a symmetric cluster
placement: a class is simulated with its lowest rank's placement.

Groups are shared tuples built once per layout (`LayoutIndex`) and looked up by identity: hashing a
group of thousands of ranks per lookup made a step quadratic in the world size.
"""

from __future__ import annotations

from collections import defaultdict

from omnibench.plan import (
    BACKWARD,
    BOUNDARY,
    FORWARD,
    METADATA,
    RECV,
    SEND,
    Action,
    Layout,
    loader_group,
)


class LayoutIndex:
    """Coordinates and sub-groups of a layout without O(n) lookups per rank."""

    def __init__(self, layout: Layout):
        self.layout = layout
        dims, shape = layout.mesh_dims, layout.mesh_shape
        self.coords: dict[int, dict[str, int]] = {}
        for i, r in enumerate(layout.ranks):
            c, idx = {}, i
            for d, s in zip(reversed(dims), reversed(shape), strict=True):
                c[d] = idx % s
                idx //= s
            self.coords[r] = c
        self._groups: dict[tuple[str, ...], dict[int, tuple[int, ...]]] = {}
        self._hsdp: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None

    def group(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        """Ranks sharing every coordinate with `rank` except those in `dims`."""
        table = self._groups.get(dims)
        if table is None:
            buckets: dict[tuple, list[int]] = defaultdict(list)
            others = [d for d in self.layout.mesh_dims if d not in dims]
            for r in self.layout.ranks:
                c = self.coords[r]
                buckets[tuple(c[d] for d in others)].append(r)
            table = {}
            for members in buckets.values():
                g = tuple(members)
                for r in members:
                    table[r] = g
            self._groups[dims] = table
        return table[rank]

    def shard_dims(self) -> tuple[str, ...]:
        return self.layout.fsdp_dims

    def hsdp(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shard group, replicate group) of `rank` under HSDP (`Layout.dp_shard`): runs of
        `shard_size` consecutive members of its FSDP group, and the members holding the same shard.
        Without HSDP the shard group is the FSDP group itself (the same tuple) and the replicate
        group is the rank alone."""
        if self._hsdp is None:
            table: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
            if self.layout.shard_size >= self.layout.fsdp_size:
                for r in self.layout.ranks:
                    table[r] = (self.group(r, self.shard_dims()), (r,))
            else:
                rep_of = {x: rep for rep in self.layout.replicate_groups() for x in rep}
                for chunk in self.layout.shard_groups():
                    for x in chunk:
                        table[x] = (chunk, rep_of[x])
            self._hsdp = table
        return self._hsdp[rank]


class GroupsMixin:
    """The Engine's group lookups and colour refinement (needs `plan`, `index` and the caches
    `Engine.__init__` sets up)."""

    def _lock_group(self, module: str, rank: int) -> tuple[int, ...] | None:
        lay = self.plan.layouts[module]
        g = self._grad_group(module, rank)
        if lay.hsdp:
            # Gathers lock the shard group; its ep groups lie inside it (ep divides dp_shard).
            g = self._shard_group(module, rank)
        if len(g) > 1 and (lay.fsdp or lay.ep > 1):
            return g
        return None

    def _shard_group(self, module: str, rank: int) -> tuple[int, ...]:
        return self.index[module].hsdp(rank)[0]

    def _replicate_group(self, module: str, rank: int) -> tuple[int, ...]:
        return self.index[module].hsdp(rank)[1]

    def _grad_group(self, module: str, rank: int) -> tuple[int, ...]:
        idx = self.index[module]
        return idx.group(rank, idx.shard_dims())

    def _loader_group(self, rank: int, what: str) -> tuple[int, ...]:
        """omnibench.plan.loader_group, computed once per distinct group (a shared tuple)."""
        c = self.index["llm"].coords[rank]
        size = max(1, min(int(self.plan.options.get("reorder_group", 1)), self.plan.layouts["llm"].dp))
        key = (what, c["pp"], c["cp"], c["tp"], c["dp"] // size if what == "reorder" else 0)
        got = self._loader_groups.get(key)
        if got is None:
            got = self._loader_groups[key] = loader_group(self.plan.layouts["llm"], rank, what, size)
        return got

    def _long_group(self, module: str, rank: int, mb: int) -> tuple[int, ...]:
        """omni (systems/omni, plan.options["long_short"]): the sequence-parallel group that runs this
        encoder microbatch together (its work split over the group, Ulysses all-to-alls), else ()."""
        cfg = self.plan.options.get("long_short")  # the LLM's too: omni's long LLM samples
        if not cfg or mb not in cfg.get("long_microbatches", {}).get(module, {}).get(str(rank), ()):
            return ()
        of_rank = self._sp_group_of.get(module)
        if of_rank is None:  # rank -> its group, once per module (a scan per call was O(world))
            of_rank = self._sp_group_of[module] = {r: tuple(g) for g in cfg["groups"][module] for r in g}
        return of_rank[rank]

    def _expert_group(self, rank: int, shard: tuple[int, ...], ep: int) -> tuple[int, ...]:
        """Ranks holding the same experts: every ep-th rank of the shard group (cached, shared tuple)."""
        key = (id(shard), rank % max(1, ep), ep)
        got = self._edp_cache.get(key)
        if got is None or got[1] is not shard:
            i = shard.index(rank)
            got = self._edp_cache[key] = (shard[i % ep:: ep] if ep > 1 else shard, shard)
        return got[0]

    def _members(self, group: tuple[int, ...], cls: dict[int, int]) -> tuple[int, int]:
        """(id, size) of the set of distinct classes in a group; groups are the index's shared
        tuples, so they are looked up by identity (hashing a 1,024-rank tuple per action is slow)."""
        got = self._member_cache.get(id(group))
        if got is None:
            members = tuple(sorted({cls[x] for x in group if x in cls}))
            gid = self._member_ids.setdefault(members, len(self._member_ids))
            got = self._member_cache[id(group)] = (gid, len(members), group)
        return got[0], got[1]

    def _boundary_tokens(self, rank: int, a: Action) -> int:
        """LLM tokens in one boundary message (all routes of one (src, src mb, dst, dst mb))."""
        src, dst = (rank, a.peer) if a.direction == "send" else (a.peer, rank)
        smb, dmb = (a.microbatch, a.peer_microbatch) if a.direction == "send" else (a.peer_microbatch, a.microbatch)
        if a.what == "grad":
            src, dst, smb, dmb = dst, src, dmb, smb  # grads flow back along the route
        return self.message_tokens.get((a.module, src, smb, dst, dmb), 0)

    @staticmethod
    def _boundary_key(rank: int, a: Action, cls: dict[int, int]) -> tuple:
        # No occurrence count: the receiver waits for "its peer's class has sent this microbatch's
        # message to its class", which stays matched when classes collapse several senders.
        if a.direction == "send":
            src, dst, smb, dmb = rank, a.peer, a.microbatch, a.peer_microbatch
        else:
            src, dst, smb, dmb = a.peer, rank, a.peer_microbatch, a.microbatch
        return ("bnd", a.module, a.what, cls.get(src, src), cls.get(dst, dst), smb, dmb)

    def classes(self) -> dict[int, int]:
        """rank -> representative rank of its class."""
        plan = self.plan
        ranks = sorted(plan.actions)
        base: dict[int, int] = {}
        intern: dict = {}
        for r in ranks:
            sig = []
            for a in plan.actions[r]:
                if a.kind in (FORWARD, BACKWARD, SEND, RECV):
                    data = self._signature(a.module, r, a.microbatch)
                    if a.kind == FORWARD:
                        data = (data, self.input_elements(a.module, r, a))
                elif a.kind == BOUNDARY:
                    data = (a.direction, a.peer_microbatch, self._boundary_tokens(r, a))
                else:
                    data = ()
                sig.append((a.kind, a.module, a.stage, a.microbatch, a.what, data))
            base[r] = intern.setdefault(tuple(sig), len(intern))
        colour = dict(base)
        n_classes = len(set(colour.values()))
        for _ in range(8):
            # keyed by the groups' identity: they are the layout index's shared tuples (kept alive
            # there), and hashing a tuple of thousands of ranks per lookup was quadratic at scale
            group_colour: dict[int, int] = {}
            intern = {}
            new = {}
            for r in ranks:
                sig = [colour[r]]
                for a in plan.actions[r]:
                    if a.kind in (SEND, RECV, BOUNDARY):
                        sig.append(colour.get(a.peer, -1))
                    elif a.kind == METADATA:  # the loaders' all-gathers lock their group as grad_sync does
                        g = self._loader_group(r, a.what)
                        got = group_colour.get(id(g))
                        if got is None:
                            got = group_colour[id(g)] = hash(frozenset(colour[x] for x in g if x in colour))
                        sig.append(got)
                for m in plan.layouts:
                    if r in self.index[m].coords:
                        groups = [self._grad_group(m, r)]
                        if plan.layouts[m].hsdp:  # FSDP locks the shard group layer by layer
                            groups.append(self._shard_group(m, r))
                        for g in groups:
                            got = group_colour.get(id(g))
                            if got is None:
                                got = group_colour[id(g)] = hash(frozenset(colour[x] for x in g if x in colour))
                            sig.append(got)
                new[r] = intern.setdefault(tuple(sig), len(intern))
            colour = new
            if len(intern) == n_classes:
                break
            n_classes = len(intern)
        rep: dict[int, int] = {}
        out = {}
        for r in ranks:
            out[r] = rep.setdefault(colour[r], r)
        return out

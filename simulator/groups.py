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
        # rank -> its mesh coordinates: the layout's own table (the planner has mostly built it already);
        # read, never changed
        self.coords: dict[int, dict[str, int]] = layout.coord_table()
        self._groups: dict[tuple[str, ...], dict[int, tuple[int, ...]]] = {}
        self._hsdp: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None

    def group(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        """Ranks sharing every coordinate with `rank` except those in `dims`."""
        table = self._groups.get(dims)
        if table is None:
            table = self.table(dims)
        return table[rank]

    def table(self, dims: tuple[str, ...]) -> dict[int, tuple[int, ...]]:
        """rank -> `group(rank, dims)` for every rank of the layout (built once per dims)."""
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
        return table

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
        of = self._lock_of.get(module)
        if of is None:
            of = self._lock_of[module] = {}
        got = of.get(rank, 0)
        if got == 0:
            got = of[rank] = self._lock_group_of(module, rank)
        return got

    def _lock_group_of(self, module: str, rank: int) -> tuple[int, ...] | None:
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
        table = self._grad_tables.get(module)
        if table is None:
            idx = self.index[module]
            table = self._grad_tables[module] = idx.table(idx.shard_dims())
        return table[rank]

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
        longs = self._long_mbs.get(module)
        if longs is None:  # rank -> its long microbatches, once per module (str keys: JSON)
            cfg = self.plan.options.get("long_short")  # the LLM's too: omni's long LLM samples
            per = cfg.get("long_microbatches", {}).get(module, {}) if cfg else {}
            longs = self._long_mbs[module] = {int(r): set(mbs) for r, mbs in per.items()}
        if mb not in longs.get(rank, ()):
            return ()
        of_rank = self._sp_group_of.get(module)
        if of_rank is None:  # rank -> its group, once per module (a scan per call was O(world))
            groups = self.plan.options["long_short"]["groups"][module]
            of_rank = self._sp_group_of[module] = {r: tuple(g) for g in groups for r in g}
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
        # what each rank's colour is refined with, collected once: the peers of its sends, recvs and
        # boundary messages, then the groups it synchronises with (the loaders' all-gathers, which
        # lock their group as grad_sync does, in action order; each module's gradient group, and
        # under HSDP its shard group, which FSDP locks layer by layer). Equal base colours mean equal
        # action lists, so two ranks' lists line up entry by entry wherever the refinement compares them.
        peers: dict[int, list[int]] = {}
        groups: dict[int, list[tuple[int, ...]]] = {}
        modules = [(m, self.index[m].coords, lay.hybrid) for m, lay in plan.layouts.items()]
        boundary = self._boundary_of
        for r in ranks:
            sig = []
            ps: list[int] = []
            gs: list[tuple[int, ...]] = []
            data_of: dict[str, list] = {}  # module -> the rank's microbatch signatures (`_rank_data`)
            tokens: list[int] = []  # its boundary messages' tokens, in action order (`program` reads them)
            for a in plan.actions[r]:
                kind = a.kind
                if kind == FORWARD or kind == BACKWARD or kind == SEND or kind == RECV:
                    module, mb = a.module, a.microbatch
                    sigs = data_of.get(module)
                    if sigs is None:
                        sigs = data_of[module] = self._rank_data(module, r)[0]
                    # (a microbatch beyond its assignment: `_signature` raises the plan's error)
                    data = sigs[mb] if mb < len(sigs) else self._signature(module, r, mb)
                    if kind == FORWARD:
                        data = (data, self.input_elements(module, r, a))
                    elif kind != BACKWARD:
                        ps.append(a.peer)
                elif kind == BOUNDARY:
                    n = self._boundary_tokens(r, a)
                    tokens.append(n)
                    data = (a.direction, a.peer_microbatch, n)
                    ps.append(a.peer)
                else:
                    data = ()
                    if kind == METADATA:
                        gs.append(self._loader_group(r, a.what))
                sig.append((kind, a.module, a.stage, a.microbatch, a.what, data))
            for m, coords, hsdp in modules:
                if r in coords:
                    gs.append(self._grad_group(m, r))
                    if hsdp:
                        gs.append(self._shard_group(m, r))
            base[r] = intern.setdefault(tuple(sig), len(intern))
            boundary[r] = tokens
            peers[r] = ps
            groups[r] = gs
        colour = base
        n_classes = len(intern)
        # until stable: a difference travels one peer per round (a pipeline of pp stages needs pp rounds
        # to carry a stage-0 rank's boundary traffic to the last stage), and a partition that is not
        # stable puts ranks in one class whose peers are in different classes, which deadlocks the step
        while True:
            if n_classes == len(ranks):
                break  # every rank its own class already: refining can only split classes
            # keyed by the groups' identity: they are the layout index's shared tuples (kept alive
            # there), and hashing a tuple of thousands of ranks per lookup was quadratic at scale
            group_colour: dict[int, int] = {}
            intern = {}
            new = {}
            peer_colour = colour.get
            for r in ranks:
                sig = [colour[r]]
                sig += [peer_colour(p, -1) for p in peers[r]]
                for g in groups[r]:
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

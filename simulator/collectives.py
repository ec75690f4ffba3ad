"""NCCL-like collective costs: latency per algorithm step plus bytes over bus bandwidth.

The shape follows NCCL's own cost model (`src/graph/tuning.cc`): a ring pays one link latency per
step (2(n-1) steps for an all-reduce, n-1 for all-gather / reduce-scatter); a (double binary) tree
pays a latency that grows with log2(nodes); both move bytes at a bus bandwidth set by the slowest
link the algorithm crosses. NCCL picks the algorithm with the lowest predicted time for the size
and scale, and so does `CollectiveModel`: ring, tree and the hierarchical form (reduce-scatter in
the node, all-reduce across nodes on 1/local of the data, all-gather in the node) are all costed
and the minimum wins.

Placement comes from the ranks in the group: all in one node -> NVLink figures; across nodes ->
NIC figures, with the per-GPU share of the node's NICs. `bytes` is always the full logical buffer
(the all-reduced tensor, the gathered output, the reduce-scatter input, the all-to-all input).

Calibrated alpha/beta (from `omnibench calibrate`) replace the datasheet latency/bandwidth for a
placement ("intra"/"inter") when present; "intra.inline"/"inter.inline" for the communication a
module issues inside its compute (`inline_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator.hardware import ClusterSpec

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# Bandwidth a collective reaches grows with message size beyond what latency alone explains
# (protocol switches, chunk pipelining): eff(S) = S / (S + half) per rank-chunk. 64 KiB puts NCCL's
# measured knee (a few hundred KB per rank to reach most of the bus bandwidth) in the right place.
CHUNK_HALF_BYTES = 64 * 1024
TREE_BANDWIDTH_FACTOR = 0.9  # trees reach a little less bus bandwidth than rings at large sizes

# NCCL's protocols (the "nccl" collective model): each algorithm runs in LL (8-byte lines with a flag:
# lowest latency, a fraction of the bandwidth), LL128 (128-byte lines, 92% of it) or Simple (full
# bandwidth, highest latency), and NCCL picks the (algorithm, protocol) of least predicted time, which
# is what turns bus bandwidth into a function of message size. Latencies in microseconds, read from
# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, `baseLat` and `hwLat`, commit 01afd20):
# a base latency per (algorithm, protocol) plus one hop latency per algorithm step, NVLink or network.
PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_BASE_US = {"ring": (3.6, 10.0, 8.4), "tree": (4.4, 4.4, 0.0)}
NCCL_HOP_US = {
    ("intra", "ring"): (0.47, 1.9, 3.4), ("intra", "tree"): (0.52, 1.2, 28.0),
    ("inter", "ring"): (2.7, 4.0, 9.6), ("inter", "tree"): (5.0, 8.5, 50.0),
}
RING_PLATEAU = 1.9  # NCCL: a multi-node Simple ring all-reduce of large messages pays 1.9x its latency


@dataclass(slots=True, unsafe_hash=True)  # made per cost worked out: never changed once made
class LinkCost:
    latency: float  # seconds per algorithm step
    bandwidth: float  # bytes/s per rank


@dataclass
class Placement:
    n: int  # ranks in the group
    nodes: int  # distinct nodes
    local: int  # max ranks of the group in one node
    same_rail: bool  # across nodes, every member uses the same local GPU index (one rail)


@dataclass
class CollectiveModel:
    cluster: ClusterSpec
    # placement ("intra"|"inter") -> (alpha seconds/step, beta bytes/s); from calibration
    fitted: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Whether intra-module communication overlaps compute (GPU: FSDP prefetches the next layer's
    # all-gather on its own stream, reduce-scatters run behind later compute). A CPU rank has one
    # thread: every collective blocks it (calibrated CPU profiles set this False).
    inline_overlap: bool = True
    _placement_cache: dict = field(default_factory=dict, repr=False)
    _cost_cache: dict = field(default_factory=dict, repr=False)

    def inline_model(self) -> CollectiveModel:
        """The model for communication issued inside a module's compute (FSDP gathers and
        reduce-scatters, TP/CP/EP exchanges): calibrated figures of their own where the profile has
        them (placement "intra.inline" / "inter.inline": on a CPU host a collective in the middle
        of a layer also pays thread hand-offs and the peers' per-layer skew), else the same."""
        own = {w: self.fitted[f"{w}.inline"] for w in ("intra", "inter") if f"{w}.inline" in self.fitted}
        if not own:
            return self
        return CollectiveModel(self.cluster, fitted={**self.fitted, **own}, inline_overlap=self.inline_overlap)

    def placement(self, ranks: tuple[int, ...]) -> Placement:
        # by identity, as `cost`: a tuple's hash is not cached, and hashing a data-parallel group of
        # thousands of ranks on every cost miss made a step quadratic in the world size
        got = self._placement_cache.get(id(ranks))
        if got is not None and got[1] is ranks:
            return got[0]
        gpn = self.cluster.gpus_per_node
        per_node: dict[int, int] = {}
        rails = set()
        for r in ranks:
            per_node[r // gpn] = per_node.get(r // gpn, 0) + 1
            rails.add(r % gpn)
        p = Placement(len(ranks), len(per_node), max(per_node.values()), len(rails) == 1)
        self._placement_cache[id(ranks)] = (p, ranks)
        return p

    def link(self, where: str, local: int = 1, same_rail: bool = True) -> LinkCost:
        if where in self.fitted:
            a, b = self.fitted[where]
            return LinkCost(a, b)
        c = self.cluster
        if where == "intra":
            return LinkCost(c.intra.latency, c.intra.bandwidth)
        inter = c.inter
        # The node's NICs are shared by the group members that sit in it.
        bw = inter.bandwidth * min(1.0, inter.nics_per_node / max(1, local))
        lat = inter.latency
        if inter.topology == "fat-tree":
            bw /= inter.oversubscription
        elif not same_rail:
            # Rail-optimised fabrics join equal local ranks; cross-rail traffic first hops over
            # NVLink to the right rail (PXN), one more latency.
            lat += c.intra.latency
        return LinkCost(lat, bw)

    # -- algorithms -----------------------------------------------------------------------------
    @staticmethod
    def _eff(chunk: float) -> float:
        return chunk / (chunk + CHUNK_HALF_BYTES) if chunk > 0 else 1.0

    def _ring(self, steps: int, moved: float, link: LinkCost) -> float:
        chunk = moved / max(1, steps)
        return steps * link.latency + moved / (link.bandwidth * self._eff(chunk))

    def _bus_link(self, p: Placement) -> LinkCost:
        """The slowest link a ring over this group crosses (per rank)."""
        if p.nodes == 1:
            return self.link("intra")
        intra, inter = self.link("intra"), self.link("inter", p.local, p.same_rail)
        return LinkCost(max(intra.latency, inter.latency), min(intra.bandwidth, inter.bandwidth))

    # -- NCCL's algorithms and protocols ("nccl" collective model) -------------------------------
    def _nccl(self, p: Placement) -> bool:
        """NCCL's protocol model applies: the preset says so and no calibrated figures replace it."""
        where = "intra" if p.nodes == 1 else "inter"
        return self.cluster.collectives == "nccl" and where not in self.fitted

    def _ring_busbw(self, p: Placement) -> float:
        """Bus bandwidth of a ring over the group (bytes/s). Inside a node: NVLink. Across nodes
        NCCL runs one ring channel per NIC, each leaving every node once, so a node's group members
        together drive the NICs attached to them (one per GPU on a rail-optimised node): a whole-node
        group reaches NICs x NIC bandwidth, capped by NVLink; one member per node only its own NIC."""
        intra = self.link("intra").bandwidth
        if p.nodes == 1:
            return intra
        c = self.cluster
        nics = max(1.0, p.local * c.inter.nics_per_node / c.gpus_per_node)
        inter = self.link("inter", 1, p.same_rail).bandwidth * nics
        return min(intra, inter)

    def _nccl_ring(self, coll: str, nbytes: float, p: Placement) -> float:
        n = p.n
        steps = 2 * (n - 1) if coll == "all_reduce" else n - 1
        inter_steps = (2 if coll == "all_reduce" else 1) * (p.nodes - 1)
        moved = steps / n * nbytes
        bus = self._ring_busbw(p)
        best = math.inf
        for i, proto in enumerate(PROTOCOLS):
            hop_intra = NCCL_HOP_US[("intra", "ring")][i] * (1.8 if p.nodes > 1 and proto == "LL" else 1.0)
            lat = (NCCL_BASE_US["ring"][i] + (steps - inter_steps) * hop_intra
                   + inter_steps * NCCL_HOP_US[("inter", "ring")][i]) * 1e-6
            if proto == "LL":
                bw = bus / (4.0 if p.nodes > 1 or coll == "all_reduce" else 3.0)
            elif proto == "LL128":
                bw = bus * 0.92
            else:
                bw = bus
                if coll == "all_reduce" and p.nodes > 1 and nbytes >= n / 16 * 65536:
                    lat *= RING_PLATEAU
            best = min(best, lat + moved / bw)
        return best

    def _nccl_tree(self, nbytes: float, p: Placement) -> float:
        """Double binary tree all-reduce: chain inside each node, tree across nodes; reduce then
        broadcast, so the whole buffer crosses twice at 90% of the ring's bus bandwidth."""
        bus = self._ring_busbw(p) * TREE_BANDWIDTH_FACTOR
        best = math.inf
        for i, proto in enumerate(PROTOCOLS):
            hop_intra = NCCL_HOP_US[("intra", "tree")][i] * (1.8 if p.nodes > 1 and proto == "LL" else 1.0)
            lat = (NCCL_BASE_US["tree"][i] + 2 * ((p.local - 1) * hop_intra
                   + math.ceil(math.log2(max(1, p.nodes))) * NCCL_HOP_US[("inter", "tree")][i])) * 1e-6
            bw = bus / 3.8 if proto == "LL" else bus * (0.915 if p.nodes > 1 else 7 / 9) if proto == "LL128" else bus
            best = min(best, lat + 2 * nbytes / bw)
        return best

    def _nvls(self, nbytes: float, p: Placement) -> float:
        """NVLink SHARP all-reduce inside one node (NVSwitch reduces): Simple protocol latency, the
        preset's NVLS bus bandwidth."""
        busbw = self.cluster.intra.nvls_busbw_gbs * 1e9
        lat = (NCCL_BASE_US["ring"][2] + 2 * NCCL_HOP_US[("intra", "ring")][2]) * 1e-6
        return lat + 2 * (p.n - 1) / p.n * nbytes / busbw

    def all_reduce(self, nbytes: float, ranks: tuple[int, ...]) -> tuple[float, str]:
        p = self.placement(ranks)
        n = p.n
        if n <= 1 or nbytes <= 0:
            return 0.0, "none"
        if self._nccl(p):
            options = {"ring": self._nccl_ring("all_reduce", nbytes, p), "tree": self._nccl_tree(nbytes, p)}
            if p.nodes == 1 and n > 2 and self.cluster.intra.nvls_busbw_gbs > 0:
                options["nvls"] = self._nvls(nbytes, p)
            algo = min(options, key=options.get)
            return options[algo], algo
        link = self._bus_link(p)
        options = {"ring": self._ring(2 * (n - 1), 2 * (n - 1) / n * nbytes, link)}
        # Double binary tree across nodes, chain inside each node: latency ~ log2(nodes).
        intra = self.link("intra")
        if p.nodes > 1:
            inter = self.link("inter", p.local, p.same_rail)
            tree_lat = 2 * (math.ceil(math.log2(p.nodes)) * inter.latency + (p.local - 1) * intra.latency)
            tree_bw = min(intra.bandwidth, inter.bandwidth) * TREE_BANDWIDTH_FACTOR
        else:
            tree_lat = 2 * math.ceil(math.log2(n)) * intra.latency
            tree_bw = intra.bandwidth * TREE_BANDWIDTH_FACTOR
        options["tree"] = tree_lat + 2 * nbytes / (tree_bw * self._eff(nbytes / 2))
        if p.nodes > 1 and p.local > 1:
            # Hierarchical: RS in node, AR across nodes on 1/local of the bytes (local rails in
            # parallel), AG in node.
            in_node = tuple(range(p.local))
            rs, _ = self.reduce_scatter(nbytes, in_node)
            across = tuple(i * self.cluster.gpus_per_node for i in range(p.nodes))
            ar, _ = self.all_reduce(nbytes / p.local, across)
            ag, _ = self.all_gather(nbytes, in_node)
            options["hierarchical"] = rs + ar + ag
        algo = min(options, key=options.get)
        return options[algo], algo

    def all_gather(self, nbytes: float, ranks: tuple[int, ...]) -> tuple[float, str]:
        p = self.placement(ranks)
        if p.n <= 1 or nbytes <= 0:
            return 0.0, "none"
        if self._nccl(p):
            return self._nccl_ring("all_gather", nbytes, p), "ring"
        return self._ring(p.n - 1, (p.n - 1) / p.n * nbytes, self._bus_link(p)), "ring"

    def reduce_scatter(self, nbytes: float, ranks: tuple[int, ...]) -> tuple[float, str]:
        return self.all_gather(nbytes, ranks)

    def all_to_all(self, nbytes: float, ranks: tuple[int, ...]) -> tuple[float, str]:
        """Each rank sends nbytes/n to every peer; in-node parts over NVLink, the rest over NICs."""
        p = self.placement(ranks)
        if p.n <= 1 or nbytes <= 0:
            return 0.0, "none"
        intra = self.link("intra")
        t_intra = (p.local - 1) / p.n * nbytes / (intra.bandwidth * self._eff(nbytes / p.n))
        t = intra.latency + t_intra
        if p.nodes > 1:
            inter = self.link("inter", p.local, p.same_rail)
            t_inter = (p.n - p.local) / p.n * nbytes / (inter.bandwidth * self._eff(nbytes / p.n))
            t = max(t, inter.latency + t_inter)
        return t, "pairwise"

    def expert_all_to_all(self, nbytes: float, ranks: tuple[int, ...], experts: int, top_k: int,
                          dispatcher: str = "alltoall") -> float:
        """One MoE dispatch (or combine) over an expert-parallel group: `nbytes` are the rank's token
        copies (tokens x top_k x hidden), each bound for the rank holding its expert.

        "alltoall" (Megatron-Core's all-to-all dispatcher): every copy travels on its own, so a token
        routed to several experts of one remote node crosses the network once per expert (the plain
        all-to-all). "deepep" (DeepEP's normal kernels, Megatron's flex dispatcher): a token crosses to
        each remote node at most once, to the GPU of the same rail, with a bitmask of the node's GPUs
        that need it, and is forwarded to them over NVLink (deepseek-ai/DeepEP csrc/kernels/internode.cu,
        `SourceMeta.is_token_in_nvl_rank_bits`; README: "asymmetric-domain bandwidth forwarding").
        With routing balanced over `experts` (the Plan does not know the routing), a node holding
        E_node of them is missed by a token with probability C(E - E_node, k) / C(E, k): the network
        carries (nodes - 1)(1 - that) copies per token instead of k (n - local) / n."""
        key = ("ep", nbytes, id(ranks), experts, top_k, dispatcher)
        got = self._cost_cache.get(key)
        if got is not None and got[1] is ranks:
            return got[0]
        t = self.all_to_all(nbytes, ranks)[0]
        p = self.placement(ranks)
        if dispatcher == "deepep" and p.nodes > 1 and nbytes > 0 and top_k > 0:
            per_node = experts * p.local / p.n
            miss = math.prod((experts - per_node - i) / (experts - i) for i in range(top_k)) if (
                experts - per_node >= top_k) else 0.0
            naive = top_k * (p.n - p.local) / p.n  # remote copies per token, one per expert
            remote = (p.nodes - 1) * (1.0 - miss)  # remote nodes a token reaches
            intra, inter = self.link("intra"), self.link("inter", p.local, p.same_rail)
            copies = nbytes / top_k  # bytes of one copy of each token
            # NVLink carries the in-node copies and forwards what arrives from other nodes
            t_intra = ((p.local - 1) / p.n * nbytes + naive * copies * (p.local - 1) / p.local) / (
                intra.bandwidth * self._eff(nbytes / p.n))
            t_inter = remote * copies / (inter.bandwidth * self._eff(nbytes / p.n))
            t = max(intra.latency + t_intra, inter.latency + t_inter)
        self._cost_cache[key] = (t, ranks)
        return t

    def send_recv(self, nbytes: float, src: int, dst: int) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        gpn = self.cluster.gpus_per_node
        where = 0 if src // gpn == dst // gpn else (1 if src % gpn == dst % gpn else 2)
        key = ("p2p", nbytes, where)
        got = self._cost_cache.get(key)
        if got is None:
            link = self.link("intra") if where == 0 else self.link("inter", 1, where == 1)
            got = self._cost_cache[key] = link.latency + nbytes / (link.bandwidth * self._eff(nbytes))
        return got

    def cost(self, op: str, nbytes: float, ranks: tuple[int, ...]) -> float:
        # Groups are long-lived shared tuples: cache by identity (the tuple is kept alive with it).
        key = (op, nbytes, id(ranks))
        got = self._cost_cache.get(key)
        if got is not None and got[1] is ranks:
            return got[0]
        # A collective's time is a function of the group's placement alone (size, nodes, ranks per
        # node, rail), and a layout's groups mostly share a few placements (every tp group of a
        # step is 4 ranks in a node): worked out once per (op, bytes, placement), not per group.
        if op == "send_recv":  # its two ends, not the group, decide it
            t = self._cost(op, nbytes, ranks)
        else:
            p = self.placement(ranks)
            shared = (op, nbytes, p.n, p.nodes, p.local, p.same_rail)
            t = self._cost_cache.get(shared)
            if t is None:
                t = self._cost_cache[shared] = self._cost(op, nbytes, ranks)
        self._cost_cache[key] = (t, ranks)
        return t

    def _cost(self, op: str, nbytes: float, ranks: tuple[int, ...]) -> float:
        if op == "send_recv":
            return self.send_recv(nbytes, ranks[0], ranks[-1])
        if op not in OPS:
            raise ValueError(f"collective op must be one of {', '.join(OPS)}; got {op!r}")
        return getattr(self, op)(nbytes, ranks)[0]

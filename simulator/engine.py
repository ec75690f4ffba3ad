"""The simpy engine: executes one Plan with costs, one process per *distinct* rank.

Collapsing. Ranks are grouped into classes by colour refinement: a rank's first colour is its action
list with the cost-relevant data of each action (sequence lengths, not sample ids); then, until
stable, a rank's colour also takes the colours of its send/recv peers, its boundary peers and the
groups it synchronises with (gradient groups, and omni's loader groups for the metadata all-gathers:
left out, two ranks of different loader groups could share a class whose lock then waits forever). TP peers and replicas that got identically-shaped data end in one
class and are simulated once; DP replicas that got different data stay distinct. Classes are
exact under a symmetric cluster placement: a class is simulated with its lowest rank's placement.

Streams. Each simulated rank has a compute stream (its process: forward/backward run in order),
a collective stream (grad_sync: FSDP reduce-scatter / all-reduce, overlapping later compute) and
a p2p stream (pipeline sends and boundary exchanges, overlapping compute). A compute action
expands its module's intra-module communication from the layout: TP all-reduces, CP/SP and EP
all-to-alls are on the critical path; FSDP all-gathers are prefetched one layer ahead, so only the
part a layer's compute does not hide is exposed. FSDP and EP also lock data-parallel peers together
layer by layer: such an action starts when all (distinct) peers have arrived and lasts as long as
the slowest peer's. A collective completes when all its distinct participants have arrived;
a recv completes when the matching send's transfer has (the send starts once the recv is posted).
Without overlap (`CollectiveModel.inline_overlap` False: a CPU rank is one thread) every FSDP
gather and every gradient reduction blocks the rank in line, one call per layer plus the root.

HSDP (`Layout.dp_shard`): gathers, reduce-scatters and the layer-by-layer lock run over the shard
group only; grad_sync adds one all-reduce of the gradient shard across the replicate group.

Memory per rank: bf16 + fp32 master params, fp32 grads and AdamW moments (sharded over the FSDP
group, or its shard group under HSDP), one layer of gathered bf16 params, and the activations of
the microbatches in flight (counted from the action order, so 1F1B's in-flight depth and dynamic
sequence lengths both show).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import simpy

from omnibench.plan import (
    BACKWARD,
    BOUNDARY,
    FORWARD,
    GRAD_SYNC,
    METADATA,
    OPTIMIZER_STEP,
    RECV,
    SEND,
    Action,
    Layout,
    Plan,
    loader_group,
)
from omnibench.specs import costs
from omnibench.specs.model import MultimodalSpec
from simulator.collectives import CollectiveModel
from simulator.compute import ComputeModel
from simulator.flops import (
    Work,
    audio_work,
    input_elements,
    llm_work,
    model_train_flops,
    stage_layers,
    vision_work,
)
from simulator.hardware import ClusterSpec, GiB

RESERVED_BYTES = 1.0 * GiB  # CUDA context, NCCL buffers, allocator slack


class SimulationError(ValueError):
    """The plan cannot be simulated (deadlock, missing data); the message says where."""


@dataclass(frozen=True)
class SimOptions:
    recompute: str = "none"  # "none" | "full" | "selective"; default: plan.options["recompute"]
    grad_reduce_bytes: int = 4  # FSDP2 reduce_dtype fp32
    communication: bool = True  # False: free communication (the compute-bound schedule)
    check_memory: bool = True
    # the software running the blocks (simulator/kernels.py::Stack): "eager" is this project's runtime
    # (its modules op by op under autocast, the chunked loss); "fused" is Megatron-LM's fused kernels
    stack: str = "eager"
    # encoder microbatches in chunks of at most this many encoder tokens (patches, audio positions),
    # each recomputed in the backward, as omnibench/runtime/encoder_chunks.py runs them; 0: not chunked
    encoder_chunk_tokens: int = 0


@dataclass
class Span:
    rank: int  # representative rank of the class
    stream: str  # "compute" | "collective" | "p2p"
    action: Action
    kind: str
    start: float
    duration: float

    @property
    def name(self) -> str:
        return str(self.action)

    @property
    def module(self) -> str:
        return self.action.module

    @property
    def microbatch(self) -> int:
        return self.action.microbatch


@dataclass
class RankStats:
    rank: int
    members: int  # ranks this class stands for
    finish: float = 0.0
    compute: float = 0.0  # own compute time (sum of its actions' costs)
    exposed_comm: float = 0.0  # compute stream blocked on communication
    optimizer: float = 0.0
    comm_busy: float = 0.0  # time the collective and p2p streams were busy
    memory_bytes: float = 0.0
    memory_static: float = 0.0


@dataclass
class SimResult:
    system: str
    world_size: int
    step_time: float
    tokens: int
    samples: int
    model_flops: float  # useful FLOPs of the step (fwd + bwd, no recomputation), stated below
    peak_flops: float  # per GPU
    memory_capacity: float
    ranks: list[RankStats]
    spans: list[Span]
    classes: int
    sim_seconds: float
    fits: bool = True
    fit_message: str = ""
    flop_formula: str = ("costs.batch_flops: exact forward + backward matmul FLOPs of every module, attention "
                          "over the real packed lengths, no recomputation")
    # The same counter with the run's recomputation added (what the GPU executes): the numerator
    # of hardware TFLOP/s (Megatron's "teraFLOP/s per GPU", Korthikanti et al.'s HFU).
    hardware_flops: float = 0.0
    recompute: str = "none"
    compute_model: str = ""  # which compute model answered (kernel profile, calibrated, or datasheet fallback)
    hardware_flop_formula: str = ("costs.batch_flops(recompute=<policy>).total: model FLOPs plus the "
                                  "recomputed forward")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time > 0 else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.world_size / 1e12 if self.step_time > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU counting the recomputed forward (equals tflops_per_gpu without recompute)."""
        flops = self.hardware_flops or self.model_flops
        return flops / self.step_time / self.world_size / 1e12 if self.step_time > 0 else 0.0

    @property
    def hfu(self) -> float:
        return self.hardware_tflops_per_gpu * 1e12 / self.peak_flops

    def _mean(self, f) -> float:
        n = sum(r.members for r in self.ranks)
        return sum(f(r) * r.members for r in self.ranks) / n if n else 0.0

    @property
    def bubble(self) -> float:
        """Mean fraction of the step a rank's compute stream is idle (not computing, not blocked on comm)."""
        if self.step_time <= 0:
            return 0.0
        return self._mean(lambda r: max(0.0, 1 - (r.compute + r.exposed_comm + r.optimizer) / self.step_time))

    @property
    def exposed_comm(self) -> float:
        return self._mean(lambda r: r.exposed_comm / self.step_time) if self.step_time > 0 else 0.0

    def compute_by_module(self) -> dict[str, float]:
        """Mean seconds per rank each module's forward/backward occupied the compute stream."""
        n = sum(r.members for r in self.ranks) or 1
        weight = {r.rank: r.members for r in self.ranks}
        out: dict[str, float] = defaultdict(float)
        for sp in self.spans:
            if sp.stream == "compute" and sp.kind in (FORWARD, BACKWARD):
                out[sp.module] += sp.duration * weight[sp.rank] / n
        return dict(out)

    @property
    def peak_memory(self) -> float:
        return max((r.memory_bytes for r in self.ranks), default=0.0)

    def metrics(self) -> dict:
        return {
            "system": self.system,
            "world_size": self.world_size,
            "fits": self.fits,
            "fit_message": self.fit_message,
            "step_time_s": self.step_time,
            "tokens": self.tokens,
            "samples": self.samples,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "flop_formula": self.flop_formula,
            "recompute": self.recompute,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "hfu": self.hfu,
            "hardware_flop_formula": self.hardware_flop_formula,
            "compute_model": self.compute_model,
            "bubble": self.bubble,
            "exposed_comm": self.exposed_comm,
            "peak_memory_gib": self.peak_memory / GiB,
            "memory_capacity_gib": self.memory_capacity / GiB,
            "compute_s_by_module": self.compute_by_module(),
            "distinct_ranks": self.classes,
            "sim_seconds": self.sim_seconds,
        }


# -- layout helpers ----------------------------------------------------------------------------------
class _LayoutIndex:
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


# -- ops: what a simulated rank executes ------------------------------------------------------------
@dataclass
class _Op:
    action: Action
    kind: str
    duration: float = 0.0  # own compute (compute ops) or transfer time (comm ops)
    exposed: float = 0.0  # inline communication on the compute stream
    comm: float = 0.0  # inline communication total (for comm-stream busy time)
    lock_key: tuple | None = None  # lock-step / collective rendezvous key
    lock_n: int = 1  # distinct participants
    p2p_keys: list = field(default_factory=list)  # (key, bytes-time) sends, or keys awaited for recv
    act_delta: float = 0.0  # activation bytes added (+) or freed (-)
    grad_delta: float = 0.0  # gradient bytes that appear with this backward (a module's first on the rank)
    act_transient: float = 0.0  # bytes a backward holds only while it runs (a recomputed layer)
    blocking: bool = False  # a collective the rank waits for before its next action (no overlap)
    calls: int = 0  # collective calls a compute action issues in line


class Engine:
    def __init__(self, plan: Plan, model: MultimodalSpec, cluster: ClusterSpec,
                 compute: ComputeModel | None = None, collectives: CollectiveModel | None = None,
                 options: SimOptions = SimOptions()):
        if cluster.num_gpus and plan.world_size > cluster.num_gpus:
            raise SimulationError(f"plan needs {plan.world_size} ranks; cluster has {cluster.num_gpus} GPUs")
        self.plan, self.model, self.cluster = plan, model, cluster
        self.compute = compute or ComputeModel(cluster)
        self.coll = collectives or CollectiveModel(cluster)
        self.coll_inline = self.coll.inline_model()  # FSDP/TP/CP/EP communication inside compute
        recompute = options.recompute if options.recompute != "none" else plan.options.get("recompute", "none")
        try:
            self.policy = costs.recompute_policy(recompute)  # per module
        except ValueError as e:
            raise SimulationError(str(e)) from None
        self.recompute = recompute
        from simulator.kernels import STACK_KINDS

        if options.stack not in STACK_KINDS:
            raise SimulationError(f"stack must be one of {', '.join(STACK_KINDS)}; got {options.stack!r}")
        self.options = options
        self.index = {m: _LayoutIndex(lay) for m, lay in plan.layouts.items()}
        self._work_cache: dict = {}
        self._gathered: set = set()
        self._member_cache: dict = {}
        self._loader_groups: dict[tuple, tuple[int, ...]] = {}
        self._edp_cache: dict = {}
        self._sp_group_of: dict[str, dict[int, tuple[int, ...]]] = {}
        self._member_ids: dict = {}
        self._sig_cache: dict = {}
        self._data_rank_cache: dict = {}
        self.message_tokens: dict[tuple, int] = defaultdict(int)
        for r in plan.routes:
            self.message_tokens[(r.module, r.src_rank, r.src_microbatch, r.dst_rank, r.dst_microbatch)] += r.tokens

    # -- data ----------------------------------------------------------------------------------
    def _data_rank(self, module: str, rank: int) -> int:
        """The rank whose assignment feeds `rank` (planners may list only one rank per data group)."""
        key = (module, rank)
        got = self._data_rank_cache.get(key)
        if got is not None:
            return got
        per = self.plan.assignment.get(module, {})
        found = rank
        if rank not in per and module in self.index:
            idx = self.index[module]
            c = idx.coords.get(rank)
            if c is not None:
                for r in idx.group(rank, tuple(d for d in idx.layout.mesh_dims if d != "dp")):
                    if r in per:
                        found = r
                        break
        self._data_rank_cache[key] = found
        return found

    def _microbatch(self, module: str, rank: int, mb: int) -> tuple[int, ...]:
        mbs = self.plan.assignment.get(module, {}).get(self._data_rank(module, rank), [])
        if mb >= len(mbs):
            raise SimulationError(f"rank {rank}: {module} microbatch {mb} has no assignment in the plan")
        return mbs[mb]

    def _signature(self, module: str, rank: int, mb: int) -> tuple:
        key = (module, self._data_rank(module, rank), mb)
        got = self._sig_cache.get(key)
        if got is None:
            ids = self._microbatch(module, rank, mb)
            sample = self.plan.sample
            if module == "llm":
                got = tuple(sample(i).llm_tokens for i in ids)
            elif module == "vision":
                got = tuple(s.grid_thw for i in ids for s in sample(i).segments if s.encoder == "vision")
            else:
                got = tuple(s.mel_frames for i in ids for s in sample(i).segments if s.encoder == "audio")
            self._sig_cache[key] = got
        return got

    def input_elements(self, module: str, rank: int, a: Action) -> float:
        """Raw input elements a forward prepares: encoders and the LLM's first stage take raw
        samples (the runtime draws all of each sample's inputs there); 0 for other actions."""
        if a.kind != FORWARD or (module == "llm" and a.stage != 0):
            return 0.0
        key = ("inputs", module, self._data_rank(module, rank), a.microbatch)
        got = self._sig_cache.get(key)
        if got is None:
            ids = self._microbatch(module, rank, a.microbatch)
            got = self._sig_cache[key] = float(sum(input_elements(self.plan.sample(i), self.model) for i in ids))
        return got

    def _stage(self, module: str, rank: int, action: Action) -> int:
        if module == "llm":
            return self.index["llm"].coords[rank]["pp"] if action.kind == GRAD_SYNC else action.stage
        return 0

    def work(self, module: str, stage: int, sig: tuple, sp: int = 0) -> Work:
        key = (module, stage, sig, sp)
        got = self._work_cache.get(key)
        if got is None:
            lay = self.plan.layouts[module]
            if sp:  # omni's long input: one encoder microbatch split over a sequence-parallel group
                from dataclasses import replace as _replace

                lay = _replace(lay, sp=sp)
            if module == "llm":
                llm = self.model.llm
                layers = stage_layers(llm.layers, lay.stages, stage)
                # sp: omni's long LLM sample over a context-parallel group (systems/omni/llm_long_short.py)
                got = llm_work(llm, list(sig), layers, stage == 0, stage == lay.stages - 1, lay.tp, lay.cp * lay.sp,
                               lay.ep, self.policy["llm"], lay.cp_kind)
            elif module in ("vision", "audio"):
                # omni's long inputs (sp) are split by their group, not chunked (as the runtime does)
                chunk = self.options.encoder_chunk_tokens if not sp and lay.sp == 1 else 0
                make = vision_work if module == "vision" else audio_work
                got = make(getattr(self.model, module), list(sig), lay.tp, lay.sp, self.policy[module], chunk)
            else:
                raise SimulationError(f"module must be llm, vision or audio; got {module!r}")
            if got.shape is not None and self.options.stack == "eager":
                from dataclasses import replace as _replace

                got = _replace(got, shape=_replace(got.shape, stack=self._eager_stack(module, lay)))
            self._work_cache[key] = got
        return got

    def _eager_stack(self, module: str, lay):
        """How this project's runtime runs a module (omnibench/runtime/executor.py): FSDP holds it when
        its data-parallel group has more than one rank, with bf16 parameters (MixedPrecisionPolicy);
        otherwise its weights stay fp32 under autocast, and the LLM's fp32 token embedding makes the
        residual stream fp32. Encoders start from an autocast linear / conv, so theirs is bf16."""
        from simulator.kernels import Stack

        fsdp = lay.fsdp and lay.fsdp_size > 1  # the LLM's dp x cp, an encoder's dp x sp
        chunk = costs.loss_chunk_tokens(-(-self.model.llm.vocab // lay.tp)) if module == "llm" else 0
        return Stack(kind="eager", residual_bytes=4 if module == "llm" and not fsdp else 2,
                     weight_cast=not fsdp, loss="chunked", loss_chunk_tokens=chunk)

    def stage_work(self, module: str, stage: int) -> Work:
        """Parameters of what pipeline rank `stage` holds (no data): the work of an empty microbatch;
        under interleaved 1F1B the sum over the rank's model chunks (virtual stages stage + c * pp)."""
        lay = self.plan.layouts[module]
        if module != "llm" or lay.vpp == 1:
            return self.work(module, stage, ())
        key = ("rank-stages", stage)
        got = self._work_cache.get(key)
        if got is None:
            parts = [self.work(module, stage + c * lay.pp, ()) for c in range(lay.vpp)]
            got = Work(params=sum(w.params for w in parts), expert_params=sum(w.expert_params for w in parts),
                       layers=sum(w.layers for w in parts))
            self._work_cache[key] = got
        return got

    # -- colour refinement ---------------------------------------------------------------------
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

    # -- program of one simulated rank ---------------------------------------------------------
    def _compute_op(self, rank: int, a: Action, cls: dict[int, int]) -> _Op:
        module = a.module
        lay = self.plan.layouts[module]
        idx = self.index[module]
        long_group = self._long_group(module, rank, a.microbatch)
        work = self.work(module, a.stage if module == "llm" else 0, self._signature(module, rank, a.microbatch),
                         len(long_group))
        recompute = self.policy[module] if a.kind == BACKWARD else "none"
        inputs = self.input_elements(module, rank, a)
        # chunked encoders: each chunk runs its forward again inside the backward action
        again = self.compute.action_time(work, FORWARD, "none", module) if work.chunks and a.kind == BACKWARD else 0.0
        own = self.compute.action_time(work, a.kind, recompute, module, inputs) + again
        op = _Op(a, a.kind, duration=own)
        if self.options.communication:
            comm = exposed = 0.0
            n_calls = 0  # collective calls issued in line (their CPU side is compute: see below)
            calls = 2 * work.layers
            tp_group = idx.group(rank, ("tp",))
            if work.tp_bytes and len(tp_group) > 1:
                t = calls * self.coll_inline.cost("all_reduce", work.tp_bytes / calls, tp_group)
                comm += t
                exposed += t
                n_calls += calls
            seq_dim = ("cp",) if module == "llm" else ("sp",)
            seq_group = long_group or idx.group(rank, seq_dim)
            ring = module == "llm" and lay.cp_kind == "ring" and not long_group
            if work.seq_bytes and len(seq_group) > 1 and ring:
                # Ring attention: cp - 1 K/V hand-offs per layer to the next cp rank (backward: K/V again
                # and their gradients back, twice the bytes), each hidden behind one block's attention.
                steps = len(seq_group) - 1
                nbytes = work.seq_bytes / work.layers / steps * (2 if a.kind == BACKWARD else 1)
                i = seq_group.index(rank)
                t_step = self.coll_inline.send_recv(nbytes, rank, seq_group[(i + 1) % len(seq_group)])
                prof = self.compute.kernels
                hide = 0.0
                if prof is not None and work.shape is not None:
                    from simulator.kernels import ring_step_attention

                    hide = ring_step_attention(prof, work.shape, a.kind == BACKWARD)
                comm += work.layers * steps * t_step
                exposed += work.layers * steps * max(0.0, t_step - hide)
                n_calls += work.layers * steps
            elif work.seq_bytes and len(seq_group) > 1:
                t = work.layers * self.coll_inline.cost("all_to_all", work.seq_bytes / work.layers, seq_group)
                comm += t
                exposed += t
                n_calls += work.layers
            shard = self._grad_group(module, rank)
            if work.ep_bytes and lay.ep > 1:
                i = shard.index(rank)
                ep_group = shard[i - i % lay.ep: i - i % lay.ep + lay.ep]
                t = calls * self.coll_inline.cost("all_to_all", work.ep_bytes / calls, ep_group)
                comm += t
                exposed += t
                n_calls += calls
            if (not self.coll.inline_overlap and a.kind == BACKWARD and lay.fsdp and len(shard) > 1
                    and a.microbatch == self._last_backward(rank, module)):
                n_calls += max(1, work.layers) + 1  # the reduce-scatters (the grad_sync op holds their wait)
                if lay.hsdp:
                    n_calls += max(1, work.layers) + 1  # HSDP: each followed by the replicas' all-reduce
            # HSDP gathers inside the shard group only (the FSDP group itself without HSDP).
            shard = self._shard_group(module, rank) if lay.hsdp else shard
            if lay.fsdp and len(shard) > 1 and self._gathers(rank, module, a):
                # bf16 all-gather of each layer's shard. With overlap (GPU) it is prefetched one
                # layer ahead: the first is exposed, later ones only where a layer's compute is
                # shorter than its gather. Without (one CPU thread per rank) FSDP2's gathers of
                # every layer and then the root each block the rank: the same bytes in n + 1 calls.
                # Experts are split over ep first; FSDP shards them over the rest (dp*cp/ep).
                dense = (work.params - work.expert_params) / lay.tp
                n = max(1, work.layers)
                calls = n if self.coll.inline_overlap else n + 1
                g = self.coll_inline.cost("all_gather", 2 * dense / calls, shard)
                if work.expert_params:
                    edp = self._expert_group(rank, shard, lay.ep)
                    g += self.coll_inline.cost("all_gather", 2 * work.expert_params / lay.tp / lay.ep / calls, edp)
                # chunked encoders gather per chunk, and in the backward again for each chunk's recompute
                reps = (work.chunks if a.kind == FORWARD else 2 * work.chunks) or 1
                comm += reps * calls * g
                n_calls += reps * calls
                if self.coll.inline_overlap:
                    exposed += reps * g + (reps * n - reps) * max(0.0, g - own / (reps * n))
                else:
                    exposed += reps * calls * g
            op.comm, op.exposed, op.calls = comm, exposed, n_calls
            if n_calls:
                # The rank's own work around each call (hooks, copies) runs on its compute stream.
                op.duration = self.compute.action_time(work, a.kind, recompute, module, inputs, n_calls) + again
        lock = self._lock_group(module, rank)
        if lock is not None and self.compute.lock_skew:
            op.duration *= 1.0 + self.compute.lock_skew
        if lock is not None:
            gid, n = self._members(lock, cls)
            if n > 1:
                op.lock_key = ("lock", a.kind, module, a.stage, gid)
                op.lock_n = n
        copies = self._weight_copies(module, rank, a.stage)
        # chunked encoders keep no autocast weight casts from forward to backward; a chunk's
        # recomputed forward casts them again while its backward runs
        live = self._live_activation(work) + (0.0 if work.chunks else copies)
        op.act_delta = live if a.kind == FORWARD else -live
        op.act_transient = work.act_transient + (copies if work.chunks else 0.0) if a.kind == BACKWARD else 0.0
        return op

    def _weight_copies(self, module: str, rank: int, stage: int) -> float:
        """bf16 weight copies one forward keeps for its backward where FSDP holds no bf16 parameters
        (one rank or --no-fsdp: autocast casts the fp32 weights per forward and autograd saves the
        casts); under full recomputation blocks save only their input, the casts are made again."""
        lay = self.plan.layouts[module]
        if (lay.fsdp and len(self._shard_group(module, rank)) > 1) or self.policy[module] == "full":
            return 0.0
        return 2 * self._module_params_on_rank(module, rank)

    def _last_backward(self, rank: int, module: str) -> int:
        key = ("last_bwd", rank, module)
        got = self._sig_cache.get(key)
        if got is None:
            mbs = [a.microbatch for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD and a.module == module]
            got = self._sig_cache[key] = max(mbs) if mbs else -1
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

    @property
    def reshard_after_forward(self) -> bool:
        """Under pipelining, FSDP keeps parameters gathered between microbatches (torchtitan sets
        reshard_after_forward=False with pp > 1); a plan may say otherwise in its options."""
        default = self.plan.layouts["llm"].pp == 1 if "llm" in self.plan.layouts else True
        return bool(self.plan.options.get("reshard_after_forward", default))

    def _gathers(self, rank: int, module: str, a: Action) -> bool:
        """Whether this compute action all-gathers its FSDP parameters: every action when FSDP
        reshards after forward, else only the first forward and the first backward of a stage."""
        if self.reshard_after_forward:
            return True
        key = (rank, module, a.stage, a.kind)
        if key in self._gathered:
            return False
        self._gathered.add(key)
        return True

    def _live_activation(self, work: Work) -> float:
        """costs.py counts activations for a flash-style core under the recompute policy; a kernel
        profile with unfused attention also keeps each layer's s x s scores for the backward
        (softmax output and dropout output in bf16, dropout mask in bytes: 5 bytes per score,
        Korthikanti et al. 2022 eq. 1's 5as^2b term) unless recomputation drops them. Less the
        recomputed layer that exists only during the backward (`_Op.act_transient`)."""
        out = work.act_bytes - work.act_transient
        prof = self.compute.kernels
        if (prof is not None and prof.attention_kernel == "unfused" and work.shape is not None
                and self.policy["llm"] == "none"):
            out += 5.0 * work.shape.layers * work.shape.heads * sum(x * x for x in work.shape.seq_lens)
        return out

    def _p2p_bytes(self, module: str, rank: int, mb: int) -> float:
        key = ("p2p", module, self._data_rank(module, rank), mb)
        got = self._sig_cache.get(key)
        if got is None:
            got = self._sig_cache[key] = self._p2p_bytes_of(module, rank, mb)
        return got

    def _p2p_bytes_of(self, module: str, rank: int, mb: int) -> float:
        sig = self._signature(module, rank, mb)
        lay = self.plan.layouts[module]
        if module == "llm":
            return sum(sig) / lay.cp * self.model.llm.hidden * 2
        enc = self.model.encoders[module]
        w = self.work(module, 0, sig)
        return w.tokens * enc.hidden * 2

    def program(self, rank: int, cls: dict[int, int]) -> list[_Op]:
        ops: list[_Op] = []
        seen: dict[tuple, int] = defaultdict(int)
        comm_on = self.options.communication
        hidden = self.model.llm.hidden
        for a in self.plan.actions[rank]:
            if a.kind in (FORWARD, BACKWARD):
                op = self._compute_op(rank, a, cls)
                if op.lock_key is not None:
                    n = seen[op.lock_key]
                    seen[op.lock_key] += 1
                    op.lock_key = (*op.lock_key, n)
                ops.append(op)
            elif a.kind in (SEND, RECV):
                src, dst = (rank, a.peer) if a.kind == SEND else (a.peer, rank)
                # the sending stage names the message (a rank pair carries several under interleaving)
                sender = a.stage if a.kind == SEND else a.stage - 1 if a.what == "act" else a.stage + 1
                base = ("p2p", a.module, a.what, a.microbatch, sender, cls.get(src, src), cls.get(dst, dst))
                n = seen[base]
                seen[base] += 1
                cost = self.coll.send_recv(self._p2p_bytes(a.module, rank, a.microbatch), src, dst) if comm_on else 0.0
                ops.append(_Op(a, a.kind, duration=cost, p2p_keys=[(*base, n)]))
            elif a.kind == BOUNDARY:
                key = self._boundary_key(rank, a, cls)
                if a.direction == "send":
                    nbytes = self._boundary_tokens(rank, a) * hidden * 2
                    cost = self.coll.send_recv(nbytes, rank, a.peer) if comm_on else 0.0
                    ops.append(_Op(a, "boundary_send", duration=cost, p2p_keys=[key]))
                else:
                    ops.append(_Op(a, "boundary_recv", p2p_keys=[key]))
            elif a.kind == GRAD_SYNC:
                module = a.module
                group = self._grad_group(module, rank)
                stage = self._stage(module, rank, a)
                cost = self.grad_sync_cost(module, rank, stage) if comm_on else 0.0
                gid, n_members = self._members(group, cls)
                key = ("coll", module, stage, gid)
                n = seen[key]
                seen[key] += 1
                ops.append(_Op(a, a.kind, duration=cost, lock_key=(*key, n), lock_n=n_members,
                               blocking=not self.coll.inline_overlap))
            elif a.kind == METADATA:
                # The loaders' all-gather (padded to the largest contribution, which the planner put
                # on every member). Loaders prefetch: the next step's exchange runs on the loader's
                # own thread while this step computes, so it holds the collective stream, not compute.
                group = self._loader_group(rank, a.what)
                cost = self.coll.cost("all_gather", a.nbytes * len(group), group) if comm_on else 0.0
                gid, n_members = self._members(group, cls)
                key = ("meta", a.what, gid)
                n = seen[key]
                seen[key] += 1
                ops.append(_Op(a, a.kind, duration=cost, lock_key=(*key, n), lock_n=n_members))
            elif a.kind == OPTIMIZER_STEP:
                ops.append(_Op(a, a.kind, duration=self.compute.optimizer_time(self._params_on_rank(rank),
                                                                               *self.layers_on_rank(rank))))
        # fp32 gradients of a module's parameter shard exist from its first backward to the step's end
        graded: set[str] = set()
        for op in ops:
            if op.kind == BACKWARD and op.action.module not in graded:
                graded.add(op.action.module)
                op.grad_delta = 4 * self._module_params_on_rank(op.action.module, rank)
        return ops

    def grad_sync_cost(self, module: str, rank: int, stage: int) -> float:
        """Seconds of a module's data-parallel gradient reduction on `rank` (0 without peers).

        GPU: one reduce-scatter (FSDP) or all-reduce of the stage's gradients. Without overlap
        (`inline_overlap` False, a CPU rank) FSDP2's reduce-scatters go one per layer plus the root,
        in line; a plain all-reduce stays one flat (bucketed) call, as the runtime issues it."""
        lay = self.plan.layouts[module]
        group = self._grad_group(module, rank)
        if len(group) < 2:
            return 0.0
        w = self.stage_work(module, stage)
        nbytes = self.options.grad_reduce_bytes * w.params / lay.tp
        calls = 1 if self.coll.inline_overlap or not lay.fsdp else max(1, w.layers) + 1
        op_name = "reduce_scatter" if lay.fsdp else "all_reduce"
        # FSDP2 reduce-scatters from inside the backward (per layer): communication inside compute
        coll = self.coll_inline if lay.fsdp else self.coll
        dense = nbytes * (1 - w.expert_params / w.params) if w.params else nbytes
        if lay.hsdp:
            return self._hsdp_grad_sync_cost(module, rank, w, nbytes, dense, calls)
        cost = calls * coll.cost(op_name, dense / calls, group)
        if w.expert_params and lay.ep > 1:
            # Experts are split over ep; their grads reduce over the remaining replicas.
            cost += calls * coll.cost(op_name, (nbytes - dense) / lay.ep / calls,
                                      self._expert_group(rank, group, lay.ep))
        elif w.expert_params:
            cost += calls * coll.cost(op_name, (nbytes - dense) / calls, group)
        return cost

    def _hsdp_grad_sync_cost(self, module: str, rank: int, w: Work, nbytes: float, dense: float,
                             calls: int) -> float:
        """HSDP: reduce-scatter inside the shard group, then one all-reduce of the resulting shard
        over the replicate group (FSDP2 issues both per layer from the backward)."""
        lay = self.plan.layouts[module]
        coll = self.coll_inline
        shard, rep = self._shard_group(module, rank), self._replicate_group(module, rank)
        cost = calls * (coll.cost("reduce_scatter", dense / calls, shard)
                        + coll.cost("all_reduce", dense / len(shard) / calls, rep))
        experts = nbytes - dense
        if w.expert_params:
            # Experts split over ep first, then sharded over the shard group's ranks holding them.
            eshard = self._expert_group(rank, shard, lay.ep) if lay.ep > 1 else shard
            per = experts / max(1, lay.ep)
            cost += calls * (coll.cost("reduce_scatter", per / calls, eshard)
                             + coll.cost("all_reduce", per / len(eshard) / calls, rep))
        return cost

    def layers_on_rank(self, rank: int) -> tuple[float, float]:
        """(FSDP-sharded, unsharded) layers of the modules this rank trains in the step (runs a
        backward of), each module's root (embeddings, head, patch/conv stems) counted as one more:
        what an optimizer step walks (AdamW skips parameters that got no gradient)."""
        sharded = plain = 0.0
        trained = {a.module for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD}
        for m, lay in self.plan.layouts.items():
            idx = self.index[m]
            if rank not in idx.coords or m not in trained:
                continue
            w = self.stage_work(m, idx.coords[rank].get("pp", 0))
            if lay.fsdp and len(self._grad_group(m, rank)) > 1:
                sharded += w.layers + 1
            else:
                plain += w.layers + 1
        return sharded, plain

    def _params_on_rank(self, rank: int) -> float:
        return sum(self._module_params_on_rank(m, rank) for m in self.plan.layouts)

    def _module_params_on_rank(self, m: str, rank: int) -> float:
        lay, idx = self.plan.layouts[m], self.index[m]
        if rank not in idx.coords:
            return 0.0
        w = self.stage_work(m, idx.coords[rank].get("pp", 0))
        shard = len(self._shard_group(m, rank)) if lay.fsdp else 1  # HSDP: the shard group only
        dense = w.params - w.expert_params
        return dense / lay.tp / shard + w.expert_params / lay.tp / max(1, lay.ep) / max(1, shard // lay.ep)

    def _static_memory(self, rank: int) -> float:
        """What a rank holds all step: its parameter shard's fp32 master weights and AdamW state
        (costs.training_state_bytes less the gradients, which the timeline adds at each module's
        first backward, and less the bf16 working weights, which are FSDP's gathered layers here or
        the per-forward copies the timeline adds) plus the gathered bf16 parameters: the current and
        the prefetched layer when FSDP reshards after forward, the whole stage when it keeps them.
        AdamW creates state only for parameters that get a gradient: a module the step never runs
        backward for on this rank (no audio in the batch) holds its weights alone."""
        trained = {a.module for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD}
        mem = RESERVED_BYTES
        for m in self.plan.layouts:
            state = costs.training_state_bytes(self._module_params_on_rank(m, rank), "fp32")
            mem += state.params + (state.optimizer if m in trained else 0.0)
        for m, lay in self.plan.layouts.items():
            idx = self.index[m]
            if rank in idx.coords and lay.fsdp and len(self._shard_group(m, rank)) > 1:
                w = self.stage_work(m, idx.coords[rank].get("pp", 0))
                layers = min(2, max(1, w.layers)) if self.reshard_after_forward else max(1, w.layers)
                mem += 2 * w.params / lay.tp * layers / max(1, w.layers)
        return mem

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        # Hundreds of thousands of small objects (events, spans) and no reference cycles worth
        # collecting: the cyclic GC would rescan them again and again (measured: 2x the run time).
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SimResult:
        t0 = time.perf_counter()
        plan = self.plan
        cls = self.classes()
        reps = sorted(set(cls.values()))
        members: dict[int, int] = defaultdict(int)
        for c in cls.values():
            members[c] += 1
        programs = {r: self.program(r, cls) for r in reps}

        env = simpy.Environment()
        spans: list[Span] = []
        stats = {r: RankStats(rank=r, members=members[r]) for r in reps}
        rendezvous: dict[tuple, list] = {}  # key -> [arrived, max contribution, event]
        channels: dict[tuple, list] = {}  # key -> [recv posted event, done event]
        # The collective and p2p streams of a rank are FIFO queues; each is kept as the time it is
        # next free (a simpy Resource per rank per stream costs more than the whole step at scale).
        free = {(r, stream): 0.0 for r in reps for stream in ("collective", "p2p")}

        def arrive(key, n, contribution):
            rv = rendezvous.get(key)
            if rv is None:
                rv = rendezvous[key] = [0, 0.0, env.event()]
            rv[0] += 1
            if contribution > rv[1]:
                rv[1] = contribution
            if rv[0] == n:
                rv[2].succeed(rv[1])
            return rv[2]

        def channel(key):
            ch = channels.get(key)
            if ch is None:
                ch = channels[key] = [env.event(), env.event()]
            return ch

        def transfer(rank, op, stream, kind, done):
            """Queue `op` on a stream now; returns the event of its end and triggers `done` then."""
            start = max(env.now, free[(rank, stream)])
            end = start + op.duration
            free[(rank, stream)] = end
            stats[rank].comm_busy += op.duration
            a = op.action
            spans.append(Span(rank, stream, a, kind, start, op.duration))
            ev = env.timeout(end - env.now)
            if done is not None:
                ev.callbacks.append(lambda _e, d=done: d.triggered or d.succeed())
            return ev

        def send(rank, op, pending):
            posted, done = channel(op.p2p_keys[0])
            # NCCL p2p: the transfer starts once the receiver has posted its recv.
            if posted.triggered:
                pending.append(transfer(rank, op, "p2p", SEND, done))
                return
            holder = env.event()
            pending.append(holder)

            def go(_e):
                transfer(rank, op, "p2p", SEND, done).callbacks.append(lambda _x: holder.succeed())

            posted.callbacks.append(go)

        queues = {r: deque() for r in reps}  # collectives issued but not started, per rank
        busy = dict.fromkeys(reps, False)

        def collective(rank, op, pending):
            holder = env.event()
            pending.append(holder)
            queues[rank].append((op, holder))
            if not busy[rank]:
                next_collective(rank)

        def next_collective(rank):
            q = queues[rank]
            if not q:
                busy[rank] = False
                return
            busy[rank] = True
            op, holder = q.popleft()
            ready = arrive(op.lock_key, op.lock_n, 0.0)

            def run_it(_e=None):
                ev = transfer(rank, op, "collective", op.kind, holder)
                ev.callbacks.append(lambda _x: next_collective(rank))

            if ready.triggered:
                run_it()
            else:
                ready.callbacks.append(run_it)

        def rank_proc(rank, ops):
            st = stats[rank]
            pending: list = []
            live = peak_live = 0.0
            for op in ops:
                kind = op.kind
                if kind == FORWARD or kind == BACKWARD:
                    dur = op.duration
                    if op.lock_key is not None:
                        ev = arrive(op.lock_key, op.lock_n, op.duration)
                        dur = ev.value if ev.triggered else (yield ev)
                    start = env.now
                    total = dur + op.exposed
                    yield env.timeout(total)
                    st.compute += op.duration
                    st.exposed_comm += op.exposed
                    st.comm_busy += op.comm
                    a = op.action
                    spans.append(Span(rank, "compute", a, kind, start, total))
                    # a backward's gradients appear while its activations (and a recomputed layer)
                    # are still held
                    live += op.grad_delta
                    if live + op.act_transient > peak_live:
                        peak_live = live + op.act_transient
                    live += op.act_delta
                    if live > peak_live:
                        peak_live = live
                elif kind == SEND:
                    send(rank, op, pending)
                elif kind == RECV:
                    posted, done = channel(op.p2p_keys[0])
                    if not posted.triggered:
                        posted.succeed()
                    if not done.triggered:
                        yield done
                elif kind == "boundary_send":
                    _, done = channel(op.p2p_keys[0])
                    pending.append(transfer(rank, op, "p2p", BOUNDARY, done))
                elif kind == "boundary_recv":
                    done = channel(op.p2p_keys[0])[1]
                    if not done.triggered:
                        yield done
                elif kind == GRAD_SYNC or kind == METADATA:
                    collective(rank, op, pending)
                    if op.blocking:
                        wait_start = env.now
                        yield pending.pop()
                        st.exposed_comm += env.now - wait_start
                elif kind == OPTIMIZER_STEP:
                    wait_start = env.now
                    if pending:
                        yield simpy.AllOf(env, pending)
                    pending = []
                    st.exposed_comm += env.now - wait_start
                    start = env.now
                    yield env.timeout(op.duration)
                    st.optimizer += op.duration
                    a = op.action
                    spans.append(Span(rank, "compute", a, kind, start, op.duration))
            if pending:
                yield simpy.AllOf(env, pending)
            st.finish = env.now
            st.memory_static = self._static_memory(rank)
            st.memory_bytes = st.memory_static + peak_live

        procs = [env.process(rank_proc(r, programs[r])) for r in reps]
        env.run()
        stuck = [r for r, p in zip(reps, procs, strict=True) if not p.triggered]
        if stuck:
            r = stuck[0]
            done = sum(1 for s in spans if s.rank == r and s.stream == "compute")
            raise SimulationError(
                f"simulated deadlock: {len(stuck)} rank classes never finished (first: rank {r} after "
                f"{done} compute actions); the plan's sends/recvs or collectives do not match"
            )
        step = max((s.finish for s in stats.values()), default=0.0)
        ranks = [stats[r] for r in reps]
        capacity = self.cluster.gpu.memory_bytes
        result = SimResult(
            system=plan.system,
            world_size=plan.world_size,
            step_time=step,
            tokens=sum(s.llm_tokens for s in plan.samples),
            samples=len(plan.samples),
            model_flops=model_train_flops(self.model, plan.samples),
            hardware_flops=model_train_flops(self.model, plan.samples, self.recompute),
            recompute=self.recompute,
            compute_model=self.compute.describe(),
            peak_flops=self.cluster.gpu.peak_flops,
            memory_capacity=capacity,
            ranks=ranks,
            spans=spans,
            classes=len(reps),
            sim_seconds=0.0,
        )
        if self.options.check_memory:
            worst = max(ranks, key=lambda s: s.memory_bytes)
            if worst.memory_bytes > capacity:
                result.fits = False
                result.fit_message = (
                    f"does not fit: rank {worst.rank} needs {worst.memory_bytes / GiB:.1f} GiB of "
                    f"{capacity / GiB:.1f} GiB"
                )
        result.sim_seconds = time.perf_counter() - t0
        return result


def simulate(plan: Plan, model: MultimodalSpec, cluster: ClusterSpec, *, calibration=None,
             options: SimOptions = SimOptions()) -> SimResult:
    """Simulate one step of `plan`; `calibration` is a `simulator.calibrate.Profile` or None (datasheet)."""
    compute = collectives = None
    if calibration is not None:
        compute = calibration.compute_model(cluster)
        collectives = calibration.collective_model(cluster)
    return Engine(plan, model, cluster, compute, collectives, options).run()

"""Execute a Plan on this rank with real tensors and real collectives, timing every action.

Every rank runs the same planner on the same batch (planning is deterministic and cheap), builds
the modules its layouts give it, then walks `plan.actions[rank]` in order:

- forward/backward of an encoder microbatch or an LLM pipeline stage microbatch;
- send/recv of pipeline activations and gradients (isend, blocking recv: a 1F1B order posted this
  way cannot deadlock, and every pair's messages are posted in the same order on both sides);
- boundary: the encoder->LLM exchange of one message's routes (`BoundaryCommunicator`);
- grad_sync (FSDP2 already reduce-scattered in the last microbatch's backward; without FSDP
  the data-parallel all-reduce happens here) and optimizer_step.

Losses: the last stage of every LLM data group adds sum-CE over its loss tokens divided by the
step's GLOBAL loss-token count, so microbatch, data, pipeline and context splits sum to the
single-process loss. The MoE auxiliary loss is not added (it depends on how a batch is split, so
no two systems would train the same objective); it is reported only through expert loads.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from omnibench.models import build_model, init_weights
from omnibench.models.inputs import PackedBatch, pack, synthesize
from omnibench.models.loss import IGNORE_INDEX, linear_cross_entropy
from omnibench.models.multimodal import scatter_encoder_outputs
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
)
from omnibench.runtime.parallelize import (
    CHECKPOINT_PREFIX,
    apply_ac,
    apply_compile,
    apply_cp,
    apply_encoder_tp,
    apply_ep,
    apply_fsdp,
    apply_tp,
)
from omnibench.specs.model import MultimodalSpec
from systems.common import data_rank, encoder_tokens, is_primary, long_llm_leaders
from workloads.sample import Sample, Segment

# --------------------------------------------------------------------------------- groups


class Groups:
    """Every process group the layouts need, created once in the same order on every rank
    (new_group is collective over the world); each rank keeps the ones it belongs to."""

    def __init__(self, layouts: dict[str, Layout], rank: int, timeout):
        self.rank = rank
        self.mine: dict[tuple, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._timeout = timeout
        for name in sorted(layouts):
            lay = layouts[name]
            if name == "llm":
                for key, ranks_list in self._llm_groups(lay).items():
                    for ranks in ranks_list:
                        self._new(("llm", key), ranks)
            else:
                # "dp": the gradient (FSDP) group, dp x sp; "sp": Ulysses groups (temporal's encoders).
                for ranks in lay.fsdp_groups():
                    self._new((name, "dp"), ranks)
                for ranks in lay.groups("tp"):
                    self._new((name, "tp"), ranks)
                if lay.sp > 1:
                    for ranks in lay.groups("sp"):
                        self._new((name, "sp"), ranks)
                if lay.hsdp:
                    for key, ranks_list in self._hsdp_groups(lay, lay.fsdp_groups()).items():
                        for ranks in ranks_list:
                            self._new((name, key), ranks)

    def _new(self, key, ranks):
        g = dist.new_group(list(ranks), timeout=self._timeout)
        if self.rank in ranks:
            self.mine[key] = (g, tuple(ranks))

    @staticmethod
    def _llm_groups(lay: Layout) -> dict[str, list[tuple[int, ...]]]:
        out: dict[str, list[tuple[int, ...]]] = {"tp": lay.groups("tp"), "cp": lay.groups("cp"), "dpcp": [], "ep": [], "edp": []}
        for p in range(lay.pp):
            for t in range(lay.tp):
                flat = [lay.rank_at(pp=p, dp=d, cp=c, tp=t) for d in range(lay.dp) for c in range(lay.cp)]
                out["dpcp"].append(tuple(flat))
                ep = lay.ep
                out["ep"] += [tuple(flat[i : i + ep]) for i in range(0, len(flat), ep)]
                out["edp"] += [tuple(flat[i::ep]) for i in range(ep)]
        if lay.hsdp:
            out.update(Groups._hsdp_groups(lay, out["dpcp"]))
        return out

    @staticmethod
    def _hsdp_groups(lay: Layout, fsdp_groups: list[tuple[int, ...]]) -> dict[str, list[tuple[int, ...]]]:
        """HSDP (Layout.dp_shard): each FSDP group split into shard groups of `shard_size` consecutive
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

    def get(self, module: str, dim: str) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
        return self.mine[(module, dim)]


def mesh_from(groups, names: tuple[str, ...], device: str, grid: list | None = None):
    """A DeviceMesh over existing groups (1D, or N-D with `grid` the nested list of ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0][0], device, mesh_dim_names=names)
    return DeviceMesh.from_group([g for g, _ in groups], device, mesh=torch.tensor(grid), mesh_dim_names=names)


# ----------------------------------------------------------------------------- modules


class LLMStage(nn.Module):
    """One pipeline stage of the LLM; stage 0 also embeds and scatters the encoder outputs."""

    def __init__(self, llm: nn.Module, first: bool, last: bool):
        super().__init__()
        self.llm = llm
        self.first, self.last = first, last

    def forward(self, x, position_ids, cu_seqlens, max_seqlen, enc_outs=None, cp_chunk=None, labels=None):
        """Hidden states for the next stage; on the last stage, with `labels`, the (sum-CE, count)
        of its tokens through the chunked head (omnibench.models.loss.linear_cross_entropy)."""
        if self.first:
            h = self.llm.embed(x)
            for positions, out in enc_outs or []:
                h = scatter_encoder_outputs(h, positions, out)
            if cp_chunk is not None:
                h = h[cp_chunk[0] : cp_chunk[1]]
            x = h
        if labels is None:
            return self.llm(x, position_ids, cu_seqlens, max_seqlen)
        h = self.llm(x, position_ids, cu_seqlens, max_seqlen, head=False)
        return linear_cross_entropy(h, self.llm.output.weight, labels)


def split_stage(llm: nn.Module, stage: int, stages: int) -> nn.Module:
    """Keep only this stage's layers (torchtitan-style: delete the rest, names unchanged)."""
    n = len(llm.layers)
    bounds = [round(i * n / stages) for i in range(stages + 1)]
    keep = range(bounds[stage], bounds[stage + 1])
    for i in range(n):
        if i not in keep:
            del llm.layers[str(i)]
    if stage > 0:
        llm.tok_embeddings = None
    if stage < stages - 1:
        llm.norm = None
        llm.output = None
    return llm


def _dummy_sample(module: str) -> Sample:
    # The smallest input an encoder accepts: keeps its collectives in step when a rank has no work.
    if module == "vision":
        seg = Segment("image", llm_tokens=1, encoder_seq_len=4, grid_thw=(1, 2, 2))
    else:
        seg = Segment("audio", llm_tokens=1, encoder_seq_len=2, mel_frames=4)
    return Sample(-1, "dummy", (Segment("text", 1), seg))


# ------------------------------------------------------------------------------ records


@dataclass
class Span:
    step: int
    name: str
    kind: str
    module: str
    start: float
    end: float
    # What the simulator's reader needs without parsing `name` (records.chrome_trace writes them as args).
    rank: int = -1
    microbatch: int = 0
    stage: int = 0
    what: str = ""
    cpu: float = 0.0  # CPU seconds of this rank's thread during the action (wall minus waits / load)


@dataclass
class StepState:
    enc_out: dict = field(default_factory=dict)  # (module, mb) -> (output, [sample ids], [tokens])
    emb: dict = field(default_factory=dict)  # (module, sample) -> leaf tensor on the LLM side
    enc_grad: dict = field(default_factory=dict)  # (module, sample) -> gradient on the encoder side
    act_in: dict = field(default_factory=dict)  # llm mb -> received activation (leaf)
    act_out: dict = field(default_factory=dict)  # llm mb -> stage output / loss
    grad_in: dict = field(default_factory=dict)  # llm mb -> received gradient of the output
    packed: dict = field(default_factory=dict)  # llm mb -> (PackedBatch, chunk)
    pending: list = field(default_factory=list)  # isend handles + their tensors
    loss_sum: float = 0.0


class Executor:
    def __init__(self, model_spec: MultimodalSpec, first_plan: Plan, rank: int, device: torch.device,
                 dtype: torch.dtype, seed: int, lr: float, timeout, optimizer: str = "adamw",
                 recompute: str = "none", compile: bool = False, encoder_chunk_tokens: int = 0):
        self.spec = model_spec
        from omnibench.specs.costs import recompute_policy

        self.recompute, self.compile = recompute_policy(recompute), compile
        self.rank = rank
        self.device = device
        self.dtype = dtype
        self.layouts = first_plan.layouts
        self.groups = Groups(self.layouts, rank, timeout)
        # omni's long inputs: sequence-parallel groups of their own (omnibench/runtime/long_short.py).
        from omnibench.runtime.long_short import LongShortRuntime

        self.long_short = LongShortRuntime.create(first_plan, rank, timeout)
        # encoder microbatches in chunks of a token budget, recomputed in the backward (omnibench/runtime/encoder_chunks.py)
        from omnibench.runtime.encoder_chunks import EncoderChunks

        self.enc_chunks = EncoderChunks.create(encoder_chunk_tokens)
        self.modules: dict[str, nn.Module] = {}
        self.fsdp: dict[str, bool] = {}
        self.notes: list[str] = []
        # Built on the meta device: a rank materialises (and initialises, by parameter name, exactly
        # as the single-process reference does) only the modules and layers it runs.
        with torch.device("meta"):
            full = build_model(model_spec, seed=None)
        self.seed = seed
        dev = device.type
        for name, lay in self.layouts.items():
            if rank not in lay.ranks:
                continue
            if name == "llm":
                self._build_llm(full.llm, lay, dev)
            else:
                self._build_encoder(name, getattr(full, name), lay, dev)
        del full
        params = [p for m in self.modules.values() for p in m.parameters()]
        self.optimizer = make_optimizer(optimizer, params, lr) if params else None
        self.spans: list[Span] = []

    # -- building -------------------------------------------------------------------------
    def _build_llm(self, llm: nn.Module, lay: Layout, dev: str) -> None:
        c = lay.coords(self.rank)
        self.stage, self.stages = c["pp"], lay.pp
        llm = split_stage(llm, self.stage, lay.pp)
        llm.to_empty(device=self.device)
        init_weights(llm, self.seed, prefix="llm.")
        dpcp = self.groups.get("llm", "dpcp")
        self.fsdp["llm"] = lay.fsdp and len(dpcp[1]) > 1
        dp_mesh = None
        if lay.hsdp and self.fsdp["llm"]:
            p = self.stage
            rows = [[lay.rank_at(pp=p, dp=d, cp=cc, tp=t) for t in range(lay.tp)]
                    for d in range(lay.dp) for cc in range(lay.cp)]
            dp_mesh, tp_mesh = self._hsdp_meshes("llm", lay, rows, dev)
            if tp_mesh is not None:
                apply_tp(llm, tp_mesh)
        elif lay.tp > 1:
            tp = self.groups.get("llm", "tp")
            if self.fsdp["llm"]:
                # One 2D mesh: FSDP2 needs the dp and tp meshes to share a parent.
                p = self.stage
                grid = [[lay.rank_at(pp=p, dp=d, cp=cc, tp=t) for t in range(lay.tp)]
                        for d in range(lay.dp) for cc in range(lay.cp)]
                mesh = mesh_from([dpcp, tp], ("dpcp", "tp"), dev, grid)
                dp_mesh, tp_mesh = mesh["dpcp"], mesh["tp"]
            else:
                tp_mesh = mesh_from([tp], ("tp",), dev)
            apply_tp(llm, tp_mesh)
        elif self.fsdp["llm"]:
            dp_mesh = mesh_from([dpcp], ("dpcp",), dev)
        if lay.cp > 1:
            apply_cp(llm, self.groups.get("llm", "cp")[0], lay.cp)
        extra, ignored = [], None
        self.expert_params: list = []  # ordered: collectives over them must match across ranks
        if lay.ep > 1:
            eg, eranks = self.groups.get("llm", "ep")
            local = apply_ep(llm, eg, lay.ep, eranks.index(self.rank))
            self.expert_params = [p for m in local for p in m.parameters()]
            edp = self.groups.get("llm", "edp")
            if self.fsdp["llm"] and len(edp[1]) > 1:
                # Experts shard over the ranks holding the same experts (expert data parallel); under
                # HSDP over those of the shard group, replicated across shard groups.
                emesh = self._expert_hsdp_mesh(lay, dpcp[1], dev) if lay.hsdp else mesh_from([edp], ("edp",), dev)
                extra = [(m, emesh) for m in local]
            else:
                ignored = set(self.expert_params)  # no other rank holds them, or grad_sync reduces them
        self._ac_and_compile(llm, "llm")
        stage = LLMStage(llm, self.stage == 0, self.stage == lay.pp - 1)
        if self.fsdp["llm"]:
            mp = self.dtype if self.dtype != torch.float32 else None
            apply_fsdp(stage, list(llm.layers.values()), dp_mesh, mp, extra, ignored)
        self.modules["llm"] = stage
        self.llm_layout = lay

    def _build_encoder(self, name: str, enc: nn.Module, lay: Layout, dev: str) -> None:
        enc.to_empty(device=self.device)
        init_weights(enc, self.seed, prefix=f"{name}.")
        dp = self.groups.get(name, "dp")
        self.fsdp[name] = lay.fsdp and len(dp[1]) > 1
        dp_mesh = None
        rows = [[lay.rank_at(dp=d, sp=s, tp=t) for t in range(lay.tp)] for d in range(lay.dp) for s in range(lay.sp)]
        if lay.hsdp and self.fsdp[name]:
            dp_mesh, tp_mesh = self._hsdp_meshes(name, lay, rows, dev)
            if tp_mesh is not None:
                replicated = apply_encoder_tp(enc, tp_mesh)
                if replicated:
                    self.notes.append(f"{name}: tensor parallel over tp={lay.tp} except {', '.join(replicated)} "
                                      "(replicated)")
        elif lay.tp > 1:
            tp = self.groups.get(name, "tp")
            if self.fsdp[name]:
                mesh = mesh_from([dp, tp], ("dp", "tp"), dev, rows)
                dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
            else:
                tp_mesh = mesh_from([tp], ("tp",), dev)
            replicated = apply_encoder_tp(enc, tp_mesh)
            if replicated:
                self.notes.append(f"{name}: tensor parallel over tp={lay.tp} except {', '.join(replicated)} (replicated)")
        elif self.fsdp[name]:
            dp_mesh = mesh_from([dp], ("dp",), dev)
        if lay.sp > 1:
            # Ulysses for every block of this encoder, for good (temporal: every microbatch runs over
            # the sp group), before checkpointing and FSDP as the LLM's cp swap is.
            apply_cp(enc, self.groups.get(name, "sp")[0], lay.sp)
        self._ac_and_compile(enc, name)
        if self.fsdp[name]:
            mp = self.dtype if self.dtype != torch.float32 else None
            apply_fsdp(enc, list(enc.layers.values()), dp_mesh, mp)
        self.modules[name] = enc

    def _ac_and_compile(self, module: nn.Module, name: str) -> None:
        """Between the TP/CP/EP swaps and FSDP, as torchtitan orders them (parallelize.py)."""
        apply_ac(module, self.recompute[name])
        if self.compile:
            apply_compile(module)

    def _hsdp_meshes(self, module: str, lay: Layout, rows: list[list[int]], dev: str):
        """HSDP meshes of a module: FSDP2's 2D ("dp_replicate", "dp_shard") mesh and, with tp, the tp
        mesh, both slices of one parent (FSDP2 needs them to share it). `rows`: this rank's FSDP
        group in order, each member as its tp ranks."""
        s = lay.shard_size
        self.notes.append(f"{module}: HSDP, parameters sharded over {s} ranks and replicated "
                          f"{lay.fsdp_size // s}x (dp_shard={s} of {lay.fsdp_size})")
        names = ("dp_replicate", "dp_shard")
        groups = [self.groups.get(module, "dp_replicate"), self.groups.get(module, "dp_shard")]
        grid = [rows[i : i + s] for i in range(0, len(rows), s)]  # [replica][shard][tp]
        if lay.tp > 1:
            mesh = mesh_from(groups + [self.groups.get(module, "tp")], (*names, "tp"), dev, grid)
            return mesh[names], mesh["tp"]
        return mesh_from(groups, names, dev, [[row[0] for row in g] for g in grid]), None

    def _expert_hsdp_mesh(self, lay: Layout, flat: tuple[int, ...], dev: str):
        """Experts under HSDP: ("dp_replicate", "edp_shard"), the ranks of each shard group holding
        this rank's experts, replicated across shard groups (the dense replicate groups)."""
        s, ep = lay.shard_size, lay.ep
        i = flat.index(self.rank) % s % ep
        grid = [[flat[r + i + m * ep] for m in range(s // ep)] for r in range(0, len(flat), s)]
        groups = [self.groups.get("llm", "dp_replicate"), self.groups.get("llm", "edp_shard")]
        return mesh_from(groups, ("dp_replicate", "edp_shard"), dev, grid)

    # -- one step ---------------------------------------------------------------------------
    def run_step(self, plan: Plan, global_loss_tokens: int, t0: float,
                 loaded: dict[str, tuple[float, float, float]] | None = None) -> float:
        """Run this rank's actions; `loaded`: the (start, end, cpu) the loaders' metadata exchanges
        took (omnibench/runtime/loading.py), which ran before the Plan existed."""
        self.plan = plan
        self._index_routes(plan)
        self.state = StepState()
        leaders = long_llm_leaders(plan.options)
        if leaders:
            # omni's long LLM samples are listed on every member of their group: the loaders' count
            # (each data rank's assignment) holds them k times.
            from omnibench.models.inputs import loss_token_count

            k = len(plan.options["long_short"]["groups"]["llm"][0])
            global_loss_tokens -= (k - 1) * sum(loss_token_count(plan.sample(i)) for i in leaders)
        self.global_loss_tokens = global_loss_tokens
        # FSDP reduces gradients in the last backward of each module on this rank.
        self.last_backward: dict[str, int] = {}
        for a in plan.actions.get(self.rank, []):
            if a.kind == BACKWARD:
                self.last_backward[a.module] = max(self.last_backward.get(a.module, -1), a.microbatch)
        cuda = self.device.type == "cuda"
        events = []  # CUDA: (action, host start, host cpu, start event, end event), read once per step
        for a in plan.actions.get(self.rank, []):
            if a.kind == METADATA:
                if a.what not in (loaded or {}):
                    raise RuntimeError(f"step {plan.step}: the plan lists {a} but the loader ran no such exchange")
                s, e, c = loaded[a.what]
                self.spans.append(Span(plan.step, str(a), a.kind, a.module, s, e, self.rank, 0, 0, a.what, c))
                continue
            start, cpu = time.perf_counter(), time.thread_time()
            if cuda:
                # Timed on the GPU's stream, never by synchronising: the host runs ahead and NCCL
                # overlaps compute as it would in production.
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
                with self._autocast(a):
                    self._do(a)
                ev[1].record()
                events.append((a, start, time.thread_time() - cpu, *ev))
                continue
            with self._autocast(a):
                self._do(a)
            end = time.perf_counter()
            self.spans.append(Span(plan.step, str(a), a.kind, a.module, start - t0, end - t0,
                                   self.rank, a.microbatch, a.stage, a.what, time.thread_time() - cpu))
        for h, _ in self.state.pending:
            h.wait()
        if cuda:
            self._cuda_spans(plan.step, events, t0)
        return float(self.state.loss_sum)

    def _autocast(self, a: Action):
        """bf16 compute for modules FSDP does not hold (one rank, --no-fsdp): their weights stay fp32
        and autocast casts per op, as torchtitan does without FSDP; FSDP's own policy does the rest."""
        if a.kind != FORWARD or self.dtype == torch.float32 or self.fsdp.get(a.module):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _cuda_spans(self, step: int, events: list, t0: float) -> None:
        """GPU-time spans of a step's actions: each on the stream's clock, anchored where the first
        action was issued (the host is ahead of the GPU, so later host times say nothing of the GPU)."""
        if not events:
            return
        torch.cuda.synchronize()
        first = events[0][3]
        base = events[0][1] - t0
        for a, _, cpu, ev0, ev1 in events:
            s = base + first.elapsed_time(ev0) / 1e3
            e = base + first.elapsed_time(ev1) / 1e3
            self.spans.append(Span(step, str(a), a.kind, a.module, s, e, self.rank, a.microbatch, a.stage, a.what, cpu))

    def _do(self, a: Action) -> None:
        if a.kind == FORWARD:
            (self._llm_forward if a.module == "llm" else self._enc_forward)(a)
        elif a.kind == BACKWARD:
            (self._llm_backward if a.module == "llm" else self._enc_backward)(a)
        elif a.kind == SEND:
            self._send_pipeline(a)
        elif a.kind == RECV:
            self._recv_pipeline(a)
        elif a.kind == BOUNDARY:
            self._boundary(a)
        elif a.kind == GRAD_SYNC:
            self._grad_sync(a)
        elif a.kind == OPTIMIZER_STEP:
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    # -- encoders ---------------------------------------------------------------------------
    def _enc_microbatch(self, module: str, mb: int) -> tuple[int, ...]:
        lay = self.layouts[module]
        return self.plan.assignment[module][data_rank(lay, self.rank)][mb]

    def _enc_forward(self, a: Action) -> None:
        if self.long_short is not None and self.long_short.handles(self.plan, a.module, a.microbatch):
            self.long_short.forward(self, a)
            return
        module = a.module
        ids = self._enc_microbatch(module, a.microbatch)
        lay = self.layouts[module]
        if lay.sp > 1:  # the whole microbatch over the sp group (omnibench/runtime/long_short.py)
            from omnibench.runtime.long_short import encode_over_group

            group, ranks = self.groups.get(module, "sp")
            encode_over_group(self, module, a.microbatch, ids, group, ranks, swap_cores=False, outputs_on_all=True)
            return
        samples = [self.plan.sample(i) for i in ids] or [_dummy_sample(module)]
        packed = pack([synthesize(s, self.spec, device=self.device) for s in samples]).to(self.device)
        enc = self.modules[module]
        if self.enc_chunks is not None and self.enc_chunks.applies(self, module):
            out = self.enc_chunks.forward(self, module, a.microbatch, samples, packed, _dummy_sample(module))
        elif module == "vision":
            out = enc(packed.pixel_patches, packed.grid_thw)
        else:
            out = enc(packed.mel, packed.mel_lens)
        tokens = [encoder_tokens(s, module) for s in samples] if ids else []
        self.state.enc_out[(module, a.microbatch)] = (out, list(ids), tokens)
        if ids:
            for i, piece in zip(ids, torch.split(out, tokens), strict=True):
                # A route from this rank to itself hands the output over without communication.
                self.state.emb[(module, i, "local")] = piece

    def _enc_backward(self, a: Action) -> None:
        module = a.module
        out, ids, _ = self.state.enc_out.pop((module, a.microbatch))
        lay = self.layouts[module]
        enc = self.modules[module]
        if ids:
            if self.rank == data_rank(lay, self.rank):
                grad = torch.cat([self.state.enc_grad.pop((module, i)) for i in ids]).to(out.dtype)
            else:
                # tp peers: overwritten by the broadcast below; sp peers hold the gathered output too
                # and take zeros (the gather's backward hands every member its chunk of the leader's).
                grad = torch.zeros_like(out)
            if lay.tp > 1:
                g, ranks = self.groups.get(module, "tp")
                dist.broadcast(grad, src=ranks[0], group=g)
        else:
            grad = torch.zeros_like(out)  # dummy forward: zero gradient, collectives still run
        sync = a.microbatch == self.last_backward[module] if self.fsdp.get(module) else None
        if self.enc_chunks is not None and self.enc_chunks.holds(module, a.microbatch):
            self.enc_chunks.backward(module, a.microbatch, grad, enc, sync)
            return
        if sync is not None:
            enc.set_requires_gradient_sync(sync)
        torch.autograd.backward(out, grad)

    # -- LLM --------------------------------------------------------------------------------
    def _llm_packed(self, mb: int) -> tuple[PackedBatch, tuple[int, int] | None]:
        if mb in self.state.packed:
            return self.state.packed[mb]
        lay = self.llm_layout
        ids = self.plan.assignment["llm"][data_rank(lay, self.rank)][mb]
        samples = [synthesize(self.plan.sample(i), self.spec, media=False) for i in ids]
        if not samples:  # omni's long-short: an empty microbatch keeps the data-parallel group in step
            packed = pack([synthesize(Sample(-1, "dummy", (Segment("text", 2),)), self.spec, media=False)])
            packed = replace(packed, labels=torch.full_like(packed.labels, IGNORE_INDEX), sample_ids=[])
        else:
            packed = pack(samples)
        chunk = None
        long = self._llm_long(mb)
        if long is not None:  # a long sample over a context-parallel group of data ranks
            k = len(long[1])
            packed = pad_row(packed, k)
            n = packed.tokens // k
            c = long[1].index(self.rank)
            chunk = (c * n, (c + 1) * n)
        elif lay.cp > 1:
            packed = pad_row(packed, lay.cp)
            n = packed.tokens // lay.cp
            c = lay.coords(self.rank)["cp"]
            chunk = (c * n, (c + 1) * n)
        # The encoders pack their own inputs; the LLM side reads only ids, labels and positions.
        packed = replace(packed, pixel_patches=None, grid_thw=None, mel=None, mel_lens=None).to(self.device)
        self.state.packed[mb] = (packed, chunk)
        return packed, chunk

    def _stage_input_tokens(self, mb: int) -> int:
        ids = self.plan.assignment["llm"][data_rank(self.llm_layout, self.rank)][mb]
        n = sum(self.plan.sample(i).llm_tokens for i in ids)
        cp = self.llm_layout.cp
        return -(-n // cp) if cp > 1 else n

    def _llm_long(self, mb: int):
        return self.long_short.llm_group(self.plan, mb) if self.long_short is not None else None

    def _llm_cp(self, mb: int):
        """Ulysses over the long-sample group around an LLM microbatch's forward or backward."""
        long = self._llm_long(mb)
        if long is None:
            return contextlib.nullcontext()
        from omnibench.runtime.long_short import llm_ulysses

        return llm_ulysses(self.modules["llm"], long[0], len(long[1]))

    def _llm_forward(self, a: Action) -> None:
        with self._llm_cp(a.microbatch):
            self._llm_forward_inner(a)

    def _llm_forward_inner(self, a: Action) -> None:
        mb = a.microbatch
        packed, chunk = self._llm_packed(mb)
        stage = self.modules["llm"]
        pos = packed.position_ids if chunk is None else packed.position_ids[chunk[0] : chunk[1]]
        labels = None
        if stage.last:
            labels = packed.labels if chunk is None else packed.labels[chunk[0] : chunk[1]]
        if stage.first:
            enc_outs = []
            for module in ("vision", "audio"):
                positions = getattr(packed, f"{module}_positions")
                if positions is None or not positions.numel():
                    continue
                parts = [self._embedding(module, i) for i in packed.sample_ids if self._has(i, module)]
                enc_outs.append((positions, torch.cat(parts)))
            out = stage(packed.input_ids, pos, packed.cu_seqlens, packed.max_seqlen, enc_outs, chunk, labels)
        else:
            x = self.state.act_in[mb]
            if not self.fsdp.get("llm"):  # FSDP's mixed precision casts inputs itself
                x = x.to(next(stage.parameters()).dtype)
            out = stage(x, pos, packed.cu_seqlens, packed.max_seqlen, labels=labels)
        if stage.last:
            ce, _ = out
            loss = ce / self.global_loss_tokens
            if self.llm_layout.coords(self.rank)["tp"] == 0:
                # a tensor: reading it here would stall the host until the GPU got this far
                self.state.loss_sum = self.state.loss_sum + loss.detach()
            out = loss
        self.state.act_out[mb] = out

    def _has(self, sample_id: int, module: str) -> bool:
        return bool(self.plan.sample(sample_id).encoder_seq_lens(module))

    def _embedding(self, module: str, sample_id: int) -> torch.Tensor:
        st = self.state
        key = (module, sample_id)
        if key not in st.emb:
            # Produced on this rank: a detached leaf, so LLM backward stops at the boundary and
            # the encoder's backward stays its own action.
            st.emb[key] = st.emb.pop((module, sample_id, "local")).detach().requires_grad_(True)
        return st.emb[key]

    def _llm_backward(self, a: Action) -> None:
        with self._llm_cp(a.microbatch):
            self._llm_backward_inner(a)

    def _llm_backward_inner(self, a: Action) -> None:
        mb = a.microbatch
        stage = self.modules["llm"]
        out = self.state.act_out.pop(mb)
        if self.fsdp.get("llm"):
            stage.set_requires_gradient_sync(mb == self.last_backward["llm"])
        if stage.last:
            out.backward()
        else:
            torch.autograd.backward(out, self.state.grad_in.pop(mb).to(out.dtype))
        if stage.first:
            self._collect_embedding_grads(mb)

    def _collect_embedding_grads(self, mb: int) -> None:
        """After stage 0's backward: the encoder outputs' gradients of this microbatch, summed over
        cp ranks (each saw only its chunk of the row), kept for the primary route's send."""
        lay = self.llm_layout
        packed, _ = self.state.packed[mb]
        keys = [(m, i) for m in ("vision", "audio") for i in packed.sample_ids
                if m in self.layouts and self._has(i, m)]
        if not keys:
            return
        grads = [self.state.emb[k].grad if self.state.emb[k].grad is not None else torch.zeros_like(self.state.emb[k])
                 for k in keys]
        long = self._llm_long(mb)
        if long is not None or lay.cp > 1:
            flat = torch.cat(grads)
            dist.all_reduce(flat, group=long[0] if long is not None else self.groups.get("llm", "cp")[0])
            grads = list(torch.split(flat, [g.shape[0] for g in grads]))
        for k, g in zip(keys, grads, strict=True):
            self.state.emb[k] = g  # the leaf is done with; its gradient goes back along the primary route
            if self.primary_src[k] == self.rank:
                self.state.enc_grad[k] = g

    def _index_routes(self, plan: Plan) -> None:
        """Per step: the routes of each boundary message (module, src, src mb, dst, dst mb) in
        sample-id order, whether each is its sample's primary route, and each sample's primary
        source (who takes the gradient back)."""
        llm = plan.layouts["llm"]
        leaders = long_llm_leaders(plan.options)
        self.messages: dict[tuple, list[tuple]] = defaultdict(list)
        self.primary_src: dict[tuple[str, int], int] = {}
        for r in sorted(plan.routes, key=lambda r: r.sample_id):
            primary = is_primary(r, llm, leaders)
            self.messages[(r.module, r.src_rank, r.src_microbatch, r.dst_rank, r.dst_microbatch)].append((r, primary))
            if primary:
                self.primary_src[(r.module, r.sample_id)] = r.src_rank

    # -- point to point -----------------------------------------------------------------------
    def _send_pipeline(self, a: Action) -> None:
        # Messages travel in the run's compute dtype, so both sides size their buffers alike.
        if a.what == "act":
            t = self.state.act_out[a.microbatch].detach().to(self.dtype).contiguous()
        else:
            t = self.state.act_in.pop(a.microbatch).grad.to(self.dtype).contiguous()
        self.state.pending.append((dist.isend(t, a.peer), t))

    def _recv_pipeline(self, a: Action) -> None:
        shape = (self._stage_input_tokens(a.microbatch), self.spec.llm.hidden)
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, a.peer)
        if a.what == "act":
            self.state.act_in[a.microbatch] = buf.requires_grad_(True)
        else:
            self.state.grad_in[a.microbatch] = buf

    def _boundary(self, a: Action) -> None:
        routes = self._message_routes(a)
        hidden = self.spec.llm.hidden
        if a.what == "act" and a.direction == "send":
            out, ids, tokens = self.state.enc_out[(a.module, a.microbatch)]
            by_id = dict(zip(ids, torch.split(out.detach(), tokens), strict=True))
            t = torch.cat([by_id[r.sample_id] for r in routes]).to(self.dtype).contiguous()
            self.state.pending.append((dist.isend(t, a.peer), t))
        elif a.what == "act":
            buf = torch.empty(sum(r.tokens for r in routes), hidden, dtype=self.dtype, device=self.device)
            dist.recv(buf, a.peer)
            for r, piece in zip(routes, torch.split(buf, [r.tokens for r in routes]), strict=True):
                self.state.emb[(a.module, r.sample_id)] = piece.detach().requires_grad_(True)
        elif a.direction == "send":
            t = torch.cat([self.state.emb[(a.module, r.sample_id)] for r in routes]).to(self.dtype).contiguous()
            self.state.pending.append((dist.isend(t, a.peer), t))
        else:
            out, _, _ = self.state.enc_out[(a.module, a.microbatch)]
            buf = torch.empty(sum(r.tokens for r in routes), out.shape[1], dtype=self.dtype, device=self.device)
            dist.recv(buf, a.peer)
            for r, piece in zip(routes, torch.split(buf, [r.tokens for r in routes]), strict=True):
                self.state.enc_grad[(a.module, r.sample_id)] = piece

    def _message_routes(self, a: Action):
        """The routes one boundary message carries, in sample-id order (both sides agree)."""
        if a.direction == "send" and a.what == "act":
            src, smb, dst, dmb = self.rank, a.microbatch, a.peer, a.peer_microbatch
        elif a.what == "act":
            src, smb, dst, dmb = a.peer, a.peer_microbatch, self.rank, a.microbatch
        elif a.direction == "send":
            src, smb, dst, dmb = a.peer, a.peer_microbatch, self.rank, a.microbatch
        else:
            src, smb, dst, dmb = self.rank, a.microbatch, a.peer, a.peer_microbatch
        routes = self.messages.get((a.module, src, smb, dst, dmb), [])
        return [r for r, primary in routes if primary or a.what != "grad"]

    # -- gradients ------------------------------------------------------------------------------
    def _grad_sync(self, a: Action) -> None:
        """FSDP2 reduce-scattered in the last microbatch's backward; without FSDP the gradients are
        summed here: experts over the ranks holding the same experts, the rest over dp (x cp)."""
        module = self.modules.get(a.module)
        if module is None:
            return
        dim = "dpcp" if a.module == "llm" else "dp"
        g, ranks = self.groups.mine.get((a.module, dim), (None, ()))
        experts = self.expert_params if a.module == "llm" else []
        expert_ids = {id(p) for p in experts}
        if not self.fsdp.get(a.module) and len(ranks) > 1:
            # One flat all-reduce (DDP-style bucket; a tensor-parallel DTensor gradient goes in through
            # its local shard): per-tensor calls each pay the collective's latency.
            grads = [getattr(p.grad, "_local_tensor", p.grad) for p in module.parameters()
                     if p.grad is not None and id(p) not in expert_ids]
            if grads:
                flat = torch.cat([t.reshape(-1) for t in grads])
                dist.all_reduce(flat, group=g)
                for t, part in zip(grads, torch.split(flat, [t.numel() for t in grads]), strict=True):
                    t.copy_(part.view_as(t))
        if experts and not (self.fsdp.get(a.module) and len(self.groups.get("llm", "edp")[1]) > 1):
            eg, eranks = self.groups.get("llm", "edp")
            if len(eranks) > 1:
                for p in experts:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=eg)

    # -- parameters (parity checks) -----------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank owns, gathered to full tensors, under the reference model's
        names; an expert-parallel shard is named `<name>@<first expert>`."""
        from omnibench.runtime.parallelize import ExpertParallel

        shards = {}
        for module in self.modules.values():
            for mname, m in module.named_modules():
                if isinstance(m, ExpertParallel):
                    shards[f"{mname}.local."] = m.first_expert
        out = {}
        for name, module in self.modules.items():
            for pname, p in module.named_parameters():
                t = p.full_tensor() if hasattr(p, "full_tensor") else p
                ref = _reference_name(name, pname)
                for prefix, first in shards.items():
                    if pname.startswith(prefix):
                        ref = _reference_name(name, pname.replace(".local.", ".")) + f"@{first}"
                out[ref] = t.detach().to("cpu", torch.float32).clone()
        return out


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    # CPU: the per-tensor path handles DTensor shards of every layout. CUDA: AdamW's fused kernel
    # (one launch for all tensors, as torchtitan runs it); the per-tensor loop cost 10% of a step.
    params = list(params)
    cuda = bool(params) and params[0].is_cuda
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    if cuda:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


def _reference_name(module: str, pname: str) -> str:
    pname = pname.replace(CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")
    if module == "llm":
        return "llm." + pname.removeprefix("llm.")
    return f"{module}.{pname}"


def pad_row(packed: PackedBatch, multiple: int) -> PackedBatch:
    """Pad a packed row to a multiple of `multiple` tokens with one extra, loss-free sequence."""
    n = packed.tokens
    pad = (-n) % multiple
    if not pad:
        return packed
    # replace(): the encoder inputs and anything added to PackedBatch later carry over untouched.
    cat = torch.cat
    return replace(
        packed,
        input_ids=cat([packed.input_ids, packed.input_ids.new_zeros(pad)]),
        labels=cat([packed.labels, packed.labels.new_full((pad,), IGNORE_INDEX)]),
        position_ids=cat([packed.position_ids, torch.arange(pad, dtype=packed.position_ids.dtype)]),
        cu_seqlens=cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([n + pad])]),
        max_seqlen=max(packed.max_seqlen, pad),
    )

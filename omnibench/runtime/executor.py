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

The Executor is put together from one file per idea: groups.py (process groups), build.py (the
modules and optimizer a rank holds), encoder_actions.py, llm_actions.py, communication.py (pipeline,
boundary, gradient reduction); this file walks the actions and records their spans.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from omnibench.models import build_model
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
    Plan,
    lane_of,
)
from omnibench.runtime.build import BuildMixin, LLMStage, make_optimizer, split_stage
from omnibench.runtime.communication import CommunicationMixin
from omnibench.runtime.encoder_actions import EncoderActionsMixin, dummy_sample
from omnibench.runtime.groups import Groups, mesh_from
from omnibench.runtime.llm_actions import LLMActionsMixin, pad_row
from omnibench.runtime.parallelize import (
    CHECKPOINT_PREFIX,
)
from omnibench.specs.model import MultimodalSpec
from systems.common import long_llm_leaders

__all__ = ["Executor", "Groups", "LLMStage", "Span", "StepState", "dummy_sample", "make_optimizer", "mesh_from",
           "pad_row", "split_stage"]

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


class Executor(BuildMixin, EncoderActionsMixin, LLMActionsMixin, CommunicationMixin):
    def __init__(self, model_spec: MultimodalSpec, first_plan: Plan, rank: int, device: torch.device,
                 dtype: torch.dtype, seed: int, lr: float, timeout, optimizer: str = "adamw",
                 recompute: str = "none", compile: bool = False, encoder_chunk_tokens: int = 0,
                 mixed_precision: str = "autocast"):
        self.spec = model_spec
        self.mixed_precision = mixed_precision  # modules FSDP does not hold: runtime/master.py
        from omnibench.specs.costs import recompute_policy

        self.recompute, self.compile = recompute_policy(recompute), compile
        self.rank = rank
        self.device = device
        self.dtype = dtype
        self.layouts = first_plan.layouts
        # modules whose parameters train not at all (ParallelSpec.freeze, as the planners record it)
        self.frozen = frozenset(first_plan.options.get("freeze", ()))
        for name in self.frozen - {"llm"}:
            self.recompute[name] = "none"  # a frozen encoder runs no backward: nothing to recompute for
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
        self.optimizer = self._make_optimizers(optimizer, lr)  # ZeRO: runtime/zero.py; fp32 masters: master.py
        self.spans: list[Span] = []
        self._intra_op_threads = torch.get_num_threads()  # what spatial's lanes split by quota
        self._lane_pool = None

    def run_step(self, plan: Plan, global_loss_tokens: int, t0: float,
                 loaded: dict[str, tuple[float, float, float]] | None = None) -> float:
        """Run this rank's actions; `loaded`: the (start, end, cpu) the loaders' metadata exchanges
        took (omnibench/runtime/loading.py), which ran before the Plan existed."""
        self.plan = plan
        self._index_routes(plan)
        if self.long_short is not None:
            self.long_short.prepare(plan)  # omni: this step's sequence-parallel groups (long_short.py)
        self.state = StepState()
        leaders = long_llm_leaders(plan.options)
        if leaders:
            # omni's long LLM samples are listed on every member of their group: the loaders' count
            # (each data rank's assignment) holds them k times.
            from omnibench.models.inputs import loss_token_count

            cfg = plan.options["long_short"]
            k = cfg.get("llm_data_ranks", len(cfg["groups"]["llm"][0]))
            global_loss_tokens -= (k - 1) * sum(loss_token_count(plan.sample(i)) for i in leaders)
        self.global_loss_tokens = global_loss_tokens
        cuda = self.device.type == "cuda"
        events = []  # CUDA: (action, host start, host cpu, start event, end event), read once per step
        acts = plan.actions.get(self.rank, [])
        i = 0
        while i < len(acts):
            a = acts[i]
            if a.concurrent >= 0:
                j = i
                while j < len(acts) and acts[j].concurrent == a.concurrent:
                    j += 1
                self._run_concurrent(acts[i:j], plan.step, t0)
                i = j
                continue
            i += 1
            if a.kind == METADATA:
                if a.what not in (loaded or {}):
                    raise RuntimeError(f"step {plan.step}: the plan lists {a} but the loader ran no such exchange")
                s, e, c = loaded[a.what]
                self.spans.append(Span(plan.step, str(a), a.kind, a.module, s, e, self.rank, 0, 0, a.what, c))
                continue
            if cuda:
                # Timed on the GPU's stream, never by synchronising: the host runs ahead and NCCL
                # overlaps compute as it would in production.
                start, cpu = time.perf_counter(), time.thread_time()
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
                with self._autocast(a):
                    self._do(a)
                ev[1].record()
                events.append((a, start, time.thread_time() - cpu, *ev))
                continue
            self._timed(a, plan.step, t0)
        for h, _ in self.state.pending:
            h.wait()
        if cuda:
            self._cuda_spans(plan.step, events, t0)
        return float(self.state.loss_sum)

    def _timed(self, a: Action, step: int, t0: float) -> None:
        """Run one action on the host and record its span (CPU: the host's time is the action's)."""
        start, cpu = time.perf_counter(), time.thread_time()
        with self._autocast(a):
            self._do(a)
        end = time.perf_counter()
        self.spans.append(Span(step, str(a), a.kind, a.module, start - t0, end - t0,
                               self.rank, a.microbatch, a.stage, a.what, time.thread_time() - cpu))

    def _run_concurrent(self, group: list[Action], step: int, t0: float) -> None:
        """A concurrency group (systems/spatial.py): each lane on a thread of its own with its quota of the
        rank's intra-op threads (OpenMP's thread count is per calling thread), the lanes side by side; the
        group ends when both have. The lanes share nothing but the step's dictionaries, each writing keys
        of its own: their dependencies lie in earlier groups, and each module's collectives run on its
        own process groups, in the same order on every rank."""
        if self.device.type == "cuda":
            raise RuntimeError("spatial multiplexing runs its lanes side by side on CPU threads only: CUDA streams "
                               "or green contexts per lane are not implemented")
        lanes: dict[str, list[Action]] = {}
        for a in group:
            lanes.setdefault(lane_of(a), []).append(a)
        total = self._intra_op_threads

        def run_lane(acts: list[Action]) -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(max(1, round(acts[0].quota * total)))
            try:
                for a in acts:
                    self._timed(a, step, t0)
            finally:
                torch.set_num_threads(before)

        if self._lane_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._lane_pool = ThreadPoolExecutor(2, thread_name_prefix="lane")
        futures = [self._lane_pool.submit(run_lane, acts) for acts in lanes.values()]
        for f in futures:
            f.result()

    def _autocast(self, a: Action):
        """bf16 compute for modules FSDP does not hold (one rank, --no-fsdp): under
        `--mixed-precision autocast` their weights stay fp32 and autocast casts per op, as torchtitan
        does without FSDP; ZeRO's and `master`'s weights are bf16 already and autocast only casts what
        comes in fp32 (pixels, features). FSDP's own policy does the rest."""
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
        if a.kind == FORWARD and a.module in self.frozen and a.module != "llm":
            # a frozen encoder has no backward (systems/common.py drop_frozen): it keeps nothing for one
            with torch.no_grad():
                self._enc_forward(a)
        elif a.kind == FORWARD:
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

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank owns, gathered to full tensors, under the reference model's
        names; an expert-parallel shard is named `<name>@<first expert>`."""
        from omnibench.runtime.parallelize import ExpertParallel

        shards = {}
        for module in self.modules.values():
            for mname, m in module.named_modules():
                if isinstance(m, ExpertParallel):
                    shards[f"{mname}.local."] = m.first_expert
        masters = {}  # bf16 weights with an fp32 master: the master is what the optimizer stepped
        for state in getattr(self.optimizer, "states", {}).values():
            masters.update(getattr(state, "full_tensors", dict)())
        named, rows = {}, {}  # rows: 1-D meshes' dim-0 shards (FSDP's), gathered together per mesh
        for name, module in self.modules.items():
            for pname, p in module.named_parameters():
                t = masters.get(id(p), p)
                ref = _reference_name(name, pname)
                for prefix, first in shards.items():
                    if pname.startswith(prefix):
                        ref = _reference_name(name, pname.replace(".local.", ".")) + f"@{first}"
                if _row_sharded(p):
                    rows.setdefault(p.device_mesh, []).append((ref, p, p.to_local() if t is p else t))
                    continue
                if hasattr(p, "full_tensor"):  # a tensor-parallel weight: its master is the local shard's
                    if t is not p:
                        from torch.distributed.tensor import DTensor

                        t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
                    t = t.full_tensor()
                named[ref] = t.detach().to("cpu", torch.float32).clone()
        for mesh, items in rows.items():
            named.update(_gather_rows(mesh, items))
        return named


def _row_sharded(p) -> bool:
    """A DTensor split by rows over a 1-D mesh (FSDP2's parameters without HSDP or TP)."""
    from torch.distributed.tensor import Shard

    placements = getattr(p, "placements", None)
    return placements is not None and len(placements) == 1 and placements[0] == Shard(0) and p.dim() >= 1


def _gather_rows(mesh, items: list) -> dict[str, torch.Tensor]:
    """Whole fp32 tensors of row-sharded parameters (name, DTensor, local rows) on one 1-D mesh, in
    ONE all-gather: each shard padded to torch.chunk's ceil(rows / n), as DTensor and FSDP2 split
    rows. `full_tensor()` per parameter costs a collective and DTensor's dispatch each (a seventh of
    a small parity run's time)."""
    import torch.distributed as dist

    n = mesh.size()
    flat = []
    for _, p, local in items:
        chunk = -(-p.shape[0] // n)
        piece = torch.zeros((chunk, *p.shape[1:]), dtype=torch.float32, device=local.device)
        piece[: local.shape[0]] = local.detach().to(torch.float32)
        flat.append(piece.reshape(-1))
    mine = torch.cat(flat)
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=mesh.get_group())
    out, at = {}, 0
    for ref, p, _ in items:
        chunk = -(-p.shape[0] // n)
        size = chunk * int(torch.Size(p.shape[1:]).numel())
        whole = torch.cat([part[at: at + size].reshape(chunk, *p.shape[1:]) for part in parts])
        out[ref] = whole[: p.shape[0]].to("cpu").clone()
        at += size
    return out


def _reference_name(module: str, pname: str) -> str:
    pname = pname.replace(CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")
    if module == "llm":
        return "llm." + pname.removeprefix("llm.")
    return f"{module}.{pname}"

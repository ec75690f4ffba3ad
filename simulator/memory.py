"""Memory per rank: what a rank holds all step and what its actions add and free.

Four figures per rank (RankStats): `memory_allocated`, the peak of live tensors (what
torch.cuda.max_memory_allocated and torch's MemTracker measure); `memory_reserved`, the caching
allocator's reserve at that peak when memory is plentiful (FRAGMENTATION x allocated, what torchtitan's
max_reserved publishes); `memory_bytes`, that reserve and the CUDA context and NCCL buffers outside
the allocator, the figure compared with published peaks; and `memory_needed`, what the step needs to
run under memory pressure (allocated x (1 + stranded) + outside, per stack: `allocator_need`), the
figure the fits check compares with the GPU's memory (the capacity torch reports: the hardware
presets' memory_gib).

Static: each module's training state under its data-parallel mode (`Layout.dp_mode`: DDP, ZeRO-1,
ZeRO-2, FSDP, HSDP) in the bytes per parameter its software stack keeps
(`omnibench.specs.costs.STATE_DTYPES`), and FSDP's gathered bf16 parameters (the root's, the layers
in flight). Timeline (simulator/engine.py's rank process, one (high point, what it leaves) pair per
action from `_compute_memory`): the activations of the microbatches in flight, counted from the
action order, so each pipeline schedule's in-flight depth and dynamic sequence lengths both show,
under the recompute mode as the stack's kernels keep them (`costs.llm_layer_memory`, `loss_memory`);
a backward walked layer by layer (the loss's transient, then each layer's recomputation, working
set and gradient buffers while earlier layers' activations are freed and their gradients appear);
FSDP's whole gradients accumulated across microbatches where the stack defers its reduce-scatter;
ZeRO's slices at grad_sync; the flat buffer of this runtime's non-FSDP grad_sync.

The memory conventions are a stack's, not a GPU's (MEMORY_STACKS): this project's runtime ("eager",
the default), Megatron-LM ("megatron", what the `fused` kernel stack charges), torchtitan, Composer.
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass

from omnibench.plan import (
    BACKWARD,
)
from omnibench.specs import costs
from simulator.fitted import fitted
from simulator.flops import (
    Work,
)
from simulator.hardware import GiB


# What the caching allocator and the process add to the live tensors, per software stack:
# `stranded`, the free space stranded inside segments that still hold live blocks, as a share of the
# allocated peak, when memory is short; `outside`, what lives outside the allocator (CUDA context, the
# libraries' loaded kernels and handles, NCCL's buffers), so in no max_memory_allocated /
# max_memory_reserved reading.
#
# When no cached block fits and cudaMalloc fails, PyTorch's caching allocator frees its cached free
# blocks and retries (c10/cuda/CUDACachingAllocator.cpp `malloc`: release_available_cached_blocks,
# then release_cached_blocks, then alloc_block again; pytorch/pytorch at eb42ad6e). Only the stranded
# space cannot be given back, so a step needs allocated x (1 + stranded) + outside (`memory_needed`),
# not its unpressured reserve.
@dataclass(frozen=True)
class AllocatorNeed:
    stranded: float
    outside: float  # bytes, for a rank that holds one NCCL communicator (the world's)
    source: str
    # bytes each further NCCL communicator of the rank holds outside the allocator (0: in `outside`)
    per_communicator: float = 0.0

    def outside_for(self, communicators: int) -> float:
        """What lives outside the allocator on a rank holding `communicators` NCCL communicators."""
        return self.outside + self.per_communicator * max(0, communicators - 1)


# The published stacks (Megatron-LM, NeMo, torchtitan, Composer, DeepSpeed): stranded = Y / X at the
# failure point of the 11 LLM / multimodal training-step OOM messages on 40-80 GB GPUs in
# results/validation/allocator_oom_messages.csv (public issue threads, "X GiB is allocated by PyTorch, and
# Y GiB is reserved by PyTorch but unallocated"; median 0.44%, quartiles 0.25% and 3.7%); outside: 1 GiB,
# about what the training processes' OOM messages in results/validation/gpu_capacity.md show beyond
# PyTorch's memory (0.4-1.8 GiB on A100/H100/H200). Not fitted on published_runs.csv.
PUBLISHED_ALLOCATOR = AllocatorNeed(0.0044, 1.0 * GiB, "public OOM messages")
# This project's runtime ("eager"), measured on one H100 80GB HBM3 (torch 2.11, CUDA 13, NCCL 2.28).
# stranded, by benchmarks/gpu_allocator.py (results/gpu/2026-11-27-h100/allocator): its own step, the
# allocator capped (set_per_process_memory_fraction) and bisected to the smallest cap under which the
# same steps run; the larger of the two Plans measured (llm-7b@4L text_only 9.1%, its loss's 1 GiB
# chunks need contiguous blocks; omni-7b@4L mixed_video with encoders 3.0%).
# outside, by benchmarks/gpu_memory_phases.py (results/gpu/2026-11-27-h100-b/phases): the driver's
# in-use figure less the allocator's reserve after each phase of one process. It does not grow with
# steps or shapes; it appears with the CUDA context (0.51 GiB), the first GEMM's libraries (0.16), the
# first NCCL communicator (0.55) and the step's kernels (0.06): 1.28 GiB; and then 0.380 GiB for each
# further NCCL communicator (nccl_groups.log: 6 one-member groups, 0.379-0.381 each; the runtime creates
# every group its layouts name at once, as init_process_group gets `device_id`). The Executor's groups
# (omnibench/process_groups.py) reproduce both Plans: 1.28 + 5 x 0.380 = 3.18 GiB (LLM-only, 5 groups,
# measured 3.18) and 1.28 + 9 x 0.380 = 4.70 (encoders + LLM, 9 groups, measured 4.70). With
# NCCL_MAX_NCHANNELS=2 the same step holds 1.07 GiB: the communicators' share scales with NCCL's channels.
# Why (NVIDIA/nccl v2.28.3-1, src/channel.cc initChannel: three device allocations per channel, each
# rounded up to the 2 MiB cuMem granule by ncclCuMemAlloc, src/include/alloc.h; a one-rank communicator
# gets 64 channels): 64 x 3 x 2 MiB = 384 MiB. A communicator over several GPUs also holds its
# connections' buffers, allocated at the first collective of each algorithm since NCCL 2.22 (about
# 10-12 MiB per channel and peer on NVLink or InfiniBand, by the same source), which one GPU cannot
# measure: for such ranks this is a lower bound.
EAGER_ALLOCATOR = AllocatorNeed(0.0913, 1.28 * GiB, "measured on one H100 (benchmarks/gpu_allocator.py, "
                                "gpu_memory_phases.py)", per_communicator=0.380 * GiB)


# CPU ranks (gloo): no caching allocator and no CUDA context; about 1 GiB per process for Python,
# torch and gloo, the figure the CPU runs' check has always added (their check guards a laptop from a
# real preset, it is not a precise one).
HOST_ALLOCATOR = AllocatorNeed(0.0, 1.0 * GiB, "a CPU process")
HOST_DEVICE = "cpu-process"  # a cluster whose gpu has this name is a host's memory (cpu-gloo.toml)


def allocator_need(memory_stack: str, device: str = "") -> AllocatorNeed:
    """The allocator figures of a memory stack (MEMORY_STACKS) on a device (the cluster's gpu name):
    measured on a GPU for this project's runtime, from public OOM messages for the others; a CPU
    process's on the host."""
    if device == HOST_DEVICE:
        return HOST_ALLOCATOR
    return EAGER_ALLOCATOR if memory_stack == "eager" else PUBLISHED_ALLOCATOR


_OOM = re.compile(r"this process has ([0-9.]+) (GiB|MiB) memory in use.*?Of the allocated memory ([0-9.]+) (GiB|MiB) "
                  r"is allocated by PyTorch.*?and ([0-9.]+) (GiB|MiB) is reserved by PyTorch but unallocated", re.S)


def oom_figures(message: str) -> dict | None:
    """What PyTorch's out-of-memory message says (c10/cuda/CUDACachingAllocator.cpp): bytes in use by
    the process, allocated by PyTorch (X), reserved but unallocated (Y), and the rest, outside the
    allocator; None where the message lacks them (the old format, or NVML reported no process)."""
    m = _OOM.search(message)
    if not m:
        return None
    unit = {"GiB": GiB, "MiB": 2**20}
    used, x, y = (float(m.group(i)) * unit[m.group(i + 1)] for i in (1, 3, 5))
    return {"in_use": used, "allocated": x, "stranded": y, "outside": used - x - y}


# The figures of the published stacks, under their old names (the validation's readers quote them).
RESERVED_BYTES = PUBLISHED_ALLOCATOR.outside
STRANDED = PUBLISHED_ALLOCATOR.stranded
# The caching allocator reserves more than its live tensors hold (blocks split and cached between
# differently sized requests): reserved = FRAGMENTATION x allocated at the peak, one factor for every
# stack and GPU, fitted on the published peaks of the calibration rows (simulator/fitted.py says which
# and its error). The allocated model itself is checked against torch's FSDPMemTracker running Llama 3
# 8B at full depth (0.98-0.99 of this estimate), so the factor is the allocator's. (This runtime's own
# steps on one H100 read 1.210 and 1.081: benchmarks/gpu_allocator.py.)
FRAGMENTATION = fitted("fragmentation")
ZERO_BUCKET_ELEMS = 40_000_000  # omnibench/runtime/zero.py BUCKET_ELEMS (Megatron-LM's DDP bucket)
# DeepSpeed ZeRO-3's stage3_max_live_parameters default (deepspeed/runtime/zero/constants.py at v0.3.14,
# April 2021, the release Narayanan et al.'s ZeRO-3 comparison could use): it prefetches no further
# parameters while this many are gathered
DEEPSPEED_MAX_LIVE_PARAMETERS = 1e9


def memory_needed(allocated: float, memory_stack: str = "eager", device: str = "", communicators: int = 1) -> float:
    """Bytes a rank whose live tensors peak at `allocated` needs to run under memory pressure: the
    allocator gives back every cached block it can before it fails, so only the space stranded in
    partly used segments and what lives outside the allocator (`allocator_need`, with the rank's
    `communicators`) add to it."""
    need = allocator_need(memory_stack, device)
    return allocated * (1.0 + need.stranded) + need.outside_for(communicators)


def communicators(plan, rank: int) -> int:
    """NCCL communicators `rank` holds in this runtime: the world's, one per group of the layouts it
    belongs to (omnibench/process_groups.py, created at start-up), and one per sequence-parallel group it
    is in: of omni's group pool, every group any step may name, built at start-up and kept
    (omnibench/runtime/long_short.py); a plan without a pool, of its step's groups."""
    from collections import Counter

    from omnibench.process_groups import groups_of_rank

    cached = _STEP_GROUPS.get(id(plan))
    if cached is None or cached[0]() is not plan:  # one Plan at a time: its ranks are asked in turn
        long_short = plan.options.get("long_short", {})
        if "pool" in long_short:
            members = _pool_members(plan.layouts, long_short["pool"])
        else:
            members = Counter(r for groups in long_short.get("groups", {}).values() for g in groups for r in g)
        # held weakly: a strong hold kept the step's last Plan (its actions and routes) alive into the
        # next step, where the cyclic GC scanned it again and again
        cached = (weakref.ref(plan), members)
        _STEP_GROUPS.clear()
        _STEP_GROUPS[id(plan)] = cached
    return 1 + groups_of_rank(plan.layouts, rank) + cached[1].get(rank, 0)


@functools.lru_cache(maxsize=8)
def _pool_key_members(layouts: tuple, pool: tuple):
    from collections import Counter

    from omnibench.process_groups import pool_groups

    groups = pool_groups(dict(layouts), {m: list(ks) for m, ks in pool})
    return Counter(r for g in groups for r in g)


def _pool_members(layouts: dict, pool: dict):
    """Per rank, the pool's groups it is in (the same for every step of a layout: worked out once)."""
    return _pool_key_members(tuple(sorted(layouts.items())), tuple(sorted((m, tuple(ks)) for m, ks in pool.items())))


_STEP_GROUPS: dict[int, tuple] = {}


# Whose memory conventions (training-state dtypes, costs.STATE_DTYPES; activations,
# costs.ACTIVATION_STACKS) each kernel stack (simulator/kernels.py::Stack) charges: "eager" is this
# project's runtime, "fused" Megatron-LM's (of 2021-22 when the kernel profile is unfused attention's).
MEMORY_OF_STACK = {"eager": "eager", "fused": "megatron"}
# name -> (training-state convention, activation convention)
# A name may end in "+fp8": Transformer Engine's FP8 linears (Megatron, NeMo) keep their inputs in FP8.
MEMORY_STACKS = {
    "eager": ("eager", "eager"),
    "torchtitan": ("torchtitan", "torchtitan"),
    "torchtitan-fused-norm": ("torchtitan", "torchtitan-fused-norm"),
    "torchtitan-compile": ("torchtitan", "torchtitan-compile"),
    "torchtitan-compile-loss": ("torchtitan", "torchtitan-compile-loss"),
    "megatron": ("megatron", "megatron"),
    # Megatron-LM before flash attention (2019-22: Shoeybi et al., Narayanan et al., Korthikanti et
    # al.): softmax and dropout outputs and the dropout mask of every s x s score matrix
    "megatron-2021": ("megatron", "megatron"),
    "nemo": ("nemo", "megatron"),
    # Megatron-LM with --grad-reduce-in-bf16 (bf16 main gradients)
    "megatron-bf16-grads": ("megatron-bf16-grads", "megatron"),
    # MosaicML Composer / LLM Foundry: PyTorch FSDP with fp32 shards; MPT's blocks keep Korthikanti's
    # set (low-precision LayerNorm, fused qkv, flash attention, GELU MLP), as Megatron's do
    "composer": ("torchtitan", "megatron"),
}


class MemoryMixin:
    """The Engine's memory accounting (needs WorkMixin and GroupsMixin)."""

    @property
    def memory_stack(self) -> str:
        """The stack whose memory conventions this simulation charges (SimOptions.memory_stack, else
        the kernel stack's own)."""
        name = getattr(self.options, "memory_stack", "")
        if not name:
            name = MEMORY_OF_STACK.get(self.options.stack, "eager")
            prof = self.compute.kernels
            if name == "megatron" and prof is not None and prof.attention_kernel == "unfused":
                # a kernel profile of Megatron-LM's unfused attention (simulator/data/kernels/
                # a100-published.json: the 2021-22 runs) describes that stack, scores and all
                name = "megatron-2021"
        base = name.removesuffix("+fp8")
        return name if base in MEMORY_STACKS else "eager"

    @property
    def _memory_base(self) -> str:
        return self.memory_stack.removesuffix("+fp8")

    @property
    def _state_stack(self) -> str:
        """costs.STATE_DTYPES' name of the memory stack's training-state convention."""
        return MEMORY_STACKS[self._memory_base][0]

    @property
    def activation_stack(self) -> str:
        """costs.ACTIVATION_STACKS' name of the memory stack's activation convention."""
        act = MEMORY_STACKS[self._memory_base][1]
        fp8 = self.memory_stack.endswith("+fp8") or getattr(self.options, "gemm_dtype", "bf16") == "fp8"
        return act + "-fp8" if fp8 and act == "megatron" else act

    def _dp_mode(self, module: str, rank: int) -> tuple[str, int]:
        """(data-parallel mode, ranks the state is sharded over) of `module` on `rank`. FSDP and ZeRO
        need peers: a group of one rank holds everything (the runtime applies no FSDP there)."""
        lay = self.plan.layouts[module]
        if rank not in self.index[module].coords:
            return "ddp", 1
        if lay.fsdp:
            n = len(self._shard_group(module, rank))
            return ("hsdp" if lay.hsdp else "fsdp", n) if n > 1 else ("ddp", 1)
        # ZeRO's state is sharded over the shard group (the whole data-parallel group unless hybrid)
        n = len(self._shard_group(module, rank)) if lay.zero else len(self._grad_group(module, rank))
        return (lay.dp_mode, n) if n > 1 else ("ddp", 1)

    def _model_parallel_params(self, module: str, rank: int) -> tuple[float, float]:
        """(dense, expert) parameters of the rank's model-parallel part (its stage, its tp shard, its
        experts), before any data-parallel sharding; (0, 0) on a rank the module does not use."""
        lay, idx = self.plan.layouts[module], self.index[module]
        if rank not in idx.coords:
            return 0.0, 0.0
        w = self.stage_work(module, idx.coords[rank].get("pp", 0))
        etp = 1 if lay.expert_tp == 1 else lay.tp  # folded experts (expert_tp 1) are whole on their rank
        return (w.params - w.expert_params) / lay.tp, w.expert_params / etp / max(1, lay.ep)

    def _module_state(self, module: str, rank: int) -> costs.StateBytes:
        """Weights (with master copies), gradients and AdamW state of `module` on `rank` under its
        data-parallel mode; experts are sharded over the ranks holding the same experts
        (`_expert_shards`)."""
        mode, n = self._dp_mode(module, rank)
        dense, expert = self._model_parallel_params(module, rank)
        d = self._dtypes(module, rank)
        a = costs.state_bytes(d, dense, mode, n)
        if not expert:
            return a
        b = costs.state_bytes(d, expert, mode, self._expert_shards(module, n))
        return costs.StateBytes(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer)

    def _expert_shards(self, module: str, n: int) -> int:
        """Ranks that hold the same experts and so shard their optimizer state (ZeRO) or everything
        (FSDP), given the `n` ranks the module's dense state is sharded over (dp*cp): n/ep, or under
        MoE parallel folding (Layout.expert_tp 1, tp > 1) n*tp/ep, since ep is then drawn from the
        dp*cp*tp ranks of a stage and every tp rank holds whole experts (Megatron-Core's expert data
        parallel group; the MoE model zoo's Qwen3-235B H100 table prints it as EDP = DP*TP/EP, e.g.
        TP 4, EP 8, DP 8: EDP 4)."""
        lay = self.plan.layouts[module]
        if module == "llm" and lay.expert_tp == 1 and lay.tp > 1:
            n *= lay.tp
        return max(1, n // max(1, lay.ep))

    def _dtypes(self, module: str, rank: int) -> costs.StateDtypes:
        if module in self.frozen:
            return costs.FROZEN_DTYPES  # bf16 weights alone: no master, gradients or moments
        mode = self._dp_mode(module, rank)[0]
        d = costs.state_dtypes(self._state_stack, mode)
        if (mode == "ddp" and d.name == "eager" and d.weights == 4
                and getattr(self.options, "mixed_precision", "autocast") == "master"):
            # one rank or DDP under --mixed-precision master (omnibench/runtime/master.py): bf16 weights,
            # the fp32 master and main gradients beside them, as ZeRO holds them before sharding
            d = costs.state_dtypes("eager", "zero1")
        if (self.memory_stack.endswith("+fp8") or getattr(self.options, "gemm_dtype", "bf16") == "fp8") \
                and d.name == "nemo":
            # Megatron-Bridge's FP8 recipes keep the weights in FP8 (fp8_param_gather)
            from dataclasses import replace

            d = replace(d, weights=1)
        return d

    def _grad_sync_delta(self, module: str, rank: int) -> float:
        """Gradient bytes a module's grad_sync adds (+) or frees (-) in this project's runtime: under
        ZeRO it reduce-scatters the whole fp32 gradients into the rank's fp32 slice, and ZeRO-2 frees
        the whole ones then (omnibench/runtime/zero.py). Other modes and stacks reduce in place."""
        mode, n = self._dp_mode(module, rank)
        d = self._dtypes(module, rank)
        if d.grads_static or not mode.startswith("zero") or self._memory_base != "eager":
            return 0.0
        dense, expert = self._model_parallel_params(module, rank)
        whole = d.grads * (dense + expert)
        return whole / n - (whole if mode == "zero2" else 0.0)

    def _grad_sync_buffer(self, module: str, rank: int) -> float:
        """Bytes a grad_sync allocates while it runs in this project's runtime
        (omnibench/runtime/communication.py): DDP reduces every gradient through one flat fp32 buffer
        (`torch.cat`); ZeRO reduce-scatters bucket by bucket (a padded fp32 bucket of at most
        zero.BUCKET_ELEMS, Megatron-LM's default bucket, and its slice). FSDP reduce-scatters inside
        the backward; stacks with a contiguous gradient buffer reduce it in place."""
        mode, n = self._dp_mode(module, rank)
        if n < 2 or mode in ("fsdp", "hsdp") or self._memory_base != "eager":
            return 0.0
        dense, expert = self._model_parallel_params(module, rank)
        grads = self._dtypes(module, rank).grads
        if mode == "ddp":
            return grads * dense
        return grads * min(dense, ZERO_BUCKET_ELEMS) * (1 + 1 / n)

    def _weight_copies(self, module: str, rank: int, stage: int) -> float:
        """bf16 weight copies one forward keeps for its backward where the weights are fp32 and FSDP
        gathers none (this project's runtime on one rank or under DDP: autocast casts the fp32
        weights per forward and autograd saves the casts); under full recomputation blocks save
        only their input, the casts are made again."""
        if not self._casts(module, rank) or self.policy[module] == "full":
            return 0.0
        dense, expert = self._model_parallel_params(module, rank)
        if module == "llm":
            # the blocks' linears; the token embedding is a lookup (no cast) and the chunked loss's
            # cast of the output projection lives only while the loss runs (`_compute_memory`)
            return 2 * self.stage_work(module, self.index[module].coords[rank].get("pp", 0)).layers * \
                self._layer_on_rank(module)
        return 2 * (dense + expert)

    def _scores(self, work: Work) -> float:
        """Bytes of one layer's s x s attention scores where the stack runs unfused attention: only
        Megatron-LM of 2019-22 ("megatron-2021", or SimOptions.attention "unfused") keeps softmax and
        dropout outputs in bf16 and the dropout mask in bytes, 5 bytes per score (Korthikanti et al.
        2022 eq. 1's 5as^2b). Every other stack runs flash attention (this runtime's varlen / SDPA,
        torchtitan's SDPA, Megatron's and NeMo's Transformer Engine) on every GPU: the stack, not the
        GPU, decides."""
        attention = getattr(self.options, "attention", "")
        unfused = attention == "unfused" or (not attention and self._memory_base == "megatron-2021")
        if not unfused or work.shape is None or not work.layers:
            return 0.0
        return 5.0 * work.shape.heads * sum(x * x for x in work.shape.seq_lens)

    def _live_activation(self, work: Work) -> float:
        """What a forward keeps for its backward: costs.py's held activations under the recompute
        policy (less the recomputed layer that exists only inside the backward), and the s x s scores
        of an unfused-attention stack unless recomputation drops them."""
        out = work.act_bytes - work.act_transient
        if self.policy["llm"] == "none":
            out += work.layers * self._scores(work)
        return out

    def _params_on_rank(self, rank: int) -> float:
        return sum(self._module_params_on_rank(m, rank) for m in self.plan.layouts)

    def _module_params_on_rank(self, m: str, rank: int) -> float:
        """Parameters whose weights `rank` holds: its FSDP shard, or its whole model-parallel part."""
        mode, n = self._dp_mode(m, rank)
        dense, expert = self._model_parallel_params(m, rank)
        if mode not in ("fsdp", "hsdp"):
            return dense + expert
        return dense / n + expert / self._expert_shards(m, n)

    def _stepped_params_on_rank(self, rank: int) -> float:
        """Parameters whose optimizer state `rank` holds and steps: its shard under ZeRO-1/2 and
        FSDP, everything it holds under DDP."""
        out = 0.0
        for m in self.plan.layouts:
            if m in self.frozen:
                continue  # the optimizer never sees it
            mode, n = self._dp_mode(m, rank)
            dense, expert = self._model_parallel_params(m, rank)
            out += dense + expert if mode == "ddp" else dense / n + expert / self._expert_shards(m, n)
        return out

    def _gathered_bytes(self, m: str, rank: int) -> float:
        """FSDP's gathered bf16 parameters held whenever the rank computes: the root module's (FSDP2
        never reshards the root after forward: embeddings, final norm and output projection, an
        encoder's stem and merger) and the current and the prefetched layer when FSDP reshards after
        forward (torchtitan also keeps the last block, which it does not reshard), the whole stage
        when it keeps them. This project's runtime reshards after forward at any pp
        (omnibench/runtime/parallelize.py `apply_fsdp`); torchtitan keeps the stage gathered under
        pipelining (parallelize_llama.py `apply_fsdp`), which `reshard_after_forward` says."""
        mode, _ = self._dp_mode(m, rank)
        if mode not in ("fsdp", "hsdp"):
            return 0.0
        lay = self.plan.layouts[m]
        w = self.stage_work(m, self.index[m].coords[rank].get("pp", 0))
        dense, expert = self._layer_params(m)
        layer = dense / lay.tp + expert / lay.tp / max(1, lay.ep)
        total = (w.params - w.expert_params) / lay.tp + w.expert_params / lay.tp / max(1, lay.ep)
        root = max(0.0, total - w.layers * layer)
        if self.memory_stack == "eager":
            reshard = bool(self.plan.options.get("reshard_after_forward", True))
        else:
            reshard = self.reshard_after_forward
        if not reshard:
            return 2 * total
        if self._zero3_buckets and m == "llm":
            # DeepSpeed ZeRO-3 gathers module by module: the current linear and what it prefetches,
            # and it prefetches only while fewer than stage3_max_live_parameters are gathered (stage3.py
            # `prefetch_next_sub_modules`): the largest linear and at most one more as large, or
            # max_live_parameters and the largest
            largest = self._largest_param(m)
            return 2 * (largest + min(largest, DEEPSPEED_MAX_LIVE_PARAMETERS))
        held = 3 if self.memory_stack.startswith("torchtitan") else 2  # torchtitan keeps the last block
        return 2 * (root + min(held, w.layers) * layer)

    @property
    def _zero3_buckets(self) -> bool:
        """Whether sharded data parallelism is DeepSpeed ZeRO-3's, which gathers and reduces in
        buckets of parameters (SimOptions.fsdp_gather_bucket / fsdp_reduce_bucket), not FSDP's
        per-block units."""
        return bool(getattr(self.options, "fsdp_reduce_bucket", 0.0) or getattr(self.options, "fsdp_gather_bucket", 0.0))

    def _largest_param(self, m: str) -> float:
        """Elements of the largest weight of one LLM block on a rank (the MLP's up projection or the
        fused qkv), as DeepSpeed gathers and reduces it: whole, one tensor."""
        llm = self.model.llm
        q, kv = llm.heads * llm.dim_head, llm.kv_heads * llm.dim_head
        return max(llm.hidden * costs._mlp_width(llm), llm.hidden * (q + 2 * kv)) / self.plan.layouts[m].tp

    def _zero3_grad_buffer(self, m: str) -> float:
        """Bytes of gradients DeepSpeed ZeRO-3 holds in flight during a backward: a reduce bucket's
        worth (reduce_bucket_size, or one parameter larger than it, which is reduced on its own) and
        the flat copy its reduction makes of it (`buffered_reduce_fallback`, or the contiguous ipg
        buffer), in the parameters' dtype; the whole layer's gradients are never alive at once."""
        bucket = max(float(getattr(self.options, "fsdp_reduce_bucket", 0.0)), self._largest_param(m))
        return 2 * self._dtypes(m, self.plan.layouts[m].ranks[0]).grads * bucket

    def _layer_params(self, m: str) -> tuple[float, float]:
        """(dense, expert) parameters of one block of module `m`, before any sharding."""
        key = ("layer-params", m)
        got = self._work_cache.get(key)
        if got is None:
            if m == "llm":
                llm = self.model.llm
                got = (float(costs.llm_params(llm, layers=range(1), embed=False, head=False)),)
                from simulator.flops import llm_expert_params

                e = llm_expert_params(llm, range(1))
                got = (got[0] - e, e)
            elif m == "vision":
                got = (float(costs.vision_params(self.model.vision, layers=range(1), patch_embed=False,
                                                 merger=False)), 0.0)
            else:
                a = self.model.audio
                one = costs.audio_params(a, layers=range(1), convs=False, projector=False)
                got = (float(one - costs.audio_params(a, layers=range(0), convs=False, projector=False)), 0.0)
            self._work_cache[key] = got
        return got

    def _layer_on_rank(self, m: str) -> float:
        """One block's parameters on a rank of its layout (tp, ep split; no data-parallel sharding)."""
        lay = self.plan.layouts[m]
        dense, expert = self._layer_params(m)
        return dense / lay.tp + expert / lay.tp / max(1, lay.ep)

    def _backward_order(self, rank: int, module: str, stage: int) -> list[int]:
        """The microbatches whose backward `rank` runs for (module, stage), in order."""
        key = ("bwd-order", rank, module, stage)
        got = self._sig_cache.get(key)
        if got is None:
            got = self._sig_cache[key] = [a.microbatch for a in self.plan.actions.get(rank, [])
                                          if a.kind == BACKWARD and a.module == module and a.stage == stage]
        return got

    def _first_backward(self, rank: int, module: str) -> tuple[int, int] | None:
        """(stage, microbatch) of the module's first backward on `rank`."""
        key = ("first-bwd", rank, module)
        if key not in self._sig_cache:
            first = next(((a.stage, a.microbatch) for a in self.plan.actions.get(rank, [])
                          if a.kind == BACKWARD and a.module == module), None)
            self._sig_cache[key] = first
        return self._sig_cache[key]

    def _backward_grads(self, rank: int, a) -> tuple[float, float, float, float, float, float]:
        """Gradient bytes of this backward, per the module's data-parallel mode and the stack:
        (what each layer leaves for good; what appears at the start, for the stage's head (the LLM's
        final norm and output projection, an encoder's stem and merger); what the end leaves (the
        embedding's, the root's reduction); the end's transient extra; one layer's transient gradient
        buffers; held activation bytes the start releases early).

        - FSDP2 (this project's runtime, torchtitan): a layer's bf16 gradient is copied into an fp32
          reduce-scatter input (the previous layer's still in flight) and the rank keeps its fp32
          shard; the root unit (embedding, head) holds its bf16 gradients until it reduces last. Where
          the stack reduces only in a stage's last backward microbatch (`_defers_reduce`), FSDP2
          accumulates whole (unsharded) fp32 gradients until then, adding each microbatch's through
          an fp32 copy;
        - DDP / ZeRO (this project's runtime): the fp32 gradient appears with a stage's first
          backward (its bf16 source is transient); later microbatches add an fp32 copy into it;
        - Megatron: gradient accumulation fusion writes into the static main-grad buffer.

        This runtime's chunked loss holds the output projection's fp32 weight gradient from the
        forward (costs.loss_memory); its backward scales it into a new tensor (its transient,
        `Work.loss_backward`) that becomes the weight's gradient (cast to bf16 under FSDP) and
        releases the held one.

        Every term depends on the rank only through its data-parallel mode and where the microbatch
        stands in the stage's backward order: worked out once per such case (asked by every backward)."""
        module = a.module
        mode, n = self._dp_mode(module, rank)
        order = self._backward_order(rank, module, a.stage)
        first, last = bool(order) and a.microbatch == order[0], bool(order) and a.microbatch == order[-1]
        single = len(order) <= 1  # the stage's only backward microbatch on this rank
        key = ("backward-grads", module, a.stage, mode, n, first, last, single)
        got = self._sig_cache.get(key)
        if got is None:
            got = self._sig_cache[key] = self._backward_grads_of(rank, module, a.stage, mode, n, first, last, single)
        return got

    def _backward_grads_of(self, rank: int, module: str, stage: int, mode: str, n: int, first: bool, last: bool,
                           single: bool) -> tuple[float, float, float, float, float, float]:
        d = self._dtypes(module, rank)
        if d.grads_static or module in self.frozen:  # a frozen LLM's backward makes input gradients only
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        lay = self.plan.layouts[module]
        lp = self._layer_on_rank(module)
        w = self.work(module, stage, ())
        total = (w.params - w.expert_params) / lay.tp + w.expert_params / lay.tp / max(1, lay.ep)
        root = max(0.0, total - w.layers * lp)
        embed = 0.0
        if module == "llm" and stage == 0:
            embed = min(root, self.model.llm.vocab * self.model.llm.hidden / lay.tp)
        head = root - embed
        handover = 0.0
        if self.memory_stack == "eager" and module == "llm" and stage == lay.stages - 1:
            handover = 4.0 * self.model.llm.vocab * self.model.llm.hidden / lay.tp
        if mode in ("fsdp", "hsdp") and self._zero3_buckets:
            # DeepSpeed ZeRO-3: each parameter's gradient (in the parameters' dtype) waits in the reduce
            # bucket until the bucket is full, is reduce-scattered with it and dropped; the rank keeps
            # its partition, accumulated across microbatches (stage3.py
            # `reduce_independent_p_g_buckets_and_remove_grads`, `reduce_ipg_grads`)
            g = d.grads
            per = g / n if first else 0.0
            return per * lp, g * head, per * root - g * head, g * embed, self._zero3_grad_buffer(module), handover
        if mode in ("fsdp", "hsdp"):
            reduce = 2 * lp + 4 * lp  # the layer's bf16 gradient, the previous layer's fp32 reduce-scatter input
            if single or not self._defers_reduce(module):
                # every microbatch reduce-scatters; the first creates the rank's shard, later ones add
                per, buf = (4 / n if first else 0.0), reduce
            elif first:
                per, buf = 4.0, 2 * lp
            elif last:
                per, buf = -4 + 4 / n, reduce
            else:
                per, buf = 0.0, 2 * lp + 4 * lp
            return per * lp, 2 * head, per * root - 2 * head, 2 * embed, buf, handover
        if first:
            return d.grads * lp, d.grads * head, d.grads * embed, 0.0, 2 * lp, handover
        return 0.0, 0.0, 0.0, 0.0, 2 * lp + d.grads * lp, handover

    def _defers_reduce(self, module: str) -> bool:
        """Whether FSDP reduce-scatters only in a stage's last backward microbatch, accumulating whole
        (unsharded) fp32 gradients until then: torchtitan under pipelining does
        (torch.distributed.pipelining's `backward_maybe_with_nosync`). FSDP2's default, which this
        project's runtime keeps with or without pipelining, torchtitan's gradient accumulation without
        pipelining, Composer and Megatron reduce-scatter every microbatch into the sharded gradient."""
        if getattr(self.options, "fsdp_reduce_every_microbatch", False) or self.memory_stack == "eager":
            return False
        return self.memory_stack.startswith("torchtitan") and self.plan.layouts[module].pp > 1

    def _compute_memory(self, rank: int, a, work: Work) -> tuple[float, float]:
        """(high point over what was live before, bytes left after) of one forward or backward of a
        module stage on one microbatch.

        Forward: its activations (and, where autocast casts fp32 weights, the casts it keeps), with
        the loss's transient at its end, or one block's working set where blocks recompute. Backward,
        walked layer by layer from the top: the loss's backward and the head's gradients first, then per
        layer its recomputed activations, working set and gradient buffers on top of what is still
        held; each layer frees its activations and leaves its gradient; the embedding's gradient comes
        last. Whichever point is highest sets the peak (the start when activations outweigh
        gradients, the end under full recomputation)."""
        module = a.module
        if module in self.frozen and module != "llm":
            return self._frozen_encoder_memory(module, work), 0.0
        copies = self._weight_copies(module, rank, a.stage)
        held = self._live_activation(work) + (0.0 if work.chunks else copies)
        residual = self._fp32_residual(module, rank, work)
        replicated = self._replicated_norms(module, work)
        if self.policy[module] != "full":
            held += work.layers * residual
        held += work.layers * replicated
        if a.kind != BACKWARD:
            extra = work.loss_forward
            if extra and self._casts(module, rank):
                extra += 2.0 * self.model.llm.vocab * self.model.llm.hidden / self.plan.layouts[module].tp  # autocast's cast
            if self.policy[module] != "none":
                extra = max(extra, work.act_working)
            return held + extra, held
        n = work.layers
        lp = self._layer_on_rank(module)
        layer_held = (work.act_layer + (2 * lp if copies else 0.0) + (residual if self.policy[module] != "full" else 0.0)
                      + replicated)
        if self.policy[module] == "none":
            layer_held += self._scores(work)
        g_layer, g_start, g_end, end_extra, buffers, release = self._backward_grads(rank, a)
        if work.chunks:
            # a chunked encoder's transient already holds one block's backward working set, measured
            # with MemTracker (flops._chunked_memory): its gradient buffers and the root's are in it
            g_end += g_start
            g_start = buffers = 0.0
        recompute = work.act_transient
        if self.policy[module] == "full" and self._casts(module, rank):
            recompute += 2 * lp + residual  # the recomputed forward casts the block's weights again
        if self.policy[module] != "none":
            recompute += self._scores(work)
        # unfused attention's backward makes s x s gradients beside the held scores (the dropout
        # output's and then the softmax output's, 2 bytes each of the 5 held per score, each freed once
        # the next is made); the MLP's working set is gone by then, so the larger of the two counts
        step = recompute + max(work.act_working, 0.4 * self._scores(work)) + buffers
        peak = work.loss_backward
        start = g_start - release
        if n:
            peak = max(peak, start + g_layer + step, start + (n - 1) * (g_layer - layer_held) + g_layer + step)
        delta = g_start + g_end + n * g_layer - held
        return max(peak, delta + end_extra), delta

    def _frozen_encoder_memory(self, module: str, work: Work) -> float:
        """The high point of a frozen encoder's forward, which runs as under torch.no_grad (no backward
        follows it: systems/common.py `drop_frozen`): each block's activations live only while the block
        runs, whatever the recompute mode, and nothing stays for a backward (its output, at the LLM's
        width, is the LLM's input, counted there)."""
        enc = self.model.encoders[module]
        per_token = costs.vision_layer_bytes(enc) if module == "vision" else costs.audio_layer_bytes(enc)
        return work.tokens * per_token / self.plan.layouts[module].tp if work.layers else 0.0

    def _fp32_residual(self, module: str, rank: int, work: Work) -> float:
        """Per LLM layer, what this runtime's blocks keep beyond costs.llm_layer_bytes when autocast
        runs them over fp32 weights (one rank, DDP): the fp32 token embedding makes the residual
        stream fp32, so each RMSNorm keeps three fp32 [T, hidden] tensors (input, normalised, scaled
        output) instead of one fp32 copy and two bf16 ones, and each of the five linears reading a
        norm's output (q, k, v; w1, w3) casts it to bf16 for itself: 18 bytes per token and hidden
        unit more (saved-tensor hooks under autocast, one Qwen2-7B block: 290,836 bytes per token
        against 225,288 in bf16)."""
        if module != "llm" or self.memory_stack != "eager" or not self._casts(module, rank) or not work.layers:
            return 0.0
        return 18.0 * self.model.llm.hidden * work.tokens / self.plan.layouts[module].tp

    def _replicated_norms(self, module: str, work: Work) -> float:
        """Per LLM layer, what Megatron's blocks keep beyond 1/tp without sequence parallelism
        (SimOptions.sequence_parallel off, tensor parallelism on): the layer-norm regions run on every
        tp rank whole, so their inputs and outputs (the two norms' inputs, the attention's and the
        MLP's inputs) are not split (Korthikanti et al. 2022 Table 2: 10sbh of 34sbh, less the dropout
        masks); under full recomputation the block's input too."""
        lay = self.plan.layouts[module]
        if (module != "llm" or lay.tp < 2 or not self.activation_stack.startswith("megatron")
                or getattr(self.options, "sequence_parallel", True) or not work.layers):
            return 0.0
        per_token = 2 * self.model.llm.hidden * (1 if self.policy[module] == "full" else 4)
        return per_token * work.tokens * (1 - 1 / lay.tp)

    def _casts(self, module: str, rank: int) -> bool:
        """Whether autocast casts fp32 weights to bf16 in this module's forward (no FSDP, fp32 weights)."""
        mode, _ = self._dp_mode(module, rank)
        return mode not in ("fsdp", "hsdp") and self._dtypes(module, rank).weights == 4

    def _static_memory(self, rank: int) -> float:
        """What a rank holds all step: each module's weights (with master copies) and, for modules it
        trains, AdamW state under the module's data-parallel mode (gradients come with the first
        backward, `_backward_grads`, unless the stack allocates them at start-up), plus FSDP's
        gathered bf16 parameters. AdamW creates state only for parameters that get a gradient: a
        module the step never runs backward for on this rank (no audio in the batch) holds its
        weights alone."""
        trained = {a.module for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD} - self.frozen
        # a function of each module's data-parallel mode, pipeline stage and whether the rank trains it:
        # worked out once per such case (asked for every class)
        index = self.index
        key = tuple((m, self._dp_mode(m, rank), index[m].coords[rank].get("pp", 0), m in trained)
                    for m in self.plan.layouts if rank in index[m].coords)
        got = self._static_of.get(key)
        if got is None:
            got = self._static_of[key] = self._static_memory_of(rank, trained)
        return got

    def _static_memory_of(self, rank: int, trained: set[str]) -> float:
        mem = 0.0
        for m in self.plan.layouts:
            if rank not in self.index[m].coords:
                continue
            state = self._module_state(m, rank)
            mem += state.params + (state.optimizer if m in trained else 0.0)
            if self._dtypes(m, rank).grads_static:
                mem += state.grads
            mem += self._gathered_bytes(m, rank)
        return mem

    def _rank_memory(self, stats, rank: int, peak_live: float, peak_at=None) -> None:
        """A rank's memory figures from its static state and the timeline's peak of live bytes."""
        stats.memory_peak_at = str(peak_at) if peak_at is not None else ""
        stats.memory_static = self._static_memory(rank)
        stats.memory_allocated = stats.memory_static + peak_live
        stats.memory_reserved = FRAGMENTATION * stats.memory_allocated
        device = self.cluster.gpu.name
        comms = communicators(self.plan, rank)
        stats.memory_bytes = stats.memory_reserved + allocator_need(self.memory_stack, device).outside_for(comms)
        stats.memory_needed = memory_needed(stats.memory_allocated, self.memory_stack, device, comms)

"""Memory per rank: what a rank holds all step and what its actions add and free.

Static: each module's training state under its data-parallel mode (`Layout.dp_mode`: DDP, ZeRO-1,
ZeRO-2, FSDP, HSDP) in the bytes per parameter its software stack keeps
(`omnibench.specs.costs.STATE_DTYPES`), and FSDP's gathered bf16 parameters. Timeline (simulator/
engine.py's rank process): the activations of the microbatches in flight, counted from the action
order, so 1F1B's in-flight depth and dynamic sequence lengths both show; gradients from a module's
first backward (ZeRO-2 in this project's runtime: whole until the module's grad_sync reduce-scatters
them, its shard after); a recomputed layer only inside its backward; the flat gradient buffer of a
non-FSDP grad_sync while it runs.
"""

from __future__ import annotations

from omnibench.plan import (
    BACKWARD,
)
from omnibench.specs import costs
from simulator.flops import (
    Work,
)
from simulator.hardware import GiB

RESERVED_BYTES = 1.0 * GiB  # CUDA context, NCCL buffers, allocator slack
ZERO_BUCKET_ELEMS = 40_000_000  # omnibench/runtime/zero.py BUCKET_ELEMS (Megatron-LM's DDP bucket)

# The training-state convention (costs.STATE_DTYPES) of each kernel stack (simulator/kernels.py::Stack):
# "eager" is this project's runtime, "fused" Megatron-LM's.
STATE_OF_STACK = {"eager": "eager", "fused": "megatron"}


class MemoryMixin:
    """The Engine's memory accounting (needs WorkMixin and GroupsMixin)."""

    @property
    def state_stack(self) -> str:
        """The stack whose training-state dtypes this simulation charges (SimOptions.memory_stack,
        else the kernel stack's own)."""
        name = getattr(self.options, "memory_stack", "") or STATE_OF_STACK.get(self.options.stack, "eager")
        return name if name in costs.STATE_DTYPES else "eager"

    def _dp_mode(self, module: str, rank: int) -> tuple[str, int]:
        """(data-parallel mode, ranks the state is sharded over) of `module` on `rank`. FSDP and ZeRO
        need peers: a group of one rank holds everything (the runtime applies no FSDP there)."""
        lay = self.plan.layouts[module]
        if rank not in self.index[module].coords:
            return "ddp", 1
        if lay.fsdp:
            n = len(self._shard_group(module, rank))
            return ("hsdp" if lay.hsdp else "fsdp", n) if n > 1 else ("ddp", 1)
        n = len(self._grad_group(module, rank))
        return (lay.dp_mode, n) if n > 1 else ("ddp", 1)

    def _model_parallel_params(self, module: str, rank: int) -> tuple[float, float]:
        """(dense, expert) parameters of the rank's model-parallel part (its stage, its tp shard, its
        experts), before any data-parallel sharding; (0, 0) on a rank the module does not use."""
        lay, idx = self.plan.layouts[module], self.index[module]
        if rank not in idx.coords:
            return 0.0, 0.0
        w = self.stage_work(module, idx.coords[rank].get("pp", 0))
        return (w.params - w.expert_params) / lay.tp, w.expert_params / lay.tp / max(1, lay.ep)

    def _module_state(self, module: str, rank: int) -> costs.StateBytes:
        """Weights (with master copies), gradients and AdamW state of `module` on `rank` under its
        data-parallel mode; experts are sharded over the ranks holding the same experts (dp*cp/ep)."""
        mode, n = self._dp_mode(module, rank)
        dense, expert = self._model_parallel_params(module, rank)
        stack = self.state_stack
        a = costs.dp_state_bytes(dense, mode, n, stack)
        if not expert:
            return a
        ep = max(1, self.plan.layouts[module].ep)
        b = costs.dp_state_bytes(expert, mode, max(1, n // ep), stack)
        return costs.StateBytes(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer)

    def _dtypes(self, module: str, rank: int) -> costs.StateDtypes:
        return costs.state_dtypes(self.state_stack, self._dp_mode(module, rank)[0])

    def _grad_timeline(self, module: str, rank: int) -> tuple[float, float]:
        """(bytes that appear with the module's first backward on the rank, bytes its grad_sync adds
        (+) or frees (-)). A stack with a static gradient buffer holds it all step (`_static_memory`)
        instead. This project's runtime accumulates whole fp32 gradients in every mode but FSDP; under
        ZeRO its grad_sync reduce-scatters them into the rank's fp32 slice, and ZeRO-2 frees the whole
        ones then (omnibench/runtime/zero.py)."""
        d = self._dtypes(module, rank)
        if d.grads_static:
            return 0.0, 0.0
        mode, n = self._dp_mode(module, rank)
        state = self._module_state(module, rank)
        if mode.startswith("zero"):
            dense, expert = self._model_parallel_params(module, rank)
            whole = d.grads * (dense + expert)
            return whole, state.grads - (whole if mode == "zero2" else 0.0)
        return state.grads, 0.0

    def _grad_sync_buffer(self, module: str, rank: int) -> float:
        """Bytes a grad_sync allocates while it runs in this project's runtime
        (omnibench/runtime/communication.py): DDP reduces every gradient through one flat fp32 buffer
        (`torch.cat`); ZeRO reduce-scatters bucket by bucket (a padded fp32 bucket of at most
        zero.BUCKET_ELEMS, Megatron-LM's default bucket, and its slice). FSDP reduce-scatters inside
        the backward; stacks with a contiguous gradient buffer reduce it in place."""
        mode, n = self._dp_mode(module, rank)
        if n < 2 or mode in ("fsdp", "hsdp") or self.state_stack == "megatron":
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
        mode, _ = self._dp_mode(module, rank)
        if mode in ("fsdp", "hsdp") or self.policy[module] == "full":
            return 0.0
        if self._dtypes(module, rank).weights != 4:
            return 0.0
        dense, expert = self._model_parallel_params(module, rank)
        return 2 * (dense + expert)

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

    def _params_on_rank(self, rank: int) -> float:
        return sum(self._module_params_on_rank(m, rank) for m in self.plan.layouts)

    def _module_params_on_rank(self, m: str, rank: int) -> float:
        """Parameters whose weights `rank` holds: its FSDP shard, or its whole model-parallel part."""
        mode, n = self._dp_mode(m, rank)
        dense, expert = self._model_parallel_params(m, rank)
        if mode not in ("fsdp", "hsdp"):
            return dense + expert
        ep = max(1, self.plan.layouts[m].ep)
        return dense / n + expert / max(1, n // ep)

    def _stepped_params_on_rank(self, rank: int) -> float:
        """Parameters whose optimizer state `rank` holds and steps: its shard under ZeRO-1/2 and
        FSDP, everything it holds under DDP."""
        out = 0.0
        for m in self.plan.layouts:
            mode, n = self._dp_mode(m, rank)
            dense, expert = self._model_parallel_params(m, rank)
            ep = max(1, self.plan.layouts[m].ep)
            out += dense + expert if mode == "ddp" else dense / n + expert / max(1, n // ep)
        return out

    def _gathered_bytes(self, m: str, rank: int) -> float:
        """FSDP's gathered bf16 parameters held all step: the current and the prefetched layer when
        FSDP reshards after forward, the whole stage when it keeps them."""
        mode, _ = self._dp_mode(m, rank)
        if mode not in ("fsdp", "hsdp"):
            return 0.0
        lay = self.plan.layouts[m]
        w = self.stage_work(m, self.index[m].coords[rank].get("pp", 0))
        layers = min(2, max(1, w.layers)) if self.reshard_after_forward else max(1, w.layers)
        return 2 * w.params / lay.tp * layers / max(1, w.layers)

    def _static_memory(self, rank: int) -> float:
        """What a rank holds all step: each module's weights (with master copies) and, for modules it
        trains, AdamW state under the module's data-parallel mode (gradients come with the first
        backward, `_grad_timeline`, unless the stack allocates them at start-up), plus FSDP's
        gathered bf16 parameters. AdamW creates state only for parameters that get a gradient: a
        module the step never runs backward for on this rank (no audio in the batch) holds its
        weights alone."""
        trained = {a.module for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD}
        mem = RESERVED_BYTES
        for m in self.plan.layouts:
            if rank not in self.index[m].coords:
                continue
            state = self._module_state(m, rank)
            mem += state.params + (state.optimizer if m in trained else 0.0)
            if self._dtypes(m, rank).grads_static:
                mem += state.grads
            mem += self._gathered_bytes(m, rank)
        return mem

"""Memory per rank: what a rank holds all step and what its actions add and free.

Static: bf16 + fp32 master params, fp32 grads and AdamW moments (sharded over the FSDP group, or
its shard group under HSDP), one layer of gathered bf16 params. Timeline (simulator/engine.py's
rank process): the activations of the microbatches in flight, counted from the action order, so
1F1B's in-flight depth and dynamic sequence lengths both show; gradients from a module's first
backward; a recomputed layer only inside its backward.
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


class MemoryMixin:
    """The Engine's memory accounting (needs WorkMixin and GroupsMixin)."""

    def _weight_copies(self, module: str, rank: int, stage: int) -> float:
        """bf16 weight copies one forward keeps for its backward where FSDP holds no bf16 parameters
        (one rank or --no-fsdp: autocast casts the fp32 weights per forward and autograd saves the
        casts); under full recomputation blocks save only their input, the casts are made again."""
        lay = self.plan.layouts[module]
        if (lay.fsdp and len(self._shard_group(module, rank)) > 1) or self.policy[module] == "full":
            return 0.0
        return 2 * self._module_params_on_rank(module, rank)

    def _live_activation(self, work: Work) -> float:
        """costs.py counts activations for a flash-style core under the recompute policy; a kernel
        profile with unfused attention also keeps each layer's s x s scores for the backward
        (softmax output and dropout output in bf16, dropout mask in bytes: 5 bytes per score,
        Korthikanti et al. 2022 eq. 1's 5as^2b term) unless recomputation drops them. Less the
        recomputed layer that exists only during the backward (`_Op.act_transient`)."""
        out = work.act_bytes - work.act_transient
        prof = self.compute.kernels
        if (prof is not None and (self.options.attention or prof.attention_kernel) == "unfused" and work.shape is not None
                and self.policy["llm"] == "none"):
            out += 5.0 * work.shape.layers * work.shape.heads * sum(x * x for x in work.shape.seq_lens)
        return out

    def _params_on_rank(self, rank: int) -> float:
        return sum(self._module_params_on_rank(m, rank) for m in self.plan.layouts)

    def _module_params_on_rank(self, m: str, rank: int) -> float:
        lay, idx = self.plan.layouts[m], self.index[m]
        if rank not in idx.coords:
            return 0.0
        w = self.stage_work(m, idx.coords[rank].get("pp", 0))
        shard = len(self._shard_group(m, rank)) if lay.fsdp else 1  # HSDP: the shard group only
        dense = w.params - w.expert_params
        etp = 1 if lay.expert_tp == 1 else lay.tp  # folded experts (expert_tp 1) are whole on their rank
        return dense / lay.tp / shard + w.expert_params / etp / max(1, lay.ep) / max(1, shard // lay.ep)

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

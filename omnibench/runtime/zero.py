"""ZeRO-1 and ZeRO-2 for a module that data parallelism replicates (`Layout.zero`, fsdp off).

Every rank keeps the module's whole weights, so its forward and backward never wait for a peer
(FSDP gathers each layer from the shard group, which locks the members layer by layer; omni's
joint pipeline needs encoder work that can run whenever a rank has a gap). What is sharded over the
module's data-parallel group (`Groups` "dp" for encoders, "dpcp" for the LLM) is the training
state, the way Megatron-LM's distributed optimizer and DeepSpeed ZeRO-1/2 hold it:

- the fp32 master weights and AdamW's two moments: each rank owns one contiguous 1/n of every
  bucket of the flattened parameters and steps only that (ZeRO-1 and ZeRO-2);
- the gradients, at grad_sync: one reduce-scatter per bucket gives each rank the sum of its
  slice over the group. ZeRO-2 then frees the full gradients (only the slice is kept until the
  step); ZeRO-1 keeps them until the step ends (Megatron's main-grad buffer);
- after the step every rank all-gathers the updated slices into its weights (in the weights'
  dtype): the second half of what DDP's all-reduce moved, so ZeRO costs DDP's bytes.

The weights themselves are held in the run's compute dtype (bf16 on a GPU run, fp32 on CPU), the
master copy in fp32: a bf16 weight's gradients accumulate, across microbatches, into an fp32 main
gradient (a post-accumulate hook, as Megatron's `main_grad`), never in bf16.

Hybrid (`Layout.hybrid`, omni's `encoder_dp=hzero2`): the group above is a shard group of a few nodes
and the state is replicated across the shard groups, as Megatron-Core's partial distributed optimizer
(`num_distributed_optimizer_instances`) holds it: after the reduce-scatter inside the shard group,
each slice is all-reduced over its replicate group (the ranks of the other shard groups holding the
same slice), so every ring spans tens of ranks, not the whole world.

Buckets: `BUCKET_ELEMS` elements of the flattened parameters, Megatron-LM's default DDP bucket
size (`bucket_size = max(40_000_000, 1_000_000 * dp)`, megatron/core/distributed/
distributed_data_parallel.py), so the padded gradient and gather buffers stay bounded.

Written by hand: `torch.distributed.optim.ZeroRedundancyOptimizer` is ZeRO-1 only, assigns whole
parameters to ranks (uneven shards, a broadcast per parameter after the step) and shards no
gradients. Experts split over an ep group are left to the plain optimizer (their own reduction).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omnibench.runtime.master import cast_in_place, local_shard

BUCKET_ELEMS = 40_000_000


class ShardedState:
    """One module's ZeRO-sharded training state on one rank."""

    def __init__(self, name: str, params: list[nn.Parameter], group, stage: int, optimizer: str, lr: float,
                 param_dtype: torch.dtype = torch.float32, bucket_elems: int = BUCKET_ELEMS, replicate=None):
        if stage not in (1, 2):
            raise ValueError(f"zero: stage {stage} must be 1 or 2")
        self.name, self.stage, self.group = name, stage, group
        self.replicate = replicate  # hybrid: the ranks holding the same slice in the other shard groups
        self.params = params
        self.n = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        sizes = [local_shard(p).numel() for p in params]
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        total = offsets[-1]
        # Each bucket: its flat range, its slice length per rank, and the parameter pieces it covers.
        self.buckets: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
        for lo in range(0, total, bucket_elems):
            hi = min(total, lo + bucket_elems)
            pieces = [(k, max(lo, offsets[k]) - offsets[k], min(hi, offsets[k + 1]) - offsets[k])
                      for k in range(len(params)) if offsets[k] < hi and offsets[k + 1] > lo]
            self.buckets.append((lo, hi, -(-(hi - lo) // self.n), pieces))
        self._device = local_shard(params[0]).device if params else torch.device("cpu")
        with torch.no_grad():
            master = [self._bucket(b, lambda k: local_shard(params[k]).detach().float())
                      [self.me * b[2] : (self.me + 1) * b[2]] for b in self.buckets]
            self.master = nn.Parameter(torch.cat(master) if master else torch.zeros(0, device=self._device))
            for p in params:
                cast_in_place(p, param_dtype)
        from omnibench.runtime.optim import make_optimizer

        self.optimizer = make_optimizer(optimizer, [self.master], lr)
        # bf16 weights: fp32 main gradients, accumulated by a hook (the weight's own .grad is dropped)
        self.main: list[torch.Tensor | None] = [None] * len(params)
        self.hooked = param_dtype != torch.float32
        if self.hooked:
            for k, p in enumerate(params):
                p.register_post_accumulate_grad_hook(self._accumulate(k))
        self.grad_shard: list[torch.Tensor] | None = None

    def _accumulate(self, k: int):
        def hook(p: torch.Tensor) -> None:
            g = local_shard(p.grad).float()
            if self.main[k] is None:
                self.main[k] = g if g is not local_shard(p.grad) else g.clone()
            else:
                self.main[k].add_(g)
            p.grad = None

        return hook

    def _grad(self, k: int) -> torch.Tensor | None:
        if self.hooked:
            return self.main[k]
        g = self.params[k].grad
        return None if g is None else local_shard(g)

    def _bucket(self, bucket, value) -> torch.Tensor:
        """A bucket's flat values, padded to n slices: `value(k)` is parameter k's tensor or None (zeros)."""
        lo, hi, s, pieces = bucket
        parts = []
        for k, a, b in pieces:
            v = value(k)
            parts.append(v.reshape(-1)[a:b].float() if v is not None else torch.zeros(b - a, device=self._device))
        pad = self.n * s - (hi - lo)
        if pad:
            parts.append(torch.zeros(pad, device=self._device))
        return torch.cat(parts)

    def reduce(self) -> None:
        """grad_sync: each rank's slice of the gradients, summed over the group (reduce-scatter), and
        hybrid, over the replicate group too (all-reduce of the slice)."""
        shards = []
        for bucket in self.buckets:
            flat = self._bucket(bucket, self._grad)
            out = torch.empty(bucket[2], device=self._device)
            dist.reduce_scatter_single(out, flat, group=self.group)
            if self.replicate is not None:
                dist.all_reduce(out, group=self.replicate)
            shards.append(out)
        self.grad_shard = shards
        if self.stage == 2:  # only the slice outlives the reduction
            self._drop_grads()

    def _drop_grads(self) -> None:
        self.main = [None] * len(self.params)
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """The optimizer over this rank's slice, then every rank's updated slices into the weights.
        A module whose gradients were not reduced this step (no work in the batch) is not stepped,
        as AdamW skips a parameter without a gradient."""
        if self.grad_shard is None:
            return
        self.master.grad = torch.cat(self.grad_shard) if self.grad_shard else torch.zeros_like(self.master)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_shard = None
        at = 0
        with torch.no_grad():
            for _, _, s, pieces in self.buckets:
                dtype = local_shard(self.params[pieces[0][0]]).dtype
                full = torch.empty(self.n * s, dtype=dtype, device=self._device)
                dist.all_gather_single(full, self.master[at : at + s].detach().to(dtype), group=self.group)
                at += s
                pos = 0
                for k, a, b in pieces:
                    w = local_shard(self.params[k])
                    w.view(-1)[a:b].copy_(full[pos : pos + b - a])
                    pos += b - a

    def zero_grad(self) -> None:
        self._drop_grads()
        self.grad_shard = None


class Optimizers:
    """The optimizers of one rank: each module whose training state is held apart (ZeRO-sharded,
    `ShardedState`; bf16 weights with an fp32 master, master.py `MasterWeights`) with its own state,
    everything else under one plain optimizer. Stepped and cleared together (the executor's
    optimizer_step); grad_sync reduces a held-apart module through its state's `reduce`."""

    def __init__(self, plain: torch.optim.Optimizer | None, states: dict):
        self.plain = plain
        self.states = states

    def step(self) -> None:
        if self.plain is not None:
            self.plain.step()
        for s in self.states.values():
            s.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.plain is not None:
            self.plain.zero_grad(set_to_none=set_to_none)
        for s in self.states.values():
            s.zero_grad()

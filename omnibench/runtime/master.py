"""bf16 weights with an fp32 master copy, for a module that no rank shards (`--mixed-precision master`).

A bf16 run has three ways to hold a module's weights in this runtime: FSDP2's MixedPrecisionPolicy
(fp32 shards, bf16 layers gathered per use), ZeRO-1/2 (zero.py: bf16 weights, the fp32 master
sharded) and, for a module FSDP does not hold (one rank, DDP), either

- "autocast": fp32 weights that autocast casts to bf16 in every forward, op by op (torchtitan without
  FSDP). On one H100 the plain bf16 stack lost 8.5% of its TFLOP/s held this way
  (results/gpu/2026-11-27-h100): each forward re-reads and re-writes every weight, the token
  embedding's fp32 output makes the LLM's residual stream fp32, and every norm and residual add runs
  at twice the bytes;
- "master" (this file): bf16 weights, which the forward and backward use as they are, with the fp32
  master copy and AdamW's moments in the optimizer and the gradients accumulated in fp32 main
  gradients by a post-accumulate hook, as Megatron-LM's mixed precision holds them
  (`main_grad`, `Float16OptimizerWithFloat16Params`). The arithmetic is FSDP2's with
  param_dtype=bf16 and reduce_dtype=fp32 on a group of one, so a one-rank run computes what a
  sharded run computes.

Under DDP the fp32 main gradients are what grad_sync all-reduces (the bytes of today's fp32 gradients).
Experts split over an ep group stay in the plain optimizer (their own reduction), fp32 under autocast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# the key of the LLM experts' state in zero.Optimizers.states, held apart from its dense weights
# (build.py `_expert_state`): "llm:experts"
EXPERTS_SUFFIX = ":experts"


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (tensor-parallel weights), else the tensor."""
    return getattr(t, "_local_tensor", t)


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in place through one flat buffer (DDP's bucket): per-tensor calls
    would each pay the collective's latency."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


def cast_in_place(p: nn.Parameter, dtype: torch.dtype) -> None:
    """`p` becomes a `dtype` parameter, the same Python object (the module and any list keep it).
    `p.data = p.data.to(dtype)` is not enough for a tensor-parallel DTensor: it changes the wrapper's
    dtype and leaves its local shard in the old one, and the next matmul mixes the two."""
    if p.dtype != dtype:
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))


class MasterWeights:
    """One module's bf16 weights and its fp32 training state on one rank (the whole state: no sharding)."""

    def __init__(self, name: str, params: list[nn.Parameter], group, optimizer: str, lr: float,
                 param_dtype: torch.dtype = torch.bfloat16):
        from omnibench.runtime.optim import make_optimizer

        self.name, self.group, self.params = name, group, params
        self.n = dist.get_world_size(group) if group is not None else 1
        with torch.no_grad():
            self.master = [nn.Parameter(local_shard(p).detach().float().clone()) for p in params]
            for p in params:
                cast_in_place(p, param_dtype)
        self.optimizer = make_optimizer(optimizer, self.master, lr)
        self.main: list[torch.Tensor | None] = [None] * len(params)
        for k, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._accumulate(k))

    def _accumulate(self, k: int):
        def hook(p: torch.Tensor) -> None:
            g = local_shard(p.grad)
            if self.main[k] is None:
                self.main[k] = g.float()
            else:
                self.main[k].add_(g)
            p.grad = None

        return hook

    def reduce(self) -> None:
        """grad_sync: the fp32 main gradients summed over the data-parallel group (one flat all-reduce,
        DDP's bucket), nothing to do on a group of one. A module without gradients this step (no work
        in the batch) is left alone, as AdamW skips a parameter without a gradient."""
        if self.n == 1 or all(g is None for g in self.main):
            return
        self.main = [g if g is not None else torch.zeros_like(m) for g, m in zip(self.main, self.master, strict=True)]
        all_reduce_flat(self.main, self.group)

    def step(self) -> None:
        """AdamW over the fp32 masters that have a gradient, then those masters into the bf16 weights."""
        stepped = [k for k, g in enumerate(self.main) if g is not None]
        if not stepped:
            return
        for k in stepped:
            self.master[k].grad = self.main[k]
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_([local_shard(self.params[k]) for k in stepped], [self.master[k] for k in stepped])
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.main = [None] * len(self.params)
        for p in self.params:
            p.grad = None

    def full_tensors(self) -> dict[int, torch.Tensor]:
        """id(weight) -> its fp32 master (what the weights were stepped from: parity compares these)."""
        return {id(p): m for p, m in zip(self.params, self.master, strict=True)}

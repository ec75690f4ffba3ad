"""The optimizer a rank steps its parameters (or its ZeRO slice of them) with."""

from __future__ import annotations

import torch


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

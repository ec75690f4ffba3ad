"""Real PyTorch modules for the multimodal models (Qwen2-VL ViT, Whisper-style audio, Qwen2/Qwen3 LLM).

Importing this package pulls in torch; nothing outside `omnibench.models` / `omnibench.runtime` may.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from omnibench.models.multimodal import MultimodalModel
from omnibench.specs.model import MultimodalSpec

INIT_STD = 0.02


def build_model(
    spec: MultimodalSpec, seed: int | None = 0, attn_backend: str | None = None
) -> MultimodalModel:
    """fp32 model on CPU, initialised from `seed` (None: leave torch's default init)."""
    model = MultimodalModel(spec, attn_backend)
    if seed is not None:
        init_weights(model, seed)
    return model


def _param_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Deterministic init where each parameter's values depend only on (seed, its full name).

    A pipeline stage that deleted layers, or a module built alone and named with `prefix` (e.g.
    "llm." for a bare Transformer), gets exactly the weights the whole model would have.
    Norm weights 1, biases 0, everything else N(0, 0.02). Draws on CPU in fp32, then copies.
    DTensor parameters get the same global values, distributed to their placements.
    """
    norms = (nn.LayerNorm, nn.RMSNorm)
    for mod_name, mod in module.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            full_name = prefix + (f"{mod_name}.{leaf}" if mod_name else leaf)
            if leaf == "bias":
                full = torch.zeros(p.shape)
            elif isinstance(mod, norms):
                full = torch.ones(p.shape)
            else:
                full = torch.empty(p.shape).normal_(
                    0.0, INIT_STD, generator=_param_generator(seed, full_name)
                )
            _copy_full(p, full)


def _copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):  # DTensor
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full.to(dtype=p.dtype, device=p.device))


__all__ = ["MultimodalModel", "build_model", "init_weights"]

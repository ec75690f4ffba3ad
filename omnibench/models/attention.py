"""Attention over packed (varlen) sequences, rotary embeddings, and the norms the models share.

Packed inputs are a flat token dimension [T, heads, head_dim] with `cu_seqlens` marking where each
sequence starts; a token never attends across a boundary. Head counts are read from the tensors,
never from a spec, so tensor-parallel shards (fewer local heads) and context-parallel wrappers that
replace `block.attention.core` from outside both work without touching this file.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("auto", "flash", "sdpa", "math")
ENV_BACKEND = "OMNIBENCH_ATTN"


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str | None = None) -> str:
    """`backend` argument, else $OMNIBENCH_ATTN, else auto: flash-attn on CUDA when installed, else SDPA."""
    name = backend or os.environ.get(ENV_BACKEND, "auto") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "flash" and not flash_available():
        raise ValueError("attention backend 'flash' needs CUDA and the flash-attn package")
    return name


class VarlenAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v per packed sequence; GQA by sharing each kv head across a group of q heads.

    Backends: "flash" (flash_attn_varlen_func; bf16/fp16 on CUDA, GQA native), "sdpa" (one
    F.scaled_dot_product_attention call per sequence: fastest on CPU, see REFERENCE.md), "math"
    (explicit matmuls per sequence: a reference, and the only form torch's FlopCounterMode sees on CPU).
    "auto" picks flash when it can run the given dtype/device, else sdpa.
    """

    def __init__(self, backend: str | None = None):
        super().__init__()
        self.backend = resolve_backend(backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        causal: bool,
    ) -> torch.Tensor:
        backend = self.backend
        if backend == "auto":
            flash_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_available()
            backend = "flash" if flash_ok else "sdpa"
        if backend == "flash":
            return _flash(q, k, v, cu_seqlens, max_seqlen, causal)
        return _per_sequence(q, k, v, cu_seqlens, causal, math=backend == "math")


def _flash(q, k, v, cu_seqlens, max_seqlen, causal):
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(dtype=torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), causal=causal)


def _per_sequence(q, k, v, cu_seqlens, causal, math):
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        qi, ki, vi = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        if math:
            if hkv != hq:
                ki = ki.repeat_interleave(hq // hkv, dim=0)
                vi = vi.repeat_interleave(hq // hkv, dim=0)
            outs.append(_math_attention(qi, ki, vi, causal))
        else:  # native GQA: no repeated K/V copies (about 1.4x faster on CPU for 4 q heads per kv head)
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=hkv != hq))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=1).transpose(0, 1)


def _math_attention(q, k, v, causal):
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)


# --- rotary embeddings (HF "rotate_half" convention, so Qwen2 / Qwen2-VL weights load unchanged) ---


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]. Computed in fp32 (bf16 angles lose positions past a few thousand)."""
    dtype = x.dtype
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    return (xf * c + rotate_half(xf) * s).to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """1D RoPE angles for explicit positions (a context-parallel shard passes its own positions)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    )
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RMSNorm(nn.RMSNorm):
    """RMSNorm computed in fp32 and cast back, as Qwen2 does (nn.RMSNorm keeps the input dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "rms":
        return RMSNorm(dim, eps=eps)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"norm must be one of layer, rms; got {kind!r}")

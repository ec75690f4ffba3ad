"""Attention over packed (varlen) sequences, rotary embeddings, and the norms the models share.

Packed inputs are a flat token dimension [T, heads, head_dim] with `cu_seqlens` marking where each
sequence starts; a token never attends across a boundary. Head counts are read from the tensors,
never from a spec, so tensor-parallel shards (fewer local heads) and context-parallel wrappers that
replace `block.attention.core` from outside both work without touching this file.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("auto", "flash", "varlen", "sdpa", "math")
ENV_BACKEND = "OMNIBENCH_ATTN"


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@cache
def _varlen_fn():
    """torch's own packed attention (`torch.nn.attention.varlen.varlen_attn`, PyTorch >= 2.10) and how
    to ask it for causal masking and GQA, read from its signature: 2.10 takes `is_causal`, 2.11 a
    `window_size=(-1, 0)`, 2.12 adds `enable_gqa`. None when this torch has no such function."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = "window_size" if "window_size" in params else "is_causal" if "is_causal" in params else None
    if causal is None:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def varlen_available() -> bool:
    return torch.cuda.is_available() and _varlen_fn() is not None


def resolve_backend(backend: str | None = None) -> str:
    """`backend` argument, else $OMNIBENCH_ATTN, else auto: on CUDA flash-attn when installed, else
    torch's varlen_attn; the per-sequence SDPA loop on CPU."""
    name = backend or os.environ.get(ENV_BACKEND, "auto") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "flash" and not flash_available():
        raise ValueError("attention backend 'flash' needs CUDA and the flash-attn package")
    if name == "varlen" and not varlen_available():
        raise ValueError("attention backend 'varlen' needs CUDA and torch.nn.attention.varlen.varlen_attn (torch >= 2.10)")
    return name


def auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    """What "auto" runs for tensors of this device and dtype (the fused kernels take bf16/fp16 only)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if flash_available():
            return "flash"
        if _varlen_fn() is not None:
            return "varlen"
    return "sdpa"


class VarlenAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v per packed sequence; GQA by sharing each kv head across a group of q heads.

    Backends: "flash" (flash_attn_varlen_func; bf16/fp16 on CUDA, GQA native), "varlen" (torch's
    own varlen_attn, the same FlashAttention kernels shipped with PyTorch; bf16/fp16 on CUDA),
    "sdpa" (one F.scaled_dot_product_attention call per sequence: fastest on CPU, measured with torch
    2.13 at 45 ms forward for 4,096 tokens, 8 heads, 6 sequences against 258 ms for one block-diagonal
    masked call; flex_attention has no CPU backward and torch's varlen_attn no CPU kernel; on CUDA
    restricted to the fused kernels, never the s x s math kernel), "math" (explicit matmuls
    per sequence: a reference, and the only form torch's FlopCounterMode sees on CPU).
    "auto" picks flash, then varlen, when they can run the given dtype/device, else sdpa.
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
            backend = auto_backend(q.device, q.dtype)
        if backend == "flash":
            return _flash(q, k, v, cu_seqlens, max_seqlen, causal)
        if backend == "varlen":
            return _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal)
        return _per_sequence(q, k, v, cu_seqlens, causal, math=backend == "math")


    def segments(self, q, k, v, cu_q: list[int], cu_k: list[int], causal: bool) -> torch.Tensor:
        """Segment i's queries (rows cu_q[i]:cu_q[i+1] of q) over its own keys (rows cu_k[i]:cu_k[i+1]
        of k, v), for context-parallel ranks that hold part of a sequence's queries and all its keys
        (parallelize.AllGatherKVAttention). A segment's queries are the *last* positions its keys
        reach, so causal masking aligns to the bottom right (query j of Lq sees keys <= j + Lk - Lq),
        as flash-attn's varlen kernels do when Lq < Lk."""
        backend = self.backend
        if backend == "auto":
            backend = auto_backend(q.device, q.dtype)
        if backend in ("flash", "varlen"):
            # bottom-right causal alignment is flash-attn's (>= 2.1) and the kernels torch ships
            cq, ck = (torch.tensor(c, dtype=torch.int32, device=q.device) for c in (cu_q, cu_k))
            mq = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:], strict=True))
            mk = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:], strict=True))
            if backend == "flash":
                from flash_attn import flash_attn_varlen_func

                return flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=causal)
            fn, causal_arg, gqa_flag = _varlen_fn()
            kwargs = {"window_size": (-1, 0) if causal else (-1, -1)} if causal_arg == "window_size" else {"is_causal": causal}
            if gqa_flag:
                kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
            return fn(q, k, v, cq, ck, mq, mk, **kwargs)
        hq, hkv = q.shape[1], k.shape[1]
        outs = []
        for i in range(len(cu_q) - 1):
            qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            if qb == qa:
                continue
            qi, ki, vi = q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1)  # [H, L, D]
            if hkv != hq:
                ki, vi = ki.repeat_interleave(hq // hkv, dim=0), vi.repeat_interleave(hq // hkv, dim=0)
            mask = None
            if causal:
                lq, lk = qb - qa, kb - ka
                mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
            if backend == "math":
                scores = torch.matmul(qi, ki.transpose(-1, -2)) * qi.shape[-1] ** -0.5
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                outs.append(torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(vi.dtype), vi))
            else:
                outs.append(_cpu_sdpa(qi, ki, vi, attn_mask=mask) if not q.is_cuda
                            else F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask))
        if not outs:
            return q.new_zeros(q.shape)
        return torch.cat(outs, dim=1).transpose(0, 1)


def _flash(q, k, v, cu_seqlens, max_seqlen, causal):
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(dtype=torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), causal=causal)


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal):
    fn, causal_arg, gqa_flag = _varlen_fn()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    kwargs = {"window_size": (-1, 0) if causal else (-1, -1)} if causal_arg == "window_size" else {"is_causal": causal}
    if gqa_flag:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    m = int(max_seqlen)
    return fn(q, k, v, cu, cu, m, m, **kwargs)


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
        elif q.is_cuda:
            outs.append(_fused_sdpa(qi, ki, vi, causal))
        else:  # native GQA: no repeated K/V copies (about 1.4x faster on CPU for 4 q heads per kv head)
            outs.append(_cpu_sdpa(qi, ki, vi, is_causal=causal, enable_gqa=hkv != hq))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=1).transpose(0, 1)


def _cpu_sdpa(q, k, v, **kwargs) -> torch.Tensor:
    """SDPA of one [H, L, D] sequence on the CPU, given as a batch of one: torch's CPU flash kernel
    takes only 4-D inputs, and for 3-D ones SDPA silently runs the math kernel, which builds the
    H x L x L scores (benchmarks/models_bench.py's packed attention: about 2x the time forward +
    backward; the same values to float rounding)."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), **kwargs)[0]


def _fused_sdpa(q, k, v, causal):
    """SDPA on CUDA with the fused kernels only. The flash and memory-efficient kernels refuse
    `enable_gqa` and strided [H, L, D] views, and SDPA then silently picks the math kernel, which
    materialises H x L x L scores (3.1 GiB for one 8K sequence of a 7B model): give them contiguous
    [1, H, L, D] inputs with the kv heads repeated, and forbid the math kernel outright."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    q, k, v = (x.unsqueeze(0).contiguous() for x in (q, k, v))
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)[0]


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

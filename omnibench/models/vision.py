"""Qwen2-VL vision transformer: patch embed, 2D RoPE, blocks attending within each frame group, 2x2 merger.

Input patches arrive in Qwen2-VL's processor order: for each image/video, temporal group by
temporal group, and inside a group the `merge x merge` windows are contiguous (row-major over
windows, row-major inside a window). The merger then folds each run of merge^2 patches into one
LLM token. Attention is full (not causal) within one temporal group of one image/video:
cu_seqlens = cumsum(repeat_interleave(h*w, t)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnibench.models.attention import VarlenAttention, apply_rotary, make_norm
from omnibench.specs.model import VisionEncoderSpec

ROPE_THETA = 10_000.0


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride == (temporal_patch, patch, patch), written as the equivalent Linear."""

    def __init__(self, spec: VisionEncoderSpec):
        super().__init__()
        d_in = spec.in_channels * spec.temporal_patch * spec.patch_size**2
        self.proj = nn.Linear(d_in, spec.hidden, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionEncoderSpec, attn_backend: str | None = None):
        super().__init__()
        self.head_dim = spec.hidden // spec.heads
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden, bias=True)
        self.proj = nn.Linear(spec.hidden, spec.hidden, bias=True)
        self.core = VarlenAttention(attn_backend)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, -1, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, cu_seqlens, max_seqlen, causal=False)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionEncoderSpec):
        super().__init__()
        self.kind = spec.mlp
        if spec.mlp == "swiglu":
            self.fc1 = nn.Linear(spec.hidden, 2 * spec.ffn, bias=True)  # gate and up, fused
        else:
            self.fc1 = nn.Linear(spec.hidden, spec.ffn, bias=True)
        self.fc2 = nn.Linear(spec.ffn, spec.hidden, bias=True)

    def forward(self, x):
        h = self.fc1(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "quick_gelu":
            h = h * torch.sigmoid(1.702 * h)
        else:
            h = F.gelu(h)
        return self.fc2(h)


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionEncoderSpec, attn_backend: str | None = None):
        super().__init__()
        self.norm1 = make_norm(spec.norm, spec.hidden, spec.norm_eps)
        self.attention = VisionAttention(spec, attn_backend)
        self.norm2 = make_norm(spec.norm, spec.hidden, spec.norm_eps)
        self.mlp = VisionMLP(spec)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.attention(self.norm1(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, concatenate each merge^2 window, MLP (hidden*merge^2 -> same -> out_hidden)."""

    def __init__(self, spec: VisionEncoderSpec, out_hidden: int):
        super().__init__()
        self.window = spec.merge**2
        d = spec.hidden * self.window
        self.ln_q = make_norm(spec.norm, spec.hidden, spec.norm_eps)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, out_hidden)

    def forward(self, x):
        x = self.ln_q(x).reshape(-1, x.shape[-1] * self.window)
        return self.fc2(F.gelu(self.fc1(x)))


def vision_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch, [N, 2], in Qwen2-VL's merge-window order."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pos = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], -1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def vision_rope(position_ids: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE: a quarter of the frequencies per axis; angles laid out [rows | cols | rows | cols]."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (
        ROPE_THETA ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=position_ids.device) / spatial)
    )
    freqs = position_ids.float()[..., None] * inv_freq  # [N, 2, head_dim/4]
    half = freqs.flatten(1)  # rows then cols
    emb = torch.cat([half, half], dim=-1)
    return emb.cos(), emb.sin()


def vision_cu_seqlens(grid_thw: torch.Tensor) -> tuple[torch.Tensor, int]:
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return cu, int(lengths.max()) if lengths.numel() else 0


class VisionTransformer(nn.Module):
    """forward(pixel_patches [N, C*tp*ps*ps], grid_thw [n, 3]) -> [N / merge^2, out_hidden].

    `out_hidden == 0` in the spec (a bare encoder preset) keeps the merger at the encoder's own width.

    Sequence-parallel use: pass `patch_range=(start, end)` with only those patches of the full
    concatenated sequence (both multiples of merge^2, so no merge window is split). RoPE angles
    are sliced to the shard, while `cu_seqlens` stays that of the full sequence: a
    sequence-parallel core (e.g. Ulysses, swapped in for `layers[i].attention.core`) gathers the
    shards and attends over the whole groups. With a plain core, only a full range is correct.
    """

    def __init__(self, spec: VisionEncoderSpec, attn_backend: str | None = None):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.layers = nn.ModuleDict({str(i): VisionBlock(spec, attn_backend) for i in range(spec.layers)})
        self.merger = PatchMerger(spec, spec.out_hidden or spec.hidden)

    def forward(
        self, pixel_patches: torch.Tensor, grid_thw: torch.Tensor, patch_range: tuple[int, int] | None = None
    ) -> torch.Tensor:
        grid_thw = grid_thw.long()
        cos, sin = vision_rope(
            vision_position_ids(grid_thw, self.spec.merge), self.spec.hidden // self.spec.heads
        )
        cu_seqlens, max_seqlen = vision_cu_seqlens(grid_thw)
        if patch_range is not None:
            start, end = (int(x) for x in patch_range)
            window = self.spec.merge**2
            if start % window or end % window or not 0 <= start <= end <= cos.shape[0]:
                raise ValueError(
                    f"patch_range {patch_range} must lie in [0, {cos.shape[0]}] on multiples of {window}"
                )
            cos, sin = cos[start:end], sin[start:end]
        if cos.shape[0] != pixel_patches.shape[0]:
            raise ValueError(f"{pixel_patches.shape[0]} patches given, grid_thw/patch_range say {cos.shape[0]}")
        # Moved once per call, not per block: a grid on the host (encoder chunks pass one) makes the
        # angles host tensors, and each pageable copy synchronises the host with the GPU (one chunked
        # step on an H100 synchronised 1,315 times: benchmarks/gpu_chunk_profile.py).
        device = pixel_patches.device
        cu_seqlens, cos, sin = cu_seqlens.to(device), cos.to(device), sin.to(device)
        h = self.patch_embed(pixel_patches)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cu_seqlens, max_seqlen)
        return self.merger(h)

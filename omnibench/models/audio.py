"""Whisper-style audio encoder (as used by Qwen2-Audio / Qwen2.5-Omni) over packed audio segments.

Per segment of F mel frames (10 ms each):
  conv1 (k3, s1, pad 1) + GELU           -> F positions
  conv2 (k3, s2, pad 1) + GELU           -> ceil(F/2) positions; the last one is dropped when F is odd,
                                            so the encoder sees exactly L = F // 2 positions
  + sinusoidal positions, restarted every `max_positions` (1500 = one 30 s Whisper window)
  transformer blocks, attention full within each window of one segment (cu_seqlens per window)
  avg-pool 2 (pairs never straddle a window: max_positions is even) -> L // 2
  final LayerNorm (Qwen2-Audio places it after the pool), Linear projector to the LLM width
So one segment yields (F // 2) // 2 LLM tokens: 25 per second, and the workloads' Segment rule
(encoder_seq_len = mel_frames // 2, llm_tokens = encoder_seq_len // 2) holds exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnibench.models.attention import VarlenAttention
from omnibench.specs.costs import audio_windows
from omnibench.specs.model import AudioEncoderSpec


def sinusoids(length: int, channels: int, device=None) -> torch.Tensor:
    """Whisper's fixed positional table (sin | cos halves)."""
    inc = math.log(10_000) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32, device=device))
    t = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, spec: AudioEncoderSpec, attn_backend: str | None = None):
        super().__init__()
        self.head_dim = spec.hidden // spec.heads
        self.wq = nn.Linear(spec.hidden, spec.hidden, bias=True)
        self.wk = nn.Linear(spec.hidden, spec.hidden, bias=False)  # Whisper's key has no bias
        self.wv = nn.Linear(spec.hidden, spec.hidden, bias=True)
        self.wo = nn.Linear(spec.hidden, spec.hidden, bias=True)
        self.core = VarlenAttention(attn_backend)

    def forward(self, x, cu_seqlens, max_seqlen):
        n = x.shape[0]
        q, k, v = (proj(x).view(n, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        return self.wo(self.core(q, k, v, cu_seqlens, max_seqlen, causal=False).reshape(n, -1))


class AudioBlock(nn.Module):
    def __init__(self, spec: AudioEncoderSpec, attn_backend: str | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.attention = AudioAttention(spec, attn_backend)
        self.norm2 = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.fc1 = nn.Linear(spec.hidden, spec.ffn)
        self.fc2 = nn.Linear(spec.ffn, spec.hidden)

    def forward(self, x, cu_seqlens, max_seqlen):
        x = x + self.attention(self.norm1(x), cu_seqlens, max_seqlen)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class AudioEncoder(nn.Module):
    """forward(mel [sum F, n_mels], mel_lens per segment) -> [sum (F//2)//2, out_hidden]."""

    def __init__(self, spec: AudioEncoderSpec, attn_backend: str | None = None):
        super().__init__()
        if spec.max_positions % spec.pool:
            raise ValueError(
                f"audio max_positions ({spec.max_positions}) must be a multiple of pool ({spec.pool})"
            )
        self.spec = spec
        self.conv1 = nn.Conv1d(spec.n_mels, spec.hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(spec.hidden, spec.hidden, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleDict({str(i): AudioBlock(spec, attn_backend) for i in range(spec.layers)})
        self.norm = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.projector = nn.Linear(spec.hidden, spec.out_hidden or spec.hidden)

    def forward(self, mel: torch.Tensor, mel_lens) -> torch.Tensor:
        lens = [int(x) for x in (mel_lens.tolist() if torch.is_tensor(mel_lens) else mel_lens)]
        if sum(lens) != mel.shape[0]:
            raise ValueError(f"mel_lens sum to {sum(lens)} frames but mel has {mel.shape[0]}")
        x = mel.to(self.conv1.weight.dtype)
        feats = []
        for seg in torch.split(x, lens, dim=0):
            if seg.shape[0] < 2:
                continue  # fewer than 2 frames give no encoder position
            h = F.gelu(self.conv1(seg.t().unsqueeze(0)))
            h = F.gelu(self.conv2(h))[0].t()[: seg.shape[0] // 2]
            feats.append(h)
        windows = audio_windows(lens, self.spec.max_positions)
        if not feats:
            return mel.new_zeros(0, self.projector.out_features)
        h = torch.cat(feats)
        table = sinusoids(self.spec.max_positions, self.spec.hidden, device=h.device).to(h.dtype)
        pos = torch.cat([torch.arange(w, device=h.device) for w in windows])
        h = h + table[pos]
        cu = F.pad(torch.tensor(windows, device=h.device).cumsum(0, dtype=torch.int32), (1, 0))
        max_seqlen = max(windows)
        for layer in self.layers.values():
            h = layer(h, cu, max_seqlen)
        # Average pairs within each window; an odd window drops its last position.
        keep = torch.cat(
            [
                torch.arange(s, s + (w // self.spec.pool) * self.spec.pool)
                for s, w in zip(cu[:-1].tolist(), windows, strict=True)
            ]
        ).to(h.device)
        h = h[keep].view(-1, self.spec.pool, h.shape[-1]).mean(dim=1)
        return self.projector(self.norm(h))

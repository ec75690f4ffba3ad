"""Qwen2 / Qwen3(-MoE) decoder in the torchtitan llama3 layout, over packed sequences.

Parameter names follow torchtitan (tok_embeddings, layers.N.attention.wq, feed_forward.w1/w2/w3,
attention_norm, ffn_norm, norm, output) so its TP plans read naturally; `layers` is a ModuleDict
keyed "0".."L-1" so a pipeline stage deletes the layers it does not own and keeps the names.
No parallelism here: the runtime applies TP/FSDP/CP/EP/PP from outside.
"""

from __future__ import annotations

import torch
from torch import nn

from omnibench.models.attention import RMSNorm, VarlenAttention, apply_rotary, rope_cos_sin
from omnibench.models.moe import FeedForward, MoE
from omnibench.specs.model import LLMSpec


class Attention(nn.Module):
    """GQA self-attention; local head counts come from the projection sizes (TP shards have fewer)."""

    def __init__(self, spec: LLMSpec, attn_backend: str | None = None):
        super().__init__()
        hd = spec.dim_head
        self.head_dim = hd
        self.wq = nn.Linear(spec.hidden, spec.heads * hd, bias=spec.qkv_bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_heads * hd, bias=spec.qkv_bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_heads * hd, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.heads * hd, spec.hidden, bias=False)
        self.q_norm = RMSNorm(hd, eps=spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(hd, eps=spec.norm_eps) if spec.qk_norm else None
        self.core = VarlenAttention(attn_backend)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        t = x.shape[0]
        q = self.wq(x).view(t, -1, self.head_dim)
        k = self.wk(x).view(t, -1, self.head_dim)
        v = self.wv(x).view(t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, cu_seqlens, max_seqlen, causal=True)
        return self.wo(out.reshape(t, -1))


class TransformerBlock(nn.Module):
    def __init__(self, spec: LLMSpec, attn_backend: str | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.attention = Attention(spec, attn_backend)
        self.ffn_norm = RMSNorm(spec.hidden, eps=spec.norm_eps)
        if spec.moe is not None:
            self.moe = MoE(spec.hidden, spec.moe, num_layers=spec.layers)
            self.feed_forward = None
        else:
            self.moe = None
            self.feed_forward = FeedForward(spec.hidden, spec.ffn)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.attention(self.attention_norm(x), cos, sin, cu_seqlens, max_seqlen)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return x + mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder over packed sequences: forward(tokens_or_hidden [T] / [T, hidden], position_ids [T], cu_seqlens, max_seqlen).

    Integer input is token ids and goes through `tok_embeddings`; floating input is already-embedded
    hidden states (a later pipeline stage, or text embeddings with encoder outputs scattered in).
    Returns logits [T, vocab] when `output` is present and `head` is set, else hidden [T, hidden]
    (a chunked loss applies `output.weight` itself, so [T, vocab] never exists at once).
    """

    def __init__(self, spec: LLMSpec, attn_backend: str | None = None):
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(spec, attn_backend) for i in range(spec.layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is None:
            raise RuntimeError("this stage has no token embeddings (tok_embeddings is None)")
        return self.tok_embeddings(tokens)

    def forward(
        self,
        h_or_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        head: bool = True,
    ) -> torch.Tensor:
        h = h_or_tokens
        if not h.is_floating_point():
            h = self.embed(h)
        cos, sin = rope_cos_sin(position_ids, self.spec.dim_head, self.spec.rope_theta)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cu_seqlens, max_seqlen)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and head:
            h = self.output(h)
        return h

    def aux_loss(self) -> torch.Tensor | None:
        """This module's MoE layers' load-balancing shares from the last forward, summed (None if dense).

        On the whole model this is aux_loss_coef x the mean over layers; stages' values add up to it.
        """
        losses = [layer.moe.aux_loss for layer in self.layers.values() if layer.moe is not None]
        losses = [x for x in losses if x is not None]
        return torch.stack(losses).sum() if losses else None

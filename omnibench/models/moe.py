"""Qwen3-MoE style mixture of experts: softmax router, top-k, renormalised top-k weights, SwiGLU experts.

Token dispatch is explicit so expert parallelism can be applied from outside: `MoE.forward` sorts
the routed token copies by expert and calls `self.experts(x_sorted, num_tokens_per_expert)`. An
expert-parallel wrapper that replaces `experts` sees exactly the tokens grouped by expert and the
per-expert counts it needs for its all-to-all dispatch and combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnibench.specs.model import MoESpec


class GroupedExperts(nn.Module):
    """E SwiGLU experts as batched weights: w1 (gate) / w3 (up) [E, hidden, ffn], w2 (down) [E, ffn, hidden].

    The expert count is read from the weights, so an expert-parallel shard holding E/ep experts
    runs the same code on its local experts.
    """

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] grouped by expert (expert 0's tokens first); counts [E] sum to N."""
        counts = num_tokens_per_expert.tolist()
        outs = []
        # Experts with no tokens still run (0-row matmuls): every weight stays in the graph and gets a
        # (zero) gradient, so data-parallel gradient hooks fire on every rank.
        for e, chunk in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs, dim=0)


class Router(nn.Module):
    """Linear gate -> softmax over all experts -> top-k (renormalised when `norm_topk_prob`)."""

    def __init__(self, hidden: int, experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = self.gate(x).float().softmax(dim=-1)  # [T, E]
        top_p, top_idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return top_p, top_idx, probs


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Routed experts (+ optional sigmoid-gated shared expert, Qwen2-MoE style).

    After each forward `self.aux_loss` holds this layer's share of the load-balancing loss, ready to
    add to the loss: aux_loss_coef * E * sum_e f_e * P_e / num_layers, with f_e the tokens routed to
    expert e over the token count (sums to top_k, as in HF Qwen3-MoE) and P_e its mean router
    probability. Dividing by the model's MoE layer count makes the sum over layers a mean, and lets
    pipeline stages add their layers' shares to the same total.
    """

    def __init__(self, hidden: int, spec: MoESpec, num_layers: int = 1):
        super().__init__()
        self.num_layers = num_layers
        self.num_experts = spec.experts
        self.top_k = spec.top_k
        self.aux_loss_coef = spec.aux_loss_coef
        self.router = Router(hidden, spec.experts, spec.top_k, spec.norm_topk_prob)
        self.experts = GroupedExperts(hidden, spec.expert_ffn, spec.experts)
        if spec.shared_expert_ffn:
            self.shared_expert = FeedForward(hidden, spec.shared_expert_ffn)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.aux_loss: torch.Tensor | None = None
        # Tokens each expert received in the last forward (a load-imbalance metric for the runtime).
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        top_p, top_idx, probs = self.router(x)
        flat_expert = top_idx.reshape(-1)  # [T*k], token-major
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // self.top_k
        num_tokens_per_expert = torch.bincount(flat_expert, minlength=self.num_experts)
        routed = self.experts(x[token_of], num_tokens_per_expert)
        routed = routed * top_p.reshape(-1)[order, None].to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, routed.to(x.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

        frac = num_tokens_per_expert.to(probs.dtype) / max(tokens, 1)
        balance = self.num_experts * (frac * probs.mean(dim=0)).sum()
        self.aux_loss = self.aux_loss_coef * balance / self.num_layers
        self.last_tokens_per_expert = num_tokens_per_expert.detach()
        return out

"""Token-level cross entropy as a (sum, count) pair.

Returning the sum, not the mean, lets every caller divide by the GLOBAL number of loss tokens of
the step, so splitting a batch across data-parallel ranks or microbatches gives the same loss and
gradients as the single-process reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnibench.specs.costs import loss_chunk_tokens

IGNORE_INDEX = -100


def text_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, vocab], labels [T] already aligned (labels[t] is the target of position t)."""
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, (labels != IGNORE_INDEX).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum-CE of `hidden @ weight.T` chunk by chunk, the gradients computed during the forward.

    Each chunk's logits live only inside the loop: the forward keeps the hidden gradient [T, hidden]
    and the weight gradient (the size of the weight) instead of [T, vocab] logits and their
    gradient, and nothing is recomputed. The loss is a leaf of the step (nothing follows it but the
    1/global-tokens scale), so backward only scales the stored gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h, y = hidden[s : s + chunk], labels[s : s + chunk]
            logits = (h @ weight.t()).float()  # [c, vocab]
            valid = y != IGNORE_INDEX
            target = y.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None])[:, 0]
            total += ((lse - picked) * valid).sum()
            if need_h or need_w:
                # d(sum-CE)/d logits = softmax - one_hot, zero on ignored rows; built in place.
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(g.shape[0], device=g.device), target] -= 1.0
                g.mul_(valid[:, None].to(g.dtype))
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ weight
                if need_w:  # no .float() copy: a [vocab, hidden] fp32 temporary is 2 GiB for Qwen2-7B
                    grad_w.add_(g.t() @ h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`text_loss(hidden @ weight.T, labels)` without ever holding [T, vocab] logits: (sum, count).

    Written by hand rather than with torch 2.13's `F.linear_cross_entropy`: the GPU machines run
    torch 2.11, which has none, and one implementation keeps CPU tests and GPU runs on one path.
    """
    chunk = chunk or loss_chunk_tokens(weight.shape[0])
    ce = _LinearCrossEntropy.apply(hidden, weight, labels, chunk)
    return ce, (labels != IGNORE_INDEX).sum()

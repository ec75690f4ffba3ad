"""Token-level cross entropy as a (sum, count) pair.

Returning the sum, not the mean, lets every caller divide by the GLOBAL number of loss tokens of
the step, so splitting a batch across data-parallel ranks or microbatches gives the same loss and
gradients as the single-process reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def text_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, vocab], labels [T] already aligned (labels[t] is the target of position t)."""
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, (labels != IGNORE_INDEX).sum()

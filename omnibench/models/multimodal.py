"""Encoders feeding an LLM, and the single-process reference step every system must match.

The encoders' output tokens replace the placeholder embeddings of the text row (in row order),
then the LLM runs over the packed row. Systems split this across ranks in many ways; the
reference `forward_loss` is what their losses are compared against.
"""

from __future__ import annotations

import torch
from torch import nn

from omnibench.models.audio import AudioEncoder
from omnibench.models.inputs import PackedBatch
from omnibench.models.llm import Transformer
from omnibench.models.loss import text_loss
from omnibench.models.vision import VisionTransformer
from omnibench.specs.model import MultimodalSpec


def scatter_encoder_outputs(
    text_embeds: torch.Tensor, positions: torch.Tensor, encoder_out: torch.Tensor
) -> torch.Tensor:
    """Out-of-place: rows `positions` (index tensor or bool mask) of text_embeds become encoder_out.

    Gradients flow to both the encoder output and the untouched text embeddings.
    """
    if positions.dtype == torch.bool:
        positions = positions.nonzero(as_tuple=True)[0]
    if positions.numel() != encoder_out.shape[0]:
        raise ValueError(
            f"{positions.numel()} placeholder positions but {encoder_out.shape[0]} encoder tokens"
        )
    return text_embeds.index_put((positions,), encoder_out.to(text_embeds.dtype))


class MultimodalModel(nn.Module):
    def __init__(self, spec: MultimodalSpec, attn_backend: str | None = None):
        super().__init__()
        self.spec = spec
        self.vision = VisionTransformer(spec.vision, attn_backend) if spec.vision is not None else None
        self.audio = AudioEncoder(spec.audio, attn_backend) if spec.audio is not None else None
        self.llm = Transformer(spec.llm, attn_backend)

    def embed_inputs(self, packed: PackedBatch) -> torch.Tensor:
        """Text embeddings with every encoder's outputs scattered into their placeholder positions."""
        h = self.llm.embed(packed.input_ids)
        if packed.pixel_patches is not None and packed.pixel_patches.numel():
            if self.vision is None:
                raise ValueError(f"batch has image/video inputs but {self.spec.name} has no vision encoder")
            h = scatter_encoder_outputs(
                h, packed.vision_positions, self.vision(packed.pixel_patches, packed.grid_thw)
            )
        if packed.mel is not None and packed.mel.numel():
            if self.audio is None:
                raise ValueError(f"batch has audio inputs but {self.spec.name} has no audio encoder")
            h = scatter_encoder_outputs(h, packed.audio_positions, self.audio(packed.mel, packed.mel_lens))
        return h

    def forward_loss(self, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sum of token cross entropy, number of loss tokens, MoE aux loss (0 for dense))."""
        h = self.embed_inputs(packed)
        logits = self.llm(h, packed.position_ids, packed.cu_seqlens, packed.max_seqlen)
        loss_sum, n = text_loss(logits, packed.labels)
        aux = self.llm.aux_loss()
        return loss_sum, n, aux if aux is not None else loss_sum.new_zeros(())

    def forward(self, packed: PackedBatch):
        return self.forward_loss(packed)

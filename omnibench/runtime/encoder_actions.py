"""Encoder forward and backward actions: a microbatch of images, video frames or audio through its
encoder, whole, in chunks (encoder_chunks.py) or over a sequence-parallel group (long_short.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from omnibench.models.inputs import dummy_sample, pack, synthesize
from omnibench.plan import (
    Action,
)
from systems.common import data_rank, encoder_tokens


class EncoderActionsMixin:
    """The Executor's encoder actions."""

    def _enc_microbatch(self, module: str, mb: int) -> tuple[int, ...]:
        lay = self.layouts[module]
        return self.plan.assignment[module][data_rank(lay, self.rank)][mb]

    def _enc_forward(self, a: Action) -> None:
        if self.long_short is not None and self.long_short.handles(self.plan, a.module, a.microbatch):
            self.long_short.forward(self, a)
            return
        module = a.module
        ids = self._enc_microbatch(module, a.microbatch)
        lay = self.layouts[module]
        if lay.sp > 1:  # the whole microbatch over the sp group (omnibench/runtime/long_short.py)
            from omnibench.runtime.long_short import encode_over_group

            group, ranks = self.groups.get(module, "sp")
            encode_over_group(self, module, a.microbatch, ids, group, ranks, swap_cores=False, outputs_on_all=True)
            return
        samples = [self.plan.sample(i) for i in ids] or [dummy_sample(module)]
        packed = pack([synthesize(s, self.spec, device=self.device) for s in samples]).to(self.device)
        enc = self.modules[module]
        # chunks bound what a backward recomputes; a frozen encoder has none
        if self.enc_chunks is not None and module not in self.frozen and self.enc_chunks.applies(self, module):
            out = self.enc_chunks.forward(self, module, a.microbatch, samples, packed, dummy_sample(module))
        elif module == "vision":
            out = enc(packed.pixel_patches, packed.grid_thw)
        else:
            out = enc(packed.mel, packed.mel_lens)
        tokens = [encoder_tokens(s, module) for s in samples] if ids else []
        self.state.enc_out[(module, a.microbatch)] = (out, list(ids), tokens)
        if ids:
            for i, piece in zip(ids, torch.split(out, tokens), strict=True):
                # A route from this rank to itself hands the output over without communication.
                self.state.emb[(module, i, "local")] = piece

    def _enc_backward(self, a: Action) -> None:
        module = a.module
        out, ids, tokens = self.state.enc_out.pop((module, a.microbatch))
        lay = self.layouts[module]
        enc = self.modules[module]
        if ids:
            if self.rank == data_rank(lay, self.rank):
                # Each sample's gradient comes back to its primary route's source only: every member of
                # an omni sequence-parallel group holds the whole output, the others give zeros (the
                # gather's backward sums the members' gradients).
                grad = torch.cat([self.state.enc_grad.pop((module, i)) if self.primary_src.get((module, i)) == self.rank
                                  else out.new_zeros(n, out.shape[1]) for i, n in zip(ids, tokens, strict=True)])
                grad = grad.to(out.dtype)
            else:
                # tp peers: overwritten by the broadcast below; sp peers hold the gathered output too
                # and take zeros (the gather's backward hands every member its chunk of the leader's).
                grad = torch.zeros_like(out)
            if lay.tp > 1:
                g, ranks = self.groups.get(module, "tp")
                dist.broadcast(grad, src=ranks[0], group=g)
        else:
            grad = torch.zeros_like(out)  # dummy forward: zero gradient, collectives still run
        if self.enc_chunks is not None and self.enc_chunks.holds(module, a.microbatch):
            self.enc_chunks.backward(module, a.microbatch, grad, enc)
            return
        torch.autograd.backward(out, grad)

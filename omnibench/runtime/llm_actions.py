"""LLM forward and backward actions of one pipeline stage on one microbatch: packing the microbatch's
tokens with the encoder outputs it received, context parallelism, omni's long samples, the loss on
the last stage."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist

from omnibench.models.inputs import PackedBatch, pack, synthesize
from omnibench.models.loss import IGNORE_INDEX
from omnibench.plan import (
    Action,
)
from omnibench.runtime.parallelize import take_rows, zigzag_index
from systems.common import data_rank
from workloads.sample import Sample, Segment


class LLMActionsMixin:
    """The Executor's LLM actions."""

    def _llm_packed(self, mb: int) -> tuple[PackedBatch, tuple[int, int] | None]:
        if mb in self.state.packed:
            return self.state.packed[mb]
        lay = self.llm_layout
        ids = self.plan.assignment["llm"][data_rank(lay, self.rank)][mb]
        samples = [synthesize(self.plan.sample(i), self.spec, media=False) for i in ids]
        if not samples:  # omni's long-short: an empty microbatch keeps the data-parallel group in step
            packed = pack([synthesize(Sample(-1, "dummy", (Segment("text", 2),)), self.spec, media=False)])
            packed = replace(packed, labels=torch.full_like(packed.labels, IGNORE_INDEX), sample_ids=[])
        else:
            packed = pack(samples)
        chunk = None
        k, member, kind = self._llm_cp_split(mb)
        if k > 1 and kind == "allgather":
            # two opposite pieces of the row per member (parallelize.zigzag_rows): even causal work
            packed = pad_row(packed, 2 * k)
            chunk = zigzag_index(packed.tokens, k, member)
        elif k > 1:  # omni's long-sample group of data ranks, or the layout's cp group
            packed = pad_row(packed, k)
            n = packed.tokens // k
            chunk = (member * n, (member + 1) * n)
        # The encoders pack their own inputs; the LLM side reads only ids, labels and positions.
        packed = replace(packed, pixel_patches=None, grid_thw=None, mel=None, mel_lens=None).to(self.device)
        self.state.packed[mb] = (packed, chunk)
        return packed, chunk

    def _stage_input_tokens(self, mb: int) -> int:
        """Rows of this rank's stage input, as `_llm_packed` cuts them: an empty microbatch is a
        2-token row, split over omni's long-sample group or the cp group (padded to a multiple)."""
        ids = self.plan.assignment["llm"][data_rank(self.llm_layout, self.rank)][mb]
        n = sum(self.plan.sample(i).llm_tokens for i in ids) or 2
        k, _, kind = self._llm_cp_split(mb)
        if k > 1 and kind == "allgather":
            return 2 * -(-n // (2 * k))  # padded to a multiple of 2k, two pieces per member
        return -(-n // k)

    def _llm_long(self, mb: int):
        return self.long_short.llm_group(self.plan, mb) if self.long_short is not None else None

    def _llm_long_kind(self) -> str:
        """How omni's long-sample group attends: "ulysses" or "allgather" (plan.options["long_short"])."""
        return self.plan.options.get("long_short", {}).get("llm_cp_kind") or "ulysses"

    def _llm_cp_split(self, mb: int) -> tuple[int, int, str]:
        """(ranks, this rank's place among them, kind) that split microbatch mb's row: omni's long-sample
        group when the microbatch is one of its long ones, else the layout's cp group."""
        long = self._llm_long(mb)
        if long is not None:
            return len(long[1]), long[1].index(self.rank), self._llm_long_kind()
        lay = self.llm_layout
        return lay.cp, lay.coords(self.rank)["cp"], lay.cp_kind

    def _llm_cp(self, mb: int):
        """The long-sample group's context parallelism (Ulysses, or all-gathered K/V where Ulysses
        cannot split the heads) around an LLM microbatch's forward or backward."""
        long = self._llm_long(mb)
        if long is None:
            return contextlib.nullcontext()
        from omnibench.runtime.long_short import llm_group_cp

        return llm_group_cp(self.modules["llm"], long[0], len(long[1]), self._llm_long_kind(), long[1].index(self.rank))

    def _llm_forward(self, a: Action) -> None:
        with self._llm_cp(a.microbatch):
            self._llm_forward_inner(a)

    def _llm_forward_inner(self, a: Action) -> None:
        mb = a.microbatch
        packed, chunk = self._llm_packed(mb)
        stage = self.modules["llm"]
        pos = take_rows(packed.position_ids, chunk)
        labels = None
        if stage.last:
            labels = take_rows(packed.labels, chunk)
        if stage.first:
            enc_outs = []
            for module in ("vision", "audio"):
                positions = getattr(packed, f"{module}_positions")
                if positions is None or not positions.numel():
                    continue
                parts = [self._embedding(module, i) for i in packed.sample_ids if self._has(i, module)]
                enc_outs.append((positions, torch.cat(parts)))
            out = stage(packed.input_ids, pos, packed.cu_seqlens, packed.max_seqlen, enc_outs, chunk, labels)
        else:
            x = self.state.act_in[mb]
            if not self.fsdp.get("llm"):  # FSDP's mixed precision casts inputs itself
                x = x.to(next(stage.parameters()).dtype)
            out = stage(x, pos, packed.cu_seqlens, packed.max_seqlen, labels=labels)
        if stage.last:
            ce, _ = out
            loss = ce / self.global_loss_tokens
            if self.llm_layout.coords(self.rank)["tp"] == 0:
                # a tensor: reading it here would stall the host until the GPU got this far
                self.state.loss_sum = self.state.loss_sum + loss.detach()
            out = loss
        self.state.act_out[mb] = out

    def _has(self, sample_id: int, module: str) -> bool:
        return bool(self.plan.sample(sample_id).encoder_seq_lens(module))

    def _embedding(self, module: str, sample_id: int) -> torch.Tensor:
        st = self.state
        key = (module, sample_id)
        if key not in st.emb:
            # Produced on this rank: a detached leaf, so LLM backward stops at the boundary and
            # the encoder's backward stays its own action (a frozen encoder wants no gradient).
            st.emb[key] = st.emb.pop((module, sample_id, "local")).detach().requires_grad_(module not in self.frozen)
        return st.emb[key]

    def _llm_backward(self, a: Action) -> None:
        with self._llm_cp(a.microbatch):
            self._llm_backward_inner(a)

    def _llm_backward_inner(self, a: Action) -> None:
        mb = a.microbatch
        stage = self.modules["llm"]
        out = self.state.act_out.pop(mb)
        if not out.requires_grad:
            # a frozen LLM on a microbatch with no training encoder's output: nothing wants a gradient
            self.state.grad_in.pop(mb, None)
        elif stage.last:
            out.backward()
        else:
            torch.autograd.backward(out, self.state.grad_in.pop(mb).to(out.dtype))
        if stage.first:
            self._collect_embedding_grads(mb)

    def _collect_embedding_grads(self, mb: int) -> None:
        """After stage 0's backward: the encoder outputs' gradients of this microbatch, summed over
        cp ranks (each saw only its chunk of the row), kept for the primary route's send."""
        lay = self.llm_layout
        packed, _ = self.state.packed[mb]
        keys = [(m, i) for m in ("vision", "audio") for i in packed.sample_ids
                if m in self.layouts and m not in self.frozen and self._has(i, m)]
        if not keys:
            return
        grads = [self.state.emb[k].grad if self.state.emb[k].grad is not None else torch.zeros_like(self.state.emb[k])
                 for k in keys]
        long = self._llm_long(mb)
        if long is not None or lay.cp > 1:
            flat = torch.cat(grads)
            dist.all_reduce(flat, group=long[0] if long is not None else self.groups.get("llm", "cp")[0])
            grads = list(torch.split(flat, [g.shape[0] for g in grads]))
        for k, g in zip(keys, grads, strict=True):
            self.state.emb[k] = g  # the leaf is done with; its gradient goes back along the primary route
            if self.primary_src[k] == self.rank:
                self.state.enc_grad[k] = g


def pad_row(packed: PackedBatch, multiple: int) -> PackedBatch:
    """Pad a packed row to a multiple of `multiple` tokens with one extra, loss-free sequence."""
    n = packed.tokens
    pad = (-n) % multiple
    if not pad:
        return packed
    # replace(): the encoder inputs and anything added to PackedBatch later carry over untouched.
    cat = torch.cat
    return replace(
        packed,
        input_ids=cat([packed.input_ids, packed.input_ids.new_zeros(pad)]),
        labels=cat([packed.labels, packed.labels.new_full((pad,), IGNORE_INDEX)]),
        position_ids=cat([packed.position_ids, torch.arange(pad, dtype=packed.position_ids.dtype)]),
        cu_seqlens=cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([n + pad])]),
        max_seqlen=max(packed.max_seqlen, pad),
    )

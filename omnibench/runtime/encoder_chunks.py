"""Encoder work in chunks of a token budget, recomputed chunk by chunk in the backward.

One encoder microbatch (a long video, several images, audio segments) is cut into chunks of whole
attention units, each at most `budget` encoder tokens (patches, audio positions; a unit over the
budget is a chunk of its own): vision frame groups (attention never crosses a temporal group, the
2x2 merger never crosses a frame) and whole audio segments (attention stays inside 30 s windows of
one segment; the conv front-end sees the whole segment, so a segment is never cut). The forward
action runs the encoder once per chunk without a graph; between the forward and the backward a
rank keeps only the chunks' inputs (cast to the compute dtype, as the encoder's first layer would
cast them) and the concatenated output. The backward action runs each chunk's forward again (under
the autocast of the forward) and its backward at once, so one chunk's activations (under the
recompute mode: block-level checkpointing still applies inside) exist at a time. The outputs
concatenate to exactly the unchunked output (`chunk_units` never cuts a unit), so losses and
gradients are those of the unchunked step.

Why not `torch.utils.checkpoint` around each chunk's call: FSDP2 does not reshard a module after a
forward that runs inside the backward (`FSDPParamGroup.post_forward` under `is_bw()`, meant for
AC(fully_shard(block))), so the recompute of a checkpointed root call held every block's unsharded
weights at once (1.26 GiB for the Qwen2-VL ViT, FSDPMemTracker). A plain forward inside the backward
action gathers and reshards block by block like any forward.

FSDP: every member of an encoder's data-parallel group must make the same number of forward and
backward calls (FSDP2 all-gathers each block per call, in lock step). Every rank knows every
member's encoder microbatches from the Plan, so the chunk count of a microbatch is agreed without
a collective: the most chunks any member of the group needs; a member with fewer runs the rest on
the executor's dummy sample, with a zero gradient. The backward runs chunk by chunk, last chunk
first; in the microbatch whose backward reduces gradients, each chunk's call reduce-scatters (FSDP2
accumulates the sharded gradient): one reduction at the end would hold the module's unsharded
gradient across the chunks, which is the memory chunking exists to save.

Left to others: omni's long inputs (`long_short.py`: their sequence-parallel group already splits
them), and encoders with their own Ulysses group (`Layout.sp > 1`).
"""

from __future__ import annotations

import torch

from omnibench.models.inputs import pack, synthesize
from omnibench.specs.costs import chunk_units, encoder_units, sample_lengths
from systems.common import data_rank


def encoder_inputs(samples, module: str) -> list:
    """Per-microbatch inputs as the packed batch orders them: vision grids, audio mel frames."""
    return sample_lengths(samples)[module]


def chunk_pieces(module: str, inputs: list, budget: int) -> list[tuple[int, int, list]]:
    """(start, end, chunk inputs) per chunk: the rows [start, end) of the packed pixel patches / mel
    frames, and the grid rows (t may be part of a video's temporal groups) or mel lengths they hold."""
    units = encoder_units(module, inputs)
    if module == "vision":
        owner = [(i, h * w) for i, (t, h, w) in enumerate(inputs) for _ in range(t)]
    else:
        owner = [(i, int(m)) for i, m in enumerate(inputs)]  # a unit is a segment of m frames
    out, row = [], 0
    for a, b in chunk_units(units, budget):
        rows: list = []
        size = 0
        for i, n in owner[a:b]:
            size += n
            if module == "vision":
                t, h, w = inputs[i]
                if rows and rows[-1][0] == i:
                    rows[-1][1][0] += 1
                else:
                    rows.append((i, [1, h, w]))
            else:
                rows.append((i, n))
        out.append((row, row + size, [r for _, r in rows]))
        row += size
    return out


def agreed_count(plan, layout, members, module: str, microbatch: int, budget: int, dummy) -> int:
    """The chunks every member of `members` runs for this microbatch: the most any of them needs."""
    n = 0
    for r in members:
        mbs = plan.assignment[module][data_rank(layout, r)]
        if microbatch >= len(mbs):
            continue
        samples = [plan.sample(i) for i in mbs[microbatch]] or [dummy]
        n = max(n, len(chunk_units(encoder_units(module, encoder_inputs(samples, module)), budget)))
    return n


def _grid(rows) -> torch.Tensor:
    """A chunk's grid_thw, on the host (the vision encoder reads it there)."""
    return torch.tensor(rows, dtype=torch.long)


class EncoderChunks:
    """Chunked encoder forward/backward for the executor (omnibench/runtime/executor.py)."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"encoder_chunk_tokens must be >= 1 to chunk, got {budget}")
        self.budget = budget
        # (module, microbatch) -> ([(chunk input, grid rows / mel lengths, real?)], output rows per real
        # chunk, (autocast on?, autocast dtype) of the forward)
        self.held: dict[tuple[str, int], tuple[list, list[int], tuple]] = {}
        self._dummy: dict[str, tuple] = {}

    @staticmethod
    def create(budget: int) -> EncoderChunks | None:
        return EncoderChunks(budget) if budget > 0 else None

    def applies(self, ex, module: str) -> bool:
        return self.budget > 0 and ex.layouts[module].sp == 1

    def _members(self, ex, module: str) -> tuple[int, ...]:
        if ex.fsdp.get(module):
            return ex.groups.get(module, "dp")[1]
        return (ex.rank,)

    def _dummy_inputs(self, ex, module: str, dummy_sample):
        if module not in self._dummy:
            packed = pack([synthesize(dummy_sample, ex.spec, device=ex.device)]).to(ex.device)
            lens = encoder_inputs([dummy_sample], module)
            if module == "vision":
                self._dummy[module] = (packed.pixel_patches.to(ex.dtype), _grid(lens))
            else:
                self._dummy[module] = (packed.mel.to(ex.dtype), [int(m) for m in lens])
        return self._dummy[module]

    def forward(self, ex, module: str, microbatch: int, samples, packed, dummy_sample) -> torch.Tensor:
        """The microbatch's encoder output, computed chunk by chunk without keeping a graph."""
        enc = ex.modules[module]
        inputs = encoder_inputs(samples, module)
        x = packed.pixel_patches if module == "vision" else packed.mel
        x = x.to(ex.dtype)  # what the patch embedding / first conv casts to: kept between fwd and bwd
        pieces = chunk_pieces(module, inputs, self.budget)
        count = agreed_count(ex.plan, ex.layouts[module], self._members(ex, module), module, microbatch,
                             self.budget, dummy_sample)
        if count < len(pieces):
            raise RuntimeError(f"{module} microbatch {microbatch} on rank {ex.rank}: {len(pieces)} chunks but the "
                               f"group agreed on {count}")
        chunks = [(x[start:end], _grid(rows) if module == "vision" else rows, True) for start, end, rows in pieces]
        chunks += [(*self._dummy_inputs(ex, module, dummy_sample), False)] * (count - len(pieces))
        outs = []
        with torch.no_grad():
            for x_c, lens, real in chunks:
                out = enc(x_c, lens)
                if real:
                    outs.append(out)
        device = x.device.type
        cast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.held[(module, microbatch)] = (chunks, [o.shape[0] for o in outs], cast)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def holds(self, module: str, microbatch: int) -> bool:
        return (module, microbatch) in self.held

    def backward(self, module: str, microbatch: int, grad: torch.Tensor, enc) -> None:
        """Chunk by chunk, last first: the chunk's forward again (under the forward's autocast), then its
        backward, so one chunk's activations exist at a time. Under FSDP every chunk's call reduce-scatters
        into the sharded gradient (one reduction at the end would hold the unsharded gradient across
        chunks)."""
        chunks, sizes, (autocast, dtype) = self.held.pop((module, microbatch))
        grads = list(torch.split(grad, sizes))
        for x_c, lens, real in reversed(chunks):
            with torch.autocast(x_c.device.type, dtype=dtype, enabled=autocast):
                out = enc(x_c, lens)
            g = grads.pop() if real else torch.zeros_like(out)
            if out.requires_grad:  # an audio chunk of segments too short for one position has no graph
                torch.autograd.backward(out, g.to(out.dtype))

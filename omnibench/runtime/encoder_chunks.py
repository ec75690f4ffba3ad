"""Encoder work in chunks of a token budget, each chunk's forward checkpointed (issue #11 item 4).

One encoder microbatch (a long video, several images, audio segments) is cut into chunks of whole
attention units, each at most `budget` encoder tokens (patches, audio positions; a unit over the
budget is a chunk of its own): vision frame groups (attention never crosses a temporal group, the
2x2 merger never crosses a frame) and whole audio segments (attention stays inside 30 s windows of
one segment; the conv front-end sees the whole segment, so a segment is never cut). The encoder
then runs once per chunk under non-reentrant checkpointing, so between the forward and the backward
a rank keeps only the chunks' inputs (cast to the compute dtype, as the encoder's first layer would
cast them) and their outputs; one chunk's activations exist again only while that chunk's backward
runs. The outputs concatenate to exactly the unchunked output (`chunk_units` never cuts a unit),
so losses and gradients are those of the unchunked step.

FSDP: every member of an encoder's data-parallel group must make the same number of forward and
backward calls (FSDP2 all-gathers each block per call, in lock step). Every rank knows every
member's encoder microbatches from the Plan, so the chunk count of a microbatch is agreed without
a collective: the most chunks any member of the group needs; a member with fewer runs the rest on
the executor's dummy sample, with a zero gradient. The backward runs chunk by chunk, last chunk
first, with FSDP's gradient reduction enabled only for the final call (the earlier ones accumulate
unsharded gradients), so a step reduce-scatters once per module, as without chunking.

Left to others: omni's long inputs (`long_short.py`: their sequence-parallel group already splits
them), and encoders with their own Ulysses group (`Layout.sp > 1`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

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


class EncoderChunks:
    """Chunked encoder forward/backward for the executor (omnibench/runtime/executor.py)."""

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"encoder_chunk_tokens must be >= 1 to chunk, got {budget}")
        self.budget = budget
        self.held: dict[tuple[str, int], list[tuple[torch.Tensor, bool]]] = {}
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
                self._dummy[module] = (packed.pixel_patches.to(ex.dtype), torch.tensor(lens, dtype=torch.long))
            else:
                self._dummy[module] = (packed.mel.to(ex.dtype), [int(m) for m in lens])
        return self._dummy[module]

    def forward(self, ex, module: str, microbatch: int, samples, packed, dummy_sample) -> torch.Tensor:
        """The microbatch's encoder output (detached: the chunks' own outputs are kept for the backward)."""
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
        held = []
        for start, end, rows in pieces:
            lens = torch.tensor(rows, dtype=torch.long) if module == "vision" else rows
            held.append((self._run(enc, x[start:end], lens), True))
        for _ in range(count - len(pieces)):
            held.append((self._run(enc, *self._dummy_inputs(ex, module, dummy_sample)), False))
        self.held[(module, microbatch)] = held
        outs = [o.detach() for o, real in held if real]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _run(enc, x, lens) -> torch.Tensor:
        return checkpoint(enc, x, lens, use_reentrant=False, preserve_rng_state=False)

    def holds(self, module: str, microbatch: int) -> bool:
        return (module, microbatch) in self.held

    def backward(self, module: str, microbatch: int, grad: torch.Tensor, enc, sync: bool | None) -> None:
        """Chunk by chunk, last first; `sync` (FSDP only): whether this microbatch reduces gradients,
        applied to the final call only."""
        held = self.held.pop((module, microbatch))
        sizes = [o.shape[0] for o, real in held if real]
        grads = iter(torch.split(grad, sizes))
        calls = [(o, next(grads) if real else torch.zeros_like(o)) for o, real in held]
        for k, (o, g) in enumerate(reversed(calls)):
            if sync is not None:
                enc.set_requires_gradient_sync(sync and k == len(calls) - 1)
            if o.requires_grad:  # an audio chunk of segments too short for one position has no graph
                torch.autograd.backward(o, g.to(o.dtype))

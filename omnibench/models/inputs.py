"""Synthetic tensors for a workload Sample, and packing samples into one varlen row.

Training data here is synthetic on purpose: the benchmark measures systems, so what matters is
that every system, rank and run sees bit-identical inputs for the same sample. `synthesize` draws
each segment from its own torch.Generator seeded by (sample id, segment index) alone, so any rank
can build any sample, and the LLM side can build token ids without drawing the media (a video's
pixels are hundreds of MB). Media are drawn on the device that consumes them (a CUDA generator gives
other numbers than the CPU one, the same on every rank of the run).

Row layout of one sample: its segments in order; a text segment is `llm_tokens` random text ids, a
media segment is `llm_tokens` placeholder ids (one per encoder output token). The last text
segment is the response and carries the loss; earlier text is prompt. Labels are already shifted:
labels[t] is the target of position t (the next token), -100 where there is no loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnibench.models.loss import IGNORE_INDEX
from omnibench.specs.model import MultimodalSpec, SpecError
from workloads.sample import Sample, Segment

_SEED_MIX = 0x9E3779B97F4A7C15


def special_ids(vocab: int) -> dict[str, int]:
    """Placeholder ids for media positions: the top three ids of the vocabulary."""
    return {"image": vocab - 3, "video": vocab - 2, "audio": vocab - 1}


def text_vocab(vocab: int) -> int:
    """Text tokens are drawn from [0, text_vocab)."""
    return vocab - 3


def sample_seed(sample_id: int, segment: int = 0) -> int:
    return (int(sample_id) * _SEED_MIX + 0x5EED + segment * 0x9E37) % (2**63)


@dataclass
class SampleInputs:
    sample_id: int
    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long, shifted, -100 = no loss
    pixel_patches: torch.Tensor | None = None  # [Nv, C*tp*ps*ps], segments concatenated in row order
    grid_thw: torch.Tensor | None = None  # [nv, 3] long
    vision_positions: torch.Tensor | None = None  # [Nv / merge^2] row positions of the vision outputs
    mel: torch.Tensor | None = None  # [F, n_mels]
    mel_lens: torch.Tensor | None = None  # [na] long
    audio_positions: torch.Tensor | None = None  # [sum (F//2)//2] row positions of the audio outputs

    def __len__(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class PackedBatch:
    """Samples packed into one row: position_ids restart per sample, cu_seqlens mark the samples.

    Encoder inputs are concatenated in row order, so the i-th encoder output token goes to
    `<encoder>_positions[i]` of the row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # [n+1] int32
    max_seqlen: int
    sample_ids: list[int] = field(default_factory=list)
    pixel_patches: torch.Tensor | None = None
    grid_thw: torch.Tensor | None = None
    vision_positions: torch.Tensor | None = None
    mel: torch.Tensor | None = None
    mel_lens: torch.Tensor | None = None
    audio_positions: torch.Tensor | None = None

    @property
    def n_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> PackedBatch:
        kw = {}
        for name, value in self.__dict__.items():
            kw[name] = value.to(device) if torch.is_tensor(value) else value
        return PackedBatch(**kw)


def response_segment(sample: Sample) -> int:
    """Index of the segment the loss is on (the last text segment; -1: none)."""
    return max((i for i, s in enumerate(sample.segments) if s.modality == "text"), default=-1)


def loss_token_count(sample: Sample) -> int:
    """How many labels `synthesize` marks for loss, from the segments alone: every token of the
    response is a target except a sequence's first position (no position predicts it)."""
    last = response_segment(sample)
    if last < 0:
        return 0
    starts_sequence = all(s.llm_tokens == 0 for s in sample.segments[:last])
    return max(0, int(sample.segments[last].llm_tokens) - (1 if starts_sequence else 0))


def dummy_sample(module: str) -> Sample:
    """The smallest input `module`'s encoder accepts: a rank with no work for an encoder runs it, so
    the encoder's collectives (FSDP, tp, sp) stay in step on every rank."""
    if module == "vision":
        seg = Segment("image", llm_tokens=1, encoder_seq_len=4, grid_thw=(1, 2, 2))
    else:
        seg = Segment("audio", llm_tokens=1, encoder_seq_len=2, mel_frames=4)
    return Sample(-1, "dummy", (Segment("text", 1), seg))


def synthesize(sample: Sample, spec: MultimodalSpec, media: bool = True, device=None) -> SampleInputs:
    """Deterministic tensors for `sample` under `spec` (same on every rank and system).

    `media=False` leaves out pixel patches and mel frames (what the LLM side needs: ids, labels,
    positions); `device`: where the media are drawn (default CPU).
    """
    device = torch.device(device or "cpu")

    def gen(i: int, on=torch.device("cpu")) -> torch.Generator:
        return torch.Generator(device=on).manual_seed(sample_seed(sample.sample_id, i))

    vocab = spec.llm.vocab
    ids_special = special_ids(vocab)
    ids, is_response = [], []
    last_text = response_segment(sample)
    patches, grids, vpos, mels, mel_lens, apos = [], [], [], [], [], []
    offset = 0
    for i, seg in enumerate(sample.segments):
        n = int(seg.llm_tokens)
        if seg.modality == "text":
            ids.append(torch.randint(0, text_vocab(vocab), (n,), generator=gen(i)))
        elif seg.modality in ("image", "video"):
            vit = spec.vision
            if vit is None:
                raise SpecError(
                    f"model {spec.name} has no vision encoder for {seg.modality} in sample {sample.sample_id}"
                )
            t, h, w = (int(x) for x in seg.grid_thw)
            if h % vit.merge or w % vit.merge or t * h * w // vit.merge**2 != n:
                raise SpecError(
                    f"sample {sample.sample_id}: grid_thw {seg.grid_thw} does not give llm_tokens={n} "
                    f"with merge {vit.merge}"
                )
            d = vit.in_channels * vit.temporal_patch * vit.patch_size**2
            if media:
                patches.append(torch.randn(t * h * w, d, generator=gen(i, device), device=device))
            grids.append((t, h, w))
            vpos.append(torch.arange(offset, offset + n))
            ids.append(torch.full((n,), ids_special[seg.modality], dtype=torch.long))
        elif seg.modality == "audio":
            enc = spec.audio
            if enc is None:
                raise SpecError(
                    f"model {spec.name} has no audio encoder for audio in sample {sample.sample_id}"
                )
            frames = int(seg.mel_frames)
            if (frames // 2) // enc.pool != n:
                raise SpecError(
                    f"sample {sample.sample_id}: mel_frames {frames} gives {(frames // 2) // enc.pool} "
                    f"audio tokens, segment says llm_tokens={n}"
                )
            if media:
                mels.append(torch.randn(frames, enc.n_mels, generator=gen(i, device), device=device))
            mel_lens.append(frames)
            apos.append(torch.arange(offset, offset + n))
            ids.append(torch.full((n,), ids_special["audio"], dtype=torch.long))
        else:
            raise SpecError(
                f"segment modality must be one of text, image, video, audio; got {seg.modality!r}"
            )
        is_response.append(torch.full((n,), i == last_text, dtype=torch.bool))
        offset += n
    input_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    response = torch.cat(is_response) if is_response else torch.zeros(0, dtype=torch.bool)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    if input_ids.numel() > 1:
        target_is_loss = response[1:]
        labels[:-1] = torch.where(target_is_loss, input_ids[1:], torch.full_like(input_ids[1:], IGNORE_INDEX))
    out = SampleInputs(sample_id=sample.sample_id, input_ids=input_ids, labels=labels)
    if grids:
        out.pixel_patches = torch.cat(patches) if media else None
        out.grid_thw = torch.tensor(grids, dtype=torch.long)
        out.vision_positions = torch.cat(vpos)
    if mel_lens:
        out.mel = torch.cat(mels) if media else None
        out.mel_lens = torch.tensor(mel_lens, dtype=torch.long)
        out.audio_positions = torch.cat(apos)
    return out


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    parts = [p for p in parts if p is not None]
    return torch.cat(parts) if parts else None


def pack(samples: list[SampleInputs]) -> PackedBatch:
    """One varlen row from several samples (each sample its own attention sequence)."""
    if not samples:
        raise ValueError("pack needs at least one sample")
    lens = [len(s) for s in samples]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)

    def shifted(name: str) -> torch.Tensor | None:
        return _cat(
            [
                None if getattr(s, name) is None else getattr(s, name) + o
                for s, o in zip(samples, starts, strict=True)
            ]
        )

    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PackedBatch(
        input_ids=torch.cat([s.input_ids for s in samples]),
        labels=torch.cat([s.labels for s in samples]),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seqlens=cu,
        max_seqlen=max(lens),
        sample_ids=[s.sample_id for s in samples],
        pixel_patches=_cat([s.pixel_patches for s in samples]),
        grid_thw=_cat([s.grid_thw for s in samples]),
        vision_positions=shifted("vision_positions"),
        mel=_cat([s.mel for s in samples]),
        mel_lens=_cat([s.mel_lens for s in samples]),
        audio_positions=shifted("audio_positions"),
    )

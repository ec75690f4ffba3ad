"""The unit every system and the simulator consume: a training sample and its segments.

A sample is a sequence of segments (text, image, video, audio). Each segment knows its raw
size and what the encoders turn it into, so a planner or the simulator can cost a sample
without touching a tensor. Frozen dataclasses: samples are shared, hashed and serialised.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

Modality = Literal["text", "image", "video", "audio"]
MODALITIES: tuple[str, ...] = ("text", "image", "video", "audio")
# Which encoder consumes each non-text modality.
ENCODER_OF: dict[str, str] = {"image": "vision", "video": "vision", "audio": "audio"}
ID_STRIDE = 1 << 20  # sample_id = step * ID_STRIDE + position; a batch holds < 2**20 samples


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of one step of a stream (generated or replayed): a function of (seed, step) only."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step])))


@dataclass(frozen=True, slots=True)  # slots: the generator builds >100k of these per second
class Segment:
    """One contiguous piece of a sample.

    For image/video, `grid_thw` is the encoder's patch grid: (temporal groups, rows, cols) of
    14 px patches, so `encoder_seq_len == t*h*w` and, after the 2x2 merge,
    `llm_tokens == t*h*w // 4`. For audio, `mel_frames` is the number of 10 ms mel frames;
    the encoder sees `mel_frames // 2` positions (stride-2 conv) and the LLM gets half that
    again (pooling), i.e. 25 tokens per second. Text has `encoder_seq_len == 0`.
    """

    modality: str
    llm_tokens: int
    encoder_seq_len: int = 0
    # raw size (whichever apply)
    width: int = 0
    height: int = 0
    frames: int = 0
    seconds: float = 0.0
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    mel_frames: int = 0

    @property
    def encoder(self) -> str | None:
        return ENCODER_OF.get(self.modality)


@dataclass(frozen=True, slots=True)
class Sample:
    """A training sample: deterministic id, the mixture component it came from, its segments."""

    sample_id: int
    source: str
    segments: tuple[Segment, ...]

    @property
    def llm_tokens(self) -> int:
        return sum(s.llm_tokens for s in self.segments)

    @property
    def text_tokens(self) -> int:
        return sum(s.llm_tokens for s in self.segments if s.modality == "text")

    def encoder_seq_lens(self, encoder: str) -> list[int]:
        """Encoder sequence lengths of this sample's segments for one encoder ('vision'/'audio')."""
        return [s.encoder_seq_len for s in self.segments if ENCODER_OF.get(s.modality) == encoder]

    @property
    def modalities(self) -> tuple[str, ...]:
        seen: list[str] = []
        for s in self.segments:
            if s.modality not in seen:
                seen.append(s.modality)
        return tuple(seen)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Sample:
        segs = tuple(
            Segment(**{**s, "grid_thw": tuple(s.get("grid_thw", (0, 0, 0)))}) for s in d["segments"]
        )
        return Sample(sample_id=int(d["sample_id"]), source=str(d["source"]), segments=segs)


@dataclass
class Batch:
    """The global batch of one training step (before any system splits it)."""

    step: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def llm_tokens(self) -> int:
        return sum(s.llm_tokens for s in self.samples)

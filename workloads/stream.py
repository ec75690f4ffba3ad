"""WorkloadStream: the global batch of every training step, deterministic and seekable.

    stream = WorkloadStream(get_workload("mixed_video"), seed=0, global_batch_tokens=2048,
                            length_scale=0.05)
    batch = stream.batch(step)

Determinism: step s draws from a numpy Generator seeded by SeedSequence([seed, s]) and from
nothing else, so the same (workload, seed, step, stream settings) gives the same Batch in any
process, at any world size, whatever steps were generated before. Sample ids are
`step * ID_STRIDE + position`, unique across steps.

Batch formation (pick one):
- `global_batch_tokens=T`: draw samples in order and stop before the first one that would
  take the batch's LLM tokens past T (a token budget, the way packed training fills its
  sequences); every batch has at least one sample;
- `global_batch_size=B`: exactly B samples.
Stopping at the first sample that does not fit (and dropping it) keeps batches reproducible
without carrying samples across steps, but it under-represents samples that are large
compared with the budget: with 131,072 tokens and 20K-token videos, realised shares of such
sources fall a few points below their weights (`omnibench workloads show` prints both).
A batch is global: systems split it over ranks, so it does not depend on the world size.

Knobs:
- `length_scale` s (default 1.0) shrinks raw sizes *before* the token rules so that every
  modality's tokens shrink by about s: text length and audio duration x s, image area x s,
  video frame area x sqrt(s) and duration x sqrt(s). The vision rule's pixel limits scale the
  same way (`tokens.scaled_rule`), so floors and caps (4 tokens per image, 128..768 tokens
  per frame pair, ~24,576 per video) bind where they would at full size. A tiny CPU run
  thus keeps the *shape* of the mix - same sources, same relative lengths per modality - with
  far fewer tokens. The workload's and stage's `max_sample_tokens` scale by s too. What does
  not: at least 4 frames (2 temporal groups) per video and 1 token per image or audio clip.
  A video's own audio track shrinks like audio (x s), so below s = 1 it is shorter than the
  miniature video it belongs to.
- `max_sample_tokens`: samples with more LLM tokens are dropped and redrawn (length filtering,
  as LLaVA/InternVL loaders do). The cap in force is the smallest of this argument,
  `global_batch_tokens`, and the workload's and current stage's `max_sample_tokens` (those
  two times `length_scale`).
- `total_steps` places a step within a changing or staged schedule; default: the workload's
  nominal `total_steps`. Steps past it keep the final mix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from workloads.registry import get_workload
from workloads.sample import ID_STRIDE, Batch, Sample, Segment, step_rng
from workloads.spec import MAX_SAMPLE_TOKENS, Mix, SourceSpec, WorkloadError, WorkloadSpec
from workloads.tokens import (
    PIXELS_PER_TOKEN,
    TEMPORAL_PATCH,
    VisionRule,
    audio_mel_frames_np,
    image_grid_np,
    scaled_rule,
    video_grid_np,
)

_MAX_ROUNDS = 64
_MAX_ASPECT = 150.0  # sampled aspect ratios stay well inside Qwen2-VL's 200:1 limit


@dataclass(slots=True)
class _Draw:
    """n samples of one source, drawn at once as arrays (items of sample i are off[i]:off[i+1])."""

    source: str
    tokens: np.ndarray  # LLM tokens per sample
    text: list
    img_off: list
    img: list  # per image: (width, height, rows, cols)
    vid_off: list
    vid: list  # per video: (width, height, seconds, groups, rows, cols, track mel or 0, track seconds)
    aud_off: list
    aud: list  # per audio clip: (seconds, mel)


def _counts(dist, rng, n) -> np.ndarray:
    if dist is None:
        return np.zeros(n, dtype=np.int64)
    return np.maximum(0, np.rint(dist.sample(rng, n))).astype(np.int64)


def _offsets(counts: np.ndarray) -> np.ndarray:
    off = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    return off


def _sides(area: np.ndarray, aspect: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    aspect = np.clip(aspect, 1 / _MAX_ASPECT, _MAX_ASPECT)
    h = np.maximum(1, np.rint(np.sqrt(area * aspect)))
    w = np.maximum(1, np.rint(np.sqrt(area / aspect)))
    # After rounding, tiny sides can still break the ratio; widen the short side.
    h = np.maximum(h, np.ceil(w / 200))
    w = np.maximum(w, np.ceil(h / 200))
    return w.astype(np.int64), h.astype(np.int64)


def draw_source(
    src: SourceSpec,
    n: int,
    rng: np.random.Generator,
    mult: float,
    rule: VisionRule,
    length_scale: float = 1.0,
) -> _Draw:
    """Draw n samples of `src`, token rules applied. `mult` (the phase's length multiplier)
    multiplies raw sizes as they are: durations, pixel areas, text. `length_scale` shrinks
    tokens evenly across modalities and expects `rule` already scaled by `scaled_rule`.

    The order of draws from `rng` is fixed (text, images, videos, audio), which is what makes a
    step reproducible.
    """
    tokens = np.zeros(n, dtype=np.int64)
    if src.text_tokens is not None:
        text = np.maximum(1, np.rint(src.text_tokens.sample(rng, n) * (mult * length_scale))).astype(np.int64)
        tokens += text
    else:
        text = np.zeros(n, dtype=np.int64)

    c_img = _counts(src.images, rng, n)
    k = int(c_img.sum())
    img: list = []
    if k:
        if src.image_tokens is not None:
            area = src.image_tokens.sample(rng, k) * PIXELS_PER_TOKEN
        else:
            area = src.image_pixels.sample(rng, k)
        w, h = _sides(np.maximum(area * (mult * length_scale), 1.0), src.image_aspect.sample(rng, k))
        rows, cols = image_grid_np(w, h, rule)
        tok = rows * cols // 4
        tokens += np.bincount(np.repeat(np.arange(n), c_img), weights=tok, minlength=n).astype(np.int64)
        img = list(zip(w.tolist(), h.tolist(), rows.tolist(), cols.tolist(), strict=True))

    c_vid = _counts(src.videos, rng, n)
    k = int(c_vid.sum())
    vid: list = []
    if k:
        root = math.sqrt(length_scale)
        raw_sec = src.video_seconds.sample(rng, k) * mult
        sec = np.maximum(raw_sec * root, 0.05)
        area = np.maximum(src.video_pixels.sample(rng, k) * (mult * root), 1.0)
        w, h = _sides(area, src.video_aspect.sample(rng, k))
        t, rows, cols = video_grid_np(w, h, sec, rule)
        tok = t * rows * cols // 4
        if src.video_audio:
            # The track shrinks like audio (x s) so its tokens keep their share; at full size
            # (s = 1) it has exactly the video's duration.
            track_sec = sec if length_scale == 1.0 else np.maximum(raw_sec * length_scale, 0.01)
            mel = audio_mel_frames_np(track_sec)
            tok = tok + mel // 4
        else:
            track_sec = sec
            mel = np.zeros(k, dtype=np.int64)
        tokens += np.bincount(np.repeat(np.arange(n), c_vid), weights=tok, minlength=n).astype(np.int64)
        vid = list(
            zip(
                w.tolist(),
                h.tolist(),
                np.round(sec, 3).tolist(),
                t.tolist(),
                rows.tolist(),
                cols.tolist(),
                mel.tolist(),
                np.round(track_sec, 3).tolist(),
                strict=True,
            )
        )

    c_aud = _counts(src.audios, rng, n)
    k = int(c_aud.sum())
    aud: list = []
    if k:
        sec = np.maximum(src.audio_seconds.sample(rng, k) * (mult * length_scale), 0.01)
        mel = audio_mel_frames_np(sec)
        tokens += np.bincount(np.repeat(np.arange(n), c_aud), weights=mel // 4, minlength=n).astype(np.int64)
        aud = list(zip(np.round(sec, 3).tolist(), mel.tolist(), strict=True))

    return _Draw(
        src.name,
        tokens,
        text.tolist(),
        _offsets(c_img).tolist(),
        img,
        _offsets(c_vid).tolist(),
        vid,
        _offsets(c_aud).tolist(),
        aud,
    )


class _SegmentCache:
    """Interns segments: they are frozen, so equal segments can be one shared object. Text
    segments repeat a lot, which saves most of the object construction."""

    def __init__(self, limit: int = 200_000):
        self.text: dict[int, Segment] = {}
        self.other: dict[tuple, Segment] = {}
        self.limit = limit

    def text_seg(self, n: int) -> Segment:
        s = self.text.get(n)
        if s is None:
            s = self.text[n] = Segment("text", n)
        return s

    def image_seg(self, w: int, h: int, rows: int, cols: int) -> Segment:
        key = ("i", w, h)
        s = self.other.get(key)
        if s is None:
            if len(self.other) > self.limit:
                self.other.clear()
            s = self.other[key] = Segment(
                "image", rows * cols // 4, rows * cols, w, h, 0, 0.0, (1, rows, cols), 0
            )
        return s

    def video_seg(self, w: int, h: int, sec: float, t: int, rows: int, cols: int) -> Segment:
        key = ("v", w, h, sec)
        s = self.other.get(key)
        if s is None:
            if len(self.other) > self.limit:
                self.other.clear()
            n = t * rows * cols
            s = self.other[key] = Segment(
                "video", n // 4, n, w, h, t * TEMPORAL_PATCH, sec, (t, rows, cols), 0
            )
        return s

    def audio_seg(self, sec: float, mel: int) -> Segment:
        key = ("a", mel, sec)
        s = self.other.get(key)
        if s is None:
            if len(self.other) > self.limit:
                self.other.clear()
            s = self.other[key] = Segment("audio", mel // 4, mel // 2, 0, 0, 0, sec, (0, 0, 0), mel)
        return s


def _build(d: _Draw, i: int, sid: int, cache: _SegmentCache) -> Sample:
    segs: list[Segment] = []
    text = d.text[i]
    a, b = d.img_off[i], d.img_off[i + 1]
    if b - a > 1 and text > 0:
        # Multi-image conversation: a slice of the text before each image, the rest after.
        q = text // (2 * (b - a))
        for j in range(a, b):
            if q:
                segs.append(cache.text_seg(q))
            segs.append(cache.image_seg(*d.img[j]))
        text -= q * (b - a)
    else:
        for j in range(a, b):
            segs.append(cache.image_seg(*d.img[j]))
    for j in range(d.vid_off[i], d.vid_off[i + 1]):
        w, h, sec, t, rows, cols, mel, track_sec = d.vid[j]
        segs.append(cache.video_seg(w, h, sec, t, rows, cols))
        if mel:
            # The video's own audio track, same duration (Qwen2.5-Omni interleaves the two in
            # 2 s chunks inside the LLM sequence; the encoders see each whole).
            segs.append(cache.audio_seg(track_sec, mel))
    for j in range(d.aud_off[i], d.aud_off[i + 1]):
        segs.append(cache.audio_seg(*d.aud[j]))
    if text > 0:
        segs.append(cache.text_seg(text))
    return Sample(sid, d.source, tuple(segs))


def _build_many(d: _Draw, loc: list[int], sids: list[int], cache: _SegmentCache) -> list[Sample]:
    """Samples for local indices `loc`. The common single-image + text shape takes a fast path
    (object construction is the generator's main cost); everything else goes through _build."""
    out = []
    name = d.source
    img_off, vid_off, aud_off, img, text = d.img_off, d.vid_off, d.aud_off, d.img, d.text
    tcache = cache.text
    for i, sid in zip(loc, sids, strict=True):
        a = img_off[i]
        if img_off[i + 1] - a == 1 and vid_off[i] == vid_off[i + 1] and aud_off[i] == aud_off[i + 1]:
            w, h, r, c = img[a]
            n = r * c
            seg = Segment("image", n // 4, n, w, h, 0, 0.0, (1, r, c), 0)
            t = text[i]
            if t:
                ts = tcache.get(t) or cache.text_seg(t)
                out.append(Sample(sid, name, (seg, ts)))
            else:
                out.append(Sample(sid, name, (seg,)))
        elif a == img_off[i + 1] and vid_off[i] == vid_off[i + 1] and aud_off[i] == aud_off[i + 1]:
            t = text[i]
            out.append(Sample(sid, name, ((tcache.get(t) or cache.text_seg(t)),)))
        else:
            out.append(_build(d, i, sid, cache))
    return out


class WorkloadStream:
    """Global batches of a workload, one per step; see the module docstring for the knobs."""

    def __init__(
        self,
        workload: WorkloadSpec | str,
        seed: int = 0,
        global_batch_tokens: int | None = None,
        global_batch_size: int | None = None,
        length_scale: float = 1.0,
        max_sample_tokens: int | None = None,
        total_steps: int | None = None,
    ):
        self.spec = get_workload(workload)
        if (global_batch_tokens is None) == (global_batch_size is None):
            raise WorkloadError("stream: give exactly one of global_batch_tokens or global_batch_size")
        for name, v in (
            ("global_batch_tokens", global_batch_tokens),
            ("global_batch_size", global_batch_size),
            ("max_sample_tokens", max_sample_tokens),
            ("total_steps", total_steps),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                raise WorkloadError(f"{name}: must be a positive integer, got {v!r}")
        if max_sample_tokens is not None and max_sample_tokens > MAX_SAMPLE_TOKENS:
            raise WorkloadError(f"max_sample_tokens: must be at most {MAX_SAMPLE_TOKENS:,}, got {max_sample_tokens!r}")
        if global_batch_size is not None and global_batch_size >= ID_STRIDE:
            raise WorkloadError(f"global_batch_size: must be < {ID_STRIDE}, got {global_batch_size}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise WorkloadError(f"seed: must be an integer >= 0, got {seed!r}")
        if not (
            isinstance(length_scale, (int, float)) and 0 < length_scale <= 1e3 and math.isfinite(length_scale)
        ):
            raise WorkloadError(f"length_scale: must be a number in (0, 1000], got {length_scale!r}")
        self.seed = int(seed)
        self.global_batch_tokens = global_batch_tokens
        self.global_batch_size = global_batch_size
        self.length_scale = float(length_scale)
        self.max_sample_tokens = max_sample_tokens
        self.total_steps = int(total_steps or self.spec.total_steps)
        self.rule = scaled_rule(self.spec.vision, self.length_scale)
        self._cache = _SegmentCache()
        self._mean_tokens: dict[str, float] = {}
        self._trace_state = None
        if self.spec.trace is not None:
            self._trace_state = self.spec.trace.prepare(self.length_scale, self.rule, self._cache)

    # ---- schedule ----
    def mix(self, step: int) -> Mix:
        """The mixture in force at `step` (weights over `spec.source_names`, length multipliers)."""
        return self.spec.mix(step, self.total_steps, self.seed)

    def sample_cap(self, mix: Mix) -> int | None:
        """The per-sample token cap in force: the smallest of this stream's `max_sample_tokens`
        and `global_batch_tokens` (given for this run, taken as is) and the workload's and the
        stage's caps (full-size figures, so scaled by `length_scale` like the samples)."""
        caps = [c for c in (self.max_sample_tokens, self.global_batch_tokens) if c is not None]
        caps += [
            max(1, math.ceil(c * self.length_scale))
            for c in (self.spec.max_sample_tokens, mix.max_sample_tokens)
            if c is not None
        ]
        return min(caps) if caps else None

    # ---- batches ----
    def batch(self, step: int) -> Batch:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise WorkloadError(f"step: must be an integer >= 0, got {step!r}")
        step = int(step)
        if self._trace_state is not None:
            return self._trace_state.batch(self, step)
        mix = self.mix(step)
        rng = step_rng(self.seed, step)
        cap = self.sample_cap(mix)
        srcs = self.spec.sources
        weights = mix.weights
        active = np.flatnonzero(weights > 0)
        est = max(1.0, float(sum(weights[k] * self._source_mean(k) for k in active)))
        picked: list[tuple[_Draw, np.ndarray]] = []  # (draw, local indices in chunk order)
        order: list[np.ndarray] = []  # chunk positions of picked samples, for ordering
        total_tokens = 0
        count = 0
        done = False
        rounds = 0
        while not done:
            rounds += 1
            if rounds > _MAX_ROUNDS:
                raise WorkloadError(
                    f"max_sample_tokens: cap {cap} rejects nearly every sample of workload "
                    f"{self.spec.name!r} at step {step}; raise the cap or lower length_scale"
                )
            if self.global_batch_tokens is not None:
                want = (self.global_batch_tokens - total_tokens) / est
            else:
                want = self.global_batch_size - count
            n = int(min(1 << 16, math.ceil(want * 1.25) + 8) * (1 << min(rounds - 1, 6)))
            n = min(n, 1 << 18)
            which = rng.choice(len(srcs), size=n, p=weights)
            tok = np.empty(n, dtype=np.int64)
            draws = []
            for k in active:
                pos = np.flatnonzero(which == k)
                if not pos.size:
                    continue
                d = draw_source(srcs[k], pos.size, rng, float(mix.length[k]), self.rule, self.length_scale)
                tok[pos] = d.tokens
                draws.append((d, pos))
            # Empty samples (a source whose counts all came out 0 and has no text) are redrawn too.
            ok = tok > 0 if cap is None else (tok > 0) & (tok <= cap)
            ok_pos = np.flatnonzero(ok)
            if self.global_batch_tokens is not None:
                cums = total_tokens + np.cumsum(tok[ok_pos])
                take = int(np.searchsorted(cums, self.global_batch_tokens, side="right"))
                done = take < ok_pos.size
                if take:
                    total_tokens = int(cums[take - 1])
            else:
                take = min(ok_pos.size, self.global_batch_size - count)
                done = count + take >= self.global_batch_size
            chosen = ok_pos[:take]
            count += take
            if count >= ID_STRIDE:
                raise WorkloadError(f"global_batch_tokens: batch exceeds {ID_STRIDE - 1} samples; lower it")
            # Map each chosen chunk position to (draw, local index).
            base = sum(o.size for o in order)
            for d, pos in draws:
                loc = np.flatnonzero(np.isin(pos, chosen, assume_unique=True))
                if loc.size:
                    picked.append((d, loc))
                    order.append(np.searchsorted(chosen, pos[loc]) + base)
        samples: list = [None] * count
        sid0 = step * ID_STRIDE
        for (d, loc), where in zip(picked, order, strict=True):
            where_l = where.tolist()
            built = _build_many(d, loc.tolist(), [sid0 + j for j in where_l], self._cache)
            for j, smp in zip(where_l, built, strict=True):
                samples[j] = smp
        return Batch(step, samples)

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        step = start
        while stop is None or step < stop:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def _source_mean(self, k: int) -> float:
        """Mean LLM tokens per sample of source k at length_scale (a fixed-seed pilot draw, so
        chunk sizes, and with them the batches, depend only on the stream settings)."""
        src = self.spec.sources[k]
        if src.name not in self._mean_tokens:
            d = draw_source(src, 512, np.random.default_rng(12345), 1.0, self.rule, self.length_scale)
            self._mean_tokens[src.name] = float(d.tokens.mean())
        return self._mean_tokens[src.name]


def pack_sequences(samples: list[Sample], max_seq_len: int) -> list[list[int]]:
    """First-fit-decreasing packing of samples (by LLM tokens) into sequences of at most
    `max_seq_len` tokens; returns sample indices per sequence. A sample longer than
    `max_seq_len` gets a sequence of its own."""
    if max_seq_len <= 0:
        raise WorkloadError(f"max_seq_len: must be a positive integer, got {max_seq_len}")
    order = sorted(range(len(samples)), key=lambda i: -samples[i].llm_tokens)
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = samples[i].llm_tokens
        for b, f in enumerate(free):
            if n <= f:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max_seq_len - n)
    return bins


__all__ = ["ID_STRIDE", "WorkloadStream", "draw_source", "pack_sequences", "step_rng"]

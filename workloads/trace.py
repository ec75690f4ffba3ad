"""Trace replay: a user's dataset statistics (JSONL, one sample per line) as a workload.

Each line is one sample:

    {"source": "docvqa", "segments": [{"modality": "image", "width": 1700, "height": 2200},
                                      {"modality": "text", "tokens": 52}]}

Segment fields by modality (no others are accepted):
- text:  `tokens` (int in [0, 2**24])
- image: `width`, `height` (px, ints > 0, width x height <= 2**30, aspect ratio <= 200)
- video: `width`, `height` (px), `seconds` (in (0, 1e6]); optional `audio: true` adds its audio track
- audio: `seconds` (in (0, 1e6])
`source` is optional (default "trace"). Raw sizes go through the same token rules (and the
stream's `length_scale`) as generated workloads.

Order (`load_trace(path, order=...)`):
- "random" (default): each step draws samples uniformly *with replacement* from the trace,
  from the step's own seeded generator, so batches are seekable and i.i.d. over the trace;
- "sequential": steps walk the file in order, wrapping around at the end; step s starts where
  step s-1 ended (boundaries are computed from the trace's token counts, so any step can be
  asked for first). Samples over the stream's `max_sample_tokens` are skipped.

Loading is all-or-nothing: the first malformed line raises `TraceError` naming the file, the
line number and the field, and no workload is returned.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workloads.sample import ID_STRIDE, Batch, Sample, step_rng
from workloads.spec import (
    MAX_SAMPLE_TOKENS,
    SOURCE_LIMITS,
    MixPhase,
    ScheduleSpec,
    SourceSpec,
    WorkloadError,
    WorkloadSpec,
)
from workloads.tokens import (
    HF_RULE,
    MAX_ASPECT,
    UTILS_RULE,
    VisionRule,
    audio_mel_frames_np,
    image_grid_np,
    video_grid_np,
)

if TYPE_CHECKING:
    from workloads.stream import WorkloadStream

ORDERS = ("random", "sequential")
_FIELDS = {
    "text": {"tokens"},
    "image": {"width", "height"},
    "video": {"width", "height", "seconds", "audio"},
    "audio": {"seconds"},
}


class TraceError(WorkloadError):
    """A malformed trace line: `file:line: field: problem`."""


@dataclass(frozen=True)
class Trace:
    path: str
    order: str
    sources: tuple[str, ...]  # per sample
    segments: tuple[tuple[tuple, ...], ...]  # per sample: raw segments (modality, ...)

    def __len__(self) -> int:
        return len(self.segments)

    def prepare(self, length_scale: float, rule: VisionRule, cache) -> _TraceState:
        return _TraceState(self, length_scale, rule, cache)


# The largest sizes one trace segment may give, as for generated sources (spec.py): the token rules
# compute in int64 and float64, so a larger size overflows or turns every count negative.
MAX_TOKENS = MAX_SAMPLE_TOKENS
MAX_PIXELS = SOURCE_LIMITS["image_pixels"][0]  # width x height of an image or a video frame
MAX_SECONDS = SOURCE_LIMITS["video_seconds"][0]


def _int(v, fld: str, where: str, minimum: int, maximum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        shown = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else repr(v)
        raise TraceError(f"{where}: {fld}: expected an integer in [{minimum:,}, {maximum:,}], got {shown}")
    return v


def _seconds(v, fld: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= MAX_SECONDS:
        raise TraceError(f"{where}: {fld}: expected a number of seconds in (0, {MAX_SECONDS:,}], got {v!r}")
    return float(v)


def _parse_line(obj, where: str) -> tuple[str, tuple]:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
    bad = sorted(set(obj) - {"segments", "source"})
    if bad:
        raise TraceError(f"{where}: unknown key(s) {', '.join(bad)}; allowed: segments, source")
    source = obj.get("source", "trace")
    if not isinstance(source, str) or not source:
        raise TraceError(f"{where}: source: expected a non-empty string, got {source!r}")
    segs = obj.get("segments")
    if not isinstance(segs, list) or not segs:
        raise TraceError(f"{where}: segments: expected a non-empty list")
    out = []
    for i, s in enumerate(segs):
        f = f"segments[{i}]"
        if not isinstance(s, dict):
            raise TraceError(f"{where}: {f}: expected an object")
        m = s.get("modality")
        if m not in _FIELDS:
            raise TraceError(f"{where}: {f}.modality: must be one of {', '.join(_FIELDS)}, got {m!r}")
        extra = sorted(set(s) - _FIELDS[m] - {"modality"})
        if extra:
            raise TraceError(
                f"{where}: {f}: unknown key(s) {', '.join(extra)} for {m}; "
                f"allowed: {', '.join(sorted(_FIELDS[m]))}"
            )
        missing = sorted(_FIELDS[m] - set(s) - {"audio"})
        if missing:
            raise TraceError(f"{where}: {f}.{missing[0]}: missing (required for {m})")
        if m == "text":
            out.append(("text", _int(s["tokens"], f"{f}.tokens", where, 0, MAX_TOKENS)))
            continue
        if m == "audio":
            out.append(("audio", _seconds(s["seconds"], f"{f}.seconds", where)))
            continue
        w = _int(s["width"], f"{f}.width", where, 1, MAX_PIXELS)
        h = _int(s["height"], f"{f}.height", where, 1, MAX_PIXELS)
        if w * h > MAX_PIXELS:
            raise TraceError(
                f"{where}: {f}.width: width x height must be at most {MAX_PIXELS:,} pixels, "
                f"got {w:,} x {h:,} = {w * h:,}"
            )
        if max(w, h) / min(w, h) > MAX_ASPECT:
            raise TraceError(
                f"{where}: {f}.width: aspect ratio {max(w, h) / min(w, h):.0f} over {MAX_ASPECT}"
            )
        if m == "image":
            out.append(("image", w, h))
        else:
            sec = _seconds(s["seconds"], f"{f}.seconds", where)
            track = s.get("audio", False)
            if not isinstance(track, bool):
                raise TraceError(f"{where}: {f}.audio: expected true or false, got {track!r}")
            out.append(("video", w, h, sec))
            if track:
                out.append(("audio", sec))
    if all(s[0] == "text" and s[1] == 0 for s in out):
        raise TraceError(f"{where}: segments: the sample has no tokens (only empty text)")
    return source, tuple(out)


def load_trace(path: str | Path, order: str = "random", vision: str = "hf") -> WorkloadSpec:
    """Read a JSONL trace into a workload (see the module docstring for format and order)."""
    if order not in ORDERS:
        raise TraceError(f"order: must be one of {', '.join(ORDERS)}, got {order!r}")
    if vision not in ("hf", "utils"):
        raise TraceError(f"vision: must be 'hf' or 'utils', got {vision!r}")
    path = Path(path)
    try:
        fh = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from None
    sources, segments = [], []
    with fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise TraceError(f"{where}: not valid JSON (nested too deeply)") from None
                except ValueError as e:  # an integer of more than 4,300 digits
                    raise TraceError(f"{where}: not valid JSON ({str(e).split(';')[0]})") from None
                src, segs = _parse_line(obj, where)
                sources.append(src)
                segments.append(segs)
        except UnicodeDecodeError:
            # decoded in blocks, so the line that holds the bad byte is not known
            raise TraceError(f"{path}: cannot read: not text (not UTF-8)") from None
        except OSError as e:
            raise TraceError(f"{path}: cannot read ({e.strerror})") from None
    if not segments:
        raise TraceError(f"{path}: the trace has no samples")
    trace = Trace(str(path), order, tuple(sources), tuple(segments))
    counts = Counter(sources)
    names = tuple(sorted(counts))
    phase = MixPhase("trace", tuple(counts[n] / len(sources) for n in names), tuple(1.0 for _ in names))
    return WorkloadSpec(
        name=path.stem,
        description=f"trace replay of {len(segments)} samples from {path.name} ({order} order)",
        sources=tuple(SourceSpec(name=n, description="trace source") for n in names),
        schedule=ScheduleSpec("constant", (phase,)),
        vision=HF_RULE if vision == "hf" else UTILS_RULE,
        origin=str(path),
        trace=trace,
    )


class _TraceState:
    """A trace with token rules applied at one length_scale: Segment tuples and token counts."""

    def __init__(self, trace: Trace, scale: float, rule: VisionRule, cache):
        self.trace = trace
        flat = [(i, s) for i, segs in enumerate(trace.segments) for s in segs]
        built: list = [None] * len(flat)
        # Same miniature rule as generated samples (stream.py): image area x s, video frame
        # area and duration x sqrt(s), audio (video tracks included) and text x s; `rule` is
        # already scaled.
        lin = math.sqrt(scale)  # image sides: area x s
        vlin = scale**0.25  # video sides: frame area x sqrt(s)
        for mod in ("image", "video", "audio", "text"):
            idx = [k for k, (_, s) in enumerate(flat) if s[0] == mod]
            if not idx:
                continue
            raw = [flat[k][1] for k in idx]
            if mod == "text":
                for k, s in zip(idx, raw, strict=False):
                    built[k] = cache.text_seg(max(1, round(s[1] * scale)) if s[1] else 0)
            elif mod == "image":
                w = np.maximum(1, np.rint(np.array([s[1] for s in raw]) * lin)).astype(np.int64)
                h = np.maximum(1, np.rint(np.array([s[2] for s in raw]) * lin)).astype(np.int64)
                rows, cols = image_grid_np(w, h, rule)
                for k, *a in zip(idx, w.tolist(), h.tolist(), rows.tolist(), cols.tolist(), strict=True):
                    built[k] = cache.image_seg(*a)
            elif mod == "video":
                w = np.maximum(1, np.rint(np.array([s[1] for s in raw]) * vlin)).astype(np.int64)
                h = np.maximum(1, np.rint(np.array([s[2] for s in raw]) * vlin)).astype(np.int64)
                sec = np.maximum(0.05, np.array([s[3] for s in raw]) * lin)
                t, rows, cols = video_grid_np(w, h, sec, rule)
                for k, *a in zip(
                    idx,
                    w.tolist(),
                    h.tolist(),
                    np.round(sec, 3).tolist(),
                    t.tolist(),
                    rows.tolist(),
                    cols.tolist(),
                    strict=True,
                ):
                    built[k] = cache.video_seg(*a)
            else:
                sec = np.maximum(0.01, np.array([s[1] for s in raw]) * scale)
                mel = audio_mel_frames_np(sec)
                for k, a, b in zip(idx, np.round(sec, 3).tolist(), mel.tolist(), strict=True):
                    built[k] = cache.audio_seg(a, b)
        per: list[list] = [[] for _ in trace.segments]
        for (i, _), seg in zip(flat, built, strict=True):
            if seg.llm_tokens or seg.modality != "text":
                per[i].append(seg)
        self.segments = [tuple(p) for p in per]
        self.tokens = np.array([sum(s.llm_tokens for s in p) for p in self.segments], dtype=np.int64)
        self._bounds: dict[tuple, list[int]] = {}

    def batch(self, stream: WorkloadStream, step: int) -> Batch:
        cap = stream.sample_cap(stream.mix(step))
        eligible = np.flatnonzero(self.tokens <= cap) if cap is not None else np.arange(self.tokens.size)
        if eligible.size == 0:
            raise WorkloadError(
                f"max_sample_tokens: cap {cap} is below every sample of trace {self.trace.path}"
            )
        budget, size = stream.global_batch_tokens, stream.global_batch_size
        if self.trace.order == "random":
            idx = self._random(step_rng(stream.seed, step), eligible, budget, size)
        else:
            idx = self._sequential(step, eligible, cap, budget, size)
        sid0 = step * ID_STRIDE
        src = self.trace.sources
        return Batch(step, [Sample(sid0 + j, src[i], self.segments[i]) for j, i in enumerate(idx)])

    def _random(self, rng, eligible, budget, size) -> list[int]:
        if size is not None:
            return eligible[rng.integers(0, eligible.size, size=size)].tolist()
        mean = max(1.0, float(self.tokens[eligible].mean()))
        out: list[int] = []
        total = 0
        n = int(budget / mean * 1.25) + 8
        while True:
            draw = eligible[rng.integers(0, eligible.size, size=n)]
            cums = total + np.cumsum(self.tokens[draw])
            take = int(np.searchsorted(cums, budget, side="right"))
            out.extend(draw[:take].tolist())
            if take < n:
                return out
            total = int(cums[-1])
            n *= 2

    def _sequential(self, step, eligible, cap, budget, size) -> list[int]:
        m = eligible.size
        if size is not None:
            return eligible[(np.arange(step * size, (step + 1) * size)) % m].tolist()
        key = (cap, budget)
        bounds = self._bounds.setdefault(key, [0])
        cum = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(self.tokens[eligible], out=cum[1:])
        epoch_tokens = int(cum[-1])

        def cum_at(p: int) -> int:
            return (p // m) * epoch_tokens + int(cum[p % m])

        while len(bounds) <= step + 1:
            b = bounds[-1]
            target = cum_at(b) + budget
            ep, rem = divmod(target, epoch_tokens)
            p = ep * m + int(np.searchsorted(cum, rem, side="right")) - 1
            bounds.append(max(p, b + 1))
        a, b = bounds[step], bounds[step + 1]
        return eligible[np.arange(a, b) % m].tolist()

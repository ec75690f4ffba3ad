"""Workload specs: sources (what one sample looks like), a mixture schedule over them, limits.

A workload is data. Named workloads live as TOML files in `workloads/specs/`; a user passes
a path to a TOML, YAML or JSON file with the same fields wherever a name is accepted, or a
`.jsonl` trace of real samples (see `workloads.trace`). Everything is validated here, once,
into frozen dataclasses; a bad field raises `WorkloadError` naming the field and the
allowed values.

File layout (TOML shown; YAML/JSON use the same keys):

    name = "my_mix"
    description = "one line"
    total_steps = 1000            # nominal length of training, places a step in the schedule
    max_sample_tokens = 32768     # optional: drop-and-redraw samples longer than this

    [vision]                      # optional Qwen2-VL limits (tokens.VisionRule)
    preset = "utils"              # "hf" (1,280 tokens per image) or "utils" (16,384)

    [sources.caption]             # one mixture component
    text_tokens = "sharegpt4v_caption_tokens"     # preset, number or {kind = ...}
    images = 1                    # count per sample (number or distribution)
    image_pixels = "coco_pixels"  # raw area; or image_tokens = ... (area = tokens * 784)
    image_aspect = "coco_aspect"  # height / width
    # videos / video_seconds / video_pixels / video_aspect / video_audio = true
    # audios / audio_seconds

    [schedule]                    # kind = constant | changing | staged | bursty
    kind = "constant"
    weights = { caption = 1.0 }

A mixture phase has `weights` (per source, normalised), optional `length` (per-source
multiplier on raw sizes: durations, pixel area, text) and optional `max_sample_tokens`.
- constant: one phase (`weights`, `length`, `max_sample_tokens` at the schedule level);
- changing: `initial` and `final` phases; weights and length multipliers move linearly
  between `start` and `end` (fractions of total_steps, default 0 and 1), as VeOmni's
  `schedule_type: changing`;
- staged: `[[schedule.stages]]` each with `until` (fraction of total_steps where it ends,
  increasing, last one 1.0), a curriculum like LLaVA-OneVision's;
- bursty: `[[schedule.regimes]]` each with `mean_steps` (mean dwell, geometric) and `weight`
  (chance to be the next regime); the switch steps are drawn from the stream seed, so the
  regime at a step is deterministic and independent of which steps were generated before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workloads.distributions import PRESETS, Dist, DistributionError, parse_dist
from workloads.tokens import HF_RULE, PIXELS_PER_TOKEN, UTILS_RULE, TokenRuleError, VisionRule


class WorkloadError(ValueError):
    """Bad workload spec or name; the message names the field and the allowed values."""


SCHEDULE_KINDS = ("constant", "changing", "staged", "bursty")
SOURCE_KEYS = (
    "description",
    "text_tokens",
    "images",
    "image_pixels",
    "image_tokens",
    "image_aspect",
    "videos",
    "video_seconds",
    "video_pixels",
    "video_aspect",
    "video_audio",
    "audios",
    "audio_seconds",
)
PHASE_KEYS = ("name", "weights", "length", "max_sample_tokens", "until", "mean_steps", "weight")
VISION_KEYS = ("preset",) + tuple(VisionRule.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One mixture component: the shape of its samples.

    Per sample: `images` images, then `videos` videos (each followed by its audio track when
    `video_audio`), then `audios` audio clips, then the text; multi-image samples interleave a
    slice of the text before each image, like a multi-turn conversation.
    """

    name: str
    description: str = ""
    text_tokens: Dist | None = None
    images: Dist | None = None
    image_pixels: Dist | None = None
    image_tokens: Dist | None = None
    image_aspect: Dist = PRESETS["coco_aspect"]
    videos: Dist | None = None
    video_seconds: Dist | None = None
    video_pixels: Dist = PRESETS["web_video_pixels"]
    video_aspect: Dist = PRESETS["video_aspect"]
    video_audio: bool = False
    audios: Dist | None = None
    audio_seconds: Dist | None = None

    @property
    def modalities(self) -> tuple[str, ...]:
        out = []
        if self.images is not None:
            out.append("image")
        if self.videos is not None:
            out.append("video")
        if self.audios is not None or self.video_audio:
            out.append("audio")
        if self.text_tokens is not None:
            out.append("text")
        return tuple(out)


@dataclass(frozen=True, slots=True)
class MixPhase:
    """One mixture: normalised weights and length multipliers over the spec's sources (in order)."""

    name: str
    weights: tuple[float, ...]
    length: tuple[float, ...]
    max_sample_tokens: int | None = None
    until: float = 1.0  # staged: fraction of total_steps where this stage ends
    mean_steps: float = 0.0  # bursty: mean dwell in steps
    weight: float = 1.0  # bursty: chance to be the next regime


@dataclass(frozen=True, slots=True)
class Mix:
    """The mixture in force at one step (what the stream samples from)."""

    phase: str
    weights: np.ndarray
    length: np.ndarray
    max_sample_tokens: int | None


@dataclass(frozen=True)
class ScheduleSpec:
    kind: str
    phases: tuple[MixPhase, ...]
    start: float = 0.0  # changing: fraction of total_steps where the drift begins
    end: float = 1.0  # changing: ... and ends

    def mix(self, step: int, total_steps: int, seed: int = 0) -> Mix:
        if step < 0:
            raise WorkloadError(f"step: must be >= 0, got {step}")
        progress = step / max(1, total_steps)
        if self.kind == "constant":
            return _mix(self.phases[0])
        if self.kind == "changing":
            a, b = self.phases
            span = self.end - self.start
            f = 1.0 if span <= 0 else min(1.0, max(0.0, (progress - self.start) / span))
            w = (1 - f) * np.asarray(a.weights) + f * np.asarray(b.weights)
            ln = (1 - f) * np.asarray(a.length) + f * np.asarray(b.length)
            cap = b.max_sample_tokens if f >= 0.5 else a.max_sample_tokens
            return Mix(f"{a.name}->{b.name} {f:.0%}", w / w.sum(), ln, cap)
        if self.kind == "staged":
            for ph in self.phases:
                if progress < ph.until:
                    return _mix(ph)
            return _mix(self.phases[-1])
        return _mix(self.phases[self.regime_at(step, seed)])

    def regime_at(self, step: int, seed: int) -> int:
        """Bursty: index of the regime in force at `step` (a renewal process drawn from seed)."""
        starts, regimes = _bursty_switches(self, seed, step)
        return regimes[int(np.searchsorted(starts, step, side="right")) - 1]

    def phase_names(self) -> list[str]:
        return [p.name for p in self.phases]


def _mix(ph: MixPhase) -> Mix:
    return Mix(ph.name, np.asarray(ph.weights), np.asarray(ph.length), ph.max_sample_tokens)


_BURST_CACHE: dict[tuple[ScheduleSpec, int], tuple[list[int], list[int]]] = {}
_BURST_TAG = 0xB0257


def _bursty_switches(sched: ScheduleSpec, seed: int, step: int) -> tuple[list[int], list[int]]:
    """Switch steps and regimes covering `step`. The whole sequence comes from one generator
    seeded by (seed, tag) and is regenerated from its start when it must grow, so it depends
    only on the seed, never on which steps were asked for first."""
    key = (sched, seed)
    starts, regimes = _BURST_CACHE.get(key, ([0], [0]))
    if starts[-1] > step:
        return starts, regimes
    horizon = max(step + 1, 2 * starts[-1] + 64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _BURST_TAG]))
    starts, regimes = [0], [0]
    cur, n = 0, len(sched.phases)
    w = np.asarray([p.weight for p in sched.phases])
    while starts[-1] <= horizon:
        dwell = int(rng.geometric(1.0 / max(1.0, sched.phases[cur].mean_steps)))
        others = w.copy()
        others[cur] = 0.0
        nxt = cur if others.sum() <= 0 else int(rng.choice(n, p=others / others.sum()))
        starts.append(starts[-1] + dwell)
        regimes.append(nxt)
        cur = nxt
    _BURST_CACHE[key] = (starts, regimes)
    return starts, regimes


@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload: sources, schedule, limits. `total_steps` is the nominal training
    length that places a step within a changing or staged schedule (a stream may override)."""

    name: str
    description: str
    sources: tuple[SourceSpec, ...]
    schedule: ScheduleSpec
    total_steps: int = 1000
    max_sample_tokens: int | None = None
    vision: VisionRule = HF_RULE
    origin: str = "builtin"
    trace: Any = None  # workloads.trace.Trace when the workload replays a trace
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def mix(self, step: int, total_steps: int | None = None, seed: int = 0) -> Mix:
        return self.schedule.mix(step, total_steps or self.total_steps, seed)


# Bounds that keep every size the generator computes finite and every sample trainable: no model
# has a context of 2**24 tokens (the longest published, 10M, is below it), and a length multiplier
# of 1000 already makes a 3-minute video 50 hours long.
MAX_SAMPLE_TOKENS = 1 << 24
MAX_LENGTH = 1000.0
# A billion steps: the longest published training runs take about a million; a step number past 2**63
# no longer fits the int64 the schedules compute with.
MAX_STEPS = 10**9
# What one sample of a source may hold, far beyond any data set, so that the sizes drawn (times a length
# multiplier of up to MAX_LENGTH) stay exact in int64 and a step's draw fits in memory.
SOURCE_LIMITS: dict[str, tuple[int, str]] = {
    "text_tokens": (MAX_SAMPLE_TOKENS, "tokens (the longest sample)"),
    "image_tokens": (MAX_SAMPLE_TOKENS, "tokens (the longest sample)"),
    # multi-image data sets hold up to a few hundred images per sample
    "images": (1024, "per sample"),
    "videos": (1024, "per sample"),
    "audios": (1024, "per sample"),
    # a gigapixel; Qwen2-VL resizes an image to at most 12.8 MP (qwen-vl-utils) and an 8K frame has 33 MP
    "image_pixels": (1 << 30, "pixels"),
    "video_pixels": (1 << 30, "pixels per frame"),
    # about 11.6 days; the longest videos and recordings in published sets last hours
    "video_seconds": (1_000_000, "seconds"),
    "audio_seconds": (1_000_000, "seconds"),
}
# Vision-rule limits: a pixel limit past the longest sample (2**24 tokens of 28 x 28 px) limits nothing;
# Qwen2-VL samples video at 2 fps, 4 to 768 frames.
MAX_RULE_PIXELS = MAX_SAMPLE_TOKENS * PIXELS_PER_TOKEN
MAX_FPS = 1000.0
MAX_FRAMES = 1 << 20


# ---- parsing ------------------------------------------------------------------------------------
def _positive_int(v: Any, fld: str, allow_none: bool = False, maximum: int | None = None) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or (maximum is not None and v > maximum):
        most = f" (at most {maximum:,})" if maximum is not None else ""
        raise WorkloadError(f"{fld}: must be a positive integer{most}, got {v!r}")
    return v


def _unknown(d: dict, allowed: tuple[str, ...], fld: str) -> None:
    bad = sorted(set(d) - set(allowed))
    if bad:
        raise WorkloadError(f"{fld}: unknown key(s) {', '.join(bad)}; allowed: {', '.join(allowed)}")


def _dist(d: dict, key: str, fld: str) -> Dist | None:
    if key not in d or d[key] is None:
        return None
    try:
        return parse_dist(d[key], f"{fld}.{key}")
    except DistributionError as e:
        raise WorkloadError(str(e)) from None


def _top(dist: Dist) -> float:
    """The largest value `dist` draws; inf for a tail without a bound (normal, lognormal, pareto)."""
    k, p = dist.kind, dist.params
    if k == "const":
        top = p[0]
    elif k == "uniform":
        top = p[1]
    elif k == "quantiles":
        top = math.exp(max(p[1]))
    elif k == "buckets":
        top = p[0][-1]
    elif k == "choice":
        top = max(p[0])
    elif k == "mixture":
        top = max(_top(c) for c in p[0])
    else:
        top = math.inf
    return min(top, dist.hi)


def _named(dist: Dist) -> float:
    """The largest value `dist`'s parameters name: its top, or where an unbounded tail starts (the
    median of a lognormal, the mean of a normal, the minimum of a pareto)."""
    if dist.kind in ("normal", "lognormal", "pareto"):
        return min(dist.params[0], dist.hi)
    if dist.kind == "mixture":
        return max(_named(c) for c in dist.params[0])
    return _top(dist)


def _bounded(dist: Dist, key: str, fld: str) -> Dist:
    """`dist` refused when its parameters name a value over the field's limit; an unbounded tail is cut
    at the limit (as a `max` would), so no draw is absurd either."""
    limit, unit = SOURCE_LIMITS[key]
    named = _named(dist)
    if named > limit:
        raise WorkloadError(f"{fld}.{key}: must be at most {limit:,} {unit}, got {named:g}")
    if _top(dist) > limit:
        return Dist(dist.kind, dist.params, dist.lo, float(limit))
    return dist


def parse_source(name: str, d: Any) -> SourceSpec:
    fld = f"sources.{name}"
    if not isinstance(d, dict):
        raise WorkloadError(f"{fld}: expected a table, got {type(d).__name__}")
    _unknown(d, SOURCE_KEYS, fld)
    kw: dict[str, Any] = {"name": name, "description": str(d.get("description", ""))}
    for key in SOURCE_KEYS:
        if key in ("description", "video_audio"):
            continue
        dist = _dist(d, key, fld)
        if dist is not None:
            kw[key] = _bounded(dist, key, fld) if key in SOURCE_LIMITS else dist
    va = d.get("video_audio", False)
    if not isinstance(va, bool):
        raise WorkloadError(f"{fld}.video_audio: must be true or false, got {va!r}")
    kw["video_audio"] = va
    src = SourceSpec(**kw)
    if src.images is not None and (src.image_pixels is None) == (src.image_tokens is None):
        raise WorkloadError(f"{fld}: with images, give exactly one of image_pixels or image_tokens")
    if src.videos is not None and src.video_seconds is None:
        raise WorkloadError(f"{fld}.video_seconds: required when videos is set")
    if src.audios is not None and src.audio_seconds is None:
        raise WorkloadError(f"{fld}.audio_seconds: required when audios is set")
    if va and src.videos is None:
        raise WorkloadError(f"{fld}.video_audio: needs videos")
    if not src.modalities:
        raise WorkloadError(f"{fld}: a source needs at least one of text_tokens, images, videos, audios")
    return src


def _phase(d: Any, names: tuple[str, ...], fld: str, default_name: str) -> MixPhase:
    if not isinstance(d, dict):
        raise WorkloadError(f"{fld}: expected a table, got {type(d).__name__}")
    _unknown(d, PHASE_KEYS, fld)
    weights = d.get("weights")
    if not isinstance(weights, dict) or not weights:
        raise WorkloadError(f"{fld}.weights: expected a table source -> weight over {', '.join(names)}")
    w = []
    for k in weights:
        if k not in names:
            raise WorkloadError(f"{fld}.weights.{k}: unknown source; allowed: {', '.join(names)}")
    for n in names:
        v = weights.get(n, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise WorkloadError(f"{fld}.weights.{n}: must be a number >= 0, got {v!r}")
        w.append(float(v))
    if sum(w) <= 0:
        raise WorkloadError(f"{fld}.weights: must have a positive sum")
    length = d.get("length", {}) or {}
    if not isinstance(length, dict):
        raise WorkloadError(f"{fld}.length: expected a table source -> multiplier")
    for k, v in length.items():
        if k not in names:
            raise WorkloadError(f"{fld}.length.{k}: unknown source; allowed: {', '.join(names)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_LENGTH:
            raise WorkloadError(f"{fld}.length.{k}: must be a number in (0, {MAX_LENGTH:g}], got {v!r}")
    s = sum(w)
    until = d.get("until", 1.0)
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not 0 < until <= 1:
        raise WorkloadError(f"{fld}.until: must be a fraction in (0, 1], got {until!r}")
    mean_steps = d.get("mean_steps", 0.0)
    if isinstance(mean_steps, bool) or not isinstance(mean_steps, (int, float)) or not 0 <= mean_steps <= MAX_STEPS:
        raise WorkloadError(f"{fld}.mean_steps: must be a number in [0, {MAX_STEPS:,}], got {mean_steps!r}")
    weight = d.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise WorkloadError(f"{fld}.weight: must be a finite number >= 0, got {weight!r}")
    return MixPhase(
        name=str(d.get("name", default_name)),
        weights=tuple(x / s for x in w),
        length=tuple(float(length.get(n, 1.0)) for n in names),
        max_sample_tokens=_positive_int(d.get("max_sample_tokens"), f"{fld}.max_sample_tokens", True,
                                        MAX_SAMPLE_TOKENS),
        until=float(until),
        mean_steps=float(mean_steps),
        weight=float(weight),
    )


def parse_schedule(d: Any, names: tuple[str, ...]) -> ScheduleSpec:
    if not isinstance(d, dict):
        raise WorkloadError("schedule: expected a table with kind = " + " | ".join(SCHEDULE_KINDS))
    kind = d.get("kind", "constant")
    if kind not in SCHEDULE_KINDS:
        raise WorkloadError(f"schedule.kind: must be one of {', '.join(SCHEDULE_KINDS)}, got {kind!r}")
    if kind == "constant":
        body = {k: v for k, v in d.items() if k != "kind"}
        return ScheduleSpec(kind, (_phase(body, names, "schedule", "constant"),))
    if kind == "changing":
        _unknown(d, ("kind", "initial", "final", "start", "end"), "schedule")
        if "initial" not in d or "final" not in d:
            raise WorkloadError("schedule: kind 'changing' needs 'initial' and 'final' tables")
        a = _phase(d["initial"], names, "schedule.initial", "initial")
        b = _phase(d["final"], names, "schedule.final", "final")
        start, end = d.get("start", 0.0), d.get("end", 1.0)
        for k, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise WorkloadError(f"schedule.{k}: must be a fraction in [0, 1], got {v!r}")
        if end < start:
            raise WorkloadError("schedule.end: must be >= schedule.start")
        return ScheduleSpec(kind, (a, b), float(start), float(end))
    key = "stages" if kind == "staged" else "regimes"
    _unknown(d, ("kind", key), "schedule")
    items = d.get(key)
    if not isinstance(items, list) or not items:
        raise WorkloadError(f"schedule.{key}: kind {kind!r} needs a non-empty list of {key}")
    phases = tuple(_phase(x, names, f"schedule.{key}[{i}]", f"{key[:-1]}{i}") for i, x in enumerate(items))
    if kind == "staged":
        untils = [p.until for p in phases]
        if any(b <= a for a, b in zip(untils, untils[1:], strict=False)) or untils[-1] != 1.0:
            raise WorkloadError("schedule.stages: 'until' must increase and the last stage must end at 1.0")
    else:
        for i, p in enumerate(phases):
            if p.mean_steps < 1:
                raise WorkloadError(f"schedule.regimes[{i}].mean_steps: must be >= 1, got {p.mean_steps}")
    return ScheduleSpec(kind, phases)


def parse_vision(d: Any) -> VisionRule:
    if d is None:
        return HF_RULE
    if not isinstance(d, dict):
        raise WorkloadError("vision: expected a table")
    _unknown(d, VISION_KEYS, "vision")
    preset = d.get("preset", "hf")
    if preset not in ("hf", "utils"):
        raise WorkloadError(f"vision.preset: must be 'hf' or 'utils', got {preset!r}")
    base = HF_RULE if preset == "hf" else UTILS_RULE
    kw = {k: getattr(base, k) for k in VisionRule.__dataclass_fields__}
    for k, v in d.items():
        if k == "preset":
            continue
        if k == "fps":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_FPS:
                raise WorkloadError(f"vision.fps: must be a number in (0, {MAX_FPS:g}], got {v!r}")
            kw[k] = float(v)
            continue
        top = MAX_FRAMES if k.endswith("_frames") else MAX_RULE_PIXELS
        # a float is taken when it is a whole number (1e6 pixels), never rounded
        whole = isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v == int(v))
        if isinstance(v, bool) or not whole or not 1 <= v <= top:
            raise WorkloadError(f"vision.{k}: must be an integer in [1, {top:,}], got {v!r}")
        kw[k] = int(v)
    try:
        return VisionRule(**kw)
    except TokenRuleError as e:
        raise WorkloadError(str(e)) from None


TOP_KEYS = ("name", "description", "total_steps", "max_sample_tokens", "vision", "sources", "schedule")


def spec_from_dict(d: Any, origin: str = "<dict>") -> WorkloadSpec:
    """Validate a workload dict (as read from TOML/YAML/JSON) into a WorkloadSpec."""
    if not isinstance(d, dict):
        raise WorkloadError(f"{origin}: a workload must be a table/object at the top level")
    try:
        _unknown(d, TOP_KEYS, "workload")
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise WorkloadError("name: must be a non-empty string")
        sources = d.get("sources")
        if not isinstance(sources, dict) or not sources:
            raise WorkloadError("sources: expected a table of at least one source")
        srcs = tuple(parse_source(str(k), v) for k, v in sources.items())
        names = tuple(s.name for s in srcs)
        sched = parse_schedule(d.get("schedule"), names)
        return WorkloadSpec(
            name=name,
            description=str(d.get("description", "")),
            sources=srcs,
            schedule=sched,
            total_steps=_positive_int(d.get("total_steps", 1000), "total_steps", maximum=MAX_STEPS),
            max_sample_tokens=_positive_int(d.get("max_sample_tokens"), "max_sample_tokens", True, MAX_SAMPLE_TOKENS),
            vision=parse_vision(d.get("vision")),
            origin=origin,
            raw=d,
        )
    except WorkloadError as e:
        raise WorkloadError(f"{origin}: {e}" if origin != "<dict>" else str(e)) from None


# ---- files and the registry ------------------------------------------------------------------------
SPEC_DIR = Path(__file__).with_name("specs")
FILE_SUFFIXES = (".toml", ".yaml", ".yml", ".json", ".jsonl")


def read_spec_file(path: Path) -> Any:
    suffix = path.suffix.lower()
    if path.is_dir():
        raise WorkloadError(f"{path}: is a folder, not a workload file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: cannot read: not text (not UTF-8)") from None
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        if suffix == ".json":
            return json.loads(text)
    except RecursionError:
        raise WorkloadError(f"{path}: not valid {suffix[1:].upper()}: nested too deeply") from None
    except Exception as e:  # parser errors carry line numbers; keep them on one line
        raise WorkloadError(f"{path}: not valid {suffix[1:].upper()}: {str(e).splitlines()[0]}") from None
    raise WorkloadError(f"{path}: unsupported file type {suffix!r}; allowed: {', '.join(FILE_SUFFIXES)}")

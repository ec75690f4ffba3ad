"""Length distributions: how big each raw input is (pixels, seconds, text tokens, counts).

A distribution is a small frozen object with a vectorised `sample(rng, n) -> float64 array`.
Workload files name one either inline (`{kind = "lognormal", median = 8, sigma = 0.6}`), by a
number (a constant) or by the name of a calibrated preset below (`"panda70m_seconds"`).

Every preset carries its source. Where a source gives only some quantiles, the quantile
("knots") form interpolates the inverse CDF between them in log space; knots that are not
published are marked *assumed* next to the number, so a reader can tell data from guesswork.
tests/test_workloads_distributions.py checks each published figure against samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Z90 = 1.2815515655446004  # standard normal quantile at 0.9


class DistributionError(ValueError):
    """Bad distribution spec; the message names the field and what is allowed."""


KINDS = ("const", "uniform", "normal", "lognormal", "quantiles", "buckets", "choice", "pareto", "mixture")


@dataclass(frozen=True, slots=True)
class Dist:
    """One distribution. `kind` picks the sampler; `params` are its parameters; draws are
    clipped to [lo, hi]."""

    kind: str
    params: tuple
    lo: float = -math.inf
    hi: float = math.inf

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k, p = self.kind, self.params
        if k == "const":
            x = np.full(n, p[0], dtype=np.float64)
        elif k == "uniform":
            x = rng.uniform(p[0], p[1], n)
        elif k == "normal":
            x = rng.normal(p[0], p[1], n)
        elif k == "lognormal":  # (median, sigma)
            x = p[0] * np.exp(p[1] * rng.standard_normal(n))
        elif k == "quantiles":  # (probs, log-values): piecewise log-linear inverse CDF
            x = np.exp(np.interp(rng.random(n), p[0], p[1]))
        elif k == "buckets":  # (edges, cumulative weights): uniform inside each bucket
            edges, cum = p
            b = np.searchsorted(cum, rng.random(n), side="right")
            b = np.minimum(b, len(edges) - 2)
            x = rng.uniform(np.asarray(edges)[b], np.asarray(edges)[b + 1])
        elif k == "choice":  # (values, probs)
            x = np.asarray(p[0], dtype=np.float64)[rng.choice(len(p[0]), size=n, p=p[1])]
        elif k == "pareto":  # (x_min, alpha)
            x = p[0] * (1.0 + rng.pareto(p[1], n))
        elif k == "mixture":  # (components, probs)
            comps, probs = p
            which = rng.choice(len(comps), size=n, p=probs)
            x = np.empty(n, dtype=np.float64)
            for i, c in enumerate(comps):
                idx = np.flatnonzero(which == i)
                if idx.size:
                    x[idx] = c.sample(rng, idx.size)
        else:  # pragma: no cover - parse_dist validates kinds
            raise DistributionError(f"unknown distribution kind {k!r}")
        if self.lo != -math.inf or self.hi != math.inf:
            np.clip(x, self.lo, self.hi, out=x)
        return x

    def mean(self, rng_seed: int = 0, n: int = 20_000) -> float:
        """Monte-Carlo mean (used to size draws, not for calibration claims)."""
        return float(self.sample(np.random.default_rng(rng_seed), n).mean())

    def describe(self) -> str:
        k, p = self.kind, self.params
        if k == "const":
            s = f"{p[0]:g}"
        elif k == "lognormal":
            s = f"lognormal(median={p[0]:.4g}, sigma={p[1]:.3g})"
        elif k == "quantiles":
            s = (
                "quantiles("
                + ", ".join(f"p{q * 100:g}={math.exp(v):.4g}" for q, v in zip(p[0], p[1], strict=True))
                + ")"
            )
        elif k == "buckets":
            s = f"buckets(edges={list(p[0])})"
        elif k == "choice":
            s = f"choice({list(p[0])})"
        elif k == "mixture":
            s = "mixture(" + ", ".join(c.describe() for c in p[0]) + ")"
        else:
            s = f"{k}{tuple(p)}"
        if self.lo != -math.inf or self.hi != math.inf:
            s += f" in [{self.lo:g}, {self.hi:g}]"
        return s


# ---- constructors --------------------------------------------------------------------------------
def const(value: float) -> Dist:
    return Dist("const", (float(value),))


def lognormal(median: float, sigma: float, lo: float = -math.inf, hi: float = math.inf) -> Dist:
    return Dist("lognormal", (float(median), float(sigma)), lo, hi)


def lognormal_mean(mean: float, sigma: float, lo: float = -math.inf, hi: float = math.inf) -> Dist:
    """Lognormal with a published mean and an assumed spread: median = mean / exp(sigma^2/2)."""
    return lognormal(mean / math.exp(sigma * sigma / 2), sigma, lo, hi)


def lognormal_p10_p90(p10: float, p90: float, lo: float = -math.inf, hi: float = math.inf) -> Dist:
    return lognormal(math.sqrt(p10 * p90), math.log(p90 / p10) / (2 * Z90), lo, hi)


def quantiles(knots: dict[float, float], lo: float = -math.inf, hi: float = math.inf) -> Dist:
    """Inverse CDF through (probability -> value) knots; must include 0 and 1."""
    probs = sorted(knots)
    if probs[0] != 0 or probs[-1] != 1:
        raise DistributionError("quantiles.knots: must include probabilities 0 and 1")
    vals = [float(knots[q]) for q in probs]
    if any(v <= 0 for v in vals) or any(b < a for a, b in zip(vals, vals[1:], strict=False)):
        raise DistributionError("quantiles.knots: values must be positive and non-decreasing")
    return Dist("quantiles", (tuple(float(q) for q in probs), tuple(math.log(v) for v in vals)), lo, hi)


def buckets(edges: list[float], weights: list[float], lo: float = -math.inf, hi: float = math.inf) -> Dist:
    if len(edges) != len(weights) + 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise DistributionError("buckets: need len(edges) == len(weights) + 1 and increasing edges")
    w = _probs(weights, "buckets.weights")
    return Dist("buckets", (tuple(float(e) for e in edges), tuple(np.cumsum(w).tolist())), lo, hi)


def choice(values: list[float], weights: list[float] | None = None) -> Dist:
    if not values:
        raise DistributionError("choice.values: must not be empty")
    w = _probs(weights if weights is not None else [1.0] * len(values), "choice.weights")
    if len(w) != len(values):
        raise DistributionError("choice: values and weights must have the same length")
    return Dist("choice", (tuple(float(v) for v in values), tuple(w)))


def mixture(
    components: list[Dist], weights: list[float], lo: float = -math.inf, hi: float = math.inf
) -> Dist:
    w = _probs(weights, "mixture.weights")
    if len(w) != len(components):
        raise DistributionError("mixture: components and weights must have the same length")
    return Dist("mixture", (tuple(components), tuple(w)), lo, hi)


def _probs(weights, field: str) -> list[float]:
    try:
        w = [float(x) for x in weights]
    except (TypeError, ValueError):
        raise DistributionError(f"{field}: must be a list of numbers") from None
    if not w or any(x < 0 or not math.isfinite(x) for x in w) or sum(w) <= 0:
        raise DistributionError(f"{field}: must be non-negative numbers with a positive sum")
    s = sum(w)
    return [x / s for x in w]


# ---- calibrated presets -----------------------------------------------------------------------------
CHARS_PER_TOKEN = 4.0  # assumed: English text in the Qwen2 BPE tokenizer
_P = 784  # pixels per Qwen2-VL token (28x28)

PRESETS: dict[str, Dist] = {
    # ---- images: raw pixel area and aspect (height / width) ----
    # COCO: 90% of images between 167,500 and 355,840 px (p5/p95); p50 273,280 = 640x427, one of
    # COCO's two most common sizes (assumed median); max 640x640 (COCO's longest side is 640).
    "coco_pixels": quantiles({0: 40_000, 0.05: 167_500, 0.5: 273_280, 0.95: 355_840, 1: 409_600}),
    # COCO: h/w between 0.6 and 1.5; split landscape 78% / portrait 22% is assumed.
    "coco_aspect": mixture(
        [Dist("normal", (0.72, 0.05)), Dist("normal", (1.36, 0.08))], [0.78, 0.22], lo=0.6, hi=1.5
    ),
    # Scanned pages (letter 1.29, A4 1.41): assumed.
    "document_aspect": Dist("normal", (1.32, 0.1), 0.8, 1.8),
    # Charts are landscape plots (ChartQA renders): assumed.
    "chart_aspect": Dist("normal", (0.7, 0.1), 0.4, 1.2),
    # Science diagrams (AI2D): assumed.
    "diagram_aspect": Dist("normal", (0.85, 0.2), 0.4, 1.6),
    # ---- images given by LLM token budget (InternVL SFT sets, ModelTC/OmniBal
    # data/vision/*_wh_token_lengths.json, derived). The sets publish *total* tokens (image +
    # text); the image part below is total minus the set's text p50, and the raw image is
    # synthesised with that many 28x28 px cells so the Qwen2-VL rule (utils limits) gives the
    # same budget. Knots p0/p100 are assumed. ----
    # DocVQA total p10/p50/p90 = 983/1475/1821, text p50 52 -> image 931/1423/1769.
    "docvqa_image_tokens": quantiles({0: 300, 0.1: 931, 0.5: 1423, 0.9: 1769, 1: 3300}),
    # AI2D total p10/p50/p90 = 302/811/1331, bimodal; text p50 120 (assumed) -> image
    # 182/691/1211; the p35/p65 knots that open a gap between the two modes are assumed.
    "ai2d_image_tokens": quantiles({0: 60, 0.1: 182, 0.35: 300, 0.5: 691, 0.65: 900, 0.9: 1211, 1: 1900}),
    # ChartQA total p50 1328, text p50 60 (assumed) -> image p50 1268; p10/p90 assumed +-20%.
    "chartqa_image_tokens": quantiles({0: 500, 0.1: 1010, 0.5: 1268, 0.9: 1520, 1: 2400}),
    # ---- text tokens ----
    # InternVL SFT text parts: p50 52..231, p90 67..577 across sets. DocVQA takes the low end
    # (short extractive answers) p50 52 / p90 67; other sets' text below is assumed in range.
    "docvqa_text_tokens": quantiles({0: 20, 0.1: 40, 0.5: 52, 0.9: 67, 1: 200}),
    "ai2d_text_tokens": quantiles({0: 40, 0.1: 80, 0.5: 120, 0.9: 180, 1: 400}),
    "chartqa_text_tokens": quantiles({0: 20, 0.1: 42, 0.5: 60, 0.9: 90, 1: 300}),
    # ShareGPT4V captions: about 830..940 characters; at 4 chars/token about 208..235 tokens.
    # p10/p90 and tails assumed; mean 222 tokens (888 chars).
    "sharegpt4v_caption_tokens": quantiles({0: 60, 0.1: 150, 0.5: 220, 0.9: 300, 1: 560}),
    # Text-only SFT conversations: no published figure; assumed ShareGPT-like.
    "sft_text_tokens": quantiles({0: 16, 0.1: 150, 0.5: 600, 0.9: 2400, 0.99: 6000, 1: 16_384}),
    # Short VQA-style question + answer: assumed.
    "vqa_text_tokens": quantiles({0: 8, 0.1: 20, 0.5: 60, 0.9: 180, 1: 800}),
    # Video QA / dense caption: assumed.
    "video_text_tokens": quantiles({0: 16, 0.1: 40, 0.5: 120, 0.9: 400, 1: 2000}),
    # ASR transcript / audio caption + prompt: assumed.
    "audio_text_tokens": quantiles({0: 8, 0.1: 20, 0.5: 45, 0.9: 110, 1: 400}),
    # ---- video: duration (s), frame area, aspect ----
    # Panda-70M mean 8.5 s, InternVid mean 11.7 s, WebVid-10M mean 17.5 s (derived means);
    # spreads (sigma) and clip ranges assumed.
    "panda70m_seconds": lognormal_mean(8.5, 0.55, lo=1.0, hi=60.0),
    "internvid_seconds": lognormal_mean(11.7, 0.6, lo=1.0, hi=120.0),
    "webvid_seconds": lognormal_mean(17.5, 0.5, lo=2.0, hi=60.0),
    # LLaVA-Video-178K: 0..3 min in buckets 0-30 s, 30-60 s, 1-2 min, 2-3 min (bucket shares
    # assumed; shortest clip assumed 2 s).
    "llava_video_seconds": buckets([2, 30, 60, 120, 180], [0.35, 0.3, 0.2, 0.15]),
    # Long-video sets (hour-scale lectures, movies): heavy tail, assumed: Pareto from 60 s,
    # alpha 1.1, capped at one hour.
    "long_video_seconds": Dist("pareto", (60.0, 1.1), 60.0, 3600.0),
    # Web video resolutions 360p/480p/720p/1080p (frame area; shares assumed).
    "web_video_pixels": choice([640 * 360, 854 * 480, 1280 * 720, 1920 * 1080], [0.25, 0.3, 0.35, 0.1]),
    # 16:9 landscape dominant, some 4:3 and portrait (assumed).
    "video_aspect": choice([9 / 16, 3 / 4, 16 / 9], [0.85, 0.1, 0.05]),
    # ---- audio: duration (s) ----
    # WavCaps SoundBible: mean 13.1 s, p10 1.5, p50 5.0, p90 25.1, heavy right tail; the p99/max
    # knots are chosen so the mean comes out at 13.1 s.
    "wavcaps_seconds": quantiles({0: 0.3, 0.1: 1.5, 0.5: 5.0, 0.9: 25.1, 0.99: 110.0, 1: 260.0}),
    # AudioSet / AudioCaps: 10 s clips; a few shorter ones (share assumed 8%).
    "audiocaps_seconds": quantiles({0: 1.0, 0.08: 9.99, 1: 10.0}, hi=10.0),
    # LibriSpeech: utterances up to 35 s, mean about 12 s; inner knots assumed.
    "librispeech_seconds": quantiles({0: 1.0, 0.1: 4.2, 0.3: 9.5, 0.5: 13.8, 0.9: 16.2, 0.99: 24.0, 1: 35.0}),
    # ---- counts ----
    # Multi-image conversations (LLaVA-OneVision multi-image stage): 2..12 images, shares assumed.
    "multi_image_count": choice([2, 3, 4, 5, 6, 8, 10, 12], [0.32, 0.2, 0.16, 0.1, 0.08, 0.07, 0.04, 0.03]),
}


def parse_dist(value: Any, field: str) -> Dist:
    """A distribution from a workload file value: number, preset name or inline table."""
    if isinstance(value, Dist):
        return value
    if isinstance(value, bool):
        raise DistributionError(f"{field}: expected a number, preset name or table, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise DistributionError(f"{field}: constant must be a finite number >= 0, got {value}")
        return const(value)
    if isinstance(value, str):
        if value not in PRESETS:
            raise DistributionError(
                f"{field}: unknown preset {value!r}; allowed: {', '.join(sorted(PRESETS))}"
            )
        return PRESETS[value]
    if not isinstance(value, dict):
        raise DistributionError(
            f"{field}: expected a number, preset name or table, got {type(value).__name__}"
        )
    d = dict(value)
    kind = d.pop("kind", None)
    if kind not in KINDS:
        raise DistributionError(f"{field}.kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    lo = _num(d, "min", field) if "min" in d else -math.inf
    hi = _num(d, "max", field) if "max" in d else math.inf
    try:
        if kind == "const":
            dist = const(_num(d, "value", field))
        elif kind == "uniform":
            a, b = _num(d, "low", field), _num(d, "high", field)
            if b < a:
                raise DistributionError(f"{field}.high: must be >= low")
            dist = Dist("uniform", (a, b))
        elif kind == "normal":
            dist = Dist("normal", (_num(d, "mean", field), _num(d, "std", field)))
        elif kind == "lognormal":
            sigma = _num(d, "sigma", field) if "sigma" in d else None
            if "p10" in d and "p90" in d:
                dist = lognormal_p10_p90(_num(d, "p10", field), _num(d, "p90", field))
            elif "median" in d and sigma is not None:
                dist = lognormal(_num(d, "median", field), sigma)
            elif "mean" in d and sigma is not None:
                dist = lognormal_mean(_num(d, "mean", field), sigma)
            else:
                raise DistributionError(
                    f"{field}: lognormal needs (median, sigma), (mean, sigma) or (p10, p90)"
                )
        elif kind == "quantiles":
            knots = d.pop("knots", None)
            if not isinstance(knots, dict):
                raise DistributionError(f"{field}.knots: expected a table probability -> value")
            vals = _nums(knots, "knots", field)
            dist = quantiles({float(k): v for k, v in zip(knots, vals, strict=True)})
        elif kind == "buckets":
            dist = buckets(_nums(d.pop("edges", []), "edges", field), list(d.pop("weights", [])))
        elif kind == "choice":
            dist = choice(_nums(d.pop("values", []), "values", field), d.pop("weights", None))
        elif kind == "pareto":
            dist = Dist("pareto", (_num(d, "x_min", field), _num(d, "alpha", field)))
        else:  # mixture
            comps = d.pop("components", None)
            if not isinstance(comps, list) or not comps:
                raise DistributionError(f"{field}.components: expected a non-empty list")
            parsed = [parse_dist(c, f"{field}.components[{i}]") for i, c in enumerate(comps)]
            dist = mixture(parsed, list(d.pop("weights", [1.0] * len(parsed))))
    except DistributionError as e:
        msg = str(e)
        raise DistributionError(msg if msg.startswith(field) else f"{field}: {msg}") from None
    except (TypeError, ValueError) as e:
        raise DistributionError(f"{field}: {e}") from None
    if d:
        raise DistributionError(f"{field}: unknown key(s) {', '.join(sorted(d))} for kind {kind!r}")
    if lo != -math.inf or hi != math.inf:
        if hi < lo:
            raise DistributionError(f"{field}.max: must be >= min")
        dist = Dist(dist.kind, dist.params, max(lo, dist.lo), min(hi, dist.hi))
    return dist


def _nums(values, key: str, field: str) -> list[float]:
    """A list (or a table's values) of finite numbers; true and false are not numbers here."""
    items = list(values.values()) if isinstance(values, dict) else values
    if not isinstance(items, list):
        raise DistributionError(f"{field}.{key}: expected a list of numbers, got {type(values).__name__}")
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise DistributionError(f"{field}.{key}: expected finite numbers, got {v!r}")
    return [float(v) for v in items]


def _num(d: dict, key: str, field: str) -> float:
    if key not in d:
        raise DistributionError(f"{field}.{key}: missing")
    v = d.pop(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise DistributionError(f"{field}.{key}: expected a finite number, got {v!r}")
    return float(v)

"""Length distributions: sampled statistics land on the published figures (each preset's source is named
beside it in workloads/distributions.py)."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import tokens as T
from workloads.distributions import PRESETS, DistributionError, parse_dist

N = 200_000


def _draw(name: str, seed: int = 0) -> np.ndarray:
    return PRESETS[name].sample(np.random.default_rng(seed), N)


def _close(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


# (preset, {percentile: published value}, relative tolerance)
PUBLISHED_PERCENTILES = [
    # COCO: 90% of images between 167,500 and 355,840 px.
    ("coco_pixels", {5: 167_500, 95: 355_840}, 0.03),
    # WavCaps SoundBible: p10 1.5 s, p50 5.0 s, p90 25.1 s.
    ("wavcaps_seconds", {10: 1.5, 50: 5.0, 90: 25.1}, 0.05),
    # DocVQA text part p50 52, p90 67 (low end of the InternVL SFT sets' text range).
    ("docvqa_text_tokens", {50: 52, 90: 67}, 0.05),
]


@pytest.mark.parametrize("name,targets,tol", PUBLISHED_PERCENTILES)
def test_preset_percentiles_match_published(name, targets, tol):
    x = _draw(name)
    for q, target in targets.items():
        assert _close(np.percentile(x, q), target, tol), (name, q, np.percentile(x, q), target)


@pytest.mark.parametrize(
    "name,mean,tol",
    [
        ("panda70m_seconds", 8.5, 0.05),  # Panda-70M mean clip 8.5 s
        ("internvid_seconds", 11.7, 0.05),  # InternVid 11.7 s
        ("webvid_seconds", 17.5, 0.05),  # WebVid-10M 17.5 s
        ("wavcaps_seconds", 13.1, 0.05),  # WavCaps SoundBible mean 13.1 s
        ("librispeech_seconds", 12.0, 0.08),  # LibriSpeech mean about 12 s
    ],
)
def test_preset_means_match_published(name, mean, tol):
    assert _close(_draw(name).mean(), mean, tol)


def test_librispeech_utterances_at_most_35_seconds():
    assert _draw("librispeech_seconds").max() <= 35.0


def test_audiocaps_clips_are_mostly_10_seconds():
    x = _draw("audiocaps_seconds")
    assert x.max() <= 10.0 and np.mean(x > 9.9) > 0.9


def test_llava_video_durations_span_0_to_3_minutes_in_four_buckets():
    x = _draw("llava_video_seconds")
    assert x.min() >= 0 and x.max() <= 180
    counts = np.histogram(x, bins=[0, 30, 60, 120, 180])[0]
    assert (counts > 0.1 * N).all()


def test_coco_aspect_within_published_range_and_tokens_in_qwen_range():
    a = _draw("coco_aspect")
    assert a.min() >= 0.6 and a.max() <= 1.5
    # 90% of COCO images give about 214..454 Qwen2-VL tokens.
    area = _draw("coco_pixels", 1)[:5000]
    h = np.sqrt(area * a[:5000])
    w = area / h
    rows, cols = T.image_grid_np(w, h, T.HF_RULE)
    tok = rows * cols // 4
    assert _close(np.percentile(tok, 5), 214, 0.08) and _close(np.percentile(tok, 95), 454, 0.08)


def test_sharegpt4v_captions_830_to_940_characters_on_average():
    chars = _draw("sharegpt4v_caption_tokens").mean() * 4.0  # CHARS_PER_TOKEN
    assert 830 <= chars <= 940


@pytest.mark.parametrize(
    "image,text,targets,tol",
    [
        # DocVQA total tokens p10/p50/p90 = 983/1475/1821 (OmniBal, InternVL SFT sets).
        ("docvqa_image_tokens", "docvqa_text_tokens", {10: 983, 50: 1475, 90: 1821}, 0.05),
        # AI2D 302/811/1331, bimodal.
        ("ai2d_image_tokens", "ai2d_text_tokens", {10: 302, 50: 811, 90: 1331}, 0.08),
        # ChartQA p50 1328.
        ("chartqa_image_tokens", "chartqa_text_tokens", {50: 1328}, 0.05),
    ],
)
def test_document_sets_total_tokens_match_published(image, text, targets, tol):
    # The generator turns the image budget into a raw image and back through the Qwen2-VL
    # rule (utils limits); the total (image + text) must land on the published percentiles.
    rng = np.random.default_rng(5)
    n = 20_000
    img = PRESETS[image].sample(rng, n) * T.PIXELS_PER_TOKEN
    aspect = PRESETS["document_aspect"].sample(rng, n)
    h = np.sqrt(img * aspect)
    rows, cols = T.image_grid_np(img / h, h, T.UTILS_RULE)
    total = rows * cols // 4 + np.rint(PRESETS[text].sample(rng, n))
    for q, target in targets.items():
        assert _close(np.percentile(total, q), target, tol), (image, q, np.percentile(total, q), target)


def test_ai2d_lengths_are_bimodal():
    x = _draw("ai2d_image_tokens")
    hist = np.histogram(x, bins=np.linspace(100, 1300, 13))[0]
    valley = hist[4:6].min()  # ~500-700 tokens, between the modes
    assert valley < 0.6 * hist[:4].max() and valley < 0.6 * hist[7:].max()


def test_long_video_durations_are_heavy_tailed():
    x = _draw("long_video_seconds")
    assert x.min() >= 60 and x.max() <= 3600
    assert np.percentile(x, 99) > 5 * np.percentile(x, 50)


def test_parse_dist_accepts_number_preset_and_tables():
    rng = np.random.default_rng(0)
    assert (parse_dist(7, "f").sample(rng, 3) == 7).all()
    assert parse_dist("coco_pixels", "f") is PRESETS["coco_pixels"]
    x = parse_dist({"kind": "lognormal", "p10": 10, "p90": 100}, "f").sample(rng, N)
    assert _close(np.percentile(x, 10), 10, 0.05) and _close(np.percentile(x, 90), 100, 0.05)
    x = parse_dist({"kind": "quantiles", "knots": {"0": 1, "0.5": 4, "1": 9}, "max": 5}, "f").sample(rng, N)
    assert x.max() <= 5 and _close(np.median(x), 4, 0.03)
    x = parse_dist({"kind": "mixture", "components": [1, 3], "weights": [1, 3]}, "f").sample(rng, N)
    assert _close((x == 3).mean(), 0.75, 0.02)


@pytest.mark.parametrize(
    "value,message",
    [
        ("no_such_preset", "f: unknown preset 'no_such_preset'; allowed:"),
        ({"kind": "gaussian"}, "f.kind: must be one of"),
        ({"kind": "lognormal", "median": 3}, "f: lognormal needs"),
        ({"kind": "uniform", "low": 1, "high": "x"}, "f.high: expected a finite number"),
        ({"kind": "const", "value": 1, "extra": 2}, "f: unknown key(s) extra"),
        ({"kind": "buckets", "edges": [0, 1], "weights": [1, 2]}, "f: buckets: need"),
        (-1, "f: constant must be"),
    ],
)
def test_parse_dist_errors_name_the_field(value, message):
    with pytest.raises(DistributionError) as e:
        parse_dist(value, "f")
    assert message in str(e.value)

"""Token rules: pinned against examples worked from the published rules (transformers'
`image_processing_qwen2_vl.py::smart_resize`, qwen-vl-utils `vision_process.py`) and against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import tokens as T


@pytest.mark.parametrize(
    "width,height,rule,expected",
    [
        (640, 480, T.HF_RULE, 391),
        (1280, 720, T.HF_RULE, 1196),
        (1920, 1080, T.HF_RULE, 1222),
        (1920, 1080, T.UTILS_RULE, 2691),
    ],
)
def test_image_tokens_match_published_examples(width, height, rule, expected):
    assert T.image_tokens(width, height, rule) == expected


def test_image_grid_duplicates_single_image_into_one_temporal_group():
    t, h, w = T.image_grid_thw(640, 480)
    assert (t, h, w) == (1, 34, 46)  # 476x644 px resized, 14 px patches
    assert t * h * w == 4 * T.image_tokens(640, 480)  # encoder sequence = 4x LLM tokens


def test_smart_resize_keeps_sides_multiple_of_28_and_pixels_in_range():
    rng = np.random.default_rng(1)
    for _ in range(500):
        h, w = (int(x) for x in rng.integers(1, 5000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        rh, rw = T.smart_resize(h, w)
        assert rh % 28 == 0 and rw % 28 == 0
        # Tiny or extreme-aspect inputs can leave the range by one rounding step, as in HF.
        assert rh * rw <= T.HF_MAX_PIXELS or min(rh, rw) == 28


def test_smart_resize_rejects_aspect_over_200():
    with pytest.raises(T.TokenRuleError, match="aspect ratio"):
        T.smart_resize(10, 2100)


def _transformers_smart_resize():
    """transformers' own `smart_resize`, compiled from its source file without importing
    transformers (which would pull in torch and take seconds)."""
    import ast
    import importlib.util
    import math
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("transformers is not installed")
    src = Path(spec.submodule_search_locations[0]) / "models" / "qwen2_vl" / "image_processing_qwen2_vl.py"
    tree = ast.parse(src.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    ns: dict = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), ns)
    return ns["smart_resize"]


def test_smart_resize_matches_transformers():
    hf_smart_resize = _transformers_smart_resize()
    rng = np.random.default_rng(7)
    for _ in range(2000):
        h, w = (int(x) for x in rng.integers(20, 6000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in ((T.HF_MIN_PIXELS, T.HF_MAX_PIXELS), (T.UTILS_MIN_PIXELS, T.UTILS_MAX_PIXELS)):
            assert T.smart_resize(h, w, min_pixels=lo, max_pixels=hi) == hf_smart_resize(
                h, w, factor=28, min_pixels=lo, max_pixels=hi
            )


def test_numpy_twins_agree_with_scalar_rules():
    rng = np.random.default_rng(3)
    w = rng.integers(30, 4000, 2000)
    h = np.clip((w * rng.uniform(0.2, 5, 2000)).astype(np.int64), 30, 8000)
    sec = rng.uniform(0.05, 900, 2000)
    rows, cols = T.image_grid_np(w, h, T.UTILS_RULE)
    t, vr, vc = T.video_grid_np(w, h, sec, T.HF_RULE)
    mel = T.audio_mel_frames_np(sec)
    for i in range(0, 2000, 7):
        assert T.image_grid_thw(int(w[i]), int(h[i]), T.UTILS_RULE) == (1, rows[i], cols[i])
        assert T.video_grid_thw(int(w[i]), int(h[i]), float(sec[i])) == (t[i], vr[i], vc[i])
        assert T.audio_mel_frames(float(sec[i])) == mel[i]
        assert T.audio_llm_tokens(int(mel[i])) == T.audio_llm_tokens_np(mel[i])


def test_video_samples_two_fps_even_frames_and_temporal_groups():
    assert T.video_frames(10) == 20
    assert T.video_frames(0.5) == 4  # at least 4 frames
    assert T.video_frames(10.7) == 20  # floored to even
    assert T.video_frames(3600) == 768  # at most 768 frames
    t, h, w = T.video_grid_thw(640, 360, 10)
    assert t == 10 and (h * w) // 4 == 299  # 640x360 -> 299 tokens per 2-frame group
    assert T.video_tokens(640, 360, 10) == 2990


def test_video_group_tokens_stay_between_128_and_768():
    for width, height in ((160, 90), (640, 360), (3840, 2160)):
        t, h, w = T.video_grid_thw(width, height, 4)
        assert 128 <= h * w // 4 <= 768


def test_video_total_tokens_capped_near_24576_by_per_frame_resize():
    # 3 min of 1080p: without the total cap it would be 180 groups x 768 tokens.
    n = T.video_tokens(1920, 1080, 180)
    assert n <= 24576
    assert n > 0.8 * 24576
    # Very long videos hit the 768-frame cap and the per-group floor (1.05 x 128 tokens),
    # so they exceed the nominal total, as in qwen-vl-utils.
    t, h, w = T.video_grid_thw(1920, 1080, 3600)
    assert t == 384 and h * w // 4 >= 100


def test_audio_is_25_tokens_per_second_whisper_style():
    assert T.audio_mel_frames(30) == 3000
    assert T.audio_encoder_len(3000) == 1500
    assert T.audio_tokens(30) == 750
    assert T.audio_tokens(1) == 25
    assert T.audio_tokens(0.01) >= 1


def test_audio_rule_agrees_with_segment_contract():
    # Segment contract: encoder_seq_len = mel_frames // 2, llm_tokens = encoder_seq_len // 2.
    for sec in np.linspace(0.05, 100, 997):
        m = T.audio_mel_frames(float(sec))
        assert m % 2 == 0
        assert T.audio_encoder_len(m) == m // 2
        assert T.audio_llm_tokens(m) == (m // 2) // 2


def test_vision_rule_rejects_bad_limits():
    with pytest.raises(T.TokenRuleError, match="image_min_pixels"):
        T.VisionRule(image_min_pixels=10**7, image_max_pixels=10**6)

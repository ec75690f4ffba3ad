"""Token rules: what the encoders turn a raw input into (Qwen2-VL vision, Whisper-style audio).

Every rule exists twice: a scalar function that mirrors the reference implementation line by
line (so a test can pin it against published examples and against transformers), and a numpy
twin used by the generator, which must turn hundreds of thousands of raw sizes into token
counts per second. The twins are tested to agree with the scalar functions.

Sources:
- image: transformers `models/qwen2_vl/image_processing_qwen2_vl.py::smart_resize`;
- video: QwenLM/Qwen2-VL `qwen-vl-utils/src/qwen_vl_utils/vision_process.py`
  (`smart_nframes`, `fetch_video`), with the per-video total of 24,576 tokens;
- audio: transformers `models/qwen2_5_omni` (`_get_feat_extract_output_lengths`),
  Whisper feature extractor (16 kHz, 10 ms hop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# ---- vision (Qwen2-VL / Qwen2.5-VL) ----------------------------------------------------------
PATCH = 14  # ViT patch side in px
MERGE = 2  # 2x2 patches merge into one LLM token
FACTOR = PATCH * MERGE  # 28 px: one LLM token per 28x28 px
TEMPORAL_PATCH = 2  # frames per temporal group; a single image is duplicated to fill it
PIXELS_PER_TOKEN = FACTOR * FACTOR  # 784
MAX_ASPECT = 200

# HF processor defaults (Qwen2VLImageProcessor): 56x56 px (4 tokens) .. 1280 tokens.
HF_MIN_PIXELS = 56 * 56
HF_MAX_PIXELS = 1280 * PIXELS_PER_TOKEN
# qwen-vl-utils defaults (what Qwen's own pipelines feed the model): 4 .. 16,384 tokens.
UTILS_MIN_PIXELS = 4 * PIXELS_PER_TOKEN
UTILS_MAX_PIXELS = 16384 * PIXELS_PER_TOKEN

# Video (qwen-vl-utils): 2 fps, 4..768 frames, even count; 128..768 tokens per temporal
# group; the per-frame area shrinks so the whole video stays near 24,576 tokens.
VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * PIXELS_PER_TOKEN
VIDEO_MAX_PIXELS = 768 * PIXELS_PER_TOKEN
VIDEO_TOTAL_PIXELS = 24576 * PIXELS_PER_TOKEN

# ---- audio (Whisper / Qwen2-Audio / Qwen2.5-Omni) ----------------------------------------------
AUDIO_SAMPLE_RATE = 16_000
MEL_HOP = 160  # 10 ms at 16 kHz -> 100 mel frames per second
MEL_FRAMES_PER_SECOND = AUDIO_SAMPLE_RATE // MEL_HOP


class TokenRuleError(ValueError):
    """A raw size that the reference processor would reject (e.g. aspect ratio over 200)."""


@dataclass(frozen=True, slots=True)
class VisionRule:
    """Qwen2-VL resize limits; defaults are the HF processor's for images, qwen-vl-utils' for video.

    `image_max_pixels` is the knob that matters most: the HF processor stops at 1,280 tokens per
    image, qwen-vl-utils at 16,384 (document images then keep their resolution).
    """

    image_min_pixels: int = HF_MIN_PIXELS
    image_max_pixels: int = HF_MAX_PIXELS
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS
    video_total_pixels: int = VIDEO_TOTAL_PIXELS
    fps: float = VIDEO_FPS
    min_frames: int = VIDEO_MIN_FRAMES
    max_frames: int = VIDEO_MAX_FRAMES

    def __post_init__(self) -> None:
        for name in (
            "image_min_pixels",
            "image_max_pixels",
            "video_min_pixels",
            "video_max_pixels",
            "video_total_pixels",
            "min_frames",
            "max_frames",
        ):
            if int(getattr(self, name)) <= 0:
                raise TokenRuleError(f"vision.{name}: must be a positive integer, got {getattr(self, name)}")
        if self.image_min_pixels > self.image_max_pixels:
            raise TokenRuleError("vision.image_min_pixels: must not exceed vision.image_max_pixels")
        if self.video_min_pixels > self.video_max_pixels:
            raise TokenRuleError("vision.video_min_pixels: must not exceed vision.video_max_pixels")
        if self.min_frames > self.max_frames or self.min_frames < TEMPORAL_PATCH:
            raise TokenRuleError(f"vision.min_frames: must be in [{TEMPORAL_PATCH}, max_frames]")
        if not self.fps > 0:
            raise TokenRuleError(f"vision.fps: must be > 0, got {self.fps}")


def scaled_rule(rule: VisionRule, length_scale: float) -> VisionRule:
    """The rule for a miniature run (see WorkloadStream's `length_scale`): pixel limits on an
    image scale with its area (x s); a video's per-frame limits scale with its frame area
    (x sqrt s) and its total with its tokens (x s), so floors and caps bind at the same relative
    place as at full size. Frame counts and fps are kept."""
    if length_scale == 1.0:
        return rule
    r = math.sqrt(length_scale)
    return VisionRule(
        image_min_pixels=max(1, round(rule.image_min_pixels * length_scale)),
        image_max_pixels=max(1, round(rule.image_max_pixels * length_scale)),
        video_min_pixels=max(1, round(rule.video_min_pixels * r)),
        video_max_pixels=max(1, round(rule.video_max_pixels * r)),
        video_total_pixels=max(1, round(rule.video_total_pixels * length_scale)),
        fps=rule.fps,
        min_frames=rule.min_frames,
        max_frames=rule.max_frames,
    )


HF_RULE = VisionRule()
UTILS_RULE = VisionRule(image_min_pixels=UTILS_MIN_PIXELS, image_max_pixels=UTILS_MAX_PIXELS)


# ---- scalar reference functions ----------------------------------------------------------------
def smart_resize(
    height: int,
    width: int,
    factor: int = FACTOR,
    min_pixels: int = HF_MIN_PIXELS,
    max_pixels: int = HF_MAX_PIXELS,
) -> tuple[int, int]:
    """(resized_height, resized_width) as Qwen2-VL's processor computes them."""
    if min(height, width) <= 0:
        raise TokenRuleError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise TokenRuleError(
            f"aspect ratio must be at most {MAX_ASPECT}, got {max(height, width) / min(height, width):.1f}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid_thw(width: int, height: int, rule: VisionRule = HF_RULE) -> tuple[int, int, int]:
    """Patch grid of one image: the image is duplicated to fill the temporal patch, so t == 1."""
    h, w = smart_resize(height, width, min_pixels=rule.image_min_pixels, max_pixels=rule.image_max_pixels)
    return (1, h // PATCH, w // PATCH)


def image_tokens(width: int, height: int, rule: VisionRule = HF_RULE) -> int:
    """LLM tokens of one image (encoder sequence / 4)."""
    t, h, w = image_grid_thw(width, height, rule)
    return t * h * w // (MERGE * MERGE)


def video_frames(seconds: float, rule: VisionRule = HF_RULE) -> int:
    """Frames sampled from a clip: `fps` per second, clamped to [min, max], floored to even.

    qwen-vl-utils also caps at the clip's own frame count; we assume sources of >= 2 fps
    (web video is 24-60 fps), where that cap never binds above 4 frames."""
    if not seconds > 0:
        raise TokenRuleError(f"video duration must be > 0 s, got {seconds}")
    n = seconds * rule.fps
    lo = math.ceil(rule.min_frames / TEMPORAL_PATCH) * TEMPORAL_PATCH
    hi = (rule.max_frames // TEMPORAL_PATCH) * TEMPORAL_PATCH
    n = min(max(n, lo), hi)
    return int(n // TEMPORAL_PATCH) * TEMPORAL_PATCH


def video_max_pixels(nframes: int, rule: VisionRule = HF_RULE) -> float:
    """Per-frame pixel cap: the group cap, lowered so the video's total stays near the budget
    (but never under 1.05x the group minimum, so long videos can exceed the total, as in
    qwen-vl-utils)."""
    return max(
        min(rule.video_max_pixels, rule.video_total_pixels / nframes * TEMPORAL_PATCH),
        int(rule.video_min_pixels * 1.05),
    )


def video_grid_thw(
    width: int, height: int, seconds: float, rule: VisionRule = HF_RULE
) -> tuple[int, int, int]:
    """Patch grid of one video: (frames / 2, rows, cols)."""
    nframes = video_frames(seconds, rule)
    h, w = smart_resize(
        height, width, min_pixels=rule.video_min_pixels, max_pixels=video_max_pixels(nframes, rule)
    )
    return (nframes // TEMPORAL_PATCH, h // PATCH, w // PATCH)


def video_tokens(width: int, height: int, seconds: float, rule: VisionRule = HF_RULE) -> int:
    t, h, w = video_grid_thw(width, height, seconds, rule)
    return t * h * w // (MERGE * MERGE)


def audio_mel_frames(seconds: float) -> int:
    """10 ms mel frames of a clip at 16 kHz, padded up to an even count.

    The feature extractor yields ceil(samples / 160) frames; we pad odd counts by one frame
    (10 ms of silence) so every formula in use agrees: Qwen2.5-Omni's conv arithmetic
    ((m - 1) // 2 + 1, then (e - 2) // 2 + 1) and the Segment contract's m // 2, then // 2.
    """
    if not seconds > 0:
        raise TokenRuleError(f"audio duration must be > 0 s, got {seconds}")
    m = max(4, math.ceil(round(seconds * AUDIO_SAMPLE_RATE) / MEL_HOP))
    return m + (m & 1)


def audio_encoder_len(mel_frames: int) -> int:
    """Encoder positions after the stride-2 conv (kernel 3, padding 1): 3,000 mel -> 1,500."""
    return (mel_frames - 1) // 2 + 1


def audio_llm_tokens(mel_frames: int) -> int:
    """LLM tokens after the encoder's stride-2 pooling: 1,500 positions -> 750 (25 per second)."""
    return (audio_encoder_len(mel_frames) - 2) // 2 + 1


def audio_tokens(seconds: float) -> int:
    return audio_llm_tokens(audio_mel_frames(seconds))


# ---- numpy twins (same arithmetic, float64, elementwise) ----------------------------------------
def smart_resize_np(
    height: np.ndarray, width: np.ndarray, min_pixels, max_pixels, factor: int = FACTOR
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised `smart_resize`; `min_pixels`/`max_pixels` may be scalars or arrays.

    Callers must have clipped the aspect ratio to <= 200 (the generator samples within it,
    the trace loader rejects lines beyond it).
    """
    height = np.asarray(height, dtype=np.float64)
    width = np.asarray(width, dtype=np.float64)
    # np.round rounds half to even, exactly like Python's round().
    h_bar = np.round(height / factor) * factor
    w_bar = np.round(width / factor) * factor
    area = h_bar * w_bar
    over = area > max_pixels
    under = (area < min_pixels) & ~over
    raw = height * width
    with np.errstate(divide="ignore", invalid="ignore"):
        beta_over = np.sqrt(raw / max_pixels)
        beta_under = np.sqrt(min_pixels / raw)
    h_over = np.maximum(factor, np.floor(height / beta_over / factor) * factor)
    w_over = np.maximum(factor, np.floor(width / beta_over / factor) * factor)
    h_under = np.ceil(height * beta_under / factor) * factor
    w_under = np.ceil(width * beta_under / factor) * factor
    h_out = np.where(over, h_over, np.where(under, h_under, h_bar))
    w_out = np.where(over, w_over, np.where(under, w_under, w_bar))
    return h_out.astype(np.int64), w_out.astype(np.int64)


def image_grid_np(width: np.ndarray, height: np.ndarray, rule: VisionRule) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of 14 px patches per image; t is always 1."""
    h, w = smart_resize_np(height, width, rule.image_min_pixels, rule.image_max_pixels)
    return h // PATCH, w // PATCH


def video_frames_np(seconds: np.ndarray, rule: VisionRule) -> np.ndarray:
    lo = math.ceil(rule.min_frames / TEMPORAL_PATCH) * TEMPORAL_PATCH
    hi = (rule.max_frames // TEMPORAL_PATCH) * TEMPORAL_PATCH
    n = np.clip(np.asarray(seconds, dtype=np.float64) * rule.fps, lo, hi)
    return (np.floor(n / TEMPORAL_PATCH) * TEMPORAL_PATCH).astype(np.int64)


def video_grid_np(
    width: np.ndarray, height: np.ndarray, seconds: np.ndarray, rule: VisionRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    nframes = video_frames_np(seconds, rule)
    cap = np.maximum(
        np.minimum(rule.video_max_pixels, rule.video_total_pixels / nframes * TEMPORAL_PATCH),
        int(rule.video_min_pixels * 1.05),
    )
    h, w = smart_resize_np(height, width, rule.video_min_pixels, cap)
    return nframes // TEMPORAL_PATCH, h // PATCH, w // PATCH


def audio_mel_frames_np(seconds: np.ndarray) -> np.ndarray:
    samples = np.round(np.asarray(seconds, dtype=np.float64) * AUDIO_SAMPLE_RATE)
    m = np.maximum(4, np.ceil(samples / MEL_HOP)).astype(np.int64)
    return m + (m & 1)


def audio_encoder_len_np(mel_frames: np.ndarray) -> np.ndarray:
    return (mel_frames - 1) // 2 + 1


def audio_llm_tokens_np(mel_frames: np.ndarray) -> np.ndarray:
    return (audio_encoder_len_np(mel_frames) - 2) // 2 + 1

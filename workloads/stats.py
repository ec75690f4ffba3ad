"""What a workload looks like over a run: mix, lengths, and how much batches differ.

`summarize(stream, steps)` draws the given steps and returns one JSON-able dict (the body of
`omnibench workloads show`). Encoder work is counted in forward FLOPs of the encoder that
consumes each segment, with the attention span the encoder really uses, because that is what
makes batches unequal: a quadratic term per attention window plus a linear term per position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workloads.sample import MODALITIES
from workloads.stream import WorkloadStream

PERCENTILES = (10, 50, 90, 99)

# Qwen2-VL ViT-675M and the Whisper-large-v3 encoder share this shape: 32 layers, width 1280, FFN 5120
# (the models' Hugging Face config.json: Qwen/Qwen2-VL-7B-Instruct `vision_config` depth 32, embed_dim
# 1280, mlp_ratio 4; openai/whisper-large-v3 encoder_layers 32, d_model 1280, encoder_ffn_dim 5120).
ENC_LAYERS, ENC_HIDDEN, ENC_FFN = 32, 1280, 5120
AUDIO_WINDOW = 1500  # Whisper attends within 30 s windows (1,500 positions)
_LINEAR_PER_POS = 2 * (4 * ENC_HIDDEN * ENC_HIDDEN + 2 * ENC_HIDDEN * ENC_FFN)  # QKV+O and MLP, 2 FLOP/MAC
_ATTN_PER_POS2 = 4 * ENC_HIDDEN  # QK^T and AV: 2 * 2 * h per (query, key) pair

ENCODER_WORK_DEFINITION = (
    f"encoder forward FLOPs per segment = layers * (L * {_LINEAR_PER_POS:,} + {_ATTN_PER_POS2:,} * sum(w^2)) "
    f"with layers={ENC_LAYERS}, hidden={ENC_HIDDEN}, ffn={ENC_FFN} (Qwen2-VL ViT-675M; Whisper-large-v3 "
    "encoder has the same shape), L = encoder sequence length, w = attention windows: one per image, "
    f"one per temporal group (h*w patches) for video, {AUDIO_WINDOW}-position windows for audio"
)


def encoder_flops(modality: str, seq_len: int, grid_thw: tuple[int, int, int]) -> float:
    """Forward FLOPs of the encoder for one segment (0 for text)."""
    if modality == "text" or seq_len <= 0:
        return 0.0
    if modality == "video":
        t, h, w = grid_thw
        quad = t * float(h * w) ** 2
    elif modality == "audio":
        full, rest = divmod(seq_len, AUDIO_WINDOW)
        quad = full * float(AUDIO_WINDOW) ** 2 + float(rest) ** 2
    else:
        quad = float(seq_len) ** 2
    return ENC_LAYERS * (_LINEAR_PER_POS * seq_len + _ATTN_PER_POS2 * quad)


def _pcts(x: np.ndarray) -> dict:
    if x.size == 0:
        return {f"p{p}": 0 for p in PERCENTILES} | {"max": 0, "mean": 0.0}
    q = np.percentile(x, PERCENTILES)
    return {f"p{p}": int(round(v)) for p, v in zip(PERCENTILES, q, strict=True)} | {
        "max": int(x.max()),
        "mean": round(float(x.mean()), 1),
    }


def _spread(x: np.ndarray) -> dict:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return {"min": 0.0, "max": 0.0, "mean": 0.0, "max_over_min": None, "cv": None}
    mn, mx, mean = float(x.min()), float(x.max()), float(x.mean())
    return {
        "min": round(mn, 4),
        "max": round(mx, 4),
        "mean": round(mean, 4),
        "max_over_min": round(mx / mn, 3) if mn > 0 else None,
        "cv": round(float(x.std()) / mean, 4) if mean > 0 else None,
    }


@dataclass
class _Rows:
    """Segments and batches of the drawn steps, as flat arrays."""

    seg_step: np.ndarray
    seg_mod: np.ndarray  # index into MODALITIES
    seg_tok: np.ndarray
    seg_enc: np.ndarray
    smp_step: np.ndarray
    smp_source: list
    smp_mods: np.ndarray  # [n_samples, 4] bool: sample contains modality
    b_step: np.ndarray
    b_samples: np.ndarray
    b_tokens: np.ndarray
    b_vision: np.ndarray  # TFLOP
    b_audio: np.ndarray


def collect(stream: WorkloadStream, steps: list[int]) -> _Rows:
    mod_idx = {m: i for i, m in enumerate(MODALITIES)}
    seg_step, seg_mod, seg_tok, seg_enc = [], [], [], []
    smp_step, smp_source, smp_mods = [], [], []
    b_samples, b_tokens, b_vision, b_audio = [], [], [], []
    flops_cache: dict = {}
    for step in steps:
        batch = stream.batch(step)
        vis = aud = 0.0
        for s in batch.samples:
            mods = [False] * len(MODALITIES)
            for seg in s.segments:
                mi = mod_idx[seg.modality]
                mods[mi] = True
                seg_step.append(step)
                seg_mod.append(mi)
                seg_tok.append(seg.llm_tokens)
                seg_enc.append(seg.encoder_seq_len)
                if seg.modality != "text":
                    f = flops_cache.get(seg)
                    if f is None:
                        f = flops_cache[seg] = encoder_flops(seg.modality, seg.encoder_seq_len, seg.grid_thw)
                    if seg.modality == "audio":
                        aud += f
                    else:
                        vis += f
            smp_step.append(step)
            smp_source.append(s.source)
            smp_mods.append(mods)
        b_samples.append(len(batch.samples))
        b_tokens.append(batch.llm_tokens)
        b_vision.append(vis / 1e12)
        b_audio.append(aud / 1e12)
    return _Rows(
        np.asarray(seg_step, dtype=np.int64),
        np.asarray(seg_mod, dtype=np.int64),
        np.asarray(seg_tok, dtype=np.int64),
        np.asarray(seg_enc, dtype=np.int64),
        np.asarray(smp_step, dtype=np.int64),
        smp_source,
        np.asarray(smp_mods, dtype=bool).reshape(-1, len(MODALITIES)),
        np.asarray(steps, dtype=np.int64),
        np.asarray(b_samples),
        np.asarray(b_tokens),
        np.asarray(b_vision),
        np.asarray(b_audio),
    )


def _window(rows: _Rows, lo: int, hi: int, detail: bool) -> dict:
    """Mix and lengths of the steps in [lo, hi]."""
    seg = (rows.seg_step >= lo) & (rows.seg_step <= hi)
    smp = (rows.smp_step >= lo) & (rows.smp_step <= hi)
    bat = (rows.b_step >= lo) & (rows.b_step <= hi)
    n_samples = int(smp.sum())
    tok_total = int(rows.seg_tok[seg].sum())
    mods = {}
    for i, m in enumerate(MODALITIES):
        sel = seg & (rows.seg_mod == i)
        if not sel.any():
            continue
        entry = {
            "share_of_samples": round(float(rows.smp_mods[smp, i].sum()) / max(1, n_samples), 4),
            "share_of_llm_tokens": round(float(rows.seg_tok[sel].sum()) / max(1, tok_total), 4),
            "segments": int(sel.sum()),
            "llm_tokens": _pcts(rows.seg_tok[sel]),
        }
        if m != "text":
            entry["encoder_seq_len"] = _pcts(rows.seg_enc[sel])
        if not detail:
            entry = {k: entry[k] for k in ("share_of_samples", "share_of_llm_tokens")} | {
                "llm_tokens_p50": entry["llm_tokens"]["p50"],
                "llm_tokens_p90": entry["llm_tokens"]["p90"],
            }
        mods[m] = entry
    total = rows.b_vision[bat] + rows.b_audio[bat]
    out = {"steps": [int(lo), int(hi)], "batches": int(bat.sum()), "samples": n_samples, "modalities": mods}
    src = [s for s, k in zip(rows.smp_source, smp, strict=True) if k]
    names, counts = np.unique(np.asarray(src, dtype=object), return_counts=True) if src else ([], [])
    out["sources"] = {
        str(n): round(int(c) / max(1, n_samples), 4) for n, c in zip(names, counts, strict=True)
    }
    out["batch_variation"] = {
        "samples": _spread(rows.b_samples[bat]),
        "llm_tokens": _spread(rows.b_tokens[bat]),
        "encoder_work_tflop": _spread(total),
        "vision_work_tflop": _spread(rows.b_vision[bat]),
        "audio_work_tflop": _spread(rows.b_audio[bat]),
    }
    if not detail:
        out["batch_variation"] = {k: out["batch_variation"][k] for k in ("llm_tokens", "encoder_work_tflop")}
    return out


def sample_steps(n_steps: int, total_steps: int, start: int | None = None) -> list[int]:
    """`n_steps` steps spread evenly over the schedule [0, total_steps) (all of them when
    n_steps >= total_steps), or, with `start`, the consecutive steps start .. start+n-1 (to
    see step-to-step changes such as bursts)."""
    if start is not None:
        return list(range(start, start + n_steps))
    if n_steps >= total_steps:
        return list(range(n_steps))
    return sorted({int(round(x)) for x in np.linspace(0, total_steps - 1, n_steps)})


def summarize(stream: WorkloadStream, steps: list[int], rows: _Rows | None = None) -> dict:
    """The JSON-able summary; pass `rows` from `collect` to reuse drawn batches."""
    spec = stream.spec
    rows = rows if rows is not None else collect(stream, steps)
    sched = spec.schedule
    phases = []
    for p in sched.phases:
        ph = {
            "name": p.name,
            "weights": {n: round(w, 4) for n, w in zip(spec.source_names, p.weights, strict=True) if w > 0},
        }
        if any(x != 1.0 for x in p.length):
            ph["length"] = {n: x for n, x in zip(spec.source_names, p.length, strict=True) if x != 1.0}
        if p.max_sample_tokens:
            ph["max_sample_tokens"] = p.max_sample_tokens
        if sched.kind == "staged":
            ph["until_step"] = int(math.ceil(p.until * stream.total_steps))
        if sched.kind == "bursty":
            ph["mean_steps"] = p.mean_steps
        phases.append(ph)
    mix_points = []
    for s in steps:
        mx = stream.mix(s)
        mix_points.append(
            {
                "step": int(s),
                "phase": mx.phase,
                "weights": {
                    n: round(float(w), 4) for n, w in zip(spec.source_names, mx.weights, strict=True)
                },
            }
        )
    q = max(1, len(steps) // 4)
    return {
        "workload": spec.name,
        "description": spec.description,
        "origin": spec.origin,
        "seed": stream.seed,
        "total_steps": stream.total_steps,
        "steps_drawn": len(steps),
        "batch": {
            "global_batch_tokens": stream.global_batch_tokens,
            "global_batch_size": stream.global_batch_size,
            "length_scale": stream.length_scale,
            "max_sample_tokens": stream.max_sample_tokens or spec.max_sample_tokens,
        },
        "encoder_work_definition": ENCODER_WORK_DEFINITION,
        "schedule": {"kind": sched.kind, "phases": phases},
        "mix_over_steps": mix_points,
        "overall": _window(rows, steps[0], steps[-1], detail=True),
        "first_window": _window(rows, steps[0], steps[q - 1], detail=False),
        "last_window": _window(rows, steps[-q], steps[-1], detail=False),
        "per_batch": [
            {
                "step": int(s),
                "samples": int(n),
                "llm_tokens": int(t),
                "vision_work_tflop": round(float(v), 4),
                "audio_work_tflop": round(float(a), 4),
            }
            for s, n, t, v, a in zip(
                rows.b_step, rows.b_samples, rows.b_tokens, rows.b_vision, rows.b_audio, strict=True
            )
        ],
    }

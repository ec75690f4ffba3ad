"""Workloads by name or path: the named workloads in `workloads/specs/`, spec files (TOML, YAML,
JSON) and JSONL traces of real samples, each read once and validated (spec.py, trace.py).

It sits above both readers, so neither imports the other: spec.py defines what a workload is,
trace.py builds one from a trace, and this module picks which reader a path needs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from workloads.spec import (
    FILE_SUFFIXES,
    SPEC_DIR,
    WorkloadError,
    WorkloadSpec,
    read_spec_file,
    spec_from_dict,
)
from workloads.tokens import HF_MIN_PIXELS, PIXELS_PER_TOKEN
from workloads.trace import load_trace


def load_spec_file(path: str | Path) -> WorkloadSpec:
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        return load_trace(path)
    return spec_from_dict(read_spec_file(path), origin=str(path))


_REGISTRY: dict[str, WorkloadSpec] = {}


def list_workloads() -> dict[str, str]:
    """Named workloads -> one-line description, in name order."""
    out = {}
    for p in sorted(SPEC_DIR.glob("*.toml")):
        out[p.stem] = get_workload(p.stem).description
    return out


def workload_names() -> list[str]:
    return sorted(p.stem for p in SPEC_DIR.glob("*.toml"))


# `pretrain_<N>`: text pretraining at a fixed N-token length, for any N up to this (pretrain_2048 is a file)
PRETRAIN = re.compile(r"pretrain_(\d+)")
MAX_PRETRAIN_TOKENS = 1 << 20


def pretrain_workload(seq: int) -> WorkloadSpec:
    """Every sample one fixed `seq`-token text sequence: what the published dense-LLM runs trained on."""
    return spec_from_dict({"name": f"pretrain_{seq}", "description": f"Text pretraining at a fixed {seq}-token length.",
                           "total_steps": 1000, "sources": {"text": {"text_tokens": seq}},
                           "schedule": {"kind": "constant", "weights": {"text": 1.0}}}, origin="builtin")


# `image_text_<I>_<T>`: every sample one image of I LLM tokens then T text tokens (the published encoder + LLM runs)
IMAGE_TEXT = re.compile(r"image_text_(\d+)_(\d+)")
# the longest side over the shortest the generator draws an image at (workloads/stream.py clips there)
GRID_ASPECT = 150


def image_grid(image_tokens: int) -> tuple[int, int] | None:
    """(rows, cols) of LLM tokens, rows * cols == image_tokens, the squarest such grid whose sides stay within
    the generator's aspect limit (GRID_ASPECT); None where there is none (a prime above it)."""
    best = None
    for rows in range(1, math.isqrt(image_tokens) + 1):
        if image_tokens % rows == 0 and image_tokens // rows <= GRID_ASPECT * rows:
            best = (rows, image_tokens // rows)
    return best


def image_text_workload(image_tokens: int, text_tokens: int) -> WorkloadSpec:
    """Every sample one image of exactly `image_tokens` LLM tokens (4x as many patches for a ViT with a
    2 x 2 merge) followed by `text_tokens` of text: a fixed-shape image + text run, e.g. packed
    sequences of a published length. The image's pixel area is the token count times 28 x 28 px on
    the squarest grid that has exactly that count, and the resize rule neither grows nor shrinks it."""
    name = f"image_text_{image_tokens}_{text_tokens}"
    grid = image_grid(image_tokens)
    if grid is None:
        raise WorkloadError(f"workload {name}: {image_tokens} image tokens make no grid with sides within 1:"
                            f"{GRID_ASPECT} (a prime above {GRID_ASPECT}); give a count with a divisor")
    rows, cols = grid
    pixels = image_tokens * PIXELS_PER_TOKEN
    return spec_from_dict({
        "name": name, "total_steps": 1000,
        "description": f"One {rows} x {cols}-token image ({image_tokens} tokens) and {text_tokens} text tokens "
                       "per sample.",
        "vision": {"image_min_pixels": min(pixels, HF_MIN_PIXELS), "image_max_pixels": pixels},
        "sources": {"image_text": {"text_tokens": text_tokens, "images": 1, "image_tokens": image_tokens,
                                   "image_aspect": rows / cols}},
        "schedule": {"kind": "constant", "weights": {"image_text": 1.0}}}, origin="builtin")


def get_workload(name_or_path: str | Path | WorkloadSpec) -> WorkloadSpec:
    """A named workload, or one read from a TOML/YAML/JSON spec or a JSONL trace file."""
    if isinstance(name_or_path, WorkloadSpec):
        return name_or_path
    s = str(name_or_path)
    if s in _REGISTRY:
        return _REGISTRY[s]
    builtin = SPEC_DIR / f"{s}.toml"
    if "/" not in s and "." not in s and builtin.is_file():
        spec = load_spec_file(builtin)
        if spec.name != s:
            raise WorkloadError(f"{builtin}: name {spec.name!r} does not match the file name {s!r}")
        spec = WorkloadSpec(
            **{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "origin": "builtin"}
        )
        _REGISTRY[s] = spec
        return spec
    fixed = PRETRAIN.fullmatch(s)
    if fixed and 1 <= int(fixed[1]) <= MAX_PRETRAIN_TOKENS:
        _REGISTRY[s] = pretrain_workload(int(fixed[1]))
        return _REGISTRY[s]
    shaped = IMAGE_TEXT.fullmatch(s)
    if shaped and 1 <= int(shaped[1]) and 1 <= int(shaped[2]) and int(shaped[1]) + int(shaped[2]) <= MAX_PRETRAIN_TOKENS:
        _REGISTRY[s] = image_text_workload(int(shaped[1]), int(shaped[2]))
        return _REGISTRY[s]
    p = Path(s)
    if p.suffix.lower() in FILE_SUFFIXES:
        if p.is_dir():
            raise WorkloadError(f"workload: {s} is a folder, not a workload file")
        if p.exists() and not p.is_file():
            raise WorkloadError(f"workload: {s} is not a regular file")
        if not p.is_file():
            raise WorkloadError(f"workload: file {s} does not exist")
        return load_spec_file(p)
    raise WorkloadError(
        f"workload: unknown name {s!r}; allowed: {', '.join(workload_names())}, pretrain_<N> (N <= "
        f"{MAX_PRETRAIN_TOKENS:,} tokens), image_text_<I>_<T> (I image and T text tokens, each >= 1, I + T <= "
        f"{MAX_PRETRAIN_TOKENS:,}) "
        f"or a path to a {'/'.join(x[1:] for x in FILE_SUFFIXES)} file"
    )

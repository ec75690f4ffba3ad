"""Workloads by name or path: the named workloads in `workloads/specs/`, spec files (TOML, YAML,
JSON) and JSONL traces of real samples, each read once and validated (spec.py, trace.py).

It sits above both readers, so neither imports the other: spec.py defines what a workload is,
trace.py builds one from a trace, and this module picks which reader a path needs.
"""

from __future__ import annotations

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
        f"{MAX_PRETRAIN_TOKENS:,} tokens) "
        f"or a path to a {'/'.join(x[1:] for x in FILE_SUFFIXES)} file"
    )

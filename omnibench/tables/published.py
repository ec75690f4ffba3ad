"""Summaries of the published validation (results/validation/published_table.json, written by
`python benchmarks/published_validation.py`) for the targets table: read from the committed record,
so that a figure quoted there moves when the record is rewritten. The summaries cover the text-LLM rows, the
targets' set (the encoder + LLM rows are reported apart in published_table.md, "multimodal"); the per-source
table covers every row, a column saying which sources are encoder + LLM."""

from __future__ import annotations

import json
from functools import lru_cache

from omnibench.provenance import REPO_ROOT
from omnibench.tables import table

PUBLISHED_JSON = "results/validation/published_table.json"


@lru_cache(maxsize=1)
def _published() -> dict:
    return json.loads((REPO_ROOT / PUBLISHED_JSON).read_text())


def _text_rows() -> list[dict]:
    """The text-LLM rows: the encoder + LLM rows are reported apart (published_table.md, "multimodal")."""
    return [r for r in _published()["rows"] if not r.get("multimodal")]


def _rows(split: str) -> list[dict]:
    return [r for r in _text_rows() if r.get("split") == split and r.get("error") is not None]


@table("published-step-summary")
def published_step_summary() -> str:
    """One line: held-out and calibration step-time error, and how many held-out rows are worse than 25%."""
    s = _published()["split"]
    held, cal = s["heldout"], s["calibration"]
    within = sum(abs(r["error"]) <= 0.25 for r in _rows("heldout"))
    return (f"held-out mean \\|error\\| {held['mean_abs_error']:.1%} over {held['rows']} rows (calibration "
            f"{cal['mean_abs_error']:.1%}, {cal['rows']} rows); {within} of {held['rows']} held-out rows within 25%")


@table("published-memory-summary")
def published_memory_summary() -> str:
    """One line: peak-memory error where published, and the rows that ran but are predicted not to fit."""
    m = _published()["memory"]
    rows = [r for r in _text_rows() if r.get("published_memory_gib")]
    within = sum(abs(r["memory_error"]) <= 0.10 for r in rows if r.get("memory_error") is not None)
    unfit = sorted(r["name"] for r in _text_rows() if r.get("fits") is False)
    return (f"{m['calibration']['mean_abs_error']:.1%} mean calibration ({m['calibration']['rows']} rows), "
            f"{m['heldout']['mean_abs_error']:.1%} held-out ({m['heldout']['rows']} rows), {within} of {len(rows)} "
            f"within 10%; {len(unfit)} of {len(_text_rows())} rows that ran are predicted not to fit"
            + (f" ({', '.join(unfit)})" if unfit else ""))


@table("published-memory-rows")
def published_memory_rows() -> str:
    """Every text-LLM row with a published peak: published against simulated (reserved) memory."""
    lines = ["| row | split | published GiB | simulated GiB | error |", "|---|---|---:|---:|---:|"]
    for r in _text_rows():
        if r.get("published_memory_gib") and r.get("memory_error") is not None:
            lines.append(f"| {r['name']} | {r['split']} | {r['published_memory_gib']:.1f} | "
                         f"{r['peak_memory_gib']:.1f} | {r['memory_error']:+.1%} |")
    return "\n".join(lines)


@table("published-unfit-rows")
def published_unfit_rows() -> str:
    """The text-LLM rows that really ran but whose layout the memory model says does not fit, with the need."""
    unfit = [r for r in _text_rows() if r.get("fits") is False]
    if not unfit:
        return "Every row that ran is predicted to fit."
    lines = ["| row | source | GPUs | what the memory model says |", "|---|---|---:|---|"]
    for r in unfit:
        lines.append(f"| {r['name']} | {r['source']} | {r['gpus']} | {r.get('fit_message', '')} |")
    return "\n".join(lines)


def _mean_abs(values: list[float]) -> str:
    return f"{sum(abs(v) for v in values) / len(values):.1%}" if values else "-"


@table("published-by-source")
def published_by_source() -> str:
    """Per source of the published table: rows and mean |error| of step time and of peak memory (where
    published), calibration and held-out apart, every row through the `simulate` command it prints."""
    rows = _published()["rows"]
    lines = ["| source | encoder + LLM | calibration rows | step, calibration | held-out rows | step, held-out | "
             "peaks | memory, calibration | memory, held-out |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for source in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == source]

        def errors(split: str, key: str, mine=mine) -> list[float]:
            return [r[key] for r in mine if r["split"] == split and r.get(key) is not None
                    and (key == "error" or r.get("published_memory_gib"))]

        cal, held = errors("calibration", "error"), errors("heldout", "error")
        mem_cal, mem_held = errors("calibration", "memory_error"), errors("heldout", "memory_error")
        mm = "yes" if all(r.get("multimodal") for r in mine) else ("some" if any(r.get("multimodal") for r in mine)
                                                                    else "")
        lines.append(f"| {source} | {mm} | {len(cal)} | {_mean_abs(cal)} | {len(held)} | {_mean_abs(held)} | "
                     f"{len(mem_cal) + len(mem_held)} | {_mean_abs(mem_cal)} | {_mean_abs(mem_held)} |")
    return "\n".join(lines)

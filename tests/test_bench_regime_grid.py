"""benchmarks/regime_grid.py: each cell's verdict is omni over the fastest baseline that fits (and over the
fastest other than spatial), and a cell where omni or every baseline has no layout says so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "regime_grid.py"


def _grid():
    spec = importlib.util.spec_from_file_location("regime_grid", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(tps: float, fits: bool = True) -> dict:
    return {"layout": "tp1", "fits": fits, "tokens_per_s_per_gpu": tps, "step_time_s": 1.0}


def test_a_cells_verdict_is_omni_over_the_fastest_fitting_baseline():
    g = _grid()
    cell = {"omni": _row(900), "spatial": _row(1000), "temporal": _row(950), "homogeneous": _row(2000, fits=False)}
    assert g.verdict(cell) == (0.9, "spatial", "")
    ratio, best, _ = g.verdict(cell, ("spatial",))
    assert best == "temporal" and abs(ratio - 900 / 950) < 1e-12
    assert g.verdict({"omni": _row(0, fits=False), "temporal": _row(950)})[2] == "omni: no layout fits"
    assert g.verdict({"omni": _row(900), "temporal": _row(0, fits=False)})[2] == "no baseline fits"
    assert g.verdict({"error": "tune: no layout of omni fits 8 GPUs"})[2].startswith("tune: ")
    row = g.table([{"model": "m", "workload": "w", "gpus": 1024, "budget": 4, "systems": cell}]).splitlines()[-1]
    assert "| 0.90x |" in row and "0.95x vs temporal" in row and "| homogeneous |" in row

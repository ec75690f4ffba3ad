"""The standalone quota sweep (benchmarks/gpu_quota_sweep.py) runs on CPU and writes its documented schema."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_quota_sweep.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_quota_sweep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_quick_cpu_sweep_writes_every_section_of_the_schema(tmp_path):
    out = tmp_path / "q.json"
    _load().main(["--device", "cpu", "--quick", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["schema"] == "omnibench-quota-sweep/1" and got["device"]["kind"] == "cpu"
    assert {r["kind"] for r in got["alone"]} == {"gemm", "attention", "memory"}
    assert {r["share"] for r in got["alone"]} == {0.5, 1.0} or got["device"]["threads"] == 1
    for r in got["alone"]:
        assert r["time_s"] > 0 and 0.0 <= r["u"] <= 1.0 and r["model_time_s"] >= r["full_time_s"] * (1 - 1e-9)
    assert got["pairs"] and all(p["sequential_s"] > 0 and p["concurrent_s"] > 0 for p in got["pairs"])


def test_script_imports_nothing_from_the_project():
    text = SCRIPT.read_text()
    for name in ("omnibench", "simulator", "systems", "workloads", "simpy"):
        assert f"import {name}" not in text and f"from {name}" not in text

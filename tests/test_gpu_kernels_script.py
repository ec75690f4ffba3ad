"""The standalone kernel sweep (benchmarks/gpu_kernels.py) runs on CPU and writes its documented schema."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_cpu_sweep_writes_every_section_of_the_schema(tmp_path):
    out = tmp_path / "k.json"
    _load().main(["--device", "cpu", "--quick", "--out", str(out)])
    prof = json.loads(out.read_text())
    assert prof["schema"] == "omnibench-kernel-profile/1"
    assert prof["device"]["kind"] == "cpu" and prof["quick"] is True
    assert {"m", "n", "k", "op", "time_s", "tflops"} <= set(prof["gemm"][0])
    assert {r["op"] for r in prof["gemm"]} == {"fwd", "dgrad", "wgrad"}
    assert {r["pass"] for r in prof["attention"]} == {"fwd", "fwd_bwd"}
    assert {"copy", "layernorm", "adamw_foreach"} <= {r["op"] for r in prof["memory_bound"]}
    assert prof["launch"]["host_per_kernel_s"] > 0
    assert all(r["time_s"] > 0 for r in prof["gemm"] + prof["attention"] + prof["memory_bound"])


def test_script_imports_nothing_from_the_project():
    text = SCRIPT.read_text()
    for name in ("omnibench", "simulator", "systems", "workloads", "simpy"):
        assert f"import {name}" not in text and f"from {name}" not in text

"""The allocator-pressure benchmark (benchmarks/gpu_allocator.py) runs this project's runtime step in
its own process; without CUDA it runs the steps uncapped and says pressure was not measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_on_cpu_the_runtime_steps_run_and_the_record_says_pressure_was_not_measured(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_allocator.py", "--device", "cpu", "--cases", "mm",
                           "--steps", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_allocator.json").read_text())
    (case,) = out["cases"]
    assert case["model"] == "tiny-omni" and case["recompute"] == "vision=full,audio=full"
    assert case["uncapped"]["ok"] is True and "not measured" in case["pressure"]
    assert "stranded_share" not in case  # nothing claimed where nothing was measured
    assert out["provenance"]["command"].startswith("python benchmarks/gpu_allocator.py")


def test_an_unknown_case_is_one_line_naming_the_cases():
    done = subprocess.run([sys.executable, "benchmarks/gpu_allocator.py", "--device", "cpu", "--cases", "vit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode != 0
    assert done.stderr.strip() == "error: cases: vit not among llm, mm"

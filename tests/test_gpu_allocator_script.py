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
    assert case["model"] == "tiny-omni@no-audio" and case["recompute"] == "vision=full,audio=full"
    assert case["uncapped"]["ok"] is True and "not measured" in case["pressure"]
    assert "stranded_share" not in case  # nothing claimed where nothing was measured
    assert out["provenance"]["command"].startswith("python benchmarks/gpu_allocator.py")


def test_an_unknown_case_is_one_line_naming_the_cases():
    done = subprocess.run([sys.executable, "benchmarks/gpu_allocator.py", "--device", "cpu", "--cases", "vit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode != 0
    assert done.stderr.strip() == "error: cases: vit not among llm, mm"


def _bisect():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_allocator", ROOT / "benchmarks" / "gpu_allocator.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.bisect_need


@pytest.mark.parametrize("need", [0.0, 0.0312, 0.091, 0.3, 0.7])
def test_the_bisection_finds_the_smallest_headroom_a_step_runs_under(need):
    share, tries = _bisect()(lambda s: {"ok": s >= need}, 0.16, 7)
    # to a resolution of the bracket the doubling found over 2**7
    bracket = 0.16 * 2 ** max(0, (need > 0.16) + (need > 0.32) + (need > 0.64))
    assert share is not None and need <= share <= need + bracket / 2**7 + 1e-12
    assert all(t["ok"] == (t["share"] >= need) for t in tries)
    assert share == min(t["share"] for t in tries if t["ok"])


def test_a_step_that_never_runs_gives_no_share_rather_than_a_guess():
    share, tries = _bisect()(lambda s: {"ok": False}, 0.16, 7)
    assert share is None and tries[-1]["share"] >= 1.0 and not any(t["ok"] for t in tries)


def test_the_gpu_session_script_parses_and_names_every_benchmark_it_runs():
    """A broken GPU script would spend GPU time on a syntax error: bash must parse it, and each
    benchmark it calls must exist."""
    import re

    script = ROOT / "benchmarks" / "gpu_session.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    called = set(re.findall(r"benchmarks/(gpu_\w+\.py)", script.read_text()))
    assert {"gpu_allocator.py", "gpu_figures.py", "gpu_llm_stack.py", "gpu_memory_phases.py",
            "gpu_chunk_profile.py", "gpu_nccl_memory.py"} <= called
    assert all((ROOT / "benchmarks" / name).is_file() for name in called)


@pytest.mark.parametrize("script", ["gpu_memory_phases.py", "gpu_chunk_profile.py", "gpu_nccl_memory.py"])
def test_the_cuda_only_benchmarks_say_so_in_one_line_without_a_gpu(script, tmp_path):
    done = subprocess.run([sys.executable, f"benchmarks/{script}", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert done.returncode != 0
    assert done.stderr.strip().startswith(f"error: {script} needs a CUDA device")
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_the_profiles_busy_time_is_the_union_of_kernel_intervals():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_chunk_profile", ROOT / "benchmarks" / "gpu_chunk_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.busy_seconds([(0.0, 1.0), (0.5, 1.5), (2.0, 3.0), (2.2, 2.4)]) == pytest.approx(2.5)
    assert mod.busy_seconds([]) == 0.0

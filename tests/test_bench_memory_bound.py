"""benchmarks/memory_bound.py runs and reads its own verdicts: a wrong prune is flagged where the bound is over
the device and the need under it (its figures are BENCHMARKS', not a test's)."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "memory_bound.py")


def _run(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_memory_bound_prints_every_mode_and_flags_a_bound_over_a_fitting_need():
    lines = _run("--systems", "noncolocated", "--workloads", "mixed_video", "--gpus", "64", "--tp", "2", "--pp", "4")
    rows = [ln.split() for ln in lines if ln.startswith("noncolocated")]
    assert [r[2] for r in rows] == ["none", "vision=full", "llm=full", "full"]
    for r in rows:
        bound, need, ratio = float(r[3]), float(r[4]), float(r[5])
        assert abs(need / bound - ratio) <= 0.01 * ratio  # GiB printed to 0.1
        assert ("WRONG" in r) == (bound > 79.2 >= need)  # an h100's 79.2 GiB
    assert lines[-1].startswith("lowest simulated / bound:")


def test_memory_bound_says_which_layout_cannot_plan():
    lines = _run("--systems", "homogeneous", "--workloads", "long_video", "--gpus", "64", "--tp", "2", "--pp", "4")
    assert any("cannot plan: microbatches" in ln for ln in lines)


@pytest.mark.parametrize("args,flag", [(["--systems", "foo"], "--systems"), (["--workloads", "nope"], "--workloads"),
                                       (["--hardware", "zz"], "--hardware"), (["--model", "qq"], "--model"),
                                       (["--microbatches", "-1"], "--microbatches")])
def test_memory_bound_refuses_bad_input_in_one_line_naming_the_flag(args, flag):
    out = subprocess.run([sys.executable, SCRIPT, *args, "--gpus", "16"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(flag + ":"), out.stderr[-1000:]


def test_memory_bound_takes_a_microbatch_count():
    # m == pp: every microbatch in flight (where omni's bound reads over its need)
    lines = _run("--systems", "omni", "--workloads", "image_sft", "--gpus", "64", "--tp", "2", "--pp", "4",
                 "--microbatches", "4")
    assert "4 microbatches" in lines[0]
    rows = [ln.split() for ln in lines if ln.startswith("omni ")]
    assert [r[2] for r in rows] == ["none", "vision=full", "llm=full", "full"]
    for r in rows:
        bound, need, ratio = float(r[3]), float(r[4]), float(r[5])
        assert abs(need / bound - ratio) <= 0.01 * ratio

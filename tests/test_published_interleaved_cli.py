"""benchmarks/published_interleaved.py refuses bad flags in one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "published_interleaved.py"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "flag"), [(["--vpp", "x"], "--vpp"), (["--vpp", "0,2"], "--vpp"),
                                            (["--rows", "("], "--rows"), (["--unshard", "maybe"], "--unshard")])
def test_bad_flags_are_one_line_errors_naming_the_flag(args, flag):
    got = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=50)
    assert got.returncode == 2
    last = got.stderr.strip().splitlines()[-1]
    assert flag in last and "Traceback" not in got.stderr


def test_the_whole_score_convention_weighs_4_percent_at_8k_and_40_at_128k():
    """An unstated FLOP formula is converted with causal attention; the script's last columns say what
    the published step is if every s x s score was counted (torchtitan's convention)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("published_interleaved", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from simulator.published import load_published

    rows = {r.name: r for r in load_published(SCRIPT.parents[1] / "results" / "validation" / "published_runs.csv")}
    assert mod.whole_scores_factor(rows["llama3-405b-8192gpu-cp1"]) == pytest.approx(1.040, abs=0.005)
    assert mod.whole_scores_factor(rows["llama3-405b-16384gpu-cp16"]) == pytest.approx(1.401, abs=0.005)
    stated = next(r for r in rows.values() if not r.unstated)
    assert mod.whole_scores_factor(stated) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "flag"), [(["--gpus", "100"], "--gpus"), (["--vpp", "a"], "--vpp")])
def test_the_in_flight_script_refuses_bad_flags_in_one_line(args, flag):
    script = SCRIPT.parent / "published_inflight.py"
    got = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=50)
    assert got.returncode == 2 and flag in got.stderr.strip().splitlines()[-1] and "Traceback" not in got.stderr

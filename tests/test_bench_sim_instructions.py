"""benchmarks/sim_instructions.py: bad input refused in one line naming the flag, and the phase it counts
runs as the benchmark runs it (its counts are figures under valgrind, not a test: minutes per tree)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "sim_instructions.py")
ROOT = os.path.dirname(SCRIPT).rsplit(os.sep, 1)[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,flag", [(["--system", "nope"], "--system"), (["--workload", "nope"], "--workload"),
                                       (["--gpus", "12"], "--gpus"), (["--against", "/nonexistent"], "--against")])
def test_sim_instructions_names_the_bad_flag_in_one_line(args, flag, tmp_path):
    res = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(flag), res.stderr


@pytest.mark.timeout(120)
def test_the_counted_step_plans_and_simulates_without_valgrind():
    # the child a count runs under callgrind, run plainly: it must plan and simulate this tree's step
    res = subprocess.run([sys.executable, SCRIPT, "--child", "sim", "--gpus", "64"], capture_output=True, text=True,
                         timeout=110, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr[-2000:]

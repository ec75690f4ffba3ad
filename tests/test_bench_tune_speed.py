"""benchmarks/tune_speed.py refuses bad input in one line naming the flag (its timing is a figure, not a test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "tune_speed.py")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,flag", [(["--case", "nope"], "--case"), (["--against", "/nonexistent"], "--against"),
                                       (["--workers", "0"], "--workers")])
def test_tune_speed_names_the_bad_flag_in_one_line(args, flag, tmp_path):
    res = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(flag), res.stderr


def test_every_case_reads_a_committed_seeds_file():
    """The cases run on a fresh clone: their seeds are in the repository, not in a reproduce's output."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_speed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.SEEDS.startswith(os.path.join(mod.ROOT, "benchmarks"))
    for case, (_args, seeds) in mod.CASES.items():
        assert seeds is None or os.path.isfile(os.path.join(mod.SEEDS, seeds)), f"{case}: no committed {seeds}"
    assert any(seeds is None for _args, seeds in mod.CASES.values())  # the untuned command is timed too

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

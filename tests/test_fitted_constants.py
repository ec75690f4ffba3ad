"""Every constant fitted to published results lives in simulator/fitted.py, with its error in and out of
sample as the committed validation table gives it; no cost code carries a fitted number of its own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from simulator.fitted import FITTED, fitted, mean_abs_error, rows_of
from simulator.hardware import load_cluster

ROOT = Path(__file__).resolve().parents[1]
SIMULATOR = ROOT / "simulator"
TABLE = ROOT / "results" / "validation" / "published_table.json"
# a code line holding a non-zero decimal number (an assignment, a dict entry, a call's argument)
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+")


class _Number:
    @staticmethod
    def match(line: str) -> bool:
        code = line.partition("#")[0]
        return any(float(x) != 0 for x in DECIMAL.findall(code))


NUMBER = _Number()
# a comment that says a number was fitted to measured results (not one saying it was not)
# (a profile's fields that `omnibench calibrate` fits from a user's own run traces default to 0: nothing)
SAYS_FITTED = re.compile(r"\bfitted\b(?! from run traces| curve)|\bfit on\b", re.IGNORECASE)
SAYS_NOT = re.compile(r"not fitted|nothing here was fitted|no .*fitted|never fitted", re.IGNORECASE)


def _comment_block_above(lines: list[str], i: int) -> str:
    block = []
    j = i - 1
    while j >= 0 and lines[j].lstrip().startswith("#"):
        block.append(lines[j])
        j -= 1
    return " ".join(reversed(block)) + " " + lines[i].partition("#")[2]


def test_no_cost_code_carries_a_fitted_number_outside_the_registry():
    offenders = []
    files = [p for p in SIMULATOR.rglob("*.py") if p.name != "fitted.py"] + list(SIMULATOR.rglob("*.toml"))
    for path in files:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not NUMBER.match(line):
                continue
            said = _comment_block_above(lines, i)
            if SAYS_FITTED.search(said) and not SAYS_NOT.search(said):
                offenders.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not offenders, "fitted numbers outside simulator/fitted.py:\n" + "\n".join(offenders)


@pytest.mark.parametrize("line", ["SCALE = 0.83", "SCALES = {'a100': 0.835}", "need = AllocatorNeed(0.0044, 1.2)",
                                  "x = 0.835 * share"])
def test_the_check_itself_catches_a_fitted_number(line):
    lines = ["# Fitted on the calibration rows", line]
    assert NUMBER.match(lines[1]) and SAYS_FITTED.search(_comment_block_above(lines, 1))
    assert not NUMBER.match("x = 0.0") and not NUMBER.match("# 0.835 in a comment")


def test_the_shipped_presets_read_their_fitted_scales_from_the_registry():
    assert load_cluster("h100-500w", 8).gpu.kernel_compute_scale == fitted("kernel_compute_scale.h100-500w")
    assert load_cluster("a100-40g", 8).gpu.kernel_compute_scale == fitted("kernel_compute_scale.a100")
    assert load_cluster("v100-32g", 8).gpu.kernel_compute_scale == fitted("kernel_compute_scale.v100")
    from simulator import memory

    assert memory.FRAGMENTATION == fitted("fragmentation")


def test_a_hardware_file_naming_an_unknown_fitted_constant_is_refused(tmp_path):
    text = (ROOT / "simulator" / "data" / "hardware" / "h100-500w.toml").read_text()
    bad = tmp_path / "hw.toml"
    bad.write_text(text.replace("fitted:kernel_compute_scale.h100-500w", "fitted:nope"))
    with pytest.raises(ValueError, match="names no fitted constant; known: kernel_compute_scale"):
        load_cluster(str(bad), 8)


@pytest.mark.parametrize("name", sorted(FITTED))
def test_each_constants_stated_errors_are_the_committed_tables(name):
    """in_sample / out_of_sample: the mean |error| of the committed table's calibration / held-out rows
    in the constant's scope, to 0.1 percentage point."""
    rows = json.loads(TABLE.read_text())["rows"]
    c = FITTED[name]
    assert rows_of(c, rows, "calibration"), f"{name}: no calibration row in scope"
    assert mean_abs_error(c, rows, "calibration") == pytest.approx(c.in_sample, abs=1e-3)
    out = mean_abs_error(c, rows, "heldout")
    assert out == pytest.approx(c.out_of_sample, abs=1e-3)

"""The README's tour is a specification: every command in it runs, in order, in an empty folder, and
does what the README says. Slow lines run in the small form the README names (`--gpus 64` for the
1,024-GPU simulations here; `omnibench reproduce --quick` under `-m slow`)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
SMALL = {"--gpus 1024": "--gpus 64"}  # the README's documented small forms
SLOW = ("omnibench reproduce",)  # run as `omnibench reproduce --quick` by the slow test below


def tour_commands() -> list[str]:
    section = README.split("## A tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [re.sub(r"\s+#.*$", "", ln).strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln]


def small(cmd: str) -> str:
    for big, little in SMALL.items():
        cmd = cmd.replace(big, little)
    return cmd


def test_the_readme_names_every_small_form_the_tour_test_uses():
    for big, little in SMALL.items():
        assert any(big in c for c in tour_commands()) and f"`{little}`" in README
    assert "`omnibench reproduce --quick`" in README
    assert "tests/test_readme_tour.py" in README


@pytest.fixture
def scratch(tmp_path):
    """An empty folder with `omnibench` on PATH (this checkout): nothing is copied in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "omnibench"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m omnibench "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    env.pop("COLUMNS", None)  # output to a pipe, as in CI logs: nothing may be cut

    def sh(cmd: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout)

    return work, sh


def _expect(cmd: str, out: str, work: Path) -> None:
    """What the README says each command produces."""
    if cmd == "omnibench --help":
        for c in ("workloads", "models", "run", "plan", "simulate", "calibrate", "validate", "plot", "report",
                  "reproduce"):
            assert re.search(rf"\b{c}\b", out), c
    elif cmd == "omnibench workloads list":
        for w in ("mixed_video", "long_video", "omni_av", "image_sft", "bursty_mix"):
            assert w in out
    elif cmd.startswith("omnibench workloads show") and "--plot" in cmd:
        assert (work / "mix.png").stat().st_size > 0 and json.loads(out)
    elif cmd.startswith("omnibench workloads show"):  # mix, length percentiles, batch imbalance
        assert "mixture" in out and "p99" in out and "how much batches differ" in out
    elif cmd.startswith("omnibench models list"):
        assert "omni-7b" in out and "tiny-omni" in out
    elif cmd.startswith("omnibench plan"):
        system = cmd.split("--system ")[1].split()[0]
        assert f"{system} plan" in out and "layouts" in out and "rank 0" in out
        if not any(f in cmd for f in ("--tp", "--pp", "--cp")):  # the system's own default layout, said so
            assert f"({system}'s default: " in out
    elif cmd.startswith("omnibench run"):
        runs = list((work / "results" / "runs").iterdir())
        assert len(runs) == 1 and not runs[0].name.endswith(".incomplete")
        names = {p.name for p in runs[0].iterdir()}
        assert {"config.json", "plan_step0.json", "steps.jsonl", "steps.csv", "summary.json", "trace.json"} <= names
        assert str(runs[0]) in out  # the record path, whole, in piped output
    elif cmd.startswith("omnibench simulate"):
        assert "record: results/sims/" in out and "…" not in out
        systems = ("homogeneous", "temporal", "colocated", "noncolocated", "omni") if "--system all" in cmd else ("omni",)
        for s in systems:
            assert re.search(rf"│\s+64 │ {s}\s+│\s+[\d,]+ │", out), s  # a throughput row, not "does not fit"
            # no --recompute: each system at the cheapest recomputation that fits, and the output says which
            assert re.search(rf"64 GPUs, {s}: .*recompute=\S+ \(auto: the cheapest that fits\)", out), s
    elif cmd.startswith("omnibench calibrate"):
        assert (work / "profile.json").is_file() and "profile: profile.json" in out
    elif cmd.startswith("omnibench validate --published"):
        assert "mean |error|" in out
    elif cmd.startswith("omnibench validate"):
        assert "mean absolute error" in out and "temporal" in out
    elif cmd.startswith("omnibench plot throughput"):
        assert (work / "throughput.png").stat().st_size > 0 and (work / "throughput.pdf").is_file()
    else:
        raise AssertionError(f"the tour test has no expectation for a README line: {cmd!r}")


@pytest.mark.timeout(600)
def test_every_command_of_the_readme_tour_runs_in_an_empty_folder_and_does_what_it_says(scratch):
    work, sh = scratch
    ran = []
    for cmd in tour_commands():
        if cmd.startswith(SLOW):
            continue
        res = sh(small(cmd))
        assert res.returncode == 0, f"{small(cmd)}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        _expect(cmd, res.stdout, work)
        ran.append(cmd)
    assert len(ran) == len(tour_commands()) - 1


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_tours_reproduce_in_its_small_form_makes_the_figures_and_the_report(scratch):
    work, sh = scratch
    res = sh("omnibench reproduce --quick", timeout=1700)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # breakdown_256: the breakdown again at the largest size the quick sweep reached (LARGEST_GPUS_QUICK)
    for fig in ("throughput", "speedup", "scaling", "dynamic", "dynamic_drifting", "timeline", "validation", "ablation",
                "workload", "breakdown", "breakdown_256"):
        assert (work / "results" / "figures" / f"{fig}.png").is_file(), fig
    assert (work / "results" / "report.html").is_file()
    assert not [p for p in work.rglob(".*")]  # no hidden temporary folder or file left behind


def slow_marked() -> list[str]:
    """Where the suite uses `pytest.mark.slow` (read from the source, nothing imported): a test whose
    decorators hold it, or file:line for any other use (a parameter list, a module's pytestmark)."""
    import ast

    found = []
    for path in sorted((REPO / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        inside: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in node.decorator_list:
                    if "mark.slow" in ast.unparse(deco):
                        found.append(node.name)
                        inside.update(n.lineno for n in ast.walk(deco) if hasattr(n, "lineno"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node.value).endswith("mark")
                    and node.lineno not in inside):
                found.append(f"{path.name}:{node.lineno}")
    return sorted(found)


def test_the_readme_says_exactly_what_ci_runs():
    """.ci/run runs the README's test command; the tests it leaves out are the seven marked slow, which
    the README names (no loss-parity cell is among them)."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "ruff check ." in ci and re.search(r"python3? -m pytest -n 2 -q\b", ci)
    assert 'pip install -e ".[dev]" && python -m pytest -n 2 -q' in README
    assert slow_marked() == sorted([
        "test_chunks_without_block_recompute_stay_within_15_percent_of_the_tracker",
        "test_encoder_and_llm_step_at_full_depth_within_10_percent_of_the_runtime_tracked",
        "test_llm_only_step_at_full_depth_within_10_percent_of_the_runtime_tracked",
        "test_encoder_chunking_lowers_the_tracked_vit_peak_and_the_estimate_follows",
        "test_committed_slow_tables_are_what_the_script_writes_from_the_records",
        "test_the_tours_reproduce_in_its_small_form_makes_the_figures_and_the_report",
        "test_ray_gives_the_serial_results",
        # parity cells whose plans equal another cell's on every batch (in parameter lists)
        "test_omni_parity.py:92", "test_system_layout_matches_single_process",
    ])
    assert "but the seven marked slow" in README and "`omnibench reproduce --quick`" in README
    assert "tests/test_memory_tracker.py" in README and "tests/test_tables.py" in README

"""One function settles the layout every command runs (omnibench/resolve.py): the flags, else each
system's default layout, and `--recompute auto`: the cheapest recomputation per module that the
simulator's memory estimate fits, failing only when nothing can."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnibench.resolve import recompute_modes, resolve_layout
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.hardware import load_cluster
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[1]


def _batches(workload: str, gpus: int, steps: int = 1):
    stream = WorkloadStream(workload, seed=0, global_batch_tokens=8192 * gpus)
    return [stream.batch(s) for s in range(steps)]


def test_auto_tries_encoders_before_the_llm_and_leaves_out_modules_without_work():
    model = get_model("omni-7b")
    av = recompute_modes(model, _batches("omni_av", 16)[0].samples)
    assert av[0] == "none" and av[-1] == "full"
    assert av.index("vision=full,audio=full") < av.index("llm=full") < av.index("full")
    text = recompute_modes(model, _batches("text_only", 16)[0].samples)
    assert text == ["none", "full"]  # recomputing an encoder that has no input saves nothing
    assert recompute_modes(get_model("llm-7b")) == ["none", "full"]


def test_auto_takes_the_cheapest_mode_that_fits_and_every_cheaper_one_does_not():
    model, cluster = get_model("omni-7b"), load_cluster("h100", 64)
    batches = _batches("mixed_video", 64)
    parallel = ParallelSpec(world_size=64)
    res = resolve_layout("homogeneous", model, parallel, batches, cluster, recompute="auto")
    assert res.fits and res.chosen and res.recompute not in ("none", "full")  # an encoder recomputed, not all
    assert res.peak_bytes <= cluster.gpu.memory_bytes
    assert "the system's default" not in res.layout_note and "homogeneous's default" in res.layout_note
    modes = recompute_modes(model, batches[0].samples)
    for cheaper in modes[: modes.index(res.recompute)]:
        got = resolve_layout("homogeneous", model, parallel, batches, cluster, recompute=cheaper, estimate=True)
        assert not got.fits, cheaper
    assert "(auto: the cheapest that fits)" in res.memory_note()


def test_flags_given_win_and_the_others_are_one():
    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    res = resolve_layout("colocated", model, ParallelSpec(world_size=16), _batches("image_sft", 16), cluster, tp=2,
                         recompute="full")
    assert (res.parallel.tp, res.parallel.pp, res.parallel.cp) == (2, 1, 1)
    assert res.layout_note == "given: tp 2, pp 1, cp 1" and res.recompute == "full" and not res.peak_bytes


def test_when_nothing_fits_auto_keeps_full_recomputation_and_says_so():
    model, cluster = get_model("vl-72b"), load_cluster("h100", 8)
    res = resolve_layout("homogeneous", model, ParallelSpec(world_size=8), _batches("long_video", 32), cluster,
                         recompute="auto")
    assert not res.fits and res.recompute == "full" and res.peak_bytes > res.budget_bytes
    assert "does not fit even so" in res.memory_note()


def _every_peak(system, model, parallel, batches, cluster, modes, stack="eager"):
    """Each mode's whole estimate, every batch's every class played (what resolve_layout did before it
    stopped at a layout's first rank over the budget and left the play out)."""
    from dataclasses import replace

    from simulator.engine import Engine, SimOptions
    from systems import get_planner

    out = {}
    for m in modes:
        trial = replace(parallel, recompute=m)
        tops = []
        for b in batches:
            res = Engine(get_planner(system).plan(model, trial, b), model, cluster,
                         options=SimOptions(recompute=m, check_memory=False, stack=stack)).run()
            top = max(res.ranks, key=lambda r: r.memory_needed)
            tops.append((top.memory_needed, top.rank))
        out[m] = max(tops, key=lambda t: t[0])
    return out


@pytest.mark.parametrize("system, model_name, workload, gpus, tokens, stack", [
    ("homogeneous", "omni-7b", "mixed_video", 64, 8192, "eager"),
    ("omni", "omni-7b", "mixed_video", 64, 8192, "eager"),
    ("homogeneous", "omni-7b", "mixed_video", 64, 8192, "fused"),  # the stack the step is simulated on
    ("homogeneous", "vl-72b", "long_video", 8, 32768, "eager"),  # nothing fits: the last mode's whole estimate
])
def test_auto_answers_what_every_modes_whole_estimate_would(system, model_name, workload, gpus, tokens, stack):
    from omnibench.resolve import ESTIMATE_STEPS

    model, cluster = get_model(model_name), load_cluster("h100", gpus)
    stream = WorkloadStream(workload, seed=0, global_batch_tokens=tokens * gpus)
    batches = [stream.batch(s) for s in range(2)]
    res = resolve_layout(system, model, ParallelSpec(world_size=gpus), batches, cluster, recompute="auto",
                         stack=stack)
    modes = recompute_modes(model, [x for b in batches[:ESTIMATE_STEPS] for x in b.samples])
    laid = res.parallel
    every = _every_peak(system, model, laid, batches, cluster, modes[: modes.index(res.recompute) + 1], stack)
    budget = cluster.gpu.memory_bytes
    assert all(every[m][0] > budget for m in modes[: modes.index(res.recompute)])
    assert (res.peak_bytes, res.peak_rank) == every[res.recompute]
    assert res.fits == (every[res.recompute][0] <= budget)
    assert res.fits or res.recompute == modes[-1]


def _omnibench(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "omnibench", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_most_natural_simulation_fits_every_system_and_says_which_recomputation(tmp_path):
    """No layout flags, no --recompute: five rows with throughput, exit 0, a record whose rows say the mode."""
    done = _omnibench("simulate", "--system", "all", "--workload", "mixed_video", "--gpus", "64", "--out",
                      str(tmp_path / "sims"), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    rows = out["results"]
    assert [r["system"] for r in rows] == ["homogeneous", "temporal", "colocated", "noncolocated", "omni", "spatial"]
    assert all(r["fits"] and r["tokens_per_s"] > 0 and r["recompute"] != "auto" for r in rows), rows
    assert all("auto: the cheapest that fits" in r["recompute_note"] for r in rows)
    config = json.loads((Path(out["record"]) / "config.json").read_text())
    assert config["recompute"] == "auto"


def test_plan_settles_recompute_auto_and_prints_it(tmp_path):
    done = _omnibench("plan", "--system", "omni", "--nproc", "16", "--model", "omni-7b", "--global-batch-tokens",
                      "131072", "--length-scale", "1", "--max-sample-tokens", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("memory"))
    assert re.search(r"recompute=\S+ \(auto: the cheapest that fits an H100\)", line), line
    assert "recompute=none " not in line  # omni-7b's encoders do not fit 80 GB without recomputation here


def test_simulate_help_says_the_default_layout_once_and_each_option_in_one_line(tmp_path):
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "omnibench", "simulate", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.count("anchor's usual layout") == 1 and text.count("Megatron-style") == 1
    # the options under their panels, each in one line
    from omnibench.cli.simulate import SIMULATE_PANELS

    titles = re.findall(r"╭─ (.+?) ─", text)
    assert sorted(titles) == sorted([*SIMULATE_PANELS, "Options"]), titles  # Options: --help alone
    rest = text[text.index("╭─ Options"):]
    assert [ln.split()[1] for ln in rest[:rest.index("╰")].splitlines()[1:]] == ["--help"]
    box = text[text.index("╭─"):]
    rows = [ln for ln in box.splitlines() if ln.startswith("│")]
    continued = [ln for ln in rows if not re.match(r"│\s+(\*\s+)?--", ln)]
    assert len(rows) == 1 + sum(map(len, SIMULATE_PANELS.values())) and not continued, "\n".join(continued)


def test_a_simulate_option_in_no_help_panel_is_refused_where_the_command_is_registered():
    import typer

    from omnibench.cli.common import in_panels

    def command(tp: int = typer.Option(0, "--tp"), pp: int = typer.Option(0, "--pp")) -> None: ...

    with pytest.raises(ValueError, match=r"options in no help panel: \['pp'\]"):
        in_panels(command, {"Layout": ("tp",)})
    with pytest.raises(ValueError, match=r"panels name unknown ones: \['cp'\]"):
        in_panels(command, {"Layout": ("tp", "pp", "cp")})
    assert in_panels(command, {"Layout": ("tp", "pp")}) is command

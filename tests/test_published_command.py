"""`validate --published` runs each row through the `omnibench simulate` command a user would type: the
command is in `--json`, running it as printed gives the row's step time and peak, everything it needs is a
CLI option (a software stack and its mechanism flags, a fixed-length text workload, a model file), and no
rule in simulator/ reads a row's source, table or name."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest

from omnibench.specs.presets import get_model
from simulator.published import (
    check_row,
    command_of,
    load_published,
    model_file,
    model_of,
    to_json,
)
from simulator.stacks import SOFTWARE_STACKS, parse_flags
from tests.cli_errors import invoke, one_error_line

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "results" / "validation" / "published_table.json"


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in load_published("published_runs") + load_published("megatron_a100")}


def test_every_rows_model_file_is_its_model(rows):
    for r in rows.values():
        got, want = get_model(str(model_file(r))), model_of(r)
        assert dataclasses.replace(got.llm, name="x") == dataclasses.replace(want.llm, name="x"), r.name
        assert (got.vision is None) == (want.vision is None), r.name
        if want.vision is not None:  # the encoder + LLM rows' ViT, projecting to the LLM's width
            assert dataclasses.replace(got.vision, name="x") == dataclasses.replace(want.vision, name="x"), r.name


def test_every_rows_software_is_a_named_stack_and_flags_the_cli_takes(rows):
    for r in rows.values():
        sw = r.software_spec
        assert sw.stack in SOFTWARE_STACKS, r.name
        assert parse_flags(sw.flags()) == sw, r.name  # the flags printed select this very software
        assert r.software.split()[:2] == ["--stack", sw.stack] and ("--fp8" in sw.flags()) == (r.precision == "fp8")


def test_what_a_row_runs_reads_no_note_table_or_source_of_it():
    """The row's model, layout, options and command come from its columns (the software column included),
    never from its notes, table heading or source: a rule keyed on them is a rule for a row."""
    import inspect

    from simulator import published

    for fn in (published.command_of, published.options_of, published.parallel_of, published.expert_tp_of,
               published.model_of, published.run_command, published._check_command):
        code = inspect.getsource(fn)
        assert not re.search(r"\.(notes|table|source)\b", code), fn.__name__


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["mpt-7b-8xh100", "tt-8b-fsdp8-compile-fp8", "megatron-v1-4.2b-4gpu",
                                  "nemo-llama3-8b-8gpu",
                                  # encoder + LLM: a frozen ViT in the first pipeline stage; FSDP, modules in turn
                                  "mswift-qwen2.5-vl-7b-full-tp2-2xa100", "optimus-vit3b-gpt11b-fsdp-8xa100"])
def test_a_rows_printed_command_run_as_a_user_runs_it_gives_its_step_time_and_peak(rows, name, tmp_path):
    """The committed table's figures, from the command line `--json` prints, run in a shell from the root."""
    check = check_row(rows[name])
    printed = to_json([check])["rows"][0]["command"]
    assert printed.startswith("omnibench simulate ")
    committed = {r["name"]: r for r in json.loads(TABLE.read_text())["rows"]}[name]
    argv = shlex.split(printed)[1:] + ["--json", "--workers", "1", "--out", str(tmp_path)]
    got = subprocess.run([sys.executable, "-m", "omnibench", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=200)
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout)["results"][0]
    assert result["step_time_s"] == pytest.approx(committed["simulated_s"], rel=1e-9)
    assert result["peak_memory_gib"] == pytest.approx(committed["peak_memory_gib"], rel=1e-9)


def test_a_row_the_fill_rule_changed_prints_the_command_it_ran(rows):
    """A run whose unpublished DP mode and recompute do not fit is simulated as a user of its stack would run
    it (the fastest choice that fits); the command the table records carries that choice, not the CSV's."""
    committed = {r["name"]: r for r in json.loads(TABLE.read_text())["rows"]}
    filled = [r for r in committed.values() if r["filled"]]
    assert filled
    for got in filled:
        row = rows[got["name"]]
        printed = shlex.split(got["command"])
        chosen = dict(part.split() for part in got["filled"].split(", "))
        assert chosen and got["fits"]
        assert printed[printed.index("--dp-mode") + 1] == chosen.get("dp_mode", row.dp_mode)
        assert printed[printed.index("--recompute") + 1] == chosen.get("recompute", row.recompute)
        assert printed == ["omnibench", *command_of(row, chosen.get("dp_mode"), chosen.get("recompute"))]


def test_no_rule_in_the_simulator_names_a_source_a_table_or_a_row(rows):
    words = {r.source for r in rows.values()} | set(rows)
    found = []
    for path in sorted((ROOT / "simulator").rglob("*.py")):
        text = path.read_text()
        for w in words:
            if re.search(r"(?<![\w-])" + re.escape(w) + r"(?![\w-])", text):
                found.append(f"{path.relative_to(ROOT)}: {w}")
    assert not found, found


def test_the_stacks_are_in_simulates_help():
    from typer.testing import CliRunner

    from omnibench.cli import app

    r = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "250"})
    for flag in ("--stack", "--sequence-parallel", "--overlap-grad-reduce", "--overlap-param-gather", "--tp-overlap",
                 "--attention", "--grad-reduce-dtype", "--fp8", "--ep-dispatcher", "--expert-tp"):
        assert flag in r.output, flag


@pytest.mark.parametrize("args, needles", [
    (["--stack", "megatron"], ["stack must be one of", "megatron-core"]),
    (["--stack", "torchtitan", "--grad-reduce-dtype", "bf16"], ["grad-reduce-dtype bf16", "got --stack torchtitan"]),
    (["--stack", "nemo", "--grad-reduce-dtype", "fp16"], ["grad-reduce-dtype must be one of fp32, bf16"]),
    (["--stack", "nemo", "--fp8", "--hardware", "a100-80g"], ["fp8", "Hopper or later"]),
    (["--stack", "nemo", "--fp8", "--hardware", "simulator/data/hardware/a100-80g.toml"], ["fp8", "A100-SXM4-80GB"]),
    (["--stack", "megatron-core", "--attention", "sdpa"], ["attention must be one of flash, unfused"]),
    (["--stack", "megatron-core", "--ep-dispatcher", "nccl"], ["ep-dispatcher must be one of alltoall, deepep"]),
    (["--stack", "megatron-core", "--expert-tp", "2"], ["expert-tp must be 0", "got 2"]),
    (["--stack", "megatron-core", "--tuned"], ["tuned", "--stack eager or fused"]),
])
def test_a_stack_or_flag_that_does_not_apply_is_one_line(args, needles, tmp_path):
    r = invoke("simulate", "-w", "pretrain_4096", "-s", "homogeneous", "--gpus", "8", "-m", "llm-7b",
               "--out", tmp_path / "out", *args)
    one_error_line(r, *needles)
    assert not (tmp_path / "out").exists()


def test_a_default_pipeline_layout_is_cut_as_the_stack_cuts_it(tmp_path):
    """Megatron-Core's stacks count the embedding and the loss as layers where pp does not divide the layers:
    the default layout (pp chosen by the system) gets the same cut as the layout given by hand."""
    def step(*layout: str) -> float:
        r = invoke("simulate", "-w", "pretrain_4096", "-s", "homogeneous", "--gpus", "128", "-m",
                   "published/llama-126L-16384h-128a-8kv-53248f-128256v", "--stack", "nemo", "--recompute", "full",
                   *layout, "--json", "--workers", "1", "--out", tmp_path)
        assert r.exit_code in (0, 1), r.output
        got = json.loads(r.output)["results"][0]
        return got["step_time_s"], got.get("layout", "")

    default, laid = step()
    assert step("--tp", laid.split()[0][2:], "--pp", laid.split()[1][2:])[0] == default


def test_explicit_defaults_change_nothing_and_bf16_gradients_halve_the_reduction(tmp_path):
    def row(*flags: str) -> dict:
        r = invoke("simulate", "-w", "pretrain_2048", "-s", "homogeneous", "--gpus", "16", "-m",
                   "published/gpt-24L-2304h-24a-24kv-9216f-51200v", "--hardware", "a100-80g", "--tp", "2", "--dp-mode",
                   "zero1", "--recompute", "full", *flags, "--json", "--workers", "1", "--out", tmp_path)
        assert r.exit_code in (0, 1), r.output
        return json.loads(r.output)["results"][0]

    fused = row("--stack", "fused")
    assert row("--stack", "fused", "--grad-reduce-dtype", "fp32") == {**fused, "sim_seconds": ANY, "planning_cpu_s": ANY}
    core, half = row("--stack", "megatron-core"), row("--stack", "megatron-core", "--grad-reduce-dtype", "bf16")
    assert half["peak_memory_gib"] < core["peak_memory_gib"]
    assert half["breakdown_s"]["exposed_comm"] <= core["breakdown_s"]["exposed_comm"]


def test_a_fixed_length_text_workload_is_named_by_its_length():
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    batch = WorkloadStream(get_workload("pretrain_4096"), seed=0, global_batch_tokens=8 * 4096).batch(0)
    assert [s.llm_tokens for s in batch.samples] == [4096] * 8
    r = invoke("workloads", "show", "pretrain_0")
    assert r.exit_code == 2 and "pretrain_<N>" in r.output

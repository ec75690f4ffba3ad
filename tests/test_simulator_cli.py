"""`omnibench simulate | calibrate | validate` end to end (typer app with only these commands)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from omnibench.cli import simulate as sim_cli

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def app():
    a = typer.Typer()
    sim_cli.register(a)
    return a


def test_simulate_prints_a_row_per_size_and_system_and_writes_a_record(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--workload", "mixed_video", "--system", "all", "--gpus", "16,32",
                                 "--tp", "2", "--pp", "2", "--microbatches", "4", "--global-batch-tokens",
                                 "65536", "--recompute", "full", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    rows = out["results"]
    from systems import available_systems

    assert {(x["gpus"], x["system"]) for x in rows} == {(n, s) for n in (16, 32) for s in available_systems()}
    ok = [x for x in rows if "error" not in x and x["fits"]]
    assert ok, rows
    for x in ok:
        assert x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1 and 0 <= x["bubble"] < 1
        assert x["speedup_over_best_baseline"] is None or x["speedup_over_best_baseline"] > 0
    rec = tmp_path / out["record"].split("/")[-1]
    assert (rec / "config.json").is_file() and (rec / "results.json").is_file()
    assert any(p.name.startswith("trace_") for p in rec.iterdir())
    assert "omni" in out["missing_systems"] or "omni" in available_systems()


def test_simulate_table_output(app, tmp_path, monkeypatch):
    monkeypatch.setattr(sim_cli.console, "width", 200)  # a wide terminal: no column is abbreviated
    r = CliRunner().invoke(app, ["simulate", "-w", "image_sft", "-s", "homogeneous", "--gpus", "16",
                                 "--global-batch-tokens", "65536", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "homogeneous" in r.output and "tok/s/GPU" in r.output and "record:" in r.output


def test_a_plan_that_does_not_fit_is_reported_not_timed(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "long_video", "-s", "homogeneous", "--gpus", "8",
                                 "--model", "vl-72b", "--global-batch-tokens", "262144", "--out", str(tmp_path),
                                 "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["results"][0]
    assert row["fits"] is False and row["fit_message"].startswith("does not fit: rank")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "abc"], "gpus"),
        (["--gpus", "16", "--hardware", "tpu"], "hardware must be one of"),
        (["--gpus", "16", "--system", "nosuch"], "system must be one of"),
        (["--gpus", "16", "--recompute", "some"], "recompute must be one of"),
        (["--gpus", "16", "--tp", "3"], "tp=3"),
        (["--gpus", "16", "--model", "nosuch-model"], "nosuch-model"),
    ],
)
def test_simulate_bad_input_is_one_line_naming_the_field(app, tmp_path, args, needle):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "--out", str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_calibrate_and_validate_commands(app, tmp_path):
    from test_simulator_calibrate import TRUE, write_record

    runs = []
    for i, system in enumerate(("homogeneous", "temporal")):
        d = tmp_path / f"run{i}"
        write_record(d, system, 3, 6, TRUE)
        runs.append(str(d))
    prof = tmp_path / "prof.json"
    r = CliRunner().invoke(app, ["calibrate", *runs, "--out", str(prof)])
    assert r.exit_code == 0, r.output
    assert prof.is_file() and "compute.forward" in r.output
    r = CliRunner().invoke(app, ["validate", *runs, "--calibration", str(prof)])
    assert r.exit_code == 0, r.output
    assert "mean absolute error" in r.output and "in-sample" in r.output
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_simulate_ablation_switches_reach_omnis_plan_and_the_record(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "omni", "--gpus", "16", "--tp", "2",
                                 "--no-long-short-sp", "--no-reorder", "--option", "reorder_group=4",
                                 "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rec = tmp_path / json.loads(r.output)["record"].split("/")[-1]
    assert rec.name.endswith("-no-long-short-sp-reorder")
    config = json.loads((rec / "config.json").read_text())
    assert config["options"] == {"reorder_group": "4", "long_short_sp": False, "reorder": False}
    plan = json.loads(next(rec.glob("plan_omni_16_step*.json")).read_text())
    assert plan["options"]["long_short_sp"] is False and plan["options"]["reorder"] is False


def test_simulate_bad_system_option_is_one_line(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "omni", "--gpus", "16",
                                 "--option", "reorder_group", "--out", str(tmp_path)])
    assert r.exit_code == 2
    assert "--option must look like key=value" in r.output and len(r.output.strip().splitlines()) == 1

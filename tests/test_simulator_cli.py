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
    monkeypatch.setattr(sim_cli.console, "width", 200)  # whatever width earlier tests left on the shared console
    r = CliRunner().invoke(app, ["simulate", "-w", "image_sft", "-s", "homogeneous", "--gpus", "16",
                                 "--global-batch-tokens", "65536", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "homogeneous" in r.output and "tok/s/GPU" in r.output and "record:" in r.output


def test_a_plan_that_does_not_fit_is_reported_not_timed(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "long_video", "-s", "homogeneous", "--gpus", "8",
                                 "--model", "vl-72b", "--global-batch-tokens", "262144", "--out", str(tmp_path),
                                 "--json"])
    assert r.exit_code == 1, r.output  # nothing fits: a failure, not an empty success
    out = json.loads(r.output)
    row = out["results"][0]
    assert row["fits"] is False and row["fit_message"].startswith("does not fit: rank")
    assert "tokens_per_s" not in row and "mfu" not in row and "per_step" not in row
    assert out["record"] is None and list(tmp_path.iterdir()) == []  # no trace, no record, no temp folder


def test_when_nothing_fits_or_plans_the_table_names_each_systems_reason_and_exits_non_zero(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "homogeneous,temporal", "--gpus", "16",
                                 "--tp", "4", "--pp", "4", "--recompute", "none", "--out", str(tmp_path)])
    assert r.exit_code == 1, r.output
    assert "homogeneous: does not fit: rank" in r.output
    assert "temporal: cannot plan: pp:" in r.output
    assert "no system fits or plans this layout" in r.output and "record:" not in r.output
    assert list(tmp_path.iterdir()) == []


def test_a_row_that_does_not_fit_among_rows_that_do_keeps_no_throughput_and_no_trace():
    from types import SimpleNamespace

    res = SimpleNamespace(fits=False, fit_message="does not fit: rank 3 needs 90.0 GiB of 80.0 GiB",
                          peak_memory=90 * 2**30, memory_capacity=80 * 2**30, classes=4, sim_seconds=0.1,
                          step_time=1.0, tokens=1000)
    row = sim_cli._summary([res])
    assert row["fits"] is False and row["fit_message"] == res.fit_message and row["peak_memory_gib"] == 90
    assert not {"tokens_per_s", "tokens_per_s_per_gpu", "mfu", "tflops_per_gpu", "per_step"} & set(row)


def test_a_simulation_record_holds_a_flat_results_csv_provenance_and_the_users_permissions(app, tmp_path):
    import csv
    import os
    import stat

    r = CliRunner().invoke(app, ["simulate", "-w", "image_sft", "-s", "homogeneous,temporal", "--gpus", "16",
                                 "--global-batch-tokens", "65536", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rec = tmp_path / json.loads(r.output)["record"].split("/")[-1]
    rows = list(csv.DictReader((rec / "results.csv").open()))
    assert [(x["gpus"], x["system"]) for x in rows] == [("16", "homogeneous"), ("16", "temporal")]
    assert all(float(x["tokens_per_s"]) > 0 and x["fits"] == "True" for x in rows)
    prov = json.loads((rec / "config.json").read_text())["provenance"]
    assert set(prov) >= {"commit", "dirty", "omnibench", "torch", "python", "command", "hostname", "device"}
    assert prov["device"] == "simulated: h100" and prov["torch"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(rec.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(f.stat().st_mode) for f in rec.iterdir()} == {0o666 & ~umask}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") or p.name.endswith(".incomplete")]


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
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(prof.stat().st_mode) == 0o666 & ~umask
    r = CliRunner().invoke(app, ["validate", *runs, "--calibration", str(prof)])
    assert r.exit_code == 0, r.output
    assert "mean absolute error" in r.output and "in-sample" in r.output
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_simulate_ablation_switches_reach_omnis_plan_and_the_record(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "omni", "--gpus", "16", "--tp", "2",
                                 "--recompute", "full", "--no-long-short-sp", "--no-reorder", "--option", "reorder_group=4",
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

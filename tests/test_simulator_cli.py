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


def test_a_plan_that_does_not_fit_is_timed_with_fits_false_beside_it(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "long_video", "-s", "homogeneous", "--gpus", "8",
                                 "--model", "vl-72b", "--global-batch-tokens", "262144", "--out", str(tmp_path),
                                 "--json"])
    assert r.exit_code == 1, r.output  # nothing fits: a failure, not an empty success
    out = json.loads(r.output)
    row = out["results"][0]
    assert row["fits"] is False and row["fit_message"].startswith("does not fit: rank")
    assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0 and row["mfu"] > 0
    assert out["record"] is None and list(tmp_path.iterdir()) == []  # no trace, no record, no temp folder


def test_when_nothing_fits_or_plans_the_table_names_each_systems_reason_and_exits_non_zero(app, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "homogeneous,temporal", "--gpus", "16",
                                 "--tp", "4", "--pp", "4", "--recompute", "none", "--out", str(tmp_path)])
    assert r.exit_code == 1, r.output
    assert "homogeneous: does not fit: rank" in r.output
    assert "temporal: cannot plan: pp:" in r.output
    assert "no system fits or plans this layout" in r.output and "record:" not in r.output
    assert list(tmp_path.iterdir()) == []


def test_a_row_that_does_not_fit_keeps_its_step_time_and_throughput_with_fits_false():
    from types import SimpleNamespace

    res = SimpleNamespace(fits=False, fit_message="does not fit: rank 3 needs 90.0 GiB of 80.0 GiB",
                          peak_memory=90 * 2**30, peak_reported=90 * 2**30, peak_needed=81 * 2**30, memory_capacity=80 * 2**30, classes=4, sim_seconds=0.1,
                          step_time=2.0, tokens=1000, model_flops=1e15, world_size=8, peak_flops=1e15, bubble=0.1,
                          exposed_comm=0.05, imbalance=0.0, planning=0.1, planning_exposed=0.0, flop_formula="f", breakdown=dict, metrics=lambda: {"fits": False, "step_time_s": 2.0},
                          hardware_tflops_per_gpu=150.0, compute_model="datasheet")
    row = sim_cli._summary([res], [res.metrics()])
    assert row["fits"] is False and row["fit_message"] == res.fit_message and row["peak_memory_gib"] == 90 and row["peak_memory_needed_gib"] == 81
    assert row["step_time_s"] == 2.0 and row["tokens_per_s"] == 500 and row["tokens_per_s_per_gpu"] == 62.5
    steps = sim_cli._step_rows({"gpus": 8, "system": "homogeneous", "per_step": [dict(res.metrics(), step=0)]})
    assert steps[0]["fits"] is False and steps[0]["step_time_s"] == 2.0 and "does not fit" not in steps[0]["why"]


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
        (["--gpus", "16", "--stack", "turbo"], "stack must be one of eager, fused, megatron-2021"),
        (["--gpus", "16", "--dp-mode", "zero3"], "dp_mode must be one of ddp, zero1, zero2, fsdp, hsdp"),
        (["--gpus", "16", "--dp-mode", "zero1", "--dp-shard", "8"], "dp-shard=8 needs --dp-mode hsdp"),
        (["--gpus", "16", "--cp", "2", "--cp-kind", "tree"], "cp_kind must be one of ulysses, ring, allgather"),
        (["--gpus", "16", "--micro-batch", "2", "--microbatches", "4"], "micro-batch must be"),
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


def _sim_json(app, tmp_path, *args):
    r = CliRunner().invoke(app, ["simulate", "-w", "pretrain_2048", "-s", "homogeneous", "--model", "llm-7b@4L",
                                 "--gpus", "16", "--tp", "2", "--global-batch-tokens", "131072", "--out",
                                 str(tmp_path), "--json", *args])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    rec = tmp_path / out["record"].split("/")[-1]
    plan = json.loads(next(rec.glob("plan_homogeneous_16_step*.json")).read_text())
    return out["results"][0], json.loads((rec / "config.json").read_text()), plan


def test_simulate_stack_option_costs_the_chosen_kernels(app, tmp_path):
    eager, config, _ = _sim_json(app, tmp_path / "e", "--stack", "eager")
    fused, config_f, _ = _sim_json(app, tmp_path / "f", "--stack", "fused")
    assert (config["stack"], config_f["stack"]) == ("eager", "fused")
    assert fused["step_time_s"] < eager["step_time_s"]  # fused norms and activations move fewer bytes


@pytest.mark.parametrize(("mode", "fsdp", "zero"), [("ddp", False, 0), ("zero1", False, 1), ("zero2", False, 2),
                                                     ("fsdp", True, 0)])
def test_simulate_dp_mode_reaches_the_plans_layouts(app, tmp_path, mode, fsdp, zero):
    row, config, plan = _sim_json(app, tmp_path, "--dp-mode", mode)
    lay = plan["layouts"]["llm"]
    assert (lay["fsdp"], lay["zero"], config["dp_mode"]) == (fsdp, zero, mode)
    assert row["step_time_s"] > 0


def test_an_explicit_fsdp_dp_mode_never_shards_within_nodes_where_the_default_would():
    from omnibench.specs.parallel import ParallelSpec
    from systems.common import llm_layout

    default = ParallelSpec(world_size=1024, tp=8, **sim_cli._dp_fields(None, 0))
    explicit = ParallelSpec(world_size=1024, tp=8, **sim_cli._dp_fields("fsdp", 0))
    hsdp = ParallelSpec(world_size=1024, tp=8, **sim_cli._dp_fields("hsdp", 16))
    assert llm_layout(default, range(1024)).hsdp  # automatic: shard groups within 8 nodes
    assert not llm_layout(explicit, range(1024)).hsdp and llm_layout(explicit, range(1024)).dp_mode == "fsdp"
    assert llm_layout(hsdp, range(1024)).shard_size == 16


def test_simulate_micro_batch_sets_the_microbatches_from_samples_per_data_rank(app, tmp_path):
    _, config, plan = _sim_json(app, tmp_path, "--micro-batch", "2")
    # 131,072 tokens of 2,048-token samples = 64 samples over dp 8: 8 per rank, 4 microbatches of 2
    assert config["micro_batch"] == 2 and plan["options"]["microbatches"] == 4
    assert all(len(mb) == 2 for mbs in plan["assignment"]["llm"].values() for mb in mbs)


def test_simulate_allgather_context_parallelism(app, tmp_path):
    ring, _, _ = _sim_json(app, tmp_path / "r", "--cp", "2", "--cp-kind", "ring")
    gather, config, plan = _sim_json(app, tmp_path / "g", "--cp", "2", "--cp-kind", "allgather")
    assert plan["layouts"]["llm"]["cp_kind"] == "allgather" and config["cp_kind"] == "allgather"
    assert gather["step_time_s"] > 0 and gather["step_time_s"] != ring["step_time_s"]


@pytest.mark.parametrize("hardware", ["h100-500w", "h800", "a100-40g", "v100-32g"])
def test_simulate_hardware_variants(app, tmp_path, hardware):
    row, config, _ = _sim_json(app, tmp_path, "--hardware", hardware)
    assert config["hardware"] == hardware and row["step_time_s"] > 0


def test_simulate_help_lists_the_new_options(app):
    r = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    for opt in ("--stack", "--dp-mode", "--micro-batch", "--cp-kind", "allgather", "h100-500w", "h800", "hzero2"):
        assert opt in r.output, opt


def test_tune_simulates_every_layout_with_the_stack_and_dp_mode_asked_for(monkeypatch):
    from omnibench import tune as tune_mod
    from omnibench.cli import tune as tune_cli

    seen = []
    real = tune_mod._Search._evaluate

    def spy(self, wave):
        seen.append((self.stack, dict(self.dp_fields)))
        return real(self, wave)

    monkeypatch.setattr(tune_mod._Search, "_evaluate", spy)
    app = typer.Typer()
    tune_cli.register(app)
    app.command("noop")(lambda: None)
    r = CliRunner().invoke(app, ["tune", "--system", "homogeneous", "--workload", "pretrain_2048", "--model",
                                 "llm-7b@4L", "--gpus", "8", "--global-batch-tokens", "65536", "--budget", "1",
                                 "--stack", "fused", "--dp-mode", "zero1", "--json"])
    assert r.exit_code == 0, r.output
    assert seen and all(s == ("fused", {"fsdp": False, "zero": 1, "dp_shard": -1}) for s in seen)
    r = CliRunner().invoke(app, ["tune", "--system", "homogeneous", "--workload", "pretrain_2048", "--gpus", "8",
                                 "--stack", "turbo"])
    assert r.exit_code == 2 and "stack must be one of" in r.output
    r = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "200"})
    assert "--stack" in r.output and "--dp-mode" in r.output


def test_a_steps_layout_check_planning_and_simulation_run_in_one_gc_pause(app, tmp_path, monkeypatch):
    """`simulate` (no tune) checks the default layout by planning the step and keeps that plan for the
    step: the cyclic GC stays paused from that planning until the step is simulated, so no collection
    walks the plan in between (`_one_gc_pause`)."""
    import gc

    import omnibench.resolve as resolve
    import simulator.cache as cache

    seen = []
    real_resolve, real_run = resolve.resolve_layout, cache.run_step

    def resolved(*a, **k):
        got = real_resolve(*a, **k)
        seen.append(("layout", gc.isenabled()))
        return got

    def run(*a, **k):
        seen.append(("step", gc.isenabled()))
        return real_run(*a, **k)

    monkeypatch.setattr(resolve, "resolve_layout", resolved)
    monkeypatch.setattr(cache, "run_step", run)
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "omni", "--gpus", "16",
                                 "--global-batch-tokens", "65536", "--workers", "1", "--no-cache",
                                 "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert seen == [("layout", False), ("step", False)], seen
    assert gc.isenabled()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_checked_layouts_engine_is_played_in_process_and_dropped_before_steps_run_in_workers(app, tmp_path,
                                                                                               monkeypatch, workers):
    # recompute auto checks each mode's memory and offers the chosen one's engine (simulator.engine.offer_engine):
    # one step in this process plays it; steps sent to a pool would leave it (and its plan) held here meanwhile
    from omnibench.sweep import Sweep
    from simulator import engine as sim_engine

    seen: list[tuple[bool, int]] = []
    real_map = Sweep.map

    def watched(self, fn, items):
        items = list(items)
        if fn.__name__ == "run_step":
            seen.append((self.in_process(len(items)), len(sim_engine._spare_engine)))
        return real_map(self, fn, items)

    monkeypatch.setattr(Sweep, "map", watched)
    steps = "1" if workers == "1" else "2"
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "homogeneous", "--gpus", "16", "--steps", steps,
                                 "--hardware", "h100", "--model", "omni-7b@4L", "--no-cache", "--workers", workers,
                                 "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert len(seen) == 1
    in_process, spare = seen[0]
    assert in_process is (workers == "1")
    assert spare == (1 if in_process else 0)  # offered for the step it plays, or let go before the pool's steps
    assert not sim_engine._spare_engine  # taken, or dropped


def test_each_row_says_what_its_plan_decided_and_what_planning_cost(app, tmp_path):
    """omni's row carries its plan's decisions (the encoder SP scheme, resharding) and every row the
    planner's CPU seconds per step, which the step time does not include."""
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "omni,temporal", "--gpus", "32", "-m",
                                 "omni-7b@4L", "--json", "--no-cache", "--workers", "1", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rows = {x["system"]: x for x in json.loads(r.output)["results"]}
    assert rows["omni"]["plan"]["encoders"]["vision"]["scheme"] in ("none", "long_short", "all")
    assert "resharded_samples" in rows["omni"]["plan"] and "plan" not in rows["temporal"]
    assert all(x["planning_cpu_s"] > 0 for x in rows.values())

"""What makes `reproduce` cheaper must leave every answer as it was: a tune under a memory error
reuses the steps simulated at the nominal estimate and finds what it finds from nothing; the analytic
estimates a search settles its space with, answered once per candidate and batch, are the ones computed
afresh; and `simulate --tuned` running every system's search at once (`_tune_all`) keeps each answer,
the tune cache's entries and their order, and the record's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnibench.specs.presets import get_model
from omnibench.tune import tune_converged
from simulator.hardware import load_cluster
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)


def _trials(res):
    return [(t.candidate.label(), t.step_s, t.peak_gib, t.fits, t.note, t.guard_step) for t in res.trials]


def _entries(root: Path) -> int:
    return sum(1 for _ in root.rglob("*.pkl.z"))


def test_a_tune_under_a_memory_error_from_a_warm_step_cache_is_the_one_from_a_cold_cache(tmp_path, monkeypatch):
    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    stream = WorkloadStream("bursty_mix", seed=14, global_batch_tokens=131072)
    window = [stream.batch(s) for s in range(6)]
    kw = dict(budget=2, guard_batches=window, memory_error=0.2)
    # the searches and their guard; the window's own descent after it is tested on its own (test_tune_guard.py)
    monkeypatch.setattr("omnibench.tune.guard._window_descent", lambda res, check, tuned: 0)
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    monkeypatch.setenv("OMNIBENCH_CACHE", str(warm))
    tune_converged("omni", model, window[:2], cluster, budget=2, guard_batches=window)  # the nominal tune first
    before = _entries(warm)
    from_warm = tune_converged("omni", model, window[:2], cluster, **kw)
    simulated_warm = _entries(warm) - before
    monkeypatch.setenv("OMNIBENCH_CACHE", str(cold))
    from_cold = tune_converged("omni", model, window[:2], cluster, **kw)
    assert _trials(from_warm) == _trials(from_cold) and from_warm.best.candidate == from_cold.best.candidate
    assert from_warm.guarded == from_cold.guarded and from_warm.convergence == from_cold.convergence
    # the error moved no time: the steps simulated at the nominal estimate answered part of it (46 of
    # 120 steps once all-gathered K/V joined the space; the +20% search goes on to layouts the nominal
    # one never needed)
    assert simulated_warm < _entries(cold), (simulated_warm, _entries(cold))


def _simulate(args):
    from omnibench.cli import simulate as sim_cli

    app = typer.Typer()
    sim_cli.register(app)
    app.command("noop")(lambda: None)
    return CliRunner().invoke(app, ["simulate", *args])


TIMES = {"tune_seconds", "sim_seconds", "planning_cpu_s"}  # measured, not answers


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in TIMES}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def test_every_systems_search_at_once_gives_each_answer_it_gives_alone(tmp_path, monkeypatch):
    from omnibench.cli import simulate as sim_cli

    started = []
    # the searches and their guard at once; the window's own descent after it is tested on its own
    monkeypatch.setattr("omnibench.tune.guard._window_descent", lambda res, check, tuned: 0)
    real = sim_cli._tune_all
    monkeypatch.setattr(sim_cli, "_tune_all", lambda systems, *a: started.append(systems) or real(systems, *a))
    common = ["--workload", "bursty_mix", "--seed", "14", "--system", "homogeneous,omni", "--gpus", "16",
              "--global-batch-tokens", "131072", "--tuned", "--tune-budget", "2", "--check-convergence",
              "--steps", "3", "--step-stride", "3", "--tune-steps", "2", "--json"]
    got = {}
    for workers in (1, 2):
        monkeypatch.setenv("OMNIBENCH_CACHE", str(tmp_path / f"steps{workers}"))  # each from nothing
        cache = tmp_path / f"tuned{workers}.json"
        r = _simulate([*common, "--workers", str(workers), "--tune-cache", str(cache), "--out",
                       str(tmp_path / f"out{workers}")])
        assert r.exit_code == 0, r.output
        record = Path(json.loads(r.output)["record"])
        got[workers] = (_strip(json.loads((record / "results.json").read_text())),
                        [(k, _strip(e)) for k, e in json.loads(cache.read_text()).items()],  # order too
                        (record / "steps.csv").read_text())
    assert started == [["homogeneous", "omni"]]  # only the pool runs them at once
    assert got[2] == got[1]
    rows, entries, _ = got[2]
    assert [e["system"] for _, e in entries] == ["homogeneous", "omni"]
    assert any(r.get("tune_guarded") for r in rows) or all(r["fits"] for r in rows)


def test_the_first_pipeline_stage_read_from_the_strides_is_the_one_coords_gives():
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.tune import _first_stage
    from systems.common import llm_layout

    for tp, pp, cp, world, offset in ((1, 1, 1, 8, 0), (2, 4, 1, 64, 0), (1, 2, 4, 64, 16), (4, 8, 2, 512, 0),
                                      (2, 2, 2, 48, 8)):
        lay = llm_layout(ParallelSpec(world_size=world, tp=tp, pp=pp, cp=cp), range(offset, world))
        assert _first_stage(lay) == [r for r in lay.ranks if lay.coords(r)["pp"] == 0]


def test_the_estimates_are_answered_once_per_candidate_and_batch_and_equal_a_fresh_computation():
    from omnibench import tune as tune_mod

    model, cluster = get_model("omni-7b"), load_cluster("h100", 64)
    samples = WorkloadStream("mixed_video", seed=0, global_batch_tokens=64 * 8192).batch(0).samples
    for c in tune_mod.search_space("omni", model, 64)[:6]:
        for fn, args in ((tune_mod.memory_estimate, ()), (tune_mod.time_estimate, (cluster,))):
            memo = fn(c.system, model, 64, 8, c, samples, *args, options={"hardware": "h100"})
            again = fn(c.system, model, 64, 8, c, samples, *args, options={"hardware": "h100"})
            fresh = fn.__wrapped__(c.system, model, 64, 8, c, list(samples), *args, options={"hardware": "h100"})
            assert memo == again == fresh
        # another batch with the same samples' values is computed again (keyed by identity), to the same value
        assert tune_mod.memory_estimate(c.system, model, 64, 8, c, list(samples)) == \
            tune_mod.memory_estimate.__wrapped__(c.system, model, 64, 8, c, samples)


def test_a_search_that_fails_beside_the_others_is_its_rows_error_and_the_others_are_kept(tmp_path, monkeypatch):
    from omnibench.cli import simulate as sim_cli

    real = sim_cli._search

    def failing(system, *a, **kw):
        if system == "temporal":
            raise ValueError("tune: no layout of temporal fits 16 GPUs")
        return real(system, *a, **kw)

    monkeypatch.setattr(sim_cli, "_search", failing)
    cache = tmp_path / "tuned.json"
    r = _simulate(["--workload", "mixed_video", "--system", "homogeneous,temporal,omni", "--gpus", "16",
                   "--tuned", "--tune-budget", "2", "--workers", "2", "--tune-cache", str(cache), "--out",
                   str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert [x["system"] for x in rows] == ["homogeneous", "temporal", "omni"]
    assert rows[1]["error"] == "tune: no layout of temporal fits 16 GPUs" and "error" not in rows[0] | rows[2]
    assert [e["system"] for e in json.loads(cache.read_text()).values()] == ["homogeneous", "omni"]

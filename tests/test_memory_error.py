"""`--memory-error E` (SimOptions.memory_error): what fits is decided as if every memory estimate were
off by E, in the simulator's verdict, in `tune`'s bound and in `simulate --tuned`'s cache key; the
step's time and reported peak never move, so a step simulated once answers every error."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import typer
from typer.testing import CliRunner

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from omnibench.tune import tune
from simulator import cache
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)


def _setup():
    model, cluster = get_model("omni-7b@4L"), load_cluster("h100", 16)
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=16 * 4096).batch(0)
    return model, cluster, batch, ParallelSpec(world_size=16, tp=2)


def test_a_step_fits_or_not_by_its_peak_times_one_plus_the_error_and_says_so():
    model, cluster, batch, parallel = _setup()
    plan = get_planner("omni").plan(model, parallel, batch)
    base = simulate(plan, model, cluster, options=SimOptions(recompute="full"))
    assert base.fits
    edge = cluster.gpu.memory_bytes / base.peak_needed - 1  # the error at which the need fills the GPU
    under = simulate(plan, model, cluster, options=SimOptions(recompute="full", memory_error=edge - 0.01))
    over = simulate(plan, model, cluster, options=SimOptions(recompute="full", memory_error=edge + 0.01))
    assert under.fits and not over.fits
    assert f"assuming the estimate is {edge + 0.01:.0%} low" in over.fit_message
    # the error decides what fits, nothing else: the same time and the same reported peak
    assert over.step_time == base.step_time and over.peak_memory == base.peak_memory
    high = simulate(plan, model, cluster, options=SimOptions(recompute="full", memory_error=-0.5))
    assert high.fits and high.step_time == base.step_time


def test_a_cached_step_answers_every_memory_error_without_simulating_again(tmp_path):
    model, cluster, batch, parallel = _setup()
    store = cache.SimCache(tmp_path)
    job = cache.StepJob("omni", model, parallel, batch, cluster, options=SimOptions(recompute="full"))
    first = cache.run_step(job, store)
    edge = cluster.gpu.memory_bytes / first.result.peak_needed - 1
    tight = cache.run_step(replace(job, options=SimOptions(recompute="full", memory_error=edge + 0.01)), store)
    assert (store.misses, store.hits) == (1, 1) and tight.cached
    assert not tight.result.fits and not tight.metrics["fits"] and "low" in tight.metrics["fit_message"]
    assert tight.result.step_time == first.result.step_time
    again = cache.run_step(job, store)  # the entry itself was not changed by the re-decided verdict
    assert again.result.fits and again.metrics["fits"]


def test_tune_under_a_memory_error_keeps_only_layouts_that_fit_with_it():
    model = get_model("omni-7b")
    cluster = load_cluster("h100", 16)
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=131072).batch(0)
    capacity = cluster.gpu.memory_bytes / 2**30
    plain = tune("homogeneous", model, [batch], cluster, budget=4, encoder_search=False)
    tight = tune("homogeneous", model, [batch], cluster, budget=4, encoder_search=False, memory_error=0.5)
    assert plain.best is not None and tight.best is not None
    for t in tight.trials:
        assert t.fits == (t.peak_gib * 1.5 <= capacity), t.candidate.label()
    assert tight.best.peak_gib * 1.5 <= capacity
    # the answer at 0 needs more than the device holds under +50%: a tune under the error answers otherwise
    assert plain.best.peak_gib * 1.5 > capacity and tight.best.candidate != plain.best.candidate


def _app(register):
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    return app


@pytest.mark.parametrize("value", ["1", "-0.9", "2.5"])
def test_a_memory_error_outside_the_range_is_refused_in_one_line_naming_it(value, tmp_path):
    from omnibench.cli import simulate as sim_cli
    from omnibench.cli import tune as tune_cli

    for register, cmd in ((sim_cli.register, ["simulate", "--workload", "mixed_video", "--gpus", "16",
                                              "--out", str(tmp_path)]),
                          (tune_cli.register, ["tune", "--system", "temporal", "--workload", "mixed_video",
                                               "--gpus", "16"])):
        r = CliRunner().invoke(_app(register), [*cmd, "--memory-error", value])
        assert r.exit_code == 2, r.output
        assert "memory-error must be between -0.9 and 1" in r.output and len(r.output.strip().splitlines()) <= 2


def test_simulate_tuned_keys_its_tune_cache_by_the_memory_error_and_records_it(tmp_path):
    from omnibench.cli import simulate as sim_cli

    tune_cache = tmp_path / "tuned.json"
    args = ["simulate", "--workload", "mixed_video", "--system", "temporal", "--gpus", "16",
            "--global-batch-tokens", "131072", "--tuned", "--tune-budget", "2", "--tune-cache", str(tune_cache),
            "--out", str(tmp_path / "sims"), "--json"]
    for err in ("0", "0.2"):
        r = CliRunner().invoke(_app(sim_cli.register), [*args, "--memory-error", err])
        assert r.exit_code == 0, r.output
        record = json.loads(r.output)["record"]
        assert json.loads((tmp_path / "sims" / record.split("/")[-1] / "config.json").read_text())[
            "memory_error"] == float(err)
    keys = list(json.loads(tune_cache.read_text()))
    fields = [dict(f.split("=", 1) for f in k.split("|")) for k in keys]
    assert len(keys) == 2 and {f["memory_error"] for f in fields} == {"0.0", "0.2"}
    assert any(p.name.endswith("-memerr+20") for p in (tmp_path / "sims").iterdir())

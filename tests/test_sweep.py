"""Sweeps give the same answer serial, pooled or on Ray, in the commands that run them (`tune`,
`simulate --steps`); the step cache answers a repeated step with the same result and never a stale
one."""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from omnibench.sweep import Sweep, SweepError, map_ordered
from simulator import cache
from simulator.engine import SimOptions
from simulator.hardware import load_cluster
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parent.parent


def _batch(step: int = 0, seed: int = 0):
    return WorkloadStream("mixed_video", seed=seed, global_batch_tokens=16 * 4096).batch(step)


def _jobs(**kw) -> list[cache.StepJob]:
    model = get_model("omni-7b@4L")
    cluster = load_cluster("h100", 16)
    return [cache.StepJob(system, model, ParallelSpec(world_size=16, tp=2), _batch(step), cluster,
                          options=SimOptions(recompute="full"), use_cache=False, **kw)
            for system, step in [("omni", 0), ("omni", 1), ("omni", 2), ("colocated", 0), ("homogeneous", 1)]]


def _summary(outcomes) -> list[tuple]:
    return [(o.step, o.result.step_time, o.result.peak_memory, len(o.result.spans),
             {k: v for k, v in o.metrics.items() if k not in ("sim_seconds", "planning_cpu_s")}) for o in outcomes]


def test_pool_gives_the_serial_results_bit_for_bit():
    jobs = _jobs(keep="full")
    serial = _summary(map_ordered(cache.run_step, jobs, workers=1))
    assert _summary(map_ordered(cache.run_step, jobs, workers=2)) == serial
    assert len({s[1] for s in serial}) > 1  # the jobs really differ
    assert all(s[3] > 0 for s in serial)  # "full" keeps the spans


def test_results_keep_the_items_order_across_maps_of_one_sweep():
    with Sweep(workers=2) as sweep:
        assert sweep.map(functools.partial(pow, 2), [5, 1, 3]) == [32, 2, 8]
        assert sweep.map(abs, [-4, 2]) == [4, 2]
    assert map_ordered(functools.partial(pow, 2), [5, 1, 3], workers=2) == [32, 2, 8]


def test_workers_below_one_is_refused_in_one_line():
    with pytest.raises(SweepError, match="workers must be >= 1"):
        map_ordered(abs, [1], workers=0)


@pytest.mark.slow  # Ray's map path, end to end through tune: test_tune_on_ray_gives_the_serial_answer
def test_ray_gives_the_serial_results():
    pytest.importorskip("ray")
    jobs = _jobs()[:2]
    serial = _summary(map_ordered(cache.run_step, jobs, workers=1))
    on_ray = _summary(map_ordered(cache.run_step, jobs, ray_address="local"))
    assert on_ray == serial, f"ray {on_ray} != serial {serial}"


# ------------------------------------------------------------------------------------ the cache


def _job(**kw) -> cache.StepJob:
    return cache.StepJob("omni", get_model("omni-7b@4L"), ParallelSpec(world_size=16, tp=2), _batch(),
                         load_cluster("h100", 16), options=SimOptions(recompute="full"), **kw)


def test_cache_answers_a_repeat_with_the_same_result(tmp_path):
    store = cache.SimCache(tmp_path)
    first = cache.run_step(_job(), store)
    again = cache.run_step(_job(), store)
    assert (store.misses, store.hits) == (1, 1) and again.cached and not first.cached
    assert again.result.step_time == first.result.step_time and again.metrics == first.metrics
    assert again.result.spans == [] and again.metrics["compute_s_by_module"]  # taken before the spans went


def test_a_step_asked_with_its_trace_is_cached_whole_and_with_its_plan(tmp_path):
    store = cache.SimCache(tmp_path)
    fresh = cache.run_step(_job(keep="full", want_plan=True), store)
    hit = cache.run_step(_job(keep="full", want_plan=True), store)
    assert hit.cached and len(hit.result.spans) == len(fresh.result.spans) > 0
    assert hit.plan.to_json() == fresh.plan.to_json()
    assert cache.run_step(_job(), store).cached  # the summary was stored beside it


def test_cache_key_changes_with_every_input():
    base = _job()
    k = cache.key(base)
    assert cache.key(replace(base, system="colocated")) != k
    assert cache.key(replace(base, batch=_batch(seed=1))) != k
    assert cache.key(replace(base, batch=_batch(step=1))) != k
    assert cache.key(replace(base, model=get_model("omni-7b@2L"))) != k
    assert cache.key(replace(base, parallel=ParallelSpec(world_size=16, tp=4))) != k
    assert cache.key(replace(base, parallel=ParallelSpec(world_size=16, tp=2, options={"reorder": False}))) != k
    assert cache.key(replace(base, cluster=load_cluster("a100-80g", 16))) != k
    assert cache.key(replace(base, options=SimOptions(recompute="selective"))) != k
    assert cache.key(replace(base, keep="full", use_cache=False)) == k  # how it is kept is not what it is
    assert cache.key(_job()) == k
    assert cache.key(replace(base, batch=cache.pack(base.batch))) == k  # shipped packed, keyed the same


def test_a_packed_batch_travels_once_pickled_and_plans_the_same(tmp_path):
    import pickle

    packed = cache.pack(_batch())
    assert cache.pack(packed) is packed and cache.pack(packed.get()) is packed
    again = pickle.loads(pickle.dumps(packed))
    assert repr(again.get()) == repr(_batch()) and again.digest == packed.digest
    a = cache.run_step(_job(use_cache=False))
    b = cache.run_step(replace(_job(use_cache=False), batch=again))
    assert a.metrics == {**b.metrics, "sim_seconds": a.metrics["sim_seconds"], "planning_cpu_s": a.metrics["planning_cpu_s"]}


def test_a_worker_unpickles_a_batch_once_for_all_the_jobs_that_ship_it():
    import pickle

    blob = pickle.dumps(cache.pack(_batch()))
    first, second = pickle.loads(blob), pickle.loads(blob)  # two jobs' copies arriving in one worker
    assert first.get() is second.get()
    other = pickle.loads(pickle.dumps(cache.pack(_batch(seed=1))))
    assert other.get() is not first.get() and repr(other.get()) == repr(_batch(seed=1))


def test_the_code_hash_covers_every_module_that_plans_and_simulates_a_step():
    # In a fresh process: plan and simulate one step of every system, then list the modules of this
    # repository that were imported; each must be hashed, or an edit to it would serve stale steps.
    script = (
        "import sys, json\n"
        "from omnibench.specs.presets import get_model\n"
        "from omnibench.specs.parallel import ParallelSpec\n"
        "from simulator.hardware import load_cluster\n"
        "from simulator.engine import SimOptions, simulate\n"
        "from systems import available_systems, get_planner\n"
        "from workloads.stream import WorkloadStream\n"
        "m = get_model('omni-7b@4L'); cl = load_cluster('h100', 16)\n"
        "b = WorkloadStream('mixed_video', seed=0, global_batch_tokens=16 * 16384).batch(0)\n"
        "for s in available_systems():\n"
        "    opts = {'hardware': 'h100'} if s == 'omni' else {}\n"
        "    lay = dict(cp=2) if s in ('temporal', 'spatial') else dict(tp=2, pp=2, microbatches=4)  # no pipeline\n"
        "    p = get_planner(s).plan(m, ParallelSpec(world_size=16, options=opts, **lay), b)\n"
        "    simulate(p, m, cl, options=SimOptions(recompute='full'))\n"
        "print(json.dumps(sorted({mod.__file__ for mod in list(sys.modules.values())\n"
        "                         if getattr(mod, '__file__', None)})))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = {Path(f).resolve() for f in json.loads(out.stdout)}
    ours = {f for f in loaded if REPO in f.parents and "site-packages" not in f.parts}
    hashed = {f.resolve() for f in cache.code_files()}
    assert ours, "the script imported nothing of this repository"
    assert sorted(str(f.relative_to(REPO)) for f in ours - hashed) == []
    for new in ("work.py", "groups.py", "program.py", "memory.py", "result.py", "options.py"):
        assert (REPO / "simulator" / new).resolve() in hashed


def test_a_damaged_entry_reads_as_a_miss_and_is_rewritten(tmp_path):
    store = cache.SimCache(tmp_path)
    path = store._path(cache.key(_job()))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a pickle")
    got = cache.run_step(_job(), store)
    assert store.misses == 1 and not got.cached
    assert cache.run_step(_job(), store).result.step_time == got.result.step_time


def test_no_cache_environment_bypasses_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBENCH_NO_CACHE", "1")
    monkeypatch.setenv("OMNIBENCH_CACHE", str(tmp_path))
    cache.run_step(_job())
    assert not any(tmp_path.rglob("*.z"))
    monkeypatch.delenv("OMNIBENCH_NO_CACHE")
    cache.run_step(_job(use_cache=False))  # --no-cache
    assert not any(tmp_path.rglob("*.z"))
    cache.run_step(_job())
    assert any(tmp_path.rglob("*.z"))


def test_a_planner_refusal_is_an_outcome_with_its_one_line_reason(tmp_path):
    bad = replace(_job(), system="temporal", parallel=ParallelSpec(world_size=16, tp=2, pp=2, microbatches=4))
    got = cache.run_step(bad, cache.SimCache(tmp_path))
    assert got.error and got.result is None and "\n" not in got.error


# ------------------------------------------------------------------- the commands that sweep


def _cli(register, args, monkeypatch, tmp_path):
    monkeypatch.setenv("OMNIBENCH_CACHE", str(tmp_path / "cache"))
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _no_timing(obj):
    if isinstance(obj, dict):
        return {k: _no_timing(v) for k, v in obj.items() if k not in ("seconds", "sim_seconds", "planning_cpu_s",
                                                                        "record")}
    if isinstance(obj, list):
        return [_no_timing(v) for v in obj]
    return obj


def test_tune_gives_the_same_answer_serial_pooled_and_from_the_cache(tmp_path, monkeypatch):
    from omnibench.cli import tune as tune_cli

    args = ["tune", "--system", "omni", "--workload", "mixed_video", "--gpus", "16", "--model", "omni-7b@4L",
            "--global-batch-tokens", "65536", "--budget", "10", "--check-convergence", "--json"]
    serial = _cli(tune_cli.register, [*args, "--workers", "1", "--no-cache"], monkeypatch, tmp_path)
    pooled = _cli(tune_cli.register, [*args, "--workers", "2"], monkeypatch, tmp_path)
    cached = _cli(tune_cli.register, [*args, "--workers", "2"], monkeypatch, tmp_path)
    assert _no_timing(pooled) == _no_timing(serial) == _no_timing(cached)
    conv = serial["convergence"]  # budget 10, doubled while the best still moved (tune.MAX_DOUBLINGS)
    assert serial["simulated"] > 2 * len(set(serial["notes"])) and conv["budget_2x"] == 2 * conv["budget"] >= 20


def test_tune_on_ray_gives_the_serial_answer(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from omnibench.cli import tune as tune_cli

    args = ["tune", "--system", "temporal", "--workload", "mixed_video", "--gpus", "16", "--model", "omni-7b@4L",
            "--global-batch-tokens", "65536", "--budget", "4", "--no-cache", "--json"]
    serial = _cli(tune_cli.register, [*args, "--workers", "1"], monkeypatch, tmp_path)
    on_ray = _cli(tune_cli.register, [*args, "--ray", "local", "--workers", "2"], monkeypatch, tmp_path)
    assert _no_timing(on_ray) == _no_timing(serial)


def test_simulate_over_steps_gives_the_same_record_serial_pooled_and_from_the_cache(tmp_path, monkeypatch):
    from omnibench.cli import simulate as sim_cli

    def record(name, *extra):
        args = ["simulate", "--workload", "bursty_mix", "--seed", "14", "--system", "homogeneous,omni", "--gpus",
                "16", "--model", "omni-7b@4L", "--global-batch-tokens", "65536", "--tp", "2", "--recompute", "full",
                "--steps", "3", "--out", str(tmp_path / name), "--json", *extra]
        out = _cli(sim_cli.register, args, monkeypatch, tmp_path)
        folder = Path(out["record"])
        rows = json.loads((folder / "results.json").read_text())
        traces = sorted((p.name, p.read_text()) for p in folder.glob("trace_*.json"))
        return _no_timing(rows), (folder / "steps.csv").read_text(), traces

    serial = record("a", "--workers", "1", "--no-cache")
    assert record("b", "--workers", "2") == serial
    assert record("c", "--workers", "1") == serial  # every step from the cache
    rows = serial[0]
    assert [m["step"] for m in rows[0]["per_step"]] == [0, 1, 2] and len(serial[2]) == 2


def test_a_step_leaves_nothing_for_the_cyclic_gc():
    # A tune plans and simulates hundreds of steps in one process: a step must be freed as it ends
    # (by reference counts), not left in reference cycles, nor held into the next step, for the cyclic
    # GC to scan (the engine's self-calling collective closure once kept every span and rank table of a
    # step in a cycle; the memory model's communicator count kept the last Plan alive)
    import weakref

    from simulator.engine import simulate
    from systems import get_planner

    job = _job(use_cache=False)
    cache.run_step(job)  # imports and one-off tables first
    gc.collect()
    gc.disable()
    try:
        outcome = cache.run_step(job)
        plan = get_planner(job.system).plan(job.model, job.parallel, job.batch)
        result = simulate(plan, job.model, job.cluster, options=job.options)
        held = weakref.ref(plan)
        del plan, result
        assert held() is None, "the simulated Plan outlived its step"
        assert gc.collect() == 0, "a planned and simulated step left objects in reference cycles"
    finally:
        gc.enable()
    assert outcome.result.step_time > 0

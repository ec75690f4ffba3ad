"""Sweeps give the same answer serial, pooled or on Ray; the step cache answers a repeated
simulation with the same result and never a stale one."""

from __future__ import annotations

import functools
import pickle

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from omnibench.sweep import SweepError, map_ordered
from simulator import cache
from simulator.engine import SimOptions
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.stream import WorkloadStream


def _jobs() -> list[cache.SimJob]:
    model = get_model("omni-7b@4L")
    cluster = load_cluster("h100", 16)
    out = []
    for system, step in [("omni", 0), ("omni", 1), ("omni", 2), ("colocated", 0), ("homogeneous", 1)]:
        batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=16 * 4096).batch(step)
        plan = get_planner(system).plan(model, ParallelSpec(world_size=16, tp=2), batch)
        out.append(cache.SimJob(plan, model, cluster, options=SimOptions(recompute="full"), use_cache=False))
    return out


def _summary(results) -> list[tuple[float, float, int]]:
    return [(r.step_time, r.peak_memory, len(r.spans)) for r in results]


def test_pool_gives_the_serial_results_bit_for_bit():
    jobs = _jobs()
    serial = _summary(map_ordered(cache.run_job, jobs, workers=1))
    assert _summary(map_ordered(cache.run_job, jobs, workers=2)) == serial
    assert len({s[0] for s in serial}) > 1  # the jobs really differ


def test_results_keep_the_items_order():
    assert map_ordered(functools.partial(pow, 2), [5, 1, 3], workers=2) == [32, 2, 8]


def test_workers_below_one_is_refused_in_one_line():
    with pytest.raises(SweepError, match="workers must be >= 1"):
        map_ordered(abs, [1], workers=0)


def test_ray_gives_the_serial_results():
    pytest.importorskip("ray")
    jobs = _jobs()[:2]
    serial = _summary(map_ordered(cache.run_job, jobs, workers=1))
    on_ray = _summary(map_ordered(cache.run_job, jobs, ray_address="local"))
    assert on_ray == serial, f"ray {on_ray} != serial {serial}"


def _plan_and_specs(seed: int = 0):
    model = get_model("omni-7b@4L")
    batch = WorkloadStream("mixed_video", seed=seed, global_batch_tokens=16 * 4096).batch(0)
    plan = get_planner("omni").plan(model, ParallelSpec(world_size=16, tp=2), batch)
    return plan, model, load_cluster("h100", 16)


def test_cache_answers_a_repeat_with_the_same_result(tmp_path):
    plan, model, cluster = _plan_and_specs()
    store = cache.SimCache(tmp_path)
    opts = SimOptions(recompute="full")
    first = cache.simulate_cached(plan, model, cluster, options=opts, cache=store)
    again = cache.simulate_cached(plan, model, cluster, options=opts, cache=store)
    assert (store.misses, store.hits) == (1, 1)
    assert again.step_time == first.step_time and again.peak_memory == first.peak_memory


def test_cache_key_changes_with_every_input(tmp_path):
    plan, model, cluster = _plan_and_specs()
    opts = SimOptions(recompute="full")
    base = cache.key(plan, model, cluster, None, opts)
    other_plan = _plan_and_specs(seed=1)[0]
    assert cache.key(other_plan, model, cluster, None, opts) != base
    assert cache.key(plan, get_model("omni-7b@2L"), cluster, None, opts) != base
    assert cache.key(plan, model, load_cluster("a100-80g", 16), None, opts) != base
    assert cache.key(plan, model, cluster, None, SimOptions(recompute="selective")) != base
    assert cache.key(plan, model, cluster, None, opts) == base


def test_a_damaged_entry_reads_as_a_miss_and_is_rewritten(tmp_path):
    plan, model, cluster = _plan_and_specs()
    store = cache.SimCache(tmp_path)
    opts = SimOptions(recompute="full")
    k = cache.key(plan, model, cluster, None, opts)
    path = store._path(k)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a pickle")
    got = cache.simulate_cached(plan, model, cluster, options=opts, cache=store)
    assert store.misses == 1
    assert pickle.loads(path.read_bytes()).step_time == got.step_time


def test_no_cache_environment_bypasses_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBENCH_NO_CACHE", "1")
    monkeypatch.setenv("OMNIBENCH_CACHE", str(tmp_path))
    plan, model, cluster = _plan_and_specs()
    cache.simulate_cached(plan, model, cluster, options=SimOptions(recompute="full"))
    assert not any(tmp_path.rglob("*.pkl"))

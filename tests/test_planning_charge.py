"""A step's planning is charged where it does not fit under the step it overlaps (simulator/planning.py)."""

from __future__ import annotations

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator import planning
from simulator.engine import simulate
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(120)


def _step(system: str = "homogeneous", gpus: int = 16):
    model = get_model("omni-7b")
    batch = WorkloadStream("mixed_video", seed=3, global_batch_tokens=4096 * gpus).batch(0)
    plan = get_planner(system).plan(model, ParallelSpec(world_size=gpus, tp=4, recompute="full"), batch)
    return plan, simulate(plan, model, load_cluster("h100", gpus))


def test_planning_that_fits_under_the_step_costs_nothing_and_is_reported():
    plan, res = _step()
    assert res.planning == pytest.approx(planning.planning_seconds("homogeneous", res.samples, 16))
    assert 0 < res.planning < res.step_time and res.planning_exposed == 0
    m = res.metrics()
    assert m["planning_s"] == res.planning and m["planning_exposed_s"] == 0 and m["breakdown_s"]["planning"] == 0


def test_planning_longer_than_the_step_adds_what_sticks_out_and_is_its_own_part_of_the_breakdown(monkeypatch):
    _, free = _step()
    # a planner 100,000 times dearer per sample: its planning outlasts the step it overlaps
    a, b = planning.PLANNER_CPU["homogeneous"]
    monkeypatch.setitem(planning.PLANNER_CPU, "homogeneous", (a * 1e5, b))
    _, dear = _step()
    assert dear.planning > free.step_time
    assert dear.planning_exposed == pytest.approx(dear.planning - free.step_time)
    assert dear.step_time == pytest.approx(dear.planning)  # the step waits for its plan, then runs as before
    parts = dear.breakdown()
    assert parts["planning"] == pytest.approx(dear.planning_exposed)
    total = sum(v for k, v in parts.items() if k not in ("idle_max", "idle_min"))
    assert total == pytest.approx(dear.step_time, rel=1e-9)


def test_every_system_is_charged_by_its_own_planners_measurement():
    for system in ("homogeneous", "temporal", "colocated", "noncolocated", "omni"):
        assert system in planning.PLANNER_CPU
    # omni's planner (reorder, long-short split, resharding) is the dearest per sample
    assert max(planning.PLANNER_CPU, key=lambda s: planning.PLANNER_CPU[s][0]) == "omni"
    # a system with no measurement is charged the dearest measured planner's
    assert planning.planning_seconds("unmeasured", 1000, 64) == planning.planning_seconds("omni", 1000, 64)

"""A step is planned once: the plan `with_default_layout` makes to check a layout is handed to the
next `plan` call with the same inputs (systems.offer_plan), and that plan is the one planning again
would make. At 131,072 GPUs each plan is tens of seconds; `simulate` plans the step it checked."""

from __future__ import annotations

from dataclasses import replace

import pytest

import systems
from omnibench.resolve import resolve_layout
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.hardware import load_cluster
from systems import get_planner
from systems.defaults import with_default_layout
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(240)


def _batch(gpus: int, step: int = 0):
    return WorkloadStream("mixed_video", seed=0, global_batch_tokens=4096 * gpus).batch(step)


@pytest.mark.parametrize("system", ["omni", "homogeneous"])
def test_the_layout_check_plan_is_the_next_plan_of_the_same_inputs_and_equals_a_fresh_one(system):
    model, batch = get_model("omni-7b@4L"), _batch(32)
    parallel, _ = with_default_layout(system, model, ParallelSpec(world_size=32), batch)
    taken = get_planner(system).plan(model, parallel, batch)
    again = get_planner(system).plan(model, parallel, batch)  # the spare went to the first call
    assert again is not taken
    assert taken.to_json() == again.to_json()


def test_a_plan_of_other_inputs_plans_and_drops_the_spare():
    model, batch = get_model("omni-7b@4L"), _batch(32)
    parallel, _ = with_default_layout("omni", model, ParallelSpec(world_size=32), batch)
    other = get_planner("omni").plan(model, replace(parallel, recompute="full"), batch)
    assert not systems._spare  # no plan held past the next call
    assert other.to_json() == get_planner("omni").plan(model, replace(parallel, recompute="full"), batch).to_json()
    assert get_planner("omni").plan(model, parallel, _batch(32, step=1)).step == 1


def test_resolve_layout_checks_the_layout_with_the_recompute_mode_the_step_plans_with():
    model, batch = get_model("omni-7b@4L"), _batch(32)
    cluster = load_cluster("h100", 32)
    res = resolve_layout("omni", model, ParallelSpec(world_size=32), [batch], cluster, recompute="full")
    assert res.parallel.recompute == "full"
    spare = systems._spare[0][-1]
    assert get_planner("omni").plan(model, res.parallel, batch) is spare


def test_auto_hands_the_chosen_modes_plan_of_the_first_batch_over():
    model = get_model("omni-7b@4L")
    cluster = load_cluster("h100", 32)
    batches = [_batch(32, s) for s in range(2)]
    res = resolve_layout("omni", model, ParallelSpec(world_size=32), batches, cluster, recompute="auto")
    spare = systems._spare[0][-1]
    taken = get_planner("omni").plan(model, res.parallel, batches[0])
    assert taken is spare
    assert taken.to_json() == get_planner("omni").plan(model, res.parallel, batches[0]).to_json()

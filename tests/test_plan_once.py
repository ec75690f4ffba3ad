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


def _priced(system: str, gpus: int, balancer: str = "analytic") -> ParallelSpec:
    """A layout's spec with the planner options `simulate --hardware h100 --option balancer=...` gives
    (under the simulator balancer omni prices its encoder work with the run's recompute mode there)."""
    from omnibench.cli.simulate import planner_options

    return ParallelSpec(world_size=gpus, options=planner_options(system, {"balancer": balancer}, "h100"))


@pytest.mark.parametrize("system", ["homogeneous", "temporal", "colocated", "noncolocated"])
def test_a_planner_that_says_it_does_not_read_recompute_plans_the_same_step_in_every_mode(system):
    model, batch = get_model("omni-7b"), WorkloadStream("omni_av", seed=0, global_batch_tokens=8192 * 32).batch(0)
    planner = get_planner(system)
    assert planner.reads_recompute is False
    parallel, _ = with_default_layout(system, model, _priced(system, 32), batch)
    systems.drop_spare_plan()
    plans = {m: get_planner(system).plan(model, replace(parallel, recompute=m), batch).to_json()
             for m in ("none", "vision=full", "llm=full", "full")}
    assert len(set(plans.values())) == 1


@pytest.mark.parametrize("system", ["homogeneous", "colocated", "noncolocated"])
def test_a_pipelined_baseline_plans_the_same_step_in_every_mode(system):
    # its stages' 1F1B order and where the encoders sit are the planner's; recomputation is the simulator's
    model, batch = get_model("omni-7b"), WorkloadStream("omni_av", seed=0, global_batch_tokens=8192 * 32).batch(0)
    parallel = replace(_priced(system, 32), tp=2, pp=2, microbatches=4)
    systems.drop_spare_plan()
    plans = {m: get_planner(system).plan(model, replace(parallel, recompute=m), batch) for m in ("none", "full")}
    assert {p.layouts["llm"].pp for p in plans.values()} == {2}
    assert plans["none"].to_json() == plans["full"].to_json()


def test_omni_reads_recompute():
    model, batch = get_model("omni-7b"), WorkloadStream("mixed_video", seed=0, global_batch_tokens=8192 * 32).batch(0)
    assert getattr(get_planner("omni"), "reads_recompute", True)
    parallel, _ = with_default_layout("omni", model, _priced("omni", 32, "simulator"), batch)
    none, full = (get_planner("omni").plan(model, replace(parallel, recompute=m), batch).to_json()
                  for m in ("none", "full"))
    assert none != full  # its prices hold the recomputed forward: a spare of another mode would be wrong


def test_auto_plans_a_baselines_step_once_for_every_mode_it_checks(monkeypatch):
    model, batch = get_model("omni-7b"), WorkloadStream("mixed_video", seed=0, global_batch_tokens=8192 * 64).batch(0)
    cluster = load_cluster("h100", 64)
    took: list[bool] = []
    take = systems._take_spare

    def counted(planner, model, parallel, batch):
        got = take(planner, model, parallel, batch)
        took.append(got is not None)
        return got

    monkeypatch.setattr(systems, "_take_spare", counted)
    res = resolve_layout("homogeneous", model, _priced("homogeneous", 64), [batch], cluster, recompute="auto")
    assert res.recompute != "none" and len(took) >= 3  # the layout check, then a plan per mode checked
    assert took[0] is False and all(took[1:])  # planned once: every mode's check took the layout check's plan
    assert get_planner("homogeneous").plan(model, res.parallel, batch) is not None and took[-1]

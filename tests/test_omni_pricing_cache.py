"""omni prices a whole encoder microbatch with the simulator's compute model (long_short.py
`microbatch_seconds`) through one model per hardware that lives as long as the process: what it keeps is
bounded, and trimming it changes no plan."""

from __future__ import annotations

import pytest

import systems.omni.long_short as long_short
from omnibench.cli.simulate import planner_options
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(120)

MODEL = get_model("omni-7b")


def _plans(gpus: int = 64) -> list[str]:
    # the simulator balancer on named hardware: placements checked at the simulator's prices
    opts = planner_options("omni", {"balancer": "simulator"}, "h100")
    b = WorkloadStream("mixed_video", seed=0, global_batch_tokens=4096 * gpus).batch(0)
    return [get_planner("omni").plan(MODEL, ParallelSpec(world_size=gpus, gpus_per_node=8, tp=tp, pp=pp,
                                                         options=opts), b).to_json()
            for pp, tp in [(1, 2), (2, 2), (2, 4)]]


def test_the_planners_kernel_times_are_bounded_and_trimming_them_changes_no_plan(monkeypatch):
    comp = long_short._compute("h100")
    comp.trim_kernel_times(0)
    free = _plans()
    grown = len(comp._kernel_cache)
    assert grown > 40  # untrimmed, every distinct microbatch priced leaves its kernel times behind
    comp.trim_kernel_times(0)
    monkeypatch.setattr(long_short, "KERNEL_TIMES_KEPT", 20)
    trimmed = _plans()
    # at most the bound, the profile and one microbatch's forward and backward past it
    assert len(comp._kernel_cache) <= 20 + 1 + 2
    assert trimmed == free


def test_trimming_keeps_the_kernel_profile():
    comp = long_short._compute("h100")
    _plans(16)
    profile = comp._kernel_cache.get("profile")
    assert profile is not None
    comp.trim_kernel_times(0)
    assert comp._kernel_cache == {"profile": profile}
    comp.trim_kernel_times(10)  # under the bound: nothing forgotten
    assert comp._kernel_cache == {"profile": profile}

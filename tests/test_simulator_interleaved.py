"""Interleaved 1F1B (virtual pipeline stages): the schedule the planners write and the bubble the
simulator gives it."""

from __future__ import annotations

from collections import Counter

import pytest

from omnibench.plan import BACKWARD, FORWARD, PlanError
from omnibench.specs.model import LLMSpec, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from systems.common import interleaved_1f1b
from workloads.sample import Batch, Sample, Segment

# Uniform stages: 8 layers, a vocabulary so small that the embedding and the head are noise.
FLAT = MultimodalSpec("flat", LLMSpec("flat", layers=8, hidden=4096, heads=32, kv_heads=8, ffn=16384, vocab=8))


def text_batch(n: int, tokens: int = 8192) -> Batch:
    return Batch(0, [Sample(i, "text", (Segment("text", tokens),)) for i in range(n)])


def plan(p: int, v: int, m: int, system: str = "homogeneous"):
    par = ParallelSpec(world_size=p, pp=p, virtual_stages=v, microbatches=m, fsdp=False)
    par.validate(FLAT)
    return get_planner(system).plan(FLAT, par, text_batch(m))


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 4, 8), (4, 2, 16)])
def test_interleaved_bubble_matches_the_formula(p, v, m):
    # Narayanan et al. SC'21: the bubble shrinks by v, (p - 1) / (v m + p - 1) of the step.
    cluster = load_cluster("h100", p).with_kernels("")
    res = simulate(plan(p, v, m), FLAT, cluster, options=SimOptions(communication=False))
    plain = simulate(plan(p, 1, m), FLAT, cluster, options=SimOptions(communication=False))
    assert res.bubble == pytest.approx((p - 1) / (v * m + p - 1), rel=0.03)
    assert res.bubble < plain.bubble


def test_every_chunk_runs_every_microbatch_forward_before_backward():
    for stage in range(4):
        order = interleaved_1f1b(stage, 4, 2, 8)
        assert Counter((k, c) for k, _, c in order) == {("F", 0): 8, ("F", 1): 8, ("B", 0): 8, ("B", 1): 8}
        pos = {(k, j, c): i for i, (k, j, c) in enumerate(order)}
        assert all(pos[("F", j, c)] < pos[("B", j, c)] for j in range(8) for c in range(2))


def test_a_rank_holds_its_chunks_as_virtual_stages():
    pl = plan(2, 2, 4)
    stages = {r: sorted({a.stage for a in acts if a.kind in (FORWARD, BACKWARD)}) for r, acts in pl.actions.items()}
    assert stages == {0: [0, 2], 1: [1, 3]}
    assert pl.layouts["llm"].stages == 4


def test_interleaving_needs_a_multiple_of_pp_microbatches():
    # 6 samples leave 6 microbatches of the default 8 (2 x pp)
    with pytest.raises(PlanError, match="multiple of pp=4; got 6"):
        get_planner("homogeneous").plan(
            FLAT, ParallelSpec(world_size=4, pp=4, virtual_stages=2, fsdp=False), text_batch(6))


@pytest.mark.parametrize("system", ["noncolocated", "omni"])
def test_systems_that_schedule_their_own_stages_refuse_interleaving_in_one_line(system):
    model = get_model("tiny-vl")
    par = ParallelSpec(world_size=4, pp=2, virtual_stages=2, encoder_ranks=2 if system == "noncolocated" else 0)
    batch = Batch(0, [Sample(i, "image", (Segment("text", 64), Segment("image", 16, 64, grid_thw=(1, 8, 8))))
                      for i in range(8)])
    with pytest.raises(PlanError, match="virtual_stages=2: interleaved 1F1B is planned by homogeneous and colocated"):
        get_planner(system).plan(model, par, batch)

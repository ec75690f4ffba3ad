"""Context parallelism in the simulator: Ulysses (what the runtime runs) and ring attention
(simulated only) for long sequences."""

from __future__ import annotations

import pytest

from omnibench.specs.model import SpecError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import SimOptions, simulate
from simulator.flops import llm_work
from simulator.hardware import load_cluster
from simulator.kernels import llm_attention, load_kernel_profile
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

MODEL = get_model("qwen2-7b@4L")


def step(tokens: int, cp: int, kind: str, tp: int = 4) -> float:
    par = ParallelSpec(world_size=tp * cp, tp=tp, cp=cp, cp_kind=kind, microbatches=1)
    plan = get_planner("homogeneous").plan(MODEL, par, Batch(0, [Sample(0, "text", (Segment("text", tokens),))]))
    return simulate(plan, MODEL, load_cluster("h100", tp * cp), options=SimOptions(check_memory=False)).step_time


def test_ulysses_gives_each_rank_a_cp_th_of_the_attention():
    prof = load_kernel_profile("h100-measured")
    whole = llm_attention(prof, llm_work(MODEL.llm, [65536], range(4), False, False, tp=4).shape, "fwd")
    split = llm_attention(prof, llm_work(MODEL.llm, [65536], range(4), False, False, tp=4, cp=4).shape, "fwd")
    assert split == pytest.approx(whole / 4, rel=0.01)


def test_ring_and_ulysses_cost_alike_and_ring_scales_past_the_heads():
    # Ulysses splits the 4 kv heads over cp: at tp 1 up to cp 4; ring attention keeps every head
    ulysses, ring = step(131072, 4, "ulysses", tp=1), step(131072, 4, "ring", tp=1)
    assert ring == pytest.approx(ulysses, rel=0.10)
    with pytest.raises(SpecError, match="cp=4 with cp_kind=ulysses must divide"):
        step(131072, 4, "ulysses")
    assert step(131072, 8, "ring") < 0.65 * step(131072, 4, "ring")


def test_the_runtime_refuses_ring_attention_in_one_line():
    with pytest.raises(SpecError, match="cp_kind=ring: the runtime runs Ulysses and all-gather-KV context parallelism"):
        ParallelSpec(world_size=8, tp=4, cp=2, cp_kind="ring").check_runtime()
    ParallelSpec(world_size=8, tp=4, cp=2, cp_kind="allgather").check_runtime()
    with pytest.raises(SpecError, match="cp_kind must be one of ulysses, ring"):
        ParallelSpec(world_size=8, cp=2, cp_kind="zigzag").validate(MODEL)

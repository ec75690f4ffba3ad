"""MoE parallel folding (Layout.expert_tp 1, Megatron-Core's expert tensor parallelism 1): experts whole
on their rank, the expert-parallel group drawn from the stage's dp*cp*tp ranks."""

from __future__ import annotations

import pytest

from omnibench.plan import PlanError
from omnibench.specs.model import LLMSpec, MoESpec, MultimodalSpec, SpecError
from omnibench.specs.parallel import ParallelSpec
from simulator.engine import Engine
from simulator.hardware import load_cluster
from systems import get_planner
from systems.common import llm_layout
from workloads.sample import Batch, Sample, Segment

MOE = MultimodalSpec("moe", LLMSpec("moe", layers=4, hidden=2048, heads=16, kv_heads=4, ffn=6144, vocab=32000,
                                    head_dim=128, qkv_bias=False, moe=MoESpec(experts=16, top_k=4, expert_ffn=768)))
BATCH = Batch(0, [Sample(i, "text", (Segment("text", 4096),)) for i in range(8)])


def engine(expert_tp: int, ep: int) -> Engine:
    parallel = ParallelSpec(world_size=8, tp=2, ep=ep, microbatches=2, fsdp=False, zero=1, expert_tp=expert_tp)
    plan = get_planner("homogeneous").plan(MOE, parallel, BATCH)
    return Engine(plan, MOE, load_cluster("h100", 8))


def test_folded_experts_may_spread_over_the_tensor_ranks_and_unfolded_ones_may_not():
    with pytest.raises(PlanError, match="ep=8 must divide dp\\*cp = 4"):
        llm_layout(ParallelSpec(world_size=8, tp=2, ep=8), range(8))
    lay = llm_layout(ParallelSpec(world_size=8, tp=2, ep=8, expert_tp=1), range(8))
    assert lay.expert_tp == 1 and lay.ep == 8
    with pytest.raises(SpecError, match="simulated only"):
        ParallelSpec(world_size=8, tp=2, ep=8, expert_tp=1).check_runtime()


def test_folded_experts_are_whole_and_route_the_ranks_sequence_parallel_share():
    folded, split = engine(1, 4), engine(0, 4)
    wf, ws = folded.stage_work("llm", 0), split.stage_work("llm", 0)
    sig = folded._signature("llm", 0, 0)
    shape_f, shape_s = folded.work("llm", 0, sig).shape, split.work("llm", 0, sig).shape
    assert shape_f.moe_ffn == 768 and shape_s.moe_ffn == 384  # whole experts vs experts cut over tp 2
    assert shape_f.moe_token_split == 2 and shape_s.moe_token_split == 1
    assert wf.params == ws.params
    # one tensor-parallel all-reduce's worth per layer (attention) instead of two
    assert folded.work("llm", 0, sig).tp_bytes == pytest.approx(split.work("llm", 0, sig).tp_bytes / 2)


def test_the_folded_expert_group_spans_tensor_ranks():
    eng = engine(1, 8)
    scope = eng._expert_scope("llm", 0)
    assert len(scope) == 8 and set(scope) == set(range(8))  # dp 4 x tp 2
    assert len(eng._expert_scope("llm", 0, eng._grad_group("llm", 0))) == 8
    res = eng.run()
    assert res.step_time > 0

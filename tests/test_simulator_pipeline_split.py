"""Pipelines that count the embedding and the loss as a layer each (Megatron's
account_for_embedding/loss_in_pipeline_split): simulated, validated, refused by the runtime."""

from __future__ import annotations

import pytest

from omnibench.plan import FORWARD
from omnibench.specs.model import LLMSpec, MultimodalSpec, SpecError
from omnibench.specs.parallel import ParallelSpec
from simulator.engine import simulate
from simulator.flops import stage_layers
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

MODEL = MultimodalSpec("m", LLMSpec("m", layers=14, hidden=2048, heads=16, kv_heads=8, ffn=8192, vocab=32000))


def test_the_embedding_and_the_loss_take_a_layers_place_in_the_first_and_last_stages():
    plain = [len(stage_layers(14, 4, s)) for s in range(4)]
    split = [len(stage_layers(14, 4, s, embedding_loss=True)) for s in range(4)]
    assert plain == [4, 4, 3, 3] and split == [3, 4, 4, 3]
    assert sum(split) == 14 and stage_layers(14, 4, 0, True).start == 0 and stage_layers(14, 4, 3, True).stop == 14
    # as many virtual stages as layers + 2: the first holds only the embedding, the last only the loss
    deep = [len(stage_layers(14, 16, s, embedding_loss=True)) for s in range(16)]
    assert deep[0] == deep[-1] == 0 and set(deep[1:-1]) == {1}


def test_a_pipeline_two_stages_deeper_than_the_layers_needs_the_split():
    with pytest.raises(SpecError, match="deeper than the LLM's 14 layers"):
        ParallelSpec(world_size=8, pp=8, virtual_stages=2, microbatches=8).validate(MODEL)
    ParallelSpec(world_size=8, pp=8, virtual_stages=2, microbatches=8, embedding_loss_stages=True).validate(MODEL)
    with pytest.raises(SpecError, match="simulated only"):
        ParallelSpec(world_size=8, pp=2, embedding_loss_stages=True).check_runtime()


def test_the_simulated_first_stage_does_less_work_with_the_split():
    batch = Batch(0, [Sample(i, "text", (Segment("text", 4096),)) for i in range(8)])
    cluster = load_cluster("h100", 4)

    def first_stage_forward(split: bool) -> float:
        parallel = ParallelSpec(world_size=4, pp=4, microbatches=8, fsdp=False, embedding_loss_stages=split)
        plan = get_planner("homogeneous").plan(MODEL, parallel, batch)
        assert plan.layouts["llm"].embedding_loss_stages is split
        res = simulate(plan, MODEL, cluster)
        return next(s.duration for s in res.spans if s.kind == FORWARD and s.action.stage == 0)

    assert first_stage_forward(True) < 0.8 * first_stage_forward(False)  # 3 layers instead of 4

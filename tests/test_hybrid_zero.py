"""Hybrid ZeRO-2 on omni's encoders (`encoder_dp=hzero2`, `Layout.hybrid` without FSDP): the state
sharded within shard groups of a few nodes and replicated across them. The simulator reduces within
the shard group and all-reduces the slice across the groups (fewer ring hops than ZeRO-2 over every
rank), gathers the updated weights within the shard group, holds 1/shard of the state, and counts the
two more communicators a rank is in; the runtime's side is tests/test_runtime_zero.py."""

from __future__ import annotations

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, simulate
from simulator.hardware import load_cluster
from simulator.memory import communicators
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)

MODEL = get_model("omni-7b@4L")
GPUS = 2048


@pytest.fixture(scope="module")
def plans():
    batch = WorkloadStream("omni_av", seed=0, global_batch_tokens=4096 * GPUS).batch(0)
    out = {}
    for mode in ("zero2", "hzero2"):
        parallel = ParallelSpec(world_size=GPUS, tp=2, microbatches=2, options={"hardware": "h100", "encoder_dp": mode})
        out[mode] = get_planner("omni").plan(MODEL, parallel, batch)
    return out


def test_hzero2_shards_the_encoders_state_within_groups_of_eight_nodes(plans):
    for name in MODEL.encoders:
        whole, hybrid = plans["zero2"].layouts[name], plans["hzero2"].layouts[name]
        assert not whole.hybrid and whole.shard_size == GPUS
        assert hybrid.hybrid and not hybrid.fsdp and hybrid.zero == 2 and hybrid.shard_size == 64
        assert hybrid.dp_mode == "zero2"
    assert plans["zero2"].layouts["llm"] == plans["hzero2"].layouts["llm"]


def test_hzero2_reduces_in_fewer_ring_hops_and_holds_more_state(plans):
    cluster = load_cluster("h100", GPUS)
    whole, hybrid = Engine(plans["zero2"], MODEL, cluster), Engine(plans["hzero2"], MODEL, cluster)
    for name in MODEL.encoders:
        a, b = whole.grad_sync_cost(name, 0, 0), hybrid.grad_sync_cost(name, 0, 0)
        # 63 ring hops inside the shard group plus an all-reduce over the 32 groups, against 2,047 hops
        # (at 512 GPUs the two cost about the same: bandwidth-bound)
        assert 0 < b < a
        rs_only = hybrid.coll.cost("reduce_scatter", hybrid.options.grad_reduce_bytes * hybrid.stage_work(name, 0).params,
                                   hybrid._shard_group(name, 0))
        assert b > rs_only  # the all-reduce across the replicas is part of it
        assert hybrid._dp_mode(name, 0) == ("zero2", 64) and whole._dp_mode(name, 0) == ("zero2", GPUS)
    assert hybrid._static_memory(0) > whole._static_memory(0)
    # each encoder's shard group and replicate group: two more communicators per encoder
    assert communicators(plans["hzero2"], 0) == communicators(plans["zero2"], 0) + 2 * len(MODEL.encoders)
    a, b = simulate(plans["zero2"], MODEL, cluster), simulate(plans["hzero2"], MODEL, cluster)
    assert b.step_time <= a.step_time and b.peak_memory > a.peak_memory

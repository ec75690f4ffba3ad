"""Training-state memory under every data-parallel mode (DDP, ZeRO-1, ZeRO-2, FSDP, HSDP), in the
bytes per parameter each software stack keeps, and how the simulator's timeline places it."""

from __future__ import annotations

import pytest

from omnibench.specs import costs
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

P = 1_000_000


@pytest.mark.parametrize(("mode", "n", "per_param"), [
    ("ddp", 8, 16), ("zero1", 8, 4 + 4 + 8 / 8), ("zero2", 8, 4 + 4 / 8 + 8 / 8), ("fsdp", 8, 16 / 8), ("hsdp", 4, 16 / 4),
])
def test_eager_replicated_state_is_fp32_and_each_zero_stage_shards_one_more_part(mode, n, per_param):
    # ZeRO in this project's runtime: bf16 weights (2) and an fp32 master slice (4/n) instead of fp32 weights
    want = {"zero1": 2 + 4 / 8 + 4 + 8 / 8, "zero2": 2 + 4 / 8 + 4 / 8 + 8 / 8}.get(mode, per_param)
    assert costs.dp_state_bytes(P, mode, n, "eager").total == pytest.approx(want * P)


def test_megatron_distributed_optimizer_keeps_6_plus_12_over_d_bytes_and_4_plus_12_over_d_with_bf16_grads():
    # Megatron-LM docs/source/api-guide/dist_optimizer.md: bf16 params with fp32 grads (what --bf16
    # sets, megatron/training/arguments.py; NeMo 2.0's grad_reduce_in_fp32 too) or bf16 grads
    # (--grad-reduce-in-bf16): 18 / 16 bytes under DDP
    assert costs.dp_state_bytes(P, "ddp", 8, "megatron").total == pytest.approx(18 * P)
    assert costs.dp_state_bytes(P, "zero1", 8, "megatron").total == pytest.approx((6 + 12 / 8) * P)
    assert costs.dp_state_bytes(P, "ddp", 8, "nemo").total == pytest.approx(18 * P)
    assert costs.dp_state_bytes(P, "zero1", 8, "nemo").total == pytest.approx((6 + 12 / 8) * P)
    assert costs.dp_state_bytes(P, "ddp", 8, "megatron-bf16-grads").total == pytest.approx(16 * P)
    assert costs.dp_state_bytes(P, "zero1", 8, "megatron-bf16-grads").total == pytest.approx((4 + 12 / 8) * P)
    assert costs.dp_state_bytes(P, "zero2", 8, "megatron").total == pytest.approx((2 + 16 / 8) * P)


def test_state_bytes_refuse_an_unknown_mode_or_stack():
    with pytest.raises(ValueError, match="dp_mode must be one of ddp, zero1, zero2, fsdp, hsdp"):
        costs.dp_state_bytes(P, "zero3", 8)
    with pytest.raises(ValueError, match="stack must be one of"):
        costs.dp_state_bytes(P, "ddp", 8, "jax")


def _engine(mode: str, memory_stack: str = "", world: int = 4, **kw) -> Engine:
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(2 * world)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=world, **{**dp_mode_fields(mode), **kw}), batch)
    return Engine(plan, spec, load_cluster("h100", world), options=SimOptions(check_memory=False, memory_stack=memory_stack))


def _params(e: Engine) -> float:
    return e._model_parallel_params("llm", 0)[0]


def test_static_memory_falls_with_each_zero_stage_and_fsdp():
    static = {m: _engine(m)._static_memory(0) for m in ("ddp", "zero1", "fsdp")}
    p = _params(_engine("ddp"))
    assert static["ddp"] == pytest.approx(12 * p)  # fp32 weights + AdamW; gradients come with the backward
    assert static["zero1"] == pytest.approx((2 + 4 / 4 + 8 / 4) * p)
    assert static["fsdp"] > 12 * p / 4  # plus the gathered bf16 layers
    assert static["ddp"] > static["zero1"] > static["fsdp"]


def test_the_simulated_peak_falls_from_ddp_to_zero_to_fsdp():
    peak = {m: _engine(m).run().peak_memory for m in ("ddp", "zero1", "zero2", "fsdp")}
    assert peak["ddp"] > peak["zero1"] >= peak["zero2"] > peak["fsdp"]


def test_eager_zero_reduces_into_a_slice_at_grad_sync_and_zero2_frees_the_whole_gradients():
    p = _params(_engine("zero2"))
    assert _engine("zero2")._grad_sync_delta("llm", 0) == pytest.approx(-4 * p + 4 * p / 4)
    assert _engine("zero1")._grad_sync_delta("llm", 0) == pytest.approx(4 * p / 4)
    m = _engine("zero2", memory_stack="megatron")
    assert m._grad_sync_delta("llm", 0) == 0.0  # a gradient partition allocated at start-up
    assert m._static_memory(0) == pytest.approx((2 + (4 + 4 + 8) / 4) * p)


def test_zero_shards_the_optimizer_step_and_fsdp_the_weights():
    zero, fsdp, ddp = _engine("zero1"), _engine("fsdp"), _engine("ddp")
    p = _params(ddp)
    assert zero._module_params_on_rank("llm", 0) == pytest.approx(p)  # whole weights on every rank
    assert zero._stepped_params_on_rank(0) == pytest.approx(p / 4)
    assert fsdp._module_params_on_rank("llm", 0) == pytest.approx(p / 4)
    assert ddp._stepped_params_on_rank(0) == pytest.approx(p)


def test_hsdp_shards_over_its_shard_group_only():
    e = _engine("hsdp", world=16, dp_shard=4)
    assert e._dp_mode("llm", 0) == ("hsdp", 4)
    p = _params(e)
    assert e._module_state("llm", 0).total == pytest.approx(16 * p / 4)


def test_one_rank_holds_everything_whatever_the_mode():
    for mode in ("zero2", "fsdp"):
        e = _engine(mode, world=1)
        assert e._dp_mode("llm", 0) == ("ddp", 1)


def _fsdp_engine(memory_stack: str, pp: int = 1) -> Engine:
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(16)])
    parallel = ParallelSpec(world_size=4 * pp, pp=pp, microbatches=4)
    plan = get_planner("homogeneous").plan(spec, parallel, batch)
    return Engine(plan, spec, load_cluster("h100", 4 * pp),
                  options=SimOptions(check_memory=False, memory_stack=memory_stack, stack="fused"))


def test_this_runtime_reduce_scatters_fsdp_gradients_in_every_microbatch():
    # FSDP2's default: each backward adds its gradient into the rank's fp32 shard, so no whole
    # (unsharded) gradient is ever held across microbatches
    e = _fsdp_engine("eager")
    acts = [a for a in e.plan.actions[0] if a.kind == "backward"]
    lp = e._layer_on_rank("llm")
    assert not e._defers_reduce("llm")
    assert e._backward_grads(0, acts[0])[0] == pytest.approx(4 * lp / 4)  # the shard, created once
    assert all(e._backward_grads(0, a)[0] == 0.0 for a in acts[1:])


def test_fsdp_gradient_accumulation_needs_no_unsharded_gradient_copy():
    # a 72B LLM FSDP-sharded over 128 H100s: four microbatches of a quarter of the batch each need
    # less than one microbatch of all of it, never a whole fp32 copy of the model's gradients (288 GiB)
    spec = get_model("llm-72b")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 2048),)) for i in range(512)])
    peaks = {}
    for m in (1, 4):
        parallel = ParallelSpec(world_size=128, cp=4, cp_kind="allgather", fsdp=True, microbatches=m,
                                recompute="full")
        plan = get_planner("temporal").plan(spec, parallel, batch)
        engine = Engine(plan, spec, load_cluster("h100", 128), options=SimOptions(recompute="full"))
        peaks[m] = engine.peak_needed(float("inf"))[0]
    assert peaks[4] <= peaks[1] * 1.05, {m: p / 2**30 for m, p in peaks.items()}


def test_torchtitan_reduces_every_microbatch_without_pipelining_and_defers_with_it():
    flat = _fsdp_engine("torchtitan")
    acts = [a for a in flat.plan.actions[0] if a.kind == "backward"]
    lp = flat._layer_on_rank("llm")
    assert flat._backward_grads(0, acts[0])[0] == pytest.approx(4 * lp / 4)
    assert flat._backward_grads(0, acts[1])[0] == 0.0
    piped = _fsdp_engine("torchtitan", pp=2)
    assert piped._defers_reduce("llm") and not _fsdp_engine("composer")._defers_reduce("llm")

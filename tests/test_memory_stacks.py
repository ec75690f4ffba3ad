"""What each software stack keeps per block and per loss, and how the simulator turns a peak of live
tensors into what a GPU must hold (the allocator's reserve and what lives outside it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omnibench.specs import costs
from omnibench.specs.model import LLMSpec
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions
from simulator.hardware import load_cluster
from simulator.memory import FRAGMENTATION, allocator_need
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

# Llama 3 8B (torchtitan's llama3_configs["8B"]): hidden 4096, 32 heads, 8 kv heads, ffn 14336
LLAMA3_8B = LLMSpec(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                    qkv_bias=False)


def test_torchtitan_op_sac_keeps_the_input_and_the_outputs_of_wq_wv_sdpa_w1_w2():
    m = costs.llm_layer_memory(LLAMA3_8B, "selective", "torchtitan")
    # bf16 input, wq out, wv out (kv heads), SDPA out, w1 out, w2 out; fp32 log-sum-exp per head
    assert m.held == 2 * (4096 + 4096 + 1024 + 4096 + 14336 + 4096) + 4 * 32
    none = costs.llm_layer_memory(LLAMA3_8B, "none", "torchtitan")
    assert m.recompute == pytest.approx(none.held - m.held)


def test_compiled_sac_drops_the_w2_output_no_backward_reads():
    eager = costs.llm_layer_memory(LLAMA3_8B, "selective", "torchtitan")
    compiled = costs.llm_layer_memory(LLAMA3_8B, "selective", "torchtitan-compile")
    assert eager.held - compiled.held == 2 * 4096


def test_full_recompute_keeps_the_block_input_and_rebuilds_one_block():
    for stack in costs.ACTIVATION_STACKS:
        full = costs.llm_layer_memory(LLAMA3_8B, "full", stack)
        assert full.held == 2 * 4096
        assert full.recompute == costs.llm_layer_memory(LLAMA3_8B, "none", stack).held


def test_megatron_selective_recompute_saves_nothing_under_flash_attention():
    assert costs.llm_layer_memory(LLAMA3_8B, "selective", "megatron") == costs.llm_layer_memory(LLAMA3_8B, "none", "megatron")


def test_torchtitan_loss_holds_fp32_log_softmax_and_peaks_at_three_fp32_logits_in_its_backward():
    t, v = 16384, LLAMA3_8B.vocab
    loss = costs.loss_memory(LLAMA3_8B, t, stack="torchtitan")
    assert loss.held - t * costs._rmsnorm_bytes(4096, 2) == 4 * t * v
    assert loss.forward == 6 * t * v and loss.backward == 8 * t * v
    parallel = costs.loss_memory(LLAMA3_8B, t, v // 8, stack="torchtitan", tp=8)
    assert parallel.backward == 12 * t * (v // 8)  # loss parallel's decomposed backward
    compiled = costs.loss_memory(LLAMA3_8B, t, stack="torchtitan-compile-loss")
    assert compiled.backward == 2 * t * v and compiled.forward == 0


def test_unknown_stack_is_refused_in_one_line():
    with pytest.raises(ValueError, match="stack must be one of eager, torchtitan"):
        costs.llm_layer_memory(LLAMA3_8B, "none", "jax")


def _result(memory_stack="", hardware="h100", recompute="none", **parallel):
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(4)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=2, **parallel), batch)
    opts = SimOptions(recompute=recompute, memory_stack=memory_stack, stack="fused" if memory_stack else "eager")
    return Engine(plan, spec, load_cluster(hardware, 2), options=opts).run()


def test_a_gpu_holds_the_allocators_reserve_and_the_context_outside_it():
    res = _result()
    r = res.ranks[0]
    assert r.memory_reserved == pytest.approx(FRAGMENTATION * r.memory_allocated)
    # world + llm tp, cp, dpcp, ep, edp: six NCCL communicators on each rank
    assert r.memory_bytes == pytest.approx(r.memory_reserved + allocator_need("eager").outside_for(6))
    assert r.memory_allocated > r.memory_static > 0
    assert r.memory_peak_at.startswith(("forward(llm", "backward(llm"))


def test_a_layout_that_does_not_fit_still_gets_its_step_time():
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(4)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=2), batch)
    cluster = load_cluster("h100", 2)
    small = replace(cluster, gpu=replace(cluster.gpu, memory_gib=8.0))
    res = Engine(plan, spec, small).run()
    assert not res.fits and "does not fit" in res.fit_message and f"{res.peak_needed / 2**30:.1f} GiB" in res.fit_message
    assert res.step_time == pytest.approx(Engine(plan, spec, cluster).run().step_time)


def _engine(memory_stack: str, hardware: str) -> Engine:
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(4)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=2), batch)
    return Engine(plan, spec, load_cluster(hardware, 2),
                  options=SimOptions(memory_stack=memory_stack, stack="fused" if memory_stack != "eager" else "eager"))


def test_only_an_unfused_attention_stack_keeps_s_by_s_scores_whatever_the_gpu():
    scores = 5 * 28 * 2 * 4096**2 * 4  # 5 bytes per score, 28 heads, two 4,096-token sequences, 4 layers
    held = {}
    for stack, hw in (("megatron-2021", "h100"), ("megatron", "a100-80g"), ("eager", "a100-80g"), ("eager", "h100")):
        e = _engine(stack, hw)
        held[stack, hw] = e._live_activation(e.work("llm", 0, e._signature("llm", 0, 0)))
    assert held["megatron-2021", "h100"] - held["megatron", "a100-80g"] == pytest.approx(scores, rel=0.01)
    assert held["eager", "a100-80g"] == held["eager", "h100"]  # the A100 profile's unfused kernels: time only
    # without a memory stack named, the fused stack on a profile of unfused attention is Megatron-LM of then
    assert _engine("", "a100-80g").memory_stack == "megatron-2021" and _engine("", "h100").memory_stack == "megatron"


def test_te_fp8_linears_keep_their_inputs_in_one_byte():
    bf16 = costs.llm_layer_memory(LLAMA3_8B, "none", "megatron")
    fp8 = costs.llm_layer_memory(LLAMA3_8B, "none", "megatron-fp8")
    assert bf16.held - fp8.held == 2 * 4096 + 14336 - 4096

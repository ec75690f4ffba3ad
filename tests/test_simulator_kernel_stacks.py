"""The kernel model of this project's own modules (eager stack), encoders by shape, and the one-H100
runs they are checked against."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from omnibench.specs.presets import get_model
from simulator.calibrate import validate
from simulator.flops import audio_work, llm_work, vision_work
from simulator.kernels import BlockShape, Stack, llm_pass, load_kernel_profile

ROOT = Path(__file__).resolve().parents[1]
H100_RUNS = sorted((ROOT / "results" / "gpu" / "runs").glob("*"))
EAGER = Stack(kind="eager", residual_bytes=4, weight_cast=True, loss="chunked", loss_chunk_tokens=1765)


@pytest.fixture(scope="module")
def h100():
    return load_kernel_profile("h100-measured")


def llm_shape(stack=EAGER, head=True) -> BlockShape:
    spec = get_model("qwen2-7b").llm
    shape = llm_work(spec, [8192, 8192], range(4), True, head).shape
    return replace(shape, stack=stack)


def test_eager_modules_cost_more_memory_bound_time_than_fused_kernels(h100):
    fused = llm_shape(Stack(), head=False)
    eager = llm_shape(head=False)
    for passes in ("fwd", "bwd"):
        assert llm_pass(h100, eager, passes) > llm_pass(h100, fused, passes)


def test_the_chunked_loss_computes_the_head_gradients_in_the_forward(h100):
    chunked, logits = llm_shape(), llm_shape(replace(EAGER, loss="logits"))
    body = llm_shape(head=False)
    head_fwd = llm_pass(h100, chunked, "fwd") - llm_pass(h100, body, "fwd")
    head_bwd = llm_pass(h100, chunked, "bwd") - llm_pass(h100, body, "bwd")
    logits_bwd = llm_pass(h100, logits, "bwd") - llm_pass(h100, body, "bwd")
    assert head_fwd > 2.5 * (llm_pass(h100, logits, "fwd") - llm_pass(h100, body, "fwd"))
    assert head_bwd < 0.1 * logits_bwd


def test_an_fp32_residual_stream_costs_more_than_a_bf16_one(h100):
    bf16 = llm_shape(replace(EAGER, residual_bytes=2, weight_cast=False), head=False)
    assert llm_pass(h100, llm_shape(head=False), "bwd") > llm_pass(h100, bf16, "bwd")


def test_encoders_are_costed_by_shape_with_full_attention(h100):
    spec = get_model("omni-7b")
    v = vision_work(spec.vision, [(2, 36, 46)] * 6).shape
    a = audio_work(spec.audio, [3000, 1200]).shape
    assert v is not None and not v.causal and v.seq_lens == (1656,) * 12 and v.extra_gemms
    assert a is not None and not a.causal and a.seq_lens == (1500, 600)
    causal = replace(v, causal=True)
    assert llm_pass(h100, v, "fwd") > llm_pass(h100, causal, "fwd")


def test_a_head_size_between_measured_ones_gets_a_rate_between_theirs(h100):
    lo, hi = h100.attention_rate("fwd", 64, 2048), h100.attention_rate("fwd", 128, 2048)
    assert min(lo, hi) < h100.attention_rate("fwd", 80, 2048) < max(lo, hi)


@pytest.mark.skipif(not H100_RUNS, reason="no committed H100 runs")
def test_the_measured_h100_runs_validate_within_ten_percent():
    rows = [v for v in validate([str(p) for p in H100_RUNS], None, "h100") if v.steps]
    assert rows and max(abs(v.error) for v in rows) < 0.10


def test_moe_layers_are_costed_expert_by_expert(h100):
    # moe.py loops over the rank's experts: many small experts are launch bound, so the same FLOPs
    # on fewer, larger local experts (expert parallelism) run faster
    llm = get_model("qwen3-30b-a3b").llm
    one, eight = (replace(llm_work(llm, [8192], range(2), False, False, ep=ep).shape, stack=EAGER) for ep in (1, 8))
    assert one.moe_experts == 128 and eight.moe_experts == 16
    assert llm_pass(h100, eight, "fwd") < llm_pass(h100, one, "fwd")
    dense = llm_work(get_model("qwen2-7b").llm, [8192], range(2), False, False).shape
    assert dense.moe_experts == 0

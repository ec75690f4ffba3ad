"""What a software stack runs, as SimOptions say it (simulator/options.py), and GPU variants of a kernel
profile: each option moves the simulated step the way the mechanism it stands for does."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omnibench.plan import BACKWARD, FORWARD, GRAD_SYNC, SEND
from omnibench.specs.model import LLMSpec, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(120)

MODEL = MultimodalSpec("m", LLMSpec("m", layers=8, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                                    qkv_bias=False))


def batch(n: int = 16, tokens: int = 4096) -> Batch:
    return Batch(0, [Sample(i, "text", (Segment("text", tokens),)) for i in range(n)])


def run(options: SimOptions, gpus: int = 16, hardware: str = "h100", **layout):
    parallel = ParallelSpec(world_size=gpus, microbatches=layout.pop("microbatches", 2), **layout)
    plan = get_planner("homogeneous").plan(MODEL, parallel, batch(max(16, 2 * gpus)))
    return simulate(plan, MODEL, load_cluster(hardware, gpus), options=options)


def compute(res, kind: str) -> float:
    return max(s.duration for s in res.spans if s.kind == kind and s.stream == "compute")


def test_overlapping_the_gradient_reduction_with_the_backward_shortens_a_ddp_step():
    plain = run(SimOptions(stack="fused"), **dp_mode_fields("ddp"))
    overlapped = run(SimOptions(stack="fused", overlap_grad_reduce=True), **dp_mode_fields("ddp"))
    free = run(SimOptions(stack="fused", communication=False), **dp_mode_fields("ddp"))
    sync = [s.duration for s in overlapped.spans if s.kind == GRAD_SYNC]
    assert free.step_time <= overlapped.step_time < plain.step_time
    assert sync and max(sync) < max(s.duration for s in plain.spans if s.kind == GRAD_SYNC)


def test_overlapping_the_parameter_gather_with_the_next_forward_shortens_a_zero1_step():
    plain = run(SimOptions(stack="fused"), **dp_mode_fields("zero1"))
    overlapped = run(SimOptions(stack="fused", overlap_param_gather=True), **dp_mode_fields("zero1"))
    assert overlapped.step_time < plain.step_time


def test_fp8_linears_are_faster_than_bf16_but_not_twice_as_fast_per_step():
    bf16 = run(SimOptions(stack="fused"), tp=2)
    fp8 = run(SimOptions(stack="fused", gemm_dtype="fp8"), tp=2)
    assert 1.0 < compute(bf16, FORWARD) / compute(fp8, FORWARD) < 2.0


def test_torchtitans_selective_checkpointing_costs_between_megatrons_and_full():
    def bwd(recompute: str, selective: str = "attention") -> float:
        return compute(run(SimOptions(stack="fused", recompute=recompute, selective=selective), tp=2), BACKWARD)

    assert bwd("selective") < bwd("selective", "half") < bwd("full")


def test_unfused_attention_is_slower_than_flash_attention():
    flash = run(SimOptions(stack="fused", attention="flash"), tp=2)
    unfused = run(SimOptions(stack="fused", attention="unfused"), tp=2)
    assert compute(unfused, FORWARD) > compute(flash, FORWARD)


def test_tp_overlap_hides_tensor_parallel_communication():
    plain = run(SimOptions(stack="fused"), tp=8)
    overlapped = run(SimOptions(stack="fused", tp_overlap=True), tp=8)
    assert overlapped.exposed_comm < plain.exposed_comm and overlapped.step_time < plain.step_time


def test_pipeline_sends_carry_one_tp_slice_under_scatter_gather():
    def send(sg: bool) -> float:
        res = run(SimOptions(stack="fused", p2p_scatter_gather=sg), tp=4, pp=2, microbatches=4, gpus=16)
        return max(s.duration for s in res.spans if s.kind == SEND)

    assert send(True) < send(False)


def test_bucketed_fsdp_gathers_pay_the_ring_latency_once_per_bucket():
    one = run(SimOptions(stack="fused"), gpus=64, fsdp=True, dp_shard=-1)
    bucketed = run(SimOptions(stack="fused", fsdp_gather_bucket=5e6), gpus=64, fsdp=True, dp_shard=-1)
    assert bucketed.exposed_comm > one.exposed_comm


def test_a_gpu_variant_scales_its_profiles_compute_and_element_wise_rates():
    cluster = load_cluster("h100", 8)
    slow = replace(cluster, gpu=replace(cluster.gpu, kernel_compute_scale=0.5))
    parallel = ParallelSpec(world_size=8, microbatches=1, **dp_mode_fields("ddp"))
    plan = get_planner("homogeneous").plan(MODEL, parallel, batch(8))
    free = SimOptions(stack="fused", communication=False)
    base, half = (compute(simulate(plan, MODEL, c, options=free), FORWARD) for c in (cluster, slow))
    assert 1.5 * base < half <= 2.0 * base  # GEMMs and attention at half the rate, element-wise work not
    from simulator.compute import ComputeModel

    b200 = load_cluster("b200", 8)  # the H100's profile, element-wise at the B200's bandwidth
    assert b200.gpu.kernel_memory_scale > 2
    assert ComputeModel(b200).kernels.memory_bandwidth == pytest.approx(
        ComputeModel(cluster).kernels.memory_bandwidth * b200.gpu.kernel_memory_scale, rel=1e-3)
    # the H200 has its own measured profile, nothing scaled
    h200 = ComputeModel(load_cluster("h200", 8)).kernels
    assert (h200.name, h200.device) == ("h200-measured", "NVIDIA H200")

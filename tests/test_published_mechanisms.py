"""Mechanisms of the published stacks that the published rows rest on, each checked on its own.

Transformer Engine's grouped GEMM (Megatron-Core's TEGroupedMLP) is one cuBLAS GEMM per local expert,
enqueued by the host one by one (TransformerEngine d0067d0d, common/gemm/cublaslt_gemm.cu
`multi_stream_cublas_gemm`): a group of small experts costs at least one host launch per expert, not one
launch for the whole group (`simulator/kernels.py` `grouped_gemm_time`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.kernels import FUSED, BlockShape, Stack, _moe, grouped_gemm_time, load_kernel_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def h100():
    return load_kernel_profile("h100-measured")


def test_a_grouped_gemm_of_small_experts_pays_one_launch_per_expert(h100):
    # 16 experts of 8 tokens: each GEMM is far shorter than a launch on the GPU
    one = 2.0 * 8 * 64 * 64 / h100.gemm_rate(8, 64, 64)
    assert one < h100.launch_s
    got = grouped_gemm_time(h100, 16, 8, 64, 64)
    assert got == pytest.approx(16 * h100.launch_s, rel=1e-12)
    assert got > 15 * h100.launch_s  # not one launch for the whole group


def test_a_grouped_gemm_of_large_experts_is_its_gpu_time(h100):
    # the launches hide behind long GEMMs: the floor is a max, not an added cost
    m, n, k = 8192, 4096, 4096
    gpu = 4 * 2.0 * m * n * k / h100.gemm_rate(m, n, k)
    assert gpu > 4 * h100.launch_s
    assert grouped_gemm_time(h100, 4, m, n, k) == pytest.approx(gpu, rel=1e-12)
    assert grouped_gemm_time(h100, 0, m, n, k) == 0.0


def _moe_shape(stack: Stack, experts: int) -> BlockShape:
    return BlockShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=0, seq_lens=(256,),
                      layers=1, head=False, stack=stack, moe=True, moe_experts=experts, moe_router=128,
                      moe_top_k=8, moe_ffn=768)


def test_a_fused_moe_layer_pays_a_launch_for_every_local_experts_gemm(h100):
    # 64 local experts, 256 tokens: 16 token copies per expert. Forward: fc1 and fc2, one GEMM per
    # expert each; backward: dgrad and wgrad of both
    s = _moe_shape(FUSED, 64)
    assert _moe(h100, s, 256.0, bwd=False) >= 2 * 64 * h100.launch_s
    assert _moe(h100, s, 256.0, bwd=True) >= 4 * 64 * h100.launch_s
    # the same tokens over 4 experts: 16x fewer launches, so the layer is far cheaper
    few = _moe_shape(FUSED, 4)
    assert _moe(h100, few, 256.0, bwd=False) < 0.25 * _moe(h100, s, 256.0, bwd=False)


def _step_time(micro_batch_tokens: int, microbatches: int) -> float:
    cmd = [sys.executable, "-m", "omnibench", "simulate", "--workload", "pretrain_4096", "--system", "homogeneous",
           "--gpus", "8", "--hardware", "b200",
           "--model", "published/moe-48L-2048h-32a-4kv-6144f-151936v-128d-128x8e-768ef",
           "--tp", "1", "--pp", "1", "--cp", "1", "--dp", "8", "--dp-mode", "zero1",
           "--microbatches", str(microbatches), "--global-batch-tokens", str(micro_batch_tokens * microbatches * 8),
           "--recompute", "none", "--ep", "8", "--stack", "nemo", "--fp8", "--json", "--no-cache",
           "--out", str(Path("/tmp") / "omnibench-test-published-mechanisms")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out[out.index("{"):])["results"][0]["step_time_s"]


def test_small_microbatches_of_a_small_expert_moe_are_launch_bound():
    # Qwen3-30B-A3B at EP 8 on 8 B200s, the same 2M-token batch as 64 microbatches of one 4,096-token
    # sequence or 16 of four: the expert GEMMs of a one-sequence microbatch (2,048 token copies per
    # local expert, 16 experts) are shorter than their launches, so the step is well over the
    # four-sequence step's (without the per-expert launches the two were within 17%)
    small = _step_time(4096, 64)
    large = _step_time(4 * 4096, 16)
    assert small > 1.3 * large

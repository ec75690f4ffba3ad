"""Write the A100 (and V100) kernel profiles built from published kernel measurements (no GPU here).

    python benchmarks/a100_published_profile.py              # -> simulator/data/kernels/a100-published.json
    python benchmarks/a100_published_profile.py --gpu v100   # -> simulator/data/kernels/v100-published.json

Same schema as a measured profile (`benchmarks/gpu_kernels.py`), so the simulator reads both the
same way. Every figure comes from a published measurement named in `SOURCES`; where a source gives
a curve rather than a table, the rows are that curve sampled on a grid of shapes (the functional
form is written next to it). Nothing here is fitted to a training run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "simulator" / "data" / "kernels" / "a100-published.json"
PEAK = 312e12  # A100 SXM dense bf16/fp16 tensor-core peak (NVIDIA A100 datasheet)
SMS = 108

SOURCES = {
    "gemm_max": "S. Bekman, Machine Learning Engineering (github.com/stas00/ml-engineering, compute/accelerator), "
                "maximum achievable matmul FLOPS (MAMF) A100 SXM bf16: 271.2 TFLOP/s, 86.9% of peak",
    "gemm_size": "Calculon (Isaev et al., SC'23) compute efficiency by op size: about 0.95 / 0.9 / 0.6 of the "
                 "large-op rate at 128 / 16 / 1 GFLOP (github.com/calculon-ai/calculon systems/a100_80g.json, "
                 "matrix gflops_efficiency); sampled as F / (F + 0.6 GFLOP)",
    "gemm_waves": "NVIDIA Deep Learning Performance Guide, 'Matrix Multiplication Background' (tile and wave "
                  "quantization on A100's 108 SMs; cuBLAS tiles 256x128, 128x128, 64x128)",
    "hbm": "NVIDIA A100 80GB datasheet 2,039 GB/s; BabelStream / element-wise kernels reach about 1.3 to 1.7 TB/s "
           "(copy highest, normalisations lowest); rows below: copy 1.70, add 1.60, dropout 1.45, softmax 1.40, "
           "layernorm 1.30 TB/s",
    "attention_flash": "T. Dao, FlashAttention-2 (2023), Fig. 4-5, A100 80GB causal forward+backward: head dim "
                       "64: 98/120/130/132/132 TFLOP/s and head dim 128: 132/162/171/176/176 at 512..8K; "
                       "forward only head dim 128: 150/187/200/207/210 (read off the figures)",
    "attention_kernel": "The published Megatron-LM runs (2021-22) used unfused attention: batched GEMMs over the "
                        "full s x s scores, Megatron's fused scale-mask-softmax, torch dropout "
                        "(Narayanan et al. SC'21 sec. 4; Korthikanti et al. 2022 sec. 4)",
    "launch": "PyTorch eager dispatch + CUDA launch of a small op on an A100 host: about 5 to 10 us "
              "(PyTorch performance tuning guide; 'Making Deep Learning Go Brrrr', H. He 2022); 6 us used",
}


# V100 (Shoeybi et al. 2019's DGX-2H): no published FlashAttention (FlashAttention-2 needs Ampere) and
# no maximum-achievable-matmul figure; the A100's curve is used with the V100's SM count, peak and
# HBM, and the GPU's hardware preset scales its kernel rates by a fitted per-generation efficiency
# (simulator/data/hardware/v100-32g.toml).
V100 = {
    "peak": 130e12, "sms": 80, "hbm_scale": 900 / 2039,
    "name": "V100-SXM3-32GB (A100 published curve at V100 scale)", "capability": "7.0", "memory_gib": 32,
    "sources": {
        "peak": "Shoeybi et al. 2019 (arXiv 1909.08053) sec. 5: 39 TFLOP/s on one DGX-2H GPU is '30% of the "
                "theoretical peak', i.e. 130 TFLOP/s fp16 (450 W V100 SXM3)",
        "gemm": "the A100 curve below (MAMF fraction, Calculon size fall-off, wave quantization) on 80 SMs; no "
                "V100 matmul ceiling is published, the preset's kernel_compute_scale is fitted instead",
        "hbm": "V100 datasheet 900 GB/s; element-wise rows at the A100 rows' fraction of their datasheet bandwidth",
        "attention_kernel": "Megatron-LM 2019-20 on V100: unfused attention (no FlashAttention on Volta)",
        "launch": "as the A100 profile: 6 us per eager kernel",
    },
}


def gemm_efficiency(m: int, n: int, k: int, sms: int = SMS) -> float:
    flops = 2.0 * m * n * k
    size = flops / (flops + 0.6e9)
    best = 0.0
    for (tm, tn), tile_eff in (((256, 128), 1.0), ((128, 128), 0.95), ((64, 128), 0.85)):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, tile_eff * tiles / (waves * sms))
    return 0.869 * size * best


def v100() -> None:
    out = OUT.with_name("v100-published.json")
    dims = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    gemm = []
    for m in dims:
        for n in dims:
            for k in dims:
                e = gemm_efficiency(m, n, k, V100["sms"])
                flops = 2.0 * m * n * k
                gemm.append({"m": m, "n": n, "k": k, "op": "fwd", "origin": "published curve",
                             "time_s": flops / (e * V100["peak"]), "flops": flops, "tflops": e * V100["peak"] / 1e12})
    memory = []
    for op, tbs in (("copy", 1.70), ("add", 1.60), ("dropout", 1.45), ("softmax", 1.40), ("layernorm", 1.30)):
        nbytes = 2 * 2**28
        rate = tbs * V100["hbm_scale"]
        memory.append({"op": op, "numel": 2**28, "bytes": nbytes, "time_s": nbytes / (rate * 1e12), "gbps": rate * 1e3})
    prof = {
        "schema": "omnibench-kernel-profile/1",
        "device": {"kind": "cuda", "name": V100["name"], "capability": V100["capability"],
                   "memory_bytes": V100["memory_gib"] * 2**30, "multiprocessors": V100["sms"]},
        "torch": None, "cuda": None, "date": "published", "quick": False, "dtype": "float16",
        "timing": "not measured here: rows are published figures (see sources)",
        "attention_kernel": "unfused", "sources": V100["sources"],
        "conventions": {"gemm": "flops = 2*m*n*k; rate = 0.869 * F/(F + 0.6 GFLOP) * best wave efficiency over tiles"},
        "gemm": gemm, "attention": [], "memory_bound": memory,
        "launch": {"host_per_kernel_s": 6e-6, "gpu_per_small_kernel_s": 2.5e-6, "sync_round_trip_s": 2e-5},
        "skipped": [],
    }
    out.write_text(json.dumps(prof, indent=0))
    print(f"{len(gemm)} GEMM rows -> {out}")


def main() -> None:
    import sys

    if "--gpu" in sys.argv and sys.argv[sys.argv.index("--gpu") + 1] == "v100":
        v100()
        return
    dims = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    gemm = []
    for m in dims:
        for n in dims:
            for k in dims:
                e = gemm_efficiency(m, n, k)
                flops = 2.0 * m * n * k
                gemm.append({"m": m, "n": n, "k": k, "op": "fwd", "origin": "published curve",
                             "time_s": flops / (e * PEAK), "flops": flops, "tflops": e * PEAK / 1e12})
    attention = []
    seqs = [512, 1024, 2048, 4096, 8192]
    fa2 = {("fwd_bwd", 64): [98, 120, 130, 132, 132], ("fwd_bwd", 128): [132, 162, 171, 176, 176],
           ("fwd", 128): [150, 187, 200, 207, 210], ("fwd", 64): [120, 150, 165, 170, 172]}
    for (passes, d), rates in fa2.items():
        for s, r in zip(seqs, rates, strict=True):
            b, h = max(1, 16384 // s), 16
            flops = 4.0 * b * h * s * s * d * 0.5 * (3.5 if passes == "fwd_bwd" else 1.0)
            attention.append({"impl": "sdpa_flash", "pass": passes, "batch": b, "heads": h, "seq": s, "head_dim": d,
                              "causal": True, "time_s": flops / (r * 1e12), "flops": flops, "tflops": float(r)})
    memory = []
    for op, tbs in (("copy", 1.70), ("add", 1.60), ("dropout", 1.45), ("softmax", 1.40), ("layernorm", 1.30)):
        nbytes = 2 * 2**28
        memory.append({"op": op, "numel": 2**28, "bytes": nbytes, "time_s": nbytes / (tbs * 1e12), "gbps": tbs * 1e3})
    prof = {
        "schema": "omnibench-kernel-profile/1",
        "device": {"kind": "cuda", "name": "A100-SXM4-80GB (published measurements)", "capability": "8.0",
                   "memory_bytes": 80 * 2**30, "multiprocessors": SMS},
        "torch": None, "cuda": None, "date": "published", "quick": False, "dtype": "bfloat16",
        "timing": "not measured here: rows are published figures (see sources)",
        "attention_kernel": "unfused",
        "sources": SOURCES,
        "conventions": {"gemm": "flops = 2*m*n*k; rate = 0.869 * F/(F + 0.6 GFLOP) * best wave efficiency over tiles",
                        "attention": "flash rows: fwd 4*b*h*s^2*d/2 (causal); fwd_bwd 3.5x"},
        "gemm": gemm, "attention": attention, "memory_bound": memory,
        "launch": {"host_per_kernel_s": 6e-6, "gpu_per_small_kernel_s": 2.5e-6, "sync_round_trip_s": 2e-5},
        "skipped": [],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(prof, indent=0))
    print(f"{len(gemm)} GEMM rows, {len(attention)} attention rows -> {OUT}")


if __name__ == "__main__":
    main()

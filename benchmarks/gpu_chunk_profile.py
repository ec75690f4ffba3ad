"""Why encoder chunking takes twice the step of block recomputation on a GPU: one profiled step of each.

results/gpu/runs-2026-11-27 measured homogeneous mixed_video on omni-7b@4L at 1.54 s per step with
the ViT's blocks recomputed and 3.01 s with the encoders run by chunks of 4,096 patches and no
recomputation (omnibench/runtime/encoder_chunks.py); the simulator predicts 1.60 s for the chunked
step. The FLOPs are about the same (one extra encoder forward either way), so the time goes elsewhere.
This profiles one step of each variant (after two warm-up steps on other batches) with torch.profiler
and prints, side by side: the step's wall time, the GPU's busy time (the union of kernel intervals),
the idle time between kernels, the number of kernels, host synchronisations (cudaStreamSynchronize,
cudaDeviceSynchronize, device-to-host copies), the time per module from the executor's own spans,
and the ops with the most CUDA time.

    python benchmarks/gpu_chunk_profile.py --out DIR      # one CUDA GPU; DIR/chunk_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_allocator import Step  # noqa: E402
from omnibench.provenance import provenance  # noqa: E402

CASE = ("homogeneous", "mixed_video", "omni-7b@4L")
VARIANTS = {  # name -> (recompute, encoder_chunk_tokens), as benchmarks/gpu_figures.py CHUNK_RUNS
    "vit-block-recompute": ("vision=full,audio=full", 0),
    "chunks-4096": ("none", 4096),
    "chunks-16384": ("none", 16384),
}
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_variant(name: str, tokens: int, warmup: int) -> dict:
    recompute, chunk = VARIANTS[name]
    step = Step((*CASE, recompute, tokens), warmup + 1, "cuda", encoder_chunk_tokens=chunk)
    for i in range(warmup):
        step.run(i)
    torch.cuda.synchronize()
    step.ex.spans.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step.ex.run_step(step.plans[warmup], step.counts[warmup], step.t0)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    per_module = defaultdict(float)
    for s in step.ex.spans:
        per_module[f"{s.module}:{s.kind}"] += s.end - s.start
    kernels, syncs, d2h = [], defaultdict(int), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            kernels.append((e.time_range.start / 1e6, e.time_range.end / 1e6))
        elif e.name in SYNC_EVENTS:
            syncs[e.name] += 1
        elif e.name == "cudaMemcpyAsync" or e.name == "aten::_local_scalar_dense":
            d2h += 1
    busy = busy_seconds(kernels)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
    row = {"variant": name, "recompute": recompute, "encoder_chunk_tokens": chunk, "wall_s": wall,
           "gpu_busy_s": busy, "gpu_idle_s": wall - busy, "kernels": len(kernels), "host_syncs": dict(syncs),
           "memcpy_or_item_calls": d2h, "span_seconds_by_module": dict(sorted(per_module.items())),
           "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30, "top_ops": table}
    print(f"== {name}: wall {wall:.3f} s, GPU busy {busy:.3f} s, idle {wall - busy:.3f} s, {len(kernels)} kernels, "
          f"syncs {dict(syncs)}, memcpy/item {d2h}", flush=True)
    print("   spans:", {k: round(v, 3) for k, v in row["span_seconds_by_module"].items()})
    print(table, flush=True)
    del step
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="vit-block-recompute,chunks-4096")
    ap.add_argument("--tokens", type=int, default=16384, help="global batch tokens (the runs' CUDA default)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: gpu_chunk_profile.py needs a CUDA device")
    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        sys.exit(f"error: variants: {', '.join(bad)} not among {', '.join(VARIANTS)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", 0))
    out = {"provenance": provenance(torch.cuda.get_device_name(), ["benchmarks/gpu_chunk_profile.py", *(argv or sys.argv[1:])],
                                    cuda=True), "case": list(CASE), "tokens": a.tokens, "variants": []}
    os.makedirs(a.out, exist_ok=True)
    for n in names:
        out["variants"].append(profile_variant(n, a.tokens, a.warmup))
        with open(os.path.join(a.out, "chunk_profile.json"), "w") as f:  # after each: a cut-off call keeps it
            json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()

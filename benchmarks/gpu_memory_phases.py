"""What a training process holds on the GPU outside the caching allocator, phase by phase.

`simulator/memory.py::EAGER_ALLOCATOR` adds 4.72 GiB "outside the allocator" to every rank's need,
the figure benchmarks/gpu_allocator.py read once a step had run (3.2-6.6 GiB on one H100). This says
what that memory is and whether it grows, by reading the driver's figure (`mem_get_info`: in use =
total - free) beside the allocator's reserve after each phase of one process:

  CUDA context -> first bf16 GEMM -> NCCL process group -> first all-reduce -> model and optimizer
  built -> step 0 (warm-up: optimizer state) -> steps 1..N (mixed workloads: new packed lengths each
  step) -> empty_cache

outside = in use - reserved. Growth after the first steps, step after step, means it depends on the
shapes a run meets (lazily loaded kernels, per-shape library plans) and a dynamic workload needs
more than one figure; a constant after step 0 means one figure per stack holds. Run it once as is and
once under CUDA_MODULE_LOADING=EAGER (every kernel of every loaded library at context creation): the
difference between the two is what lazy loading defers.

    python benchmarks/gpu_memory_phases.py --case mm --steps 6 --out DIR    # one CUDA GPU

Each case is the Step of gpu_allocator.py (this runtime's Executor, one rank). Writes
DIR/memory_phases-<case>[-<tag>].json with provenance and prints one line per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_allocator import CASES, Step  # noqa: E402
from omnibench.provenance import provenance  # noqa: E402

GiB = 2**30
PHASE_CASES = {
    **CASES,
    # `omnibench run`'s CUDA default on mixed_video (the run of results/gpu/runs-2026-11-27/omni-mixed_video)
    "omni-default": ("omni", "mixed_video", "omni-7b@8L", "full", 0),
}


def reading(phase: str, t0: float) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    in_use, reserved = total - free, torch.cuda.memory_reserved()
    row = {"phase": phase, "seconds": round(time.perf_counter() - t0, 2), "in_use": in_use, "reserved": reserved,
           "allocated": torch.cuda.memory_allocated(), "max_allocated": torch.cuda.max_memory_allocated(),
           "outside": in_use - reserved}
    print(f"{phase:>24}: in use {in_use / GiB:6.2f}  reserved {reserved / GiB:6.2f}  "
          f"allocated {row['allocated'] / GiB:6.2f}  outside {row['outside'] / GiB:5.2f} GiB", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="mm", choices=sorted(PHASE_CASES))
    ap.add_argument("--steps", type=int, default=6, help="steps after the warm-up step")
    ap.add_argument("--tag", default="", help="suffix of the output file (e.g. eager)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: gpu_memory_phases.py needs a CUDA device (mem_get_info is the driver's figure)")
    t0 = time.perf_counter()
    rows = []
    torch.cuda.init()
    torch.empty(1, device="cuda")
    rows.append(reading("CUDA context", t0))
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ x).sum().item()
    del x
    rows.append(reading("first bf16 GEMM", t0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", 0))
    rows.append(reading("NCCL process group", t0))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    del t
    rows.append(reading("first all-reduce", t0))
    step = Step(PHASE_CASES[a.case], a.steps, "cuda")
    rows.append(reading("model + optimizer built", t0))
    for i in range(a.steps + 1):
        step.run(i)
        rows.append(reading(f"step {i}", t0))
    # the shapes each step met: distinct LLM sample lengths (packed lengths change with them)
    lengths = [sorted({s.llm_tokens for s in p.samples}) for p in step.plans]
    del step
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    rows.append(reading("empty_cache", t0))
    first = next(r for r in rows if r["phase"] == "step 0")
    last = rows[-2]
    out = {"provenance": provenance(torch.cuda.get_device_name(), ["benchmarks/gpu_memory_phases.py", *(argv or sys.argv[1:])],
                                    cuda=True),
           "case": a.case, "spec": list(PHASE_CASES[a.case]), "steps": a.steps,
           "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
           "phases": rows, "llm_sample_lengths_per_step": lengths,
           "outside_growth_after_step0_bytes": last["outside"] - first["outside"]}
    print(f"outside after step 0 {first['outside'] / GiB:.2f} GiB, after step {a.steps} {last['outside'] / GiB:.2f} GiB "
          f"(growth {out['outside_growth_after_step0_bytes'] / GiB:+.2f})")
    os.makedirs(a.out, exist_ok=True)
    name = f"memory_phases-{a.case}{'-' + a.tag if a.tag else ''}.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()

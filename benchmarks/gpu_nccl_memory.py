"""GPU memory each NCCL communicator holds outside the caching allocator, and the knobs that change it.

benchmarks/gpu_memory_phases.py found most of what this runtime holds outside the allocator appearing
while the Executor is built (omnibench/runtime/groups.py creates one process group per layout
dimension, each an NCCL communicator created at once because init_process_group got `device_id`).
This reads the driver's figure (mem_get_info, in use - reserved) after the CUDA context, the first
process group with a first all-reduce, and each of `--groups` further new_group calls (and their
first all-reduce), once per setting in its own process: the defaults, then each of KNOBS.

    python benchmarks/gpu_nccl_memory.py --out DIR        # one CUDA GPU; DIR/nccl_memory.json

On one GPU the groups have one member; what a communicator over peers adds (its connections'
buffers) needs several GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GiB = 2**30
KNOBS = ["", "NCCL_BUFFSIZE=1048576", "NCCL_NVLS_ENABLE=0", "NCCL_CUMEM_ENABLE=0", "NCCL_MAX_NCHANNELS=2", "LAZY=1"]


def one(groups: int) -> dict:
    """In this process: the outside figure after each phase (LAZY=1: init_process_group without
    device_id, so communicators are created at their first collective)."""
    import torch
    import torch.distributed as dist

    def outside() -> float:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free - torch.cuda.memory_reserved()) / GiB

    torch.empty(1, device="cuda")
    context = outside()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    eager = {} if os.environ.get("LAZY") == "1" else {"device_id": torch.device("cuda", 0)}
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), timeout=timedelta(seconds=60), **eager)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    first = outside()
    made = [dist.new_group([0]) for _ in range(groups)]
    created = outside()
    for g in made:
        dist.all_reduce(x, group=g)
    used = outside()
    dist.destroy_process_group()
    return {"context_gib": context, "first_group_gib": first - context, "per_group_created_gib": (created - first) / groups,
            "per_group_used_gib": (used - first) / groups, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one setting
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.groups)))
        return {}
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: gpu_nccl_memory.py needs a CUDA device")
    from omnibench.provenance import provenance

    rows = []
    for knob in KNOBS:
        env = dict(os.environ)
        if knob:
            k, v = knob.split("=")
            env[k] = v
        done = subprocess.run([sys.executable, __file__, "--one", "--groups", str(a.groups), "--out", a.out], env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            rows.append({"setting": knob or "defaults", "error": done.stderr.strip().splitlines()[-1:]})
            continue
        r = {"setting": knob or "defaults", **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(r)
        print(f"{r['setting']:>24}: context {r['context_gib']:.3f}  first group {r['first_group_gib']:.3f}  "
              f"per further group created {r['per_group_created_gib']:.3f}, after its first all-reduce "
              f"{r['per_group_used_gib']:.3f} GiB", flush=True)
    out = {"provenance": provenance(torch.cuda.get_device_name(), ["benchmarks/gpu_nccl_memory.py", *(argv or sys.argv[1:])],
                                    cuda=True), "groups": a.groups, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "nccl_memory.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

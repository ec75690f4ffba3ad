"""The simulator's own cost against cluster size, side by side in one run (issue 21's targets).

    python benchmarks/sim_scale.py [--gpus 1024,16384,131072] [--limit-s 600]

One omni `mixed_video` step with full recomputation (the issue's reference case) per size, each in
a fresh process so its peak memory (max RSS) is its own, and then all five systems at 1,024 GPUs
(each at its default layout, full recomputation) in one process. Per size: workload generation,
planning and simulation wall times, total wall time, max RSS, and the ratio to the 1,024-GPU time.
Targets printed beside the figures: 16,384 GPUs in <= 10 s and <= 4x the 1,024 time, 131,072 in
<= 60 s and <= 4 GB, all five at 1,024 in <= 5 s together. A size that runs past `--limit-s` is
reported as such, not guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")


def one(system: str, gpus: int, workload: str, model_name: str) -> dict:
    """Generate, plan (at the system's default layout) and simulate one step; wall times."""
    import resource

    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from simulator.engine import SimOptions, simulate
    from simulator.hardware import load_cluster
    from systems import get_planner
    from systems.defaults import with_default_layout
    from workloads.stream import WorkloadStream

    model = get_model(model_name)
    cluster = load_cluster("h100", gpus)
    t0 = time.perf_counter()
    batch = WorkloadStream(workload, seed=0, global_batch_tokens=4096 * gpus).batch(0)
    t1 = time.perf_counter()
    parallel, _ = with_default_layout(system, model, ParallelSpec(world_size=gpus), batch)
    plan = get_planner(system).plan(model, parallel, batch)
    t2 = time.perf_counter()
    r = simulate(plan, model, cluster, options=SimOptions(recompute="full"))
    t3 = time.perf_counter()
    return {"system": system, "gpus": gpus, "batch_s": t1 - t0, "plan_s": t2 - t1, "sim_s": t3 - t2,
            "total_s": t3 - t0, "step_s": r.step_time, "distinct": r.classes,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1024,16384,131072")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--model", default="omni-7b")
    ap.add_argument("--limit-s", type=int, default=600, help="per size; a size past it is reported, not guessed")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        system, gpus = args.child.split(":")
        print(json.dumps(one(system, int(gpus), args.workload, args.model)))
        return
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start (timings scale with it)")
    print(f"omni, {args.model}, {args.workload}, h100, default layout, full recompute, 4,096 tokens/GPU")
    print(f"{'GPUs':>7} {'batch s':>8} {'plan s':>8} {'sim s':>8} {'total s':>8} {'x1024':>6} {'RSS GiB':>8} "
          f"{'distinct':>9}  target")
    base = None
    for n in [int(x) for x in args.gpus.split(",")]:
        cmd = [sys.executable, __file__, "--child", f"omni:{n}", "--workload", args.workload, "--model", args.model]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit_s, check=True)
        except subprocess.TimeoutExpired:
            print(f"{n:>7}  did not finish in {args.limit_s} s")
            continue
        except subprocess.CalledProcessError as e:
            print(f"{n:>7}  failed: {(e.stderr or '').strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = r["total_s"] if n == 1024 else base
        ratio = f"{r['total_s'] / base:.1f}" if base else "-"
        target = {16384: "<= 10 s, <= 4x", 131072: "<= 60 s, <= 4 GB"}.get(n, "")
        print(f"{n:>7} {r['batch_s']:>8.2f} {r['plan_s']:>8.2f} {r['sim_s']:>8.2f} {r['total_s']:>8.2f} "
              f"{ratio:>6} {r['max_rss_gib']:>8.2f} {r['distinct']:>9}  {target}")
    t0 = time.perf_counter()
    rows = [one(s, 1024, args.workload, args.model) for s in SYSTEMS]
    total = time.perf_counter() - t0
    print(f"all five systems at 1,024 GPUs: {total:.2f} s together (target <= 5 s): "
          + ", ".join(f"{r['system']} {r['total_s']:.2f}" for r in rows))


if __name__ == "__main__":
    main()

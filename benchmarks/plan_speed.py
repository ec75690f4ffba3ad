"""How long each baseline planner takes for one step at cluster scale (no torch involved).

    python benchmarks/plan_speed.py [--gpus 1024] [--model omni-72b] [--tp 8] [--pp 4]
"""

from __future__ import annotations

import argparse
import time

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
    args = ap.parse_args()
    model = get_model(args.model)
    batch = WorkloadStream(args.workload, seed=0, global_batch_tokens=args.global_batch_tokens).batch(0)
    print(f"{len(batch.samples)} samples, {batch.llm_tokens} LLM tokens, {args.gpus} GPUs, tp={args.tp} pp={args.pp}")
    for system in ("homogeneous", "temporal", "colocated", "noncolocated"):
        pp = 1 if system == "temporal" else args.pp
        parallel = ParallelSpec(world_size=args.gpus, tp=args.tp, pp=pp)
        planner = get_planner(system)
        start = time.perf_counter()
        plan = planner.plan(model, parallel, batch)
        took = time.perf_counter() - start
        n = sum(len(a) for a in plan.actions.values())
        print(f"{system:14s} {took * 1e3:7.0f} ms  {n} actions, {len(plan.routes)} routes (validated)")


if __name__ == "__main__":
    main()

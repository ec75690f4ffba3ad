"""Simulated step time of omni vs the baselines and omni's ablations on one batch at cluster scale.

    python benchmarks/bench_omni_sim.py --gpus 1024 --model omni-7b --workload mixed_video --step 800 --tp 4 --pp 4

Every system plans the same batch (global batch = gpus x --tokens-per-gpu, real sample sizes); the
calibrated simulator (datasheet curves unless --calibration is given) runs each Plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ABLATIONS = {"omni": {}, "omni-no-joint-pipeline": {"joint_pipeline": False}, "omni-no-reorder": {"reorder": False},
             "omni-no-reshard": {"reshard": False}, "omni-no-long-short-sp": {"long_short_sp": False}}


def main() -> None:
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from simulator import load_cluster, simulate
    from systems import get_planner
    from workloads.stream import WorkloadStream

    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--model", default="omni-7b")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--step", type=int, default=800)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--tokens-per-gpu", type=int, default=4096, help="global batch = gpus x this")
    args = ap.parse_args()
    model = get_model(args.model)
    batch = WorkloadStream(args.workload, seed=3, global_batch_tokens=args.gpus * args.tokens_per_gpu, length_scale=1.0).batch(args.step)
    cluster = load_cluster(args.hardware, args.gpus)
    print(f"{args.workload} step {args.step}: {len(batch.samples)} samples, {batch.llm_tokens} tokens; {args.model} "
          f"on {args.gpus} x {args.hardware}, tp={args.tp} pp={args.pp}")
    print(f"{'system':24s} {'step s':>7s} {'MFU':>6s} {'plan s':>7s} {'sim s':>6s}")
    runs = [(s, s, {}) for s in ("homogeneous", "temporal", "colocated", "noncolocated")]
    runs += [(name, "omni", opts) for name, opts in ABLATIONS.items()]
    for name, system, opts in runs:
        pp = 1 if system == "temporal" else args.pp
        parallel = ParallelSpec(world_size=args.gpus, tp=args.tp, pp=pp, options=opts)
        t0 = time.perf_counter()
        try:
            plan = get_planner(system).plan(model, parallel, batch)
        except ValueError as e:  # a layout this batch cannot feed: say so, go on
            print(f"{name:24s} cannot plan: {e}")
            continue
        t1 = time.perf_counter()
        res = simulate(plan, model, cluster)
        t2 = time.perf_counter()
        print(f"{name:24s} {res.step_time:7.3f} {res.mfu:6.1%} {t1 - t0:7.2f} {t2 - t1:6.2f}")
    print("command: python benchmarks/bench_omni_sim.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()

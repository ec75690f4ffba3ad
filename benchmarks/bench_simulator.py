"""How fast the simulator executes one training step at cluster scale (CPU wall time).

    python benchmarks/bench_simulator.py [--gpus 1024,8192] [--system homogeneous] [--model omni-7b]
                                         [--dp-shard 0]   # 0: automatic HSDP; -1: plain FSDP
                                         [--recompute full]

Prints, per cluster size: workload generation, planning (the planner's job) and simulation
(class detection + program building + simpy run) wall times, the distinct ranks simulated, and the
simulated step's figures. Only the simulation time is the simulator's figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.stream import WorkloadStream


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1024,8192")
    ap.add_argument("--system", default="homogeneous")
    ap.add_argument("--model", default="omni-7b")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=1, help="interleaved 1F1B chunks per pipeline rank")
    ap.add_argument("--tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--encoder-ranks-fraction", type=float, default=0.25)
    ap.add_argument("--dp-shard", type=int, default=0,
                    help="HSDP shard group size; 0: automatic (within 8 nodes), -1: plain FSDP over the whole group")
    ap.add_argument("--recompute", default="none", choices=("none", "full", "selective"),
                    help="activation recomputation the simulated step assumes (memory vs compute)")
    args = ap.parse_args()
    model = get_model(args.model)
    print(f"system {args.system}, model {model.name}, workload {args.workload}, hardware {args.hardware}, "
          f"tp {args.tp} pp {args.pp} (x{args.virtual_stages} virtual) microbatches {args.microbatches}, {args.tokens_per_gpu} tokens/GPU/step, "
          f"dp_shard {args.dp_shard}, recompute {args.recompute}")
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start (timings scale with it)")
    print(f"{'GPUs':>6} {'batch s':>8} {'plan s':>8} {'sim s':>8} {'distinct':>9} {'step s':>8} "
          f"{'tok/s/GPU':>10} {'MFU':>6} {'bubble':>7} {'exp.comm':>8} {'mem GiB':>8} {'fits':>4}  dp_shard")
    for n in [int(x) for x in args.gpus.split(",")]:
        t0 = time.perf_counter()
        batch = WorkloadStream(args.workload, seed=0, global_batch_tokens=args.tokens_per_gpu * n).batch(0)
        t1 = time.perf_counter()
        enc = int(n * args.encoder_ranks_fraction) if args.system == "noncolocated" else 0
        parallel = ParallelSpec(world_size=n, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                                encoder_ranks=enc, dp_shard=args.dp_shard, virtual_stages=args.virtual_stages)
        plan = get_planner(args.system).plan(model, parallel, batch)
        shards = " ".join(f"{m}={lay.shard_size}/{lay.fsdp_size}" for m, lay in plan.layouts.items() if lay.fsdp)
        t2 = time.perf_counter()
        res = simulate(plan, model, load_cluster(args.hardware, n), options=SimOptions(recompute=args.recompute))
        t3 = time.perf_counter()
        print(f"{n:>6} {t1 - t0:>8.2f} {t2 - t1:>8.2f} {t3 - t2:>8.2f} {res.classes:>9} {res.step_time:>8.3f} "
              f"{res.tokens_per_s_per_gpu:>10,.0f} {res.mfu:>6.1%} {res.bubble:>7.1%} {res.exposed_comm:>8.1%} "
              f"{res.peak_memory / 2**30:>8.1f} {'yes' if res.fits else 'no':>4}  {shards}", flush=True)


if __name__ == "__main__":
    main()

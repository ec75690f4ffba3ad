"""tune's analytic memory bound against the simulator's count, system by system and mode by mode.

    python benchmarks/memory_bound.py [--systems ...] [--workloads ...] [--gpus 1024] [--hardware h100]
    python benchmarks/memory_bound.py --gpus 64 --tp 2 --pp 4    # a pipelined layout instead of the defaults
    python benchmarks/memory_bound.py --systems omni --gpus 64 --tp 2 --pp 4 --microbatches 4  # every one in flight

`tune` drops every recompute mode whose bound (`omnibench.tune.memory_estimate`) is over the device and
keeps the cheapest one left (`_Search.settle`); the simulator only ever retries towards more
recomputation. So a bound above the simulated need prunes a mode that fits, and the tuned system runs
slower than it could. Per system (at its default layout as `tune` weighs it: no microbatch count named), per
workload and per mode this prints the bound, the simulated need of the first batch
(`omnibench.resolve.peak_memory`, the figure `simulate` checks) and their ratio; a ratio under 1 is
a bound that is not one, and `WRONG PRUNE` marks a mode the bound drops although it fits.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from omnibench.cli.simulate import planner_options
    from omnibench.plan import PlanError
    from omnibench.resolve import default_layout, peak_memory, recompute_modes
    from omnibench.specs.model import SpecError
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from omnibench.tune import Candidate, memory_estimate
    from simulator.hardware import load_cluster
    from systems import SYSTEMS
    from workloads.stream import WorkloadStream

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="homogeneous,temporal,colocated,noncolocated,omni")
    ap.add_argument("--workloads", default="mixed_video,long_video,image_sft,omni_av")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="omni-7b")
    ap.add_argument("--tp", type=int, default=0, help="this tp instead of each system's default layout's")
    ap.add_argument("--pp", type=int, default=0, help="this pp instead of each system's default layout's")
    ap.add_argument("--microbatches", type=int, default=0,
                    help="this many microbatches per data rank instead of the planner's default")
    args = ap.parse_args()
    if args.microbatches < 0:
        raise SystemExit(f"--microbatches: a count of microbatches per data rank, >= 1 (0: the planner's); "
                         f"got {args.microbatches}")
    # bad input is refused here, in one line naming the flag, before anything is simulated
    for s in args.systems.split(","):
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    try:
        flag = "--model"
        model = get_model(args.model)
        flag = "--hardware"
        cluster = load_cluster(args.hardware, args.gpus)
        flag = "--workloads"
        for wl in args.workloads.split(","):
            WorkloadStream(wl, seed=0, global_batch_tokens=8192 * args.gpus)
    except ValueError as e:
        raise SystemExit(f"{flag}: {str(e).splitlines()[0]}") from None
    gpn, budget = cluster.gpus_per_node, cluster.gpu.memory_bytes
    layout = f"tp {args.tp or 'default'}, pp {args.pp or 'default'}" if args.tp or args.pp else "each system's default layout"
    layout += f", {args.microbatches} microbatches" if args.microbatches else ""
    print(f"{args.model} on {args.gpus} x {args.hardware} ({budget / 2**30:.1f} GiB), 8,192 tokens per GPU, {layout}; "
          "GiB as the fits check counts them")
    print(f"{'system':13s} {'workload':12s} {'recompute':24s} {'bound':>8s} {'simulated':>10s} {'ratio':>7s}")
    lowest, wrong = float("inf"), 0
    for wl in args.workloads.split(","):
        batch = WorkloadStream(wl, seed=0, global_batch_tokens=8192 * args.gpus).batch(0)
        modes = recompute_modes(model, batch.samples)
        for system in args.systems.split(","):
            given = ParallelSpec(world_size=args.gpus, gpus_per_node=gpn,
                                 options=planner_options(system, {}, args.hardware))
            try:
                laid, _ = default_layout(system, model, given, batch, args.tp, args.pp, memory_bytes=budget)
                if args.microbatches:
                    laid = replace(laid, microbatches=args.microbatches)
                # the planner's verdict on the layout: the recompute mode never decides whether a step plans
                needs = [peak_memory(system, model, replace(laid, recompute=mode), [batch], cluster)[0]
                         for mode in modes]
            except (PlanError, SpecError, ValueError) as e:
                print(f"{system:13s} {wl:12s} cannot plan: {str(e).splitlines()[0]}")
                continue
            for mode, need in zip(modes, needs, strict=True):
                trial = replace(laid, recompute=mode)
                c = Candidate(system, tp=trial.tp, pp=trial.pp, cp=trial.cp, ep=trial.ep,
                              microbatches=trial.microbatches, virtual_stages=trial.virtual_stages, recompute=mode,
                              encoder_tp=trial.encoder_tp, encoder_sp=trial.encoder_sp,
                              encoder_ranks=trial.encoder_ranks, cp_kind=trial.cp_kind)
                bound = memory_estimate(system, model, args.gpus, gpn, c, batch.samples, options=trial.options,
                                        device=cluster.gpu.name, mixed_precision=trial.mixed_precision)
                lowest = min(lowest, need / bound)
                flag = "WRONG PRUNE" if bound > budget >= need else ""
                wrong += bool(flag)
                print(f"{system:13s} {wl:12s} {mode:24s} {bound / 2**30:8.1f} {need / 2**30:10.1f} "
                      f"{need / bound:7.3f} {flag}", flush=True)
    print(f"lowest simulated / bound: {lowest:.3f}; modes pruned although they fit: {wrong}")


if __name__ == "__main__":
    main()

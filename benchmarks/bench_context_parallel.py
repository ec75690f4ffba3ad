"""Simulated step of one long sequence under context parallelism: Ulysses against ring attention.

    python benchmarks/bench_context_parallel.py [--model qwen2-7b] [--tokens 32768,131072]

homogeneous, tp 4, one microbatch holding one sequence, full recomputation, h100 preset (kernel
profile, NCCL collectives), memory check off. Ulysses is what the runtime runs; ring is simulated only.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.specs.parallel import ParallelSpec  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402
from simulator.engine import SimOptions, simulate  # noqa: E402
from simulator.hardware import load_cluster  # noqa: E402
from systems import get_planner  # noqa: E402
from workloads.sample import Batch, Sample, Segment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-7b")
    ap.add_argument("--tokens", default="32768,131072")
    args = ap.parse_args()
    model = get_model(args.model)
    print(f"{'tokens':>8} {'cp':>3} {'kind':>8} {'step s':>8} {'exp.comm':>8} {'MFU':>6}")
    for tokens in (int(x) for x in args.tokens.split(",")):
        for cp, kind in ((1, "ulysses"), (4, "ulysses"), (4, "ring"), (8, "ring")):
            par = ParallelSpec(world_size=4 * cp, tp=4, cp=cp, cp_kind=kind, microbatches=1, recompute="full")
            batch = Batch(0, [Sample(0, "text", (Segment("text", tokens),))])
            plan = get_planner("homogeneous").plan(model, par, batch)
            res = simulate(plan, model, load_cluster("h100", 4 * cp),
                           options=SimOptions(recompute="full", check_memory=False))
            print(f"{tokens:>8} {cp:>3} {kind:>8} {res.step_time:>8.3f} {res.exposed_comm:>8.1%} {res.mfu:>6.1%}")


if __name__ == "__main__":
    main()

"""Simulated step of one long sequence under context parallelism: Ulysses against all-gathered K/V and ring
attention.

    python benchmarks/bench_context_parallel.py [--model qwen2-7b] [--tokens 32768,131072] [--tp 1] [--cp 4,8]

homogeneous, one microbatch holding one sequence (no data parallelism: world = tp x cp), full
recomputation, h100 preset (kernel profile, NCCL collectives), memory check off. Each cp > 1 is run with
every kind the model accepts: Ulysses splits each tp rank's heads over the cp ranks, so cp must divide the
heads and kv heads per tp rank (Qwen2-7B's 28 / 4 heads: cp 1, 2 or 4 at tp 1, none above 1 at tp 4);
all-gathered K/V and ring take any cp. The runtime runs Ulysses and all-gathered K/V; ring is simulated
only. A layout `ParallelSpec.validate` refuses is listed under the table, not run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.specs.model import SpecError  # noqa: E402
from omnibench.specs.parallel import ParallelSpec  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402
from simulator.engine import SimOptions, simulate  # noqa: E402
from simulator.hardware import load_cluster  # noqa: E402
from systems import get_planner  # noqa: E402
from workloads.sample import Batch, Sample, Segment  # noqa: E402

CP_KINDS = ("ulysses", "allgather", "ring")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-7b")
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", default="4,8", help="context-parallel sizes beside cp 1, comma-separated")
    args = ap.parse_args()
    model = get_model(args.model)
    layouts = [(1, "ulysses")] + [(int(c), kind) for c in args.cp.split(",") for kind in CP_KINDS]
    refused: dict[tuple[int, str], str] = {}
    print(f"{model.name}, tp {args.tp}")
    print(f"{'tokens':>8} {'cp':>3} {'kind':>9} {'step s':>8} {'exp.comm':>8} {'MFU':>6}")
    for tokens in (int(x) for x in args.tokens.split(",")):
        for cp, kind in layouts:
            world = args.tp * cp
            par = ParallelSpec(world_size=world, tp=args.tp, cp=cp, cp_kind=kind, microbatches=1, recompute="full")
            try:
                par.validate(model)
            except SpecError as e:
                refused[(cp, kind)] = str(e)
                continue
            batch = Batch(0, [Sample(0, "text", (Segment("text", tokens),))])
            plan = get_planner("homogeneous").plan(model, par, batch)
            res = simulate(plan, model, load_cluster("h100", world),
                           options=SimOptions(recompute="full", check_memory=False))
            print(f"{tokens:>8} {cp:>3} {kind:>9} {res.step_time:>8.3f} {res.exposed_comm:>8.1%} {res.mfu:>6.1%}")
    for (cp, kind), why in refused.items():
        print(f"not run: cp {cp} {kind}: {why}")


if __name__ == "__main__":
    main()

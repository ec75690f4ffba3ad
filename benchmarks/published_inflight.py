"""How many microbatches an interleaved pipeline keeps in flight on its first rank, and what they cost,
for the Llama 3 405B 8K row reduced to a few data ranks (the schedule and the per-rank activations do
not depend on dp; FSDP's static share does, so compare the two depths' difference, not the totals).

    python benchmarks/published_inflight.py [--gpus 256] [--microbatches 32] [--vpp 1,4]

Counts, on rank 0, the most forward actions of the LLM not yet matched by their backward (chunk-
microbatches, each of the rank's chunk of layers) and prints the simulated allocated peak. Megatron's
interleaved 1F1B warms up (pp - rank - 1) * 2 + (vpp - 1) * pp chunk-microbatches before its first
backward (megatron/core/pipeline_parallel/schedules.py), one more in flight at the first backward.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.plan import BACKWARD, FORWARD  # noqa: E402
from simulator.engine import Engine  # noqa: E402
from simulator.hardware import load_cluster  # noqa: E402
from simulator.published import load_published, model_of, options_of, parallel_of  # noqa: E402
from systems import get_planner  # noqa: E402
from workloads.registry import get_workload  # noqa: E402
from workloads.stream import WorkloadStream  # noqa: E402

ROW = "llama3-405b-8192gpu-cp1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="results/validation/published_runs.csv")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=32, help="per data rank (the 8,192-GPU row has 32)")
    ap.add_argument("--vpp", default="1,4")
    a = ap.parse_args()
    row = next(r for r in load_published(a.table) if r.name == ROW)
    if a.gpus < 1 or a.gpus % (row.tp * row.pp):
        ap.error(f"--gpus must be a positive multiple of tp * pp = {row.tp * row.pp}, got {a.gpus}")
    try:
        depths = [int(v) for v in a.vpp.split(",")]
    except ValueError:
        ap.error(f"--vpp: positive integers separated by commas, got {a.vpp!r}")
    row = replace(row, gpus=a.gpus, global_batch=a.gpus // (row.tp * row.pp) * a.microbatches)
    print(f"{ROW} at {a.gpus} GPUs, {a.microbatches} microbatches per data rank, pp {row.pp}")
    print(f"{'vpp':>3} {'in flight (rank 0)':>19} {'Megatron warm-up + 1':>21} {'allocated GiB':>13} {'peak at':>30}")
    for v in depths:
        r = replace(row, vpp=v)
        cluster = load_cluster(r.hardware, r.gpus)
        model, parallel = model_of(r), parallel_of(r, cluster.gpus_per_node)
        stream = WorkloadStream(get_workload(f"pretrain_{r.seq}"), seed=0, global_batch_tokens=r.global_batch * r.seq)
        plan = get_planner("homogeneous").plan(model, parallel, stream.batch(0))
        res = Engine(plan, model, cluster, options=options_of(r)).run()
        live = peak = 0
        for act in plan.actions[0]:
            if act.module == "llm" and act.kind in (FORWARD, BACKWARD):
                live += 1 if act.kind == FORWARD else -1
                peak = max(peak, live)
        warm = (row.pp - 1) * 2 + (v - 1) * row.pp + 1 if v > 1 else min(row.pp, a.microbatches)
        rank0 = next(x for x in res.ranks if x.rank == 0)
        print(f"{v:>3} {peak:>19} {warm:>21} {rank0.memory_allocated / 2**30:>13.1f} {rank0.memory_peak_at:>30}")


if __name__ == "__main__":
    main()

"""Simulated NCCL bus bandwidth by message size and group shape, beside published NCCL-tests figures.

    python benchmarks/bench_collectives.py [--hardware h100]

Bus bandwidth as NCCL-tests reports it (all-reduce: 2 (n - 1) / n x bytes / time; all-gather:
(n - 1) / n x bytes / time) and the algorithm the model picks, for groups inside a node, over whole
nodes, and one GPU per node (one rail). Published figures to compare with (sources in the
hardware presets and results/BENCHMARKS.md): 8 x H100 NVLS all-reduce about 480 GB/s at large sizes,
rings about 370 GB/s (NVIDIA/nccl-tests#212); one 400 Gb/s NIC 46-48 GB/s (NVIDIA/nccl-tests#290).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.collectives import CollectiveModel  # noqa: E402
from simulator.hardware import load_cluster  # noqa: E402

SIZES = [2**k for k in (16, 20, 22, 24, 26, 28, 30, 32)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="h100")
    args = ap.parse_args()
    cluster = load_cluster(args.hardware, 2048)
    m = CollectiveModel(cluster)
    gpn = cluster.gpus_per_node
    shapes = {
        f"{gpn} GPUs, 1 node": tuple(range(gpn)),
        f"{2 * gpn} GPUs, 2 nodes": tuple(range(2 * gpn)),
        f"{16 * gpn} GPUs, 16 nodes": tuple(range(16 * gpn)),
        "16 nodes x 1 rail": tuple(range(0, 16 * gpn, gpn)),
        "256 nodes x 1 rail": tuple(range(0, 256 * gpn, gpn)),
    }
    print(f"{args.hardware}: bus bandwidth GB/s (algorithm) by message size")
    print(f"{'op / group':34s}" + "".join(f"{s / 2**20:>13,.2f}M" for s in SIZES))
    for op in ("all_reduce", "all_gather"):
        for name, ranks in shapes.items():
            n = len(ranks)
            cells = []
            for s in SIZES:
                t, algo = getattr(m, op)(s, ranks)
                moved = (2 if op == "all_reduce" else 1) * (n - 1) / n * s
                cells.append(f"{moved / t / 1e9:>8.1f} {algo[:4]:>4}")
            print(f"{op + ' ' + name:34s}" + " ".join(cells))


if __name__ == "__main__":
    main()

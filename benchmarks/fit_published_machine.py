"""Fit the machine-level constants of the simulator on the calibration rows of the published set, and
nothing else (issue 24 item 3: never a constant per row or per source).

    python benchmarks/fit_published_machine.py [--workers N]

Two kinds of constant, both properties of a machine rather than of a run:
- `kernel_compute_scale`, one per GPU generation (V100; A100, both memory sizes; H100 at 700 W, with
  the H200 and H800 that share its silicon and power; H100 at a 500 W cap): the share of its kernel
  profile's GEMM and attention rates the GPU holds through a whole training step (clocks under
  sustained load and power caps; a profile is measured kernel by kernel);
- `comm_contention`, one for every GPU: the share of compute lost while communication runs beside it
  (NCCL's kernels hold SMs and HBM bandwidth).

Rows: `split == calibration` in results/validation/published_runs.csv, less those whose FLOP rate has
no stated formula. Each is simulated three times (as the presets are, with the compute scale at 0.8 of
that, with the contention 0.2 higher) and its step time modelled as t0 + B (s0/s - 1) + C (c - c0),
linear in 1/s and c; the fit minimises the mean |log(simulated / published)| over all rows on a grid
(c in steps of 0.01, s per generation in steps of 0.005). It prints the values to put in the presets'
TOML files (simulator/data/hardware/), then the held-out rows are never looked at.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.sweep import map_ordered  # noqa: E402
from simulator.hardware import load_cluster  # noqa: E402
from simulator.published import check_row, load_published  # noqa: E402

CSV = "results/validation/published_runs.csv"
GENERATION = {"v100-32g": "v100", "a100-80g": "a100", "a100-40g": "a100", "h100": "h100", "h200": "h100",
              "h800": "h100", "h100-500w": "h100-500w"}
PRESETS = {"v100": ["v100-32g"], "a100": ["a100-80g", "a100-40g"], "h100": ["h100", "h200", "h800"],
           "h100-500w": ["h100-500w"]}


def three_points(row, ds: float = 0.8, dc: float = 0.2) -> tuple[float, float, float, float, float]:
    gpu = load_cluster(row.hardware).gpu
    s0, c0 = gpu.kernel_compute_scale, gpu.comm_contention
    base = check_row(row)
    slow = check_row(row, gpu={"kernel_compute_scale": s0 * ds})
    cont = check_row(row, gpu={"comm_contention": min(0.99, c0 + dc)})
    b = (slow.simulated_s - base.simulated_s) / (1 / ds - 1)
    c = (cont.simulated_s - base.simulated_s) / dc
    return base.measured_s, base.simulated_s, b, c, s0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    rows = [r for r in load_published(CSV) if r.split == "calibration" and not r.unstated]
    pts = map_ordered(three_points, rows, workers=args.workers, label="calibration rows")
    c0 = load_cluster("h100").gpu.comm_contention

    def predict(i: int, rel_s: float, c: float) -> float:
        pub, t0, b, cc, _ = pts[i]
        return max(1e-9, t0 + b * (1 / rel_s - 1) + cc * (c - c0))

    gens = sorted({GENERATION[r.hardware] for r in rows})
    best = None
    for ci in range(0, 41):
        c = ci / 100
        total, fit = 0.0, {}
        for g in gens:
            idx = [i for i, r in enumerate(rows) if GENERATION[r.hardware] == g]
            cand = []
            for si in range(100, 261):  # relative scale 0.5 .. 1.3
                s = si / 200
                err = sum(abs(math.log(predict(i, s, c) / pts[i][0])) for i in idx) / len(idx)
                cand.append((err, s))
            err, s = min(cand)
            fit[g] = s
            total += err * len(idx)
        if best is None or total < best[0]:
            best = (total / len(rows), c, fit)
    mean, c, fit = best
    print(f"calibration rows: {len(rows)}; fitted mean |log error| {mean:.3f}")
    print(f"comm_contention = {c:.2f}   # every preset's [gpu]")
    for g in gens:
        s0 = pts[[GENERATION[r.hardware] for r in rows].index(g)][4]
        for name in PRESETS[g]:
            print(f"{name}: kernel_compute_scale = {s0 * fit[g]:.3f}")
    for i, r in enumerate(rows):
        print(f"  {r.name:36s} {r.hardware:10s} published {pts[i][0]:8.3f} s, before {pts[i][1]:8.3f} s, "
              f"fitted {predict(i, fit[GENERATION[r.hardware]], c):8.3f} s")


if __name__ == "__main__":
    main()

"""Fit the simulator's machine-level constant on the calibration rows of the published set, and nothing
else (never a constant per row or per source).

    python benchmarks/fit_published_machine.py [--workers N]

The constant is `kernel_compute_scale`, one per GPU generation (V100; A100, both memory sizes; H100 at
700 W, with the H200 and H800 that share its silicon and power; H100 at a 500 W cap): the share of its
kernel profile's GEMM and attention rates the GPU holds through a whole training step. A profile is
measured (or published) kernel by kernel, on one GPU, in bursts; a training step keeps every GPU of
the node at its power limit for seconds, where the clocks settle lower (most of all under a 500 W cap).

Rows: `split == calibration` in results/validation/published_runs.csv, less those whose FLOP rate has
no stated formula. Each is simulated twice (as the presets say, and with the scale at 0.8 of that) and
its step time modelled as t0 + B (s0/s - 1), linear in the compute time; the fit minimises the mean
|log(simulated / published)| of each generation's rows on a grid (steps of 0.005 of the preset's
value) and prints the values to write in the fitted-constants registry (simulator/fitted.py), which the
presets name (`kernel_compute_scale = "fitted:..."`). The
held-out rows are never looked at. The H100 at 700 W (and the H200/H800 with it) keeps 1.0: this
project's own measured one-H100 steps disagree with its 3 calibration rows (simulator/data/hardware/h100.toml). (A second constant, a share of compute lost to communication
running beside it, was fitted with this one on the same rows and came out at 0; it was dropped.)
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


def two_points(row, ds: float = 0.8) -> tuple[float, float, float, float]:
    s0 = load_cluster(row.hardware).gpu.kernel_compute_scale
    base = check_row(row)
    slow = check_row(row, gpu={"kernel_compute_scale": s0 * ds})
    return base.measured_s, base.simulated_s, (slow.simulated_s - base.simulated_s) / (1 / ds - 1), s0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    rows = [r for r in load_published(CSV) if r.split == "calibration" and not r.unstated]
    pts = map_ordered(two_points, rows, workers=args.workers, label="calibration rows")

    def predict(i: int, rel: float) -> float:
        _, t0, b, _ = pts[i]
        return max(1e-9, t0 + b * (1 / rel - 1))

    total = 0.0
    for g in sorted({GENERATION[r.hardware] for r in rows}):
        idx = [i for i, r in enumerate(rows) if GENERATION[r.hardware] == g]
        err, rel = min((sum(abs(math.log(predict(i, k / 200) / pts[i][0])) for i in idx) / len(idx), k / 200)
                       for k in range(100, 301))
        total += err * len(idx)
        for name in PRESETS[g]:
            print(f"{name}: kernel_compute_scale = {pts[idx[0]][3] * rel:.3f}   "
                  f"({len(idx)} calibration rows, mean |log error| {err:.3f})")
        for i in idx:
            print(f"  {rows[i].name:36s} {rows[i].hardware:10s} published {pts[i][0]:8.3f} s, as now "
                  f"{pts[i][1]:8.3f} s, fitted {predict(i, rel):8.3f} s")
    print(f"calibration rows: {len(rows)}; fitted mean |log error| {total / len(rows):.3f}")


if __name__ == "__main__":
    main()

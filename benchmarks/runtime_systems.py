"""Wall time and throughput of real `omnibench run`s, one per system (default: the CPU defaults).

    python benchmarks/runtime_systems.py [--systems homogeneous,colocated] [--steps 5] [-- extra run args]

Prints one row per system: wall time of the whole command (process start to record written),
mean step time and tokens/s over the timed steps (all but the first), as the run's summary reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="homogeneous,temporal,colocated,noncolocated")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="more `omnibench run` arguments (after --)")
    args = ap.parse_args()
    print(f"{'system':14s} {'ranks':>5s} {'wall s':>7s} {'step ms':>8s} {'tokens/s':>9s} {'tok/s/GPU':>9s} "
          f"{'bubble':>7s} loss")
    for system in args.systems.split(","):
        out = os.path.join(tempfile.mkdtemp(prefix="omnibench-bench-"), "run")
        cmd = [sys.executable, "-m", "omnibench", "run", "--system", system, "--workload", args.workload,
               "--steps", str(args.steps), "--out", out, "--json", *args.extra]
        start = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
        wall = time.perf_counter() - start
        if res.returncode:
            print(f"{system:14s} failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
            continue
        s = json.loads(res.stdout)
        print(f"{system:14s} {s['world_size']:5d} {wall:7.1f} {s['mean_step_time_s'] * 1e3:8.0f} "
              f"{s['tokens_per_s']:9.0f} {s['tokens_per_s_per_gpu']:9.0f} {s['bubble_fraction']:7.1%} "
              f"{s['final_loss']:.4f}")
    print("command: python -m omnibench run --system <system> --workload", args.workload, "--steps", args.steps,
          *args.extra)


if __name__ == "__main__":
    main()

"""What each planner costs per sample: the measurement behind simulator/planning.py.

    python benchmarks/planning_cost.py [--gpus 256,1024,4096] [--repeats 2] [--out results/planning_cost.json]

Every system's runtime plans step s+1 on a planner thread while step s computes (omnibench/runtime/
worker.py); the simulator charges what of it would not fit under the step. The planner's work grows
with the step's samples (each is weighed, placed and routed), so the charge is CPU seconds per sample,
one figure per system: this script plans steps of the static workloads at the sizes given (8,192 tokens
per GPU, omni-7b, tp 4, full recomputation), takes each cell's fastest of `--repeats` (host noise only
adds), and fits per system seconds = a x samples + b x GPUs (least squares on relative error: a plan
also holds every rank's actions), as simulator/planning.py holds them, with the fit's error. The figures
are this host's Python on one thread; a GPU node's host cores are of the same order.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnibench.specs.parallel import ParallelSpec  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402
from systems import available_systems, get_planner  # noqa: E402
from workloads.stream import WorkloadStream  # noqa: E402

WORKLOADS = ("mixed_video", "image_sft", "long_video", "omni_av")
TOKENS_PER_GPU = 8192


def measure(system: str, model, parallel: ParallelSpec, batch, repeats: int) -> float:
    planner = get_planner(system)
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            began = time.process_time()
            planner.plan(model, parallel, batch)
            best = min(best, time.process_time() - began)
        finally:
            gc.enable()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    model = get_model("omni-7b")
    rows = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        for wl in WORKLOADS:
            batch = WorkloadStream(wl, seed=3, global_batch_tokens=TOKENS_PER_GPU * gpus).batch(1)
            for system in available_systems():
                parallel = ParallelSpec(world_size=gpus, tp=4, recompute="full")
                try:
                    seconds = measure(system, model, parallel, batch, args.repeats)
                except ValueError as e:
                    print(f"{system:13s} {wl:12s} {gpus:5d}: refused ({str(e).splitlines()[0][:60]})")
                    continue
                per = seconds / len(batch.samples)
                rows.append({"system": system, "workload": wl, "gpus": gpus, "samples": len(batch.samples),
                             "seconds": seconds, "us_per_sample": per * 1e6})
                print(f"{system:13s} {wl:12s} {gpus:5d} GPUs {len(batch.samples):6d} samples "
                      f"{seconds:7.3f} s  {per * 1e6:6.1f} us/sample", flush=True)
    summary = {}
    print("\nper system: planner CPU seconds = a x samples + b x GPUs (fit on relative error)")
    for system in available_systems():
        mine = [r for r in rows if r["system"] == system]
        if not mine:
            continue
        x = np.array([[r["samples"], r["gpus"]] for r in mine], dtype=float)
        y = np.array([r["seconds"] for r in mine])
        coef = np.maximum(np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0], 0.0)
        err = np.abs(x @ coef / y - 1)
        summary[system] = {"us_per_sample": coef[0] * 1e6, "us_per_gpu": coef[1] * 1e6,
                           "mean_abs_error": float(err.mean()), "max_abs_error": float(err.max()), "cells": len(mine)}
        print(f"  {system:13s} a {coef[0] * 1e6:6.1f} us/sample  b {coef[1] * 1e6:6.1f} us/GPU  "
              f"error mean {err.mean():.0%} max {err.max():.0%} ({len(mine)} cells)")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python benchmarks/planning_cost.py " + " ".join(sys.argv[1:]),
                                              "rows": rows, "per_system": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Every system on the local GPU(s), two workloads, one table; then an H100 calibration profile
fitted on some of the runs and validated on the others.

    python benchmarks/gpu_figures.py --out DIR [--steps 5] [--systems all] [--workloads text_only,mixed_video]

`text_only` runs the LLM alone (`llm-7b@4L`: Qwen2-7B's shapes cut to 4 layers, the plain-stack
benchmark's model); `mixed_video` runs the CUDA default (`omni-7b` at the depth and recompute mode
the memory check picks for the device). Each run is `omnibench run ... --json`; a run the harness
refuses (noncolocated needs 2 ranks, i.e. 2 GPUs) is listed with its one-line reason.
Writes DIR/gpu_figures.json, DIR/gpu_figures.md, the record folders under DIR/runs/, and, when at
least 4 runs trained, DIR/calibration.json (fitted on the text_only runs and half the others) with
`omnibench validate`'s held-out table in DIR/validate.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")
MODELS = {"text_only": "llm-7b@4L", "mixed_video": ""}


def run(system: str, workload: str, steps: int, out: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "omnibench", "run", "--system", system, "--workload", workload,
           "--steps", str(steps), "--out", out, "--json", *extra]
    if MODELS.get(workload):
        cmd += ["--model", MODELS[workload]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    row = {"system": system, "workload": workload, "command": " ".join(cmd[1:])}
    if done.returncode:
        lines = [x for x in (done.stderr or done.stdout).strip().splitlines() if x.strip()]
        row["error"] = next((x for x in lines if x.startswith("error")), lines[-1] if lines else "failed")
        return row
    s = json.loads(done.stdout)
    row.update({k: s[k] for k in ("model", "world_size", "mean_step_time_s", "tokens_per_s", "tokens_per_s_per_gpu",
                                  "tflops_per_gpu", "mfu", "peak_memory_bytes", "recompute", "final_loss",
                                  "bubble_fraction", "notes")})
    row["record"] = out
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--systems", default="all")
    ap.add_argument("--workloads", default="text_only,mixed_video")
    ap.add_argument("--extra", default="", help="more `omnibench run` flags, space separated")
    a = ap.parse_args()
    systems = SYSTEMS if a.systems == "all" else tuple(a.systems.split(","))
    table = os.path.join(a.out, "gpu_figures.json")
    done = {}
    if os.path.exists(table):  # resume: keep the runs an earlier call finished
        with open(table) as f:
            done = {(r["system"], r["workload"]): r for r in json.load(f)}
    rows = []
    for workload in a.workloads.split(","):
        for system in systems:
            folder = os.path.join(a.out, "runs", f"{system}-{workload}")
            if (system, workload) in done and ("error" in done[(system, workload)] or os.path.isdir(folder)):
                rows.append(done[(system, workload)])
                continue
            shutil.rmtree(folder + ".incomplete", ignore_errors=True)
            rows.append(run(system, workload, a.steps, folder, a.extra.split()))
            r = rows[-1]
            print(f"{system:13s} {workload:12s} " + (r["error"] if "error" in r else
                  f"{r['model']:14s} {r['mean_step_time_s'] * 1e3:8.1f} ms {r['tokens_per_s_per_gpu']:8.0f} tok/s/GPU "
                  f"{r['tflops_per_gpu']:6.1f} TFLOP/s {r['mfu']:6.1%} MFU {r['peak_memory_bytes'] / 2**30:5.1f} GiB "
                  f"recompute={r['recompute']}"), flush=True)
            with open(table, "w") as f:  # after every run: a cut-off call keeps what it measured
                json.dump(rows + [v for k, v in done.items() if k not in {(x["system"], x["workload"]) for x in rows}],
                          f, indent=1)
    with open(os.path.join(a.out, "gpu_figures.md"), "w") as f:
        f.write("| system | workload | model | recompute | step ms | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if "error" in r:
                f.write(f"| {r['system']} | {r['workload']} | - | - | refused: {r['error']} | | | | |\n")
                continue
            f.write(f"| {r['system']} | {r['workload']} | {r['model']} | {r['recompute']} | "
                    f"{r['mean_step_time_s'] * 1e3:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']:.1f} | "
                    f"{r['mfu']:.1%} | {r['peak_memory_bytes'] / 2**30:.1f} |\n")
    ok = [r for r in rows if "error" not in r]
    if len(ok) < 4:
        return
    # Fit on every text_only run and every other mixed run; the rest are held out.
    mixed = [r for r in ok if r["workload"] != "text_only"]
    fit = [r["record"] for r in ok if r["workload"] == "text_only"] + [r["record"] for r in mixed[::2]]
    held = [r["record"] for r in mixed[1::2]]
    prof = os.path.join(a.out, "calibration.json")
    for cmd, log in ((["calibrate", *fit, "--out", prof], "calibrate.txt"),
                     (["validate", *fit, *held, "--calibration", prof], "validate.txt")):
        done = subprocess.run([sys.executable, "-m", "omnibench", *cmd], capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "200"})
        with open(os.path.join(a.out, log), "w") as f:
            f.write(f"$ omnibench {' '.join(cmd)}\n# held out: {held}\n{done.stdout}{done.stderr}")
        print(done.stdout[-3000:], done.stderr[-1500:], flush=True)


if __name__ == "__main__":
    main()

"""Every system on the local GPU(s), two workloads, one table; then an H100 calibration profile
fitted on some of the runs and validated on the others.

    python benchmarks/gpu_figures.py --out DIR [--steps 5] [--systems all] [--workloads text_only,mixed_video]

`text_only` runs the LLM alone (`llm-7b@4L`: Qwen2-7B's shapes cut to 4 layers, the plain-stack
benchmark's model); `mixed_video` runs the CUDA default (`omni-7b` at the depth and recompute mode
the memory check picks for the device). Each run is `omnibench run ... --json`; a run the harness
refuses (noncolocated needs 2 ranks, i.e. 2 GPUs) is listed with its one-line reason.
Writes DIR/gpu_figures.json (each row with its record's provenance: commit, torch, CUDA, driver,
GPU, the exact command), DIR/gpu_figures.md, the record folders under DIR/runs/, and, when at least
4 runs trained, DIR/calibration.json with `omnibench validate`'s table in DIR/validate.txt. The
profile is fitted on the first table's runs and validated on the encoder-chunking runs, which are
other Plans (other recompute modes, chunk sizes, a second workload): on one GPU every system runs
the same single-rank Plan, so holding out a system would hold out nothing.

Then (skip with `--no-chunk-runs`) encoder chunking (omnibench/runtime/encoder_chunks.py) on
mixed_video and long_video, homogeneous at `omni-7b@4L`: the ViT bounded by block recomputation
(today's default), by chunks of 4,096 patches without block recomputation, and by chunks of 16,384
under block recomputation; each row's step time and measured peak against the estimate, in
DIR/gpu_figures.md's second table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.provenance import provenance  # noqa: E402

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")
MODELS = {"text_only": "llm-7b@4L", "mixed_video": ""}


CHUNK_MODEL = "omni-7b@4L"
CHUNK_RUNS = {  # variant -> `omnibench run` flags
    "vit-block-recompute": ["--recompute", "vision=full,audio=full", "--encoder-chunk-tokens", "0"],
    "chunks-4096": ["--recompute", "none", "--encoder-chunk-tokens", "4096"],
    "chunks-16384+block-recompute": ["--recompute", "vision=full,audio=full", "--encoder-chunk-tokens", "16384"],
}


def run(system: str, workload: str, steps: int, out: str, extra: list[str], variant: str = "") -> dict:
    cmd = [sys.executable, "-m", "omnibench", "run", "--system", system, "--workload", workload,
           "--steps", str(steps), "--out", out, "--json", *extra]
    if variant:
        cmd += ["--model", CHUNK_MODEL, *CHUNK_RUNS[variant]]
    elif MODELS.get(workload):
        cmd += ["--model", MODELS[workload]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    row = {"system": system, "workload": workload, "variant": variant, "command": " ".join(cmd[1:])}
    if done.returncode:
        lines = [x for x in (done.stderr or done.stdout).strip().splitlines() if x.strip()]
        row["error"] = next((x for x in lines if x.startswith("error")), lines[-1] if lines else "failed")
        # a refusal is a figure too: say which code and which GPU refused
        row["provenance"] = provenance("cuda", ["omnibench", *cmd[3:]], cuda=True)
        return row
    s = json.loads(done.stdout)
    row.update({k: s[k] for k in ("model", "world_size", "mean_step_time_s", "tokens_per_s", "tokens_per_s_per_gpu",
                                  "tflops_per_gpu", "mfu", "peak_memory_bytes", "recompute", "final_loss",
                                  "bubble_fraction", "notes")})
    # the memory check's note: "memory: <model> with recompute=... estimated at X GiB on rank r of Y GiB"
    found = [re.search(r"estimated at ([0-9.]+) GiB", n) for n in s.get("notes") or [] if "estimated at" in n]
    row["estimate_gib"] = float(found[0].group(1)) if found else None
    row["record"] = out
    with open(os.path.join(out, "config.json")) as f:
        row["provenance"] = json.load(f).get("provenance")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--systems", default="all")
    ap.add_argument("--workloads", default="text_only,mixed_video")
    ap.add_argument("--extra", default="", help="more `omnibench run` flags, space separated")
    ap.add_argument("--no-chunk-runs", action="store_true", help="skip the encoder-chunking runs")
    ap.add_argument("--cells", default="", help="system:workload pairs instead of --systems x --workloads, "
                                                "comma separated (e.g. homogeneous:text_only,omni:mixed_video)")
    ap.add_argument("--chunk-workloads", default="mixed_video,long_video", help="workloads of the chunking runs")
    ap.add_argument("--no-fit", action="store_true", help="leave the calibrate/validate pass to another machine")
    a = ap.parse_args()
    systems = SYSTEMS if a.systems == "all" else tuple(a.systems.split(","))
    table = os.path.join(a.out, "gpu_figures.json")
    done = {}
    if os.path.exists(table):  # resume: keep the runs an earlier call finished
        with open(table) as f:
            done = {(r["system"], r["workload"], r.get("variant", "")): r for r in json.load(f)}
    rows = []
    cells = [(system, workload, "") for workload in a.workloads.split(",") for system in systems]
    if a.cells:
        cells = [(*c.split(":", 1), "") for c in a.cells.split(",")]
    if not a.no_chunk_runs:
        cells += [("homogeneous", w, v) for w in a.chunk_workloads.split(",") for v in CHUNK_RUNS]
    for system, workload, variant in cells:
        key = (system, workload, variant)
        folder = os.path.join(a.out, "runs", "-".join(x for x in key if x))
        if key in done and ("error" in done[key] or os.path.isdir(folder)):
            rows.append(done[key])
            continue
        shutil.rmtree(folder + ".incomplete", ignore_errors=True)
        rows.append(run(system, workload, a.steps, folder, a.extra.split(), variant))
        r = rows[-1]
        print(f"{system:13s} {workload:12s} {variant} " + (r["error"] if "error" in r else
              f"{r['model']:14s} {r['mean_step_time_s'] * 1e3:8.1f} ms {r['tokens_per_s_per_gpu']:8.0f} tok/s/GPU "
              f"{r['tflops_per_gpu']:6.1f} TFLOP/s {r['mfu']:6.1%} MFU {r['peak_memory_bytes'] / 2**30:5.1f} GiB "
              f"recompute={r['recompute']}"), flush=True)
        with open(table, "w") as f:  # after every run: a cut-off call keeps what it measured
            mine = {(x["system"], x["workload"], x.get("variant", "")) for x in rows}
            json.dump(rows + [v for k, v in done.items() if k not in mine], f, indent=1)
    with open(os.path.join(a.out, "gpu_figures.md"), "w") as f:
        f.write("| system | workload | model | recompute | step ms | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if r.get("variant"):
                continue
            if "error" in r:
                f.write(f"| {r['system']} | {r['workload']} | - | - | refused: {r['error']} | | | | |\n")
                continue
            f.write(f"| {r['system']} | {r['workload']} | {r['model']} | {r['recompute']} | "
                    f"{r['mean_step_time_s'] * 1e3:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']:.1f} | "
                    f"{r['mfu']:.1%} | {r['peak_memory_bytes'] / 2**30:.1f} |\n")
        chunked = [r for r in rows if r.get("variant")]
        if chunked:
            f.write(f"\nEncoder chunking, homogeneous, {CHUNK_MODEL}:\n\n")
            f.write("| workload | encoder memory bound | step ms | tokens/s/GPU | MFU | peak GiB | estimate GiB |\n")
            f.write("|---|---|---|---|---|---|---|\n")
            for r in chunked:
                if "error" in r:
                    f.write(f"| {r['workload']} | {r['variant']} | refused: {r['error']} | | | | |\n")
                    continue
                est = f"{r['estimate_gib']:.1f}" if r.get("estimate_gib") else "-"
                f.write(f"| {r['workload']} | {r['variant']} | {r['mean_step_time_s'] * 1e3:.0f} | "
                        f"{r['tokens_per_s_per_gpu']:.0f} | {r['mfu']:.1%} | {r['peak_memory_bytes'] / 2**30:.1f} | "
                        f"{est} |\n")
    ok = [r for r in rows if "error" not in r and not r.get("variant")]
    if len(ok) < 4 or a.no_fit:
        return
    # Split before fitting, by Plan: the first table's runs (every system, the same single-rank Plan
    # per workload on one GPU) are fitted; the chunking runs (other recompute modes and chunk sizes,
    # long_video too) are held out.
    fit = [r["record"] for r in ok]
    held = [r["record"] for r in rows if "error" not in r and r.get("variant")]
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

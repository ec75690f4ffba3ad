"""Record the CPU runs that calibrate and validate the simulator (2 ranks, gloo, one thread each).

    python benchmarks/cpu_validation_runs.py --out DIR [--steps 8] [--quiet-limit 0.5]
        [--systems homogeneous,temporal,colocated,noncolocated,omni]
        [--workloads mixed_video,image_sft,omni_av,text_only]

Each workload's batches are written once to `<out>/batches/<workload>.json` (the workload stream's
first `--steps` steps, CPU sizes) and every system replays the same file (`--batches-file`), so
systems differ only in their Plans. Runs go to `<out>/<system>-<workload>`; also two 2-stage
pipeline runs (`homogeneous-pp2mb{4,2}-<first workload>`), whose messages give pure communication.
Before each run the host's other load is printed (1-minute load average, and `busy`: other runnable
processes right now); `--quiet-limit` waits for a quiet host first. Figures from a loaded host are noise.
Then calibrate on some runs and validate on all (see `omnibench calibrate` / `omnibench validate`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The CPU defaults of omnibench/runtime/launch.py (resolve), stated so the batches files match them.
CPU_BATCH_TOKENS, CPU_LENGTH_SCALE, CPU_MAX_SAMPLE_TOKENS = 1536, 0.02, 384


def write_batches(workload: str, steps: int, path: str, seed: int) -> None:
    sys.path.insert(0, REPO)
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(workload, seed=seed, global_batch_tokens=CPU_BATCH_TOKENS,
                            length_scale=CPU_LENGTH_SCALE, max_sample_tokens=CPU_MAX_SAMPLE_TOKENS)
    out = [{"step": s, "samples": [x.to_dict() for x in stream.batch(s).samples]} for s in range(steps)]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f)


def runnable_others(seconds: float = 2.0) -> float:
    """Mean number of runnable processes over `seconds`, this one left out (/proc/loadavg's
    running count): the host's other work right now, which the 1-minute load average lags."""
    samples = []
    end = time.time() + seconds
    while time.time() < end:
        with open("/proc/loadavg") as f:
            samples.append(int(f.read().split()[3].split("/")[0]) - 1)
        time.sleep(0.1)
    return sum(samples) / len(samples)


def wait_quiet(limit: float, patience: float) -> float:
    """Wait (up to `patience` seconds) until other runnable work is at most `limit`; returns it."""
    deadline = time.time() + patience
    busy = runnable_others()
    while busy > limit and time.time() < deadline:
        time.sleep(5)
        busy = runnable_others()
    return busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default="homogeneous,temporal,colocated,noncolocated,omni")
    ap.add_argument("--workloads", default="mixed_video,image_sft,omni_av,text_only")
    ap.add_argument("--no-pp2", action="store_true")
    ap.add_argument("--quiet-limit", type=float, default=0.0,
                    help="before each run wait until other runnable processes average at most this (0: don't wait)")
    ap.add_argument("--quiet-patience", type=float, default=120.0)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    jobs = []
    for w in workloads:
        batches = os.path.abspath(os.path.join(args.out, "batches", f"{w}.json"))
        if not os.path.exists(batches):
            write_batches(w, args.steps, batches, args.seed)
        for system in args.systems.split(","):
            jobs.append((f"{system}-{w}", ["--system", system, "--workload", w, "--batches-file", batches]))
        if w == workloads[0] and not args.no_pp2:
            # two microbatch counts: pipeline messages of two sizes for the p2p bandwidth fit
            for mbs in (4, 2):
                jobs.append((f"homogeneous-pp2mb{mbs}-{w}", ["--system", "homogeneous", "--workload", w, "--pp", "2",
                                                            "--microbatches", str(mbs), "--batches-file", batches]))
    print(f"{'run':32s} {'load':>5s} {'busy':>5s} {'step ms (median of timed)':>26s}")
    for name, extra in jobs:
        out = os.path.abspath(os.path.join(args.out, name))
        if os.path.exists(out):
            print(f"{name:32s} exists, kept")
            continue
        busy = wait_quiet(args.quiet_limit, args.quiet_patience) if args.quiet_limit else runnable_others(0.5)
        load = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "omnibench", "run", "--device", "cpu", "--nproc", "2", "--steps",
               str(args.steps), "--seed", str(args.seed), "--out", out, "--json", *extra]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
        if res.returncode:
            print(f"{name:32s} failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        with open(os.path.join(out, "steps.jsonl")) as f:
            times = sorted([json.loads(line)["step_time_s"] for line in f if line.strip()][1:])
        print(f"{name:32s} {load:5.2f} {busy:5.1f} {1e3 * times[len(times) // 2]:26.1f}   {' '.join(cmd[3:])}",
              flush=True)
        time.sleep(0.5)


if __name__ == "__main__":
    main()

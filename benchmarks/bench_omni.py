"""Measured step time of omni against the four baselines, and omni's ablations, on the same samples.

    python benchmarks/bench_omni.py --workload long_video --start-step 900 --steps 6 --nproc 2
    python benchmarks/bench_omni.py --workload mixed_video --start-step 900 --only omni,omni-no-long-short-sp

The batches (steps start-step .. start-step+steps-1 of the workload's stream, CPU sample sizes unless
overridden) are written to one file and replayed by every run (`omnibench run --batches-file`), so
every system trains on identical samples. Prints, per run, the median over `--repeat` interleaved
repeats of the median step time over the timed steps (all but the first), the spread over repeats,
and the final loss (equal across systems: loss parity).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RUNS = {
    "homogeneous": ["--system", "homogeneous"],
    "temporal": ["--system", "temporal"],
    "colocated": ["--system", "colocated"],
    "noncolocated": ["--system", "noncolocated"],
    "omni": ["--system", "omni"],
    "omni-no-joint-pipeline": ["--system", "omni", "--no-joint-pipeline"],
    "omni-no-reorder": ["--system", "omni", "--no-reorder"],
    "omni-no-reshard": ["--system", "omni", "--no-reshard"],
    "omni-no-long-short-sp": ["--system", "omni", "--no-long-short-sp"],
}


def write_batches(path: str, workload: str, start: int, steps: int, tokens: int, scale: float, max_tokens: int) -> dict:
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(workload, seed=0, global_batch_tokens=tokens, length_scale=scale,
                            max_sample_tokens=max_tokens or None)
    batches = [stream.batch(s) for s in range(start, start + steps)]
    with open(path, "w") as f:
        json.dump([{"step": b.step, "samples": [s.to_dict() for s in b.samples]} for b in batches], f)
    return {"samples": sum(len(b.samples) for b in batches), "tokens": sum(b.llm_tokens for b in batches)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="long_video")
    ap.add_argument("--start-step", type=int, default=900)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats of every run")
    ap.add_argument("--global-batch-tokens", type=int, default=1536)
    ap.add_argument("--length-scale", type=float, default=0.02)
    ap.add_argument("--max-sample-tokens", type=int, default=384)
    ap.add_argument("--only", default=",".join(RUNS), help="comma list of: " + ", ".join(RUNS))
    ap.add_argument("extra", nargs="*", help="more `omnibench run` arguments (after --)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="omnibench-omni-bench-")
    batches = os.path.join(work, "batches.json")
    info = write_batches(batches, args.workload, args.start_step, args.steps, args.global_batch_tokens,
                         args.length_scale, args.max_sample_tokens)
    print(f"{args.workload} steps {args.start_step}..{args.start_step + args.steps - 1}: {info['samples']} samples, "
          f"{info['tokens']} LLM tokens; {args.nproc} gloo ranks")
    names = args.only.split(",")
    results: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    for rep in range(args.repeat):  # interleaved, so a burst of load on the machine hits every run alike
        for name in names:
            out = os.path.join(work, f"{name}-{rep}")
            cmd = [sys.executable, "-m", "omnibench", "run", *RUNS[name], "--nproc", str(args.nproc),
                   "--steps", str(args.steps), "--batches-file", batches, "--out", out, "--json", *args.extra]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
            if res.returncode:
                tail = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else str(res.returncode)
                print(f"{name:24s} failed: {tail}")
                continue
            summary = json.loads(res.stdout)
            with open(os.path.join(summary["record"], "steps.jsonl")) as f:
                times = [json.loads(line)["step_time_s"] for line in f][1:]
            results[name].append(statistics.median(times))
            losses[name] = summary["final_loss"]
    print(f"{'run':24s} {'median ms':>9s} {'min..max of repeats':>20s} {'loss':>8s}")
    for name in names:
        got = results[name]
        if got:
            print(f"{name:24s} {statistics.median(got) * 1e3:9.1f} {min(got) * 1e3:9.1f}..{max(got) * 1e3:<9.1f} "
                  f"{losses[name]:8.4f}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("command: python benchmarks/bench_omni.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()

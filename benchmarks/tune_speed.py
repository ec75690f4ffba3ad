"""A seeded tune's own cost, this tree against another one side by side (`reproduce` is its tunes).

    python benchmarks/tune_speed.py --against /tmp/wt-base            # both cases, 2 rounds, alternating
    python benchmarks/tune_speed.py --case image_sft-8192 --rounds 1   # one case, this tree only
    python benchmarks/tune_speed.py --against /tmp/wt-base --workers 2 # in a pool of 2, as reproduce runs

Each case is one `simulate --tuned` as `reproduce` runs its stages: seeded as its stage is (the stage's
seeds file, benchmarks/data/tune_speed_seeds: copied from a reproduce at f48de1e whose 95 convergence rows
equal results/convergence.csv's), tune budget 4 with its doublings, one worker (or a
pool of `--workers`, as `reproduce --workers 2` runs: CPU seconds then include the workers'), no step
cache, in a fresh process. The trees run one after the other, round by round (A B A B: a drifting host
shows in both), and each run prints its CPU seconds (user + sys of the process, not the wall clock
other work on the host adds to) and its answer: the tuned layout and step time of every system, which
must be the same in every tree whose change is meant to keep them (the script says when they differ).

Cases: `image_sft-8192` (homogeneous at 8,192 GPUs: many small samples, the planning and boundary
routes per sample count), `omni_av-1024` (colocated and omni at 1,024 GPUs, the size of most of
reproduce's stages), `mixed_video-8192` (omni alone in reproduce's largest stage, where its planner
weighs splitting the long samples) and `image_sft-h200-1024` (every system on 1,024 H200s, reproduce's
stage on the second machine, whose kernels are the H100's scaled); the default run times the first two.
Two cases are the untuned command as a user types it, the layout checked and `--recompute auto` settled by
the memory estimate of each cheaper mode before the step (omnibench/resolve.py): `simulate-16384` (omni
at 16,384 GPUs; `simulate-131072` the same at 131,072) and `simulate-five-1024` (every system at 1,024 GPUs).
Like every case they run with `--workers 1`: in a pool (a user's default, all cores) a command of several
steps plays them in workers, where the engine that checked a layout's memory is not at hand, so
`simulate-five-1024` then saves the checks' plays but not the step's programs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "benchmarks", "data", "tune_speed_seeds")
H100 = ["--hardware", "h100"]

CASES = {
    "image_sft-8192": (["--workload", "image_sft", "--system", "homogeneous", "--gpus", "8192"], "tuned-image_sft-b4s.json"),
    "omni_av-1024": (["--workload", "omni_av", "--system", "colocated,omni", "--gpus", "1024"], "tuned-omni_av-b4s.json"),
    "mixed_video-8192": (["--workload", "mixed_video", "--system", "omni", "--gpus", "8192"],
                         "largest-mixed_video-8192-b4s.json"),
    "image_sft-h200-1024": (["--workload", "image_sft", "--system", "homogeneous,temporal,colocated,noncolocated,omni",
                             "--gpus", "1024", "--hardware", "h200"], "tuned-image_sft-h200-b4s.json"),
    # the command as a user types it (no tune): the default layout, recompute `auto` settled by the memory
    # estimate of each cheaper mode (omnibench/resolve.py), then the step
    "simulate-16384": (["--workload", "mixed_video", "--system", "omni", "--gpus", "16384"], None),
    "simulate-131072": (["--workload", "mixed_video", "--system", "omni", "--gpus", "131072"], None),
    "simulate-five-1024": (["--workload", "mixed_video", "--system", "homogeneous,temporal,colocated,noncolocated,omni",
                            "--gpus", "1024"], None),
}


def run_case(tree: str, case: str, workers: int = 1) -> tuple[float, list]:
    """(CPU seconds, [(system, layout, recompute, step s)]) of `case` (a tune, or the untuned command) with the code
    of `tree`."""
    args, seeds = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        machine = [] if "--hardware" in args else H100
        tune = [] if seeds is None else ["--tuned", "--tune-budget", "4", "--tune-cache", os.path.join(tmp, "cache"),
                                         "--seed-from", os.path.join(SEEDS, seeds)]
        cmd = [sys.executable, "-m", "omnibench", "simulate", *args, *machine, "--model", "omni-7b", *tune, "--out",
               os.path.join(tmp, "out"), "--no-cache", "--workers", str(workers), "--json"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{tree}: {case} failed: {tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = json.loads(res.stdout)
    return cpu, [(r["system"], r["layout"], r.get("recompute"), r["step_time_s"]) for r in out["results"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="", help="another checkout (e.g. a worktree of the commit before) to time "
                    "beside this one")
    ap.add_argument("--case", default="image_sft-8192,omni_av-1024", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="simulate's --workers (1: in the tune's process)")
    args = ap.parse_args()
    if args.workers < 1:
        raise SystemExit(f"--workers: must be at least 1, got {args.workers}")
    cases = [c for c in args.case.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"--case: {c!r} is not one of {', '.join(CASES)}")
    trees = [ROOT] + ([os.path.abspath(args.against)] if args.against else [])
    for t in trees[1:]:
        if not os.path.isfile(os.path.join(t, "omnibench", "__main__.py")):
            raise SystemExit(f"--against: {t} is not an omnibench checkout (no omnibench/__main__.py)")
    for case in cases:
        times: dict[str, list[float]] = {t: [] for t in trees}
        answers: dict[str, list] = {}
        for _ in range(args.rounds):
            for t in reversed(trees):  # the other tree first in each round
                cpu, answer = run_case(t, case, args.workers)
                times[t].append(cpu)
                answers[t] = answer
                print(f"{case:16s} {t:40s} {cpu:7.1f} s CPU  {answer}", flush=True)
        best = {t: min(v) for t, v in times.items()}
        line = f"{case}: this tree {best[ROOT]:.1f} s CPU (best of {args.rounds}, workers {args.workers})"
        if args.against:
            other = trees[1]
            same = "same answers" if answers[other] == answers[ROOT] else "ANSWERS DIFFER"
            line += f", {other} {best[other]:.1f} s: ratio {best[ROOT] / best[other]:.2f} ({same})"
        print(line, flush=True)


if __name__ == "__main__":
    main()

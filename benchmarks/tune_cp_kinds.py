"""What searching the context-parallel kind adds to each system's tuned step (a fairness check).

    python benchmarks/tune_cp_kinds.py [--workload long_video] [--gpus 1024] [--systems all] [--budget 8]
        [--out FILE]

For each system, `omnibench tune` (converged: the budget doubled until the best moves <= 2%) twice on
the same batch, side by side in one run: over the space before all-gathered K/V (`--cp-kinds ulysses`)
and over today's (`ulysses,allgather`). Prints each system's best layout and step time in both, the
ratio, and omni against the best baseline in both. Unseeded tunes from each system's default layout,
so the figures are the search's own, not `reproduce`'s seeded ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")
SPACES = (("ulysses",), ("ulysses", "allgather"))


def best(system: str, workload: str, gpus: int, budget: int, kinds: tuple[str, ...]):
    from omnibench.cli.tune import run_tune

    res = run_tune(system, workload, gpus, "omni-7b", "h100", 1, 0, 0, 0, budget, None, converge=True,
                   cp_kinds=kinds)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="long_video")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--systems", default="all")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    systems = SYSTEMS if a.systems == "all" else tuple(s.strip() for s in a.systems.split(","))
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        sys.exit(f"error: systems must be all or some of {', '.join(SYSTEMS)}; got {', '.join(bad)}")
    if a.gpus < 1 or a.budget < 1:
        sys.exit(f"error: gpus and budget must be positive integers; got {a.gpus}, {a.budget}")
    lines = [f"# python benchmarks/tune_cp_kinds.py --workload {a.workload} --gpus {a.gpus} --systems {a.systems} "
             f"--budget {a.budget}",
             "# omni-7b, h100, step 0, seed 0, 8,192 tokens/GPU; each tune converged (budget doubled until <= 2%)",
             "| system | Ulysses only: best | step s | + all-gathered K/V: best | step s | after / before | "
             "simulated | CPU s |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    steps: dict[tuple[str, tuple], float] = {}
    for s in systems:
        row = [s]
        sims, cpu = [], 0.0
        for kinds in SPACES:
            t0 = time.process_time()
            try:
                res = best(s, a.workload, a.gpus, a.budget, kinds)
            except ValueError as e:
                row += [f"({str(e).splitlines()[0][:60]})", "-"]
                continue
            cpu += time.process_time() - t0
            sims.append(res.simulated)
            if res.best is None:
                row += ["(nothing fits)", "-"]
                continue
            steps[(s, kinds)] = res.best.step_s
            row += [res.best.candidate.label(), f"{res.best.step_s:.3f}"]
        before, after = steps.get((s, SPACES[0])), steps.get((s, SPACES[1]))
        row += [f"{after / before:.3f}" if before and after else "-", " / ".join(map(str, sims)), f"{cpu:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    if "omni" in systems:
        for kinds in SPACES:
            base = [steps[(s, kinds)] for s in systems if s != "omni" and (s, kinds) in steps]
            if base and ("omni", kinds) in steps:
                lines.append(f"omni vs the best baseline over {'+'.join(kinds)}: "
                             f"{min(base) / steps[('omni', kinds)]:.2f}x")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Try to beat each baseline's tuned layout with its neighbours: is every baseline at its best?

    python benchmarks/adversarial_baselines.py [--sims results/sims/reproduce] [--out results/adversarial.md]
                                               [--workers N] [--margin 0.01]

For every cell of the reproduce's tuned comparison on H100s (each static workload at each size its tune cache
holds; the dynamic ones over every step of their window with --dynamic), and every baseline's tuned layout
there (the tune cache `tuned-layouts.json` the reproduce wrote), it simulates the layouts one change away:
tp, pp and cp halved or doubled, the other cp kind, microbatches halved or doubled, every recompute mode of
the tune's space (`omnibench.tune.recompute_modes`, a superset of `--recompute auto`'s list), interleaved
stages, the encoder knobs its tune varies (systems' encoder tp, noncolocated's encoder share, spatial's
quota), and the data-parallel modes (ddp, zero1, zero2, fsdp): `omnibench.tune.neighbour_layouts`, the set
the tune's own neighbour descent walks, so a faster one here is a descent that stopped short. Each on the
same batch(es) as the tuned layout, with
the same simulator (the step cache answers layouts simulated before). It prints and writes every neighbour
faster than the tuned layout by more than `--margin`, and says for each cell how many it tried. A faster
neighbour is a tune that missed: the comparison then understates that baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINES = ("homogeneous", "temporal", "colocated", "noncolocated", "spatial")
STATIC = ("mixed_video", "long_video", "image_sft", "omni_av")
# (steps, stride, seed) as the reproduce runs them (omnibench/cli/report.py DYNAMIC_RUNS)
DYNAMIC = {"bursty_mix": (16, 1, 14), "drifting_video": (12, 90, 0)}


def neighbours(c, model, world: int, gpn: int, samples) -> list:
    """The layouts one change away from candidate `c`: the ones the tune's neighbour descent walks
    (`omnibench.tune.neighbour_layouts`), every data-parallel mode among them."""
    from omnibench.tune import neighbour_layouts, recompute_modes

    return neighbour_layouts(c, model, world, gpn, recompute_modes(model, (), samples))


def step_jobs(system: str, model, c, cluster, batches) -> list:
    """The simulations of candidate `c` on `batches`, as `simulate` makes them (its planner options on the
    hardware, the same SimOptions); none for a layout the model refuses."""
    from omnibench.cli.simulate import planner_options
    from simulator.cache import StepJob
    from simulator.engine import SimOptions

    par = c.parallel(cluster.num_gpus, cluster.gpus_per_node, planner_options(system, {}, "h100"))
    try:
        par.validate(model)
    except ValueError:
        return []
    opts = SimOptions(recompute=c.recompute)
    return [StepJob(system, model, par, b, cluster, None, opts, keep="summary") for b in batches]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sims", default=str(ROOT / "results" / "sims" / "reproduce"))
    ap.add_argument("--out", default=str(ROOT / "results" / "adversarial.md"))
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("--dynamic", action="store_true", help="also the dynamic workloads, over their steps")
    ap.add_argument("--workloads", default="", help="only these workloads (comma list)")
    ap.add_argument("--systems", default=",".join(BASELINES), help="only these baselines (comma list)")
    args = ap.parse_args()

    from omnibench.specs.presets import get_model
    from omnibench.sweep import Sweep
    from omnibench.tune import Candidate
    from simulator.cache import pack, run_step
    from simulator.hardware import load_cluster
    from workloads.stream import WorkloadStream

    cache = json.loads((Path(args.sims) / "tuned-layouts.json").read_text())
    cells = {}
    for e in cache.values():
        if not isinstance(e, dict) or e.get("system") not in args.systems.split(",") or e.get("hardware") != "h100" \
                or e.get("memory_error"):
            continue
        wl = Path(str(e["workload"])).stem
        if args.workloads and wl not in args.workloads.split(","):
            continue
        if wl in STATIC or (args.dynamic and wl in DYNAMIC):
            # a seeded tune runs once per (cell, system): the last entry written is the one the stage used
            cells[(wl, int(e["gpus"]), e["system"])] = e
    rows, found = [], []
    with Sweep(args.workers, None, label="adversarial", quiet=True) as sweep:
        for (wl, gpus, system), e in sorted(cells.items()):
            model = get_model(e["model"])
            cluster = load_cluster("h100", gpus)
            steps, stride, seed = DYNAMIC.get(wl, (1, 1, 0))
            stream = WorkloadStream(wl, seed=seed, global_batch_tokens=8192 * gpus)
            batches = [pack(stream.batch(k * stride)) for k in range(steps)]
            tuned = Candidate(**e["candidate"])
            samples = [s for b in batches for s in b.get().samples]  # every step the layout runs
            variants = [(c.label(), c) for c in [tuned, *neighbours(tuned, model, gpus, cluster.gpus_per_node,
                                                                      samples)]]
            todo = [(label, step_jobs(system, model, c, cluster, batches)) for label, c in variants]
            flat = [j for _, js in todo for j in js]
            outs = iter(sweep.map(run_step, flat))
            times = {}
            for label, js in todo:
                got = [next(outs) for _ in js]
                if not js or any(o.error or not o.metrics.get("fits") for o in got):
                    continue
                times[label] = sum(o.metrics["step_time_s"] for o in got)
            base = times.get(tuned.label())
            if base is None:
                rows.append((wl, gpus, system, tuned.label(), "tuned layout did not run here", len(variants) - 1, ""))
                continue
            faster = sorted((t, lab) for lab, t in times.items() if t < base * (1 - args.margin))
            for t, lab in faster:
                found.append((wl, gpus, system, tuned.label(), lab, base / t - 1))
            best = f"{faster[0][1]} ({base / faster[0][0] - 1:+.1%})" if faster else "none"
            rows.append((wl, gpus, system, tuned.label(), f"{base:.4f}", len(times) - 1, best))
            print(f"{wl} {gpus} {system}: tuned {tuned.label()} {base:.4f} s, {len(times) - 1} neighbours ran, "
                  f"faster by > {args.margin:.0%}: {best}", flush=True)
    lines = [f"`python benchmarks/adversarial_baselines.py{' --dynamic' if args.dynamic else ''}` over "
             f"`{Path(args.sims).relative_to(ROOT) if Path(args.sims).is_relative_to(ROOT) else args.sims}` "
             f"(H100, the tune cache of `python -m omnibench reproduce --out results --workers 2`)", "",
             "| workload | GPUs | baseline | tuned layout | tuned step s | neighbours that ran | faster by > "
             f"{args.margin:.0%} |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {wl} | {gpus:,} | {s} | {lab} | {t} | {n} | {best} |" for wl, gpus, s, lab, t, n, best in rows]
    lines += ["", f"{len(found)} neighbour(s) faster than a tuned layout by more than {args.margin:.0%} in "
              f"{len({(w, g, s) for w, g, s, *_ in found})} of {len(rows)} (cell, baseline) pairs."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Where spatial multiplexing pays: spatial against temporal at the same layouts, simulated.

    python benchmarks/spatial_regimes.py [--gpus 1024] [--workers 2] [--out results/spatial_regimes.md]

spatial runs temporal's layout with the encoders and the LLM side by side on every GPU (systems/spatial.py);
with one microbatch its step is temporal's. So the question is what two lanes buy at the same layout: for
each workload and tokens per GPU, temporal's default layout for the batch (VeOmni's: tp 1, pp 1, the Ulysses
degree the longest sample needs, FSDP over all ranks) at 1, 2 and 4 microbatches, each recompute mode from
none to full until one fits, simulated for temporal and for spatial at three quotas (auto: each phase's share
of the work by the balancer; 0.3; 0.5). It prints and writes, per cell, temporal's best step, spatial's best
at two or more microbatches, and what spatial gains at the same microbatch count. Every number rests on the
quota model, which no GPU has measured yet (simulator/quota.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = ("mixed_video", "image_sft", "omni_av", "long_video")
TOKENS_PER_GPU = (8192, 2048)
MICROBATCHES = (1, 2, 4)
QUOTAS = ("auto", "0.3", "0.5")
RECOMPUTE = ("none", "vision=full,audio=full", "full")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "results" / "spatial_regimes.md"))
    args = ap.parse_args()

    from omnibench.resolve import model_for_workload
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from omnibench.sweep import Sweep
    from simulator.cache import StepJob, pack, run_step
    from simulator.engine import SimOptions
    from simulator.hardware import load_cluster
    from systems.defaults import default_layout
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    cluster = load_cluster(args.hardware, args.gpus)
    rows = []
    with Sweep(args.workers, None, label="spatial", quiet=True) as sweep:
        for wl in args.workloads.split(","):
            model = get_model(model_for_workload("omni-7b", get_workload(wl))[0])
            for tpg in TOKENS_PER_GPU:
                batch = WorkloadStream(wl, seed=0, global_batch_tokens=tpg * args.gpus).batch(0)
                d = default_layout("temporal", model, args.gpus, cluster.gpus_per_node, batch.samples)
                variants = [("temporal", m, "") for m in MICROBATCHES]
                variants += [("spatial", m, q) for m in MICROBATCHES if m > 1 for q in QUOTAS]
                jobs = []
                for system, m, q in variants:
                    for rc in RECOMPUTE:
                        par = ParallelSpec(world_size=args.gpus, tp=1, pp=1, cp=d.cp, microbatches=m, recompute=rc,
                                           options={"quota": q} if q else {})
                        jobs.append(((system, m, q, rc),
                                     StepJob(system, model, par, pack(batch), cluster, None, SimOptions(recompute=rc),
                                             keep="summary")))
                outs = sweep.map(run_step, [j for _, j in jobs])
                best: dict[tuple, tuple[float, str]] = {}
                for (key, _), out in zip(jobs, outs, strict=True):
                    system, m, q, rc = key
                    if out.error or not out.metrics.get("fits"):
                        continue
                    k = (system, m, q)
                    t = out.metrics["step_time_s"]
                    if k not in best or t < best[k][0]:
                        best[k] = (t, rc)
                temporal = {m: best[("temporal", m, "")] for m in MICROBATCHES if ("temporal", m, "") in best}
                spatial = {k: v for k, v in best.items() if k[0] == "spatial"}
                if not temporal:
                    rows.append((wl, tpg, d.cp, "nothing fits", "", "", ""))
                    continue
                t_best = min(temporal.items(), key=lambda x: x[1][0])
                line = f"{t_best[1][0]:.3f} s (mb{t_best[0]}, recompute {t_best[1][1]})"
                if not spatial:
                    rows.append((wl, tpg, d.cp, line, "does not fit at 2 or more microbatches", "", ""))
                    continue
                s_key, (s_t, s_rc) = min(spatial.items(), key=lambda x: x[1][0])
                same = [f"mb{m}: {temporal[m][0] / min(v[0] for k, v in spatial.items() if k[1] == m):.2f}x"
                        for m in MICROBATCHES if m in temporal and any(k[1] == m for k in spatial)]
                rows.append((wl, tpg, d.cp, line, f"{s_t:.3f} s (mb{s_key[1]}, quota {s_key[2]}, recompute {s_rc})",
                             f"{t_best[1][0] / s_t:.2f}x", ", ".join(same) or "-"))
                print(f"{wl} {tpg}: {rows[-1][3:]}", flush=True)
    lines = [f"`python benchmarks/spatial_regimes.py --gpus {args.gpus}` ({args.hardware.upper()}, omni-7b, step 0 of "
             "each workload; temporal's default Ulysses degree; the quota model is unmeasured)", "",
             "| workload | tokens/GPU | cp | temporal, best | spatial, best at 2+ microbatches | spatial / temporal "
             "(best vs best) | spatial's gain at the same microbatches |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {wl} | {tpg:,} | {cp} | {t} | {s} | {r} | {same} |" for wl, tpg, cp, t, s, r, same in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

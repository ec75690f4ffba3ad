"""The simulator's peak memory per GPU against published runs (results/validation/published_runs.csv).

Every row of the CSV ran, so none may be predicted not to fit; 20 rows (torchtitan's H100 and H200
benchmarks) publish their peak memory, as the caching allocator's `max_reserved` (torchtitan's device
memory monitor). Each row is read and simulated as `omnibench validate --published` does
(simulator/published.py: its model, layout and its software column's options, memory conventions
included: `options_of`), planned by `homogeneous`, exactly as the row's `omnibench simulate` command
sets it (the CSV's micro batch, also where the source leaves it unpublished).

Rows larger than `--max-gpus` are simulated at fewer data-parallel replicas with the same per-rank
work: the same microbatches per rank and the same sharding degree of the training state (memory per
rank depends on nothing else); communication is not simulated (memory does not depend on it). Prints
one line per row, the summary per split, and the allocator factor the calibration rows fit.

    python benchmarks/published_memory.py                  # the 20 rows with a published peak
    python benchmarks/published_memory.py --all            # every row: does it fit?
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CSV = ROOT / "results" / "validation" / "published_runs.csv"
GiB = 2**30


def simulate_row(r, max_gpus: int) -> dict:
    from simulator.engine import Engine
    from simulator.hardware import load_cluster
    from simulator.published import model_of, options_of, parallel_of
    from systems import get_planner
    from workloads.sample import Batch, Sample, Segment

    sim_dp = r.dp
    while sim_dp * r.tp * r.pp * r.cp > max_gpus and sim_dp % 2 == 0 and sim_dp > 2:
        sim_dp //= 2
    shard = r.dp * r.cp  # the data-parallel group the state is sharded over (experts: / ep)
    small = replace(r, gpus=sim_dp * r.tp * r.pp * r.cp, global_batch=sim_dp * r.microbatches * r.micro_batch)
    model = model_of(small)
    cluster = load_cluster(r.hardware, small.gpus)
    parallel = parallel_of(small, cluster.gpus_per_node)
    parallel.validate(model)
    batch = Batch(0, [Sample(i, "t", (Segment("text", r.seq),)) for i in range(small.global_batch)])
    plan = get_planner("homogeneous").plan(model, parallel, batch)
    opts = replace(options_of(r), communication=False, check_memory=False)

    class RowEngine(Engine):
        def _dp_mode(self, module, rank):  # the row's sharding degree at fewer simulated replicas
            m, n = super()._dp_mode(module, rank)
            return (m, n * shard // (sim_dp * r.cp)) if n > 1 else (m, n)

    res = RowEngine(plan, model, cluster, options=opts).run()
    worst = max(res.ranks, key=lambda s: s.memory_bytes)
    cap = cluster.gpu.memory_bytes
    return {"peak_gib": worst.memory_bytes / GiB, "reserved_gib": worst.memory_reserved / GiB,
            "allocated_gib": worst.memory_allocated / GiB, "capacity_gib": cap / GiB,
            "fits": worst.memory_bytes <= cap, "sim_gpus": small.gpus, "micro_batch": r.micro_batch, "stack": opts.memory_stack,
            "peak_rank": worst.rank, "peak_at": worst.memory_peak_at, "static_gib": worst.memory_static / GiB}


def main(argv=None) -> int:
    from simulator.memory import FRAGMENTATION
    from simulator.published import load_published

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(CSV))
    ap.add_argument("--all", action="store_true", help="every row (does it fit?), not only published peaks")
    ap.add_argument("--max-gpus", type=int, default=1024)
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--json", default="")
    ap.add_argument("--explain", action="store_true", help="the peak rank, its static bytes, the action at the peak")
    args = ap.parse_args(argv)
    rows = load_published(args.csv)
    if not args.all:
        rows = [r for r in rows if r.peak_memory_gib]
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r.name in keep]
    out = []
    for r in rows:
        t0 = time.perf_counter()
        try:
            got = simulate_row(r, args.max_gpus)
        except Exception as e:  # a row the planner or simulator cannot express: reported, not hidden
            got = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        got.update(name=r.name, split=r.split, published_gib=r.peak_memory_gib, seconds=time.perf_counter() - t0)
        out.append(got)
        if "error" in got:
            print(f"{r.name:40s} {r.split:11s} not simulated: {got['error']}", flush=True)
            continue
        pub = got["published_gib"]
        err = f"{(got['reserved_gib'] - pub) / pub:+6.1%}" if pub else "      "
        print(f"{r.name:40s} {r.split:11s} {got['stack']:24s} mb {got['micro_batch']:2d} needs {got['peak_gib']:6.1f} "
              f"GiB (reserved {got['reserved_gib']:5.1f}, allocated {got['allocated_gib']:5.1f}) published "
              f"{pub or float('nan'):5.1f} {err} of {got['capacity_gib']:5.0f}: {'fits' if got['fits'] else 'DOES NOT FIT'}"
              + (f" [rank {got['peak_rank']} static {got['static_gib']:.1f} at {got['peak_at']}]" if args.explain else ""),
              flush=True)
    done = [g for g in out if "error" not in g]
    with_pub = [g for g in done if g["published_gib"]]
    for split in ("calibration", "heldout"):
        errs = [(g["reserved_gib"] - g["published_gib"]) / g["published_gib"] for g in with_pub if g["split"] == split]
        if errs:
            print(f"{split}: {len(errs)} rows with a published peak, mean |error| of the reserved estimate "
                  f"{sum(abs(e) for e in errs) / len(errs):.1%}, worst {max(errs, key=abs):+.1%}, "
                  f"{sum(abs(e) <= 0.10 for e in errs)} within 10%")
    cal = [g for g in with_pub if g["split"] == "calibration"]
    if cal:
        # reserved / allocated that best fits the calibration rows (geometric mean of published / allocated)
        k = math.exp(sum(math.log(g["published_gib"] / g["allocated_gib"]) for g in cal) / len(cal))
        print(f"fragmentation fitted on the {len(cal)} calibration rows: {k:.3f} (simulator/memory.py uses "
              f"{FRAGMENTATION})")
    print(f"predicted not to fit: {sum(not g['fits'] for g in done)} of {len(done)} simulated rows"
          + "".join(f"\n  {g['name']}" for g in done if not g["fits"])
          + f"\nnot simulated: {len(out) - len(done)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

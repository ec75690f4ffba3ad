"""What each modelling choice costs in error on the published-results table.

    python benchmarks/published_ablation.py [--table results/validation/megatron_a100.csv]

Simulates every row of the table once per variant of the machine model and prints mean and worst
|error| per variant (error = simulated / published step time - 1), plus the memory check: each row
must fit as published, and the same layout without recomputation must not fit on the large models.
Variants change one choice each against the full model (kernel profile a100-published):
- datasheet: no kernel profile, the datasheet roofline curve (the simulator before it had kernel profiles);
- flash attention: the profile's FlashAttention-2 rows instead of the unfused kernels the runs used
  (the attention kernel is the row's stack's: simulator/published.py::options_of);
- no memory-bound work: norms, dropout, residual adds, activations, loss at zero cost;
- GEMMs at the best rate: every GEMM at 271 TFLOP/s whatever its shape;
- micro batch 1 / 2 for the rows that do not publish it (the table assumes 4);
- no communication.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.kernels import DATA_DIR  # noqa: E402
from simulator.published import check_row, load_published  # noqa: E402


def profile_variant(tmp: str, name: str, edit) -> str:
    data = json.loads((DATA_DIR / "a100-published.json").read_text())
    edit(data)
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(data, fh)
    return path


def run(rows, **kw):
    return [check_row(r, **kw) for r in rows]


def summary(label: str, checks) -> None:
    errs = [c.error for c in checks]
    mae = sum(abs(e) for e in errs) / len(errs)
    worst = max(errs, key=abs)
    per = " ".join(f"{e:+.0%}" for e in errs)
    print(f"{label:32s} mean |error| {mae:5.1%}  worst {worst:+6.1%}   rows: {per}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="results/validation/megatron_a100.csv")
    args = ap.parse_args()
    rows = load_published(args.table)
    with tempfile.TemporaryDirectory() as tmp:

        def no_mem(d):
            for r in d["memory_bound"]:
                r["time_s"] *= 1e-6
        nomem = profile_variant(tmp, "nomem", no_mem)

        def flat(d):
            for r in d["gemm"]:
                r["time_s"] = r["flops"] / 271.2e12
        flatg = profile_variant(tmp, "flat", flat)
        print(f"table: {args.table} ({len(rows)} rows: {', '.join(r.name for r in rows)})")
        summary("full model (a100-published)", run(rows))
        summary("datasheet roofline (no profile)", run(rows, kernels="none"))
        import simulator.published as published

        stack_options = published.options_of  # the attention kernel is the stack's (options_of), not the profile's
        published.options_of = lambda row, stack=None: replace(stack_options(row, stack), attention="flash")
        summary("flash attention kernels", run(rows))
        published.options_of = stack_options
        summary("no memory-bound work", run(rows, kernels=nomem))
        summary("GEMMs at the best rate", run(rows, kernels=flatg))
        for mb in (1, 2):
            var = [replace(r, micro_batch=mb) if r.source.startswith("narayanan") else r for r in rows]
            summary(f"micro batch {mb} where unpublished", run(var))
        from simulator import engine

        orig = engine.SimOptions
        engine.SimOptions = lambda **kw: orig(communication=False, **kw)  # noqa: E731
        import simulator.published  # noqa: F401  (check_row imports SimOptions from engine at call time)
        summary("no communication", run(rows))
        engine.SimOptions = orig
    print("\nmemory (fits as published / fits without recomputation):")
    for r in rows:
        a = check_row(r)
        b = check_row(replace(r, recompute="none"))
        print(f"  {r.name:10s} {a.peak_memory_gib:5.1f} GiB {'fits' if a.fits else 'DOES NOT FIT'};  "
              f"no recompute {b.peak_memory_gib:6.1f} GiB {'fits' if b.fits else 'does not fit'}")


if __name__ == "__main__":
    main()

"""Sensitivity of the published pipeline rows to what their publications leave out: interleaved 1F1B
(virtual stages) and whether the schedule unshards FSDP chunks ahead of their first use.

    python benchmarks/published_interleaved.py [--table results/validation/megatron_a100.csv]
    python benchmarks/published_interleaved.py --table results/validation/published_runs.csv \\
        --rows '^llama3-405b-.*cp1$' --vpp 1,2,4 --unshard both

The Megatron rows do not say whether they interleaved; by default each pipelined row is simulated as
published (its vpp) and with the deepest interleaving its layers allow (at most 3 chunks per rank).
`--vpp` names the depths instead (those the layers and microbatches do not allow are skipped).
`--unshard both` simulates each depth with FSDP's per-chunk gathers in line (off) and unsharded ahead
by the schedule (on: SimOptions.pp_prefetch_unshard, as torch.distributed.pipelining does), side by
side. Nothing here changes a row's committed fill: this shows how far each unpublished choice moves it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.specs.costs import llm_flops  # noqa: E402
from simulator.published import check_row, load_published, model_of  # noqa: E402


def whole_scores_factor(row) -> float | None:
    """Published step under whole-s x s counting over the causal one (None: the row says its formula)."""
    if not row.unstated:
        return None
    llm = model_of(row).llm
    return llm_flops(llm, [row.seq], attention="dense").total / llm_flops(llm, [row.seq]).total


def _depths(row, wanted: list[int] | None) -> list[int]:
    if wanted is None:
        deepest = max(v for v in (1, 2, 3) if row.layers % (row.pp * v) == 0 and row.microbatches % row.pp == 0)
        return sorted({row.vpp, deepest})
    return [v for v in wanted if v == 1 or (row.pp * v <= row.layers and row.microbatches % row.pp == 0)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="results/validation/megatron_a100.csv")
    ap.add_argument("--rows", default="", help="only rows whose name matches this regular expression")
    ap.add_argument("--vpp", default="", help="virtual stages to try, e.g. 1,2,4 (default: as published and "
                    "the deepest of 1-3 the layers allow)")
    ap.add_argument("--unshard", choices=("row", "off", "on", "both"), default="row",
                    help="FSDP chunks unsharded ahead by the schedule: the row's stack rule, off, on, or both")
    args = ap.parse_args()
    try:
        wanted = [int(v) for v in args.vpp.split(",")] if args.vpp else None
    except ValueError:
        wanted = [0]
    if wanted is not None and min(wanted) < 1:
        ap.error(f"--vpp: positive integers separated by commas (e.g. 1,2,4), got {args.vpp!r}")
    try:
        re.compile(args.rows)
    except re.error as e:
        ap.error(f"--rows: not a regular expression ({e})")
    modes = {"row": [None], "off": [False], "on": [True], "both": [False, True]}[args.unshard]
    print(f"{'row':34s} {'GPUs':>6} {'pp':>3} {'vpp':>3} {'unshard':>8} {'published s':>11} {'simulated s':>11} "
          f"{'error':>7} {'bubble':>7} {'exposed':>7} {'fits':>4} {'whole s^2 s':>11} {'error':>7}")
    for row in load_published(args.table):
        if row.pp < 2 or (args.rows and not re.search(args.rows, row.name)):
            continue
        whole = whole_scores_factor(row)
        for v in _depths(row, wanted):
            for ahead in modes:
                sim = None if ahead is None else {"pp_prefetch_unshard": ahead}
                c = check_row(replace(row, vpp=v), sim=sim)
                how = "row" if ahead is None else ("ahead" if ahead else "in line")
                print(f"{row.name:34s} {row.gpus:>6} {row.pp:>3} {v:>3} {how:>8} {c.measured_s:>11.3f} "
                      f"{c.simulated_s:>11.3f} {c.error:>+7.1%} {c.breakdown['bubble']:>7.1%} "
                      f"{c.breakdown['exposed_comm']:>7.1%} {'yes' if c.fits else 'no':>4} "
                      + (f"{c.measured_s * whole:>11.3f} {c.simulated_s / (c.measured_s * whole) - 1:>+7.1%}"
                         if whole else f"{'-':>11} {'-':>7}"), flush=True)


if __name__ == "__main__":
    main()

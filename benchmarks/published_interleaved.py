"""Sensitivity of the published pipeline rows to interleaved 1F1B (virtual stages).

    python benchmarks/published_interleaved.py [--table results/validation/megatron_a100.csv]

The Megatron rows do not say whether they interleaved; each pipelined row is simulated as published
(vpp 1) and with the deepest interleaving its layers allow (at most 3 chunks per rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.published import check_row, load_published  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="results/validation/megatron_a100.csv")
    args = ap.parse_args()
    print(f"{'row':10s} {'pp':>3} {'vpp':>3} {'simulated s':>11} {'error':>7} {'bubble':>7}")
    for row in load_published(args.table):
        if row.pp < 2:
            continue
        deepest = max(v for v in (1, 2, 3) if row.layers % (row.pp * v) == 0 and row.microbatches % row.pp == 0)
        for v in sorted({1, deepest}):
            c = check_row(replace(row, vpp=v))
            print(f"{row.name:10s} {row.pp:>3} {v:>3} {c.simulated_s:>11.3f} {c.error:>+7.1%} {c.breakdown['bubble']:>7.1%}")


if __name__ == "__main__":
    main()

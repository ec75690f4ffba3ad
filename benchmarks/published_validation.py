"""Rewrite the committed validation table over every published row.

    python benchmarks/published_validation.py [--workers N]

Runs `python -m omnibench validate --published results/validation/published_runs.csv --markdown
results/validation/published_table.md` (every row, 1 to 16,384 GPUs: the 8,192-16,384-GPU rows take
minutes each) and the same command's --json into results/validation/published_table.json. The table's
first line names the command; tests/test_published_table.py checks a fixed subset of its rows
against the simulator on every test run, and that its statistics follow from its rows.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSV = "results/validation/published_runs.csv"
TABLE = "results/validation/published_table.md"
JSON = ROOT / "results" / "validation" / "published_table.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1, help="rows simulated in parallel (processes)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "omnibench", "validate", "--published", CSV, "--markdown", TABLE, "--json",
           "--workers", str(args.workers)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    JSON.write_text(out.stdout)
    print(Path(ROOT / TABLE).read_text())


if __name__ == "__main__":
    main()

"""Rewrite the committed validation table over every published row, or over some of them.

    python benchmarks/published_validation.py [--workers N]
    python benchmarks/published_validation.py --rows PATTERN [--workers N]

Runs `python -m omnibench validate --published results/validation/published_runs.csv --markdown
results/validation/published_table.md` (every row, 1 to 16,384 GPUs: the 8,192-16,384-GPU rows take
minutes each) and the same command's --json into results/validation/published_table.json. The table's
first line names the command; tests/test_published_table.py checks a fixed subset of its rows
against the simulator on every test run, and that its statistics follow from its rows.

With --rows, only the rows whose name matches the regular expression PATTERN are simulated (as that
command simulates each row: `simulator.published.check_row`), and they take their place in the committed
table and JSON (`simulator.published.merge_table`): added where new, replaced where present, every row in
the CSV's order, the statistics computed again. The other rows keep their committed figures, so the
result is what the whole command writes only while nothing they depend on has changed since the table was
last written whole; use it for rows just added to the CSV, never after a change to the cost model.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSV = "results/validation/published_runs.csv"
TABLE = "results/validation/published_table.md"
JSON = ROOT / "results" / "validation" / "published_table.json"


def _check(row):
    """One row as `validate --published` simulates it, or (row, why) where it cannot be simulated."""
    from simulator.published import check_row

    try:
        return check_row(row)
    except ValueError as e:
        return row, str(e).splitlines()[0]


def merge_rows(pattern: str, workers: int) -> None:
    from omnibench.sweep import map_ordered
    from simulator.published import load_published, merge_table

    rows = load_published(ROOT / CSV)
    chosen = [r for r in rows if re.search(pattern, r.name)]
    if not chosen:
        sys.exit(f"rows: no row name matches {pattern!r}")
    done = map_ordered(_check, chosen, workers=workers, label="published rows")
    failed = [d for d in done if isinstance(d, tuple)]
    checks = [d for d in done if not isinstance(d, tuple)]
    text, merged = merge_table((ROOT / TABLE).read_text(), json.loads(JSON.read_text()), checks, failed, rows)
    (ROOT / TABLE).write_text(text)
    JSON.write_text(json.dumps(merged, indent=1) + "\n")
    for c in checks:
        print(f"{c.row.name}: published {c.measured_s:.4g} s, simulated {c.simulated_s:.4g} s, {c.error:+.1%}, "
              f"fits {'yes' if c.fits else 'no'}")
    for r, why in failed:
        print(f"{r.name}: not simulated: {why}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1, help="rows simulated in parallel (processes)")
    ap.add_argument("--rows", default="", help="regular expression: simulate only the matching rows and put "
                    "them into the committed table in place")
    args = ap.parse_args()
    if args.rows:
        merge_rows(args.rows, args.workers)
        return
    cmd = [sys.executable, "-m", "omnibench", "validate", "--published", CSV, "--markdown", TABLE, "--json",
           "--workers", str(args.workers)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    JSON.write_text(out.stdout)
    print(Path(ROOT / TABLE).read_text())


if __name__ == "__main__":
    main()

"""How much the GB200 NVL72 job placement decides the held-out GB200 rows (results/validation/README.md,
"Blackwell, held out").

    python benchmarks/gb200_placement.py [--rows REGEX] [--workers N]

`gb200.toml` places a job larger than one rack in equal segments of whole compute trays (`tray_gpus = 4`:
256 GPUs run as 4 NVLink domains of 64, as Megatron-Bridge's launcher asks Slurm for them). This
simulates the GB200 rows of results/validation/published_runs.csv larger than one rack with the same
preset but `tray_gpus = 0` (the 72-GPU domains filled in rank order: 72 + 72 + 72 + 40) and prints each
row's error beside the committed table's (results/validation/published_table.json, segment placement).
A sensitivity check: nothing is fitted, the preset is not changed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnibench.sweep import map_ordered  # noqa: E402
from simulator.hardware import DATA_DIR  # noqa: E402
from simulator.published import check_row, load_published  # noqa: E402

CSV = ROOT / "results" / "validation" / "published_runs.csv"
TABLE = ROOT / "results" / "validation" / "published_table.json"
FILL = "gb200-fill-in-order.toml"  # the name starts with "gb200": the reader's Blackwell rules apply


def _in_order(row):
    return check_row(replace(row, hardware=FILL))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=".", help="only rows whose name matches this regular expression")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    text = (DATA_DIR / "gb200.toml").read_text()
    assert "\ntray_gpus = 4\n" in text
    rows = [r for r in load_published(CSV) if r.hardware == "gb200" and r.gpus > 72 and re.search(args.rows, r.name)]
    committed = {r["name"]: r for r in json.loads(TABLE.read_text())["rows"]}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / FILL).write_text(text.replace("\ntray_gpus = 4\n", "\ntray_gpus = 0\n"))
        os.chdir(tmp)  # a relative hardware path: load_cluster reads the file from here
        checks = map_ordered(_in_order, rows, workers=args.workers, label="gb200 rows, domains filled in order")
    print("| row | GPUs | tp/pp/v/cp/ep | published s | segments of trays (committed) | 72-GPU domains in order |")
    print("|---|---:|---|---:|---:|---:|")
    for r, c in zip(rows, checks, strict=True):
        seg = committed.get(r.name, {})
        seg_txt = f"{seg['simulated_s']:.2f} s ({seg['error']:+.1%})" if seg else "-"
        print(f"| {r.name} | {r.gpus} | {r.tp}/{r.pp}/{r.vpp}/{r.cp}/{r.ep} | {c.measured_s:.2f} | {seg_txt} | "
              f"{c.simulated_s:.2f} s ({c.error:+.1%}) |")


if __name__ == "__main__":
    main()

"""The memory estimate against the peaks measured on one H100 (the committed records in results/gpu/).

Each record holds the Plans its steps ran and, per step, `torch.cuda.max_memory_allocated`; the
simulator's `memory_allocated` of the same Plan must be within 5% of it for every step after the
first (the first step has no AdamW state yet; the estimate counts it, as every later step holds it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnibench.plan import Plan
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions
from simulator.hardware import load_cluster

ROOT = Path(__file__).resolve().parents[1]
RUNS = ["results/gpu/runs/homogeneous-text_only", "results/gpu/runs/homogeneous-mixed_video",
        "results/gpu/runs-2026-11-23-b/omni-mixed-permodule", "results/gpu/runs-2026-11-23-b/omni-default"]


@pytest.mark.parametrize("run", RUNS, ids=[r.split("/")[-1] for r in RUNS])
def test_estimate_within_5_percent_of_each_measured_h100_step(run):
    folder = ROOT / run
    recompute = json.loads((folder / "config.json").read_text())["run"]["recompute"]
    steps = [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]
    plans = [Plan.from_json(line) for line in (folder / "plans.jsonl").read_text().splitlines()]
    assert len(steps) == len(plans) > 1
    for step, plan in zip(steps[1:], plans[1:], strict=True):
        res = Engine(plan, get_model(plan.model), load_cluster("h100", 1),
                     options=SimOptions(recompute=recompute, check_memory=False)).run()
        ratio = res.ranks[0].memory_allocated / step["peak_memory_bytes"]
        assert 0.95 <= ratio <= 1.05, (run, step["step"], ratio)

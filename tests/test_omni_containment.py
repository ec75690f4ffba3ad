"""omni's space contains the baselines' schemes (issue 20 item 1): at each of homogeneous's, temporal's
and colocated's best tuned layouts, omni's planner (its defaults: ZeRO-2 encoders, the encoder SP
scheme and group size chosen per batch, reorder, reshard, the joint pipeline, the LLM long-short
split) yields a plan the simulator times no slower than the baseline's, within 1%, and that fits
wherever the baseline's fits.

The layouts were found with `tune` at budget 12 (omni-7b@4L, 32 H100s, step 0 of the stream at
8,192 tokens per GPU, seed 0), e.g.

    python -m omnibench tune --system colocated --workload mixed_video --gpus 32 --model omni-7b@4L --budget 12

and are fixed here so the test does not depend on the search (which other work keeps improving).
noncolocated is not here: its encoders run on ranks of their own, a placement outside omni's space
(results/BENCHMARKS.md, "What omni's space contains")."""

from __future__ import annotations

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)

MODEL = get_model("omni-7b@4L")
GPUS = 32

BEST = [
    # (workload, baseline, its best layout at budget 12, its recompute mode)
    ("mixed_video", "homogeneous", dict(tp=2, cp=2), "none"),
    ("mixed_video", "temporal", dict(cp=4), "none"),
    ("mixed_video", "colocated", dict(cp=4, encoder_tp=4), "full"),
    ("image_sft", "homogeneous", dict(cp=4), "none"),
    ("image_sft", "temporal", dict(cp=4), "none"),
    ("image_sft", "colocated", dict(cp=4), "none"),
]


def _simulate(system: str, workload: str, layout: dict, recompute: str):
    batch = WorkloadStream(workload, seed=0, global_batch_tokens=8192 * GPUS).batch(0)
    options = {"hardware": "h100"} if system == "omni" else {}  # omni plans with the simulator's costs
    parallel = ParallelSpec(world_size=GPUS, recompute=recompute, options=options, **layout)
    plan = get_planner(system).plan(MODEL, parallel, batch)
    return simulate(plan, MODEL, load_cluster("h100", GPUS), options=SimOptions(recompute=recompute))


@pytest.mark.parametrize("workload,baseline,layout,recompute", BEST,
                         ids=[f"{w}-{b}" for w, b, _, _ in BEST])
def test_omni_is_no_slower_than_a_baseline_at_its_best_layout(workload, baseline, layout, recompute):
    base = _simulate(baseline, workload, layout, recompute)
    omni = _simulate("omni", workload, layout, recompute)
    assert omni.step_time <= base.step_time * 1.01, (
        f"omni {omni.step_time:.4f} s vs {baseline} {base.step_time:.4f} s at {layout}, recompute {recompute}")
    assert omni.fits or not base.fits, f"omni peaks at {omni.peak_memory / 2**30:.1f} GiB where {baseline} fits"

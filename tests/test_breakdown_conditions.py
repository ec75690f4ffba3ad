"""Where the step goes (SimResult.breakdown, `plot breakdown`) and the condition grid that shows where
decoupling pays (workloads/conditions.py, `plot conditions`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from systems import SYSTEMS, get_planner
from workloads.conditions import cell_name, cell_toml, parse_cell, write_grid
from workloads.registry import get_workload
from workloads.stream import WorkloadStream


@pytest.mark.parametrize("system", SYSTEMS)
def test_breakdown_parts_add_up_to_the_step_time(system):
    model, cluster = get_model("omni-7b@4L"), load_cluster("h100", 16)
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=16 * 4096).batch(0)
    parallel = ParallelSpec(world_size=16, tp=1 if system == "temporal" else 2)
    res = simulate(get_planner(system).plan(model, parallel, batch), model, cluster, options=SimOptions(recompute="full"))
    b = res.breakdown()
    parts = b["encoder"] + b["llm"] + b["optimizer"] + b["exposed_comm"] + b["imbalance"] + b["idle"]
    assert parts == pytest.approx(res.step_time, rel=1e-9)
    assert b["encoder"] > 0 and b["llm"] > 0
    assert b["idle_min"] <= b["idle"] <= b["idle_max"] <= res.step_time
    assert res.metrics()["breakdown_s"] == b


def test_condition_cells_are_ordinary_workloads_whose_names_give_their_coordinates(tmp_path):
    paths = write_grid(tmp_path, video_shares=(0.2, 0.7), sigmas=(0.5,))
    assert [p.stem for p in paths] == [cell_name(0.2, 0.5), cell_name(0.7, 0.5)]
    assert [parse_cell(p.stem) for p in paths] == [(0.2, 0.5), (0.7, 0.5)]
    assert parse_cell("mixed_video") is None
    shares = []
    for p in paths:
        spec = get_workload(str(p))
        batch = WorkloadStream(spec, seed=0, global_batch_tokens=64 * 8192).batch(0)
        shares.append(sum(1 for s in batch.samples if any(g.modality == "video" for g in s.segments)) / len(batch.samples))
    assert shares[0] < shares[1]  # more video samples where the cell says so


@pytest.mark.parametrize("share, sigma, field", [(0.0, 1.0, "video_share"), (1.0, 1.0, "video_share"),
                                                  (0.5, 0.0, "sigma"), (0.5, 9.0, "sigma")])
def test_a_cell_outside_the_grid_is_refused_naming_the_field(share, sigma, field):
    with pytest.raises(ValueError, match=field):
        cell_toml(share, sigma)


@pytest.mark.timeout(600)
def test_plot_breakdown_and_conditions_draw_from_simulations(tmp_path):
    grid = write_grid(tmp_path / "grid", video_shares=(0.1, 0.9), sigmas=(1.0,))
    sims = tmp_path / "sims"
    for wl in grid:
        # omni and one baseline: what both figures compare (omni over the best baseline, and where each step goes)
        done = subprocess.run([sys.executable, "-m", "omnibench", "simulate", "--system", "omni,temporal", "--workload",
                               str(wl),
                               "--gpus", "16", "--tp", "2", "--recompute", "full", "--model", "omni-7b@4L",
                               "--out", str(sims), "--json"], capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stderr[-2000:]
        assert all("breakdown_s" in r for r in json.loads(done.stdout)["results"] if r.get("fits"))
    for kind in ("breakdown", "conditions"):
        out = tmp_path / kind
        done = subprocess.run([sys.executable, "-m", "omnibench", "plot", kind, *map(str, sims.iterdir()),
                               "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert (out / f"{kind}.png").stat().st_size > 10_000

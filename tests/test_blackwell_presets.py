"""Blackwell presets (simulator/data/hardware/b200.toml, gb200.toml): the datasheet figures their comments
cite, the H100 kernel profile scaled by the datasheet ratios, GB200 NVL72's 72-GPU NVLink domain and its
tray-segment placement, and a one-node step that simulates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.collectives import CollectiveModel
from simulator.compute import ComputeModel
from simulator.engine import SimOptions, simulate
from simulator.hardware import DATA_DIR, HardwareError, available_presets, load_cluster
from simulator.published import load_published, options_of
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

H100_BF16_TFLOPS, H100_HBM_GBS = 989.0, 3350.0
CSV = Path(__file__).resolve().parents[1] / "results" / "validation" / "published_runs.csv"


@pytest.mark.parametrize("name, tflops, gib, hbm, gpn", [
    ("b200", 2250.0, 178.35, 7700.0, 8),   # HGX B200: 4.5 PFLOPS BF16 with sparsity, 180 GB at 7.7 TB/s
    ("gb200", 2500.0, 184.31, 8000.0, 72),  # GB200 NVL72: 5 PFLOPS BF16 with sparsity, 186 GB at 8 TB/s
])
def test_blackwell_presets_carry_their_cited_figures(name, tflops, gib, hbm, gpn):
    assert name in available_presets()
    c = load_cluster(name)
    assert c.gpu.peak_tflops == tflops and c.gpu.memory_gib == gib and c.gpu.memory_bandwidth_gbs == hbm
    assert c.gpus_per_node == gpn and c.inter.nics_per_node == gpn  # one 400 Gb/s ConnectX-7 per GPU
    assert c.intra.bandwidth_gbs == 900.0 and c.inter.bandwidth_gbs == 50.0  # NVLink 5: 1.8 TB/s both ways
    assert c.inter.topology == "rail-optimised"
    # the H100's measured kernels scaled by the datasheet ratios, nothing fitted
    assert c.kernels == "h100-measured"
    assert c.gpu.kernel_compute_scale == pytest.approx(tflops / H100_BF16_TFLOPS, abs=1e-4)
    assert c.gpu.kernel_memory_scale == pytest.approx(hbm / H100_HBM_GBS, abs=1e-4)
    h100 = ComputeModel(load_cluster("h100", 8)).kernels
    k = ComputeModel(c.with_gpus(8)).kernels
    assert k.gemm_rate(8192, 8192, 8192) == pytest.approx(h100.gemm_rate(8192, 8192, 8192) * tflops / H100_BF16_TFLOPS,
                                                          rel=1e-3)
    assert k.memory_bandwidth == pytest.approx(h100.memory_bandwidth * hbm / H100_HBM_GBS, rel=1e-3)


def test_gb200_jobs_beyond_one_rack_run_in_segments_of_whole_trays():
    # up to a rack: one NVLink domain of 72
    for gpus in (8, 64, 72):
        c = load_cluster("gb200", gpus)
        assert c.gpus_per_node == 72 and c.num_nodes == 1
        assert CollectiveModel(c).placement(tuple(range(gpus))).nodes == 1
    # 256 GPUs = 64 trays: 4 segments of 16 trays (Slurm --segment as Megatron-Bridge asks for it)
    c = load_cluster("gb200", 256)
    assert c.gpus_per_node == 64 and c.inter.nics_per_node == 64 and c.num_nodes == 4
    cm = CollectiveModel(c)
    assert cm.placement(tuple(range(64, 128))).nodes == 1  # a 64-rank pipeline stage never straddles racks
    assert cm.placement(tuple(range(0, 256, 64))).same_rail
    assert load_cluster("gb200", 144).gpus_per_node == 72  # 36 trays: two full racks
    assert load_cluster("b200", 256).gpus_per_node == 8  # no trays: nodes filled in order


def test_tray_gpus_must_divide_the_domain(tmp_path):
    text = (DATA_DIR / "gb200.toml").read_text().replace("tray_gpus = 4", "tray_gpus = 5")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(HardwareError, match="tray_gpus"):
        load_cluster(str(bad))


@pytest.mark.parametrize("hardware", ["b200", "gb200"])
def test_one_node_step_of_a_small_llm_simulates_faster_than_on_h100(hardware):
    model = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "text", (Segment("text", 4096),)) for i in range(8)])
    plan = get_planner("homogeneous").plan(model, ParallelSpec(world_size=8, tp=2), batch)
    opts = SimOptions(check_memory=False, stack="fused")
    blackwell = simulate(plan, model, load_cluster(hardware, 8), options=opts).step_time
    hopper = simulate(plan, model, load_cluster("h100", 8), options=opts).step_time
    # at most the peak ratio faster (launch floors and latencies do not scale), and clearly faster
    assert hopper / 2.6 < blackwell < hopper / 1.5


def test_published_fp8_rows_on_blackwell_run_fp8_gemms():
    row = next(r for r in load_published(CSV)
               if r.hardware == "h100" and r.precision == "fp8" and r.stack == "nemo")
    for hardware in ("h100", "b200", "gb200"):
        assert options_of(replace(row, hardware=hardware)).gemm_dtype == "fp8"

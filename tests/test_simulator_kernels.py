"""Kernel-profile compute model, recompute reporting both ways, and the published-results check."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnibench.cli import simulate as sim_cli
from omnibench.specs.model import SpecError
from omnibench.specs.parallel import ParallelSpec
from simulator.hardware import load_cluster
from simulator.kernels import KernelProfileError, load_kernel_profile
from simulator.published import PublishedError, check_row, load_published, model_of

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "results" / "validation" / "megatron_a100.csv"
HEADER = ("name,source,layers,hidden,heads,vocab,seq,gpus,tp,pp,vpp,global_batch,micro_batch,data_parallel,"
          "recompute,tflops_per_gpu,step_time_s,flop_formula,hardware\n")
ROW_17B = "gpt-1.7b,narayanan2021-table1,24,2304,24,51200,2048,32,1,1,1,512,4,ddp,full,137,,megatron-hfu,a100-80g\n"
ROW_22B = "gpt-22b,korthikanti2022-table4,48,6144,64,51200,2048,8,8,1,1,4,4,ddp,full,,1.42,,a100-80g\n"


def test_small_and_skinny_gemms_run_far_below_the_best_rate():
    prof = load_kernel_profile("a100-published")
    big = prof.gemm_rate(8192, 8192, 8192)
    assert 0.8 * 312e12 < big <= 271.2e12 * 1.0001
    assert prof.gemm_rate(256, 256, 256) < 0.2 * big
    assert prof.gemm_rate(8192, 128, 8192) < prof.gemm_rate(8192, 4096, 8192)


def test_the_a100_preset_uses_its_kernel_profile_and_says_so():
    cluster = load_cluster("a100-80g", 8)
    assert cluster.kernels == "a100-published"
    with pytest.raises(ValueError, match="kernels"):
        cluster.with_kernels("no-such-profile")


def test_a_measured_sweep_loads_as_a_kernel_profile(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cpu-kernels.json"
    mod.main(["--device", "cpu", "--quick", "--out", str(out)])
    prof = load_kernel_profile(str(out))
    assert prof.gemm_rate(128, 128, 64) > 0 and prof.memory_bandwidth > 0
    assert prof.attention_kernel == "flash" and prof.attention


def test_a_profile_of_another_schema_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "other"}')
    with pytest.raises(KernelProfileError, match="schema"):
        load_kernel_profile(str(bad))


def test_hardware_tflops_count_the_recomputed_forward_and_mfu_does_not(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + ROW_22B)
    row = load_published(p)[0]
    full = check_row(row)
    none = check_row(replace(row, recompute="none"))
    model_tflops = full.mfu * 312
    # the recomputed forward: a fifth to a third more (checkpointing stops before a block's last GEMM)
    assert full.hfu_tflops > 1.2 * model_tflops
    assert none.hfu_tflops == pytest.approx(none.mfu * 312)


def test_published_layouts_fit_and_drop_out_without_recomputation(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + ROW_22B)
    row = load_published(p)[0]
    assert check_row(row).fits
    assert not check_row(replace(row, recompute="none")).fits


def test_the_gpt_model_is_a_gelu_mlp_of_four_times_the_hidden_size():
    row = load_published(TABLE)[0]
    llm = model_of(row).llm
    assert (llm.mlp, llm.norm, llm.ffn, llm.kv_heads) == ("gelu", "layer", 4 * row.hidden, row.heads)


def test_a_bad_published_row_names_the_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + ROW_17B.replace(",32,1,1,1,512", ",30,4,1,1,512"))
    with pytest.raises(PublishedError, match="tp\\*pp\\*cp"):
        load_published(p)
    p.write_text(HEADER + ROW_17B.replace(",137,", ",137,3.5"))
    with pytest.raises(PublishedError, match="exactly one of tflops_per_gpu, mfu, step_time_s"):
        load_published(p)


def test_validate_published_prints_each_rows_error_and_the_mean(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + ROW_17B + ROW_22B)
    app = typer.Typer()
    sim_cli.register(app)
    r = CliRunner().invoke(app, ["validate", "--published", str(p)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "gpt-1.7b" in r.output and "gpt-22b" in r.output
    assert "mean |error|" in r.output and "megatron-hfu" in r.output
    assert "kernel profile a100-published" in r.output
    r = CliRunner().invoke(app, ["validate", "--published", str(p), "--kernels", "none"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "datasheet roofline curve (fallback" in r.output


def test_virtual_stages_are_validated_and_refused_by_the_runtime():
    model = model_of(load_published(TABLE)[0])
    with pytest.raises(SpecError, match="virtual_stages=2 needs pp >= 2"):
        ParallelSpec(world_size=8, tp=8, virtual_stages=2).validate(model)
    with pytest.raises(SpecError, match="not supported by the runtime"):
        ParallelSpec(world_size=8, pp=2, virtual_stages=2).check_runtime()


def test_a_scaled_gpus_simulations_share_one_kernel_profile_and_answer_as_a_fresh_one_would():
    """Every simulation makes its own ComputeModel; on a GPU whose kernels are the H100's scaled (H200,
    A100, B200) each used to get a scaled copy with empty caches. One profile per process now, so what
    a step costs must not depend on which steps were costed on it before (GEMM rates by bucket centre,
    a block's terms by token count, attention by length)."""
    from omnibench.specs.presets import get_model
    from simulator.compute import ComputeModel
    from simulator.engine import simulate
    from systems import get_planner
    from workloads.stream import WorkloadStream

    cluster = load_cluster("h200", 64)
    assert ComputeModel(cluster).kernels is ComputeModel(cluster.with_gpus(8)).kernels
    assert ComputeModel(cluster).kernels is not ComputeModel(load_cluster("h100", 64)).kernels
    model = get_model("omni-7b")
    parallel = ParallelSpec(world_size=64, tp=2, microbatches=2)
    stream = WorkloadStream("mixed_video", seed=3, global_batch_tokens=4096 * 64)
    plans = [get_planner("homogeneous").plan(model, parallel, stream.batch(s)) for s in (0, 1)]

    def step(plan) -> tuple:
        r = simulate(plan, model, cluster)
        return r.step_time, tuple(s.memory_needed for s in r.ranks)

    load_kernel_profile.cache_clear()  # a profile loaded again gets a fresh scaled copy
    fresh_profile = ComputeModel(cluster).kernels
    fresh = step(plans[1])
    load_kernel_profile.cache_clear()
    assert ComputeModel(cluster).kernels is not fresh_profile
    step(plans[0])  # another batch first: the profile's caches hold its shapes
    assert step(plans[1]) == fresh

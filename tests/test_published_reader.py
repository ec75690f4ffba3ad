"""The published-runs reader (`simulator/published.py`) and `omnibench validate --published`: every row
of results/validation/published_runs.csv becomes a model, a layout and a measured step time; error is
reported per row, per source, calibration and held-out apart, unstated FLOP formulas apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnibench.cli import simulate as sim_cli
from simulator.hardware import load_cluster
from simulator.published import (
    PublishedCheck,
    PublishedError,
    groups,
    load_published,
    measured,
    model_of,
    options_of,
    parallel_of,
    publication_flops,
)

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "results" / "validation" / "published_runs.csv"
# cheap rows (8 to 32 GPUs): one per split, one of an unstated FLOP formula
FAST = "megatron-1.7b-32gpu|mpt-7b-8xh100|megatron2019-1.2b-1gpu"


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in load_published(CSV)}


def test_every_row_loads_gets_a_layout_and_has_a_hardware_preset(rows):
    from systems.common import llm_layout

    refused = {}  # rows the simulator cannot express: none
    assert len(rows) >= 100
    for r in rows.values():
        cluster = load_cluster(r.hardware, r.gpus)
        assert measured(r, cluster.gpu.peak_tflops) > 0
        model = model_of(r)
        parallel = parallel_of(r, cluster.gpus_per_node)
        try:
            parallel.validate(model)
            llm_layout(parallel, range(r.gpus), interleaved=True)
        except ValueError as e:
            refused[r.name] = str(e)
            continue
        assert parallel.dp * parallel.tp * parallel.pp * parallel.cp == r.gpus, r.name
        assert parallel.dp_mode == r.dp_mode, r.name
    assert not refused, refused


def test_a_rows_plan_holds_its_global_batch(rows):
    from systems import get_planner
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    for name in ("tt-8b-fsdp8", "megatron-1.7b-32gpu", "nemo-llama2-13b-16gpu"):
        r = rows[name]
        stream = WorkloadStream(get_workload(f"pretrain_{r.seq}"), seed=0, global_batch_tokens=r.global_batch * r.seq)
        plan = get_planner("homogeneous").plan(model_of(r), parallel_of(r, 8), stream.batch(0))
        assert len(plan.samples) == r.global_batch
        assert all(len(mb) == r.micro_batch for mbs in plan.assignment["llm"].values() for mb in mbs), name


def test_each_model_kind_gets_its_block(rows):
    gpt, llama, moe = (model_of(rows[n]).llm for n in ("megatron-1.7b-32gpu", "tt-8b-fsdp8",
                                                         "mbridge-qwen3-30b-a3b-16gpu"))
    assert (gpt.mlp, gpt.norm, gpt.positions, gpt.kv_heads, gpt.tie_embeddings) == ("gelu", "layer", "learned", 24, True)
    assert (llama.mlp, llama.norm, llama.positions, llama.kv_heads, llama.tie_embeddings) == \
        ("swiglu", "rms", "rope", 8, False)
    assert moe.moe is not None and (moe.moe.experts, moe.moe.top_k, moe.moe.expert_ffn) == (128, 8, 768)
    assert moe.dim_head == 128 and moe.qk_norm  # head_dim=128 from the notes, not hidden/heads = 64


def test_rows_that_name_deepep_dispatch_through_it_and_the_others_all_to_all(rows):
    assert options_of(rows["modelzoo-qwen3-235b-256gpu-1"]).ep_dispatcher == "deepep"
    assert options_of(rows["modelzoo-qwen3-235b-256gpu-4"]).ep_dispatcher == "alltoall"  # "dispatcher A2A"
    assert options_of(rows["mbridge-qwen3-235b-a22b-256gpu"]).ep_dispatcher == "alltoall"  # not stated


def test_measured_step_time_follows_the_rows_figure(rows):
    tps = rows["tt-8b-fsdp8"]
    assert measured(tps) == pytest.approx(16 * 8192 / (5762 * 8))
    step = rows["megascale-175b-megatron-256gpu"]
    assert measured(step) == 40.0
    hfu = rows["megatron-1.7b-32gpu"]
    b, s, n, h, v = 512, 2048, 24, 2304, 51200
    flops = 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert publication_flops(hfu) == pytest.approx(flops)
    assert measured(hfu) == pytest.approx(flops / (137e12 * 32))


def test_unstated_flop_rates_use_the_model_flop_counter_and_are_reported_apart(rows):
    r = rows["llama3-405b-8192gpu-cp1"]
    assert r.unstated
    # 6 N T plus causal attention, no recomputation: more than 6 N T, less than 1.2x it
    n_params = 405e9
    six_nt = 6 * n_params * r.global_batch * r.seq
    assert six_nt < publication_flops(r) < 1.2 * six_nt
    fake = [PublishedCheck(row=x, measured_s=1.0, simulated_s=1.0 + e, fits=True, fit_message="", peak_memory_gib=1.0,
                           mfu=0.5, hfu_tflops=1.0)
            for x, e in ((r, 0.5), (rows["tt-8b-fsdp8"], 0.1), (rows["tt-8b-fsdp8-compile"], -0.2))]
    g = groups(fake)
    assert g["split"]["unstated"].rows == 1 and g["split"]["unstated"].mean_abs == pytest.approx(0.5)
    assert g["split"]["calibration"].rows == 1 and g["split"]["heldout"].worst == pytest.approx(-0.2)
    assert ("llama3-2024", "unstated") in g["source"] and ("llama3-2024", "heldout") not in g["source"]


def test_a_bad_row_names_its_column(tmp_path):
    lines = CSV.read_text().splitlines()
    header, first = lines[0], lines[1]
    bad = tmp_path / "bad.csv"
    bad.write_text(header + "\n" + first.replace(",selective,,bf16,,torchtitan,", ",sometimes,,bf16,,torchtitan,") + "\n")
    with pytest.raises(PublishedError, match="recompute must be one of none, selective, full; got 'sometimes'"):
        load_published(bad)
    bad.write_text(header + "\n" + first.replace(",fsdp,16,2,", ",fsdp,15,2,") + "\n")
    with pytest.raises(PublishedError, match="global_batch 15 is not a multiple"):
        load_published(bad)
    bad.write_text(header.replace("notes", "remarks") + "\n" + first + "\n")
    with pytest.raises(PublishedError, match="missing column notes"):
        load_published(bad)


def _app():
    app = typer.Typer()
    sim_cli.register(app)
    return app


@pytest.mark.timeout(300)
def test_validate_published_prints_splits_sources_and_writes_json_and_markdown(tmp_path):
    md = tmp_path / "table.md"
    r = CliRunner().invoke(_app(), ["validate", "--published", str(CSV), "--rows", FAST, "--markdown", str(md)],
                           env={"COLUMNS": "220"})
    assert r.exit_code == 0, r.output
    for text in ("megatron-1.7b-32gpu", "calibration: mean |error|", "heldout: mean |error|",
                 "unstated: mean |error|", "narayanan2021 (calibration)", "llm-foundry (heldout)",
                 "shoeybi2019 (unstated)"):
        assert text in r.output, text
    table = md.read_text()
    assert table.startswith("<!-- written by `python -m omnibench validate --published")
    assert "| mpt-7b-8xh100 | llm-foundry | heldout |" in table
    r = CliRunner().invoke(_app(), ["validate", "--published", str(CSV), "--rows", "megatron-1.7b", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["rows"][0]["name"] == "megatron-1.7b-32gpu" and got["split"]["calibration"]["rows"] == 1
    assert got["rows"][0]["measured_s"] > 0 and "error" in got["rows"][0]


def test_validate_published_refuses_an_unknown_stack_and_an_empty_selection():
    r = CliRunner().invoke(_app(), ["validate", "--published", str(CSV), "--stack", "turbo"])
    assert r.exit_code != 0 and "stack must be one of eager, fused; got 'turbo'" in r.output
    r = CliRunner().invoke(_app(), ["validate", "--published", str(CSV), "--rows", "no-such-row"])
    assert r.exit_code != 0 and "no row name matches" in r.output

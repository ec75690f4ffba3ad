"""One rule per layout constraint, the same for plan, run, simulate and tune: a layout one command
refuses is refused by every command, before any work or any record."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_errors import invoke

from omnibench.specs.model import SpecError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model

pytestmark = pytest.mark.timeout(180)



def test_ulysses_cp_must_divide_the_heads_per_tp_rank():
    model = get_model("omni-7b")  # 28 query heads, 4 kv heads
    with pytest.raises(SpecError, match=r"cp=8 with cp_kind=ulysses .* allowed cp: 1, 2, 4"):
        ParallelSpec(world_size=64, cp=8, cp_kind="ulysses").validate(model)
    # all-gathered K/V and ring attention keep every head on every rank: any cp
    for kind in ("allgather", "ring"):
        ParallelSpec(world_size=64, cp=8, cp_kind=kind).validate(model)
    ParallelSpec(world_size=64, cp=4, cp_kind="ulysses").validate(model)
    with pytest.raises(SpecError, match=r"heads per tp rank \(28/2 query, 4/2 kv\)"):
        ParallelSpec(world_size=64, tp=2, cp=4, cp_kind="ulysses").validate(model)


@pytest.mark.parametrize("command", [
    ("plan", "--system", "homogeneous", "--nproc", "6", "--cp", "3"),
    ("simulate", "--system", "homogeneous", "-w", "mixed_video", "--gpus", "24", "--cp", "3", "--cp-kind", "ulysses"),
], ids=["plan", "simulate"])
def test_plan_and_simulate_refuse_the_ulysses_layout_run_refuses(tmp_path, command):
    out = tmp_path / "out"
    r = invoke(*command, *(("--out", str(out)) if command[0] == "simulate" else ()))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "cp=3 with cp_kind=ulysses must divide" in errors[0], r.output
    assert not out.exists() or not any(out.iterdir())


def test_a_workload_trains_the_model_less_the_encoders_its_samples_never_feed():
    from omnibench.resolve import model_for_workload
    from workloads.modules import encoders_used
    from workloads.registry import get_workload

    assert encoders_used(get_workload("long_video")) == ("vision",)
    assert encoders_used(get_workload("omni_av")) == ("vision", "audio")
    assert encoders_used(get_workload("text_only")) == ()
    name, note = model_for_workload("omni-7b", get_workload("long_video"))
    assert name == "omni-7b@no-audio" and "long_video feeds no audio encoder" in note
    assert model_for_workload("omni-7b", get_workload("omni_av")) == ("omni-7b", "")
    assert model_for_workload("qwen2-vl-7b", get_workload("long_video")) == ("qwen2-vl-7b", "")
    model = get_model("omni-7b@8L@no-audio")
    assert list(model.encoders) == ["vision"] and model.llm.layers == 8
    assert get_model("omni-7b@no-audio").vision == get_model("omni-7b").vision
    with pytest.raises(SpecError, match="qwen2-vl-7b has no audio encoder"):
        get_model("qwen2-vl-7b@no-audio")


def test_an_encoder_no_sample_feeds_constrains_no_layout():
    # temporal's one Ulysses degree spans every encoder it runs: omni-7b's audio encoder (20 heads) rules
    # out cp 8, but long_video never feeds it, so without it cp 8 plans
    from systems import get_planner
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    batch = WorkloadStream(get_workload("long_video"), seed=0, global_batch_tokens=64 * 8192).batch(0)
    parallel = ParallelSpec(world_size=64, cp=8, cp_kind="allgather", fsdp=True)
    with pytest.raises(Exception, match="does not divide its 20 heads"):
        get_planner("temporal").plan(get_model("omni-7b"), parallel, batch)
    plan = get_planner("temporal").plan(get_model("omni-7b@no-audio"), parallel, batch)
    assert set(plan.layouts) == {"llm", "vision"}


def test_simulate_runs_the_model_less_the_encoders_the_workload_never_feeds(tmp_path):
    import json

    r = invoke("simulate", "--system", "temporal", "--workload", "long_video", "--gpus", "64", "--tp", "1",
               "--cp", "8", "--cp-kind", "allgather", "--out", str(tmp_path / "out"), "--json")
    assert r.exit_code == 0, r.output
    record = json.loads(r.output)["record"]
    config = json.loads((Path(record) / "config.json").read_text())
    assert config["model"] == "omni-7b@no-audio" and "feeds no audio encoder" in config["model_note"]
    row = json.loads(r.output)["results"][0]
    assert row["fits"] and "imbalance" in row
    assert row["peak_memory_gib"] <= row["memory_capacity_gib"]

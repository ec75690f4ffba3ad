"""temporal is VeOmni (FSDP over all ranks, one Ulysses degree for encoders and LLM, no pipeline)
and homogeneous is Megatron-style; each system has its own default layout (systems/defaults.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from omnibench.cli import app
from omnibench.plan import FORWARD, PlanError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine
from simulator.hardware import load_cluster
from systems import get_planner
from systems.defaults import default_layout, with_default_layout
from workloads.stream import WorkloadStream

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")


def _batch(n: int, tokens_per_rank: int = 8192, workload: str = "mixed_video", **kw):
    return WorkloadStream(workload, seed=0, global_batch_tokens=tokens_per_rank * n, **kw).batch(0)


def _tiny_batch():
    # What `omnibench plan` draws by default (4 ranks, tiny samples).
    return WorkloadStream("mixed_video", seed=0, global_batch_tokens=1536, length_scale=0.02,
                          max_sample_tokens=384).batch(0)


# ------------------------------------------------------------------------------------ planner


def test_temporal_encoders_run_ulysses_over_the_llms_cp_group_with_fsdp_over_every_rank():
    model = get_model("tiny-omni")
    plan = get_planner("temporal").plan(model, ParallelSpec(world_size=8, cp=2), _tiny_batch())
    llm = plan.layouts["llm"]
    for module in ("vision", "audio"):
        enc = plan.layouts[module]
        assert (enc.tp, enc.sp, enc.dp) == (1, 2, 4) and enc.fsdp
        assert sorted(enc.groups("sp")) == sorted(llm.groups("cp"))  # VeOmni's one ulysses_parallel_size
        assert enc.fsdp_groups() == [tuple(range(8))]  # parameters sharded over all ranks
    # Every cp member ends the encoder forward holding the whole output: nothing crosses ranks.
    assert plan.routes and all(r.src_rank == r.dst_rank for r in plan.routes)
    for acts in plan.actions.values():
        kinds = [(a.kind, a.module) for a in acts if a.kind == FORWARD]
        assert kinds == [(FORWARD, "vision"), (FORWARD, "llm")]  # one module at a time (no audio in this batch)


def test_temporal_refuses_an_encoder_sp_other_than_its_cp_and_encoder_tp():
    model = get_model("tiny-omni")
    with pytest.raises(PlanError, match="encoder_sp"):
        get_planner("temporal").plan(model, ParallelSpec(world_size=4, cp=2, encoder_sp=4), _tiny_batch())
    with pytest.raises(PlanError, match="encoder_tp"):
        get_planner("temporal").plan(model, ParallelSpec(world_size=4, encoder_tp=2), _tiny_batch())


# ----------------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("model_name,world", [("tiny-omni", 4), ("omni-7b", 64)])
def test_homogeneous_and_temporal_plans_differ_at_their_own_default_layouts(model_name, world):
    model = get_model(model_name)
    batch = _tiny_batch() if model_name.startswith("tiny") else _batch(world)
    plans = {}
    for system in ("homogeneous", "temporal"):
        parallel, note = with_default_layout(system, model, ParallelSpec(world_size=world), batch)
        assert "fell back" not in note, note
        plans[system] = get_planner(system).plan(model, parallel, batch)
    hom, tem = plans["homogeneous"], plans["temporal"]
    # Megatron-style: tp inside a node, encoders inherit it; VeOmni: tp 1 everywhere, FSDP over all ranks.
    assert hom.layouts["llm"].tp > 1 and hom.layouts["vision"].tp == hom.layouts["llm"].tp
    assert tem.layouts["llm"].tp == 1 and tem.layouts["vision"].tp == 1
    assert tem.layouts["vision"].fsdp_size == world
    assert tem.layouts["vision"].sp == tem.layouts["llm"].cp
    assert hom.to_dict()["layouts"] != tem.to_dict()["layouts"]


def test_temporal_default_sp_grows_with_the_longest_sample():
    model = get_model("omni-7b")
    short = _batch(64, workload="image_sft")
    long = _batch(64, workload="mixed_video")
    assert max(s.llm_tokens for s in long.samples) > sum(s.llm_tokens for s in long.samples) / 64
    d_long = default_layout("temporal", model, 64, 8, long.samples)
    assert (d_long.tp, d_long.pp) == (1, 1) and d_long.cp > 1
    longest = max(s.llm_tokens for s in short.samples)
    d_short = default_layout("temporal", model, 64, 8, short.samples)
    assert longest / d_short.cp <= sum(s.llm_tokens for s in short.samples) / 64 or d_short.cp == 4
    assert d_short.cp <= d_long.cp


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("model_name,world", [("tiny-omni", 2), ("tiny-omni", 4), ("tiny-omni", 8), ("omni-7b", 16),
                                              ("omni-7b", 256)])
def test_each_default_layout_is_valid_for_its_world_size_and_model(system, model_name, world):
    model = get_model(model_name)
    batch = _tiny_batch() if model_name.startswith("tiny") else _batch(world)
    parallel, note = with_default_layout(system, model, ParallelSpec(world_size=world), batch)
    assert "fell back" not in note, note
    parallel.validate(model)
    plan = get_planner(system).plan(model, parallel, batch)
    assert plan.world_size == world
    if system == "temporal":
        assert (parallel.tp, parallel.pp) == (1, 1)
    else:
        assert parallel.tp == min(world // 2, 2 if model_name.startswith("tiny") else 4) and parallel.cp == 1


def test_a_default_that_does_not_plan_falls_back_with_a_note():
    from omnibench.specs.model import SpecError

    def no_tensor_parallelism(model, parallel):  # a runtime limit, as `run` passes launch.runtime_limits
        if parallel.tp > 1:
            raise SpecError(f"tp={parallel.tp}: not on this runtime")

    model = get_model("omni-7b")
    parallel, note = with_default_layout("homogeneous", model, ParallelSpec(world_size=16), _batch(16),
                                         check=no_tensor_parallelism)
    assert (parallel.tp, parallel.pp, parallel.cp) == (1, 1, 1)
    assert note == ("homogeneous's default layout (tp 4, pp 1, cp 1) does not plan here (tp=4: not on this "
                    "runtime); fell back to tp 1, pp 1, cp 1")


def test_tune_starts_from_each_systems_default_layout():
    from omnibench.tune import Candidate, default_candidate, search_space

    model = get_model("omni-7b")
    batch = _batch(64)
    hom = default_candidate("homogeneous", model, 64, 8, batch.samples)
    tem = default_candidate("temporal", model, 64, 8, batch.samples)
    assert (hom.tp, hom.pp, hom.cp) == (4, 1, 1)
    assert (tem.tp, tem.pp) == (1, 1) and tem.cp == default_layout("temporal", model, 64, 8, batch.samples).cp > 1
    assert tem in search_space("temporal", model, 64, 8)
    assert default_candidate("temporal") == Candidate("temporal")  # no model given: tp 1, pp 1


# -------------------------------------------------------------------------------------- CLI


def test_plan_prints_each_systems_own_default_layout_and_explicit_flags_override_it():
    runner = CliRunner()
    out = {}
    for system in ("homogeneous", "temporal"):
        r = runner.invoke(app, ["plan", "--system", system], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        out[system] = r.output
    assert "layout: tp 2, pp 1, cp 1 (homogeneous's default: Megatron-style" in out["homogeneous"]
    assert "layout: tp 1, pp 1, cp 1 (temporal's default: VeOmni-style" in out["temporal"]
    r = runner.invoke(app, ["plan", "--system", "homogeneous", "--tp", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["layouts"]["llm"]["tp"] == 1
    r = runner.invoke(app, ["plan", "--system", "temporal", "--cp", "2", "--json"])
    assert json.loads(r.output)["layouts"]["vision"]["sp"] == 2


def test_simulate_runs_each_system_at_its_default_layout_and_says_which(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "-w", "mixed_video", "-s", "homogeneous,temporal", "--gpus", "16",
                                 "--recompute", "full", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rows = {x["system"]: x for x in json.loads(r.output)["results"]}
    assert rows["homogeneous"]["layout"] == "tp4 pp1 cp1"
    assert rows["temporal"]["layout"].startswith("tp1 pp1 cp")


# ---------------------------------------------------------------------------------- simulator


def test_the_simulator_costs_temporals_encoder_all_to_alls():
    """sp 2 splits each encoder microbatch over the cp group: half the positions per rank and two
    all-to-alls per block, costed on the encoder's forward (no FSDP here, so that is its only comm)."""
    model = get_model("omni-7b")
    batch = _batch(16)
    cluster = load_cluster("h100", 16)
    got = {}
    for cp in (1, 2):
        plan = get_planner("temporal").plan(model, ParallelSpec(world_size=16, cp=cp, fsdp=False), batch)
        eng = Engine(plan, model, cluster)
        cls = eng.classes()
        fwd = [op for op in eng.program(0, cls) if op.action.kind == FORWARD and op.action.module == "vision"][0]
        work = eng.work("vision", 0, eng._signature("vision", 0, 0))
        positions = sum(sum(plan.sample(i).encoder_seq_lens("vision")) for i in eng._microbatch("vision", 0, 0))
        got[cp] = (fwd.comm, work.seq_bytes, work.tokens, positions)
    assert got[1][0] == 0 and got[1][1] == 0 and got[1][2] == got[1][3]
    assert got[2][0] > 0 and got[2][1] > 0 and got[2][2] == got[2][3] // 2


# ------------------------------------------------------------------------------------- parity


# temporal at cp 2 against homogeneous over four steps: tests/test_omni_parity.py
# (test_temporal_with_ulysses_sp_2_trains_like_homogeneous_over_four_steps), in that module's launch,
# whose homogeneous run on the same four batches it shares.


@pytest.mark.timeout(240)
def test_run_without_layout_flags_trains_at_the_systems_default_and_records_it(tmp_path):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # four ranks give homogeneous's Megatron-style default a tp group; temporal's is tp 1 at any size
    for system, tp, nproc in (("homogeneous", 2, "4"), ("temporal", 1, "2")):
        out = tmp_path / system
        res = subprocess.run([sys.executable, "-m", "omnibench", "run", "--system", system, "--device", "cpu",
                              "--nproc", nproc, "--steps", "1", "--out", str(out), "--json"], capture_output=True,
                             text=True, timeout=200, cwd=repo, env={**os.environ, "PYTHONPATH": repo})
        assert res.returncode == 0, res.stderr
        summary = json.loads(res.stdout)
        assert summary["steps"] == 1 and any(n.startswith(f"{system}'s default: ") for n in summary["notes"])
        run = json.loads((out / "config.json").read_text())["run"]
        assert (run["tp"], run["pp"]) == (tp, 1)

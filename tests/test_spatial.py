"""spatial: temporal's layout with the encoders and the LLM side by side on every rank, each lane on a quota
of the device (systems/spatial.py); its plans, the simulator's timing of them (simulator/quota.py,
simulator/program.py `concurrent_ops`) and tune's quota search. Its loss parity with one process is
tests/test_runtime_parity.py's."""

from __future__ import annotations

import pytest

from omnibench.plan import BACKWARD, BOUNDARY, FORWARD, GRAD_SYNC, Action, PlanError, lane_of
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, simulate
from simulator.hardware import load_cluster
from simulator.quota import quota_time
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)


def _batch(gpus: int, workload: str = "omni_av", tokens: int = 16384):
    return WorkloadStream(workload, seed=3, global_batch_tokens=tokens * gpus).batch(0)


def _plan(system: str, gpus: int = 8, **layout):
    return get_planner(system).plan(get_model("omni-7b"), ParallelSpec(world_size=gpus, **layout), _batch(gpus))


def _compute(acts):
    return [(a.kind, a.module, a.microbatch, a.concurrent) for a in acts if a.kind in (FORWARD, BACKWARD)]


def test_a_step_runs_in_phases_a_pass_beside_the_same_pass_of_a_neighbouring_microbatch():
    plan = _plan("spatial", cp=2, microbatches=3, options={"quota": "0.4"})
    acts = plan.actions[0]
    assert _compute(acts) == [
        (FORWARD, "vision", 0, -1), (FORWARD, "audio", 0, -1),  # alone: the whole device
        (FORWARD, "llm", 0, 0), (FORWARD, "vision", 1, 0), (FORWARD, "audio", 1, 0),
        (BACKWARD, "llm", 0, -1),  # no encoder backward before it: alone
        (FORWARD, "llm", 1, 1), (FORWARD, "vision", 2, 1), (FORWARD, "audio", 2, 1),
        (BACKWARD, "llm", 1, 2), (BACKWARD, "audio", 0, 2), (BACKWARD, "vision", 0, 2),
        (FORWARD, "llm", 2, -1),
        (BACKWARD, "llm", 2, 3), (BACKWARD, "audio", 1, 3), (BACKWARD, "vision", 1, 3),
        (BACKWARD, "audio", 2, -1), (BACKWARD, "vision", 2, -1),
    ]
    grouped = [a for a in acts if a.concurrent >= 0]
    assert {lane_of(a): a.quota for a in grouped} == {"llm": 0.6, "encoders": 0.4}
    assert plan.options["spatial"] == {"quota": "given", "encoder_quota": 0.4}
    assert acts[-1].kind != FORWARD and any(a.kind == GRAD_SYNC for a in acts)


def test_one_microbatch_is_temporals_step():
    spatial, temporal = _plan("spatial", cp=2, microbatches=1), _plan("temporal", cp=2, microbatches=1)
    assert {r: [str(a) for a in acts] for r, acts in spatial.actions.items()} == \
        {r: [str(a) for a in acts] for r, acts in temporal.actions.items()}
    cluster = load_cluster("h100", 8)
    model = get_model("omni-7b")
    assert simulate(spatial, model, cluster).step_time == simulate(temporal, model, cluster).step_time


def test_the_auto_quota_is_the_encoders_share_of_the_work_and_a_boundary_crosses_between_phases():
    plan = _plan("spatial", tp=2, microbatches=3)  # tp 2: the encoders split each microbatch over the tp ranks
    assert plan.options["spatial"]["quota"].startswith("auto")
    for acts in plan.actions.values():
        shares = {a.concurrent: a.quota for a in acts if a.concurrent >= 0 and a.module != "llm"}
        assert shares and all(0.05 <= q <= 0.95 for q in shares.values())
    # per phase: the shares differ with the microbatches' mixes
    assert len({a.quota for acts in plan.actions.values() for a in acts if a.concurrent >= 0 and a.module != "llm"}) > 1
    boundary = [a for acts in plan.actions.values() for a in acts if a.kind == BOUNDARY]
    assert boundary and all(a.concurrent < 0 for a in boundary)
    plan.validate(order=True)


@pytest.mark.parametrize("options, match", [
    ({"quota": "1.5"}, "options.quota must be auto or a share in"),
    ({"quota": "half"}, "options.quota must be auto or a share in"),
])
def test_a_bad_quota_is_refused_naming_the_option(options, match):
    with pytest.raises(PlanError, match=match):
        _plan("spatial", microbatches=2, options=options)


def test_pipelines_and_other_encoder_layouts_are_refused():
    with pytest.raises(PlanError, match="pp: spatial"):
        _plan("spatial", pp=2, microbatches=2)
    with pytest.raises(PlanError, match="encoder_tp"):
        _plan("spatial", encoder_tp=2)


def _regroup(plan, rank, change):
    plan.actions[rank] = [change(a) if a.concurrent >= 0 else a for a in plan.actions[rank]]


def test_validate_refuses_oversubscribed_split_or_non_compute_groups():
    plan = _plan("spatial", microbatches=2, options={"quota": "0.4"})
    over = _plan("spatial", microbatches=2, options={"quota": "0.4"})
    _regroup(over, 0, lambda a: Action(a.kind, a.module, a.microbatch, a.stage, concurrent=a.concurrent, quota=0.7))
    with pytest.raises(PlanError, match="sum to more than the device"):
        over.validate()
    split = plan.actions[0]
    first = next(i for i, a in enumerate(split) if a.concurrent == 0)
    split.insert(first + 1, Action(GRAD_SYNC, "llm"))
    with pytest.raises(PlanError, match="only forward and backward|not listed together"):
        plan.validate()


def test_a_lane_on_a_quota_stretches_only_the_part_that_needs_every_sm():
    assert quota_time(1.0, 0.0, 0.5) == 1.0  # leaves the SMs idle (launch- or memory-bound): no slower
    assert quota_time(1.0, 1.0, 0.5) == 2.0  # fills the device: half of it, twice as long
    assert quota_time(1.0, 0.4, 0.25) == pytest.approx(0.4 * 4 + 0.6)
    assert quota_time(1.0, 1.0, 1.0) == 1.0


def test_a_phase_lasts_as_long_as_its_longer_lane_and_locks_its_peers():
    model, cluster = get_model("omni-7b"), load_cluster("h100", 8)
    plan = _plan("spatial", cp=2, microbatches=3, options={"quota": "0.4"})
    engine = Engine(plan, model, cluster)
    cls, _, _ = engine._classes()
    raw = []
    for a in plan.actions[0]:
        if a.kind in (FORWARD, BACKWARD) and a.concurrent == 2:
            raw.append(engine._compute_op(0, a, cls))
    lanes = {"llm": 0.0, "encoders": 0.0}
    for op in raw:
        lanes[lane_of(op.action)] += op.duration + op.exposed
    merged = [op for op in engine.program(0, cls) if op.action.concurrent == 2]
    assert len(merged) == 1
    assert merged[0].duration + merged[0].exposed == pytest.approx(max(lanes.values()))
    assert merged[0].lock_key is not None and merged[0].mem_peak >= max(op.mem_peak for op in raw)
    # each lane on its share: the LLM's backward is slower than on the whole device
    whole = Engine(_plan("temporal", cp=2, microbatches=3), model, cluster)
    llm_bwd = next(a for a in whole.plan.actions[0] if a.kind == BACKWARD and a.module == "llm" and a.microbatch == 1)
    shared = next(op for op in raw if op.action.kind == BACKWARD and op.action.module == "llm")
    assert shared.duration > whole._compute_op(0, llm_bwd, whole._classes()[0]).duration


def test_tune_searches_the_quota_around_a_two_microbatch_layout():
    from omnibench.tune import Candidate, encoder_variants

    model = get_model("omni-7b")
    one = Candidate("spatial", cp=4, microbatches=1)
    got = encoder_variants("spatial", model, 64, one, 8)
    assert got[0] == Candidate("spatial", cp=4, microbatches=2)
    assert {c.quota for c in got[1:]} == {"0.2", "0.3", "0.4", "0.5", "0.6"} and all(c.microbatches == 2 for c in got)
    assert encoder_variants("spatial", model, 64, one, 8, options={"quota": "0.3"}) == []
    assert got[1].flags()[-2:] == ["--option", "quota=0.2"] and got[1].label().endswith("q0.2")


def test_the_cli_simulates_and_plans_spatial_and_refuses_a_bad_quota_in_one_line(tmp_path):
    import json

    from cli_errors import invoke, one_error_line

    out = tmp_path / "sim"
    r = invoke("simulate", "--system", "spatial,temporal", "--workload", "omni_av", "--gpus", "8", "--cp", "2",
               "--microbatches", "3", "--recompute", "full", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["system"]: row for row in json.loads(r.output)["results"]}
    assert rows["spatial"]["step_time_s"] > 0 and rows["temporal"]["step_time_s"] > 0
    r = invoke("plan", "--system", "spatial", "--nproc", "4", "--microbatches", "2", "--option", "quota=0.3")
    assert r.exit_code == 0, r.output
    assert "group0 q0.30" in r.output and "group0 q0.70" in r.output
    one_error_line(invoke("simulate", "--system", "spatial", "--workload", "omni_av", "--gpus", "8",
                          "--option", "quota=2", "--out", tmp_path / "bad"), "options.quota", "(0, 1)")
    assert not (tmp_path / "bad").exists()


def test_omnibench_run_trains_spatial_with_its_lanes_and_records_their_quotas(tmp_path):
    """`omnibench run --system spatial` as a user types it: a complete record whose plan groups the LLM and
    encoder lanes with the quota given."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "omnibench", "run", "--system", "spatial", "--device", "cpu",
                          "--nproc", "2", "--steps", "1", "--microbatches", "2", "--option", "quota=0.4",
                          "--out", str(out), "--json"], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["steps"] == 1
    assert json.loads((out / "config.json").read_text())["run"]["options"] == {"quota": "0.4"}
    plan = json.loads((out / "plan_step0.json").read_text())
    grouped = [a for acts in plan["actions"].values() for a in acts if a.get("concurrent", -1) >= 0]
    assert {round(a["quota"], 2) for a in grouped} == {0.4, 0.6}
    assert {a["module"] for a in grouped} >= {"llm", "vision"}

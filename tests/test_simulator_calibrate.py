"""Calibration and validation: read run records, fit cost curves, compare simulated with measured.

The records here are synthetic (written by the simulator itself with known costs, in the runtime's
record format), so the tests check that the machinery recovers what it was given; how well the
simulator predicts real CPU runs is a measured figure (see benchmarks / the validate command).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.calibrate import CalibrationError, Profile, _Identity, calibrate, validate
from simulator.compute import EfficiencyCurve
from simulator.engine import Engine, SimOptions, simulate
from simulator.hardware import load_cluster
from simulator.traces import TraceError, read_run
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(120)

TRUE = Profile(
    hardware="cpu-gloo",
    compute={
        "forward": EfficiencyCurve(5e10, 0.30, 2e6, 1.5, 2e-3, 0.0, 2e-9),
        "backward": EfficiencyCurve(5e10, 0.12, 3e6, 1.5, 3e-3),
    },
    collectives={"intra": (8e-5, 1.2e9)},
)


def batch(step: int, n: int) -> Batch:
    out = []
    for i in range(n):
        k = (7 * i + 3 * step) % 5
        segs = [Segment("text", 40 + 23 * k)]
        if k % 2 == 0:
            t, h, w = (1, 8, 8 + 4 * k)
            segs.append(Segment("image", t * h * w // 4, t * h * w, grid_thw=(t, h, w)))
        if k == 3:
            segs.append(Segment("audio", 50, 100, mel_frames=200 + 40 * step))
        out.append(Sample(1000 * step + i, "mix", tuple(segs)))
    return Batch(step, out)


def write_record(folder: Path, system: str, steps: int, n: int, profile: Profile, pp: int = 1,
                 plans_jsonl: bool = False, loaded: float = 0.0) -> list[float]:
    """A run record in the runtime's format (records.py), with times from the simulator.

    `plans_jsonl`: every step's Plan in plans.jsonl (today's runtime) instead of plan_step<N>.json;
    `loaded`: compute spans carry their true cost as CPU time (args.cpu_s) while their wall time is
    stretched by up to that factor, as on a host busy with other work."""
    model = get_model("tiny-omni")
    cluster = load_cluster("cpu-gloo", 2)
    planner = get_planner(system)
    parallel = ParallelSpec(world_size=2, pp=pp, microbatches=2 * pp)
    folder.mkdir(parents=True)
    events, rows, t0, plans = [], [], 0.0, []
    for s in range(steps):
        plan = planner.plan(model, parallel, batch(s, n + 2 * s))
        plans.append(plan.to_json(indent=None))
        if not plans_jsonl:
            (folder / f"plan_step{s}.json").write_text(plan.to_json())
        res = simulate(plan, model, cluster, calibration=profile, options=SimOptions(check_memory=False))
        # a rank's own compute of an action (no waits for peers or for communication): its CPU time
        own = Engine(plan, model, cluster, profile.compute_model(cluster), profile.collective_model(cluster),
                     SimOptions(check_memory=False, communication=False))
        for i, sp in enumerate(res.spans):
            args = {"step": s, "module": sp.module}
            dur = sp.duration
            if plans_jsonl:
                args.update(rank=sp.rank, kind=sp.kind, microbatch=sp.microbatch, stage=sp.action.stage,
                            what=sp.action.what)
            if loaded:
                args["cpu_s"] = sp.duration if sp.stream == "compute" else 0.0
                if sp.kind in ("forward", "backward"):
                    args["cpu_s"] = own._compute_op(sp.rank, sp.action, _Identity()).duration
                if sp.kind in ("forward", "backward"):
                    dur *= 1.0 + loaded * ((7 * i + 3 * s) % 10) / 10
            events.append({"name": sp.name, "cat": sp.kind, "ph": "X", "pid": 0, "tid": sp.rank,
                           "ts": (t0 + sp.start) * 1e6, "dur": dur * 1e6, "args": args})
        rows.append({"step": s, "step_time_s": res.step_time})
        t0 += res.step_time
    if plans_jsonl:
        (folder / "plans.jsonl").write_text("".join(p + "\n" for p in plans))
    (folder / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (folder / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"device": "cpu", "dtype": "float32"}))
    from dataclasses import asdict

    (folder / "config.json").write_text(json.dumps({"run": {"system": system}, "model": asdict(model)}))
    return [r["step_time_s"] for r in rows]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = []
    for i, (system, n, pp) in enumerate([("homogeneous", 6, 1), ("temporal", 8, 1), ("homogeneous", 10, 2),
                                         ("colocated", 7, 1)]):
        d = root / f"run{i}"
        write_record(d, system, 4, n, TRUE, pp)
        out.append(str(d))
    return out


def test_reader_parses_runtime_records(records):
    run = read_run(records[2])
    assert sorted(run.step_times) == [0, 1, 2, 3]
    assert len(run.plans) == 4 and run.hardware == "cpu-gloo"
    fwd = [s for s in run.spans if s.kind == "forward" and s.module == "llm"]
    assert fwd and {s.rank for s in fwd} == {0, 1}
    assert {s.microbatch for s in fwd} == {0, 1, 2, 3}  # parsed from the action's name


def test_calibration_recovers_the_costs_that_made_the_traces(records):
    prof = calibrate(records)
    for kind in ("forward", "backward"):
        got, want = prof.compute[kind], TRUE.compute[kind]
        assert got.e_max == pytest.approx(want.e_max, rel=0.05), kind
        assert prof.fit[f"compute.{kind}"]["r2"] > 0.99
    assert prof.provenance["runs"] and prof.provenance["device"] == ["cpu"] and prof.provenance["date"]


def test_validation_with_the_fitted_profile_matches_in_sample(records):
    prof = calibrate(records[:3])
    rows = validate(records, prof)
    assert len(rows) == 4
    assert all(r.steps == 3 for r in rows)  # the warm-up step is left out
    # runs 0-2 are in-sample, run 3 (colocated) is held out; the costs are exact, so both are close
    assert max(abs(r.error) for r in rows) < 0.03


def test_validation_without_calibration_reports_the_datasheet_error(records):
    rows = validate(records[:1], None)
    assert abs(rows[0].error) > 0.1  # cpu-gloo datasheet figures are placeholders, not measurements


def test_profile_round_trips_through_json(tmp_path, records):
    prof = calibrate(records[:2])
    prof.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.compute == prof.compute and again.collectives == prof.collectives
    assert again.optimizer == prof.optimizer and again.provenance == prof.provenance


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        read_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no plan"):
        read_run(tmp_path / "empty")
    with pytest.raises(CalibrationError, match="no such profile"):
        Profile.load(tmp_path / "p.json")


def test_steps_whose_plan_is_unknown_are_skipped_with_the_reason(tmp_path, records):
    import shutil

    d = tmp_path / "only_step0"
    shutil.copytree(records[0], d)
    for p in d.glob("plan_step*.json"):
        if p.name != "plan_step0.json":
            p.unlink()
    rows = validate([str(d), records[1]], None)
    assert rows[0].steps == 0 and rows[0].note.startswith("skipped:") and "RunSpec" in rows[0].note
    assert rows[1].steps == 3


def test_reader_takes_every_steps_plan_from_plans_jsonl_and_span_fields_from_args(tmp_path):
    d = tmp_path / "run"
    write_record(d, "homogeneous", 3, 8, TRUE, pp=2, plans_jsonl=True)
    run = read_run(d)
    assert [p.step for p in run.plans] == [0, 1, 2] and not run.notes
    assert not list(d.glob("plan_step*.json"))
    fwd = [s for s in run.spans if s.kind == "forward" and s.module == "llm"]
    assert {s.microbatch for s in fwd} == {0, 1, 2, 3} and {s.stage for s in fwd} == {0, 1}
    rows = validate([str(d)], TRUE)
    assert rows[0].steps == 2 and abs(rows[0].error) < 1e-6  # the simulator replays its own costs


def test_compute_is_fitted_from_cpu_time_when_the_host_was_loaded(tmp_path):
    dirs = []
    for i, (system, n, pp) in enumerate([("homogeneous", 6, 1), ("temporal", 9, 1), ("homogeneous", 10, 2)]):
        dirs.append(str(tmp_path / f"run{i}"))
        write_record(Path(dirs[-1]), system, 4, n, TRUE, pp, plans_jsonl=True, loaded=2.0)
    prof = calibrate(dirs)
    assert prof.provenance["compute_from"] == "thread CPU time of each action"
    for kind in ("forward", "backward"):
        # wall times were stretched by up to 3x; CPU time still holds the true cost
        assert prof.compute[kind].e_max == pytest.approx(TRUE.compute[kind].e_max, rel=0.05), kind
    # preparing raw inputs (pixel patches, mel frames) is a forward cost of its own
    assert prof.compute["forward"].per_input_element_s == pytest.approx(2e-9, rel=0.1)
    assert prof.compute["backward"].per_input_element_s == 0.0
    # validation says how much of the cores the run had (CPU over wall of actions that wait for nobody:
    # here the 2-stage pipeline's, whose stages have no lock-step peers)
    row = validate(dirs[2:], prof)[0]
    assert row.cpu_share is not None and 0.3 < row.cpu_share < 0.95


def test_compute_fit_separates_the_cost_per_inline_collective_call_from_flops():
    from simulator.calibrate import fit_compute

    rng = __import__("random").Random(0)
    truth = EfficiencyCurve(5e10, 0.4, 1e6, 2.0, 1e-3, 5e-5, 1e-9, 8e-4)
    points = []
    for _ in range(60):
        mm, attn = rng.uniform(1e8, 2e9), rng.uniform(1e7, 3e8)
        ops, seqs = rng.choice([14, 28]), rng.randint(4, 80)
        inputs, calls = rng.uniform(0, 5e6), rng.choice([0, 5, 10])  # FSDP and plain actions
        points.append((mm, attn, ops, seqs, inputs, calls, truth.time(mm, attn, ops, seqs, inputs, calls)))
    curve, stats = fit_compute(points, 5e10)
    assert stats["r2"] > 0.999
    assert curve.per_inline_call_s == pytest.approx(8e-4, rel=0.05)
    assert curve.e_max == pytest.approx(0.4, rel=0.05)


def _pipeline_record(folder: Path, alpha: float, beta: float) -> None:
    """A 2-stage pipeline run in the runtime's format, one span per action in plan order: a send
    only posts its message; a recv ends when the message, sent at the later of the two starts, has
    crossed a link of latency `alpha` and bandwidth `beta` (as the simulator costs it)."""
    from simulator.collectives import CollectiveModel

    model = get_model("tiny-omni")
    cluster = load_cluster("cpu-gloo", 2)
    link = CollectiveModel(cluster, fitted={"intra": (alpha, beta)})
    planner = get_planner("homogeneous")
    folder.mkdir(parents=True)
    events, rows, plans, clock = [], [], [], 0.0
    for s in range(3):
        plan = planner.plan(model, ParallelSpec(world_size=2, pp=2, microbatches=4), batch(s, 8 + s))
        plans.append(plan.to_json(indent=None))
        from simulator.engine import Engine

        eng = Engine(plan, model, cluster)
        now = {r: clock for r in plan.actions}
        pos = dict.fromkeys(plan.actions, 0)
        posted: dict[tuple, float] = {}
        while any(pos[r] < len(plan.actions[r]) for r in plan.actions):
            moved = False
            for r, acts in plan.actions.items():
                while pos[r] < len(acts):
                    a = acts[pos[r]]
                    start = now[r]
                    if a.kind == "send":
                        posted[(r, a.peer, a.what, a.microbatch)] = start
                        end = start + 1e-4
                    elif a.kind == "recv":
                        key = (a.peer, r, a.what, a.microbatch)
                        if key not in posted:
                            break
                        nbytes = eng._p2p_bytes("llm", a.peer, a.microbatch)
                        end = max(start, posted[key]) + link.send_recv(nbytes, a.peer, r)
                    else:
                        end = start + (0.004 if a.kind in ("forward", "backward") else 1e-3)
                    events.append({"name": str(a), "cat": a.kind, "ph": "X", "pid": 0, "tid": r, "ts": start * 1e6,
                                   "dur": (end - start) * 1e6, "args": {"step": s, "rank": r, "kind": a.kind,
                                   "module": a.module, "microbatch": a.microbatch, "stage": a.stage,
                                   "what": a.what, "cpu_s": 1e-4 if a.kind in ("send", "recv") else end - start}})
                    now[r] = end
                    pos[r] += 1
                    moved = True
            assert moved, "the test's pipeline deadlocked"
        rows.append({"step": s, "step_time_s": max(now.values()) - clock})
        clock = max(now.values()) + 0.01
    (folder / "plans.jsonl").write_text("".join(p + "\n" for p in plans))
    (folder / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (folder / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"device": "cpu", "dtype": "float32"}))
    from dataclasses import asdict

    (folder / "config.json").write_text(json.dumps({"run": {"system": "homogeneous"}, "model": asdict(model)}))


def test_p2p_alpha_beta_are_fitted_from_matched_send_recv_pairs_not_from_waits(tmp_path):
    from simulator.calibrate import _comm_points, fit_collectives

    _pipeline_record(tmp_path / "pp", alpha=3e-4, beta=2e8)
    points = _comm_points([read_run(tmp_path / "pp")], None)
    # steps 1 and 2 (step 0 is warm-up): 8 activation and 8 gradient messages each
    assert len(points) == 16 and {p[4] for p in points} == {"p2p"}
    fitted, stats = fit_collectives(points)
    alpha, beta = fitted["intra"]
    assert alpha == pytest.approx(3e-4, rel=0.02) and beta == pytest.approx(2e8, rel=0.02)
    assert stats["intra"]["r2"] > 0.999


def test_a_cpu_profile_blocks_on_collectives_and_counts_optimizer_cost_per_layer():
    from simulator.collectives import CollectiveModel
    from simulator.compute import ComputeModel

    model = get_model("tiny-omni")
    cluster = load_cluster("cpu-gloo", 2)
    plan = get_planner("homogeneous").plan(model, ParallelSpec(world_size=2), batch(1, 8))
    comp = ComputeModel(cluster, dict(TRUE.compute), (1e-3, 0.0, 2e-4, 2e-5))
    times = {}
    for overlap in (True, False):
        coll = CollectiveModel(cluster, fitted={"intra": (5e-3, 1e9)}, inline_overlap=overlap)
        from simulator.engine import Engine

        eng = Engine(plan, model, cluster, comp, coll, SimOptions(check_memory=False))
        times[overlap] = eng.run()
        # FSDP over both ranks: every module's layers (and its root) are sharded
        sharded, plain = eng.layers_on_rank(0)
        assert plain == 0 and sharded == (model.llm.layers + 1) + (model.vision.layers + 1) + (model.audio.layers + 1)
        opt = [sp for sp in times[overlap].spans if sp.kind == "optimizer_step"][0]
        assert opt.duration == pytest.approx(1e-3 + 2e-4 * sharded)
    # without overlap every gather and reduction of every layer waits 5 ms of latency in line
    assert times[False].step_time > times[True].step_time + 0.02
    assert times[False].exposed_comm > times[True].exposed_comm


def test_inline_communication_and_lock_skew_are_fitted_from_the_waits_in_lock_stepped_actions():
    from simulator.calibrate import fit_inline

    rng = __import__("random").Random(1)
    points = []
    for _ in range(80):
        calls, compute = rng.choice([3, 5, 10]), rng.uniform(0.01, 0.08)
        moved = calls * rng.uniform(5e4, 3e5)
        gap = 9e-4 * calls + moved / 5e8 + 0.03 * compute
        points.append(("intra", calls, moved, gap, "inline", compute))
    fitted, skew, stats = fit_inline(points)
    alpha, beta = fitted["intra"]
    assert alpha == pytest.approx(9e-4, rel=0.02) and beta == pytest.approx(5e8, rel=0.02)
    assert skew == pytest.approx(0.03, rel=0.05) and stats["intra"]["r2"] > 0.999


def test_profile_keeps_its_runs_when_the_folder_moves(tmp_path):
    import shutil

    from simulator.calibrate import Profile

    a = tmp_path / "a"
    (a / "runs" / "r1").mkdir(parents=True)
    Profile(hardware="cpu-gloo", provenance={"runs": [str(a / "runs" / "r1")]}).save(a / "profile.json")
    assert '"runs/r1"' in (a / "profile.json").read_text()  # stored relative to the profile
    shutil.move(str(a), str(tmp_path / "b"))
    moved = Profile.load(tmp_path / "b" / "profile.json")
    assert moved.provenance["runs"] == [str((tmp_path / "b" / "runs" / "r1").resolve())]


def test_an_optimizer_term_no_run_constrains_is_fixed_at_zero_and_named():
    from simulator.calibrate import fit_optimizer

    # params vary, plain layers vary, no run had FSDP: sharded layers are 0 on every point
    pts = [(p, 0, L, 0.002 + 3e-9 * p + 1e-4 * L) for p, L in ((1e6, 4), (2e6, 4), (4e6, 8), (8e6, 12), (3e6, 2))]
    coef, stats = fit_optimizer(pts)
    assert coef[2] == 0.0 and stats["fixed_at_zero"] == ["per sharded layer"]
    assert coef[0] == pytest.approx(0.002, rel=1e-3) and coef[1] == pytest.approx(3e-9, rel=1e-3)
    assert coef[3] == pytest.approx(1e-4, rel=1e-3)


def test_calibrate_warns_about_weak_curves_unfitted_actions_and_terms_fixed_at_zero():
    from simulator.calibrate import Profile, fit_warnings

    prof = Profile(hardware="cpu-gloo")
    prof.fit = {
        "compute.forward": {"points": 40, "r2": 0.99, "mape": 0.03},  # good: no warning
        "compute.backward": {"points": 30, "r2": 0.04, "mape": 0.46},  # weak: warned
        "compute.forward.audio": {"points": 3, "not_fitted": "3 traced actions, fewer than 7"},
        "optimizer": {"points": 8, "r2": 0.9, "mape": 0.02, "fixed_at_zero": ["per sharded layer"]},
        "collectives.intra": {"points": 20, "r2": -0.01, "mape": 0.02},  # flat data, small error: fine
    }
    lines = fit_warnings(prof)
    assert len(lines) == 3, lines
    assert lines[0].startswith("compute.backward:") and "R2 0.04" in lines[0] and "46%" in lines[0]
    assert lines[1].startswith("compute.forward.audio: not fitted (3 traced actions")
    assert lines[2].startswith("optimizer: per sharded layer fixed at 0")

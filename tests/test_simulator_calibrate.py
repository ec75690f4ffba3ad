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
from simulator.calibrate import CalibrationError, Profile, calibrate, validate
from simulator.compute import EfficiencyCurve
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from simulator.traces import TraceError, read_run
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(120)

TRUE = Profile(
    hardware="cpu-gloo",
    compute={
        "forward": EfficiencyCurve(5e10, 0.30, 2e6, 1.5, 2e-3),
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


def write_record(folder: Path, system: str, steps: int, n: int, profile: Profile, pp: int = 1) -> list[float]:
    """A run record in the runtime's format (records.py), with times from the simulator."""
    model = get_model("tiny-omni")
    cluster = load_cluster("cpu-gloo", 2)
    planner = get_planner(system)
    parallel = ParallelSpec(world_size=2, pp=pp, microbatches=2 * pp)
    folder.mkdir(parents=True)
    events, rows, t0 = [], [], 0.0
    for s in range(steps):
        plan = planner.plan(model, parallel, batch(s, n + 2 * s))
        (folder / f"plan_step{s}.json").write_text(plan.to_json())
        res = simulate(plan, model, cluster, calibration=profile, options=SimOptions(check_memory=False))
        for sp in res.spans:
            events.append({"name": sp.name, "cat": sp.kind, "ph": "X", "pid": 0, "tid": sp.rank,
                           "ts": (t0 + sp.start) * 1e6, "dur": sp.duration * 1e6,
                           "args": {"step": s, "module": sp.module}})
        rows.append({"step": s, "step_time_s": res.step_time})
        t0 += res.step_time
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

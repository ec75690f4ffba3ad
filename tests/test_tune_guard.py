"""tune's guard: a layout kept for a window of steps runs every one of them. The search's answer is
simulated on the window's other steps; one that cannot run a step is ruled out for the next fastest
(omni on bursty_mix, tuned on three regime steps, needed 80.0 of 80.0 GiB at step 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnibench import tune as tune_mod
from omnibench.specs.presets import get_model
from omnibench.tune import tune, tune_converged
from simulator.hardware import load_cluster
from workloads.sample import Batch
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)

# bursty_mix, seed 14, on 16 H100s: steps 0-8 calm (largest sample ~15k), 9-15 bursts (~120k); at 131,072
# tokens a step the homogeneous layout tuned on step 0 needs more than 80 GiB at every burst.


def _window(global_batch_tokens: int) -> list[Batch]:
    stream = WorkloadStream("bursty_mix", seed=14, global_batch_tokens=global_batch_tokens)
    return [stream.batch(s) for s in range(16)]


@pytest.fixture(scope="module")
def window():
    return _window(131072)


# Which layouts fit which steps moves with the batch size: at 114,688 tokens a step the homogeneous
# layout tuned on step 0 fails bursts that a slower one it simulated runs; at 147,456 omni's runs every
# step, and homogeneous's default layout with its recompute retries runs none of the bursts.
@pytest.fixture(scope="module")
def window_115k():
    return _window(114688)


@pytest.fixture(scope="module")
def window_147k():
    return _window(147456)


# at 110,592 not every layout a converged search of 3 (then 6) layouts simulated is ruled out: the guard
# rules out the fastest ones and keeps another, without searching again
@pytest.fixture(scope="module")
def window_111k():
    return _window(110592)


@pytest.fixture(scope="module")
def setup():
    return get_model("omni-7b"), load_cluster("h100", 16)


@pytest.fixture
def guard_alone(monkeypatch):
    """The guard without the window's contention and descent after it (`_Search.contend`,
    `_window_descent`, each tested on its own)."""
    monkeypatch.setattr("omnibench.tune.search.WINDOW_CONTENDERS", 0)
    monkeypatch.setattr("omnibench.tune.guard._window_descent", lambda res, check, tuned: 0)


def _runs(system, model, cluster, c, batches):
    """Each batch's (fits, message) for candidate `c`, simulated here (not through the guard)."""
    from simulator.engine import SimOptions, simulate
    from systems import get_planner

    out = []
    for b in batches:
        plan = get_planner(system).plan(model, c.parallel(cluster.num_gpus, cluster.gpus_per_node), b)
        res = simulate(plan, model, cluster, options=SimOptions(recompute=c.recompute))
        out.append((b.step, res.fits))
    return out


def _trials(res):
    return [(t.candidate.label(), t.step_s, t.fits, t.note) for t in res.trials]


def test_without_a_guard_or_with_nothing_left_to_check_the_search_is_unchanged(window, setup):
    model, cluster = setup
    plain = tune("homogeneous", model, window[:1], cluster, budget=6)
    same = tune("homogeneous", model, window[:1], cluster, budget=6, guard_batches=[window[0]])
    assert _trials(same) == _trials(plain) and same.best.candidate == plain.best.candidate
    assert (same.guarded, same.guard_steps, same.guard_simulations) == ([], [], 0)
    assert all(t.guard_step is None for t in plain.trials)


def test_an_answer_that_runs_every_step_is_kept_and_each_step_simulated_once(window_147k, setup, guard_alone):
    model, cluster = setup
    window = window_147k
    # the search without its neighbour descent: its answer here runs every step of the window
    plain = tune("omni", model, window[:1], cluster, budget=6, descent=False)
    guarded = tune("omni", model, window[:1], cluster, budget=6, guard_batches=window, descent=False)
    assert guarded.guarded == [] and guarded.best.candidate == plain.best.candidate
    assert guarded.guard_steps == list(range(1, 16)) and guarded.guard_simulations == 15
    assert _trials(guarded) == _trials(plain) and guarded.steps == [0]


def test_a_layout_that_cannot_run_a_step_of_the_window_is_ruled_out_for_one_that_can(window_115k, setup, guard_alone):
    model, cluster = setup
    window = window_115k
    plain = tune("homogeneous", model, window[:1], cluster, budget=6)
    res = tune("homogeneous", model, window[:1], cluster, budget=6, guard_batches=window)
    # the search's own answer does not fit some step: the guard says which, and so does a direct simulation
    label, step = res.guarded[0]
    assert label == plain.best.candidate.label() and res.best.candidate != plain.best.candidate
    assert (step, False) in _runs("homogeneous", model, cluster, plain.best.candidate, window[step:step + 1])
    ruled = next(t for t in res.trials if t.candidate.label() == label)
    assert not ruled.fits and ruled.guard_step == step and ruled.note.startswith(f"step {step}: ")
    assert any(n.startswith("guard: ruled out") for n in res.notes)
    # the answer is the fastest simulated layout the guard did not rule out, and it runs every step
    assert res.best.step_s >= plain.best.step_s and res.steps == [0]
    assert all(fits for _, fits in _runs("homogeneous", model, cluster, res.best.candidate, window))
    ruled_out = {lab for lab, _ in res.guarded}
    faster = [t for t in plain.trials if t.fits and t.step_s < res.best.step_s]
    assert {t.candidate.label() for t in faster} == ruled_out
    # a ruled-out layout after the first costs the step that broke one before it, not the whole window
    assert 2 * 15 <= res.guard_simulations < 15 * (len(res.guarded) + 1)


def test_the_window_decides_between_the_guards_answer_and_the_layouts_nearly_as_fast_on_the_tuned_steps(
        window_147k, setup):
    """`_Search.contend`: the layouts within WINDOW_MARGIN of the guard's answer on the tuned steps (at most
    WINDOW_CONTENDERS) run every step of the window too, and the answer is the fastest over all of it."""
    from omnibench.tune.budget import WINDOW_CONTENDERS, WINDOW_MARGIN
    from simulator.engine import SimOptions, simulate
    from systems import get_planner

    model, cluster = setup
    window = window_147k
    res = tune("omni", model, window[:1], cluster, budget=6, guard_batches=window, descent=False)
    kept = min((t for t in res.trials if t.fits and t.window_s > 0), key=lambda t: t.step_s)  # the guard's answer
    # what the search timed within the margin behind the guard's answer (those the window then ruled out too)
    near = [t for t in res.trials if t is not kept and t.simulated and (t.fits or t.guard_step is not None)
            and kept.step_s <= t.step_s <= kept.step_s * (1 + WINDOW_MARGIN)]
    ran = [t for t in res.trials if t.window_s > 0]
    contended = [t for t in near if t.window_s > 0 or t.guard_step is not None]  # ran, or a step ruled it out
    distinct = {(t.step_s, t.peak_gib) for t in near} - {(kept.step_s, kept.peak_gib)}  # equal steps contend once
    assert kept in ran and len(contended) == min(len(distinct), WINDOW_CONTENDERS) >= 2
    assert res.guard_simulations == 15 * (1 + len(contended))
    assert res.best is min(ran, key=lambda t: (t.window_s, t.candidate.label()))
    # window_s is the layout's mean step over the window, as simulate gives it step by step
    c = res.best.candidate
    times = [simulate(get_planner("omni").plan(model, c.parallel(16, 8), b), model, cluster,
                      options=SimOptions(recompute=c.recompute)).step_time for b in window]
    assert res.best.window_s == pytest.approx(sum(times) / len(times), rel=1e-6)
    # here a contender two stages deep without the encoders' tp is faster over the window than the guard's answer
    assert res.best is not kept and res.best.step_s > kept.step_s and res.best.window_s < kept.window_s
    assert any(n.startswith("window: " + c.label()) for n in res.notes)


def test_the_layout_the_window_keeps_gets_a_descent_of_its_own_over_the_window(window_115k, setup, monkeypatch):
    """`_window_descent`: where the guard rules out the search's fastest layouts, the neighbour descent
    ran around a layout the window does not keep; the one it keeps is descended from again, each
    neighbour timed over the whole window, and a faster one is the answer."""
    from simulator.engine import SimOptions, simulate
    from systems import get_planner

    model, cluster = setup
    window = window_115k
    res = tune("homogeneous", model, window[:1], cluster, budget=6, guard_batches=window)
    monkeypatch.setattr("omnibench.tune.guard._window_descent", lambda res, check, tuned: 0)
    before = tune("homogeneous", model, window[:1], cluster, budget=6, guard_batches=window)
    assert res.guarded and before.best.candidate != res.best.candidate
    assert res.best.window_s < before.best.window_s
    note = next(n for n in res.notes if n.startswith("window descent: "))
    assert note.startswith(f"window descent: {res.best.candidate.label()} ") and before.best.candidate.label() in note
    # its window mean and its time on the tuned step are each what simulate gives, step by step
    c = res.best.candidate
    times = [simulate(get_planner("homogeneous").plan(model, c.parallel(16, 8), b), model, cluster,
                      options=SimOptions(recompute=c.recompute)).step_time for b in window]
    assert res.best.window_s == pytest.approx(sum(times) / len(times), rel=1e-6)
    assert res.best.step_s == pytest.approx(times[0], rel=1e-6) and res.best.fits
    assert res.guard_simulations > before.guard_simulations


def test_when_every_simulated_layout_is_ruled_out_the_burst_joins_the_tuned_batches(window_147k, setup,
                                                                                   monkeypatch, guard_alone):
    model, cluster = setup
    window = window_147k
    # budget 1: the default layout and its recompute retries only; none runs the whole window
    res = tune("homogeneous", model, window[:1], cluster, budget=1, encoder_search=False, guard_batches=window)
    assert res.guarded and len(res.steps) == 2 and res.steps[0] == 0 and res.steps[1] in range(1, 16)
    assert res.guard_steps == [k for k in range(1, 16) if k != res.steps[1]]
    assert all(fits for _, fits in _runs("homogeneous", model, cluster, res.best.candidate, window))
    # no search again allowed: a one-line error naming the step
    monkeypatch.setattr(tune_mod, "GUARD_ROUNDS", 0)
    with pytest.raises(ValueError, match=r"runs every step of the window \(tuned on steps 0; .* at step \d+: ") as e:
        tune("homogeneous", model, window[:1], cluster, budget=1, encoder_search=False, guard_batches=window)
    assert "\n" not in str(e.value)


def test_a_step_no_layout_runs_is_named(window, setup):
    model, cluster = setup
    lone = Batch(7, window[0].samples[:1])  # one sample for 16 data ranks: no planner takes it
    with pytest.raises(ValueError, match=r"no layout of homogeneous on 16 GPUs runs step 7 \(tuned on steps 0, 7"):
        tune("homogeneous", model, window[:1], cluster, budget=2, encoder_search=False, guard_batches=[lone])


def test_a_converged_search_is_guarded_once_it_has_settled(window_111k, setup, guard_alone):
    model, cluster = setup
    window = window_111k
    plain = tune_converged("homogeneous", model, window[:1], cluster, budget=3, encoder_search=False, doublings=1)
    res = tune_converged("homogeneous", model, window[:1], cluster, budget=3, encoder_search=False, doublings=1,
                         guard_batches=window)
    assert res.convergence is not None and res.convergence.row() == plain.convergence.row()
    assert res.guarded and res.guarded[0][0] == plain.best.candidate.label()
    assert all(fits for _, fits in _runs("homogeneous", model, cluster, res.best.candidate, window))


def _simulate(args):
    from omnibench.cli import simulate as sim_cli

    app = typer.Typer()
    sim_cli.register(app)
    return CliRunner().invoke(app, ["simulate", *args])


def test_simulate_tuned_over_steps_keeps_a_layout_that_runs_every_one(tmp_path):
    # steps 0, 5, 10 of bursty_mix: step 10 is a burst the layout tuned on step 0 does not fit
    base = ["--workload", "bursty_mix", "--seed", "14", "--system", "homogeneous", "--gpus", "16",
            "--global-batch-tokens", "114688", "--tuned", "--tune-budget", "6", "--steps", "3", "--step-stride", "5",
            "--tune-steps", "1"]
    r = _simulate([*base, "--no-tune-guard", "--out", str(tmp_path / "off"), "--json"])
    assert r.exit_code == 0, r.output
    off = json.loads(r.output)["results"][0]
    assert not off["fits"] and off["steps_failed"] and "tune_guarded" not in off
    cache = tmp_path / "tuned.json"
    r = _simulate([*base, "--tune-cache", str(cache), "--out", str(tmp_path / "on"), "--json"])
    assert r.exit_code == 0, r.output
    record = Path(json.loads(r.output)["record"])
    row = json.loads((record / "results.json").read_text())[0]
    assert row["fits"] and row["steps_failed"] == 0 and all(m["fits"] for m in row["per_step"])
    assert [m["step"] for m in row["per_step"]] == [0, 5, 10] and row["tune_guard_steps"] == [5, 10]
    assert row["tune_guarded"][0]["layout"] == off["layout"] != row["layout"]
    assert row["tune_ruled_out"] == len(row["tune_guarded"])
    assert json.loads((record / "config.json").read_text())["tune_guard"] is True
    (key, entry), = json.loads(cache.read_text()).items()
    assert key.endswith("|guard=0,5,10") and entry["guarded"] == row["tune_guarded"]
    assert entry["guard_simulations"] >= 2
    # the cached answer is reused, its ruled-out layouts said again
    r = _simulate([*base, "--tune-cache", str(cache), "--out", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output
    assert f"ruled out {off['layout']} (step " in " ".join(r.output.split()) and "from --tune-cache" in r.output


def test_the_recompute_choices_are_those_of_every_batch_tuned_on(setup):
    """An encoder with work in any batch the search is tuned on is a recompute choice, though the first
    batch feeds it nothing (bursty_mix's calm steps carry no audio)."""
    from omnibench.sweep import Sweep
    from omnibench.tune.search import _Search

    model, cluster = setup
    window = _window(114688)
    audio = [b for b in window if any(seg.modality == "audio" for s in b.samples for seg in s.segments)]
    quiet = [b for b in window if b not in audio]
    assert audio and quiet
    with Sweep(workers=1) as sweep:
        alone = _Search("homogeneous", model, quiet[:1], cluster, None, None, sweep, True, None, None, None)
        both = _Search("homogeneous", model, [quiet[0], audio[0]], cluster, None, None, sweep, True, None, None, None)
    assert not any("audio" in m for m in alone.modes)
    assert "audio" in both.modules and {"audio=full", "vision=full,audio=full"} <= set(both.modes)

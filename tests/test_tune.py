"""`omnibench tune`: the search space keeps the layout rules, the memory bound prunes, and the best
layout it returns simulates at least as fast as the system's default layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from omnibench.cli import tune as tune_cli
from omnibench.specs.costs import recompute_policy
from omnibench.specs.presets import get_model
from omnibench.tune import (
    DESCENT_ROUNDS,
    Candidate,
    memory_estimate,
    recompute_modes,
    regime_batches,
    resolve_budget,
    search_space,
    tune,
    tune_converged,
)
from simulator.hardware import load_cluster
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)


def _batches(n: int, tokens: int = 131072, steps: int = 1):
    stream = WorkloadStream("mixed_video", seed=0, global_batch_tokens=tokens)
    return [stream.batch(s) for s in range(steps)]


@pytest.mark.parametrize("system", ["homogeneous", "temporal", "colocated", "noncolocated", "omni"])
def test_search_space_respects_the_layout_rules(system):
    model = get_model("omni-7b")
    llm = model.llm
    space = search_space(system, model, 64, 8)
    assert space
    for c in space:
        assert llm.heads % c.tp == 0 and llm.kv_heads % c.tp == 0 and c.tp * c.cp <= 8
        if c.cp_kind == "ulysses":  # Ulysses splits the heads; all-gathered K/V splits any cp
            assert llm.kv_heads % (c.tp * c.cp) == 0
        else:
            assert c.cp_kind == "allgather" and c.cp > 1
        assert c.pp <= llm.layers and c.ep == 1  # dense model: no expert parallelism
        if system == "temporal":  # VeOmni's space: no tp, no pp; cp is every module's Ulysses degree
            assert c.pp == 1 and c.tp == 1 and all(e.heads % c.cp == 0 for e in model.encoders.values())
        if c.pp > 1:
            assert c.microbatches >= c.pp  # 1F1B needs a microbatch per stage in flight
        if c.virtual_stages > 1:
            assert c.pp >= 2 and llm.layers % (c.pp * c.virtual_stages) == 0 and c.microbatches % c.pp == 0
        c.parallel(64, 8).validate(model)  # every enumerated layout passes the spec's own checks
    assert len(set(space)) == len(space)
    # both context-parallel kinds at every cp Ulysses can split, and all-gathered K/V beyond the kv heads
    cps = {(c.tp, c.cp, c.cp_kind) for c in space if c.cp > 1}
    assert all((tp, cp, "allgather") in cps for tp, cp, kind in cps if kind == "ulysses"), cps
    if system != "temporal":  # temporal's audio (20 heads) caps its cp at 4
        assert (1, 8, "allgather") in cps and (1, 8, "ulysses") not in cps  # omni-7b: 4 kv heads
    # every microbatch count, 1 included, for every system
    for pp in {c.pp for c in space}:
        counts = {c.microbatches for c in space if c.pp == pp}
        assert counts >= ({1, 2, 4} if pp == 1 else {pp, 2 * pp, 4 * pp}), (pp, counts)


def test_recompute_is_searched_per_module():
    model = get_model("omni-7b")
    modes = recompute_modes(model)
    # the LLM at each mode under every set of the encoders recomputed, each policy once
    assert {"none", "selective", "full", "vision=full", "audio=full", "vision=full,audio=full", "llm=selective",
            "llm=selective,vision=full", "llm=selective,audio=full", "llm=selective,vision=full,audio=full",
            "llm=full", "llm=full,vision=full", "llm=full,audio=full"} == set(modes)
    assert len({tuple(sorted(recompute_policy(m).items())) for m in modes}) == len(modes)
    # auto's list (one set of modules in full) is part of the space the tune searches
    from omnibench.resolve import recompute_modes as auto_modes

    auto = {tuple(sorted(recompute_policy(m).items())) for m in auto_modes(model)}
    assert auto <= {tuple(sorted(recompute_policy(m).items())) for m in modes}
    # an encoder a batch gives no work is no choice: image_sft feeds no audio
    image = WorkloadStream("image_sft", seed=0, global_batch_tokens=131072).batch(0).samples
    assert not any("audio" in m for m in recompute_modes(model, (), image))
    assert any("vision" in m for m in recompute_modes(model, (), image))
    assert recompute_modes(get_model("qwen2-7b")) == ["none", "selective", "full"]  # text only: no encoders
    # mixed_video at 16 GPUs: nothing fits without recomputation, and the fastest layout the search finds
    # recomputes some modules and not others
    res = tune("homogeneous", model, _batches(16), load_cluster("h100", 16), budget=4, encoder_search=False)
    assert res.best is not None and "=" in res.best.candidate.recompute, res.best


def test_the_budget_is_a_share_of_each_systems_pruned_space():
    assert resolve_budget(0, 0.25, 102) == 26 and resolve_budget(0, 0.25, 6) == 4
    assert resolve_budget(0, 0.25, 3) == 3  # never more than the space
    assert resolve_budget(7, 0.25, 102) == 7  # a budget given is a budget kept
    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    small = tune("temporal", model, _batches(16), cluster, fraction=0.5, encoder_search=False)
    large = tune("homogeneous", model, _batches(16), cluster, fraction=0.05, encoder_search=False)
    assert small.budget == resolve_budget(0, 0.5, small.space) and small.space < large.space
    assert large.budget == resolve_budget(0, 0.05, large.space)


def test_twice_the_budget_extends_the_search_and_says_how_far_the_best_moved():
    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    first = tune("homogeneous", model, _batches(16), cluster, budget=3, encoder_search=False)
    logged = []
    second = tune("homogeneous", model, _batches(16), cluster, budget=6, encoder_search=False,
                  known=first.evaluated, log=logged.append)
    assert logged and not {t.candidate for t in logged} & set(first.evaluated)  # nothing simulated twice
    assert {t.candidate for t in first.trials} <= {t.candidate for t in second.trials}
    both = tune_converged("homogeneous", model, _batches(16), cluster, budget=3, encoder_search=False, doublings=1)
    conv = both.convergence
    assert (conv.budget, conv.budget_2x) == (3, 6) and both.best.step_s == conv.best_s_2x <= conv.best_s
    assert conv.moved == pytest.approx(conv.best_s / conv.best_s_2x - 1) and conv.converged == (conv.moved <= 0.02)
    assert [t.step_s for t in both.trials] == [t.step_s for t in second.trials]  # the same search, rerun


def test_a_search_that_still_moves_at_twice_its_budget_doubles_again_until_it_settles():
    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    once = tune_converged("colocated", model, _batches(16), cluster, budget=1, encoder_search=False, doublings=1)
    more = tune_converged("colocated", model, _batches(16), cluster, budget=1, encoder_search=False, doublings=4)
    assert not once.convergence.converged  # 1 -> 2 layouts moves colocated's best by 26% here
    conv = more.convergence
    budgets = [1, 2, 4, 8, 16]
    assert conv.budget in budgets[:-1] and conv.budget_2x == min(2 * conv.budget, more.space)
    # it stopped at the first doubling that settled, or when the doublings (or the space) ran out
    assert conv.converged or conv.budget_2x in (16, more.space)
    assert conv.budget > once.convergence.budget and more.best.step_s < once.best.step_s


def test_regime_batches_span_the_calmest_to_the_burstiest():
    stream = WorkloadStream("bursty_mix", seed=14, global_batch_tokens=131072)
    window = [stream.batch(s) for s in range(16)]
    picks = regime_batches(window, 3)

    def largest(b):
        return max(s.llm_tokens + sum(g.encoder_seq_len for g in s.segments) for s in b.samples)

    sizes = sorted(largest(b) for b in window)
    assert len(picks) == 3 and [b.step for b in picks] == sorted(b.step for b in picks)
    assert largest(picks[0]) == sizes[0] or min(largest(b) for b in picks) == sizes[0]
    assert max(largest(b) for b in picks) == sizes[-1]
    assert [b.step for b in regime_batches(window, 1)] == [0]  # one batch: the deployment's first
    assert regime_batches(window[:2], 3) == window[:2]


def test_a_layout_tuned_across_regimes_fails_fewer_steps_than_one_tuned_on_step_0_and_the_guard_fails_none(tmp_path,
                                                                                                     monkeypatch):
    # the guard alone: the window's own descent after it is tested on its own (tests/test_tune_guard.py)
    monkeypatch.setattr("omnibench.tune.guard._window_descent", lambda res, check, tuned: 0)

    def run(k, *extra):
        r = _simulate(["--workload", "bursty_mix", "--seed", "14", "--steps", "16", "--system", "homogeneous",
                       "--gpus", "16", "--global-batch-tokens", "114688", "--tuned", "--tune-steps", str(k),
                       "--tune-budget", "6", "--out", str(tmp_path / f"{k}{''.join(extra)}"), "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["results"][0]

    calm, regimes = run(1, "--no-tune-guard"), run(3, "--no-tune-guard")
    assert calm["tuned_at_steps"] == [0] and not calm["fits"] and "does not fit" in calm["fit_message"]
    # the regime picks are a proxy for the window's bursts: fewer steps fail, not none
    assert len(regimes["tuned_at_steps"]) == 3 and regimes["steps_failed"] < calm["steps_failed"]
    assert "tune_guarded" not in calm
    # the guard (the default) checks step 0's answer on the other 15 steps: it is ruled out for one that runs all
    guarded = run(1)
    assert guarded["tuned_at_steps"] == [0] and guarded["fits"] and guarded["steps_failed"] == 0
    assert guarded["tune_guarded"][0]["layout"] == calm["layout"] != guarded["layout"]
    assert guarded["tune_guard_steps"] == list(range(1, 16))


def test_search_space_of_a_moe_model_has_expert_parallelism():
    model = get_model("omni-moe-30b")
    eps = {c.ep for c in search_space("homogeneous", model, 64, 8)}
    assert eps > {1}
    for c in search_space("homogeneous", model, 64, 8):
        assert model.llm.moe.experts % c.ep == 0


def test_memory_bound_is_below_the_simulated_peak_and_prunes_on_a_small_device():
    from simulator.engine import SimOptions, simulate
    from systems import get_planner

    model = get_model("omni-7b")
    batch = _batches(16)[0]
    cluster = load_cluster("h100", 16)
    for c in (Candidate("homogeneous", tp=2), Candidate("homogeneous", tp=1, pp=2, microbatches=4, recompute="full"),
              Candidate("colocated", tp=4), Candidate("omni", tp=2, cp=2)):
        plan = get_planner(c.system).plan(model, c.parallel(16, 8), batch)
        sim = simulate(plan, model, cluster, options=SimOptions(recompute=c.recompute, check_memory=False))
        est = memory_estimate(c.system, model, 16, 8, c, batch.samples)
        assert est <= sim.peak_memory * 1.001, (c, est / 2**30, sim.peak_memory / 2**30)
    # A device far too small for any layout: everything is pruned before simulation.
    tiny = replace(cluster, gpu=replace(cluster.gpu, memory_gib=4.0))
    res = tune("homogeneous", model, [batch], tiny, budget=4, encoder_search=False)
    assert res.pruned_memory == res.enumerated and res.best is None


@pytest.mark.parametrize("system", ["homogeneous", "omni"])
def test_best_layout_simulates_at_least_as_fast_as_the_default(system):
    model = get_model("omni-7b")
    cluster = load_cluster("h100", 16)
    res = tune(system, model, _batches(16), cluster, budget=6)
    assert res.best is not None and res.default.simulated and res.default.fits
    assert res.best.step_s <= res.default.step_s
    assert [t.step_s for t in res.trials if t.fits] == sorted(t.step_s for t in res.trials if t.fits)
    # the budget, the default, recompute retries, encoder knobs, and the neighbour descent's rounds around the best
    assert res.simulated <= 6 + 1 + 3 * 20 + DESCENT_ROUNDS * 40
    recompute_policy(res.best.candidate.parallel(16, 8).recompute)  # a mode the simulator and runtime read


def test_tune_cli_json_and_one_line_errors():
    app = typer.Typer()
    tune_cli.register(app)
    app.command("noop")(lambda: None)
    r = CliRunner().invoke(app, ["tune", "--system", "temporal", "--workload", "mixed_video", "--gpus", "16",
                                 "--global-batch-tokens", "65536", "--budget", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["best"]["step_s"] <= out["default"]["step_s"] and all(x["pp"] == 1 for x in out["layouts"])
    r = CliRunner().invoke(app, ["tune", "--system", "nope", "--workload", "mixed_video", "--gpus", "16"])
    assert r.exit_code == 2 and "system must be one of" in r.output and len(r.output.strip().splitlines()) <= 2
    r = CliRunner().invoke(app, ["tune", "--system", "temporal", "--workload", "mixed_video", "--gpus", "16",
                                 "--cp-kinds", "ulysses,ring"])
    assert r.exit_code == 2 and "cp-kinds must be one or more of ulysses, allgather" in r.output \
        and len(r.output.strip().splitlines()) <= 2


def test_the_space_of_given_cp_kinds():
    """`tune --cp-kinds ulysses` is the space before all-gathered K/V joined it; both kinds is the default."""
    model = get_model("omni-7b")
    old = search_space("homogeneous", model, 64, 8, ("ulysses",))
    new = search_space("homogeneous", model, 64, 8)
    assert {c.cp_kind for c in old} == {"ulysses"} and set(old) < set(new)
    assert {c for c in new if c.cp_kind == "ulysses"} == set(old)
    only = search_space("homogeneous", model, 64, 8, ("allgather",))
    assert all(c.cp == 1 or c.cp_kind == "allgather" for c in only)


def test_a_search_of_given_cp_kinds_descends_only_into_them():
    """The neighbour descent's "other cp kind" is not a way out of `--cp-kinds`."""
    model, cluster = get_model("omni-7b@no-audio"), load_cluster("h100", 16)
    res = tune("temporal", model, _batches(16), cluster, budget=4, cp_kinds=("ulysses",))
    assert res.trials and all(t.candidate.cp == 1 or t.candidate.cp_kind == "ulysses" for t in res.trials)


def test_simulate_tuned_puts_each_system_at_its_own_layout(tmp_path):
    from omnibench.cli import simulate as sim_cli

    app = typer.Typer()
    sim_cli.register(app)
    r = CliRunner().invoke(app, ["simulate", "--workload", "mixed_video", "--system", "homogeneous,temporal",
                                 "--gpus", "16", "--global-batch-tokens", "131072", "--tuned", "--tune-budget", "3",
                                 "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert all(x.get("layout") and x["fits"] for x in rows), rows


def _simulate(args):
    from omnibench.cli import simulate as sim_cli

    app = typer.Typer()
    sim_cli.register(app)
    return CliRunner().invoke(app, ["simulate", *args])


def test_simulate_tuned_over_many_steps_tunes_once_on_step_0_and_keeps_that_layout(tmp_path, monkeypatch):
    import omnibench.tune as tune_mod

    calls, original = [], tune_mod.tune

    def counting(system, model, batches, cluster, **kw):
        calls.append((system, [b.step for b in batches]))
        return original(system, model, batches, cluster, **kw)

    monkeypatch.setattr(tune_mod, "tune", counting)
    cache = tmp_path / "tuned.json"
    r = _simulate(["--workload", "drifting_video", "--system", "homogeneous", "--gpus", "16", "--global-batch-tokens",
                   "131072", "--tuned", "--tune-budget", "2", "--steps", "3", "--step-stride", "300",
                   "--tune-cache", str(cache), "--out", str(tmp_path / "a"), "--json"])
    assert r.exit_code == 0, r.output
    assert calls == [("homogeneous", [0])]  # step 0's batch only, never again for steps 300 and 600
    record = Path(json.loads(r.output)["record"])
    row = json.loads((record / "results.json").read_text())[0]
    assert [m["step"] for m in row["per_step"]] == [0, 300, 600]
    assert {m["layout"] for m in row["per_step"]} == {row["layout"]}
    config = json.loads((record / "config.json").read_text())
    assert config["tuned_at_step"] == 0 and config["layout_kept"] and config["steps_simulated"] == [0, 300, 600]
    tuned = next(iter(json.loads(cache.read_text()).values()))["candidate"]
    for k in (0, 300, 600):
        llm = json.loads((record / f"plan_homogeneous_16_step{k}.json").read_text())["layouts"]["llm"]
        assert (llm["tp"], llm["pp"], llm["cp"]) == (tuned["tp"], tuned["pp"], tuned["cp"])

    # A layout in the cache is used as it is for every step (a re-tune would not find this one: it is
    # not the best), and nothing is tuned again.
    (key, entry), = json.loads(cache.read_text()).items()
    assert key.endswith("|guard=0,300,600")  # the answer was checked on these steps (the same command's only)
    other = {**entry["candidate"], "tp": 4, "cp": 1, "recompute": "full"}
    cache.write_text(json.dumps({key: {**entry, "candidate": other}}))
    calls.clear()
    r = _simulate(["--workload", "drifting_video", "--system", "homogeneous", "--gpus", "16", "--global-batch-tokens",
                   "131072", "--tuned", "--tune-budget", "2", "--steps", "3", "--step-stride", "300",
                   "--tune-cache", str(cache), "--out", str(tmp_path / "b"), "--json"])
    assert r.exit_code == 0, r.output
    assert calls == []
    record = Path(json.loads(r.output)["record"])
    for k in (0, 300, 600):
        llm = json.loads((record / f"plan_homogeneous_16_step{k}.json").read_text())["layouts"]["llm"]
        assert (llm["tp"], llm["cp"]) == (4, 1)
    steps = (record / "steps.csv").read_text().splitlines()
    assert steps[0].startswith("gpus,system,step,layout") and len(steps) == 4 and "tp4 pp1" in steps[1]


def test_simulate_tuned_ablation_keeps_omnis_own_tuned_layout(tmp_path, monkeypatch):
    import omnibench.tune as tune_mod

    seen, original = [], tune_mod.tune

    def recording(system, model, batches, cluster, **kw):
        seen.append(dict(kw["options"]))
        return original(system, model, batches, cluster, **kw)

    monkeypatch.setattr(tune_mod, "tune", recording)
    r = _simulate(["--workload", "mixed_video", "--system", "omni", "--gpus", "16", "--global-batch-tokens", "131072",
                   "--tuned", "--tune-budget", "2", "--no-reorder", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert len(seen) == 1 and "reorder" not in seen[0]  # tuned with every technique on
    record = Path(json.loads(r.output)["record"])
    assert json.loads((record / "plan_omni_16_step0.json").read_text())["options"]["reorder"] is False


def test_the_first_wave_spans_pipeline_depths_and_splits_before_the_analytic_order_decides():
    from omnibench import tune as tune_mod

    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    logged = []
    res = tune("omni", model, _batches(16), cluster, budget=tune_mod.WAVE, encoder_search=False,
               log=logged.append)
    first = [t.candidate for t in logged[:tune_mod.WAVE]]
    # the default layout (in the recompute mode its bound allowed; a retry with more may follow)
    assert any(replace(c, recompute="none") == replace(res.default.candidate, recompute="none") for c in first)
    # not eight microbatch counts of one layout: the levels the analytic time is least sure of
    assert len({c.pp for c in first}) >= 3 and len({(c.tp, c.cp) for c in first}) >= 3
    assert res.budget == tune_mod.WAVE


def test_the_encoder_knobs_are_searched_until_no_change_helps():
    # noncolocated's encoder share and encoder tp interact: the descent goes on from the best variant,
    # so every layout one encoder knob away from the answer was timed
    from omnibench import tune as tune_mod

    model, cluster = get_model("omni-7b"), load_cluster("h100", 64)
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=64 * 8192).batch(0)
    res = tune("noncolocated", model, [batch], cluster, budget=4)
    best = res.best.candidate
    assert best.encoder_tp or best.encoder_ranks  # the default encoder layout is not the answer here
    timed = {replace(c, recompute="none") for c in res.evaluated}
    for v in tune_mod.encoder_variants("noncolocated", model, 64, best, 8):
        assert replace(v, recompute="none") in timed, v.label()


def test_omnis_search_weighs_its_encoders_data_parallel_mode():
    # ZeRO-2 (the default) against HSDP and hybrid ZeRO-2: the knob is one of omni's encoder variants
    # wherever the shard group is not the whole cluster, never where the user's options fix it, and a
    # candidate carries it into the ParallelSpec's options and its label
    from omnibench import tune as tune_mod

    model = get_model("omni-7b")
    base = tune_mod.Candidate("omni", tp=2, pp=4, microbatches=8)
    modes = lambda world, options=None: {v.encoder_dp for v in tune_mod.encoder_variants(  # noqa: E731
        "omni", model, world, base, 8, options) if replace(v, encoder_dp="") == base}
    assert modes(1024) == {"hsdp", "hzero2"}
    assert modes(64) == set() and modes(1024, {"encoder_dp": "zero2"}) == set()
    assert not any(v.encoder_dp for v in tune_mod.encoder_variants("temporal", model, 1024, base, 8))
    hsdp = replace(base, encoder_dp="hsdp")
    assert {v.encoder_dp for v in tune_mod.encoder_variants("omni", model, 1024, hsdp, 8)} >= {"", "hzero2"}
    spec = hsdp.parallel(1024, 8, {"hardware": "h100"})
    assert spec.options == {"hardware": "h100", "encoder_dp": "hsdp"} and hsdp.label().endswith("edp-hsdp")
    assert tune_mod.Seed.from_row({"candidate": {"system": "omni", "tp": 2}, "world": 8}).candidate.encoder_dp == ""


def test_omnis_tune_times_every_encoder_state_mode_around_its_answer():
    model, cluster = get_model("omni-7b"), load_cluster("h100", 128)
    batch = WorkloadStream("omni_av", seed=0, global_batch_tokens=128 * 8192).batch(0)
    # the encoder knobs' search times them (the neighbour descent after it is tested on its own)
    res = tune("omni", model, [batch], cluster, budget=4, descent=False)
    best = res.best.candidate
    timed = {replace(c, recompute="none") for c in res.evaluated}
    for other in {"", "hsdp", "hzero2"} - {best.encoder_dp}:
        assert replace(best, encoder_dp=other, recompute="none") in timed, (best.label(), other)


def test_a_larger_cluster_starts_from_the_smaller_ones_answer(tmp_path, monkeypatch):
    from omnibench import tune as tune_mod

    seen = []
    original = tune_mod.tune

    def recording(system, model, batches, cluster, **kw):
        seen.append((cluster.num_gpus, kw.get("prior")))
        return original(system, model, batches, cluster, **kw)

    monkeypatch.setattr(tune_mod, "tune", recording)
    cache = tmp_path / "tuned.json"
    r = _simulate(["--workload", "mixed_video", "--system", "noncolocated", "--gpus", "16,32", "--model", "omni-7b@4L",
                   "--global-batch-tokens", "65536", "--tuned", "--tune-budget", "3", "--tune-cache", str(cache),
                   "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert [n for n, _ in seen] == [16, 32] and seen[0][1] is None
    prior = seen[1][1]
    small, large = sorted(json.loads(cache.read_text()).values(), key=lambda e: e["gpus"])
    assert prior.world == 16 and prior.top[0] == Candidate(**small["candidate"])
    assert large["started_from"] == 16 and small["started_from"] is None
    assert tune_mod.Prior.from_row(prior.row()) == prior


def test_a_smaller_clusters_layout_keeps_its_encoder_share_of_the_ranks():
    from omnibench.tune import _scaled

    c = Candidate("noncolocated", tp=2, cp=2, microbatches=2, recompute="full", encoder_tp=2, encoder_ranks=256)
    settled = {replace(c, recompute="none", encoder_tp=0, encoder_ranks=0): replace(c, recompute="vision=full")}
    got = _scaled(c, 1024, 4096, settled)
    assert got.encoder_ranks == 1024 and got.encoder_tp == 2 and got.recompute == "vision=full"
    assert _scaled(replace(c, tp=4), 1024, 4096, settled) is None  # not in this search's space


def test_a_tuned_layouts_flags_simulate_it_again_untuned(tmp_path):
    """Every tuned row names the simulate flags of its layout (`layout_flags`: encoder tp, sp and ranks and
    omni's encoder state mode included); typed into simulate without a tune, they give the same step."""
    common = ["--workload", "mixed_video", "--gpus", "16", "--global-batch-tokens", "131072", "--json", "--no-trace"]
    r = _simulate([*common, "--system", "colocated,omni", "--tuned", "--tune-budget", "3", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert {x["system"] for x in rows} == {"colocated", "omni"}
    assert any(f in x["layout_flags"] for x in rows for f in ("--encoder-tp", "--encoder-sp", "--encoder-ranks"))
    for row in rows:
        again = _simulate([*common, "--system", row["system"], *row["layout_flags"].split(), "--out", str(tmp_path)])
        assert again.exit_code == 0, again.output
        (untuned,) = json.loads(again.output)["results"]
        assert untuned["tokens_per_s"] == row["tokens_per_s"] and untuned["fits"] == row["fits"], row["layout"]


def test_the_answer_has_no_faster_neighbour_one_change_away():
    """The neighbour descent: around the best layout, every layout one change away (another recompute split,
    the other cp kind, a data-parallel mode, ...) that fits was simulated and is not faster; without the
    descent the same search stops short of one."""
    from omnibench.tune import neighbour_layouts

    model = get_model("omni-7b")
    cluster = load_cluster("h100", 32)
    batches = [WorkloadStream("image_sft", seed=0, global_batch_tokens=8192 * 32).batch(0)]
    res = tune("colocated", model, batches, cluster, budget=4, use_cache=False)
    best = res.best
    near = [res.evaluated[n] for n in neighbour_layouts(best.candidate, model, 32, 8, recompute_modes(model))
            if n in res.evaluated and res.evaluated[n].simulated and res.evaluated[n].fits]
    assert len(near) >= 5 and all(t.step_s >= best.step_s for t in near)
    plain = tune("colocated", model, batches, cluster, budget=4, use_cache=False, descent=False)
    assert best.step_s < plain.best.step_s

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
from omnibench.specs.presets import get_model
from omnibench.tune import Candidate, memory_estimate, search_space, tune
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
        assert llm.heads % c.tp == 0 and llm.kv_heads % (c.tp * c.cp) == 0 and c.tp * c.cp <= 8
        assert c.pp <= llm.layers and c.ep == 1  # dense model: no expert parallelism
        if system == "temporal":  # VeOmni's space: no tp, no pp; cp is every module's Ulysses degree
            assert c.pp == 1 and c.tp == 1 and all(e.heads % c.cp == 0 for e in model.encoders.values())
        if c.pp > 1:
            assert c.microbatches % c.pp == 0 and c.microbatches >= c.pp
        if c.virtual_stages > 1:
            assert c.pp >= 2 and llm.layers % (c.pp * c.virtual_stages) == 0
        c.parallel(64, 8).validate(model)  # every enumerated layout passes the spec's own checks
    assert len(set(space)) == len(space)


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
    assert res.simulated <= 6 + 1 + 3 * 20  # the budget, the default, recompute retries, encoder knobs
    assert res.best.candidate.parallel(16, 8).recompute in ("none", "selective", "full")


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
    other = {**entry["candidate"], "tp": 4, "cp": 1, "recompute": "full"}
    cache.write_text(json.dumps({key: {**entry, "candidate": other}}))
    calls.clear()
    r = _simulate(["--workload", "drifting_video", "--system", "homogeneous", "--gpus", "16", "--global-batch-tokens",
                   "131072", "--tuned", "--tune-budget", "2", "--steps", "2", "--step-stride", "300",
                   "--tune-cache", str(cache), "--out", str(tmp_path / "b"), "--json"])
    assert r.exit_code == 0, r.output
    assert calls == []
    record = Path(json.loads(r.output)["record"])
    for k in (0, 300):
        llm = json.loads((record / f"plan_homogeneous_16_step{k}.json").read_text())["layouts"]["llm"]
        assert (llm["tp"], llm["cp"]) == (4, 1)
    steps = (record / "steps.csv").read_text().splitlines()
    assert steps[0].startswith("gpus,system,step,layout") and len(steps) == 3 and "tp4 pp1" in steps[1]


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

"""The cumulative ablation: omni's decoupled layout with the baselines' loading (one global split by their
balancer, `loading=global`), then its techniques added one at a time. The global split is the baselines'
own; `reproduce` simulates every step at omni's tuned layout; the figure and table draw them from records."""

from __future__ import annotations

import copy
from pathlib import Path

import matplotlib.colors as mc
import matplotlib.pyplot as plt
import pytest
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from test_omni_planner import MODEL, batch_of, skewed_batch
from typer.testing import CliRunner

from omnibench.cli import app, report
from omnibench.plan import PlanError
from omnibench.plots import figures
from omnibench.plots.load import PlotInputError, Records, load
from omnibench.specs.parallel import ParallelSpec
from systems import available_systems, get_planner
from systems.common import _weights, assign_llm, balance, weigh_of
from systems.omni.options import OmniOptions
from systems.omni.reorder import LoaderSpec, in_process_loading

pytestmark = pytest.mark.timeout(120)
GLOBAL = {"loading": "global", "reorder": False}
STEP0 = {**GLOBAL, "joint_pipeline": False, "reshard": False, "long_short_sp": False, "llm_long_short": False}


def _split(batch, world: int, options: dict) -> list[list[int]]:
    planner = get_planner("omni")
    parallel = ParallelSpec(world_size=world, options=options)
    spec = planner.loader_spec(MODEL, parallel, len(batch.samples))
    return in_process_loading(spec, planner.cost_model(MODEL, OmniOptions.parse(options)), batch.samples).shards


@pytest.mark.parametrize("world", [4, 8])
def test_a_global_split_gives_every_loader_what_a_baselines_data_rank_gets(world):
    batch = batch_of("mixed_video", 3, tokens=4096)
    parallel = ParallelSpec(world_size=world, options=GLOBAL)
    weights = _weights(batch, weigh_of(MODEL, parallel, with_encoders=True))  # homogeneous' and temporal's split
    want = balance(weights.items(), world)
    got = _split(batch, world, GLOBAL)
    assert got == want
    # the same per-rank weights as the baselines' split of this batch (their microbatches flattened)
    split = assign_llm(batch, world, 1, 1, weigh_of(MODEL, parallel, with_encoders=True))
    theirs = [sorted(i for mb in g for i in mb) for g in split]
    assert [sum(weights[i] for i in s) for s in got] == [sum(weights[i] for i in s) for s in theirs]
    # and not what the sampler deals (the round robin the reorder switch leaves)
    assert got != _split(batch, world, {"reorder": False})


def test_the_global_split_is_what_the_plan_runs_when_nothing_reshards_it():
    batch = skewed_batch(32)
    p = get_planner("omni").plan(MODEL, ParallelSpec(world_size=4, options=STEP0), batch)
    weights = _weights(batch, weigh_of(MODEL, ParallelSpec(world_size=4), with_encoders=True))
    ran = [sorted(i for mb in mbs for i in mb) for _, mbs in sorted(p.assignment["llm"].items())]
    assert ran == balance(weights.items(), 4)
    assert p.options["loading"] == "global" and not p.notes["acted"]["reorder"]
    rr = get_planner("omni").plan(MODEL, ParallelSpec(world_size=4, options={**STEP0, "loading": "sampler"}), batch)
    assert p.notes["reorder"]["max_over_mean_after"] < rr.notes["reorder"]["max_over_mean_after"]


def test_a_global_split_needs_every_loader_and_refuses_the_grouped_reorder():
    with pytest.raises(PlanError, match="reorder=false"):
        OmniOptions.parse({"loading": "global"})
    with pytest.raises(PlanError, match="sampler, global"):
        OmniOptions.parse({"loading": "somewhere", "reorder": False})
    spec = LoaderSpec(loaders=4, group_size=2, reorder=False, count_llm=True, floor=1, encoders=(), split="global")
    assert spec.groups() == [[0, 1, 2, 3]]
    from systems.omni.reorder import decide

    with pytest.raises(PlanError, match="every loader's metadata"):  # a loader alone cannot split the batch
        decide(spec, [1], [[(1.0, 1.0, 2.0)]])


def test_reproduce_adds_the_techniques_one_at_a_time_at_omnis_tuned_layout():
    sims = Path("/x/sims")
    stages = report._stages(Path("/x/runs"), sims, available_systems(), quick=False)
    steps = [st for st in stages if st.key.startswith(report.CUMULATIVE_PREFIX)]
    assert [st.key for st in steps] == [f"{report.CUMULATIVE_PREFIX}{name.replace('_', '-')}-b8"
                                        for name, _ in figures.CUMULATIVE[:-1]]
    sweep = next(st for st in stages if st.key == "tuned-mixed_video-b8")
    # the tune cache's key: the same command line as the tuned comparison's, so its answer is read, not tuned
    keyed = ("--workload", "--gpus", "--hardware", "--model", "--tune-budget", "--tune-cache", "--out")
    off = {"reshard", "long-short-sp", "joint-pipeline", "llm-long-short", "reorder"}
    for st, (name, _) in zip(steps, figures.CUMULATIVE, strict=False):
        a = st.args
        off -= {name.replace("_", "-")}  # each step switches one more technique back on, the first none
        assert a[a.index("--system") + 1] == "omni" and {"--tuned", "--check-convergence"} <= set(a)
        assert {x.removeprefix("--no-") for x in a if x.startswith("--no-")} == off
        assert a[a.index("--option") + 1] == "loading=global"
        assert [a[a.index(x) + 1] for x in keyed] == [sweep.args[sweep.args.index(x) + 1] for x in keyed]
        assert stages.index(st) > stages.index(sweep) and st.no_fit_is_an_answer and "--seed-from" not in a
    assert off == {"reorder"}  # the last step is omni itself: the tuned comparison's own record
    quick = [st for st in report._stages(Path("/x/runs"), sims, available_systems(), quick=True)
             if st.key.startswith(report.CUMULATIVE_PREFIX)]
    assert [st.key.removeprefix(report.CUMULATIVE_PREFIX) for st in quick] == ["decoupled-b2"]


runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """omni at every cumulative step, once without the reorder alone (the one-off ablation) and the baselines:
    16 simulated GPUs (a few seconds)."""
    out = tmp_path_factory.mktemp("cumulative")
    base = ["simulate", "--workload", "mixed_video", "--gpus", "16", "--tp", "4", "--recompute", "full",
            "--out", str(out), "--json"]
    r = runner.invoke(app, [*base, "--system", "all"])
    assert r.exit_code == 0, r.output
    for st in [*report._cumulative_flags(), ["--no-reorder"]]:
        r = runner.invoke(app, [*base, "--system", "omni", *st])
        assert r.exit_code == 0, r.output
    return out


def _texts(fig) -> list:
    fig.canvas.draw()
    rend = fig.canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(rend)) for t in fig.findobj(plt.Text)
            if t.get_visible() and t.get_text().strip()]


def _legend_is_drawn(fig) -> bool:
    """Every legend entry stands for something drawn: a bar of its colour, the baseline's line."""
    ax = fig.axes[0]
    bars = {mc.to_hex(b.get_facecolor()) for b in ax.patches if b.get_width() > 0}
    for h in fig.legends[0].legend_handles:
        if isinstance(h, Patch) and mc.to_hex(h.get_facecolor()) not in bars:
            return False
        if isinstance(h, Line2D) and not any(x.get_linestyle() == h.get_linestyle() for x in ax.get_lines()):
            return False
    return True


def test_the_figure_draws_each_step_from_its_record_against_the_best_baseline(tiny):
    recs = load([tiny])
    d = figures.cumulative_ablation(recs)
    ax = d.fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [lab for _, lab in figures.CUMULATIVE]
    t = d.table.set_index("step")
    rows = figures.throughput_table(recs)
    omni = rows[(rows.system == "omni") & (rows.variant == "omni")].tokens_per_s_per_gpu.iloc[0]
    best = rows[rows.system.isin(["homogeneous", "temporal", "colocated", "noncolocated"])]
    assert t.tokens_per_s_per_gpu.iloc[-1] == pytest.approx(omni)
    assert t.vs_best_baseline.iloc[-1] == pytest.approx(omni / best.tokens_per_s_per_gpu.max())
    assert (t.best_baseline == best.loc[best.tokens_per_s_per_gpu.idxmax(), "system"]).all()
    # each bar is its step's throughput over the best baseline's
    widths = [b.get_width() for b in ax.patches if b.get_height() > 0]
    assert widths == pytest.approx(list(t.vs_best_baseline))
    legend = [x.get_text() for x in d.fig.legends[0].get_texts()]
    assert legend[-1].startswith("best baseline") and len(legend) == len(set(legend)) == 4
    assert _legend_is_drawn(d.fig)
    # one condition a title line, no text on another
    assert all(len(line) < 90 for line in ax.get_title().splitlines())
    boxes = _texts(d.fig)
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            assert not ba.overlaps(bb), (a, b)
    plt.close(d.fig)


def test_the_baseline_it_compares_with_ran_as_the_steps_did(tiny):
    recs = load([tiny])
    want = figures.cumulative_ablation(recs)
    plt.close(want.fig)
    base = next(r for r in recs.sims if "temporal" in r.systems)
    faster = []
    for config in ({"hardware": "h200"}, {"memory_error": 0.2}, {"options": {"balancer": "tokens"}}):
        r = copy.deepcopy(base)
        r.config.update(config)
        for row in r.rows:
            row["tokens_per_s"], row["tokens_per_s_per_gpu"] = 10 * row["tokens_per_s"], 10 * row["tokens_per_s_per_gpu"]
        faster.append(r)
    d = figures.cumulative_ablation(Records(sims=recs.sims + faster))
    assert d.table.best_baseline_tokens_per_s_per_gpu.iloc[0] == want.table.best_baseline_tokens_per_s_per_gpu.iloc[0]
    plt.close(d.fig)


def test_the_one_off_ablation_leaves_the_cumulative_steps_out(tiny):
    recs = load([tiny])
    d = figures.ablation(recs)
    assert list(d.table.variant) == ["omni", "omni w/o reorder"]  # the last step before omni has that label too
    rows = figures.throughput_table(recs)
    one_off = rows[(rows.variant == "omni w/o reorder") & ~figures.globally_loaded(rows, recs)]
    assert len(one_off) == 1 and d.table.tokens_per_s.iloc[1] == pytest.approx(one_off.tokens_per_s.iloc[0])
    plt.close(d.fig)


def test_a_step_that_does_not_fit_is_a_labelled_gap_not_a_missing_bar(tiny):
    recs = load([tiny])
    kept = [r for r in recs.sims if (r.config.get("options") or {}).get("reshard") is not False
            or (r.config.get("options") or {}).get("loading") != "global"]
    why = {figures.CUMULATIVE[0][0]: "does not fit: rank 3 needs 99 GiB of 79 GiB"}
    d = figures.cumulative_ablation(Records(sims=kept), notes=why)
    t = d.table.set_index("step")
    assert t.loc[figures.CUMULATIVE[0][1], "note"].startswith("does not fit")
    assert any("does not fit" in x for x, _ in _texts(d.fig))
    assert len(d.fig.legends[0].get_texts()) == 3 and _legend_is_drawn(d.fig)  # no bar of the first kind left
    plt.close(d.fig)
    with pytest.raises(PlotInputError, match="loading=global"):
        figures.cumulative_ablation(Records(sims=[r for r in recs.sims
                                                  if (r.config.get("options") or {}).get("loading") != "global"]))


def test_the_table_reads_the_figures_csvs(tmp_path, monkeypatch):
    import csv

    from omnibench.tables import comparison

    fig = tmp_path / "results" / "figures"
    fig.mkdir(parents=True)
    rows = [{"step": lab, "technique": name, "tokens_per_s_per_gpu": 4000 + 100 * k, "vs_best_baseline": 0.8 + 0.05 * k,
             "vs_previous": 1.0 + 0.01 * k if k else "", "best_baseline": "temporal",
             "best_baseline_tokens_per_s_per_gpu": 5000, "note": "", "workload": "mixed_video", "gpus": 1024}
            for k, (name, lab) in enumerate(figures.CUMULATIVE)]
    rows[0].update(note="does not fit: rank 1 needs 80 GiB of 79 GiB", tokens_per_s_per_gpu="", vs_best_baseline="")
    one_off = [{"variant": "omni", "relative": 1.0, "best_baseline_relative": 1.02, "workload": "mixed_video",
                "gpus": 1024}]
    for name, got in (("ablation_cumulative", rows), ("ablation", one_off)):
        with open(fig / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(got[0]))
            w.writeheader()
            w.writerows(got)
    (tmp_path / "results" / "reproduce-stages.csv").write_text("stage,seconds,note\n")
    monkeypatch.setattr(comparison, "REPO_ROOT", tmp_path)
    lines = comparison.tuned_ablation().splitlines()
    assert lines[0].startswith("| omni, techniques added one at a time |") and "temporal" in lines[0]
    assert lines[2] == f"| {figures.CUMULATIVE[0][1]} | does not fit: rank 1 needs 80 GiB of 79 GiB | | |"
    assert lines[3] == f"| {figures.CUMULATIVE[1][1]} | 4,100 | 0.85x | +1.0% |"
    assert lines[2 + len(rows)] == "| the best baseline: temporal, at its own tuned layout | 5,000 | 1.00x | |"
    assert "| omni, one technique off | throughput vs all techniques |" in lines
    summary = comparison.tuned_ablation_summary()
    assert f"{figures.CUMULATIVE[0][1]}: does not fit" in summary and f"{figures.CUMULATIVE[-1][1]} 1.05x" in summary

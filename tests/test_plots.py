"""Paper figures and the report: every kind drawn from small record folders, bad inputs refused.

Run records are written in the runtime's format (omnibench/runtime/records.py: config, the real
Plans of a real planner, steps.jsonl, summary, a Chrome trace through `records.chrome_trace`) with
synthetic timings; simulation records come from the real `omnibench simulate` command.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from typer.testing import CliRunner

from omnibench.cli import app
from omnibench.plots import figures
from omnibench.plots.load import PlotInputError, load

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()
SIM_SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")


def write_run(root: Path, system: str, workload: str = "mixed_video", steps: int = 3, slow: float = 1.0,
              options: dict | None = None, name: str | None = None) -> Path:
    """A finished run record in the runtime's format, with made-up (but consistent) timings."""
    from omnibench.runtime.records import chrome_trace
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from omnibench.specs.run import RunSpec
    from systems import get_planner
    from workloads.stream import WorkloadStream

    folder = root / (name or f"{system}-{workload}")
    folder.mkdir(parents=True)
    spec = RunSpec(system=system, workload=workload, model="tiny-omni", nproc=2, steps=steps, global_batch_tokens=1536,
                   length_scale=0.02, max_sample_tokens=384, out=str(folder), options=dict(options or {}),
                   recompute="none",  # as a CPU run's resolved spec records it
                   extra={"device": "cpu", "backend": "gloo"})
    model = get_model("tiny-omni")
    stream = WorkloadStream(workload, seed=0, global_batch_tokens=1536, length_scale=0.02, max_sample_tokens=384)
    planner = get_planner(system)
    spans: dict[int, list[dict]] = {0: [], 1: []}
    rows, t0 = [], 0.0
    for s in range(steps):
        plan = planner.plan(model, ParallelSpec(world_size=2, options=dict(options or {})), stream.batch(s))
        if s == 0:
            (folder / "plan_step0.json").write_text(plan.to_json())
        tokens = sum(x.llm_tokens for x in plan.samples)
        ends = []
        for rank, acts in plan.actions.items():
            t = t0
            for a in acts:
                d = slow * 1e-3 * (1.5 if s == 0 else 1.0)  # a fixed cost, plus one per token of compute
                if a.kind in ("forward", "backward"):
                    ids = plan.microbatches(a.module, rank)[a.microbatch]
                    work = sum(plan.sample(i).llm_tokens if a.module == "llm" else
                               sum(plan.sample(i).encoder_seq_lens(a.module)) for i in ids)
                    d += slow * 2e-5 * work * (2 if a.kind == "backward" else 1)
                spans[rank].append({"name": str(a), "kind": a.kind, "module": a.module, "step": s, "start": t,
                                    "end": t + d})
                t += d * 1.1
            ends.append(t)
        step_time = max(ends) - t0
        rows.append({"step": s, "loss": 6.0 - 0.1 * s, "step_time_s": step_time, "tokens": tokens,
                     "samples": len(plan.samples), "tokens_per_s": tokens / step_time,
                     "tokens_per_s_per_gpu": tokens / step_time / 2, "tflops_per_gpu": 0.01, "mfu": None,
                     "bubble_fraction": 0.1, "exposed_comm_fraction": 0.05, "peak_memory_bytes": 1 << 28})
        t0 += step_time
    timed = rows[1:]
    tps = sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)
    summary = {"system": system, "workload": workload, "model": "tiny-omni", "world_size": 2, "device": "cpu",
               "steps": steps, "mean_step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
               "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / 2, "tflops_per_gpu": 0.01, "mfu": None,
               "bubble_fraction": 0.1, "exposed_comm_fraction": 0.05, "peak_memory_bytes": 1 << 28}
    from dataclasses import asdict

    (folder / "config.json").write_text(json.dumps({"run": spec.to_dict(), "model": asdict(model)}))
    (folder / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "trace.json").write_text(json.dumps(chrome_trace(spans)))
    return folder


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Path:
    """A real simulation record: every system at 8 and 16 GPUs, three consecutive steps."""
    out = tmp_path_factory.mktemp("sims")
    r = runner.invoke(app, ["simulate", "--workload", "bursty_mix", "--gpus", "8,16", "--steps", "3", "--tp", "4",
                            "--recompute", "full", "--system", ",".join(SIM_SYSTEMS), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return Path(json.loads(r.output[r.output.index("{"):])["record"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_run(root, "homogeneous", slow=1.0)
    write_run(root, "temporal", slow=2.0)
    return root


def _is_png(p: Path) -> bool:
    return p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _is_pdf(p: Path) -> bool:
    return p.stat().st_size > 1000 and p.read_bytes()[:5] == b"%PDF-"


def _bars(ax) -> list:
    return [b for c in ax.containers for b in c]


def test_throughput_from_simulations_has_one_bar_per_system_with_speedup_labels(sim):
    d = figures.throughput(load([sim]))
    ax = d.fig.axes[0]
    assert len(_bars(ax)) == len(SIM_SYSTEMS)  # one workload at its largest size (16 GPUs)
    assert set(d.table.gpus) == {16}
    labels = [t.get_text() for t in ax.texts]
    assert len(labels) == len(SIM_SYSTEMS) and all(t.endswith("x") for t in labels)
    best_base = d.table[d.table.system != "omni"].speedup.max()
    assert best_base == pytest.approx(1.0)
    plt.close(d.fig)


def test_throughput_from_runs_is_normalised_to_the_best_baseline(runs):
    d = figures.throughput(load([runs]))
    sp = d.table.set_index("system").speedup
    assert sp["homogeneous"] == pytest.approx(1.0)
    assert sp["temporal"] == pytest.approx(0.5, rel=0.05)  # twice the step time
    heights = sorted(b.get_height() for b in _bars(d.fig.axes[0]))
    assert heights == pytest.approx(sorted(sp))
    plt.close(d.fig)


def test_scaling_draws_one_line_per_system_in_both_panels(sim):
    d = figures.scaling(load([sim]))
    a, b = d.fig.axes[:2]
    assert len(a.get_lines()) == len(SIM_SYSTEMS) == len(b.get_lines())
    assert all(len(line.get_xdata()) == 2 for line in a.get_lines())
    assert a.get_xscale() == "log"
    assert "tokens/s/GPU" in a.get_ylabel() and "MFU" in b.get_ylabel()
    plt.close(d.fig)


def test_dynamic_shows_per_step_throughput_per_cluster_size_over_the_modality_mix(sim):
    d = figures.dynamic(load([sim]))
    at8, at16, mix = d.fig.axes[:3]  # a panel per cluster size, then the mix
    for ax in (at8, at16):
        assert len(ax.get_lines()) == len(SIM_SYSTEMS)
        assert all(len(line.get_xdata()) == 3 for line in ax.get_lines())
    assert "8 GPUs" in at8.get_title(loc="left") and "16 GPUs" in at16.get_title(loc="left")
    assert len(mix.collections) >= 2  # one stacked band per modality present
    t = d.table
    assert len(t) == 2 * len(SIM_SYSTEMS) and set(t.steps) == {3}
    assert (t.min_tokens_per_s <= t.p10_tokens_per_s).all() and (t.p10_tokens_per_s <= t.mean_tokens_per_s).all()
    for _, g in t.groupby("gpus"):  # the best baseline is 1.0 of itself, omni is measured against it
        base = g[g.system != "omni"]
        assert base.rel_best_baseline.max() == pytest.approx(1.0)
        assert set(g.best_baseline) == {base.loc[base.mean_tokens_per_s.idxmax()].system}
    plt.close(d.fig)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> Path:
    """Tuned simulations (homogeneous and omni, budget 2): mixed_video at 8 and 16 GPUs, one step;
    drifting_video over two steps 300 batches apart."""
    out = tmp_path_factory.mktemp("tuned")
    common = ["--system", "homogeneous,omni", "--gpus", "8,16", "--global-batch-tokens", "131072", "--tuned",
              "--tune-budget", "2", "--tune-cache", str(out / "layouts.json"), "--out", str(out), "--json"]
    for extra in (["--workload", "mixed_video"], ["--workload", "drifting_video", "--steps", "2", "--step-stride",
                                                  "300"]):
        r = runner.invoke(app, ["simulate", *extra, *common])
        assert r.exit_code == 0, r.output
    return out


def test_speedup_is_omni_over_the_best_baseline_per_workload_and_cluster_size(tuned):
    recs = load([tuned])
    d = figures.speedup(recs)
    t = d.table.set_index(["workload", "gpus"])
    assert set(t.index) == {(w, n) for w in ("mixed_video", "drifting_video") for n in (8, 16)}
    rows = figures.throughput_table(recs).set_index(["workload", "gpus", "system"]).tokens_per_s
    for (wl, n), r in t.iterrows():
        assert r.best_baseline == "homogeneous"
        assert r.speedup == pytest.approx(rows[(wl, n, "omni")] / rows[(wl, n, "homogeneous")])
        assert r.omni_layout and r.best_baseline_layout  # the tuned layouts, named
    assert t.loc[("drifting_video", 16)].steps == 2
    ax = d.fig.axes[0]
    assert len(ax.texts) == 4 and all("x\nvs homogeneous" in x.get_text() for x in ax.texts)
    assert "tuned layouts (tune budget 2, at step 0)" in ax.get_title()
    plt.close(d.fig)


def test_dynamic_of_tuned_records_says_each_layout_was_tuned_at_step_0_and_kept(tuned):
    d = figures.dynamic(load([tuned]), workload="drifting_video")
    assert "tuned layouts (tune budget 2, at step 0)" in d.fig._suptitle.get_text()
    assert "tuned once on step 0's batch and kept" in d.caption
    assert d.fig.axes[-1].get_xlabel() == "training step (every 300th batch)"
    assert all(d.table.layout.str.startswith("tp"))  # one layout per system and size: never re-tuned
    plt.close(d.fig)


def test_a_step_the_layout_cannot_run_is_recorded_and_drawn_as_such_while_the_others_run(tmp_path):
    # bursty_mix seed 14 bursts into long videos at step 9: 12 samples for 16 data-parallel ranks
    r = runner.invoke(app, ["simulate", "--workload", "bursty_mix", "--seed", "14", "--steps", "10", "--gpus", "16",
                            "--global-batch-tokens", "131072", "--system", "homogeneous,omni", "--recompute", "full",
                            "--tp", "1",
                            "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output[r.output.index("{"):])
    for row in out["results"]:
        assert row["error"].startswith("step 9: batch: 12 samples cannot feed") and row["steps_failed"] == 1
    record = Path(out["record"])
    steps = (record / "steps.csv").read_text().splitlines()
    assert len(steps) == 1 + 2 * 10 and sum(",False," in x for x in steps) == 2
    d = figures.dynamic(load([record]))
    ax = d.fig.axes[0]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 2 and all(abs(c.get_xdata()[0] - 9) < 0.5 for c in crosses)
    assert all(len(line.get_xdata()) == 10 for line in ax.get_lines() if line.get_marker() == "o")
    t = d.table.set_index("system")
    assert (t.steps_failed == 1).all() and (t.steps == 10).all() and t.mean_tokens_per_s.gt(0).all()
    assert t.rel_best_baseline.isna().all()  # no ratio from a mean over the steps a layout survived
    assert "homogeneous at 16: 1 of 10, first step 9: batch: 12 samples" in d.caption
    plt.close(d.fig)


def test_speedup_without_omni_and_a_baseline_in_one_cell_says_what_is_missing(sim, tmp_path):
    r = runner.invoke(app, ["simulate", "--workload", "mixed_video", "--gpus", "8", "--tp", "4", "--recompute",
                            "full", "--system", "omni", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    with pytest.raises(PlotInputError, match="needs omni and at least one baseline"):
        figures.speedup(load([tmp_path]))


def test_timeline_of_a_run_draws_every_span_of_the_chosen_step(runs):
    rec = load([runs / "homogeneous-mixed_video"]).runs[0]
    d = figures.timeline(rec, step=1)
    trace = json.loads((rec.path / "trace.json").read_text())["traceEvents"]
    expected = sum(1 for e in trace if e["ph"] == "X" and e["args"]["step"] == 1)
    assert d.fig.spans_drawn == expected > 0
    assert [t.get_text() for t in d.fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]
    plt.close(d.fig)


def test_timeline_of_a_simulation_draws_compute_and_communication_lanes(sim):
    d = figures.timeline(load([sim]).sims[0], system="homogeneous", gpus=8)
    assert d.fig.spans_drawn > 0
    assert {"compute"} < set(d.table.stream)  # communication lanes too
    plt.close(d.fig)


def test_validation_has_one_point_per_run_the_identity_line_and_the_error(runs):
    d = figures.validation(load([runs]))
    ax = d.fig.axes[0]
    assert sum(len(c.get_offsets()) for c in ax.collections) == 2
    assert any("MAE" in t.get_text() for t in ax.texts)
    assert len(d.table) == 2 and d.table.simulated_s.gt(0).all()
    plt.close(d.fig)


def test_ablation_has_a_bar_per_switched_off_technique(tmp_path):
    write_run(tmp_path, "omni", name="full")
    write_run(tmp_path, "omni", slow=1.25, options={"reorder": False}, name="no-reorder")
    write_run(tmp_path, "omni", slow=1.6, options={"joint_pipeline": False}, name="no-joint")
    d = figures.ablation(load([tmp_path]))
    ax = d.fig.axes[0]
    assert len(_bars(ax)) == 3
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks[0] == "omni (all techniques)" and "w/o reorder" in ticks and "w/o joint pipeline" in ticks
    rel = d.table.set_index("variant").relative
    assert rel["omni"] == 1.0 and rel["omni w/o joint pipeline"] < rel["omni w/o reorder"] < 1.0
    plt.close(d.fig)


def test_ablation_from_simulations_uses_the_records_switches_and_says_gpus(tmp_path):
    base = ["simulate", "--workload", "mixed_video", "--gpus", "16", "--tp", "4", "--recompute", "full",
            "--system", "omni", "--out", str(tmp_path), "--json"]
    for extra in ([], ["--no-reorder"]):
        r = runner.invoke(app, [*base, *extra])
        assert r.exit_code == 0, r.output
    d = figures.ablation(load([tmp_path]))
    ax = d.fig.axes[0]
    assert len(_bars(ax)) == 2
    assert [t.get_text() for t in ax.get_yticklabels()] == ["omni (all techniques)", "w/o reorder"]
    assert "16 GPUs (simulated)" in ax.get_title()
    plt.close(d.fig)


def test_workload_figure_has_a_distribution_per_modality_and_a_bar_per_phase():
    d = figures.workload("bursty_mix", steps=40, global_batch_tokens=16384)
    cdf, phases = d.fig.axes[:2]
    assert len(cdf.get_lines()) == 4  # text, image, video, audio
    assert [t.get_text() for t in phases.get_yticklabels()] == ["calm", "video_burst", "audio_burst"]
    plt.close(d.fig)


def test_plot_command_writes_png_and_pdf(sim, tmp_path):
    r = runner.invoke(app, ["plot", "scaling", str(sim), "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert _is_png(tmp_path / "scaling.png") and _is_pdf(tmp_path / "scaling.pdf")


def test_report_is_one_self_contained_html_page(sim, runs, tmp_path):
    r = runner.invoke(app, ["report", str(sim), str(runs), "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 6
    assert "src='http" not in page and "<link" not in page and "<script" not in page
    assert "omnibench simulate --workload bursty_mix" in page and "omnibench run --system temporal" in page
    assert "<table" in page


def test_the_report_closes_each_figure_as_it_draws_it(sim, runs, monkeypatch):
    # a reproduce's records make dozens of figures: pyplot held every one open until the page was
    # written (matplotlib's more-than-20-figures warning in reproduce's output)
    import matplotlib.pyplot as plt

    from omnibench.plots.load import load
    from omnibench.plots.report import draw_all

    plt.close("all")
    opened = []
    real = plt.subplots

    def counting(*a, **k):
        out = real(*a, **k)
        opened.append(len(plt.get_fignums()))
        return out

    monkeypatch.setattr(plt, "subplots", counting)
    sections = draw_all(load([sim, runs]), prov={"commit": "abc", "command": "test"})
    monkeypatch.undo()
    drawn = [s for s in sections if s.drawn]
    assert len(drawn) >= 6 and all(s.png for s in drawn)
    assert opened and max(opened) == 1 and plt.get_fignums() == []


@pytest.mark.parametrize("args, words", [
    (["plot", "throughput"], "no record folders given"),
    (["plot", "histogram", "x"], "KIND must be one of"),
    (["plot", "throughput", "{one}"], "at least two systems"),
    (["plot", "scaling", "{runs}"], "needs simulation records"),
    (["plot", "validation", "{sim}"], "is a simulation record"),
    (["plot", "throughput", "{incomplete}"], "unfinished run"),
    (["plot", "ablation", "{runs}"], "needs omni records"),
    (["plot", "throughput", "{missing}"], "does not exist"),
])
def test_bad_inputs_get_a_one_line_error_and_exit_2(args, words, sim, runs, tmp_path):
    incomplete = tmp_path / "r.incomplete"
    incomplete.mkdir()
    paths = {"sim": str(sim), "runs": str(runs), "one": str(runs / "homogeneous-mixed_video"),
             "incomplete": str(incomplete), "missing": str(tmp_path / "nope")}
    r = runner.invoke(app, [a.format(**paths) for a in args])
    assert r.exit_code == 2
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert words in " ".join(lines)
    assert len(lines) == 1 and lines[0].startswith("error:")


def test_loader_skips_unfinished_folders_when_scanning_a_parent(runs, tmp_path):
    root = tmp_path / "all"
    write_run(root, "homogeneous")
    (root / "x.incomplete").mkdir()
    recs = load([root])
    assert len(recs.runs) == 1 and recs.skipped and "unfinished" in recs.skipped[0]
    with pytest.raises(PlotInputError, match="unfinished"):
        load([root / "x.incomplete"])


def test_plot_modules_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, omnibench.plots.figures, omnibench.plots.report, omnibench.plots.load, omnibench.cli.report; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1]).returncode == 0


def test_reproduce_reuse_without_earlier_data_is_refused(tmp_path):
    r = runner.invoke(app, ["reproduce", "--out", str(tmp_path), "--reuse"])
    assert r.exit_code == 2 and "run without --reuse first" in r.output


def test_validation_with_a_calibration_shows_both_cost_sets_and_says_in_sample(tmp_path):
    # spans long enough that the compute left after the engine's own communication estimate is positive
    runs = [write_run(tmp_path / "runs", s, steps=5, slow=30.0) for s in ("homogeneous", "temporal")]
    r = runner.invoke(app, ["calibrate", *map(str, runs), "--out", str(tmp_path / "profile.json")])
    assert r.exit_code == 0, r.output
    d = figures.validation(load(runs), calibration=str(tmp_path / "profile.json"))
    ax = d.fig.axes[0]
    assert sum(len(c.get_offsets()) for c in ax.collections) == 4  # 2 runs x (datasheet, calibrated)
    text = " ".join(t.get_text() for t in ax.texts)
    assert "datasheet: MAE" in text and "calibrated (in-sample): MAE" in text
    assert set(d.table.costs) == {"datasheet", "calibrated"}
    plt.close(d.fig)


def test_modality_colours_never_reuse_a_system_colour():
    from omnibench.plots import style

    assert not set(style.MODALITY_COLORS.values()) & set(style.SYSTEM_COLORS.values())
    assert len(set(style.MODALITY_COLORS.values())) == len(style.MODALITY_COLORS)


def test_a_scaling_title_states_model_layout_scale_and_weak_scaling(sim):
    d = figures.scaling(load([sim]))
    title = d.fig._suptitle.get_text()
    assert "8 to 16 GPUs" in title and "omni-7b on h100" in title and "tp 4 / pp 1" in title
    assert "recompute full" in title and "weak scaling, 8,192 tokens/GPU" in title
    plt.close(d.fig)


def test_a_timeline_tells_forward_from_backward_by_shade_and_names_pipeline_stages(tmp_path):
    import matplotlib.colors as mc

    from omnibench.plots import style

    rec = load([write_run(tmp_path, "homogeneous")]).runs[0]
    trace = json.loads((rec.path / "trace.json").read_text())
    for e in trace["traceEvents"]:  # as a pp 2 run records it: rank 1 holds the second LLM stage
        if e["ph"] == "X" and e["args"]["rank"] == 1 and e["args"]["module"] == "llm":
            e["args"]["stage"] = 1
    (rec.path / "trace.json").write_text(json.dumps(trace))
    d = figures.timeline(load([rec.path]).runs[0], step=1)
    ax = d.fig.axes[0]
    faces = {tuple(round(v, 3) for v in mc.to_rgb(c.get_facecolor()[0])) for c in ax.collections}
    llm = style.module_color("llm")
    assert tuple(round(v, 3) for v in mc.to_rgb(llm)) in faces  # forward
    assert tuple(round(v, 3) for v in style.lighten(llm, 0.5)) in faces  # backward, lighter
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 · stage 0", "rank 1 · stage 1"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "dark: forward" in legend and "light: backward" in legend
    plt.close(d.fig)


def test_measured_throughput_of_repeated_runs_is_their_mean_with_an_error_bar(tmp_path):
    for system, slows in (("homogeneous", (1.0, 1.3)), ("temporal", (2.0, 2.2))):
        for k, slow in enumerate(slows):
            write_run(tmp_path, system, slow=slow, name=f"{system}-mixed_video" + (f"-r{k}" if k else ""))
    d = figures.throughput(load([tmp_path]), source="run")
    t = d.table.set_index("system")
    assert (t.records == 2).all() and (t.tokens_per_s_std > 0).all()
    from matplotlib.container import BarContainer

    bars = [c for c in d.fig.axes[0].containers if isinstance(c, BarContainer)]
    assert len(bars) == 2 and all(c.errorbar is not None for c in bars)
    assert "mean over up to 2 repeated runs" in d.caption
    plt.close(d.fig)

"""Figures stay legible whatever records they draw: titles wrapped to the figure (one condition a
line), every legend entry visible, no label on another, blank cells saying why, and the breakdown's
imbalance part drawn as its own segment."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import matplotlib.colors as mc
import matplotlib.pyplot as plt
import numpy as np
import pytest
from typer.testing import CliRunner

from omnibench.cli import app
from omnibench.plots import figures, style
from omnibench.plots.load import Records, load

pytestmark = pytest.mark.timeout(180)
runner = CliRunner()


def _simulate(out: Path, workload: str, gpus: str = "8,16") -> Path:
    r = runner.invoke(app, ["simulate", "--workload", workload, "--gpus", gpus, "--tp", "4", "--recompute", "full",
                            "--system", "all", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return Path(json.loads(r.output[r.output.index("{"):])["record"])


@pytest.fixture(scope="module")
def recs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sims")
    return {wl: load([_simulate(out, wl)]).sims[0] for wl in ("mixed_video", "bursty_mix")}


def _copy(rec, **config):
    r = copy.deepcopy(rec)
    r.config.update(config)
    return r


def _texts(fig) -> list:
    """Every visible, non-empty text of the figure, with its rendered box."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    out = []
    for t in fig.findobj(plt.Text):
        if t.get_visible() and t.get_text().strip():
            out.append((t.get_text(), t.get_window_extent(r)))
    return out


def test_throughput_of_two_records_puts_each_condition_on_its_own_line_and_keeps_its_shape(recs, tmp_path):
    two = Records(sims=[recs["mixed_video"], _copy(recs["bursty_mix"], recompute="none", tp=2)])
    d = figures.throughput(two, source="sim")
    ax = d.fig.axes[0]
    title = ax.get_title()
    assert all(line.count("weak scaling") <= 1 and line.count(" on h100") <= 1 for line in title.splitlines())
    assert "mixed_video:" in title and "bursty_mix:" in title  # what differs, per workload
    fig_w = d.fig.get_figwidth() * d.fig.dpi
    assert all(box.width <= fig_w for _, box in _texts(d.fig))  # no title wider than the figure
    png = style.save(d.fig, tmp_path, "throughput")[0]
    w, h = plt.imread(png).shape[1::-1]
    assert w / h < 3.0  # a plot, not a strip under a one-line title
    pos = ax.get_position()
    assert pos.height * d.fig.get_figheight() > 0.35 * pos.width * d.fig.get_figwidth()
    plt.close(d.fig)


def _colour_pixels(fig, ax, colour, tol: float = 0.06) -> int:
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255.0
    b = ax.get_window_extent()
    h = img.shape[0]
    crop = img[int(h - b.y1):int(h - b.y0), int(b.x0):int(b.x1)]
    return int((np.abs(crop - np.array(mc.to_rgb(colour))).max(axis=-1) < tol).sum())


def test_scaling_shows_every_system_in_its_legend_even_where_two_lines_coincide(recs):
    rec = copy.deepcopy(recs["mixed_video"])
    by = {(r["system"], r["gpus"]): r for r in rec.rows}
    for r in rec.rows:  # temporal within 0.3% of colocated, as a sweep can make them
        if r["system"] == "temporal":
            for k in ("tokens_per_s", "tokens_per_s_per_gpu", "mfu"):
                r[k] = by[("colocated", r["gpus"])][k] * 1.003
    d = figures.scaling(Records(sims=[rec]))
    legend = [t.get_text() for t in d.fig.axes[1].get_legend().get_texts()]
    assert "temporal" in legend
    for s in legend:
        assert _colour_pixels(d.fig, d.fig.axes[0], style.system_color(s)) > 30, s
    plt.close(d.fig)


def test_scaling_leaves_a_system_that_never_fits_out_of_its_legend_and_says_why(recs):
    rec = copy.deepcopy(recs["mixed_video"])
    for r in rec.rows:
        if r["system"] == "temporal":
            r["fits"] = False
    d = figures.scaling(Records(sims=[rec]))
    legend = [t.get_text() for t in d.fig.axes[1].get_legend().get_texts()]
    assert "temporal" not in legend
    drawn = {line.get_label() for line in d.fig.axes[0].get_lines()}
    assert set(legend) <= drawn
    notes = [t for t, _ in _texts(d.fig)]
    assert any("temporal: does not fit at any size" in t for t in notes)
    assert "temporal: does not fit at any size" in d.caption
    plt.close(d.fig)


def test_memory_figure_labels_never_overlap(recs):
    sims = []
    for wl, rec in recs.items():
        for err in (0.0, 0.2, -0.2):
            r = _copy(rec, memory_error=err)
            for row in r.rows:  # both workloads' lines within a few percent: their labels meet
                if row["system"] == "omni" and wl == "bursty_mix":
                    other = next(x for x in recs["mixed_video"].rows if x["system"] == "omni"
                                 and x["gpus"] == row["gpus"])
                    row["tokens_per_s"] = other["tokens_per_s"] * 1.02
            sims.append(r)
    d = figures.memory_sensitivity(Records(sims=sims))
    boxes = _texts(d.fig)
    assert sum("vs " in t for t, _ in boxes) >= 4
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            assert not ba.overlaps(bb), (a, b)
    plt.close(d.fig)


def test_speedup_marks_each_blank_cell_with_why_and_states_its_setup_once(recs):
    mv = recs["mixed_video"]
    bm = copy.deepcopy(recs["bursty_mix"])
    bm.rows = [r for r in bm.rows if r["gpus"] == 8]  # bursty_mix not simulated at 16 GPUs
    for r in bm.rows:
        r["fits"] = r["system"] == "omni"  # and at 8 no baseline fits
    other = _copy(mv, workload="image_sft", recompute="none")
    other.rows = [r for r in other.rows if r["gpus"] == 16]  # image_sft not simulated at 8
    d = figures.speedup(Records(sims=[mv, bm, other]))
    ax = d.fig.axes[0]
    wls = [t.get_text() for t in ax.get_yticklabels()]
    sizes = [int(t.get_text().split()[0].replace(",", "")) for t in ax.get_xticklabels()]
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    have = {(r.workload, r.gpus) for r in d.table.itertuples()}
    for i, wl in enumerate(wls):
        for j, n in enumerate(sizes):
            assert (i, j) in cells, (wl, n)
            if (wl, n) not in have:
                assert cells[(i, j)].startswith("n/a"), (wl, n)
    why = {(wls[i], sizes[j]): t for (i, j), t in cells.items()}
    assert "not simulated" in why[("bursty_mix", 16)] and "not simulated" in why[("image_sft", 8)]
    assert "baseline" in why[("bursty_mix", 8)]
    assert any(p.get_hatch() for p in ax.patches)
    title = ax.get_title()
    assert title.count("on h100") == 1 and title.count("weak scaling") == 1
    assert len(d.table) == 3  # the data: only the cells with a speedup
    plt.close(d.fig)


def _segments(ax) -> list[list[float]]:
    return [[b.get_width() for b in c] for c in ax.containers]


def test_breakdown_draws_imbalance_as_its_own_segment_and_reads_records_without_it(recs):
    rec = recs["mixed_video"]
    d = figures.breakdown(Records(sims=[rec]), gpus=16)
    ax = d.fig.axes[0]
    legend = [t.get_text() for t in d.fig.legends[0].get_texts()]
    assert len(legend) == len(figures.BREAKDOWN_PARTS) == len(ax.containers)
    assert any(lab.startswith("imbalance") for lab in legend)
    k = [key for key, _ in figures.BREAKDOWN_PARTS].index("imbalance")
    systems = [t.get_text() for t in ax.get_yticklabels()]
    rows = {r["system"]: r for r in rec.rows if r["gpus"] == 16 and r.get("fits")}
    assert _segments(ax)[k] == pytest.approx([rows[s]["breakdown_s"]["imbalance"] for s in systems])
    assert any(w > 0 for w in _segments(ax)[k])
    ends = np.sum(_segments(ax), axis=0)  # the parts add up to the step
    assert ends == pytest.approx([rows[s]["step_time_s"] for s in systems], rel=1e-3)
    assert "imbalance" in d.table.columns
    plt.close(d.fig)

    old = copy.deepcopy(rec)
    for r in old.rows:
        r.get("breakdown_s", {}).pop("imbalance", None)
    d = figures.breakdown(Records(sims=[old]), gpus=16)
    assert (d.table.imbalance == 0).all()
    assert all(w == 0 for w in _segments(d.fig.axes[0])[k])
    plt.close(d.fig)

"""Every figure the inputs can make, on one self-contained HTML page (images inline as base64, no
external assets), with the table behind each figure and the commands that produced the data."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
from dataclasses import dataclass

import matplotlib.pyplot as plt

from omnibench.plots import figures
from omnibench.plots.load import PlotInputError, Records, memory_error, nominal


@dataclass
class Section:
    title: str
    drawn: figures.Drawn | None
    reason: str = ""  # why it was not drawn
    png: str = ""  # the figure as the page inlines it (base64), rendered when drawn; "" : render at write time


def _draw(title: str, fn, *args, **kw) -> Section:
    try:
        return Section(title, fn(*args, **kw))
    except PlotInputError as e:
        return Section(title, None, str(e))


def draw_all(recs: Records, calibration: str | None = None, prov: dict | None = None) -> list[Section]:
    """Each figure kind for which the records hold enough data; the rest say why not. Simulations are
    kept apart by what they answer: the condition grid's cells (the conditions figure), those under a
    --memory-error (the memory figure), and the rest, one hardware at a time (a comparison never
    mixes machines). Each figure is rendered for the page (its PNG naming `prov`, default: this
    process's provenance; pass `write_html` the same) and closed as soon as it is drawn: a reproduce's
    records make dozens, and pyplot held every one open until the page was written."""
    from omnibench.provenance import figure_provenance
    from workloads.conditions import parse_cell

    prov = prov or figure_provenance()

    def _try(title: str, fn, *args, **kw) -> Section:
        s = _draw(title, fn, *args, **kw)
        if s.drawn is not None:
            s.png = _png(s.drawn.fig, prov)
            plt.close(s.drawn.fig)
        return s

    grid = [r for r in nominal(recs.sims) if parse_cell(r.workload)]
    varied = [r for r in recs.sims if memory_error(r)]
    main = [r for r in nominal(recs.sims) if not parse_cell(r.workload)]
    machines = sorted({str(r.config.get("hardware")) for r in main})

    def on(hw: str) -> Records:
        return Records(sims=[r for r in main if str(r.config.get("hardware")) == hw])

    def named(title: str, hw: str) -> str:
        return f"{title} ({hw})" if len(machines) > 1 else title

    out: list[Section] = []
    has_runs, has_sims = bool(recs.runs), bool(main)
    if has_runs:
        out.append(_try("Throughput (measured runs)", figures.throughput, recs, source="run"))
    for hw in machines:
        out.append(_try(named("Throughput (simulated)", hw), figures.throughput, on(hw), source="sim"))
    if not (has_runs or has_sims):
        out.append(Section("Throughput", None, "no run or simulation records given"))
    # Per workload only where the data allow it; otherwise one line says why not.
    scaled = []
    for hw in machines:
        sizes: dict[str, set] = {}
        for r in on(hw).sims:
            sizes.setdefault(r.workload, set()).update(int(g) for g in r.config.get("gpus", []))
        scaled += [(hw, wl) for wl, g in sizes.items() if len(g) >= 2]
    out += [_try(named(f"Scaling ({wl})", hw), figures.scaling, on(hw), workload=wl) for hw, wl in scaled] or [
        _try("Scaling", figures.scaling, Records(sims=main))]
    everyday = Records(runs=recs.runs, sims=main)
    dyn = []
    for wl in dict.fromkeys(r.workload for r in recs.runs if _steps(r) >= 2):
        dyn.append(_try(f"Throughput over training ({wl}, measured)", figures.dynamic, Records(runs=recs.runs),
                        workload=wl))
    for hw in machines:
        for wl in dict.fromkeys(r.workload for r in on(hw).sims if _steps(r) >= 2):
            dyn.append(_try(named(f"Throughput over training ({wl})", hw), figures.dynamic, on(hw), workload=wl))
    out += dyn or [Section("Throughput over training", None, "needs records with at least two steps (--steps N)")]
    for hw in machines:
        out.append(_try(named("omni speedup over the best baseline", hw), figures.speedup, on(hw)))
        out.append(_try(named("Where the step goes", hw), figures.breakdown, on(hw)))
    if grid:
        out.append(_try("Where decoupling pays (condition grid)", figures.conditions, Records(sims=grid)))
    if varied:
        out.append(_try("How the verdict moves when memory is mispredicted", figures.memory_sensitivity,
                        Records(sims=main + varied)))
    timeline_recs = [(r, r.system) for r in {r.system: r for r in reversed(recs.runs)}.values()]
    if not timeline_recs:
        seen = set()
        for rec in main:
            for s in rec.systems:
                if s not in seen and any(rec.trace_path(s, int(x["gpus"])) for x in rec.rows if x["system"] == s):
                    seen.add(s)
                    timeline_recs.append((rec, s))
    for rec, s in sorted(timeline_recs, key=lambda x: figures.style.order_systems([y[1] for y in timeline_recs])
                         .index(x[1])):
        kind = "measured" if rec.kind == "run" else "simulated"
        out.append(_try(f"Timeline: {s} ({kind})", figures.timeline, rec, system=s))
    if not timeline_recs:
        out.append(Section("Timeline", None, "no record with a trace"))
    if has_runs:
        out.append(_try("Simulated vs measured", figures.validation, Records(runs=recs.runs), calibration))
    else:
        out.append(Section("Simulated vs measured", None, "needs run records (omnibench run); only simulations given"))
    wls = everyday.workloads()
    ablations = []  # measured and simulated apart, each machine apart
    for label, rs in [("measured", Records(runs=recs.runs))] + [(named("simulated", hw), on(hw)) for hw in machines]:
        if not rs.all:
            continue
        rows = figures.throughput_table(rs)
        globally = figures.globally_loaded(rows, rs)  # the cumulative ablation's steps
        variants = rows[(rows.system == "omni") & ~globally].groupby("workload").variant.nunique()
        ablations += [_try(f"omni ablation ({wl}, {label})", figures.ablation, rs, workload=wl)
                      for wl in rs.workloads() if variants.get(wl, 0) >= 2]
        ablations += [_try(f"omni's techniques added one at a time ({wl}, {label})", figures.cumulative_ablation, rs,
                           workload=wl) for wl in dict.fromkeys(rows[globally].workload)]
    out += ablations or [Section("omni ablation", None, "needs omni records (with techniques switched off); none given")]
    for wl in wls:
        out.append(_try(f"Workload {wl}", figures.workload, wl))
    return out


def _steps(rec) -> int:
    if rec.kind == "run":
        return len(rec.steps)
    return max((len(r.get("per_step", [])) for r in rec.rows), default=0)


def _png(fig, prov: dict) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150, metadata=figures.style.png_metadata(prov))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _table_html(df) -> str:
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object:
            df[c] = df[c].map(lambda v: ", ".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else v)
    if len(df) > 60:
        df = df.head(60)
    return df.to_html(index=False, border=0, classes="t", float_format=lambda x: f"{x:,.4g}", na_rep="-")


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;color:#222;
line-height:1.4;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
img{max-width:100%;border:1px solid #eee}p.cap{color:#444;font-size:.92em}
table.t{border-collapse:collapse;font-size:.78em;margin:.5em 0}table.t td,table.t th{padding:2px 8px;
border-bottom:1px solid #eee;text-align:right}table.t th{background:#f6f6f6}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.8em}.miss{color:#a33}
p.prov{color:#777;font-size:.75em;margin-top:0}
details{margin:.4em 0}
"""


def write_html(sections: list[Section], recs: Records, path, title: str = "omnibench report",
               prov: dict | None = None) -> None:
    """The page, and under it and every figure which code (commit, dirty flag) and command made it
    (`prov`, default: this process's); each inline PNG carries the same in its metadata."""
    from omnibench.cli.common import atomic_write
    from omnibench.provenance import figure_provenance, provenance_text

    prov = prov or figure_provenance()
    made = html.escape(provenance_text(prov))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<meta name='generator' content='{made}'>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p>Generated {stamp} from {len(recs.runs)} run record(s) and {len(recs.sims)} simulation record(s); "
             f"{made}.</p>"]
    drawn = [s for s in sections if s.drawn]
    missing = [s for s in sections if not s.drawn]
    parts.append("<ul>" + "".join(f"<li><a href='#f{i}'>{html.escape(s.title)}</a></li>" for i, s in
                                  enumerate(drawn)) + "</ul>")
    for i, s in enumerate(drawn):
        d = s.drawn
        parts.append(f"<h2 id='f{i}'>{html.escape(s.title)}</h2><img alt='{html.escape(s.title)}' "
                     f"src='data:image/png;base64,{s.png or _png(d.fig, prov)}'><p class='cap'>{html.escape(d.caption)}</p>"
                     f"<p class='prov'>Figure {made}.</p>"
                     f"<details><summary>table ({len(d.table)} rows)</summary>{_table_html(d.table)}</details>")
        plt.close(d.fig)
    if missing:
        parts.append("<h2>Figures not drawn</h2><ul>" + "".join(
            f"<li><b>{html.escape(s.title)}</b>: <span class='miss'>{html.escape(s.reason)}</span></li>"
            for s in missing) + "</ul>")
    if recs.skipped:
        parts.append("<p class='miss'>Skipped unfinished folders: " + html.escape("; ".join(recs.skipped)) + "</p>")
    parts.append("<h2>Commands that produced the data</h2><pre>" + html.escape(
        "\n".join(r.command for r in recs.all) or "(no records)") + "</pre>")
    parts.append(f"<hr><p class='prov'>This page was {made}.</p></body></html>")
    # whole or not at all: a page cut short by a full disk still opens and would pass for the report
    try:
        atomic_write(path, "\n".join(parts))
    except OSError as e:
        e.filename = str(path)  # the page, not atomic_write's temporary file beside it
        raise

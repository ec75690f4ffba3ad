"""The paper's figures. Each `<kind>(...)` returns a `Drawn`: the matplotlib Figure, the table
behind it (a DataFrame, shown under the figure in the report) and a caption; inputs that cannot
make the figure raise PlotInputError saying what is missing (never an empty figure)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch
from matplotlib.ticker import (
    FuncFormatter,
    LogLocator,
    MaxNLocator,
    NullFormatter,
    NullLocator,
    PercentFormatter,
)

from omnibench.plots import style
from omnibench.plots.load import (
    BASELINES,
    PlotInputError,
    Records,
    RunRecord,
    SimRecord,
    memory_error,
    mix_table,
    nominal,
    steps_table,
    stream_of,
    throughput_table,
    trace_table,
    validation_table,
)


@dataclass
class Drawn:
    name: str
    fig: plt.Figure
    table: pd.DataFrame
    caption: str


def _si(x: float, _pos=None) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{suffix}"
    return f"{x:g}"


def _pick_source(df: pd.DataFrame, what: str) -> pd.DataFrame:
    """Measured runs when there are any, else simulations (one figure never mixes the two)."""
    if df.empty:
        raise PlotInputError(f"{what}: no run or simulation results that ran (all inputs failed or did not fit)")
    return df[df.source == "run"] if (df.source == "run").any() else df[df.source == "sim"]


def _systems_text(df: pd.DataFrame) -> str:
    return ", ".join(style.order_systems(df.system.unique())) or "none"


def setup_lines(sims, workload: str | None = None) -> list[str]:
    """What a simulated figure's title must state: model and hardware, layout, and whether the batch
    grows with the cluster (weak scaling: tokens per GPU fixed) or not (strong scaling). One line per
    set of conditions: what every record shares first, then per set of workloads what differs."""
    conds: dict[tuple, list[str]] = {}
    for r in sims:
        if workload is not None and r.workload != workload:
            continue
        c = r.config
        gbt = c.get("global_batch_tokens") or 0
        batch = f"strong scaling, {gbt:,} tokens/step" if gbt else "weak scaling, 8,192 tokens/GPU"
        where = (str(c.get("model")), f"on {c.get('hardware')}")  # apart: records differ in model, not machine
        if c.get("tuned"):
            parts = (*where, tuned_text(c), batch)
        elif c.get("default_layouts"):
            parts = (*where, "each system's default layout", recompute_text(c), batch)
        else:
            layout = f"tp {c.get('tp', 1)} / pp {c.get('pp', 1)}" + "".join(
                f" / {k} {c[k]}" for k in ("cp", "ep") if c.get(k, 1) > 1)
            parts = (*where, layout, recompute_text(c), batch)
        wls = conds.setdefault(parts, [])
        if r.workload not in wls:
            wls.append(r.workload)
    if len(conds) <= 1:
        return [_joined(p) for p in conds]
    # Said once: a part every set of conditions shares (a title that repeats it buries what differs).
    common = [p for p in next(iter(conds)) if all(p in c for c in conds)]
    lines = [_joined(common)] if common else []
    for parts, wls in conds.items():
        rest = _joined([p for p in parts if p not in common])
        lines.append(f"{', '.join(wls)}: {rest}" if workload is None else rest)
    return lines


def _joined(parts) -> str:
    """Parts of a setup line as a sentence reads them: "omni-7b on h100, tp 4 / pp 1, ..."."""
    return "".join(p if i == 0 else (" " if p.startswith("on ") else ", ") + p for i, p in enumerate(parts))


def titled(head: str, lines: list[str], width_in: float, fontsize: float) -> str:
    """A title over `lines` (setup_lines), each wrapped to `width_in` at `fontsize`: a line wider than
    the figure makes a tight save widen the image around it, squeezing the plot to a strip."""
    chars = max(30, int(width_in * 72 / (0.6 * fontsize)))  # 0.6 em: a wide average glyph, digits and commas
    return "\n".join([head, *(_wrap(x, chars) for x in lines if x)])


def _wrap(line: str, chars: int) -> str:
    """`line` in rows of at most `chars`, broken after a ", " outside parentheses where it can be (a
    phrase such as "tuned layouts (tune budget 8, at step 0)" stays whole), else between words."""
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(line):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0 and line[i + 1:i + 2] == " ":
            pieces.append(line[start:i + 1])
            start = i + 2
    pieces.append(line[start:])
    rows = [pieces[0]]
    for p in pieces[1:]:
        if len(rows[-1]) + 1 + len(p) > chars:
            rows.append(p)
        else:
            rows[-1] += " " + p
    out = [w for r in rows for w in textwrap.wrap(r, chars, break_on_hyphens=False)]
    return "\n".join(out[:1] + ["  " + w for w in out[1:]])


def _grow_for_title(fig: plt.Figure, title: str, fontsize: float, room: int = 2) -> None:
    """A taller figure for a title of more than `room` lines, so the axes keep their height."""
    extra = title.count("\n") + 1 - room
    if extra > 0:
        fig.set_figheight(fig.get_figheight() + extra * 1.25 * fontsize / 72)


def recompute_text(config: dict) -> str:
    """A simulation's recomputation as a title says it: `auto` settled per system (rows say which mode)."""
    mode = config.get("recompute", "none")
    return "recompute: the cheapest that fits, per system" if mode == "auto" else f"recompute {mode}"


def tuned_text(config: dict) -> str:
    """How a tuned simulation chose its layouts, as a figure's title says it."""
    budget = config.get("tune_budget")
    steps = config.get("tuned_at_steps") or [config.get("tuned_at_step", 0)]
    where = f"at step {steps[0]}" if len(steps) == 1 else f"on steps {', '.join(map(str, steps))}"
    return f"tuned layouts (tune budget {budget}, {where})" if budget else f"tuned layouts ({where})"


# -- 1. throughput ---------------------------------------------------------------------------------
def throughput(recs: Records, source: str = "auto", gpus: int | None = None, hardware: str | None = None) -> Drawn:
    """Grouped bars per workload. Simulations (on one hardware; none under a --memory-error): by
    default each workload at the largest cluster size where at least two systems ran (`gpus` picks
    one size)."""
    sims = nominal(recs.sims)
    if sims and (source != "run" and not (source == "auto" and recs.runs)):
        sims, _hw = _hardware_of(sims, hardware, "throughput")
    recs = Records(runs=recs.runs, sims=sims)
    full = throughput_table(recs)
    if source != "auto":
        full = full[full.source == source]
        if full.empty:
            raise PlotInputError(f"throughput: no {'run' if source == 'run' else 'simulation'} results given")
    df = _pick_source(full, "throughput")
    df = df[df.variant == df.system]  # omni's ablation variants belong to the ablation figure
    if gpus is not None:
        if gpus not in set(df.gpus):
            raise PlotInputError(f"throughput: no results at {gpus:,} GPUs; sizes: "
                                 f"{', '.join(f'{g:,}' for g in sorted(set(df.gpus)))}")
        df = df[df.gpus == gpus]
    elif (df.source == "sim").all():
        n_sys = df.groupby(["workload", "gpus"]).system.nunique()
        top = {wl: max(g for (w, g), n in n_sys.items() if w == wl and n >= 2) for wl, _ in n_sys[n_sys >= 2].index}
        df = df[[top.get(w) == g for w, g in zip(df.workload, df.gpus, strict=True)]] if top else df
    # Measured runs of one system on one workload are repeats: their mean, with the spread as an error
    # bar. Simulations of one system are layouts: the best one.
    measured = bool((df.source == "run").all())
    how = "mean" if measured else "max"
    agg = (df.groupby(["workload", "gpus", "system"], as_index=False)
           .agg(tokens_per_s=("tokens_per_s", how), tokens_per_s_per_gpu=("tokens_per_s_per_gpu", how),
                tokens_per_s_std=("tokens_per_s", "std"), records=("record", "count")))
    agg["tokens_per_s_std"] = agg["tokens_per_s_std"].fillna(0.0) if measured else 0.0
    groups = []
    for (wl, gpus), g in agg.groupby(["workload", "gpus"], sort=False):
        if g.system.nunique() < 2:
            continue
        base = g[g.system.isin(BASELINES)]
        best = (base if not base.empty else g[g.system != "omni"]).tokens_per_s.max()
        g = g.assign(speedup=g.tokens_per_s / best, speedup_std=g.tokens_per_s_std / best, best_baseline=best)
        groups.append(((wl, gpus), g))
    if not groups:
        raise PlotInputError(
            "throughput compares systems: need results of at least two systems on the same workload and cluster "
            f"size; got {_systems_text(df)} ({', '.join(sorted(set(df.workload)))})")
    table = pd.concat([g for _, g in groups], ignore_index=True)
    systems = style.order_systems(table.system.unique())
    many_sizes = table.gpus.nunique() > 1
    width = 0.8 / len(systems)
    style.apply_theme()
    fig, ax = plt.subplots(figsize=(min(style.DOUBLE_IN, max(style.COLUMN_IN, 0.3 * len(systems) * len(groups) + 1.6)),
                                    2.3))
    repeats = int(table.records.max())
    for i, s in enumerate(systems):
        xs, ys, errs = [], [], []
        for j, (_, g) in enumerate(groups):
            row = g[g.system == s]
            if not row.empty:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(float(row.speedup.iloc[0]))
                errs.append(float(row.speedup_std.iloc[0]))
        bars = ax.bar(xs, ys, width=width * 0.95, color=style.system_color(s), label=s, edgecolor="white",
                      linewidth=0.4, yerr=errs if measured and repeats > 1 else None,
                      error_kw={"elinewidth": 0.7, "capsize": 1.5, "ecolor": "0.2"})
        ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=5.5, padding=1, rotation=90 if len(
            systems) * len(groups) > 8 else 0)
    ax.axhline(1.0, color="0.3", linewidth=0.6, linestyle="--", zorder=0)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{wl}\n{gpus:,} GPUs" if many_sizes else wl for (wl, gpus), _ in groups])
    ax.set_ylabel("throughput (tokens/s)\nrel. to best baseline")
    ax.set_ylim(0, table.speedup.max() * 1.22)
    src = "measured" if (df.source == "run").all() else "simulated"
    if src == "measured":
        src = f"measured on {', '.join(sorted(_devices(recs, df)))}"
    size = "" if many_sizes else f", {int(table.gpus.iloc[0]):,} {'ranks' if (df.source == 'run').all() else 'GPUs'}"
    setup = [] if src != "simulated" else setup_lines(recs.sims)
    fs = plt.rcParams["axes.titlesize"]
    title = titled(f"Training throughput per system ({src}{size})", setup, fig.get_figwidth(), fs)
    _grow_for_title(fig, title, fs)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title="system")
    fig.tight_layout()
    caption = (f"{src[0].upper() + src[1:]} training throughput (tokens/s), normalised per group to the best baseline "
               f"({', '.join(b for b in BASELINES)}); labels give the speedup. "
               + (f"Bars: mean over up to {repeats} repeated runs, error bars one standard deviation."
                  if measured and repeats > 1 else "Measured: one run per bar (no repeats; no error bar)."
                  if measured else "Where a system has several records (layouts) in a group, its best one is shown."))
    return Drawn("throughput", fig, table, caption + _left_out(full) + _cpu_note(recs, df))


CPU_NOTE = (" Measured on CPU (gloo, tiny preset): such runs prove the code paths; their speed is dominated by "
            "per-action overheads on a shared host and says little about GPUs at scale.")


def _devices(recs: Records, df: pd.DataFrame) -> set[str]:
    """The devices of the runs behind a table's rows ("?" where a record does not say)."""
    keep = set(df.record)
    return {str(r.summary.get("device", "?")) for r in recs.runs if str(r.path) in keep}


def _cpu_note(recs: Records, df: pd.DataFrame) -> str:
    devs = _devices(recs, df)
    return CPU_NOTE if devs and all(d.startswith("cpu") for d in devs) else ""


def _left_out(df: pd.DataFrame) -> str:
    lo = df.attrs.get("left_out") or []
    return (" Left out (did not run): " + "; ".join(lo[:8]) + (" ..." if len(lo) > 8 else "") + ".") if lo else ""


# -- 2. scaling ------------------------------------------------------------------------------------
def _one_workload(df: pd.DataFrame, workload: str | None, what: str) -> tuple[pd.DataFrame, str]:
    wls = list(dict.fromkeys(df.workload))
    if workload is not None:
        if workload not in wls:
            raise PlotInputError(f"{what}: no results for workload {workload!r}; records hold {', '.join(wls)}")
        return df[df.workload == workload], workload
    if len(wls) > 1:
        raise PlotInputError(f"{what}: records hold several workloads ({', '.join(wls)}); pick one with --workload")
    return df, wls[0]


def scaling(recs: Records, workload: str | None = None) -> Drawn:
    if not recs.sims:
        raise PlotInputError("scaling needs simulation records (omnibench simulate --gpus 256,1024,...); "
                             "got only real runs")
    full = throughput_table(Records(sims=nominal(recs.sims)))
    df = full[(full.source == "sim") & (full.variant == full.system)]
    if df.empty:
        raise PlotInputError("scaling: no simulated result fits in memory" + _left_out(full))
    df, wl = _one_workload(df, workload, "scaling")
    sizes = sorted(df.gpus.unique())
    if len(sizes) < 2:
        raise PlotInputError(f"scaling needs at least two cluster sizes; records of {wl} hold only {sizes[0]:,} GPUs")
    if df.system.nunique() < 2:
        raise PlotInputError(f"scaling compares systems: records of {wl} hold only {_systems_text(df)}")
    table = (df.groupby(["system", "gpus"], as_index=False)
             .agg(tokens_per_s_per_gpu=("tokens_per_s_per_gpu", "mean"), mfu=("mfu", "mean"),
                  tflops_per_gpu=("tflops_per_gpu", "mean"), bubble=("bubble", "mean")))
    style.apply_theme()
    fig, axes = plt.subplots(1, 2, figsize=(style.DOUBLE_IN, 2.3))
    handles = []
    for s in style.order_systems(table.system.unique()):
        g = table[table.system == s].sort_values("gpus")
        i = style.SYSTEM_ORDER.index(s) if s in style.SYSTEM_ORDER else len(style.SYSTEM_ORDER)
        if not (np.isfinite(g.tokens_per_s_per_gpu.astype(float)).any() or np.isfinite(g.mfu.astype(float)).any()):
            continue
        # Systems within a hair of each other draw one line over another: a marker of its own, and the
        # later (upper) lines dashed and thinner, let the one underneath show through.
        kw = dict(color=style.system_color(s), marker=SCALING_MARKERS[i % len(SCALING_MARKERS)],
                  markersize=5.0 - 0.3 * i, linewidth=1.8 - 0.15 * i, linestyle=SCALING_DASHES[i % len(SCALING_DASHES)],
                  label=s)
        handles += axes[0].plot(g.gpus, g.tokens_per_s_per_gpu, **kw)
        axes[1].plot(g.gpus, g.mfu * 100, **kw)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: f"{int(x):,}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("cluster size (GPUs, log$_2$)")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("throughput (tokens/s/GPU)")
    axes[0].yaxis.set_major_formatter(FuncFormatter(_si))
    axes[1].set_ylabel("MFU (%)")
    axes[0].set_title("(a) per-GPU throughput")
    axes[1].set_title("(b) model FLOPs utilisation")
    axes[1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title="system")
    hw = ", ".join(sorted({f"{r.config.get('model')} on {r.config.get('hardware')}" for r in recs.sims
                           if r.workload == wl}))
    title = titled(f"Scaling on {wl}, {sizes[0]:,} to {sizes[-1]:,} GPUs (simulated)", setup_lines(recs.sims, wl),
                   fig.get_figwidth(), 9)
    _grow_for_title(fig, title, 9)
    fig.suptitle(title, fontsize=9)
    missing = _not_drawn(recs.sims, wl, {h.get_label() for h in handles})
    if missing:
        fig.text(0.01, 0.01, "Not drawn: " + "; ".join(missing), fontsize=6, color="0.3", ha="left", va="bottom",
                 wrap=True)
        fig.set_figheight(fig.get_figheight() + 0.15 * len(missing))
        fig.tight_layout(rect=(0, 0.1 * len(missing) / fig.get_figheight() + 0.04, 1, 1))
    else:
        fig.tight_layout()
    caption = (f"Simulated weak scaling on {wl} ({hw}): tokens/s/GPU and MFU (model FLOPs of the step, exact "
               "per-module formula, over step time x GPUs x peak) against cluster size."
               + (" Not drawn: " + "; ".join(missing) + "." if missing else ""))
    return Drawn("scaling", fig, table, caption + _left_out(full))


SCALING_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
SCALING_DASHES = ("-", (0, (5, 1.5)), (0, (3, 1.5)), (0, (1.5, 1.5)), (0, (5, 1.5, 1.5, 1.5)))


def _not_drawn(sims: list, workload: str, drawn: set[str]) -> list[str]:
    """'system: why' for each system the records of `workload` hold that no line shows."""
    rows: dict[str, list[dict]] = {}
    for rec in sims:
        if rec.workload == workload:
            for row in rec.rows:
                rows.setdefault(row["system"], []).append(row)
    out = []
    for s in style.order_systems(set(rows) - drawn):
        errors = [r for r in rows[s] if "error" in r]
        why = ("does not fit at any size" if not errors
               else f"no plan at any size ({errors[0]['error']})" if len(errors) == len(rows[s])
               else "does not fit or has no plan at any size")
        out.append(f"{s}: {why}")
    return out


# -- 3. dynamic ------------------------------------------------------------------------------------
def dynamic_summary(g: pd.DataFrame) -> pd.DataFrame:
    """Per (cluster size, system) over the steps of `g` (a steps_table slice): steps, mean, min and
    10th percentile of tokens/s, and each system's mean relative to the best baseline's mean."""
    rows = []
    for (gpus, system), d in g.groupby(["gpus", "system"]):
        ok = d[d.ran]
        tps = ok.groupby("step").tokens_per_s.mean()
        bad = d[~d.ran].drop_duplicates("step")
        layouts = sorted({x for x in d.layout.dropna() if x})
        rows.append({"gpus": int(gpus), "system": system, "steps": d.step.nunique(), "steps_failed": len(bad),
                     "first_failure": f"step {int(bad.step.iloc[0])}: {bad.why.iloc[0]}" if len(bad) else "",
                     "layout": ", ".join(layouts),
                     "mean_tokens_per_s": float(tps.mean()) if len(tps) else np.nan,
                     "min_tokens_per_s": float(tps.min()) if len(tps) else np.nan,
                     "p10_tokens_per_s": float(np.percentile(tps, 10)) if len(tps) else np.nan,
                     "mean_tokens_per_s_per_gpu": float(tps.mean()) / int(gpus) if len(tps) else np.nan})
    out = pd.DataFrame(rows)
    out["rel_best_baseline"] = np.nan
    out["best_baseline"] = ""
    for _gpus, d in out.groupby("gpus"):
        # the best baseline among those that ran every step (a deployment that stops has no mean)
        base = d[d.system.isin(BASELINES) & (d.steps_failed == 0)]
        if base.empty:
            continue
        best = base.loc[base.mean_tokens_per_s.idxmax()]
        ran_all = d[d.steps_failed == 0]  # a mean over only the steps a layout survived compares nothing
        out.loc[ran_all.index, "rel_best_baseline"] = ran_all.mean_tokens_per_s / best.mean_tokens_per_s
        out.loc[d.index, "best_baseline"] = best.system
    order = {s: i for i, s in enumerate(style.order_systems(out.system.unique()))}
    return out.sort_values(["gpus", "system"], key=lambda c: c.map(order) if c.name == "system" else c,
                           ignore_index=True)


def dynamic(recs: Records, workload: str | None = None, gpus: int | None = None) -> Drawn:
    """Throughput per step over training, one panel per cluster size (the sizes with the most systems
    over at least two steps, or `gpus`), above the modality mix of each step."""
    recs = Records(runs=recs.runs, sims=nominal(recs.sims))  # a --memory-error run is the memory figure's
    st = steps_table(recs)
    if st.empty:
        raise PlotInputError("dynamic: no per-step results in the records")
    st, wl = _one_workload(st, workload, "dynamic")
    keys = {}
    for (src, n), g in st.groupby(["source", "gpus"]):
        n_steps = g[g.ran].groupby("system").step.nunique().max()
        if n_steps >= 2:
            keys[(src, int(n))] = (g.system.nunique(), n_steps)
    if gpus is not None and keys and not any(k[1] == gpus for k in keys):
        raise PlotInputError(f"dynamic: no records with at least two steps on {wl} at {gpus:,} GPUs; sizes that have "
                             f"them: {', '.join(f'{n:,}' for n in sorted({k[1] for k in keys}))}")
    if gpus is not None:
        keys = {k: v for k, v in keys.items() if k[1] == gpus}
    if not keys:
        raise PlotInputError(f"dynamic needs records with at least two steps on {wl}; every record holds one "
                             "step (simulate with --steps N, run with --steps N)")
    # One source; within it every cluster size that has as many systems as the best one.
    src = max(keys, key=lambda k: (keys[k], k[0] == "sim"))[0]
    most = max(v[0] for k, v in keys.items() if k[0] == src)
    sizes = sorted(n for (s, n), v in keys.items() if s == src and v[0] == most)
    g = st[(st.source == src) & st.gpus.isin(sizes)]
    steps = sorted(g.step.unique())
    recs_of = recs.runs if src == "run" else recs.sims
    rec = next(r for r in recs_of if str(r.path) == g[g.gpus == sizes[0]].record.iloc[0])
    mix = mix_table(rec, steps, sizes[0] if src == "sim" else None)
    style.apply_theme()
    fig, axes = plt.subplots(len(sizes) + 1, 1, figsize=(5.6, 1.0 + 1.5 * len(sizes) + 1.1), sharex=True,
                             gridspec_kw={"height_ratios": [1.5] * len(sizes) + [1]})
    axm = axes[-1]
    markers = 2 if len(steps) > 30 else 3
    for i, (ax, n) in enumerate(zip(axes[:-1], sizes, strict=True)):
        gn = g[g.gpus == n]
        failed_any = False
        order = style.order_systems(gn.system.unique())
        nudge = 0.06 * (steps[1] - steps[0])  # the crosses of systems failing one step side by side
        for j, s in enumerate(order):
            d = gn[gn.system == s].groupby("step", as_index=False).agg(tokens_per_s=("tokens_per_s", "mean"),
                                                                        ran=("ran", "all"))
            ys = (d.tokens_per_s / n).where(d.ran)  # a gap where the kept layout cannot run the step
            ax.plot(d.step, ys, color=style.system_color(s), label=s, linewidth=1.2, marker="o", markersize=markers)
            if (~d.ran).any():
                failed_any = True
                ax.plot(d.step[~d.ran] + (j - (len(order) - 1) / 2) * nudge, [0] * int((~d.ran).sum()),
                        linestyle="none", marker="x", markersize=5,
                        markeredgewidth=1.2, color=style.system_color(s), clip_on=False, zorder=5)
        if src == "run":
            ax.axvspan(steps[0] - 0.5, steps[0] + 0.5, color="0.9", zorder=0)
            ax.text(steps[0], ax.get_ylim()[1], " warm-up", fontsize=6, va="top", color="0.4")
        ax.set_ylabel("tokens/s/GPU")
        ax.yaxis.set_major_formatter(FuncFormatter(_si))
        ax.set_ylim(bottom=0)
        unit = "ranks" if src == "run" else "GPUs"
        ax.set_title(f"({chr(97 + i)}) {n:,} {unit}", fontsize=7.5, loc="left")
        if failed_any:
            ax.text(1.01, 0.0, "x on the axis: cannot run\nthis step (out of memory\nor no plan)", transform=ax.transAxes,
                    fontsize=5.5, va="bottom", color="0.3")
        if i == 0:
            ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="system")
    wide = mix.pivot(index="step", columns="modality", values="share")
    mods = [m for m in style.MODALITY_COLORS if m in wide.columns and wide[m].sum() > 0]
    # steps, not slopes: each training step has one mix (its band spans the step's neighbourhood)
    axm.stackplot(wide.index, [wide[m] for m in mods], labels=mods, colors=[style.MODALITY_COLORS[m] for m in mods],
                  alpha=0.85, linewidth=0, step="mid")
    axm.set_ylim(0, 1)
    phases = mix.drop_duplicates("step").set_index("step").phase
    runs_ = (phases != phases.shift()).cumsum()
    drifting = phases.str.contains("->").any()  # a changing schedule: every step is its own blend
    if 1 < runs_.iloc[-1] <= 6 and not drifting:  # staged or bursty: name each stretch, mark where it changes
        for _, seg in phases.groupby(runs_):
            lo, hi = seg.index[0], seg.index[-1]
            if lo != steps[0]:
                for a in axes:
                    a.axvline(lo - 0.5, color="0.2", linewidth=0.6, linestyle=":")
            axm.text((lo + hi) / 2, 0.97, seg.iloc[0], ha="center", va="top", fontsize=5.5, color="white",
                     fontweight="bold", clip_on=True)
    axm.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    axm.set_ylabel("LLM tokens\nper modality")
    axm.set_xlabel("training step" + (f" (every {steps[1] - steps[0]:,}th batch)" if steps[1] - steps[0] > 1 else ""))
    pad = 0.5 * (steps[1] - steps[0])
    axm.set_xlim(steps[0] - pad, steps[-1] + pad)
    axm.xaxis.set_major_locator(MaxNLocator(integer=True))
    axm.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="modality")
    kind = "measured" if src == "run" else "simulated"
    tuned = [r.config for r in recs.sims if r.workload == wl and r.config.get("tuned")] if src == "sim" else []
    how = setup_lines([r for r in recs.sims if str(r.path) in set(g.record)], wl) if src == "sim" else []
    title = titled(f"Throughput under a changing mix: {wl} ({kind})", how, fig.get_figwidth(), 8.5)
    _grow_for_title(fig, title, 8.5)
    fig.suptitle(title, fontsize=8.5)
    fig.tight_layout()
    table = dynamic_summary(g)
    kept = (" Each system's layout was tuned once on step 0's batch and kept for every step (a static deployment)."
            if tuned else "")
    failed = table[table.steps_failed > 0]
    if len(failed):
        kept += " Steps a kept layout cannot run (x): " + "; ".join(
            f"{r.system} at {r.gpus:,}: {r.steps_failed} of {r.steps}, first {r.first_failure}"
            for r in failed.itertuples()) + "."
    caption = (f"Per-step {kind} throughput per system on {wl} at {', '.join(f'{n:,}' for n in sizes)} "
               f"{'ranks' if src == 'run' else 'GPUs'}, above the share of each step's LLM tokens per modality "
               f"(recomputed from the same sample stream, at {sizes[0]:,}).{kept} Table: per system the mean, "
               "minimum and 10th percentile of tokens/s over the steps it ran, and (if it ran every step) its mean relative "
               "to the best baseline's that ran every step.")
    return Drawn("dynamic", fig, table, caption)


# -- 3b. speedup sweep -----------------------------------------------------------------------------
def _hardware_of(sims: list, hardware: str | None, what: str) -> tuple[list, str]:
    """The simulations on one hardware (`hardware`, or the only one the records hold): a comparison
    across systems never mixes machines."""
    have = sorted({str(r.config.get("hardware")) for r in sims})
    if hardware is not None:
        if hardware not in have:
            raise PlotInputError(f"{what}: no simulation on hardware {hardware!r}; records hold {', '.join(have)}")
        return [r for r in sims if str(r.config.get("hardware")) == hardware], hardware
    if len(have) > 1:
        raise PlotInputError(f"{what}: records hold several hardware ({', '.join(have)}); pick one with --hardware "
                             "(a figure never mixes machines)")
    return sims, have[0] if have else ""


def _omni_vs_best(df: pd.DataFrame, keys: list[str]) -> list[dict]:
    """Per group of `keys` (a throughput_table slice, one variant per system): omni's best record
    against the fastest baseline's, with both layouts and the speedup."""
    rows = []
    for key, g in df.groupby(keys, sort=False):
        best = g.loc[g.groupby("system").tokens_per_s.idxmax()]
        omni, base = best[best.system == "omni"], best[best.system.isin(BASELINES)]
        if omni.empty or base.empty:
            continue
        o, b = omni.iloc[0], base.loc[base.tokens_per_s.idxmax()]
        rows.append({**dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True)),
                     "omni_tokens_per_s_per_gpu": o.tokens_per_s_per_gpu, "omni_layout": o.layout,
                     "best_baseline": b.system, "best_baseline_tokens_per_s_per_gpu": b.tokens_per_s_per_gpu,
                     "best_baseline_layout": b.layout, "speedup": o.tokens_per_s / b.tokens_per_s,
                     "baselines_ran": int(len(base)), "steps": int(max(o.steps, b.steps)),
                     # where each step goes (shares of its time) and what omni's plan decided: the
                     # explanation the documents print comes from these, never from prose
                     **{f"{who}_{part}": getattr(r, part) for who, r in (("omni", o), ("best_baseline", b))
                        for part in ("bubble", "exposed_comm", "imbalance")},
                     "omni_plan": o.plan})
    return rows


def speedup(recs: Records, hardware: str | None = None, as_deployed: bool = False) -> Drawn:
    """omni over the best baseline per workload x cluster size on one hardware (simulations; per
    system its best record in a cell), as a heatmap with the speedup and the best baseline written in
    each cell. Simulations under a --memory-error are left out (the memory figure's)."""
    sims = nominal(recs.sims)
    if not sims:
        raise PlotInputError("speedup needs simulation records (omnibench simulate --system all ...); got "
                             + ("only --memory-error ones" if recs.sims else "only runs"))
    sims, hw = _hardware_of(sims, hardware, "speedup")
    full = throughput_table(Records(sims=sims))
    df = full[full.variant == full.system]
    rows = [{"hardware": hw, **r} for r in _omni_vs_best(df, ["workload", "gpus"])]
    for r in rows:
        r["gpus"] = int(r["gpus"])
    if not rows:
        raise PlotInputError("speedup needs omni and at least one baseline on the same workload and cluster size; got "
                             f"{_systems_text(df) if not df.empty else 'nothing that ran'}" + _left_out(full))
    table = pd.DataFrame(rows)
    ran = _cells_simulated(sims)
    wls = list(dict.fromkeys([*table.workload, *(w for w, _ in ran)]))
    sizes = sorted({*table.gpus, *(n for _, n in ran)})
    grid = np.full((len(wls), len(sizes)), np.nan)
    for r in table.itertuples():
        grid[wls.index(r.workload), sizes.index(r.gpus)] = r.speedup
    from matplotlib.colors import TwoSlopeNorm

    style.apply_theme()
    fig, ax = plt.subplots(figsize=(min(style.DOUBLE_IN, 1.9 + 1.25 * len(sizes)), 0.9 + 0.36 * len(wls)))
    lo, hi = np.nanmin(grid), np.nanmax(grid)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
    im = ax.imshow(grid, cmap="RdBu", norm=norm, aspect="auto")
    for r in table.itertuples():
        i, j = wls.index(r.workload), sizes.index(r.gpus)
        dark = abs(norm(r.speedup) - 0.5) > 0.35
        ax.text(j, i, f"{r.speedup:.2f}x\nvs {r.best_baseline}", ha="center", va="center", fontsize=6,
                color="white" if dark else "0.1")
    from matplotlib.patches import Rectangle

    for i, j in zip(*np.nonzero(np.isnan(grid)), strict=True):
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="none", edgecolor="0.8", hatch="////",
                               linewidth=0))
        ax.text(j, i, f"n/a\n{_no_speedup_why(ran.get((wls[i], sizes[j])))}", ha="center", va="center",
                fontsize=5.5, color="0.25", bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none"))
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{n:,} GPUs" for n in sizes])
    ax.set_yticks(range(len(wls)))
    ax.set_yticklabels(wls)
    ax.grid(False)
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.03).set_label("omni / best baseline", fontsize=7)
    which = "the best baseline as deployed (split by tokens)" if as_deployed else "the best baseline"
    title = titled(f"omni speedup over {which} (simulated)", setup_lines(sims), fig.get_figwidth(), 8)
    _grow_for_title(fig, title, 8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    multi = sorted({r.workload for r in table.itertuples() if r.steps > 1})
    caption = (f"Simulated throughput of omni divided by that of the fastest baseline ({', '.join(BASELINES)}) per "
               f"workload and cluster size on {hw}; each system at the layout its record holds (with --tuned: its own, "
               "tuned once and kept). A hatched cell (n/a) has no speedup and says why: not simulated, or omni "
               "or every baseline did not fit (or had no plan)."
               + (" The baselines split their batches by token counts, as Megatron-LM and VeOmni do, at the layouts "
                  "tuned at full strength; omni by the analytic FLOP estimate." if as_deployed else
                  " Every system splits its batches by the analytic FLOP estimate (full strength).")
               + (f" Over several steps ({', '.join(multi)}): total tokens over total time, and only systems whose "
                  "kept layout ran every step compete." if multi else "")
               + _left_out(full))
    return Drawn("speedup", fig, table.assign(mode="as deployed" if as_deployed else "full strength"), caption)


def _cells_simulated(sims: list) -> dict[tuple[str, int], dict[str, bool]]:
    """Per (workload, cluster size) the records simulated: whether each system fitted there."""
    out: dict[tuple[str, int], dict[str, bool]] = {}
    for rec in sims:
        for row in rec.rows:
            cell = out.setdefault((rec.workload, int(row["gpus"])), {})
            cell[row["system"]] = cell.get(row["system"], False) or ("error" not in row and bool(row.get("fits")))
    return out


def _no_speedup_why(cell: dict[str, bool] | None) -> str:
    """Why a (workload, cluster size) cell has no speedup of omni over a baseline, in a few words."""
    if not cell:
        return "not simulated"
    base = [s for s in cell if s in BASELINES]
    if "omni" not in cell:
        return "omni not simulated"
    if not base:
        return "no baseline\nsimulated"
    if not cell["omni"]:
        return "omni does\nnot fit"
    if not any(cell[s] for s in base):
        return "no fitting\nbaseline"
    return "not\ncompared"  # e.g. only ablated omni records


# -- 3b. where the step goes -------------------------------------------------------------------------
BREAKDOWN_PARTS = (("encoder", "encoder compute"), ("llm", "LLM compute"), ("optimizer", "optimizer step"),
                   ("exposed_comm", "exposed communication"),
                   ("imbalance", "imbalance (waiting on a slower data-parallel peer)"),
                   ("planning", "planning not hidden under the step before"),
                   ("idle", "idle (bubbles, other waits)"))


def _best_rows(sims: list) -> pd.DataFrame:
    """Per (workload, cluster size, system): the fastest record's row that fits, with its breakdown."""
    rows = []
    for rec in sims:
        for row in rec.rows:
            if "error" in row or not row.get("fits", False) or not row.get("breakdown_s"):
                continue
            rows.append({"workload": rec.workload, "gpus": int(row["gpus"]), "system": row["system"],
                         "tokens_per_s": row["tokens_per_s"], "step_time_s": row["step_time_s"],
                         # records written before imbalance was its own part counted it in idle
                         "layout": row.get("layout", ""), "imbalance": 0.0, "planning": 0.0, **row["breakdown_s"]})
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    return df.loc[df.groupby(["workload", "gpus", "system"]).tokens_per_s.idxmax()].reset_index(drop=True)


def breakdown(recs: Records, gpus: int | None = None, hardware: str | None = None) -> Drawn:
    """Where each system's step goes at one cluster size on one hardware, one panel per workload: mean
    seconds per rank of encoder compute, LLM compute, optimizer, exposed communication, imbalance and idle,
    stacked; a tick marks the idlest rank's idle time (how unevenly ranks idle)."""
    from workloads.conditions import parse_cell

    if not nominal(recs.sims):
        raise PlotInputError("breakdown needs simulation records (omnibench simulate ...); got only runs")
    sims, hw = _hardware_of(nominal(recs.sims), hardware, "breakdown")
    sims = [r for r in sims if not parse_cell(r.workload)] or sims  # the condition grid has its own figure
    df = _best_rows(sims)
    if df.empty:
        raise PlotInputError("breakdown needs simulation records written by this version (rows with breakdown_s) "
                             "that fit; simulate again")
    sizes = sorted(df.gpus.unique())
    # by default the size at which the most workloads have several systems to compare (the smallest of ties)
    cover = df.groupby(["gpus", "workload"]).system.nunique().ge(2).groupby("gpus").sum()
    n = gpus if gpus is not None else min(sizes, key=lambda g: (-cover.get(g, 0), g))
    if n not in sizes:
        raise PlotInputError(f"breakdown: no records at {n} GPUs; records hold {', '.join(map(str, sizes))}")
    df = df[df.gpus == n]
    wls = list(dict.fromkeys(df.workload))
    style.apply_theme()
    cols = min(3, len(wls))
    rows_n = -(-len(wls) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(style.DOUBLE_IN, 0.4 + 1.45 * rows_n), squeeze=False)
    colors = dict(zip([k for k, _ in BREAKDOWN_PARTS], [style.MODULE_COLORS["vision"], style.MODULE_COLORS["llm"],
                                                         "0.55", "0.3", style.IMBALANCE_COLOR, "0.1", "0.85"],
                      strict=True))
    for ax, wl in zip(axes.flat, wls, strict=False):
        g = df[df.workload == wl].set_index("system")
        order = [s for s in style.order_systems(g.index)]
        left = np.zeros(len(order))
        for key, _label in BREAKDOWN_PARTS:
            vals = np.array([g.loc[s, key] for s in order])
            ax.barh(range(len(order)), vals, left=left, color=colors[key], edgecolor="white", linewidth=0.3)
            left += vals
        ax.plot([g.loc[s, "idle_max"] + left[i] - g.loc[s, "idle"] for i, s in enumerate(order)], range(len(order)),
                "|", color="0.1", markersize=7)
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels(order, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(wl, fontsize=8)
        ax.set_xlabel("seconds per step (mean over ranks)", fontsize=7)
    for ax in list(axes.flat)[len(wls):]:
        ax.set_visible(False)
    fig.legend(handles=[Patch(color=colors[k], label=lab) for k, lab in BREAKDOWN_PARTS], loc="lower center",
               ncol=3, fontsize=6, frameon=False)
    title = titled(f"Where the step goes, {n:,} GPUs (simulated)", setup_lines(sims), fig.get_figwidth(), 8)
    _grow_for_title(fig, title, 8)
    fig.set_figheight(fig.get_figheight() + 0.24)  # the legend's second and third rows
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0.42 / fig.get_figheight(), 1, 1))
    table = df[["workload", "system", "layout", "step_time_s", *[k for k, _ in BREAKDOWN_PARTS], "idle_max",
                "idle_min"]].reset_index(drop=True)
    caption = (f"Simulated step at {n:,} GPUs on {hw}, each system's fastest record per workload (over several "
               "steps: the mean step): per rank, the mean seconds "
               "of its own encoder and LLM compute, the optimizer step, communication its compute stream waited "
               "for, imbalance (waiting at a collective for a slower data-parallel peer; 0 in records that predate "
               "it), planning the step waited for (its plan not done under the step before: simulator/planning.py) "
               "and idle time (pipeline bubbles, waiting on the encoder->LLM boundary); the "
               "tick marks where the idlest rank's idle time would end. The parts add up to the step time.")
    return Drawn("breakdown", fig, table, caption)


# -- 3c. where decoupling pays -----------------------------------------------------------------------
def _encoder_share(rec, gpus: int) -> float:
    """Encoder share of the step-0 batch's model FLOPs (costs.batch_flops), for the record's model."""
    from omnibench.specs import costs
    from omnibench.specs.presets import get_model

    batch, _ = stream_of(rec, gpus)
    flops = costs.batch_flops(get_model(str(rec.config.get("model") or "omni-7b")), batch(0).samples)
    total = sum(f.total for f in flops.values())
    return 1.0 - flops["llm"].total / total if total else 0.0


def conditions(recs: Records) -> Drawn:
    """omni over the best baseline on the condition grid (workloads/conditions.py): x the encoder share
    of the step's model FLOPs (measured on step 0's batch), one line per video-length sigma and model,
    one panel per cluster size."""
    from workloads.conditions import parse_cell

    sims = [r for r in nominal(recs.sims) if parse_cell(r.workload)]
    if not sims:
        raise PlotInputError("conditions needs simulations of the condition grid's workloads "
                             "(workloads/conditions.py write_grid; omnibench reproduce makes them)")
    full = throughput_table(Records(sims=sims))
    df = full[full.variant == full.system]
    by_path = {str(r.path): r for r in sims}
    rows = []
    for r in _omni_vs_best(df, ["record", "gpus"]):
        rec, n = by_path[r.pop("record")], int(r.pop("gpus"))
        share, sigma = parse_cell(rec.workload)
        rows.append({"workload": rec.workload, "model": str(rec.config.get("model") or "omni-7b"),
                     "hardware": str(rec.config.get("hardware")), "gpus": n, "video_share": share, "sigma": sigma,
                     "encoder_flop_share": _encoder_share(rec, n), **r})
    if not rows:
        raise PlotInputError("conditions needs omni and at least one baseline simulated on the same grid cell")
    if len({r["hardware"] for r in rows}) > 1:
        raise PlotInputError("conditions: records hold several hardware "
                             f"({', '.join(sorted({r['hardware'] for r in rows}))}); give one's records")
    table = pd.DataFrame(rows).sort_values(["model", "gpus", "sigma", "encoder_flop_share"]).reset_index(drop=True)
    sizes = sorted(table.gpus.unique())
    style.apply_theme()
    fig, axes = plt.subplots(1, len(sizes), figsize=(min(style.DOUBLE_IN, 2.4 * len(sizes) + 0.8), 2.4),
                             squeeze=False, sharey=True)
    markers = dict(zip(sorted(table.model.unique()), "osD^v", strict=False))
    dashes = dict(zip(sorted(table.sigma.unique()), ["-", "--", ":", "-."], strict=False))
    # a spread apart by shade as well as by dash: a legend's short handle shows a dash poorly
    shades = {sg: style.lighten(style.system_color("omni"), 0.5 * i / max(1, len(dashes) - 1))
              for i, sg in enumerate(dashes)}
    for ax, n in zip(axes[0], sizes, strict=True):
        for (model, sigma), g in table[table.gpus == n].groupby(["model", "sigma"]):
            ax.plot(100 * g.encoder_flop_share, g.speedup, linestyle=dashes[sigma], marker=markers[model],
                    markersize=3.5, color=shades[sigma], label=f"{model}, length sigma {sigma:g}")
        ax.axhline(1.0, color="0.4", linewidth=0.7)
        ax.set_title(f"{n:,} GPUs", fontsize=8)
        ax.set_xlabel("encoder share of model FLOPs (%)", fontsize=7)
    axes[0][0].set_ylabel("omni / best baseline", fontsize=7)
    axes[0][-1].legend(fontsize=6, frameon=False, handlelength=3.5)
    title = titled("Where decoupling pays: the condition grid (simulated)", setup_lines(sims), fig.get_figwidth(), 8)
    _grow_for_title(fig, title, 8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    caption = ("Simulated throughput of omni over the fastest baseline on synthetic workloads that move one "
               "condition at a time (workloads/conditions.py): the share of video samples (text-only SFT samples "
               "the rest), which sets the encoder share of the step's FLOPs (x axis, measured on step 0's batch), "
               "and the spread of video durations (lognormal sigma: line style and shade), per model and cluster size; each "
               "system at the layout its record holds." + _convergence_text(sims))
    return Drawn("conditions", fig, table, caption)


def _convergence_text(sims: list) -> str:
    """What the records' tunes say about their own convergence (rows' tune_moved: how far twice the
    budget moved the best step time), for a caption."""
    rows = [r for rec in sims for r in rec.rows if "error" not in r and r.get("tune_budget")]
    if not rows:
        return ""
    budgets = sorted({int(r["tune_budget"]) for r in rows})
    how = f"tuned per cell at a budget of {', '.join(map(str, budgets))} layouts"
    checked = [r for r in rows if r.get("tune_converged") is not None]
    if not checked:
        return f" Every system {how} (convergence not checked)."
    moved = [r["tune_moved"] for r in checked if r.get("tune_moved") is not None]
    worst = f"{max(moved):.1%}" if moved else "-"
    off = [r for r in checked if not r["tune_converged"]]
    if not off:
        return f" Every system {how}; twice the budget moved no best step time by more than 2% (at most {worst})."
    return (f" Every system {how}: NOT converged in {len(off)} of {len(checked)} tunes (twice the budget moved the "
            f"best step time by up to {worst}, over the 2% a converged search allows), so a cell's verdict may move "
            "with a larger budget.")


# -- 3d. how the verdict moves when memory is mispredicted ---------------------------------------------
def memory_sensitivity(recs: Records) -> Drawn:
    """omni over the best baseline against the memory error each simulation decided fits under
    (`simulate --tuned --memory-error E`: every system re-tuned as if each memory estimate were off
    by E), one line per workload and cluster size; the nominal records (E = 0) of the same workload,
    size and hardware are the middle point."""
    varied = {(str(r.config.get("hardware")), r.workload) for r in recs.sims if memory_error(r)}
    if not varied:
        raise PlotInputError("memory needs simulations under a memory error (omnibench simulate --tuned "
                             "--memory-error 0.2 ...; omnibench reproduce makes them)")
    sims = [r for r in recs.sims if (str(r.config.get("hardware")), r.workload) in varied]
    full = throughput_table(Records(sims=sims))
    df = full[full.variant == full.system]
    rows = _omni_vs_best(df, ["hardware", "workload", "gpus", "memory_error"])
    oom: dict[tuple, list[str]] = {}
    for rec in sims:
        for row in rec.rows:
            if "error" not in row and not row.get("fits", False):
                key = (str(rec.config.get("hardware")), rec.workload, int(row["gpus"]), memory_error(rec))
                oom.setdefault(key, []).append(row["system"])
    for r in rows:
        r["gpus"] = int(r["gpus"])
        r["did_not_fit"] = ", ".join(style.order_systems(oom.get((r["hardware"], r["workload"], r["gpus"],
                                                                  r["memory_error"]), [])))
    table = pd.DataFrame(rows)
    if table.empty:
        raise PlotInputError("memory: no workload where omni and a baseline both fit under some memory error")
    # only the (workload, size) pairs simulated under an error: the nominal sweep holds more sizes
    keep = {(r.hardware, r.workload, r.gpus) for r in table.itertuples() if r.memory_error}
    table = table[[(r.hardware, r.workload, r.gpus) in keep for r in table.itertuples()]]
    table = table.sort_values(["hardware", "workload", "gpus", "memory_error"]).reset_index(drop=True)
    style.apply_theme()
    fig, ax = plt.subplots(figsize=(style.COLUMN_IN + 0.9, 2.5))
    lines = list(table.groupby(["hardware", "workload", "gpus"], sort=False))
    palette = style.sns.color_palette("dark", max(3, len(lines)))
    for i, ((hw, wl, n), g) in enumerate(lines):
        ax.plot(100 * g.memory_error, g.speedup, marker="o", markersize=4, color=palette[i],
                label=f"{wl}, {n:,} GPUs" + (f" ({hw})" if table.hardware.nunique() > 1 else ""))
    # Lines close together put their labels on one another: per error, the upper half of the lines'
    # labels stack above the highest point (the highest line's nearest), the lower half below the lowest.
    colour = {key: palette[i] for i, (key, _) in enumerate(lines)}
    stacked = 1
    for e, at in table.groupby("memory_error"):
        at = at.sort_values("speedup", ascending=False)
        up = -(-len(at) // 2)
        stacked = max(stacked, up)
        top, bottom = at.speedup.max(), at.speedup.min()
        for k, r in enumerate(at.itertuples()):
            above = k < up
            ax.annotate(f"{r.speedup:.2f}x\nvs {r.best_baseline}", (100 * e, top if above else bottom), fontsize=5,
                        textcoords="offset points", ha="center", va="bottom" if above else "top",
                        xytext=(0, 5 + 15 * k if above else -6 - 15 * (len(at) - 1 - k)),
                        color=colour[(r.hardware, r.workload, r.gpus)])
    ax.axhline(1.0, color="0.4", linewidth=0.7)
    errs = sorted(table.memory_error.unique())
    span = 100 * max(max(errs) - min(errs), 0.1)
    ax.set_xlim(100 * min(errs) - 0.25 * span, 100 * max(errs) + 0.25 * span)  # the end labels inside the axes
    ax.set_xticks([100 * e for e in errs])
    ax.set_xticklabels([f"{100 * e:+.0f}%" if e else "0 (as estimated)" for e in errs])
    ax.set_xlabel("memory estimate assumed off by (+: each rank needs more)", fontsize=7)
    ax.set_ylabel("omni / best baseline", fontsize=7)
    ax.set_ylim(0, max(1.2, table.speedup.max() * (1.3 + 0.12 * (stacked - 1))))
    ax.legend(fontsize=6, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    hw = ", ".join(sorted(table.hardware.unique()))
    ax.set_title(f"How the verdict moves when memory is mispredicted (simulated, {hw})", fontsize=7.5)
    fig.tight_layout()
    caption = ("omni's throughput over the fastest baseline when every system is tuned again and every step judged "
               "as if each memory estimate were off by the given error (+20%: a rank needs 1.2x the estimate, so "
               "layouts near the device's memory stop fitting; -20%: 0.8x, so more fit), the nominal comparison in "
               "the middle. Over several steps: total tokens over total time, only systems whose kept layout ran "
               "every step compete; the table names the systems that did not fit under each error.")
    return Drawn("memory", fig, table, caption)


# -- 4. timeline -----------------------------------------------------------------------------------
def timeline(rec, system: str | None = None, gpus: int | None = None, step: int | None = None,
             max_ranks: int = 16) -> Drawn:
    df = trace_table(rec, system, gpus, step)
    ranks = sorted(df["rank"].unique())
    # Evenly spaced ranks, not the first few: the first ranks of a big cluster all sit in one pipeline stage.
    shown = [ranks[i] for i in sorted({int(round(x)) for x in np.linspace(0, len(ranks) - 1, max_ranks)})] if len(
        ranks) > max_ranks else ranks
    df = df[df["rank"].isin(shown)]
    style.apply_theme()
    fig, ax = plt.subplots(figsize=(style.DOUBLE_IN, 0.9 + 0.26 * len(shown)))
    scale, unit = (1e3, "ms") if df.start.max() + df.duration.max() < 10 else (1.0, "s")
    lanes = {"compute": (0.0, 0.56), "collective": (0.58, 0.2), "p2p": (0.8, 0.2)}
    spans_drawn = 0
    for row, r in enumerate(shown):
        d = df[df["rank"] == r]
        for (stream, module, backward), g in d.groupby(["stream", "module", d.kind == "backward"]):
            off, h = lanes.get(stream, (0.8, 0.2))
            comm = stream != "compute"
            # forward solid in the module's colour, backward the same hue lightened (and edged darker)
            color = style.lighten(style.module_color(module), 0.5) if backward else style.module_color(module)
            ax.broken_barh(list(zip(g.start * scale, g.duration * scale, strict=True)), (row + off - 0.4, h),
                           facecolors=color, alpha=0.55 if comm else 0.95,
                           hatch="/////" if comm else None, edgecolor=style.module_color(module) if comm or backward
                           else "white", linewidth=0.2 if not backward else 0.5)
            spans_drawn += len(g)
    end = (df.start + df.duration).max() * scale
    ax.set_xlim(0, end * 1.01)
    ax.set_ylim(len(shown) - 0.4, -0.5)
    members = df.groupby("rank").members.first() if "members" in df else None
    ax.set_yticks(range(len(shown)))
    # pipeline stage of each rank's LLM work (runs record it per span; 0 everywhere = no pipeline)
    stages = df[df.module == "llm"].groupby("rank").stage.max() if "stage" in df and df.stage.max() > 0 else None
    ax.set_yticklabels([f"rank {r}" + (f" · stage {int(stages[r])}" if stages is not None and r in stages else "")
                        + (f" (x{int(members[r])})" if members is not None and members[r] > 1 else "")
                        for r in shown])
    ax.set_xlabel(f"time in step ({unit})")
    ax.grid(axis="y", visible=False)
    busy = df[df.stream == "compute"].groupby("rank").duration.sum()
    idle = 1 - busy / (end / scale)
    mods = [m for m in ("vision", "audio", "llm", "all") if m in set(df.module)]
    handles = [Patch(color=style.module_color(m), label="optimizer" if m == "all" else m) for m in mods]
    handles += [Patch(facecolor="0.45", edgecolor="white", label="dark: forward"),
                Patch(facecolor="0.85", edgecolor="0.45", label="light: backward"),
                Patch(facecolor="0.93", edgecolor="0.25", label="solid: compute"),
                Patch(facecolor="white", edgecolor="0.4", hatch="/////", label="hatched: communication"),
                Patch(facecolor="white", edgecolor="white", label="blank: idle (bubble)")]
    legend_rows = -(-len(handles) // 5)
    ax.legend(handles=handles, ncol=min(len(handles), 5), frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              fontsize=6)
    more = f"; {len(shown)} of them shown, evenly spaced" if len(ranks) > len(shown) else ""
    ax.set_title(f"{df.attrs['label']}: mean idle {idle.mean():.0%}{more}", pad=5 + 11 * legend_rows)  # above the legend
    fig.tight_layout()
    table = (df.groupby(["rank", "stream", "module", "kind"], as_index=False)
             .agg(spans=("duration", "size"), busy_s=("duration", "sum")))
    caption = (f"Per-rank timeline of one step ({df.attrs['label']}; from {df.attrs['source']}). Upper lane: "
               "compute; lower lanes: collectives and point-to-point/boundary transfers; colour = module; gaps are "
               "idle time (pipeline bubbles, waits).")
    fig.spans_drawn = spans_drawn  # for tests and the report's table
    return Drawn("timeline", fig, table, caption)


# -- 5. validation ---------------------------------------------------------------------------------
def validation(recs: Records, calibration: str | None = None) -> Drawn:
    """One point per run: datasheet costs (hollow) and, with `calibration`, the calibrated simulator
    (filled); each set's mean absolute error is written on the figure."""
    if recs.sims:
        raise PlotInputError(f"validation compares measured runs with the simulator: {recs.sims[0].path} is a "
                             "simulation record; give run records (omnibench run)")
    if not recs.runs:
        raise PlotInputError("validation needs run records (omnibench run); none given")
    try:
        sets = [("datasheet", validation_table(recs.runs, None))]
        if calibration:
            sets.append(("calibrated", validation_table(recs.runs, calibration)))
    except ValueError as e:
        raise PlotInputError(f"validation: {e}") from None
    table = pd.concat([t.assign(costs=name) for name, t in sets], ignore_index=True)
    style.apply_theme()
    fig, ax = plt.subplots(figsize=(style.COLUMN_IN, 3.5))
    for name, t in sets:
        for s in style.order_systems(t.system.unique()):
            d = t[t.system == s]
            c = style.system_color(s)
            ax.scatter(d.measured_s * 1e3, d.simulated_s * 1e3, s=18, zorder=3, linewidth=0.9 if name == "datasheet"
                       else 0.3, facecolor="none" if name == "datasheet" else c,
                       edgecolor=c if name == "datasheet" else "black", marker="o" if name == "datasheet" else "D",
                       label=s if name == sets[-1][0] else None)
    ms, ss = table.measured_s * 1e3, table.simulated_s * 1e3
    lo, hi = min(ms.min(), ss.min()) * 0.8, max(ms.max(), ss.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.3", linewidth=0.8, linestyle="--", label="simulated = measured")
    if hi / lo > 5:
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda x, _p: f"{x:g}"))
            axis.set_minor_locator(NullLocator())
            axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("simulated step time (ms)")
    prof = sets[-1][1].attrs["calibration"] if calibration else ""
    in_sample = False
    if calibration:
        from simulator.calibrate import Profile

        fitted = {str(Path(p).resolve()) for p in Profile.load(calibration).provenance.get("runs", [])}
        in_sample = any(str(r.path.resolve()) in fitted for r in recs.runs)
    maes = {name: float(t.error.abs().mean()) for name, t in sets}
    text = "\n".join(f"{'o' if n == 'datasheet' else chr(9670)} {n}{' (in-sample)' if n == 'calibrated' and in_sample else ''}"
                     f": MAE {m:.0%}" for n, m in maes.items())
    ax.text(0.04, 0.96, f"{text}\n{len(sets[0][1])} run(s)", transform=ax.transAxes, va="top", fontsize=6.5,
            bbox=dict(boxstyle="round,pad=0.3", facecolor="white", edgecolor="0.7"))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False, fontsize=6, ncol=3)
    ax.set_title("Simulator vs measured runs")
    fig.tight_layout()
    left = sets[0][1].attrs["left_out"]
    caption = ("Median step time per run (first, warm-up, step left out), simulated on the run's own Plans vs "
               "measured; mean absolute error " + ", ".join(f"{n} {m:.1%}" for n, m in maes.items())
               + (f" (calibration profile {prof}{', fitted on these runs: in-sample' if in_sample else ''})"
                  if calibration else " (datasheet costs, no calibration)") + "."
               + (" Not simulated: " + "; ".join(left) + "." if left else ""))
    return Drawn("validation", fig, table.drop(columns=["record"]), caption)


# -- 6. ablation -----------------------------------------------------------------------------------
# The cumulative ablation's steps, in order: (the technique the step switches on, its label). Step 0 is omni's
# decoupled layout with every technique off and the baselines' loading (one global split of the batch by their
# balancer: omni's `loading=global`); each later step keeps the techniques before it; the last one trades the
# global split for loaders rebalancing in groups (the grouped reorder): omni itself.
CUMULATIVE = (("decoupled", "decoupled only"), ("reshard", "+ reshard"), ("long_short_sp", "+ long-short SP"),
              ("joint_pipeline", "+ joint pipeline"), ("llm_long_short", "+ LLM long-short"),
              ("reorder", "+ grouped reorder (omni)"))
TECHNIQUES = tuple(t for t, _ in CUMULATIVE[1:])


def cumulative_off(step: int) -> tuple[str, ...]:
    """The techniques switched off at cumulative step `step` (reorder too until the last: the global split
    stands in for it)."""
    on = set(TECHNIQUES[:step])
    return tuple(t for t in TECHNIQUES if t not in on)


def _loading_of(recs: Records) -> dict[str, str]:
    """record path -> where its omni loaders' shards came from (omni's `loading` option; sampler unless set)."""
    out = {str(r.path): str((r.plan_options or {}).get("loading") or "sampler") for r in recs.runs}
    out.update({str(r.path): str((r.config.get("options") or {}).get("loading") or "sampler") for r in recs.sims})
    return out


def globally_loaded(df: pd.DataFrame, recs: Records) -> pd.Series:
    """Rows of omni whose loaders took one global split (the cumulative ablation's steps before the last)."""
    loading = _loading_of(recs)
    return (df.system == "omni") & (df.record.map(lambda p: loading.get(p, "sampler")) == "global")


def ablation(recs: Records, workload: str | None = None) -> Drawn:
    full = throughput_table(recs)
    full = full[~globally_loaded(full, recs)]  # the cumulative ablation's steps: its own figure
    df = _pick_source(full, "ablation")
    omni = df[df.system == "omni"]
    if omni.empty:
        raise PlotInputError(f"ablation needs omni records (with techniques switched off in its plan options); got "
                             f"{_systems_text(df)}")
    if workload is None:  # only workloads where some technique was switched off can make this figure
        ablated = omni.groupby("workload").variant.nunique()
        omni = omni[omni.workload.isin(ablated[ablated >= 2].index)] if (ablated >= 2).any() else omni
    omni, wl = _one_workload(omni, workload, "ablation")
    groups = []
    for gpus, g in omni.groupby("gpus"):
        variants = g.groupby("variant", as_index=False).tokens_per_s.mean()
        if "omni" in set(variants.variant) and len(variants) >= 2:
            groups.append((gpus, variants))
    if not groups:
        raise PlotInputError(
            f"ablation needs a full omni record and at least one with a technique switched off (a false flag in its "
            f"plan options) at the same cluster size; got {', '.join(sorted(set(omni.variant)))}")
    gpus, variants = max(groups, key=lambda x: (len(x[1]), x[0]))
    ref = float(variants[variants.variant == "omni"].tokens_per_s.iloc[0])
    variants = variants.assign(relative=variants.tokens_per_s / ref)
    order = ["omni"] + sorted(v for v in variants.variant if v != "omni")
    variants = variants.set_index("variant").loc[order].reset_index()
    base = df[(df.workload == wl) & (df.gpus == gpus) & df.system.isin(BASELINES)]
    style.apply_theme()
    fig, ax = plt.subplots(figsize=(style.COLUMN_IN, 1.3 + 0.32 * len(variants)))
    colors = [style.system_color("omni") if v == "omni" else style.lighten(style.system_color("omni"))
              for v in variants.variant]
    bars = ax.barh(range(len(variants)), variants.relative, color=colors, edgecolor="0.3", linewidth=0.4)
    ax.bar_label(bars, labels=[f"{x:.2f}x" for x in variants.relative], fontsize=6, padding=2)
    ax.set_yticks(range(len(variants)))
    ax.set_yticklabels(["omni (all techniques)" if v == "omni" else v.removeprefix("omni ") for v in variants.variant])
    ax.invert_yaxis()
    if not base.empty:
        b = base.groupby("system").tokens_per_s.mean()
        ax.axvline(b.max() / ref, color=style.system_color(b.idxmax()), linestyle="--", linewidth=1,
                   label=f"best baseline ({b.idxmax()})")
        # Below the axes: inside, it would cover the bars' labels.
        fig.legend(loc="lower center", bbox_to_anchor=(0.5, 0.0), fontsize=6, frameon=False)
        variants["best_baseline_relative"] = b.max() / ref
    ax.set_xlabel("throughput rel. to full omni (tokens/s)")
    ax.set_xlim(0, max(variants.relative.max(), variants.get("best_baseline_relative", pd.Series([0])).max()) * 1.18)
    src = "measured" if (df.source == "run").all() else "simulated"
    # Measured runs here are ranks of whatever device ran them (CPU processes on the dev machine).
    scale = f"{gpus:,} {'ranks' if src == 'measured' else 'GPUs'}"
    tuned = [r.config for r in recs.sims if r.workload == wl and r.config.get("tuned")
             and gpus in r.config.get("gpus", [])] if src == "simulated" else []
    ax.set_title(f"omni ablation: {wl}, {scale} ({src})" + (f"\n{tuned_text(tuned[0])}" if tuned else ""), fontsize=7.5)
    fig.tight_layout(rect=(0, 0.07 if not base.empty else 0, 1, 1))
    caption = (f"omni with one technique switched off at a time ({src}, {wl}, {scale}), throughput relative "
               "to omni with every technique on."
               + (" Every variant runs at omni's own tuned layout (tuned with every technique on, at step 0); the "
                  "dashed line is the best baseline at its own tuned layout." if tuned else "") + _cpu_note(recs, omni))
    return Drawn("ablation", fig, variants.assign(workload=wl, gpus=int(gpus)), caption)


def _cumulative_step(options: dict, globally: bool) -> int | None:
    """The cumulative step a record of omni ran (its switches and loading), or None (another variant)."""
    off = tuple(t for t in TECHNIQUES if options.get(t) is False)
    if not globally:
        return len(TECHNIQUES) if not off else None
    return next((k for k in range(len(TECHNIQUES)) if off == cumulative_off(k)), None)


def _like_the_steps(recs: Records) -> Records:
    """The simulations comparable with the cumulative steps': on their machine, under no memory error, every
    system splitting by the steps' balancer (the baselines as deployed, split by tokens, are another
    comparison), and tuned where the steps ran at a tuned layout (each system at its own). Runs as they are."""
    from systems.common import DEFAULT_BALANCER

    def balancer(r) -> str:
        return str((r.config.get("options") or {}).get("balancer") or DEFAULT_BALANCER)

    sims = nominal(recs.sims)
    steps = [r for r in sims if str((r.config.get("options") or {}).get("loading")) == "global"]
    if not steps:
        return Records(runs=recs.runs, sims=sims)
    machines = sorted({str(r.config.get("hardware")) for r in steps})
    if len(machines) > 1:
        raise PlotInputError(f"cumulative ablation: its steps ran on several machines ({', '.join(machines)}); give "
                             "one machine's records (a figure never mixes machines)")
    ways = {balancer(r) for r in steps}
    tuned = all(r.config.get("tuned") for r in steps)
    return Records(runs=recs.runs, sims=[r for r in sims if str(r.config.get("hardware")) == machines[0]
                                         and balancer(r) in ways and (r.config.get("tuned") or not tuned)])


def cumulative_ablation(recs: Records, workload: str | None = None, notes: dict[str, str] | None = None) -> Drawn:
    """omni's techniques added one at a time on its decoupled layout, each step's throughput per GPU over the
    best baseline's at the same size (each system at its own layout; for the baselines' split to be the one
    the first steps' loaders take, the records must weigh samples alike: the default balancer). `notes`:
    why a step has no record (technique name -> e.g. "does not fit: ..."), written where its bar would be."""
    recs = _like_the_steps(recs)
    full = throughput_table(recs)
    df = _pick_source(full, "cumulative ablation")
    df = df.assign(step=[_cumulative_step(o, g) if s == "omni" else None
                         for o, g, s in zip(df.options, globally_loaded(df, recs), df.system, strict=True)])
    notes = {k: v for k, v in (notes or {}).items() if v}
    steps = df[df.step.notna()]
    before_last = steps[steps.step < len(TECHNIQUES)]
    if before_last.empty and not notes:
        raise PlotInputError("cumulative ablation needs omni records with the baselines' loading and techniques "
                             "switched off (`--option loading=global --no-reorder --no-...`); got "
                             + (", ".join(sorted(set(df[df.system == "omni"].variant))) or "no omni record"))
    _, wl = _one_workload(before_last if not before_last.empty else df[df.system == "omni"], workload,
                          "cumulative ablation")
    # the size with the most steps (a step that did not fit has only its note, at the size it was asked for)
    steps = steps[steps.workload == wl]
    gpus = int(steps.groupby("gpus").step.nunique().sort_index().idxmax())
    here = df[(df.workload == wl) & (df.gpus == gpus)]
    base = here[here.system.isin(BASELINES)].groupby("system").tokens_per_s_per_gpu.max()  # each at its best
    if base.empty:
        raise PlotInputError(f"cumulative ablation: no baseline ran {wl} at {gpus:,} GPUs to compare with")
    best, best_tps = str(base.idxmax()), float(base.max())
    ran = here[here.step.notna()]
    got = ran.groupby(ran.step.astype(int)).tokens_per_s_per_gpu.mean()
    rows, prev = [], None
    for k, (tech, label) in enumerate(CUMULATIVE):
        tps = float(got[k]) if k in got.index else None
        note = "" if tps is not None else notes.get(tech) or "not simulated"
        rows.append({"step": label, "technique": tech, "tokens_per_s_per_gpu": tps,
                     "vs_best_baseline": tps / best_tps if tps is not None else None,
                     "vs_previous": tps / prev if tps is not None and prev else None, "best_baseline": best,
                     "best_baseline_tokens_per_s_per_gpu": best_tps, "note": note, "workload": wl, "gpus": gpus})
        prev = tps
    table = pd.DataFrame(rows)

    style.apply_theme()
    fig, ax = plt.subplots(figsize=(style.COLUMN_IN, 1.4 + 0.3 * len(table)))
    omni_color = style.system_color("omni")
    shades = {"decoupled": style.lighten(omni_color, 0.75), "technique": style.lighten(omni_color, 0.4),
              "omni": omni_color}
    kinds = ["decoupled" if k == 0 else "omni" if k == len(CUMULATIVE) - 1 else "technique" for k in range(len(table))]
    rel = table.vs_best_baseline.fillna(0.0)
    ax.barh(range(len(table)), rel, color=[shades[x] for x in kinds], edgecolor="0.3", linewidth=0.4)
    top = max(1.0, float(rel.max()))
    for k, r in table.iterrows():
        if r.vs_best_baseline is None or pd.isna(r.vs_best_baseline):
            # where the bar would be: why there is none (a step whose kept layout stops fitting says so), its
            # first clause (the caption holds the whole note), over the baseline's line
            why = re.split(r" under | \(|; ", r.note)[0]
            ax.text(0.02 * top, k, textwrap.fill(why, 40), va="center", fontsize=5.5, color="0.25", linespacing=1.1,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.6))
            continue
        change = f" ({r.vs_previous - 1:+.1%})" if r.vs_previous is not None and not pd.isna(r.vs_previous) else ""
        # right of the bar and of the baseline's line, which would otherwise run through the text
        ax.text(max(r.vs_best_baseline, 1.0) + 0.04 * top, k, f"{r.vs_best_baseline:.2f}x{change}", va="center",
                fontsize=6, bbox=dict(facecolor="white", edgecolor="none", pad=0.4))
    ax.set_yticks(range(len(table)))
    ax.set_yticklabels(table.step)
    ax.invert_yaxis()
    line = ax.axvline(1.0, color=style.system_color(best), linestyle="--", linewidth=1)
    drawn = [k for k in ("decoupled", "technique", "omni") if k in kinds and table.vs_best_baseline[
        [i for i, x in enumerate(kinds) if x == k]].notna().any()]
    names = {"decoupled": "omni's layout, techniques off, baselines' loading",
             "technique": "+ each technique, keeping those above", "omni": "omni (grouped reorder, no global split)"}
    handles = [Patch(facecolor=shades[k], edgecolor="0.3", linewidth=0.4, label=names[k]) for k in drawn]
    handles.append(line)
    line.set_label(f"best baseline ({best}, its own layout)")
    # Below the axes: inside, the legend would cover the bars' labels.
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), fontsize=6, frameon=False, ncol=1)
    ax.set_xlabel(f"tokens/s per GPU rel. to the best baseline ({best_tps:,.0f})")
    ax.set_xlim(0, top * 1.45)
    src = "measured" if (df.source == "run").all() else "simulated"
    scale = f"{gpus:,} {'ranks' if src == 'measured' else 'GPUs'}"
    tuned = [r.config for r in recs.sims if r.workload == wl and r.config.get("tuned")
             and gpus in r.config.get("gpus", [])] if src == "simulated" else []
    at_size = [r for r in recs.sims if gpus in [int(g) for g in r.config.get("gpus", [])]]
    lines = [f"{wl}, {scale} ({src})", *(setup_lines(at_size, wl) if src == "simulated" else []),
             "omni's layout at every step", "loaders: the baselines' split until the last step"]
    title = titled("omni, techniques added one at a time", lines, style.COLUMN_IN, 7.5)
    ax.set_title(title, fontsize=7.5)
    _grow_for_title(fig, title, 7.5, room=3)
    legend_rows = len(handles)
    fig.tight_layout(rect=(0, 0.035 * legend_rows + 0.02, 1, 1))
    caption = (f"omni's techniques switched on one at a time ({src}, {wl}, {scale}), throughput per GPU relative "
               f"to the best baseline ({best}, {best_tps:,.0f} tokens/s/GPU). The first step is omni's decoupled "
               "layout with every technique off and its loaders handed the split the baselines make of the same "
               "batch (one global split by their balancer, the same weights); each later step keeps the "
               "techniques above it; the last trades the global split for loaders rebalancing in groups of 8 "
               "(the grouped reorder), which is omni."
               + (" Every step runs at omni's own tuned layout (tuned with every technique on); the baselines at "
                  "theirs." if tuned else "")
               + "".join(f" {r.step}: {r.note}." for r in table.itertuples() if r.note) + _cpu_note(recs, here))
    return Drawn("ablation_cumulative", fig, table, caption)


# -- 7. workload -----------------------------------------------------------------------------------
def workload(name: str, steps: int = 200, global_batch_tokens: int = 131072, seed: int = 0) -> Drawn:
    from workloads import WorkloadError, WorkloadStream
    from workloads.sample import MODALITIES
    from workloads.stats import collect, sample_steps, summarize

    try:
        stream = WorkloadStream(name, seed=seed, global_batch_tokens=global_batch_tokens)
        drawn = sample_steps(steps, stream.total_steps)
        rows = collect(stream, drawn)
        summary = summarize(stream, drawn, rows)
    except WorkloadError as e:
        raise PlotInputError(f"workload: {e}") from None
    seg = pd.DataFrame({"modality": np.asarray(MODALITIES, dtype=object)[rows.seg_mod], "llm_tokens": rows.seg_tok,
                        "step": rows.seg_step})
    seg = seg[seg.llm_tokens > 0]
    phase_of = {p["step"]: p["phase"] for p in summary["mix_over_steps"]}
    named = [p["name"] for p in summary["schedule"]["phases"]]
    if not set(phase_of.values()) <= set(named):
        # A changing schedule blends its phases step by step: show the mix in quarters of training instead.
        edges = np.linspace(0, summary["total_steps"], 5).astype(int)
        named = [f"steps {a:,}-{b - 1:,}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
        phase_of = {s: named[min(int(np.searchsorted(edges, s, side="right")) - 1, 3)] for s in phase_of}
    seg["phase"] = seg.step.map(phase_of)
    mods = [m for m in MODALITIES if m in set(seg.modality)]
    style.apply_theme()
    fig, (ax, axp) = plt.subplots(1, 2, figsize=(style.DOUBLE_IN, 2.4), gridspec_kw={"width_ratios": [1.4, 1]})
    for m in mods:
        x = np.sort(seg[seg.modality == m].llm_tokens.to_numpy())
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=style.MODALITY_COLORS[m], linewidth=1.3,
                label=f"{m} (p50 {int(np.median(x)):,})")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_si))
    ax.set_xlabel("LLM tokens per segment (log)")
    ax.set_ylabel("fraction of segments (CDF)")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.legend(loc="lower right", frameon=True)
    ax.set_title("(a) token length per modality")
    phases = [p for p in named if p in set(seg.phase)]
    share = (seg.groupby(["phase", "modality"]).llm_tokens.sum() / seg.groupby("phase").llm_tokens.sum()).unstack(
        fill_value=0.0).reindex(index=phases, columns=mods, fill_value=0.0)
    left = np.zeros(len(phases))
    for m in mods:
        axp.barh(range(len(phases)), share[m], left=left, color=style.MODALITY_COLORS[m], label=m, height=0.7)
        left += share[m].to_numpy()
    axp.set_yticks(range(len(phases)))
    axp.set_yticklabels(phases)
    axp.invert_yaxis()
    axp.set_xlim(0, 1)
    axp.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    axp.set_xlabel("share of LLM tokens")
    axp.grid(axis="y", visible=False)
    axp.set_title(f"(b) mix per phase ({summary['schedule']['kind']} schedule)")
    axp.legend(frameon=False, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"Workload {summary['workload']}: {len(drawn)} steps over {summary['total_steps']:,}, "
                 f"{global_batch_tokens:,} tokens/batch", fontsize=9)
    fig.tight_layout()
    pct = (seg.groupby("modality").llm_tokens.describe(percentiles=[0.1, 0.5, 0.9])
           [["count", "10%", "50%", "90%", "max"]].reindex(mods))
    table = pct.join(share.T.add_prefix("share in ").rename_axis("modality"))
    caption = (f"Workload {summary['workload']} ({summary['description']}): LLM tokens per segment by modality "
               f"(CDF) and the realised share of LLM tokens per modality in each phase of its "
               f"{summary['schedule']['kind']} schedule; seed {seed}, {global_batch_tokens:,} tokens per batch.")
    return Drawn("workload", fig, table.reset_index(), caption)


def record_of(recs: Records, system: str | None):
    """The record a timeline is drawn from: a run of `system` when there is one, else a simulation."""
    runs = [r for r in recs.runs if system in (None, r.system)]
    if runs:
        return runs[0]
    sims = [r for r in recs.sims if system is None or system in r.systems]
    if sims:
        return sims[0]
    have = sorted({r.system for r in recs.runs} | {s for r in recs.sims for s in r.systems})
    raise PlotInputError(f"timeline: no record of system {system!r}; records hold {', '.join(have) or 'none'}")


__all__ = ["CUMULATIVE", "Drawn", "RunRecord", "SimRecord", "ablation", "breakdown", "conditions", "throughput_table",
           "cumulative_ablation", "dynamic", "globally_loaded", "memory_sensitivity", "record_of", "scaling",
           "speedup", "throughput",
           "timeline", "validation", "workload"]


# -- spatial's quota ablation ------------------------------------------------------------------------
def spatial_quota(recs: Records, workload: str = "mixed_video") -> Drawn:
    """spatial at its tuned layout with the quota its tune picked, with a fixed even split and with the
    balancer's per-phase share (`--option quota=...`), beside temporal, whose step it multiplexes."""
    df = throughput_table(recs)
    df = df[(df.source == "sim") & (df.workload == workload)]
    asked = {str(r.path): str((r.config.get("options") or {}).get("quota") or "") for r in recs.sims}
    sp = df[df.system == "spatial"].assign(quota=lambda d: d.record.map(lambda p: asked.get(p, "")))
    tuned = sp[sp.quota == ""]
    if tuned.empty or len(sp) < 2:
        raise PlotInputError(f"spatial_quota needs spatial at its tuned layout on {workload} and at least one record "
                             f"of it with `--option quota=...`; got {len(sp)} spatial row(s)")
    gpus = int(tuned.gpus.iloc[0])
    sp = sp[sp.gpus == gpus]
    ref = float(tuned.tokens_per_s_per_gpu.iloc[0])
    picked = _quota_of(str(tuned.layout.iloc[0]))
    rows = [("searched (its tune's pick: " + picked + ")", ref, str(tuned.layout.iloc[0]))]
    for q in sorted(set(sp.quota) - {""}):
        r = sp[sp.quota == q].iloc[0]
        name = "even split (0.5)" if q == "0.5" else "per-phase balancer share (auto)" if q == "auto" else f"quota {q}"
        rows.append((name, float(r.tokens_per_s_per_gpu), str(r.layout)))
    temporal = df[(df.system == "temporal") & (df.gpus == gpus)]
    table = pd.DataFrame(rows, columns=["variant", "tokens_per_s_per_gpu", "layout"])
    table["relative"] = table.tokens_per_s_per_gpu / ref
    if not temporal.empty:
        table["vs_temporal"] = table.tokens_per_s_per_gpu / float(temporal.tokens_per_s_per_gpu.iloc[0])
    style.apply_theme()
    fig, ax = plt.subplots(figsize=(style.COLUMN_IN, 1.3 + 0.32 * len(table)))
    color = style.system_color("spatial")
    bars = ax.barh(range(len(table)), table.relative, color=[color] + [style.lighten(color)] * (len(table) - 1),
                   edgecolor="0.3", linewidth=0.4)
    ax.bar_label(bars, labels=[f"{x:.2f}x" for x in table.relative], fontsize=6, padding=2)
    ax.set_yticks(range(len(table)))
    ax.set_yticklabels(table.variant)
    ax.invert_yaxis()
    if not temporal.empty:
        t = float(temporal.tokens_per_s_per_gpu.iloc[0]) / ref
        ax.axvline(t, color=style.system_color("temporal"), linestyle="--", linewidth=1, label="temporal, tuned")
        fig.legend(loc="lower center", bbox_to_anchor=(0.5, 0.0), fontsize=6, frameon=False)
    ax.set_xlabel("throughput rel. to spatial as tuned (tokens/s/GPU)")
    ax.set_xlim(0, max(table.relative.max(), table.get("vs_temporal", pd.Series([0])).max()) * 1.2)
    ax.set_title(f"spatial's quota: {workload}, {gpus:,} GPUs (simulated)", fontsize=7.5)
    fig.tight_layout(rect=(0, 0.07 if not temporal.empty else 0, 1, 1))
    caption = (f"spatial at its tuned layout ({workload}, {gpus:,} GPUs, simulated) with the encoders' quota its "
               "tune picked, with a fixed even split, and with each phase's share of the work by the balancer; "
               "the dashed line is temporal at its own tuned layout. The quota model is unmeasured "
               "(simulator/quota.py).")
    return Drawn("spatial_quota", fig, table.assign(workload=workload, gpus=gpus), caption)


def _quota_of(layout: str) -> str:
    """The quota a tuned layout's label names (`q0.3`), or auto."""
    got = [p for p in layout.split() if p.startswith("q") and p[1:2].isdigit()]
    return f"quota {got[0][1:]}" if got else "auto"

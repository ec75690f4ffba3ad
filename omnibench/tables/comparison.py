"""Tables of the tuned comparison `omnibench reproduce --out results` wrote: omni
against the best tuned baseline per workload x cluster size x hardware, where each system's step goes,
the condition grid, the memory sensitivity, omni's ablation, the tunes' convergence and what each stage
of the reproduce took. Every figure is read from the CSVs that command commits beside its figures
(results/figures/<figure>.csv, results/convergence.csv, results/reproduce-stages.csv)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from omnibench.provenance import REPO_ROOT
from omnibench.tables import table

FIGURES = "results/figures"
REPRODUCE = "python -m omnibench reproduce --out results --workers 2"
DYNAMIC = ("bursty_mix", "drifting_video")
BREAKDOWN_PARTS = (("encoder", "encoder"), ("llm", "LLM"), ("optimizer", "optimizer"),
                   ("exposed_comm", "exposed comm"), ("imbalance", "imbalance"), ("idle", "idle"))


def _rows(path: str) -> list[dict]:
    p = REPO_ROOT / path
    if not p.is_file():
        raise FileNotFoundError(f"{path} is missing: `{REPRODUCE}` writes it")
    with open(p, newline="") as f:
        return list(csv.DictReader(f))


AS_DEPLOYED = "speedup_as_deployed.csv"  # omni against the baselines split by token counts


def _speedups(as_deployed: bool = False) -> list[dict]:
    """The speedup figures' rows: full strength (every system split by the analytic estimate), or omni
    against the baselines as deployed."""
    rows = []
    for name in sorted(Path(REPO_ROOT / FIGURES).glob("speedup*.csv")):
        if (name.name == AS_DEPLOYED) == as_deployed:
            rows += _rows(f"{FIGURES}/{name.name}")
    order = {wl: i for i, wl in enumerate(("mixed_video", "long_video", "image_sft", "omni_av", *DYNAMIC))}
    return sorted(rows, key=lambda r: (r["hardware"] != "h100", r["hardware"], order.get(r["workload"], 99),
                                       int(r["gpus"])))


def _layout(text: str) -> str:
    return text.replace("rc-", "recompute ").strip() or "-"


def _strongest() -> list[dict]:
    """Per full-strength cell, omni against the stronger of the two ways the baselines can split a batch:
    the row of whichever best baseline (analytic split, or split by tokens) is faster, with its speedup."""
    deployed = {(r["workload"], r["hardware"], r["gpus"]): r for r in _speedups(as_deployed=True)}
    out = []
    for r in _speedups():
        d = deployed.get((r["workload"], r["hardware"], r["gpus"]))
        tokens_faster = d is not None and float(d["best_baseline_tokens_per_s_per_gpu"]) > float(
            r["best_baseline_tokens_per_s_per_gpu"])
        out.append({**r, **({k: d[k] for k in ("best_baseline", "best_baseline_tokens_per_s_per_gpu",
                                                  "best_baseline_layout", "speedup")} if tokens_faster else {}),
                    "split": "tokens" if tokens_faster else "analytic", "deployed": d})
    return out


@table("tuned-comparison")
def tuned_comparison() -> str:
    """omni over the best tuned baseline, per workload x cluster size x hardware: against the baselines
    splitting by the analytic estimate (every system's default), by tokens (as deployed), and the stronger."""
    lines = ["| workload | hardware | GPUs | omni tokens/s/GPU (layout) | best baseline, analytic split: tokens/s/GPU "
             "(layout), omni / it | best baseline split by tokens: tokens/s/GPU, omni / it | "
             "omni / the stronger |", "|---|---|---|---|---|---|---|"]
    for r, full in zip(_strongest(), _speedups(), strict=True):
        steps = int(r["steps"])
        wl = r["workload"] + (f" ({steps} steps)" if steps > 1 else "")
        d = r["deployed"]
        as_dep = (f"{d['best_baseline']} {float(d['best_baseline_tokens_per_s_per_gpu']):,.0f}, "
                  f"{float(d['speedup']):.2f}x" if d else "not simulated")
        lines.append(f"| {wl} | {r['hardware'].upper()} | {int(r['gpus']):,} | "
                     f"{float(r['omni_tokens_per_s_per_gpu']):,.0f} ({_layout(r['omni_layout'])}) | "
                     f"{full['best_baseline']} {float(full['best_baseline_tokens_per_s_per_gpu']):,.0f} "
                     f"({_layout(full['best_baseline_layout'])}), {float(full['speedup']):.2f}x | {as_dep} | "
                     f"**{float(r['speedup']):.2f}x**{'' if d else ' (analytic only)'} |")
    lines += ["", f"`{REPRODUCE}` (results/figures/speedup*.csv; the cells its default plan leaves out for time, "
              "4,096 GPUs, 8,192 beyond mixed_video and H200s beyond mixed_video and image_sft: `--extended`, or "
              "`--resume --extended` after it). Every system at its own layout, tuned once with every system "
              "splitting its batches by the analytic FLOP estimate (`--option balancer=analytic`, the default; omni "
              "too, never the simulator's own costs) on step 0's batch (the dynamic workloads: on their calmest, "
              "median and burstiest steps) and kept; the baselines then also split by token counts "
              "(`--option balancer=tokens`, as Megatron-LM and VeOmni deploy) at the same layouts, where the 1,024 "
              "H100 stages ran it. The last column takes, per cell, whichever baseline is faster either way; over "
              "several steps, total tokens over total time, and only a system whose kept layout ran every step "
              "competes."]
    return "\n".join(lines)


@table("tuned-comparison-range")
def tuned_comparison_range() -> str:
    """One line: omni over the stronger tuned baseline on the static mixes and on each dynamic one, then
    against the baselines split by the analytic estimate and by tokens."""
    out = "against the stronger baseline per cell (its better split): " + _range(_strongest())
    out += "; against the baselines splitting by the analytic estimate: " + _range(_speedups())
    deployed = _speedups(as_deployed=True)
    out += "; split by tokens (as deployed): " + _range(deployed) if deployed else ""
    apart = _without("spatial")
    return out + (f"; without spatial, whose quota model no GPU has measured (against the other four baselines, "
                  f"analytic split): {_range(apart)}" if apart else "")


def _without(system: str) -> list[dict]:
    """Per cell of the throughput figures (each system at its tuned layout, analytic split), omni over the
    fastest baseline other than `system`, as speedup rows."""
    out = []
    for name, hardware in (("throughput.csv", "h100"), ("throughput_h200.csv", "h200")):
        if not (REPO_ROOT / FIGURES / name).is_file():
            continue
        cells: dict[tuple, dict] = {}
        for r in _rows(f"{FIGURES}/{name}"):
            cells.setdefault((r["workload"], r["gpus"]), {})[r["system"]] = float(r["tokens_per_s_per_gpu"])
        for (wl, gpus), tps in cells.items():
            rest = [v for s, v in tps.items() if s not in ("omni", system)]
            if "omni" in tps and rest:
                out.append({"workload": wl, "gpus": gpus, "hardware": hardware, "speedup": tps["omni"] / max(rest)})
    return out


def _range(rows: list[dict]) -> str:
    static = [float(r["speedup"]) for r in rows if r["workload"] not in DYNAMIC]
    parts = [f"{min(static):.2f}-{max(static):.2f}x on the static mixes ({len(static)} cells, "
             f"{', '.join(sorted({r['hardware'].upper() for r in rows if r['workload'] not in DYNAMIC}))})"]
    for wl in DYNAMIC:
        got = [float(r["speedup"]) for r in rows if r["workload"] == wl]
        if got:
            lo, hi = f"{min(got):.2f}", f"{max(got):.2f}"
            parts.append(f"{lo}x on {wl}" if lo == hi else f"{lo}-{hi}x on {wl}")
    return "; ".join(parts)


@table("tuned-explanation")
def tuned_explanation() -> str:
    """Per full-strength cell, what omni's plan decided and where omni's and the best baseline's steps go:
    the explanation of each cell, read from the simulations' own rows."""
    lines = ["| workload | GPUs | omni / best | what omni's plan did | bubble omni / best | exposed comm omni / best "
             "| imbalance omni / best |", "|---|---|---|---|---|---|---|"]

    def pct(r: dict, key: str) -> str:
        v = r.get(key)
        return f"{100 * float(v):.1f}%" if v not in (None, "") else "-"

    for r in _speedups():
        if r["hardware"] != "h100" or "omni_plan" not in r:
            continue
        lines.append(f"| {r['workload']} | {int(r['gpus']):,} | {float(r['speedup']):.2f}x vs {r['best_baseline']} | "
                     f"{r['omni_plan'] or '-'} | "
                     + " | ".join(f"{pct(r, 'omni_' + p)} / {pct(r, 'best_baseline_' + p)}"
                                  for p in ("bubble", "exposed_comm", "imbalance")) + " |")
    lines += ["", "Shares of each system's step time (waiting for a slower peer is imbalance, not communication); "
              "omni's plan as its first simulated step decided it (systems/common.py `plan_summary`). "
              f"From `{REPRODUCE}` (results/figures/speedup.csv)."]
    return "\n".join(lines)


def _breakdown_size(best: dict, rows: list[dict]) -> int:
    """The cluster size of results/figures/breakdown.csv (its rows name no size): the smallest at which one of
    its workloads has a comparison. The figures at other sizes are breakdown_<gpus>.csv."""
    sizes = sorted({n for (_, n) in best})
    return next((g for g in sizes if any(k == (r["workload"], g) for r in rows for k in best)), sizes[0])


@table("tuned-breakdown")
def tuned_breakdown() -> str:
    """Where omni's and the best baseline's step goes, per workload, at the breakdown figure's size."""
    best = {(r["workload"], int(r["gpus"])): r["best_baseline"] for r in _speedups() if r["hardware"] == "h100"}
    rows = _rows(f"{FIGURES}/breakdown.csv")
    n = _breakdown_size(best, rows)
    lines = ["| workload | system | layout | step s | " + " | ".join(lab for _, lab in BREAKDOWN_PARTS) + " |",
             "|---|---|---|---|" + "---|" * len(BREAKDOWN_PARTS)]
    for r in rows:
        if r["system"] not in ("omni", best.get((r["workload"], n))):
            continue
        step = float(r["step_time_s"])
        parts = " | ".join(f"{float(r.get(k) or 0.0) / step:.0%}" for k, _ in BREAKDOWN_PARTS)
        lines.append(f"| {r['workload']} | {r['system']} | {_layout(r['layout'])} | {step:.2f} | {parts} |")
    lines += ["", f"Share of the step per rank (mean over ranks), {n:,} H100s, omni and the best baseline of each "
              "workload (results/figures/breakdown.csv; every system is in the figure)."]
    return "\n".join(lines)


@table("tuned-breakdown-scale")
def tuned_breakdown_scale() -> str:
    """How omni's and the best baseline's step time and exposed communication move with the cluster, per
    workload simulated at several sizes (results/figures/breakdown*.csv, one per size)."""
    best = {(r["workload"], int(r["gpus"])): r["best_baseline"] for r in _speedups() if r["hardware"] == "h100"}
    at: dict[tuple[str, str, int], dict] = {}
    for path in sorted(Path(REPO_ROOT / FIGURES).glob("breakdown*.csv")):
        rows = _rows(f"{FIGURES}/{path.name}")
        tail = path.stem.removeprefix("breakdown").lstrip("_")
        n = int(tail) if tail else _breakdown_size(best, rows)
        for r in rows:
            at[(r["workload"], r["system"], n)] = r
    sizes = sorted({n for (_, _, n) in at})
    lines = ["| workload | system | " + " | ".join(f"{n:,} GPUs: step s (exposed comm s)" for n in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for wl in dict.fromkeys(w for (w, _, _) in sorted(at, key=lambda k: k[2])):
        have = [n for n in sizes if (wl, "omni", n) in at]
        if len(have) < 2:
            continue
        for system in ("omni", *dict.fromkeys(best[(wl, n)] for n in have if (wl, n) in best)):
            cells = [f"{float(at[k]['step_time_s']):.3f} ({float(at[k]['exposed_comm']):.3f})"
                     if (k := (wl, system, n)) in at else "-" for n in sizes]
            lines.append(f"| {wl} | {system} | " + " | ".join(cells) + " |")
    lines += ["", "H100s, each system at its own tuned layout (the tables above); exposed communication: mean seconds "
              "per rank (results/figures/breakdown*.csv, one per size, written by `reproduce`; 4,096 and 8,192 beyond "
              "mixed_video by `--extended`)."]
    return "\n".join(lines)


@table("memory-sensitivity")
def memory_sensitivity() -> str:
    """omni over the best baseline when every memory estimate is assumed off by -20%, 0, +20%."""
    lines = ["| workload | GPUs | memory estimate | omni / best | best baseline | did not fit |", "|---|---|---|---|---|---|"]
    for r in _rows(f"{FIGURES}/memory.csv"):
        e = float(r["memory_error"])
        what = "as estimated" if not e else f"{abs(e):.0%} {'low' if e > 0 else 'high'}"
        lines.append(f"| {r['workload']} | {int(r['gpus']):,} | {what} | **{float(r['speedup']):.2f}x** | "
                     f"{r['best_baseline']} | {r['did_not_fit'] or '-'} |")
    lines += ["", "Every system tuned again under each error (`simulate --tuned --memory-error E`: a layout fits "
              "if (1 + E) x its estimated peak fits the GPU), results/figures/memory.csv."]
    return "\n".join(lines)


@table("conditions")
def conditions() -> str:
    """The condition grid: omni over the best baseline per model, length spread and video share."""
    rows = _rows(f"{FIGURES}/conditions.csv")
    lines = ["| model | GPUs | video length sigma | video share | encoder FLOP share | omni / best | best baseline |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], int(r["gpus"]), float(r["sigma"]), float(r["video_share"]))):
        lines.append(f"| {r['model']} | {int(r['gpus']):,} | {float(r['sigma']):g} | {float(r['video_share']):.0%} | "
                     f"{float(r['encoder_flop_share']):.0%} | **{float(r['speedup']):.2f}x** | {r['best_baseline']} |")
    lines += ["", "Synthetic workloads (workloads/conditions.py): video samples (lognormal durations, median 20 s) "
              "among text-only SFT samples; every system tuned per cell (results/figures/conditions.csv)."]
    return "\n".join(lines)


def _num(text: str) -> float | None:
    return float(text) if text not in ("", None) else None


@table("tuned-ablation")
def tuned_ablation() -> str:
    """omni's techniques added one at a time on its decoupled layout (which starts with the baselines'
    loading), then omni with one technique off at a time; both at its own tuned layout."""
    steps = _rows(f"{FIGURES}/ablation_cumulative.csv")
    s0 = steps[0]
    best, best_tps = s0["best_baseline"], float(s0["best_baseline_tokens_per_s_per_gpu"])
    lines = [f"| omni, techniques added one at a time | tokens/s/GPU | vs the best baseline ({best}) | "
             "vs the step before |", "|---|---|---|---|"]
    for r in steps:
        tps, rel, prev = _num(r["tokens_per_s_per_gpu"]), _num(r["vs_best_baseline"]), _num(r["vs_previous"])
        if tps is None:
            lines.append(f"| {r['step']} | {r['note'] or 'not simulated'} | | |")
            continue
        lines.append(f"| {r['step']} | {tps:,.0f} | {rel:.2f}x | {f'{prev - 1:+.1%}' if prev is not None else ''} |")
    lines.append(f"| the best baseline: {best}, at its own tuned layout | {best_tps:,.0f} | 1.00x | |")
    lines += ["", f"{s0['workload']}, {int(s0['gpus']):,} H100s, every step at omni's tuned layout from the tune "
              "cache (results/figures/ablation_cumulative.csv). The first step is omni's decoupled layout with "
              "every technique off and its loaders given the split the baselines make of the same batch (one "
              "global split by their balancer: `--option loading=global`); each step keeps the techniques above "
              "it; the last trades the global split for loaders that rebalance in groups of 8 (the grouped "
              "reorder), which is omni.", ""]
    rows = _rows(f"{FIGURES}/ablation.csv")
    lines += ["| omni, one technique off | throughput vs all techniques |", "|---|---|"]
    for r in rows:
        name = "all techniques" if r["variant"] == "omni" else r["variant"].removeprefix("omni ")
        lines.append(f"| {name} | {float(r['relative']):.2f}x |")
    for r in _rows("results/reproduce-stages.csv"):  # a switch whose layout stopped fitting has no bar
        if r["stage"].startswith("tuned-omni-no-") and r.get("note"):
            tech = r["stage"].removeprefix("tuned-omni-no-").rsplit("-", 1)[0].replace("-", " ")
            lines.append(f"| w/o {tech} | does not fit ({r['note'].removeprefix('does not fit: ')}) |")
    lines.append(f"| the best baseline | {float(rows[0]['best_baseline_relative']):.2f}x |")
    lines += ["", f"{rows[0]['workload']}, {int(rows[0]['gpus']):,} H100s, omni's tuned layout from the tune cache, "
              "its loaders on the sampler's shards (results/figures/ablation.csv)."]
    return "\n".join(lines)


@table("tuned-ablation-summary")
def tuned_ablation_summary() -> str:
    """One line: each cumulative step of omni's ablation against the best baseline (ablation_cumulative.csv)."""
    steps = _rows(f"{FIGURES}/ablation_cumulative.csv")
    s0 = steps[0]
    parts = [f"{r['step']} {float(r['vs_best_baseline']):.2f}x" if _num(r["vs_best_baseline"]) is not None
             else f"{r['step']}: {(r['note'] or 'not simulated').split(':')[0]}" for r in steps]
    return (f"against the best baseline ({s0['best_baseline']} at its own tuned layout; {s0['workload']}, "
            f"{int(s0['gpus']):,} H100s, omni's tuned layout): " + "; ".join(parts))


@table("spatial-quota")
def spatial_quota() -> str:
    """spatial's quota ablation: its tuned layout with the quota its tune picked, an even split and the
    balancer's per-phase share, against temporal (results/figures/spatial_quota.csv)."""
    rows = _rows(f"{FIGURES}/spatial_quota.csv")
    r0 = rows[0]
    lines = ["| spatial's quota | tokens/s/GPU | vs spatial as tuned | vs temporal (tuned) |", "|---|---|---|---|"]
    for r in rows:
        vs = _num(r.get("vs_temporal"))
        lines.append(f"| {r['variant']} | {float(r['tokens_per_s_per_gpu']):,.0f} | {float(r['relative']):.2f}x | "
                     f"{f'{vs:.2f}x' if vs is not None else '-'} |")
    lines += ["", f"{r0['workload']}, {int(r0['gpus']):,} H100s, spatial's tuned layout ({_layout(r0['layout'])}) from "
              "the tune cache, its quota set with `--option quota=...` (results/figures/spatial_quota.csv). The quota "
              "model these rest on is unmeasured (simulator/quota.py)."]
    return "\n".join(lines)


@table("tune-convergence")
def tune_convergence() -> str:
    """One line: how many tunes moved their best step time by <= 2% at twice the budget."""
    rows = _rows("results/convergence.csv")
    ok = [r for r in rows if r["converged"] == "True"]
    moved = [(float(r["moved"]), r) for r in rows if r["moved"]]
    worst, w = max(moved, key=lambda x: x[0])
    budgets = sorted({int(r["budget"]) for r in rows})
    # seeded tunes (tune.Seed): how many found nothing faster than a layout that won elsewhere
    seeded = [r for r in rows if r.get("over_seeds")]
    is_seed = [r for r in seeded if float(r["over_seeds"]) <= 0]
    seeds = (f"; {len(seeded)} were seeded with the layouts earlier tunes found, and in {len(is_seed)} of them the "
             "answer is a seed (the search found nothing faster)") if seeded else ""
    return (f"{len(ok)} of {len(rows)} tunes converged (twice the budget, {'/'.join(map(str, budgets))} layouts, "
            f"moved the best step time by <= 2%); the worst moved {worst:.1%} ({w['system']}, {w['workload']}, "
            f"{int(w['gpus']):,} {w['hardware'].upper()}s{', ' + w['model'] if w['model'] != 'omni-7b' else ''})"
            + seeds)


_GROUPS = (("run-", "CPU runs (2 ranks, tiny model)"), ("calibrate", "calibrate"), ("sim-", "one-layout simulations"),
           ("tuned-omni-no-", "omni's ablation"), ("omni-cumulative-", "omni's cumulative ablation"),
           ("tuned-", "tuned comparison, 1,024 H100s"),
           ("memory-", "memory errors"), ("conditions-", "condition grid"), ("largest-", "largest clusters"))


@table("reproduce-stages")
def reproduce_stages() -> str:
    """The reproduce's stage times, grouped (results/reproduce-stages.csv)."""
    rows = _rows("results/reproduce-stages.csv")
    groups: dict[str, list[float]] = {}
    for r in rows:
        key = r["stage"]
        name = next((lab for pre, lab in _GROUPS if key.startswith(pre)), key)
        if key.startswith("tuned-") and "-h200-" in key:
            name = "tuned comparison, 1,024 H200s"
        elif key.startswith("largest-"):  # largest-<workload>-<gpus>-<budget>
            name = f"{int(key.split('-')[2]):,} H100s: {key.split('-')[1]}"
        elif key.startswith("tuned-") and not key.startswith("tuned-omni-no-"):
            name = f"{name}: {key.split('-')[1]}"
        elif key.startswith("extended-"):  # extended-<workload>-<gpus>-<hardware>-<budget>
            _, wl, n, hw, _ = key.split("-")
            name = f"--extended: {wl}, {int(n):,} {hw.upper()}s"
        groups.setdefault(name, []).append(float(r["seconds"]))
    lines = ["| stage | commands | seconds |", "|---|---|---|"]
    for name, secs in groups.items():
        lines.append(f"| {name} | {len(secs)} | {sum(secs):,.0f} |")
    default = [float(r["seconds"]) for r in rows if not r["stage"].startswith("extended-")]
    extended = [float(r["seconds"]) for r in rows if r["stage"].startswith("extended-")]
    total = sum(default)
    lines.append(f"| **all stages{' of the default plan' if extended else ''}** | {len(default)} | **{total:,.0f}** "
                 f"({total / 60:.1f} min) |")
    if extended:
        lines.append(f"| **--extended stages** | {len(extended)} | **{sum(extended):,.0f}** "
                     f"({sum(extended) / 60:.1f} min) |")
    return "\n".join(lines)


TIME_FILE = "results/reproduce-time.txt"  # `/usr/bin/time -v` of that reproduce, then the load averages seen


def _timed() -> dict:
    """Wall and CPU seconds of the committed reproduce, summed over its parts (one GNU `time -v` report
    each: a reproduce stopped and continued with --resume), and the 1-minute load averages sampled
    while it ran (lines `HH:MM:SS l1 l5 l15`)."""
    p = REPO_ROOT / TIME_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{TIME_FILE} is missing: the GNU time report of `/usr/bin/time -v {REPRODUCE}`")
    got: dict = {"load": [], "user": 0.0, "sys": 0.0, "wall": 0.0, "parts": 0}
    for line in p.read_text().splitlines():
        key, _, value = line.strip().partition(": ")
        if key == "User time (seconds)":
            got["user"] += float(value)
        elif key == "System time (seconds)":
            got["sys"] += float(value)
        elif key.startswith("Elapsed (wall clock) time"):
            parts = [float(x) for x in line.rsplit(": ", 1)[1].split(":")]
            got["wall"] += sum(x * 60 ** i for i, x in enumerate(reversed(parts)))
            got["parts"] += 1
        elif key == "Exit status":
            got["exit"] = int(value)  # the last part's
        elif len(line.split()) == 4 and line[2:3] == ":" and line[5:6] == ":":
            got["load"].append(float(line.split()[1]))
    return got


def _min(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


@table("reproduce-total")
def reproduce_total() -> str:
    """One line: the reproduce's wall and CPU time, the load it ran under, and CPU / 2."""
    t = _timed()
    cpu = t["user"] + t["sys"]
    load = t["load"]
    parts = f" over {t['parts']} parts (continued with --resume)" if t["parts"] > 1 else ""
    seen = (f"1-minute load average {min(load):.1f}-{max(load):.1f} (mean {sum(load) / len(load):.1f})" if len(load) > 1
            else f"1-minute load average {load[0]:.1f} (one reading)" if load else "load not sampled")
    return (f"{_min(t['wall'])} wall{parts}, {_min(cpu)} CPU (user + sys; CPU / 2 = {_min(cpu / 2)}, the bound on "
            f"2 quiet cores), {seen} on the 2 cores, last exit status {t['exit']}")


def _cells() -> dict[tuple, dict[str, float]]:
    """(workload, GPUs, hardware) -> system -> tokens/s/GPU at its tuned layout (analytic split)."""
    cells: dict[tuple, dict[str, float]] = {}
    for name, hardware in (("throughput.csv", "h100"), ("throughput_h200.csv", "h200")):
        if (REPO_ROOT / FIGURES / name).is_file():
            for r in _rows(f"{FIGURES}/{name}"):
                cells.setdefault((r["workload"], int(r["gpus"]), hardware), {})[r["system"]] = float(
                    r["tokens_per_s_per_gpu"])
    return cells


def _cell_name(wl: str, gpus: int, hardware: str) -> str:
    return wl + ("" if (gpus, hardware) == (1024, "h100") else f" ({gpus:,} {hardware.upper()}s)")


@table("omni-over-temporal")
def omni_over_temporal() -> str:
    """One line: omni over temporal (the VeOmni-style baseline) per cell of the tuned comparison."""
    parts = [f"{_cell_name(*k)} {v['omni'] / v['temporal']:.2f}x" for k, v in _cells().items()
             if "omni" in v and "temporal" in v]
    return ", ".join(parts) + " (omni / temporal, each at its tuned layout, analytic split)"


@table("spatial-over-temporal")
def spatial_over_temporal() -> str:
    """One line: how much faster spatial is than temporal where spatial is the fastest baseline."""
    gains = [v["spatial"] / v["temporal"] - 1 for v in _cells().values()
             if "spatial" in v and "temporal" in v
             and v["spatial"] == max(x for s, x in v.items() if s != "omni")]
    if not gains:
        return "spatial is the fastest baseline in no cell (analytic split)"
    return (f"{min(gains):.1%} to {max(gains):.1%} faster than temporal in the {len(gains)} cells where it is the "
            "fastest baseline (analytic split)")


ADVERSARIAL = "results/adversarial.md"


@table("adversarial-summary")
def adversarial_summary() -> str:
    """One line: of the (cell, baseline) pairs `benchmarks/adversarial_baselines.py` tried (static, then the
    dynamic cells over their windows), how many have a neighbour faster than the tuned layout by more than
    its margin, and which."""
    p = REPO_ROOT / ADVERSARIAL
    if not p.is_file():
        raise FileNotFoundError(f"{ADVERSARIAL} is missing: `python benchmarks/adversarial_baselines.py` writes it")
    text = p.read_text()
    static, _, dynamic = text.partition("## The dynamic cells")
    out = []
    for name, part in (("static", static), ("dynamic", dynamic)):
        rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in part.splitlines()
                if re.match(r"\| [a-z_]+ \| [0-9,]+ \|", ln)]
        if not rows:
            continue
        beaten = [r for r in rows if r[-1] != "none"]
        said = (f"none of the {len(rows)} {name} (cell, baseline) pairs has a neighbour faster by more than 1%"
                if not beaten else f"{len(beaten)} of {len(rows)} {name} pairs have one: "
                + ", ".join(f"{r[2]} on {r[0]} ({r[-1]})" for r in beaten))
        out.append(said)
    return "; ".join(out)


REGIMES = "results/regimes/grid.md"


@table("regime-grid")
def regime_grid() -> str:
    """The cells `benchmarks/regime_grid.py` simulated (results/regimes/grid.md, from its grid.json)."""
    p = REPO_ROOT / REGIMES
    if not p.is_file():
        raise FileNotFoundError(f"{REGIMES} is missing: `python benchmarks/regime_grid.py` writes it")
    return p.read_text().strip()

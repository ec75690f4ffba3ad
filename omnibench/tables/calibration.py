"""Tables of the CPU calibration (results/calibration/cpu-gloo-2rank*.json against the committed runs
they were fitted on) and of the published A100 rows (results/validation/megatron_a100.csv)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from omnibench.provenance import REPO_ROOT
from omnibench.tables import table

CPU_RUNS = "results/calibration/cpu-gloo-2rank-runs"
CPU_PROFILES = ("cpu-gloo-2rank.json", "cpu-gloo-2rank-fit-baselines.json", "cpu-gloo-2rank-fit-no-image_sft.json")
A100_CSV = "results/validation/megatron_a100.csv"
# Rows whose figures no stored copy of their source confirms (results/validation/README.md).
A100_UNVERIFIED_SOURCES = ("korthikanti2022-table4",)


def _cpu_runs() -> list[Path]:
    return sorted(p.parent for p in (REPO_ROOT / CPU_RUNS).glob("*-*/config.json"))


@lru_cache(maxsize=len(CPU_PROFILES))
def _cpu_validation(profile: str) -> tuple[list, set[str]]:
    from simulator.calibrate import Profile, validate

    prof = Profile.load(REPO_ROOT / "results/calibration" / profile)
    runs = _cpu_runs()
    fitted = {str(Path(p).resolve()) for p in prof.provenance.get("runs", [])}
    return validate([str(r) for r in runs], prof), {str(r.resolve()) for r in runs if str(r.resolve()) in fitted}


def _held_out_what(held: list[str], fitted: list[str]) -> str:
    """What sets the held-out runs apart, in words: the systems or workloads no fitted run has."""
    def parts(names, i):
        return {n.split("-", 1)[i] if "-" in n else n for n in names}

    systems = sorted(parts(held, 0) - parts(fitted, 0))
    workloads = sorted({n.rsplit("-", 1)[-1] for n in held} - {n.rsplit("-", 1)[-1] for n in fitted})
    if systems:
        return f"system{'s' if len(systems) > 1 else ''} {', '.join(systems)}"
    if workloads:
        return f"workload{'s' if len(workloads) > 1 else ''} {', '.join(workloads)}"
    return "runs"


def _cpu_rows() -> list[dict]:
    out = []
    for profile in CPU_PROFILES:
        vals, fitted = _cpu_validation(profile)
        ins = [v for v in vals if str(Path(v.run).resolve()) in fitted]
        held = [v for v in vals if str(Path(v.run).resolve()) not in fitted]
        name = [Path(v.run).name for v in ins]
        out.append({
            "profile": profile, "fitted": len(ins), "held": len(held),
            "what": _held_out_what([Path(v.run).name for v in held], name) if held else "",
            "in_mae": sum(abs(v.error) for v in ins) / len(ins),
            "held_mae": sum(abs(v.error) for v in held) / len(held) if held else None,
        })
    return out


@table("cpu-calibration")
def cpu_calibration() -> str:
    """The CPU profiles, each validated on all committed CPU runs, in-sample and held out."""
    lines = ["| profile | fitted on | in-sample MAE | held out | held-out MAE |", "|---|---|---|---|---|"]
    for r in _cpu_rows():
        lines.append(f"| `{r['profile']}` | {r['fitted']} runs | {r['in_mae']:.1%} | "
                     + (f"{r['what']} ({r['held']} runs) | {r['held_mae']:.1%} |" if r["held"] else "- | - |"))
    lines += ["", f"MAE: mean \\|step-time error\\| of `omnibench validate {CPU_RUNS}/*-* --calibration "
              "results/calibration/PROFILE` (median step of the steps after the first, each run's own Plans); "
              "the held-out runs were named before fitting (the `calibrate` commands above)."]
    return "\n".join(lines)


@table("cpu-calibration-summary")
def cpu_calibration_summary() -> str:
    """One line: the CPU profiles' in-sample and held-out error."""
    rows = _cpu_rows()
    held = [f"{r['held_mae']:.1%} held-out {r['what'].split(' ')[0]}" for r in rows if r["held"]]
    return f"{rows[0]['in_mae']:.1%} in-sample, " + ", ".join(held)


@lru_cache(maxsize=1)
def _a100() -> list:
    from simulator.published import check_row, load_published

    return [check_row(r) for r in load_published(REPO_ROOT / A100_CSV)]


def _verified(check) -> bool:
    return check.row.source not in A100_UNVERIFIED_SOURCES


@table("a100-published", slow=True)
def a100_published() -> str:
    """The published Megatron-LM A100 rows, simulated."""
    rows = _a100()
    lines = ["| row | source | figures checked | GPUs | tp/pp | published s | simulated s | error | simulated GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        r = c.row
        lines.append(f"| {r.name} | {r.source} | {'yes' if _verified(c) else 'no'} | {r.gpus} | {r.tp}/{r.pp} | "
                     f"{c.measured_s:.3f} | {c.simulated_s:.3f} | {c.error:+.1%} | {c.peak_memory_gib:.0f} |")
    lines += ["", f"`omnibench validate --published {A100_CSV}`: {a100_published_summary()}. Not held out: the "
              "kernel profile `a100-published` and the micro batch of 4 the Narayanan rows do not publish were "
              "settled with these rows in view; the rows not checked are out of every other validation set "
              "(results/validation/README.md)."]
    return "\n".join(lines)


@table("a100-published-summary", slow=True)
def a100_published_summary() -> str:
    """One line: the A100 rows' error, rows whose figures were checked apart from the others."""
    rows = _a100()
    ok = [c for c in rows if _verified(c)]
    other = [c for c in rows if not _verified(c)]

    def mae(cs):
        return sum(abs(c.error) for c in cs) / len(cs)

    worst = max(ok, key=lambda c: abs(c.error))
    text = (f"mean \\|error\\| {mae(ok):.1%} (worst {worst.error:+.1%}) over the {len(ok)} rows whose published "
            "figures were checked")
    if other:
        text += f", {mae(other):.1%} over {len(other)} rows not checked against their source"
    return text

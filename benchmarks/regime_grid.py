"""Where decoupling pays: omni against the best tuned baseline over model size and cluster size.

    python benchmarks/regime_grid.py [--models omni-7b,omni-72b,omni-moe-30b] [--gpus 1024,4096]
                                     [--workloads mixed_video,long_video] [--budget 4] [--workers 1]
                                     [--out results/regimes] [--redraw]

Each cell is the command a user types, `omnibench simulate --system all --workload W --model M --gpus G
--tuned --tune-budget B --check-convergence --json` (every system at its own tuned layout, on step 0's batch,
its tune searched again at twice the budget until the best step moves by at most 2%; a workload with no audio
runs the model without its audio encoder), run as a subprocess and read back. It writes OUT/grid.json
(every system's tuned layout and throughput per cell), OUT/grid.md (the table) and OUT/regimes.png (omni /
best baseline per cell, the baseline named; a cell where omni or every baseline has no layout that fits says
so). The tunes share one cache (OUT/tune-cache.json), so a rerun with more cells reuses the ones done.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("omni-7b", "omni-72b", "omni-moe-30b")
GPUS = (1024, 4096)
WORKLOADS = ("mixed_video", "long_video")


def cell_command(model: str, workload: str, gpus: int, budget: int, workers: int, cache: Path) -> list[str]:
    return [sys.executable, "-m", "omnibench", "simulate", "--system", "all", "--workload", workload, "--model",
            model, "--gpus", str(gpus), "--tuned", "--tune-budget", str(budget), "--check-convergence",
            "--workers", str(workers), "--tune-cache", str(cache), "--json"]


def run_cell(cmd: list[str]) -> dict:
    """The cell's systems as `simulate --json` reports them: system -> its row (layout, throughput, fits)."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    rows = json.loads(done.stdout)["results"]
    return {r["system"]: {"layout": r.get("layout", ""), "fits": bool(r.get("fits")),
                          "tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu") or 0.0,
                          "step_time_s": r.get("step_time_s") or 0.0, "imbalance": r.get("imbalance"),
                          "bubble": r.get("bubble"), "exposed_comm": r.get("exposed_comm")} for r in rows}


def verdict(systems: dict, without: tuple[str, ...] = ()) -> tuple[float | None, str, str]:
    """(omni / best fitting baseline other than `without`, that baseline, why there is no ratio)."""
    fit = {s: r for s, r in systems.items() if s != "error" and r["fits"] and r["tokens_per_s_per_gpu"] > 0}
    base = {s: r for s, r in fit.items() if s != "omni" and s not in without}
    if "error" in systems:
        return None, "", systems["error"]
    if "omni" not in fit:
        return None, max(base, key=lambda s: base[s]["tokens_per_s_per_gpu"]) if base else "", "omni: no layout fits"
    if not base:
        return None, "", "no baseline fits"
    best = max(base, key=lambda s: base[s]["tokens_per_s_per_gpu"])
    return fit["omni"]["tokens_per_s_per_gpu"] / base[best]["tokens_per_s_per_gpu"], best, ""


def no_fit(systems: dict) -> str:
    """The systems of a cell with no layout that fits (or no plan), as a comma list."""
    return ", ".join(s for s, r in systems.items() if s != "error" and not (r["fits"] and r["tokens_per_s_per_gpu"] > 0))


def table(cells: list[dict]) -> str:
    lines = ["| model | workload | GPUs | tune budget | omni tok/s/GPU | best baseline | its tok/s/GPU | omni / best | "
             "omni / best without spatial | no layout fits | omni's layout |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for c in cells:
        ratio, best, why = verdict(c["systems"])
        apart, other, _ = verdict(c["systems"], ("spatial",))
        omni = c["systems"].get("omni", {})
        base = c["systems"].get(best, {})
        lines.append(f"| {c['model']} | {c['workload']} | {c['gpus']:,} | {c['budget']} | "
                     f"{omni.get('tokens_per_s_per_gpu', 0):,.0f} | {best or '-'} | "
                     f"{base.get('tokens_per_s_per_gpu', 0):,.0f} | "
                     f"{f'{ratio:.2f}x' if ratio is not None else why} | "
                     f"{f'{apart:.2f}x vs {other}' if apart is not None else '-'} | {no_fit(c['systems']) or '-'} | "
                     f"{omni.get('layout', '') or '-'} |")
    return "\n".join(lines) + "\n"


def figure(cells: list[dict], out: Path) -> None:
    import matplotlib.pyplot as plt

    from omnibench.plots.style import DOUBLE_IN, apply_theme, save

    apply_theme()
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    models = list(dict.fromkeys(c["model"] for c in cells))
    sizes = sorted({c["gpus"] for c in cells})
    fig, axes = plt.subplots(1, len(workloads), figsize=(DOUBLE_IN, 1.0 + 0.7 * len(models)), squeeze=False)
    cmap = plt.get_cmap("RdBu")
    for ax, wl in zip(axes[0], workloads, strict=True):
        for i, m in enumerate(models):
            for j, g in enumerate(sizes):
                c = next((c for c in cells if (c["model"], c["workload"], c["gpus"]) == (m, wl, g)), None)
                ratio, best, why = verdict(c["systems"]) if c else (None, "", "not run")
                colour = cmap(min(max((ratio - 0.5) / 1.0, 0.0), 1.0)) if ratio is not None else (0.9, 0.9, 0.9)
                ax.add_patch(plt.Rectangle((j, i), 1, 1, color=colour))
                text = f"{ratio:.2f}x\nvs {best}" if ratio is not None else why.replace(": ", ":\n")
                apart, other, _ = verdict(c["systems"], ("spatial",)) if c else (None, "", "")
                if ratio is not None and best == "spatial" and apart is not None:
                    text += f"\n({apart:.2f}x vs {other})"
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=6.5)
        ax.set_xlim(0, len(sizes))
        ax.set_ylim(len(models), 0)
        ax.set_xticks([j + 0.5 for j in range(len(sizes))], [f"{g:,}" for g in sizes])
        ax.set_yticks([i + 0.5 for i in range(len(models))], models if ax is axes[0][0] else [""] * len(models))
        ax.set_xlabel("H100s")
        ax.set_title(wl, fontsize=8)
        ax.grid(False)
    fig.suptitle("omni / best tuned baseline (tokens/s/GPU), each system at its own tuned layout\nblue: omni ahead, red: behind", fontsize=8)
    fig.tight_layout()
    save(fig, out, "regimes")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpus", default=",".join(str(g) for g in GPUS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "regimes"))
    ap.add_argument("--redraw", action="store_true", help="only the table and figure, from OUT/grid.json")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done_path = out / "grid.json"
    cells = json.loads(done_path.read_text()) if done_path.exists() else []
    for model in [] if args.redraw else args.models.split(","):
        for workload in args.workloads.split(","):
            for gpus in (int(g) for g in args.gpus.split(",")):
                cmd = cell_command(model, workload, gpus, args.budget, args.workers, out / "tune-cache.json")
                t0 = time.perf_counter()
                systems = run_cell(cmd)
                cell = {"model": model, "workload": workload, "gpus": gpus, "budget": args.budget,
                        "command": " ".join(["python"] + cmd[1:]), "seconds": round(time.perf_counter() - t0, 1),
                        "systems": systems}
                cells = [c for c in cells if (c["model"], c["workload"], c["gpus"]) != (model, workload, gpus)]
                cells.append(cell)
                ratio, best, why = verdict(systems)
                print(f"{model} {workload} {gpus}: " + (f"omni {ratio:.2f}x of {best}" if ratio is not None else why)
                      + f" ({cell['seconds']:.0f} s)", flush=True)
                done_path.write_text(json.dumps(cells, indent=1) + "\n")
    cells.sort(key=lambda c: (c["workload"], c["model"], c["gpus"]))
    done_path.write_text(json.dumps(cells, indent=1) + "\n")
    (out / "grid.md").write_text(table(cells))
    figure(cells, out)
    print(table(cells))


if __name__ == "__main__":
    main()

"""`omnibench plot | report | reproduce`: paper-style figures from run and simulation records.

plot: one figure kind (PNG + PDF). report: one self-contained HTML page with every figure the
records can make. reproduce: re-make the committed reference figures from scratch (CPU runs through
`omnibench run`, simulations through `omnibench simulate`, then figures and report).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from omnibench import stopping
from omnibench.cli.common import (
    atomic_write,
    console,
    err_console,
    fail,
    writable_file,
    writable_folder,
    writing,
)
from omnibench.provenance import REPO_ROOT
from workloads.conditions import cell_name

ABLATIONS = ("joint-pipeline", "reorder", "reshard", "long-short-sp")  # omni's switches (`omnibench run --no-X`)
SIM_ABLATIONS = (*ABLATIONS, "llm-long-short")  # and the one only a cluster shows (long LLM samples over a cp group)
# The tuned comparison of `reproduce`: each system at its own layout, tuned once and kept for every step,
# at these sizes (--quick: the small ones). The tune simulates TUNE_BUDGET layouts per system (one wave of
# tune.WAVE: the fastest of each pipeline depth and tp x cp split) and checks it converged (twice that
# moves the best by <= 2%, OUT/convergence.csv); `--tune-budget 0` simulates TUNE_FRACTION of each pruned
# space instead (about 3x the time: 27 layouts of a 108-layout space, 54 for the check). --quick simulates
# TUNE_BUDGET_QUICK. Every tune after the first is seeded with the earlier tunes' answers (tune.Seed) and
# searches half that budget. The dynamic workloads are tuned on TUNE_STEPS_DYNAMIC batches picked across
# their window (calmest, median, burstiest), so a layout survives the burst.
TUNE_FRACTION, TUNE_BUDGET, TUNE_BUDGET_QUICK = 0.25, 8, 2
TUNE_STEPS_DYNAMIC = 3
SWEEP_GPUS, SWEEP_GPUS_QUICK = (1024,), (64, 128)
STATIC_WORKLOADS = ("mixed_video", "long_video", "image_sft", "omni_av")
# bursty_mix seed 14: calm -> audio burst -> video burst in its first 16 steps; drifting_video: 12 steps
# spread over its 1,000 (every 90th batch).
DYNAMIC_RUNS = {"bursty_mix": ("--seed", "14", "--steps", "16"),
                "drifting_video": ("--steps", "12", "--step-stride", "90")}
DYNAMIC_RUNS_QUICK = {"bursty_mix": ("--seed", "14", "--steps", "10"),
                      "drifting_video": ("--steps", "4", "--step-stride", "300")}
# The largest H100 cluster for a static video mix; a second machine (H200: the
# H100's compute with 141 GB at 4.8 TB/s) at the first size. bursty_mix at 8,192 GPUs (16 steps, tuned on
# 3) would cost about 26 more minutes on 2 cores, twice all the rest of the tuned comparison: not in the
# default plan (`omnibench simulate --workload bursty_mix --gpus 8192 --seed 14 --steps 16 --tune-steps 3
# --tuned ...` makes it).
LARGEST_GPUS, LARGEST_GPUS_QUICK = 8192, 256
LARGEST_WORKLOADS = ("mixed_video",)
LARGEST, LARGEST_QUICK = tuple((wl, LARGEST_GPUS) for wl in LARGEST_WORKLOADS), (("mixed_video", LARGEST_GPUS_QUICK),)
# a seeded tune (half the budget, its seeds on top): its time as a share of an unseeded one's, assumed from the
# budget alone; it only sizes the estimate of a stage that results/reproduce-stages.csv does not time
# (`_measured` puts the CSV's measured seconds in place of every estimate it names)
SEEDED_SCALE = 0.5
# the layouts of each earlier tune that seed the later ones: its answer and its runner-up (colocated's
# image_sft answer, tp 1 / cp 4 / 2 microbatches, was its runner-up on mixed_video; seeded with the answers
# alone, its search at half the budget settled 2.2% slower than an unseeded search at the full budget)
SEEDS_PER_TUNE = 2
SECOND_HARDWARE = "h200"
SECOND_HARDWARE_WORKLOADS = ("mixed_video", "image_sft")  # a video mix, and the one the baselines fit without
                                                          # recomputation (where 141 GB can move the verdict)
# How the verdict moves when memory is mispredicted: bursty_mix (where omni's lead rests on predicted
# out-of-memory) and mixed_video, every system re-tuned under each error, at the first size.
MEMORY_WORKLOADS = ("bursty_mix", "mixed_video")
MEMORY_ERRORS = (-0.2, 0.2)
# The condition grid (workloads/conditions.py) at two sizes, per model: omni-moe-30b's LLM has 3B active
# parameters, so its encoders' share of the step is large. Every system tuned per cell at a fixed budget.
CONDITION_GPUS, CONDITION_GPUS_QUICK = (256,), (64,)
# omni-moe-30b (3B active LLM parameters: a large encoder share) would double the grid's time: not in the
# default plan; `simulate --model omni-moe-30b --workload <cell>.toml --tuned ...` makes it.
CONDITION_MODELS, CONDITION_MODELS_QUICK = ("omni-7b",), ("omni-7b",)
CONDITION_BUDGET = 4
# `reproduce --extended`: the cells the default plan leaves out for time (every workload at
# 1,024, 4,096 and 8,192 GPUs, H100 and H200), after every default stage and seeded by the same workload's
# answers before it. The static workloads at these H100 sizes (a cell the default plan has, mixed_video at
# 8,192, is not repeated), and every workload on 1,024 H200s. Still out, for time: the dynamic workloads
# above 1,024 GPUs (bursty_mix's 16 steps at 4,096 GPUs cost about as much as the whole default tuned
# comparison: `omnibench simulate --workload bursty_mix --gpus 4096 --seed 14 --steps 16 --tune-steps 3
# --tuned ...` makes it) and H200s above 1,024 (about 70 more minutes: `--hardware h200 --gpus 4096`).
EXTENDED_GPUS, EXTENDED_GPUS_QUICK = (4096, 8192), (256,)
CONDITION_SHARES, CONDITION_SHARES_QUICK, CONDITION_SIGMAS_QUICK = (0.1, 0.6, 0.9), (0.1, 0.9), (1.0,)
KINDS = ("throughput", "scaling", "dynamic", "speedup", "breakdown", "conditions", "memory", "timeline", "validation",
         "ablation", "ablation_cumulative", "spatial_quota", "workload")
# The cumulative ablation's stages (omnibench/plots/figures.py CUMULATIVE: omni's decoupled layout with the
# baselines' loading and every technique off, then its techniques one at a time): one per step before the
# last, which is omni itself (the tuned comparison's own record)
CUMULATIVE_PREFIX = "omni-cumulative-"
# spatial's quota ablation: its tuned layout with a fixed even split and with the balancer's per-phase share
SPATIAL_ABLATION_QUOTAS = ("0.5", "auto")

_PLOT_EXAMPLES = """
Examples:

  omnibench plot throughput results/runs/*

  omnibench plot scaling results/sims/20261121-055030-mixed_video-omni-7b-h100 --out figs

  omnibench plot timeline results/runs/my-run --step 2

  omnibench plot timeline results/sims/<record> --system omni --gpus 256

  omnibench plot workload --workload bursty_mix
"""


def _load(run_dirs: list[Path] | None, kind: str):
    from omnibench.plots.load import PlotInputError, load

    if not run_dirs:
        fail(f"{kind}: no record folders given (pass run folders from `omnibench run` or simulation folders "
             "from `omnibench simulate`, e.g. results/runs/<run> results/sims/<record>)")
    try:
        recs = load(run_dirs)
    except PlotInputError as e:
        fail(str(e))
    for why in recs.skipped:
        err_console.print(f"[yellow]skipped:[/] {why}", highlight=False)
    return recs


def draw(kind: str, run_dirs: list[Path] | None, workload: str | None = None, system: str | None = None,
         gpus: int | None = None, step: int | None = None, calibration: str | None = None,
         hardware: str | None = None):
    """One figure (a `figures.Drawn`), or a one-line error naming what is missing."""
    from omnibench.plots import figures
    from omnibench.plots.load import PlotInputError

    if kind not in KINDS:
        fail(f"KIND must be one of {', '.join(KINDS)}; got {kind!r}")
    try:
        if kind == "workload":
            if workload is None:
                if not run_dirs:
                    fail("plot workload: give --workload NAME (or record folders whose workload to draw)")
                wls = _load(run_dirs, "plot workload").workloads()
                if len(wls) > 1:
                    fail(f"plot workload: records hold several workloads ({', '.join(wls)}); pick one with --workload")
                workload = wls[0]
            return figures.workload(workload)
        recs = _load(run_dirs, f"plot {kind}")
        if kind == "throughput":
            return figures.throughput(recs, gpus=gpus, hardware=hardware)
        if kind == "scaling":
            return figures.scaling(recs, workload)
        if kind == "dynamic":
            return figures.dynamic(recs, workload, gpus)
        if kind == "speedup":
            return figures.speedup(recs, hardware)
        if kind == "breakdown":
            return figures.breakdown(recs, gpus, hardware)
        if kind == "conditions":
            return figures.conditions(recs)
        if kind == "memory":
            return figures.memory_sensitivity(recs)
        if kind == "timeline":
            if len(recs.all) > 1 and system is None:
                fail(f"plot timeline draws one record; got {len(recs.all)}: give one folder or pick with --system")
            return figures.timeline(figures.record_of(recs, system), system, gpus, step)
        if kind == "validation":
            return figures.validation(recs, calibration)
        if kind == "ablation":
            return figures.ablation(recs, workload)
        if kind == "ablation_cumulative":
            return figures.cumulative_ablation(recs, workload)
        if kind == "spatial_quota":
            return figures.spatial_quota(recs, workload or "mixed_video")
    except PlotInputError as e:
        fail(str(e))
    raise AssertionError(kind)


def register(app: typer.Typer) -> None:
    @app.command("plot", epilog=_PLOT_EXAMPLES)
    def plot_cmd(
        kind: str = typer.Argument(..., help=f"One of: {', '.join(KINDS)}."),
        run_dirs: list[Path] = typer.Argument(None, help="Run and/or simulation record folders (or folders of them)."),
        out: Path = typer.Option(Path("."), "--out", help="Folder for <KIND>.png and <KIND>.pdf."),
        workload: str = typer.Option(None, "--workload", "-w", help="Workload to draw (records with several)."),
        system: str = typer.Option(None, "--system", "-s", help="timeline: the system whose trace to draw."),
        gpus: int = typer.Option(None, "--gpus", help="timeline/throughput/dynamic/breakdown: a cluster size."),
        hardware: str = typer.Option(None, "--hardware", help="throughput/speedup/breakdown: the records' hardware "
                                     "to draw (a figure never mixes machines)."),
        step: int = typer.Option(None, "--step", help="timeline: step of a run's trace (default: the second)."),
        calibration: str = typer.Option(None, "--calibration", help="validation: profile from `omnibench calibrate`."),
        name: str = typer.Option(None, "--name", help="File name without suffix (default: KIND)."),
    ) -> None:
        """Draw one paper-style figure (PNG at 200 dpi and PDF) from run or simulation records."""
        from omnibench.plots import style

        if kind not in KINDS:
            fail(f"KIND must be one of {', '.join(KINDS)}; got {kind!r}")
        if name is not None and (not name.strip() or name in (".", "..") or Path(name).name != name):
            fail(f"name: a file name without folder or suffix (PNG and PDF get it), e.g. {kind}_h100; got {name!r}")
        _check_calibration(calibration)
        stem = name or kind
        out_folder(out)  # before the drawing, which a folder that cannot take the files would lose
        for suffix in (".png", ".pdf"):
            _not_a_folder(out / f"{stem}{suffix}")
        d = draw(kind, run_dirs, workload, system, gpus, step, calibration, hardware)
        with writing(out / f"{stem}.png"):
            paths = style.save(d.fig, out, stem)
        console.print(d.caption, highlight=False)
        for p in paths:
            console.print(f"wrote {p}", highlight=False)

    @app.command("report")
    def report_cmd(
        run_dirs: list[Path] = typer.Argument(None, help="Run and/or simulation record folders (or folders of them)."),
        out: Path = typer.Option(Path("."), "--out", help="Folder for report.html, or the page's own file name "
                                 "(ending in .html)."),
        calibration: str = typer.Option(None, "--calibration", help="Profile for the validation figure."),
        title: str = typer.Option("omnibench report", "--title"),
    ) -> None:
        """One self-contained HTML page: every figure the records can make, its table, the commands."""
        from omnibench.plots.report import draw_all, write_html
        from omnibench.provenance import figure_provenance

        _check_calibration(calibration)
        path = report_path(out)  # checked before the drawing, which a page that cannot be written would lose
        recs = _load(run_dirs, "report")
        prov = figure_provenance()  # one for the page and every figure on it
        sections = draw_all(recs, calibration=calibration, prov=prov)
        if not any(s.drawn for s in sections):
            fail("report: the records make no figure: " + "; ".join(f"{s.title}: {s.reason}" for s in sections))
        with writing(path):
            write_html(sections, recs, path, title, prov=prov)
        for s in sections:
            mark = "[green]drawn[/]" if s.drawn else f"[yellow]not drawn[/]: {s.reason}"
            console.print(f"{s.title}: {mark}", highlight=False)
        console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", highlight=False)

    @app.command("reproduce", short_help="Re-make every reference figure from scratch: CPU runs, simulations, the tuned "
                 "comparison, the condition grid; --plan lists the stages.")
    def reproduce_cmd(
        out: Path = typer.Option(Path("results"), "--out", help="Results folder (figures/, report.html, runs/, sims/)."),
        quick: bool = typer.Option(False, "--quick", help="Fewer runs, steps and cluster sizes (a smoke test)."),
        reuse: bool = typer.Option(False, "--reuse", help="Redraw from the data an earlier reproduce produced."),
        resume: bool = typer.Option(False, "--resume", help="Continue an interrupted reproduce: keep the stages "
                                    "it finished, redo the rest."),
        repeat: int = typer.Option(1, "--repeat", help="Repeats of each measured CPU run: the measured "
                                   "throughput figure shows their mean with an error bar."),
        tune_budget: int = typer.Option(None, "--tune-budget", help=f"Layouts `tune` simulates per system for the "
                                        f"tuned figures (default {TUNE_BUDGET}, {TUNE_BUDGET_QUICK} with --quick; the "
                                        "seeded tunes after the first: half of it); 0: "
                                        "--tune-fraction of each system's space."),
        tune_fraction: float = typer.Option(TUNE_FRACTION, "--tune-fraction", help="With --tune-budget 0: the share "
                                            "of each system's pruned layout space its tune simulates."),
        workers: int = typer.Option(None, "--workers", help="Simulations run at once inside each stage (default: "
                                    "every core; the measured CPU runs always run alone)."),
        ray: str = typer.Option(None, "--ray", help="Run the stages' simulations on a Ray cluster: auto, local, or "
                                "ray://host:port."),
        no_cache: bool = typer.Option(False, "--no-cache", help="Simulate everything again (no step cache)."),
        plan: bool = typer.Option(False, "--plan", help="List the stages, their commands and estimated times; run "
                                  "nothing."),
        extended: bool = typer.Option(False, "--extended", help="Also the cells the default plan leaves out for time, "
                                      "after it: the static workloads at 4,096 and 8,192 H100s and every workload "
                                      "on 1,024 H200s (about 90 more minutes on 2 cores; with --resume after a "
                                      "default reproduce, only those)."),
    ) -> None:
        """Re-make the reference figures from scratch: CPU runs (2 ranks, tiny model), simulations at 256 to
        8,192 GPUs at one layout (scaling, timelines), and the tuned comparison, each system at its own
        layout tuned once and kept for every step (on step 0's batch for the static workloads, on the
        calmest, median and burstiest simulated steps for bursty_mix and drifting_video): every workload at
        1,024 H100s, mixed_video and image_sft at 1,024 H200s, mixed_video at 8,192 H100s, mixed_video and bursty_mix
        again under memory estimates 20% low and high, and the condition grid (video share x
        length spread, omni-7b, 256 GPUs); then every figure and its table (CSV) under
        OUT/figures, OUT/report.html, and OUT/convergence.csv: each tune searched again at twice its budget,
        and how far its best step time moved (and, for the tunes seeded with the earlier tunes' answers, how
        far it beat its fastest seed). Tunes are kept in OUT/sims/reproduce/tuned-layouts.json and
        reused by later stages and --resume; simulations run on every core (--workers) and through the
        step cache. Prints each stage (k of N, what it runs, time left; --plan lists them and runs
        nothing); exits 1 if a stage failed or a figure could not be drawn."""
        if reuse and resume:
            fail("reproduce: --reuse redraws only, --resume produces what is missing; give one")
        if repeat < 1:
            fail(f"repeat must be a positive integer, got {repeat}")
        if tune_budget is not None and tune_budget < 0:
            fail(f"tune-budget must be >= 0 (0: --tune-fraction of each space), got {tune_budget}")
        if not 0 < tune_fraction <= 1:
            fail(f"tune-fraction must be in (0, 1] (a share of the layouts left after pruning), got {tune_fraction}")
        if workers is not None and workers < 1:
            fail(f"workers must be a positive integer (default: every core), got {workers}")
        sweep = SweepArgs(tune_fraction=tune_fraction, workers=workers, ray=ray, no_cache=no_cache)
        if plan:
            from systems import available_systems

            stages = _measured(_stages(out / "runs" / "reproduce", out / "sims" / "reproduce", available_systems(),
                                       quick, repeat, tune_budget, sweep, extended=extended), quick)
            for k, st in enumerate(stages, 1):
                args = st.args if isinstance(st.args, list) else ["(arguments made when it starts)"]
                console.print(f"[{k}/{len(stages)}] {st.key}: about {_duration(st.estimate_s)}\n      "
                              + "omnibench " + " ".join(args), highlight=False, soft_wrap=True)
            console.print(f"{len(stages)} stages, about {_duration(sum(st.estimate_s for st in stages))} on 2 quiet "
                          "cores, then the figures", highlight=False)
            return
        # before the first stage: hours of runs and simulations must not end in a folder nothing can be written in
        out_folder(out)
        for part in ("runs", "runs/reproduce", "sims", "sims/reproduce", "figures"):
            if (out / part).exists() and not (out / part).is_dir():
                fail(f"out: {out / part} is a file where reproduce keeps a folder; remove it or give another --out")
        _not_a_folder(out / "report.html")
        reproduce(out, quick, reuse, resume, repeat, tune_budget, sweep, extended=extended)


def report_path(out: Path) -> Path:
    """Where `report --out` puts the page: OUT/report.html, or OUT itself when it names an .html file
    (not an existing folder); a file in the way or a place this process cannot write is refused."""
    _resolvable(out)
    if out.suffix.lower() in (".html", ".htm") and not out.is_dir():
        return writable_file(out, "out")
    if out.exists() and not out.is_dir():
        fail(f"out: {out} is a file; --out names the folder for report.html or an .html file to write")
    return _not_a_folder(writable_folder(out, "out") / "report.html")


def _not_a_folder(path: Path) -> Path:
    """A file the command writes in --out, refused up front when a folder has its name."""
    if path.is_dir():
        fail(f"out: {path} is a folder where the command writes the file {path.name}; remove it or give another "
             "--out")
    return path


def out_folder(out: Path) -> Path:
    """--out of plot and reproduce: a folder this process can write in (made if missing), else one line."""
    _resolvable(out)
    return writable_folder(out, "out")


def _resolvable(out: Path) -> None:
    """A symbolic link on the way that leads nowhere (a loop, a missing target) named as such: the
    system's own words for it ("File exists", "Too many levels of symbolic links") say nothing useful."""
    for p in (out, *out.parents):
        if p.is_symlink() and not p.exists():
            try:
                target = os.readlink(p)
            except OSError:
                target = "?"
            fail(f"out: {p} is a symbolic link to {target}, which leads nowhere (a loop or a missing target); "
                 "give another --out or fix the link")


def _check_calibration(calibration: str | None) -> None:
    """--calibration read before any drawing: a profile that is missing or not one is bad input (exit 2),
    not a validation figure quietly left out of the page."""
    if calibration is None:
        return
    from simulator.calibrate import CalibrationError, Profile

    try:
        Profile.load(calibration)
    except CalibrationError as e:
        fail(str(e))


# -- reproduce -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepArgs:
    """How the simulation stages search and run (passed on to each `simulate`)."""

    tune_fraction: float = TUNE_FRACTION
    workers: int | None = None
    ray: str | None = None
    no_cache: bool = False

    def run_args(self) -> list[str]:
        return ([f"--workers={self.workers}"] if self.workers else []) + (["--ray", self.ray] if self.ray else []) \
            + (["--no-cache"] if self.no_cache else [])


# What each stage took in the committed reproduce (on 2 cores; a reproduce writes OUT/reproduce-stages.csv
# from its ledger): the progress line's estimate for every stage it names, the stage's formula for the rest.
STAGE_TIMES = REPO_ROOT / "results" / "reproduce-stages.csv"


def _stage_seconds(path: Path) -> dict[str, float]:
    """stage key -> seconds, from a reproduce-stages.csv (empty when it cannot be read)."""
    import csv

    try:
        with path.open(newline="") as f:
            return {r["stage"]: float(r["seconds"]) for r in csv.DictReader(f) if r.get("stage") and r.get("seconds")}
    except (OSError, ValueError, KeyError):
        return {}


def _measured(stages: list[Stage], quick: bool = False) -> list[Stage]:
    """`stages` with the committed reproduce's time as the estimate of each stage it names. Not with
    --quick: its stages share some keys with the default plan's (runs, the scaling sweep) but do less."""
    if quick:
        return stages
    measured = _stage_seconds(STAGE_TIMES)
    return [replace(st, estimate_s=measured.get(st.key, st.estimate_s)) for st in stages]


def _pace_kind(st: Stage) -> str:
    """CPU training runs and simulations keep different paces on a host (the runs' ranks wait on each
    other, the simulations fill both cores): each kind's time left is paced by its own stages so far."""
    return "run" if st.key.startswith("run-") or st.key == "calibrate" else "sim"


def _time_left(todo: list[Stage], spent: dict[str, float], estimated: dict[str, float]) -> float:
    """Estimated seconds of `todo`, each stage's estimate scaled by measured / estimated over the stages
    of its kind run so far (1 before the first)."""
    def pace(kind: str) -> float:
        return spent[kind] / estimated[kind] if estimated.get(kind) else 1.0
    return sum(st.estimate_s * pace(_pace_kind(st)) for st in todo)


@dataclass
class Stage:
    """One command of `reproduce`'s data production. `args` may be a function: its arguments depend on
    what earlier stages left (calibrate takes the finished runs). `estimate_s`: its time on 2 shared
    cores (results/BENCHMARKS.md), for the progress line's time left; the committed reproduce's
    measured time replaces it where it names the stage (`_measured`)."""

    key: str
    what: str
    args: list[str] | Callable[[], list[str]]
    estimate_s: float
    # an ablation at a kept layout: "nothing fits" is its answer (that switch costs the layout its
    # memory), kept as the stage's note rather than a failure
    no_fit_is_an_answer: bool = False
    # run just before the command (when the earlier stages are done): writes the seeds file it reads
    prepare: Callable[[], None] | None = None


def _dies_with(parent: int) -> Callable[[], None] | None:
    """For Popen's preexec_fn: the child asks Linux for SIGKILL when `parent` ends, however it ends (a
    SIGKILL or the OOM killer gives reproduce no chance to stop it): an orphaned stage would run on,
    finish, and leave a folder the next `--resume` trips over. The child's own children (a run's ranks, a
    simulation's pool) already die with it. Elsewhere None: nothing asked."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    # looked up here, in the parent: between fork and exec the child should only make the call
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1  # <linux/prctl.h>

    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # the parent ended before the request was in place
            os._exit(1)

    return arm


def _spawn(argv: list[str]) -> subprocess.Popen:
    """Start a stage's process, its output captured, ending with this process (`_dies_with`)."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_dies_with(os.getpid()))


def _omnibench(args: list[str]) -> tuple[bool, str]:
    """Run an omnibench command in a fresh process (exactly the code path a user's command takes);
    (ok, the last lines of its error output). Stopping reproduce stops the command too."""
    proc = _spawn([sys.executable, "-m", "omnibench", *args])
    try:
        stdout, stderr = proc.communicate()
    except BaseException:  # Ctrl-C or SIGTERM: the child ends with us and cleans its own temp folder
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if proc.returncode != 0:
        return False, _why(stdout, stderr)
    return True, ""


NOTHING_FITS = "nothing fits: "


def _why(stdout: str, stderr: str) -> str:
    """Why a command failed: a simulation's own verdicts when nothing fitted (its --json output), else
    the last lines of its error output."""
    import json

    try:
        got = json.loads(stdout[stdout.index("{"):])
        msgs = [r.get("fit_message") or r.get("error") for r in got.get("results", []) if not r.get("fits")]
        if msgs and all(msgs):
            return NOTHING_FITS + "; ".join(dict.fromkeys(msgs))
    except (ValueError, AttributeError):
        pass
    return " | ".join((stderr or stdout).strip().splitlines()[-3:])


def reproduce(out: Path, quick: bool, reuse: bool = False, resume: bool = False, repeat: int = 1,
              tune_budget: int | None = None, sweep: SweepArgs = SweepArgs(), extended: bool = False) -> None:
    from systems import available_systems

    runs_dir, sims_dir, fig_dir = out / "runs" / "reproduce", out / "sims" / "reproduce", out / "figures"
    systems = available_systems()
    log: list[str] = []
    if reuse:
        if not (runs_dir.is_dir() and sims_dir.is_dir()):
            fail(f"reproduce --reuse: no earlier data under {runs_dir} and {sims_dir}; run without --reuse first")
    else:
        _produce(runs_dir, sims_dir, systems, quick, resume, log, repeat, tune_budget, sweep, extended=extended)
    n = len(_stages(runs_dir, sims_dir, systems, quick, repeat, tune_budget, sweep, extended=extended)) + 1
    console.print(f"[{n}/{n}] figures under {fig_dir} and {out / 'report.html'}", highlight=False)

    # 3. figures, each from the records whose configs say they are its data; each names the code as it
    # was before the first one was written (writing them makes the checkout differ from its commit)
    from omnibench.provenance import figure_provenance

    prov = figure_provenance()
    fig_dir.mkdir(parents=True, exist_ok=True)
    results = _reference_figures(runs_dir, sims_dir, fig_dir, systems, quick, prov)
    _reference_report(out, runs_dir, sims_dir, prov, results)
    _convergence_table(out, sims_dir, results)
    _reproduce_verdict(out, results, log, reuse)


class _FigureMaker:
    """Draws `reproduce`'s figures into one folder, each with its table (CSV), and notes for each whether
    it was written or why not (`results`: (name, status))."""

    def __init__(self, fig_dir: Path, prov):
        self.fig_dir, self.prov = fig_dir, prov
        self.results: list[tuple[str, str]] = []

    def make(self, name: str, fn, *args, **kw):
        from omnibench.plots import style
        from omnibench.plots.load import PlotInputError

        fig_dir = self.fig_dir
        try:
            d = fn(*args, **kw)
        except (PlotInputError, OSError) as e:
            self.results.append((name, f"not produced: {e}"))
            return None
        # a full disk ends the command (one line, exit 1): every figure after this one would fail the same way
        with writing(fig_dir / f"{name}.png"):
            style.save(d.fig, fig_dir, name, self.prov)
        if d.table is not None and not d.table.empty:  # the figure's numbers, for the documents' tables
            with writing(fig_dir / f"{name}.csv"):
                atomic_write(fig_dir / f"{name}.csv", d.table.to_csv(index=False, float_format="%.6g"))
        self.results.append((name, "written"))
        import matplotlib.pyplot as plt

        plt.close(d.fig)
        return d


def _reference_figures(runs_dir: Path, sims_dir: Path, fig_dir: Path, systems: list[str], quick: bool,
                       prov) -> list[tuple[str, str]]:
    """Every reference figure under `fig_dir`, each from the records that are its data; (name, written or
    why not) per figure. A figure an earlier reproduce drew and this one did not is removed."""
    from omnibench.plots import figures
    from omnibench.plots.load import Records, load

    def pick(pred) -> list[Path]:
        return sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.name.endswith(".incomplete") and pred(p))

    def recs_of(paths) -> Records:
        return load(paths) if paths else Records()

    maker = _FigureMaker(fig_dir, prov)
    make, results = maker.make, maker.results
    sims = _reference_sims(sims_dir)
    sweep, second, deployed = sims["sweep"], sims["second"], sims["deployed"]
    real = recs_of(pick(lambda p: "pp2" not in p.name and "-no-" not in p.name))
    pp2 = pick(lambda p: "pp2" in p.name)
    sizes = SWEEP_GPUS_QUICK if quick else SWEEP_GPUS
    # One cluster size for every workload, so the bars compare like with like.
    make("throughput", figures.throughput, Records(sims=sweep), source="sim", gpus=sizes[0])
    make("speedup", figures.speedup, Records(sims=sweep))
    if deployed:  # omni (its one way) against the baselines as their anchors deploy them
        omni_only = [replace(r, rows=[x for x in r.rows if x["system"] == "omni"]) for r in sweep]
        make("speedup_as_deployed", figures.speedup, Records(sims=[r for r in omni_only if r.rows] + deployed),
             as_deployed=True)
    make(f"throughput_{SECOND_HARDWARE}", figures.throughput, Records(sims=second), source="sim", gpus=sizes[0])
    make(f"speedup_{SECOND_HARDWARE}", figures.speedup, Records(sims=second))
    make("breakdown", figures.breakdown, Records(sims=sweep), gpus=sizes[0])
    # and at each larger size the sweep reached (the 8,192-GPU stage, `--extended`'s 4,096 and 8,192): how the
    # step's parts move with the cluster
    for n in sorted({int(g) for r in sweep for g in r.config.get("gpus", [])} - set(sizes)):
        make(f"breakdown_{n}", figures.breakdown, Records(sims=sweep), gpus=n)
    make("conditions", figures.conditions, Records(sims=sims["grid"]))
    make("memory", figures.memory_sensitivity, Records(sims=sweep + sims["varied"]))
    make("throughput_measured", figures.throughput, real, source="run")
    make("scaling", figures.scaling, Records(sims=sims["scaling"]))
    make("dynamic", figures.dynamic, Records(sims=[r for r in sweep if r.workload == "bursty_mix"]))
    make("dynamic_drifting", figures.dynamic, Records(sims=[r for r in sweep if r.workload == "drifting_video"]))
    if sims["pipelined"]:
        if "omni" in systems:
            make("timeline", figures.timeline, sims["pipelined"][0], system="omni")
        make("timeline_homogeneous", figures.timeline, sims["pipelined"][0], system="homogeneous")
    else:
        results.append(("timeline", "not produced: the pipelined simulation failed"))
    if pp2:
        make("timeline_measured", figures.timeline, load(pp2).runs[0])
    else:
        results.append(("timeline_measured", "not produced: the pipelined run failed"))
    profile = sims_dir / "calibration.json"  # fitted by `omnibench calibrate` on these runs
    make("validation", figures.validation, recs_of(pick(lambda p: True)),
         calibration=str(profile) if profile.is_file() else None)
    one_off, cumulative, cumulative_notes = ablation_inputs(sweep, sims["ablated"], sims_dir)
    make("ablation", figures.ablation, one_off, workload="mixed_video")
    make("ablation_cumulative", figures.cumulative_ablation, cumulative, workload="mixed_video",
         notes=cumulative_notes)
    make("spatial_quota", figures.spatial_quota, Records(sims=[r for r in sweep if r.workload == "mixed_video"]
                                                          + sims["quotas"]))
    make("ablation_measured", figures.ablation,
         recs_of(pick(lambda p: p.name.startswith("omni-") and "mixed_video" in p.name
                      and not re.search(r"-r\d+$", p.name))))  # repeats (--repeat) are the throughput figure's
    make("workload", figures.workload, "mixed_video")
    # The folder is this command's: a figure an earlier reproduce drew that this one did not (a size only
    # --extended reached, a figure whose data failed now) would pass for this data's, and the documents'
    # tables read its CSV.
    drawn = {name for name, status in results if status == "written"}
    for old in fig_dir.iterdir():
        if old.suffix in (".png", ".pdf", ".csv") and old.stem not in drawn:
            old.unlink()
    return results


def _reference_sims(sims_dir: Path) -> dict[str, list]:
    """`reproduce`'s simulation records, kept apart by what they answer: the condition grid ("grid"), the
    memory errors ("varied"), the baselines as deployed ("deployed"), each system at its own tuned layout
    on H100s ("sweep") and on the second machine ("second"), omni's tuned ablations ("ablated"), spatial's
    quotas ("quotas"), and the
    untuned scaling ("scaling") and pipelined ("pipelined") simulations."""
    from omnibench.plots.load import load, memory_error, nominal
    from workloads.conditions import parse_cell

    sims = load([sims_dir]).sims if any(sims_dir.iterdir()) else []
    # kept apart by what they answer: the condition grid, the memory errors, and each machine's comparison
    grid = [r for r in nominal(sims) if parse_cell(r.workload)]
    varied = [r for r in sims if memory_error(r)]
    main = [r for r in nominal(sims) if not parse_cell(r.workload)]

    def on(hw: str) -> list:
        return [r for r in main if str(r.config.get("hardware")) == hw]

    # the baselines as deployed (split by tokens) at the layouts tuned at full strength
    deployed = [r for r in main if (r.config.get("options") or {}).get("balancer") == "tokens"]
    main = [r for r in main if r not in deployed]
    tuned = [r for r in on("h100") if r.config.get("tuned")]
    untuned = [r for r in on("h100") if not r.config.get("tuned")]
    ablated = [r for r in tuned if any(v is False for v in (r.config.get("options") or {}).values())]
    quotas = [r for r in tuned if "quota" in (r.config.get("options") or {})]  # spatial's quota ablation
    sweep = [r for r in tuned if r not in ablated and r not in quotas]  # every system at its own tuned layout
    second = [r for r in on(SECOND_HARDWARE) if r.config.get("tuned")]
    scaling = [r for r in untuned if r.workload == "mixed_video" and len(r.config.get("gpus", [])) > 1]
    pipelined = [r for r in untuned if r.config.get("pp", 1) > 1]
    return {"grid": grid, "varied": varied, "deployed": deployed, "sweep": sweep, "second": second,
            "ablated": ablated, "quotas": quotas, "scaling": scaling, "pipelined": pipelined}


def _reference_report(out: Path, runs_dir: Path, sims_dir: Path, prov, results: list[tuple[str, str]]) -> None:
    """4. the report over everything produced, and what each stage took (reproduce-stages.csv)."""
    from omnibench.plots.load import PlotInputError, load
    from omnibench.plots.report import draw_all, write_html

    profile = sims_dir / "calibration.json"  # fitted by `omnibench calibrate` on these runs
    try:
        everything = load([runs_dir, sims_dir])
        with writing(out / "report.html"):
            write_html(draw_all(everything, calibration=str(profile) if profile.is_file() else None, prov=prov),
                       everything, out / "report.html", "omnibench reference results", prov=prov)
        results.append(("report.html", "written"))
    except PlotInputError as e:
        results.append(("report.html", f"not produced: {e}"))
    # what each stage took (from the ledger `--resume` reads), for the documents
    if _ledger(sims_dir).is_file():
        from omnibench.provenance import write_csv

        took = _read_ledger(_ledger(sims_dir))
        notes = _read_notes(sims_dir)
        with writing(out / "reproduce-stages.csv"):
            write_csv(out / "reproduce-stages.csv", [{"stage": k, "seconds": round(v, 1), "note": notes.get(k)}
                                                     for k, v in took.items()], ["stage", "seconds", "note"])
        results.append(("reproduce-stages.csv", "written"))


def _convergence_table(out: Path, sims_dir: Path, results: list[tuple[str, str]]) -> None:
    """5. did every tune converge? (doubling its budget moved its best step time by <= 2%): OUT/convergence.csv
    and its table."""
    conv = convergence_rows(sims_dir / "tuned-layouts.json")
    unconverged = [r for r in conv if not r["converged"]]
    if not conv:
        return
    from rich.table import Table

    from omnibench.provenance import write_csv

    with writing(out / "convergence.csv"):
        write_csv(out / "convergence.csv", conv, CONVERGENCE_COLUMNS)
    table = Table(title="convergence of the tunes (best step time at the budget and at twice it)")
    for col in ("workload", "GPUs", "system", "layout", "space", "budget", "best s", "2x budget", "best s (2x)",
                "moved", "vs seeds"):
        table.add_column(col, justify="left" if col in ("workload", "system", "layout") else "right")
    for r in conv:
        moved = "-" if r["moved"] is None else f"{r['moved']:.1%}"
        # how far the answer beat its fastest seed; "a seed": the search found nothing faster than one
        over = "-" if r["over_seeds"] is None else "a seed" if r["over_seeds"] <= 0 else f"+{r['over_seeds']:.1%}"
        table.add_row(r["workload"], str(r["gpus"]), r["system"], r["layout"], str(r["space"]), str(r["budget"]),
                      f"{r['best_s']:.3f}", str(r["budget_2x"]), f"{r['best_s_2x']:.3f}",
                      moved if r["converged"] else f"[red]{moved}[/]", over)
    console.print(table)
    results.append(("convergence.csv", "written" if not unconverged else
                    f"written: {len(unconverged)} of {len(conv)} tunes moved by more than 2% at twice the budget "
                    "(raise --tune-fraction)"))


def _reproduce_verdict(out: Path, results: list[tuple[str, str]], log: list[str], reuse: bool) -> None:
    """What was written, what failed, and exit 1 if a stage failed or a figure could not be drawn."""
    console.print("\n[bold]reference figures[/]", highlight=False)
    for name, what in results:
        console.print(f"  {name}: {what}", highlight=False)
    console.print(f"report: {out / 'report.html'}", highlight=False)
    failed = [line for line in log if line.startswith("FAILED")]
    if failed:
        console.print(f"{len(failed)} command(s) failed:", highlight=False)
        for line in failed:
            console.print("  " + line, highlight=False)
    missing = [name for name, what in results if what != "written" and name != "convergence.csv"]
    if failed or missing:
        hint = "`omnibench reproduce --resume` redoes what failed" if not reuse else \
            "run `omnibench reproduce --resume` to produce the missing data"
        fail(f"reproduce: {len(failed)} command(s) failed, {len(missing)} figure(s) not drawn"
             f"{': ' + ', '.join(missing) if missing else ''}; {hint}", code=1)


def _ledger(sims_dir: Path) -> Path:
    return sims_dir / "reproduce-stages.json"


def _notes(sims_dir: Path) -> Path:
    return sims_dir / "reproduce-notes.json"


def _produce(runs_dir: Path, sims_dir: Path, systems: list[str], quick: bool, resume: bool, log: list[str],
             repeat: int = 1, tune_budget: int | None = None, sweep: SweepArgs = SweepArgs(),
             extended: bool = False) -> None:
    """Run every stage, printing `[k/N] what` before and its time after, with an estimate of the time
    left; the finished stages are kept in a ledger so that `--resume` skips them."""
    done: dict[str, float] = {}
    if resume and _ledger(sims_dir).is_file():
        done = _read_ledger(_ledger(sims_dir))
    else:
        for d in (runs_dir, sims_dir):  # from scratch: these two folders belong to this command alone
            shutil.rmtree(d, ignore_errors=True)
    for d in (runs_dir, sims_dir):
        d.mkdir(parents=True, exist_ok=True)
        # what an interrupted stage left (a simulation's too, under sims/<hardware>, memory/, conditions/): it
        # runs again
        for part in sorted(d.rglob("*.incomplete")):
            if part.is_dir() and not part.is_symlink():
                shutil.rmtree(part, ignore_errors=True)
    stages = _measured(_stages(runs_dir, sims_dir, systems, quick, repeat, tune_budget, sweep, extended=extended), quick)
    todo = [st for st in stages if st.key not in done]
    if done:
        console.print(f"resuming: {len(stages) - len(todo)} of {len(stages)} stages already done", highlight=False)
    # measured and estimated seconds of the stages run so far, per kind: their ratio paces the rest
    spent, estimated = {"run": 0.0, "sim": 0.0}, {"run": 0.0, "sim": 0.0}
    stopping.install()  # so that the running command is stopped with us
    for st in stages:
        stopping.raise_if_stopped()
        k = stages.index(st) + 1
        if st.key in done:
            continue
        left = _time_left(todo[todo.index(st):], spent, estimated)
        console.print(f"[{k}/{len(stages)}] {st.what} (about {_duration(left)} left)", highlight=False)
        if st.prepare is not None:
            st.prepare()
        args = st.args() if callable(st.args) else st.args
        line = "omnibench " + " ".join(args)
        kept = _kept_record(args)
        if kept is not None:
            folder, dt = kept
            done[st.key] = dt
            _write_json(_ledger(sims_dir), done)
            console.print(f"      kept {folder}: this stage's run finished before reproduce was stopped",
                          highlight=False)
            log.append(line)
            continue
        t0 = time.perf_counter()
        if err_console.is_terminal:  # a spinner while the stage runs (its own bar is quiet: --json)
            with err_console.status(f"[{k}/{len(stages)}] {st.what}", spinner="dots"):
                ok, why = _omnibench(args)
        else:
            ok, why = _omnibench(args)
        dt = time.perf_counter() - t0
        spent[_pace_kind(st)] += dt
        estimated[_pace_kind(st)] += st.estimate_s
        if not ok and st.no_fit_is_an_answer and why.startswith(NOTHING_FITS):
            notes = _read_notes(sims_dir)
            notes[st.key] = why.removeprefix(NOTHING_FITS)
            _write_json(_notes(sims_dir), notes)
            console.print(f"      {why} (the ablation's answer)", highlight=False)
            ok = True
        if ok:
            done[st.key] = dt
            _write_json(_ledger(sims_dir), done)
            console.print(f"      done in {dt:.0f} s", highlight=False)
            log.append(line)
        else:
            err_console.print(f"      [red]failed[/] ({dt:.0f} s): {why}", highlight=False)
            log.append(f"FAILED ({st.what}): {line}: {why}")


def _write_json(path: Path, obj) -> None:
    """The ledger and notes `--resume` reads: whole or not at all (a kill mid-write must not lose every
    finished stage), a full disk one line."""
    import json

    with writing(path):
        atomic_write(path, json.dumps(obj, indent=1))


def _read_ledger(path: Path) -> dict[str, float]:
    import json

    try:
        done = json.loads(path.read_text())
        if not (isinstance(done, dict) and all(isinstance(v, (int, float)) for v in done.values())):
            raise ValueError("expected {stage: seconds}")
    except (OSError, ValueError) as e:
        fail(f"reproduce --resume: {path} is not a stage ledger ({e}); remove it to redo every stage, or run "
             "without --resume to start over")
    return done


def _read_notes(sims_dir: Path) -> dict[str, str]:
    """The ablations' notes (an answer of "nothing fits"); a file that cannot be read is no note."""
    import json

    try:
        notes = json.loads(_notes(sims_dir).read_text())
    except (OSError, ValueError):
        return {}
    return notes if isinstance(notes, dict) else {}


def _run_out(args: list[str]) -> Path | None:
    """The record folder a `run` stage creates (its --out), else None."""
    if args[:1] == ["run"] and "--out" in args:
        return Path(args[args.index("--out") + 1])
    return None


def _kept_record(args: list[str]) -> tuple[Path, float] | None:
    """A `run` stage whose folder is already there: a reproduce stopped (killed) after the run had
    finished but before the ledger said so. (folder, seconds it took) when it holds this stage's
    finished record, which is kept; otherwise the folder (an unfinished or different run's) is removed
    so that the stage runs again: it is under runs/reproduce, which belongs to reproduce alone. When it
    cannot be removed, one line says what to do."""
    folder = _run_out(args)
    if folder is None or not (folder.exists() or folder.is_symlink()):
        return None
    if _finished_run(folder, args):
        times = [(folder / f).stat().st_mtime for f in ("config.json", "summary.json")]
        return folder, max(0.0, times[1] - times[0])
    console.print(f"      replacing {folder}: not this stage's finished record", highlight=False)
    try:
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
        else:
            folder.unlink()
    except OSError as e:
        fail(f"reproduce: cannot remove {folder}, which is not this stage's finished record "
             f"({e.strerror or e}); remove it by hand and run `omnibench reproduce --resume` again", code=1)
    return None


def _finished_run(folder: Path, args: list[str]) -> bool:
    """`folder` holds a finished run record made by the command `args` (system, workload, ranks, steps,
    pipeline and the techniques switched off)."""
    from omnibench.plots.load import PlotInputError, read_run

    if folder.is_symlink() or not (folder / "summary.json").is_file() or not (folder / "steps.jsonl").is_file():
        return False
    try:
        spec = read_run(folder).spec
    except (PlotInputError, OSError):
        return False

    def given(flag: str) -> str | None:
        return args[args.index(flag) + 1] if flag in args else None

    want = {k: given(f"--{k}") for k in ("system", "workload", "nproc", "steps", "pp", "microbatches")}
    if any(v is not None and str(spec.get(k)) != v for k, v in want.items()):
        return False
    off = {a.removeprefix("--no-").replace("-", "_") for a in args if a.startswith("--no-")}
    return off == {k for k, v in (spec.get("options") or {}).items() if v is False}


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def ablation_inputs(sweep: list, ablated: list, sims_dir: Path) -> tuple:
    """What the two ablation figures of `reproduce` draw, from its tuned H100 records: (the one-off
    ablation's records, the cumulative ablation's, the cumulative steps' notes). Each is drawn beside the
    tuned comparison's mixed_video records (omni itself and the baselines at their own layouts). A
    cumulative step whose kept layout stops fitting has no record, only its stage's note ("does not fit:
    ..."), keyed by the technique it adds (figures.CUMULATIVE)."""
    from omnibench.plots.load import Records

    compared = [r for r in sweep if r.workload == "mixed_video"]
    steps = [r for r in ablated if (r.config.get("options") or {}).get("loading") == "global"]
    notes = {k.removeprefix(CUMULATIVE_PREFIX).rsplit("-", 1)[0].replace("-", "_"): why
             for k, why in _read_notes(sims_dir).items() if k.startswith(CUMULATIVE_PREFIX)}
    return (Records(sims=compared + [r for r in ablated if r not in steps]), Records(sims=compared + steps), notes)


def _cumulative_flags() -> list[list[str]]:
    """`simulate`'s switches for each cumulative step before the last (omni itself): its techniques off,
    the grouped reorder among them, and the baselines' loading in its place."""
    from omnibench.plots.figures import TECHNIQUES, cumulative_off

    return [[*(f"--no-{t.replace('_', '-')}" for t in cumulative_off(k)), "--option", "loading=global"]
            for k in range(len(TECHNIQUES))]


def _stages(runs_dir: Path, sims_dir: Path, systems: list[str], quick: bool, repeat: int = 1,
            tune_budget: int | None = None, sweep: SweepArgs = SweepArgs(), extended: bool = False) -> list[Stage]:
    stages = _run_stages(runs_dir, sims_dir, systems, quick, repeat)
    stages += _one_layout_stages(sims_dir, systems, quick, sweep)
    tuned = _TunedStages(sims_dir, systems, quick, tune_budget, sweep)
    stages += tuned.comparison()
    stages += tuned.ablations()
    stages += tuned.second_hardware()
    stages += tuned.memory()
    stages += tuned.conditions()
    stages += tuned.largest()
    if extended:
        stages += _extended_stages(systems, quick, sims_dir, tuned.workloads, tuned.dynamic_runs,
                                   tuned.dynamic_args, tuned.tuned, tuned.seeded, tuned.seeded_search,
                                   tuned.seeded_tag, tuned.cost)
    return stages


def _run_stages(runs_dir: Path, sims_dir: Path, systems: list[str], quick: bool, repeat: int) -> list[Stage]:
    """1. real runs on the CPU, and the simulator calibrated on them."""
    stages: list[Stage] = []
    steps = "3" if quick else "5"
    run_s = 8.0 if quick else 11.0
    run_workloads = ["mixed_video"] if quick else ["mixed_video", "image_sft"]
    # 1. real runs on the CPU: 2 ranks, tiny model (the default preset on CPU)
    for k in range(repeat):  # repeat k > 0 writes <system>-<workload>-r<k>: the same run again
        suffix = f"-r{k}" if k else ""
        for wl in run_workloads:
            for s in systems:
                stages.append(Stage(f"run-{s}-{wl}{suffix}",
                                    f"run {s} on {wl} (2 CPU ranks, {steps} steps)"
                                    + (f", repeat {k + 1} of {repeat}" if repeat > 1 else ""),
                                    ["run", "--system", s, "--workload", wl, "--nproc", "2", "--steps", steps,
                                     "--out", str(runs_dir / f"{s}-{wl}{suffix}"), "--json"], run_s))
    if "omni" in systems:  # the ablation: one technique off at a time
        for tech in ABLATIONS[:1] if quick else ABLATIONS:
            stages.append(Stage(f"run-omni-no-{tech}", f"run omni without {tech} on mixed_video",
                                ["run", "--system", "omni", "--workload", "mixed_video", "--nproc", "2", "--steps",
                                 steps, f"--no-{tech}", "--out", str(runs_dir / f"omni-no-{tech}-mixed_video"),
                                 "--json"], run_s))
    # a pipelined run: its measured timeline shows real pipeline bubbles
    stages.append(Stage("run-homogeneous-pp2", "pipelined run (homogeneous, pp 2)",
                        ["run", "--system", "homogeneous", "--workload", "mixed_video", "--nproc", "2", "--pp", "2",
                         "--microbatches", "4", "--steps", steps, "--out",
                         str(runs_dir / "homogeneous-pp2-mixed_video"), "--json"], run_s))

    # the simulator fitted to these runs (validation shows datasheet and calibrated costs against them)
    def calibrate_args() -> list[str]:
        finished = sorted(str(p) for p in runs_dir.iterdir() if p.is_dir() and not p.name.endswith(".incomplete"))
        return ["calibrate", *finished, "--out", str(sims_dir / "calibration.json")]

    stages.append(Stage("calibrate", "calibrate the simulator on the runs", calibrate_args, 3.0))
    return stages


def _one_layout_stages(sims_dir: Path, systems: list[str], quick: bool, sweep: SweepArgs) -> list[Stage]:
    """2. simulations: one layout for every system (TP 4 inside a node, full recomputation to fit 80 GB)."""
    sim_common = ["--system", ",".join(systems), "--hardware", "h100", "--model", "omni-7b", "--tp", "4",
                  "--recompute", "full", "--out", str(sims_dir), "--json", *sweep.run_args()]
    sizes = "256,1024" if quick else "256,512,1024,2048,4096,8192"
    stages = [Stage("sim-scaling", f"simulate mixed_video at {sizes} GPUs",
                    ["simulate", "--workload", "mixed_video", "--gpus", sizes, *sim_common],
                    25.0 if quick else 120.0)]
    # a pipelined layout (PP 4) at 256 GPUs: its traces show pipeline bubbles and what fills them
    piped = [s for s in systems if s not in ("temporal", "spatial")]  # neither has a pipeline
    stages.append(Stage("sim-pipelined", "simulate a pipelined layout (pp 4) at 256 GPUs",
                        ["simulate", "--workload", "mixed_video", "--gpus", "256", "--pp", "4", "--microbatches",
                         "8", *sim_common[2:], "--system", ",".join(piped)], 8.0))
    return stages


class _TunedStages:
    """3.-7. the stages that tune every system (the tuned comparison, its ablations, a second machine,
    memory errors, the condition grid, the largest clusters), and what their commands and estimates
    share: each tune checked at twice its budget and kept in tuned-layouts.json for the stages after
    it (and --resume)."""

    def __init__(self, sims_dir: Path, systems: list[str], quick: bool, tune_budget: int | None, sweep: SweepArgs):
        self.sims_dir, self.systems, self.quick, self.sweep = sims_dir, systems, quick, sweep
        budget = (TUNE_BUDGET_QUICK if quick else TUNE_BUDGET) if tune_budget is None else tune_budget
        self.search = ["--tune-budget", str(budget)] if budget else ["--tune-fraction", str(sweep.tune_fraction)]
        self.tag = f"b{budget}" if budget else f"f{sweep.tune_fraction}"
        self.gpus = SWEEP_GPUS_QUICK if quick else SWEEP_GPUS
        largest = LARGEST_GPUS_QUICK if quick else LARGEST_GPUS
        self.cache = str(sims_dir / "tuned-layouts.json")
        self.tuned_common = self.tuned(sims_dir, self.search)
        # Every tune after the first starts from what won for the same system in the stages before it (tune.Seed:
        # the layouts in the tune cache when it starts, written to seeds/<stage>.json, which its command names):
        # a first wave that holds them settles at half the budget (the seeds are simulated on top), and the
        # condition grid's video-heavy cells no longer miss omni's tp 1 / cp 4
        seeded_budget = max(TUNE_BUDGET_QUICK, budget // 2) if budget else 0
        self.seeded_search = ["--tune-budget", str(seeded_budget)] if budget else self.search
        self.seeded_tag = (f"b{seeded_budget}" if budget else f"f{sweep.tune_fraction}") + "s"
        # estimated wall seconds on 2 quiet cores, for stages results/reproduce-stages.csv does not time (`_measured`
        # uses the CSV's seconds where it names the stage): the tune of one system at a size (budget 8, checked at
        # 16 and doubled while it moves: 12-60 simulated layouts; a fraction of the space is about 3x that; seeded
        # at half the budget: SEEDED_SCALE of it) and the simulation of one of its steps
        per_layout = 1.0 if budget else 3.0
        # (above 1,024 GPUs a search started from smaller sizes' answers simulates fewer layouts: in
        # results/reproduce-stages.csv the 8,192-GPU mixed_video stage took 550 s against the 1,024-GPU one's 426 s,
        # not 8x, hence the square root)
        self.tune_s = {n: (1.0 if quick else 25.0 * per_layout * (n / 1024 if n <= 1024 else (n / 1024) ** 0.5))
                       for n in (*self.gpus, largest, *CONDITION_GPUS, *(n for _, n in (*LARGEST, *LARGEST_QUICK)),
                                 *EXTENDED_GPUS, *EXTENDED_GPUS_QUICK)}
        self.step_s = {n: (0.4 if quick else 1.0 * n / 1024) for n in self.tune_s}
        self.workloads = ["mixed_video"] if quick else list(STATIC_WORKLOADS)
        self.dynamic_runs = DYNAMIC_RUNS_QUICK if quick else DYNAMIC_RUNS
        self.at = _sizes(self.gpus)
        self.baselines = [s for s in systems if s != "omni"]

    def tuned(self, out: Path, how: list[str], hardware: str = "h100", model: str = "omni-7b") -> list[str]:
        return ["--hardware", hardware, "--model", model, "--tuned", *how, "--check-convergence", "--tune-cache",
                self.cache, "--out", str(out), "--json", *self.sweep.run_args()]

    def seeded(self, key: str, workload: str | None = None) -> tuple[list[str], Callable[[], None]]:
        path = self.sims_dir / "seeds" / f"{key}.json"
        cache = self.cache

        def prepare() -> None:  # a stage run again (--resume) reads the seeds it was given the first time
            if not path.is_file():
                write_seeds(Path(cache), path, workload)
        return ["--seed-from", str(path)], prepare

    def dynamic_args(self, wl: str) -> list[str]:  # its steps, and the layouts tuned on TUNE_STEPS_DYNAMIC of them
        extra = list(self.dynamic_runs.get(wl, ()))
        if extra:
            extra += ["--tune-steps", str(min(TUNE_STEPS_DYNAMIC, int(extra[extra.index("--steps") + 1])))]
        return extra

    def cost(self, wl: str, n: int, tune_scale: float = 1.0) -> float:
        extra = self.dynamic_runs.get(wl, ())
        n_steps = int(extra[extra.index("--steps") + 1]) if extra else 1
        k = min(TUNE_STEPS_DYNAMIC, n_steps)
        return len(self.systems) * (k * self.tune_s[n] * tune_scale + n_steps * self.step_s[n])

    def as_deployed(self, key: str, wl: str, args: list[str], n_steps: int, prepare=None) -> list[Stage]:
        """The same cell with the baselines as their anchors deploy them (every batch split by token
        counts: `--option balancer=tokens`) at the layouts the full-strength stage tuned (its tune cache
        answers: the key holds no balancer), beside it."""
        if not self.baselines:
            return []
        where = args.index("--out") + 1
        args = [*args[:where], str(self.sims_dir / "as-deployed"), *args[where + 1:]]
        args[args.index("--system") + 1] = ",".join(self.baselines)
        return [Stage(f"{key}-as-deployed", f"the baselines on {wl} at {self.at} GPUs as deployed (balanced by "
                      "tokens), at their tuned layouts", [*args, "--option", "balancer=tokens"],
                      len(self.baselines) * sum(n_steps * self.step_s[n] for n in self.gpus), prepare=prepare)]

    def comparison(self) -> list[Stage]:
        """3. the tuned comparison: every system at its own layout (tuned once, kept for every step), on
        every workload, each beside the baselines as deployed."""
        stages: list[Stage] = []
        systems, gpus, at = ",".join(self.systems), _csv(self.gpus), self.at
        for i, wl in enumerate(self.workloads):
            if i == 0:  # the first tune: nothing won before it, so a full budget
                args = ["simulate", "--workload", wl, "--system", systems, "--gpus", gpus, *self.tuned_common]
                stages.append(Stage(f"tuned-{wl}-{self.tag}", f"tune every system on {wl} at {at} GPUs, simulate it "
                                    "there", args, sum(self.cost(wl, n) for n in self.gpus)))
                stages += self.as_deployed(f"tuned-{wl}-{self.tag}", wl, args, 1)
                continue
            key = f"tuned-{wl}-{self.seeded_tag}"
            seed_args, prepare = self.seeded(key)
            args = ["simulate", "--workload", wl, "--system", systems, "--gpus", gpus,
                    *self.tuned(self.sims_dir, self.seeded_search), *seed_args]
            stages.append(Stage(key, f"tune every system on {wl} at {at} GPUs from the layouts that won before, "
                                "simulate it there", args, sum(self.cost(wl, n, SEEDED_SCALE) for n in self.gpus),
                                prepare=prepare))
            stages += self.as_deployed(key, wl, args, 1, prepare)
        for wl, extra in self.dynamic_runs.items():
            n_steps = int(extra[extra.index("--steps") + 1])
            k = min(TUNE_STEPS_DYNAMIC, n_steps)
            key = f"tuned-{wl}-{self.seeded_tag}"
            seed_args, prepare = self.seeded(key)
            args = ["simulate", "--workload", wl, "--system", systems, "--gpus", gpus,
                    *self.dynamic_args(wl), *self.tuned(self.sims_dir, self.seeded_search), *seed_args]
            stages.append(Stage(key, f"{wl} over {n_steps} steps at {at} GPUs, layouts tuned on {k} of them (calmest "
                                "to burstiest) from the layouts that won before, and kept", args,
                                sum(self.cost(wl, n, SEEDED_SCALE) for n in self.gpus), prepare=prepare))
            stages += self.as_deployed(key, wl, args, n_steps, prepare)
        return stages

    def ablations(self) -> list[Stage]:
        """The ablation at omni's own tuned layout (from the cache: no tune again), one technique off at a
        time and cumulatively."""
        if "omni" not in self.systems:
            return []
        stages: list[Stage] = []
        n = self.gpus[0]
        for tech in SIM_ABLATIONS[:1] if self.quick else SIM_ABLATIONS:
            stages.append(Stage(f"tuned-omni-no-{tech}-{self.tag}", f"simulate omni without {tech} at its tuned layout, "
                                f"{n:,} GPUs", ["simulate", "--workload", "mixed_video", "--system", "omni",
                                                "--gpus", str(n), f"--no-{tech}", *self.tuned_common],
                                self.step_s[n] * 2, no_fit_is_an_answer=True))
        stages += self.spatial_quotas(n)
        # and cumulatively: from the decoupled layout alone, with the baselines' loading, technique by technique
        from omnibench.plots.figures import CUMULATIVE

        for (name, label), flags in list(zip(CUMULATIVE[:-1], _cumulative_flags(), strict=True))[:1 if self.quick else None]:
            stages.append(Stage(f"{CUMULATIVE_PREFIX}{name.replace('_', '-')}-{self.tag}",
                                f"simulate omni at its tuned layout, {n:,} GPUs, cumulative ablation: {label}",
                                ["simulate", "--workload", "mixed_video", "--system", "omni", "--gpus", str(n),
                                 *flags, *self.tuned_common], self.step_s[n] * 2, no_fit_is_an_answer=True))
        return stages

    def spatial_quotas(self, n: int) -> list[Stage]:
        """spatial at its tuned layout on mixed_video with the quota its tune did not pick: a fixed even split,
        and the per-phase share by the balancer (`auto`): what searching the quota buys."""
        if "spatial" not in self.systems:
            return []
        return [Stage(f"spatial-quota-{q}-{self.tag}", f"simulate spatial at its tuned layout with quota {q}, {n:,} GPUs",
                      ["simulate", "--workload", "mixed_video", "--system", "spatial", "--gpus", str(n),
                       "--option", f"quota={q}", *self.tuned_common], self.step_s[n] * 2, no_fit_is_an_answer=True)
                for q in SPATIAL_ABLATION_QUOTAS]

    def second_hardware(self) -> list[Stage]:
        """4. a second machine (same compute, 141 GB), a figure of its own."""
        stages: list[Stage] = []
        n = self.gpus[0]
        for wl in [w for w in self.workloads if w in SECOND_HARDWARE_WORKLOADS]:
            key = f"tuned-{wl}-{SECOND_HARDWARE}-{self.seeded_tag}"
            seed_args, prepare = self.seeded(key)
            stages.append(Stage(key, f"tune every system on {wl} at {n:,} {SECOND_HARDWARE.upper()}s from the "
                                "layouts that won before, simulate it there",
                                ["simulate", "--workload", wl, "--system", ",".join(self.systems), "--gpus", str(n),
                                 *self.tuned(self.sims_dir / SECOND_HARDWARE, self.seeded_search,
                                             hardware=SECOND_HARDWARE),
                                 *seed_args], self.cost(wl, n, SEEDED_SCALE), prepare=prepare))
        return stages

    def memory(self) -> list[Stage]:
        """5. memory sensitivity: every system tuned again and judged as if each memory estimate were off by
        -20% / +20% (the step cache answers the layouts already simulated: the error moves no time)."""
        stages: list[Stage] = []
        n = self.gpus[0]
        for wl in MEMORY_WORKLOADS:
            extra = self.dynamic_args(wl)
            for err in MEMORY_ERRORS:
                key = f"memory-{wl}-{err:+.2f}-{self.seeded_tag}"
                seed_args, prepare = self.seeded(key)
                stages.append(Stage(key, f"{wl} at {n:,} GPUs, every system tuned as if memory were {abs(err):.0%} "
                                    f"{'under' if err > 0 else 'over'}-estimated",
                                    ["simulate", "--workload", wl, "--system", ",".join(self.systems), "--gpus", str(n),
                                     *extra, "--memory-error", str(err),
                                     *self.tuned(self.sims_dir / "memory", self.seeded_search), *seed_args],
                                    self.cost(wl, n, SEEDED_SCALE * 0.5), prepare=prepare))  # the step cache answers half
        return stages

    def conditions(self) -> list[Stage]:
        """6. the condition grid (workloads/conditions.py): where decoupling pays, every system tuned per cell
        at a small fixed budget whose convergence the figure's caption reports, seeded with every answer
        before it."""
        stages: list[Stage] = []
        grid_dir, cond_dir = self.sims_dir / "conditions" / "grid", self.sims_dir / "conditions"
        cond_gpus = CONDITION_GPUS_QUICK if self.quick else CONDITION_GPUS
        cond_budget = TUNE_BUDGET_QUICK if self.quick else CONDITION_BUDGET
        for model in CONDITION_MODELS_QUICK if self.quick else CONDITION_MODELS:
            for share, sigma in _grid_cells(self.quick):
                cell = grid_dir / f"{cell_name(share, sigma)}.toml"
                key = f"conditions-{model}-{cell.stem}-b{cond_budget}s"
                seed_args, prepare = self.seeded(key)
                stages.append(Stage(key, f"condition cell {cell.stem} ({model}) at {_sizes(cond_gpus)} GPUs, every "
                                    "system tuned",
                                    _cell_args(cell, share, sigma,
                                               ["simulate", "--workload", str(cell), "--system", ",".join(self.systems),
                                                "--gpus", _csv(cond_gpus),
                                                *self.tuned(cond_dir, ["--tune-budget", str(cond_budget)], model=model),
                                                *seed_args]),
                                    sum(len(self.systems) * (self.tune_s[n] * 0.5 + self.step_s[n]) for n in cond_gpus),
                                    prepare=prepare))
        return stages

    def largest(self) -> list[Stage]:
        """7. the largest clusters, last (their simulations are the dearest: 4-8x a 1,024-GPU step each), seeded
        with the same workload's answers at the sizes and on the machines before them (each seed costs a
        simulation at this size; per-GPU work is the same at every size). Searched alone at 8,192 GPUs, omni's
        tune settled on tp 4 (4 -> 8 layouts moved 0%) and missed tp 1 / cp 4, 1.36x faster."""
        stages: list[Stage] = []
        for wl, n in LARGEST_QUICK if self.quick else LARGEST:
            extra = self.dynamic_args(wl)
            key = f"largest-{wl}-{n}-{self.seeded_tag}"
            seed_args, prepare = self.seeded(key, wl)
            stages.append(Stage(key, f"tune every system on {wl} at {n:,} GPUs from the layouts that won before, "
                                "simulate it there" + (f" ({extra[extra.index('--steps') + 1]} steps)" if extra else ""),
                                ["simulate", "--workload", wl, "--system", ",".join(self.systems), "--gpus", str(n),
                                 *extra, *self.tuned(self.sims_dir, self.seeded_search), *seed_args],
                                self.cost(wl, n, SEEDED_SCALE), prepare=prepare))
        return stages


def _extended_stages(systems, quick, sims_dir, workloads, dynamic_runs, dynamic_args, tuned, seeded, seeded_search,
                     seeded_tag, cost) -> list[Stage]:
    """`reproduce --extended` (EXTENDED_GPUS): the cheap cells first (1,024 H200s, the static workloads), then
    the larger H100 clusters, bursty_mix on 1,024 H200s last (its 16 steps are the dearest). Each seeded with the same
    workload's answers before it (as the default plan's largest clusters are: a seed costs a simulation at
    the stage's size), so the order of stages of different workloads changes no answer. Their tunes grew about
    linearly with the GPUs (4,096: 187-494 s, 8,192: 389-1,309 s on 2 cores, results/reproduce-stages.csv),
    not as the square root the default plan's seeded 8,192-GPU stage showed: hence the estimate's factor."""
    stages: list[Stage] = []
    gpus = (SWEEP_GPUS_QUICK if quick else SWEEP_GPUS)[0]
    have = set(LARGEST_QUICK if quick else LARGEST)

    def add(wl: str, n: int, hardware: str) -> None:
        key = f"extended-{wl}-{n}-{hardware}-{seeded_tag}"
        seed_args, prepare = seeded(key, wl)
        out = sims_dir / hardware if hardware != "h100" else sims_dir
        extra = dynamic_args(wl)
        stages.append(Stage(key, f"--extended: tune every system on {wl} at {n:,} {hardware.upper()}s from the layouts "
                            "that won before, simulate it there"
                            + (f" ({extra[extra.index('--steps') + 1]} steps)" if extra else ""),
                            ["simulate", "--workload", wl, "--system", ",".join(systems), "--gpus", str(n), *extra,
                             *tuned(out, seeded_search, hardware=hardware), *seed_args],
                            cost(wl, n, SEEDED_SCALE * max(1.0, (n / 1024) ** 0.5)), prepare=prepare))

    second = [w for w in (*workloads, *dynamic_runs) if w not in SECOND_HARDWARE_WORKLOADS]
    for wl in [w for w in second if w != "bursty_mix"]:
        add(wl, gpus, SECOND_HARDWARE)
    for n in EXTENDED_GPUS_QUICK if quick else EXTENDED_GPUS:
        for wl in workloads:
            if (wl, n) not in have:
                add(wl, n, "h100")
    if "bursty_mix" in second:
        add("bursty_mix", gpus, SECOND_HARDWARE)
    return stages


def write_seeds(tune_cache: Path, path: Path, workload: str | None = None) -> None:
    """The seeds file a stage's `--seed-from` names: each system's answer and runner-up (SEEDS_PER_TUNE
    distinct layouts: the entry's `prior`) at each workload, size, machine and grid cell the tune cache
    holds (tuned with nominal memory estimates; only `workload`'s when given), each layout once."""
    import json

    from omnibench.tune import Candidate, Seed
    from simulator.traces import write_json_atomic

    try:
        entries = json.loads(tune_cache.read_text()) if tune_cache.is_file() else {}
        if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
            raise ValueError("expected {key: tune}")
    except (OSError, ValueError) as e:
        fail(f"reproduce: {tune_cache} is not a tune cache ({e}); remove it (its tunes are searched again) and run "
             "`omnibench reproduce --resume`", code=1)
    rows, seen = [], set()
    for e in entries.values():
        if "candidate" not in e or e.get("memory_error") or (workload and e.get("workload") != workload):
            continue
        source = f"{Path(str(e.get('workload'))).stem} {int(e['gpus']):,} {e.get('hardware')}"
        top = [Candidate(**e["candidate"])] + [Candidate(**t) for t in (e.get("prior") or {}).get("top", [])]
        ranked = list(dict.fromkeys(top))[:SEEDS_PER_TUNE]
        for i, c in enumerate(ranked):
            if (c, e.get("model")) not in seen:
                seen.add((c, e.get("model")))
                rows.append({**Seed(c, int(e["gpus"]), source + (" (runner-up)" if i else "")).row(),
                             "model": e.get("model")})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"from": str(tune_cache), "seeds": rows})


def _csv(sizes) -> str:
    return ",".join(str(n) for n in sizes)


def _sizes(sizes) -> str:
    return ", ".join(f"{n:,}" for n in sizes)


def _grid_cells(quick: bool) -> list[tuple[float, float]]:
    from workloads.conditions import SIGMAS

    shares, sigmas = (CONDITION_SHARES_QUICK, CONDITION_SIGMAS_QUICK) if quick else (CONDITION_SHARES, SIGMAS)
    return [(share, sigma) for sigma in sigmas for share in shares]


def _cell_args(cell: Path, share: float, sigma: float, args: list[str]) -> Callable[[], list[str]]:
    """A stage's arguments, written when it starts: the grid cell's workload file first (a user can rerun
    the command; the file stays beside the records)."""
    def make() -> list[str]:
        from workloads.conditions import cell_toml

        cell.parent.mkdir(parents=True, exist_ok=True)
        with writing(cell):
            atomic_write(cell, cell_toml(share, sigma))
        return args

    return make


CONVERGENCE_COLUMNS = ["system", "workload", "gpus", "hardware", "model", "memory_error", "layout", "space", "budget",
                       "budget_2x", "best_s", "best_s_2x", "moved", "converged", "seeds", "seeds_best_s", "over_seeds",
                       "tuned_at_steps", "simulated", "tune_seconds"]


def convergence_rows(tune_cache: Path) -> list[dict]:
    """One row per tune `reproduce` ran (its tuned-layouts.json): did doubling the budget move the best?"""
    import json

    if not tune_cache.is_file():
        return []
    rows = []
    for entry in json.loads(tune_cache.read_text()).values():
        conv = entry.get("convergence")
        if not conv or "system" not in entry:
            continue
        rows.append({**{k: entry.get(k) for k in ("system", "gpus", "hardware", "model", "space", "simulated",
                                                   "tune_seconds")},
                     "workload": Path(str(entry.get("workload"))).stem, "memory_error": entry.get("memory_error", 0.0),
                     "layout": entry.get("label"), "seeds": len(entry.get("seeds") or []),
                     "seeds_best_s": None, "over_seeds": None, **conv,
                     "tuned_at_steps": " ".join(str(k) for k in entry.get("tuned_at_steps", []))})
    return sorted(rows, key=lambda r: (str(r["hardware"]), str(r["model"]), r["memory_error"] or 0.0, r["workload"],
                                       r["gpus"], r["system"]))

"""`omnibench tune`: search a system's layouts with the simulator (omnibench/tune/)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from omnibench.cli.common import FREEZE_HELP, MAX_GPUS, batch_error, console, fail, freeze_option, in_panels
from omnibench.cli.simulate import (
    HARDWARE_HELP,
    MEMORY_ERROR_HELP,
    MIXED_PRECISION_HELP,
    STACK_HELP,
    check_memory_error,
    check_mixed_precision,
)

TUNE_HELP = """Search the layouts SYSTEM can take with the simulator and print the fastest few.

Space: LLM tp (dividing heads and kv heads, inside a node), pp, cp inside a node, as Ulysses (tp*cp
dividing the kv heads) or with all-gathered K/V (Llama 3's context parallelism, any cp),
ep (MoE only); temporal and spatial search VeOmni's space: tp 1, pp 1, cp (its one Ulysses degree for
encoders and LLM, dividing the encoders' heads too) and FSDP over all ranks; every microbatch count
of {1, 2, 4} at pp 1 and {pp, 2pp, 4pp} with pipelining (and the system's own default); virtual
stages 2 (where pp divides the depth; refused while a planner cannot interleave); recomputation per
module (none, selective, full, the encoders fully recomputed under an LLM at none or selective, the
LLM alone at full); then around the best layouts the encoder knobs: encoder tp (colocated,
noncolocated, omni), encoder sp (omni), the encoders' share of ranks (noncolocated), the encoders'
quota (spatial); last, from the best, the layouts one change away (tp, pp, cp, microbatches halved or
doubled, the other cp kind, every recompute mode, the encoder knobs, the data-parallel modes where
--dp-mode fixes none), again around the fastest of them until none is faster.

Pruned analytically before any simulation: a per-rank memory lower bound (parameter-shard
training state under the planners' HSDP groups + activations of the microbatches 1F1B keeps in
flight, at least the batch's largest sample) drops layouts over the device's memory and settles
each layout's fastest fitting recompute mode; the survivors are ordered by an analytic step time
(compute at the datasheet's matmul rate, the 1F1B bubble, tp/cp exchanges over NVLink) and the
first --budget are simulated (default: --budget-fraction of them), the system's default layout
(its anchor's usual one, as `omnibench plan` prints it) always among them. The simulator's memory
estimate is the final word: a layout it finds too big is retried with more recomputation, and the
smallest simulated/bound ratio seen so far scales the bound for the layouts still to come.

Simulations run in waves on every core (--workers) or on a Ray cluster (--ray), the same result
either way, and go through the step cache (--no-cache to bypass). --check-convergence searches
again at twice the budget (reusing what was simulated) and reports how far the best moved.
--memory-error E searches as if every memory estimate were off by E (the bound and the simulator's
verdict alike), for how a verdict that rests on what fits moves when memory is mispredicted."""


def _batches(workload: str, seed: int, tokens: int, steps: int, start: int, window: int = 0):
    from omnibench.tune import regime_batches
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(workload, seed=seed, global_batch_tokens=tokens)
    if window:
        return regime_batches([stream.batch(start + s) for s in range(window)], steps)
    return [stream.batch(start + s) for s in range(steps)]


def run_tune(system: str, workload: str, n: int, model: str, hardware: str, steps: int, start_step: int,
             seed: int, global_batch_tokens: int, budget: int, calibration: str | None, options: dict | None = None,
             log=None, *, fraction: float | None = None, window: int = 0, converge: bool = False, sweep=None,
             use_cache: bool = True, stack: str = "eager", dp_mode: str | None = None, memory_error: float = 0.0,
             seeds: list | None = None, mixed_precision: str = "autocast", cp_kinds: tuple[str, ...] | None = None,
             freeze: tuple[str, ...] = ()):
    """`omnibench tune`'s search: the one `simulate --tuned` runs (`omnibench.cli.simulate._search`) on the
    batches these arguments pick; raises ValueError with a one-line message. tune settles each layout's
    recompute mode itself (the cheapest that fits), so there is no --recompute. `freeze`: the modules that
    do not train (--freeze), checked against `model` and kept to what runs of it."""
    from omnibench.cli.simulate import _search
    from omnibench.resolve import model_for_workload
    from omnibench.specs.model import freeze_for_model
    from omnibench.specs.presets import get_model
    from simulator.calibrate import Profile
    from simulator.hardware import load_cluster
    from workloads.registry import get_workload

    spec = get_model(model_for_workload(model, get_workload(workload))[0])
    freeze = freeze_for_model(tuple(freeze), get_model(model), spec)
    cluster = load_cluster(hardware, n)
    profile = Profile.load(calibration) if calibration else None
    batches = _batches(workload, seed, global_batch_tokens or 8192 * n, steps, start_step, window)
    return _search(system, spec, batches, cluster, profile, budget, dict(options or {}), hardware, fraction=fraction,
                   converge=converge, sweep=sweep, use_cache=use_cache, stack=stack, dp_mode=dp_mode,
                   memory_error=memory_error, seeds=seeds, mixed_precision=mixed_precision, freeze=freeze,
                   cp_kinds=cp_kinds, log=log)


def check_sweep_options(workers: int | None, fraction: float | None = None, budget: int = 0) -> None:
    """One-line errors for the sweep options shared by tune, simulate and reproduce."""
    if workers is not None and workers < 1:
        fail(f"workers must be a positive integer (default: every core), got {workers}")
    if fraction is not None and not 0 < fraction <= 1:
        fail(f"budget-fraction must be in (0, 1] (a share of the layouts left after pruning), got {fraction}")
    if budget < 0:
        fail(f"budget must be >= 0 (0: --budget-fraction of the space), got {budget}")


TUNE_PANELS = {
    "Workload and model": ("system", "workload", "gpus", "model", "global_batch_tokens", "steps", "window",
                           "start_step", "seed"),
    "Machine and software": ("hardware", "stack", "calibration"),
    "Layout": ("dp_mode", "mixed_precision", "cp_kinds"),
    "Memory": ("freeze", "memory_error"),
    "Tuning": ("budget", "fraction", "check_convergence", "seed_from"),
    "Sweeps": ("workers", "ray", "no_cache"),
    "Output": ("top", "as_json", "verbose"),
}


def register(app: typer.Typer) -> None:
    def tune(
        system: str = typer.Option(..., "--system", "-s", help="A system name."),
        workload: str = typer.Option(..., "--workload", "-w", help="Named workload or a workload file."),
        gpus: int = typer.Option(..., "--gpus", help="Cluster size."),
        model: str = typer.Option("omni-7b", "--model", "-m", help="Preset, TOML/YAML file or HF config.json."),
        hardware: str = typer.Option("h100", "--hardware", help=HARDWARE_HELP),
        stack: str = typer.Option("eager", "--stack", help=STACK_HELP),
        dp_mode: str = typer.Option(None, "--dp-mode", help="ddp | zero1 | zero2 | fsdp | hsdp for every layout; "
                                    "default: the system's."),
        mixed_precision: str = typer.Option("autocast", "--mixed-precision", help=MIXED_PRECISION_HELP),
        freeze: str = typer.Option("", "--freeze", help=FREEZE_HELP),
        cp_kinds: str = typer.Option("ulysses,allgather", "--cp-kinds", help="Context-parallel kinds searched "
                                     "(comma-separated): ulysses, allgather."),
        steps: int = typer.Option(1, "--steps", help="Batches each layout is simulated on (a layout fits only if "
                                  "it fits all)."),
        window: int = typer.Option(0, "--window", help="Pick the --steps batches from the first W of the stream "
                                   "by how bursty they are (calmest, median, burstiest for 3); 0: consecutive."),
        start_step: int = typer.Option(0, "--start-step", help="First batch of the stream."),
        seed: int = typer.Option(0, "--seed"),
        global_batch_tokens: int = typer.Option(0, "--global-batch-tokens", help="0: 8,192 per GPU."),
        budget: int = typer.Option(0, "--budget", help="Layouts simulated in the LLM phase (after pruning); 0: "
                                   "--budget-fraction of them."),
        fraction: float = typer.Option(None, "--budget-fraction", help="Share of the layouts left after pruning "
                                       "simulated when --budget is 0 (default 0.25, at least 4)."),
        check_convergence: bool = typer.Option(False, "--check-convergence", help="Search again at twice the "
                                               "budget; report how far the best step time moved (<= 2%: converged)."),
        top: int = typer.Option(5, "--top", help="Layouts printed."),
        calibration: str = typer.Option(None, "--calibration", help="Profile JSON from `omnibench calibrate`."),
        workers: int = typer.Option(None, "--workers", help="Simulations run at once (default: every core)."),
        ray: str = typer.Option(None, "--ray", help="Run the simulations on a Ray cluster: auto, local, or "
                                "ray://host:port (pip install 'omnibench[ray]')."),
        no_cache: bool = typer.Option(False, "--no-cache", help="Simulate everything again (no step cache)."),
        memory_error: float = typer.Option(0.0, "--memory-error", help=MEMORY_ERROR_HELP),
        seed_from: list[Path] = typer.Option([], "--seed-from", metavar="FILE", help="Start from the layouts that won for this "
                                             "system in these files (a tune cache or a seeds file; repeatable)."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every layout as it is simulated."),
    ) -> None:
        from omnibench.cli.simulate import _check_stack, _dp_fields, read_seeds
        from omnibench.specs.presets import get_model
        from omnibench.sweep import Sweep, SweepError
        from systems import available_systems

        _check_stack(stack)
        _dp_fields(dp_mode, 0)
        check_mixed_precision(mixed_precision, stack)
        frozen = freeze_option(freeze)
        from omnibench.tune import CP_KINDS_SEARCHED

        kinds = tuple(k.strip() for k in cp_kinds.split(",") if k.strip())
        if not kinds or any(k not in CP_KINDS_SEARCHED for k in kinds):
            fail(f"cp-kinds must be one or more of {', '.join(CP_KINDS_SEARCHED)}, comma-separated; got {cp_kinds!r}")
        if system not in available_systems():
            fail(f"system must be one of {', '.join(available_systems())}; got {system!r}")
        for name, v in (("gpus", gpus), ("steps", steps), ("top", top)):
            if v < 1:
                fail(f"{name} must be a positive integer, got {v}")
        if gpus > MAX_GPUS:
            fail(f"gpus must be at most {MAX_GPUS:,}, got {gpus:,}")
        if window and window < steps:
            fail(f"window must be 0 (consecutive batches) or at least --steps ({steps}), got {window}")
        check_sweep_options(workers, fraction, budget)
        check_memory_error(memory_error)
        try:
            seeds = read_seeds(seed_from, get_model(model).name) if seed_from else None
        except ValueError as e:
            fail(str(e))
        log = (lambda t: console.print(f"  {t.candidate.label():48s} "
                                       + (f"{t.step_s:.3f} s, {t.peak_gib:.1f} GiB" if t.simulated else t.note),
                                       highlight=False)) if verbose else None
        try:
            with Sweep(workers, ray, label=f"tune {system}", quiet=as_json) as sweep:
                res = run_tune(system, workload, gpus, model, hardware, steps, start_step, seed, global_batch_tokens,
                               budget, calibration, log=log, fraction=fraction, window=window,
                               converge=check_convergence, sweep=sweep, use_cache=not no_cache, stack=stack,
                               dp_mode=dp_mode, memory_error=memory_error, seeds=seeds,
                               mixed_precision=mixed_precision, cp_kinds=kinds, freeze=frozen)
        except SweepError as e:
            fail(str(e))
        except ValueError as e:
            fail(batch_error(e, gpus, global_batch_tokens))
        conv = res.convergence
        if as_json:
            print(json.dumps({"system": system, "gpus": gpus, "freeze": list(frozen), "enumerated": res.enumerated,
                              "pruned_memory": res.pruned_memory, "refused": res.refused, "space": res.space,
                              "budget": res.budget, "simulated": res.simulated, "steps": res.steps,
                              "seconds": res.seconds, "cp_kinds": list(kinds), "convergence": conv.row() if conv else None,
                              "best": res.best.row() if res.best else None, "default": res.default.row(),
                              "layouts": [t.row() for t in res.trials[:top]], "notes": res.notes[:20],
                              "seeds": [{**sd.row(), "as": tr.candidate.label() if tr else None,
                                         "step_s": tr.step_s if tr and tr.simulated else None,
                                         "fits": bool(tr and tr.fits)} for sd, tr in res.seeded]}, indent=1))
            return
        table = Table(title=f"{system}: {model} on {gpus} x {hardware}, workload {Path(workload).stem}, "
                            f"step(s) {', '.join(map(str, res.steps))}"
                            + (f", frozen: {', '.join(frozen)}" if frozen else ""))
        for col in ("#", "layout", "step s", "tok/s/GPU", "MFU", "GiB (est.)", "vs default"):
            table.add_column(col, justify="left" if col == "layout" else "right")
        d = res.default
        for i, t in enumerate(res.trials[:top], 1):
            vs = f"{d.step_s / t.step_s:.2f}x" if d.fits and t.fits else "-"
            gib = f"{t.peak_gib:.1f} ({t.estimate_gib:.1f})" if t.fits else f"[red]{t.peak_gib:.1f}[/]"
            table.add_row(str(i), t.candidate.label(), f"{t.step_s:.3f}", f"{t.tokens_per_s_per_gpu:,.0f}",
                          f"{t.mfu:.1%}", gib, vs)
        console.print(table)
        dl = f"{d.step_s:.3f} s, {d.tokens_per_s_per_gpu:,.0f} tok/s/GPU" if d.fits else "does not fit"
        console.print(f"default layout ({d.candidate.label()}): {dl}", highlight=False)
        console.print(f"{res.enumerated} layouts enumerated, {res.pruned_memory} pruned by the memory bound, "
                      f"{res.refused} refused by the layout rules; budget {res.budget} of the {res.space} left; "
                      f"{res.simulated} simulated in {res.seconds:.1f} s", highlight=False)
        if conv:
            verdict = "converged" if conv.converged else "[yellow]not converged[/]"
            console.print(f"convergence: best {conv.best_s:.3f} s at budget {conv.budget}, {conv.best_s_2x:.3f} s at "
                          f"{conv.budget_2x}: moved {conv.moved:.1%} ({verdict}, limit 2%)", highlight=False)
        if res.seeded:
            fast = res.seeds_best
            at, best = (res.time_of(fast), res.time_of(res.best)) if fast is not None else (0.0, 0.0)
            said = "none fitted" if fast is None else \
                f"the fastest {fast.candidate.label()} at {at:.3f} s" + (
                    ": the answer is a seed" if at <= best else f", beaten by {at / best - 1:.1%}")
            console.print(f"seeds: {len(res.seeded)} for {system}, {said}", highlight=False)
        for note in res.notes[:5]:
            console.print(f"note: {note}", highlight=False)

    app.command("tune", help=TUNE_HELP)(in_panels(tune, TUNE_PANELS))

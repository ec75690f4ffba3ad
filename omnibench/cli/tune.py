"""`omnibench tune`: search a system's layouts with the simulator (omnibench/tune.py)."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from omnibench.cli.common import MAX_GPUS, batch_error, console, fail
from omnibench.cli.simulate import HARDWARE_HELP, STACK_HELP

TUNE_HELP = """Search the layouts SYSTEM can take with the simulator and print the fastest few.

Space: LLM tp (dividing heads and kv heads, inside a node), pp, cp (tp*cp dividing the kv heads),
ep (MoE only); temporal searches VeOmni's space: tp 1, pp 1, cp (its one Ulysses degree for
encoders and LLM, dividing the encoders' heads too) and FSDP over all ranks; microbatches ({1, 2} at pp 1, {pp, 2pp, 4pp} with pipelining),
virtual stages 2 (where pp divides the depth; refused while a planner cannot interleave), then
around the best layouts the encoder knobs: encoder tp (colocated, noncolocated, omni), encoder sp
(omni), the encoders' share of ranks (noncolocated).

Pruned analytically before any simulation: a per-rank memory lower bound (parameter-shard
training state under the planners' HSDP groups + activations of the microbatches 1F1B keeps in
flight, at least the batch's largest sample) drops layouts over the device's memory and settles
each layout's cheapest fitting recompute mode; the survivors are ordered by an analytic step time
(compute at the datasheet's matmul rate, the 1F1B bubble, tp/cp exchanges over NVLink) and only
the first --budget are simulated, the system's default layout (its anchor's usual one, as `omnibench
plan` prints it: Megatron-style tp inside a node for homogeneous, colocated, noncolocated and omni;
VeOmni's tp 1 / pp 1 / Ulysses cp for temporal) always among them. The
simulator's memory estimate is the final word: a layout it finds too big is retried with more
recomputation, and the smallest simulated/bound ratio seen so far scales the bound for the
layouts still to come."""


def _batches(workload: str, seed: int, tokens: int, steps: int, start: int):
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(workload, seed=seed, global_batch_tokens=tokens)
    return [stream.batch(start + s) for s in range(steps)]


def run_tune(system: str, workload: str, n: int, model: str, hardware: str, steps: int, start_step: int,
             seed: int, global_batch_tokens: int, budget: int, calibration: str | None, options: dict | None = None,
             log=None, stack: str = "eager", dp_mode: str | None = None):
    """Shared by `tune` and `simulate --tuned`; raises ValueError with a one-line message. The search
    starts from the layout omnibench/resolve.py settles (the system's default layout); tune settles
    each layout's recompute mode itself (the cheapest that fits), so there is no --recompute."""
    from omnibench.resolve import resolve_layout
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from omnibench.tune import Candidate, tune
    from simulator.calibrate import Profile
    from simulator.hardware import load_cluster

    spec = get_model(model)
    cluster = load_cluster(hardware, n)
    profile = Profile.load(calibration) if calibration else None
    batches = _batches(workload, seed, global_batch_tokens or 8192 * n, steps, start_step)
    if profile is None:
        from omnibench.cli.simulate import planner_options

        options = planner_options(system, options or {}, hardware)
    laid = resolve_layout(system, spec, ParallelSpec(world_size=n, gpus_per_node=cluster.gpus_per_node,
                                                     options=dict(options or {})), batches, cluster, recompute="none")
    start = Candidate(system, tp=laid.parallel.tp, pp=laid.parallel.pp, cp=laid.parallel.cp)
    return tune(system, spec, batches, cluster, profile=profile, budget=budget, options=options, log=log,
                stack=stack, dp_mode=dp_mode, default=start)


def register(app: typer.Typer) -> None:
    @app.command(help=TUNE_HELP)
    def tune(
        system: str = typer.Option(..., "--system", "-s", help="A system name."),
        workload: str = typer.Option(..., "--workload", "-w", help="Named workload or a workload file."),
        gpus: int = typer.Option(..., "--gpus", help="Cluster size."),
        model: str = typer.Option("omni-7b", "--model", "-m", help="Model preset or TOML/YAML file."),
        hardware: str = typer.Option("h100", "--hardware", help=HARDWARE_HELP),
        stack: str = typer.Option("eager", "--stack", help=STACK_HELP),
        dp_mode: str = typer.Option(None, "--dp-mode", help="ddp | zero1 | zero2 | fsdp | hsdp: every layout "
                                    "simulated with this data-parallel mode (fsdp: one shard group over all data "
                                    "ranks; hsdp: sharded within 8 nodes); default: the system's (FSDP, HSDP "
                                    "within 8 nodes on large clusters)."),
        steps: int = typer.Option(1, "--steps", help="Batches each layout is simulated on."),
        start_step: int = typer.Option(0, "--start-step", help="First batch of the stream."),
        seed: int = typer.Option(0, "--seed"),
        global_batch_tokens: int = typer.Option(0, "--global-batch-tokens", help="0: 8,192 per GPU."),
        budget: int = typer.Option(24, "--budget", help="Layouts simulated in the LLM phase (after pruning)."),
        top: int = typer.Option(5, "--top", help="Layouts printed."),
        calibration: str = typer.Option(None, "--calibration", help="Profile JSON from `omnibench calibrate`."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every layout as it is simulated."),
    ) -> None:
        from omnibench.cli.simulate import _check_stack, _dp_fields
        from systems import available_systems

        _check_stack(stack)
        _dp_fields(dp_mode, 0)
        if system not in available_systems():
            fail(f"system must be one of {', '.join(available_systems())}; got {system!r}")
        for name, v in (("gpus", gpus), ("steps", steps), ("budget", budget), ("top", top)):
            if v < 1:
                fail(f"{name} must be a positive integer, got {v}")
        if gpus > MAX_GPUS:
            fail(f"gpus must be at most {MAX_GPUS:,}, got {gpus:,}")
        log = (lambda t: console.print(f"  {t.candidate.label():48s} "
                                       + (f"{t.step_s:.3f} s, {t.peak_gib:.1f} GiB" if t.simulated else t.note),
                                       highlight=False)) if verbose else None
        try:
            res = run_tune(system, workload, gpus, model, hardware, steps, start_step, seed, global_batch_tokens,
                           budget, calibration, log=log, stack=stack, dp_mode=dp_mode)
        except ValueError as e:
            fail(batch_error(e, gpus, global_batch_tokens))
        if as_json:
            print(json.dumps({"system": system, "gpus": gpus, "enumerated": res.enumerated,
                              "pruned_memory": res.pruned_memory, "refused": res.refused,
                              "simulated": res.simulated, "seconds": res.seconds,
                              "best": res.best.row() if res.best else None, "default": res.default.row(),
                              "layouts": [t.row() for t in res.trials[:top]], "notes": res.notes[:20]}, indent=1))
            return
        table = Table(title=f"{system}: {model} on {gpus} x {hardware}, workload {workload}")
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
                      f"{res.refused} refused by the layout rules, {res.simulated} simulated in {res.seconds:.1f} s",
                      highlight=False)
        for note in res.notes[:5]:
            console.print(f"not simulated: {note}", highlight=False)

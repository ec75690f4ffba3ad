"""`omnibench run` (a real training run) and `omnibench plan` (print what a system decides)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from omnibench.cli.common import (
    CP_HELP,
    DEFAULT_LAYOUT_TEXT,
    FREEZE_HELP,
    MAX_GPUS,
    MAX_LOCAL_RANKS,
    OPTION_HELP,
    PP_HELP,
    RECOMPUTE_HELP,
    RECOMPUTE_TEXT,
    TP_HELP,
    DpShard,
    console,
    err_console,
    fail,
    freeze_option,
    in_panels,
    writable_folder,
    writing,
)


def _parallel_opts(tp, pp, cp, ep, dp, microbatches, encoder_tp, encoder_ranks, dp_shard=0, encoder_sp=0) -> dict:
    return dict(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, microbatches=microbatches, encoder_tp=encoder_tp,
                encoder_sp=encoder_sp, encoder_ranks=encoder_ranks, dp_shard=dp_shard)


NOT_IN_CONFIG = ("config", "as_json")  # options a run config file cannot set
# plan --step: the workload stream numbers samples from the step (about a million per step), in 64 bits
MAX_PLAN_STEP = 1_000_000_000


def error_text(e: Exception) -> str:
    """An exception's message as written: str() of a KeyError quotes it (repr), and stripping those quotes
    off the ends would also eat the closing quote of a value the message quotes ("got 'tpu'")."""
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]
    return str(e)


def with_run_config(ctx, path: Path) -> dict:
    """The run command's options with a TOML run config applied: the file's values (any tables, keys
    named like the options, `-` or `_`) replace defaults; options given on the command line win.
    torchtitan's job config works the same way; the resolved options are what the record stores."""
    import tomllib
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        fail(f"config: cannot read {path}: {e.strerror}")
    except tomllib.TOMLDecodeError as e:
        fail(f"config: {path} is not valid TOML: {e}")
    except UnicodeDecodeError as e:
        fail(f"config: {path} is not valid TOML: not UTF-8 text (byte {e.start})")
    flat: dict[str, object] = {}

    def walk(table: dict, where: str) -> None:
        for k, v in table.items():
            if isinstance(v, dict):
                walk(v, f"{where}{k}.")
                continue
            key = k.replace("-", "_")
            key = {"json": "as_json"}.get(key, key)
            if key in flat:
                fail(f"config: {where}{k} sets {key} a second time in {path}")
            flat[key] = v

    walk(doc, "")
    values = dict(ctx.params)
    allowed = sorted(k for k in values if k not in NOT_IN_CONFIG)
    for key, v in flat.items():
        if key not in allowed:
            fail(f"config: unknown key {key!r} in {path}; allowed: {', '.join(allowed)}")
        default = values[key]
        want = type(default) if default is not None else str
        ok = isinstance(v, want) and not (want is int and isinstance(v, bool))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v, ok = float(v), True
        if want is list:
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
        if not ok:
            fail(f"config: {key} in {path} must be {want.__name__}, got {v!r}")
        if ctx.get_parameter_source(key).name != "COMMANDLINE":
            values[key] = v
    values["config"] = str(path)
    return values


def systems_help() -> str:
    """The registered systems, as `--system` help lists them (from the registry, so none is left out)."""
    from systems import available_systems

    return " | ".join(available_systems())


RUN_HELP = "\n\n".join([
    "Train for a few steps with real tensors and collectives; write a record folder.", DEFAULT_LAYOUT_TEXT,
    RECOMPUTE_TEXT + " On CPU (tiny presets) auto is none; on CUDA it is settled against the device's memory "
    "before any rank starts, with the depth of the default model."])
PLAN_HELP = "\n\n".join([
    "Print the Plan a system makes for one step: layouts, data, routes, per-rank actions, and each rank's "
    "estimated peak memory on an H100 (the estimate `run` checks and `simulate` reports).", DEFAULT_LAYOUT_TEXT,
    RECOMPUTE_TEXT])


RUN_PANELS = {
    "Run": ("system", "workload", "nproc", "model", "steps", "seed", "global_batch_tokens", "length_scale",
            "batches_file", "config"),
    "Layout": ("tp", "pp", "cp", "cp_kind", "ep", "dp", "dp_shard", "microbatches", "encoder_tp", "encoder_sp",
               "encoder_ranks", "fsdp", "dp_mode", "mixed_precision"),
    "Memory": ("recompute", "freeze", "encoder_chunk_tokens"),
    "Device": ("device", "dtype", "compile", "timeout"),
    "omni ablations and planner options": ("no_joint_pipeline", "no_reorder", "no_reshard", "no_long_short_sp",
                                           "no_llm_long_short", "option"),
    "Output and faults": ("out", "as_json", "dump_params", "inject_failure"),
}
PLAN_PANELS = {
    "Step": ("system", "workload", "nproc", "model", "step", "seed", "global_batch_tokens", "length_scale",
             "max_sample_tokens"),
    "Layout": ("tp", "pp", "cp", "cp_kind", "ep", "dp", "dp_shard", "microbatches", "encoder_tp", "encoder_sp",
               "encoder_ranks"),
    "Memory": ("recompute", "freeze", "encoder_chunk_tokens"),
    "omni ablations and planner options": ("no_joint_pipeline", "no_reorder", "no_reshard", "no_long_short_sp",
                                           "no_llm_long_short", "option"),
    "Output": ("as_json",),
}


def register(app: typer.Typer) -> None:
    app.command("run", help=RUN_HELP)(in_panels(run, RUN_PANELS))
    app.command("plan", help=PLAN_HELP)(in_panels(plan_cmd, PLAN_PANELS))


def run(
    ctx: typer.Context,
    system: str = typer.Option("", "--system", help=systems_help()),
    workload: str = typer.Option("mixed_video", "--workload"),
    nproc: int = typer.Option(0, "--nproc", help="ranks (0: 2 on CPU, every GPU on CUDA)"),
    model: str = typer.Option("", "--model", help="Model preset, TOML/YAML file or Hugging Face config.json (default: tiny-omni on CPU, omni-7b on CUDA)."),
    steps: int = typer.Option(5, "--steps"),
    seed: int = typer.Option(0, "--seed"),
    tp: int = typer.Option(0, "--tp", help=TP_HELP),
    pp: int = typer.Option(0, "--pp", help=PP_HELP),
    cp: int = typer.Option(0, "--cp", help=CP_HELP),
    cp_kind: str = typer.Option("ulysses", "--cp-kind", help="ulysses | allgather (Llama 3's all-gathered K/V)"),
    ep: int = typer.Option(1, "--ep"),
    dp: int = typer.Option(0, "--dp", help="0: what is left"),
    dp_shard: DpShard = 0,
    microbatches: int = typer.Option(0, "--microbatches"),
    encoder_tp: int = typer.Option(0, "--encoder-tp"),
    encoder_sp: int = typer.Option(0, "--encoder-sp", help="encoders' sequence-parallel group size (0: the system's)"),
    encoder_ranks: int = typer.Option(0, "--encoder-ranks", help="noncolocated: ranks for the encoders"),
    fsdp: bool = typer.Option(True, "--fsdp/--no-fsdp", help="shard data-parallel state (FSDP2) or replicate"),
    dp_mode: str = typer.Option(None, "--dp-mode", help="how data parallelism holds the training state: ddp | "
                                "zero1 | zero2 (weights replicated, optimizer state and, zero2, gradients "
                                "sharded) | fsdp | hsdp; overrides --fsdp/--no-fsdp. omni's encoders keep their "
                                "own (--option encoder_dp=..., default zero2)"),
    recompute: str = typer.Option("auto", "--recompute", help=RECOMPUTE_HELP),
    freeze: str = typer.Option("", "--freeze", help=FREEZE_HELP),
    compile: bool = typer.Option(False, "--compile", help="torch.compile each transformer block"),
    encoder_chunk_tokens: str = typer.Option(
        "0", "--encoder-chunk-tokens",
        help="run each encoder microbatch in chunks (recomputed in the backward) of at most N encoder tokens (patches, audio "
             "positions); 0: off (the default until chunked runs are measured on a GPU); auto: chunk only where the "
             "memory check needs it (CUDA)"),
    global_batch_tokens: int = typer.Option(0, "--global-batch-tokens"),
    length_scale: float = typer.Option(0.0, "--length-scale"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16"),
    mixed_precision: str = typer.Option(
        "autocast", "--mixed-precision",
        help="bf16 runs, modules FSDP does not shard (one rank, DDP): autocast (fp32 weights cast per op, "
             "torchtitan without FSDP) | master (bf16 weights, fp32 master and gradients in the optimizer)"),
    out: str = typer.Option("", "--out", help="record folder (default results/runs/<time>-<system>-<workload>)"),
    batches_file: str = typer.Option("", "--batches-file", help="replay batches from a JSON file"),
    timeout: float = typer.Option(120.0, "--timeout", help="seconds any wait may take: collectives, loaders"),
    inject_failure: str = typer.Option("", "--inject-failure", hidden=True),
    dump_params: bool = typer.Option(False, "--dump-params", hidden=True),
    no_joint_pipeline: bool = typer.Option(False, "--no-joint-pipeline", help="omni: encoder work all before/after the LLM pipeline"),
    no_reorder: bool = typer.Option(False, "--no-reorder", help="omni: no grouped reordering in the loaders"),
    no_reshard: bool = typer.Option(False, "--no-reshard", help="omni: LLM ranks consume what their loader holds"),
    no_long_short_sp: bool = typer.Option(False, "--no-long-short-sp", help="omni: no sequence parallelism for long inputs"),
    no_llm_long_short: bool = typer.Option(False, "--no-llm-long-short",
                                           help="omni: long LLM samples stay data-parallel (no context-parallel group)"),
    option: list[str] = typer.Option([], "--option", help=OPTION_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    config: Path = typer.Option(None, "--config", help="a TOML run config (any of these options, by name, "
                                "in any tables); options given on the command line override it"),
) -> None:
    if config is not None and not ctx.meta.get("omnibench.config_applied"):
        ctx.meta["omnibench.config_applied"] = True  # the call below runs with the file's values applied
        return run(ctx, **with_run_config(ctx, config))
    from omnibench.plan import PlanError
    from omnibench.specs.model import SpecError
    from omnibench.specs.run import RunSpec
    from systems.omni.options import options_from_flags

    _check_system(system)
    try:
        chunk = chunk_tokens_option(encoder_chunk_tokens, allow_auto=True)
        options = options_from_flags(no_joint_pipeline, no_reorder, no_reshard, no_long_short_sp, option,
                                     no_llm_long_short)
    except (SpecError, PlanError) as e:
        fail(str(e))
    frozen = freeze_option(freeze)  # the names here; against the model once resolve() knows it
    if nproc > MAX_LOCAL_RANKS:
        fail(f"nproc must be at most {MAX_LOCAL_RANKS:,} (the processes run starts on this machine; torchrun "
             f"starts more), got {nproc:,}")
    spec = RunSpec(system=system, workload=workload, model=model, nproc=nproc, steps=steps, seed=seed,
                   global_batch_tokens=global_batch_tokens, length_scale=length_scale, device=device, dtype=dtype,
                   mixed_precision=mixed_precision, out=out,
                   batches_file=batches_file, timeout_s=timeout, inject_failure=inject_failure,
                   dump_params=dump_params, fsdp=fsdp, recompute=recompute, freeze=frozen, compile=compile,
                   encoder_chunk_tokens=chunk, cp_kind=cp_kind,
                   options=options, **_parallel_opts(tp, pp, cp, ep, dp, microbatches, encoder_tp,
                                                              encoder_ranks, dp_shard, encoder_sp))
    try:
        spec.validate()  # the values alone, before --out is looked at or anything is made on disk
    except SpecError as e:
        fail(str(e))
    _check_out(out)
    spec = _settled_run(spec, dp_mode, dp_shard, bool(model), config)
    _launch_and_report(spec, as_json)


def _check_system(system: str) -> None:
    """--system: given (on the command line or in the config file), and registered."""
    from systems import SYSTEMS, available_systems

    if not system:
        fail(f"system: give --system (or system = \"...\" in a --config file), one of {', '.join(available_systems())}")
    if system not in available_systems():
        allowed = available_systems() or list(SYSTEMS)
        fail(f"system must be one of {', '.join(allowed)}; got {system!r}")


def _settled_run(spec, dp_mode: str | None, dp_shard: int, model_given: bool, config: Path | None):
    """The RunSpec the ranks start with: --dp-mode applied, the layout resolved and checked, recompute
    `auto` settled against the device (CUDA), and what the record's provenance keeps."""
    from omnibench.plan import PlanError
    from omnibench.runtime.launch import check_layout, resolve
    from omnibench.runtime.memory import fit_to_device
    from omnibench.specs.model import SpecError

    if dp_mode is not None:
        from omnibench.specs.parallel import dp_mode_fields

        try:
            fields = dp_mode_fields(dp_mode)
        except SpecError as e:
            fail(str(e))
        if dp_shard and dp_mode != "hsdp":
            fail(f"dp-shard={dp_shard} needs --dp-mode hsdp (or no --dp-mode); got --dp-mode {dp_mode}")
        spec.fsdp, spec.zero, spec.dp_shard = fields["fsdp"], fields["zero"], dp_shard or fields["dp_shard"]
    try:
        spec = resolve(spec)
        spec, fit_note = fit_to_device(spec, model_given=model_given)  # settles recompute=auto on CUDA
        check_layout(spec)
    except (SpecError, PlanError, ValueError, KeyError) as e:
        fail(error_text(e))
    if config:
        spec.extra["config_file"] = str(config)
    spec.extra["argv"] = list(sys.argv)  # the record's provenance names the command as typed
    if fit_note:
        spec.extra["notes"] = [*spec.extra.get("notes", []), fit_note]
    return spec


def _launch_and_report(spec, as_json: bool) -> None:
    """Start the ranks, wait for them, and print the run's summary (rank 0 only, under torchrun)."""
    from omnibench.runtime.launch import LaunchError, launch, under_torchrun

    start = time.perf_counter()
    # the launcher's own writes (the record's config.json, its lock) on a full disk: one line, exit 1
    with writing(spec.out or "the record folder"):
        try:
            if as_json or under_torchrun():
                folder = launch(spec)
            else:
                folder = _launch_with_progress(spec, launch)
        except LaunchError as e:  # one line: which rank failed first and how, or which signal stopped it
            fail(str(e), e.exit_code)
        except FileExistsError as e:
            fail(str(e))
    wall = time.perf_counter() - start
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return  # under torchrun only rank 0 reports

    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    summary["wall_time_s"] = wall
    summary["record"] = folder
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    _print_summary(summary, folder)

def plan_cmd(
    system: str = typer.Option(..., "--system", help=systems_help()),
    workload: str = typer.Option("mixed_video", "--workload"),
    nproc: int = typer.Option(4, "--nproc"),
    model: str = typer.Option("tiny-omni", "--model"),
    step: int = typer.Option(0, "--step"),
    seed: int = typer.Option(0, "--seed"),
    tp: int = typer.Option(0, "--tp", help=TP_HELP),
    pp: int = typer.Option(0, "--pp", help=PP_HELP),
    cp: int = typer.Option(0, "--cp", help=CP_HELP),
    cp_kind: str = typer.Option("ulysses", "--cp-kind", help="ulysses | allgather (Llama 3's all-gathered K/V)"),
    ep: int = typer.Option(1, "--ep"),
    dp: int = typer.Option(0, "--dp"),
    dp_shard: DpShard = 0,
    microbatches: int = typer.Option(0, "--microbatches"),
    encoder_tp: int = typer.Option(0, "--encoder-tp"),
    encoder_sp: int = typer.Option(0, "--encoder-sp"),
    encoder_ranks: int = typer.Option(0, "--encoder-ranks"),
    global_batch_tokens: int = typer.Option(1536, "--global-batch-tokens"),
    length_scale: float = typer.Option(0.02, "--length-scale"),
    max_sample_tokens: int = typer.Option(384, "--max-sample-tokens"),
    no_joint_pipeline: bool = typer.Option(False, "--no-joint-pipeline", help="omni: encoder work all before/after the LLM pipeline"),
    no_reorder: bool = typer.Option(False, "--no-reorder", help="omni: no grouped reordering in the loaders"),
    no_reshard: bool = typer.Option(False, "--no-reshard", help="omni: LLM ranks consume what their loader holds"),
    no_long_short_sp: bool = typer.Option(False, "--no-long-short-sp", help="omni: no sequence parallelism for long inputs"),
    no_llm_long_short: bool = typer.Option(False, "--no-llm-long-short",
                                           help="omni: long LLM samples stay data-parallel (no context-parallel group)"),
    option: list[str] = typer.Option([], "--option", help=OPTION_HELP),
    recompute: str = typer.Option("auto", "--recompute", help=RECOMPUTE_HELP),
    freeze: str = typer.Option("", "--freeze", help=FREEZE_HELP),
    encoder_chunk_tokens: str = typer.Option(
        "0", "--encoder-chunk-tokens", help="encoders in chunks (recomputed in the backward) of at most N tokens, for the memory "
                                            "estimate; 0: off"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    from omnibench.plan import PlanError
    from omnibench.resolve import resolve_layout
    from omnibench.specs.costs import recompute_policy
    from omnibench.specs.model import SpecError
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from simulator.hardware import load_cluster
    from systems import get_planner
    from systems.omni.options import options_from_flags
    from workloads.stream import WorkloadStream

    if not 1 <= nproc <= MAX_GPUS:
        fail(f"nproc must be a positive integer, at most {MAX_GPUS:,}; got {nproc:,}")
    if not 0 <= step <= MAX_PLAN_STEP:
        fail(f"step must be an integer from 0 to {MAX_PLAN_STEP:,}; got {step:,}")
    frozen = freeze_option(freeze)
    try:
        from omnibench.resolve import model_for_workload
        from omnibench.specs.model import freeze_for_model
        from workloads.registry import get_workload

        named = get_model(model)
        model, model_note = model_for_workload(model, get_workload(workload))
        spec = get_model(model)
        frozen = freeze_for_model(frozen, named, spec)
        parallel = ParallelSpec(world_size=nproc, cp_kind=cp_kind, **_parallel_opts(1, 1, 1, ep, dp, microbatches, encoder_tp,
                                                                   encoder_ranks, dp_shard, encoder_sp),
                                options=options_from_flags(no_joint_pipeline, no_reorder, no_reshard,
                                                           no_long_short_sp, option, no_llm_long_short),
                                freeze=frozen)
        stream = WorkloadStream(workload, seed=seed, global_batch_tokens=global_batch_tokens,
                                length_scale=length_scale, max_sample_tokens=max_sample_tokens or None)
        if recompute != "auto":
            recompute_policy(recompute)
        chunk = chunk_tokens_option(encoder_chunk_tokens)
        cluster = load_cluster("h100", nproc)
        batches = [stream.batch(step + k) for k in range(4 if recompute == "auto" else 1)]
        resolved = resolve_layout(system, spec, parallel, batches, cluster, tp=tp, pp=pp, cp=cp,
                                  recompute=recompute, encoder_chunk_tokens=chunk)
        parallel = resolved.parallel
        p = get_planner(system).plan(spec, parallel, batches[0])
    except (SpecError, PlanError, ValueError, KeyError) as e:
        fail(error_text(e))
    if as_json:
        print(p.to_json())
        return
    if model_note:
        console.print(model_note, highlight=False, soft_wrap=True)
    console.print(f"[bold]layout[/]: tp {parallel.tp}, pp {parallel.pp}, cp {parallel.cp} ({resolved.layout_note})",
                  highlight=False, soft_wrap=True)
    if parallel.freeze:
        console.print(f"[bold]frozen[/]: {', '.join(parallel.freeze)} (no gradients, optimizer state or gradient "
                      "reduction; a frozen encoder runs no backward)", highlight=False, soft_wrap=True)
    print_plan(p)
    _print_memory(p, spec, cluster, parallel, chunk, resolved)


def _print_memory(p, spec, cluster, parallel, chunk: int, resolved) -> None:
    """Each rank's estimated peak memory under plan `p` on an H100 (the first 16 ranks), and how the
    recompute mode was settled."""
    try:
        from simulator.engine import SimOptions, simulate

        # the engine that checked this layout's memory (recompute auto) is played, not built again
        res = simulate(p, spec, cluster, options=SimOptions(recompute=parallel.recompute, check_memory=False,
                                                            encoder_chunk_tokens=chunk,
                                                            mixed_precision=parallel.mixed_precision))
    except ValueError as e:
        fail(error_text(e))
    worst = max(res.ranks, key=lambda r: r.memory_bytes)
    chunked = f", encoder chunks of {chunk} tokens" if chunk else ""
    how = " (auto: the cheapest that fits an H100)" if resolved.chosen and resolved.fits else ""
    if resolved.chosen and not resolved.fits:
        how = " (auto: nothing fits an H100; the most recomputation)"
    console.print(f"[bold]memory[/] (estimate, bf16, recompute={parallel.recompute}{how}{chunked}): peak {worst.memory_bytes / 2**30:.2f} GiB "
                  f"on rank {worst.rank}; " + ", ".join(f"rank {r.rank}: {r.memory_bytes / 2**30:.2f}"
                                                        for r in sorted(res.ranks, key=lambda r: r.rank)[:16]),
                  highlight=False, soft_wrap=True)


def _check_out(out: str) -> None:
    """--out names the record folder a run creates: refuse a file, a folder or a symbolic link that
    leads nowhere in the way, or a parent this process cannot write in, before any work (records.start
    refuses a folder that is in use or left from an unfinished run)."""
    from omnibench.runtime.records import new_run_dir, out_taken

    final = Path(new_run_dir(out, "x", "y")) if out else Path("results/runs")
    if out and final.exists() and not final.is_dir():
        fail(f"out: {out} is a file; --out names the record folder the run creates")
    taken = out_taken(str(final)) if out else None
    if taken:
        fail(taken)
    writable_folder(final.parent if out else final)


def chunk_tokens_option(text: str, allow_auto: bool = False) -> int:
    """--encoder-chunk-tokens: a token budget, 0 (off) or, where allowed, auto (-1 in RunSpec)."""
    from omnibench.specs.model import SpecError

    text = str(text).strip()
    if allow_auto and text == "auto":
        return -1
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        allowed = "a token budget N >= 1, 0 (off)" + (" or auto" if allow_auto else "")
        raise SpecError(f"encoder_chunk_tokens must be {allowed}; got {text!r}")
    return n


def print_plan(p) -> None:
    from collections import Counter

    console.print(f"[bold]{p.system}[/] plan, step {p.step}: {len(p.samples)} samples, "
                  f"{sum(s.llm_tokens for s in p.samples)} LLM tokens, world size {p.world_size}, model {p.model}")
    console.print(f"options: {p.options}")
    t = Table(title="layouts")
    for c in ("module", "mesh", "ranks"):
        t.add_column(c)
    for name, lay in p.layouts.items():
        mesh = " x ".join(f"{d}={getattr(lay, d)}" for d in lay.mesh_dims) + (f" ep={lay.ep}" if lay.ep > 1 else "")
        t.add_row(name, mesh, _ranks(lay.ranks))
    console.print(t)
    t = Table(title="data assignment (microbatches: sample ids; LLM tokens, or encoder positions for encoders)")
    for c in ("module", "rank", "microbatches"):
        t.add_column(c)
    for module, per_rank in p.assignment.items():
        for r, mbs in sorted(per_rank.items()):
            cells = []
            for j, mb in enumerate(mbs):
                ids = ",".join(map(str, mb)) if len(mb) <= 6 else f"{len(mb)} samples"
                if module == "llm":
                    cells.append(f"mb{j}: [{ids}] {sum(p.sample(i).llm_tokens for i in mb)} tok")
                else:
                    cells.append(f"mb{j}: [{ids}] {sum(sum(p.sample(i).encoder_seq_lens(module)) for i in mb)} pos")
            t.add_row(module, str(r), "; ".join(cells))
    console.print(t)
    moved = [r for r in p.routes if r.src_rank != r.dst_rank]
    by_pair = Counter((r.module, r.src_rank, r.dst_rank) for r in moved)
    tokens = Counter()
    for r in moved:
        tokens[(r.module, r.src_rank, r.dst_rank)] += r.tokens
    console.print(f"routes: {len(p.routes)} ({len(p.routes) - len(moved)} local, {len(moved)} cross ranks, "
                  f"{sum(r.tokens for r in moved)} tokens moved)")
    for (m, s, d), n in sorted(by_pair.items())[:24]:
        console.print(f"  {m}: rank {s} -> rank {d}: {n} samples, {tokens[(m, s, d)]} tokens")
    if len(by_pair) > 24:
        console.print(f"  ... {len(by_pair) - 24} more rank pairs")
    for r, acts in sorted(p.actions.items()):
        console.print(f"[bold]rank {r}[/] ({len(acts)} actions): " + " ".join(str(a) for a in acts),
                      highlight=False, soft_wrap=True)
    if p.notes:
        console.print("[bold]notes[/] (what the system decided)")
        for key, value in p.notes.items():
            console.print(f"  {key}: {json.dumps(value)}", highlight=False, soft_wrap=True)


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks)) if len(ranks) <= 16 else f"{len(ranks)} ranks"


def _launch_with_progress(spec, launch) -> str:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # Transient: a failed or interrupted run leaves its one-line error, not a bar stopped mid-way; and
    # no bar where it cannot animate (a log file would only get rich's blank line).
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console,
                  transient=True, disable=not err_console.is_interactive) as bar:
        task = bar.add_task(f"{spec.system} x{spec.nproc} {spec.model}", total=spec.steps, info="starting ranks")

        def on_progress(line: dict) -> None:
            loss = "not finite" if line["loss"] is None else f"{line['loss']:.4f}"
            bar.update(task, completed=line["step"] + 1, info=f"loss {loss}  {line['step_time_s'] * 1e3:.0f} ms/step")

        return launch(spec, on_progress)


def _print_summary(s: dict, folder: str) -> None:
    t = Table(title=f"{s['system']} on {s['workload']}: {s['model']}, {s['world_size']} x {s['device']} ({s['dtype']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("steps", str(s["steps"])),
        ("final loss", "not finite (see the notes)" if s["final_loss"] is None else f"{s['final_loss']:.5f}"),
        ("step time", f"{s['mean_step_time_s'] * 1e3:.1f} ms ({s['timed_steps']} steps)"),
        ("tokens/s", f"{s['tokens_per_s']:.0f}"),
        ("tokens/s/GPU", f"{s['tokens_per_s_per_gpu']:.0f}"),
        ("TFLOPS/GPU", f"{s['tflops_per_gpu']:.4f}"),
        ("MFU", f"{s['mfu'] * 100:.1f}%" if s["mfu"] is not None else "n/a (no peak for this device)"),
        ("bubble fraction", f"{s['bubble_fraction'] * 100:.1f}%"),
        ("exposed communication", f"{s['exposed_comm_fraction'] * 100:.1f}%"),
        ("peak memory", f"{s['peak_memory_bytes'] / 2**20:.0f} MiB"),
        *([("frozen", ", ".join(s["freeze"]))] if s.get("freeze") else []),
        ("recompute", f"{s.get('recompute', 'none')}" + (", compiled blocks" if s.get("compile") else "")
         + (f", encoder chunks of {s['encoder_chunk_tokens']} tokens" if s.get("encoder_chunk_tokens") else "")),
        ("wall time", f"{s['wall_time_s']:.1f} s"),
        ("record", folder),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for n in s.get("notes", []):
        console.print(f"note: {n}")

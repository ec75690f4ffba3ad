"""`omnibench simulate | calibrate | validate`: the simulator's commands.

simulate: plan every requested system on the same sample stream at each cluster size, execute the
plans with costs, print one table row per (cluster size, system), and write a record folder
(config, per-step metrics, Perfetto trace of the distinct ranks) under results/sims/.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import re
import shutil
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import typer
from rich.table import Table

from omnibench.cli.common import (
    CP_HELP,
    DEFAULT_LAYOUT_TEXT,
    FREEZE_HELP,
    MAX_GPUS,
    OPTION_HELP,
    PP_HELP,
    RECOMPUTE_HELP,
    RECOMPUTE_TEXT,
    TP_HELP,
    DpShard,
    atomic_write,
    batch_error,
    console,
    fail,
    freeze_option,
    in_panels,
    writable_file,
    writable_folder,
    writing,
)
from omnibench.provenance import provenance, publish, write_csv
from omnibench.stopping import exit_on_sigterm, raise_if_stopped

BASELINES = ("homogeneous", "temporal", "colocated", "noncolocated", "spatial")  # what omni is judged against
SAVE_PLANS_UP_TO = 256  # plans of bigger clusters are tens of MB; their traces and metrics are kept
TRACE_RANKS = 512  # simulated ranks drawn in a record's timeline (the lowest ones; the rest are noted)
INCOMPLETE = ".incomplete"  # a record folder being written (same suffix as a run's)
# results.csv: results.json's rows, flat (per-step metrics stay in results.json's "per_step").
RESULT_COLUMNS = ["gpus", "system", "layout", "layout_flags", "recompute", "global_batch_tokens", "fits", "error", "fit_message", "steps", "step_time_s",
                  "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "bubble", "exposed_comm",
                  "imbalance", "peak_memory_gib", "peak_memory_needed_gib", "peak_memory_unpressured_gib",
                  "memory_capacity_gib", "speedup_over_best_baseline",
                  "distinct_ranks", "sim_seconds", "planning_s", "planning_exposed_s", "planning_cpu_s", "tuned_at_step", "tune_seconds", "tune_budget", "tune_space",
                  "tune_moved", "tune_converged", "tune_seeds", "tune_over_seeds", "tune_ruled_out", "steps_failed"]
# steps.csv: one row per (gpus, system, simulated step): throughput over training at a kept layout.
STEP_COLUMNS = ["gpus", "system", "step", "layout", "fits", "why", "tokens", "step_time_s", "tokens_per_s",
                "tokens_per_s_per_gpu", "mfu", "bubble", "peak_memory_gib"]


def _claim(out: Path, name: str) -> Path:
    """The record's final path, out/name (or name-2, -3, ...), claimed by making its `.incomplete`
    folder: mkdir is atomic, so two simulations started in the same second into one --out never
    take the same name (the loser moves on to the next one)."""
    k = 1
    while True:
        final = out / (name if k == 1 else f"{name}-{k}")
        k += 1
        if final.exists():
            continue
        try:
            final.with_name(final.name + INCOMPLETE).mkdir()
        except FileExistsError:
            continue
        if final.exists():  # finished (and renamed) between the check and the claim
            final.with_name(final.name + INCOMPLETE).rmdir()
            continue
        return final


def _ints(text: str, field: str) -> list[int]:
    """`--gpus 256,1024`: positive integers up to MAX_GPUS, no empty item."""
    items = [x.strip() for x in text.split(",")]
    usage = f"{field} must be a comma-separated list of positive integers (at most {MAX_GPUS:,})"
    if any(not x for x in items):
        fail(f"{usage}; got {text!r}, which has an empty item")
    try:
        out = [int(x) for x in items]
    except ValueError:
        fail(f"{usage}; got {text!r}")
    if any(v < 1 or v > MAX_GPUS for v in out):
        fail(f"{usage}; got {text!r}")
    return out


def _finished_runs(dirs: list[str], command: str) -> list[str]:
    """The run folders that finished; each unfinished one (`.incomplete`: interrupted or failed) is
    named with how far it got and left out, and none finished is a one-line failure."""
    from simulator.traces import TraceError, read_run

    done = []
    for d in dirs:
        if Path(d).name.endswith(INCOMPLETE):
            try:
                read_run(d)
            except TraceError as e:
                console.print(f"{command}: skipped {e}", highlight=False, soft_wrap=True)
            continue
        done.append(d)
    if not done:
        fail(f"{command}: no finished run among the folders given (unfinished runs keep the {INCOMPLETE} suffix)")
    return done


def _fit_text(fit: dict) -> str:
    parts = [f"{fit['points']} points"] if "points" in fit else []
    if "r2" in fit:
        parts.append(f"R2 {fit['r2']:.3f}")
    if "mape" in fit:
        parts.append(f"mean |error| {fit['mape']:.1%}")
    return ", ".join(parts)


def _stream(workload: str, seed: int, global_batch_tokens: int):
    from workloads.stream import WorkloadStream

    return WorkloadStream(workload, seed=seed, global_batch_tokens=global_batch_tokens)


def planner_options(system: str, options: dict, hardware: str) -> dict:
    """omni knows the hardware it is simulated on (its collectives' prices; with `--option balancer=simulator`
    its compute costs too, as any system's under that oracle)."""
    knows = system == "omni" or options.get("balancer") == "simulator"
    if knows and "hardware" not in options and "calibration" not in options:
        return {**options, "hardware": hardware}
    return options


def step_indices(steps: int, stride: int = 1) -> list[int]:
    """The batches of the stream a simulation covers: 0, stride, 2*stride, ... (steps of them)."""
    return [k * stride for k in range(steps)]


# One line each (`simulate --help` keeps every option to one line); the command's description says more.
HARDWARE_HELP = "Preset (h100, h200, b200, ...) or a file."
STACK_HELP = "eager (this runtime) | fused (Megatron)."
SOFTWARE_STACK_HELP = "eager | fused | a framework's (above)."
DP_MODE_HELP = "ddp | zero1 | zero2 | fsdp | hsdp."
MICRO_BATCH_HELP = "Samples per LLM microbatch; 0: off."
CP_KIND_HELP = "ulysses | ring | allgather."
MEMORY_ERROR_HELP = "Judge fits as if memory were off by E (0.2: 20% low)."
MIXED_PRECISION_HELP = "autocast | master (bf16 + fp32 master)."


def check_memory_error(memory_error: float) -> None:
    if not -0.9 < memory_error < 1:
        fail(f"memory-error must be between -0.9 and 1, exclusive (0.2: the memory estimate is assumed 20% low, "
             f"-0.2: 20% high); got {memory_error}")


def check_mixed_precision(mixed_precision: str, stack: str) -> None:
    """One-line errors for --mixed-precision (simulate, tune)."""
    from omnibench.specs.run import MIXED_PRECISION

    if mixed_precision not in MIXED_PRECISION:
        fail(f"mixed-precision must be one of {', '.join(MIXED_PRECISION)}; got {mixed_precision!r}")
    if mixed_precision != "autocast" and stack != "eager":
        fail(f"mixed-precision {mixed_precision} is this project's runtime's (--stack eager); --stack {stack} "
             "holds its weights its own way")


def _dp_fields(dp_mode: str | None, dp_shard: int) -> dict:
    """ParallelSpec fields of `--dp-mode` and `--dp-shard` together (one-line error otherwise)."""
    from omnibench.specs.parallel import dp_mode_fields

    if dp_mode is None:
        return {"dp_shard": dp_shard}
    try:
        fields = dp_mode_fields(dp_mode)
    except ValueError as e:
        fail(str(e))
    if dp_shard:
        if dp_mode != "hsdp":
            fail(f"dp-shard={dp_shard} needs --dp-mode hsdp (or no --dp-mode); got --dp-mode {dp_mode}")
        fields["dp_shard"] = dp_shard
    return fields


def software_from_flags(stack: str, hardware: str, **flags):
    """The Software (simulator/stacks.py) of `--stack` and its mechanism flags; one line naming the flag
    and its allowed values otherwise."""
    from simulator.stacks import StackError, software_of

    try:
        return software_of(stack, hardware=hardware, **flags)
    except StackError as e:
        fail(str(e))


def _check_stack(stack: str) -> None:
    from simulator.kernels import STACK_KINDS

    if stack not in STACK_KINDS:
        fail(f"stack must be one of {', '.join(STACK_KINDS)}; got {stack!r}")


def with_micro_batch(parallel, batch, micro_batch: int):
    """`parallel` with as many microbatches per LLM data rank as `micro_batch` samples each take."""
    dp = parallel.dp or max(1, parallel.world_size // (parallel.tp * parallel.pp * parallel.cp))
    per_rank = -(-len(batch.samples) // dp)
    m = max(1, -(-per_rank // micro_batch))
    if parallel.virtual_stages > 1:
        m = -(-m // parallel.pp) * parallel.pp  # the interleaved schedule wants a multiple of pp
    return replace(parallel, microbatches=m)


def _step_jobs(system, model, parallel, stream, steps, cluster, profile, recompute, hardware="", stride=1,
               chunk_tokens=0, want_plans=False, use_cache=True, packed: dict | None = None, stack: str = "eager",
               memory_error: float = 0.0, software: dict | None = None, spans: bool = True):
    """The steps to simulate of `system` at one fixed layout (`parallel`, `recompute`): the batches
    `step_indices(steps, stride)`, the layout never revisited between steps. The first keeps its
    spans (the record's trace). `packed`: the stream's batches packed so far, shared by the systems.
    `software`: SimOptions fields of `--stack` and its mechanism flags (simulator/stacks.py), over `stack`."""
    from dataclasses import replace

    from simulator.cache import StepJob, pack
    from simulator.engine import SimOptions

    if hardware and profile is None:
        parallel = replace(parallel, options=planner_options(system, parallel.options, hardware))
    sim_options = SimOptions(recompute=recompute, encoder_chunk_tokens=chunk_tokens, memory_error=memory_error,
                             mixed_precision=parallel.mixed_precision, **{"stack": stack, **(software or {})})
    packed = {} if packed is None else packed
    for s in step_indices(steps, stride):
        if s not in packed:
            packed[s] = pack(stream.batch(s))
    return [StepJob(system, model, parallel, packed[s], cluster, profile, sim_options,
                    keep="full" if k == 0 and spans else "summary", want_plan=want_plans, use_cache=use_cache)
            for k, s in enumerate(step_indices(steps, stride))]


def _collect(outcomes, steps: int):
    """(results, metrics, plans, failed) of one system's simulated steps (`simulator.cache.StepOutcome`s)."""
    results, metrics, plans, failed = [], [], [], []
    for o in outcomes:
        if o.error:
            if steps == 1:
                raise ValueError(o.error)
            # Over many steps at a kept layout a later batch may not plan (fewer samples than data
            # ranks, ...): that step is recorded as failed, the others still run.
            failed.append({"step": o.step, "fits": False, "error": o.error})
            continue
        results.append(o.result)
        metrics.append({**o.metrics, "step": o.step})
        plans.append(o.plan)
    if not results:
        raise ValueError(f"step {failed[0]['step']}: {failed[0]['error']}")
    return results, metrics, plans, failed


TUNE_KEY_FIELDS = ("system", "workload", "gpus", "model", "hardware", "seed", "global_batch_tokens", "budget",
                   "calibration", "tune_steps", "converge", "prior", "memory_error")


@functools.lru_cache(maxsize=1)
def tune_code_version() -> str:
    """A hash of the layout search's source (omnibench/tune/): what its answers depend on beyond the
    simulator's."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((Path(__file__).resolve().parents[1] / "tune").glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _tune_key(seeds: list | None = None, guard: str = "", mixed_precision: str = "autocast", freeze: tuple = (),
              **fields) -> str:
    """The tune cache's key: the inputs that decide the answer (a seeded search: its seeds too, as a
    digest, so that an unseeded answer is never taken for a seeded one; a guarded one: the steps its
    answer was checked on, so that an unguarded answer is never taken for a guarded one), and the
    simulator's code and the search's (simulator.cache.code_version and `tune_code_version`: an answer
    tuned under another memory model, cost model or search is never reused, as the step cache's own
    entries are not)."""
    from simulator.cache import code_version

    key = "|".join(f"{k}={fields[k]}" for k in TUNE_KEY_FIELDS) + f"|code={code_version()[:12]}"
    key += f"|search={tune_code_version()[:12]}"
    if guard:
        key += f"|guard={guard}"
    if mixed_precision != "autocast":  # autocast's keys stay what they were before the option existed
        key += f"|mixed_precision={mixed_precision}"
    if freeze:  # as are the keys of runs that train every module
        key += f"|freeze={','.join(freeze)}"
    if seeds:
        import hashlib

        rows = json.dumps(sorted(json.dumps(sd.row(), sort_keys=True) for sd in seeds))
        key += f"|seeds={hashlib.sha256(rows.encode()).hexdigest()[:12]}"
    return key


def read_seeds(paths: list[Path], model: str) -> list:
    """The layouts in `paths` (`--seed-from`), as `tune.Seed`s of `model`: a tune cache (`--tune-cache`:
    each entry's answer) or a seeds file (`{"seeds": [Seed rows with "model"]}`, what `reproduce`
    passes from stage to stage). Each layout once (the first source that names it); a layout of
    another model is not a seed."""
    from omnibench.tune import Candidate, Seed

    out: dict = {}
    for path in paths:
        try:
            got = json.loads(Path(path).read_text())
            if isinstance(got, dict) and isinstance(got.get("seeds"), list):
                rows = [(r, Seed.from_row(r)) for r in got["seeds"]]
            elif isinstance(got, dict):
                rows = [(e, Seed(Candidate(**e["candidate"]), int(e["gpus"]),
                                 f"{Path(str(e.get('workload'))).stem} {int(e['gpus']):,} {e.get('hardware')}"
                                 + (f" memory error {e['memory_error']:+.0%}" if e.get("memory_error") else "")))
                        for e in got.values() if isinstance(e, dict) and "candidate" in e and "gpus" in e]
            else:
                raise ValueError("neither a tune cache nor a seeds file")
        except (OSError, ValueError, TypeError, KeyError) as e:
            fail(f"seed-from: cannot read layouts from {path} ({type(e).__name__}: {e}); give a tune cache "
                 "(--tune-cache) or a seeds file ({\"seeds\": [...]})")
        for row, sd in rows:
            if row.get("model", model) == model and sd.candidate not in out:
                out[sd.candidate] = sd
    return list(out.values())


def read_tune_cache(path: Path | None) -> dict:
    """The tune cache at `path` ({} when there is none yet). A file that is not one (truncated JSON, a
    list, another tool's file) is refused before any work: the command would otherwise write its
    answers over it."""
    if path is None:
        return {}
    if path.is_dir():
        fail(f"tune-cache: {path} is a folder; give a JSON file (made if missing)")
    if not path.is_file():
        return {}
    try:
        got = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"tune-cache: cannot read {path} ({type(e).__name__}: {e}); delete it to tune again")
    if not isinstance(got, dict):
        fail(f"tune-cache: {path} is not a tune cache (a JSON object of tuned layouts, one per key), but a JSON "
             f"{type(got).__name__}; give another file or delete it")
    return got


def _cached_candidate(entry, system: str):
    """The layout of `system` a tune cache entry holds, or None when the entry is damaged (edited by hand,
    written by another version, another system's layout): such an entry is tuned again and replaced,
    never trusted."""
    from omnibench.tune import Candidate

    if not isinstance(entry, dict) or not isinstance(entry.get("candidate"), dict):
        return None
    try:
        c = Candidate(**entry["candidate"])
        c.label()
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    ok = c.system == system and isinstance(entry.get("tuned_at_steps"), list) and entry["tuned_at_steps"]
    return c if ok else None


def _search(system: str, spec, batches, cluster, profile, budget: int, options: dict, hardware: str, *,
            fraction: float | None = None, converge: bool = False, sweep=None, use_cache: bool = True, prior=None,
            stack: str = "eager", dp_mode: str | None = None, memory_error: float = 0.0, seeds: list | None = None,
            guard_batches: list | None = None, mixed_precision: str = "autocast", freeze: tuple = (),
            cp_kinds: tuple[str, ...] | None = None, log=None):
    """The search behind `simulate --tuned` (`tuned_layout`) and `omnibench tune` (`run_tune`): the
    `tune.TuneResult` of `system` (every omni technique on), starting from the system's default candidate.
    Given the same batches, cluster and options the two commands answer the same; `simulate --tuned` over
    several sizes also starts each size from the smaller one's answer (`prior`), and over a window of steps
    guards its answer on them (`guard_batches`), which `tune` does not."""
    from omnibench import tune as tune_mod

    full = {k: v for k, v in options.items() if not isinstance(v, bool)}  # technique switches back on
    search = tune_mod.tune_converged if converge else tune_mod.tune
    return search(system, spec, batches, cluster, profile=profile, budget=budget,
                  fraction=fraction or tune_mod.BUDGET_FRACTION,
                  options=planner_options(system, full, hardware) if profile is None else full, sweep=sweep,
                  use_cache=use_cache, prior=prior, stack=stack, dp_mode=dp_mode, memory_error=memory_error,
                  seeds=seeds, guard_batches=guard_batches, mixed_precision=mixed_precision, freeze=freeze,
                  cp_kinds=cp_kinds or tune_mod.CP_KINDS_SEARCHED, log=log)


def _tune_all(systems: list[str], tune_inputs, cache: dict, spec, batches, cluster, profile, budget: int,
              options: dict, hardware: str) -> dict:
    """Every system's search (`_search`, its arguments from `tune_inputs(system)`) not already in the tune
    `cache`, started at once, each in a thread of its own whose waves go through the one sweep (its
    process pool runs them, whichever thread maps them): {tune cache key: a future of the TuneResult or
    of the error the search raised}. A search reads nothing another writes (its seeds, prior and
    batches are fixed before they start; the step cache answers the same for any order), so each
    answer is the one it finds alone; the caller takes them in the systems' order. Daemon threads:
    a command stopped meanwhile (SIGTERM, Ctrl-C) does not wait for them, and its sweep's abort ends
    their simulations."""
    import threading
    from concurrent.futures import Future

    def start(fut: Future, fn, kw: dict) -> None:
        def body() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(**kw))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it in its own thread
                fut.set_exception(e)
        threading.Thread(target=body, daemon=True, name=f"tune-{kw['system']}").start()

    found: dict = {}
    for s in systems:
        key, kw = tune_inputs(s)
        if (key in cache and _cached_candidate(cache[key], s) is not None) or key in found:
            continue
        found[key] = Future()
        start(found[key], _search, dict(system=s, spec=spec, batches=batches, cluster=cluster, profile=profile,
                                        budget=budget, options=options, hardware=hardware, **kw))
    return found


def tuned_layout(system: str, spec, batches, cluster, profile, budget: int, options: dict, hardware: str,
                 cache: dict, key: str, *, fraction: float | None = None, converge: bool = False, sweep=None,
                 use_cache: bool = True, describe: dict | None = None, prior=None, stack: str = "eager",
                 dp_mode: str | None = None, memory_error: float = 0.0, seeds: list | None = None,
                 guard_batches: list | None = None, found=None, mixed_precision: str = "autocast",
                 freeze: tuple = ()):
    """(Candidate, the tune cache's entry) for `system`: `omnibench tune` on `batches` (step 0's
    batch, or batches picked across the simulated window by regime), its answer checked to run every
    batch of `guard_batches` (the window it is kept for; the layouts ruled out in `entry["guarded"]`),
    with every omni technique on
    (the ablation keeps the full system's layout), starting from `prior` (the next smaller size's
    answer, a `tune.Prior`); or the layout `cache[key]` holds from an earlier tune with the same
    inputs (its entry then says `tune_seconds` 0 for this command). The entry keeps this search's
    own answer as the prior of the next size (`entry["prior"]`), and the `seeds` (`tune.Seed`s) it
    started from with each one's simulated step time here (`entry["seeds"]`). `found`: a future of
    this very search already started (`_tune_all`), whose result (or error) is taken instead."""
    from dataclasses import asdict

    kept = _cached_candidate(cache[key], system) if key in cache else None
    if kept is not None:
        return kept, {**cache[key], "tune_seconds": 0.0}
    if found is not None:  # the same search, run beside the other systems' (`_tune_all`)
        res = found.result()
    else:
        res = _search(system, spec, batches, cluster, profile, budget, options, hardware, fraction=fraction,
                      converge=converge, sweep=sweep, use_cache=use_cache, prior=prior, stack=stack,
                      dp_mode=dp_mode, memory_error=memory_error, seeds=seeds, guard_batches=guard_batches,
                      mixed_precision=mixed_precision, freeze=freeze)
    if res.best is None:
        raise ValueError(f"tune: no layout of {system} fits {cluster.num_gpus} GPUs")
    entry = {**(describe or {}), "candidate": asdict(res.best.candidate), "label": res.best.candidate.label(),
             "tune_seconds": res.seconds, "simulated": res.simulated, "space": res.space,
             "budget": res.convergence.budget if res.convergence else res.budget,
             "enumerated": res.enumerated, "tuned_at_steps": res.steps, "best_s": res.best.step_s,
             "prior": res.prior().row(), "started_from": prior.world if prior is not None else None}
    if guard_batches:
        entry["guard_steps"] = res.guard_steps
        entry["guarded"] = [{"layout": lab, "step": k} for lab, k in res.guarded]
        entry["guard_simulations"] = res.guard_simulations
        entry["window_s"] = res.best.window_s or None
    if res.seeded:
        entry["seeds"] = [{**sd.row(), "as": tr.candidate.label() if tr else None,
                           "step_s": tr.step_s if tr and tr.simulated else None, "fits": bool(tr and tr.fits),
                           "window_s": (tr.window_s or None) if tr else None}
                          for sd, tr in res.seeded]
        # over the window where the guard ran them (res.time_of), as the answer was chosen
        fast = res.seeds_best
        entry["seeds_best_s"] = res.time_of(fast) if fast else None
        entry["over_seeds"] = res.time_of(fast) / res.time_of(res.best) - 1 if fast else None
    if res.convergence is not None:
        entry["convergence"] = res.convergence.row()
    cache[key] = entry
    return res.best.candidate, entry


def _one_gc_pause(on: bool):
    """The cyclic GC paused over a simulation's planning and its steps (`systems.cyclic_gc_paused`), where
    no tune runs between them. Planner and engine pause it each for themselves, but a step's default
    layout is checked by planning it (`resolve_layout`, the plan kept for the step): made in one pause
    and simulated in the next, that plan's objects (330,000 actions at 16,384 GPUs) were walked by the
    collections in between and again when they were promoted. A tune keeps its own pauses (its memos
    live across steps, and the steps' garbage is freed as it goes)."""
    from contextlib import nullcontext

    from systems import cyclic_gc_paused

    return cyclic_gc_paused() if on else nullcontext()


def _resolved(row: dict, system: str, model, parallel, stream, steps: int, stride: int, cluster, tp: int, pp: int,
              cp: int, recompute: str, options: dict, hardware: str, profile, chunk_tokens: int,
              packed: dict | None = None, memory_error: float = 0.0, stack: str = "eager",
              software: dict | None = None):
    """The layout and recompute mode `system` is simulated with (omnibench/resolve.py: the flags, else
    its default layout; `auto`: the cheapest recompute that the simulator's memory estimate of the
    first simulated batches fits); what was settled goes into `row`. `packed`: the stream's batches
    packed so far (`_step_jobs`' own): the step then plans the very batch its layout was checked
    with, and takes the plan made for the check (systems.offer_plan) instead of planning again."""
    from dataclasses import replace

    from omnibench.resolve import ESTIMATE_STEPS, resolve_layout
    from simulator.cache import pack

    if hardware and profile is None:  # the plans estimated are the plans simulated
        parallel = replace(parallel, options=planner_options(system, parallel.options, hardware))
    packed = {} if packed is None else packed
    batches = []
    for i in step_indices(min(steps, ESTIMATE_STEPS), stride):
        if i not in packed:
            packed[i] = pack(stream.batch(i))
        batches.append(packed[i].get())
    res = resolve_layout(system, model, parallel, batches, cluster, tp=tp, pp=pp, cp=cp, recompute=recompute,
                         encoder_chunk_tokens=chunk_tokens,
                         budget_bytes=cluster.gpu.memory_bytes / (1.0 + memory_error), stack=stack,
                         software=software)
    if (tp, pp, cp) == (0, 0, 0):
        row["layout"] = f"tp{res.parallel.tp} pp{res.parallel.pp} cp{res.parallel.cp}"
        row["layout_note"] = res.layout_note
    row["recompute"] = res.recompute
    if res.chosen:
        row["recompute_note"] = res.memory_note()
    return replace(res.parallel, options=options), res.recompute


def _summary(results, metrics) -> dict:
    """A (size, system) row over its simulated steps (`results` without spans suffice, `metrics` are
    each step's `SimResult.metrics()` taken with them). A plan that does not fit in memory still gets
    its step time and throughput, with `fits: false` and why beside them (the simulator times the
    step as if memory were no object; the record keeps no trace of it)."""
    from simulator.result import FITS_RULE

    fits = all(r.fits for r in results)
    t = sum(r.step_time for r in results)
    tokens = sum(r.tokens for r in results)
    flops = sum(r.model_flops for r in results)
    n = results[0].world_size
    first = results[0]
    return {
        "fits": fits,
        "fit_message": "" if fits else next(r.fit_message for r in results if not r.fits),
        "steps": len(results),
        "step_time_s": t / len(results),
        "tokens_per_s": tokens / t if t else 0.0,
        "tokens_per_s_per_gpu": tokens / t / n if t else 0.0,
        "tflops_per_gpu": flops / t / n / 1e12 if t else 0.0,
        "mfu": flops / t / n / first.peak_flops if t else 0.0,
        # counting the recomputed forward too: what the GPUs execute
        "hardware_tflops_per_gpu": sum(r.hardware_tflops_per_gpu * r.step_time for r in results) / t if t else 0.0,
        "flop_formula": first.flop_formula,
        "compute_model": first.compute_model,
        "bubble": sum(r.bubble * r.step_time for r in results) / t if t else 0.0,
        "exposed_comm": sum(r.exposed_comm * r.step_time for r in results) / t if t else 0.0,
        "imbalance": sum(r.imbalance * r.step_time for r in results) / t if t else 0.0,
        # the peak a run would reserve (paired with fits: SimResult.peak_reported), the need under memory
        # pressure, which decides what fits (simulator/memory.py STRANDED), and the unpressured reserve
        "peak_memory_gib": max(r.peak_reported for r in results) / 2**30,
        "peak_memory_needed_gib": max(r.peak_needed for r in results) / 2**30,
        "peak_memory_unpressured_gib": max(r.peak_memory for r in results) / 2**30,
        "memory_capacity_gib": first.memory_capacity / 2**30,
        "fits_rule": FITS_RULE,
        "distinct_ranks": max(r.classes for r in results),
        "sim_seconds": sum(r.sim_seconds for r in results),
        # the planner's CPU seconds per step by simulator/planning.py's model, and what of it the steps
        # waited for (in step_time_s: planning overlaps the step before)
        "planning_s": sum(r.planning for r in results) / len(results),
        "planning_exposed_s": sum(r.planning_exposed for r in results) / len(results),
        # the same, measured in this process (a step answered by the step cache: as when it was simulated)
        "planning_cpu_s": (sum(m.get("planning_cpu_s", 0.0) for m in metrics) / len(metrics)) if metrics else 0.0,
        "breakdown_s": _mean_breakdown(results),
        "per_step": [dict(m) for m in metrics],
    }


def _mean_breakdown(results) -> dict:
    """Each part of SimResult.breakdown averaged over the steps (they add up to the mean step time)."""
    parts = [r.breakdown() for r in results]
    return {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]} if parts and parts[0] else {}


def _step_rows(row: dict) -> list[dict]:
    """steps.csv's rows of one (gpus, system) result."""
    out = []
    for m in row.get("per_step", []):
        ran = "step_time_s" in m  # a step that cannot plan has no time, only why (one that does not fit has both)
        out.append({"gpus": row["gpus"], "system": row["system"], "step": m["step"], "layout": row.get("layout", ""),
                    "fits": m["fits"], "why": m.get("error") or m.get("fit_message") or "",
                    **{k: m.get(k) if ran else None for k in ("tokens", "step_time_s", "tokens_per_s",
                                                             "tokens_per_s_per_gpu", "mfu", "bubble")},
                    "peak_memory_gib": m.get("peak_memory_gib")})
    return out


def _check_published(row, kernels: str | None = None, stack: str | None = None):
    """One published row, or (row, error text) when it cannot be simulated (a worker of the sweep)."""
    from simulator.published import check_row

    try:
        return check_row(row, kernels=kernels, stack=stack)
    except ValueError as e:
        return row, str(e).splitlines()[0]


def _validate_published(path: Path, kernels: str | None, stack: str | None = None, rows: str = "",
                        as_json: bool = False, markdown: Path | None = None, workers: int = 1) -> None:
    from functools import partial

    from omnibench.sweep import map_ordered
    from simulator.published import groups, load_published, to_json
    from simulator.published import markdown as to_markdown

    if workers is None or workers < 1:
        fail(f"workers must be a positive integer (published rows simulated at once), got {workers}")
    try:
        pattern = re.compile(rows) if rows else None
    except re.error as e:
        fail(f"rows: {rows!r} is not a regular expression ({e})")
    if markdown is not None:
        writable_file(markdown, "markdown")  # before the simulations, whose table it would lose
    try:
        table_rows = load_published(path)
        if pattern is not None:
            table_rows = [r for r in table_rows if pattern.search(r.name)]
            if not table_rows:
                fail(f"rows: no row name matches {rows!r}")
        done = map_ordered(partial(_check_published, kernels=kernels, stack=stack), table_rows, workers=workers,
                           label="published rows")
    except ValueError as e:
        fail(str(e))
    failed = [d for d in done if isinstance(d, tuple)]
    checks = [d for d in done if not isinstance(d, tuple)]
    if markdown is not None:
        command = f"python -m omnibench validate --published {path} --markdown {markdown}"
        if rows:
            command += f" --rows '{rows}'"
        if stack:
            command += f" --stack {stack}"
        if kernels:
            command += f" --kernels {kernels}"
        with writing(markdown):
            atomic_write(markdown, to_markdown(checks, command, [(r.name, e) for r, e in failed]))
    if as_json:
        out = to_json(checks)
        out["failed"] = [{"name": r.name, "error": e} for r, e in failed]
        print(json.dumps(out, indent=1))
        return
    table = Table(title=f"simulated vs published: {path}")
    for col in ("run", "split", "GPUs", "tp/pp/v/cp/ep", "dp", "batch", "pub. s", "sim. s", "error", "MFU",
                "GiB pub/sim"):
        table.add_column(col, justify="left" if col in ("run", "split", "dp") else "right", no_wrap=True)
    for c in checks:
        r = c.row
        mem = f"{r.peak_memory_gib:.0f}/" if r.peak_memory_gib else "-/"
        mem += f"{c.peak_memory_gib:.0f}" if c.fits else f"[red]{c.peak_memory_gib:.0f}[/]"
        table.add_row(r.name, ("unstated" if r.unstated else r.split) or "-", str(r.gpus),
                      f"{r.tp}/{r.pp}/{r.vpp}/{r.cp}/{r.ep}", r.dp_mode, f"{r.global_batch}x{r.micro_batch}",
                      f"{c.measured_s:.3f}", f"{c.simulated_s:.3f}", f"{c.error:+.1%}", f"{c.mfu:.1%}", mem)
    console.print(table)
    g = groups(checks)
    for split, st in g["split"].items():
        console.print(f"{split}: mean |error| {st.mean_abs:.1%} over {st.rows} rows, worst {st.worst_row} "
                      f"{st.worst:+.1%}", highlight=False)
    for (src, split), st in g["source"].items():
        console.print(f"  {src} ({split}): mean |error| {st.mean_abs:.1%} over {st.rows} rows, worst "
                      f"{st.worst_row} {st.worst:+.1%}", highlight=False)
    for split, st in g["memory"].items():
        console.print(f"peak memory ({split}): mean |error| {st.mean_abs:.1%} over {st.rows} rows, worst "
                      f"{st.worst_row} {st.worst:+.1%} (memory: simulator/memory.py's model)", highlight=False)
    console.print("error = simulated / published step time - 1 (negative: the simulator is optimistic); a row "
                  "that does not fit still gets its step time (memory in red).", highlight=False)
    console.print("published s: the row's step time; B*s / (tokens/s/GPU * GPUs); or its FLOP rate turned into "
                  "seconds with the publication's formula (megatron-hfu: 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))). "
                  "Rows whose publication does not state its FLOP counting ('unstated') are converted with this "
                  "project's model-FLOP counter (costs.batch_flops, no recomputation) and reported apart.",
                  highlight=False)
    for model in sorted({c.compute_model for c in checks}):
        console.print(f"compute model: {model}", highlight=False)
    for r, e in failed:
        console.print(f"[red]{r.name}: not simulated: {e}[/]", highlight=False)
    if markdown is not None:
        console.print(f"wrote {markdown}", highlight=False)


SIMULATE_HELP = "\n\n".join([
    "Simulate systems at cluster sizes nobody here has; one row per (size, system), and a record folder.",
    DEFAULT_LAYOUT_TEXT,
    RECOMPUTE_TEXT,
    "Steps: --steps N simulates batches 0..N-1 of the stream (with --step-stride K: 0, K, 2K, ..., a mix drifting "
    "over training), each system's layout kept for all of them.",
    "Tuned: --tuned puts each system at its own best layout, `omnibench tune` on step 0's batch (or, with "
    "--tune-steps K, on K batches picked across the simulated steps by how bursty they are), kept for every step "
    "(a static deployment, never re-tuned); with --steps > 1 the answer is also simulated on every step, and one "
    "that cannot run some step is ruled out for the next fastest (--no-tune-guard: kept anyway); the layout flags "
    "are then ignored, and with --no-* switches omni keeps the layout tuned with every technique on. --tune-budget 0 simulates --tune-fraction of each system's pruned "
    "space; --check-convergence tunes again at twice the budget and says how far the best moved (doubling "
    "again, up to 3 times, while it moves more than 2%).",
    "Machine and software: --hardware names a preset (h100 at 700 W, h100-500w: 96 GB HBM2e at a 500 W cap, h800: "
    "NVLink at 200 GB/s, h200, b200, gb200: one 72-GPU NVLink domain, a100-80g, a100-40g, v100-32g, cpu-gloo) "
    "or a file; --stack names the software (eager: this runtime; fused: Megatron's kernels; megatron-2021, megatron-core, nemo, megatron-flash, torchtitan[-compile...], composer, deepspeed-zero3: the stacks of published runs, simulator/stacks.py), and --sequence-parallel, --overlap-grad-reduce, --overlap-param-gather, --tp-overlap, --attention, --grad-reduce-dtype, --fp8 and --ep-dispatcher change one mechanism of it (Megatron-LM's names: each turns one on over the stack's choice); --dp-mode says how data parallelism holds the training state (an "
    "explicit fsdp never shards within nodes; hsdp shards within 8 nodes, or --dp-shard ranks); --cp-kind allgather "
    "(Llama 3's all-gathered K/V) runs in `run` too; ring is simulated only.",
    "Sweeps: every simulation runs in a pool (--workers, default every core) or on Ray (--ray), each step cached on "
    "disk (--no-cache to simulate again); with a pool, --tuned searches every system at once (the same answers).",
    "The --no-* switches turn off one omni technique each, for the ablation a paper shows.",
    "--memory-error E decides what fits (and, with --tuned or --recompute auto, what is chosen) as if every memory "
    "estimate were off by E (0.2: each rank needs 20% more than estimated); the peaks reported stay the estimates.",
])


SIMULATE_PANELS = {
    "Workload and model": ("workload", "system", "gpus", "model", "global_batch_tokens", "steps", "step_stride",
                           "seed"),
    "Machine and software": ("hardware", "stack", "sequence_parallel", "overlap_grad_reduce", "overlap_param_gather",
                             "tp_overlap", "attention", "grad_reduce_dtype", "fp8", "ep_dispatcher", "calibration"),
    "Layout": ("tp", "pp", "cp", "cp_kind", "ep", "expert_tp", "dp", "dp_shard", "dp_mode", "microbatches",
               "virtual_stages", "micro_batch", "encoder_tp", "encoder_sp", "encoder_ranks", "mixed_precision"),
    "Memory": ("recompute", "freeze", "encoder_chunk_tokens", "memory_error"),
    "Tuning": ("tuned", "tune_budget", "tune_fraction", "tune_steps", "check_convergence", "tune_cache", "seed_from",
               "no_tune_guard"),
    "Sweeps": ("workers", "ray", "no_cache"),
    "omni ablations and planner options": ("no_joint_pipeline", "no_reorder", "no_reshard", "no_long_short_sp",
                                           "no_llm_long_short", "option"),
    "Output": ("out", "as_json", "no_trace"),
}


def register(app: typer.Typer) -> None:
    app.command(help=SIMULATE_HELP)(in_panels(simulate, SIMULATE_PANELS))
    app.command()(calibrate)
    app.command()(validate)


def simulate(
    workload: str = typer.Option(..., "--workload", "-w", help="Named workload or a workload file."),
    system: str = typer.Option("all", "--system", "-s", help="A system name, a comma list, or 'all'."),
    gpus: str = typer.Option("256,1024", "--gpus", help="Cluster sizes, comma-separated."),
    hardware: str = typer.Option("h100", "--hardware", help=HARDWARE_HELP),
    model: str = typer.Option("omni-7b", "--model", "-m", help="Preset, TOML/YAML file or HF config.json."),
    stack: str = typer.Option("eager", "--stack", help=SOFTWARE_STACK_HELP),
    sequence_parallel: bool = typer.Option(None, "--sequence-parallel", help="Norms over 1/tp of the tokens."),
    overlap_grad_reduce: bool = typer.Option(None, "--overlap-grad-reduce", help="DP reduction behind the backward."),
    overlap_param_gather: bool = typer.Option(None, "--overlap-param-gather", help="ZeRO gathers behind the forward."),
    tp_overlap: bool = typer.Option(None, "--tp-overlap", help="TP collectives behind the GEMMs."),
    attention: str = typer.Option("", "--attention", help="flash | unfused; default: the stack's."),
    grad_reduce_dtype: str = typer.Option("", "--grad-reduce-dtype", help="fp32 | bf16 (Megatron's main grads)."),
    fp8: bool = typer.Option(False, "--fp8", help="FP8 linears (Hopper or later)."),
    ep_dispatcher: str = typer.Option("alltoall", "--ep-dispatcher", help="alltoall | deepep (MoE dispatch)."),
    dp_mode: str = typer.Option(None, "--dp-mode", help=DP_MODE_HELP),
    mixed_precision: str = typer.Option("autocast", "--mixed-precision", help=MIXED_PRECISION_HELP),
    micro_batch: int = typer.Option(0, "--micro-batch", help=MICRO_BATCH_HELP),
    steps: int = typer.Option(1, "--steps", help="Steps (batches) to simulate."),
    step_stride: int = typer.Option(1, "--step-stride", help="With --steps: every K-th batch of the stream."),
    calibration: str = typer.Option(None, "--calibration", help="Profile JSON from `omnibench calibrate`."),
    tp: int = typer.Option(0, "--tp", help=TP_HELP),
    pp: int = typer.Option(0, "--pp", help=PP_HELP),
    cp: int = typer.Option(0, "--cp", help=CP_HELP),
    cp_kind: str = typer.Option("ulysses", "--cp-kind", help=CP_KIND_HELP),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel degree (MoE models)."),
    expert_tp: int = typer.Option(0, "--expert-tp", help="0: experts split over tp | 1: whole."),
    dp: int = typer.Option(0, "--dp", help="Data-parallel degree; 0: what is left."),
    dp_shard: DpShard = 0,
    microbatches: int = typer.Option(0, "--microbatches", help="Per LLM data rank; 0: system default."),
    virtual_stages: int = typer.Option(1, "--virtual-stages", help="Interleaved 1F1B model chunks per pipeline rank."),
    encoder_tp: int = typer.Option(0, "--encoder-tp", help="Encoders' tensor parallelism; 0: the system's."),
    encoder_sp: int = typer.Option(0, "--encoder-sp", help="Encoders' SP group size; 0: the system's."),
    encoder_ranks: int = typer.Option(0, "--encoder-ranks", help="noncolocated: ranks for the encoders."),
    global_batch_tokens: int = typer.Option(
        0, "--global-batch-tokens", help="Tokens per step; 0: 8,192 per GPU of each cluster size."),
    recompute: str = typer.Option("auto", "--recompute", help=RECOMPUTE_HELP),
    freeze: str = typer.Option("", "--freeze", help=FREEZE_HELP),
    encoder_chunk_tokens: int = typer.Option(
        0, "--encoder-chunk-tokens", help="Encoder chunks of at most N tokens; 0: off."),
    seed: int = typer.Option(0, "--seed", help="Seed of the workload's sample stream."),
    out: Path = typer.Option(Path("results/sims"), "--out", help="Where the record folder goes."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
    no_joint_pipeline: bool = typer.Option(False, "--no-joint-pipeline", help="omni: encoder work before/after the LLM pipeline"),
    no_reorder: bool = typer.Option(False, "--no-reorder", help="omni: no grouped reordering in the loaders"),
    no_reshard: bool = typer.Option(False, "--no-reshard", help="omni: encoder outputs go back to their source rank"),
    no_long_short_sp: bool = typer.Option(False, "--no-long-short-sp", help="omni: long inputs stay data-parallel"),
    no_llm_long_short: bool = typer.Option(False, "--no-llm-long-short", help="omni: long LLM samples stay on one data rank"),
    option: list[str] = typer.Option([], "--option", help=OPTION_HELP),
    tuned: bool = typer.Option(False, "--tuned", help="Each system at its own best layout, tuned once, kept."),
    tune_budget: int = typer.Option(0, "--tune-budget", help="With --tuned: layouts per system; 0: a fraction."),
    tune_fraction: float = typer.Option(None, "--tune-fraction", help="Share of the pruned space (default 0.25)."),
    tune_steps: int = typer.Option(1, "--tune-steps", help="With --tuned: batches tuned on, picked by regime."),
    check_convergence: bool = typer.Option(False, "--check-convergence", help="With --tuned: tune again at 2x "
                                            "(again while the best moves > 2%)."),
    workers: int = typer.Option(None, "--workers", help="Simulations at once (default: every core)."),
    ray: str = typer.Option(None, "--ray", help="Ray cluster: auto, local or ray://host:port."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Simulate again (no step cache)."),
    tune_cache: Path = typer.Option(None, "--tune-cache", help="With --tuned: JSON file of tuned layouts to reuse/extend."),
    seed_from: list[Path] = typer.Option([], "--seed-from", metavar="FILE", help="With --tuned: seed each search from a tune "
                                         "cache or seeds file."),
    memory_error: float = typer.Option(0.0, "--memory-error", help=MEMORY_ERROR_HELP),
    no_tune_guard: bool = typer.Option(False, "--no-tune-guard", help="With --tuned: no check that the layout runs every step."),
    no_trace: bool = typer.Option(False, "--no-trace", help="The record without timelines or plans."),
) -> None:
    # the options as given, by name (taken before the body binds any other name): what the steps below read
    flags = SimpleNamespace(**locals())
    sim = _settle(flags)
    if tuned and tune_cache is not None:
        writable_file(tune_cache, "tune-cache")  # before the tune, whose answers it would lose
    made_out = not out.exists()
    writable_folder(out)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    final = _claim(out, _record_name(sim, stamp))
    tmp = final.with_name(final.name + INCOMPLETE)  # visible, like a run's; the plot loader refuses it
    rows, fitting = _simulate_and_record(sim, stamp, final, tmp, made_out)
    _report(sim, rows, fitting, final)


@dataclass
class _Simulation:
    """What `simulate` settled from its flags before anything is made on disk."""

    flags: SimpleNamespace  # the command's options, as given
    sizes: list[int]  # cluster sizes, each once
    options: dict  # the planners' options (omni's switches and --option)
    cache: dict  # the tune cache (--tune-cache), {} untuned
    dp_fields: dict  # ParallelSpec fields of --dp-mode, --dp-shard and --mixed-precision
    software: object  # simulator.stacks.Software of --stack and its mechanism flags
    sim_software: dict  # its SimOptions fields
    stack: str  # what the tune and the layout checks cost the blocks with
    systems: list[str]
    missing: list[str]  # with --system all: the systems not registered yet
    spec: object  # the model trained: the one named, less the encoders the workload never feeds
    model_note: str
    frozen: tuple
    profile: object  # simulator.calibrate.Profile of --calibration, or None
    clusters: dict  # size -> simulator.hardware cluster
    seeds: list  # tune.Seeds of --seed-from
    prepared: dict  # size -> (global batch tokens, sample stream, ParallelSpec)


def _settle(f: SimpleNamespace) -> _Simulation:
    """Every input of `simulate`, checked before anything is made (the --out folder, a record, the tune
    cache): a refused command leaves the disk as it found it. Checked in the order a user reads the
    flags, so that of two mistakes the same one is named first."""
    from omnibench.specs.presets import get_model

    sizes = list(dict.fromkeys(_ints(f.gpus, "gpus")))  # a size given twice is simulated once
    options = _planner_flags(f)
    _check_counts(f)
    cache = read_tune_cache(f.tune_cache) if f.tuned else {}
    if f.seed_from and not f.tuned:
        fail("seed-from: seeds start a tune; give --tuned too")
    from omnibench.sweep import SweepError, check_ray

    try:
        check_ray(f.ray)
    except SweepError as e:
        fail(str(e))
    dp_fields, software = _software_flags(f)
    _check_layout_flags(f)
    frozen = freeze_option(f.freeze)  # the names alone here; against the model once it is known
    systems, missing = _chosen_systems(f.system)
    try:
        from omnibench.resolve import model_for_workload
        from simulator.calibrate import Profile
        from simulator.hardware import load_cluster
        from workloads.registry import get_workload

        # every system trains the model less the encoders the workload never feeds
        named = get_model(f.model)
        model, model_note = model_for_workload(f.model, get_workload(f.workload))
        spec = get_model(model)
        profile = Profile.load(f.calibration) if f.calibration else None
        clusters = {n: load_cluster(f.hardware, n) for n in sizes}
    except ValueError as e:
        fail(str(e))
    frozen = freeze_option(f.freeze, named, spec)
    from simulator.stacks import fp8_capable

    gpu_name = next(iter(clusters.values())).gpu.name
    if software.fp8 and not fp8_capable(gpu_name):
        fail(f"fp8: FP8 tensor cores need Hopper or later (h100, h200, h800, b200, gb200); --hardware {f.hardware}'s "
             f"GPU is {gpu_name}")
    seeds = read_seeds(f.seed_from, spec.name) if f.seed_from else []
    sim = _Simulation(f, sizes, options, cache, dp_fields, software, software.sim_fields(), software.preset.kernels,
                      systems, missing, spec, model_note, frozen, profile, clusters, seeds, {})
    sim.prepared = _prepared(sim)
    return sim


def _planner_flags(f: SimpleNamespace) -> dict:
    """The planners' options of omni's --no-* switches and --option; an unknown key or value is refused
    whichever systems run."""
    from systems.omni.options import OmniOptions, options_from_flags
    from systems.spatial import parse_quota

    try:
        options = options_from_flags(f.no_joint_pipeline, f.no_reorder, f.no_reshard, f.no_long_short_sp, f.option,
                                     f.no_llm_long_short)
        OmniOptions.parse(options)
        parse_quota(options)
    except ValueError as e:
        fail(f"option: {e}")
    return options


def _check_counts(f: SimpleNamespace) -> None:
    """One-line errors for the steps simulated, the tune's budget and window, the workers and --memory-error."""
    if f.steps < 1:
        fail(f"steps must be a positive integer, got {f.steps}")
    if f.step_stride < 1:
        fail(f"step-stride must be a positive integer, got {f.step_stride}")
    if f.tune_budget < 0:
        fail(f"tune-budget must be >= 0 (0: --tune-fraction of each system's space), got {f.tune_budget}")
    if f.tune_fraction is not None and not 0 < f.tune_fraction <= 1:
        fail(f"tune-fraction must be in (0, 1] (a share of the layouts left after pruning), got {f.tune_fraction}")
    if f.tune_steps < 1 or f.tune_steps > f.steps:
        fail(f"tune-steps must be between 1 and --steps ({f.steps}), got {f.tune_steps}")
    if f.workers is not None and f.workers < 1:
        fail(f"workers must be a positive integer (default: every core), got {f.workers}")
    check_memory_error(f.memory_error)


def _software_flags(f: SimpleNamespace) -> tuple[dict, object]:
    """(the ParallelSpec fields of --dp-mode, --dp-shard and --mixed-precision, the Software of --stack and
    its mechanism flags); one line naming the flag otherwise."""
    dp_fields = _dp_fields(f.dp_mode, f.dp_shard)
    check_mixed_precision(f.mixed_precision, f.stack)
    dp_fields["mixed_precision"] = f.mixed_precision
    software = software_from_flags(f.stack, f.hardware, attention=f.attention, grad_reduce_dtype=f.grad_reduce_dtype,
                                   fp8=f.fp8, ep_dispatcher=f.ep_dispatcher, sequence_parallel=f.sequence_parallel,
                                   overlap_grad_reduce=f.overlap_grad_reduce,
                                   overlap_param_gather=f.overlap_param_gather, tp_overlap=f.tp_overlap)
    if f.tuned and software.flags() not in (["--stack", "eager"], ["--stack", "fused"]):
        fail(f"tuned: --tuned searches with --stack eager or fused and no mechanism flags; got "
             f"{' '.join(software.flags())}")
    return dp_fields, software


def _check_layout_flags(f: SimpleNamespace) -> None:
    """One-line errors for --expert-tp, --micro-batch, --encoder-chunk-tokens, --global-batch-tokens and
    --recompute (the values alone: the model checks the layout later)."""
    from omnibench.specs.costs import recompute_policy

    if f.expert_tp not in (0, 1):
        fail(f"expert-tp must be 0 (experts split over tp) or 1 (experts whole, ep over dp*cp*tp); got {f.expert_tp}")
    if f.micro_batch < 0 or (f.micro_batch and f.microbatches):
        fail(f"micro-batch must be a positive number of samples (or 0: --microbatches decides), and not given "
             f"with --microbatches; got --micro-batch {f.micro_batch} --microbatches {f.microbatches}")
    if f.encoder_chunk_tokens < 0:
        fail(f"encoder-chunk-tokens must be a token budget N >= 1 or 0 (off), got {f.encoder_chunk_tokens}")
    if f.global_batch_tokens < 0:
        fail(f"global-batch-tokens must be >= 0 (0 = 8,192 per GPU), got {f.global_batch_tokens}")
    try:
        if f.recompute != "auto":
            recompute_policy(f.recompute)
    except ValueError as e:
        fail(f"{e} (or auto)")


def _chosen_systems(system: str) -> tuple[list[str], list[str]]:
    """(the systems --system names, each once, in the order given; with `all`, the ones not registered yet)."""
    from systems import SYSTEMS, available_systems

    registered = available_systems()
    if system.strip() == "all":
        systems = registered
        missing = [s for s in SYSTEMS if s not in registered]
        if not systems:
            fail("system: no systems are registered yet")
        return systems, missing
    # each system once, in the order given: a repeated name would be simulated and reported twice
    systems = list(dict.fromkeys(s.strip() for s in system.split(",") if s.strip()))
    if not systems:
        fail(f"system must be one of {', '.join(registered) or '(none registered)'}, a comma list of "
             f"them, or all; got {system!r}")
    for s in systems:
        if s not in registered:
            fail(f"system must be one of {', '.join(registered) or '(none registered)'} or all; got {s!r}")
    return systems, []


def _prepared(sim: _Simulation) -> dict[int, tuple]:
    """Each size's (global batch tokens, sample stream, layout asked for), checked here (a workload that
    does not load, a layout the model refuses, a batch the stream cannot form) rather than inside the sweep."""
    from omnibench.specs.parallel import ParallelSpec
    from simulator.stacks import splits_embedding_loss

    f, spec = sim.flags, sim.spec
    prepared: dict[int, tuple] = {}
    for n in sim.sizes:
        gbt = f.global_batch_tokens or 8192 * n
        try:
            stream = _stream(f.workload, f.seed, gbt)
            parallel = ParallelSpec(world_size=n, gpus_per_node=sim.clusters[n].gpus_per_node, dp=f.dp,
                                    tp=f.tp or 1, pp=f.pp or 1, cp=f.cp or 1, ep=f.ep, microbatches=f.microbatches,
                                    virtual_stages=f.virtual_stages, cp_kind=f.cp_kind, options=sim.options,
                                    expert_tp=f.expert_tp, freeze=sim.frozen, encoder_tp=f.encoder_tp,
                                    encoder_sp=f.encoder_sp, encoder_ranks=f.encoder_ranks,
                                    embedding_loss_stages=splits_embedding_loss(sim.software, spec.llm.layers,
                                                                                f.pp or 1, f.virtual_stages),
                                    **sim.dp_fields)
            parallel.validate(spec)
        except ValueError as e:
            fail(str(e))
        try:
            stream.batch(step_indices(f.steps, f.step_stride)[0])
        except ValueError as e:
            fail(batch_error(e, n, f.global_batch_tokens))
        prepared[n] = (gbt, stream, parallel)
    return prepared


def _record_name(sim: _Simulation, stamp: str) -> str:
    """The record folder's name: when, the workload, the systems, the model, the machine, and what was
    switched off or changed."""
    f = sim.flags
    # the systems in the name: two simulations of one workload started in the same second differ by it
    chosen = "all" if f.system.strip() == "all" else "+".join(sim.systems)
    # a model named by a path keeps that path in its name (`dir/m.toml@no-vision`): its last part names it
    name = f"{stamp}-{Path(f.workload).stem}-{chosen}-{Path(sim.spec.name).name}-{Path(f.hardware).stem}"
    off = sorted(k for k, v in sim.options.items() if v is False)
    if off:
        name += "-no-" + "-".join(k.replace("_", "-") for k in off)
    if f.memory_error:
        name += f"-memerr{round(100 * f.memory_error):+d}"
    if sim.frozen:
        name += "-freeze-" + "-".join(sim.frozen)
    return name


def _simulate_and_record(sim: _Simulation, stamp: str, final: Path, tmp: Path, made_out: bool
                         ) -> tuple[list[dict], list[dict]]:
    """(rows, the rows that fit): every (size, system) simulated, and the record written to `tmp` and
    moved to `final` when some system ran some step. Whatever ends it early (an error, Ctrl-C,
    SIGTERM) leaves no record and no --out folder this command made."""
    from omnibench.sweep import Sweep, SweepError
    from simulator.traces import write_json_atomic

    f = sim.flags
    # SIGTERM (a job's time limit, `reproduce` stopped) ends the simulation through the cleanup below
    with exit_on_sigterm():
        try:
            with Sweep(f.workers, f.ray, label="simulate", quiet=f.as_json) as sweep, _one_gc_pause(not f.tuned):
                todo = _layouts_and_jobs(sim, sweep)
                outcomes = _run_steps(sweep, todo)
            rows = _result_rows(sim, todo, outcomes, tmp)
            config = _record_config(sim, rows, stamp)
            fitting = [r for r in rows if "error" not in r and r["fits"]]
            # Over many steps a record is worth keeping when some system ran some step (the rest say why).
            fitting = fitting or [r for r in rows if any(m["fits"] for m in r.get("per_step", []))]
            raise_if_stopped()  # a SIGTERM whose exit a finalizer dropped: nothing is published
            if fitting:
                # a full disk here ends the command with one line; the handler below removes the
                # unfinished folder, so no record is left that looks complete
                with writing(tmp):
                    write_json_atomic(tmp / "config.json", config)
                    write_json_atomic(tmp / "results.json", rows)
                    write_csv(tmp / "results.csv", rows, RESULT_COLUMNS)
                    write_csv(tmp / "steps.csv", [x for r in rows for x in _step_rows(r)], STEP_COLUMNS)
                    publish(tmp)
                    os.replace(tmp, final)
            else:  # nothing to plot or compare: no record, and a non-zero exit below
                shutil.rmtree(tmp)
                if made_out:
                    with suppress(OSError):
                        f.out.rmdir()
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if made_out:  # the --out folder this command made, left empty: as if never asked
                with suppress(OSError):
                    f.out.rmdir()
            if isinstance(e, SweepError):  # Ray lost or refusing meanwhile
                fail(str(e))
            if isinstance(e, SystemExit) and e.code == 128 + signal.SIGTERM:
                # stopped (the sweep's workers are already ended): leave now. The interpreter's exit
                # would join the process pool's manager thread, which a signal landing inside
                # concurrent.futures (holding a future's lock) can leave blocked for good
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(e.code)
            raise
    return rows, fitting


@dataclass
class _Size:
    """One cluster size's inputs, shared by its systems: its stream and the layout asked for, the
    stream's batches packed so far, and (--tuned) the batches tuned on and guarded, and the searches
    started beside each other (`_tune_all`: tune cache key -> the future of its search)."""

    n: int
    gbt: int
    stream: object
    parallel: object
    packed: dict = field(default_factory=dict)
    window: list | None = None
    guard: list = field(default_factory=list)
    found: dict = field(default_factory=dict)


def _layouts_and_jobs(sim: _Simulation, sweep) -> list[tuple[dict, list]]:
    """1. each system's layout at each size (tuned, its default, or the one asked for): (row, its
    steps' jobs) per (size, system)."""
    todo: list[tuple[dict, list]] = []  # (row, its steps' jobs)
    priors: dict[str, object] = {}  # system -> the last (smaller) size's answer, a tune.Prior
    for n in sim.sizes:
        size = _Size(n, *sim.prepared.pop(n))
        for s in sim.systems:
            todo.append(_system_jobs(sim, sweep, size, priors, s))
    return todo


def _system_jobs(sim: _Simulation, sweep, size: _Size, priors: dict, s: str) -> tuple[dict, list]:
    """(row, its steps' jobs) of system `s` at one size: its layout settled (tuned, its default, or the
    one asked for). A system that cannot plan gets its row's error and no jobs, or, simulated alone,
    ends the command with it."""
    from simulator.stacks import splits_embedding_loss

    f, spec, n = sim.flags, sim.spec, size.n
    row = {"gpus": n, "system": s, "global_batch_tokens": size.gbt,
           **({"freeze": list(sim.frozen)} if sim.frozen else {})}
    try:
        if f.tuned:
            sys_parallel, sys_recompute = _tuned_parallel(sim, sweep, size, priors, s, row)
        else:
            sys_parallel, sys_recompute = _resolved(row, s, spec, size.parallel, size.stream, f.steps,
                                                    f.step_stride, sim.clusters[n], f.tp, f.pp, f.cp, f.recompute,
                                                    sim.options, f.hardware, sim.profile, f.encoder_chunk_tokens,
                                                    size.packed, f.memory_error, sim.stack, sim.sim_software)
        if f.micro_batch and not f.tuned:
            sys_parallel = with_micro_batch(sys_parallel, size.stream.batch(0), f.micro_batch)
        # a stack that cuts pipelines with the embedding and loss as layers does so on
        # the layout settled here (a default or tuned pp too)
        split = splits_embedding_loss(sim.software, spec.llm.layers, sys_parallel.pp, sys_parallel.virtual_stages)
        if split != sys_parallel.embedding_loss_stages:
            sys_parallel = replace(sys_parallel, embedding_loss_stages=split)
            sys_parallel.validate(spec)
        row.setdefault("recompute", sys_recompute)
        jobs = _step_jobs(s, spec, sys_parallel, size.stream, f.steps, sim.clusters[n], sim.profile, sys_recompute,
                          f.hardware, f.step_stride, f.encoder_chunk_tokens,
                          want_plans=n <= SAVE_PLANS_UP_TO and not f.no_trace, use_cache=not f.no_cache,
                          packed=size.packed, stack=sim.stack, memory_error=f.memory_error,
                          software=sim.sim_software, spans=not f.no_trace)
    except ValueError as e:
        if len(sim.systems) == 1:
            fail(f"{s} at {n} GPUs: {str(e).splitlines()[0]}")
        row["error"] = str(e).splitlines()[0]
        jobs = []
    return row, jobs


def _tune_inputs(sim: _Simulation, sweep, priors: dict, n: int, gbt: int, s: str, window: list,
                 guard: list) -> tuple[str, dict]:
    """`s`'s tune cache key and `_search`'s arguments at `n` GPUs, tuned on `window` and guarded on
    `guard`: the same whether the search runs here or beside the others'."""
    from omnibench.tune import BUDGET_FRACTION, MAX_DOUBLINGS

    f = sim.flags
    budget_key = f.tune_budget or f"f{f.tune_fraction or BUDGET_FRACTION}"
    # each size's search starts from the next smaller size's answer
    prior = priors[s] if s in priors and priors[s].world < n else None
    mine = [sd for sd in sim.seeds if sd.candidate.system == s]
    key = _tune_key(mine, system=s, workload=f.workload, gpus=n, model=sim.spec.name,
                    hardware=f.hardware, seed=f.seed, global_batch_tokens=gbt,
                    budget=budget_key, calibration=f.calibration,
                    tune_steps=",".join(str(b.step) for b in window),
                    converge=MAX_DOUBLINGS if f.check_convergence else 0,
                    prior=prior.world if prior is not None else 0,
                    memory_error=f.memory_error, mixed_precision=f.mixed_precision,
                    guard=",".join(str(b.step) for b in guard), freeze=sim.frozen)
    return key, dict(fraction=f.tune_fraction, converge=f.check_convergence, sweep=sweep,
                     use_cache=not f.no_cache, prior=prior, stack=sim.stack, dp_mode=f.dp_mode,
                     memory_error=f.memory_error, seeds=mine, guard_batches=guard,
                     mixed_precision=f.mixed_precision, freeze=sim.frozen)


def _tune_window(sim: _Simulation, sweep, size: _Size, priors: dict) -> None:
    """The batches every system at this size is tuned on (the same for each) and the window a kept
    layout must run; with a pool, every system's search started at once."""
    from omnibench.tune import regime_batches
    from simulator.cache import pack

    f, n = sim.flags, size.n
    span = [size.stream.batch(k) for k in step_indices(f.steps, f.step_stride)]
    size.window = regime_batches(span, f.tune_steps)
    # the window a kept layout must run (--no-tune-guard: whatever the
    # tuned batches say); packed once for the tune and the steps alike
    size.guard = span if f.steps > 1 and not f.no_tune_guard else []
    for b in span:
        size.packed.setdefault(b.step, pack(b))
    if len(sim.systems) > 1 and sweep.concurrent():
        # every system's search at once: one system's waves alone leave
        # a worker idle, and no search reads another's (the answers go
        # into the tune cache in the systems' order below)
        sweep.describe(f"tune {len(sim.systems)} systems at {n:,} GPUs")
        size.found = _tune_all(sim.systems,
                               partial(_tune_inputs, sim, sweep, priors, n, size.gbt, window=size.window,
                                       guard=size.guard),
                               sim.cache, sim.spec, size.window, sim.clusters[n], sim.profile, f.tune_budget,
                               sim.options, f.hardware)


def _tuned_parallel(sim: _Simulation, sweep, size: _Size, priors: dict, s: str, row: dict):
    """(layout, recompute) of system `s` at its tuned layout (`tuned_layout`: tuned here, beside the
    others, or kept in the tune cache); what the tune settled goes into `row`."""
    f, n = sim.flags, size.n
    if size.window is None:  # the same batches for every system
        _tune_window(sim, sweep, size, priors)
    if not size.found:
        sweep.describe(f"tune {s} at {n:,} GPUs")
    key, kw = _tune_inputs(sim, sweep, priors, n, size.gbt, s, size.window, size.guard)
    c, entry = tuned_layout(s, sim.spec, size.window, sim.clusters[n], sim.profile, f.tune_budget, sim.options,
                            f.hardware, sim.cache, key, found=size.found.get(key),
                            describe={"system": s, "workload": f.workload, "gpus": n,
                                      "hardware": f.hardware, "model": sim.spec.name,
                                      "memory_error": f.memory_error}, **kw)
    if entry.get("prior") and (s not in priors or priors[s].world < n):
        from omnibench.tune import Prior

        priors[s] = Prior.from_row(entry["prior"])
    if f.tune_cache is not None:
        with writing(f.tune_cache):  # whole or not at all, as open() makes files
            atomic_write(f.tune_cache, json.dumps(sim.cache, indent=1))
    sys_parallel = c.parallel(n, sim.clusters[n].gpus_per_node, sim.options)
    if f.dp_mode is not None:
        sys_parallel = replace(sys_parallel, **sim.dp_fields)
    sys_parallel = replace(sys_parallel, freeze=sim.frozen)
    _tuned_row(row, c, entry)
    return sys_parallel, c.recompute


def _tuned_row(row: dict, c, entry: dict) -> None:
    """What the tune settled, in `row`: the layout (and as flags), when and how it was tuned."""
    row["layout"] = c.label()
    row["layout_flags"] = " ".join(c.flags())  # to simulate it again untuned
    row["tuned_at_step"] = entry["tuned_at_steps"][0]
    row["tuned_at_steps"] = entry["tuned_at_steps"]
    row["tune_seconds"] = entry["tune_seconds"]
    row["tune_budget"], row["tune_space"] = entry.get("budget"), entry.get("space")
    conv = entry.get("convergence")
    if conv:
        row["tune_budget_2x"] = conv["budget_2x"]
        row["tune_moved"], row["tune_converged"] = conv["moved"], conv["converged"]
    if entry.get("seeds"):
        row["tune_seeds"] = len(entry["seeds"])
        row["tune_over_seeds"] = entry.get("over_seeds")
    if "guarded" in entry:
        row["tune_guard_steps"] = entry["guard_steps"]
        row["tune_guarded"] = entry["guarded"]
        row["tune_ruled_out"] = len(entry["guarded"])


def _run_steps(sweep, todo: list[tuple[dict, list]]):
    """2. every step of every (size, system) at once: independent simulations; their outcomes in
    `todo`'s order."""
    from simulator.cache import run_step

    sweep.describe(f"simulate {sum(len(j) for _, j in todo)} step(s)")
    step_jobs = [j for _, jobs in todo for j in jobs]
    if not sweep.in_process(len(step_jobs)):
        # the steps run in workers: the checked layout's spare plan and engine would only be
        # held here while they run (simulator.engine.offer_engine, systems.offer_plan)
        from simulator.engine import drop_spare_engine
        from systems import drop_spare_plan

        drop_spare_engine()
        drop_spare_plan()
    return iter(sweep.map(run_step, step_jobs))


def _result_rows(sim: _Simulation, todo: list[tuple[dict, list]], outcomes, tmp: Path) -> list[dict]:
    """A row per (size, system) over its simulated steps (or why it has none), the traces and plans of
    those that ran into `tmp`, and each size's speedups over its best baseline."""
    steps = sim.flags.steps
    rows: list[dict] = []
    for row, jobs in todo:
        n, s = row["gpus"], row["system"]
        if "error" in row:
            rows.append(row)
            continue
        try:
            results, metrics, plans, failed = _collect([next(outcomes) for _ in jobs], steps)
        except ValueError as e:
            if len(sim.systems) == 1:
                fail(f"{s} at {n} GPUs: {e}")
            row["error"] = str(e).splitlines()[0]
            rows.append(row)
            continue
        _steps_row(row, results, metrics, failed, steps)
        rows.append(row)
        if "error" in row or not row["fits"] or sim.flags.no_trace:
            continue  # no trace: a timeline of a step that cannot run would mislead
        _write_timeline(tmp, s, n, results[0], plans)
    for n in sim.sizes:
        group = [r for r in rows if r["gpus"] == n and "error" not in r and r["fits"]]
        best = max((r["tokens_per_s"] for r in group if r["system"] in BASELINES), default=0.0)
        for r in group:
            r["speedup_over_best_baseline"] = r["tokens_per_s"] / best if best else None
    return rows


def _steps_row(row: dict, results, metrics: list[dict], failed: list[dict], steps: int) -> None:
    """`row` over its simulated steps (`_summary`), each step's own metrics with it; a layout that
    cannot run every step has no throughput as a whole."""
    row.update(_summary(results, metrics))
    if metrics and metrics[0].get("plan"):
        row["plan"] = metrics[0]["plan"]  # what the first step's plan decided
    # each step's own metrics (a step that did not fit says so: a figure shows which ran);
    # "step" is the stream's batch index (with --step-stride, not the position)
    row.setdefault("per_step", metrics)
    row["per_step"] = sorted(row["per_step"] + failed, key=lambda m: m["step"])
    for m in row["per_step"]:
        m["layout"] = row.get("layout", "")
    row["steps"] = len(row["per_step"])
    bad = [m for m in row["per_step"] if not m["fits"]]
    row["steps_failed"] = len(bad)
    if bad and steps > 1:  # a layout that cannot run every step has no throughput (as a whole)
        first = bad[0]
        row["fits"] = False if "fit_message" in first else row["fits"]
        if "error" in first:
            row["error"] = f"step {first['step']}: {first['error']}"
        else:
            row["fit_message"] = f"step {first['step']}: {first['fit_message']}"


def _write_timeline(tmp: Path, s: str, n: int, first, plans) -> None:
    """The record's Perfetto trace of the first step of system `s` at `n` GPUs, and (clusters up to
    SAVE_PLANS_UP_TO) its steps' plans."""
    from simulator.traces import perfetto_events, write_json_atomic

    with writing(tmp / f"trace_{s}_{n}.json"):
        write_json_atomic(tmp / f"trace_{s}_{n}.json", perfetto_events(first, max_ranks=TRACE_RANKS), indent=None)
    if n <= SAVE_PLANS_UP_TO:
        for p in plans:
            with writing(tmp / f"plan_{s}_{n}_step{p.step}.json"):
                (tmp / f"plan_{s}_{n}_step{p.step}.json").write_text(p.to_json(indent=None))


def _record_config(sim: _Simulation, rows: list[dict], stamp: str) -> dict:
    """The record's config.json: what was simulated, as asked and as settled."""
    f, software = sim.flags, sim.software
    tp, pp, cp = f.tp, f.pp, f.cp
    return {
        "command": "simulate", "workload": f.workload, "systems": sim.systems, "systems_missing": sim.missing,
        "gpus": sim.sizes, "hardware": f.hardware, "cluster": {n: sim.clusters[n].name for n in sim.sizes},
        "model": sim.spec.name, **({"model_note": sim.model_note} if sim.model_note else {}),
        "steps": f.steps, "calibration": f.calibration,
        # the layout asked for: 0 everywhere = each system's own default (rows' "layout" say which)
        **({"default_layouts": True} if (tp, pp, cp) == (0, 0, 0) else {"tp": tp or 1, "pp": pp or 1, "cp": cp or 1}),
        "ep": f.ep, "dp": f.dp, "dp_shard": f.dp_shard, "dp_mode": f.dp_mode, "microbatches": f.microbatches,
        "micro_batch": f.micro_batch, "stack": software.stack,
        "software": " ".join(software.flags()), "mixed_precision": f.mixed_precision, "cp_kind": f.cp_kind,
        "global_batch_tokens": f.global_batch_tokens,
        "recompute": f.recompute, "freeze": list(sim.frozen),
        "encoder_chunk_tokens": f.encoder_chunk_tokens, "seed": f.seed, "date": stamp, "options": sim.options,
        "tuned": f.tuned,
        "memory_error": f.memory_error,
        "step_stride": f.step_stride, "steps_simulated": step_indices(f.steps, f.step_stride),
        # a static deployment: each system's layout tuned once (on step 0's batch, or on --tune-steps
        # batches picked across the window by regime), kept for every step
        **({"tune_budget": f.tune_budget, "tune_fraction": f.tune_fraction, "tune_steps": f.tune_steps,
            "check_convergence": f.check_convergence, "seed_from": [str(p) for p in f.seed_from],
            "tune_guard": not f.no_tune_guard,
            "tuned_at_step": min((r["tuned_at_step"] for r in rows if "tuned_at_step" in r), default=0),
            "tuned_at_steps": sorted({k for r in rows for k in r.get("tuned_at_steps", [])}),
            "layout_kept": True} if f.tuned else {}),
        "calibration_provenance": sim.profile.provenance if sim.profile else None,
        "provenance": provenance(f"simulated: {f.hardware}"),
    }


def _report(sim: _Simulation, rows: list[dict], fitting: list[dict], final: Path) -> None:
    """The results: JSON (--json), or a table, why each row that has no throughput has none, how each
    layout was settled, and the record's path; exit 1 when nothing fits."""
    f = sim.flags
    if f.as_json:
        print(json.dumps({"record": str(final) if fitting else None, "missing_systems": sim.missing,
                          "results": [{k: v for k, v in r.items() if k != "per_step"} for r in rows]}, indent=1))
        if not fitting:
            raise typer.Exit(1)
        return
    console.print(_results_table(sim, rows))
    for r in rows:
        if "error" in r:
            console.print(f"{r['gpus']} GPUs, {r['system']}: cannot plan: {r['error']}", highlight=False)
        elif not r["fits"]:
            console.print(f"{r['gpus']} GPUs, {r['system']}: {r['fit_message']}", highlight=False)
    for r in rows:
        said = []
        if r.get("layout") and f.tuned:
            said.append(_tuned_note(r, f.steps))
        elif r.get("layout"):
            said.append(f"default layout {r['layout']}" + (f" ({r['layout_note']})" if r.get("layout_note") else ""))
        if r.get("recompute_note"):
            said.append(r["recompute_note"])
        if said:
            console.print(f"{r['gpus']} GPUs, {r['system']}: " + "; ".join(said), highlight=False, soft_wrap=True)
    if sim.missing:
        console.print(f"not registered yet, so not simulated: {', '.join(sim.missing)}")
    if sim.model_note:
        console.print(sim.model_note, highlight=False, soft_wrap=True)
    formula = next((r["flop_formula"] for r in rows if "flop_formula" in r), "")
    if formula:
        console.print(f"MFU = {formula} / (step time x GPUs x peak)", highlight=False)
    if not fitting:
        fail("no system fits or plans this layout (the reason per system is above), so no throughput and no "
             "record; try a larger --tp or --pp, more GPUs, or a smaller --global-batch-tokens"
             + ("" if f.recompute == "auto" else ", or --recompute auto"), code=1)
    console.print(f"record: {final}", soft_wrap=True)


def _results_table(sim: _Simulation, rows: list[dict]) -> Table:
    """One row per (size, system): throughput, where the step's time went, memory and speedup."""
    f = sim.flags
    table = Table(title=f"{sim.spec.name} on {f.hardware}, workload {f.workload}, {f.steps} step(s)"
                        + (f", frozen: {', '.join(sim.frozen)}" if sim.frozen else ""))
    for col in ("GPUs", "system", "tokens/s", "tok/s/GPU", "TFLOPS/GPU", "MFU", "bubble", "exposed comm",
                "imbalance", "mem need / peak GiB", "speedup"):
        table.add_column(col, justify="right" if col not in ("system",) else "left")
    for r in rows:
        if "error" in r:
            table.add_row(str(r["gpus"]), r["system"], "[red]cannot plan[/]", *[""] * 8)
        else:
            sp = r.get("speedup_over_best_baseline")
            need = f"{r['peak_memory_needed_gib']:.1f}"
            mem = (need if r["fits"] else f"[red]{need} > {r['memory_capacity_gib']:.0f}[/]")
            mem += f" / {r['peak_memory_gib']:.1f}"
            table.add_row(
                str(r["gpus"]), r["system"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                f"{r['tflops_per_gpu']:.1f}", f"{r['mfu']:.1%}", f"{r['bubble']:.1%}", f"{r['exposed_comm']:.1%}",
                f"{r.get('imbalance', 0.0):.1%}", mem, (f"{sp:.2f}x" if sp else "-") if r["fits"] else "[red]does not fit[/]",
            )
    return table


def _tuned_note(r: dict, steps: int) -> str:
    """How a row's tuned layout was found: its budget, steps, convergence, seeds and guard, and the
    flags that simulate it again untuned."""
    kept = f", kept for all {steps} steps" if steps > 1 else ""
    spent = f"; tuned in {r['tune_seconds']:.0f} s" if r.get("tune_seconds") else "; from --tune-cache"
    at = ", ".join(str(k) for k in r.get("tuned_at_steps", [0]))
    conv = ""
    if r.get("tune_converged") is not None:
        moved = r["tune_moved"]
        conv = (f"; budget {r['tune_budget_2x']} moved the best by "
                + (f"{moved:.1%}" if moved is not None else "(only it found a fit)")
                + (": converged" if r["tune_converged"] else ": NOT converged"))
    if r.get("tune_seeds"):
        over = r.get("tune_over_seeds")
        conv += (f"; {r['tune_seeds']} seed(s): " + ("none fitted" if over is None else
                 "the answer is a seed" if over <= 0 else f"beat the fastest by {over:.1%}"))
    if r.get("tune_guard_steps"):
        out = r.get("tune_guarded") or []
        conv += (f"; checked on {len(r['tune_guard_steps'])} more step(s)" + (
            ", ruled out " + ", ".join(f"{g['layout']} (step {g['step']})" for g in out) if out else ""))
    return (f"tuned layout {r['layout']} (budget {r.get('tune_budget')} of {r.get('tune_space')}, "
            f"tuned at step(s) {at}{kept}{spent}{conv}; as flags: {r['layout_flags']})")


def calibrate(
    run_dirs: list[Path] = typer.Argument(..., help="Run record folders (from `omnibench run`)."),
    out: Path = typer.Option(None, "--out", help="Profile JSON to write (default: results/sims/calibration-<date>.json)."),
    hardware: str = typer.Option(None, "--hardware", help="Base preset; default: the runs' own (else cpu-gloo)."),
) -> None:
    """Fit compute efficiency curves and collective alpha/beta from run traces."""
    from simulator.calibrate import calibrate as fit

    if out is None:
        out = Path("results/sims") / f"calibration-{_dt.datetime.now(_dt.timezone.utc):%Y%m%d-%H%M%S}.json"
    writable_file(out)  # before the fit, which a profile that cannot be written would lose
    try:
        prof = fit(_finished_runs([str(d) for d in run_dirs], "calibrate"), hardware)
    except ValueError as e:
        fail(str(e))
    prof.provenance["command"] = " ".join(["omnibench calibrate", *(str(d) for d in run_dirs), "--out", str(out),
                                           *(["--hardware", hardware] if hardware else [])])
    with writing(out):
        prof.save(out)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(out, 0o666 & ~umask)  # like every record file (saved through a temp file: 0600)
    table = Table(title="calibration")
    table.add_column("model")
    table.add_column("fit", justify="left")
    for k, c in prof.compute.items():
        table.add_row(f"compute.{k}", f"e_max {c.e_max:.3g} of {c.peak_flops / 1e12:.3g} TF, F_half "
                      f"{c.half_flops / 1e9:.3g} GFLOP, attn x{c.attention_weight:.2f}, overhead "
                      f"{c.overhead_s * 1e3:.2f} ms/action + {c.per_sequence_s * 1e6:.0f} us/sequence + "
                      f"{c.per_input_element_s * 1e9:.2f} ns/input element + {c.per_inline_call_s * 1e6:.0f} "
                      "us/inline collective call; "
                      f"{_fit_text(prof.fit.get(f'compute.{k}', {}))}")
    for k, (a, b) in prof.collectives.items():
        table.add_row(f"collectives.{k}", f"alpha {a * 1e6:.1f} us/step, beta {b / 1e9:.3g} GB/s; "
                      f"{_fit_text(prof.fit.get(f'collectives.{k}', {}))}")
    if prof.optimizer is not None:
        per_layer = (f" + {prof.optimizer[2] * 1e3:.2f} ms/sharded layer + {prof.optimizer[3] * 1e3:.2f} ms/plain layer"
                     if len(prof.optimizer) >= 4 else "")
        table.add_row("optimizer", f"{prof.optimizer[0] * 1e3:.2f} ms + {prof.optimizer[1] * 1e9:.3g} ns/param"
                      f"{per_layer}; "
                      f"{_fit_text(prof.fit.get('optimizer', {}))}")
    console.print(table)
    from simulator.calibrate import fit_warnings

    for w in fit_warnings(prof):
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    if prof.lock_skew:
        console.print(f"lock-step skew: {prof.lock_skew:.1%} of a lock-stepped action's compute", highlight=False)
    console.print(f"profile: {out}")

def validate(
    run_dirs: list[Path] = typer.Argument(None, help="Run record folders; default: every folder in results/runs."),
    calibration: str = typer.Option(None, "--calibration", help="Profile JSON; default: datasheet figures."),
    hardware: str = typer.Option(None, "--hardware"),
    by_action: bool = typer.Option(False, "--by-action", help="Also break each run down by action kind: "
                                   "measured wall and CPU seconds vs simulated, per step."),
    published: Path = typer.Option(None, "--published", help="CSV of published training results, or a "
                                   "shipped table's name (megatron_a100, published_runs): simulate each "
                                   "row, print the error."),
    kernels: str = typer.Option(None, "--kernels", help="With --published: kernel profile for every row "
                                "(name or .json); 'none' = the datasheet roofline fallback."),
    stack: str = typer.Option(None, "--stack", help="With --published: cost every row's blocks with this "
                              "software stack (eager | fused) instead of the row's own."),
    rows: str = typer.Option("", "--rows", help="With --published: only rows whose name matches this "
                             "regular expression."),
    as_json: bool = typer.Option(False, "--json", help="With --published: print rows and statistics as JSON."),
    markdown: Path = typer.Option(None, "--markdown", help="With --published: also write the validation "
                                  "table (per split, per source, per row) to this Markdown file."),
    workers: int = typer.Option(1, "--workers", help="With --published: rows simulated in parallel "
                                "(processes)."),
) -> None:
    """Simulate each run's own Plan and compare with the measured step time (or, with --published,
    each row of a table of published large-scale results)."""
    given = [f for f, v in (("markdown", markdown), ("rows", rows), ("kernels", kernels)) if v]
    if published is None and given:
        fail(f"{given[0]}: applies to --published only (a table of published results); give --published FILE")
    if published is not None:
        if stack is not None and stack not in ("eager", "fused"):
            fail(f"stack must be one of eager, fused; got {stack!r}")
        _validate_published(published, kernels, stack, rows, as_json, markdown, workers)
        return
    from simulator.calibrate import Profile
    from simulator.calibrate import validate as check

    dirs = [str(d) for d in run_dirs] if run_dirs else sorted(
        str(p) for p in Path("results/runs").glob("*") if p.is_dir())
    if not dirs:
        fail("validate: no run folders given and none in results/runs")
    try:
        prof = Profile.load(calibration) if calibration else None
        rows = check(_finished_runs(dirs, "validate"), prof, hardware)
    except ValueError as e:
        fail(str(e))
    table = Table(title="simulated vs measured" + (" (calibrated)" if prof else ""))
    for col in ("run", "system", "ranks", "measured s", "simulated s", "measured tok/s", "simulated tok/s",
                "error", "host cpu/wall"):
        table.add_column(col, justify="left" if col in ("run", "system") else "right")
    done = [v for v in rows if v.steps]
    for v in done:
        table.add_row(Path(v.run).name, v.system, str(v.world_size), f"{v.measured_s:.4f}",
                      f"{v.simulated_s:.4f}", f"{v.tokens / v.measured_s:,.0f}", f"{v.tokens / v.simulated_s:,.0f}",
                      f"{v.error:+.1%}", "-" if v.cpu_share is None else f"{v.cpu_share:.2f}")
    console.print(table)
    for v in rows:
        if not v.steps:
            console.print(f"{Path(v.run).name}: {v.note}", highlight=False)
    if not done:
        fail("validate: no run could be compared (see the reasons above)")
    mae = sum(abs(v.error) for v in done) / len(done)
    console.print(f"mean absolute error: {mae:.1%} over {len(done)} run(s); step times are medians over "
                  "each run's steps after the first (warm-up)")
    for model in sorted({v.compute_model for v in done if v.compute_model}):
        console.print(f"compute model: {model}", highlight=False)
    if any(v.cpu_share is not None for v in done):
        console.print("host cpu/wall: CPU over wall time of the actions that wait for nobody; well below 1 means "
                      "other work shared the cores and the measured times are not the run's alone", highlight=False)
    if prof is not None:
        fitted_on = set(prof.provenance.get("runs", []))
        inside = [v for v in done if str(Path(v.run).resolve()) in fitted_on]
        held = [v for v in done if v not in inside]
        if inside:
            console.print(f"{len(inside)} of {len(done)} runs were also used to fit the profile (in-sample)")
        else:
            console.print("no run here was used to fit the profile (held out)")
        for label, part in (("in-sample", inside), ("held-out", held)):
            if part and held and inside:
                console.print(f"mean absolute error, {label}: {sum(abs(v.error) for v in part) / len(part):.1%} "
                              f"over {len(part)} run(s)")
    if by_action:
        from simulator.calibrate import action_breakdown

        for v in done:
            t = Table(title=f"{Path(v.run).name}: seconds per step, summed over ranks")
            for col in ("action", "module", "measured wall", "measured CPU", "simulated"):
                t.add_column(col, justify="left" if col in ("action", "module") else "right")
            try:
                parts = action_breakdown(v.run, prof, hardware)
            except ValueError as e:
                fail(str(e))
            for r in parts:
                t.add_row(r.kind, r.module, f"{r.measured_s:.4f}",
                          "-" if r.measured_cpu_s is None else f"{r.measured_cpu_s:.4f}", f"{r.simulated_s:.4f}")
            console.print(t)
        console.print("simulated: forward/backward/optimizer on the compute stream (with exposed inline "
                      "communication); send/boundary/grad_sync as transfers; a recv's wait is not an action "
                      "in the simulator but a measured span", highlight=False)

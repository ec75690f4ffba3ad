"""What every rank runs: set up the process group, plan each step, execute it, report metrics.

Rank 0 gathers every rank's trace and step figures and writes the record folder; the folder only
loses its `.incomplete` suffix once everything is written (records.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import re
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from omnibench.plan import Plan
from omnibench.runtime import metrics, records
from omnibench.runtime.executor import Executor
from omnibench.runtime.loading import LoaderExchange
from omnibench.runtime.run_inputs import batch_source, parallel_spec
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.run import RunSpec
from omnibench.stopping import die_with_parent
from systems import get_planner
from systems.common import data_rank


class InjectedFailure(RuntimeError):
    """Raised on purpose by --inject-failure (tests of failure handling)."""


def loss_tokens(plan: Plan, rank: int) -> int:
    """This rank's share of the step's loss tokens (LLM data ranks count their samples)."""
    from omnibench.models.inputs import loss_token_count

    lay = plan.layouts["llm"]
    if rank not in lay.ranks or data_rank(lay, rank) != rank:
        return 0
    return sum(loss_token_count(plan.sample(i)) for mb in plan.assignment["llm"][rank] for i in mb)


def run_rank(spec: RunSpec, model: MultimodalSpec, run_dir: str, store=None) -> None:
    """This rank's share of one run. `store`: the rendezvous of this run's process group (launch_many
    runs several in one process, each under a prefix of the launcher's store); None: from the
    environment (MASTER_ADDR/MASTER_PORT), as torchrun and `launch` set it."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(spec.extra["device"])
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(int(spec.extra.get("threads", 1)))
    dtype = torch.bfloat16 if spec.extra["dtype"] == "bf16" else torch.float32
    timeout = timedelta(seconds=spec.timeout_s)
    dist.init_process_group(spec.extra["backend"], rank=rank, world_size=world, timeout=timeout, store=store,
                            device_id=device if device.type == "cuda" else None)
    planner = get_planner(spec.system)
    parallel = parallel_spec(spec, world)
    next_batch = batch_source(spec)
    # Step 0 planned in one process gives the layouts the runtime builds once.
    first = planner.plan(model, parallel, next_batch(0))
    ex = Executor(model, first, rank, device, dtype, spec.seed, spec.lr, timeout, spec.optimizer,
                  recompute=spec.recompute, compile=spec.compile,
                  encoder_chunk_tokens=max(0, spec.encoder_chunk_tokens),  # -1: auto, settled before launch
                  mixed_precision=spec.mixed_precision)
    # Systems whose loaders exchange metadata (omni) plan every step from that real exchange.
    exchange = (LoaderExchange(planner, model, parallel, first.layouts, rank, timeout)
                if hasattr(planner, "loader_spec") else None)

    def prepare(step: int) -> tuple[Plan, dict, float]:
        """Step `step`'s Plan, the loaders' measured exchanges and the planner's CPU seconds: on the
        planner thread, as every system's data loader would (omni's loaders exchange metadata first)."""
        if exchange is not None:
            batch, loading, loaded = exchange.run(step, next_batch(step).samples, t0)
            how = {"loading": loading}
        else:
            batch, how, loaded = next_batch(step), {}, {}
        cpu = time.thread_time()
        plan = planner.plan(model, parallel, batch, **how)
        return plan, loaded, time.thread_time() - cpu

    plans = []
    fail_rank, fail_step = (int(x) for x in spec.inject_failure.split(":")) if spec.inject_failure else (-1, -1)
    steps = []
    dist.barrier()
    t0 = time.perf_counter()
    # Every system plans step s+1 on a thread while step s computes; step 0 waits for all of its own.
    planning_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"planner{rank}")
    wait = time.perf_counter()
    prefetch = planning_thread.submit(prepare, 0)
    for step in range(spec.steps):
        # What the step waited for: loading and planning that did not fit under the previous step
        # (step 0's from its submission: the planner thread may hold the GIL until it is done)
        wait = wait if step == 0 else time.perf_counter()
        plan, loaded, planning_s = prefetch.result(timeout=spec.timeout_s)
        waited = time.perf_counter() - wait
        if step + 1 < spec.steps:
            prefetch = planning_thread.submit(prepare, step + 1)
        if rank == 0:
            plans.append(plan)  # every step's Plan goes into the record (plans.jsonl)
        if plan.layouts != first.layouts:
            raise RuntimeError(f"step {step}: the planner changed layouts between steps; the runtime builds them once")
        counts = torch.tensor([loss_tokens(plan, rank)], dtype=torch.float64, device=device)  # NCCL: on GPU
        dist.all_reduce(counts)
        if rank == fail_rank and step == fail_step:
            raise InjectedFailure(f"injected failure on rank {rank} at step {step}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = ex.run_step(plan, int(counts.item()), t0, loaded)
        # Waiting for the loaders and the planner is part of the step, for every system.
        end = time.perf_counter() + waited
        figures = torch.tensor([loss, end - start], dtype=torch.float64, device=device)
        loss_t, time_t = figures[:1].clone(), figures[1:].clone()
        dist.all_reduce(loss_t)
        dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
        figures = torch.cat([loss_t, time_t]).cpu()
        steps.append({"step": step, "loss": float(figures[0]), "step_time_s": float(figures[1]),
                      "start_s": start - t0, "peak_memory_bytes": metrics.peak_memory(device),
                      "loss_tokens": int(counts.item()), "planning_s": planning_s, "waited_s": waited})
        if rank == 0:  # the record takes step figures from rank 0 (other ranks: peak memory only)
            steps[-1].update(**metrics.batch_figures(model, plan), plan={"options": plan.options, **plan.notes})
            records.progress(run_dir, step, spec.steps, float(figures[0]), float(figures[1]), steps[-1], plan)
    planning_thread.shutdown(wait=True)
    params = ex.full_parameters() if spec.dump_params else None
    mine = {"rank": rank, "spans": [s.__dict__ for s in ex.spans], "steps": steps, "notes": ex.notes}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if params is not None:
        torch.save(params, os.path.join(run_dir, f"params_rank{rank}.pt"))
    if rank == 0:
        records.finish(run_dir, spec, model, plans, gathered, device, dtype)
    dist.barrier()
    dist.destroy_process_group()


# How gloo and NCCL word the failures a rank sees when another rank died or stopped answering: the
# launcher names a rank reporting one of these only when no rank failed on its own.
_PEER_LOST = re.compile(r"gloo/transport|Connection (closed|reset) by peer|Broken pipe|Timed out waiting|"
                        r"NCCL communicator was aborted|collective operation timeout|Socket Timeout")


def lost_peer(e: BaseException) -> bool:
    """True when `e` says another rank died or stopped answering, not that this rank went wrong."""
    if isinstance(e, (TimeoutError, concurrent.futures.TimeoutError, dist.DistError)):
        return True
    return bool(_PEER_LOST.search(str(e)))


def _die_with_launcher() -> None:
    """Ranks run in sessions of their own (launch.py), so nothing else ends them if the launcher is
    killed outright (SIGKILL, the OOM killer, a test's timeout): ask Linux to SIGKILL this rank then."""
    launcher = os.environ.get("OMNIBENCH_LAUNCHER_PID")
    if os.environ.get("OMNIBENCH_LAUNCHER") == "1" and launcher:
        die_with_parent(int(launcher))


def _heartbeat(run_dir: str, rank: int) -> None:
    """Touch this rank's heartbeat every records.HEARTBEAT_S from a daemon thread: it keeps beating
    while the rank computes or waits in a collective (which releases the interpreter), and stops when
    the process is stopped or frozen, which is how the launcher tells the rank everyone waits for."""
    import threading

    path = records.heartbeat_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def beat() -> None:
        while True:
            # A beat that fails (a full disk: no room for the file) is skipped; a thread ended by it would
            # leave a live rank that the launcher soon names as frozen.
            with contextlib.suppress(OSError), open(path, "a"):
                os.utime(path)
            time.sleep(records.HEARTBEAT_S)

    threading.Thread(target=beat, name="omnibench-heartbeat", daemon=True).start()


def main(runs: list[tuple[RunSpec, str]]) -> None:
    """Entry of one rank process (also under torchrun): each (spec, record folder) in turn, each in a
    process group of its own (launch_many; `launch` passes one). Errors go to the failing run's
    folder, errors/rank<r>.txt: a JSON line {time, lost_peer, error} (what the launcher reads), then
    the traceback; the process then ends, and the runs after it never start."""
    _die_with_launcher()
    # What the imports left (torch's and ours, a quarter of a million objects) is never garbage: keep it
    # out of every later collection (the automatic ones during a step, _forget_meshes's between runs).
    gc.freeze()
    rank = int(os.environ.get("RANK", 0))
    run_dir = runs[0][1]
    try:
        if os.environ.get("OMNIBENCH_LAUNCHER") == "1":
            _heartbeat(run_dir, rank)
        from omnibench.specs.presets import get_model

        if len(runs) == 1:
            run_rank(runs[0][0], get_model(runs[0][0].model), run_dir)
        else:
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 int(os.environ["WORLD_SIZE"]), is_master=False,
                                 timeout=timedelta(seconds=max(s.timeout_s for s, _ in runs)))
            for i, (spec, run_dir) in enumerate(runs):
                run_rank(spec, get_model(spec.model), run_dir, store=dist.PrefixStore(f"run{i}", base))
                _forget_meshes()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher once
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        first_line = (str(e).strip().splitlines() or [""])[0]
        head = {"time": time.time(), "lost_peer": lost_peer(e),
                "error": f"{type(e).__name__}: {first_line}" if first_line else type(e).__name__}
        if isinstance(e, OSError) and e.errno is not None:
            head.update(errno=e.errno, filename=None if e.filename is None else str(e.filename))
        _report(run_dir, rank, head, text)
        if os.environ.get("OMNIBENCH_LAUNCHER") != "1":
            print(f"[rank {rank}] {text}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's worker threads can outlive interpreter shutdown and abort it with SIGABRT ("terminate called
    # without an active exception", pytorch/pytorch#190489): on torch 2.13 CPU, 1 of 60 runs that did
    # barrier + destroy_process_group still aborted, none of 60 that then left through os._exit. Leave now.
    os._exit(0)


def _report(run_dir: str, rank: int, head: dict, text: str) -> None:
    """errors/rank<r>.txt: the JSON `head` line, then the traceback. Where that cannot be written (a full
    disk, the folder gone) `head` goes down the launcher's report pipe instead: a pipe needs no disk, and
    one short line is written whole. Never raises: the rank is failing already."""
    path = os.path.join(run_dir, "errors", f"rank{rank}.txt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        records.write_whole(path, json.dumps(head) + "\n" + text)
        return
    except OSError:
        pass
    fd = os.environ.get(records.REPORT_FD, "")
    if fd.isdigit():
        line = json.dumps({"rank": rank, **head})
        if len(line) >= 4000:  # under PIPE_BUF (4096 on Linux): the write is atomic, never interleaved
            line = json.dumps({"rank": rank, **head, "error": head["error"][:1000],
                               "filename": (head.get("filename") or "")[:2000]})
        with contextlib.suppress(OSError):
            os.write(int(fd), (line + "\n").encode())


def _forget_meshes() -> None:
    """Between the runs of one process (launch_many): DTensor caches its redistribution planners and
    sharding decisions by device mesh, and meshes compare by ranks and dim names, not by process
    group, so the next run's equal mesh would be handed this run's destroyed groups ("could not
    resolve the process group"). torch has no public call for this; these are its own clearers."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _clear_sharding_prop_cache()
    gc.collect()
    gc.freeze()  # what outlived the run is live module state (lazy imports, caches): never rescan it


def _runs_from_argv(argv: list[str]) -> list[tuple[RunSpec, str]]:
    """`SPEC_JSON RUN_DIR` (one run) or `--runs FILE` (launch_many: a JSON list of {spec, work})."""
    if argv[0] == "--runs":
        with open(argv[1]) as f:
            return [(RunSpec.from_dict(c["spec"]), c["work"]) for c in json.load(f)]
    return [(RunSpec.from_dict(json.loads(argv[0])), argv[1])]


if __name__ == "__main__":
    main(_runs_from_argv(sys.argv[1:]))

"""Record folders: written under `<dir>.incomplete`, renamed to `<dir>` only when complete.

An interrupted run therefore never looks finished: its folder keeps the `.incomplete` suffix.
Contents: config.json (the resolved RunSpec, the model, and provenance: git commit and dirty flag,
versions, command line, host, device), plans.jsonl (every step's Plan, one
`Plan.to_json` per line, in step order), plan_step0.json (the first step's Plan, for readers that
want one file to look at), steps.jsonl (per-step metrics), steps.csv (the
same, flat: one row per step, one column per scalar metric), summary.json, trace.json
(Chrome/Perfetto: one track per rank, one span per action, args {step, rank, kind, module,
microbatch, stage, what, cpu_s}; cpu_s: the rank thread's CPU seconds in the span, which tells
compute from waiting and from a loaded host).

While it runs, and in an interrupted run's `.incomplete` folder: config.json from the start (the
RunSpec, model, command and provenance; "finished": false until the last step), progress.jsonl
(each finished step's figures, as rank 0 saw them), plans.jsonl (each finished step's Plan), and
`.lock`, which the process writing the folder holds (flock) so no second run writes into it.

JSON here is strict: a value that is not a finite number (a diverged loss) is written as null, never
as a bare NaN or Infinity, which JSON does not have.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
from dataclasses import asdict
from datetime import datetime, timezone

from omnibench.plan import METADATA
from omnibench.provenance import provenance, write_csv

INCOMPLETE = ".incomplete"
LOCK = ".lock"  # inside a folder being written: flock-held by the process writing it, with its pid
_held: dict[str, int] = {}  # work folder -> fd of the lock this process holds on it
HEARTBEATS = ".heartbeat"  # inside a folder being written: one file per rank, touched while it lives
HEARTBEAT_S = 1.0  # how often a rank touches its heartbeat (launch.py reads how old it is)
# The environment variable naming the launcher's pipe for error reports a rank cannot write into its folder
REPORT_FD = "OMNIBENCH_REPORT_FD"


def heartbeat_path(work: str, rank: int) -> str:
    return os.path.join(work, HEARTBEATS, f"rank{rank}")


def finite(obj):
    """`obj` with every float that is not finite (nan, inf) replaced by None, for strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kw)


def new_run_dir(out: str, system: str, workload: str) -> str:
    """The final folder name; the run writes into `<it>.incomplete` until it finishes."""
    if out:
        return os.path.abspath(out)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(os.path.join("results", "runs", f"{stamp}-{system}-{workload}"))


def torchrun_run_dir(parent: str, system: str, workload: str, timeout_s: float) -> str:
    """The record folder of a run under torchrun: `<UTC time>-<system>-<workload>` (then -2, -3, ... if
    taken), unique per run however torchrun was started. Rank 0 picks the name and every rank reads it
    from torchrun's own agent store (the TCPStore the process group joins too). Without an agent store
    (ranks started by hand with RANK/MASTER_ADDR set) the ranks cannot agree on a time, and the folder
    is named by the rendezvous id as before."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return os.path.join(parent, f"{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}-{system}-{workload}")
    from datetime import timedelta

    import torch.distributed as dist

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"omnibench/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
    if int(os.environ["RANK"]) == 0:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        name, k = f"{stamp}-{system}-{workload}", 1
        while os.path.exists(os.path.join(parent, name)) or os.path.exists(os.path.join(parent, name + INCOMPLETE)):
            k += 1
            name = f"{stamp}-{system}-{workload}-{k}"
        store.set("run_dir", name)
    else:
        name = store.get("run_dir").decode()  # waits (up to timeout_s) for rank 0
    return os.path.join(parent, name)


def out_taken(final_dir: str) -> str | None:
    """Why a run cannot create its record folder `final_dir` (one line naming --out), or None. A
    symbolic link there that leads nowhere (dangling, or a loop) is taken too: the finished record
    could never be renamed onto it, and the run would find that out only after its last step."""
    if os.path.islink(final_dir) and not os.path.exists(final_dir):
        try:
            os.stat(final_dir)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"out: {final_dir} is a symbolic link that loops; give another --out"
        return (f"out: {final_dir} is a symbolic link to {os.readlink(final_dir)}, which does not exist; give "
                "another --out (or the link's target itself)")
    if os.path.lexists(final_dir):
        return f"out: {final_dir} already exists; --out names a new record folder"
    return None


def start(final_dir: str) -> str:
    """Claim `final_dir` for a new run: make `<final_dir>.incomplete` (mkdir is atomic: of two runs
    started at once into one --out only one gets it) and hold its lock until `complete` or
    `release`. Never reuses a folder: a finished record, a live run's folder or a stale `.incomplete`
    (an interrupted run's, with its error reports) is refused with FileExistsError in one line."""
    taken = out_taken(final_dir)
    if taken:
        raise FileExistsError(taken)
    work = final_dir + INCOMPLETE
    os.makedirs(os.path.dirname(work) or ".", exist_ok=True)
    try:
        os.mkdir(work)
    except FileExistsError:
        holder = lock_holder(work)
        if holder is not None:
            raise FileExistsError(f"out: {final_dir} is in use: another run (pid {holder}) is writing {work}; "
                                  "wait for it or give another --out") from None
        raise FileExistsError(f"out: {work} is left from an unfinished run (its partial record and error "
                              "reports); remove it or give another --out") from None
    try:
        fd = os.open(os.path.join(work, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else can hold it: the folder is new
        _held[work] = fd
        with _writing(os.path.join(work, LOCK)):
            os.write(fd, str(os.getpid()).encode())
    except BaseException:
        discard(work)  # a folder without its lock would read as a stale run's
        raise
    return work


def lock_holder(work: str) -> int | None:
    """The pid of the live process writing `work`, or None when nobody holds its lock (a stale folder)."""
    path = os.path.join(work, LOCK)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def release(work: str) -> None:
    """Let go of `work`'s lock (a run that ended unfinished keeps its folder, stale from now on)."""
    fd = _held.pop(work, None)
    if fd is not None:
        os.close(fd)


def discard(work: str) -> None:
    """Remove `work` whole: a run that failed before any rank started has nothing worth keeping, and its
    folder left behind would only block the next run into the same --out."""
    release(work)
    shutil.rmtree(work, ignore_errors=True)


def begin(work_dir: str, spec, model, device_text: str) -> None:
    """config.json at the start of a run, so an interrupted run's folder says what ran and how."""
    _write(os.path.join(work_dir, "config.json"), {
        "run": spec.to_dict(), "model": asdict(model), "finished": False,
        "provenance": provenance(device_text, spec.extra.get("argv"), cuda=spec.extra.get("device") == "cuda")})


def progress(work_dir: str, step: int, steps: int, loss: float, step_time: float, record: dict | None = None,
             plan=None) -> None:
    """After each finished step (rank 0): its Plan to plans.jsonl, then its figures to progress.jsonl. In
    that order, so that a run stopped between the two (SIGINT lands anywhere) never leaves a finished
    step without its Plan: it may leave a Plan whose step's figures never came."""
    line = {"step": step, "steps": steps, "loss": loss, "step_time_s": step_time, **(record or {})}
    if plan is not None:
        _append(os.path.join(work_dir, "plans.jsonl"), plan.to_json(indent=None) + "\n")
    _append(os.path.join(work_dir, "progress.jsonl"), dumps(line) + "\n")


@contextlib.contextmanager
def _writing(path: str):
    """An OSError inside names `path`: a write() or close() that fails (a full disk) carries no file
    name, and one on the temporary file beside it names that; the run's one-line error must say which
    record file could not be written."""
    try:
        yield
    except OSError as e:
        if e.filename != path:
            raise OSError(e.errno, e.strerror or str(e), path) from e
        raise


def _append(path: str, text: str) -> None:
    """Append `text` whole or not at all: a write cut short (a full disk) is cut back off, so a reader
    of the file never meets half a line."""
    with _writing(path), open(path, "a") as f:
        size = f.tell()
        try:
            f.write(text)
            f.flush()
        except OSError:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise


def write_whole(path: str, text: str) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it): a failed write leaves no
    truncated file, nor the temporary one."""
    tmp = path + ".tmp"
    try:
        with _writing(path), open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write(path: str, obj) -> None:
    write_whole(path, dumps(obj, indent=1))


def finish(work_dir: str, spec, model, plans, gathered: list[dict], device, dtype) -> None:
    """Rank 0 after the last step: metrics, trace, config and every step's Plan (`plans`: a list in
    step order, or one Plan) (the launcher renames the folder)."""
    import torch

    from omnibench.runtime.metrics import peak_tflops, step_metrics

    plans = plans if isinstance(plans, list) else [plans]
    world = len(gathered)
    spans = {g["rank"]: g["spans"] for g in gathered}
    peak = peak_tflops(device)
    steps = [step_metrics(s, spans, world, peak) for s in gathered[0]["steps"]]
    for s in steps:
        s["peak_memory_bytes"] = max(g["steps"][s["step"]]["peak_memory_bytes"] for g in gathered)
    write_whole(os.path.join(work_dir, "steps.jsonl"), "".join(dumps(s) + "\n" for s in steps))
    flat = [flat_step(s) for s in steps]
    csv_path = os.path.join(work_dir, "steps.csv")
    try:
        with _writing(csv_path):
            write_csv(csv_path, flat, list(dict.fromkeys(k for s in flat for k in s)))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(csv_path + ".tmp")  # write_csv's own, left when a write fails
        raise
    timed = steps[1:] or steps  # the first step pays one-time costs (allocations, warm-up)
    summary = {
        "system": spec.system, "workload": spec.workload, "model": model.name, "world_size": world,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "steps": len(steps),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "final_loss": steps[-1]["loss"],
        "mean_step_time_s": sum(s["step_time_s"] for s in timed) / len(timed),
        "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["step_time_s"] for s in timed),
        "peak_tflops_per_gpu": peak,
        "flop_formula": "omnibench.specs.costs.batch_flops: exact matmul FLOPs per module, fwd+bwd, "
        "attention per real packed sequence",
        "notes": list(spec.extra.get("notes", [])) + sorted({n for g in gathered for n in g["notes"]}),
        "recompute": spec.recompute,
        "freeze": list(spec.freeze),
        "compile": spec.compile,
        "encoder_chunk_tokens": max(0, spec.encoder_chunk_tokens),
        "timed_steps": "all but the first" if len(steps) > 1 else "all",
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads() if device.type == "cpu" else None,
    }
    summary["tokens_per_s_per_gpu"] = summary["tokens_per_s"] / world
    for k in ("tflops_per_gpu", "bubble_fraction", "exposed_comm_fraction"):
        summary[k] = sum(s[k] for s in timed) / len(timed)
    summary["mfu"] = summary["tflops_per_gpu"] / peak if peak else None
    summary["peak_memory_bytes"] = max(s["peak_memory_bytes"] for s in steps)
    diverged = [s["step"] for s in steps if not math.isfinite(s["loss"])]
    if diverged:
        summary["notes"].append(f"the loss is not a finite number from step {diverged[0]} on (written as null)")
    _write(os.path.join(work_dir, "summary.json"), summary)
    write_whole(os.path.join(work_dir, "plan_step0.json"), plans[0].to_json())
    write_whole(os.path.join(work_dir, "plans.jsonl"), "".join(p.to_json(indent=None) + "\n" for p in plans))
    _write(os.path.join(work_dir, "trace.json"), chrome_trace(spans))
    # Last: "finished": true only once every other file is whole (a full disk stops short of it)
    device_text = f"{summary['device_name']} ({device})" if device.type == "cuda" else f"cpu x{world} ranks"
    _write(os.path.join(work_dir, "config.json"), {
        "run": spec.to_dict(), "model": asdict(model), "finished": True,
        "provenance": provenance(device_text, spec.extra.get("argv"), cuda=device.type == "cuda")})


def flat_step(step: dict) -> dict:
    """One steps.csv row: the step's scalar metrics, per-module FLOPs as flops_<module>; the step's Plan
    summary and other nested values stay in steps.jsonl."""
    row = {}
    for k, v in step.items():
        if isinstance(v, dict):
            if k == "flops_by_module":
                row.update({f"flops_{m}": x for m, x in v.items() if not isinstance(x, (dict, list))})
        elif not isinstance(v, list):
            row[k] = v
    return row


LOADER_TID = 100_000  # trace thread id offset of each rank's loader track


def chrome_trace(spans_by_rank: dict[int, list[dict]]) -> dict:
    events = []
    for rank, spans in sorted(spans_by_rank.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        if any(s["kind"] == METADATA for s in spans):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": LOADER_TID + rank,
                           "args": {"name": f"rank {rank} loader"}})
        for s in spans:
            # The loader thread's exchanges overlap the previous step's compute: a track of their own.
            tid = LOADER_TID + rank if s["kind"] == METADATA else rank
            events.append({
                "name": s["name"], "cat": s["kind"], "ph": "X", "pid": 0, "tid": tid,
                "ts": s["start"] * 1e6, "dur": (s["end"] - s["start"]) * 1e6,
                "args": {"step": s["step"], "rank": rank, "kind": s["kind"], "module": s["module"],
                         "microbatch": s.get("microbatch", 0), "stage": s.get("stage", 0), "what": s.get("what", ""),
                         "cpu_s": s.get("cpu", 0.0)},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def complete(work_dir: str) -> str:
    """The finished record: lock file gone, `.incomplete` suffix dropped."""
    final = work_dir.removesuffix(INCOMPLETE)
    lock = os.path.join(work_dir, LOCK)
    if os.path.exists(lock):
        os.unlink(lock)
    shutil.rmtree(os.path.join(work_dir, HEARTBEATS), ignore_errors=True)
    release(work_dir)
    os.replace(work_dir, final)
    return final

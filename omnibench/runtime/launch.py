"""Start a run: resolve defaults, refuse impossible layouts before any process starts, spawn the
ranks the way torchrun does (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT), watch
them, and turn the first failure into one error.

However a run ends, no rank outlives the launcher: a failed rank, SIGINT, SIGTERM or SIGHUP make
the launcher stop every rank (SIGTERM, SIGKILL after STOP_GRACE_S) before it returns or raises,
and ranks ask Linux to kill them if the launcher itself is killed (worker.py). The record folder
then keeps its `.incomplete` suffix.

A rank that stops making progress is found long before the ranks waiting on it time out (--timeout,
120 s): the launcher watches each rank's process state (a rank stopped by SIGSTOP/SIGTSTP, state T,
for STOPPED_S) and its heartbeat (worker.py touches one every records.HEARTBEAT_S from a thread that runs
while the rank waits in a collective; none for HANG_S means the rank is frozen, e.g. in a C call
holding the GIL), and names that rank, not the healthy ones waiting for it.

Inside an existing torchrun environment (`torchrun ... -m omnibench run ...`) this process *is*
a rank: it runs its share and rank 0 completes the record folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from omnibench.runtime.run_inputs import batch_source, parallel_spec, runtime_limits
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.run import RunSpec

CPU_DEFAULT_MODEL = "tiny-omni"
CUDA_DEFAULT_MODEL = "omni-7b"
CUDA_TOKENS_PER_GPU = 16384  # global batch per GPU on CUDA when none is given (torchtitan's default is 8K x 2)


POLL_S = 0.05  # how often the launcher looks at its ranks
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL for a rank still alive after this
STOPPED_S = 2.0  # a rank in state T (stopped by a signal) this long has stopped the run
HANG_S = 30.0  # a rank whose heartbeat is this old has stopped making progress (well under --timeout)
# Signals that stop a run. Each one's default would kill the launcher and orphan the ranks (they run
# in sessions of their own), and SIGINT arrives ignored when the launcher was started as a
# background job of a non-interactive shell (CI scripts, `cmd &`): Python then never raises
# KeyboardInterrupt for it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class LaunchError(RuntimeError):
    """A run that could not go on, in one line (the command's error); exit status `exit_code`."""

    exit_code = 1


class RunFailed(LaunchError):
    """A run that ended unfinished (its record folder keeps the `.incomplete` suffix), in one line: the
    rank that failed first, how it ended, and its traceback file if it wrote one."""

    exit_code = 1

    def __init__(self, rank: int, reason: str, work: str, report: str = ""):
        where = f"traceback in {report}" if report else f"the partial record is in {work}"
        super().__init__(f"rank {rank} {reason}; {where}")
        self.rank, self.reason, self.work, self.report = rank, reason, work, report


class RunInterrupted(RunFailed):
    """The launcher got one of STOP_SIGNALS and stopped every rank; no rank failed (`rank` is None)."""

    def __init__(self, signum: int, work: str):
        reason = f"interrupted by {signal.Signals(signum).name}"
        where = f"the partial record is in {work}" if work else "no rank had started, and nothing is kept"
        RuntimeError.__init__(self, f"{reason}; {where}")
        self.rank, self.reason, self.work, self.report = None, reason, work, ""
        self.signum = signum
        self.exit_code = 128 + signum  # what a shell reports for a process this signal ended


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch/cuda means the CPU path
        return 0


def under_torchrun() -> bool:
    """True inside a torchrun-started rank (not one of our own spawned ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get("OMNIBENCH_LAUNCHER") != "1"


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_torchrun_env() -> None:
    """Under torchrun, what it set for this rank, read before anything waits on it: a rank number that is
    not one, or not below WORLD_SIZE, would otherwise surface as a traceback or a wait of --timeout for a
    rank 0 that never comes."""
    from omnibench.specs.model import SpecError

    env = os.environ
    shown = ", ".join(TORCHRUN_ENV)

    def number(name: str, low: int, high: int | None = None) -> int:
        text = env.get(name, "")
        ok = text.strip().isdigit() and int(text) >= low and (high is None or int(text) <= high)
        if not ok:
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise SpecError(f"environment: {name} must be an integer {bound} (torchrun sets {shown} for each "
                            f"rank); got {text!r}")
        return int(text)

    world = number("WORLD_SIZE", 1)
    number("RANK", 0, world - 1)
    if "LOCAL_RANK" in env:
        number("LOCAL_RANK", 0)
    if not env.get("MASTER_ADDR", "").strip():
        raise SpecError(f"environment: MASTER_ADDR is not set (torchrun sets {shown} for each rank)")
    number("MASTER_PORT", 1, 65535)


def resolve(spec: RunSpec) -> RunSpec:
    """Fill every 0/auto default for this machine (see RunSpec) and validate."""
    spec.validate()
    if under_torchrun():
        check_torchrun_env()
    gpus = _cuda_count() if spec.device in ("auto", "cuda") else 0
    if spec.device == "cuda" and not gpus:
        from omnibench.specs.model import SpecError

        raise SpecError("device=cuda but no CUDA device is visible")
    cuda = gpus > 0
    from omnibench.specs.presets import list_models

    model = spec.model or (CPU_DEFAULT_MODEL if not cuda else _cuda_default(list_models()))
    named = model
    extra = dict(spec.extra)
    if not spec.batches_file:  # batches read from a file may feed any encoder
        from omnibench.resolve import model_for_workload
        from workloads.registry import get_workload

        model, model_note = model_for_workload(model, get_workload(spec.workload))
        if model_note:
            extra["notes"] = [*extra.get("notes", []), model_note]
    from omnibench.specs.model import freeze_for_model
    from omnibench.specs.presets import get_model

    freeze = freeze_for_model(spec.freeze, get_model(named), get_model(model))
    extra.update(
        device="cuda" if cuda else "cpu",
        backend="nccl" if cuda else "gloo",
        dtype=("bf16" if cuda else "fp32") if spec.dtype == "auto" else spec.dtype,
        threads=max(1, (os.cpu_count() or 1) // max(1, spec.nproc or 2)),
    )
    if extra["dtype"] == "fp32" and spec.mixed_precision == "master":
        from omnibench.specs.model import SpecError

        raise SpecError("mixed_precision master holds bf16 weights with an fp32 master: it needs dtype bf16 "
                        f"(this run's dtype is fp32{', auto on CPU' if spec.dtype == 'auto' else ''}); "
                        "use --dtype bf16 or --mixed-precision autocast")
    nproc = spec.nproc or (gpus if cuda else 2)
    if cuda and nproc > gpus and not under_torchrun():
        from omnibench.specs.model import SpecError

        raise SpecError(f"nproc={nproc} but {gpus} CUDA device(s) are visible: NCCL runs one rank per GPU (it "
                        f"refuses two ranks on one device); use --nproc {gpus} or fewer, or --device cpu")
    if under_torchrun():
        nproc = int(os.environ["WORLD_SIZE"])  # torchrun decided how many ranks there are
        if spec.nproc and spec.nproc != nproc:
            from omnibench.specs.model import SpecError

            raise SpecError(f"nproc={spec.nproc} but torchrun started WORLD_SIZE={nproc} ranks")
    out = replace(
        spec,
        model=model,
        freeze=freeze,
        nproc=nproc,
        # CPU: tiny samples so a step takes a fraction of a second; GPU: the workload as written.
        length_scale=spec.length_scale or (1.0 if cuda else 0.02),
        global_batch_tokens=spec.global_batch_tokens or (CUDA_TOKENS_PER_GPU * nproc if cuda else 1536),
        # "auto" on CUDA is settled by the memory check (fit_to_device), which knows the device
        recompute="none" if spec.recompute == "auto" and not cuda else spec.recompute,
        encoder_chunk_tokens=0 if spec.encoder_chunk_tokens == -1 and not cuda else spec.encoder_chunk_tokens,
        max_sample_tokens=spec.max_sample_tokens or (0 if cuda else 384),
        extra=extra,
    )
    return resolve_layout(out, _device_bytes() if cuda else None)


def resolve_layout(spec: RunSpec, memory_bytes: float | None = None) -> RunSpec:
    """tp, pp, cp as omnibench/resolve.py settles them for every command: the flags, some 0 (those
    are 1), or all 0: the system's default layout for this model, world size and the run's first
    batch, within the runtime's limits (a note in the record says which and why)."""
    from omnibench.resolve import resolve_layout as resolve_for_all
    from omnibench.specs.presets import get_model
    from simulator.hardware import load_cluster
    from systems.defaults import DEVICE_BYTES

    model = get_model(spec.model)
    plain = replace(spec, tp=1, pp=1, cp=1)
    cluster = load_cluster("h100", spec.nproc)
    cluster = replace(cluster, gpu=replace(cluster.gpu, memory_gib=(memory_bytes or DEVICE_BYTES) / 2**30))
    # recompute is the memory check's to settle (runtime/memory.py::fit_to_device), after the layout
    res = resolve_for_all(spec.system, model, parallel_spec(replace(plain, recompute="none"), spec.nproc),
                          [batch_source(plain)(0)], cluster, tp=spec.tp, pp=spec.pp, cp=spec.cp,
                          recompute="none", check=_runtime_check)
    notes = spec.extra.get("notes", [])
    if (spec.tp, spec.pp, spec.cp) == (0, 0, 0):
        notes = [*notes, res.layout_note]
    return replace(spec, tp=res.parallel.tp, pp=res.parallel.pp, cp=res.parallel.cp,
                   extra={**spec.extra, "notes": notes})


def _runtime_check(model, parallel: ParallelSpec) -> None:
    parallel.check_runtime()
    runtime_limits(model, parallel)


def _device_bytes() -> float:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory)


def _cuda_default(names: list[str]) -> str:
    return CUDA_DEFAULT_MODEL if CUDA_DEFAULT_MODEL in names else next(n for n in names if not n.startswith("tiny"))


def check_layout(spec: RunSpec) -> None:
    """Plan step 0 in this process: every impossible layout fails here with a one-line error."""
    from omnibench.specs.model import SpecError
    from omnibench.specs.presets import get_model
    from systems import get_planner

    model = get_model(spec.model)
    parallel = parallel_spec(spec, spec.nproc)
    parallel.validate(model)
    parallel.check_runtime()
    runtime_limits(model, parallel)
    plan = get_planner(spec.system).plan(model, parallel, batch_source(spec)(0))
    if spec.device == "cuda" and plan.concurrent:
        raise SpecError("system: spatial runs its lanes side by side on CPU threads only (--device cpu): lanes on "
                        "CUDA green contexts or streams are not built yet")


def _rendezvous_store(spec: RunSpec):
    """The ranks' rendezvous store, hosted here as torchrun's agent hosts it. Binding port 0 in the
    store itself is atomic: picking a free port and handing it to rank 0 to bind later raced with
    other launches on a busy machine (EADDRINUSE seen under pytest -n 2)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, spec.nproc, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=spec.timeout_s))


def launch(spec: RunSpec, on_progress: Callable[[dict], None] | None = None) -> str:
    """Run `spec` (already resolved); returns the completed record folder. Raises RunFailed naming
    the rank that failed first, or RunInterrupted; either way every rank has ended by then."""
    from omnibench.runtime import records

    final = records.new_run_dir(spec.out, spec.system, spec.workload)
    if under_torchrun():
        return _as_torchrun_rank(spec, final)
    return _launch([spec], [final], on_progress)[0]


def launch_many(specs: list[RunSpec]) -> list[str]:
    """Run several resolved specs of one world size (each with its own --out) in ONE launch of ranks:
    each rank process runs the runs one after the other, each in a process group of its own, and
    each run writes its own record. Start-up (a Python interpreter and torch per rank, the
    rendezvous) is paid once for all of them: what the loss-parity suite does to run every cell in
    CI. Fails as `launch` does, naming the rank (and the run's folder) that failed first."""
    from omnibench.runtime import records

    if not specs or len({s.nproc for s in specs}) != 1:
        raise ValueError(f"launch_many: runs of one world size; got {sorted({s.nproc for s in specs})}")
    if under_torchrun():
        raise RuntimeError("launch_many starts its own ranks; under torchrun launch each run on its own")
    return _launch(specs, [records.new_run_dir(s.out, s.system, s.workload) for s in specs])


def _launch(specs: list[RunSpec], finals: list[str], on_progress=None) -> list[str]:
    """Claim every record folder (all or none), run the ranks, release what did not complete."""
    from omnibench.runtime import records

    works: list[str] = []
    try:
        for final in finals:
            works.append(records.start(final))
        return _launch_ranks(specs, works, on_progress)
    except BaseException:
        if not _ranks_started(works):  # nothing ran: no partial record worth keeping, nor a folder in the way
            for work in works:
                records.discard(work)
        raise
    finally:
        for work in works:
            records.release(work)  # a run that ended unfinished leaves a stale folder, never one in use


_started: set[str] = set()  # work folders whose ranks were started by this process


def _ranks_started(works: list[str]) -> bool:
    return any(w in _started for w in works)


def _launch_ranks(specs: list[RunSpec], works: list[str], on_progress) -> list[str]:
    import tempfile

    from omnibench.runtime import records
    from omnibench.specs.presets import get_model

    spec, work = specs[0], works[0]  # the first run's folder holds the ranks' heartbeats
    # From the first file written on: a signal during the set-up (provenance runs git, which can take a
    # while) stops the run in order too, not with a traceback from wherever it landed.
    with _stop_signals_recorded() as received:
        for s, w in zip(specs, works, strict=True):
            records.begin(w, s, get_model(s.model), f"{s.extra.get('device', 'cpu')} x{s.nproc} ranks")
        store = _rendezvous_store(spec)  # lives as long as this call: the ranks' rendezvous
        # Reports a rank cannot write into its record folder (a full disk) come down this pipe (worker._report).
        report_r, report_w = os.pipe()
        cells = None
        try:
            os.set_blocking(report_r, False)
            os.set_blocking(report_w, False)  # a full pipe drops a late report; it never blocks a failing rank
            env = {**os.environ, "OMNIBENCH_LAUNCHER": "1", "OMNIBENCH_LAUNCHER_PID": str(os.getpid()),
                   records.REPORT_FD: str(report_w),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "WORLD_SIZE": str(spec.nproc), "OMP_NUM_THREADS": str(spec.extra.get("threads", 1)),
                   "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH", "")]))}
            if len(specs) == 1:
                argv = [json.dumps(spec.to_dict()), work]
            else:  # the runs' list in a file: a command line has a length limit
                fd, cells = tempfile.mkstemp(prefix="omnibench-runs-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump([{"spec": s.to_dict(), "work": w} for s, w in zip(specs, works, strict=True)], f)
                argv = ["--runs", cells]
            ranks = _Ranks()
            try:
                for r in range(spec.nproc):
                    if received:
                        break
                    # Own session: a terminal's Ctrl-C reaches only the launcher, which stops the ranks in
                    # order (each rank raising KeyboardInterrupt on its own would print one traceback per rank).
                    ranks.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "omnibench.runtime.worker", *argv],
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True,
                        pass_fds=(report_w,),
                    ))
                    _started.update(works)
                seen, failed, stalled = 0, False, None
                while not received and not failed:
                    seen = _report_progress(work, seen, on_progress)
                    codes = ranks.poll()
                    failed = any(c not in (None, 0) for c in codes)
                    stalled = None if failed else ranks.stalled(work)
                    failed = failed or stalled is not None
                    if not failed and all(c == 0 for c in codes):
                        _report_progress(work, seen, on_progress)
                        return [records.complete(w) for w in works]
                    time.sleep(POLL_S)
            finally:
                ranks.stop()  # whatever ended the watch, even an exception of our own
            piped = _piped_reports(report_r)
        finally:
            os.close(report_r)
            os.close(report_w)
            if cells is not None:
                os.unlink(cells)
    if stalled is not None:
        raise RunFailed(stalled[0], stalled[1], work)
    if failed:
        raise _first_failure(works, ranks, piped)
    raise RunInterrupted(received[0], work if _ranks_started(works) else "")


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report_progress(work: str, seen: int, cb) -> int:
    path = os.path.join(work, "progress.jsonl")
    if cb is None or not os.path.exists(path):
        return seen
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines[seen:]:
        try:
            cb(json.loads(line))
        except json.JSONDecodeError:
            return seen  # a line still being written; read it next time
        seen += 1
    return seen


@contextlib.contextmanager
def _stop_signals_recorded() -> Iterator[list[int]]:
    """While launching, STOP_SIGNALS are only recorded (in the yielded list); the watch loop acts on
    them within POLL_S. A handler that raised instead could interrupt Popen() after its fork (a rank
    nobody tracks) or Popen.poll() holding the lock every later wait() of that Popen blocks on."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received  # only the main thread may set handlers; launch's `finally` still stops the ranks
        return
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


class _Ranks:
    """The launcher's rank processes: when it saw each one end, and which ones it stopped itself."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.ended: dict[int, float] = {}  # rank -> time.time() when the launcher first saw it gone
        self.stopped: set[int] = set()
        self.stopped_since: dict[int, float] = {}  # rank -> when it was first seen in state T

    def poll(self) -> list[int | None]:
        codes = [p.poll() for p in self.procs]
        now = time.time()
        for r, code in enumerate(codes):
            if code is not None:
                self.ended.setdefault(r, now)
        return codes

    def stalled(self, work: str) -> tuple[int, str] | None:
        """(rank, why) for the first rank that stopped making progress: stopped by a signal for
        STOPPED_S, or no heartbeat for HANG_S; None while every rank moves (or waits while moving)."""
        now, wall = time.monotonic(), time.time()
        for r, p in enumerate(self.procs):
            if p.returncode is not None:
                continue
            if _process_state(p.pid) == "T":
                since = self.stopped_since.setdefault(r, now)
                if now - since >= STOPPED_S:
                    return r, (f"stopped making progress: it was stopped by a signal (SIGSTOP or SIGTSTP) for "
                               f"{now - since:.0f} s while the other ranks waited for it")
                continue
            self.stopped_since.pop(r, None)
            beat = _heartbeat_age(work, r, wall)
            if beat is not None and beat >= HANG_S:
                return r, (f"stopped making progress: no heartbeat for {beat:.0f} s (frozen, e.g. in a call that "
                           "holds the interpreter) while the other ranks waited for it")
        return None

    def stop(self) -> None:
        """End every rank still running: SIGTERM to its process group (a rank's own children, e.g.
        compile workers, go with it), SIGKILL after STOP_GRACE_S. Returns once all have been reaped."""
        alive = [r for r, code in enumerate(self.poll()) if code is None]
        for r in alive:
            self._signal(r, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for r in alive:
            try:
                self.procs[r].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(r, signal.SIGKILL)
                self.procs[r].wait()

    def _signal(self, r: int, sig: int) -> None:
        self.stopped.add(r)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[r].pid, sig)
            if sig == signal.SIGTERM:  # a stopped rank acts on SIGTERM only once it runs again
                os.killpg(self.procs[r].pid, signal.SIGCONT)


def _process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (R, S, D, T, Z, ...); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return ""
    return text.rsplit(")", 1)[-1].split()[0] if ")" in text else ""


def _heartbeat_age(work: str, rank: int, now: float) -> float | None:
    """Seconds since rank `rank` last touched its heartbeat (worker.py); None before its first."""
    from omnibench.runtime import records

    try:
        return now - os.stat(records.heartbeat_path(work, rank)).st_mtime
    except OSError:
        return None


def _piped_reports(fd: int) -> dict[int, tuple[float, bool, str, str]]:
    """Reports that came down the launcher's pipe (worker._report), as _error_reports gives them (no file)."""
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    out = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            head = json.loads(line)
            out[int(head["rank"])] = (float(head["time"]), bool(head["lost_peer"]), _report_error(head), "")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short: the rank counts as one that ended without a report
    return out


def _report_error(head: dict) -> str:
    """A report's error in words: a full disk named as such, with the file that could not be written."""
    if head.get("errno") == errno.ENOSPC:
        return f"writing {head.get('filename') or 'its record'}: no space left on the device"
    return head["error"]


def _first_failure(works: list[str], ranks: _Ranks, piped: dict | None = None) -> RunFailed:
    """The rank whose failure came first, not one that failed because of it: a rank that reports a
    lost peer or a timed-out wait (worker.py marks those) only counts when no rank failed on its own;
    a rank killed by a signal (not ours) or exiting without a report counts from when it was seen gone.
    `piped`: reports that came down the launcher's pipe, for ranks that could not write theirs."""
    reports: dict[int, tuple[float, bool, str, str]] = dict(piped or {})
    for w in works:  # launch_many: a rank reports into the folder of the run it failed in
        for r, rep in _error_reports(w).items():
            if r not in reports or rep[0] < reports[r][0] or not reports[r][3]:
                reports[r] = rep
    work = works[0]
    found = []  # (secondary, time, rank, reason, report path)
    for r, p in enumerate(ranks.procs):
        code = p.returncode
        if r in reports:
            stamp, lost_peer, error, path = reports[r]
            found.append((lost_peer, stamp, r, f"failed: {error}", path))
        elif code not in (None, 0) and r not in ranks.stopped:
            how = (f"was killed by {_signal_name(-code)}" if code < 0 else
                   f"exited with code {code} without an error report (it failed before it could start: see its "
                   "output above)")
            found.append((False, ranks.ended[r], r, how, ""))
    if not found:
        raise RuntimeError(f"launcher: a rank failed but none can be named (no report in {work}/errors)")
    _, _, rank, reason, path = min(found)
    return RunFailed(rank, reason, work, path)


def _error_reports(work: str) -> dict[int, tuple[float, bool, str, str]]:
    """errors/rank<r>.txt as worker.main writes them: a JSON header line, then the traceback."""
    folder = os.path.join(work, "errors")
    out = {}
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("rank") and name.endswith(".txt") and name[4:-4].isdigit():
                path = os.path.join(folder, name)
                try:
                    with open(path) as f:
                        head = json.loads(f.readline())
                    out[int(name[4:-4])] = (float(head["time"]), bool(head["lost_peer"]), _report_error(head), path)
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # unreadable: the rank counts as one that ended without a report
    return out


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _as_torchrun_rank(spec: RunSpec, final: str) -> str:
    from omnibench.runtime import records
    from omnibench.runtime.worker import run_rank
    from omnibench.specs.presets import get_model

    if not spec.out:
        final = records.torchrun_run_dir(os.path.dirname(final), spec.system, spec.workload, spec.timeout_s)
    work = final + records.INCOMPLETE
    if int(os.environ["RANK"]) == 0:
        records.start(final)  # never reuses a folder: a stale .incomplete or one in use is refused
        records.begin(work, spec, get_model(spec.model), f"{spec.extra.get('device', 'cpu')} x{spec.nproc} ranks")
    else:
        deadline = time.monotonic() + spec.timeout_s
        while not os.path.isdir(work):
            if time.monotonic() > deadline:
                raise LaunchError(f"rank {os.environ['RANK']}: rank 0 did not create {work} within --timeout "
                                  f"{spec.timeout_s:g} s (is rank 0 running, with the same --out?)")
            time.sleep(POLL_S)
    run_rank(spec, get_model(spec.model), work)
    if int(os.environ["RANK"]) == 0:
        return records.complete(work)
    return final

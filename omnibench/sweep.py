"""Independent simulations of a sweep (tune's candidates, `simulate --steps`, reproduce's stages)
run on every core, or on a Ray cluster, with one progress bar.

`Sweep.map(fn, items)` returns `[fn(x) for x in items]`, in the items' order whatever finished
first, so a sweep gives the same answer serial, pooled or on Ray: each simulation is deterministic
(simpy's event order and the engine's hashing of integer rank sets do not depend on the process),
and nothing a worker computes depends on what another computed. A command opens one `Sweep` and
maps through it as often as its logic needs (tune maps one wave of candidates at a time): the pool
or the Ray connection and the progress bar live as long as the `with` block.

- `workers=1`: in this process (no pickling; what tests and small sweeps use).
- `workers=N` / `None` (all cores): a process pool, forked where the OS can (fast start; simulation
  workers run no torch kernels, so torch's thread pools inherited in an undefined state are never
  used; spawning instead re-imports `__main__`, which fails under runners such as pytest-xdist).
- `ray_address="auto" | "local" | "ray://host:port"`: Ray tasks (`pip install omnibench[ray]`);
  "local" starts a private Ray instance on this machine and stops it afterwards.

`fn` must be picklable (a module-level function or a `functools.partial` of one) for the pool and
Ray. The bar goes to stderr, and only when stderr is a terminal and the command is not quiet
(`--json`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from omnibench.stopping import die_with_parent, raise_if_stopped


class SweepError(ValueError):
    """A sweep option is impossible (workers < 1, Ray asked for but not installed)."""


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def check_workers(workers: int | None) -> None:
    if workers is not None and workers < 1:
        raise SweepError(f"workers must be >= 1 (or omitted for all {default_workers()} cores), got {workers}")


RAY_USAGE = "ray must be auto, local, ray://host:port (Ray Client) or host:port (a cluster's head)"
RAY_CONNECT_S = 5.0  # a Ray address that does not answer a TCP connection in this long is unreachable


def _ray_endpoint(address: str) -> tuple[str, int]:
    """(host, port) of `ray://host:port` or `host:port`; a SweepError naming --ray otherwise."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SweepError(f"{RAY_USAGE}; got {address!r}")
    return host, int(port)


def check_ray(address: str | None) -> None:
    """Before any work: Ray importable, `address` well formed and, for a remote cluster, answering on
    its port within RAY_CONNECT_S (Ray itself retries an address that does not answer for minutes)."""
    if address is None:
        return
    if address not in ("auto", "local"):
        host, port = _ray_endpoint(address)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SweepError(f"ray: --ray {address} needs Ray, which is not installed here: "
                         "pip install 'omnibench[ray]'") from None
    if address.startswith("ray://"):
        try:
            from ray._private.utils import get_ray_client_dependency_error
        except ImportError:  # another Ray version: its own error, at connection time
            get_ray_client_dependency_error = None
        if get_ray_client_dependency_error is not None and get_ray_client_dependency_error() is not None:
            raise SweepError(f"ray: --ray {address} connects through Ray Client, which is not installed here: "
                             "pip install 'ray[client]' (or give the head's host:port without ray://)")
    if address == "local":
        return
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # another Ray version: its own error, at connection time
            return
        try:
            found = canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError) as e:
            raise SweepError(f"ray: --ray auto found no running Ray cluster on this machine or in RAY_ADDRESS "
                             f"({str(e).splitlines()[0]}); start one (ray start --head) or give --ray local") from None
        if not found:
            return
        host, port = _ray_endpoint(found)
    try:
        with socket.create_connection((host, port), timeout=RAY_CONNECT_S):
            pass
    except OSError as e:
        why = "no answer" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        raise SweepError(f"ray: cannot reach the Ray cluster at --ray {address} ({why}); start it (ray start "
                         "--head) or give --ray local") from None


def resolve_workers(workers: int | None, n_items: int) -> int:
    check_workers(workers)
    return max(1, min(workers or default_workers(), n_items))


def _noop(x):
    return x


def _worker_init(parent: int) -> None:
    """A worker leaves Ctrl-C to its parent and dies at once when the parent stops it (a fork would
    otherwise inherit the command's SIGTERM handler, which exits through the command's cleanup), and
    with the parent however it ends: a command stopped by SIGTERM left its idle workers waiting on
    their queue for good (`die_with_parent`, as the runtime's ranks do)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)


class Sweep:
    """One command's sweep machinery: serial, a process pool or Ray, and one progress bar."""

    def __init__(self, workers: int | None = 1, ray_address: str | None = None, label: str | None = None,
                 quiet: bool = False):
        check_workers(workers)
        self.workers = workers
        self.ray_address = ray_address
        self.label = label
        self.quiet = quiet
        self._pool: ProcessPoolExecutor | None = None
        self._ray_started = False
        self._ray = None
        self._remote: dict = {}
        self._bar = None
        self._task = None
        self.submitted = 0

    # -- lifetime
    def __enter__(self) -> Sweep:
        check_ray(self.ray_address)
        if not self.ray_address and resolve_workers(self.workers, 2) > 1:
            self._start_pool()
        return self

    def _start_pool(self) -> None:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._pool = ProcessPoolExecutor(max_workers=resolve_workers(self.workers, 1 << 30), mp_context=ctx,
                                         initializer=_worker_init, initargs=(os.getpid(),))
        # Fork every worker now, before the bar's refresh thread exists (a fork copies no thread, but
        # it would copy a lock that thread holds).
        self._pool.submit(_noop, None).result()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False) -> None:
        """Stop the bar, the pool and a Ray instance this sweep started. `abort` (an error, Ctrl-C,
        SIGTERM): the workers are stopped mid-simulation instead of waited for."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._pool is not None:
            manager = getattr(self._pool, "_executor_manager_thread", None)
            if abort:
                # the executor has no terminate(); its worker processes are stopped directly, else a
                # stopped command would wait for simulations nobody will read
                for proc in list((self._pool._processes or {}).values()):
                    proc.terminate()
                # the queue's feeder thread may be blocked writing a task (a pickled plan) that no
                # stopped worker will read; exit must not wait for it
                call_queue = getattr(self._pool, "_call_queue", None)
                if call_queue is not None:
                    call_queue.cancel_join_thread()
            self._pool.shutdown(wait=not abort, cancel_futures=True)
            self._pool = None
            if abort and manager is not None:
                _retire_manager(manager)
        if self._ray_started:
            self._ray.shutdown()
            self._ray_started = False

    # -- progress
    def _grow(self, n: int) -> None:
        self.submitted += n
        if not self.label or self.quiet or not sys.stderr.isatty():
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True, console=Console(stderr=True))
            self._task = self._bar.add_task(self.label, total=0)
            self._bar.start()
        self._bar.update(self._task, total=self.submitted)

    def _advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def describe(self, text: str) -> None:
        """What the bar says it is doing now (e.g. which system is being tuned)."""
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    # -- mapping
    def concurrent(self) -> bool:
        """Do maps from several threads at once run side by side? With a process pool they do: every
        item a thread other than the main one maps runs in the pool's workers (`map`)."""
        return not self.ray_address and resolve_workers(self.workers, 2) > 1

    def in_process(self, n_items: int) -> bool:
        """Whether `map` of `n_items` runs them in this process (and thread). One item runs here even with
        a pool: nothing to overlap, and its job and result (a large cluster's step with spans) are not
        pickled across, nor is a spare plan of the parent lost; but not in a thread mapping beside others
        (`concurrent`): this process would run them one at a time while the workers wait."""
        if self.ray_address:
            return False
        return resolve_workers(self.workers, 2) == 1 or (n_items == 1
                                                         and threading.current_thread() is threading.main_thread())

    def map(self, fn: Callable[[Any], Any], items: Sequence) -> list:
        items = list(items)
        if not items:
            return []
        if self.ray_address:
            return self._map_ray(fn, items)
        if self.in_process(len(items)):
            self._grow(len(items))
            out = []
            for x in items:
                out.append(fn(x))
                raise_if_stopped()
                self._advance()
            return out
        if self._pool is None:
            self._start_pool()
        self._grow(len(items))
        results: list = [None] * len(items)
        futures = {self._pool.submit(fn, x): i for i, x in enumerate(items)}
        for f in as_completed(futures):
            results[futures[f]] = f.result()
            raise_if_stopped()
            self._advance()
        return results

    def _map_ray(self, fn, items: list) -> list:
        if self._ray is None:
            try:
                import ray
            except ImportError:
                raise SweepError("--ray needs Ray: pip install 'omnibench[ray]'") from None
            self._ray = ray
            if not ray.is_initialized():
                try:
                    if self.ray_address == "local":
                        ray.init(num_cpus=self.workers or default_workers(), include_dashboard=False,
                                 log_to_driver=False)
                    else:
                        ray.init(address=self.ray_address, log_to_driver=False)
                except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
                    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise SweepError(f"ray: cannot connect to --ray {self.ray_address} ({text})") from None
                self._ray_started = True
        ray = self._ray
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = ray.remote(fn)
        self._grow(len(items))
        refs = [remote.remote(x) for x in items]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            self._advance()
        return ray.get(refs)


MANAGER_JOIN_S = 10.0  # how long a stopped pool's manager thread is given to notice its workers are gone


def _retire_manager(thread: threading.Thread) -> None:
    """Wait (bounded) for an aborted pool's manager thread to end. Left running, it closes its wake-up
    pipe while concurrent.futures' exit hook writes to it, and the interpreter prints "Exception
    ignored in _python_exit ... Bad file descriptor" after the command's own last line. Once the
    thread is over, the hook finds the pipe marked closed and does nothing. A thread that does not
    end in time (a signal landed while it held a lock) is taken off the hook's list, so at least the
    hook does not write to its pipe (the SIGTERM path leaves through os._exit instead)."""
    from concurrent.futures import process

    thread.join(MANAGER_JOIN_S)
    if thread.is_alive():
        process._threads_wakeups.pop(thread, None)


def map_ordered(fn: Callable[[Any], Any], items: Sequence, *, workers: int | None = 1,
                ray_address: str | None = None, label: str | None = None) -> list:
    """`[fn(x) for x in items]` through a `Sweep` of its own (one-off sweeps)."""
    items = list(items)
    if not items:
        return []
    if not ray_address:
        workers = resolve_workers(workers, len(items))
    with Sweep(workers, ray_address, label) as sweep:
        return sweep.map(fn, items)

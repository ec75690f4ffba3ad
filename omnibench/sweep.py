"""Independent simulations of a sweep (tune's candidates, `simulate --steps`, reproduce's stages)
run on every core, or on a Ray cluster, with one progress bar.

`map_ordered(fn, items)` returns `[fn(x) for x in items]`, in the items' order whatever finished
first, so a sweep gives the same answer serial, pooled or on Ray: each simulation is deterministic
(simpy's event order and the engine's hashing of integer rank sets do not depend on the process),
and nothing a worker computes depends on what another computed.

- `workers=1`: in this process (no pickling; what tests and small sweeps use).
- `workers=N` / `None` (all cores): a process pool, forked where the OS can (fast start; simulation
  workers run no torch kernels, so torch's thread pools inherited in an undefined state are never
  used; spawning instead re-imports `__main__`, which fails under runners such as pytest-xdist).
- `ray_address="auto" | "local" | "ray://host:port"`: Ray tasks (`pip install omnibench[ray]`);
  "local" starts a private Ray instance on this machine and stops it afterwards.

`fn` must be picklable (a module-level function or a `functools.partial` of one) for the pool and
Ray.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


class SweepError(ValueError):
    """A sweep option is impossible (workers < 1, Ray asked for but not installed)."""


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int | None, n_items: int) -> int:
    if workers is not None and workers < 1:
        raise SweepError(f"workers must be >= 1 (or omitted for all {default_workers()} cores), got {workers}")
    return max(1, min(workers or default_workers(), n_items))


def _progress(label: str | None, total: int):
    """A rich progress bar on a terminal; nothing when not a terminal or no label."""
    if not label or not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True)
    bar.start()
    bar.add_task(label, total=total)
    return bar


def _advance(bar) -> None:
    if bar is not None:
        bar.advance(bar.task_ids[0])


def map_ordered(fn: Callable[[Any], Any], items: Sequence, *, workers: int | None = 1,
                ray_address: str | None = None, label: str | None = None) -> list:
    items = list(items)
    if not items:
        return []
    if ray_address:
        return _map_ray(fn, items, ray_address, label)
    n = resolve_workers(workers, len(items))
    bar = _progress(label, len(items))
    try:
        if n == 1:
            out = []
            for x in items:
                out.append(fn(x))
                _advance(bar)
            return out
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        results: list = [None] * len(items)
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            futures = {pool.submit(fn, x): i for i, x in enumerate(items)}
            for f in as_completed(futures):
                results[futures[f]] = f.result()
                _advance(bar)
        return results
    finally:
        if bar is not None:
            bar.stop()


def _map_ray(fn, items: list, address: str, label: str | None) -> list:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'omnibench[ray]'") from None
    started = False
    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=default_workers(), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        started = True
    bar = _progress(label, len(items))
    try:
        remote = ray.remote(fn)
        refs = [remote.remote(x) for x in items]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            _advance(bar)
        return ray.get(refs)
    finally:
        if bar is not None:
            bar.stop()
        if started:
            ray.shutdown()

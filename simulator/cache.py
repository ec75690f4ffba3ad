"""A disk cache of simulated steps, so that a repeated `tune`, `simulate --tuned` or `reproduce`
never simulates the same thing twice.

Key: everything the simulated step depends on, hashed together: the Plan (its JSON), the model
spec, the cluster (hardware and topology), the calibration profile, the simulation options, and
the source of the code that costs a Plan (`simulator/`, `omnibench/specs/`, `omnibench/plan.py`).
The code's hash is what keeps the cache from going stale: an edit to a cost model is a new key.
Values are the pickled `SimResult`. A damaged entry reads as a miss and is rewritten.

Where: `$OMNIBENCH_CACHE` or `~/.cache/omnibench/sims`; `OMNIBENCH_NO_CACHE=1` (or `--no-cache`
on the commands that simulate) bypasses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from functools import lru_cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_CODE = ("simulator", "omnibench/specs", "omnibench/plan.py")


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the source that turns a Plan into a simulated step (read once per process)."""
    h = hashlib.sha256()
    for part in _CODE:
        p = _ROOT / part
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".py", ".json", ".toml")) \
            if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_dir() -> Path:
    return Path(os.environ.get("OMNIBENCH_CACHE") or Path.home() / ".cache" / "omnibench" / "sims")


def enabled() -> bool:
    return os.environ.get("OMNIBENCH_NO_CACHE", "") in ("", "0")


def _plain(obj):
    """A JSON-able, order-stable form of specs, options and profiles (dataclasses, dicts, paths)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__type__": type(obj).__name__, **{f.name: _plain(getattr(obj, f.name))
                                                  for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return "nan"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def key(plan, model, cluster, calibration, options) -> str:
    h = hashlib.sha256(code_version().encode())
    h.update(plan.to_json(indent=None).encode())
    for part in (model, cluster, calibration, options):
        h.update(b"\0")
        h.update(json.dumps(_plain(part), sort_keys=True, separators=(",", ":")).encode())
    kernels = getattr(cluster, "kernels", "")
    if kernels:  # a profile given as a path may lie outside the hashed code: its bytes
        for cand in (Path(kernels), _ROOT / kernels):
            if cand.is_file():
                h.update(cand.read_bytes())
                break
    return h.hexdigest()


class SimCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_dir()
        self.hits = self.misses = 0

    def _path(self, k: str) -> Path:
        return self.root / k[:2] / f"{k}.pkl"

    def get(self, k: str):
        p = self._path(k)
        try:
            with p.open("rb") as f:
                got = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            self.misses += 1
            return None
        self.hits += 1
        return got

    def put(self, k: str, result) -> None:
        p = self._path(k)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(f".{os.getpid()}.tmp")
            with tmp.open("wb") as f:
                pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
            tmp.replace(p)  # atomic: a reader never sees half an entry, two writers both succeed
        except OSError:
            pass  # a read-only or full disk costs the cache, never the simulation


def simulate_cached(plan, model, cluster, *, calibration=None, options=None, cache: SimCache | None = None):
    """`simulator.engine.simulate`, answered from the cache when the same step was simulated before."""
    from simulator.engine import SimOptions, simulate

    options = options or SimOptions()
    if cache is None and not enabled():
        return simulate(plan, model, cluster, calibration=calibration, options=options)
    cache = cache or SimCache()
    k = key(plan, model, cluster, calibration, options)
    got = cache.get(k)
    if got is None:
        got = simulate(plan, model, cluster, calibration=calibration, options=options)
        cache.put(k, got)
    return got


@dataclasses.dataclass(frozen=True)
class SimJob:
    """One independent simulation of a sweep (what a pool or Ray worker receives)."""

    plan: object
    model: object
    cluster: object
    calibration: object = None
    options: object = None
    use_cache: bool = True


def run_job(job: SimJob):
    """Simulate one job (module level, so process pools and Ray can ship it)."""
    return simulate_cached(job.plan, job.model, job.cluster, calibration=job.calibration, options=job.options,
                           cache=None if job.use_cache and enabled() else _NO_CACHE)


class _Bypass(SimCache):
    def get(self, k: str):
        return None

    def put(self, k: str, result) -> None:
        pass


_NO_CACHE = _Bypass(Path("/nonexistent"))

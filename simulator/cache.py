"""A disk cache of simulated steps, so that a repeated `tune`, `simulate` or `reproduce` never
plans and simulates the same step twice.

A `StepJob` is one step of one system at one layout: the planner's inputs (system, model spec,
`ParallelSpec`, the batch's samples) and the simulator's (cluster, calibration profile, options).
`run_step` plans it, simulates it and answers a `StepOutcome`; it is module level, so process
pools and Ray can ship it.

Key: everything the outcome depends on, hashed together: those inputs, and the source of the
code that turns them into a simulated step (`code_files()`: the planners, the workload's sample
types, the specs, the Plan, the simulator with its presets and kernel profiles). Hashing the code
is what keeps the cache from going stale: an edit to a planner or a cost model is a new key. A
kernel profile given as a path outside the repository is hashed by its bytes.

Values: the step's metrics and its `SimResult` without spans (what `tune` and a step's row need,
tens of kB), or, for a job that asks for its trace (`keep="full"`), the whole result under a key
of its own (compressed). Each entry holds its own key beside the value and is trusted only under
that key: a file copied, renamed or swapped onto another key's path reads as a miss (and is
rewritten), never as another step's outcome. A damaged entry reads as a miss and is rewritten; an
entry never holds half a write.

Where: `$OMNIBENCH_CACHE` or `~/.cache/omnibench/sims`; `OMNIBENCH_NO_CACHE=1` (or `--no-cache`
on the commands that simulate) bypasses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import time
import zlib
from functools import lru_cache
from pathlib import Path

from systems.common import by_identity

_ROOT = Path(__file__).resolve().parent.parent
# What plans and costs a step (tests/test_sweep.py checks that every module of this repository a
# plan-and-simulate imports lies under one of these).
CODE = ("simulator", "systems", "workloads", "omnibench/specs", "omnibench/plan.py", "omnibench/process_groups.py",
        "omnibench/__init__.py")
_SUFFIXES = (".py", ".json", ".toml", ".yaml", ".yml")
FORMAT = 2  # bump when StepOutcome or an entry (key, value) changes shape


def code_files() -> list[Path]:
    out: list[Path] = []
    for part in CODE:
        p = _ROOT / part
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIXES
                          and "__pycache__" not in f.parts)
        elif p.is_file():
            out.append(p)
    return out


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the source that turns a step's inputs into a simulated step (read once per process)."""
    h = hashlib.sha256(str(FORMAT).encode())
    for f in code_files():
        h.update(str(f.relative_to(_ROOT)).encode())
        h.update(b"\0")
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
    if isinstance(obj, (set, frozenset)):
        return sorted(repr(_plain(v)) for v in obj)
    if isinstance(obj, float) and obj != obj:
        return "nan"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def _kernel_bytes(cluster) -> bytes:
    kernels = getattr(cluster, "kernels", "")
    if kernels:
        for cand in (Path(kernels), _ROOT / kernels):
            if cand.is_file():
                return cand.read_bytes()
    return b""


class PackedBatch:
    """A batch pickled once for every job that ships it, with its digest (a 4,096-GPU batch holds
    ~14,000 samples: pickling it per job, and hashing it per job in the workers, was the parent's
    work while both workers waited). Unpacked on first use where it lands."""

    __slots__ = ("_batch", "blob", "digest", "step")

    def __init__(self, batch):
        self.step = batch.step
        self.blob = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        self.digest = hashlib.sha256(repr(batch).encode()).hexdigest()  # frozen dataclasses: a stable repr
        self._batch = batch

    def __getstate__(self):
        return self.step, self.digest, self.blob

    def __setstate__(self, state) -> None:
        self.step, self.digest, self.blob = state
        self._batch = None

    def get(self):
        if self._batch is None:
            # A pool worker receives the same batch with every job of a tune (an 8,192-GPU batch of ~63,000
            # samples took 0.65 s to unpickle, a seventh of its simulation): the first copy serves the rest.
            got = _unpacked.get(self.digest)
            if got is None:
                if len(_unpacked) >= 8:
                    _unpacked.clear()
                got = _unpacked[self.digest] = pickle.loads(self.blob)
            self._batch = got
        return self._batch


_unpacked: dict[str, object] = {}  # digest -> batch, in the process that unpacks it (shared like a serial run's)


def pack(batch) -> PackedBatch:
    """`batch` packed, once per batch object (the last 64 are kept, so an id is never reused)."""
    return batch if isinstance(batch, PackedBatch) else _pack(batch)


@by_identity(1, size=64)
def _pack(batch) -> PackedBatch:
    return PackedBatch(batch)


@dataclasses.dataclass(frozen=True)
class StepJob:
    """One step of one system at one layout (what a pool or Ray worker receives)."""

    system: str
    model: object  # MultimodalSpec
    parallel: object  # ParallelSpec (options included: omni's technique switches, its cost model)
    batch: object  # workloads.sample.Batch, or a PackedBatch of one (`pack`)
    cluster: object  # ClusterSpec
    calibration: object = None  # simulator.calibrate.Profile
    options: object = None  # SimOptions
    keep: str = "summary"  # "summary": metrics and the result without spans; "full": with spans (traces)
    want_plan: bool = False  # also answer the Plan (planned again on a cache hit)
    use_cache: bool = True


@dataclasses.dataclass
class StepOutcome:
    """A planned and simulated step: `result` (spans only with keep="full") and its `metrics()`
    taken before the spans were dropped; or `error`, the planner's or the simulator's one line."""

    step: int
    result: object = None
    metrics: dict | None = None
    error: str = ""
    plan: object = None
    cached: bool = False


def key(job: StepJob) -> str:
    from simulator.engine import SimOptions

    h = hashlib.sha256(code_version().encode())
    h.update(job.system.encode())
    for part in (job.model, job.parallel, job.cluster, job.calibration, job.options or SimOptions()):
        h.update(b"\0")
        h.update(json.dumps(_plain(part), sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    digest = job.batch.digest if isinstance(job.batch, PackedBatch) else \
        hashlib.sha256(repr(job.batch).encode()).hexdigest()
    h.update(digest.encode())
    h.update(_kernel_bytes(job.cluster))
    return h.hexdigest()


class SimCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_dir()
        self.hits = self.misses = 0

    def _path(self, k: str) -> Path:
        return self.root / k[:2] / f"{k}.pkl.z"

    def get(self, k: str):
        p = self._path(k)
        try:
            stored, got = pickle.loads(zlib.decompress(p.read_bytes()))
        except (OSError, zlib.error, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError,
                TypeError, IndexError):
            self.misses += 1
            return None
        if stored != k:  # another key's entry at this path: a miss, so the step is simulated and put again
            self.misses += 1
            return None
        self.hits += 1
        return got

    def put(self, k: str, value) -> None:
        p = self._path(k)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
            tmp.write_bytes(zlib.compress(pickle.dumps((k, value), protocol=pickle.HIGHEST_PROTOCOL), 1))
            tmp.replace(p)  # atomic: a reader never sees half an entry, two writers both succeed
        except OSError:
            pass  # a read-only or full disk costs the cache, never the simulation


class _Bypass(SimCache):
    def get(self, k: str):
        return None

    def put(self, k: str, value) -> None:
        pass


def _store(job: StepJob, cache: SimCache | None) -> SimCache:
    if cache is not None:
        return cache
    return SimCache() if job.use_cache and enabled() else _Bypass(Path("/nonexistent"))


def run_step(job: StepJob, cache: SimCache | None = None) -> StepOutcome:
    """Plan and simulate `job`, or answer it from the cache (module level: pools and Ray ship it).
    A step is simulated and cached at memory error 0 and its fit decided for the job's own
    (`engine.check_fit`): the error moves no time, so a tune under +-20% reuses every step."""
    from simulator.engine import SimOptions, check_fit

    options = job.options or SimOptions()
    error = options.memory_error
    if not error:
        return _run_step(job, cache)
    got = _run_step(dataclasses.replace(job, options=dataclasses.replace(options, memory_error=0.0)), cache)
    if got.result is not None and options.check_memory:
        got = dataclasses.replace(got, result=check_fit(dataclasses.replace(got.result), error))
        got.metrics = {**got.metrics, "fits": got.result.fits, "fit_message": got.result.fit_message}
    return got


def _run_step(job: StepJob, cache: SimCache | None = None) -> StepOutcome:
    from systems import cyclic_gc_paused

    # One pause over the planning and the simulation: paused apart (each pauses itself), the step's
    # Plan, made while the GC slept, was scanned by the first collection in the simulator's set-up and
    # again by the older generations' (2-4% of a tune's CPU); in one pause it is freed before the GC
    # wakes, and what survives a step is its outcome.
    with cyclic_gc_paused():
        return _plan_and_simulate(job, cache)


def _plan_and_simulate(job: StepJob, cache: SimCache | None) -> StepOutcome:
    from simulator.engine import SimOptions, simulate
    from systems import get_planner

    store = _store(job, cache)
    k = key(job)
    batch = job.batch.get() if isinstance(job.batch, PackedBatch) else job.batch
    full_key = k + "-full"
    got = store.get(full_key if job.keep == "full" else k)
    plan = None
    if got is None:
        planner = get_planner(job.system)
        try:
            began = time.process_time()
            plan = planner.plan(job.model, job.parallel, batch)
            planning = time.process_time() - began
            res = simulate(plan, job.model, job.cluster, calibration=job.calibration,
                           options=job.options or SimOptions())
        except ValueError as e:  # a planner refusing the layout, a simulated deadlock: one line
            got = StepOutcome(batch.step, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            store.put(k, got)
            if job.keep == "full":
                store.put(full_key, got)
        else:
            from systems.common import plan_summary

            light = dataclasses.replace(res, spans=[])
            # the planner's CPU seconds for this step, measured here (one host thread): shown beside the
            # step's charge, which comes from simulator/planning.py's model of it (a measurement taken
            # here would make the same step's time depend on this host's load)
            got = StepOutcome(batch.step, light, {**res.metrics(), "plan": plan_summary(plan),
                                                  "planning_cpu_s": planning})
            store.put(k, got)
            if job.keep == "full":
                store.put(full_key, dataclasses.replace(got, result=res))
                got = dataclasses.replace(got, result=res)
    else:
        got.cached = True
    if job.want_plan and plan is None and not got.error:
        plan = get_planner(job.system).plan(job.model, job.parallel, batch)
    got.plan = plan if job.want_plan else None
    return got

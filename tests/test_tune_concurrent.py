"""What makes `reproduce` cheaper must leave every answer as it was (issue 21): a tune under a memory
error reuses the steps simulated at the nominal estimate and finds what it finds from nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnibench.specs.presets import get_model
from omnibench.tune import tune_converged
from simulator.hardware import load_cluster
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)


def _trials(res):
    return [(t.candidate.label(), t.step_s, t.peak_gib, t.fits, t.note, t.guard_step) for t in res.trials]


def _entries(root: Path) -> int:
    return sum(1 for _ in root.rglob("*.pkl.z"))


def test_a_tune_under_a_memory_error_from_a_warm_step_cache_is_the_one_from_a_cold_cache(tmp_path, monkeypatch):
    model, cluster = get_model("omni-7b"), load_cluster("h100", 16)
    stream = WorkloadStream("bursty_mix", seed=14, global_batch_tokens=131072)
    window = [stream.batch(s) for s in range(6)]
    kw = dict(budget=2, guard_batches=window, memory_error=0.2)
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    monkeypatch.setenv("OMNIBENCH_CACHE", str(warm))
    tune_converged("omni", model, window[:2], cluster, budget=2, guard_batches=window)  # the nominal tune first
    before = _entries(warm)
    from_warm = tune_converged("omni", model, window[:2], cluster, **kw)
    simulated_warm = _entries(warm) - before
    monkeypatch.setenv("OMNIBENCH_CACHE", str(cold))
    from_cold = tune_converged("omni", model, window[:2], cluster, **kw)
    assert _trials(from_warm) == _trials(from_cold) and from_warm.best.candidate == from_cold.best.candidate
    assert from_warm.guarded == from_cold.guarded and from_warm.convergence == from_cold.convergence
    # the error moved no time: the steps simulated at the nominal estimate answered most of it
    assert simulated_warm < _entries(cold) / 2, (simulated_warm, _entries(cold))

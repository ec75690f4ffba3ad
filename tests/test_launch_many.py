"""launch_many: several runs in one launch of ranks, each its own process group and record (what
the parity suite runs on); a run that fails is named, the runs before it keep their records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnibench.runtime import records
from omnibench.runtime.launch import RunFailed, launch_many, resolve
from omnibench.specs.run import RunSpec

pytestmark = pytest.mark.timeout(300)


def _spec(tmp_path: Path, name: str, system: str, **kw) -> RunSpec:
    return resolve(RunSpec(system=system, nproc=2, steps=2, device="cpu", out=str(tmp_path / name), timeout_s=120, **kw))


def test_runs_in_one_launch_each_write_their_own_complete_record(tmp_path):
    a, b = _spec(tmp_path, "a", "homogeneous"), _spec(tmp_path, "b", "temporal", seed=1)
    folders = launch_many([a, b])
    assert folders == [a.out, b.out]
    for folder, system in zip(folders, ("homogeneous", "temporal"), strict=True):
        summary = json.loads((Path(folder) / "summary.json").read_text())
        assert summary["system"] == system and summary["steps"] == 2
        assert json.loads((Path(folder) / "config.json").read_text())["finished"] is True
    # different seeds, different batches: each run trained on its own stream
    losses = [[json.loads(x)["loss"] for x in open(Path(f) / "steps.jsonl")] for f in folders]
    assert losses[0] != losses[1]


def test_a_failing_run_is_named_and_the_runs_before_it_keep_what_they_wrote(tmp_path):
    a = _spec(tmp_path, "a", "homogeneous")
    b = _spec(tmp_path, "b", "homogeneous", inject_failure="1:0")
    c = _spec(tmp_path, "c", "homogeneous")
    with pytest.raises(RunFailed) as e:
        launch_many([a, b, c])
    assert e.value.rank == 1 and "injected failure on rank 1 at step 0" in str(e.value)
    assert e.value.report.startswith(b.out + records.INCOMPLETE)
    assert (Path(a.out + records.INCOMPLETE) / "steps.jsonl").is_file()  # a finished before b failed
    assert not (Path(c.out + records.INCOMPLETE) / "steps.jsonl").exists()  # c never started
    for s in (a, b, c):
        assert records.lock_holder(s.out + records.INCOMPLETE) is None  # every folder released


def test_runs_of_different_world_sizes_are_refused_before_any_rank_starts(tmp_path):
    a = _spec(tmp_path, "a", "homogeneous")
    b = resolve(RunSpec(system="homogeneous", nproc=4, steps=1, device="cpu", out=str(tmp_path / "b")))
    with pytest.raises(ValueError, match="one world size"):
        launch_many([a, b])
    assert not list(tmp_path.iterdir())

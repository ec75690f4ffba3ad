"""omni's loaders really exchange metadata: 4 gloo processes run the loading phase
(omnibench/runtime/loading.py) with two reorder groups. Each loader reads only the samples it was
dealt before its group's exchange, and afterwards only those its group gave it; the result equals
the in-process exchange the simulator and `omnibench plan` use."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from datetime import timedelta

import pytest
from gloo_ranks import join_group, leave_group
from test_omni_planner import skewed_batch

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import get_planner
from systems.omni.reorder import dealt, in_process_loading

WORLD = 4
OPTIONS = {"reorder_group": 2, "reshard": False}


class RecordingDataset:
    """The step's index list; remembers which positions a loader read and when."""

    def __init__(self, samples):
        self.samples, self.reads = samples, []

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, k):
        self.reads.append(k)
        return self.samples[k]


def _rank(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    from omnibench.runtime.loading import LoaderExchange

    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.FileStore(store_path, WORLD)
    join_group(rank, WORLD, store=store)
    model, planner = get_model("tiny-omni"), get_planner("omni")
    parallel = ParallelSpec(world_size=WORLD, options=OPTIONS)
    batch = skewed_batch(32)
    first = planner.plan(model, parallel, batch)
    ex = LoaderExchange(planner, model, parallel, first.layouts, rank, timedelta(seconds=30))
    data = RecordingDataset(batch.samples)
    marks = {}

    def mark_first_gather(*a, **k):  # reads before the group's all-gather are the loader's own
        marks.setdefault("before_exchange", len(data.reads))
        return gather(*a, **k)

    gather = ex._gather_metadata
    ex._gather_metadata = mark_first_gather
    got, loading, timings = ex.run(0, data, 0.0)
    plan = planner.plan(model, parallel, got, loading=loading)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"reads": data.reads, "before_exchange": marks.get("before_exchange"),
                   "shards": loading.shards, "traffic": loading.traffic, "before": loading.before,
                   "after": loading.after, "timings": sorted(timings), "same_batch": got.samples == batch.samples,
                   "plan": plan.to_dict()}, f)
    leave_group()


@pytest.mark.timeout(120)
def test_loaders_exchange_metadata_inside_their_groups(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    model, planner = get_model("tiny-omni"), get_planner("omni")
    parallel = ParallelSpec(world_size=WORLD, options=OPTIONS)
    batch = skewed_batch(32)
    spec = planner.loader_spec(model, parallel, len(batch.samples))
    ref = in_process_loading(spec, planner.cost_model(model, planner_options(parallel)), batch.samples)
    expected = json.loads(planner.plan(model, parallel, batch).to_json())
    for r, g in enumerate(got):
        mine = list(dealt(32, r, WORLD))
        assert sorted(g["reads"][: g["before_exchange"]]) == mine  # only its own samples before exchanging
        assert set(g["reads"]) <= set(mine) | {k for k in range(32) if batch.samples[k].sample_id in ref.shards[r]}
        assert g["shards"] == ref.shards and g["before"] == ref.before and g["after"] == ref.after
        assert g["traffic"] == ref.traffic and [t["metadata_entries"] for t in g["traffic"]] == [16, 16]
        assert g["timings"] == ["plan", "reorder"] and g["same_batch"]
        assert g["plan"] == expected  # every rank builds the Plan the in-process exchange gives
    assert any(t["moved"] > 0 for t in ref.traffic)


def planner_options(parallel):
    from systems.omni.options import OmniOptions

    return OmniOptions.parse(parallel.options)

"""omni's sequence-parallel groups over a run (omnibench/runtime/long_short.py): a rank builds its plan's
group pool (every group any step may name) once, before the first step, and every step uses those
groups, creating none and releasing none, as the simulator's memory check counts them
(`simulator.memory.communicators`: one NCCL communicator each on a GPU). Four real gloo ranks, three
steps whose plans name different group sizes, as omni's planner does when a batch changes, and a step
naming a group outside the pool, refused."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group

from omnibench.plan import Layout

WORLD = 4
# step -> the plan's long_short groups (module -> groups of ranks)
STEPS = [
    {"vision": [[0, 1], [2, 3]]},
    {"vision": [[0, 1, 2, 3]], "llm": [[0, 1], [2, 3]]},
    {"vision": [[0, 1, 2, 3]], "audio": [[0, 1, 2, 3]]},
]


LAYOUTS = {"vision": Layout("vision", tuple(range(4)), dp=4), "audio": Layout("audio", tuple(range(4)), dp=4),
           "llm": Layout("llm", tuple(range(4)), dp=4)}
POOL = {"vision": [2, 4], "llm": [2]}  # groups [0, 1], [2, 3], [0, 1, 2, 3] (the LLM's pairs are the vision pairs)


def _plan(groups: dict, step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(step=step, layouts=LAYOUTS,
                           options={"long_short": {"pool": POOL, "groups": groups, "long_microbatches": {}}})


def _worker(rank: int, init: str, out: str) -> None:
    from omnibench.runtime.long_short import LongShortRuntime

    timeout = timedelta(seconds=60)
    join_group(rank, WORLD, init)
    rt = LongShortRuntime.create(_plan(STEPS[0]), rank, timeout)
    pool_ids = {k: id(g) for k, g in rt.built.items()}
    seen = []
    for i, groups in enumerate(STEPS):
        rt.prepare(_plan(groups, i))
        sums = {}
        for module, (group, ranks) in sorted(rt.groups.items()):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=group)
            sums[module] = (list(ranks), t.item())
        live = sum(1 for pg in dist.distributed_c10d._world.pg_map if pg is not dist.group.WORLD)
        seen.append({"built": sorted(str(list(k)) for k in rt.built), "sums": sums, "live_subgroups": live,
                     "same_groups": {k: id(g) for k, g in rt.built.items()} == pool_ids})
    try:  # every rank refuses alike, before any collective
        rt.prepare(_plan({"vision": [[0, 2], [1, 3]]}, 3))
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": seen, "refused": refused}, f)
    leave_group()


@pytest.mark.timeout(120)
def test_a_rank_builds_its_group_pool_once_and_every_step_uses_it():
    from simulator.memory import _pool_members

    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'store')}"
        mp.spawn(_worker, args=(init, out), nprocs=WORLD, join=True)
        got = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]
    held = _pool_members(LAYOUTS, POOL)
    for rank, rec in enumerate(got):
        for groups, step in zip(STEPS, rec["steps"], strict=True):
            assert step["built"] == ["[0, 1, 2, 3]", "[0, 1]", "[2, 3]"], (rank, step)
            assert step["same_groups"], (rank, step)  # none created, none released after start-up
            # the pool's groups this rank is in: the simulator's count of its SP communicators
            assert step["live_subgroups"] == held[rank] == 2, (rank, step)
            named = {module for module, gs in groups.items() if any(rank in g for g in gs)}
            assert set(step["sums"]) == named, (rank, step)
            for module, (ranks, total) in step["sums"].items():
                assert rank in ranks and total == sum(r + 1 for r in ranks), (rank, module, ranks, total)
        assert "step 3: the plan names the vision group [0, 2]" in rec["refused"], rec["refused"]

"""omni's sequence-parallel groups over a run (omnibench/runtime/long_short.py): a rank holds only its
step's groups, as the simulator's memory check counts them (`simulator.memory.communicators`: one NCCL
communicator each on a GPU), keeps a group that the next step names again, and the groups it creates
after releasing others still communicate. Four real gloo ranks, three steps whose plans name
different group sizes, as omni's planner does when a batch changes."""

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

WORLD = 4
# step -> the plan's long_short groups (module -> groups of ranks)
STEPS = [
    {"vision": [[0, 1], [2, 3]]},
    {"vision": [[0, 1, 2, 3]], "llm": [[0, 1], [2, 3]]},
    {"vision": [[0, 1, 2, 3]], "audio": [[0, 1, 2, 3]]},
]


def _plan(groups: dict) -> SimpleNamespace:
    return SimpleNamespace(options={"long_short": {"groups": groups, "long_microbatches": {}}})


def _worker(rank: int, init: str, out: str) -> None:
    from omnibench.runtime.long_short import LongShortRuntime

    timeout = timedelta(seconds=60)
    join_group(rank, WORLD, init)
    rt = LongShortRuntime.create(_plan(STEPS[0]), rank, timeout)
    seen, kept_ids = [], []
    for i, groups in enumerate(STEPS):
        if i:
            before = {k: id(g) for k, g in rt.built.items()}
            rt.prepare(_plan(groups))
            kept_ids.append(sorted(str(list(k)) for k, g in rt.built.items() if before.get(k) == id(g)))
        # every group this rank is in must work after the others were released
        sums = {}
        for module, (group, ranks) in sorted(rt.groups.items()):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=group)
            sums[module] = (list(ranks), t.item())
        live = sum(1 for pg in dist.distributed_c10d._world.pg_map if pg is not dist.group.WORLD)
        seen.append({"built": sorted(str(list(k)) for k in rt.built), "sums": sums, "live_subgroups": live})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": seen, "kept": kept_ids}, f)
    leave_group()


@pytest.mark.timeout(120)
def test_a_rank_holds_only_its_steps_sequence_parallel_groups():
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'store')}"
        mp.spawn(_worker, args=(init, out), nprocs=WORLD, join=True)
        got = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]
    for rank, rec in enumerate(got):
        for groups, step in zip(STEPS, rec["steps"], strict=True):
            named = sorted({str(g) for gs in groups.values() for g in gs})
            assert step["built"] == named, (rank, step)
            mine = [g for gs in groups.values() for g in gs if rank in g]
            # distinct groups this rank is in: the simulator's count of its SP communicators
            assert step["live_subgroups"] == len({tuple(g) for g in mine}), (rank, step)
            for module, (ranks, total) in step["sums"].items():
                assert rank in ranks and total == sum(r + 1 for r in ranks), (rank, module, ranks, total)
        # a group is its ranks, whichever module names it: step 1's LLM pairs are step 0's vision pairs,
        # kept; step 2 names the 4-rank group again (kept) and no pair (released)
        assert rec["kept"] == [["[0, 1]", "[2, 3]"], ["[0, 1, 2, 3]"]], rec["kept"]

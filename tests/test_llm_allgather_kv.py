"""omni's long LLM samples where Ulysses cannot split the heads: the long-sample group
all-gathers K/V instead (systems/omni/llm_long_short.py, omnibench/runtime/parallelize.py
AllGatherKVAttention). Loss parity on gloo is in tests/test_omni_parity.py (`cp2-allgather`)."""

from __future__ import annotations

import pytest
import torch

from omnibench.models.attention import VarlenAttention
from omnibench.runtime.parallelize import AllGatherKVAttention, zigzag_index, zigzag_rows
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import simulate
from simulator.hardware import load_cluster
from simulator.options import SimOptions
from systems import get_planner
from systems.common import llm_layout
from systems.omni.llm_long_short import llm_group_size
from workloads.stream import WorkloadStream


def test_group_kind_is_ulysses_where_the_heads_allow_and_allgather_where_they_do_not():
    model = get_model("omni-7b")  # 28 heads, 4 kv heads
    at = {}
    for cp in (1, 4):
        par = ParallelSpec(world_size=64, cp=cp)
        at[cp] = llm_group_size(model, par, llm_layout(par, range(64)))
    assert at[1] == (4, "ulysses", "")  # 4 divides 28 and 4; 8 does not
    assert at[4] == (2, "allgather", "")  # 2 x cp 4 = 8 ranks: no Ulysses over 4 kv heads, a node's worth
    par = ParallelSpec(world_size=64, tp=2, cp=4)
    k, kind, why = llm_group_size(model, par, llm_layout(par, range(64)))
    assert (k, kind) == (1, "") and "inside a node of 8" in why


def test_zigzag_pieces_cover_the_row_once_and_even_out_causal_work():
    tokens, k = 48, 3
    rows = torch.cat([zigzag_index(tokens, k, m) for m in range(k)])
    assert sorted(rows.tolist()) == list(range(tokens))
    work = [sum(p + 1 for a, b in zigzag_rows(tokens, k, m) for p in range(a, b)) for m in range(k)]
    assert max(work) == min(work)  # keys each member's queries see, one causal sequence over the row


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_each_member_attends_its_pieces_exactly_as_whole_row_attention(backend):
    """Without a process group: every member's query pieces over the gathered K/V they select,
    put back in row order, equal varlen attention over the whole packed row (GQA, causal)."""
    torch.manual_seed(0)
    tokens, k = 24, 3
    q, key, v = torch.randn(tokens, 4, 8), torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
    cu = torch.tensor([0, 5, 17, 20, 24])
    core = VarlenAttention(backend)
    ref = core(q, key, v, cu, 12, True)
    order = torch.cat([zigzag_index(tokens, k, m) for m in range(k)])
    gathered = torch.cat([key, v], dim=1)[order]  # what the all-gather returns, member by member
    out = torch.empty_like(ref)
    for m in range(k):
        cu_q, cu_k, keys = AllGatherKVAttention(core, None, k, m)._layout(cu, tokens)
        kv = gathered.index_select(0, keys)
        mine = zigzag_index(tokens, k, m)
        out[mine] = core.segments(q[mine], kv[:, :2], kv[:, 2:], cu_q, cu_k, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_long_video_samples_split_over_allgather_groups_shorten_omnis_step():
    """omni-7b on long_video at 256 H100s, tp 1 / cp 4: the longest videos' LLM sequences exceed a
    data rank's balanced share; split over 2 data ranks x cp 4 with all-gathered K/V they no longer
    set the step (with the split off, no group: the step is the longest sample's)."""
    gpus = 256
    model = get_model("omni-7b")
    batch = WorkloadStream("long_video", seed=0, global_batch_tokens=8192 * gpus).batch(0)
    cluster = load_cluster("h100", gpus)
    steps = {}
    for on in (True, False):
        par = ParallelSpec(world_size=gpus, cp=4, microbatches=1, recompute="full",
                           options={"hardware": "h100", "llm_long_short": on})
        plan = get_planner("omni").plan(model, par, batch)
        if on:
            assert plan.options["long_short"]["llm_cp_kind"] == "allgather"
            assert all(len(g) == 8 for g in plan.options["long_short"]["groups"]["llm"])
            assert plan.notes["llm_long_short"]["long_samples"]
        res = simulate(plan, model, cluster, options=SimOptions(recompute="full"))
        assert res.fits
        steps[on] = res.step_time
    assert steps[True] < 0.95 * steps[False], steps


@pytest.mark.timeout(300)
def test_the_split_is_weighed_per_batch_and_declined_where_it_would_slow_the_step():
    """mixed_video at 256 H100s, tp 1 / cp 4: a few samples cross a data rank's share, but splitting
    them costs every data rank a second lock-step microbatch; the planner's estimate says so, the
    plan keeps them whole and says why (with `llm_split=always` it splits, and the step is slower)."""
    gpus = 256
    model = get_model("omni-7b")
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=8192 * gpus).batch(0)
    cluster = load_cluster("h100", gpus)
    rc = "vision=full,audio=full"
    steps, plans = {}, {}
    for rule in ("auto", "always"):
        par = ParallelSpec(world_size=gpus, cp=4, microbatches=1, recompute=rc,
                           options={"hardware": "h100", "encoder_dp": "hsdp", "llm_split": rule,
                                    "balancer": "simulator"})  # the estimate at the simulator's prices
        plans[rule] = get_planner("omni").plan(model, par, batch)
        steps[rule] = simulate(plans[rule], model, cluster, options=SimOptions(recompute=rc)).step_time
    notes = plans["auto"].notes["llm_long_short"]
    assert plans["always"].notes["llm_long_short"]["long_samples"]
    assert not notes["long_samples"] and "estimates" in notes["why_not"]
    assert notes["estimated_step_s"]["split"] > notes["estimated_step_s"]["whole"]
    assert steps["auto"] < steps["always"], steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workload, layout, kept, alone", [
    ("mixed_video", {"tp": 4}, "whole", {"llm_long_short": False}),  # the estimate keeps samples whole
    ("long_video", {"tp": 2, "cp": 2}, "split", {"llm_split": "always"}),  # the estimate splits
])
def test_the_way_kept_is_the_plan_of_that_way_alone_and_only_it_is_built(monkeypatch, workload, layout, kept, alone):
    """Weighing the split plans the batch up to its estimate both ways and builds routes and actions for
    the way kept only (a third of a plan's cost at 16,384 GPUs): the Plan equals the one planned that way
    alone, and `to_actions` runs once."""
    import systems.omni as omni

    gpus, model = 256, get_model("omni-7b")
    batch = WorkloadStream(workload, seed=0, global_batch_tokens=8192 * gpus).batch(0)
    calls = []
    real = omni.to_actions
    monkeypatch.setattr(omni, "to_actions", lambda *a, **k: calls.append(1) or real(*a, **k))
    options = {"hardware": "h100", "balancer": "simulator"}  # both ways estimated at the simulator's prices
    weighed = get_planner("omni").plan(model, ParallelSpec(world_size=gpus, options=options, **layout), batch)
    assert len(calls) == 1
    notes = weighed.notes["llm_long_short"]
    assert {"split", "whole"} <= set(notes["estimated_step_s"])
    assert bool(notes["long_samples"]) == (kept == "split") and ("why_not" in notes) == (kept == "whole")
    one_way = get_planner("omni").plan(model, ParallelSpec(world_size=gpus, options={**options, **alone}, **layout),
                                       batch)
    assert weighed.actions == one_way.actions and weighed.routes == one_way.routes
    assert weighed.assignment == one_way.assignment


@pytest.mark.timeout(180)
def test_a_ways_floor_is_under_its_estimate_and_decides_only_where_the_estimate_would(monkeypatch):
    """Each way's `_Floor` (the first stage's LLM work, schedule.step_floor, plus every rank's share of
    the encoder work at its cheapest) is never above the estimate its draft then works out: at pp 1 and
    2, with or without the joint pipeline, with measured or datasheet prices, with FSDP-locked encoders;
    and the planner's decision, floored (`floor` in the notes) or not, is the one both drafts' estimates
    make. The encoder share must lift some floor above the LLM's alone (else it checks nothing)."""
    import systems.omni as omni
    from systems.omni import SPLIT_MARGIN, _r

    llm_floors = []
    real = omni.step_floor
    monkeypatch.setattr(omni, "step_floor", lambda *a: llm_floors.append(real(*a)) or llm_floors[-1])
    gpus, model = 256, get_model("omni-7b")
    floored = lifted = 0
    for workload, layout in (("mixed_video", {"tp": 4}), ("long_video", {"tp": 2, "cp": 2}),
                             ("mixed_video", {"tp": 4, "pp": 2}), ("long_video", {"tp": 2, "cp": 2, "pp": 2})):
        batch = WorkloadStream(workload, seed=0, global_batch_tokens=8192 * gpus).batch(0)
        for options in ({"hardware": "h100"}, {"hardware": "h100", "joint_pipeline": False}, {},
                        {"hardware": "h100", "encoder_dp": "fsdp"}):
            par = ParallelSpec(world_size=gpus, options=options, **layout)
            planner = get_planner("omni")
            est = {}
            for split in (True, False):
                way = planner._plan(model, par, batch, split_llm=split)
                floor, draft = next(way), next(way)
                assert _r(floor.step_s) <= draft.estimated_step_s, (workload, layout, options, split)
                lifted += floor.step_s > llm_floors[-1]
                est[split] = draft.estimated_step_s
            plan = planner.plan(model, par, batch)
            notes = plan.notes["llm_long_short"]
            if "estimated_step_s" not in notes:
                continue
            assert bool(notes["long_samples"]) == (est[True] < (1 - SPLIT_MARGIN) * est[False])
            floored += "floor" in notes["estimated_step_s"]
    assert floored, "no case decided by a floor: the test checks nothing of it"
    assert lifted, "no floor holds encoder work: its share checks nothing"

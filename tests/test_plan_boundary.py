"""Plan additions the runtime relies on: boundary actions carry direction and the peer's
microbatch, survive JSON, and unmatched or misordered messages are caught before execution."""

from __future__ import annotations

import dataclasses

import pytest

from omnibench.plan import BOUNDARY, Action, Plan, PlanError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import get_planner
from systems.common import balance, check_p2p_order, one_f_one_b
from workloads.sample import Batch, Sample, Segment


def _batch() -> Batch:
    samples = []
    for i in range(8):
        segs = (Segment("text", 5 + i), Segment("image", 4, 16, grid_thw=(1, 4, 4)), Segment("text", 6))
        samples.append(Sample(i, "t", segs))
    return Batch(0, samples)


def _plan() -> Plan:
    return get_planner("noncolocated").plan(get_model("tiny-vl"), ParallelSpec(world_size=4, encoder_ranks=2, microbatches=2, options={"balancer": "tokens"}), _batch())


def test_boundary_actions_round_trip_through_json():
    plan = _plan()
    acts = [a for acts in plan.actions.values() for a in acts if a.kind == BOUNDARY]
    assert acts and all(a.direction in ("send", "recv") and a.peer_microbatch >= 0 for a in acts)
    again = Plan.from_json(plan.to_json())
    assert again.actions == plan.actions and again.routes == plan.routes
    assert "send" in str(acts[0]) or "recv" in str(acts[0])


def test_a_boundary_send_without_its_recv_is_invalid():
    plan = _plan()
    for acts in plan.actions.values():
        for i, a in enumerate(acts):
            if a.kind == BOUNDARY and a.direction == "recv":
                del acts[i]
                with pytest.raises(PlanError, match="no matching boundary recv"):
                    plan.validate()
                with pytest.raises(PlanError, match="no matching boundary recv"):
                    plan.validate(order=True)  # omni's one pass over the messages finds it too
                return
    pytest.fail("plan has no boundary recv")


def test_messages_posted_in_different_orders_are_caught():
    plan = _plan()
    rank = next(r for r, acts in plan.actions.items() if sum(a.kind == BOUNDARY and a.direction == "recv" for a in acts) > 1)
    acts = plan.actions[rank]
    idx = [i for i, a in enumerate(acts) if a.kind == BOUNDARY and a.direction == "recv"]
    same_peer = [i for i in idx if acts[i].peer == acts[idx[0]].peer]
    assert len(same_peer) > 1
    i, j = same_peer[0], same_peer[1]
    acts[i], acts[j] = acts[j], acts[i]
    plan.validate()  # still every message has its partner...
    with pytest.raises(PlanError, match="different orders"):
        check_p2p_order(plan)  # ...but FIFO matching per pair would deliver the wrong one
    with pytest.raises(PlanError, match="different orders"):
        plan.validate(order=True)  # as omni's planner validates: the same check in validate's pass


def test_action_defaults_keep_older_plans_loadable():
    old = {"kind": "forward", "module": "llm", "microbatch": 0, "stage": 0, "what": "", "peer": -1}
    a = Action(**old)
    assert a.direction == "" and a.peer_microbatch == -1
    assert {f.name for f in dataclasses.fields(Action)} >= set(old)


def test_one_f_one_b_runs_every_microbatch_once_each_way_and_warms_up_by_depth():
    for stages in (1, 2, 4):
        for stage in range(stages):
            for m in (stages, 2 * stages):
                order = one_f_one_b(stage, stages, m)
                assert sorted(j for k, j in order if k == "F") == list(range(m))
                assert sorted(j for k, j in order if k == "B") == list(range(m))
                first_b = next(i for i, (k, _) in enumerate(order) if k == "B")
                assert first_b == min(stages - stage - 1, m) + 1


def test_balance_is_deterministic_and_spreads_cost():
    items = [(i, float((i * 37) % 11 + 1)) for i in range(40)]
    a, b = balance(items, 4), balance(list(reversed(items)), 4)
    assert a == b
    loads = [sum(c for i, c in items if i in set(part)) for part in a]
    assert max(loads) - min(loads) <= 11

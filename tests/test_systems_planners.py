"""The four baseline planners: valid plans for every layout, the same data split for every system,
their defining placement and schedule, and early refusal of impossible layouts."""

from __future__ import annotations

import copy
import random

import pytest

from omnibench.plan import BACKWARD, BOUNDARY, FORWARD, Plan, PlanError
from omnibench.specs.model import SpecError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import available_systems, get_planner
from systems.common import check_p2p_order, data_rank, one_f_one_b, stage_of
from systems.noncolocated import split_ranks
from workloads.sample import Batch, Sample, Segment

BASELINES = ("homogeneous", "temporal", "colocated", "noncolocated")
MODEL = get_model("tiny-omni")


def mixed_batch(n: int = 24, step: int = 0, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        segs = [Segment("text", rng.randint(4, 30))]
        k = rng.random()
        if k < 0.35:
            segs.append(Segment("image", 4, 16, grid_thw=(1, 4, 4)))
        elif k < 0.5:
            segs.append(Segment("video", 8, 32, grid_thw=(2, 4, 4)))
        elif k < 0.75:
            segs.append(Segment("audio", 6, 12, mel_frames=24))
        segs.append(Segment("text", rng.randint(2, 20)))
        samples.append(Sample(step * 1000 + i, "t", tuple(segs)))
    return Batch(step, samples)


LAYOUTS = [
    dict(world_size=4),
    dict(world_size=4, tp=2),
    dict(world_size=4, pp=2),
    dict(world_size=4, cp=2),
    dict(world_size=8, tp=2, pp=2),
    dict(world_size=8, pp=2, cp=2),
    dict(world_size=6, encoder_tp=2),
]


def _plan(system: str, **kw) -> Plan:
    return get_planner(system).plan(MODEL, ParallelSpec(**kw), mixed_batch())


def test_all_four_baselines_are_registered():
    assert set(BASELINES) <= set(available_systems())


@pytest.mark.parametrize("system", BASELINES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_plan_is_valid_and_its_messages_line_up(system, layout):
    if system == "temporal" and layout.get("pp", 1) > 1:
        pytest.skip("temporal has no pipeline (refusal tested below)")
    if system in ("homogeneous", "temporal") and layout.get("encoder_tp"):
        layout = {**layout, "encoder_tp": 0}
    if system == "noncolocated" and layout["world_size"] == 4 and layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) > 1:
        layout = {**layout, "encoder_ranks": 2}
    plan = _plan(system, **layout)
    plan.validate()
    check_p2p_order(plan)
    # Every rank of the world does something, and the step ends with an optimizer step everywhere.
    assert sorted(plan.actions) == list(range(plan.world_size))
    assert all(acts[-1].kind == "optimizer_step" for acts in plan.actions.values())
    # Every encoder sample is routed to every consuming LLM rank, and a primary route exists.
    for module in MODEL.encoders:
        users = {s.sample_id for s in plan.samples if s.encoder_seq_lens(module)}
        assert {r.sample_id for r in plan.routes if r.module == module} == users
    assert Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()


def _split(system: str, batch, balancer: str) -> list[list[int]]:
    plan = get_planner(system).plan(MODEL, ParallelSpec(world_size=4, options={"balancer": balancer}), batch)
    return sorted(sorted(i for mb in mbs for i in mb) for mbs in plan.assignment["llm"].values())


def test_systems_split_the_global_batch_identically_across_llm_data_ranks():
    """By tokens (the baselines as deployed) every system splits alike; by the analytic cost (every
    system's default) the systems whose encoders run on the LLM's data ranks weigh that work too."""
    batch = mixed_batch()
    by_tokens = [_split(s, batch, "tokens") for s in ("homogeneous", "temporal", "colocated")]
    assert by_tokens[0] == by_tokens[1] == by_tokens[2]
    tokens = [sum(s.llm_tokens for s in batch.samples if s.sample_id in ids) for ids in by_tokens[0]]
    assert max(tokens) - min(tokens) <= max(s.llm_tokens for s in batch.samples)
    assert _split("homogeneous", batch, "analytic") == _split("temporal", batch, "analytic")


def test_the_analytic_balancer_evens_out_each_data_ranks_llm_and_encoder_flops():
    from omnibench.specs.cost_model import CostModel

    batch = mixed_batch()
    cm = CostModel.analytic(MODEL)
    by_id = {s.sample_id: s for s in batch.samples}

    def spread(groups: list[list[int]]) -> float:
        loads = [sum(cm.llm(by_id[i]) + cm.encoders(by_id[i]) for i in g) for g in groups]
        return max(loads) - min(loads)

    assert spread(_split("temporal", batch, "analytic")) <= spread(_split("temporal", batch, "tokens"))
    assert spread(_split("temporal", batch, "analytic")) <= max(cm.llm(s) + cm.encoders(s) for s in batch.samples)


def test_an_unknown_balancer_is_refused_and_omni_refuses_tokens():
    from omnibench.plan import PlanError

    with pytest.raises(PlanError, match="balancer must be one of tokens, analytic, simulator"):
        _split("temporal", mixed_batch(), "flops")
    with pytest.raises(PlanError, match="omni plans with per-sample costs"):
        _split("omni", mixed_batch(), "tokens")


def test_homogeneous_runs_encoders_only_on_stage0_before_each_llm_microbatch():
    plan = _plan("homogeneous", world_size=4, pp=2)
    llm = plan.layouts["llm"]
    assert set(plan.layouts["vision"].ranks) == {r for r in llm.ranks if stage_of(llm, r) == 0}
    for r, acts in plan.actions.items():
        kinds = [(a.kind, a.module, a.microbatch) for a in acts if a.kind in (FORWARD, BACKWARD)]
        if stage_of(llm, r) == 1:
            assert all(m == "llm" for _, m, _ in kinds)
            continue
        for j in range(plan.options["microbatches"]):
            assert kinds.index((FORWARD, "vision", j)) < kinds.index((FORWARD, "llm", j))
            assert kinds.index((BACKWARD, "llm", j)) < kinds.index((BACKWARD, "vision", j))


def test_temporal_runs_one_module_at_a_time_per_microbatch_on_every_rank():
    plan = _plan("temporal", world_size=4, microbatches=2)
    for acts in plan.actions.values():
        order = [(a.kind, a.module) for a in acts if a.kind in (FORWARD, BACKWARD)]
        per_mb = [("forward", "vision"), ("forward", "audio"), ("forward", "llm"), ("backward", "llm"),
                  ("backward", "audio"), ("backward", "vision")]
        assert order == per_mb * 2
    assert plan.layouts["vision"].ranks == tuple(range(4)) and plan.layouts["vision"].tp == 1


def test_temporal_refuses_pipeline_parallelism():
    with pytest.raises(PlanError, match="pp"):
        _plan("temporal", world_size=4, pp=2)


def test_colocated_encodes_the_whole_batch_before_the_llm_and_backprops_after():
    plan = _plan("colocated", world_size=4, pp=2, encoder_tp=2)
    assert plan.layouts["vision"].tp == 2 and plan.layouts["vision"].dp == 2
    for acts in plan.actions.values():
        comp = [(a.kind, a.module) for a in acts if a.kind in (FORWARD, BACKWARD)]
        enc_fwd = [i for i, c in enumerate(comp) if c[0] == FORWARD and c[1] != "llm"]
        enc_bwd = [i for i, c in enumerate(comp) if c[0] == BACKWARD and c[1] != "llm"]
        llm = [i for i, c in enumerate(comp) if c[1] == "llm"]
        assert max(enc_fwd) < min(llm) and max(llm) < min(enc_bwd)


def test_noncolocated_encoder_and_llm_ranks_are_disjoint_and_overlap_as_a_pipeline():
    plan = _plan("noncolocated", world_size=4, encoder_ranks=2, pp=2)
    enc, llm = set(plan.layouts["vision"].ranks), set(plan.layouts["llm"].ranks)
    assert enc == {0, 1} and llm == {2, 3}
    acts = [(a.kind, a.microbatch) for a in plan.actions[0] if a.kind in (FORWARD, BACKWARD) and a.module == "vision"]
    # Warm-up: the encoder runs ahead of the LLM by pp microbatches, then alternates (1F1B).
    assert [("F" if k == FORWARD else "B", j) for k, j in acts] == one_f_one_b(0, 3, plan.options["microbatches"])
    assert all(a.peer in llm for a in plan.actions[0] if a.kind == BOUNDARY)


def test_noncolocated_default_split_leaves_both_sides_ranks():
    for world in (2, 4, 8, 64):
        n = split_ranks(MODEL, ParallelSpec(world_size=world))
        assert 1 <= n < world


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(world_size=4, tp=3), "tp"),
        (dict(world_size=4, dp=3), "dp"),
        (dict(world_size=4, pp=8), "pp"),
        (dict(world_size=4, ep=2), "ep"),
        (dict(world_size=6, tp=4), "tp"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_field(kw, field):
    for system in ("homogeneous", "colocated"):
        with pytest.raises((PlanError, SpecError), match=field):
            _plan(system, **kw)


def test_noncolocated_refuses_a_split_that_leaves_a_side_without_ranks():
    with pytest.raises(PlanError, match="encoder_ranks"):
        _plan("noncolocated", world_size=4, encoder_ranks=4)
    with pytest.raises(PlanError, match="encoder_ranks"):
        _plan("noncolocated", world_size=4, encoder_ranks=1, tp=2)


def test_too_few_samples_for_the_pipeline_is_refused_naming_microbatches():
    batch = Batch(0, mixed_batch(1).samples)
    with pytest.raises(PlanError, match="microbatches"):
        get_planner("homogeneous").plan(MODEL, ParallelSpec(world_size=2, pp=2, microbatches=4), batch)


def test_llm_assignment_is_keyed_by_data_ranks_only():
    plan = _plan("homogeneous", world_size=8, tp=2, pp=2)
    llm = plan.layouts["llm"]
    assert sorted(plan.assignment["llm"]) == sorted({data_rank(llm, r) for r in llm.ranks})


def test_plans_are_deterministic():
    a = _plan("noncolocated", world_size=8, pp=2).to_json()
    b = _plan("noncolocated", world_size=8, pp=2).to_json()
    assert a == b


@pytest.mark.parametrize("system", BASELINES)
def test_a_batch_planned_again_or_a_new_batch_with_the_same_ids_plans_from_its_own_samples(system):
    # the per-sample tokens and encoder costs are kept per batch object for the batch's later plans
    from systems.common import encoder_costs_of, llm_tokens_of

    batch = mixed_batch(seed=1)
    parallel = ParallelSpec(world_size=4)
    first = get_planner(system).plan(MODEL, parallel, batch)
    again = get_planner(system).plan(MODEL, parallel, batch)
    assert (first.assignment, first.actions) == (again.assignment, again.actions)
    other = mixed_batch(seed=2)  # the same sample ids, other lengths
    assert [s.sample_id for s in other.samples] == [s.sample_id for s in batch.samples]
    assert llm_tokens_of(other) == {s.sample_id: s.llm_tokens for s in other.samples} != llm_tokens_of(batch)
    assert set(encoder_costs_of(other, "vision")) == {s.sample_id for s in other.samples if s.encoder_seq_lens("vision")}
    fresh = get_planner(system).plan(MODEL, parallel, Batch(0, list(other.samples)))
    assert get_planner(system).plan(MODEL, parallel, other).assignment == fresh.assignment
    # the LLM's split is kept per (batch, dp, microbatches, pp) too, and the stage-0 encoders' split of
    # it (homogeneous, temporal): a plan's lists are its own
    expected = copy.deepcopy(again.assignment)
    for lists in first.assignment.values():
        lists[next(iter(lists))].append((999,))
    assert again.assignment == expected and get_planner(system).plan(MODEL, parallel, batch).assignment == expected

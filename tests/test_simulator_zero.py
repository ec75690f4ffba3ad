"""ZeRO-1/2 time in the simulator (Layout.zero without FSDP): gradients reduce-scattered instead of
all-reduced, the optimizer stepping the rank's 1/dp shard, and an all-gather of the updated bf16
parameters after the step, for LLM and encoder layouts alike."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from omnibench.plan import GRAD_SYNC, OPTIMIZER_STEP
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions, simulate
from simulator.hardware import load_cluster
from simulator.program import PARAM_GATHER
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(120)

GPUS = 16  # two nodes: the data-parallel group crosses the network


def text_batch(n: int, tokens: int = 2048) -> Batch:
    return Batch(0, [Sample(i, "text", (Segment("text", tokens),)) for i in range(n)])


def mixed_batch(n: int, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t, h, w = rng.choice([(1, 32, 44), (1, 16, 16)])
        segs = (Segment("text", rng.randint(200, 800)),
                Segment("image", t * h * w // 4, t * h * w, grid_thw=(t, h, w)),
                Segment("audio", 250, 500, mel_frames=1000))
        out.append(Sample(i, "mix", segs))
    return Batch(0, out)


def llm_plan(mode: str, tp: int = 2):
    model = get_model("llm-7b@4L")
    parallel = ParallelSpec(world_size=GPUS, tp=tp, microbatches=2, **dp_mode_fields(mode))
    return model, get_planner("homogeneous").plan(model, parallel, text_batch(16))


def spans_of(res, kind: str, module: str = "llm") -> list:
    return [s for s in res.spans if s.kind == kind and s.module == module]


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_zero_reduce_scatters_gradients_where_ddp_all_reduces(mode):
    model, plan = llm_plan(mode)
    cluster = load_cluster("h100", GPUS)
    eng = Engine(plan, model, cluster)
    group = eng._grad_group("llm", 0)
    w = eng.stage_work("llm", 0)
    grads = 4.0 * w.params / 2  # fp32 gradients of the rank's tp shard
    res = eng.run()
    sync = spans_of(res, GRAD_SYNC)
    assert sync and all(s.action.what == "" for s in sync)
    assert sync[0].duration == pytest.approx(eng.coll.cost("reduce_scatter", grads, group))
    ddp_model, ddp_plan = llm_plan("ddp")
    ddp = Engine(ddp_plan, ddp_model, cluster)
    ddp_res = ddp.run()
    assert spans_of(ddp_res, GRAD_SYNC)[0].duration == pytest.approx(ddp.coll.cost("all_reduce", grads, group))
    assert not spans_of(ddp_res, PARAM_GATHER)


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_zero_all_gathers_the_updated_bf16_parameters_after_the_step(mode):
    model, plan = llm_plan(mode)
    eng = Engine(plan, model, load_cluster("h100", GPUS))
    group = eng._grad_group("llm", 0)
    w = eng.stage_work("llm", 0)
    res = eng.run()
    gathers = spans_of(res, PARAM_GATHER)
    assert gathers, "no parameter all-gather after the optimizer step"
    g = gathers[0]
    assert g.stream == "collective"
    assert g.duration == pytest.approx(eng.coll.cost("all_gather", 2.0 * w.params / 2, group))
    step = next(s for s in res.spans if s.kind == OPTIMIZER_STEP and s.rank == g.rank)
    assert g.start >= step.start + step.duration - 1e-12
    # the next step's forward needs the weights: the step ends after the gather
    assert res.step_time >= g.start + g.duration - 1e-12


def test_zero_optimizer_steps_one_data_parallel_shard():
    cluster = load_cluster("h100", GPUS)
    opt = {}
    for mode in ("ddp", "zero1", "zero2"):
        model, plan = llm_plan(mode)
        res = simulate(plan, model, cluster)
        opt[mode] = max(s.duration for s in res.spans if s.kind == OPTIMIZER_STEP)
    dp = GPUS // 2
    assert opt["zero1"] == pytest.approx(opt["ddp"] / dp, rel=1e-6)
    assert opt["zero2"] == pytest.approx(opt["zero1"])


def test_zero1_and_zero2_take_the_same_time():
    cluster = load_cluster("h100", GPUS)
    times = [simulate(plan, model, cluster).step_time for model, plan in (llm_plan("zero1"), llm_plan("zero2"))]
    assert times[0] == pytest.approx(times[1])


def test_zero_without_communication_is_faster_than_ddp_by_the_sharded_step():
    cluster = load_cluster("h100", GPUS)
    free = SimOptions(communication=False)
    ddp = simulate(*llm_plan("ddp")[::-1], cluster, options=free)
    zero = simulate(*llm_plan("zero1")[::-1], cluster, options=free)
    assert zero.step_time < ddp.step_time
    assert not spans_of(zero, PARAM_GATHER)


def test_encoder_layouts_at_zero_gather_their_own_parameters():
    """omni puts its encoders at fsdp=False, zero=1|2: each encoder reduce-scatters its gradients and
    all-gathers its updated weights over its own data ranks."""
    model = get_model("omni-7b@4L")
    parallel = ParallelSpec(world_size=GPUS, tp=2, microbatches=2, **dp_mode_fields("zero2"))
    plan = get_planner("colocated").plan(model, parallel, mixed_batch(32))
    for m in ("vision", "audio"):
        assert plan.layouts[m].zero == 2 and not plan.layouts[m].fsdp
    eng = Engine(plan, model, load_cluster("h100", GPUS))
    res = eng.run()
    for m in ("llm", "vision", "audio"):
        gathers = spans_of(res, PARAM_GATHER, m)
        assert gathers, m
        rank = gathers[0].rank
        lay = plan.layouts[m]
        group = eng._grad_group(m, rank)
        w = eng.stage_work(m, 0)
        assert gathers[0].duration == pytest.approx(eng.coll.cost("all_gather", 2.0 * w.params / lay.tp, group))
        sync = next(s for s in spans_of(res, GRAD_SYNC, m) if s.rank == rank)
        assert sync.duration == pytest.approx(eng.coll.cost("reduce_scatter", 4.0 * w.params / lay.tp, group))


def test_encoder_zero_shards_the_optimizer_step_as_the_llm_does():
    model = get_model("omni-7b@4L")
    cluster = load_cluster("h100", GPUS)
    batch = mixed_batch(32)
    parallel = ParallelSpec(world_size=GPUS, tp=2, microbatches=2, **dp_mode_fields("zero1"))
    plan = get_planner("colocated").plan(model, parallel, batch)
    ddp = replace(plan, layouts={m: replace(lay, zero=0) for m, lay in plan.layouts.items()})
    # the vision encoder alone at ZeRO-1, the rest DDP: only its share of the step shrinks
    vision = replace(ddp, layouts={**ddp.layouts, "vision": plan.layouts["vision"]})
    eng, eng_ddp, eng_vision = (Engine(p, model, cluster) for p in (plan, ddp, vision))
    expected = sum(eng._module_params_on_rank(m, 0) / len(eng._grad_group(m, 0)) for m in plan.layouts)
    assert eng._stepped_params_on_rank(0) == pytest.approx(expected)
    assert eng._stepped_params_on_rank(0) < eng_vision._stepped_params_on_rank(0) < eng_ddp._stepped_params_on_rank(0)
    saved = eng_ddp._stepped_params_on_rank(0) - eng_vision._stepped_params_on_rank(0)
    held = eng._module_params_on_rank("vision", 0)
    assert saved == pytest.approx(held * (1 - 1 / len(eng._grad_group("vision", 0))))

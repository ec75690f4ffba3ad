"""The simulator at scale: its fast run loop gives today's results, on every system and layout kind.

`Engine` plays a step on one heap of time-ordered wake-ups and works collective and message times
out as soon as they are known; `SimpyEngine` (simulator/engine_simpy.py) is the simpy loop it
replaced, kept as the reference. On small clusters the two must agree: step time within 0.5% (they
agree to the last bit), the same peak memory, the same per-rank statistics and the same spans.
"""

from __future__ import annotations

import math

import pytest

from omnibench.plan import FORWARD, RECV, SEND, Action, Layout, Plan
from omnibench.specs.model import LLMSpec, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions, SimulationError
from simulator.engine_simpy import SimpyEngine
from simulator.hardware import load_cluster
from systems import get_planner
from systems.defaults import with_default_layout
from workloads.sample import Batch, Sample, Segment
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni", "spatial")

# (system, model, workload, hardware, GPUs, layout or "default", recompute, options, tokens per GPU)
CASES = [
    *[(s, "omni-7b", "mixed_video", "h100", 32, "default", "full", {}, 4096) for s in SYSTEMS],
    # pipelines: sends wait for their recv to be posted (1F1B, interleaved), encoders in the bubbles
    ("homogeneous", "omni-7b", "mixed_video", "h100", 32, dict(tp=2, pp=4, virtual_stages=2, microbatches=8),
     "full", {}, 16384),
    ("omni", "omni-7b", "mixed_video", "h100", 32, dict(tp=2, pp=2, microbatches=4), "full", {}, 16384),
    ("noncolocated", "omni-7b", "mixed_video", "h100", 32, dict(tp=2, pp=2, microbatches=4), "full", {}, 16384),
    # one CPU thread per rank: blocking collectives, FSDP calls in line
    ("homogeneous", "omni-7b", "mixed_video", "cpu-gloo", 8, dict(tp=2, pp=2, microbatches=4), "none", {}, 16384),
    ("omni", "omni-7b", "bursty_mix", "cpu-gloo", 8, dict(tp=1), "none", {}, 4096),
    # spatial's concurrency groups: two lanes as one locked op
    ("spatial", "omni-7b", "omni_av", "cpu-gloo", 8, dict(cp=2, microbatches=3), "none", {}, 4096),
    # MoE expert groups, HSDP, ring context parallelism, ZeRO with encoder chunks, free communication
    ("colocated", "omni-moe-30b", "mixed_video", "h100", 32, dict(tp=2, ep=4, microbatches=2), "selective", {}, 4096),
    ("omni", "omni-7b", "mixed_video", "h100", 128, dict(tp=2, dp_shard=8, microbatches=2), "full", {}, 4096),
    ("homogeneous", "omni-7b", "long_video", "h100", 32, dict(cp=4, cp_kind="ring", microbatches=2), "full", {},
     65536),
    ("temporal", "omni-7b", "omni_av", "a100-80g", 16, dict(fsdp=False, zero=1), "full",
     {"encoder_chunk_tokens": 4096}, 4096),
    ("omni", "omni-7b", "mixed_video", "h100", 32, dict(tp=2, pp=2, microbatches=4), "full",
     {"communication": False}, 16384),
]


def _plan(system, model, workload, hardware, gpus, layout, tokens):
    batch = WorkloadStream(workload, seed=3, global_batch_tokens=tokens * gpus).batch(0)
    if layout == "default":
        parallel, _ = with_default_layout(system, model, ParallelSpec(world_size=gpus), batch)
    else:
        parallel = ParallelSpec(world_size=gpus, **layout)
    return get_planner(system).plan(model, parallel, batch)


def _case(case):
    """(model, cluster, plan, options) of a CASES entry."""
    system, model_name, workload, hardware, gpus, layout, recompute, options, tokens = case
    model = get_model(model_name)
    return (model, load_cluster(hardware, gpus), _plan(system, model, workload, hardware, gpus, layout, tokens),
            SimOptions(recompute=recompute, **options))


def _case_id(c) -> str:
    return f"{c[0]}-{c[2]}-{c[3]}-{c[4]}-{c[5]}-{c[7]}"


def _spans(result):
    return sorted((s.rank, s.stream, str(s.action), s.kind, s.start, s.duration) for s in result.spans)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fast_loop_gives_the_simpy_loops_step(case):
    model, cluster, plan, opts = _case(case)
    fast = Engine(plan, model, cluster, options=opts).run()
    ref = SimpyEngine(plan, model, cluster, options=opts).run()
    assert fast.step_time == pytest.approx(ref.step_time, rel=0.005)
    assert fast.peak_memory == ref.peak_memory
    assert fast.step_time == ref.step_time  # in fact to the last bit: same arithmetic in the same order
    assert [vars(r) for r in fast.ranks] == [vars(r) for r in ref.ranks]
    assert _spans(fast) == _spans(ref)
    assert fast.metrics() | {"sim_seconds": 0} == ref.metrics() | {"sim_seconds": 0}


FLAT = MultimodalSpec("flat", LLMSpec("flat", layers=8, hidden=4096, heads=32, kv_heads=8, ffn=16384, vocab=8))


def _two_stage_plan(actions: dict[int, list[Action]]) -> Plan:
    batch = Batch(0, [Sample(i, "text", (Segment("text", 1024),)) for i in range(2)])
    return Plan("hand", 0, 2, "flat", batch.samples, {"llm": Layout("llm", (0, 1), pp=2, fsdp=False)},
                {"llm": {0: [(0,), (1,)]}}, [], actions)


def test_a_send_issued_before_its_recv_is_posted_starts_when_it_is_in_both_loops():
    # stage 1 posts its second recv only after its first forward: stage 0's second send, issued
    # earlier, waits for that (NCCL p2p matching) in both loops
    plan = _two_stage_plan({
        0: [Action(FORWARD, "llm", 0, 0), Action(SEND, "llm", 0, 0, "act", 1),
            Action(FORWARD, "llm", 1, 0), Action(SEND, "llm", 1, 0, "act", 1)],
        1: [Action(RECV, "llm", 0, 1, "act", 0), Action(FORWARD, "llm", 0, 1),
            Action(RECV, "llm", 1, 1, "act", 0), Action(FORWARD, "llm", 1, 1)],
    })
    cluster = load_cluster("h100", 8)
    fast, ref = Engine(plan, FLAT, cluster).run(), SimpyEngine(plan, FLAT, cluster).run()
    first_forward_on_1 = next(s for s in fast.spans if s.rank == 1 and s.stream == "compute")
    second_send = [s for s in fast.spans if s.rank == 0 and s.kind == SEND][1]
    assert second_send.start == first_forward_on_1.start + first_forward_on_1.duration
    assert fast.step_time > 0 and fast.step_time == ref.step_time
    assert _spans(fast) == _spans(ref)


def test_a_deadlocked_plan_is_reported_by_the_fast_loop_as_by_the_reference():
    plan = _two_stage_plan({
        0: [Action(RECV, "llm", 0, 0, "grad", 1), Action(SEND, "llm", 0, 0, "act", 1)],
        1: [Action(RECV, "llm", 0, 1, "act", 0), Action(SEND, "llm", 0, 1, "grad", 0)],
    })
    cluster = load_cluster("h100", 8)
    messages = []
    for engine in (Engine, SimpyEngine):
        with pytest.raises(SimulationError, match="simulated deadlock") as err:
            engine(plan, FLAT, cluster).run()
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_fast_loop_step_is_finite_and_positive_at_a_thousand_gpus():
    model = get_model("omni-7b")
    plan = _plan("omni", model, "mixed_video", "h100", 1024, "default", 4096)
    res = Engine(plan, model, load_cluster("h100", 1024), options=SimOptions(recompute="full")).run()
    assert 1 < res.classes <= 1024 and math.isfinite(res.step_time) and res.step_time > 0


@pytest.mark.parametrize("shape", [dict(dp=4, tp=2, pp=3, cp=2), dict(dp=3, tp=1, pp=2, cp=4), dict(dp=1, tp=4)])
def test_layout_groups_are_the_ranks_sharing_every_other_coordinate(shape):
    # Layout.groups / fsdp_groups are built by index arithmetic (planning at scale); they must list
    # exactly the ranks agreeing on every other mesh coordinate, in mesh order
    size = math.prod(shape.values())
    lay = Layout("llm", tuple(range(100, 100 + 3 * size, 3)), **shape)  # ranks need not be 0..n-1
    coords = {r: lay.coords(r) for r in lay.ranks}

    def by_definition(free: tuple[str, ...]) -> list[tuple[int, ...]]:
        out: dict[tuple, list[int]] = {}
        for r in lay.ranks:  # mesh order
            out.setdefault(tuple(coords[r][d] for d in lay.mesh_dims if d not in free), []).append(r)
        return [tuple(g) for g in out.values()]

    for dim in lay.mesh_dims:
        assert lay.groups(dim) == by_definition((dim,))
        assert all(lay.group(r, dim) in lay.groups(dim) and r in lay.group(r, dim) for r in lay.ranks)
    assert lay.fsdp_groups() == by_definition(lay.fsdp_dims)
    assert all(lay.coord(r, d) == coords[r][d] for r in lay.ranks for d in lay.mesh_dims)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 2, 4, 6, 9, 11, 12)], ids=_case_id)
def test_memory_checked_before_the_play_is_the_steps_and_the_play_after_it_is_a_fresh_engines(case):
    # omnibench/resolve.py checks a layout's memory with Engine.peak_needed (programs, no play) and hands
    # that engine to the step's simulation (offer_engine): the same figures as one engine run once
    model, cluster, plan, opts = _case(case)
    fresh = Engine(plan, model, cluster, options=opts).run()
    top = max(fresh.ranks, key=lambda r: r.memory_needed)
    checked = Engine(plan, model, cluster, options=opts)
    assert checked.peak_needed() == (top.memory_needed, top.rank)
    again = checked.run()
    assert again.step_time == fresh.step_time
    assert [vars(r) for r in again.ranks] == [vars(r) for r in fresh.ranks]
    assert _spans(again) == _spans(fresh)
    assert again.metrics() | {"sim_seconds": 0} == fresh.metrics() | {"sim_seconds": 0}
    # asked only whether it fits under less than its peak: it stops at the first class over it
    lower = Engine(plan, model, cluster, options=opts)
    need, rank = lower.peak_needed(over=top.memory_needed * 0.999)
    assert need > top.memory_needed * 0.999
    first_over = next(r for r in fresh.ranks if r.memory_needed > top.memory_needed * 0.999)
    assert (need, rank) == (first_over.memory_needed, first_over.rank)
    assert len(lower._memory_stats) == [r.rank for r in fresh.ranks].index(rank) + 1
    late = lower.run()  # the rest built when it is played after all
    assert late.step_time == fresh.step_time
    assert [vars(r) for r in late.ranks] == [vars(r) for r in fresh.ranks]
    assert _spans(late) == _spans(fresh)


def test_simulate_plays_an_offered_engine_only_for_its_own_plan_and_costs():
    from dataclasses import replace

    from simulator.engine import _spare_engine, offer_engine, simulate

    model, cluster = get_model("omni-7b"), load_cluster("h100", 32)
    plan = _plan("omni", model, "mixed_video", "h100", 32, "default", 4096)
    opts = SimOptions(recompute="full")
    fresh = Engine(plan, model, cluster, options=opts).run()
    other = _plan("omni", model, "mixed_video", "h100", 32, "default", 4096)  # equal, but not the same object

    def offered(check_opts):
        e = Engine(plan, model, cluster, options=check_opts)
        e.peak_needed()
        offer_engine(e)
        return e

    for target, sim_opts, taken in ((plan, replace(opts, memory_error=0.2), True), (other, opts, False),
                                    (plan, replace(opts, stack="fused"), False)):
        e = offered(replace(opts, check_memory=False))
        got = simulate(target, model, cluster, options=sim_opts)
        assert not _spare_engine  # taken or dropped
        assert (e._reps is not None and not e._memory_stats) is taken  # played: its memory figures used
        if sim_opts.stack == "eager":
            assert got.step_time == fresh.step_time and [vars(r) for r in got.ranks] == [vars(r) for r in fresh.ranks]
        if taken:
            assert got.fits == (max(r.memory_needed for r in got.ranks) * 1.2 <= cluster.gpu.memory_bytes)
            assert got.sim_seconds >= e._built_s > 0

    # an equal plan on another machine, or beside another model, is never the offered engine's
    renamed = replace(model, name=model.name + "-renamed")
    for target_model, target_cluster in ((model, load_cluster("h200", 32)), (renamed, cluster)):
        e = offered(replace(opts, check_memory=False))
        simulate(plan, target_model, target_cluster, options=opts)
        assert not _spare_engine and e._memory_stats  # dropped, not played

    class Datasheet:  # a calibration whose models are the default ones: still never the offered engine's
        def compute_model(self, c):
            from simulator.compute import ComputeModel
            return ComputeModel(c)

        def collective_model(self, c):
            from simulator.collectives import CollectiveModel
            return CollectiveModel(c)

    e = offered(replace(opts, check_memory=False))
    got = simulate(plan, model, cluster, calibration=Datasheet(), options=opts)
    assert not _spare_engine and e._memory_stats  # dropped, not played
    assert got.step_time == fresh.step_time

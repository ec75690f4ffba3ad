"""The simpy engine: collapsing, synchronisation, overlap and the sanity laws of a step simulator."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from omnibench.plan import BACKWARD, FORWARD, GRAD_SYNC, OPTIMIZER_STEP, RECV, SEND, Action, Layout, Plan
from omnibench.specs.model import LLMSpec, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions, SimulationError, simulate
from simulator.hardware import load_cluster
from simulator.traces import perfetto_events
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(120)

# Uniform stages: 8 layers over 2 or 4 stages, a vocabulary so small the head is noise.
FLAT = MultimodalSpec("flat", LLMSpec("flat", layers=8, hidden=4096, heads=32, kv_heads=8, ffn=16384, vocab=8))


def text_batch(n: int, tokens=lambda i: 1024, step: int = 0) -> Batch:
    return Batch(step, [Sample(i, "text", (Segment("text", tokens(i)),)) for i in range(n)])


def mixed_batch(n: int, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segs = [Segment("text", rng.randint(100, 900))]
        if rng.random() < 0.6:
            t, h, w = rng.choice([(1, 32, 44), (4, 20, 36), (1, 16, 16)])
            segs.append(Segment("image" if t == 1 else "video", t * h * w // 4, t * h * w, grid_thw=(t, h, w)))
        if rng.random() < 0.3:
            mel = rng.randint(500, 3000)
            segs.append(Segment("audio", mel // 4, mel // 2, mel_frames=mel))
        out.append(Sample(i, "mix", tuple(segs)))
    return Batch(0, out)


def one_f_one_b(stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    warm = min(stages - stage - 1, m)
    order = [("F", j) for j in range(warm)]
    f = warm
    b = 0
    while f < m:
        order += [("F", f), ("B", b)]
        f += 1
        b += 1
    return order + [("B", j) for j in range(b, m)]


def pipeline_plan(p: int, m: int, tokens: int = 8192, tail: bool = False) -> Plan:
    """One rank per stage, m identical microbatches, 1F1B, written by hand (no planner)."""
    batch = text_batch(m, lambda i: tokens)
    actions = {}
    for s in range(p):
        acts = []
        for kind, j in one_f_one_b(s, p, m):
            if kind == "F":
                if s:
                    acts.append(Action(RECV, "llm", j, s, "act", s - 1))
                acts.append(Action(FORWARD, "llm", j, s))
                if s < p - 1:
                    acts.append(Action(SEND, "llm", j, s, "act", s + 1))
            else:
                if s < p - 1:
                    acts.append(Action(RECV, "llm", j, s, "grad", s + 1))
                acts.append(Action(BACKWARD, "llm", j, s))
                if s:
                    acts.append(Action(SEND, "llm", j, s, "grad", s - 1))
        if tail:
            acts += [Action(GRAD_SYNC, "llm"), Action(OPTIMIZER_STEP, "all")]
        actions[s] = acts
    layout = Layout("llm", tuple(range(p)), pp=p, fsdp=False)
    return Plan("hand", 0, p, "flat", batch.samples, {"llm": layout},
                {"llm": {0: [(j,) for j in range(m)]}}, [], actions)


def test_simulator_imports_no_torch():
    code = (
        "import sys; import simulator, simulator.engine, simulator.calibrate, simulator.traces, "
        "simulator.collectives, simulator.compute, simulator.hardware; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_uniform_1f1b_bubble_matches_the_formula(p, m):
    # The datasheet roofline: the measured kernel profile's launch floors make the embedding and head
    # stages slightly unequal, and the formula is for equal stages.
    cluster = load_cluster("h100", p).with_kernels("")
    res = simulate(pipeline_plan(p, m), FLAT, cluster, options=SimOptions(communication=False))
    expected = (p - 1) / (m + p - 1)
    # Stage 0 holds the embedding, the last stage the (tiny) head: uniform to well under 1%.
    assert res.bubble == pytest.approx(expected, rel=0.01)


def test_free_communication_gives_the_compute_bound_schedule():
    p, m = 4, 8
    cluster = load_cluster("h100", p)
    # Megatron's fused stack: the eager one charges stage 0 a dense fp32 embedding gradient and the
    # last stage the chunked loss, and the formula is for equal stages.
    eng = Engine(pipeline_plan(p, m), FLAT, cluster, options=SimOptions(communication=False, stack="fused"))
    res = eng.run()
    w = eng.work("llm", 1, (8192,))
    tf = eng.compute.action_time(w, "forward")
    tb = eng.compute.action_time(w, "backward")
    assert res.step_time == pytest.approx((m + p - 1) * (tf + tb), rel=0.01)
    assert res.exposed_comm == 0.0


def test_busy_time_per_rank_equals_the_sum_of_its_action_costs():
    plan = get_planner("homogeneous").plan(get_model("omni-7b"), ParallelSpec(world_size=32, tp=2, pp=2,
                                                                                 microbatches=4, fsdp=False),
                                           mixed_batch(64))
    cluster = load_cluster("h100", 32)
    eng = Engine(plan, get_model("omni-7b"), cluster)
    res = eng.run()
    cls = eng.classes()
    for st in res.ranks:
        ops = eng.program(st.rank, cls)
        assert st.compute == pytest.approx(sum(o.duration for o in ops if o.kind in (FORWARD, BACKWARD)))
        spans = [s for s in res.spans if s.rank == st.rank and s.stream == "compute"]
        assert sum(s.duration for s in spans) == pytest.approx(st.compute + st.exposed_comm + st.optimizer
                                                               - _opt_wait(res, st), rel=1e-9)
        assert st.finish <= res.step_time + 1e-12


def _opt_wait(res, st):
    # exposed_comm also holds the wait for outstanding grad syncs before the optimizer step (not a span)
    spans = [s for s in res.spans if s.rank == st.rank and s.stream == "compute"]
    inline = sum(s.duration for s in spans if s.kind in (FORWARD, BACKWARD)) - st.compute
    return st.exposed_comm - inline


def test_more_bandwidth_never_makes_a_step_slower():
    model = get_model("omni-7b")
    plan = get_planner("homogeneous").plan(model, ParallelSpec(world_size=64, tp=4, pp=4, microbatches=8),
                                           mixed_batch(256))
    base = load_cluster("h100", 64)
    times = []
    for k in (0.5, 1.0, 2.0, 4.0):
        c = replace(base, intra=replace(base.intra, bandwidth_gbs=450 * k),
                    inter=replace(base.inter, bandwidth_gbs=50 * k))
        times.append(simulate(plan, model, c).step_time)
    assert times == sorted(times, reverse=True)
    free = simulate(plan, model, base, options=SimOptions(communication=False)).step_time
    assert free <= times[-1]


def test_bigger_global_batch_never_lowers_tokens_per_second():
    model = get_model("omni-7b")
    cluster = load_cluster("h100", 32)
    planner = get_planner("homogeneous")
    rates = []
    for n in (64, 128, 256):
        plan = planner.plan(model, ParallelSpec(world_size=32, tp=2, pp=2, microbatches=4), mixed_batch(n))
        rates.append(simulate(plan, model, cluster).tokens_per_s)
    assert rates == sorted(rates)


def test_tp_peers_and_identical_replicas_collapse_but_different_data_stays_distinct():
    model = get_model("omni-7b")
    parallel = ParallelSpec(world_size=64, tp=4, pp=2, microbatches=4)
    same = get_planner("homogeneous").plan(model, parallel, text_batch(64))
    res = simulate(same, model, load_cluster("h100", 64))
    assert res.classes == 2  # one per pipeline stage: tp peers and the 8 dp replicas got the same shapes
    assert sum(r.members for r in res.ranks) == 64
    varied = get_planner("homogeneous").plan(model, parallel, mixed_batch(64))
    res2 = simulate(varied, model, load_cluster("h100", 64))
    assert res2.classes == 16  # 8 dp replicas x 2 stages, tp peers still collapsed


def test_data_parallel_imbalance_shows_as_a_straggler():
    model = get_model("qwen2-vl-7b")
    parallel = ParallelSpec(world_size=16, tp=4, microbatches=1)
    cluster = load_cluster("h100", 16)
    even = simulate(get_planner("homogeneous").plan(model, parallel, text_batch(4, lambda i: 4096)), model, cluster)
    skew = simulate(get_planner("homogeneous").plan(model, parallel,
                                                    text_batch(4, lambda i: 13312 if i == 0 else 1024)),
                    model, cluster)
    assert skew.tokens == even.tokens
    assert skew.step_time > even.step_time  # the rank with the long sample sets the step


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_waiting_for_a_slower_peer_is_imbalance_not_exposed_communication(fsdp):
    # one data rank holds a long sample: its peers wait for it at the gradient reduction (DDP) or at every
    # layer's locked gather and reduce (FSDP). With communication free that wait is still there, so it is
    # imbalance, its own column, and exposed communication is only what transfers cost
    model = get_model("qwen2-vl-7b")
    parallel = ParallelSpec(world_size=16, tp=4, microbatches=1, fsdp=fsdp)
    cluster = load_cluster("h100", 16)
    plan = get_planner("homogeneous").plan(model, parallel, text_batch(4, lambda i: 13312 if i == 0 else 1024))
    res = simulate(plan, model, cluster)
    free = simulate(plan, model, cluster, options=SimOptions(communication=False))
    assert free.imbalance > 0.3  # the short ranks wait most of the step
    # exposed communication is at most what communication adds to the step
    assert res.exposed_comm * res.step_time <= (res.step_time - free.step_time) * 1.05 + 1e-6
    assert res.imbalance == pytest.approx(free.imbalance, rel=0.2)
    assert "imbalance" in res.breakdown() and "imbalance" in res.metrics()
    even = simulate(get_planner("homogeneous").plan(model, parallel, text_batch(4, lambda i: 4096)), model, cluster)
    assert even.imbalance < 0.01


def test_recv_waits_for_the_matching_send():
    p, m = 2, 1
    cluster = load_cluster("a100-80g", 16)
    res = simulate(pipeline_plan(p, m, tokens=8192), FLAT, cluster)
    spans = {(s.rank, s.kind, s.stream): s for s in res.spans}
    f0, f1 = spans[(0, FORWARD, "compute")], spans[(1, FORWARD, "compute")]
    send = spans[(0, SEND, "p2p")]
    assert send.start >= f0.start + f0.duration - 1e-12
    assert f1.start >= send.start + send.duration - 1e-12


def test_grad_sync_overlaps_later_compute_and_blocks_only_the_optimizer():
    p, m = 2, 4
    cluster = load_cluster("h100", 2)
    plan = pipeline_plan(p, m, tail=True)
    plan.layouts["llm"] = Layout("llm", (0, 1), pp=2, fsdp=False)
    res = simulate(plan, FLAT, cluster)
    assert res.step_time > 0 and all(r.optimizer > 0 for r in res.ranks)


def test_plan_that_cannot_fit_says_so_with_the_sizes():
    model = get_model("dense-72b")
    plan = get_planner("homogeneous").plan(model, ParallelSpec(world_size=8, tp=1, microbatches=1, fsdp=False),
                                           text_batch(8, lambda i: 4096))
    res = simulate(plan, model, load_cluster("h100", 8))
    assert not res.fits
    assert res.fit_message.startswith("does not fit: rank ") and "GiB of 79.2 GiB" in res.fit_message


def test_sharding_lowers_peak_memory():
    model = get_model("omni-7b")
    batch = mixed_batch(32)
    cluster = load_cluster("h100", 16)
    replicated = simulate(get_planner("homogeneous").plan(model, ParallelSpec(world_size=16, fsdp=False), batch),
                          model, cluster)
    sharded = simulate(get_planner("homogeneous").plan(model, ParallelSpec(world_size=16, fsdp=True), batch),
                       model, cluster)
    assert sharded.peak_memory < replicated.peak_memory


def test_mismatched_p2p_is_reported_as_a_deadlock_not_a_hang():
    plan = pipeline_plan(2, 2)
    plan.actions[0] = [a for a in plan.actions[0] if not (a.kind == SEND and a.microbatch == 1)]
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(plan, FLAT, load_cluster("h100", 2))


def test_every_registered_baseline_simulates():
    from systems import available_systems

    model = get_model("omni-7b")
    cluster = load_cluster("h100", 32)
    batch = mixed_batch(128)
    done = []
    for name in available_systems():
        parallel = ParallelSpec(world_size=32, tp=2, pp=2 if name not in ("temporal", "spatial") else 1, microbatches=4,
                                encoder_ranks=8 if name == "noncolocated" else 0)
        try:
            plan = get_planner(name).plan(model, parallel, batch)
        except ValueError as e:
            pytest.fail(f"{name}: {e}")
        res = simulate(plan, model, cluster)
        assert res.step_time > 0 and 0 < res.mfu < 1, name
        done.append(name)
    assert "homogeneous" in done


def test_perfetto_trace_has_one_track_per_simulated_rank(tmp_path):
    res = simulate(pipeline_plan(4, 4), FLAT, load_cluster("h100", 4))
    events = perfetto_events(res)["traceEvents"]
    procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0, 1, 2, 3}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["kind"] for e in spans} >= {FORWARD, BACKWARD, SEND}
    json.dumps(events)


def test_a_thousand_gpu_step_collapses_to_its_distinct_ranks():
    from workloads.stream import WorkloadStream

    model = get_model("omni-7b")
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=1024 * 2048).batch(0)
    plan = get_planner("homogeneous").plan(model, ParallelSpec(world_size=1024, tp=4, pp=4, microbatches=8), batch)
    res = simulate(plan, model, load_cluster("h100", 1024))
    # tp peers collapse; each (data-parallel replica, stage) has its own data: 64 x 4 classes
    assert res.classes == 64 * 4
    assert sum(r.members for r in res.ranks) == 1024
    by_module = res.compute_by_module()
    assert set(by_module) >= {"llm", "vision"} and all(v > 0 for v in by_module.values())


def test_omni_loader_exchanges_are_costed_collectives_overlapping_the_step():
    """omni's metadata all-gathers (reorder group, then the whole data-parallel group) run on every
    rank's collective stream, take time that grows with the group and the bytes, overlap compute
    (loaders prefetch the next step's) and finish before the optimizer step."""
    model = get_model("omni-7b")
    batch = mixed_batch(256)
    cluster = load_cluster("h100", 64)
    kw = {"world_size": 64, "tp": 2, "pp": 2, "microbatches": 4}
    on = get_planner("omni").plan(model, ParallelSpec(options={"reorder_group": 4}, **kw), batch)
    res = simulate(on, model, cluster)
    meta = [s for s in res.spans if s.kind == "metadata"]
    assert {s.action.what for s in meta} == {"reorder", "plan"} and all(s.stream == "collective" for s in meta)
    assert {s.rank for s in meta} == {r.rank for r in res.ranks}
    by_what = {w: max(s.duration for s in meta if s.action.what == w) for w in ("reorder", "plan")}
    assert 0 < by_what["reorder"] < by_what["plan"]  # 4 loaders' costs vs 16 loaders' headers
    for r in res.ranks:
        mine = [s for s in res.spans if s.rank == r.rank]
        first_compute = min(s.start for s in mine if s.stream == "compute")
        optimizer = min(s.start for s in mine if s.kind == OPTIMIZER_STEP)
        ends = [s.start + s.duration for s in meta if s.rank == r.rank]
        assert first_compute < max(ends) <= optimizer + 1e-12
    off = get_planner("omni").plan(model, ParallelSpec(options={"reorder": False}, **kw), batch)
    assert {s.action.what for s in simulate(off, model, cluster).spans if s.kind == "metadata"} == {"plan"}
    free = simulate(on, model, cluster, options=SimOptions(communication=False))
    assert all(s.duration == 0 for s in free.spans if s.kind == "metadata")


def test_ranks_of_different_loader_groups_never_share_a_class_whose_metadata_lock_cannot_fill():
    # omni at cp 4: the loaders' all-gathers run per (cp, tp, pp) coordinate. Before the loader groups
    # took part in the colour refinement, ranks of different such groups merged into one class and the
    # step deadlocked (mixed_video, 64 GPUs, 131,072 tokens; bursty_mix's video burst at 1,024).
    from omnibench.plan import METADATA
    from workloads.stream import WorkloadStream

    model = get_model("omni-7b")
    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=131072).batch(0)
    plan = get_planner("omni").plan(model, ParallelSpec(world_size=64, cp=4, microbatches=2, recompute="full",
                                                        options={"hardware": "h100"}), batch)
    engine = Engine(plan, model, load_cluster("h100", 64), options=SimOptions(recompute="full"))
    cls = engine.classes()
    for r, rep in cls.items():
        for a in plan.actions[r]:
            if a.kind == METADATA:  # a rank's class representative sits in a group of the same classes
                mine = {cls[x] for x in engine._loader_group(r, a.what)}
                assert mine == {cls[x] for x in engine._loader_group(rep, a.what)}
    res = simulate(plan, model, load_cluster("h100", 64), options=SimOptions(recompute="full"))
    assert res.step_time > 0


def test_a_batch_simulated_at_many_layouts_counts_its_own_tokens_and_flops_every_time():
    # the totals are worked out once per (samples, model, recompute) and reused: each run must still get
    # the ones of its own samples and recompute mode, as if worked out afresh
    from omnibench.specs import costs
    from simulator.flops import lengths_train_flops

    model, cluster = get_model("omni-7b@2L"), load_cluster("h100", 8)
    batches = [mixed_batch(32, seed) for seed in (0, 1)]
    for batch in batches + batches:
        for tp, recompute in ((1, "none"), (2, "full"), (1, "full")):
            plan = get_planner("homogeneous").plan(model, ParallelSpec(world_size=8, tp=tp), batch)
            r = simulate(plan, model, cluster, options=SimOptions(recompute=recompute))
            lens = costs.sample_lengths(batch.samples)
            assert r.tokens == sum(lens["llm"])
            assert r.model_flops == lengths_train_flops(model, lens)
            assert r.hardware_flops == lengths_train_flops(model, lens, recompute)
    assert lengths_train_flops(model, lens, "full") > lengths_train_flops(model, lens)

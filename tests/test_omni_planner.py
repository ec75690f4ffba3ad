"""Properties of omni's plans: what each technique promises, checked on real workload batches."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from omnibench.plan import BACKWARD, BOUNDARY, FORWARD, GRAD_SYNC, RECV, SEND, Plan, PlanError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import get_planner
from systems.common import is_primary
from systems.omni.reorder import LoaderSpec, Loading, dealt, decide, lpt_with_floor, max_over_mean
from workloads.sample import Batch, Sample, Segment
from workloads.stream import WorkloadStream

MODEL = get_model("tiny-omni")


def batch_of(workload: str, step: int, tokens: int = 1536, seed: int = 0) -> Batch:
    return WorkloadStream(workload, seed=seed, global_batch_tokens=tokens, length_scale=0.02,
                          max_sample_tokens=384).batch(step)


def plan(batch: Batch, world: int = 4, **kw) -> Plan:
    options = kw.pop("options", {})
    return get_planner("omni").plan(MODEL, ParallelSpec(world_size=world, options=options, **kw), batch)


def skewed_batch(n: int = 32) -> Batch:
    """Text-heavy samples first, media-heavy last: a round-robin loader split is badly imbalanced."""
    out = []
    for i in range(n):
        if i % 4 == 0:
            segs = (Segment("text", 8), Segment("video", 32, 128, grid_thw=(2, 8, 8)), Segment("text", 8))
        else:
            segs = (Segment("text", 4 + (i % 7)),)
        out.append(Sample(i, "skew", segs))
    return Batch(0, out)


def test_reordering_reduces_max_over_mean_loader_cost():
    p = plan(skewed_batch(), options={"reshard": False})
    r = p.notes["reorder"]
    assert r["max_over_mean_before"] > 1.5
    assert r["max_over_mean_after"] < r["max_over_mean_before"]
    assert r["max_over_mean_after"] < 1.15
    off = plan(skewed_batch(), options={"reshard": False, "reorder": False})
    assert off.notes["reorder"]["max_over_mean_after"] == off.notes["reorder"]["max_over_mean_before"]


def test_reordering_stays_inside_its_groups():
    ids = list(range(40))
    cost = {i: float((i * 37) % 11 + (50 if i % 8 == 0 else 0)) for i in ids}
    # No encoders and the LLM cost counted: the objective is `cost` itself.
    spec = LoaderSpec(loaders=8, group_size=4, reorder=True, count_llm=True, floor=2, encoders=())
    shards = [list(dealt(40, r, 8)) for r in range(8)]
    decisions = []
    for group in spec.groups():
        gathered = [[(float(i), float(i), cost[i]) for i in shards[r]] for r in group]
        decisions.append(decide(spec, group, gathered))
    loading = Loading.merge(spec, decisions)
    new = loading.shards
    for g in (range(0, 4), range(4, 8)):
        assert sorted(i for r in g for i in shards[r]) == sorted(i for r in g for i in new[r])
    assert all(len(s) >= 2 for s in new)
    assert [t["metadata_entries"] for t in loading.traffic] == [20, 20]
    per_group_before = [max_over_mean([sum(cost[i] for i in shards[r]) for r in g]) for g in (range(4), range(4, 8))]
    per_group_after = [max_over_mean([sum(cost[i] for i in new[r]) for r in g]) for g in (range(4), range(4, 8))]
    assert all(a <= b for a, b in zip(per_group_after, per_group_before, strict=True))
    assert loading.before == [sum(cost[i] for i in shards[r]) for r in range(8)]


def test_a_reorder_group_decides_from_its_own_samples_alone():
    """With two reorder groups of two loaders, making the second group's samples heavier changes
    the second group's shards and nothing in the first group's."""
    base = skewed_batch(32)
    heavier = Batch(0, [s if s.sample_id % 4 != 2 else
                        Sample(s.sample_id, "skew", (*s.segments, Segment("text", 10 * s.sample_id)))
                        for s in base.samples])
    kw = {"world": 4, "options": {"reorder_group": 2, "reshard": False}}
    a, b = plan(base, **kw), plan(heavier, **kw)
    shards = [[sorted(i for mb in a.assignment["llm"][r] for i in mb) for r in range(4)],
              [sorted(i for mb in b.assignment["llm"][r] for i in mb) for r in range(4)]]
    assert shards[0][:2] == shards[1][:2]
    assert shards[0][2:] != shards[1][2:]
    assert [g["metadata_entries"] for g in a.notes["reorder"]["groups"]] == [16, 16]
    exchange = [x for x in a.actions[0] if x.kind == "metadata"]
    assert [x.what for x in exchange] == ["reorder", "plan"] and all(x.nbytes > 0 for x in exchange)


def test_lpt_with_floor_gives_every_bin_its_floor():
    items = [(0, 100.0)] + [(i, 1.0) for i in range(1, 8)]
    parts = lpt_with_floor(items, 4, floor=2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert all(len(p) >= 2 for p in parts)


def test_resharding_balances_llm_tokens_across_data_ranks():
    b = batch_of("mixed_video", 900, tokens=6144)
    on, off = plan(b, world=8), plan(b, world=8, options={"reshard": False})
    t_on = on.notes["reshard"]["tokens_max_over_mean"]
    assert t_on <= off.notes["reshard"]["tokens_max_over_mean"]
    assert t_on < 1.1
    assert on.notes["reshard"]["samples_moved_off_loader"] > 0
    assert off.notes["reshard"]["samples_moved_off_loader"] == 0


@pytest.mark.parametrize("layout", [{}, {"pp": 2}, {"tp": 2}, {"cp": 2}])
def test_every_encoded_sample_is_routed_once_to_each_consumer(layout):
    b = batch_of("mixed_video", 700, tokens=3072)
    p = plan(b, **layout)
    p.validate()
    llm = p.layouts["llm"]
    where = {i: (r, j) for r, mbs in p.assignment["llm"].items() for j, mb in enumerate(mbs) for i in mb}
    for module in MODEL.encoders:
        with_input = {s.sample_id for s in b.samples if s.encoder_seq_lens(module)}
        primary = defaultdict(int)
        for rt in p.routes:
            if rt.module != module:
                continue
            assert llm.coords(rt.dst_rank)["dp"] == llm.coords(where[rt.sample_id][0])["dp"]
            assert rt.dst_microbatch == where[rt.sample_id][1]
            primary[rt.sample_id] += is_primary(rt, llm)
        assert set(primary) == with_input
        assert all(n == 1 for n in primary.values())


def test_long_samples_are_those_above_the_balanced_share():
    b = batch_of("long_video", 950, tokens=4096)
    p = plan(b, world=16, options={"encoder_sp_scheme": "long_short"})
    notes = p.notes["long_short"]["vision"]
    from omnibench.specs.cost_model import CostModel

    cm = CostModel.analytic(MODEL)
    costs = {s.sample_id: cm.encoder(s, "vision") for s in b.samples if s.encoder_seq_lens("vision")}
    share = sum(costs.values()) / p.layouts["vision"].dp
    assert notes["threshold_s"] == pytest.approx(share, rel=1e-3)
    assert {x["sample"] for x in notes["long_samples"]} == {i for i, c in costs.items() if c > share}
    assert notes["long_samples"], "a long_video batch late in training should hold a long video"
    off = plan(b, world=16, options={"long_short_sp": False})
    assert off.notes["long_short"]["vision"]["long_samples"] == []
    assert {m: v for m, v in off.options["long_short"]["long_microbatches"].items() if m != "llm"} == {}


def _encoder_positions(p: Plan, rank: int) -> tuple[int, int]:
    acts = p.actions[rank]
    llm = [k for k, a in enumerate(acts) if a.module == "llm" and a.kind in (FORWARD, BACKWARD)]
    enc_f = [k for k, a in enumerate(acts) if a.module != "llm" and a.kind == FORWARD]
    enc_b = [k for k, a in enumerate(acts) if a.module != "llm" and a.kind == BACKWARD]
    return sum(k < llm[0] for k in enc_f), sum(k > llm[-1] for k in enc_b)


def test_joint_schedule_fills_warmup_and_cooldown_bubbles():
    # A real model and real sample sizes: the LLM dominates, so pipeline bubbles are worth filling.
    model = get_model("omni-7b")
    b = WorkloadStream("mixed_video", seed=0, global_batch_tokens=8 * 65536, length_scale=1.0).batch(600)
    planner = get_planner("omni")
    on = planner.plan(model, ParallelSpec(world_size=16, pp=4), b)
    off = planner.plan(model, ParallelSpec(world_size=16, pp=4, options={"joint_pipeline": False}), b)
    assert on.notes["schedule"]["order"] == "joint"
    assert on.notes["schedule"]["encoder_placement"] == "bubble_aware"
    llm = on.layouts["llm"]
    for r in llm.ranks:
        if llm.coords(r)["pp"] == llm.pp - 1:
            warm, cool = _encoder_positions(on, r)
            assert warm > 0 and cool > 0, f"rank {r} (last stage) has no encoder work in its bubbles"
    # Later stages carry more encoder work than stage 0 (they have the idle time for it).
    work = on.notes["long_short"]["vision"]["encoder_cost_per_rank_s"]
    stage = [llm.coords(r)["pp"] for r in range(16)]
    first = sum(w for w, s in zip(work, stage, strict=True) if s == 0)
    last = sum(w for w, s in zip(work, stage, strict=True) if s == llm.pp - 1)
    assert last > first
    assert on.notes["schedule"]["estimated_step_s"] < off.notes["schedule"]["estimated_step_s"]
    # The ablation runs every encoder forward before the pipeline on every rank.
    assert off.notes["schedule"]["order"] == "all_ahead"
    for r in off.layouts["llm"].ranks:
        acts = off.actions[r]
        first_llm = min(k for k, a in enumerate(acts) if a.module == "llm" and a.kind == FORWARD)
        assert all(k < first_llm for k, a in enumerate(acts) if a.module != "llm" and a.kind == FORWARD)


def _runs_to_completion(p: Plan) -> bool:
    """Abstract execution: recvs block until the matching send is posted (FIFO per pair), long-input
    forwards/backwards block on their whole group, grad_sync on every rank."""
    pos = {r: 0 for r in p.actions}
    sent: dict[tuple[int, int], deque] = defaultdict(deque)
    long_mb = p.options.get("long_short", {}).get("long_microbatches", {})
    groups = p.options.get("long_short", {}).get("groups", {})
    arrived: dict[tuple, set] = defaultdict(set)

    def collective_key(r, a):
        if a.kind == GRAD_SYNC:
            return ("sync", a.module), set(p.actions)
        if a.module in long_mb and a.microbatch in long_mb[a.module].get(str(r), []):
            g = next(g for g in groups[a.module] if r in g)
            n = long_mb[a.module][str(r)].index(a.microbatch)
            return ("long", a.kind, a.module, tuple(g), n), set(g)
        return None, None

    progress = True
    while progress:
        progress = False
        for r, acts in p.actions.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind == SEND or (a.kind == BOUNDARY and a.direction == "send"):
                    sent[(r, a.peer)].append(a)
                elif a.kind == RECV or (a.kind == BOUNDARY and a.direction == "recv"):
                    if not sent[(a.peer, r)]:
                        break
                    sent[(a.peer, r)].popleft()
                else:
                    key, members = collective_key(r, a)
                    if key is not None:
                        arrived[key].add(r)
                        if arrived[key] < members:
                            break
                pos[r] += 1
                progress = True
    return all(pos[r] == len(acts) for r, acts in p.actions.items())


@pytest.mark.parametrize("layout", [{"pp": 2}, {"pp": 4}, {"pp": 2, "tp": 2}, {"pp": 2, "cp": 2}])
@pytest.mark.parametrize("step", [100, 900])
def test_plans_run_to_completion_without_deadlock(layout, step):
    b = batch_of("mixed_video", step, tokens=6144)
    p = plan(b, world=8, **layout)
    assert _runs_to_completion(p)


def test_plan_for_1024_ranks_keeps_every_llm_tp_group_inside_one_node():
    # How fast this plans is a benchmark figure (benchmarks/plan_speed.py), not a test: time on a shared host is noise.
    model = get_model("omni-7b")
    b = WorkloadStream("mixed_video", seed=3, global_batch_tokens=1024 * 4096, length_scale=1.0).batch(800)
    parallel = ParallelSpec(world_size=1024, tp=4, pp=4, gpus_per_node=8)
    p = get_planner("omni").plan(model, parallel, b)
    assert p.notes["placement"]["llm_tp"]["inside_one_node"] == p.notes["placement"]["llm_tp"]["groups"]


def test_unknown_option_is_refused_with_the_allowed_names():
    with pytest.raises(PlanError, match="options.warp_drive: unknown option; allowed: .*reorder.*quota \\(spatial\\)"):
        plan(batch_of("mixed_video", 0), options={"warp_drive": True})
    with pytest.raises(PlanError, match="options.reorder must be one of true, false"):
        plan(batch_of("mixed_video", 0), options={"reorder": "maybe"})


def test_plan_survives_a_json_round_trip():
    p = plan(batch_of("long_video", 900, tokens=4096), world=8, pp=2)
    q = Plan.from_json(p.to_json())
    q.validate()
    assert q.options == p.options and q.notes == p.notes and q.actions == p.actions


# -- encoder sequence-parallel scheme (systems/omni/long_short.py) ------------------------------------


def _omni7b_plan(world: int = 64, workload: str = "mixed_video", **kw) -> Plan:
    options = {"hardware": "h100", "balancer": "simulator", **kw.pop("options", {})}
    b = WorkloadStream(workload, seed=0, global_batch_tokens=8192 * world).batch(0)
    return get_planner("omni").plan(get_model("omni-7b"), ParallelSpec(world_size=world, options=options, **kw), b)


def test_auto_scheme_is_the_checked_fastest_of_every_scheme_and_group_size():
    p = _omni7b_plan(cp=4, microbatches=1)
    notes = p.notes["long_short"]["vision"]
    cands = notes["candidates"]
    assert {c["scheme"] for c in cands} == {"none", "long_short", "all"}
    assert {c["group_size"] for c in cands if c["scheme"] == "all"} == {2, 4, 8}  # ViT 16 heads, 8 per node
    best = min(cands, key=lambda c: c["checked_s"])
    assert (notes["scheme"], notes["sp_group_size"]) == (best["scheme"], best["group_size"])
    for scheme in ("none", "long_short", "all"):
        forced = _omni7b_plan(cp=4, microbatches=1, options={"encoder_sp_scheme": scheme}).notes["long_short"]["vision"]
        assert forced["scheme"] == scheme and {c["scheme"] for c in forced["candidates"]} == {scheme}
        # what auto weighed for a scheme is what that scheme, forced, weighs
        assert [c for c in cands if c["scheme"] == scheme] == forced["candidates"]


def test_group_samples_are_packed_per_group_and_llm_microbatch():
    p = _omni7b_plan(cp=4, microbatches=2, options={"encoder_sp_scheme": "all"})
    groups = [tuple(g) for g in p.options["long_short"]["groups"]["vision"]]
    long_mb = p.options["long_short"]["long_microbatches"]["vision"]
    due = {i: j for mbs in p.assignment["llm"].values() for j, mb in enumerate(mbs) for i in mb}
    seen = []
    for g in groups:
        lists = [[p.assignment["vision"][r][j] for j in long_mb[str(r)]] for r in g if str(r) in long_mb]
        assert all(x == lists[0] for x in lists), "every member runs the same microbatches in the same order"
        for mb in lists[0] if lists else []:
            assert len({due[i] for i in mb}) == 1  # one LLM microbatch's samples per group microbatch
        seen += [i for mb in (lists[0] if lists else []) for i in mb]
        dues = [due[mb[0]] for mb in (lists[0] if lists else [])]
        assert dues == sorted(set(dues)), "one microbatch per LLM microbatch, in the order the LLM needs them"
    with_vision = {s.sample_id for s in p.samples if s.encoder_seq_lens("vision")}
    assert sorted(seen) == sorted(with_vision)
    assert p.notes["long_short"]["vision"]["group_microbatches"] < len(with_vision)


def test_a_group_member_that_consumes_a_sample_reads_its_own_copy():
    """Every member of a sequence-parallel group ends with the whole output: consumers inside the group
    get no boundary transfer, and the primary consumer, when inside, is the primary source (the
    gradient comes back without crossing ranks)."""
    p = _omni7b_plan(cp=4, microbatches=1, options={"encoder_sp_scheme": "all", "reorder": False},
                     encoder_sp=4)
    llm = p.layouts["llm"]
    member_of = {r: tuple(g) for g in p.options["long_short"]["groups"]["vision"] for r in g}
    local = crossing = 0
    for rt in p.routes:
        if rt.module != "vision":
            continue
        group = member_of[rt.src_rank]
        if rt.dst_rank in group:
            assert rt.src_rank == rt.dst_rank
            local += 1
        else:
            crossing += 1
        if is_primary(rt, llm) and rt.dst_rank in group:
            assert rt.src_rank == rt.dst_rank
    assert local > crossing  # groups equal to the LLM's cp groups: samples mostly stay with their consumers


def test_long_samples_of_one_group_and_llm_microbatch_share_a_microbatch():
    """Three long videos feeding the one LLM microbatch, one sequence-parallel group over all 4
    ranks: one group microbatch holds all three (one packed row), not one microbatch each."""
    short = [Sample(i, "s", (Segment("text", 8), Segment("image", 4, 16, grid_thw=(1, 4, 4)))) for i in range(8)]
    long = [Sample(100 + i, "v", (Segment("text", 5), Segment("video", 45, 180, grid_thw=(3, 6, 10)))) for i in range(3)]
    p = plan(Batch(0, short + long), microbatches=1, encoder_sp=4, options={"encoder_sp_scheme": "long_short"})
    notes = p.notes["long_short"]["vision"]
    assert {x["sample"] for x in notes["long_samples"]} == {100, 101, 102}
    assert notes["group_microbatches"] == 1
    long_mb = p.options["long_short"]["long_microbatches"]["vision"]
    assert {p.assignment["vision"][int(r)][js[0]] for r, js in long_mb.items()} == {(100, 101, 102)}


def test_reorder_counts_long_samples_at_their_loader():
    """A loader holding a sample far above the balanced share takes fewer of the others: the long
    sample runs by its loader's ranks (it is no longer counted as free)."""
    from systems.omni.reorder import EncoderShare

    spec = LoaderSpec(loaders=2, group_size=2, reorder=True, count_llm=False, floor=0,
                      encoders=(EncoderShare("vision", 1, 2),))
    big = [(0.0, 0.0, 100.0, 1.0)]
    small = [(float(k), float(k), 10.0, 1.0) for k in range(1, 11)]
    d = decide(spec, [0, 1], [big + small[:5], small[5:]])
    holder = next(r for r, ids in d.shards.items() if 0 in ids)
    assert len(d.shards[holder]) < len(d.shards[1 - holder])
    assert d.after[holder] == pytest.approx(100.0) and d.after[1 - holder] == pytest.approx(100.0)


def test_lock_stepped_microbatches_are_levelled_to_the_costliest():
    """Two data ranks whose microbatch j runs in lock-step: rank 0 holds one costly sample, rank 1
    four small ones split two and two. Rank 1 moves work into its first microbatch up to rank 0's
    level and tokens, so the step pays max(j=0) + max(j=1) = 10 + 0 instead of 10 + 5."""
    from systems.omni.reshard import level_microbatches

    cost = {0: 10.0, 1: 4.0, 2: 4.0, 3: 1.0, 4: 1.0}
    tokens = {0: 100, 1: 40, 2: 40, 3: 10, 4: 10}
    before = [[(0,), ()], [(1, 3), (2, 4)]]
    after = level_microbatches(before, cost, tokens, [[0, 1]])
    assert after[0] == [(0,), ()]
    assert after[1] == [(1, 2, 3, 4), ()]
    steps = [sum(max(sum(cost[i] for i in mbs[j]) for mbs in x) for j in range(2)) for x in (before, after)]
    assert steps == [10 + 5, 10 + 0]
    # the token cap: a rank never grows a microbatch beyond the group's largest in tokens
    capped = level_microbatches(before, cost, {**tokens, 2: 90}, [[0, 1]])
    assert capped[1] == [(1, 3, 4), (2,)]


def _reshard_by_scan(ids, cost, home, dp, floor, start=None):
    """`reshard` as first written (every rank scanned per sample once only the floor is left to fill):
    the reference its heap must agree with, bit for bit."""
    import heapq

    from systems.omni.reshard import SLACK

    order = sorted(ids, key=lambda i: (-cost[i], i))
    floor = min(floor, len(order) // dp)
    tol = SLACK * (sum(cost[i] for i in order) + sum(start or ())) / dp
    loads = list(start) if start is not None else [0.0] * dp
    counts, out = [0] * dp, [[] for _ in range(dp)]
    heap = [(loads[b], b) for b in range(dp)]
    heapq.heapify(heap)
    left, deficit = len(order), floor * dp
    for i in order:
        if left <= deficit:
            short = [b for b in range(dp) if counts[b] < floor]
            b = home[i] if home[i] in short else min(short, key=lambda b: (loads[b], b))
        else:
            while True:
                load, b = heapq.heappop(heap)
                if load == loads[b]:
                    heapq.heappush(heap, (load, b))
                    break
            if loads[home[i]] <= loads[b] + tol and (counts[home[i]] < floor or left - 1 >= deficit):
                b = home[i]
        deficit -= counts[b] < floor
        counts[b] += 1
        loads[b] += cost[i]
        out[b].append(i)
        heapq.heappush(heap, (loads[b], b))
        left -= 1
    return [sorted(x) for x in out]


def test_resharding_fills_the_floor_as_a_scan_of_every_rank_would():
    # the ranks still under the floor are kept in a heap (a scan of every rank per sample was
    # quadratic at thousands of data ranks): the same split as the scan, ties and zero costs included
    import random

    from systems.omni.reshard import reshard

    rng = random.Random(0)
    for _ in range(1500):
        dp = rng.choice([1, 2, 3, 8, 33])
        ids = rng.sample(range(5000), rng.randint(0, 200))
        ints = rng.random() < 0.4
        cost = {i: float(rng.randint(0, 3)) if ints else rng.random() * 100 for i in ids}
        home = {i: rng.randrange(dp) for i in ids}
        floor = rng.randint(0, 8)
        start = [rng.random() * 50 for _ in range(dp)] if rng.random() < 0.3 else None
        assert reshard(ids, cost, home, dp, floor, start) == _reshard_by_scan(ids, cost, home, dp, floor, start)


def test_a_batch_planned_at_other_layouts_first_is_planned_as_a_fresh_copy_of_it_is():
    """What omni works out once per batch for every plan of it (`systems.omni._per_batch`: costs, the
    loaders' exchange per loader spec, prices per group size and weight dtype) never leaks one layout's
    answer into another's: each plan of a batch a tune has already planned elsewhere equals the plan of
    an equal batch planned first."""
    model = get_model("omni-7b")

    def batch():
        return WorkloadStream("mixed_video", seed=0, global_batch_tokens=8192 * 32).batch(0)

    shared = batch()
    layouts = [dict(cp=4), dict(cp=4, options={"encoder_dp": "ddp"}),  # encoders in fp32, then bf16 weights
               dict(cp=4, mixed_precision="master", options={"encoder_dp": "ddp"}),
               dict(cp=4, recompute="full"), dict(cp=2, tp=2),  # other recompute, other loaders
               dict(cp=4, options={"encoder_sp_scheme": "all"}), dict(cp=2, pp=2, options={"reorder_group": 4})]
    for kw in layouts:
        kw = dict(kw)
        par = ParallelSpec(world_size=32, options={"hardware": "h100", **kw.pop("options", {})}, **kw)
        got = get_planner("omni").plan(model, par, shared).to_json()
        assert got == get_planner("omni").plan(model, par, batch()).to_json(), kw

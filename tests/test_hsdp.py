"""HSDP (`ParallelSpec.dp_shard` / `Layout.dp_shard`): parameters sharded inside groups of dp_shard
ranks and replicated across them, in the planners, the runtime (FSDP2 on a 2D mesh, real gloo ranks)
and the simulator (gathers and reduce-scatters over the shard group, one all-reduce across replicas)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from omnibench.plan import Layout, Plan, PlanError
from omnibench.specs.model import LLMSpec, MultimodalSpec, SpecError
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from systems.common import AUTO_SHARD_NODES
from workloads.sample import Batch, Sample, Segment

FLAT = MultimodalSpec("flat", LLMSpec("flat", layers=8, hidden=4096, heads=32, kv_heads=8, ffn=16384, vocab=8))


def text_batch(n: int, tokens: int = 2048) -> Batch:
    return Batch(0, [Sample(i, "text", (Segment("text", tokens),)) for i in range(n)])


def with_shard(plan: Plan, module: str, dp_shard: int) -> Plan:
    """The same plan with one module's layout sharded differently (everything else untouched)."""
    out = Plan.from_dict(plan.to_dict())
    out.layouts[module] = replace(out.layouts[module], dp_shard=dp_shard)
    out.validate()
    return out


# ------------------------------------------------------------------------------------- layouts


def test_shard_and_replicate_groups_partition_every_fsdp_group():
    lay = Layout("llm", tuple(range(32)), dp=4, tp=2, pp=2, cp=2, dp_shard=4)
    assert lay.fsdp_size == 8 and lay.shard_size == 4 and lay.hsdp
    for groups in (lay.shard_groups(), lay.replicate_groups()):
        assert sorted(r for g in groups for r in g) == list(range(32))
    fsdp = {frozenset(g) for g in lay.fsdp_groups()}
    for s in lay.shard_groups():
        assert len(s) == 4 and any(set(s) <= f for f in fsdp)
    for rep in lay.replicate_groups():
        assert len(rep) == 2  # one member per shard group of its FSDP group
        assert all(sum(r in s for s in lay.shard_groups()) == 1 for r in rep)
    # tp innermost: a shard group of 4 dp*cp members spans 8 consecutive ranks.
    assert lay.shard_groups()[0] == (0, 2, 4, 6)


def test_old_plan_json_without_dp_shard_loads_as_plain_fsdp():
    plan = get_planner("homogeneous").plan(FLAT, ParallelSpec(world_size=8), text_batch(8))
    d = json.loads(plan.to_json())
    for lay in d["layouts"].values():
        del lay["dp_shard"]
    old = Plan.from_dict(d)
    assert old.layouts["llm"].dp_shard == 0 and not old.layouts["llm"].hsdp
    assert old.layouts == plan.layouts


def test_layout_rejects_a_dp_shard_that_does_not_divide_the_fsdp_group():
    with pytest.raises(PlanError, match=r"layout\.llm\.dp_shard: 3 .* divisor of dp\*cp = 8"):
        Layout("llm", tuple(range(8)), dp=8, dp_shard=3).validate()
    with pytest.raises(PlanError, match="multiple of ep=4"):
        Layout("llm", tuple(range(8)), dp=8, ep=4, dp_shard=2).validate()


# ------------------------------------------------------------------------------------ planners


@pytest.mark.parametrize("system", ["homogeneous", "temporal", "colocated", "noncolocated", "omni"])
def test_automatic_dp_shard_keeps_plain_fsdp_up_to_64_ranks(system):
    model = get_model("omni-7b")
    from workloads.stream import WorkloadStream

    batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=64 * 4096).batch(0)
    kw = {"encoder_ranks": 16} if system == "noncolocated" else {}
    auto = get_planner(system).plan(model, ParallelSpec(world_size=64, microbatches=2, **kw), batch)
    assert all(lay.dp_shard == 0 for lay in auto.layouts.values())


def test_automatic_dp_shard_shards_within_eight_nodes_at_scale():
    parallel = ParallelSpec(world_size=1024, tp=4, pp=2, cp=2, microbatches=2)
    plan = get_planner("homogeneous").plan(FLAT, parallel, text_batch(1024))
    llm = plan.layouts["llm"]
    assert llm.fsdp_size == 128 and llm.shard_size == 16 and llm.hsdp
    span = AUTO_SHARD_NODES * parallel.gpus_per_node
    for g in llm.shard_groups():
        assert max(g) - min(g) < span  # members tp apart: 16 x tp 4 = 64 consecutive ranks
    assert llm.shard_size % llm.cp == 0
    # MoE: a shard group holds whole expert groups.
    moe = get_model("tiny-omni-moe")
    lay = get_planner("temporal").plan(moe, ParallelSpec(world_size=512, ep=4, tp=2, microbatches=1),
                                       text_batch(512, 64)).layouts["llm"]
    assert lay.hsdp and lay.shard_size % 4 == 0


def test_explicit_dp_shard_reaches_every_fsdp_layout():
    plan = get_planner("colocated").plan(get_model("tiny-omni"), ParallelSpec(world_size=8, dp_shard=2),
                                         _mixed_batch(16))
    assert {m: lay.shard_size for m, lay in plan.layouts.items()} == {"llm": 2, "vision": 2, "audio": 2}
    flat = get_planner("colocated").plan(get_model("tiny-omni"), ParallelSpec(world_size=8, dp_shard=-1),
                                         _mixed_batch(16))
    assert all(lay.dp_shard == 0 for lay in flat.layouts.values())


@pytest.mark.parametrize("kw, field", [
    (dict(world_size=8, dp=8, dp_shard=3), "dp_shard=3 must divide dp\\*cp = 8"),
    (dict(world_size=8, dp_shard=-2), "dp_shard must be -1"),
    (dict(world_size=8, dp_shard=2, fsdp=False), "dp_shard=2 needs fsdp"),
])
def test_bad_dp_shard_is_refused_naming_the_field(kw, field):
    with pytest.raises(SpecError, match=field):
        ParallelSpec(**kw).validate(get_model("tiny-omni"))


def test_dp_shard_not_dividing_the_automatic_dp_is_refused():
    with pytest.raises(PlanError, match="dp_shard=3 does not divide the 8 ranks"):
        get_planner("homogeneous").plan(FLAT, ParallelSpec(world_size=8, dp_shard=3), text_batch(8))


def _mixed_batch(n: int) -> Batch:
    out = []
    for i in range(n):
        segs = [Segment("text", 8)]
        if i % 3 == 0:
            segs.append(Segment("image", 4, 16, grid_thw=(1, 4, 4)))
        elif i % 3 == 1:
            segs.append(Segment("audio", 4, 8, mel_frames=16))
        out.append(Sample(i, "test", (*segs, Segment("text", 6))))
    return Batch(0, out)


# ----------------------------------------------------------------------------------- simulator


def _flat_plan(world: int, dp_shard: int = -1) -> Plan:
    return get_planner("homogeneous").plan(FLAT, ParallelSpec(world_size=world, microbatches=1, dp_shard=dp_shard),
                                           text_batch(world))


def test_dp_shard_equal_to_the_fsdp_group_reproduces_plain_fsdp_exactly():
    cluster = load_cluster("h100", 256)
    plain = _flat_plan(256)
    assert plain.layouts["llm"].dp_shard == 0
    same = with_shard(plain, "llm", 256)
    a, b = simulate(plain, FLAT, cluster), simulate(same, FLAT, cluster)
    drop = {"sim_seconds"}  # the simulator's own wall time
    assert {k: v for k, v in a.metrics().items() if k not in drop} == {k: v for k, v in b.metrics().items()
                                                                         if k not in drop}
    assert [(r.finish, r.exposed_comm, r.memory_bytes) for r in a.ranks] == \
           [(r.finish, r.exposed_comm, r.memory_bytes) for r in b.ranks]


def test_hsdp_gathers_and_reduces_faster_but_holds_more_memory_at_large_dp():
    cluster = load_cluster("h100", 1024)
    plain = _flat_plan(1024)
    hsdp = with_shard(plain, "llm", 64)
    ep, eh = Engine(plain, FLAT, cluster), Engine(hsdp, FLAT, cluster)
    cp, ch = ep.classes(), eh.classes()
    fwd = next(a for a in plain.actions[0] if a.kind == "forward")
    gather_plain, gather_hsdp = ep._compute_op(0, fwd, cp).comm, eh._compute_op(0, fwd, ch).comm
    # Same bytes per rank; 63 ring latency steps per layer instead of 1,023 (about half the time here).
    assert 0 < gather_hsdp < gather_plain / 2
    sync_plain, sync_hsdp = ep.grad_sync_cost("llm", 0, 0), eh.grad_sync_cost("llm", 0, 0)
    # Bandwidth-bound reductions cost about the same: plain FSDP's ring drives all 8 NICs of each node;
    # HSDP pays fewer latency steps, but its all-reduce across replicas runs on one rail per GPU.
    assert 0 < sync_hsdp < 1.2 * sync_plain
    # The all-reduce across the 16 replicas is part of it: more than the shard group's reduce-scatter alone.
    rs_only = eh.coll_inline.cost("reduce_scatter", ep.options.grad_reduce_bytes * eh.stage_work("llm", 0).params,
                                  eh._shard_group("llm", 0))
    assert sync_hsdp > rs_only
    assert eh._params_on_rank(0) == pytest.approx(ep._params_on_rank(0) * 16)
    assert eh._static_memory(0) > ep._static_memory(0)
    a, b = simulate(plain, FLAT, cluster), simulate(hsdp, FLAT, cluster)
    assert b.step_time < a.step_time and b.peak_memory > a.peak_memory


def test_hsdp_lock_step_spans_the_shard_group_only():
    eng = Engine(with_shard(_flat_plan(128), "llm", 16), FLAT, load_cluster("h100", 128))
    shard = eng._lock_group("llm", 5)
    assert len(shard) == 16 and 5 in shard
    assert eng._replicate_group("llm", 5) == tuple(range(5, 128, 16))


# ------------------------------------------------------------------------------------- runtime


RUNTIME_CELLS = [
    # (system, layout, model): 4 gloo ranks; dp_shard < the FSDP group turns FSDP2 into HSDP.
    ("homogeneous", {"dp": 4, "dp_shard": 2}, "tiny-omni"),  # LLM and encoders: 2 shard groups of 2
    ("colocated", {"tp": 2, "dp_shard": 1}, "tiny-omni"),  # 3D mesh (replicate, shard, tp); encoders 4 -> 1
    ("temporal", {"ep": 2, "dp_shard": 2}, "tiny-omni-moe"),  # experts: shard group of 1, replicated
    ("omni", {"dp_shard": 2}, "tiny-omni"),  # omni's LLM (its encoders are replicated, not FSDP)
]


# Two steps (AdamW): the second steps from the sharded moments the first left; a third adds nothing.
HSDP_STEPS = 2


def _cell_id(c) -> str:
    return f"{c[0]}-" + "-".join(f"{k}{v}" for k, v in c[1].items())


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    """Every HSDP cell in one launch of ranks (tests/parity.py)."""
    from parity import Run, make_batches, run_all

    return run_all(tmp_path_factory.mktemp("hsdp"), [Run(_cell_id(c), c[0], c[2], make_batches(HSDP_STEPS), c[1])
                                                     for c in RUNTIME_CELLS])


@pytest.mark.timeout(900)  # the first cell's setup launches all of them
@pytest.mark.xdist_group("parity-hsdp")
@pytest.mark.parametrize("cell", [pytest.param(c, id=_cell_id(c)) for c in RUNTIME_CELLS])
def test_hsdp_training_matches_single_process(hsdp_runs, cell):
    from parity import assert_parity, make_batches, reference

    system, layout, model = cell
    run = hsdp_runs[_cell_id(cell)]
    assert_parity(*run.get(), *reference(model, make_batches(HSDP_STEPS)))
    summary = json.loads((run.folder / "summary.json").read_text())
    assert any(n.startswith("llm: HSDP, parameters sharded over") for n in summary["notes"]), summary["notes"]


# ----------------------------------------------------------------------------------------- CLI


def test_cli_dp_shard_reaches_the_plan_and_bad_values_fail_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from omnibench.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--system", "homogeneous", "--nproc", "4", "--tp", "1", "--dp-shard", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["layouts"]["llm"]["dp_shard"] == 2
    bad = runner.invoke(app, ["plan", "--system", "homogeneous", "--nproc", "4", "--tp", "1", "--dp", "4", "--dp-shard", "3"])
    assert bad.exit_code == 2
    assert "dp_shard=3 must divide dp*cp = 4" in bad.output and len(bad.output.strip().splitlines()) == 1
    sim = runner.invoke(app, ["simulate", "-w", "text_only", "-s", "homogeneous", "--gpus", "16", "--dp-shard", "4",
                              "--global-batch-tokens", "65536", "--out", str(tmp_path), "--json"])
    assert sim.exit_code == 0, sim.output
    record = json.loads(sim.output)["record"]
    assert json.loads((tmp_path / record.rsplit("/", 1)[-1] / "config.json").read_text())["dp_shard"] == 4

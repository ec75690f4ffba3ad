"""What decides "does it fit": the allocated peak, the space PyTorch's caching allocator cannot give
back once it has released its cache and retried, and the context outside it (simulator/memory.py
STRANDED, from public OOM messages), not the reserve an unpressured run shows; and the training
state Megatron-LM keeps in bf16 (fp32 main gradients)."""

from __future__ import annotations

import csv
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from omnibench.specs import costs
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions, check_fit
from simulator.hardware import GiB, load_cluster
from simulator.memory import (
    EAGER_ALLOCATOR,
    FRAGMENTATION,
    HOST_ALLOCATOR,
    HOST_DEVICE,
    RESERVED_BYTES,
    STRANDED,
    allocator_need,
    communicators,
    memory_needed,
    oom_figures,
)
from simulator.published import load_published, options_of
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

ROOT = Path(__file__).resolve().parents[1]
OOM_CSV = ROOT / "results" / "validation" / "allocator_oom_messages.csv"
RUNS_CSV = ROOT / "results" / "validation" / "published_runs.csv"


def _oom_rows() -> list[dict]:
    with OOM_CSV.open() as f:
        return list(csv.DictReader(f))


def test_the_stranded_fraction_is_the_median_of_the_collected_oom_messages():
    rows = _oom_rows()
    assert len(rows) >= 10 and all(r["url"].startswith("https://github.com/") for r in rows)
    # training steps on 40-80 GB GPUs only, each with both figures of the message
    assert all(38 <= float(r["total_capacity_gib"]) <= 81 for r in rows)
    ratios = [float(r["reserved_unallocated_gib"]) / float(r["allocated_gib"]) for r in rows]
    assert STRANDED == pytest.approx(statistics.median(ratios), abs=5e-5)
    # the pressured need is far below the unpressured reserve the allocator shows with memory to spare
    assert STRANDED < FRAGMENTATION - 1


def _result(world=2, tokens=4096, memory_stack=""):
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", tokens),)) for i in range(world * 2)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=world), batch)
    opts = SimOptions(check_memory=False, memory_stack=memory_stack, stack="fused" if memory_stack else "eager")
    return Engine(plan, spec, load_cluster("h100", world), options=opts).run()


def test_a_published_stacks_rank_needs_its_allocated_peak_with_the_stranded_space_and_the_context():
    r = _result(memory_stack="torchtitan").ranks[0]
    assert r.memory_needed == pytest.approx(r.memory_allocated * (1 + STRANDED) + RESERVED_BYTES)
    assert r.memory_needed == pytest.approx(memory_needed(r.memory_allocated, "torchtitan"))
    # the reserve stays what published max_reserved readings are compared with
    assert r.memory_bytes == pytest.approx(FRAGMENTATION * r.memory_allocated + RESERVED_BYTES)
    assert r.memory_needed < r.memory_bytes


def test_this_runtimes_rank_needs_what_the_allocator_measured_on_a_gpu():
    res = _result()
    r = res.ranks[0]
    need = allocator_need("eager")
    assert need is EAGER_ALLOCATOR and need.stranded > STRANDED and need.per_communicator > 0
    # the world's communicator and one per group of the layouts: llm tp, cp, dpcp, ep, edp
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(4)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=2), batch)
    assert communicators(plan, 0) == 6
    outside = need.outside + 5 * need.per_communicator
    assert outside > RESERVED_BYTES
    assert r.memory_needed == pytest.approx(r.memory_allocated * (1 + need.stranded) + outside)
    assert r.memory_bytes == pytest.approx(FRAGMENTATION * r.memory_allocated + outside)


PHASES = ROOT / "results" / "gpu" / "2026-11-27-h100-b" / "phases"


def _one_rank_plan(case):
    from omnibench.runtime.launch import resolve
    from omnibench.runtime.run_inputs import batch_source, parallel_spec
    from omnibench.specs.run import RunSpec

    system, workload, model, recompute, tokens = case
    spec = resolve(RunSpec(system=system, workload=workload, model=model, nproc=1, steps=1, recompute=recompute,
                           global_batch_tokens=tokens, device="cpu"))
    # the model as the measured run trained it (runs from before a workload's unused encoders were left out
    # held them)
    return get_planner(system).plan(get_model(model or spec.model), parallel_spec(spec, 1), batch_source(spec)(0))


def test_the_eager_figures_are_the_committed_gpu_measurement():
    """EAGER_ALLOCATOR is what the GPU benchmarks measured (their JSON is committed): the largest stranded
    share of gpu_allocator.py's Plans; outside the allocator, a base and a figure per NCCL communicator
    (gpu_memory_phases.py, the NCCL log) that reproduce every measured process from the groups its
    runtime created, and the omni_av run's OOM message."""
    import json

    from omnibench.tables.gpu import nccl_group_costs

    d = json.loads((ROOT / "results" / "gpu" / "2026-11-27-h100" / "allocator" / "gpu_allocator.json").read_text())
    assert d["provenance"]["gpu_name"] == "NVIDIA H100 80GB HBM3"
    shares = [c["stranded_share"] for c in d["cases"]]
    assert all(c["need_reproduced"] for c in d["cases"])
    assert EAGER_ALLOCATOR.stranded == pytest.approx(max(shares), abs=5e-4)
    assert EAGER_ALLOCATOR.per_communicator == pytest.approx(nccl_group_costs()["per_group"] * GiB, abs=0.002 * GiB)
    for name in ("llm", "mm", "omni-default"):
        run = json.loads((PHASES / f"memory_phases-{name}.json").read_text())
        assert run["provenance"]["gpu_name"] == "NVIDIA H100 80GB HBM3" and not run["provenance"]["dirty"]
        plan = _one_rank_plan(run["spec"])
        measured = [p for p in run["phases"] if p["phase"].startswith("step ")][-1]["outside"]
        assert EAGER_ALLOCATOR.outside_for(communicators(plan, 0)) == pytest.approx(measured, abs=0.02 * GiB), name
    # the omni_av run that ran out of memory: a fresh `omnibench run` process, its OOM message's figure
    calls = json.loads((ROOT / "results" / "gpu" / "2026-11-27-h100" / "gpu_figures-call1.json").read_text())
    (oom,) = [r for r in calls if "OutOfMemoryError" in r.get("error", "")]
    plan = _one_rank_plan(("omni", "omni_av", "omni-7b@8L", "full", 0))
    assert EAGER_ALLOCATOR.outside_for(communicators(plan, 0)) == pytest.approx(oom_figures(oom["error"])["outside"],
                                                                               abs=0.05 * GiB)


def test_a_cpu_process_adds_a_hosts_figures_not_the_gpus():
    """cpu-gloo (and run's CPU check) is a host's memory: no caching allocator, no CUDA context."""
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(4)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=2), batch)
    r = Engine(plan, spec, load_cluster("cpu-gloo", 2), options=SimOptions(check_memory=False)).run().ranks[0]
    assert r.memory_needed == pytest.approx(r.memory_allocated + HOST_ALLOCATOR.outside)
    assert memory_needed(r.memory_allocated, "eager", HOST_DEVICE) == pytest.approx(r.memory_needed)


def test_tunes_bound_on_a_cpu_cluster_stays_under_the_simulated_need():
    """The search prunes on a lower bound: on cpu-gloo it must add the host's figures, as the
    simulator does, or it throws away layouts that fit (tp2 pp2 on 4 ranks, for one)."""
    from omnibench.tune import Candidate, memory_estimate

    model = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 8192),)) for i in range(8)])
    c = Candidate("homogeneous", tp=2, pp=2, microbatches=8, recompute="none")
    bound = memory_estimate("homogeneous", model, 4, 64, c, batch.samples, device=HOST_DEVICE)
    plan = get_planner("homogeneous").plan(model, c.parallel(4, 64, {}), batch)
    res = Engine(plan, model, load_cluster("cpu-gloo", 4), options=SimOptions(check_memory=False)).run()
    assert bound <= res.peak_needed
    assert memory_estimate("homogeneous", model, 4, 64, c, batch.samples) > bound  # the GPU's figures add more


def test_a_step_between_its_need_and_its_unpressured_reserve_fits_and_the_verdict_names_the_figure():
    res = _result()
    worst = max(res.ranks, key=lambda s: s.memory_needed)
    between = (worst.memory_needed + res.peak_memory) / 2  # a GPU holding the need, not the reserve
    fits = check_fit(replace(res, memory_capacity=between))
    assert fits.fits and not fits.fit_message
    tight = check_fit(replace(res, memory_capacity=worst.memory_needed * 0.99))
    assert not tight.fits
    assert f"needs {worst.memory_needed / GiB:.1f} GiB" in tight.fit_message
    assert "under memory pressure" in tight.fit_message and "reserved when unpressured" in tight.fit_message
    assert res.metrics()["peak_memory_needed_gib"] == pytest.approx(res.peak_needed / GiB)


def test_megatron_in_bf16_keeps_fp32_main_gradients_and_the_distributed_optimizer_does_not_shard_them():
    p, d = 1e9, 8
    ddp = costs.dp_state_bytes(p, "ddp", d, stack="megatron")
    assert (ddp.params + ddp.grads + ddp.optimizer) / p == pytest.approx(18)  # 2 + 4 master + 4 grads + 8
    dist = costs.dp_state_bytes(p, "zero1", d, stack="megatron")
    assert dist.grads == pytest.approx(4 * p)  # the whole grad buffer on every rank
    assert (dist.params + dist.grads + dist.optimizer) / p == pytest.approx(6 + 12 / d)
    # --grad-reduce-in-bf16 (NeMo launcher's grad_sync_dtype=bf16) keeps bf16 main gradients
    bf16 = costs.dp_state_bytes(p, "zero1", d, stack="megatron-bf16-grads")
    assert (bf16.params + bf16.grads + bf16.optimizer) / p == pytest.approx(4 + 12 / d)


def test_the_published_rows_that_reduced_gradients_in_bf16_keep_bf16_gradients_the_others_fp32():
    """--grad-reduce-dtype bf16 (the NeMo launcher's grad_sync_dtype=bf16) is a flag of the row's software,
    not a rule keyed by who published it: those rows keep bf16 main gradients, the other Megatron-family
    rows fp32."""
    rows = load_published(RUNS_CSV)
    bf16 = [r for r in rows if "--grad-reduce-dtype bf16" in r.software]
    fp32 = [r for r in rows if r.software_spec.stack in ("nemo", "megatron-core", "megatron-flash")
            and "--grad-reduce-dtype" not in r.software]
    assert bf16 and fp32
    assert {options_of(r).memory_stack for r in bf16} == {"megatron-bf16-grads"}
    assert {options_of(r).memory_stack for r in fp32} <= {"megatron", "nemo"}


def test_a_rank_holds_a_communicator_per_group_it_is_in_omnis_group_pool_included():
    """simulator/memory.py communicators: the world's, every layout group the runtime creates with the
    rank in it (the counting shortcut equals the runtime's enumeration), and every group of omni's
    sequence-parallel pool it is in (built at start-up: each size any step may name, not only the
    step's); its need grows by the measured figure per communicator."""
    from collections import Counter

    from omnibench.process_groups import group_counts, groups_of_rank, pool_groups
    from tests.test_omni_planner import _omni7b_plan

    p = _omni7b_plan(cp=4, microbatches=2, options={"encoder_sp_scheme": "all"})
    named = Counter(r for gs in p.options["long_short"]["groups"].values() for g in gs for r in g)
    pool = Counter(r for g in pool_groups(p.layouts, p.options["long_short"]["pool"]) for r in g)
    assert named and all(pool[r] > named[r] for r in named)  # the pool holds sizes this step does not name
    counted = group_counts(p.layouts)
    world = max(r for lay in p.layouts.values() for r in lay.ranks) + 1
    for r in range(world):
        assert groups_of_rank(p.layouts, r) == counted.get(r, 0)
        assert communicators(p, r) == 1 + counted.get(r, 0) + pool.get(r, 0)
    r = next(iter(named))
    assert EAGER_ALLOCATOR.outside_for(communicators(p, r)) == pytest.approx(
        EAGER_ALLOCATOR.outside + (counted[r] + pool[r]) * EAGER_ALLOCATOR.per_communicator)


@pytest.mark.parametrize("tp,pp,cp,dp_shard", [(1, 1, 1, 0), (2, 2, 2, 0), (1, 2, 2, 2), (2, 1, 1, 4)])
def test_counting_groups_without_enumerating_them_matches_the_runtimes_groups(tp, pp, cp, dp_shard):
    from omnibench.process_groups import fewest_groups, group_counts, groups_of_rank
    from systems.common import encoder_layout, llm_layout, with_dp_shard

    world = 32
    parallel = ParallelSpec(world_size=world, tp=tp, pp=pp, cp=cp, dp_shard=dp_shard)
    layouts = {"llm": llm_layout(parallel, range(world)),
               "vision": with_dp_shard(encoder_layout("vision", range(world // 2), tp=1, sp=2), parallel)}
    counted = group_counts(layouts)
    assert [groups_of_rank(layouts, r) for r in range(world)] == [counted.get(r, 0) for r in range(world)]
    assert fewest_groups(layouts, world) == min(counted.get(r, 0) for r in range(world))


@pytest.mark.parametrize("where", ["below-need", "between", "above-reserve"])
def test_the_fits_verdict_and_the_reported_peak_are_one_consistent_pair(where):
    # a run that fits never reports a peak over the device (the allocator hands its cache back under
    # pressure); one that does not fit reports a peak over it; the record says what fits compares
    res = _result()
    need = res.peak_needed
    capacity = {"below-need": need * 0.99, "between": (need + res.peak_memory) / 2,
                "above-reserve": res.peak_memory * 1.5}[where]
    got = check_fit(replace(res, memory_capacity=capacity))
    m = got.metrics()
    assert got.fits == (m["peak_memory_gib"] <= m["memory_capacity_gib"]), m
    assert got.fits == (m["peak_memory_needed_gib"] <= m["memory_capacity_gib"])
    assert m["peak_memory_unpressured_gib"] == pytest.approx(res.peak_memory / GiB)
    assert m["peak_memory_gib"] >= m["peak_memory_needed_gib"] - 1e-9
    assert "peak_memory_needed_gib" in m["fits_rule"] and "memory_capacity_gib" in m["fits_rule"]

"""Pipelining with FSDP: a schedule that unshards each model chunk ahead of its first use
(SimOptions.pp_prefetch_unshard, torch.distributed.pipelining's UNSHARD actions) leaves only the rank's
first gather of the step in line. Without it every chunk's first forward and first backward wait for a
gather, and under interleaving those waits sit on the pipeline fill's critical path."""

from __future__ import annotations

import pytest

from omnibench.specs.model import LLMSpec, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from simulator.engine import SimOptions, simulate
from simulator.hardware import load_cluster
from simulator.published import PublishedRun, options_of
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(120)

# 8 layers large enough for their gathers to matter, a vocabulary small enough that the head is noise
FLAT = MultimodalSpec("flat", LLMSpec("flat", layers=8, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=8))


def _step(pp: int, v: int, prefetch: bool, dp: int = 2, m: int = 8):
    world = pp * dp * 8
    par = ParallelSpec(world_size=world, tp=8, pp=pp, virtual_stages=v, microbatches=m)
    par.validate(FLAT)
    batch = Batch(0, [Sample(i, "text", (Segment("text", 4096),)) for i in range(m * dp)])
    plan = get_planner("homogeneous").plan(FLAT, par, batch)
    return simulate(plan, FLAT, load_cluster("h100", world),
                    options=SimOptions(sequence_parallel=True, p2p_scatter_gather=True, pp_prefetch_unshard=prefetch))


@pytest.mark.parametrize("v", [1, 2])
def test_prefetched_unshards_shorten_a_pipelined_fsdp_step(v):
    inline, ahead = _step(4, v, False), _step(4, v, True)
    assert ahead.step_time < inline.step_time
    # the gathers still happen (the same bytes on the wire): only their wait moves
    assert ahead.ranks[0].comm_busy == pytest.approx(inline.ranks[0].comm_busy)
    assert ahead.ranks[0].exposed_comm < inline.ranks[0].exposed_comm


def test_the_first_gather_of_a_step_stays_in_line():
    # one chunk: its gathering actions are the first forward (nothing before it to hide the gather
    # behind) and the first backward (unshard prefetched behind the forwards)
    inline, ahead = _step(2, 1, False, m=2), _step(2, 1, True, m=2)

    def first(res, kind):
        return min((s for s in res.spans if s.rank == 0 and s.kind == kind), key=lambda s: s.start).duration

    assert first(ahead, "forward") == pytest.approx(first(inline, "forward"))
    assert first(ahead, "backward") < first(inline, "backward")


def test_inert_without_pipelining():
    # pp 1: FSDP reshards after every forward and prefetches layer by layer; no chunk to unshard ahead
    assert _step(1, 1, True).step_time == _step(1, 1, False).step_time


def test_published_rows_get_it_from_their_stack():
    def row(software: str) -> PublishedRun:
        return PublishedRun(name="r", source="s", split="heldout", hardware="h100", gpus=64, model_kind="llama",
                            layers=8, hidden=8192, heads=64, kv_heads=8, ffn=28672, glu=True, vocab=8, seq=4096,
                            tp=8, pp=4, vpp=1, cp=1, cp_kind="", ep=1, dp_mode="fsdp", global_batch=16,
                            micro_batch=1, recompute="none", precision="bf16", stack="other", software=f"--stack {software}",
                            step_time_s=1.0)

    assert options_of(row("torchtitan")).pp_prefetch_unshard
    assert options_of(row("torchtitan-compile")).pp_prefetch_unshard
    assert not options_of(row("megatron-core")).pp_prefetch_unshard
    assert not options_of(row("megatron-flash")).pp_prefetch_unshard

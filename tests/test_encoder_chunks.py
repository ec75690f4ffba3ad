"""Encoder chunking (omnibench/runtime/encoder_chunks.py): chunks of whole attention units under
checkpointing give the unchunked outputs and gradients; the chunk count is agreed from the Plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnibench.models import build_model
from omnibench.models.inputs import pack, synthesize
from omnibench.plan import Layout
from omnibench.runtime.encoder_chunks import EncoderChunks, agreed_count, chunk_pieces
from omnibench.runtime.executor import dummy_sample
from omnibench.specs.costs import chunk_units, encoder_chunk_sizes
from omnibench.specs.presets import get_model
from workloads.sample import Sample, Segment


def test_chunk_units_keep_units_whole_under_the_budget():
    assert chunk_units([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert chunk_units([4, 20, 4], 8) == [(0, 1), (1, 2), (2, 3)]  # a unit over the budget stands alone
    assert chunk_units([4, 4, 0], 8) == [(0, 3)]  # an empty unit joins the chunk before it
    assert chunk_units([4, 4], 0) == [(0, 2)]
    with pytest.raises(ValueError, match="encoder_chunk_tokens"):
        chunk_units([4], -2)
    # a video's temporal groups are units: a 6-frame video of 16 patches per frame at budget 40
    assert encoder_chunk_sizes("vision", [(6, 4, 4)], 40) == [32, 32, 32]
    assert encoder_chunk_sizes("audio", [40, 16, 24], 20) == [20, 20]


def test_chunk_pieces_cut_a_video_at_frame_groups():
    pieces = chunk_pieces("vision", [(1, 4, 4), (5, 4, 4)], 40)
    assert pieces == [(0, 32, [[1, 4, 4], [1, 4, 4]]), (32, 64, [[2, 4, 4]]), (64, 96, [[2, 4, 4]])]
    assert chunk_pieces("audio", [40, 16, 24], 20) == [(0, 40, [40]), (40, 80, [16, 24])]


def _samples():
    return [
        Sample(0, "t", (Segment("text", 3), Segment("video", 5 * 4, 5 * 16, grid_thw=(5, 4, 4)),
                        Segment("audio", 10, 20, mel_frames=40), Segment("text", 4))),
        Sample(1, "t", (Segment("text", 3), Segment("image", 6, 24, grid_thw=(1, 4, 6)),
                        Segment("audio", 4, 8, mel_frames=16), Segment("text", 4))),
        Sample(2, "t", (Segment("text", 3), Segment("audio", 6, 12, mel_frames=24), Segment("text", 2))),
    ]


def _fake_executor(model, spec, samples, members=(0,)):
    """What EncoderChunks reads of the executor: one rank, its modules, a plan with its microbatch."""
    by_id = {s.sample_id: s for s in samples}
    assignment = {m: {r: [tuple(s.sample_id for s in samples)] for r in members} for m in ("vision", "audio")}
    plan = SimpleNamespace(assignment=assignment, sample=lambda i: by_id[i])
    layouts = {m: Layout(m, tuple(members), dp=len(members)) for m in ("vision", "audio")}
    return SimpleNamespace(modules={"vision": model.vision, "audio": model.audio}, dtype=torch.float32,
                           device=torch.device("cpu"), spec=spec, plan=plan, layouts=layouts, fsdp={}, rank=0)


@pytest.mark.parametrize("budget", [1, 20, 40, 100])
def test_chunked_encoders_give_the_unchunked_outputs_and_gradients(budget):
    spec = get_model("tiny-omni")
    samples = _samples()
    packed = pack([synthesize(s, spec) for s in samples])
    runs = {}
    for chunked in (False, True):
        model = build_model(spec, seed=0)
        ex = _fake_executor(model, spec, samples)
        chunks = EncoderChunks(budget)
        outs = {}
        for module in ("vision", "audio"):
            if chunked:
                out = chunks.forward(ex, module, 0, samples, packed, dummy_sample(module))
            elif module == "vision":
                out = model.vision(packed.pixel_patches, packed.grid_thw)
            else:
                out = model.audio(packed.mel, packed.mel_lens)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
            if chunked:
                chunks.backward(module, 0, g, getattr(model, module))
            else:
                out.backward(g)
            outs[module] = out.detach()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        runs[chunked] = (outs, grads)
    (plain_out, plain_grads), (chunk_out, chunk_grads) = runs[False], runs[True]
    for m in plain_out:
        assert torch.allclose(chunk_out[m], plain_out[m], atol=1e-6, rtol=0), m
    assert set(chunk_grads) == set(plain_grads) and len(plain_grads) > 10
    for k, g in plain_grads.items():
        # to 1e-6 of the gradient's scale: a weight gradient sums over tokens, in chunks it sums in
        # another order (fp32 rounding), and nothing else may differ
        err = (chunk_grads[k] - g).abs().max().item()
        assert err <= 1e-6 * max(1.0, g.abs().max().item()), f"{k}: {err}"


def test_the_chunked_forward_keeps_no_graph_only_the_chunk_inputs():
    """Between forward and backward nothing is saved for autograd; what is kept are the chunks'
    inputs (views of one cast copy of the pixels) and grids, cut at frame groups."""
    spec = get_model("tiny-omni")
    samples = _samples()
    packed = pack([synthesize(s, spec) for s in samples])
    model = build_model(spec, seed=0)
    ex = _fake_executor(model, spec, samples)
    saved = []
    chunks = EncoderChunks(40)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = chunks.forward(ex, "vision", 0, samples, packed, dummy_sample("vision"))
    assert not saved and not out.requires_grad
    held, sizes, _ = chunks.held[("vision", 0)]
    # a 5-frame video and an image: chunks of 32, 32 and 16 + 24 patches, 8, 8 and 10 output tokens
    assert [(x.shape[0], g.tolist()) for x, g, _ in held] == [
        (32, [[2, 4, 4]]), (32, [[2, 4, 4]]), (40, [[1, 4, 4], [1, 4, 6]])]
    assert sizes == [8, 8, 10]


def test_the_chunk_count_is_the_most_any_member_needs():
    spec = get_model("tiny-omni")
    long = Sample(5, "t", (Segment("text", 2), Segment("video", 6 * 4, 6 * 16, grid_thw=(6, 4, 4))))
    short = Sample(6, "t", (Segment("text", 2), Segment("image", 4, 16, grid_thw=(1, 4, 4))))
    by_id = {5: long, 6: short}
    plan = SimpleNamespace(assignment={"vision": {0: [(6,), ()], 1: [(5,), (6,)]}}, sample=lambda i: by_id[i])
    lay = Layout("vision", (0, 1), dp=2)
    dummy = dummy_sample("vision")
    assert agreed_count(plan, lay, (0, 1), "vision", 0, 32, dummy) == 3  # rank 1's video: 3 chunks
    assert agreed_count(plan, lay, (0,), "vision", 0, 32, dummy) == 1
    assert agreed_count(plan, lay, (0, 1), "vision", 1, 32, dummy) == 1  # an empty microbatch: one dummy
    del spec


# ------------------------------------------------------------------ 4 gloo ranks, loss parity

CHUNK_TOKENS = 16  # below a tiny 2-frame video (32 patches) and most microbatches: uneven counts


def _uneven_counts(system: str, batches, module: str = "vision") -> bool:
    """Whether some encoder microbatch needs a different number of chunks on two members of the
    module's data-parallel group (without the agreement FSDP would hang there)."""
    from omnibench.specs.parallel import ParallelSpec
    from systems import get_planner
    from systems.common import data_rank

    spec = get_model("tiny-omni")
    for b in batches:
        plan = get_planner(system).plan(spec, ParallelSpec(world_size=4), b)
        lay = plan.layouts[module]
        for group in lay.groups("dp"):
            mbs = [plan.assignment[module][data_rank(lay, r)] for r in group]
            for mb in range(min(len(m) for m in mbs)):
                counts = {len(encoder_chunk_sizes(module, _inputs(plan, m[mb], module), CHUNK_TOKENS)) for m in mbs}
                if len(counts) > 1:
                    return True
    return False


def _inputs(plan, ids, module):
    from omnibench.runtime.encoder_chunks import encoder_inputs

    return encoder_inputs([plan.sample(i) for i in ids] or [dummy_sample(module)], module)


CHUNK_SYSTEMS = ("homogeneous", "colocated", "temporal")
# Two steps (AdamW): the second one steps from the moments the first left, and both batches already have
# microbatches whose chunk counts differ between members (_uneven_counts); a third adds nothing.
CHUNK_STEPS = 2


@pytest.fixture(scope="module")
def chunk_runs(tmp_path_factory):
    """Every chunked-encoder parity run in one launch of ranks (tests/parity.py)."""
    from parity import Run, make_batches, run_all
    from test_omni_parity import long_batches

    runs = [Run(s, s, "tiny-omni", make_batches(CHUNK_STEPS), {"encoder_chunk_tokens": CHUNK_TOKENS})
            for s in CHUNK_SYSTEMS]
    runs.append(Run("omni", "omni", "tiny-omni", long_batches(CHUNK_STEPS), {
        "options": {}, "encoder_chunk_tokens": CHUNK_TOKENS, "recompute": "vision=full,audio=full"}))
    return run_all(tmp_path_factory.mktemp("chunks"), runs)


@pytest.mark.timeout(900)  # the first test's setup launches all of them
@pytest.mark.xdist_group("parity-chunks")
@pytest.mark.parametrize("system", CHUNK_SYSTEMS)
def test_chunked_fsdp_encoders_train_like_a_single_process(chunk_runs, system):
    """FSDP encoders, chunk counts that differ between members: same losses and parameters as the
    single process (no hang: every member runs the agreed count, dummies for the rest)."""
    from parity import assert_parity, make_batches, reference

    assert _uneven_counts(system, make_batches(CHUNK_STEPS))
    assert_parity(*chunk_runs[system].get(), *reference("tiny-omni", make_batches(CHUNK_STEPS)))


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("parity-chunks")
def test_chunked_encoders_keep_omni_long_short_exact(chunk_runs):
    """omni: replicated encoders, long inputs over the sequence-parallel group (left whole), short
    ones chunked; full recompute inside the chunks too (nested checkpoints)."""
    from parity import assert_parity, reference
    from test_omni_parity import long_batches

    assert_parity(*chunk_runs["omni"].get(), *reference("tiny-omni", long_batches(CHUNK_STEPS)))


def test_the_simulator_counts_chunks_less_memory_one_more_encoder_forward():
    """The estimate `simulate`, `plan` and the pre-launch check share: chunking a long video lowers a
    rank's peak and adds the chunks' second forward to the encoder's backward."""
    from omnibench.specs.parallel import ParallelSpec
    from simulator.engine import Engine, SimOptions
    from simulator.hardware import load_cluster
    from systems import get_planner
    from workloads.sample import Batch

    spec = get_model("qwen2-vl-7b@2L")
    video = (Segment("text", 8), Segment("video", 64 * 256, 64 * 1024, grid_thw=(64, 32, 32)), Segment("text", 8))
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=2), Batch(0, [Sample(i, "v", video)
                                                                                       for i in range(2)]))
    runs = {c: Engine(plan, spec, load_cluster("h100", 2), options=SimOptions(
        recompute="vision=full", check_memory=False, encoder_chunk_tokens=c)).run() for c in (0, 16384)}
    peak = {c: max(r.memory_bytes for r in res.ranks) for c, res in runs.items()}
    assert peak[16384] < peak[0] - 4 * 2**30  # 82 KB per patch kept unchunked: 5 GiB of 65,536 patches

    def vision_backward(res):
        return sum(s.duration for s in res.spans if s.kind == "backward" and s.action.module == "vision")

    assert vision_backward(runs[16384]) > 1.2 * vision_backward(runs[0])

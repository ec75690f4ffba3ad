"""Models train from workload samples on CPU; inputs are deterministic; init is per-parameter deterministic."""

from __future__ import annotations

import pytest
import torch

from omnibench.models import build_model, init_weights
from omnibench.models.inputs import loss_token_count, pack, special_ids, synthesize
from omnibench.models.llm import Transformer
from omnibench.models.moe import MoE
from omnibench.specs.costs import model_params
from omnibench.specs.model import MoESpec, SpecError
from omnibench.specs.presets import MODEL_PRESETS, get_model
from workloads.sample import Sample, Segment
from workloads.tokens import audio_encoder_len, audio_llm_tokens, audio_mel_frames, image_grid_thw

pytestmark = pytest.mark.timeout(120)



def _image(w, h):
    t, gh, gw = image_grid_thw(w, h)
    return Segment("image", t * gh * gw // 4, t * gh * gw, width=w, height=h, grid_thw=(t, gh, gw))


def _audio(seconds):
    m = audio_mel_frames(seconds)
    return Segment("audio", audio_llm_tokens(m), audio_encoder_len(m), seconds=seconds, mel_frames=m)


def _samples():
    return [
        Sample(11, "caption", (Segment("text", 12), _image(112, 84), Segment("text", 30))),
        Sample(12, "asr", (Segment("text", 8), _audio(1.3), Segment("text", 25))),
        Sample(
            13, "video", (Segment("text", 6), Segment("video", 24, 96, frames=4, grid_thw=(2, 4, 12)),
                          Segment("text", 20)),
        ),
        Sample(14, "text", (Segment("text", 40),)),
    ]


@pytest.mark.parametrize("name", ["tiny-omni", "tiny-omni-moe"])
def test_adamw_steps_on_one_batch_lower_the_loss(name):
    torch.manual_seed(0)
    spec = get_model(name)
    model = build_model(spec, seed=0)
    batch = pack([synthesize(s, spec) for s in _samples()])
    # 2e-3: at 3e-3 Adam overshoots on some draws of the synthetic batch (MoE's loss rose once).
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(5):
        loss_sum, n, aux = model.forward_loss(batch)
        loss = loss_sum / n + aux
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    # every encoder got gradient from the LLM loss through the scatter
    assert model.vision.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.audio.conv1.weight.grad.abs().sum() > 0


def test_model_parameter_count_equals_spec_count_for_tiny_presets():
    for name, spec in MODEL_PRESETS.items():
        if not name.startswith("tiny"):
            continue
        model = build_model(spec, seed=None)
        assert sum(p.numel() for p in model.parameters()) == model_params(spec)["total"], name


def test_synthesize_is_deterministic_and_follows_segment_token_rules():
    spec = get_model("tiny-omni")
    a = synthesize(_samples()[1], spec)
    b = synthesize(_samples()[1], spec)
    for field in ("input_ids", "labels", "mel", "mel_lens", "audio_positions"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    sample = _samples()[0]
    x = synthesize(sample, spec)
    assert len(x) == sample.llm_tokens
    ids = special_ids(spec.llm.vocab)
    assert int((x.input_ids == ids["image"]).sum()) == sample.segments[1].llm_tokens
    assert torch.equal(x.input_ids[x.vision_positions], torch.full_like(x.vision_positions, ids["image"]))
    # loss only on the response (last text segment), labels already shifted
    n_resp = sample.segments[2].llm_tokens
    assert int((x.labels != -100).sum()) == n_resp
    start = len(x) - n_resp
    assert torch.equal(x.labels[start - 1 : -1], x.input_ids[start:])
    assert synthesize(Sample(99, "t", sample.segments), spec).input_ids.ne(x.input_ids).any()


def test_loss_token_count_from_segments_equals_synthesized_labels():
    from workloads.stream import WorkloadStream

    spec = get_model("tiny-omni")
    samples = list(_samples())
    samples += [Sample(90, "t", (Segment("text", 1),)), Sample(91, "t", (Segment("text", 0), Segment("text", 5))),
                Sample(92, "v", (_image(28, 28),)), Sample(93, "t", (Segment("text", 4), _image(28, 28)))]
    for wl in ("mixed_video", "omni_av", "text_only"):
        samples += WorkloadStream(wl, seed=1, global_batch_tokens=2048, length_scale=0.02,
                                  max_sample_tokens=256).batch(3).samples
    counts = [loss_token_count(s) for s in samples]
    assert counts == [int((synthesize(s, spec).labels != -100).sum()) for s in samples]
    assert 0 < sum(counts) and 0 in counts


def test_encoders_emit_exactly_the_segments_llm_tokens():
    spec = get_model("tiny-omni")
    model = build_model(spec, seed=0)
    segs = [_audio(s) for s in (0.5, 2.0, 3.7)] + [Segment("audio", 7, 15, mel_frames=31)]  # odd frames too
    sample = Sample(5, "a", tuple(segs) + (Segment("text", 3),))
    x = synthesize(sample, spec)
    with torch.no_grad():
        out = model.audio(x.mel, x.mel_lens)
    assert out.shape == (sum(s.llm_tokens for s in segs), spec.llm.hidden)
    vis = Sample(6, "v", (_image(300, 200), Segment("text", 2)))
    y = synthesize(vis, spec)
    with torch.no_grad():
        assert model.vision(y.pixel_patches, y.grid_thw).shape == (vis.segments[0].llm_tokens, spec.llm.hidden)


def test_long_audio_is_windowed_at_30_seconds():
    spec = get_model("tiny-audio")
    model = build_model(spec, seed=0)
    seg = _audio(31.0)  # 3100 frames -> 1550 positions: windows of 1500 and 50
    x = synthesize(Sample(7, "a", (seg, Segment("text", 2))), spec)
    with torch.no_grad():
        full = model.audio(x.mel, x.mel_lens)
        head = model.audio(x.mel[:3000], [3000])
    assert full.shape[0] == seg.llm_tokens == 775
    # Attention never crosses the window; only the conv at the window's last position sees one more frame.
    torch.testing.assert_close(full[:749], head[:749])


def test_pack_restarts_positions_and_offsets_encoder_positions():
    spec = get_model("tiny-omni")
    parts = [synthesize(s, spec) for s in _samples()]
    batch = pack(parts)
    lens = [len(p) for p in parts]
    assert batch.cu_seqlens.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert batch.max_seqlen == max(lens)
    assert batch.position_ids[lens[0]] == 0
    ids = special_ids(spec.llm.vocab)
    assert torch.isin(batch.input_ids[batch.vision_positions], torch.tensor([ids["image"], ids["video"]])).all()
    assert (batch.input_ids[batch.audio_positions] == ids["audio"]).all()
    assert batch.n_loss_tokens == sum(int((p.labels != -100).sum()) for p in parts)


def test_packed_loss_equals_sum_of_per_sample_losses():
    spec = get_model("tiny-omni")
    model = build_model(spec, seed=3)
    parts = [synthesize(s, spec) for s in _samples()]
    with torch.no_grad():
        whole, n, _ = model.forward_loss(pack(parts))
        singles = [model.forward_loss(pack([p])) for p in parts]
    torch.testing.assert_close(whole, sum(s[0] for s in singles), rtol=1e-5, atol=1e-4)
    assert int(n) == sum(int(s[1]) for s in singles)


def test_sample_needing_a_missing_encoder_is_refused():
    with pytest.raises(SpecError, match="no vision encoder"):
        synthesize(_samples()[0], get_model("tiny-llm"))


def test_pipeline_stage_gets_the_same_weights_as_the_full_model():
    spec = get_model("tiny-llm")
    full = build_model(spec, seed=7)
    stage = Transformer(spec.llm)
    for name in ("0", "1"):
        del stage.layers[name]
    stage.tok_embeddings = None
    init_weights(stage, seed=7, prefix="llm.")
    full_sd = full.state_dict()
    for name, value in stage.state_dict().items():
        assert torch.equal(value, full_sd["llm." + name]), name
    assert not torch.equal(full_sd["llm.layers.2.attention.wq.weight"], full_sd["llm.layers.3.attention.wq.weight"])


def test_stage_forward_chain_equals_full_forward():
    spec = get_model("tiny-llm")
    full = build_model(spec, seed=1).llm
    first, last = Transformer(spec.llm), Transformer(spec.llm)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    del first.layers["2"], first.layers["3"], last.layers["0"], last.layers["1"]
    first.norm = first.output = last.tok_embeddings = None
    tokens = torch.randint(0, 500, (20,))
    pos = torch.cat([torch.arange(8), torch.arange(12)])
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens, pos, cu, 12), pos, cu, 12), full(tokens, pos, cu, 12))


def _dense_moe_reference(moe: MoE, x):
    probs = moe.router.gate(x).softmax(-1)
    top_p, top_i = probs.topk(moe.top_k, -1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for p, e in zip(top_p[t], top_i[t], strict=True):
            w = moe.experts
            out[t] += p * ((torch.nn.functional.silu(x[t] @ w.w1[e]) * (x[t] @ w.w3[e])) @ w.w2[e])
    if moe.shared_expert is not None:
        out += torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


@pytest.mark.parametrize("shared", [0, 24])
def test_moe_dispatch_matches_per_token_loop(shared):
    moe = MoE(16, MoESpec(experts=6, top_k=2, expert_ffn=8, shared_expert_ffn=shared))
    init_weights(moe, seed=2)
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _dense_moe_reference(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.aux_loss is not None and moe.aux_loss > 0
    assert int(moe.last_tokens_per_expert.sum()) == 13 * 2


def test_moe_experts_are_called_with_tokens_grouped_by_expert():
    moe = MoE(16, MoESpec(experts=4, top_k=2, expert_ffn=8))
    init_weights(moe, seed=0)
    seen = {}
    inner = moe.experts

    class Spy(torch.nn.Module):
        def forward(self, x, counts):
            seen["x"], seen["counts"] = x, counts
            return inner(x, counts)

    moe.experts = Spy()
    x = torch.randn(9, 16)
    moe(x)
    assert seen["x"].shape == (18, 16) and int(seen["counts"].sum()) == 18
    _, top_i = moe.router.gate(x).topk(2, -1)
    assert seen["counts"].tolist() == torch.bincount(top_i.reshape(-1), minlength=4).tolist()


def test_workload_stream_batch_trains_on_tiny_omni_moe():
    """A real generator batch (omni_av: video, image, audio, text; shrunk for CPU) trains end to end."""
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(get_workload("omni_av"), seed=0, global_batch_tokens=1024, length_scale=0.05)
    samples = stream.batch(0).samples
    assert {"audio", "text"} <= {m for s in samples for m in s.modalities}
    spec = get_model("tiny-omni-moe")
    model = build_model(spec, seed=0)
    batch = pack([synthesize(s, spec) for s in samples])
    assert batch.tokens == sum(s.llm_tokens for s in samples)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss_sum, n, aux = model.forward_loss(batch)
        opt.zero_grad()
        (loss_sum / n + aux).backward()
        opt.step()
        losses.append(loss_sum.item() / int(n))
    assert losses[-1] < losses[0] - 0.3, losses


def test_vision_shard_gets_its_own_rope_positions_and_full_cu_seqlens():
    spec = get_model("tiny-vl")
    vit = build_model(spec, seed=0).vision
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(40, 3 * 2 * 14 * 14)
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, q, k, v, cu_seqlens, max_seqlen, causal):
            seen.append((q.clone(), cu_seqlens.clone()))
            return q

    vit.layers["0"].attention.core = Recorder()
    with torch.no_grad():
        vit(pixels, grid)
        vit(pixels[8:28], grid, patch_range=(8, 28))
    (q_full, cu_full), (q_shard, cu_shard) = seen
    torch.testing.assert_close(q_shard, q_full[8:28])
    assert torch.equal(cu_shard, cu_full)
    with pytest.raises(ValueError, match="multiples of 4"):
        vit(pixels[6:28], grid, patch_range=(6, 28))


def test_experts_without_tokens_still_get_gradients():
    moe = MoE(16, MoESpec(experts=4, top_k=1, expert_ffn=8))
    init_weights(moe, seed=0)
    x = torch.randn(5, 16)
    counts = torch.tensor([5, 0, 0, 0])
    moe.experts(x, counts).sum().backward()
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        assert w.grad is not None and torch.all(w.grad[1:] == 0)
    moe.experts.zero_grad(set_to_none=True)
    moe.experts(x[:0], torch.zeros(4, dtype=torch.long)).sum().backward()
    assert all(w.grad is not None for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))


def test_the_vision_tower_moves_its_angles_to_the_device_once_per_call_not_per_block():
    """A grid on the host (encoder chunks pass one per chunk) makes the RoPE angles host tensors; a copy
    per block synchronised a chunked H100 step 1,315 times (benchmarks/gpu_chunk_profile.py). The count
    of `.to` calls must not grow with the blocks."""
    from dataclasses import replace

    from torch.overrides import TorchFunctionMode

    class CountTo(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            moves = [a for a in (*args[1:], (kwargs or {}).get("device")) if isinstance(a, (torch.device, str))]
            if func is torch.Tensor.to and moves:  # a move to a device, not a cast
                self.n += 1
            return func(*args, **(kwargs or {}))

    base = get_model("tiny-vl")
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(40, 3 * 2 * 14 * 14)
    counts = []
    for layers in (1, 4):
        spec = replace(base, vision=replace(base.vision, layers=layers))
        vit = build_model(spec, seed=0).vision
        with torch.no_grad(), CountTo() as mode:
            vit(pixels, grid)
        counts.append(mode.n)
    assert counts[0] == counts[1], counts

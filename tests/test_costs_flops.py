"""The spec-only FLOP formulas equal what torch's FlopCounterMode counts on the real modules.

FlopCounterMode counts matmuls, convolutions and (on CUDA) fused attention kernels; on CPU the
fused SDPA kernel is invisible to it, so the models run with the "math" attention backend (explicit
matmuls over each full s x s block). Causal attention therefore is compared with
`attention="dense"`; the causal count (s(s+1)/2 pairs) is checked against a hand count.
Forward and backward are compared separately and must match exactly (integers).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from omnibench.models import build_model
from omnibench.specs.costs import audio_flops, causal_pairs, llm_flops, vision_flops
from omnibench.specs.presets import get_model

pytestmark = pytest.mark.timeout(120)



def _count(fn) -> int:
    mode = FlopCounterMode(display=False)
    with mode:
        out = fn()
    return mode.get_total_flops(), out


def _fwd_bwd(forward):
    fwd, out = _count(forward)
    bwd, _ = _count(lambda: out.float().square().mean().backward())
    return fwd, bwd


@pytest.mark.parametrize("name", ["tiny-llm", "tiny-moe"])
def test_llm_flops_match_flop_counter(name):
    spec = get_model(name)
    llm = build_model(spec, seed=0, attn_backend="math").llm
    lens = [7, 13, 5, 1]
    tokens = torch.randint(0, spec.llm.vocab, (sum(lens),))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    fwd, bwd = _fwd_bwd(lambda: llm(tokens, pos, cu, max(lens)))
    want = llm_flops(spec.llm, lens, attention="dense")
    assert fwd == want.forward
    assert bwd == want.backward


def test_pipeline_stage_flops_cover_only_its_layers():
    spec = get_model("tiny-llm")
    llm = build_model(spec, seed=0, attn_backend="math").llm
    del llm.layers["0"], llm.layers["1"], llm.layers["2"]
    llm.tok_embeddings = None
    lens = [9, 4]
    h = torch.randn(13, spec.llm.hidden, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, 9, 13], dtype=torch.int32)
    fwd, bwd = _fwd_bwd(lambda: llm(h, pos, cu, 9))
    want = llm_flops(spec.llm, lens, layers=range(3, 4), embed=False, head=True, attention="dense")
    assert (fwd, bwd) == (want.forward, want.backward)


class _Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


@pytest.mark.parametrize("name", ["tiny-llm", "tiny-moe"])
def test_full_recompute_matches_torch_checkpoint_per_block(name):
    spec = get_model(name)
    llm = build_model(spec, seed=0, attn_backend="math").llm
    for k in list(llm.layers):
        llm.layers[k] = _Checkpointed(llm.layers[k])
    lens = [10, 6]
    tokens = torch.randint(0, 500, (16,))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    fwd, bwd = _fwd_bwd(lambda: llm(tokens, pos, cu, 10))
    want = llm_flops(spec.llm, lens, attention="dense", recompute="full")
    assert fwd == want.forward
    assert bwd == want.backward + want.recompute
    blocks = want.forward - want.parts["head"]
    if spec.llm.moe is None:  # early stop skips each block's final down projection
        assert want.recompute == blocks - spec.llm.layers * 2 * 16 * spec.llm.ffn * spec.llm.hidden
    else:
        assert want.recompute == blocks


def test_encoder_full_recompute_matches_torch_checkpoint():
    spec = get_model("tiny-omni")
    model = build_model(spec, seed=0, attn_backend="math")
    for enc in (model.vision, model.audio):
        for k in list(enc.layers):
            enc.layers[k] = _Checkpointed(enc.layers[k])
    grids = [(1, 4, 6)]
    pixels = torch.randn(24, 3 * 2 * 14 * 14)
    fwd, bwd = _fwd_bwd(lambda: model.vision(pixels, torch.tensor(grids)))
    want = vision_flops(spec.vision, grids, recompute="full")
    assert (fwd, bwd) == (want.forward, want.backward + want.recompute)
    mel = torch.randn(200, spec.audio.n_mels)
    fwd, bwd = _fwd_bwd(lambda: model.audio(mel, [200]))
    want = audio_flops(spec.audio, [200], recompute="full")
    assert (fwd, bwd) == (want.forward, want.backward + want.recompute)


def test_vision_flops_match_flop_counter():
    spec = get_model("tiny-vl")
    vit = build_model(spec, seed=0, attn_backend="math").vision
    grids = [(1, 4, 6), (2, 2, 4)]
    d_in = 3 * 2 * 14 * 14
    pixels = torch.randn(24 + 16, d_in)
    fwd, bwd = _fwd_bwd(lambda: vit(pixels, torch.tensor(grids)))
    want = vision_flops(spec.vision, grids)
    assert fwd == want.forward
    assert bwd == want.backward  # patch embedding: weight gradient only (pixels need none)


def test_audio_flops_match_flop_counter():
    spec = get_model("tiny-audio")
    enc = build_model(spec, seed=0, attn_backend="math").audio
    mel_lens = [300, 57, 3100]  # an odd segment and one spanning two 30 s windows
    mel = torch.randn(sum(mel_lens), spec.audio.n_mels)
    fwd, bwd = _fwd_bwd(lambda: enc(mel, mel_lens))
    want = audio_flops(spec.audio, mel_lens)
    assert fwd == want.forward
    assert bwd == want.backward


def test_causal_attention_counts_half_the_pairs_plus_diagonal():
    spec = get_model("qwen2-7b").llm
    lens = [4096, 1024, 3]
    causal = llm_flops(spec, lens).parts["attention_core"]
    dense = llm_flops(spec, lens, attention="dense").parts["attention_core"]
    assert causal_pairs(lens) == 4096 * 4097 // 2 + 1024 * 1025 // 2 + 6
    assert causal / dense == pytest.approx(causal_pairs(lens) / sum(n * n for n in lens))
    # per layer: 4 * head_dim * heads * pairs
    assert causal == spec.layers * 4 * 128 * 28 * causal_pairs(lens)


def test_packing_cost_depends_on_real_lengths_not_total_tokens():
    spec = get_model("qwen2-7b").llm
    one = llm_flops(spec, [8192]).forward
    many = llm_flops(spec, [1024] * 8).forward
    assert many < one
    assert llm_flops(spec, [8192]).parts["mlp"] == llm_flops(spec, [1024] * 8).parts["mlp"]


def test_moe_counts_active_experts_and_router():
    spec = get_model("qwen3-30b-a3b").llm
    f = llm_flops(spec, [1000])
    assert f.parts["experts"] == spec.layers * 3 * 2 * 1000 * 8 * 2048 * 768
    assert f.parts["router"] == spec.layers * 2 * 1000 * 2048 * 128
    assert "mlp" not in f.parts


def test_selective_recompute_redoes_only_attention_core():
    spec = get_model("qwen2-7b").llm
    f = llm_flops(spec, [2048], recompute="selective")
    assert f.recompute == f.parts["attention_core"]
    with pytest.raises(ValueError, match="recompute must be one of"):
        llm_flops(spec, [1], recompute="some")

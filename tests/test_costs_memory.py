"""Activation and training-state memory estimates match what the real modules keep for backward.

Measured with torch's saved-tensor hooks (distinct storages, parameters excluded) with the
attention core replaced by a flash-style one that keeps only q, k, v and its output (as
flash-attn does on GPU; CPU SDPA keeps more). Parameter-sized tensors are excluded.
"""

from __future__ import annotations

import pytest
import torch

from omnibench.models import build_model
from omnibench.models.attention import VarlenAttention
from omnibench.models.loss import linear_cross_entropy
from omnibench.specs.costs import (
    audio_activation_bytes,
    llm_activation_bytes,
    loss_transient_bytes,
    training_state_bytes,
    vision_activation_bytes,
)
from omnibench.specs.presets import get_model

pytestmark = pytest.mark.timeout(120)



class _FlashLikeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, causal):
        with torch.no_grad():
            out = VarlenAttention("sdpa")(q, k, v, cu, 0, causal).contiguous()
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad):  # never called: only the forward's saved tensors are measured
        raise NotImplementedError


class _FlashLike(torch.nn.Module):
    def forward(self, q, k, v, cu, max_seqlen, causal):
        return _FlashLikeFn.apply(q, k, v, cu, causal)


def _saved_bytes(fn, module) -> int:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def keep(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn()
    return sum(seen.values())


def _model(name, dtype, layers):
    model = build_model(get_model(name), seed=0).to(dtype)
    for m in model.modules():
        if hasattr(m, "core"):
            m.core = _FlashLike()
    for part in (model.llm, model.vision, model.audio):
        if part is not None:
            for k in list(part.layers)[layers:]:
                del part.layers[k]
    return model


@pytest.mark.parametrize("name", ["tiny-llm", "tiny-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llm_activation_estimate_matches_saved_tensors(name, dtype):
    spec = get_model(name)
    t = 384
    tokens = torch.randint(0, 500, (t,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(200), torch.arange(184)])
    cu = torch.tensor([0, 200, t], dtype=torch.int32)
    labels = torch.roll(tokens, -1)
    for layers in (1, 3):
        llm = _model(name, dtype, layers).llm

        def step(llm=llm):  # the runtime's last stage: hidden states into the chunked loss
            return linear_cross_entropy(llm(tokens, pos, cu, 200, head=False), llm.output.weight, labels)[0]

        measured = _saved_bytes(step, llm)
        want = llm_activation_bytes(spec.llm, t, layers=range(layers), dtype_bytes=dtype.itemsize)
        # saved-tensor hooks see what is kept for backward, not the loss's chunk while it runs
        want -= loss_transient_bytes(spec.llm, t, dtype.itemsize)
        assert measured == pytest.approx(want, rel=0.03), (layers, measured, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_activation_estimates_match_saved_tensors(dtype):
    spec = get_model("tiny-omni")
    for layers in (1, 2):
        model = _model("tiny-omni", dtype, layers)
        pixels = torch.randn(128, 3 * 2 * 14 * 14, dtype=dtype)
        grid = torch.tensor([[1, 8, 12], [2, 4, 4]])
        got = _saved_bytes(lambda m=model, x=pixels, g=grid: m.vision(x, g).sum(), model.vision)
        want = vision_activation_bytes(spec.vision, 128, layers=range(layers), dtype_bytes=dtype.itemsize)
        assert got == pytest.approx(want, rel=0.03), ("vision", layers, got, want)
        mel = torch.randn(600, spec.audio.n_mels, dtype=dtype)
        got = _saved_bytes(lambda m=model, x=mel: m.audio(x, [200, 400]).sum(), model.audio)
        want = audio_activation_bytes(spec.audio, 300, layers=range(layers), dtype_bytes=dtype.itemsize)
        assert got == pytest.approx(want, rel=0.03), ("audio", layers, got, want)


def test_full_recompute_keeps_one_input_per_layer():
    llm = get_model("qwen2-7b").llm
    none = llm_activation_bytes(llm, 8192, head=False)
    full = llm_activation_bytes(llm, 8192, head=False, recompute="full")
    assert full < none / 5
    per_layer_input = 8192 * 2 * llm.hidden
    assert full > llm.layers * per_layer_input


def test_training_state_bytes_per_parameter():
    assert training_state_bytes(1000, "fp32").total == 16_000
    assert training_state_bytes(1000, "bf16").total == 18_000
    assert training_state_bytes(1000, "bf16", shard=8).total == 18_000 / 8
    with pytest.raises(ValueError, match="precision must be one of"):
        training_state_bytes(10, "fp8")

"""omnibench's modules reproduce HF transformers' models exactly (fp32): Qwen2 decoder, Qwen2-VL vision
tower, Qwen3-MoE decoder (logits and balance loss), Whisper encoder trunk.

The HF models are built offline from a config (random init, no download); their weights are
copied into omnibench's modules by name mapping, then outputs are compared.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnibench.models.audio import AudioEncoder  # noqa: E402
from omnibench.models.llm import Transformer  # noqa: E402
from omnibench.models.vision import VisionTransformer  # noqa: E402
from omnibench.specs.model import AudioEncoderSpec, LLMSpec, MoESpec, VisionEncoderSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)


LLM = LLMSpec(name="fid-llm", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, rope_theta=10_000.0)
VIT = VisionEncoderSpec(name="fid-vit", layers=2, hidden=64, heads=4, ffn=256, out_hidden=48, mlp="quick_gelu")


def _hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=LLM.vocab,
        hidden_size=LLM.hidden,
        intermediate_size=LLM.ffn,
        num_hidden_layers=LLM.layers,
        num_attention_heads=LLM.heads,
        num_key_value_heads=LLM.kv_heads,
        rms_norm_eps=LLM.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": LLM.rope_theta},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    # HF zero-inits biases; random ones make the bias mapping part of the check.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _load_qwen2(hf) -> Transformer:
    ours = Transformer(LLM, attn_backend="sdpa").eval()
    sd = hf.state_dict()
    mapping = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
    for i in range(LLM.layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for a, b in (("q", "wq"), ("k", "wk"), ("v", "wv")):
            mapping[f"{dst}attention.{b}.weight"] = f"{src}self_attn.{a}_proj.weight"
            mapping[f"{dst}attention.{b}.bias"] = f"{src}self_attn.{a}_proj.bias"
        mapping[f"{dst}attention.wo.weight"] = f"{src}self_attn.o_proj.weight"
        mapping[f"{dst}feed_forward.w1.weight"] = f"{src}mlp.gate_proj.weight"
        mapping[f"{dst}feed_forward.w3.weight"] = f"{src}mlp.up_proj.weight"
        mapping[f"{dst}feed_forward.w2.weight"] = f"{src}mlp.down_proj.weight"
        mapping[f"{dst}attention_norm.weight"] = f"{src}input_layernorm.weight"
        mapping[f"{dst}ffn_norm.weight"] = f"{src}post_attention_layernorm.weight"
    assert set(mapping) == set(ours.state_dict()), "every omnibench parameter is mapped"
    ours.load_state_dict({k: sd[v] for k, v in mapping.items()})
    return ours


def test_llm_matches_hf_qwen2_per_sequence_and_packed():
    hf = _hf_qwen2()
    ours = _load_qwen2(hf)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, LLM.vocab, (n,), generator=g) for n in (7, 13, 5)]
    with torch.no_grad():
        ref = [hf(input_ids=s[None]).logits[0] for s in seqs]
        packed = torch.cat(seqs)
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        cu = torch.tensor([0, 7, 20, 25], dtype=torch.int32)
        got = ours(packed, pos, cu, 13)
    torch.testing.assert_close(got, torch.cat(ref), rtol=1e-5, atol=1e-5)


def _hf_vision():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = Qwen2VLVisionConfig(
        depth=VIT.layers, embed_dim=VIT.hidden, hidden_size=VIT.out_hidden, hidden_act="quick_gelu",
        mlp_ratio=VIT.ffn // VIT.hidden, num_heads=VIT.heads, in_channels=VIT.in_channels,
        patch_size=VIT.patch_size, spatial_merge_size=VIT.merge, temporal_patch_size=VIT.temporal_patch,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen2VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _load_vision(hf) -> VisionTransformer:
    ours = VisionTransformer(VIT, attn_backend="sdpa").eval()
    sd = hf.state_dict()
    out = {"patch_embed.proj.weight": sd["patch_embed.proj.weight"].reshape(VIT.hidden, -1)}
    for name in ("ln_q.weight", "ln_q.bias"):
        out[f"merger.{name}"] = sd[f"merger.{name}"]
    for ours_name, hf_name in (("fc1", "mlp.0"), ("fc2", "mlp.2")):
        for leaf in ("weight", "bias"):
            out[f"merger.{ours_name}.{leaf}"] = sd[f"merger.{hf_name}.{leaf}"]
    for i in range(VIT.layers):
        for ours_name, hf_name in (("norm1", "norm1"), ("norm2", "norm2"), ("attention.qkv", "attn.qkv"),
                                   ("attention.proj", "attn.proj"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
            for leaf in ("weight", "bias"):
                out[f"layers.{i}.{ours_name}.{leaf}"] = sd[f"blocks.{i}.{hf_name}.{leaf}"]
    assert set(out) == set(ours.state_dict()), "every omnibench parameter is mapped"
    ours.load_state_dict(out)
    return ours


def test_vision_tower_matches_hf_qwen2_vl_on_images_and_video():
    hf = _hf_vision()
    ours = _load_vision(hf)
    grid = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 6, 2]])  # two images and a 2-group video
    d_in = VIT.in_channels * VIT.temporal_patch * VIT.patch_size**2
    n = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    pixels = torch.randn(n, d_in, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid)
    assert got.shape == (n // 4, VIT.out_hidden)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


MOE_LLM = LLMSpec(
    name="fid-moe", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, head_dim=24, qkv_bias=False,
    qk_norm=True, rope_theta=10_000.0,
    moe=MoESpec(experts=6, top_k=2, expert_ffn=32, aux_loss_coef=0.01, norm_topk_prob=True),
)


def _hf_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    m = MOE_LLM
    cfg = Qwen3MoeConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn, moe_intermediate_size=m.moe.expert_ffn,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim, num_experts=m.moe.experts, num_experts_per_tok=m.moe.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False, rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta}, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight"):  # HF zero-inits the router; make routing non-trivial
                p.normal_(0.0, 0.5)
    return model


def test_moe_llm_matches_hf_qwen3_moe_logits_and_balance_loss():
    hf = _hf_qwen3_moe()
    sd = hf.state_dict()
    ours = Transformer(MOE_LLM, attn_backend="sdpa").eval()
    ffn = MOE_LLM.moe.expert_ffn
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(MOE_LLM.layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for a, b in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
            out[f"{dst}attention.{b}.weight"] = sd[f"{src}self_attn.{a}_proj.weight"]
        out[f"{dst}attention.q_norm.weight"] = sd[f"{src}self_attn.q_norm.weight"]
        out[f"{dst}attention.k_norm.weight"] = sd[f"{src}self_attn.k_norm.weight"]
        out[f"{dst}attention_norm.weight"] = sd[f"{src}input_layernorm.weight"]
        out[f"{dst}ffn_norm.weight"] = sd[f"{src}post_attention_layernorm.weight"]
        out[f"{dst}moe.router.gate.weight"] = sd[f"{src}mlp.gate.weight"]
        gate_up = sd[f"{src}mlp.experts.gate_up_proj"]  # [E, 2*ffn, hidden], gate first
        out[f"{dst}moe.experts.w1"] = gate_up[:, :ffn].transpose(1, 2)
        out[f"{dst}moe.experts.w3"] = gate_up[:, ffn:].transpose(1, 2)
        out[f"{dst}moe.experts.w2"] = sd[f"{src}mlp.experts.down_proj"].transpose(1, 2)
    assert set(out) == set(ours.state_dict()), "every omnibench parameter is mapped"
    ours.load_state_dict({k: v.contiguous() for k, v in out.items()})

    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    tokens = torch.randint(0, MOE_LLM.vocab, (11,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=tokens[None], output_router_logits=True)
        got = ours(tokens, torch.arange(11), torch.tensor([0, 11], dtype=torch.int32), 11)
    torch.testing.assert_close(got, ref.logits[0], rtol=1e-5, atol=1e-5)
    # HF pools layer statistics before the product; per layer the two definitions coincide.
    per_layer = [
        load_balancing_loss_func((logits,), MOE_LLM.moe.experts, MOE_LLM.moe.top_k) for logits in ref.router_logits
    ]
    want = MOE_LLM.moe.aux_loss_coef * torch.stack(per_layer).mean()
    torch.testing.assert_close(ours.aux_loss(), want, rtol=1e-5, atol=1e-7)


AUDIO = AudioEncoderSpec(name="fid-audio", layers=2, hidden=64, heads=4, ffn=128, n_mels=32, max_positions=50,
                         out_hidden=48)


def test_audio_encoder_trunk_matches_hf_whisper_encoder():
    """Convs, sinusoidal positions and blocks equal HF's WhisperEncoder per 30 s window (here 50 positions);
    our pooling + final LayerNorm + projector are then applied to HF's (pre-norm) output."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(
        num_mel_bins=AUDIO.n_mels, d_model=AUDIO.hidden, encoder_layers=AUDIO.layers,
        encoder_attention_heads=AUDIO.heads, encoder_ffn_dim=AUDIO.ffn, max_source_positions=AUDIO.max_positions,
        activation_function="gelu", attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = WhisperEncoder(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ours = AudioEncoder(AUDIO, attn_backend="sdpa").eval()
    sd = hf.state_dict()
    out = {k: sd[k] for k in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias")}
    out |= {"norm.weight": sd["layer_norm.weight"], "norm.bias": sd["layer_norm.bias"]}
    out |= {k: v for k, v in ours.state_dict().items() if k.startswith("projector.")}
    for i in range(AUDIO.layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        for a, b in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("out", "wo")):
            for leaf in ("weight", "bias"):
                if f"{src}self_attn.{a}_proj.{leaf}" in sd:
                    out[f"{dst}attention.{b}.{leaf}"] = sd[f"{src}self_attn.{a}_proj.{leaf}"]
        for a, b in (("self_attn_layer_norm", "norm1"), ("final_layer_norm", "norm2"), ("fc1", "fc1"), ("fc2", "fc2")):
            for leaf in ("weight", "bias"):
                out[f"{dst}{b}.{leaf}"] = sd[f"{src}{a}.{leaf}"]
    assert set(out) == set(ours.state_dict()), "every omnibench parameter is mapped"
    ours.load_state_dict(out)
    hf.layer_norm = torch.nn.Identity()  # HF normalises before our pooling; compare the trunk, then pool

    g = torch.Generator().manual_seed(4)
    segments = [torch.randn(2 * AUDIO.max_positions, AUDIO.n_mels, generator=g) for _ in range(2)]
    with torch.no_grad():
        got = ours(torch.cat(segments), [s.shape[0] for s in segments])
        ref = []
        for seg in segments:
            trunk = hf(seg.t()[None]).last_hidden_state[0]  # [50, hidden]
            pooled = trunk.view(-1, 2, AUDIO.hidden).mean(1)
            ref.append(ours.projector(ours.norm(pooled)))
    assert got.shape == (2 * AUDIO.max_positions // 2, AUDIO.out_hidden)
    torch.testing.assert_close(got, torch.cat(ref), rtol=1e-5, atol=1e-5)

"""A model from its Hugging Face `config.json`, read with transformers' own config classes (`AutoConfig`),
for the architectures the presets cover: the Qwen2 / Llama / Qwen3 decoders and Qwen3's MoE (a text-only
model), Qwen2-VL (its ViT and merger feeding a Qwen2 decoder) and InternVL in its transformers format
(InternViT read in the Qwen2-VL block form, as the InternViT presets are: its pixel shuffle is the 2x2 merge;
QK norm, learned positions and layer scale are not modelled, the compute per patch is the same). As with
those presets, an image is one sequence of patches: InternVL's 448 px tiles, each attended within itself,
are not modelled, so its attention over a large image is priced as over one sequence (an upper bound), and
its projector as the Qwen2-VL merger.

What the presets do not cover is refused in one line saying what is missing, never approximated: a ViT
that attends in windows (Qwen2.5-VL, Qwen2.5-Omni), a CLIP tower with unmerged patches and a CLS token
(LLaVA), sliding-window attention, a decoder with dense layers among MoE ones. transformers is imported
only here, when a config is read (the `hf` extra); the rest of the specs never import it."""

from __future__ import annotations

import re
from pathlib import Path

from omnibench.specs.model import SpecError

DECODERS = ("qwen2", "qwen3", "qwen3_moe", "llama")
# the decoder of a covered multimodal config, as transformers names it (a flat Qwen2-VL config reads as itself)
TEXT_KINDS = DECODERS + ("qwen2_vl_text", "qwen2_vl")
MULTIMODAL = ("qwen2_vl", "internvl")
NOT_COVERED = {
    "qwen2_5_vl": "its ViT attends in windows of 112 px in all but 4 of its layers (window_size, "
                  "fullatt_block_indexes); the vision encoder here attends over the whole image (Qwen2-VL's)",
    "qwen2_5_omni": "its ViT attends in windows (Qwen2.5-VL's, window_size) and its thinker's audio tower "
                    "pools by chunks; the vision encoder here attends over the whole image (Qwen2-VL's)",
    "llava": "its CLIP tower feeds every patch unmerged with a CLS token; the vision encoders here merge "
             "2x2 patches (Qwen2-VL's)",
    "internvl_chat": "it is InternVL's remote-code format; give the transformers-format config "
                     "(the -hf checkpoints, model_type internvl)",
}


def is_hf_config(path: Path) -> bool:
    """A `config.json`-style file, or a checkpoint folder holding one."""
    return path.suffix.lower() == ".json" or (path.is_dir() and (path / "config.json").is_file())


def hf_model_data(path: str | Path) -> dict:
    """The MultimodalSpec fields (as `presets.model_from_dict` reads them) of the Hugging Face config at
    `path` (a .json file or a folder with config.json), named after its folder (or file); a SpecError in
    one line for anything else."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise SpecError(f"model file {path} does not exist")
    config = _read(file)
    kind = config.model_type
    if kind in NOT_COVERED:
        raise SpecError(f"model file {path}: model_type {kind} is not covered: {NOT_COVERED[kind]}")
    if kind not in DECODERS + MULTIMODAL:
        raise SpecError(f"model file {path}: model_type {kind} is not covered; allowed: "
                        f"{', '.join(DECODERS + MULTIMODAL)}")
    name = _name(file)
    data: dict = {"name": name, "llm": _llm(config, _raw(file), name, path)}
    if kind == "qwen2_vl":
        data["vision"] = _qwen2_vl_vision(config.vision_config, name)
    elif kind == "internvl":
        data["vision"] = _internvit(config, name, path)
    return data


def _read(file: Path):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise SpecError(f"model file {file}: reading a Hugging Face config needs transformers "
                        "(pip install -e '.[hf]')") from None
    from transformers.utils import logging

    logging.set_verbosity_error()  # its warnings on a config's token ids say nothing about the shapes read here
    try:
        return AutoConfig.from_pretrained(str(file))
    except Exception as exc:  # a config transformers cannot read is a user error: one line, with the file
        raise SpecError(f"model file {file}: {str(exc).splitlines()[0]}") from None


def _raw(file: Path) -> dict:
    """The config's JSON as written: which keys it sets (transformers' classes fill in their defaults)."""
    import json

    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"model file {file}: {str(exc).splitlines()[0]}") from None
    return data if isinstance(data, dict) else {}


def _name(file: Path) -> str:
    stem = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-") or "hf-model"


def _llm(config, raw: dict, name: str, path: Path) -> dict:
    text = config.get_text_config()
    kind = text.model_type
    if kind not in TEXT_KINDS:
        raise SpecError(f"model file {path}: a {kind} decoder is not covered; allowed: {', '.join(DECODERS)}")
    act = getattr(text, "hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"model file {path}: hidden_act {act} is not covered; the decoders here gate with SiLU (SwiGLU)")
    if getattr(text, "use_sliding_window", False) or "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        raise SpecError(f"model file {path}: sliding-window attention (use_sliding_window, layer_types) is not "
                        "covered; the decoders here attend over the whole sequence")
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or 0
    rope = getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
    # as written: the text config's own key, else the root's (every transformers class defaults it)
    tie = (raw.get("text_config") or {}).get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    out = {
        "name": f"{name}-llm",
        "layers": text.num_hidden_layers,
        "hidden": text.hidden_size,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "ffn": text.intermediate_size,
        "vocab": text.vocab_size,
        "head_dim": 0 if head_dim * heads == text.hidden_size else head_dim,
        # Qwen2's attention has q/k/v biases whatever its config says; Llama's and Qwen3's follow attention_bias
        "qkv_bias": kind in ("qwen2", "qwen2_vl_text", "qwen2_vl") or bool(getattr(text, "attention_bias", False)),
        "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "tie_embeddings": bool(tie),
        "norm_eps": float(text.rms_norm_eps),
    }
    if rope:
        out["rope_theta"] = float(rope)
    if kind == "qwen3_moe":
        if getattr(text, "decoder_sparse_step", 1) != 1 or getattr(text, "mlp_only_layers", None):
            raise SpecError(f"model file {path}: dense layers among MoE ones (decoder_sparse_step, mlp_only_layers) "
                            "are not covered; every layer here is MoE")
        out["moe"] = {"experts": text.num_experts, "top_k": text.num_experts_per_tok,
                      "expert_ffn": text.moe_intermediate_size, "aux_loss_coef": float(text.router_aux_loss_coef),
                      "norm_topk_prob": bool(text.norm_topk_prob)}
    return out


def _qwen2_vl_vision(v, name: str) -> dict:
    return {"name": f"{name}-vit", "layers": v.depth, "hidden": v.embed_dim, "heads": v.num_heads,
            "ffn": int(v.embed_dim * v.mlp_ratio), "patch_size": v.patch_size, "temporal_patch": v.temporal_patch_size,
            "merge": v.spatial_merge_size, "in_channels": v.in_channels, "mlp": v.hidden_act}


def _internvit(config, name: str, path: Path) -> dict:
    v = config.vision_config
    merge = round(1 / config.downsample_ratio)
    patch = v.patch_size[0] if isinstance(v.patch_size, (list, tuple)) else v.patch_size
    if v.hidden_act not in ("gelu", "quick_gelu") or merge * config.downsample_ratio != 1:
        raise SpecError(f"model file {path}: an InternViT with hidden_act {v.hidden_act} or downsample_ratio "
                        f"{config.downsample_ratio} is not covered (gelu, 0.5)")
    return {"name": f"{name}-vit", "layers": v.num_hidden_layers, "hidden": v.hidden_size,
            "heads": v.num_attention_heads, "ffn": v.intermediate_size, "patch_size": patch, "merge": merge,
            "in_channels": v.num_channels, "mlp": v.hidden_act,
            "norm": "rms" if v.norm_type == "rms_norm" else "layer", "norm_eps": float(v.layer_norm_eps)}

"""Model presets: real configurations and tiny ones for CPU tests.

The real ones copy the models' Hugging Face config.json: Qwen/Qwen2-7B, Qwen/Qwen2-72B,
Qwen/Qwen3-30B-A3B, the `vision_config` of Qwen/Qwen2-VL-7B-Instruct, OpenGVLab/InternViT-300M-448px
and the encoder of openai/whisper-large-v3.

Components (an LLM, a vision encoder, an audio encoder) are presets of their own; composed models
pick one of each and set the encoders' `out_hidden` to the LLM width. `get_model` takes a composed
name, an LLM name (text-only), or a TOML/YAML file with the same fields. No torch here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from omnibench.specs.model import (
    AudioEncoderSpec,
    LLMSpec,
    MoESpec,
    MultimodalSpec,
    SpecError,
    VisionEncoderSpec,
)

# --- LLMs ---------------------------------------------------------------------------------------

LLM_PRESETS: dict[str, LLMSpec] = {
    # Qwen2-7B (Qwen2.5-7B has the same shape): 7.62B parameters.
    "qwen2-7b": LLMSpec(
        name="qwen2-7b",
        layers=28,
        hidden=3584,
        heads=28,
        kv_heads=4,
        ffn=18944,
        vocab=152_064,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
    ),
    # Qwen2-72B shape (80 x 8192, 64/8 heads, FFN 29568): 72.7B parameters.
    "dense-72b": LLMSpec(
        name="dense-72b",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        ffn=29568,
        vocab=152_064,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
    ),
    # Qwen3-30B-A3B: 30.5B total, 3.3B active; head_dim 128 (not hidden/heads), q/k RMSNorm, no qkv bias.
    "qwen3-30b-a3b": LLMSpec(
        name="qwen3-30b-a3b",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        ffn=6144,
        vocab=151_936,
        head_dim=128,
        qkv_bias=False,
        qk_norm=True,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        moe=MoESpec(experts=128, top_k=8, expert_ffn=768, aux_loss_coef=0.001, norm_topk_prob=True),
    ),
    # Tiny ones: heads/kv_heads divisible by 2 (tp=2), 4 layers (pp=2), experts divisible by 2 (ep=2).
    "tiny-llm": LLMSpec(
        name="tiny-llm",
        layers=4,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn=128,
        vocab=512,
        rope_theta=10_000.0,
    ),
    "tiny-moe": LLMSpec(
        name="tiny-moe",
        layers=4,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn=128,
        vocab=512,
        head_dim=16,
        qkv_bias=False,
        qk_norm=True,
        rope_theta=10_000.0,
        moe=MoESpec(experts=8, top_k=2, expert_ffn=32, aux_loss_coef=0.01),
    ),
}

# --- vision encoders ------------------------------------------------------------------------------

VISION_PRESETS: dict[str, VisionEncoderSpec] = {
    # Qwen2-VL ViT with its own 2x2 merger to 3584 (the Qwen2-VL-7B width): 675.8M parameters.
    "vit-675m": VisionEncoderSpec(
        name="vit-675m",
        layers=32,
        hidden=1280,
        heads=16,
        ffn=5120,
        out_hidden=3584,
        mlp="quick_gelu",
    ),
    # InternViT-300M's trunk (24 x 1024, 16 heads, FFN 4096) in the Qwen2-VL block form: ~303M without
    # a projector (InternVL counts its MLP projector separately). Its learned absolute positions, CLS
    # token and layer scale are not modelled; the compute per patch is the same.
    "internvit-300m": VisionEncoderSpec(
        name="internvit-300m",
        layers=24,
        hidden=1024,
        heads=16,
        ffn=4096,
        mlp="gelu",
    ),
    # InternViT-6B-448px-V1-5 (OpenGVLab's config.json on the Hugging Face hub: 45 layers of width 3200, 25
    # heads, FFN 12800, GELU; 5.54B parameters, the last 3 of the original 48 blocks discarded), the vision
    # encoder of InternVL 1.5-2.5's largest models, in the Qwen2-VL block form: its QK normalisation, learned
    # absolute positions and layer scale are not modelled (the compute per patch is the same). 25 heads: a
    # Ulysses degree must divide them (1, 5 or 25).
    "internvit-6b": VisionEncoderSpec(
        name="internvit-6b",
        layers=45,
        hidden=3200,
        heads=25,
        ffn=12800,
        mlp="gelu",
    ),
    "tiny-vit": VisionEncoderSpec(name="tiny-vit", layers=2, hidden=64, heads=4, ffn=128, mlp="quick_gelu"),
}

# --- audio encoders -------------------------------------------------------------------------------

AUDIO_PRESETS: dict[str, AudioEncoderSpec] = {
    # Whisper-large-v3 encoder: 635M parameters (fixed sinusoidal positions are not parameters).
    "whisper-large-enc": AudioEncoderSpec(
        name="whisper-large-enc",
        layers=32,
        hidden=1280,
        heads=20,
        ffn=5120,
        n_mels=128,
    ),
    "tiny-whisper": AudioEncoderSpec(name="tiny-whisper", layers=2, hidden=64, heads=4, ffn=128, n_mels=32),
}


def compose(
    name: str, llm: LLMSpec, vision: VisionEncoderSpec | None = None, audio: AudioEncoderSpec | None = None
) -> MultimodalSpec:
    """Join encoders to an LLM: each encoder projects to the LLM's width."""
    return MultimodalSpec(
        name=name,
        llm=llm,
        vision=None if vision is None else dataclasses.replace(vision, out_hidden=llm.hidden),
        audio=None if audio is None else dataclasses.replace(audio, out_hidden=llm.hidden),
    )


def _composed() -> dict[str, MultimodalSpec]:
    L, V, A = LLM_PRESETS, VISION_PRESETS, AUDIO_PRESETS
    return {
        "qwen2-vl-7b": compose("qwen2-vl-7b", L["qwen2-7b"], V["vit-675m"]),
        "internvl-8b": compose("internvl-8b", L["qwen2-7b"], V["internvit-300m"]),
        "omni-7b": compose("omni-7b", L["qwen2-7b"], V["vit-675m"], A["whisper-large-enc"]),
        "vl-72b": compose("vl-72b", L["dense-72b"], V["vit-675m"]),
        "omni-72b": compose("omni-72b", L["dense-72b"], V["vit-675m"], A["whisper-large-enc"]),
        "omni-moe-30b": compose("omni-moe-30b", L["qwen3-30b-a3b"], V["vit-675m"], A["whisper-large-enc"]),
        # InternVL2.5-78B's shape: InternViT-6B feeding a 72B dense LLM (an encoder of several billion parameters)
        "internvl-78b": compose("internvl-78b", L["dense-72b"], V["internvit-6b"]),
        "llm-7b": compose("llm-7b", L["qwen2-7b"]),
        "llm-72b": compose("llm-72b", L["dense-72b"]),
        "llm-moe-30b": compose("llm-moe-30b", L["qwen3-30b-a3b"]),
        "tiny-llm": compose("tiny-llm", L["tiny-llm"]),
        "tiny-vl": compose("tiny-vl", L["tiny-llm"], V["tiny-vit"]),
        "tiny-audio": compose("tiny-audio", L["tiny-llm"], None, A["tiny-whisper"]),
        "tiny-omni": compose("tiny-omni", L["tiny-llm"], V["tiny-vit"], A["tiny-whisper"]),
        "tiny-moe": compose("tiny-moe", L["tiny-moe"]),
        "tiny-omni-moe": compose("tiny-omni-moe", L["tiny-moe"], V["tiny-vit"], A["tiny-whisper"]),
    }


MODEL_PRESETS: dict[str, MultimodalSpec] = _composed()


def list_models() -> list[str]:
    """Names `get_model` accepts: composed models, then bare LLMs not already listed."""
    return list(MODEL_PRESETS) + [n for n in LLM_PRESETS if n not in MODEL_PRESETS]


def list_components() -> dict[str, list[str]]:
    return {"llm": list(LLM_PRESETS), "vision": list(VISION_PRESETS), "audio": list(AUDIO_PRESETS)}


def get_component(name: str) -> LLMSpec | VisionEncoderSpec | AudioEncoderSpec:
    for table in (LLM_PRESETS, VISION_PRESETS, AUDIO_PRESETS):
        if name in table:
            return table[name]
    allowed = ", ".join(n for t in (LLM_PRESETS, VISION_PRESETS, AUDIO_PRESETS) for n in t)
    raise SpecError(f"unknown model component {name!r}; allowed: {allowed}")


REDUCED_DEPTH = re.compile(r"^(?P<base>.+)@(?P<layers>\d+)L$")
WITHOUT_ENCODER = re.compile(r"^(?P<base>.+)@no-(?P<module>vision|audio)$")


PUBLISHED_PREFIX = "published/"
PUBLISHED_MODELS = Path(__file__).resolve().parents[2] / "results" / "validation" / "models"


def get_model(name_or_path: str | Path) -> MultimodalSpec:
    """A preset name, a .toml/.yaml/.yml file with MultimodalSpec's fields (validated), or a Hugging Face
    config.json (or the checkpoint folder holding it) of an architecture the presets cover
    (`omnibench.specs.hf_config`).

    `NAME@<n>L` is preset NAME with its LLM cut to its first n layers (encoders, widths and vocabulary
    unchanged): the real shapes at a depth that fits one GPU, e.g. `omni-7b@4L`. `NAME@no-audio` (or
    `@no-vision`) is NAME without that encoder: what a workload whose samples never feed it trains
    (omnibench.resolve.model_for_workload). Suffixes chain: `omni-7b@8L@no-audio`.
    """
    text = str(name_or_path)
    without = WITHOUT_ENCODER.match(text)
    if without:
        base = get_model(without["base"])
        if without["module"] not in base.encoders:
            raise SpecError(f"model {text!r}: {without['base']} has no {without['module']} encoder")
        return dataclasses.replace(base, name=text, **{without["module"]: None})
    cut = REDUCED_DEPTH.match(text)
    if cut:
        base, layers = get_model(cut["base"]), int(cut["layers"])
        if not 1 <= layers <= base.llm.layers:
            raise SpecError(f"model {text!r}: the LLM layer count must be in [1, {base.llm.layers}], got {layers}")
        return dataclasses.replace(base, name=text, llm=dataclasses.replace(base.llm, layers=layers))
    if text.startswith(PUBLISHED_PREFIX):
        # the published runs' models (results/validation/models/): `validate --published` prints them so,
        # and the command runs from any folder
        name = text.removeprefix(PUBLISHED_PREFIX)
        path = PUBLISHED_MODELS / f"{name}.toml"
        if "/" in name or not path.is_file():
            known = sorted(p.stem for p in PUBLISHED_MODELS.glob("*.toml"))
            raise SpecError(f"unknown model {text!r}; the published runs' models are {PUBLISHED_PREFIX}<name> for "
                            f"<name> in {', '.join(known[:3])}, ... ({len(known)} in results/validation/models)")
        return model_from_dict(_read_file(path), source=f"model {text}")
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text]
    if text in LLM_PRESETS:
        return compose(text, LLM_PRESETS[text])
    path = Path(text)
    from omnibench.specs.hf_config import hf_model_data, is_hf_config

    if is_hf_config(path):
        return model_from_dict(hf_model_data(path), source=f"model file {text}")
    if path.suffix.lower() in (".toml", ".yaml", ".yml"):
        if path.is_dir():
            raise SpecError(f"model file {text} is a folder; give a .toml/.yaml file")
        if not path.is_file():
            raise SpecError(f"model file {text} does not exist")
        try:
            return model_from_dict(_read_file(path), source=f"model file {text}")
        except SpecError as e:  # the file in every message: a run may name several
            msg = str(e)
            raise SpecError(msg if msg.startswith(("cannot parse model file", "model file"))
                            else f"model file {text}: {msg}") from None
    raise SpecError(f"unknown model {text!r}; allowed: {', '.join(list_models())}, a .toml/.yaml file or a "
                    "Hugging Face config.json (or its folder)")


def _read_file(path: Path) -> dict:
    try:
        if path.suffix.lower() == ".toml":
            import tomllib  # Python >= 3.11

            data = tomllib.loads(path.read_text())
        else:
            import yaml

            data = yaml.safe_load(path.read_text())
    except Exception as exc:  # a parse error is a user error: one line, with the file
        raise SpecError(f"cannot parse model file {path}: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise SpecError(f"model file {path} must hold a table/mapping at top level")
    return data


def _build(cls, data: Any, where: str, nested: dict[str, type] | None = None):
    """A frozen spec from a mapping; unknown or mistyped fields raise SpecError naming `where.field`."""
    if not isinstance(data, dict):
        raise SpecError(f"{where} must be a table/mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(f"{where}.{unknown[0]} is not a field; allowed: {', '.join(fields)}")
    kw = {}
    for key, value in data.items():
        if nested and key in nested:
            kw[key] = None if value is None else _build(nested[key], value, f"{where}.{key}")
            continue
        default = fields[key].default
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:  # required fields: name (str) and integer sizes
            ok = (
                isinstance(value, str)
                if key == "name"
                else isinstance(value, int) and not isinstance(value, bool)
            )
        if not ok:
            expected = ("true or false" if isinstance(default, bool) else "a string" if isinstance(default, str)
                        or key == "name" else "a number" if isinstance(default, float) else "an integer")
            raise SpecError(f"{where}.{key} has the wrong type ({type(value).__name__}: {value!r}); "
                            f"expected {expected}")
        kw[key] = value
    missing = [n for n, f in fields.items() if n not in kw and f.default is dataclasses.MISSING]
    if missing:
        raise SpecError(f"{where}.{missing[0]} is required")
    return cls(**kw)


def model_from_dict(data: dict, source: str = "model") -> MultimodalSpec:
    """A validated MultimodalSpec from plain data; encoders' out_hidden default to the LLM width.

    Component values may be preset names: `llm = "qwen2-7b"`, `vision = "vit-675m"`.
    """
    if not isinstance(data, dict):
        raise SpecError(f"{source} must be a table/mapping")
    allowed = ("name", "llm", "vision", "audio")
    for key in data:
        if key not in allowed:
            raise SpecError(f"{source}: {key} is not a field; allowed: {', '.join(allowed)}")
    if "llm" not in data:
        raise SpecError(f"{source}: llm is required")

    def part(key, cls, table, nested=None):
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            if value not in table:
                raise SpecError(f"{key} = {value!r} is not a {key} preset; allowed: {', '.join(table)}")
            return table[value]
        return _build(cls, value, key, nested)

    llm = part("llm", LLMSpec, LLM_PRESETS, {"moe": MoESpec})
    vision = part("vision", VisionEncoderSpec, VISION_PRESETS)
    audio = part("audio", AudioEncoderSpec, AUDIO_PRESETS)
    name = data.get("name", llm.name)
    if not isinstance(name, str):
        raise SpecError(f"{source}: name must be a string")
    spec = MultimodalSpec(
        name=name,
        llm=llm,
        vision=None
        if vision is None
        else dataclasses.replace(vision, out_hidden=vision.out_hidden or llm.hidden),
        audio=None
        if audio is None
        else dataclasses.replace(audio, out_hidden=audio.out_hidden or llm.hidden),
    )
    validate_model(spec)
    return spec


# Numeric fields that are not sizes (every other number is a count or width, >= 1): their bounds.
POSITIVE_REALS = ("rope_theta", "norm_eps")
ZERO_OR_MORE = ("head_dim", "shared_expert_ffn", "aux_loss_coef", "out_hidden")

# The largest value of each number a spec holds, the same in the LLM, the MoE block and the encoders.
# Each is far above every published model, so every real one passes; each is low enough that the plans,
# FLOP counts and memory estimates built from a spec stay exact and finish in seconds: a layer count of
# 1e9 makes a plan of a billion layers (minutes, then MemoryError), one of 1e20 overflows len().
MAX_WIDTH = 65_536  # the widest published dense transformers: 25,600 (Megatron 1T), 20,480 (MT-NLG 530B)
MAX_FFN = 4 * MAX_WIDTH  # the widest published: 102,400 (Megatron 1T); 4 x hidden is the usual ratio
LIMITS: dict[str, int | float] = {
    "layers": 1024,  # the deepest published dense transformers have ~120-200 layers (Megatron 1T: 128)
    "hidden": MAX_WIDTH,
    "out_hidden": MAX_WIDTH,
    "heads": 1024,  # the most published: 160 (Megatron 1T), 128 (Llama 3.1 405B)
    "kv_heads": 1024,
    "head_dim": 4096,  # the widest published: 256 (Gemma)
    "ffn": MAX_FFN,
    "expert_ffn": MAX_FFN,
    "shared_expert_ffn": MAX_FFN,
    "vocab": 1 << 22,  # ~4M ids; the largest published: 262,144 (Gemma 3)
    "experts": 4096,  # the most published: 256 (DeepSeek-V3), 128 (Qwen3-MoE)
    "top_k": 4096,
    "patch_size": 1024,  # ViTs use 14-32 px patches
    "temporal_patch": 64,  # Qwen2-VL: 2 frames per patch
    "merge": 64,  # Qwen2-VL: 2 x 2 patches per token
    "in_channels": 64,  # RGB: 3; multispectral imagery: ~13
    "n_mels": 1024,  # Whisper: 80 or 128
    "max_positions": 1 << 20,  # Whisper: 1,500 per 30 s window
    "rope_theta": 1e12,  # published: 1e4 (RoPE) to 1e7-1e8 (million-token contexts)
    "norm_eps": 1.0,  # published: 1e-6 to 1e-5
    "aux_loss_coef": 1.0,  # a weight beside the language-model loss; published: 1e-4 to 1e-2
}


def _num(v: int | float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def _numbers(part, where: str) -> None:
    """Every number of a spec part finite and in range, named as the user's file names it."""
    for f in dataclasses.fields(part):
        v = getattr(part, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise SpecError(f"{where}.{f.name} must be a finite number, got {v}")
        if f.name in POSITIVE_REALS and v <= 0:
            raise SpecError(f"{where}.{f.name} must be > 0, got {v}")
        if f.name in ZERO_OR_MORE and v < 0:
            raise SpecError(f"{where}.{f.name} must be >= 0, got {v}")
        top = LIMITS.get(f.name)
        if top is not None and v > top:
            low = "(0" if f.name in POSITIVE_REALS else "[0" if f.name in ZERO_OR_MORE else "[1"
            raise SpecError(f"{where}.{f.name} must be in {low}, {_num(top)}], got {_num(v)}")


def validate_model(spec: MultimodalSpec) -> None:
    """Architecture consistency; raises SpecError naming the field the user sets (never a derived one)."""
    llm = spec.llm
    for part, where in ((llm, "llm"), (llm.moe, "llm.moe"), (spec.vision, "vision"), (spec.audio, "audio")):
        if part is not None:
            _numbers(part, where)
    for key in ("layers", "hidden", "heads", "kv_heads", "vocab"):
        if getattr(llm, key) < 1:
            raise SpecError(f"llm.{key} must be >= 1, got {getattr(llm, key)}")
    if llm.ffn < 1 and llm.moe is None:
        raise SpecError(f"llm.ffn must be >= 1 for a dense LLM, got {llm.ffn}")
    if llm.ffn < 0:
        raise SpecError(f"llm.ffn must be >= 0 (0: none beside the experts), got {llm.ffn}")
    if llm.heads % llm.kv_heads:
        raise SpecError(f"llm.kv_heads ({llm.kv_heads}) must divide llm.heads ({llm.heads})")
    if not llm.head_dim and llm.hidden % llm.heads:
        raise SpecError(
            f"llm.heads ({llm.heads}) must divide llm.hidden ({llm.hidden}) unless head_dim is set"
        )
    if llm.dim_head % 2:
        given = (f"llm.head_dim ({llm.head_dim})" if llm.head_dim
                 else f"llm.hidden / llm.heads ({llm.hidden} / {llm.heads} = {llm.dim_head}, the head dim)")
        raise SpecError(f"{given} must be even for RoPE")
    for key, allowed in (("mlp", ("swiglu", "gelu")), ("norm", ("rms", "layer")),
                         ("positions", ("rope", "learned", "alibi"))):
        if getattr(llm, key) not in allowed:
            raise SpecError(f"llm.{key} must be one of {', '.join(allowed)}; got {getattr(llm, key)!r}")
    if llm.vocab < 4:
        raise SpecError(f"llm.vocab must be >= 4 (three ids are media placeholders), got {llm.vocab}")
    if llm.moe is not None:
        moe = llm.moe
        if moe.experts < 1:
            raise SpecError(f"llm.moe.experts must be >= 1, got {moe.experts}")
        if not 1 <= moe.top_k <= moe.experts:
            raise SpecError(f"llm.moe.top_k must be in [1, experts={moe.experts}], got {moe.top_k}")
        if moe.expert_ffn < 1:
            raise SpecError(f"llm.moe.expert_ffn must be >= 1, got {moe.expert_ffn}")
    if spec.vision is not None:
        v = spec.vision
        for key in ("layers", "hidden", "heads", "ffn", "patch_size", "temporal_patch", "merge", "in_channels"):
            if getattr(v, key) < 1:
                raise SpecError(f"vision.{key} must be >= 1, got {getattr(v, key)}")
        if v.hidden % v.heads or (v.hidden // v.heads) % 4:
            raise SpecError(
                f"vision.heads ({v.heads}) must split vision.hidden ({v.hidden}) into head dims divisible by 4"
            )
        if v.mlp not in ("gelu", "quick_gelu", "swiglu"):
            raise SpecError(f"vision.mlp must be one of gelu, quick_gelu, swiglu; got {v.mlp!r}")
        if v.norm not in ("layer", "rms"):
            raise SpecError(f"vision.norm must be one of layer, rms; got {v.norm!r}")
    if spec.audio is not None:
        a = spec.audio
        for key in ("layers", "hidden", "heads", "ffn", "n_mels"):
            if getattr(a, key) < 1:
                raise SpecError(f"audio.{key} must be >= 1, got {getattr(a, key)}")
        if a.hidden % a.heads or a.hidden % 2:
            raise SpecError(f"audio.heads ({a.heads}) must divide audio.hidden ({a.hidden}), hidden even")
        if a.pool != 2:
            raise SpecError(f"audio.pool must be 2 (the workloads' 25 tokens/s rule); got {a.pool}")
        if a.max_positions < 2 or a.max_positions % a.pool:
            raise SpecError(f"audio.max_positions must be a positive multiple of pool, got {a.max_positions}")


for _spec in MODEL_PRESETS.values():
    validate_model(_spec)

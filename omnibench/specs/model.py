"""Model specs: the architecture as data. No torch here (the simulator counts FLOPs from these).

Field names follow the papers' and HF configs' words. Presets live in `presets.py`.
"""

from __future__ import annotations

from dataclasses import dataclass


class SpecError(ValueError):
    """A spec field holds an impossible value; the message names the field and what is allowed."""


@dataclass(frozen=True)
class MoESpec:
    experts: int
    top_k: int
    expert_ffn: int
    shared_expert_ffn: int = 0  # 0: no shared expert
    aux_loss_coef: float = 0.001
    norm_topk_prob: bool = True  # Qwen3-MoE renormalises the top-k router probabilities


@dataclass(frozen=True)
class LLMSpec:
    """Qwen2 / Llama-style decoder: RMSNorm, RoPE, GQA, SwiGLU (or MoE) MLP; or, for the simulator's
    published GPT rows, a GPT block (`mlp="gelu"`: two matrices of width `ffn`, `norm="layer"`,
    learned or ALiBi `positions`). The runtime builds the Llama-style block only."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = True  # Qwen2 has q/k/v bias; Qwen3 does not
    qk_norm: bool = False  # Qwen3
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    moe: MoESpec | None = None
    mlp: str = "swiglu"  # "swiglu" (gate, up, down) | "gelu" (GPT: fc1, fc2)
    norm: str = "rms"  # "rms" | "layer"
    positions: str = "rope"  # "rope" | "learned" (GPT-3) | "alibi" (MPT): no rotary kernels

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads


@dataclass(frozen=True)
class VisionEncoderSpec:
    """Qwen2-VL-style ViT: 14 px patches, temporal patch 2, 2D RoPE, 2x2 merger to `out_hidden`."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    patch_size: int = 14
    temporal_patch: int = 2
    merge: int = 2
    in_channels: int = 3
    out_hidden: int = 0  # LLM hidden; set when composed into a MultimodalSpec
    mlp: str = "gelu"  # "gelu" | "quick_gelu" (what Qwen2-VL uses) | "swiglu"
    norm: str = "layer"  # "layer" | "rms"
    norm_eps: float = 1e-6


@dataclass(frozen=True)
class AudioEncoderSpec:
    """Whisper-style: mel -> 2 convs (second stride 2) -> transformer -> avg-pool 2 -> projector."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    n_mels: int = 128
    pool: int = 2
    out_hidden: int = 0
    max_positions: int = 1500  # sinusoidal/learned positions per 30 s window
    norm_eps: float = 1e-5


@dataclass(frozen=True)
class MultimodalSpec:
    """Encoders feeding an LLM. `vision`/`audio` may be None (text-only or single-encoder)."""

    name: str
    llm: LLMSpec
    vision: VisionEncoderSpec | None = None
    audio: AudioEncoderSpec | None = None

    @property
    def encoders(self) -> dict[str, VisionEncoderSpec | AudioEncoderSpec]:
        out: dict[str, VisionEncoderSpec | AudioEncoderSpec] = {}
        if self.vision is not None:
            out["vision"] = self.vision
        if self.audio is not None:
            out["audio"] = self.audio
        return out


# Modules `--freeze` may name: their parameters take no gradient, no optimizer state and no gradient reduction.
FREEZABLE = ("vision", "audio", "llm")


def parse_freeze(text: str | tuple | list) -> tuple[str, ...]:
    """`--freeze`'s modules (a comma list, or the names already split) in FREEZABLE's order, each once; an
    unknown name refused in one line naming the option and the allowed names."""
    names = [x.strip() for x in text.split(",")] if isinstance(text, str) else [str(x).strip() for x in text]
    names = [x for x in names if x]
    for x in names:
        if x not in FREEZABLE:
            raise SpecError(f"--freeze: unknown module {x!r}; allowed: {', '.join(FREEZABLE)}")
    return tuple(m for m in FREEZABLE if m in names)


def model_modules(model: MultimodalSpec) -> tuple[str, ...]:
    """The modules of `model` in FREEZABLE's order: its encoders and the LLM."""
    return tuple(m for m in FREEZABLE if m == "llm" or m in model.encoders)


def check_freeze(freeze: tuple[str, ...], model: MultimodalSpec) -> None:
    """That `model` has every frozen module and that some module still trains."""
    have = model_modules(model)
    for m in parse_freeze(freeze):
        if m not in have:
            raise SpecError(f"--freeze: unknown module {m!r} for {model.name}; allowed: {', '.join(have)}")
    if freeze and set(have) <= set(freeze):
        raise SpecError(f"--freeze: {', '.join(have)} would freeze every module of {model.name}, so nothing would "
                        "train; leave at least one module out")


def freeze_for_model(freeze: tuple[str, ...], named: MultimodalSpec, model: MultimodalSpec) -> tuple[str, ...]:
    """`freeze` checked against `named` (the model the user named) and kept to the modules of `model` (what
    runs: `named` less the encoders no sample feeds, omnibench/resolve.py `model_for_workload`): an encoder
    that never runs holds nothing that trains, frozen or not. Refused where nothing of `model` trains."""
    check_freeze(freeze, named)
    kept = tuple(m for m in freeze if m in model_modules(model))
    check_freeze(kept, model)
    return kept

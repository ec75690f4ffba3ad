"""Exact FLOPs, parameter counts and memory of the models in `omnibench.models`, from specs alone.

No torch: planners, the simulator and the MFU metric all count from here. Conventions:

* FLOPs are matmul FLOPs (2 per multiply-add), the convention of MFU and of torch's
  FlopCounterMode. Norms, activations, softmax, RoPE and the loss are not counted (they are
  memory-bound and a few percent of the total at real sizes).
* Backward = 2x forward for every matmul whose input needs a gradient (input grad + weight grad);
  1x for the first op on raw data (patch embedding of pixels, first audio conv on mel): those
  inputs need no gradient, so only the weight gradient is computed.
* Attention core = QK^T and PV per head: 4 * head_dim * (query, key) pairs; pairs are counted per
  real packed sequence: s(s+1)/2 for causal (LLM), s^2 for full attention (each ViT frame group,
  each audio window). `attention="dense"` counts s^2 for causal too: what a dense-mask kernel
  (and FlopCounterMode) sees.
* Recompute: "full" re-runs each transformer block's forward in the backward, as torch's
  non-reentrant checkpoint of a block does: it stops as soon as the last tensor backward needs is
  rebuilt, so a dense block's final MLP down projection (whose output only feeds the residual add)
  is not re-run; an MoE block re-runs everything (the expert output is multiplied by the routing
  weights, so it is needed). "selective" re-runs only the attention core (Megatron's selective
  recompute).
* Layer ranges (`layers=range(a, b)`) cost a pipeline stage; `embed`/`head` say whether the stage
  holds the embedding / final norm + output projection (LLM), patch embedding / merger (vision),
  convs / projector (audio).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from omnibench.specs.model import AudioEncoderSpec, LLMSpec, MultimodalSpec, VisionEncoderSpec

RECOMPUTE = ("none", "full", "selective")
ATTENTION_COUNTS = ("causal", "dense")


@dataclass
class Flops:
    """Forward, backward and recompute matmul FLOPs of one module (or a sum of them).

    `parts` holds the forward FLOPs per part (e.g. "attention_core", "mlp") for inspection.
    """

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Work of one training step: forward + backward + recomputed forward."""
        return self.forward + self.backward + self.recompute

    def __add__(self, other: Flops) -> Flops:
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        return Flops(
            self.forward + other.forward,
            self.backward + other.backward,
            self.recompute + other.recompute,
            parts,
        )

    def _add(self, part: str, fwd: float, bwd_factor: float = 2.0) -> None:
        self.forward += fwd
        self.backward += bwd_factor * fwd
        self.parts[part] = self.parts.get(part, 0.0) + fwd


RECOMPUTED_MODULES = ("llm", "vision", "audio")


def frozen_flops(f: Flops, module: str) -> Flops:
    """What a step executes of a module whose weights take no gradient (`--freeze`): a frozen encoder
    runs its forward alone (it sits at the front of the model: no input gradient is wanted and no
    backward runs, so nothing is recomputed); a frozen LLM's backward computes the input gradients only,
    each matmul's data gradient as many FLOPs as its forward (every LLM matmul's input needs a
    gradient) and the attention core's backward whole (it has no weights)."""
    if module != "llm":
        return Flops(f.forward, 0.0, 0.0, dict(f.parts))
    core = f.parts.get("attention_core", 0.0)
    return Flops(f.forward, (f.forward - core) + 2 * core, f.recompute, dict(f.parts))


def recompute_policy(text: str) -> dict[str, str]:
    """Activation checkpointing per module from `MODE` (every module) or `module=MODE,...` (modules
    not named: none), e.g. "vision=full,audio=full" recomputes the encoders and not the LLM."""
    if "=" not in text:
        if text not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)} or module=mode,...; got {text!r}")
        return dict.fromkeys(RECOMPUTED_MODULES, text)
    policy = dict.fromkeys(RECOMPUTED_MODULES, "none")
    for part in text.split(","):
        module, _, mode = part.partition("=")
        if module.strip() not in RECOMPUTED_MODULES or mode.strip() not in RECOMPUTE:
            raise ValueError(f"recompute: {part!r} must be module=mode with module one of "
                             f"{', '.join(RECOMPUTED_MODULES)} and mode one of {', '.join(RECOMPUTE)}")
        policy[module.strip()] = mode.strip()
    return policy


def _check(recompute: str, attention: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {recompute!r}")
    if attention not in ATTENTION_COUNTS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_COUNTS)}; got {attention!r}")


def _layer_count(total: int, layers: Iterable[int] | None) -> int:
    if layers is None:
        return total
    idx = list(layers)
    bad = [i for i in idx if not 0 <= i < total]
    if bad:
        raise ValueError(f"layer {bad[0]} is outside the model's {total} layers")
    return len(idx)


def _block_recompute(
    out: Flops, block_fwd: float, core_fwd: float, recompute: str, tail: float = 0.0
) -> None:
    """`tail`: forward FLOPs at the block's end that checkpoint's early stop never re-runs."""
    if recompute == "full":
        out.recompute += block_fwd - tail
    elif recompute == "selective":
        out.recompute += core_fwd


# --- LLM ------------------------------------------------------------------------------------------


def causal_pairs(seq_lens: Sequence[int]) -> int:
    return sum(s * (s + 1) // 2 for s in seq_lens)


def llm_flops(
    llm: LLMSpec,
    seq_lens: Sequence[int],
    layers: Iterable[int] | None = None,
    embed: bool = True,
    head: bool = True,
    recompute: str = "none",
    attention: str = "causal",
) -> Flops:
    """FLOPs of the LLM (or of `layers`) over packed sequences of the given lengths.

    `embed` is free (a lookup); it is accepted for symmetry with the stage layout. `head` adds the
    output projection over every token (logits are computed for all positions).
    """
    _check(recompute, attention)
    n_layers = _layer_count(llm.layers, layers)
    t = sum(seq_lens)
    h, d = llm.hidden, llm.dim_head
    pairs = causal_pairs(seq_lens) if attention == "causal" else sum(s * s for s in seq_lens)
    out = Flops()
    proj = 2 * t * h * d * (2 * llm.heads + 2 * llm.kv_heads)
    core = 4 * d * llm.heads * pairs
    tail = 0.0
    if llm.moe is None:
        mlp = {"mlp": (3 if llm.mlp == "swiglu" else 2) * 2 * t * h * llm.ffn}
        tail = 2 * t * llm.ffn * h  # w2
    else:
        moe = llm.moe
        mlp = {
            "router": 2 * t * h * moe.experts,
            "experts": 3 * 2 * t * moe.top_k * h * moe.expert_ffn,
        }
        if moe.shared_expert_ffn:
            mlp["shared_expert"] = 3 * 2 * t * h * moe.shared_expert_ffn + 2 * t * h
    if n_layers:  # identical layers: one layer's work times the count (cheap for thousands of stages)
        out._add("attention_proj", n_layers * proj)
        out._add("attention_core", n_layers * core)
        for k, v in mlp.items():
            out._add(k, n_layers * v)
        _block_recompute(
            out, n_layers * (proj + core + sum(mlp.values())), n_layers * core, recompute, n_layers * tail
        )
    if head:
        out._add("head", 2 * t * h * llm.vocab)
    return out


def llm_params(
    llm: LLMSpec,
    layers: Iterable[int] | None = None,
    embed: bool = True,
    head: bool = True,
    active: bool = False,
) -> int:
    """Parameters of the LLM (or a stage of it). `active`: only the top-k experts count (MoE)."""
    n_layers = _layer_count(llm.layers, layers)
    h, d = llm.hidden, llm.dim_head
    attn = h * d * (2 * llm.heads + 2 * llm.kv_heads)
    if llm.qkv_bias:
        attn += d * (llm.heads + 2 * llm.kv_heads)
    if llm.qk_norm:
        attn += 2 * d
    if llm.moe is None:
        mlp = (3 if llm.mlp == "swiglu" else 2) * h * llm.ffn
    else:
        moe = llm.moe
        mlp = h * moe.experts + (moe.top_k if active else moe.experts) * 3 * h * moe.expert_ffn
        if moe.shared_expert_ffn:
            mlp += 3 * h * moe.shared_expert_ffn + h
    total = n_layers * (attn + mlp + 2 * h)
    if embed:
        total += llm.vocab * h
    if head:
        total += h + (0 if (llm.tie_embeddings and embed) else llm.vocab * h)
    return total


# --- vision ---------------------------------------------------------------------------------------


def vision_groups(grid_thws: Sequence[Sequence[int]]) -> list[int]:
    """Attention sequence lengths: one per temporal group (h*w patches) of each image/video."""
    return [h * w for t, h, w in grid_thws for _ in range(t)]


def vision_flops(
    vit: VisionEncoderSpec,
    grid_thws: Sequence[Sequence[int]],
    layers: Iterable[int] | None = None,
    patch_embed: bool = True,
    merger: bool = True,
    recompute: str = "none",
) -> Flops:
    _check(recompute, "causal")
    n_layers = _layer_count(vit.layers, layers)
    groups = vision_groups(grid_thws)
    n = sum(groups)
    h = vit.hidden
    d = h // vit.heads
    out = Flops()
    if patch_embed:
        d_in = vit.in_channels * vit.temporal_patch * vit.patch_size**2
        out._add("patch_embed", 2 * n * d_in * h, bwd_factor=1.0)
    proj = 2 * n * h * 4 * h
    core = 4 * d * vit.heads * sum(s * s for s in groups)
    mlp = 2 * n * h * vit.ffn * (3 if vit.mlp == "swiglu" else 2)
    if n_layers:
        out._add("attention_proj", n_layers * proj)
        out._add("attention_core", n_layers * core)
        out._add("mlp", n_layers * mlp)
        tail = 2 * n * vit.ffn * h
        _block_recompute(out, n_layers * (proj + core + mlp), n_layers * core, recompute, n_layers * tail)
    if merger:
        m = n // vit.merge**2
        wide = h * vit.merge**2
        out._add("merger", 2 * m * wide * (wide + (vit.out_hidden or h)))
    return out


def vision_params(
    vit: VisionEncoderSpec, layers: Iterable[int] | None = None, patch_embed: bool = True, merger: bool = True
) -> int:
    h = vit.hidden
    norm = 2 * h if vit.norm == "layer" else h
    fc1 = 2 * vit.ffn if vit.mlp == "swiglu" else vit.ffn
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * fc1 + fc1) + (vit.ffn * h + h) + 2 * norm
    total = _layer_count(vit.layers, layers) * block
    if patch_embed:
        total += vit.in_channels * vit.temporal_patch * vit.patch_size**2 * h
    if merger:
        wide = h * vit.merge**2
        out_h = vit.out_hidden or h
        total += norm + wide * wide + wide + wide * out_h + out_h
    return total


# --- audio ----------------------------------------------------------------------------------------


def audio_windows(mel_lens: Sequence[int], max_positions: int) -> list[int]:
    """Attention windows of the encoder: each segment's F//2 positions cut into max_positions pieces."""
    out = []
    for frames in mel_lens:
        n = frames // 2
        while n > 0:
            out.append(min(n, max_positions))
            n -= out[-1]
    return out


def audio_llm_tokens(mel_frames: int, pool: int = 2) -> int:
    return (mel_frames // 2) // pool


def audio_flops(
    enc: AudioEncoderSpec,
    mel_lens: Sequence[int],
    layers: Iterable[int] | None = None,
    convs: bool = True,
    projector: bool = True,
    recompute: str = "none",
) -> Flops:
    _check(recompute, "causal")
    n_layers = _layer_count(enc.layers, layers)
    windows = audio_windows(mel_lens, enc.max_positions)
    t = sum(windows)
    h = enc.hidden
    d = h // enc.heads
    out = Flops()
    if convs:
        frames = [f for f in mel_lens if f >= 2]
        out._add("conv1", 2 * sum(frames) * enc.n_mels * 3 * h, bwd_factor=1.0)
        out._add("conv2", 2 * sum((f + 1) // 2 for f in frames) * h * 3 * h)
    proj = 2 * t * h * 4 * h
    core = 4 * d * enc.heads * sum(w * w for w in windows)
    mlp = 2 * 2 * t * h * enc.ffn
    if n_layers:
        out._add("attention_proj", n_layers * proj)
        out._add("attention_core", n_layers * core)
        out._add("mlp", n_layers * mlp)
        tail = 2 * t * enc.ffn * h
        _block_recompute(out, n_layers * (proj + core + mlp), n_layers * core, recompute, n_layers * tail)
    if projector:
        pooled = sum(w // enc.pool for w in windows)
        out._add("projector", 2 * pooled * h * (enc.out_hidden or h))
    return out


def audio_params(
    enc: AudioEncoderSpec, layers: Iterable[int] | None = None, convs: bool = True, projector: bool = True
) -> int:
    h = enc.hidden
    block = (4 * h * h + 3 * h) + (h * enc.ffn + enc.ffn) + (enc.ffn * h + h) + 4 * h
    total = _layer_count(enc.layers, layers) * block + 2 * h  # final LayerNorm
    if convs:
        total += enc.n_mels * h * 3 + h + h * h * 3 + h
    if projector:
        out_h = enc.out_hidden or h
        total += h * out_h + out_h
    return total


# --- whole model ----------------------------------------------------------------------------------


def model_params(spec: MultimodalSpec, active: bool = False) -> dict[str, int]:
    """Parameters per module and in total (`active`: MoE counts top-k experts only)."""
    out = {"llm": llm_params(spec.llm, active=active)}
    if spec.vision is not None:
        out["vision"] = vision_params(spec.vision)
    if spec.audio is not None:
        out["audio"] = audio_params(spec.audio)
    out["total"] = sum(out.values())
    return out


def sample_lengths(samples) -> dict[str, list]:
    """Per-module sequence inputs of workload Samples: llm lengths, vision grids, audio mel frames."""
    out: dict[str, list] = {"llm": [], "vision": [], "audio": []}
    for s in samples:
        out["llm"].append(s.llm_tokens)
        for seg in s.segments:
            if seg.modality in ("image", "video"):
                out["vision"].append(tuple(seg.grid_thw))
            elif seg.modality == "audio":
                out["audio"].append(seg.mel_frames)
    return out


def batch_flops(spec: MultimodalSpec, samples, recompute: str = "none") -> dict[str, Flops]:
    """FLOPs per module for training on `samples` packed one sequence per sample (the MFU numerator);
    `recompute` as `recompute_policy` reads it."""
    return lengths_flops(spec, sample_lengths(samples), recompute)


def lengths_flops(spec: MultimodalSpec, lens: dict[str, list], recompute: str = "none") -> dict[str, Flops]:
    """`batch_flops` from the samples' `sample_lengths` (a caller asking for several recompute modes
    walks the samples once)."""
    policy = recompute_policy(recompute)
    out = {"llm": llm_flops(spec.llm, lens["llm"], recompute=policy["llm"])}
    if spec.vision is not None:
        out["vision"] = vision_flops(spec.vision, lens["vision"], recompute=policy["vision"])
    if spec.audio is not None:
        out["audio"] = audio_flops(spec.audio, lens["audio"], recompute=policy["audio"])
    return out


# --- encoder chunks -------------------------------------------------------------------------------


def chunk_units(units: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive attention units (vision frame groups, audio segments: attention never crosses
    one) grouped greedily into chunks of at most `budget` encoder tokens; a unit over the budget is a
    chunk of its own. Returns [start, end) index ranges over `units`; `budget` 0: one chunk of all."""
    if budget < 0:
        raise ValueError(f"encoder_chunk_tokens must be >= 0 (0 = off), got {budget}")
    if not units:
        return []
    if budget == 0:
        return [(0, len(units))]
    out, start, size = [], 0, 0
    for i, u in enumerate(units):
        if i > start and u and size + u > budget:  # an empty unit joins the chunk before it
            out.append((start, i))
            start, size = i, 0
        size += u
    out.append((start, len(units)))
    return out


def encoder_units(module: str, inputs: Sequence) -> list[int]:
    """A module's chunkable units in encoder tokens: vision, each temporal group of each grid
    (h*w patches); audio, each segment (mel_frames // 2 positions: its conv front-end sees the whole
    segment, so a segment is never cut)."""
    if module == "vision":
        return vision_groups(inputs)
    if module == "audio":
        return [int(m) // 2 for m in inputs]
    raise ValueError(f"module must be vision or audio; got {module!r}")


def encoder_chunk_sizes(module: str, inputs: Sequence, budget: int) -> list[int]:
    """Encoder tokens of each chunk one microbatch runs in (`inputs`: vision grids or audio mel frames)."""
    units = encoder_units(module, inputs)
    return [sum(units[a:b]) for a, b in chunk_units(units, budget)]


# --- memory ---------------------------------------------------------------------------------------

PRECISIONS = ("bf16", "fp32")


@dataclass(slots=True, unsafe_hash=True)  # made per rank and module at scale: never changed once made
class StateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def training_state_bytes(params: int, precision: str = "bf16", shard: int = 1) -> StateBytes:
    """Weights, gradients and AdamW state per rank for `params` parameters sharded `shard` ways.

    fp32: weights 4 + grads 4 + Adam m, v 8 = 16 bytes/param.
    bf16 (mixed precision): bf16 working weights 2 + fp32 master 4, fp32 grads 4 (reduced in fp32),
    Adam 8 = 18 bytes/param. With FSDP (`shard` > 1) all of it is divided by the shard count; the
    transient unsharded bf16 copy of one layer during its compute is left to activation headroom.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    p = params / shard
    weights = 6 * p if precision == "bf16" else 4 * p
    return StateBytes(params=weights, grads=4 * p, optimizer=8 * p)


# How data parallelism holds the training state (omnibench.plan.Layout.dp_mode), and the bytes per
# parameter each software stack keeps (`StateDtypes`). Every stack trains with AdamW: two fp32 moments.
DP_MODES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")


@dataclass(frozen=True)
class StateDtypes:
    """Bytes per parameter a software stack keeps for training, before any sharding.

    `weights`: the parameters every forward reads (fp32 where they are also the master copy);
    `master`: a separate fp32 copy the optimizer updates (0 when the weights are fp32);
    `grads`: the gradient the backward accumulates into; `optimizer`: AdamW's two fp32 moments.
    `grads_static`: the gradient buffer is allocated once at start-up (Megatron's contiguous
    main-grad buffer) rather than by the first backward of a step.
    """

    name: str
    weights: int
    master: int
    grads: int
    optimizer: int = 8
    grads_static: bool = False


# A module whose weights take no gradient (`--freeze`), under any stack and data-parallel mode: its bf16
# weights alone (FSDP shards them as it shards trained ones; a replicated or ZeRO module keeps them whole),
# no fp32 master, no gradients, no optimizer state: what the runtime holds for it on a bf16 run
# (omnibench/runtime/build.py casts a frozen module to the compute dtype; the optimizer never sees it).
FROZEN_DTYPES = StateDtypes("frozen", weights=2, master=0, grads=0, optimizer=0)


def frozen_state_bytes(params: float, dp_mode: str = "ddp", shard: int = 1) -> StateBytes:
    """Per rank: a frozen module's state (FROZEN_DTYPES) of `params` parameters under `dp_mode`."""
    return state_bytes(FROZEN_DTYPES, params, dp_mode, shard)


# Per stack, per how data parallelism holds the state: "replicated" (one rank, DDP), "zero" (ZeRO-1/2)
# and "sharded" (FSDP/HSDP).
STATE_DTYPES = {
    "eager": {
        # This project's runtime (omnibench/runtime), bf16 compute. One rank or DDP: fp32 parameters
        # that autocast casts to bf16 in every forward (the casts are activations:
        # simulator/memory.py `_weight_copies`), fp32 gradients.
        "replicated": StateDtypes("eager", weights=4, master=0, grads=4),
        # ZeRO-1/2 (omnibench/runtime/zero.py): bf16 weights, an fp32 master slice per rank, fp32 main
        # gradients accumulated from the first backward by a hook (whole until grad_sync's
        # reduce-scatter; ZeRO-2 keeps only the rank's slice after it).
        "zero": StateDtypes("eager", weights=2, master=4, grads=4),
        # FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards of
        # parameters, gradients and moments; a layer's bf16 weights exist only while gathered.
        "sharded": StateDtypes("eager", weights=4, master=0, grads=4),
    },
    # torchtitan: FSDP2 with the same MixedPrecisionPolicy (fp32 sharded state, bf16 gathered layers,
    # fp32 reduce-scatter); without sharding, fp32 parameters under autocast.
    "torchtitan": {
        "replicated": StateDtypes("torchtitan", weights=4, master=0, grads=4),
        "zero": StateDtypes("torchtitan", weights=2, master=4, grads=4),
        "sharded": StateDtypes("torchtitan", weights=4, master=0, grads=4),
    },
    # Megatron-LM (Megatron Core, bf16): bf16 parameters and a main-grad buffer allocated at start-up
    # (gradient accumulation fusion writes into it) in fp32: "bfloat16 requires gradient accumulation
    # and all-reduce to be done in fp32" (megatron/training/arguments.py, NVIDIA/Megatron-LM at
    # 307dcf37: under --bf16 it sets accumulate_allreduce_grads_in_fp32, main grads fp32, unless
    # --grad-reduce-in-bf16). The optimizer keeps fp32 master weights and AdamW moments. The
    # distributed optimizer (zero1) shards those 12 bytes only: the grad buffer stays whole on every
    # rank (its reduce-scatter writes into the rank's slice of it), so 18 bytes per parameter under
    # DDP, 6 + 12/d distributed (docs/source/api-guide/dist_optimizer.md: "bf16 param, fp32 grads").
    # "sharded" under this convention is what the DeepSpeed ZeRO-3 rows of Narayanan et al. 2021 ran
    # (fp16 gradient partitions and reduce buckets in the parameters' dtype: `_zero3_grad_buffer`), so
    # it keeps 2-byte gradients. DeepSpeed ZeRO-1/2/3 keep the same fp32 master and moments
    # (Rajbhandari et al. 2020: K = 12 bytes per parameter).
    "megatron": {
        "replicated": StateDtypes("megatron", weights=2, master=4, grads=4, grads_static=True),
        "zero": StateDtypes("megatron", weights=2, master=4, grads=4, grads_static=True),
        "sharded": StateDtypes("megatron", weights=2, master=4, grads=2),
    },
    # Megatron-LM run with --grad-reduce-in-bf16 (NeMo's launcher scripts' grad_sync_dtype=bf16):
    # bf16 main gradients, 16 bytes per parameter under DDP, 4 + 12/d distributed.
    "megatron-bf16-grads": {
        "replicated": StateDtypes("megatron-bf16-grads", weights=2, master=4, grads=2, grads_static=True),
        "zero": StateDtypes("megatron-bf16-grads", weights=2, master=4, grads=2, grads_static=True),
        "sharded": StateDtypes("megatron-bf16-grads", weights=2, master=4, grads=2),
    },
    # NeMo 2.0 on Megatron Core: the same with fp32 main gradients (its bf16 DDP config sets
    # grad_reduce_in_fp32): 18 bytes per parameter under DDP, 6 + 12/d distributed.
    "nemo": {
        "replicated": StateDtypes("nemo", weights=2, master=4, grads=4, grads_static=True),
        "zero": StateDtypes("nemo", weights=2, master=4, grads=4, grads_static=True),
        "sharded": StateDtypes("nemo", weights=2, master=4, grads=4),
    },
}
STATE_STACKS = tuple(STATE_DTYPES)


def state_dtypes(stack: str, dp_mode: str) -> StateDtypes:
    """The bytes per parameter `stack` keeps under `dp_mode` (see STATE_DTYPES)."""
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode must be one of {', '.join(DP_MODES)}; got {dp_mode!r}")
    if stack not in STATE_DTYPES:
        raise ValueError(f"stack must be one of {', '.join(STATE_STACKS)}; got {stack!r}")
    kind = "replicated" if dp_mode == "ddp" else "zero" if dp_mode.startswith("zero") else "sharded"
    return STATE_DTYPES[stack][kind]


def dp_state_bytes(params: float, dp_mode: str = "ddp", shard: int = 1, stack: str = "eager") -> StateBytes:
    """Per rank: weights (with the master copy), gradients and AdamW state of `params` parameters
    whose data-parallel group has `shard` ranks, under `dp_mode`:

    - ddp: every rank holds everything;
    - zero1 (Megatron's distributed optimizer, DeepSpeed ZeRO-1): master weights and moments sharded;
    - zero2: the gradients too (what a rank keeps after the reduce-scatter);
    - fsdp / hsdp (ZeRO-3; `shard` = the HSDP shard group): everything sharded.
    """
    return state_bytes(state_dtypes(stack, dp_mode), params, dp_mode, shard)


def state_bytes(d: StateDtypes, params: float, dp_mode: str, shard: int = 1) -> StateBytes:
    """`dp_state_bytes` for given bytes per parameter."""
    if shard < 1:
        raise ValueError(f"shard must be >= 1, got {shard}")
    p = float(params)
    full = dp_mode in ("fsdp", "hsdp")
    weights = d.weights * p / (shard if full else 1)
    master = d.master * p / (shard if dp_mode != "ddp" else 1)
    grads = d.grads * p / (shard if dp_mode in ("zero2", "fsdp", "hsdp") else 1)
    optimizer = d.optimizer * p / (shard if dp_mode != "ddp" else 1)
    return StateBytes(params=weights + master, grads=grads, optimizer=optimizer)


# Activation bytes per token (or patch / audio position) that a block keeps for its backward, for
# the modules in omnibench.models with a flash-style attention core (it keeps q, k, v and its
# output, never an s x s matrix). `b` is the compute dtype's size; RMSNorm works in fp32 and keeps
# an fp32 copy of its input. Checked against torch's saved-tensor hooks in tests/test_costs_memory.py.


def _rmsnorm_bytes(width: int, b: int) -> int:
    return 4 * width + 2 * b * width + 4  # fp32 input copy, normalised, scaled output; 1/rms


def _layernorm_bytes(width: int, b: int) -> int:
    return 2 * b * width + 8  # input, output; mean and 1/std


def llm_layer_bytes(llm: LLMSpec, b: int = 2) -> int:
    h, d = llm.hidden, llm.dim_head
    q, kv = llm.heads * d, llm.kv_heads * d
    out = 2 * _rmsnorm_bytes(h, b) + b * (2 * q + 2 * kv)  # norms; q, k, v, attention output
    if llm.qk_norm:
        out += (4 + b) * (q + kv) + 4 * (llm.heads + llm.kv_heads)
    if llm.moe is None:
        # w1 out, w3 out, silu out, w2 input (GELU MLP: fc1 out, fc2 input)
        return out + (4 if llm.mlp == "swiglu" else 2) * b * llm.ffn
    moe = llm.moe
    k = moe.top_k
    out += 4 * moe.experts + 24 * k  # router probabilities; top-k weights, expert order (int64)
    out += 3 * b * k * h + 4 * b * k * moe.expert_ffn  # gathered tokens, expert outputs; SwiGLU per copy
    if moe.shared_expert_ffn:
        out += 4 * b * moe.shared_expert_ffn + 2 * b * h
    return out


def vision_layer_bytes(vit: VisionEncoderSpec, b: int = 2) -> int:
    h = vit.hidden
    norm = _layernorm_bytes(h, b) if vit.norm == "layer" else _rmsnorm_bytes(h, b)
    mlp = {"quick_gelu": 3, "gelu": 2, "swiglu": 4}[vit.mlp] * b * vit.ffn
    return 2 * norm + 6 * b * h + mlp  # fused qkv output, rotated q and k, attention output


def audio_layer_bytes(enc: AudioEncoderSpec, b: int = 2) -> int:
    h = enc.hidden
    return 2 * _layernorm_bytes(h, b) + 4 * b * h + 2 * b * enc.ffn  # q, k, v, output; GELU in and out


# --- activations per software stack ------------------------------------------------------------------
# What one LLM block keeps per token depends on the kernels that run, not on the GPU:
#
# - "eager": this project's modules (omnibench/models), measured by saved-tensor hooks above;
# - "torchtitan": torchtitan's Llama (torchtitan/models/llama/model.py at 9dec370, Dec 2024, the
#   commit of its published H100 benchmarks): fp32 RMSNorm math, RoPE in fp32 complex numbers (saves
#   nothing per token: the other operand is the constant table), k and v repeated to every query
#   head before SDPA's flash kernel (which saves q, k, v, its output and the log-sum-exp), the
#   attention output made contiguous for wo, SwiGLU as three saved ffn-wide tensors and the product.
#   Its "selective" is op-level SAC (parallelize_llama.py `_save_list`): the outputs of every mm
#   except every second one (wq, wv, w1, w2 of wq wk wv wo w1 w3 w2) and of SDPA are kept with the
#   checkpoint's input; the rest is recomputed in the backward;
# - "megatron": Megatron Core with Transformer Engine (fused LayerNorm-linear, flash attention with
#   GQA kept as kv heads, fused SwiGLU): the block's input and each linear's input (the layer norm's
#   output), q, k, v and the attention output, the fc1 output (gate and up) and fc2's input
#   (Korthikanti et al. 2022, Table 2 without dropout masks and without the 5as^2 scores flash never
#   stores); "selective" recomputes the attention core only, which under flash stores nothing.
#
# "full" recomputation keeps each block's input; its backward rebuilds one block at a time.
#
# "torchtitan-compile" is torchtitan with each block under torch.compile (parallelize_llama.py
# `apply_compile`): the compiled backward saves only what the backward reads (min-cut
# partitioning; under SAC it drops the w2 output eager SAC caches for the recomputation, which the
# backward never reads) and fuses element-wise chains, so no fp32 norm or RoPE copies exist.
#
# "torchtitan-compile-loss" also compiles the loss (torchtitan from May 2025,
# components/loss.py `build_cross_entropy_loss`; the December 2024 version left it eager because
# compiling it "causes CUDA errors", train.py at 9dec370).
#
# "torchtitan-fused-norm" is torchtitan with its Triton RMSNorm (`norm_type = "fused_rmsnorm"`, the
# Llama 2 13B and Llama 3 8B configs of April 2024): a norm keeps its bf16 input and 1/rms only.
# "megatron-fp8" is Megatron with Transformer Engine's FP8 linears: each linear keeps its input in
# FP8 (1 byte) for its weight gradient.
ACTIVATION_STACKS = ("eager", "torchtitan", "torchtitan-fused-norm", "torchtitan-compile", "torchtitan-compile-loss",
                     "megatron", "megatron-fp8")


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per token of one block: `held` from its forward to its backward, `recompute` rebuilt
    while its backward runs (recomputation), `working` the gradients and temporaries alive inside
    its backward at their high point (measured with torch's MemTracker: tests/test_memory_tracker.py)."""

    held: float
    recompute: float
    working: float


def _mlp_width(llm: LLMSpec) -> int:
    """Per token, the ffn width a token's MLP runs (an MoE token's top-k experts plus the shared one)."""
    if llm.moe is None:
        return llm.ffn
    return llm.moe.top_k * llm.moe.expert_ffn + llm.moe.shared_expert_ffn


def llm_layer_memory(llm: LLMSpec, recompute: str = "none", stack: str = "eager", b: int = 2) -> LayerMemory:
    """One LLM block under `recompute` as `stack` runs it (see ACTIVATION_STACKS)."""
    _check(recompute, "causal")
    if stack not in ACTIVATION_STACKS:
        raise ValueError(f"stack must be one of {', '.join(ACTIVATION_STACKS)}; got {stack!r}")
    h, d = llm.hidden, llm.dim_head
    q, kv = llm.heads * d, llm.kv_heads * d
    f = _mlp_width(llm)
    lse = 4 * llm.heads  # fp32 log-sum-exp per query head
    moe_extra = llm_layer_bytes(llm, b) - llm_layer_bytes(_dense(llm), b) if llm.moe is not None else 0
    glu = llm.mlp == "swiglu" or llm.moe is not None
    if stack == "eager":
        none = float(llm_layer_bytes(llm, b))
    elif stack in ("torchtitan", "torchtitan-fused-norm"):
        # norms; q, k and v repeated to every head, the core's output and its contiguous copy; SwiGLU's
        # w1, w3 and silu outputs and their product (a GELU MLP: fc1's output and fc2's input)
        norm = _rmsnorm_bytes(h, b) if stack == "torchtitan" else 2 * b * h + 4
        none = 2 * norm + b * (q + 2 * q + q + q) + lse + (4 if glu else 2) * b * f + moe_extra
    elif stack.startswith("torchtitan-compile"):
        # normed inputs (with 1/rms), q and k, v repeated for SDPA, its output; w1 and w3 outputs and
        # their product (w2's weight gradient)
        none = 2 * (b * h + 4) + b * (q + 2 * q + q) + lse + (3 if glu else 2) * b * f + moe_extra
    else:
        # input and normed input twice (attention, MLP), q, k, v, the core's output; fc1 out (2 f for
        # the gated pair), fc2 in
        none = b * (4 * h + 2 * q + 2 * kv + (3 if glu else 2) * f) + lse + 8
        if stack == "megatron-fp8":
            # FP8 copies for the linears' weight gradients: the two normed inputs and fc2's input in one
            # byte instead of two, and one more byte per element of the core's output (kept by the core)
            none += -(b - 1) * (2 * h + f) + q
    # the backward's high point inside a block: the MLP's ffn-wide gradients (two at once, with the
    # tensors they are computed from) and the hidden-wide gradients flowing through the block
    working = b * (2 * f + 2 * h)
    if recompute == "full":
        return LayerMemory(held=b * h, recompute=none, working=working)
    if recompute == "selective" and stack in ("torchtitan", "torchtitan-fused-norm"):
        # input; wq, wv, SDPA, w1, w2 outputs (a GELU MLP's two matmuls are the 5th and 6th: fc1's only)
        sac = b * (h + q + kv + q + f + (h if glu else 0)) + lse
        return LayerMemory(held=sac, recompute=none - sac, working=working)
    if recompute == "selective" and stack.startswith("torchtitan-compile"):
        sac = b * (h + q + kv + q + f) + lse  # input; wq, wv, SDPA, w1 outputs (w2's is never read)
        return LayerMemory(held=sac, recompute=none - sac, working=working)
    return LayerMemory(held=none, recompute=0.0, working=working)


def _dense(llm: LLMSpec) -> LLMSpec:
    """The same block with a dense MLP of the MoE's per-token width (for the MoE's extra saved bytes)."""
    from dataclasses import replace

    return replace(llm, moe=None, ffn=_mlp_width(llm))


@dataclass(frozen=True)
class LossMemory:
    """Bytes of the LLM head (final norm, output projection, cross-entropy) for `tokens` tokens on a
    rank holding `vocab` columns: `held` from the forward to the backward, `forward` / `backward` the
    transient extra at each pass's high point."""

    held: float
    forward: float
    backward: float


def loss_memory(llm: LLMSpec, tokens: int, vocab: int | None = None, stack: str = "eager", b: int = 2,
                tp: int = 1, weight_grad: bool = True) -> LossMemory:
    """- eager: the chunked loss (omnibench/models/loss.py): the hidden gradient and an fp32 weight
      gradient held from the forward (it computes both there), one chunk of fp32 logits and their
      gradient while it runs; its backward scales the weight gradient into a new fp32 tensor;
    - torchtitan: `cross_entropy(pred.flatten(0, 1).float(), labels)` on full logits (train.py at
      9dec370): the forward holds the bf16 logits, their fp32 copy and log_softmax's fp32 output at
      once and keeps the last; the backward adds NLL's dense fp32 gradient and log_softmax's (three
      fp32 logits-sized tensors at its high point);
    - megatron: the vocab-parallel cross-entropy keeps one fp32 softmax (computed in place from an fp32
      copy of the bf16 logits) and writes its gradient into it; bf16 logits and the bf16 gradient
      exist only while each pass runs.

    `weight_grad` False (a frozen LLM): the chunked loss computes no weight gradient (its forward asks
    autograd which inputs need one), so it holds, adds into and scales none.
    """
    v = llm.vocab if vocab is None else vocab
    h = llm.hidden
    if stack not in ACTIVATION_STACKS:
        raise ValueError(f"stack must be one of {', '.join(ACTIVATION_STACKS)}; got {stack!r}")
    logits = float(tokens) * v  # the rank's vocabulary shard (tp: vocabulary-parallel head)
    if stack == "eager":
        # the final norm (sequence-parallel under tp) and the fp32 weight gradient; the backward
        # scales that gradient into a new fp32 tensor (which becomes the weight's gradient)
        # while a chunk runs: its fp32 logits (made softmax - one-hot in place) and their bf16 copy, and
        # the bf16 product g.T @ h added into the fp32 weight gradient
        w = 1.0 if weight_grad else 0.0
        return LossMemory(held=tokens * _rmsnorm_bytes(h, b) / tp + w * 4.0 * v * h,
                          forward=float(min(tokens, loss_chunk_tokens(v)) * (4 + b) * v) + w * b * v * h,
                          backward=w * 4.0 * v * h)
    if stack == "torchtitan-compile-loss":
        # one fused graph from the bf16 logits: it keeps them and each token's log-sum-exp, and its
        # backward writes the bf16 gradient directly
        norm = tokens * (_rmsnorm_bytes(h, b) / tp + (b * h * (1 - 1 / tp) if tp > 1 else 0.0))
        return LossMemory(held=norm + b * logits + 4.0 * tokens, forward=0.0, backward=b * logits)
    if stack.startswith("torchtitan") and tp > 1:
        # loss parallel (torch.distributed.tensor.parallel.loss, torchtitan's default under tp): the
        # vocabulary-sharded log_softmax in decomposed ops (fp32 input, shifted, exp, result: the
        # forward's high point with the bf16 logits) and a backward building zeros, exp, their sum and
        # product beside the saved output; the output projection keeps its all-gathered input
        return LossMemory(held=tokens * (_rmsnorm_bytes(h, b) / tp + b * h * (1 - 1 / tp)) + 4 * logits,
                          forward=(b + 12) * logits - 4 * logits, backward=12 * logits)
    if stack.startswith("torchtitan"):
        return LossMemory(held=tokens * _rmsnorm_bytes(h, b) / tp + 4 * logits, forward=(b + 4) * logits,
                          backward=8 * logits)
    return LossMemory(held=tokens * (b * h + 4) / tp + 4 * logits, forward=b * logits, backward=b * logits)


def _activations(per_layer: float, n_layers: int, count: int, recompute: str, hidden: int, b: int) -> float:
    if recompute == "full":
        # Each block keeps only its input; one block's full set is live again during its backward.
        return count * (n_layers * b * hidden + (per_layer if n_layers else 0))
    return count * n_layers * per_layer


# Logits of one chunk of the loss are [chunk, vocab] fp32; ~1 GiB of them bounds the loss's memory
# for any number of tokens (16K tokens over Qwen2's 152K vocabulary would be 9.3 GiB, and as much
# again for their gradient). Here, not in models/loss.py, so the simulator counts it without torch.
LOSS_CHUNK_BYTES = 1 << 30


def loss_chunk_tokens(vocab: int, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    return max(1, budget_bytes // (4 * vocab))


def llm_activation_bytes(
    llm: LLMSpec,
    tokens: int,
    layers: Iterable[int] | None = None,
    head: bool = True,
    recompute: str = "none",
    dtype_bytes: int = 2,
) -> float:
    """Activation memory held for backward by one microbatch of `tokens` tokens.

    With `head`, the final norm and the chunked loss (omnibench.models.loss.linear_cross_entropy):
    it keeps the hidden gradient (b x hidden per token) and an fp32 weight gradient (4 x vocab x
    hidden) from its forward to its backward, and one chunk of fp32 logits with their bf16
    gradient while it runs; never [tokens, vocab]. "selective" recompute keeps the same as "none"
    here (the flash core stores no s x s matrix to drop).
    """
    _check(recompute, "causal")
    n = _layer_count(llm.layers, layers)
    b = dtype_bytes
    out = _activations(llm_layer_bytes(llm, b), n, tokens, recompute, llm.hidden, b)
    if n:
        out += tokens * 8 * llm.dim_head  # fp32 RoPE cos/sin, shared by all layers
    if head:
        # the final norm's saved tensors (its output goes into the loss, which keeps the hidden
        # gradient in its place: b x hidden either way) and the loss's fp32 weight gradient
        out += tokens * _rmsnorm_bytes(llm.hidden, b) + 4 * llm.vocab * llm.hidden
        out += loss_transient_bytes(llm, tokens, b)
    return out


def loss_transient_bytes(llm: LLMSpec, tokens: int, b: int = 2) -> int:
    """What the chunked loss holds only while it runs: one chunk's fp32 logits and bf16 gradient."""
    return min(tokens, loss_chunk_tokens(llm.vocab)) * (4 + b) * llm.vocab


def vision_activation_bytes(
    vit: VisionEncoderSpec,
    patches: int,
    layers: Iterable[int] | None = None,
    patch_embed: bool = True,
    merger: bool = True,
    recompute: str = "none",
    dtype_bytes: int = 2,
) -> float:
    _check(recompute, "causal")
    n = _layer_count(vit.layers, layers)
    b = dtype_bytes
    out = _activations(vision_layer_bytes(vit, b), n, patches, recompute, vit.hidden, b)
    if n:
        out += patches * 8 * (vit.hidden // vit.heads)  # fp32 2D RoPE cos/sin
    if patch_embed:
        out += patches * b * vit.in_channels * vit.temporal_patch * vit.patch_size**2  # pixels (weight grad)
    if merger:
        out += patches * (_layernorm_bytes(vit.hidden, b) + 2 * b * vit.hidden)  # ln_q; GELU in and out
    return out


def audio_activation_bytes(
    enc: AudioEncoderSpec,
    positions: int,
    layers: Iterable[int] | None = None,
    convs: bool = True,
    projector: bool = True,
    recompute: str = "none",
    dtype_bytes: int = 2,
) -> float:
    """`positions`: encoder positions (mel frames // 2)."""
    _check(recompute, "causal")
    n = _layer_count(enc.layers, layers)
    b = dtype_bytes
    out = _activations(audio_layer_bytes(enc, b), n, positions, recompute, enc.hidden, b)
    if convs:
        # conv1 runs at the mel rate (2 frames per position): its mel input, GELU input and output;
        # conv2's GELU input.
        out += positions * b * (2 * enc.n_mels + 4 * enc.hidden + enc.hidden)
    if projector:
        out += positions // enc.pool * _layernorm_bytes(enc.hidden, b)
    return out

"""Work of one module stage on one microbatch, per rank of its layout: FLOPs split by kind (matmul /
attention core) for forward, backward and recomputation, op count, activation and communication
bytes. No torch.

FLOPs, parameter counts and activation bytes come from the project's one counter,
`omnibench/specs/costs.py` (exact per-layer formulas over the real packed sequence lengths); this
module only divides them over the layout (tp, cp, sp, ep) and adds what the simulator needs on top
(op counts for the efficiency curve, bytes moved by intra-module collectives).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from omnibench.specs import costs
from omnibench.specs.model import AudioEncoderSpec, LLMSpec, MultimodalSpec, VisionEncoderSpec

# Matmul ops per transformer layer (q, k, v, o + attention core) used to turn a stage's FLOPs into
# "op size" for the efficiency curve; the MLP adds 2 (GELU) or 3 (SwiGLU) per expert group.
_ATTN_OPS = 4


# slots, not frozen: a step at scale makes a Work per distinct microbatch, and a frozen dataclass sets
# every field through object.__setattr__ (6x dearer to make with its 25 fields). Nothing changes one once
# made (they are cached and shared); eq and hash are the frozen ones.
@dataclass(slots=True, unsafe_hash=True)
class Work:
    """Work of one module stage on one microbatch, per rank of its layout (after tp/cp/sp)."""

    matmul_flops: float = 0.0  # forward
    attention_flops: float = 0.0  # forward attention core (QK^T, PV)
    backward_matmul: float = 0.0
    backward_attention: float = 0.0
    recompute_matmul: float = 0.0
    recompute_attention: float = 0.0
    ops: int = 0  # matmul ops of one forward (for the efficiency curve's op size)
    sequences: int = 0  # attention calls of one forward: packed sequences x layers (varlen loops)
    tokens: int = 0  # tokens this rank processes (after cp/sp split)
    layers: int = 0
    act_bytes: float = 0.0  # activation bytes kept for backward (under the run's recompute policy)
    # of act_bytes, what full recomputation holds only while this stage runs its backward (one
    # layer's activations, recomputed); the rest is held from the forward to the backward
    act_transient: float = 0.0
    # of the held part, what each layer holds (freed as the backward passes it; 0: freed at its end)
    act_layer: float = 0.0
    # gradients and temporaries alive inside one layer's backward at their high point
    act_working: float = 0.0
    # the loss's transient extra at the forward's and at the backward's high point (last LLM stage)
    loss_forward: float = 0.0
    loss_backward: float = 0.0
    params: float = 0.0  # parameters of the stage (before any sharding)
    expert_params: float = 0.0  # of `params`, those split over ep
    tp_bytes: float = 0.0  # bytes all-reduced over tp (forward), whole stage; 2 calls per layer
    seq_bytes: float = 0.0  # bytes through the cp/sp exchange (forward), whole stage; 1 call per layer
    ep_bytes: float = 0.0  # bytes through the expert all-to-all (forward), whole stage; 2 calls per layer
    shape: object = None  # simulator.kernels.BlockShape (dense stages): what the kernel model costs
    # encoders run in chunks, each recomputed in the backward (omnibench/runtime/encoder_chunks.py):
    # how many; 0 = not chunked
    chunks: int = 0

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops


def _stack_fields(kernel_stack, sequence_parallel: bool) -> dict:
    """A BlockShape's stack fields (its defaults unless given): set when the shape is made, rather
    than replaced on a finished Work (two dataclass copies per distinct microbatch at scale)."""
    out = {} if kernel_stack is None else {"stack": kernel_stack}
    if sequence_parallel:
        out["sequence_parallel"] = True
    return out


def stage_layers(n_layers: int, pp: int, stage: int, embedding_loss: bool = False) -> range:
    """Even split, the first `n_layers % pp` stages one layer longer. `embedding_loss`: the embedding
    and the loss are cut as one layer each (Megatron's account_for_embedding/loss_in_pipeline_split),
    so the first and last stages hold one transformer layer fewer (possibly none)."""
    units = n_layers + (2 if embedding_loss else 0)
    base, extra = divmod(units, pp)
    start = stage * base + min(stage, extra)
    stop = start + base + (1 if stage < extra else 0)
    if embedding_loss:  # unit 0 is the embedding, unit n_layers + 1 the loss
        start, stop = max(0, start - 1), min(n_layers, stop - 1)
    return range(start, max(start, stop))


def _split(f: costs.Flops, div: float) -> dict:
    core = f.parts.get("attention_core", 0.0)
    # costs.py counts backward = 2x forward per op (1x for ops on raw inputs) and recompute per policy;
    # the attention core's share is exactly 2x forward in backward and 1x in any recompute.
    rec_core = min(core, f.recompute)
    return {
        "matmul_flops": (f.forward - core) / div,
        "attention_flops": core / div,
        "backward_matmul": (f.backward - 2 * core) / div,
        "backward_attention": 2 * core / div,
        "recompute_matmul": (f.recompute - rec_core) / div,
        "recompute_attention": rec_core / div,
    }


def llm_expert_params(llm: LLMSpec, layers: range) -> float:
    if llm.moe is None:
        return 0.0
    return float(len(layers) * llm.moe.experts * 3 * llm.hidden * llm.moe.expert_ffn)


def llm_work(llm: LLMSpec, seq_lens: list[int], layers: range, first: bool, last: bool,
             tp: int = 1, cp: int = 1, ep: int = 1, recompute: str = "none", cp_kind: str = "ulysses",
             expert_tp: int = 0, stack: str = "eager", kernel_stack=None, sequence_parallel: bool = False,
             frozen: bool = False) -> Work:
    """`stack`: whose kernels keep the activations (costs.ACTIVATION_STACKS); `kernel_stack` and
    `sequence_parallel`: the shape's software stack (simulator.kernels.Stack; FUSED when None) and
    whether tp runs sequence-parallel, as the kernel model costs it. `frozen`: the LLM's weights take no
    gradient (`--freeze llm`): its backward computes input gradients only (costs.frozen_flops) and its
    loss keeps no weight gradient (the kernel model reads the same from `kernel_stack.frozen`)."""
    st = _llm_stage(llm, layers, first, last, tp, cp, ep, recompute, cp_kind, expert_tp, stack, kernel_stack,
                    sequence_parallel)
    h, d = llm.hidden, llm.dim_head
    t = sum(seq_lens)
    n = st.layers
    f = costs.llm_flops(llm, seq_lens, layers=layers, embed=first, head=last, recompute=recompute)
    per_rank_tokens = t // cp
    from simulator.kernels import BlockShape

    shape = BlockShape(**st.shape, seq_lens=tuple(seq_lens), tokens=max(1, per_rank_tokens) if cp > 1 else 0)
    if frozen:
        f = costs.frozen_flops(f, "llm")
    mem = _llm_memory(llm, per_rank_tokens, n, first, last, tp, recompute, stack, st.layer_memory, not frozen)
    ring, gather = st.ring, st.gather
    return Work(
        **_split(f, tp * cp),
        ops=st.ops,
        sequences=n * len(seq_lens),
        tokens=per_rank_tokens,
        layers=n,
        **mem,
        params=st.params,
        expert_params=st.expert_params,
        # two bf16 all-reduces per layer (one where folded experts need none)
        tp_bytes=n * (1 if st.folded else 2) * (t / cp) * h * 2 if tp > 1 else 0.0,
        # Ulysses: q, k, v in and the output back, bf16, per layer; ring: the rank's K/V block passed
        # on cp - 1 times (point to point, overlapped with the block's attention: simulator/program.py);
        # all-gather: the gathered K/V of the whole sequences (the all-gather's output), per layer
        seq_bytes=(0.0 if cp == 1 else n * (t / cp) * 2 * llm.kv_heads * d * 2 / tp * (cp - 1) if ring
                   else n * t * 2 * llm.kv_heads * d * 2 / tp if gather
                   else n * (t / cp) * 2 * (llm.heads + llm.kv_heads) * d * 2 / tp),
        ep_bytes=n * 2 * (t / cp) * llm.moe.top_k * h * 2 / tp if llm.moe is not None and ep > 1 else 0.0,
        shape=shape,
    )


@dataclass(frozen=True)
class _LLMStage:
    """What `llm_work` gives every microbatch of one stage under one layout alike: the shape's fields but
    its sequences and tokens, the op count, the parameters and one block's bytes per token."""

    shape: dict
    layers: int
    ops: int
    params: float
    expert_params: float
    layer_memory: costs.LayerMemory
    ring: bool
    gather: bool
    folded: bool


@functools.lru_cache(maxsize=512)
def _llm_stage(llm: LLMSpec, layers: range, first: bool, last: bool, tp: int, cp: int, ep: int, recompute: str,
               cp_kind: str, expert_tp: int, stack: str, kernel_stack, sequence_parallel: bool) -> _LLMStage:
    # worked out once per (stage, layout, stack): a tune meets thousands of microbatches per stage, and
    # these fields took half of each one's Work
    h, d = llm.hidden, llm.dim_head
    n = len(layers)
    mats = 3 if llm.mlp == "swiglu" else 2
    mlp_ops = mats if llm.moe is None else 3 * max(1, llm.moe.experts // ep) + 1
    heads, kvh, ffn = llm.heads // tp, max(1, llm.kv_heads // tp), -(-llm.ffn // tp)
    # Context parallelism is Ulysses (omnibench/runtime/parallelize.py::UlyssesAttention): each cp
    # rank runs the GEMMs of 1/cp of the packed tokens, and attention over whole sequences with 1/cp
    # of its heads, between all-to-alls of q, k, v (in) and the output (back).
    # Ring (cp_kind "ring", simulated only): every rank keeps 1/cp of each sequence with all its heads
    # and computes cp blocks of attention as K/V travel around the ring (`ring` in the shape).
    # All-gather KV (cp_kind "allgather"; Llama 3, torchtitan; parallelize.AllGatherKVAttention): every rank keeps 1/cp of
    # each sequence (two opposite chunks, balancing the causal work) and all-gathers the whole K/V of
    # its sequences before each attention (their gradients reduce-scattered back in the backward).
    ring = cp > 1 and cp_kind == "ring"
    gather = cp > 1 and cp_kind == "allgather"
    ulysses = cp if cp > 1 and not ring and not gather else 1
    moe = llm.moe
    # MoE parallel folding (expert_tp 1): experts whole, each rank routing its sequence-parallel 1/tp
    # of the tokens over an ep group drawn from the stage's dp*cp*tp ranks
    folded = moe is not None and expert_tp == 1 and tp > 1
    moe_fields = {} if moe is None else dict(
        moe_experts=max(1, moe.experts // ep), moe_router=moe.experts, moe_top_k=moe.top_k,
        moe_ffn=moe.expert_ffn if folded else -(-moe.expert_ffn // tp),
        moe_shared_ffn=-(-moe.shared_expert_ffn // tp), moe_token_split=tp if folded else 1)
    mlp_params = mats * h * ffn if moe is None else (
        3 * h * moe_fields["moe_ffn"] * moe_fields["moe_experts"] + h * moe.experts + 3 * h * moe_fields["moe_shared_ffn"])
    shape = dict(
        **moe_fields,
        hidden=h, heads=heads / ulysses, kv_heads=kvh / ulysses, head_dim=d, ffn=0 if moe is not None else ffn,
        vocab=-(-llm.vocab // tp), layers=n, head=last, tp=tp, ring=cp if ring else 1, kv_gather=cp if gather else 1,
        biased=(heads + 2 * kvh) * d if llm.qkv_bias else 0,
        mlp=llm.mlp, norm=llm.norm, rope=llm.positions == "rope",
        params=float(h * (heads + 2 * kvh) * d + heads * d * h + mlp_params), embed=first,
        **_stack_fields(kernel_stack, sequence_parallel))
    return _LLMStage(shape=shape, layers=n, ops=n * (_ATTN_OPS + mlp_ops) + (1 if last else 0),
                     params=float(costs.llm_params(llm, layers=layers, embed=first, head=last)),
                     expert_params=llm_expert_params(llm, layers),
                     layer_memory=costs.llm_layer_memory(llm, recompute, stack), ring=ring, gather=gather,
                     folded=folded)


def _llm_memory(llm: LLMSpec, tokens: int, n: int, first: bool, last: bool, tp: int, recompute: str,
                stack: str, lm: costs.LayerMemory, weight_grad: bool = True) -> dict:
    """Work's memory fields of an LLM stage on one microbatch of `tokens` tokens per rank (tp splits
    the activations: sequence-parallel norms, column/row-parallel linears); `lm`: one block's bytes per
    token (costs.llm_layer_memory under `recompute` and `stack`)."""
    layer = tokens * lm.held / tp
    transient = tokens * lm.recompute / tp if n else 0.0
    if tp > 1 and not stack.startswith("megatron"):
        # DTensor tensor parallelism with sequence-parallel norms (this project's runtime, torchtitan):
        # each column-parallel linear saves its all-gathered input, whole, not 1/tp of it (the
        # attention's q/k/v and the MLP's w1/w3 share one each). Megatron saves its sharded input
        # and gathers again in the backward (Korthikanti et al. 2022, sec. 4.2.2).
        gathered = 2 * 2 * llm.hidden * tokens * (1 - 1 / tp)
        if recompute == "none" or (recompute == "selective" and not stack.startswith("torchtitan")):
            layer += gathered
        elif n:
            transient += gathered + (2 * 2 * llm.hidden * tokens / tp if recompute == "selective" else 0.0)
    held = n * layer
    if n and stack == "eager":
        held += tokens * 8 * llm.dim_head  # fp32 RoPE cos/sin, shared by all layers
    loss = (costs.loss_memory(llm, tokens, -(-llm.vocab // tp), stack, tp=tp, weight_grad=weight_grad) if last
            else costs.LossMemory(0, 0, 0))
    held += loss.held
    return dict(act_bytes=held + transient, act_transient=transient, act_layer=layer,
                act_working=tokens * lm.working / tp if n else 0.0, loss_forward=loss.forward,
                loss_backward=loss.backward)


def _chunked_memory(module: str, enc, inputs: list, per_rank: int, chunk_tokens: int, recompute: str,
                    b: int = 2) -> tuple[float, float, int]:
    """(act_bytes, act_transient, chunks) of an encoder microbatch run in chunks
    (omnibench/runtime/encoder_chunks.py): held from forward to backward, its inputs in the compute
    dtype and the output; while a chunk's backward runs, that chunk's activations under the recompute
    mode (the largest chunk sets the peak) and the working set of one block's backward, counted as one
    block's activations again (their gradients). MemTracker measures that working set at 0.6-0.7 of
    a block's activations for the Qwen2-VL ViT (tests/test_memory_tracker.py); unchunked encoders do
    not count it yet, a small share of their larger peak."""
    sizes = costs.encoder_chunk_sizes(module, inputs, chunk_tokens)
    largest = max(sizes)
    out_width = enc.out_hidden or enc.hidden
    if module == "vision":
        held = per_rank * b * enc.in_channels * enc.temporal_patch * enc.patch_size**2
        held += per_rank // enc.merge**2 * out_width * b
        transient = costs.vision_activation_bytes(enc, largest, patch_embed=False, recompute=recompute)
        transient += largest * costs.vision_layer_bytes(enc, b)
    else:
        held = 2 * per_rank * enc.n_mels * b
        held += per_rank // enc.pool * out_width * b
        transient = costs.audio_activation_bytes(enc, largest, recompute=recompute)
        transient += largest * costs.audio_layer_bytes(enc, b)
    return held + transient, transient, len(sizes)


def vision_work(v: VisionEncoderSpec, grids: list[tuple[int, int, int]], tp: int = 1, sp: int = 1,
                recompute: str = "none", chunk_tokens: int = 0, kernel_stack=None,
                sequence_parallel: bool = False) -> Work:
    h = v.hidden
    t = sum(a * b * c for a, b, c in grids)
    f = costs.vision_flops(v, grids, recompute=recompute)
    mlp_mats = 3 if v.mlp == "swiglu" else 2
    per_rank = t // sp
    from simulator.kernels import BlockShape

    heads, ffn, win = max(1, v.heads // (tp * sp)), -(-v.ffn // tp), v.merge**2
    d_in = v.in_channels * v.temporal_patch * v.patch_size**2
    out = v.out_hidden or h
    groups = tuple(costs.vision_groups(grids))  # the attention calls: the shape's and `sequences`
    shape = BlockShape(
        hidden=h, heads=heads, kv_heads=heads, head_dim=h // v.heads, ffn=ffn, vocab=0,
        seq_lens=groups, layers=v.layers, head=False, tp=tp, tokens=max(1, per_rank),
        mlp=v.mlp, norm=v.norm, rope=True, causal=False, fused_qkv=True,
        biased=3 * heads * (h // v.heads) + h + (2 if v.mlp == "swiglu" else 1) * ffn + h,
        params=float(4 * h * h / tp + mlp_mats * h * ffn),
        # patch embedding (its input needs no gradient) and the 2x2 merger's two linears
        extra_gemms=((per_rank, h, d_in, False), (per_rank // win, win * h, win * h, True),
                     (per_rank // win, out, win * h, True)),
        # fp32 patches cast for the patch embedding, the merger's norm and GELU
        extra_pointwise=float(per_rank) * (6 * d_in + 20 * h + 4 * h),
        **_stack_fields(kernel_stack, sequence_parallel),
    ) if t else None
    layer = working = 0.0
    if chunk_tokens and t and sp == 1:
        act, transient, chunks = _chunked_memory("vision", v, grids, per_rank, chunk_tokens, recompute)
    else:
        act = costs.vision_activation_bytes(v, per_rank, recompute=recompute)
        transient, chunks = _recomputed_layer(recompute, v.layers, per_rank * costs.vision_layer_bytes(v)), 0
        layer = per_rank * (2 * h if recompute == "full" else costs.vision_layer_bytes(v))
        working = per_rank * _encoder_working(h, v.ffn)
    return Work(
        **_split(f, tp * sp),
        shape=shape,
        ops=v.layers * (_ATTN_OPS + mlp_mats) + 3,
        sequences=v.layers * len(groups),
        tokens=per_rank,
        layers=v.layers,
        act_bytes=act / tp,
        act_transient=transient / tp,
        act_layer=layer / tp,
        act_working=working / tp,
        chunks=chunks,
        params=float(costs.vision_params(v)),
        tp_bytes=v.layers * 2 * (t / sp) * h * 2 if tp > 1 else 0.0,
        seq_bytes=v.layers * 4 * (t / sp) * h * 2 / tp if sp > 1 else 0.0,  # Ulysses: q, k, v in, out back
    )


def _encoder_working(hidden: int, ffn: int, b: int = 2) -> float:
    """Per token, an encoder block's backward working set (as costs.llm_layer_memory's `working`)."""
    return b * (2 * ffn + 2 * hidden)


def _recomputed_layer(recompute: str, layers: int, layer_bytes: float) -> float:
    """The one layer's activations that full recomputation rebuilds inside a backward (costs._activations)."""
    return layer_bytes if recompute == "full" and layers else 0.0


def audio_work(a: AudioEncoderSpec, mel_frames: list[int], tp: int = 1, sp: int = 1,
               recompute: str = "none", chunk_tokens: int = 0, kernel_stack=None,
               sequence_parallel: bool = False) -> Work:
    h = a.hidden
    t = sum(m // 2 for m in mel_frames)
    f = costs.audio_flops(a, mel_frames, recompute=recompute)
    per_rank = t // sp
    from simulator.kernels import BlockShape

    heads, ffn = max(1, a.heads // (tp * sp)), -(-a.ffn // tp)
    hd = h // a.heads
    out = a.out_hidden or h
    windows = tuple(costs.audio_windows(mel_frames, a.max_positions))  # the attention calls
    shape = BlockShape(
        hidden=h, heads=heads, kv_heads=heads, head_dim=hd, ffn=ffn, vocab=0,
        seq_lens=windows, layers=a.layers, head=False, tp=tp,
        tokens=max(1, per_rank), mlp="gelu", norm="layer", rope=False, causal=False,
        biased=3 * heads * hd + ffn + h,  # q, v, out projection, fc1, fc2 (Whisper's key has no bias)
        params=float(4 * h * h / tp + 2 * h * ffn),
        # the conv front-end as GEMMs (kernel 3 over mel frames, then stride 2) and the projector
        extra_gemms=((2 * per_rank, h, 3 * a.n_mels, False), (per_rank, h, 3 * h, True),
                     (per_rank // a.pool, out, h, True)),
        # GELU after both convs, positions added, the final norm and the pooling
        extra_pointwise=float(per_rank) * h * (3 * 4 + 6 + 20 + 4),
        **_stack_fields(kernel_stack, sequence_parallel),
    ) if t else None
    layer = working = 0.0
    if chunk_tokens and t and sp == 1:
        act, transient, chunks = _chunked_memory("audio", a, mel_frames, per_rank, chunk_tokens, recompute)
    else:
        act = costs.audio_activation_bytes(a, per_rank, recompute=recompute)
        transient, chunks = _recomputed_layer(recompute, a.layers, per_rank * costs.audio_layer_bytes(a)), 0
        layer = per_rank * (2 * h if recompute == "full" else costs.audio_layer_bytes(a))
        working = per_rank * _encoder_working(h, a.ffn)
    return Work(
        **_split(f, tp * sp),
        shape=shape,
        ops=a.layers * (_ATTN_OPS + 2) + 3,
        sequences=a.layers * len(windows),
        tokens=per_rank,
        layers=a.layers,
        act_bytes=act / tp,
        act_transient=transient / tp,
        act_layer=layer / tp,
        act_working=working / tp,
        chunks=chunks,
        params=float(costs.audio_params(a)),
        tp_bytes=a.layers * 2 * (t / sp) * h * 2 if tp > 1 else 0.0,
        seq_bytes=a.layers * 4 * (t / sp) * h * 2 / tp if sp > 1 else 0.0,
    )


def input_elements(sample, model: MultimodalSpec) -> int:
    """Elements of a sample's raw input tensors (pixel patches, mel frames): a forward that takes
    raw samples prepares them, at a cost in proportion to their size and not to any FLOPs."""
    n = 0
    for seg in sample.segments:
        if seg.modality in ("image", "video") and model.vision is not None and seg.grid_thw:
            v = model.vision
            t, h, w = seg.grid_thw
            n += t * h * w * v.in_channels * v.temporal_patch * v.patch_size**2
        elif seg.modality == "audio" and model.audio is not None:
            n += seg.mel_frames * model.audio.n_mels
    return n


def model_train_flops(model: MultimodalSpec, samples, recompute: str = "none", frozen=()) -> float:
    """FLOPs of one training step over a batch, each sample its own packed sequence
    (costs.batch_flops). recompute "none": forward + backward, the model FLOPs of MFU; else the
    recomputed forward is added (what the GPU executes: hardware FLOPs, HFU). `frozen`: modules whose
    weights take no gradient, counted as the step runs them (costs.frozen_flops)."""
    return lengths_train_flops(model, costs.sample_lengths(samples), recompute, frozen)


def lengths_train_flops(model: MultimodalSpec, lens: dict[str, list], recompute: str = "none", frozen=()) -> float:
    """`model_train_flops` from the samples' `costs.sample_lengths`."""
    per = costs.lengths_flops(model, lens, recompute=recompute)
    return sum((costs.frozen_flops(f, m) if m in frozen else f).total for m, f in per.items())

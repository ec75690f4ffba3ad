"""The analytic estimates, which prune and order the space before anything is simulated: a per-rank
memory lower bound (`memory_estimate`) and a step time for ordering (`time_estimate`), each under the
system's own rules (`_Rules`) and this runtime's training-state bytes (`_state`), answered once per
batch (`_per_batch`) and once per candidate (`_per_candidate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from omnibench.specs import costs
from omnibench.specs.model import MultimodalSpec, VisionEncoderSpec
from omnibench.tune.space import ULYSSES_SYSTEMS, Candidate, default_microbatches, llm_ranks
from systems.common import by_identity

# `fn(model, samples, *args)` answered once per batch: tune asks the same layout-independent sums (token and
# position totals, a step's FLOPs) for every candidate and recompute mode, and a 4,096-GPU batch has ~14,000
# samples. Keyed by the model's and the samples' identities (systems.common.by_identity).
_per_batch = by_identity(2)


@_per_batch
def _train_flops(model: MultimodalSpec, samples, recompute: str, frozen: str = "") -> float:
    from simulator.flops import model_train_flops

    return model_train_flops(model, samples, recompute, tuple(frozen.split(",")) if frozen else ())


def _mean_loads(model: MultimodalSpec, samples) -> tuple[float, dict[str, float]]:
    """(LLM tokens, encoder positions per encoder) of the whole batch."""
    tokens = float(sum(s.llm_tokens for s in samples))
    pos = {m: float(sum(sum(s.encoder_seq_lens(m)) for s in samples)) for m in model.encoders}
    return tokens, pos


def _largest(model: MultimodalSpec, samples) -> tuple[int, dict[str, int]]:
    """The largest single sample's LLM tokens and encoder positions: some rank holds it whole."""
    tokens = max((s.llm_tokens for s in samples), default=0)
    pos = {m: max((sum(s.encoder_seq_lens(m)) for s in samples), default=0) for m in model.encoders}
    return tokens, pos


# Layout-independent sums over a batch's samples, asked for every candidate and mode: once per batch.
_mean_loads, _largest = _per_batch(_mean_loads), _per_batch(_largest)
_batch_flops = _per_batch(costs.batch_flops)  # per module, once per batch and recompute mode


def _per_candidate(fn):
    """`fn(system, model, world, gpus_per_node, c, samples, *args, **kw)` (an analytic estimate) answered
    once per its inputs: each search of a convergence check, and the guard's, is a new `_Search` over the
    same batch and candidates, and settling its space asked for every candidate's estimates again (at
    1,024 GPUs most of a tune's time outside the simulations). The model, the samples and any other
    object argument (a cluster) are keyed by identity and kept alive with the answer, so an identity is
    never reused; strings, numbers and candidates by value, a dict (a system's options) by its items."""
    memo: dict = {}

    def by_value(x) -> bool:
        return x is None or isinstance(x, (str, int, float, bool, Candidate))

    def part(x):
        if by_value(x):
            return x
        if isinstance(x, dict):
            return tuple(sorted((k, repr(v)) for k, v in x.items()))
        return ("id", id(x))

    def wrapped(system, model, world, gpus_per_node, c, samples, *args, **kw):
        named = sorted(kw.items())
        objs = (model, samples, *(v for v in (*args, *(v for _, v in named)) if not by_value(v)
                                  and not isinstance(v, dict)))
        k = (system, world, gpus_per_node, c, id(model), id(samples), tuple(part(a) for a in args),
             tuple((n, part(v)) for n, v in named))
        hit = memo.get(k)
        if hit is not None and all(a is b for a, b in zip(hit[0], objs, strict=True)):
            return hit[1]
        if len(memo) >= 1 << 16:
            memo.clear()
        out = fn(system, model, world, gpus_per_node, c, samples, *args, **kw)
        memo[k] = (objs, out)
        return out

    wrapped.__wrapped__ = fn
    wrapped.__doc__ = fn.__doc__
    return wrapped


@dataclass(frozen=True)
class _Rules:
    """What a system does with a layout, as far as the estimates need it (each planner's own rules,
    read from the layouts the planners build, not planned): the LLM layout; per encoder its layout
    (ranks, tp, sp, data-parallel mode), the ranks a sample of it can be split over (temporal: its
    Ulysses degree; omni: its sequence-parallel group), and whether all of a step's encoder outputs
    are live through the LLM pass (colocated, noncolocated) or only the microbatches in flight; the
    ranks a long LLM sample is split over beyond the layout's cp (omni's LLM long-short groups);
    whether encoder work fills pipeline bubbles (omni's joint pipeline) or sits on stage 0
    (homogeneous)."""

    llm: object
    encoders: dict
    split: dict
    whole_batch_live: bool
    llm_split: int
    fills_bubbles: bool
    stage0_encoders: bool
    separate_encoders: bool


def _first_stage(lay) -> list[int]:
    """The ranks of `lay` at pipeline coordinate 0, in rank order: `[r for r in lay.ranks if
    lay.coords(r)["pp"] == 0]` from the mesh's strides (plan.Layout._tables), without the coordinates
    of every rank that `coords` builds once per layout (tune asks for a new layout per candidate)."""
    stride = 1
    for d, n in zip(reversed(lay.mesh_dims), reversed(lay.mesh_shape), strict=True):
        if d == "pp":
            break
        stride *= n
    # rank i is at pp (i // stride) % pp: the first `stride` of every block of stride * pp (slices, not a
    # test per rank: at 8,192 GPUs the per-rank test was 0.7 ms a candidate, a fiftieth of a tune)
    ranks = lay.ranks
    return [r for k in range(0, len(ranks), stride * lay.pp) for r in ranks[k:k + stride]]


def _rules(system: str, model: MultimodalSpec, world: int, gpus_per_node: int, c: Candidate,
           options: dict | None = None) -> _Rules:
    from omnibench.plan import Layout
    from systems.common import encoder_layout, llm_layout, with_dp_shard

    parallel = c.parallel(world, gpus_per_node, options)
    n_llm = llm_ranks(system, model, world, c, gpus_per_node)
    llm = llm_layout(replace(parallel, virtual_stages=1), range(world - n_llm, world))
    encoders: dict[str, Layout] = {}
    split = {m: 1 for m in model.encoders}
    llm_split = 1
    if system == "omni":
        from systems.omni.layout import build_layouts, sp_sizes
        from systems.omni.llm_long_short import llm_group_size
        from systems.omni.options import OmniOptions

        opts = OmniOptions.parse(parallel.options)
        flat = replace(parallel, virtual_stages=1)  # omni refuses interleaving when it plans, not here
        encoders = {m: lay for m, lay in build_layouts(model, flat, opts.encoder_dp).items() if m != "llm"}
        for m, lay in encoders.items():
            if opts.long_short_sp and opts.encoder_sp_scheme != "none" and lay.tp == 1:
                split[m] = max(sp_sizes(model, parallel, m, lay), default=1)
        if opts.llm_long_short:
            llm_split = llm_group_size(model, flat, llm)[0]
    elif system in ("homogeneous", *ULYSSES_SYSTEMS):
        stage0 = _first_stage(llm)
        sp = c.cp if system in ULYSSES_SYSTEMS else 1
        tp = 1 if system in ULYSSES_SYSTEMS else c.tp
        for m in model.encoders:
            encoders[m] = with_dp_shard(encoder_layout(m, stage0, tp=tp, sp=sp, fsdp=parallel.fsdp, zero=parallel.zero),
                                        parallel)
            split[m] = sp
    else:
        ranks = range(world - n_llm) if system == "noncolocated" else range(world)
        for m in model.encoders:
            encoders[m] = with_dp_shard(encoder_layout(m, ranks, tp=c.encoder_tp or 1, fsdp=parallel.fsdp,
                                                       zero=parallel.zero), parallel)
    return _Rules(llm, encoders, split, system in ("colocated", "noncolocated"), llm_split,
                  system == "omni", system == "homogeneous", system == "noncolocated")


def _state(params: float, lay, master: bool = False, frozen: bool = False) -> costs.StateBytes:
    """Per rank: a module's training state under its layout's data-parallel mode (this project's
    runtime's dtypes, costs.STATE_DTYPES["eager"]): FSDP and ZeRO over its shard group (the whole
    data-parallel group unless hybrid), nothing shared without peers; `frozen`: its bf16 weights alone
    (costs.frozen_state_bytes)."""
    n = lay.shard_size
    mode = lay.dp_mode if n > 1 else "ddp"
    if frozen:
        return costs.frozen_state_bytes(params, mode, max(1, n))
    return _dp_state(params, mode, max(1, n), master)


def _dp_state(params: float, mode: str, shard: int, master: bool) -> costs.StateBytes:
    """costs.dp_state_bytes in this runtime's dtypes; a replicated module (DDP, one rank) under
    `--mixed-precision master` holds bf16 weights with its fp32 master and main gradients, ZeRO's
    dtypes unsharded (simulator/memory.py `_dtypes`, omnibench/runtime/master.py)."""
    if master and mode == "ddp":
        return costs.state_bytes(costs.state_dtypes("eager", "zero1"), params, "ddp", shard)
    return costs.dp_state_bytes(params, mode, shard)


@_per_candidate
def memory_estimate(system: str, model: MultimodalSpec, world: int, gpus_per_node: int, c: Candidate,
                    samples, options: dict | None = None, memory_stack: str = "eager", device: str = "",
                    mixed_precision: str = "autocast", frozen: str = "") -> float:
    """Bytes per rank, a lower bound on the simulator's count (the package's docstring, step 2), under each
    system's own memory rules (`_rules`): its data-parallel mode per module (omni's encoders ZeRO-2 by
    default, the others' FSDP), how far the largest sample is split (temporal: over its Ulysses
    degree; omni: over its sequence-parallel group, its long LLM samples over their group), and
    which encoder outputs stay live through the LLM pass. `options`: the system's switches
    (ParallelSpec.options, e.g. omni's encoder_dp); `mixed_precision`: how replicated modules hold
    their weights (ParallelSpec.mixed_precision); `frozen`: the modules that do not train, a comma list
    (ParallelSpec.freeze: bf16 weights alone, costs.frozen_state_bytes; a frozen encoder keeps no
    activations). In the figure the simulator's fits check
    compares with the device (simulator/memory.py memory_needed: the allocated bytes with the space
    the allocator cannot give back under pressure, and what lives outside it, as `memory_stack` has them)."""
    from omnibench.process_groups import fewest_groups
    from simulator.flops import audio_work, llm_work, stage_layers, vision_work
    from simulator.memory import memory_needed

    rules = _rules(system, model, world, gpus_per_node, c, options)
    mode = costs.recompute_policy(c.recompute)  # per module: "vision=full,audio=full" leaves the LLM's none
    still = set(frozen.split(",")) if frozen else set()
    lay = rules.llm
    tokens, positions = _mean_loads(model, samples)
    big_tokens, big_positions = _largest(model, samples)
    m = c.microbatches or default_microbatches(system, c.pp)
    mean_mb = max(1, int(tokens / lay.dp / m))
    per_mb = max(mean_mb, big_tokens // rules.llm_split)
    layers = stage_layers(model.llm.layers, c.pp, 0)
    w = llm_work(model.llm, [per_mb], layers, True, c.pp == 1, c.tp, c.cp, c.ep, mode["llm"], c.cp_kind,
                 frozen="llm" in still)
    dense = (w.params - w.expert_params) / c.tp
    expert = w.expert_params / c.tp / max(1, c.ep)
    # As the simulator's timeline holds them at the LLM's first backward: its training state, the
    # activations in flight less a recomputed layer (held only inside a backward); FSDP's gathered
    # bf16 layers and the step's imbalance are left out of this lower bound.
    master = mixed_precision == "master"
    llm_state = _state(dense, lay, master, "llm" in still)
    if expert:
        e_mode = lay.dp_mode if lay.fsdp_size > 1 else "ddp"
        e_shard = max(1, (lay.shard_size if lay.fsdp else lay.fsdp_size) // max(1, c.ep))
        e = (costs.frozen_state_bytes(expert, e_mode, e_shard) if "llm" in still
             else _dp_state(expert, e_mode, e_shard, master))
        llm_state = costs.StateBytes(llm_state.params + e.params, llm_state.grads + e.grads,
                                     llm_state.optimizer + e.optimizer)
    in_flight = min(c.pp, m)
    # A first-stage rank's 1F1B holds up to `in_flight` microbatches at once: the rank holding the largest
    # sample holds at least that sample's microbatch, and every rank holds at once each run of
    # `in_flight` consecutive microbatches, so the heaviest of its ceil(m / in_flight) disjoint runs holds
    # at least that share of its microbatches, at least m of the mean size over the ranks (activations
    # grow with tokens at least linearly). The largest sample's microbatch counted for each one in
    # flight was no lower bound: it pruned pipelined layouts' cheaper recompute modes that fit.
    llm_act = w.act_bytes - w.act_transient
    if in_flight > 1:
        mean = w if mean_mb == per_mb else llm_work(model.llm, [mean_mb], layers, True, c.pp == 1, c.tp, c.cp,
                                                     c.ep, mode["llm"], c.cp_kind, frozen="llm" in still)
        llm_act = max(llm_act, m / math.ceil(m / in_flight) * (mean.act_bytes - mean.act_transient))
    llm_side = llm_state.params + llm_state.optimizer + llm_state.grads + llm_act  # allocated bytes
    enc_state = enc_grads = enc_act = 0.0
    # the share of a rank's encoder activations live at once: every microbatch's where the encoders run
    # the whole batch before the LLM (colocated); those in flight where they run inside the LLM's pipeline;
    # noncolocated's encoder ranks run 1F1B as one more stage before the LLM's pp, so at most pp + 1 of
    # its m rounds are live, and the heaviest run of them holds at least 1 / ceil(m / (pp + 1)) of the
    # rank's rounds (a lower bound also where pp + 1 does not divide m)
    if rules.separate_encoders:
        enc_live = 1.0 / math.ceil(m / min(c.pp + 1, m))
    else:
        enc_live = 1.0 if rules.whole_batch_live else in_flight / m
    for name, enc in model.encoders.items():
        if not positions[name]:
            continue
        elay = rules.encoders[name]
        per_rank = max(positions[name] / max(1, elay.dp * elay.sp), big_positions[name] / rules.split[name])
        sp = max(1, elay.sp)
        if isinstance(enc, VisionEncoderSpec):
            ew = vision_work(enc, [(1, 1, max(1, int(per_rank * sp)))], elay.tp, sp, mode[name])
        else:
            ew = audio_work(enc, [max(2, int(2 * per_rank * sp))], elay.tp, sp, mode[name])
        if name in still:  # its weights alone; its forward keeps nothing (it runs no backward)
            enc_state += _state(ew.params / elay.tp, elay, frozen=True).params
            continue
        st = _state(ew.params / elay.tp, elay, master)
        enc_state += st.params + st.optimizer  # its gradients appear only at its own backward
        # whole until grad_sync under this runtime's ZeRO (simulator/memory.py _grad_timeline)
        enc_grads += 4.0 * ew.params / elay.tp if elay.dp_mode.startswith("zero") else st.grads
        enc_act += (ew.act_bytes - ew.act_transient) * enc_live
    # the NCCL communicators the fewest-grouped rank holds (the world's and its layouts' groups)
    comms = 1 + fewest_groups({"llm": rules.llm, **rules.encoders}, world)
    if rules.separate_encoders:
        return memory_needed(max(llm_side, enc_state + enc_grads + enc_act), memory_stack, device, comms)
    # at the LLM's first backward, and at the end of the step (every gradient, no activation left)
    return memory_needed(max(llm_side + enc_state + enc_act, llm_side - llm_act + enc_state + enc_grads),
                         memory_stack, device, comms)


@_per_candidate
def time_estimate(system: str, model: MultimodalSpec, world: int, gpus_per_node: int, c: Candidate, samples,
                  cluster, options: dict | None = None, frozen: str = "") -> float:
    """Seconds, for ordering candidates only: each module's compute at the datasheet's achievable
    matmul rate over the ranks the system runs it on, the 1F1B bubble, the largest sample's share of
    its data rank, tp all-reduces and cp all-to-alls over NVLink. Each system's own balancing:
    homogeneous encodes on stage 0 only, colocated before the pipeline, noncolocated on ranks of
    their own beside it, temporal splits every sample over its Ulysses degree, omni puts encoder
    work in the pipeline's bubbles and splits its largest samples over their groups."""
    rules = _rules(system, model, world, gpus_per_node, c, options)
    still = set(frozen.split(",")) if frozen else set()
    per_module = {m: costs.frozen_flops(f, m) if m in still else f
                  for m, f in _batch_flops(model, samples, c.recompute).items()}
    gpu = cluster.gpu
    rate = gpu.peak_flops * gpu.matmul_efficiency
    llm_flops = per_module["llm"].total
    n_llm = rules.llm.size
    m = c.microbatches or default_microbatches(system, c.pp)
    tokens, _ = _mean_loads(model, samples)
    # A rank's LLM work is at least the mean and at least the largest sample's (exact FLOPs, attention
    # quadratic) split over the ranks that share it: its stage's tp x cp, and omni's long-sample group.
    # Under 1F1B every stage waits (pp - 1) microbatch slots, each at least that sample's.
    big_tokens, _ = _largest(model, samples)
    per_rank = llm_flops / n_llm / rate
    big = costs.llm_flops(model.llm, [big_tokens], recompute=costs.recompute_policy(c.recompute)["llm"])
    big = (costs.frozen_flops(big, "llm") if "llm" in still else big).total
    big_s = big / (c.tp * c.cp * c.pp * rules.llm_split) / rate if big_tokens else 0.0
    slot = max(per_rank / (c.virtual_stages * m), big_s)
    extra = 1.0 + 0.02 * (m - 1) if c.pp == 1 else 1.0  # small microbatches run less efficiently
    llm_s = max(per_rank, big_s) * extra
    bubble_s = (c.pp - 1) * slot if c.pp > 1 else 0.0
    dp = rules.llm.dp
    _, positions = _mean_loads(model, samples)
    _, big_positions = _largest(model, samples)
    enc_s = 0.0
    for name, f in per_module.items():
        if name == "llm" or not positions.get(name):
            continue
        lay = rules.encoders[name]
        # the rank holding the largest sample (split over its group, where the system splits one) runs
        # at least that sample's share
        biggest = f.total * big_positions[name] / positions[name] / rules.split[name] / lay.tp
        enc_s += max(f.total / lay.size, biggest) / rate
    per_rank_tokens = tokens / dp / c.cp
    llm = model.llm
    layers = llm.layers / c.pp
    nvlink = cluster.intra.bandwidth_gbs * 1e9 * cluster.intra.efficiency
    comm = 0.0
    if c.tp > 1:  # 4 all-reduces per layer (2 forward, 2 backward) of the hidden states
        comm += 4 * layers * 2 * (c.tp - 1) / c.tp * per_rank_tokens * llm.hidden * 2 / nvlink
    if c.cp > 1 and c.cp_kind == "allgather":
        # each layer's K/V gathered from the other cp ranks (forward), their gradients reduce-scattered
        # back and, under recomputation, gathered again (simulator/program.py `_compute_op`)
        kv = 2 * llm.kv_heads * llm.dim_head / c.tp * 2 * per_rank_tokens * (c.cp - 1)
        comm += (3 if c.recompute != "none" else 2) * layers * kv / nvlink
    elif c.cp > 1:
        comm += 4 * layers * per_rank_tokens * llm.hidden * 2 / c.tp / nvlink
    pipeline = llm_s + comm + bubble_s
    if rules.separate_encoders:
        return max(pipeline, enc_s)
    if rules.fills_bubbles:  # encoder work goes into the bubbles first
        return max(pipeline, llm_s + comm + enc_s)
    if rules.stage0_encoders:  # stage 0 runs every encoder microbatch beside its layers: the slowest stage
        return pipeline + enc_s * (1 + bubble_s / max(1e-12, llm_s + comm))
    return pipeline + enc_s

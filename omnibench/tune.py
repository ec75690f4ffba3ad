"""Layout search: the fastest layout each system can take, found with the simulator.

A system's throughput depends as much on its layout (LLM tp/pp/cp/ep, microbatches, virtual
stages, recomputation; encoder tp/sp; for noncolocated how many ranks the encoders get) as on
its design, so comparing systems at one hand-picked layout compares layouts. `tune` searches
each system's own space:

1. **Enumerate** the layouts the system can take under the layout rules (`search_space`): tp
   divides the LLM's heads and kv heads and fits in a node; tp*cp divides the kv heads (Ulysses
   splits heads); pp at most the LLM's depth, temporal only pp 1; tp*pp*cp divides the ranks the
   LLM gets; ep only for mixture-of-experts models (dividing experts and dp*cp); microbatches
   {1, 2} at pp 1 and {pp, 2pp, 4pp} with pipelining; virtual stages 2 where pp >= 2 divides the
   depth evenly (refused by a planner that does not interleave yet: recorded, not simulated);
   encoder tp for the systems that give encoders a layout of their own, encoder sp for omni,
   the encoders' share of ranks for noncolocated.
2. **Prune analytically** before simulating anything (`memory_estimate`): per rank, the training
   state of its parameter shard (costs.training_state_bytes, with the same HSDP shard groups the
   planners resolve) plus the activations of the microbatches 1F1B keeps in flight
   (costs.*_activation_bytes at the mean tokens per data rank): a lower bound on what the
   simulator will count. A layout over the device's memory under every recompute mode is dropped;
   otherwise only its cheapest fitting recompute mode is kept (more recomputation never makes the
   same layout faster). The survivors are ordered by an analytic step time (compute at the
   datasheet's achievable rate, the 1F1B bubble (pp-1)/(m+pp-1), tp/cp exchanges over NVLink).
3. **Simulate** the first `budget` of them, the system's default layout always among them, with
   the simulator's memory estimate as the final word (a layout that does not fit there is tried
   again with the next recompute mode, and the smallest simulated/bound ratio seen per mode
   scales the bound for the layouts still to come); then, around the best, the encoder knobs.

No torch here (planners and the simulator only).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from omnibench.plan import PlanError
from omnibench.specs import costs
from omnibench.specs.model import MultimodalSpec, SpecError, VisionEncoderSpec
from omnibench.specs.parallel import ParallelSpec

RECOMPUTE_ORDER = ("none", "selective", "full")
SYSTEMS_WITH_ENCODER_LAYOUT = ("colocated", "noncolocated", "omni")
DEFAULT_BUDGET = 24  # simulated layouts per system in the LLM-layout phase
ENCODER_ROUNDS = 1  # best LLM layouts whose encoder knobs are searched afterwards


@dataclass(frozen=True)
class Candidate:
    """One layout of one system (the ParallelSpec fields tune varies)."""

    system: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    microbatches: int = 0
    virtual_stages: int = 1
    recompute: str = "none"
    encoder_tp: int = 0
    encoder_sp: int = 0
    encoder_ranks: int = 0

    def parallel(self, world: int, gpus_per_node: int, options: dict | None = None) -> ParallelSpec:
        return ParallelSpec(world_size=world, gpus_per_node=gpus_per_node, tp=self.tp, pp=self.pp, cp=self.cp,
                            ep=self.ep, microbatches=self.microbatches, virtual_stages=self.virtual_stages,
                            encoder_tp=self.encoder_tp, encoder_sp=self.encoder_sp,
                            encoder_ranks=self.encoder_ranks, recompute=self.recompute, options=dict(options or {}))

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.microbatches or 'auto'}")
        parts.append(f"rc-{self.recompute}")
        if self.encoder_tp:
            parts.append(f"etp{self.encoder_tp}")
        if self.encoder_sp:
            parts.append(f"esp{self.encoder_sp}")
        if self.encoder_ranks:
            parts.append(f"enc{self.encoder_ranks}")
        return " ".join(parts)


@dataclass
class Trial:
    candidate: Candidate
    estimate_gib: float = 0.0  # analytic memory lower bound
    estimate_s: float = 0.0  # analytic step time (ordering only)
    simulated: bool = False
    step_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    peak_gib: float = 0.0
    fits: bool = False
    note: str = ""  # why it was pruned / refused

    def row(self) -> dict:
        return {"layout": self.candidate.label(), **asdict(self.candidate),
                **{k: v for k, v in asdict(self).items() if k != "candidate"}}


@dataclass
class TuneResult:
    system: str
    world: int
    enumerated: int
    pruned_memory: int
    refused: int
    simulated: int
    trials: list[Trial]  # simulated ones, fastest first (fitting before not fitting)
    default: Trial
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Trial | None:
        ok = [t for t in self.trials if t.fits]
        return ok[0] if ok else None


# -------------------------------------------------------------------------------- search space


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _pow2(cap: int) -> list[int]:
    out, k = [], 1
    while k <= cap:
        out.append(k)
        k *= 2
    return out


def llm_ranks(system: str, model: MultimodalSpec, world: int, c: Candidate, gpus_per_node: int) -> int:
    if system != "noncolocated":
        return world
    from systems.noncolocated import split_ranks

    return world - split_ranks(model, c.parallel(world, gpus_per_node))


def default_candidate(system: str, model: MultimodalSpec | None = None, world: int = 0, gpus_per_node: int = 8,
                      samples=(), memory_bytes: float = 0.0) -> Candidate:
    """The layout `simulate` uses when given no layout flags: the system's default layout, its
    anchor's usual one (systems/defaults.py); tp 1, pp 1 when no model and world size are given."""
    if model is None or not world:
        return Candidate(system)
    from systems.defaults import DEVICE_BYTES, default_layout

    d = default_layout(system, model, world, gpus_per_node, samples, memory_bytes or DEVICE_BYTES)
    return Candidate(system, tp=d.tp, pp=d.pp, cp=d.cp)


def search_space(system: str, model: MultimodalSpec, world: int, gpus_per_node: int = 8) -> list[Candidate]:
    """Every LLM layout the system may take under the layout rules (module docstring), with the
    system's default encoder knobs and recompute "none" (the recompute mode is settled by pruning)."""
    llm = model.llm
    out: list[Candidate] = []
    tps = [t for t in _divisors(gpus_per_node, gpus_per_node) if llm.heads % t == 0 and llm.kv_heads % t == 0]
    pps = [1] if system == "temporal" else [p for p in _pow2(llm.layers) if p <= llm.layers]
    if system == "temporal":
        # VeOmni's space: FSDP over all ranks with no tensor parallelism; cp is the one Ulysses degree
        # of encoders and LLM, so it must divide every encoder's heads too.
        tps = [1]
    enc_heads = [e.heads for e in model.encoders.values()] if system == "temporal" else []
    eps = [1]
    if llm.moe is not None:
        eps = [e for e in _pow2(llm.moe.experts) if llm.moe.experts % e == 0 and e <= 64]
    for tp in tps:
        for cp in _pow2(llm.kv_heads // tp):
            if (llm.kv_heads // tp) % cp or (llm.heads // tp) % cp or tp * cp > gpus_per_node:
                continue
            if any(h % cp for h in enc_heads):
                continue
            for pp in pps:
                for ep in eps:
                    base = Candidate(system, tp=tp, pp=pp, cp=cp, ep=ep)
                    n = llm_ranks_safe(system, model, world, base, gpus_per_node)
                    per = tp * pp * cp
                    if n is None or n % per:
                        continue
                    dp = n // per
                    if dp < 1 or (dp * cp) % ep:
                        continue
                    mbs = [0, 2] if pp == 1 else [pp, 2 * pp, 4 * pp]
                    vs = [1, 2] if pp >= 2 and llm.layers % (2 * pp) == 0 else [1]
                    for m in mbs:
                        for v in vs:
                            if v > 1 and m % pp:
                                continue
                            out.append(replace(base, microbatches=m, virtual_stages=v))
    return out


def llm_ranks_safe(system, model, world, c, gpus_per_node) -> int | None:
    try:
        return llm_ranks(system, model, world, c, gpus_per_node)
    except ValueError:
        return None


def encoder_variants(system: str, model: MultimodalSpec, world: int, c: Candidate, gpus_per_node: int) -> list[Candidate]:
    """The encoder knobs around one LLM layout: encoder tp (colocated, noncolocated, omni), encoder
    sp (omni), the encoders' share of ranks (noncolocated)."""
    if system not in SYSTEMS_WITH_ENCODER_LAYOUT or not model.encoders:
        return []
    heads = [e.heads for e in model.encoders.values()]
    etps = [t for t in (1, 2, 4) if all(h % t == 0 for h in heads) and t <= gpus_per_node]
    out = [replace(c, encoder_tp=t) for t in etps if t != 1]
    if system == "omni":
        out += [replace(c, encoder_sp=k) for k in (2, 4, 8) if all(h % k == 0 for h in heads) and k <= gpus_per_node]
    if system == "noncolocated":
        per = c.tp * c.pp * c.cp
        seen = set()
        for frac in (1 / 8, 1 / 4, 3 / 8, 1 / 2):
            n = max(per, round(frac * world / per) * per)
            if n < world and (world - n) % per == 0 and n not in seen:
                seen.add(n)
                out.append(replace(c, encoder_ranks=n))
    return out


# ------------------------------------------------------------------------------ analytic pruning


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
    elif system in ("homogeneous", "temporal"):
        stage0 = [r for r in llm.ranks if llm.coords(r)["pp"] == 0]
        sp = c.cp if system == "temporal" else 1
        tp = 1 if system == "temporal" else c.tp
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


def _state(params: float, lay) -> costs.StateBytes:
    """Per rank: a module's training state under its layout's data-parallel mode (this project's
    runtime's dtypes, costs.STATE_DTYPES["eager"]): FSDP over its shard group, ZeRO over the whole
    data-parallel group, nothing shared without peers."""
    n = lay.shard_size if lay.fsdp else lay.fsdp_size
    return costs.dp_state_bytes(params, lay.dp_mode if n > 1 else "ddp", max(1, n))


def memory_estimate(system: str, model: MultimodalSpec, world: int, gpus_per_node: int, c: Candidate,
                    samples, options: dict | None = None) -> float:
    """Bytes per rank, a lower bound on the simulator's count (module docstring, step 2), under each
    system's own memory rules (`_rules`): its data-parallel mode per module (omni's encoders ZeRO-2 by
    default, the others' FSDP), how far the largest sample is split (temporal: over its Ulysses
    degree; omni: over its sequence-parallel group, its long LLM samples over their group), and
    which encoder outputs stay live through the LLM pass. `options`: the system's switches
    (ParallelSpec.options, e.g. omni's encoder_dp)."""
    from simulator.engine import RESERVED_BYTES
    from simulator.flops import audio_work, llm_work, stage_layers, vision_work

    rules = _rules(system, model, world, gpus_per_node, c, options)
    lay = rules.llm
    tokens, positions = _mean_loads(model, samples)
    big_tokens, big_positions = _largest(model, samples)
    m = c.microbatches or (2 * c.pp if c.pp > 1 else 1)
    per_mb = max(1, int(tokens / lay.dp / m), big_tokens // rules.llm_split)
    w = llm_work(model.llm, [per_mb], stage_layers(model.llm.layers, c.pp, 0), True, c.pp == 1, c.tp, c.cp, c.ep,
                 c.recompute)
    dense = (w.params - w.expert_params) / c.tp
    expert = w.expert_params / c.tp / max(1, c.ep)
    # As the simulator's timeline holds them at the LLM's first backward: its training state, the
    # activations in flight less a recomputed layer (held only inside a backward); FSDP's gathered
    # bf16 layers and the step's imbalance are left out of this lower bound.
    llm_state = _state(dense, lay)
    if expert:
        e = costs.dp_state_bytes(expert, lay.dp_mode if lay.fsdp_size > 1 else "ddp",
                                 max(1, (lay.shard_size if lay.fsdp else lay.fsdp_size) // max(1, c.ep)))
        llm_state = costs.StateBytes(llm_state.params + e.params, llm_state.grads + e.grads,
                                     llm_state.optimizer + e.optimizer)
    in_flight = min(c.pp, m)
    llm_act = in_flight * (w.act_bytes - w.act_transient)
    llm_side = RESERVED_BYTES + llm_state.params + llm_state.optimizer + llm_state.grads + llm_act
    enc_state = enc_grads = enc_act = 0.0
    for name, enc in model.encoders.items():
        if not positions[name]:
            continue
        elay = rules.encoders[name]
        per_rank = max(positions[name] / max(1, elay.dp * elay.sp), big_positions[name] / rules.split[name])
        sp = max(1, elay.sp)
        if isinstance(enc, VisionEncoderSpec):
            ew = vision_work(enc, [(1, 1, max(1, int(per_rank * sp)))], elay.tp, sp, c.recompute)
        else:
            ew = audio_work(enc, [max(2, int(2 * per_rank * sp))], elay.tp, sp, c.recompute)
        st = _state(ew.params / elay.tp, elay)
        enc_state += st.params + st.optimizer  # its gradients appear only at its own backward
        # whole until grad_sync under this runtime's ZeRO (simulator/memory.py _grad_timeline)
        enc_grads += 4.0 * ew.params / elay.tp if elay.dp_mode.startswith("zero") else st.grads
        enc_act += (ew.act_bytes - ew.act_transient) * (1.0 if rules.whole_batch_live else in_flight / m)
    if rules.separate_encoders:
        return max(llm_side, RESERVED_BYTES + enc_state + enc_grads + enc_act)
    # at the LLM's first backward, and at the end of the step (every gradient, no activation left)
    return max(llm_side + enc_state + enc_act, llm_side - llm_act + enc_state + enc_grads)


def time_estimate(system: str, model: MultimodalSpec, world: int, gpus_per_node: int, c: Candidate, samples,
                  cluster, options: dict | None = None) -> float:
    """Seconds, for ordering candidates only: each module's compute at the datasheet's achievable
    matmul rate over the ranks the system runs it on, the 1F1B bubble, the largest sample's share of
    its data rank, tp all-reduces and cp all-to-alls over NVLink. Each system's own balancing:
    homogeneous encodes on stage 0 only, colocated before the pipeline, noncolocated on ranks of
    their own beside it, temporal splits every sample over its Ulysses degree, omni puts encoder
    work in the pipeline's bubbles and splits its largest samples over their groups."""
    rules = _rules(system, model, world, gpus_per_node, c, options)
    per_module = costs.batch_flops(model, samples, c.recompute)
    gpu = cluster.gpu
    rate = gpu.peak_flops * gpu.matmul_efficiency
    llm_flops = per_module["llm"].total
    n_llm = rules.llm.size
    m = c.microbatches or (2 * c.pp if c.pp > 1 else 1)
    tokens, _ = _mean_loads(model, samples)
    # A rank's LLM work is at least the mean and at least the largest sample's (exact FLOPs, attention
    # quadratic) split over the ranks that share it: its stage's tp x cp, and omni's long-sample group.
    # Under 1F1B every stage waits (pp - 1) microbatch slots, each at least that sample's.
    big_tokens, _ = _largest(model, samples)
    per_rank = llm_flops / n_llm / rate
    big = costs.llm_flops(model.llm, [big_tokens], recompute=costs.recompute_policy(c.recompute)["llm"]).total
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
    if c.cp > 1:
        comm += 4 * layers * per_rank_tokens * llm.hidden * 2 / c.tp / nvlink
    pipeline = llm_s + comm + bubble_s
    if rules.separate_encoders:
        return max(pipeline, enc_s)
    if rules.fills_bubbles:  # encoder work goes into the bubbles first
        return max(pipeline, llm_s + comm + enc_s)
    if rules.stage0_encoders:  # stage 0 runs every encoder microbatch beside its layers: the slowest stage
        return pipeline + enc_s * (1 + bubble_s / max(1e-12, llm_s + comm))
    return pipeline + enc_s


# ------------------------------------------------------------------------------------- search


def _next_recompute(system, model, world, gpn, c: Candidate, samples) -> Candidate | None:
    """The next recompute mode that holds less memory (selective keeps what none keeps with a
    flash-style core, so after none comes full)."""
    here = memory_estimate(system, model, world, gpn, c, samples)
    for mode in RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(c.recompute) + 1:]:
        nxt = replace(c, recompute=mode)
        if memory_estimate(system, model, world, gpn, nxt, samples) < here:
            return nxt
    return None


def _evaluate(trial: Trial, model, world, gpus_per_node, batches, cluster, profile, options, stack: str = "eager",
              dp_fields: dict | None = None) -> None:
    from simulator.engine import SimOptions, simulate
    from systems import get_planner

    c = trial.candidate
    planner = get_planner(c.system)
    parallel = replace(c.parallel(world, gpus_per_node, options), **(dp_fields or {}))
    t = tokens = flops = 0.0
    peak = 0.0
    fits = True
    for batch in batches:
        plan = planner.plan(model, parallel, batch)
        r = simulate(plan, model, cluster, calibration=profile, options=SimOptions(recompute=c.recompute, stack=stack))
        t += r.step_time
        tokens += r.tokens
        flops += r.model_flops
        peak = max(peak, r.peak_memory)
        fits = fits and r.fits
        if not fits:
            trial.note = r.fit_message
    trial.simulated = True
    trial.step_s = t / len(batches)
    trial.tokens_per_s_per_gpu = tokens / t / world if t else 0.0
    trial.mfu = flops / t / world / cluster.gpu.peak_flops if t else 0.0
    trial.peak_gib = peak / 2**30
    trial.fits = fits


def tune(system: str, model: MultimodalSpec, batches: list, cluster, *, profile=None, budget: int = DEFAULT_BUDGET,
         options: dict | None = None, encoder_search: bool = True, log=None, stack: str = "eager",
         dp_mode: str | None = None, default: Candidate | None = None) -> TuneResult:
    """Search `system`'s layouts on `batches` (a step's samples each) on `cluster`, starting from
    `default` (omnibench/resolve.py's layout; default: `default_candidate`); every layout simulated
    with the `stack`'s kernels (eager | fused) and, when given, the data-parallel mode `dp_mode`."""
    from omnibench.specs.parallel import dp_mode_fields
    from systems import get_planner

    get_planner(system)  # one-line error for an unknown system
    t0 = time.perf_counter()
    world, gpn = cluster.num_gpus, cluster.gpus_per_node
    capacity = cluster.gpu.memory_bytes
    samples = [s for b in batches for s in b.samples]
    per_batch = samples[: len(batches[0].samples)]
    space = search_space(system, model, world, gpn)
    keep: list[Trial] = []
    pruned = refused = 0
    notes: list[str] = []

    def settle(c: Candidate) -> tuple[Trial | None, str]:
        """The cheapest recompute mode whose analytic memory fits; else None and why."""
        for mode in RECOMPUTE_ORDER:
            cand = replace(c, recompute=mode)
            try:
                cand.parallel(world, gpn).validate(model)
                est = memory_estimate(system, model, world, gpn, cand, per_batch)
            except (SpecError, PlanError, ValueError) as e:
                return None, f"{cand.label()}: {str(e).splitlines()[0]}"
            if est <= capacity:
                return Trial(cand, estimate_gib=est / 2**30,
                             estimate_s=time_estimate(system, model, world, gpn, cand, per_batch, cluster)), ""
        return None, "memory"

    for c in space:
        tr, why = settle(c)
        if tr is not None:
            keep.append(tr)
        elif why == "memory":
            pruned += 1
        else:
            refused += 1
            notes.append(why)
    keep.sort(key=lambda tr: (tr.estimate_s, tr.candidate.label()))
    start = default or default_candidate(system, model, world, gpn, per_batch, capacity)
    default = settle(start)[0] or Trial(replace(start, recompute="full"))
    queue = keep[:budget]
    if all(tr.candidate != default.candidate for tr in queue):
        queue.append(default)
    done: dict[Candidate, Trial] = {}

    # Learned while searching: per recompute mode, the smallest ratio of simulated peak memory to
    # the analytic bound seen so far. A layout whose bound times that ratio is over the device is
    # not simulated in that mode (the bound alone is loose: it misses the imbalance of a step).
    ratio: dict[str, float] = {}

    def run(tr: Trial) -> Trial:
        c = tr.candidate
        while True:
            if c in done:
                return done[c]
            est = memory_estimate(system, model, world, gpn, c, per_batch)
            nxt = _next_recompute(system, model, world, gpn, c, per_batch)
            if nxt is not None and est * ratio.get(c.recompute, 1.0) > capacity:
                c = nxt
                continue
            tr = replace(tr, candidate=c, note="", simulated=False, estimate_gib=est / 2**30)
            try:
                _evaluate(tr, model, world, gpn, batches, cluster, profile, options, stack,
                          dp_mode_fields(dp_mode) if dp_mode else None)
            except ValueError as e:  # a planner refusing a layout (e.g. interleaving not planned)
                tr.note = str(e).splitlines()[0]
                tr.simulated = False
            done[c] = tr
            if log:
                log(tr)
            if tr.simulated and est > 0:
                ratio[c.recompute] = min(ratio.get(c.recompute, float("inf")), tr.peak_gib * 2**30 / est)
            if tr.simulated and not tr.fits and nxt is not None:
                c = nxt  # the simulator's estimate is the final word
                continue
            return tr

    for tr in queue:
        run(tr)
    if encoder_search:
        ranked = sorted((t for t in done.values() if t.fits), key=lambda t: t.step_s)
        for base in ranked[:ENCODER_ROUNDS]:
            for var in encoder_variants(system, model, world, base.candidate, gpn):
                if var in done:
                    continue
                try:
                    var.parallel(world, gpn).validate(model)
                except ValueError as e:
                    notes.append(f"{var.label()}: {str(e).splitlines()[0]}")
                    continue
                run(Trial(var))
    sims = [t for t in done.values() if t.simulated]
    sims.sort(key=lambda t: (not t.fits, t.step_s))
    for t in done.values():
        if not t.simulated and t.note:
            notes.append(f"{t.candidate.label()}: {t.note}")
    d = done.get(default.candidate, default)
    while d.simulated and not d.fits and d.candidate.recompute != "full":
        nxt = replace(d.candidate, recompute=RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(d.candidate.recompute) + 1])
        d = done.get(nxt) or run(Trial(nxt))
    return TuneResult(system, world, len(space), pruned, refused, len(sims), sims, d, time.perf_counter() - t0,
                      notes)

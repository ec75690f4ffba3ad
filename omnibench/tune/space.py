"""The search space: one layout of one system (`Candidate`), every layout its layout rules allow
(`search_space`) with the microbatch counts and recompute modes searched, the encoder knobs around an
LLM layout (`encoder_variants`), and the layouts one change away from one (`neighbour_layouts`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields
from systems import QUOTA_OPTION
from systems.spatial import SPATIAL_MICROBATCHES

RECOMPUTE_ORDER = ("none", "selective", "full")  # the uniform modes, least memory last
SYSTEMS_WITH_ENCODER_LAYOUT = ("colocated", "noncolocated", "omni")
# VeOmni's space (tp 1, pp 1, one Ulysses degree for every module): temporal's, and spatial's, which runs the
# same layout with its modules side by side
ULYSSES_SYSTEMS = ("temporal", "spatial")
# spatial's encoder quotas searched around its best layout, beside its default (the balancer's work share)
SPATIAL_QUOTAS = ("0.2", "0.3", "0.4", "0.5", "0.6")


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
    # omni: how the encoders' data parallelism holds their state (systems/omni/options.py `encoder_dp`);
    # "": the system's default (ZeRO-2) or what the user's options say
    encoder_dp: str = ""
    # how the LLM attends across its cp ranks: Ulysses (heads split: cp must divide the heads and kv
    # heads per tp rank) or all-gathered K/V (Llama 3's context parallelism: any cp; `plan.CP_KINDS`)
    cp_kind: str = "ulysses"
    # spatial: the encoders' share of the device (systems/spatial.py `quota`); "": auto or the user's options
    quota: str = ""
    # how data parallelism holds the training state (`--dp-mode`: specs/parallel.py DP_MODES); "": the tune's
    # (the user's --dp-mode, else the system's default)
    dp_mode: str = ""

    def parallel(self, world: int, gpus_per_node: int, options: dict | None = None) -> ParallelSpec:
        options = dict(options or {})
        if self.encoder_dp:
            options["encoder_dp"] = self.encoder_dp
        if self.quota and QUOTA_OPTION not in options:  # a quota the user gives wins (an ablation's even split)
            options[QUOTA_OPTION] = self.quota
        return ParallelSpec(world_size=world, gpus_per_node=gpus_per_node, tp=self.tp, pp=self.pp, cp=self.cp,
                            cp_kind=self.cp_kind, ep=self.ep, microbatches=self.microbatches, virtual_stages=self.virtual_stages,
                            encoder_tp=self.encoder_tp, encoder_sp=self.encoder_sp,
                            encoder_ranks=self.encoder_ranks, recompute=self.recompute, options=options,
                            **(dp_mode_fields(self.dp_mode) if self.dp_mode else {}))

    def flags(self) -> list[str]:
        """The `omnibench simulate` (and `run`, `plan`) flags that give this layout: what a user types to
        simulate it again without a tune."""
        out = ["--tp", str(self.tp), "--pp", str(self.pp), "--cp", str(self.cp)]
        if self.cp > 1 and self.cp_kind != "ulysses":
            out += ["--cp-kind", self.cp_kind]
        if self.ep > 1:
            out += ["--ep", str(self.ep)]
        if self.virtual_stages > 1:
            out += ["--virtual-stages", str(self.virtual_stages)]
        if self.microbatches:
            out += ["--microbatches", str(self.microbatches)]
        out += ["--recompute", self.recompute]
        for flag, value in (("--encoder-tp", self.encoder_tp), ("--encoder-sp", self.encoder_sp),
                            ("--encoder-ranks", self.encoder_ranks)):
            if value:
                out += [flag, str(value)]
        if self.encoder_dp:
            out += ["--option", f"encoder_dp={self.encoder_dp}"]
        if self.quota:
            out += ["--option", f"quota={self.quota}"]
        if self.dp_mode:
            out += ["--dp-mode", self.dp_mode]
        return out

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + (f"-{self.cp_kind}" if self.cp_kind != "ulysses" else ""))
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
        if self.encoder_dp:
            parts.append(f"edp-{self.encoder_dp}")
        if self.quota:
            parts.append(f"q{self.quota}")
        if self.dp_mode:
            parts.append(f"dp-{self.dp_mode}")
        return " ".join(parts)


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


def default_microbatches(system: str, pp: int) -> int:
    """The count a planner takes when given none (systems/common.py::default_microbatches; noncolocated
    counts its encoder stage as one more pipeline stage)."""
    if system == "noncolocated":
        return 2 * (pp + 1)
    if system == "spatial":
        return SPATIAL_MICROBATCHES
    return 2 * pp if pp > 1 else 1


def default_candidate(system: str, model: MultimodalSpec | None = None, world: int = 0, gpus_per_node: int = 8,
                      samples=(), memory_bytes: float = 0.0) -> Candidate:
    """The layout `simulate` uses when given no layout flags: the system's default layout, its
    anchor's usual one (systems/defaults.py), with the microbatch count its planner would take;
    tp 1, pp 1 when no model and world size are given."""
    if model is None or not world:
        return Candidate(system)
    from systems.defaults import DEVICE_BYTES, default_layout

    d = default_layout(system, model, world, gpus_per_node, samples, memory_bytes or DEVICE_BYTES)
    return Candidate(system, tp=d.tp, pp=d.pp, cp=d.cp, microbatches=default_microbatches(system, d.pp))


def microbatch_counts(system: str, pp: int) -> list[int]:
    """Every count the search tries at `pp` stages: 1, 2, 4 unpipelined, pp, 2pp, 4pp pipelined (1F1B
    needs at least pp), and the system's own default."""
    base = [1, 2, 4] if pp == 1 else [pp, 2 * pp, 4 * pp]
    return sorted({*base, default_microbatches(system, pp)})


def recomputed_modules(model: MultimodalSpec, frozen: tuple[str, ...] = (), samples: Sequence = ()) -> list[str]:
    """The modules whose recomputation is a choice: the LLM, and every encoder that trains (a `frozen`
    one runs no backward) and, when `samples` are given, has work in them."""
    trained = [m for m in model.encoders if m not in frozen]
    if samples:
        from simulator.flops import model_train_flops

        base = model_train_flops(model, samples)
        trained = [m for m in trained if model_train_flops(model, samples, f"{m}=full") > base]
    return ["llm", *trained]


def mode_key(mode: str, modules: Sequence[str]) -> tuple[str, ...]:
    """What `mode` recomputes of `modules`: two modes with one key are one choice there."""
    from omnibench.specs.costs import recompute_policy

    policy = recompute_policy(mode)
    return tuple(policy[m] for m in modules)


def recompute_modes(model: MultimodalSpec, frozen: tuple[str, ...] = (), samples: Sequence = ()) -> list[str]:
    """The activation-recomputation choices searched, per module (costs.recompute_policy): the three
    uniform modes, then the LLM at none, selective or full under every set of the encoders recomputed
    in full (e.g. "vision=full", "llm=selective,vision=full,audio=full"); one name per choice over the
    modules where it is one (`recomputed_modules`). Encoder activations are most of a video step's
    memory and the LLM most of its time, so the mixed modes are often the fastest that fit; one encoder
    alone is the cheapest where the other's activations are small. `auto`'s list (omnibench/resolve.py
    `recompute_modes`) is part of this one."""
    return modes_of(recomputed_modules(model, frozen, samples))


def modes_of(modules: Sequence[str]) -> list[str]:
    """`recompute_modes` over `modules` (the LLM first, then the encoders that are a choice)."""
    from itertools import combinations

    encoders = modules[1:]
    modes = list(RECOMPUTE_ORDER)
    for llm in RECOMPUTE_ORDER:
        for k in range(len(encoders) + 1):
            for enc in combinations(encoders, k):
                parts = ([f"llm={llm}"] if llm != "none" else []) + [f"{m}=full" for m in enc]
                if parts:
                    modes.append(",".join(parts))
    seen: set[tuple[str, ...]] = set()
    out = []
    for mode in modes:  # the uniform names first
        key = mode_key(mode, modules)
        if key not in seen:
            seen.add(key)
            out.append(mode)
    return out


CP_KINDS_SEARCHED = ("ulysses", "allgather")


def search_space(system: str, model: MultimodalSpec, world: int, gpus_per_node: int = 8,
                 cp_kinds: tuple[str, ...] = CP_KINDS_SEARCHED) -> list[Candidate]:
    """Every LLM layout the system may take under the layout rules (the package's docstring), with the
    system's default encoder knobs and recompute "none" (the recompute mode is settled by pruning);
    context parallelism of the `cp_kinds` given."""
    llm = model.llm
    out: list[Candidate] = []
    tps = [t for t in _divisors(gpus_per_node, gpus_per_node) if llm.heads % t == 0 and llm.kv_heads % t == 0]
    pps = [1] if system in ULYSSES_SYSTEMS else [p for p in _pow2(llm.layers) if p <= llm.layers]
    if system in ULYSSES_SYSTEMS:
        # VeOmni's space: FSDP over all ranks with no tensor parallelism; cp is the one Ulysses degree
        # of encoders and LLM, so it must divide every encoder's heads too.
        tps = [1]
    enc_heads = [e.heads for e in model.encoders.values()] if system in ULYSSES_SYSTEMS else []
    eps = [1]
    if llm.moe is not None:
        eps = [e for e in _pow2(llm.moe.experts) if llm.moe.experts % e == 0 and e <= 64]
    splits = []  # (tp, cp, cp_kind)
    for tp in tps:
        for cp in _pow2(gpus_per_node // tp):
            if any(h % cp for h in enc_heads):
                continue
            if cp == 1 or ("ulysses" in cp_kinds and (llm.kv_heads // tp) % cp == 0 and (llm.heads // tp) % cp == 0):
                splits.append((tp, cp, "ulysses"))
            if cp > 1 and "allgather" in cp_kinds:
                splits.append((tp, cp, "allgather"))
    for tp, cp, kind in splits:
        for pp in pps:
            for ep in eps:
                base = Candidate(system, tp=tp, pp=pp, cp=cp, ep=ep, cp_kind=kind)
                n = llm_ranks_safe(system, model, world, base, gpus_per_node)
                per = tp * pp * cp
                if n is None or n % per:
                    continue
                dp = n // per
                if dp < 1 or (dp * cp) % ep:
                    continue
                vs = [1, 2] if pp >= 2 and llm.layers % (2 * pp) == 0 else [1]
                for m in microbatch_counts(system, pp):
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


# omni's encoder state modes the search weighs ("": the default, ZeRO-2). ZeRO-2's reduce-scatter and
# all-gather are rings over every rank, and a ring pays a hop latency per member, so at thousands of GPUs
# its exposed communication grows with the cluster (omni_av: 0.10 -> 0.18 s per step from 1,024 to 8,192
# H100s). Two modes keep the rings to a shard group of a few nodes (systems/common.py `resolve_dp_shard`),
# replicated across groups: HSDP, which also shards the weights and so locks the encoder forward in step
# with its peers (omni_av +7% at 8,192 H100s, long_video -12% there), and hybrid ZeRO-2 (`hzero2`, whole
# weights, no lock; a little more optimizer state per rank). ddp and zero1 move ZeRO-2's bytes with more
# memory, fsdp spans every rank like ZeRO-2 and locks like HSDP: neither can win.
ENCODER_DP_MODES = ("", "hsdp", "hzero2")


def encoder_variants(system: str, model: MultimodalSpec, world: int, c: Candidate, gpus_per_node: int,
                     options: dict | None = None) -> list[Candidate]:
    """The encoder knobs around one LLM layout: encoder tp (colocated, noncolocated, omni), encoder
    sp and the encoders' data-parallel mode (omni; not where the user's `options` fix it), the encoders'
    share of ranks (noncolocated)."""
    if system == "spatial" and model.encoders and QUOTA_OPTION not in (options or {}):
        # a quota acts only where two microbatches let the lanes overlap: around a one-microbatch best
        # (temporal's step), its two-microbatch twin
        base = c if c.microbatches >= 2 else replace(c, microbatches=2, quota="")
        return ([base] if base != c else []) + [replace(base, quota=q) for q in SPATIAL_QUOTAS if q != base.quota]
    if system not in SYSTEMS_WITH_ENCODER_LAYOUT or not model.encoders:
        return []
    heads = [e.heads for e in model.encoders.values()]
    etps = [t for t in (1, 2, 4) if all(h % t == 0 for h in heads) and t <= gpus_per_node]
    out = [replace(c, encoder_tp=t) for t in etps if t != 1]
    if system == "omni":
        out += [replace(c, encoder_sp=k) for k in (2, 4, 8) if all(h % k == 0 for h in heads) and k <= gpus_per_node]
        from systems.common import auto_shard_span

        # on a cluster no larger than one shard group HSDP is plain FSDP and hzero2 is ZeRO-2
        if "encoder_dp" not in (options or {}) and world > auto_shard_span(gpus_per_node):
            out += [replace(c, encoder_dp=m) for m in ENCODER_DP_MODES if m != c.encoder_dp]
    if system == "noncolocated":
        per = c.tp * c.pp * c.cp
        seen = set()
        for frac in (1 / 8, 1 / 4, 3 / 8, 1 / 2):
            n = max(per, round(frac * world / per) * per)
            if n < world and (world - n) % per == 0 and n not in seen:
                seen.add(n)
                out.append(replace(c, encoder_ranks=n))
    return out


# the data-parallel modes a layout's neighbours take where the user fixed none (specs/parallel.py DP_MODES; hsdp
# is fsdp within shard groups of a few nodes, which the planners choose by themselves at scale)
NEIGHBOUR_DP_MODES = ("ddp", "zero1", "zero2", "fsdp")


def neighbour_layouts(c: Candidate, model: MultimodalSpec, world: int, gpus_per_node: int, modes: list[str],
                      options: dict | None = None, dp_modes: tuple[str, ...] = NEIGHBOUR_DP_MODES) -> list[Candidate]:
    """The layouts one change away from `c`: tp, pp, cp and the microbatch count halved or doubled, the other
    cp kind, interleaving on or off, every other recompute mode of `modes`, the encoder knobs
    (`encoder_variants`), and every other data-parallel mode of `dp_modes`. What the search's descent walks
    and `benchmarks/adversarial_baselines.py` tries against a tuned answer."""
    out = []
    for f in ("tp", "pp", "cp", "microbatches"):
        v = getattr(c, f)
        for w in (v * 2, v // 2):
            if w >= 1 and w != v and not (f == "microbatches" and v == 0):
                out.append(replace(c, **{f: w}))
    if c.cp > 1:
        out.append(replace(c, cp_kind="allgather" if c.cp_kind == "ulysses" else "ulysses"))
    if c.pp > 1:
        out += [replace(c, virtual_stages=v) for v in (1, 2) if v != c.virtual_stages]
    out += [replace(c, recompute=m) for m in modes if m != c.recompute]
    out += encoder_variants(c.system, model, world, c, gpus_per_node, options)
    out += [replace(c, dp_mode=m) for m in dp_modes if m != c.dp_mode]
    return [n for n in dict.fromkeys(out) if n != c]


def llm_key(c: Candidate) -> Candidate:
    """A layout of the pruned space as it was enumerated (recompute and encoder knobs cleared)."""
    return replace(c, recompute="none", encoder_tp=0, encoder_sp=0, encoder_ranks=0, encoder_dp="", quota="",
                   dp_mode="")

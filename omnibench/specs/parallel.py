"""The parallel layout a user asks for; each system turns it into per-module Layouts in its Plan.

Validated once here (`ParallelSpec.validate(model)`), so planners and executors trust it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnibench.specs.model import FREEZABLE, MultimodalSpec, SpecError, check_freeze, parse_freeze

# How data parallelism holds the training state, as a user names it (`--dp-mode`), and the
# ParallelSpec fields each name sets: fsdp, zero, and dp_shard (-1 plain FSDP, 0 automatic HSDP).
DP_MODES = {
    "ddp": dict(fsdp=False, zero=0, dp_shard=-1),
    "zero1": dict(fsdp=False, zero=1, dp_shard=-1),
    "zero2": dict(fsdp=False, zero=2, dp_shard=-1),
    "fsdp": dict(fsdp=True, zero=0, dp_shard=-1),
    "hsdp": dict(fsdp=True, zero=0, dp_shard=0),
}


def dp_mode_fields(mode: str) -> dict:
    """ParallelSpec fields of a `--dp-mode` name; one line naming the allowed values otherwise."""
    if mode not in DP_MODES:
        raise SpecError(f"dp_mode must be one of {', '.join(DP_MODES)}; got {mode!r}")
    return dict(DP_MODES[mode])


@dataclass(frozen=True)
class ParallelSpec:
    """LLM mesh (dp x cp x tp per pipeline stage, pp stages) and encoder knobs.

    `dp=0` means "whatever is left": world_size // (tp * pp * cp) for systems whose LLM spans
    every rank. Encoder layout knobs are read by the systems that give encoders their own
    layout (colocated, noncolocated, omni); 0 means the system's default.
    """

    world_size: int
    gpus_per_node: int = 8
    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # How context parallelism splits attention: "ulysses" (all-to-all to whole sequences x 1/cp of the
    # heads; what the runtime runs), "ring" (each rank keeps 1/cp of every sequence, K/V blocks
    # travel around the cp ranks) or "allgather" (each rank keeps 1/cp of every sequence and
    # all-gathers the whole K/V before each attention: Llama 3, torchtitan); ring is simulated only
    cp_kind: str = "ulysses"
    ep: int = 1
    microbatches: int = 0  # per LLM data rank per step; 0: system default (>= pp)
    # Interleaved 1F1B (Narayanan et al. SC'21): model chunks per pipeline rank, each rank holding
    # `virtual_stages` non-adjacent slices of layers. 1: plain 1F1B. Planned by homogeneous and
    # colocated (systems/common.py::interleaved_1f1b) and simulated; the runtime refuses it
    # (`check_runtime`, called by omnibench/runtime/launch.py::check_layout).
    virtual_stages: int = 1
    encoder_tp: int = 0
    encoder_sp: int = 0
    encoder_ranks: int = 0  # noncolocated: ranks given to the encoders (the rest run the LLM)
    fsdp: bool = True
    # Without fsdp: the ZeRO stage over the data-parallel group (Layout.zero): 0 DDP, 1 optimizer
    # state and master weights sharded (Megatron's distributed optimizer), 2 also the gradients.
    zero: int = 0
    # HSDP: ranks one copy of a module's parameters is sharded over, out of its FSDP group (the LLM:
    # dp*cp); replicated across the groups. 0: automatic (systems/common.py::resolve_dp_shard:
    # a shard group spans at most 8 nodes, so nothing changes up to 64 ranks); -1: the whole FSDP
    # group (plain FSDP, whatever the cluster size).
    dp_shard: int = 0
    # Megatron's account_for_embedding/loss_in_pipeline_split: the embedding and the loss count as a
    # layer each when the LLM is cut into pp * virtual_stages stages (Layout.embedding_loss_stages)
    embedding_loss_stages: bool = False
    # MoE: expert tensor parallelism; 0 as tp (ep drawn from dp*cp), 1: experts whole, ep drawn from
    # dp*cp*tp (Megatron's MoE parallel folding, Layout.expert_tp)
    expert_tp: int = 0
    recompute: str = "none"  # "none" | "full" | "selective", or per module "vision=full,llm=none"
    # bf16 runs: how a module FSDP does not shard (one rank, DDP) holds its weights (RunSpec.mixed_precision,
    # omnibench/runtime/master.py): "autocast" fp32 weights cast per op | "master" bf16 weights, fp32 master
    mixed_precision: str = "autocast"
    options: dict = field(default_factory=dict)  # system-specific switches (e.g. omni's ablations)
    # Modules whose parameters train not at all (`--freeze`, FREEZABLE's order): no gradients, no optimizer
    # state, no gradient reduction; a frozen encoder runs no backward (systems/common.py `drop_frozen`)
    freeze: tuple[str, ...] = ()

    def validate(self, model: MultimodalSpec) -> None:
        """Refuse impossible layouts before any process starts, naming the field."""
        for name in ("world_size", "tp", "pp", "cp", "ep", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise SpecError(f"virtual_stages must be a positive integer, got {self.virtual_stages!r}")
        if self.virtual_stages > 1 and self.pp < 2:
            raise SpecError(f"virtual_stages={self.virtual_stages} needs pp >= 2 (interleaving splits pipeline stages)")
        if self.virtual_stages > 1 and self.microbatches and self.microbatches % self.pp:
            raise SpecError(f"virtual_stages={self.virtual_stages}: microbatches ({self.microbatches}) must be a "
                            f"multiple of pp={self.pp} under the interleaved schedule")
        if self.dp < 0 or self.microbatches < 0:
            raise SpecError("dp and microbatches must be >= 0 (0 = system default)")
        for name in ("encoder_tp", "encoder_sp", "encoder_ranks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"{name} must be 0 (the system's default) or a positive integer, got {v!r}")
        if not isinstance(self.dp_shard, int) or self.dp_shard < -1:
            raise SpecError(f"dp_shard must be -1 (whole FSDP group), 0 (automatic) or a positive divisor of dp*cp; "
                            f"got {self.dp_shard!r}")
        if self.zero not in (0, 1, 2):
            raise SpecError(f"zero must be 0 (DDP), 1 (ZeRO-1) or 2 (ZeRO-2); got {self.zero!r}")
        if self.zero and self.fsdp:
            raise SpecError(f"zero={self.zero} needs fsdp off (FSDP already shards parameters, gradients and "
                            "optimizer state)")
        if self.dp_shard > 0 and not self.fsdp:
            raise SpecError(f"dp_shard={self.dp_shard} needs fsdp (without it parameters are replicated, not sharded)")
        if self.dp_shard > 0 and self.dp and (self.dp * self.cp) % self.dp_shard:
            g = self.dp * self.cp
            raise SpecError(f"dp_shard={self.dp_shard} must divide dp*cp = {g} (the ranks FSDP shards the LLM over); "
                            f"allowed: -1 (whole group), 0 (automatic) or a divisor of {g}")
        if self.dp_shard > 0 and self.ep > 1 and self.dp_shard % self.ep:
            raise SpecError(f"dp_shard={self.dp_shard} must be a multiple of ep={self.ep} "
                            "(a shard group holds whole expert groups); 0 = automatic")
        from omnibench.plan import CP_KINDS
        from omnibench.specs.run import MIXED_PRECISION

        if self.mixed_precision not in MIXED_PRECISION:
            raise SpecError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}; got {self.mixed_precision!r}")

        if self.cp_kind not in CP_KINDS:
            raise SpecError(f"cp_kind must be one of {', '.join(CP_KINDS)}; got {self.cp_kind!r}")
        if not isinstance(self.freeze, tuple) or parse_freeze(self.freeze) != self.freeze:
            raise SpecError(f"--freeze: a tuple of modules in the order {', '.join(FREEZABLE)}, each once; got "
                            f"{self.freeze!r}")
        check_freeze(self.freeze, model)
        from omnibench.specs.costs import recompute_policy

        try:
            recompute_policy(self.recompute)
        except ValueError as e:
            raise SpecError(str(e)) from None
        llm = model.llm
        if llm.heads % self.tp or llm.kv_heads % self.tp:
            allowed = [t for t in range(1, llm.kv_heads + 1) if llm.heads % t == 0 and llm.kv_heads % t == 0]
            raise SpecError(f"tp={self.tp} does not divide the LLM's attention heads ({llm.heads}) and kv heads "
                            f"({llm.kv_heads}) of {llm.name}; allowed tp: {', '.join(map(str, allowed))}")
        # Ulysses splits each tp rank's heads again over the cp ranks (an all-to-all from sequence to head
        # shards), so cp must divide both head counts per tp rank; all-gathered K/V and ring attention keep
        # every head on every rank and take any cp.
        if self.cp > 1 and self.cp_kind == "ulysses" and ((llm.heads // self.tp) % self.cp
                                                           or (llm.kv_heads // self.tp) % self.cp):
            allowed = [c for c in range(1, llm.kv_heads // self.tp + 1)
                       if (llm.heads // self.tp) % c == 0 and (llm.kv_heads // self.tp) % c == 0]
            raise SpecError(f"cp={self.cp} with cp_kind=ulysses must divide the LLM's heads per tp rank "
                            f"({llm.heads}/{self.tp} query, {llm.kv_heads}/{self.tp} kv) of {llm.name}; allowed cp: "
                            f"{', '.join(map(str, allowed))}, or cp_kind=allgather or ring for any cp")
        units = llm.layers + (2 if self.embedding_loss_stages else 0)
        if self.pp * self.virtual_stages > units:
            extra = " plus its embedding and loss" if self.embedding_loss_stages else ""
            raise SpecError(f"pp*virtual_stages={self.pp * self.virtual_stages} is deeper than the LLM's "
                            f"{llm.layers} layers{extra}")
        if self.ep > 1:
            if llm.moe is None:
                raise SpecError(f"ep={self.ep} needs a mixture-of-experts LLM; {llm.name} is dense")
            if llm.moe.experts % self.ep:
                raise SpecError(f"ep={self.ep} does not divide the LLM's {llm.moe.experts} experts")
        if self.expert_tp not in (0, 1):
            raise SpecError(f"expert_tp must be 0 (experts split over tp) or 1 (experts whole, ep over dp*cp*tp); "
                            f"got {self.expert_tp!r}")
        for enc_name, enc in model.encoders.items():
            if self.encoder_tp and enc.heads % self.encoder_tp:
                raise SpecError(f"encoder_tp={self.encoder_tp} does not divide {enc_name} heads ({enc.heads})")
            if self.encoder_sp and enc.heads % self.encoder_sp:
                raise SpecError(f"encoder_sp={self.encoder_sp} does not divide {enc_name} heads ({enc.heads})")

    @property
    def dp_mode(self) -> str:
        """ddp, zero1, zero2, fsdp or hsdp (automatic HSDP, dp_shard 0, counts as fsdp here)."""
        if self.fsdp:
            return "hsdp" if self.dp_shard > 0 else "fsdp"
        return ("ddp", "zero1", "zero2")[self.zero]

    def check_runtime(self) -> None:
        """What only the simulator executes: refuse it before a real run starts."""
        from omnibench.plan import RUNTIME_CP_KINDS

        if self.cp > 1 and self.cp_kind not in RUNTIME_CP_KINDS:
            raise SpecError(f"cp_kind={self.cp_kind}: the runtime runs Ulysses and all-gather-KV context parallelism "
                            "(ring attention is simulated, not run)")
        if self.virtual_stages > 1:
            raise SpecError(f"virtual_stages={self.virtual_stages}: interleaved 1F1B is not supported by the runtime; "
                            "the runtime runs plain 1F1B (virtual_stages=1)")
        if self.embedding_loss_stages:
            raise SpecError("embedding_loss_stages: the runtime cuts stages by layers only (simulated only)")
        if self.expert_tp:
            raise SpecError("expert_tp=1: the runtime splits experts over tp (MoE parallel folding is simulated only)")

"""RunSpec: everything one `omnibench run` needs, validated once at the edge (no torch here)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from omnibench.specs.model import FREEZABLE, SpecError, parse_freeze

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
MIXED_PRECISION = ("autocast", "master")  # omnibench/runtime/master.py (no torch import here)
OPTIMIZERS = ("adamw", "sgd")
# rank 0 keeps every step's Plan in memory for the record (plans.jsonl): a benchmark run, not a training job
MAX_STEPS = 100_000
# --timeout bounds every wait (rendezvous, collectives, loaders): under a second no rendezvous completes,
# and past a day a rank that never answers is as good as never noticed (inf and nan are no bound at all)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 86_400.0


@dataclass
class RunSpec:
    system: str
    workload: str = "mixed_video"
    model: str = ""  # preset name; "" = tiny-omni on CPU, a real preset on CUDA
    nproc: int = 0  # 0: 2 on CPU, every GPU on CUDA
    steps: int = 5
    seed: int = 0
    dp: int = 0
    # tp, pp, cp all 0: the system's default layout (systems/defaults.py, settled by launch.resolve);
    # some 0 and others given: the 0s are 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_kind: str = "ulysses"  # how the LLM's cp ranks attend: ulysses | allgather (ParallelSpec.cp_kind)
    ep: int = 1
    microbatches: int = 0
    encoder_tp: int = 0
    encoder_sp: int = 0  # encoders' sequence-parallel group size; 0: the system's
    encoder_ranks: int = 0
    fsdp: bool = True
    zero: int = 0  # without fsdp: ZeRO stage over the data-parallel group (ParallelSpec.zero; runtime/zero.py)
    # activation checkpointing: none | selective | full, or per module "vision=full,llm=none"; auto: what fits
    recompute: str = "auto"
    freeze: tuple[str, ...] = ()  # modules that do not train (ParallelSpec.freeze)
    compile: bool = False  # torch.compile each block
    # encoder microbatches in chunks (recomputed in the backward) of at most this many encoder tokens (patches, audio
    # positions; omnibench/runtime/encoder_chunks.py): 0 off, -1 auto (CUDA: chunk when it must to fit). Off by
    # default: chunked runs are exact and their memory checked on CPU (FakeTensorMode), never timed on a GPU yet.
    encoder_chunk_tokens: int = 0
    dp_shard: int = 0  # HSDP shard group size (ParallelSpec.dp_shard); 0 = automatic, -1 = whole group
    device: str = "auto"
    dtype: str = "auto"
    # how a bf16 run holds the weights of a module FSDP does not shard (one rank, DDP; omnibench/runtime/
    # master.py): autocast (fp32 weights cast per op, torchtitan without FSDP) | master (bf16 weights,
    # an fp32 master copy and main gradients in the optimizer, Megatron-LM's mixed precision)
    mixed_precision: str = "autocast"
    lr: float = 1e-3
    optimizer: str = "adamw"  # "adamw" | "sgd"
    global_batch_tokens: int = 0  # 0: a size that keeps steps short on the device
    length_scale: float = 0.0  # 0: device default (CPU shrinks samples)
    max_sample_tokens: int = 0
    batches_file: str = ""  # JSON list of Batch dicts to replay instead of the workload stream
    out: str = ""  # record folder; "" = results/runs/<timestamp>-<system>-<workload>
    timeout_s: float = 120.0  # every process group's timeout
    dump_params: bool = False  # write full parameters after the last step (parity tests)
    inject_failure: str = ""  # "rank:step": that rank raises at that step (failure tests)
    options: dict = field(default_factory=dict)  # system switches (ParallelSpec.options), e.g. omni ablations
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("steps", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{name} must be a positive integer, got {v!r}")
        if self.steps > MAX_STEPS:
            raise SpecError(f"steps must be at most {MAX_STEPS:,} (rank 0 keeps every step's Plan for the record), "
                            f"got {self.steps:,}")
        timeout = self.timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
                or not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S):
            raise SpecError(f"timeout must be a finite number of seconds from {MIN_TIMEOUT_S:g} to "
                            f"{MAX_TIMEOUT_S:,.0f} (a day): how long any wait (rendezvous, collective, loader) may "
                            f"take; got {timeout!r}")
        for name in ("tp", "pp", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise SpecError(f"{name} must be a positive integer (0: the system's default layout), got {v!r}")
        for name in ("nproc", "dp", "microbatches", "encoder_tp", "encoder_sp", "encoder_ranks", "global_batch_tokens"):
            if getattr(self, name) < 0:
                raise SpecError(f"{name} must be >= 0 (0 = default), got {getattr(self, name)!r}")
        if not isinstance(self.encoder_chunk_tokens, int) or self.encoder_chunk_tokens < -1:
            raise SpecError(f"encoder_chunk_tokens must be a positive token budget, 0 (off) or -1 (auto); "
                            f"got {self.encoder_chunk_tokens!r}")
        from omnibench.plan import RUNTIME_CP_KINDS

        if self.cp_kind not in RUNTIME_CP_KINDS:
            raise SpecError(f"cp_kind must be one of {', '.join(RUNTIME_CP_KINDS)} (what the runtime runs; ring is "
                            f"simulated only); got {self.cp_kind!r}")
        if self.dp_shard < -1:
            raise SpecError(f"dp_shard must be -1 (whole FSDP group), 0 (automatic) or a positive divisor of dp*cp; "
                            f"got {self.dp_shard!r}")
        if self.recompute != "auto":
            from omnibench.specs.costs import recompute_policy

            try:
                recompute_policy(self.recompute)
            except ValueError as e:
                raise SpecError(f"{e} (or auto)") from None
        if not isinstance(self.freeze, tuple) or parse_freeze(self.freeze) != self.freeze:
            parse_freeze(self.freeze)  # an unknown module: named with the allowed ones
            raise SpecError(f"--freeze: a tuple of modules in the order {', '.join(FREEZABLE)}, each once; got "
                            f"{self.freeze!r}")
        if self.device not in DEVICES:
            raise SpecError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise SpecError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}; got {self.mixed_precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise SpecError(f"lr must be a finite number > 0, got {self.lr}")
        if self.inject_failure and not re.fullmatch(r"\d+:\d+", self.inject_failure):
            raise SpecError(f"inject_failure must be 'rank:step' (two integers >= 0), got {self.inject_failure!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> RunSpec:
        spec = RunSpec(**d)
        spec.freeze = tuple(spec.freeze)  # a JSON list
        return spec

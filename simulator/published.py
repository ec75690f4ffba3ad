"""Validate the simulator against published large-scale training results (`omnibench validate --published`).

A published table is a CSV, one training run per row (see `results/validation/README.md`):

    name, source, layers, hidden, heads, vocab, seq, gpus, tp, pp, vpp, global_batch, micro_batch,
    data_parallel, recompute, tflops_per_gpu, step_time_s, flop_formula, hardware

Each row becomes what a user would type: a dense text model of the row's shape (`gpt_model`: a GPT
block's 12h^2 matmul weights per layer expressed in this project's decoder, SwiGLU width 8h/3),
the fixed-length text workload (`workloads/specs/pretrain_2048.toml` or the same at the row's
`seq`), the row's layout and batch on the row's hardware, planned by `homogeneous` (Megatron-style
1F1B, interleaved when `vpp` > 1) and simulated. The measured step time is the row's
`step_time_s`, or the row's TFLOP/s per GPU turned back into seconds with the formula that
publication used (`flop_formula`), never with this project's counter. Nothing is fitted per row.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from omnibench.specs.model import LLMSpec, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec

COLUMNS = ("name", "source", "layers", "hidden", "heads", "vocab", "seq", "gpus", "tp", "pp", "vpp",
           "global_batch", "micro_batch", "data_parallel", "recompute", "tflops_per_gpu", "step_time_s",
           "flop_formula", "hardware")
DATA_PARALLEL = ("ddp", "fsdp")
FLOP_FORMULAS = {
    # Narayanan et al. SC'21, eq. (3): forward, backward and the full recomputation's forward,
    # attention over full s x s scores, logits counted 3x (no recomputation of the head).
    "megatron-hfu": "96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))",
    # The same without recomputation (model FLOPs, Korthikanti et al. MFU): 72*B*s*l*h^2*(...).
    "megatron-mfu": "72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))",
}


class PublishedError(ValueError):
    """A published-results table holds an impossible value; the message names the row and column."""


@dataclass(frozen=True)
class PublishedRow:
    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    tp: int
    pp: int
    vpp: int
    global_batch: int
    micro_batch: int
    data_parallel: str
    recompute: str
    tflops_per_gpu: float | None
    step_time_s: float | None
    flop_formula: str
    hardware: str

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Microbatches per data-parallel rank per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    def publication_flops(self) -> float:
        """FLOPs of one step by the publication's own formula (`flop_formula`)."""
        b, s, n, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        if self.flop_formula == "megatron-hfu":
            return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
        return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))

    @property
    def measured_step_s(self) -> float:
        if self.step_time_s is not None:
            return self.step_time_s
        assert self.tflops_per_gpu is not None
        return self.publication_flops() / (self.tflops_per_gpu * 1e12 * self.gpus)


def _parse_row(raw: dict, where: str) -> PublishedRow:
    def text(col: str, allowed: tuple[str, ...] | None = None, default: str | None = None) -> str:
        v = (raw.get(col) or "").strip()
        if not v and default is not None:
            return default
        if not v:
            raise PublishedError(f"{where}: column {col} is empty")
        if allowed and v not in allowed:
            raise PublishedError(f"{where}: {col} must be one of {', '.join(allowed)}; got {v!r}")
        return v

    def integer(col: str, default: int | None = None) -> int:
        v = (raw.get(col) or "").strip()
        if not v and default is not None:
            return default
        try:
            out = int(v)
        except ValueError:
            raise PublishedError(f"{where}: {col} must be a positive integer, got {v!r}") from None
        if out < 1:
            raise PublishedError(f"{where}: {col} must be a positive integer, got {v!r}")
        return out

    def number(col: str) -> float | None:
        v = (raw.get(col) or "").strip()
        if not v:
            return None
        try:
            out = float(v)
        except ValueError:
            raise PublishedError(f"{where}: {col} must be a positive number, got {v!r}") from None
        if out <= 0:
            raise PublishedError(f"{where}: {col} must be a positive number, got {v!r}")
        return out

    row = PublishedRow(
        name=text("name"), source=text("source"), layers=integer("layers"), hidden=integer("hidden"),
        heads=integer("heads"), vocab=integer("vocab"), seq=integer("seq"), gpus=integer("gpus"),
        tp=integer("tp"), pp=integer("pp"), vpp=integer("vpp", 1), global_batch=integer("global_batch"),
        micro_batch=integer("micro_batch", 1), data_parallel=text("data_parallel", DATA_PARALLEL, "ddp"),
        recompute=text("recompute", ("none", "full", "selective"), "none"),
        tflops_per_gpu=number("tflops_per_gpu"), step_time_s=number("step_time_s"),
        flop_formula=text("flop_formula", tuple(FLOP_FORMULAS), "megatron-hfu"),
        hardware=text("hardware", None, "a100-80g"),
    )
    if (row.tflops_per_gpu is None) == (row.step_time_s is None):
        raise PublishedError(f"{where}: give exactly one of tflops_per_gpu and step_time_s")
    if row.gpus % (row.tp * row.pp):
        raise PublishedError(f"{where}: tp*pp = {row.tp * row.pp} does not divide gpus = {row.gpus}")
    if row.global_batch % (row.dp * row.micro_batch):
        raise PublishedError(f"{where}: global_batch {row.global_batch} is not a multiple of dp*micro_batch = "
                             f"{row.dp}*{row.micro_batch}")
    if row.hidden % row.heads:
        raise PublishedError(f"{where}: heads {row.heads} does not divide hidden {row.hidden}")
    return row


def load_published(path: str | Path) -> list[PublishedRow]:
    p = Path(path)
    if not p.is_file():
        raise PublishedError(f"published: no such file {str(path)!r}")
    with p.open(newline="") as fh:
        lines = [ln for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    missing = [c for c in ("name", "source", "layers", "hidden", "heads", "vocab", "seq", "gpus", "tp", "pp",
                           "global_batch") if c not in (reader.fieldnames or [])]
    if missing:
        raise PublishedError(f"{p.name}: missing column {missing[0]}; columns: {', '.join(COLUMNS)}")
    unknown = [c for c in reader.fieldnames or [] if c not in COLUMNS]
    if unknown:
        raise PublishedError(f"{p.name}: unknown column {unknown[0]!r}; allowed: {', '.join(COLUMNS)}")
    rows = [_parse_row(r, f"{p.name} row {i + 1}") for i, r in enumerate(reader)]
    if not rows:
        raise PublishedError(f"{p.name}: no rows")
    return rows


def gpt_model(row: PublishedRow) -> MultimodalSpec:
    """A GPT-style dense decoder of the row's shape in this project's LLM spec: multi-head attention
    (kv heads = heads), no biases, a gated MLP of width 8h/3 (rounded to a multiple of 8) so its three
    matrices hold GPT's 8h^2 MLP weights, tied input/output embeddings (as Megatron GPT)."""
    h = row.hidden
    ffn = max(8, round(8 * h / 3 / 8) * 8)
    llm = LLMSpec(name=f"gpt-{row.name}", layers=row.layers, hidden=h, heads=row.heads, kv_heads=row.heads,
                  ffn=ffn, vocab=row.vocab, qkv_bias=False, tie_embeddings=True, rope_theta=10_000.0)
    return MultimodalSpec(name=llm.name, llm=llm)


def fixed_text_workload(seq: int):
    """`pretrain_2048` at another fixed sequence length."""
    from workloads.spec import spec_from_dict

    return spec_from_dict({"name": f"pretrain_{seq}", "description": f"Text pretraining at a fixed {seq}-token length.",
                           "total_steps": 1000, "sources": {"text": {"text_tokens": seq}},
                           "schedule": {"kind": "constant", "weights": {"text": 1.0}}}, origin="published")


def parallel_spec(row: PublishedRow, gpus_per_node: int) -> ParallelSpec:
    return ParallelSpec(world_size=row.gpus, gpus_per_node=gpus_per_node, dp=row.dp, tp=row.tp, pp=row.pp,
                        virtual_stages=row.vpp, microbatches=row.microbatches, recompute=row.recompute,
                        fsdp=row.data_parallel == "fsdp", dp_shard=-1)


@dataclass
class PublishedCheck:
    row: PublishedRow
    measured_s: float
    simulated_s: float
    fits: bool
    fit_message: str
    peak_memory_gib: float
    mfu: float  # simulated, model FLOPs (no recomputation)
    hfu_tflops: float  # simulated TFLOP/s per GPU counting the recomputed forward
    breakdown: dict = field(default_factory=dict)
    compute_model: str = ""

    @property
    def error(self) -> float:
        """(simulated - measured) / measured: negative = the simulator is optimistic."""
        return (self.simulated_s - self.measured_s) / self.measured_s


def check_row(row: PublishedRow, calibration=None, kernels: str | None = None) -> PublishedCheck:
    """Simulate one row. `kernels`: a kernel profile for the row's hardware instead of its preset's
    ("none": the datasheet roofline fallback)."""
    from simulator.engine import SimOptions, simulate
    from simulator.hardware import load_cluster
    from systems import get_planner
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    cluster = load_cluster(row.hardware, row.gpus)
    if kernels is not None:
        cluster = cluster.with_kernels("" if kernels == "none" else kernels)
    model = gpt_model(row)
    parallel = parallel_spec(row, cluster.gpus_per_node)
    parallel.validate(model)
    spec = get_workload("pretrain_2048") if row.seq == 2048 else fixed_text_workload(row.seq)
    stream = WorkloadStream(spec, seed=0, global_batch_tokens=row.global_batch * row.seq)
    plan = get_planner("homogeneous").plan(model, parallel, stream.batch(0))
    res = simulate(plan, model, cluster, calibration=calibration, options=SimOptions(recompute=row.recompute, stack="fused"))
    return PublishedCheck(row=row, measured_s=row.measured_step_s, simulated_s=res.step_time, fits=res.fits,
                          fit_message=res.fit_message, peak_memory_gib=res.peak_memory / 2**30, mfu=res.mfu,
                          hfu_tflops=res.hardware_tflops_per_gpu,
                          breakdown={"bubble": res.bubble, "exposed_comm": res.exposed_comm},
                          compute_model=res.compute_model)

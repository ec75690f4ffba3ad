"""Validate the simulator against published large-scale training runs (`omnibench validate --published`).

The validation set is `results/validation/published_runs.csv` (README there: columns, sources, fill
rules, the calibration/held-out split, FLOP formulas). Each row becomes what a user would type: a
model of the row's shape (`model_of`: the LLM, and for an encoder + LLM row its ViT), the fixed-shape
workload of the row's samples (`PublishedRun.workload`: text at `seq`, or one image of `image_tokens`
then text), the row's layout, data-parallel mode and frozen modules (`parallel_of`), its software stack
and precision (`options_of`: kernels, attention, GEMM dtype, what the stack overlaps), on the row's
hardware preset, planned by the row's `system` (`homogeneous` unless it says otherwise: Megatron-style
1F1B, interleaved when `vpp` > 1) and simulated.
The measured step time comes from the row's own figure (`measured`): a published step time, tokens
per second per GPU, or a FLOP rate turned back into seconds with the formula the publication used.
Nothing is fitted per row or per source.

The older table `megatron_a100.csv` (one schema before: `data_parallel`, no model columns) is read
too: its rows are converted to the new schema (GPT blocks, Megatron stack, bf16, no split column).
"""

from __future__ import annotations

import csv
import math
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from omnibench.specs.model import LLMSpec, MoESpec, MultimodalSpec, VisionEncoderSpec
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields

COLUMNS = ("name", "source", "table", "url", "split", "hardware", "gpus", "model_kind", "layers", "hidden", "heads",
           "kv_heads", "ffn", "glu", "vocab", "experts", "top_k", "expert_ffn", "vision_layers", "vision_hidden",
           "vision_heads", "vision_ffn", "vision_mlp", "seq", "image_tokens", "tp", "pp", "vpp", "cp", "cp_kind", "ep",
           "dp_mode", "global_batch", "micro_batch", "recompute", "freeze", "precision", "system", "stack",
           "software", "tflops_per_gpu", "mfu", "step_time_s", "tokens_per_s_per_gpu", "flop_formula", "peak_memory_gib",
           "verified", "notes")
# the columns of an image encoder; a row that gives image_tokens gives them all
VISION_COLUMNS = ("vision_layers", "vision_hidden", "vision_heads", "vision_ffn", "vision_mlp")
# added with the encoder + LLM rows: a table of text rows written before them may leave them out
ENCODER_COLUMNS = VISION_COLUMNS + ("image_tokens", "freeze", "system")
LEGACY_COLUMNS = ("name", "source", "layers", "hidden", "heads", "vocab", "seq", "gpus", "tp", "pp", "vpp",
                  "global_batch", "micro_batch", "data_parallel", "recompute", "tflops_per_gpu", "step_time_s",
                  "flop_formula", "hardware")
MEASURED = ("tflops_per_gpu", "mfu", "step_time_s", "tokens_per_s_per_gpu")
SPLITS = ("calibration", "heldout")
MODEL_KINDS = ("gpt", "llama", "moe")
DP_MODE_NAMES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
STACKS = ("megatron", "nemo", "torchtitan", "deepspeed", "fsdp", "other")
PRECISIONS = ("bf16", "fp16", "fp8")
RECOMPUTES = ("none", "selective", "full")
CP_KINDS = {"": "ulysses", "ulysses": "ulysses", "ring": "ring", "allgather-kv": "allgather"}
VISION_MLPS = ("gelu", "quick_gelu", "swiglu")
# `--system`: the planner that runs a row the way its source placed the encoders (systems/*.py docstrings)
SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")
FLOP_FORMULAS = {
    # Narayanan et al. SC'21, eq. (3): forward, backward and the full recomputation's forward,
    # attention over full s x s scores, logits counted 3x (no recomputation of the head).
    "megatron-hfu": "96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))",
    # The same without recomputation (model FLOPs, Korthikanti et al. MFU): 72*B*s*l*h^2*(...).
    "megatron-mfu": "72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))",
    # The publication does not say how it counted: converted with this project's model-FLOP counter
    # (costs.batch_flops: exact matmul FLOPs, causal attention, no recomputation) and reported apart.
    "unstated": "costs.batch_flops (model FLOPs, causal attention, no recomputation)",
}


class PublishedError(ValueError):
    """A published-results table holds an impossible value; the message names the row and column."""


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    split: str  # calibration | heldout | "" (a table without a split column)
    hardware: str
    gpus: int
    model_kind: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    glu: bool
    vocab: int
    seq: int
    tp: int
    pp: int
    vpp: int
    cp: int
    cp_kind: str  # the CSV's word: "", ring, allgather-kv, ulysses
    ep: int
    dp_mode: str
    global_batch: int
    micro_batch: int
    recompute: str
    precision: str
    stack: str  # the framework family, for grouping (STACKS)
    # what it ran, as `omnibench simulate` flags (simulator/stacks.py): --stack NAME and mechanism flags
    software: str = "--stack megatron-2021"
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    flop_formula: str = ""
    peak_memory_gib: float | None = None
    notes: str = ""
    table: str = ""
    # an image encoder (0 layers: a text-only row) and what each sample feeds it: one image of
    # `image_tokens` LLM tokens (4x as many patches), the rest of `seq` text
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_heads: int = 0
    vision_ffn: int = 0
    vision_mlp: str = ""
    image_tokens: int = 0
    freeze: tuple[str, ...] = ()  # `--freeze`: modules that do not train
    system: str = "homogeneous"  # `--system`

    @property
    def multimodal(self) -> bool:
        return self.image_tokens > 0

    @property
    def workload(self) -> str:
        """`--workload`: fixed-length text, or one fixed-size image then text, `seq` LLM tokens a sample."""
        if self.multimodal:
            return f"image_text_{self.image_tokens}_{self.seq - self.image_tokens}"
        return f"pretrain_{self.seq}"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        """Microbatches per data-parallel rank per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def head_dim(self) -> int:
        """The notes' `head_dim=N` (Qwen3: 128 whatever hidden/heads), else hidden / heads."""
        m = re.search(r"head_dim\s*=\s*(\d+)", self.notes)
        return int(m.group(1)) if m else 0

    @property
    def unstated(self) -> bool:
        """The measured figure is a FLOP rate whose counting the publication does not give."""
        return self.flop_formula == "unstated"

    @property
    def unpublished(self) -> tuple[str, ...]:
        """The columns the notes list after `unpublished:` (filled by the README's rules)."""
        m = re.search(r"unpublished:\s*([a-z_, ]+)", self.notes)
        return tuple(c.strip() for c in m.group(1).split(",") if c.strip()) if m else ()

    @property
    def software_spec(self):
        """The row's Software (simulator/stacks.py): its software column, FP8 linears where it ran in fp8."""
        from simulator.stacks import parse_flags

        flags = self.software.split() + (["--fp8"] if self.precision == "fp8" else [])
        return parse_flags(flags)


def _parse_row(raw: dict, where: str) -> PublishedRun:
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
        if not math.isfinite(out) or out <= 0:
            raise PublishedError(f"{where}: {col} must be a positive number, got {v!r}")
        return out

    def freeze_of(col: str) -> tuple[str, ...]:
        from omnibench.specs.model import SpecError, parse_freeze

        try:
            return parse_freeze(raw.get(col) or "")
        except SpecError as e:
            raise PublishedError(f"{where}: {col}: {str(e).removeprefix('--freeze: ')}") from None

    kind = text("model_kind", MODEL_KINDS)
    image_tokens = integer("image_tokens", 0)
    vision = {}
    if image_tokens or any((raw.get(c) or "").strip() for c in VISION_COLUMNS):
        vision = {c: integer(c) for c in VISION_COLUMNS[:-1]} | {"vision_mlp": text("vision_mlp", VISION_MLPS)}
        if not image_tokens:
            raise PublishedError(f"{where}: a row with an image encoder gives image_tokens (LLM tokens of its "
                                 "image per sample)")
    row = PublishedRun(
        name=text("name"), source=text("source"), table=(raw.get("table") or "").strip(),
        split=text("split", SPLITS), hardware=text("hardware"), gpus=integer("gpus"), model_kind=kind,
        layers=integer("layers"), hidden=integer("hidden"), heads=integer("heads"), kv_heads=integer("kv_heads"),
        ffn=integer("ffn"), glu=text("glu", ("yes", "no")) == "yes", vocab=integer("vocab"),
        experts=integer("experts", 0) if kind != "moe" else integer("experts"),
        top_k=integer("top_k", 0) if kind != "moe" else integer("top_k"),
        expert_ffn=integer("expert_ffn", 0) if kind != "moe" else integer("expert_ffn"),
        seq=integer("seq"), tp=integer("tp", 1), pp=integer("pp", 1), vpp=integer("vpp", 1), cp=integer("cp", 1),
        cp_kind=text("cp_kind", tuple(k for k in CP_KINDS if k), ""), ep=integer("ep", 1),
        dp_mode=text("dp_mode", DP_MODE_NAMES), global_batch=integer("global_batch"),
        micro_batch=integer("micro_batch", 1), recompute=text("recompute", RECOMPUTES, "none"),
        precision=text("precision", PRECISIONS, "bf16"), stack=text("stack", STACKS),
        software=text("software"),
        tflops_per_gpu=number("tflops_per_gpu"), mfu=number("mfu"), step_time_s=number("step_time_s"),
        tokens_per_s_per_gpu=number("tokens_per_s_per_gpu"),
        flop_formula=text("flop_formula", tuple(FLOP_FORMULAS), ""),
        peak_memory_gib=number("peak_memory_gib"), notes=(raw.get("notes") or "").strip(),
        image_tokens=image_tokens, freeze=freeze_of("freeze"), system=text("system", SYSTEMS, "homogeneous"),
        **vision,
    )
    return _check(row, where)


def _check(row: PublishedRun, where: str) -> PublishedRun:
    given = [c for c in MEASURED if getattr(row, c) is not None]
    if len(given) != 1:
        raise PublishedError(f"{where}: give exactly one of {', '.join(MEASURED)}; got {', '.join(given) or 'none'}")
    if given[0] in ("tflops_per_gpu", "mfu") and not row.flop_formula:
        raise PublishedError(f"{where}: flop_formula must be one of {', '.join(FLOP_FORMULAS)} for a FLOP rate")
    if row.gpus % (row.tp * row.pp * row.cp):
        raise PublishedError(f"{where}: tp*pp*cp = {row.tp * row.pp * row.cp} does not divide gpus = {row.gpus}")
    if row.global_batch % (row.dp * row.micro_batch):
        raise PublishedError(f"{where}: global_batch {row.global_batch} is not a multiple of dp*micro_batch = "
                             f"{row.dp}*{row.micro_batch}")
    if row.heads % row.kv_heads or (not row.head_dim and row.hidden % row.heads):
        raise PublishedError(f"{where}: heads {row.heads} must divide hidden {row.hidden} (or notes give head_dim) "
                             f"and be a multiple of kv_heads {row.kv_heads}")
    if row.multimodal and row.image_tokens >= row.seq:
        raise PublishedError(f"{where}: image_tokens {row.image_tokens} must be below seq {row.seq} (the rest of "
                             "each sample is text)")
    if row.multimodal and row.vision_hidden % row.vision_heads:
        raise PublishedError(f"{where}: vision_heads {row.vision_heads} must divide vision_hidden "
                             f"{row.vision_hidden}")
    if row.freeze and not row.multimodal:
        raise PublishedError(f"{where}: freeze names modules of an encoder + LLM row; this row has no encoder")
    from simulator.stacks import StackError

    try:
        row.software_spec.check(row.hardware)
    except StackError as e:
        raise PublishedError(f"{where}: software: {e}") from None
    return row


def _legacy_row(raw: dict, where: str) -> PublishedRun:
    """A row of the schema before published_runs.csv (megatron_a100.csv): dense GPT, Megatron-LM."""
    h, heads = (raw.get("hidden") or "").strip(), (raw.get("heads") or "").strip()
    data_parallel = (raw.get("data_parallel") or "ddp").strip() or "ddp"
    if data_parallel not in ("ddp", "fsdp"):
        raise PublishedError(f"{where}: data_parallel must be one of ddp, fsdp; got {data_parallel!r}")
    hidden = int(h) if h.isdigit() else 0
    new = {**raw, "split": raw.get("split") or "heldout", "model_kind": "gpt", "kv_heads": heads,
           "ffn": str(4 * hidden) if hidden else "", "glu": "no", "cp": "1", "ep": "1", "dp_mode": data_parallel,
           "precision": "bf16", "stack": "megatron", "software": "--stack megatron-2021", "hardware": (raw.get("hardware") or "").strip() or "a100-80g",
           "flop_formula": (raw.get("flop_formula") or "").strip() if (raw.get("tflops_per_gpu") or "").strip()
           else ""}
    if (raw.get("tflops_per_gpu") or "").strip() and not new["flop_formula"]:
        new["flop_formula"] = "megatron-hfu"
    row = _parse_row(new, where)
    return replace(row, split="")


# The published tables this checkout holds: `--published NAME` reads NAME.csv here from any folder
SHIPPED = Path(__file__).resolve().parents[1] / "results" / "validation"


def shipped_tables() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.csv") if p.stem in ("megatron_a100", "published_runs"))


def load_published(path: str | Path) -> list[PublishedRun]:
    """Rows of a published-results CSV: a path, or the name of a table this checkout ships
    (`shipped_tables()`: megatron_a100, published_runs)."""
    p = Path(path)
    if not p.is_file() and str(path) in shipped_tables():
        p = SHIPPED / f"{path}.csv"
    if not p.is_file():
        names = ", ".join(shipped_tables())
        raise PublishedError(f"published: no such file {str(path)!r}; give a CSV path or a shipped table: {names}")
    try:
        with p.open(newline="") as fh:
            lines = [ln for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
    except UnicodeDecodeError as e:
        raise PublishedError(f"published: {p} is not a text CSV file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise PublishedError(f"published: cannot read {p} ({e.strerror or e})") from None
    try:
        for _ in csv.reader(lines):  # the parser's own refusals (a NUL byte, an open quote) first, as one line
            pass
    except csv.Error as e:
        raise PublishedError(f"published: {p} is not a CSV file ({e})") from None
    reader = csv.DictReader(lines)
    names = tuple(reader.fieldnames or ())
    legacy = "model_kind" not in names
    expected = LEGACY_COLUMNS if legacy else COLUMNS
    required = ("name", "source", "layers", "hidden", "heads", "vocab", "seq", "gpus", "tp", "pp", "global_batch")
    missing = [c for c in (required if legacy else COLUMNS) if c not in names and c not in ENCODER_COLUMNS]
    if missing:
        raise PublishedError(f"{p.name}: missing column {missing[0]}; columns: {', '.join(expected)}")
    unknown = [c for c in names if c not in expected]
    if unknown:
        raise PublishedError(f"{p.name}: unknown column {unknown[0]!r}; allowed: {', '.join(expected)}")
    parse = _legacy_row if legacy else _parse_row
    rows = [parse(r, f"{p.name} row {i + 1} ({(r.get('name') or '').strip() or '?'})") for i, r in enumerate(reader)]
    if not rows:
        raise PublishedError(f"{p.name}: no rows")
    seen: set[str] = set()
    for r in rows:
        if r.name in seen:
            raise PublishedError(f"{p.name}: row name {r.name!r} appears twice")
        seen.add(r.name)
    return rows


# -- what each row runs -------------------------------------------------------------------------------------


def model_of(row: PublishedRun) -> MultimodalSpec:
    """The row's text model in this project's LLM spec.

    gpt: multi-head attention, a GELU MLP of width `ffn` (two matrices), LayerNorm, no rotary
    embedding (learned positions for GPT-3/Megatron, ALiBi for MPT: neither runs a per-layer kernel
    worth costing), tied input/output embeddings (Megatron GPT and MPT both tie them).
    llama: grouped-query attention, SwiGLU of width `ffn`, RMSNorm, RoPE, untied embeddings.
    moe (Qwen3-MoE): as llama with every MLP a top-k MoE of `experts` experts of width `expert_ffn`,
    q/k norms, the head dimension the notes give (128).
    A row with `image_tokens` has an image encoder of its `vision_*` columns (`vision`) projecting to the
    LLM's width."""
    gated = row.glu
    vision = None
    if row.multimodal:
        # the Qwen2-VL block form (14 px patches, 2 x 2 merge to the LLM width): the workloads' token rules;
        # SwiGLU ViTs (Qwen2.5-VL) norm with RMSNorm, GELU ones (ViT-22B's family, Qwen2-VL) with LayerNorm
        vision = VisionEncoderSpec(name=f"vit-{row.name}", layers=row.vision_layers, hidden=row.vision_hidden,
                                   heads=row.vision_heads, ffn=row.vision_ffn, mlp=row.vision_mlp,
                                   norm="rms" if row.vision_mlp == "swiglu" else "layer", out_hidden=row.hidden)
    llm = LLMSpec(
        name=f"{row.model_kind}-{row.name}", layers=row.layers, hidden=row.hidden, heads=row.heads,
        kv_heads=row.kv_heads, ffn=row.ffn, vocab=row.vocab, head_dim=row.head_dim, qkv_bias=False,
        qk_norm=row.model_kind == "moe", tie_embeddings=row.model_kind == "gpt",
        mlp="swiglu" if gated else "gelu", norm="layer" if row.model_kind == "gpt" else "rms",
        positions="learned" if row.model_kind == "gpt" else "rope",
        moe=MoESpec(experts=row.experts, top_k=row.top_k, expert_ffn=row.expert_ffn) if row.model_kind == "moe"
        else None,
    )
    return MultimodalSpec(name=llm.name, llm=llm, vision=vision)


def parallel_of(row: PublishedRun, gpus_per_node: int) -> ParallelSpec:
    """The row's layout: dp = gpus / (tp pp cp), its data-parallel mode as `--dp-mode` names it
    (fsdp: one shard group over the whole data-parallel group, as the stacks ran it). A stack that cuts
    the pipeline with the embedding and the loss counted as layers (simulator/stacks.py) does so where
    the layers alone do not divide. MoE rows with tp > 1 keep their experts whole (expert tensor
    parallelism 1: the MoE model zoo's ETP column for every H100 row; for Megatron-Bridge's TP 2 x EP 32
    on 256 GPUs the only ETP the layout allows), ep drawn from the dp*cp*tp ranks (Megatron's MoE
    parallel folding)."""
    from simulator.stacks import splits_embedding_loss

    split = splits_embedding_loss(row.software_spec, row.layers, row.pp, row.vpp)
    return ParallelSpec(world_size=row.gpus, gpus_per_node=gpus_per_node, dp=row.dp, tp=row.tp, pp=row.pp,
                        cp=row.cp, cp_kind=CP_KINDS[row.cp_kind], ep=row.ep, virtual_stages=row.vpp,
                        microbatches=row.microbatches, recompute=row.recompute, embedding_loss_stages=split,
                        expert_tp=expert_tp_of(row), freeze=row.freeze, **dp_mode_fields(row.dp_mode))


def expert_tp_of(row: PublishedRun) -> int:
    """`--expert-tp` of the row: 1 (experts whole) for MoE rows with tp > 1, else 0 (the default)."""
    return 1 if row.model_kind == "moe" and row.tp > 1 else 0


def options_of(row: PublishedRun, stack: str | None = None):
    """What the row's software runs, as simulation options: its software column through the same
    function `omnibench simulate --stack ...` uses (simulator/stacks.py). `stack` ("eager" | "fused")
    replaces the row's kernel stack (everything else stays the row's)."""
    from simulator.engine import SimOptions

    fields = row.software_spec.sim_fields()
    if stack:
        fields["stack"] = stack
    return SimOptions(recompute=row.recompute, **fields)


# -- the user's path: each row as the `omnibench simulate` command that simulates it --------------------------

# One TOML model file per architecture in the tables (`--model` takes it); written by `write_model_files`
MODELS = SHIPPED / "models"


def model_slug(row: PublishedRun) -> str:
    """The row's architecture as a file name: rows of one model share one file."""
    slug = f"{row.model_kind}-{row.layers}L-{row.hidden}h-{row.heads}a-{row.kv_heads}kv-{row.ffn}f-{row.vocab}v"
    if row.head_dim:
        slug += f"-{row.head_dim}d"
    if row.model_kind == "moe":
        slug += f"-{row.experts}x{row.top_k}e-{row.expert_ffn}ef"
    slug += "" if row.glu or row.model_kind != "llama" else "-gelu"
    if row.multimodal:
        slug += f"-vit{row.vision_layers}L-{row.vision_hidden}h-{row.vision_heads}a-{row.vision_ffn}f"
        slug += "" if row.vision_mlp == "gelu" else f"-{row.vision_mlp.replace('_', '')}"
    return slug


def model_file(row: PublishedRun) -> Path:
    return MODELS / f"{model_slug(row)}.toml"


def model_toml(row: PublishedRun) -> str:
    """The TOML file of the row's model (`model_of`), as `--model FILE` reads it back."""
    llm = model_of(row).llm

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return f'"{v}"' if isinstance(v, str) else repr(v)

    kind = f"{row.model_kind} + ViT" if row.multimodal else row.model_kind
    lines = [f"# {kind} model of the published runs table (simulator/published.py model_of)",
             f'name = "{model_slug(row)}"', "", "[llm]"]
    lines += [f"{k} = {value(v)}" for k, v in vars(llm).items() if k not in ("moe", "name")]
    lines.insert(4, f'name = "{model_slug(row)}"')
    if llm.moe is not None:
        lines += ["", "[llm.moe]"] + [f"{k} = {value(v)}" for k, v in vars(llm.moe).items()]
    vision = model_of(row).vision
    if vision is not None:
        lines += ["", "[vision]"] + [f"{k} = {value(v)}" for k, v in vars(vision).items() if k != "name"]
        lines.insert(lines.index("[vision]") + 1, f'name = "vit-{model_slug(row)}"')
    return "\n".join(lines) + "\n"


def write_model_files(rows: list[PublishedRun]) -> list[Path]:
    """Every row's model file, written where missing or different; the paths written."""
    written = []
    for row in rows:
        path, text = model_file(row), model_toml(row)
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def command_of(row: PublishedRun, dp_mode: str | None = None, recompute: str | None = None) -> list[str]:
    """The `omnibench simulate` arguments that simulate `row` (with `dp_mode` / `recompute` in place of the
    row's: what the fill rule chose), from any folder: the row's system (homogeneous, one layout for every
    module, for a text-only run and for encoders in the first pipeline stage) at the row's layout, batch,
    workload, frozen modules and software."""
    argv = ["simulate", "--workload", row.workload, "--system", row.system, "--gpus", str(row.gpus),
            "--hardware", row.hardware, "--model", f"published/{model_slug(row)}",
            "--tp", str(row.tp), "--pp", str(row.pp), "--cp", str(row.cp), "--dp", str(row.dp),
            "--dp-mode", dp_mode or row.dp_mode, "--microbatches", str(row.microbatches),
            "--global-batch-tokens", str(row.global_batch * row.seq), "--recompute", recompute or row.recompute]
    if row.vpp > 1:
        argv += ["--virtual-stages", str(row.vpp)]
    if row.cp > 1:
        argv += ["--cp-kind", CP_KINDS[row.cp_kind]]
    if row.ep > 1:
        argv += ["--ep", str(row.ep)]
    if expert_tp_of(row):
        argv += ["--expert-tp", str(expert_tp_of(row))]
    if row.freeze:
        argv += ["--freeze", ",".join(row.freeze)]
    return argv + row.software_spec.flags()


def run_command(argv: list[str]) -> dict:
    """`omnibench <argv> --json` run in this process, into a record folder that is then removed: the
    simulate command's one result row. PublishedError with the command's own one-line error when it
    refuses the input."""
    import contextlib
    import io
    import json
    import tempfile

    import click
    import typer

    from omnibench.cli import app

    args = list(argv)
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory(prefix="published-") as tmp:
        # what the command prints and where, not what it simulates: no timeline or plan files are written
        args += ["--json", "--workers", "1", "--out", tmp, "--no-trace"]
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = typer.main.get_command(app).main(args=args, prog_name="omnibench", standalone_mode=False)
            except SystemExit as e:
                code = e.code
            except click.ClickException as e:
                raise PublishedError(f"omnibench {' '.join(argv)}: {e.format_message()}") from None
    text = out.getvalue()
    if code not in (0, 1, None) or not text.strip():
        why = (err.getvalue().strip().splitlines() or ["no output"])[-1]
        raise PublishedError(f"omnibench {' '.join(argv)}: {why}")
    return json.loads(text)["results"][0]


# -- the measured side ----------------------------------------------------------------------------------------


def publication_flops(row: PublishedRun) -> float:
    """FLOPs of one step as the publication counts them (`flop_formula`)."""
    b, s, n, h, v = row.global_batch, row.seq, row.layers, row.hidden, row.vocab
    if row.flop_formula == "megatron-hfu":
        return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    if row.flop_formula == "megatron-mfu":
        return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
    from simulator.flops import model_train_flops
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    sample = WorkloadStream(get_workload(row.workload), seed=0, global_batch_tokens=s).batch(0).samples[:1]
    return b * model_train_flops(model_of(row), sample)


def measured(row: PublishedRun, peak_tflops: float = 0.0) -> float:
    """The published step time in seconds (README, "What each measured figure means")."""
    if row.step_time_s is not None:
        return row.step_time_s
    if row.tokens_per_s_per_gpu is not None:
        return row.global_batch * row.seq / (row.tokens_per_s_per_gpu * row.gpus)
    rate = row.tflops_per_gpu if row.tflops_per_gpu is not None else row.mfu * peak_tflops
    return publication_flops(row) / (rate * 1e12 * row.gpus)


# -- one row ------------------------------------------------------------------------------------------------


@dataclass
class PublishedCheck:
    row: PublishedRun
    measured_s: float
    simulated_s: float
    fits: bool
    fit_message: str
    peak_memory_gib: float
    mfu: float  # simulated, model FLOPs (no recomputation)
    hfu_tflops: float  # simulated TFLOP/s per GPU counting the recomputed forward
    breakdown: dict = field(default_factory=dict)
    compute_model: str = ""
    sim_seconds: float = 0.0
    # an unpublished field the check chose so that the run fits (`check_row`), e.g. "recompute selective"
    filled: str = ""
    # the `omnibench simulate` arguments that gave these figures (empty for a study's override: `check_row`)
    command: list = field(default_factory=list)

    @property
    def error(self) -> float:
        """(simulated - measured) / measured: negative = the simulator is optimistic."""
        return (self.simulated_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float | None:
        if self.row.peak_memory_gib is None:
            return None
        return (self.peak_memory_gib - self.row.peak_memory_gib) / self.row.peak_memory_gib


def check_row(row: PublishedRun, calibration=None, kernels: str | None = None, stack: str | None = None,
              gpu: dict | None = None, sim: dict | None = None) -> PublishedCheck:
    """Simulate one row through `omnibench simulate` (`command_of`, `run_command`): the command a user
    types. The studies' overrides, which no user command takes, simulate the row's own Plan directly
    instead (no `command` then): `calibration`, a fitted profile; `kernels`, a kernel profile for the
    row's hardware instead of its preset's ("none": the datasheet roofline fallback); `stack`,
    eager|fused kernels for every row; `gpu`, GPUSpec fields to change on the preset (what the machine
    fit varies); `sim`, SimOptions fields to change on the row's software (sensitivity studies).

    A run that ran but does not fit with the fill rule's choices of its unpublished fields is
    simulated with what a user of the stack would have run instead: among the unpublished DP mode
    (DDP or the distributed optimizer, ZeRO-1) and recomputation (the fill rule's or heavier), the
    fastest choice that fits. The check says so (`filled`, `fit_message`, the table's fits column)."""
    plans: dict = {}  # planned once per DP mode: the planner never reads recompute (SimOptions charges it)
    check = _check_row(row, calibration, kernels, stack, gpu, sim, plans)
    if check.fits:
        return check
    dp_modes = [row.dp_mode] + (["zero1"] if "dp_mode" in row.unpublished and row.dp_mode == "ddp" else [])
    recomputes = (list(RECOMPUTES[RECOMPUTES.index(row.recompute):]) if "recompute" in row.unpublished
                  else [row.recompute])
    best = None
    for dp_mode in dp_modes:
        for mode in recomputes:
            if (dp_mode, mode) == (row.dp_mode, row.recompute):
                continue
            tried = _check_row(replace(row, dp_mode=dp_mode, recompute=mode), calibration, kernels, stack, gpu, sim,
                               plans)
            if tried.fits and (best is None or tried.simulated_s < best[0].simulated_s):
                best = (tried, dp_mode, mode)
    if best is None:
        return check
    tried, dp_mode, mode = best
    chosen = [f"dp_mode {dp_mode}"] if dp_mode != row.dp_mode else []
    chosen += [f"recompute {mode}"] if mode != row.recompute else []
    tried.row, tried.filled = row, ", ".join(chosen)
    tried.fit_message = (f"{' and '.join(c.split()[0] for c in chosen)} unpublished; the fill rule's "
                         f"{row.dp_mode}/{row.recompute} does not fit ({check.peak_memory_gib:.1f} GiB), "
                         f"{dp_mode}/{mode} is the fastest that does")
    return tried


def _check_row(row: PublishedRun, calibration, kernels, stack, gpu, sim=None,
               plans: dict | None = None) -> PublishedCheck:
    """One simulation of `row` as given: its command, or (a study's override) its Plan simulated here.
    `plans`: the Plans of this row already made, by DP mode (the fill tries several recompute modes of
    one row, and the Plan does not depend on them)."""
    if calibration is None and kernels is None and stack is None and not gpu and not sim:
        return _check_command(row)
    from simulator.engine import simulate
    from simulator.hardware import load_cluster
    from systems import get_planner
    from workloads.registry import get_workload
    from workloads.stream import WorkloadStream

    cluster = load_cluster(row.hardware, row.gpus)
    if gpu:
        cluster = replace(cluster, gpu=replace(cluster.gpu, **gpu))
    if kernels is not None:
        cluster = cluster.with_kernels("" if kernels == "none" else kernels)
    model = model_of(row)
    parallel = parallel_of(row, cluster.gpus_per_node)
    parallel.validate(model)
    spec = get_workload(row.workload)
    stream = WorkloadStream(spec, seed=0, global_batch_tokens=row.global_batch * row.seq)
    plan = (plans or {}).get(row.dp_mode)
    if plan is None:
        plan = get_planner(row.system).plan(model, parallel, stream.batch(0))
        if plans is not None:
            plans[row.dp_mode] = plan
    res = simulate(plan, model, cluster, calibration=calibration, options=replace(options_of(row, stack), **(sim or {})))
    return PublishedCheck(row=row, measured_s=measured(row, cluster.gpu.peak_tflops), simulated_s=res.step_time,
                          fits=res.fits, fit_message=res.fit_message, peak_memory_gib=res.peak_reported / 2**30,
                          mfu=res.mfu, hfu_tflops=res.hardware_tflops_per_gpu,
                          breakdown={"bubble": res.bubble, "exposed_comm": res.exposed_comm},
                          compute_model=res.compute_model, sim_seconds=res.sim_seconds)


def _check_command(row: PublishedRun) -> PublishedCheck:
    """`row` simulated by its `omnibench simulate` command."""
    from simulator.hardware import load_cluster

    argv = command_of(row)
    got = run_command(argv)
    if "error" in got:
        raise PublishedError(f"{row.name}: {got['error']}")
    peak = load_cluster(row.hardware, row.gpus).gpu.peak_tflops
    breakdown = {"bubble": got["bubble"], "exposed_comm": got["exposed_comm"]}
    return PublishedCheck(row=row, measured_s=measured(row, peak), simulated_s=got["step_time_s"], fits=got["fits"],
                          fit_message=got["fit_message"], peak_memory_gib=got["peak_memory_gib"], mfu=got["mfu"],
                          hfu_tflops=got["hardware_tflops_per_gpu"], breakdown=breakdown,
                          compute_model=got["compute_model"], sim_seconds=got["sim_seconds"], command=argv)


# -- statistics and the committed table ----------------------------------------------------------------------


@dataclass(frozen=True)
class TableRow:
    """One row as the validation table prints it: step times at 4 significant digits, and every
    statistic computed from those printed figures (so a committed table is checkable on its own)."""

    name: str
    source: str
    split: str
    unstated: bool
    gpus: int
    layout: str  # tp/pp/vpp/cp/ep
    dp_mode: str
    measured_s: float
    simulated_s: float
    fits: bool
    published_gib: float | None
    simulated_gib: float
    filled: str = ""  # PublishedCheck.filled: an unpublished field chosen so that the run fits
    # an encoder + LLM row: its data shape rests on the multimodal fill rules, so it is reported apart
    multimodal: bool = False

    @property
    def error(self) -> float:
        return (self.simulated_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float | None:
        if self.published_gib is None:
            return None
        return (self.simulated_gib - self.published_gib) / self.published_gib

    @property
    def fits_cell(self) -> str:
        return ("yes" if self.fits else "no") + (f" ({self.filled}, unpublished)" if self.filled else "")

    def line(self) -> str:
        split = (f"{self.split} (unstated FLOPs)" if self.unstated else f"{self.split} (multimodal)"
                 if self.multimodal else (self.split or "all"))
        mem = f"{self.published_gib:g}" if self.published_gib is not None else "-"
        return (f"| {self.name} | {self.source} | {split} | {self.gpus} | {self.layout} | {self.dp_mode} | "
                f"{self.measured_s:.4g} | {self.simulated_s:.4g} | {self.error:+.1%} | {self.fits_cell} | "
                f"{mem} / {self.simulated_gib:.1f} |")


def table_row(c: PublishedCheck) -> TableRow:
    r = c.row
    layout = f"{r.tp}/{r.pp}/{r.vpp}/{r.cp}/{r.ep}" + (f" {r.system}" if r.multimodal else "")
    return TableRow(name=r.name, source=r.source, split=r.split, unstated=r.unstated, gpus=r.gpus,
                    layout=layout, dp_mode=r.dp_mode, multimodal=r.multimodal,
                    measured_s=float(f"{c.measured_s:.4g}"), simulated_s=float(f"{c.simulated_s:.4g}"), fits=c.fits,
                    published_gib=r.peak_memory_gib, simulated_gib=float(f"{c.peak_memory_gib:.1f}"), filled=c.filled)


@dataclass
class Stats:
    rows: int
    mean_abs: float
    worst: float  # signed error of the worst row
    worst_row: str

    def to_dict(self) -> dict:
        return {"rows": self.rows, "mean_abs_error": self.mean_abs, "worst_error": self.worst,
                "worst_row": self.worst_row}


def stats(pairs: list[tuple[str, float]]) -> Stats | None:
    if not pairs:
        return None
    worst = max(pairs, key=lambda p: abs(p[1]))
    return Stats(len(pairs), sum(abs(e) for _, e in pairs) / len(pairs), worst[1], worst[0])


def groups(rows: list) -> dict:
    """Step-time error by split (calibration, heldout; rows of an `unstated` FLOP formula apart,
    encoder + LLM rows apart as "multimodal", and a table without a split column as "all"), by source
    and split, and memory error where a peak memory is published (multimodal rows apart again).
    `rows`: PublishedChecks or TableRows."""
    rows = [table_row(r) if isinstance(r, PublishedCheck) else r for r in rows]
    out: dict = {"split": {}, "source": {}, "memory": {}}
    stated = [r for r in rows if not r.unstated and not r.multimodal]
    for split in sorted({r.split for r in stated}):
        out["split"][split or "all"] = stats([(r.name, r.error) for r in stated if r.split == split])
    unstated = [(r.name, r.error) for r in rows if r.unstated]
    if unstated:
        out["split"]["unstated"] = stats(unstated)
    multimodal = [(r.name, r.error) for r in rows if r.multimodal and not r.unstated]
    if multimodal:
        out["split"]["multimodal"] = stats(multimodal)
    for src in sorted({r.source for r in rows}):
        for split in sorted({r.split for r in stated if r.source == src}):
            out["source"][(src, split or "all")] = stats([(r.name, r.error) for r in stated
                                                          if r.source == src and r.split == split])
        sel = [(r.name, r.error) for r in rows if r.source == src and r.unstated]
        if sel:
            out["source"][(src, "unstated")] = stats(sel)
        sel = [(r.name, r.error) for r in rows if r.source == src and r.multimodal and not r.unstated]
        if sel:
            out["source"][(src, "multimodal")] = stats(sel)
    for split in sorted({r.split for r in rows}):
        mem = [(r.name, r.memory_error) for r in rows if r.split == split and r.memory_error is not None
               and not r.multimodal]
        if mem:
            out["memory"][split or "all"] = stats(mem)
    mem = [(r.name, r.memory_error) for r in rows if r.multimodal and r.memory_error is not None]
    if mem:
        out["memory"]["multimodal"] = stats(mem)
    return out


def row_keys(row: PublishedRun) -> dict:
    """What a JSON row says of the row's run besides its figures: its system and workload, and whether it is
    an encoder + LLM row (reported apart)."""
    return {"system": row.system, "workload": row.workload, "multimodal": row.multimodal}


def to_json(checks: list[PublishedCheck]) -> dict:
    g = groups(checks)
    return {
        "rows": [{"name": c.row.name, "source": c.row.source, "split": c.row.split, "hardware": c.row.hardware,
                  "gpus": c.row.gpus, "stack": c.row.stack, **row_keys(c.row), "flop_formula": c.row.flop_formula or None,
                  "measured_s": c.measured_s, "simulated_s": c.simulated_s, "error": c.error, "fits": c.fits,
                  "fit_message": c.fit_message, "filled": c.filled or None, "peak_memory_gib": c.peak_memory_gib,
                  "published_memory_gib": c.row.peak_memory_gib, "memory_error": c.memory_error, "mfu": c.mfu,
                  "hfu_tflops": c.hfu_tflops, **c.breakdown,
                  # the whole command line that gave these figures, from the repository root
                  "command": shlex.join(["omnibench", *c.command]) if c.command else None} for c in checks],
        "split": {k: v.to_dict() for k, v in g["split"].items() if v},
        "source": {f"{s}/{sp}": v.to_dict() for (s, sp), v in g["source"].items() if v},
        "memory": {k: v.to_dict() for k, v in g["memory"].items() if v},
        "unstated_formula": FLOP_FORMULAS["unstated"],
    }


ROW_HEADER = ("| run | source | split | GPUs | tp/pp/v/cp/ep | dp | published s | simulated s | error | fits "
              "| memory GiB pub. / sim. |")


def render(rows: list[TableRow], command: str, failed: list[tuple[str, str]] = ()) -> str:
    """The validation table as committed (written by `validate --published ... --markdown`)."""
    g = groups(rows)
    lines = [f"<!-- written by `{command}`; do not edit by hand -->", "",
             "| split | rows | mean abs. step-time error | worst row |", "|---|---:|---:|---|"]
    for split, s in g["split"].items():
        lines.append(f"| {split} | {s.rows} | {s.mean_abs:.1%} | {s.worst_row} ({s.worst:+.1%}) |")
    lines += ["", "| source | split | rows | mean abs. error | worst row |", "|---|---|---:|---:|---|"]
    for (src, split), s in g["source"].items():
        lines.append(f"| {src} | {split} | {s.rows} | {s.mean_abs:.1%} | {s.worst_row} ({s.worst:+.1%}) |")
    if g["memory"]:
        lines += ["", "| peak memory | rows | mean abs. error | worst row |", "|---|---:|---:|---|"]
        for split, s in g["memory"].items():
            lines.append(f"| {split} | {s.rows} | {s.mean_abs:.1%} | {s.worst_row} ({s.worst:+.1%}) |")
    lines += ["", ROW_HEADER, "|---|---|---|---:|---|---|---:|---:|---:|---|---|"]
    lines += [r.line() for r in rows]
    if failed:
        lines += ["", "Not simulated (the simulator cannot express the row; kept out of every statistic above):", ""]
        lines += [f"- {name}: {why}" for name, why in failed]
    return "\n".join(lines) + "\n"


def markdown(checks: list[PublishedCheck], command: str, failed: list[tuple[str, str]] = ()) -> str:
    return render([table_row(c) for c in checks], command, failed)


def _filled_of(cell: str) -> str:
    m = re.search(r"\((.*), unpublished\)", cell)
    return m.group(1) if m else ""


def parse_table(text: str) -> tuple[str, list[TableRow], list[tuple[str, str]]]:
    """(command, rows, not simulated) of a table `render` wrote."""
    lines = text.splitlines()
    m = re.match(r"<!-- written by `(.*)`; do not edit by hand -->", lines[0]) if lines else None
    if m is None:
        raise PublishedError("validation table: the first line must name the command that wrote it")
    start = lines.index(ROW_HEADER) + 2
    rows, failed = [], []
    for ln in lines[start:]:
        if ln.startswith("- "):
            name, why = ln[2:].split(": ", 1)
            failed.append((name, why))
        if not ln.startswith("| "):
            continue
        cells = [x.strip() for x in ln.strip("|").split("|")]
        split = cells[2].replace(" (unstated FLOPs)", "").replace(" (multimodal)", "")
        pub, sim = cells[10].split(" / ")
        rows.append(TableRow(name=cells[0], source=cells[1], split="" if split == "all" else split,
                             unstated=cells[2].endswith("(unstated FLOPs)"), gpus=int(cells[3]), layout=cells[4],
                             dp_mode=cells[5], measured_s=float(cells[6]), simulated_s=float(cells[7]),
                             fits=cells[9].split(" ")[0] == "yes", published_gib=None if pub == "-" else float(pub),
                             simulated_gib=float(sim), filled=_filled_of(cells[9]),
                             multimodal=cells[2].endswith("(multimodal)")))
    return m.group(1), rows, failed


def merge_table(text: str, table: dict, checks: list[PublishedCheck], failed: list[tuple[PublishedRun, str]],
                rows: list[PublishedRun]) -> tuple[str, dict]:
    """The committed table (`text`, with `table` its JSON) with `checks` and `failed` ((row, why) not
    simulated) in place of those rows' earlier entries, every row in the order of `rows` (the CSV's): the
    table its own command writes when only these rows changed, without simulating the others again. The
    other rows keep their committed figures; their JSON rows gain the keys added since (`row_keys`).
    Statistics are computed afresh from the printed figures, as `render` and `to_json` compute them."""
    command, old_rows, old_failed = parse_table(text)
    new = {c.row.name: table_row(c) for c in checks}
    why = {r.name: e for r, e in failed}
    old, old_why = {r.name: r for r in old_rows}, dict(old_failed)
    kept, kept_failed = [], []
    for r in rows:
        if r.name in new or (r.name not in why and r.name in old):
            kept.append(new.get(r.name) or old[r.name])
        elif r.name in why or r.name in old_why:
            kept_failed.append((r.name, why.get(r.name) or old_why[r.name]))
    fresh = {j["name"]: j for j in to_json(checks)["rows"]}
    committed = {j["name"]: j for j in table.get("rows", [])}
    json_rows = []
    for r in rows:
        if r.name in fresh:
            json_rows.append(fresh[r.name])
        elif r.name in committed and r.name not in why:
            j = committed[r.name]
            at = list(j).index("stack") + 1
            keys = list(j)[:at] + [k for k in row_keys(r) if k not in j] + list(j)[at:]
            json_rows.append({k: j[k] if k in j else row_keys(r)[k] for k in keys})
    g = groups(kept)
    merged = {"rows": json_rows, "split": {k: v.to_dict() for k, v in g["split"].items() if v},
              "source": {f"{s}/{sp}": v.to_dict() for (s, sp), v in g["source"].items() if v},
              "memory": {k: v.to_dict() for k, v in g["memory"].items() if v},
              "unstated_formula": FLOP_FORMULAS["unstated"],
              "failed": [{"name": n, "error": e} for n, e in kept_failed]}
    return render(kept, command, kept_failed), merged

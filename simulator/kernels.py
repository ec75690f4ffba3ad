"""Kernel-level compute costs from a kernel profile: GEMMs by shape, attention by sequence length and
head size, memory-bound work by bytes over achieved HBM bandwidth, and a host launch floor per kernel.

A kernel profile is one JSON file in the schema `benchmarks/gpu_kernels.py` writes
(`omnibench-kernel-profile/1`): measured on a GPU (`results/calibration/h100-kernels.json`), or a
documented table read off published kernel measurements in the same schema
(`simulator/data/kernels/a100-published.json`, sources inside). A cluster preset names its profile
(`kernels = ...`); without one the simulator falls back to the datasheet roofline curve
(`simulator/compute.py::default_curve`) and says so in its output.

How a profile answers (no per-model constants, nothing fitted to training runs):
- GEMM (m, n, k): achieved FLOP/s interpolated from the profile's GEMM rows, inverse-distance
  weighted over the 4 nearest shapes in (log m, log n, log k) (skinny and small shapes fall where
  their measured neighbours are), never above the best measured rate;
- attention: `flash` (the profile's measured flash/varlen rows, interpolated in log sequence length
  per head size and pass) or `unfused` (the kernels of Megatron-LM 2021-22: two batched GEMMs per
  head over the full s x s scores, a fused scale-mask-softmax and a dropout moving s^2 scores
  through HBM); the profile's `attention_kernel` says which;
- memory-bound ops: bytes / achieved bandwidth (the profile's large-size element-wise rate);
- every kernel costs at least the host's launch time (a queue of short kernels runs at the rate the
  host issues them).

The layer is decomposed the way Megatron-LM / torchtitan run a dense decoder block (`llm_pass`).
"""

from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

import numpy as np

SCHEMA = "omnibench-kernel-profile/1"
DATA_DIR = Path(__file__).parent / "data" / "kernels"
REPO_ROOT = Path(__file__).resolve().parents[1]
ATTENTION_KERNELS = ("flash", "unfused")


class KernelProfileError(ValueError):
    """A kernel profile is missing or malformed; the message names the file and field."""


def _bucket(x: float) -> int:
    """The 1/64-octave bucket of a GEMM dimension: what `gemm_rate` keys its rates by."""
    return round(64 * math.log2(max(x, 1)))


@dataclass
class KernelProfile:
    name: str
    device: str
    peak_flops: float  # the datasheet peak the efficiencies are relative to (for reports only)
    gemm: list[tuple[float, float, float, float]]  # (log2 m, log2 n, log2 k, achieved FLOP/s)
    attention: dict[tuple[str, int], list[tuple[float, float]]]  # (pass, head_dim) -> [(log2 s, FLOP/s)]
    memory_bandwidth: float  # achieved bytes/s of large element-wise ops
    launch_s: float  # host time per kernel
    attention_kernel: str = "flash"
    source: str = ""
    _best: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._best = max((r[3] for r in self.gemm), default=0.0)
        self._gemm_cache: dict = {}
        self._attention_cache: dict = {}
        self._block_cache: dict = {}
        self._rates_cache: dict = {}
        self._outside_cache: dict = {}
        # the measured shapes' (log2 m, log2 n, log2 k), one contiguous column each (gemm_rate's distance)
        xyz = np.array([r[:3] for r in self.gemm], dtype=float).reshape(-1, 3)
        self._gemm_cols = tuple(np.ascontiguousarray(xyz[:, i]) for i in range(3))
        self._gemm_log_rate = np.log(np.array([r[3] for r in self.gemm], dtype=float))
        self._gemm_smallest = min((2 ** (a + b + c) for a, b, c, _ in self.gemm), default=1.0)

    def scaled(self, compute: float, memory: float) -> KernelProfile:
        """The same profile on a variant of its GPU: GEMM and attention rates times `compute`,
        element-wise bandwidth times `memory` (hardware.GPUSpec.kernel_compute_scale / _memory_scale)."""
        from dataclasses import replace as _replace

        c = math.log2(compute)
        return _replace(self, name=f"{self.name} x{compute:g} compute x{memory:g} memory",
                        gemm=[(a, b, k, r * compute) for a, b, k, r in self.gemm],
                        attention={key: [(x, r * compute) for x, r in rows] for key, rows in self.attention.items()},
                        memory_bandwidth=self.memory_bandwidth * memory) if c or memory != 1.0 else self

    # -- queries ---------------------------------------------------------------------------------
    def gemm_rate(self, m: float, n: float, k: float) -> float:
        # Rates are smooth in log size: shapes within 1/64 octave of each other share one lookup (a
        # simulation meets thousands of token counts; the rate moves by far less than 0.1% inside).
        # The rate is the bucket centre's, so it never depends on which shape asked first (a rate
        # of the first query made results depend on what the process had simulated before).
        key = (_bucket(m), _bucket(n), _bucket(k))
        got = self._gemm_cache.get(key)
        if got is not None:
            return got
        q = np.array(key, dtype=float) / 64.0
        m, n, k = (2.0 ** x for x in q)
        # the squared distance column by column, summed in the order sum(axis=1) takes, (dm + dn) + dk: the
        # same bits at a quarter of the time (a row-wise sum over an axis of 3 is numpy's slow case)
        x, y, z = self._gemm_cols
        d2 = ((x - q[0]) ** 2 + (y - q[1]) ** 2) + (z - q[2]) ** 2
        # the 4 nearest measured shapes; ties (a grid has many) go to the slower shape
        cand = np.argpartition(d2, 15)[:16] if len(d2) > 16 else np.arange(len(d2))
        near = cand[np.lexsort((self._gemm_log_rate[cand], d2[cand]))][:4]
        if d2[near[0]] < 1e-12:
            rate = float(np.exp(self._gemm_log_rate[near[0]]))
        else:
            w = 1.0 / d2[near]
            rate = float(np.exp((w * self._gemm_log_rate[near]).sum() / w.sum()))
        # Beyond the table a GEMM is no faster than the fastest measured and, for a shape smaller than
        # every neighbour, no faster than its FLOPs allow at the neighbours' rate (scaled down).
        smallest = self._gemm_smallest
        size = m * n * k
        if size < smallest:
            rate *= size / smallest
        rate = min(rate, self._best)
        self._gemm_cache[key] = rate
        return rate

    def gemm_time(self, m: float, n: float, k: float, count: float = 1.0, fp8: bool = False) -> float:
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        rate = self.gemm_rate(m, n, k) * (fp8_speedup(min(m, n, k)) if fp8 else 1.0)
        return count * self.gemm_at(m, n, k, rate)

    def gemm_at(self, m: float, n: float, k: float, rate: float) -> float:
        """Seconds of one (m, n, k) GEMM at `rate` FLOP/s (a kernel costs at least its launch)."""
        return max(2.0 * m * n * k / rate, self.launch_s)

    def attention_rate(self, passes: str, head_dim: int, seq: float) -> float:
        rows = self.attention.get((passes, head_dim))
        if rows is not None:
            return self._attention_rate(rows, seq)
        dims = sorted(d for p, d in self.attention if p == passes)
        if not dims:
            raise KernelProfileError(f"kernel profile {self.name}: no {passes} attention rows")
        lo = max((d for d in dims if d < head_dim), default=dims[0])
        hi = min((d for d in dims if d > head_dim), default=dims[-1])
        r_lo = self._attention_rate(self.attention[(passes, lo)], seq)
        if hi == lo:  # outside the measured head sizes: the nearest one's rate
            return r_lo
        # between two measured head sizes: linear in the head size
        f = (head_dim - lo) / (hi - lo)
        return r_lo + f * (self._attention_rate(self.attention[(passes, hi)], seq) - r_lo)

    @staticmethod
    def _attention_rate(rows: list[tuple[float, float]], seq: float) -> float:
        x = math.log2(max(seq, 2))
        if x <= rows[0][0]:
            # shorter than measured: the same time per call as the shortest (launch/occupancy bound)
            return rows[0][1] * 2 ** (x - rows[0][0])
        if x >= rows[-1][0]:
            return rows[-1][1]
        for (x0, r0), (x1, r1) in zip(rows, rows[1:], strict=False):
            if x0 <= x <= x1:
                f = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
                return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
        return rows[-1][1]

    def memory_time(self, nbytes: float, kernels: int = 1) -> float:
        if nbytes <= 0:
            return 0.0
        return max(nbytes / self.memory_bandwidth, kernels * self.launch_s)

    def describe(self) -> str:
        return (f"kernel profile {self.name} ({self.device}): GEMMs up to {self._best / 1e12:.0f} TFLOP/s, "
                f"{self.attention_kernel} attention, {self.memory_bandwidth / 1e12:.2f} TB/s element-wise, "
                f"{self.launch_s * 1e6:.1f} us launch")


# FP8 over bf16/fp16 GEMM throughput on Hopper by the GEMM's smallest dimension: the same tuned
# kernels, M = N = 8192 and K from 256 to 16384, measured on an H800 SXM (H100 compute): fp16 386, 520,
# 628, 705, 736, 758, 766 TFLOP/s; fp8 569, 858, 1129, 1343, 1467, 1507, 1541 (tile-lang benchmark
# records, github.com/xwhzz/tilelang benchmark/matmul/README.md and benchmark/matmul_fp8/README.md at
# b2acfc3). A thin GEMM gains less: its operand traffic, not its math, bounds it.
FP8_SPEEDUP = ((8, 569 / 386), (9, 858 / 520), (10, 1129 / 628), (11, 1343 / 705), (12, 1467 / 736),
               (13, 1507 / 758), (14, 1541 / 766))


def fp8_speedup(smallest_dim: float) -> float:
    x = math.log2(max(smallest_dim, 1.0))
    pts = FP8_SPEEDUP
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return r0 + (x - x0) / (x1 - x0) * (r1 - r0)
    return pts[-1][1]


def _resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".json":
        for cand in (p, REPO_ROOT / p):
            if cand.is_file():
                return cand
        raise KernelProfileError(f"kernels: no such file {name_or_path!r}")
    cand = DATA_DIR / f"{name_or_path}.json"
    if not cand.is_file():
        names = ", ".join(sorted(x.stem for x in DATA_DIR.glob("*.json")))
        raise KernelProfileError(f"kernels must be one of {names} or a .json profile; got {name_or_path!r}")
    return cand


@lru_cache(maxsize=16)
def load_kernel_profile(name_or_path: str, peak_flops: float = 0.0) -> KernelProfile:
    path = _resolve(name_or_path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KernelProfileError(f"{path}: not valid JSON: {e}") from None
    if data.get("schema") != SCHEMA:
        raise KernelProfileError(f"{path}: schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    gemm = [(math.log2(r["m"]), math.log2(r["n"]), math.log2(r["k"]), r["flops"] / r["time_s"])
            for r in data.get("gemm", []) if r.get("time_s", 0) > 0]
    if not gemm:
        raise KernelProfileError(f"{path}: gemm: no measurements")
    # Attention: prefer packed varlen rows, else SDPA flash; median rate per (pass, head_dim, seq).
    att_rows = data.get("attention", [])
    impls = {r.get("impl") for r in att_rows}
    impl = "varlen_attn" if "varlen_attn" in impls else "sdpa_flash" if "sdpa_flash" in impls else None
    attention: dict[tuple[str, int], dict[float, list[float]]] = {}
    for r in att_rows:
        if impl is not None and r.get("impl") != impl or r.get("time_s", 0) <= 0:
            continue
        attention.setdefault((r["pass"], int(r["head_dim"])), {}).setdefault(
            math.log2(r["seq"]), []).append(r["flops"] / r["time_s"])
    att = {k: sorted((x, sorted(v)[len(v) // 2]) for x, v in d.items()) for k, d in attention.items()}
    kind = data.get("attention_kernel", "flash")
    if kind not in ATTENTION_KERNELS:
        raise KernelProfileError(f"{path}: attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}; got {kind!r}")
    if kind == "flash" and not att:
        raise KernelProfileError(f"{path}: attention: no flash measurements (or set attention_kernel = 'unfused')")
    mem = [r for r in data.get("memory_bound", []) if r.get("time_s", 0) > 0 and not r["op"].startswith("adamw")]
    if not mem:
        raise KernelProfileError(f"{path}: memory_bound: no measurements")
    # The element-wise rate of large tensors (launch-free): median over ops of each op's best rate.
    best: dict[str, float] = {}
    for r in mem:
        best[r["op"]] = max(best.get(r["op"], 0.0), r["bytes"] / r["time_s"])
    rates = sorted(best.values())
    bw = rates[len(rates) // 2]
    launch = data.get("launch", {}).get("host_per_kernel_s")
    if not isinstance(launch, (int, float)) or launch < 0:
        raise KernelProfileError(f"{path}: launch.host_per_kernel_s must be a number >= 0")
    dev = data.get("device", {}).get("name", "?")
    return KernelProfile(name=path.stem, device=dev, peak_flops=peak_flops, gemm=gemm, attention=att,
                         memory_bandwidth=bw, launch_s=float(launch), attention_kernel=kind,
                         source=str(data.get("sources", "")) or f"measured {data.get('date', '')}")


# -- transformer blocks as kernels ----------------------------------------------------------------------
STACK_KINDS = ("fused", "eager")
LOSS_KINDS = ("logits", "chunked")


@dataclass(frozen=True)
class Stack:
    """The software that runs a block, as far as its memory-bound kernels differ (GEMMs and attention
    cost the same under any stack):

    - `fused` (Megatron-LM 2021-22, the published rows): fused norm, bias-dropout-add and softmax
      kernels, one read and one write per element per op, bf16/fp16 activations; full logits and a
      loss whose gradient is taken in the backward;
    - `eager` (this project's modules, `omnibench/models`, run as the runtime runs them): every
      PyTorch op its own kernel; RMSNorm and RoPE computed in fp32 (`attention.py`), autocast's
      fp32 LayerNorm, and the chunked linear + cross-entropy (`loss.py`) that computes the head's
      gradients inside the forward.

    `residual_bytes`: bytes per element of the residual stream (4 where the LLM's token embedding is
    an fp32 parameter under autocast: one rank without FSDP); `weight_cast`: autocast casts fp32
    weights to bf16 in every forward and their bf16 gradients back to fp32 in the backward.
    `attention`: which attention kernel runs (flash, or unfused GEMMs over s x s scores); `gemm`:
    "fp8" runs the transformer blocks' linear layers as FP8 GEMMs (Transformer Engine, torchao
    Float8; the head, router and attention core stay bf16) and pays their quantisation (`_fp8_bytes`).
    """

    kind: str = "fused"
    residual_bytes: int = 2
    weight_cast: bool = False
    loss: str = "logits"
    loss_chunk_tokens: int = 0  # chunked loss: tokens per chunk (omnibench.specs.costs.loss_chunk_tokens)
    attention: str = ""  # "" the profile's `attention_kernel`, else "flash" | "unfused"
    gemm: str = "bf16"  # "fp8": the blocks' linears on FP8 tensor cores with per-tensor scaling
    # the module's weights take no gradient (`--freeze`): its backward computes input gradients only
    # (no weight-gradient GEMMs, no bias or embedding gradients) and its loss no weight gradient
    frozen: bool = False


FUSED = Stack()
FULL_ATTENTION_STRETCH = math.sqrt(2.0)  # see _attention


@dataclass(slots=True, unsafe_hash=True)  # as flops.Work: made per distinct microbatch, never changed once made
class BlockShape:
    """What the kernel model needs of one stage of a transformer (LLM or encoder) on one microbatch,
    per rank (after tp / cp / sp)."""

    hidden: int
    heads: float  # query heads per rank (after tp and Ulysses sp/cp; a share where they do not divide)
    kv_heads: float  # per rank
    head_dim: int
    ffn: int  # per rank (after tp)
    vocab: int  # per rank (after tp); 0 without a head
    seq_lens: tuple[int, ...]  # attention sequences (after cp)
    layers: int
    head: bool  # holds the output projection and the loss
    tp: int = 1
    sequence_parallel: bool = False
    moe: bool = False
    tokens: int = 0  # tokens through the GEMMs per rank when not sum(seq_lens) (Ulysses sp splits them)
    mlp: str = "swiglu"  # swiglu | gelu | quick_gelu
    norm: str = "rms"  # rms | layer
    rope: bool = True
    causal: bool = True
    fused_qkv: bool = False  # one qkv projection split by views (its gradient is assembled in backward)
    biased: int = 0  # output elements per token of the biased linears (their bias gradient reads them)
    params: float = 0.0  # weights of one block (autocast casts them each forward)
    embed: bool = False  # holds the token embedding (first LLM stage)
    # GEMMs outside the blocks, (m, n, k, needs input grad): patch embedding, merger, conv front-end
    extra_gemms: tuple[tuple[int, int, int, bool], ...] = ()
    extra_pointwise: float = 0.0  # bytes of element-wise work outside the blocks, forward
    stack: Stack = FUSED
    ring: int = 1  # ring attention over this many context-parallel ranks (1: whole sequences here)
    # all-gather-KV context parallelism over this many ranks: the rank's 1/cp of each sequence's
    # queries attends to the whole gathered sequence (1: whole sequences here)
    kv_gather: int = 1
    # MoE MLP (omnibench/models/moe.py): experts held by this rank (E / ep), experts routed over,
    # top-k, expert and shared-expert widths; 0 experts: the dense MLP of width `ffn`
    moe_experts: int = 0
    moe_router: int = 0
    moe_top_k: int = 0
    moe_ffn: int = 0
    moe_shared_ffn: int = 0
    moe_token_split: int = 1  # the MoE sees 1/this of the rank's tokens (folded experts: its SP shard)
    # its block fields (`_block_key`) as the one object of their value, once asked (`_block_of`)
    _block: tuple | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def ntokens(self) -> float:
        return float(self.tokens or sum(self.seq_lens))


LLMShape = BlockShape  # the name the decoder-only callers use

# What `llm_pass` keys its terms by: a layer's terms depend on the shape's block fields and the token
# count only (not the sequence lengths, the layer count or what lies outside the blocks); the stage's
# terms outside its blocks on every field but the sequence lengths.
_OUTSIDE = ("seq_lens", "tokens", "layers", "head", "embed", "extra_gemms", "extra_pointwise")
_block_key = operator.attrgetter(*(f.name for f in fields(BlockShape) if f.name not in _OUTSIDE and f.init))
# A block key's value -> the one object of it, process-wide (a few per simulation: one per module stage,
# layout and stack). The profile's caches are keyed by that object's identity: hashing the 27 fields (the
# stack's own among them) on every lookup was a fifth of a warm `llm_pass`. A value met again is the same
# object; an entry is kept with the object it was made for, so an identity is never reused.
_BLOCK_KEYS: dict[tuple, tuple] = {}


def _block_of(s: BlockShape) -> tuple:
    bk = s._block
    if bk is None:
        k = _block_key(s)
        bk = s._block = _BLOCK_KEYS.setdefault(k, k)
    return bk


def llm_pass(p: KernelProfile, s: BlockShape, passes: str, blocks_only: bool = False) -> float:
    """Seconds of one forward (`passes` "fwd") or backward ("bwd", without recomputation) of a stage;
    `blocks_only`: its transformer blocks alone, as recomputation re-runs them (not the head, the
    embedding or the GEMMs and element-wise work outside the blocks)."""
    t = s.ntokens
    if t <= 0:
        return 0.0
    bwd = passes == "bwd"
    # Everything but the attention core depends on the microbatch only through its token count, and
    # at thousands of ranks many microbatches share it with different sequences (and a forward and
    # its recomputation share the blocks): those terms are worked out once per (shape without its
    # sequences, tokens, pass) and added in the same order as ever: the same sum to the last bit.
    bk = _block_of(s)
    key = (passes, t, id(bk))
    hit = p._block_cache.get(key)
    if hit is not None and hit[1] is bk:
        block = hit[0]
    else:
        block = _block_parts(p, s, t, bwd, bk)
        p._block_cache[key] = (block, bk)
    before, after = block
    time = before + _attention(p, s, bwd)
    for x in after:
        time += x
    total = s.layers * time
    if not blocks_only and (s.extra_gemms or s.extra_pointwise or s.head or s.embed):
        # every field but the sequence lengths: the block's, and those outside it
        key = (passes, t, id(bk), s.tokens, s.layers, s.head, s.embed, s.extra_gemms, s.extra_pointwise)
        hit = p._outside_cache.get(key)
        if hit is not None and hit[1] is bk:
            outside = hit[0]
        else:
            outside = _outside_parts(p, s, t, bwd)
            p._outside_cache[key] = (outside, bk)
        for x in outside:
            total += x
    return total


def _linears(s: BlockShape) -> list[tuple[float, float]]:
    """(fan_out, fan_in) of one block's linear layers, per rank."""
    h, d = s.hidden, s.head_dim
    q, kv = s.heads * d, s.kv_heads * d
    linears = [(q + 2 * kv, h), (h, q)]
    if not s.moe_experts:
        linears += [((2 if s.mlp == "swiglu" else 1) * s.ffn, h), (h, s.ffn)]
    return linears


def _block_parts(p: KernelProfile, s: BlockShape, t: float, bwd: bool, bk: tuple) -> tuple[float, tuple]:
    """One layer's terms of `llm_pass` that do not depend on the sequence lengths: its GEMMs (and FP8
    quantisation) summed, and the terms added after its attention, in `llm_pass`'s order; `bk`: the
    shape's block fields (`_block_key`)."""
    linears = _linears(s)
    time = 0.0
    fp8 = s.stack.gemm == "fp8"
    if fp8 or min(min(fan) for fan in linears) <= 0:  # (an empty linear costs nothing in `gemm_time`)
        frozen = s.stack.frozen
        for fan_out, fan_in in linears:
            if bwd:  # dgrad, wgrad
                time += p.gemm_time(t, fan_in, fan_out, fp8=fp8) + (
                    0.0 if frozen else p.gemm_time(fan_out, fan_in, t, fp8=fp8))
            else:
                time += p.gemm_time(t, fan_out, fan_in, fp8=fp8)
    else:
        # `gemm_time` of each linear, its rates read once per 1/64 octave of the token count (the
        # bucket `gemm_rate` keys them by: at thousands of ranks nearly every microbatch has a token
        # count of its own, and working out three buckets per GEMM was most of such a miss), each
        # GEMM then timed as `gemm_time` times it: the same bits
        rates = _linear_rates(p, linears, t, bwd, bk)
        if bwd:
            frozen = s.stack.frozen
            for (fan_out, fan_in), (r_d, r_w) in zip(linears, rates, strict=True):
                time += p.gemm_at(t, fan_in, fan_out, r_d) + (0.0 if frozen else p.gemm_at(fan_out, fan_in, t, r_w))
        else:
            for (fan_out, fan_in), r in zip(linears, rates, strict=True):
                time += p.gemm_at(t, fan_out, fan_in, r)
    if fp8:
        time += p.memory_time(_fp8_bytes(s, linears, t, bwd), 2 * len(linears))
    after = []
    if s.moe_experts:
        after.append(_moe(p, s, t, bwd))
    nbytes, kernels = (_eager_block_bytes if s.stack.kind == "eager" else _fused_block_bytes)(s, bwd)
    after.append(p.memory_time(t * nbytes + _cast_bytes(s) * s.params, kernels))
    return time, tuple(after)


def _linear_rates(p: KernelProfile, linears: list[tuple[float, float]], t: float, bwd: bool, bk: tuple) -> tuple:
    """The GEMM rates of a block's linears at `t` tokens (backward: (dgrad, wgrad) per linear), as
    `gemm_rate` answers them: one lookup per (pass, bucket of t, block)."""
    key = (bwd, _bucket(t), id(bk))
    hit = p._rates_cache.get(key)
    if hit is not None and hit[1] is bk:
        return hit[0]
    if bwd:
        got = tuple((p.gemm_rate(t, fan_in, fan_out), p.gemm_rate(fan_out, fan_in, t)) for fan_out, fan_in in linears)
    else:
        got = tuple(p.gemm_rate(t, fan_out, fan_in) for fan_out, fan_in in linears)
    p._rates_cache[key] = (got, bk)
    return got


def _outside_parts(p: KernelProfile, s: BlockShape, t: float, bwd: bool) -> tuple:
    """The terms `llm_pass` adds to a stage's total after its layers, in its order."""
    outside = []
    for m, n, k, dgrad in s.extra_gemms:
        if bwd:
            outside.append((0.0 if s.stack.frozen else p.gemm_time(n, k, m)) + (p.gemm_time(m, k, n) if dgrad else 0.0))
        else:
            outside.append(p.gemm_time(m, n, k))
    if s.extra_pointwise:
        outside.append(p.memory_time(s.extra_pointwise * (2 if bwd else 1), 4))
    if s.head:
        outside.append(_head(p, s, bwd))
    if s.embed and s.stack.kind == "eager" and bwd and not s.stack.frozen:
        # dense fp32 embedding gradient: zero-filled [vocab, hidden], then one row added per token
        outside.append(p.memory_time(4.0 * s.vocab * s.hidden + 12.0 * t * s.hidden, 3))
    return tuple(outside)


# FP8 quantisation with per-tensor dynamic ("current") scaling, bytes per element of each GEMM operand:
# an amax pass (read bf16, 2) then the cast (read bf16 2, write fp8 1); the backward's gradient also
# gets the transposed fp8 copy Hopper's FP8 GEMMs need for the weight gradient (+1 write) and the saved
# fp8 input is transposed (read 1, write 1). Fused stacks (Transformer Engine, torch.compile) compute
# the amax and the cast inside the producing kernel (norm, activation): one extra fp8 write per element
# (and its transpose in the backward); their fp8 weights are cast once per step, not per microbatch.
_FP8_EAGER = {"fwd_act": 5.0, "fwd_weight": 5.0, "bwd_act": 6.0 + 2.0, "bwd_weight": 2.0}
_FP8_FUSED = {"fwd_act": 1.0, "fwd_weight": 0.0, "bwd_act": 2.0 + 2.0, "bwd_weight": 0.0}


def _fp8_bytes(s: BlockShape, linears: list[tuple[float, float]], t: float, bwd: bool) -> float:
    c = _FP8_EAGER if s.stack.kind == "eager" else _FP8_FUSED
    act = sum(fan_in for _, fan_in in linears) if not bwd else sum(fan_out for fan_out, _ in linears)
    weights = sum(fo * fi for fo, fi in linears)
    if bwd:
        return t * act * c["bwd_act"] + weights * c["bwd_weight"]
    return t * act * c["fwd_act"] + weights * c["fwd_weight"]


def grouped_gemm_time(p: KernelProfile, gemms: int, m: float, n: float, k: float, fp8: bool = False) -> float:
    """Seconds of a grouped expert GEMM over `gemms` local experts, each an (m, n, k) GEMM, as the fused
    stacks issue it: one GEMM per expert, each enqueued by the host on its own (over a few streams), not
    one kernel for the group. So the group takes at least `gemms` host launches (`launch_s` each, a lower
    bound on a GEMM's host cost), however short the experts' GEMMs are on the GPU. Where the fused stacks'
    grouped GEMM is read from: docs/simulator-accuracy.md, "Host-bound steps"."""
    if gemms <= 0 or min(m, n, k) <= 0:
        return 0.0
    gpu = gemms * 2.0 * m * n * k / (p.gemm_rate(m, n, k) * (fp8_speedup(min(m, n, k)) if fp8 else 1.0))
    return max(gpu, gemms * p.launch_s)


def _moe(p: KernelProfile, s: BlockShape, t: float, bwd: bool) -> float:
    """The MoE MLP of one layer: router GEMM, then (eager: this project's moe.py) one SwiGLU expert after
    another (three GEMMs and two element-wise kernels each, so small experts are launch bound) or
    (fused: Megatron-Core) grouped GEMMs over the rank's experts, the token copies gathered, weighted
    and added back, and the shared expert. Tokens are
    spread evenly over experts (the Plan does not know the routing): t * top_k / E per expert of
    each rank's tokens, an expert-parallel rank receiving its experts' share of all ep ranks' tokens."""
    h, f = s.hidden, s.moe_ffn
    t = t / s.moe_token_split
    routed = t * s.moe_top_k  # token copies this rank's experts process (balanced all-to-all)
    te = routed / s.moe_experts
    out = 0.0

    def linear(m: float, fan_out: int, fan_in: int) -> float:
        if bwd:
            return p.gemm_time(m, fan_in, fan_out) + (0.0 if s.stack.frozen else p.gemm_time(fan_out, fan_in, m))
        return p.gemm_time(m, fan_out, fan_in)

    out += linear(t, s.moe_router, h)
    if s.moe_shared_ffn:
        out += 2 * linear(t, s.moe_shared_ffn, h) + linear(t, h, s.moe_shared_ffn) + linear(t, 1, h)
    if s.stack.kind != "eager":
        # the fused stacks: the rank's experts as grouped GEMMs (each group at its own shape's rate, one
        # host launch per local expert: `grouped_gemm_time`, so small experts are launch bound), fused
        # permute / unpermute of the token copies (read and write each, bf16) and a fused gated activation
        fp8 = s.stack.gemm == "fp8"
        for fan_out, fan_in in ((2 * f, h), (h, f)):
            shapes = ((fan_in, fan_out, te), (fan_out, fan_in, te))[:1 if s.stack.frozen else 2] if bwd \
                else ((te, fan_out, fan_in),)
            for m, n, k in shapes:
                if min(m, n, k) > 0:
                    out += grouped_gemm_time(p, s.moe_experts, m, n, k, fp8)
        nbytes = routed * (8 * h + 6 * f) * (2 if bwd else 1) + t * s.moe_router * 4 * 3
        return out + p.memory_time(nbytes, 16 if bwd else 8)
    out += s.moe_experts * (2 * linear(te, f, h) + linear(te, h, f))
    r = s.stack.residual_bytes if s.stack.kind == "eager" else 2
    # per routed copy and hidden element: gather (r + r), cast for the expert GEMMs (r + 2), the
    # concatenated outputs (4), the routing weight (4), back to the stream's dtype and index-added (3 r)
    per = (2 * r + r + 2 + 4 + 4 + 3 * r) * h + _EAGER[("swiglu", 0)][0] * f
    nbytes = routed * per * (2 if bwd else 1) + t * s.moe_router * 4 * 3
    kernels = s.moe_experts * 2 + 8
    return out + p.memory_time(nbytes, 2 * kernels if bwd else kernels)


def _cast_bytes(s: BlockShape) -> float:
    """Autocast's weight casts per parameter: fp32 -> bf16 (forward), bf16 grad -> fp32 (backward)."""
    return 6.0 if s.stack.kind == "eager" and s.stack.weight_cast else 0.0


def _fused_block_bytes(s: BlockShape, bwd: bool) -> tuple[float, int]:
    """Megatron-style fused kernels, bf16 (2 bytes): the replicated parts see the full hidden (1/tp of
    it under sequence parallelism); the split parts see the rank's heads / ffn."""
    h, d = s.hidden, s.head_dim
    q, kv = s.heads * d, s.kv_heads * d
    rep = h / s.tp if s.sequence_parallel else h
    fwd_bytes = 2 * (
        2 * 2 * rep  # two norms: read, write
        + 2 * (3 * rep + rep / 2)  # two dropout + residual adds: read x and residual, write; 1-byte mask
        + (2 * (q + kv) if s.rope else 0)  # rotary on q and k: read, write
        + (3 if s.mlp == "swiglu" else 2) * s.ffn  # activation: read gate (and up), write
    )
    kernels = 12  # norms, adds/dropouts, rotary, activation, reshapes per layer
    if bwd:
        return 2 * fwd_bytes, 2 * kernels  # a backward reads the saved input and the incoming grad, writes the grad
    return fwd_bytes, kernels


# Bytes per element of each eager op chain, read + written, (forward, backward), counted from the
# modules' code (omnibench/models/attention.py, llm.py, vision.py, audio.py, moe.py) op by op:
# RMSNorm on an fp32 stream: pow (8), mean (4), x * rsqrt (8), weight * (8), autocast's cast for the
# next linear (6); its backward adds the two gradients of x and the products' partial sums. RoPE from
# a bf16 projection: .float() (6), x * cos (8), the negated half (4), cat (8), * sin (8), add (12),
# back to bf16 (6); its backward has no gradient for the tables. LayerNorm runs in fp32 under autocast
# (one fused kernel, plus the casts around it).
_EAGER = {
    ("rms", 4): (34, 66), ("rms", 2): (36, 66),
    ("layer", 4): (14, 26), ("layer", 2): (20, 32),
    ("rope", 0): (52, 44),
    ("swiglu", 0): (10, 18), ("quick_gelu", 0): (14, 28), ("gelu", 0): (4, 6),
}


def _eager_block_bytes(s: BlockShape, bwd: bool) -> tuple[float, int]:
    """Bytes per token of one block's memory-bound kernels in eager PyTorch under autocast."""
    r = s.stack.residual_bytes
    h, d = s.hidden, s.head_dim
    rep = h / s.tp if s.sequence_parallel else h
    i = 1 if bwd else 0
    rope_elems = (s.heads + s.kv_heads) * d if s.rope else 0
    # residual add (x [r] + branch [bf16]); backward: the branch's gradient cast and the two
    # gradients of x (norm and add) summed
    residual = (2 * r + 2) if not bwd else (18 if r == 4 else 6)
    nbytes = (2 * _EAGER[(s.norm, r)][i] * rep + 2 * residual * rep
              + _EAGER[("rope", 0)][i] * rope_elems + _EAGER[(s.mlp, 0)][i] * s.ffn)
    kernels = 2 * 6 + (14 if s.rope else 0) + 2 + 3
    if bwd:
        if not s.stack.frozen:
            nbytes += 2.0 * s.biased  # bias gradients: a reduction over the tokens of each biased output
        if s.fused_qkv:
            nbytes += 4.0 * (s.heads + 2 * s.kv_heads) * d  # q, k, v gradients assembled into one
        kernels = 2 * kernels
    return nbytes, kernels


def _head(p: KernelProfile, s: BlockShape, bwd: bool) -> float:
    """Output projection and loss of the last stage."""
    t, h, v = s.ntokens, s.hidden, s.vocab
    st = s.stack
    if st.kind != "eager" or st.loss != "chunked":
        wgrad = 0.0 if st.frozen else p.gemm_time(v, h, t)
        out = (p.gemm_time(t, h, v) + wgrad) if bwd else p.gemm_time(t, v, h)
        # cross-entropy over fp32 logits: fwd reads bf16 logits, writes fp32 softmax; bwd writes grads
        out += p.memory_time(t * v * 6, 4)
        return out + p.memory_time(t * h * 2 * 2, 1)  # final norm
    # loss.py::_LinearCrossEntropy: per chunk of c tokens the logits, the softmax-gradient and both
    # gradient GEMMs run in the forward; per logit: .float() (6), logsumexp (amax, subtract, exp, sum:
    # 28), subtract lse (8), exp (8), mask (8), back to bf16 (6); the fp32 weight gradient takes each
    # chunk's bf16 product, casts it (6) and adds it (12). The backward only scales the kept gradients.
    norm = _EAGER[(s.norm, st.residual_bytes)][1 if bwd else 0] * t * h
    # a frozen head: no fp32 weight gradient to fill, cast and add per chunk, or to scale after
    wgrad = 0.0 if st.frozen else 1.0
    if bwd:
        return p.memory_time(wgrad * 8.0 * v * h + 4.0 * t * h + norm, 3)
    c = max(1, st.loss_chunk_tokens or int(t))
    full, rest = divmod(int(t), c)
    gemms = 0.0
    for m, n in ((c, full), (rest, 1 if rest else 0)):
        if n:
            gemms += n * (p.gemm_time(m, v, h) + p.gemm_time(m, h, v) + wgrad * p.gemm_time(v, h, m))
    chunks = full + (1 if rest else 0)
    nbytes = 64.0 * t * v + (wgrad * (18.0 * chunks + 4.0) + _cast_bytes(s)) * v * h + norm
    return gemms + p.memory_time(nbytes, 10 * chunks)


def llm_attention(p: KernelProfile, s: BlockShape, passes: str) -> float:
    """Seconds of the attention core alone of a stage (what selective recomputation re-runs)."""
    return s.layers * _attention(p, s, passes == "bwd")


def _attention(p: KernelProfile, s: BlockShape, bwd: bool) -> float:
    d = s.head_dim
    if (s.stack.attention or p.attention_kernel) == "unfused":
        out = 0.0
        for L in s.seq_lens:
            # scores = Q K^T and out = P V per head: batched GEMMs over the full s x s (masked), then
            # scale-mask-softmax and dropout over s^2 fp16/bf16 scores (bytes: write scores, softmax
            # read + write, dropout read + write + 1-byte mask, read by P V = 6.5 passes of 2 bytes).
            gemms = 2 * (p.gemm_time(L, L, d) if not bwd else 2 * p.gemm_time(L, L, d))
            score_bytes = s.heads * L * L * 2 * (6.5 if not bwd else 7.5)
            out += s.heads * gemms + p.memory_time(score_bytes, 3)
        return out
    if s.ring > 1:
        return _ring_attention(p, s, bwd)
    if s.kv_gather > 1:
        # load-balanced causal: the rank's L/cp queries see on average half of the L keys; one call's
        # time per length, looked up (as the table below is) and summed in the lengths' order
        table = p._attention_cache.setdefault((s.heads, d, s.causal, bwd, s.kv_gather), {})
        for L in s.seq_lens:
            if L not in table:
                table[L] = _flash_call(p, s.heads, d, L / s.kv_gather, L, s.causal, bwd)
        return sum(map(table.__getitem__, s.seq_lens))
    # The profile's flash rows are causal. A full (encoder) attention of length L does the work of a
    # causal one of length L * sqrt(2) over the same tiles, so it is read at that length.
    # one table per (heads, head size, mask, pass): a microbatch's lengths are looked up in it with no
    # key built per sequence (an encoder microbatch holds dozens), summed left to right as a loop does
    table = p._attention_cache.setdefault((s.heads, d, s.causal, bwd), {})
    try:
        return functools.reduce(operator.add, map(table.__getitem__, s.seq_lens), 0.0)
    except KeyError:
        pass
    stretch = 1.0 if s.causal else FULL_ATTENTION_STRETCH
    for L in s.seq_lens:
        if L in table:
            continue
        fwd_flops = 4.0 * s.heads * L * L * d * (0.5 if s.causal else 1.0)
        x = L * stretch
        if bwd:
            # measured fwd_bwd minus measured fwd: the backward alone
            t = fwd_flops * 3.5 / p.attention_rate("fwd_bwd", d, x) - fwd_flops / p.attention_rate("fwd", d, x)
            t = max(t, 2 * p.launch_s)
        else:
            t = max(fwd_flops / p.attention_rate("fwd", d, x), p.launch_s)
        table[L] = t
    return functools.reduce(operator.add, map(table.__getitem__, s.seq_lens), 0.0)


def _flash_call(p: KernelProfile, heads: int, d: int, q_len: float, kv_len: float, causal: bool, bwd: bool) -> float:
    """One flash-attention call of q_len queries over kv_len keys (profile rows read at the length of
    a square causal call of the same work)."""
    flops = 4.0 * heads * q_len * kv_len * d * (0.5 if causal else 1.0)
    x = math.sqrt(q_len * kv_len) * (1.0 if causal else FULL_ATTENTION_STRETCH)
    if bwd:
        t = flops * 3.5 / p.attention_rate("fwd_bwd", d, x) - flops / p.attention_rate("fwd", d, x)
        return max(t, 2 * p.launch_s)
    return max(flops / p.attention_rate("fwd", d, x), p.launch_s)


def _ring_attention(p: KernelProfile, s: BlockShape, bwd: bool) -> float:
    """Ring attention, causal, load-balanced (each rank holds two opposite 1/(2 cp) chunks of every
    sequence, as Megatron-LM's and torchtitan's context parallelism place them): per sequence one
    causal call on the rank's own block and cp - 1 full calls of half a block against a block."""
    table = p._attention_cache.setdefault((s.heads, s.head_dim, s.causal, bwd, "ring", s.ring), {})
    out = 0.0
    for L in s.seq_lens:
        calls = table.get(L)
        if calls is None:  # worked out once per length (sequences repeat across microbatches)
            block = L / s.ring
            calls = table[L] = (
                _flash_call(p, s.heads, s.head_dim, block, block, s.causal, bwd),
                (s.ring - 1) * _flash_call(p, s.heads, s.head_dim, block / 2 if s.causal else block, block,
                                           False, bwd))
        out += calls[0]
        out += calls[1]
    return out


def ring_step_attention(p: KernelProfile, s: BlockShape, bwd: bool) -> float:
    """Seconds of attention a ring step has to hide its K/V transfer behind (one layer)."""
    return _ring_attention(p, s, bwd) / max(1, s.ring)

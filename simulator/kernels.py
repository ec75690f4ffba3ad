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

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

SCHEMA = "omnibench-kernel-profile/1"
DATA_DIR = Path(__file__).parent / "data" / "kernels"
REPO_ROOT = Path(__file__).resolve().parents[1]
ATTENTION_KERNELS = ("flash", "unfused")


class KernelProfileError(ValueError):
    """A kernel profile is missing or malformed; the message names the file and field."""


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

    # -- queries ---------------------------------------------------------------------------------
    def gemm_rate(self, m: float, n: float, k: float) -> float:
        key = (round(m), round(n), round(k))
        got = self._gemm_cache.get(key)
        if got is not None:
            return got
        q = (math.log2(max(m, 1)), math.log2(max(n, 1)), math.log2(max(k, 1)))
        dists = sorted(((q[0] - a) ** 2 + (q[1] - b) ** 2 + (q[2] - c) ** 2, r) for a, b, c, r in self.gemm)[:4]
        if dists[0][0] < 1e-12:
            rate = dists[0][1]
        else:
            w = [1.0 / d for d, _ in dists]
            rate = math.exp(sum(wi * math.log(r) for wi, (_, r) in zip(w, dists, strict=True)) / sum(w))
        # Beyond the table a GEMM is no faster than the fastest measured and, for a shape smaller than
        # every neighbour, no faster than its FLOPs allow at the neighbours' rate (scaled down).
        smallest = min(2 ** (a + b + c) for a, b, c, _ in self.gemm)
        size = m * n * k
        if size < smallest:
            rate *= size / smallest
        rate = min(rate, self._best)
        self._gemm_cache[key] = rate
        return rate

    def gemm_time(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        t = 2.0 * m * n * k / self.gemm_rate(m, n, k)
        return count * max(t, self.launch_s)

    def attention_rate(self, passes: str, head_dim: int, seq: float) -> float:
        key = (passes, head_dim)
        rows = self.attention.get(key)
        if rows is None:  # nearest measured head size
            dims = sorted({d for p, d in self.attention if p == passes}, key=lambda d: abs(d - head_dim))
            if not dims:
                raise KernelProfileError(f"kernel profile {self.name}: no {passes} attention rows")
            rows = self.attention[(passes, dims[0])]
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


# -- a dense decoder layer as kernels ------------------------------------------------------------------
@dataclass(frozen=True)
class LLMShape:
    """What the kernel model needs of one LLM stage on one microbatch, per rank."""

    hidden: int
    heads: int  # query heads per rank (after tp)
    kv_heads: int  # per rank
    head_dim: int
    ffn: int  # per rank (after tp)
    vocab: int  # per rank (after tp)
    seq_lens: tuple[int, ...]  # sequences of the microbatch, per rank (after cp)
    layers: int
    head: bool  # holds the output projection and the loss
    tp: int = 1
    sequence_parallel: bool = False
    moe: bool = False


def llm_pass(p: KernelProfile, s: LLMShape, passes: str) -> float:
    """Seconds of one forward (`passes` "fwd") or backward ("bwd", without recomputation) of a stage."""
    t = float(sum(s.seq_lens))
    if t <= 0:
        return 0.0
    h, d = s.hidden, s.head_dim
    q, kv = s.heads * d, s.kv_heads * d
    linears = [(q + 2 * kv, h), (h, q), (2 * s.ffn, h), (h, s.ffn)]  # (fan_out, fan_in): qkv, proj, fc1, fc2
    bwd = passes == "bwd"
    time = 0.0
    for fan_out, fan_in in linears:
        if bwd:
            time += p.gemm_time(t, fan_in, fan_out) + p.gemm_time(fan_out, fan_in, t)  # dgrad, wgrad
        else:
            time += p.gemm_time(t, fan_out, fan_in)
    time += _attention(p, s, bwd)
    # Memory-bound work per token (bf16, 2 bytes): the replicated parts see the full hidden (1/tp of
    # it under sequence parallelism); the split parts see the rank's heads / ffn.
    rep = h / s.tp if s.sequence_parallel else h
    fwd_bytes = 2 * (
        2 * 2 * rep  # two norms: read, write
        + 2 * (3 * rep + rep / 2)  # two dropout + residual adds: read x and residual, write; 1-byte mask
        + 2 * (q + kv)  # rotary on q and k: read, write
        + 3 * s.ffn  # gated activation: read gate and up, write
    )
    kernels = 12  # norms, adds/dropouts, rotary, activation, reshapes per layer
    if bwd:
        fwd_bytes *= 2  # a backward reads the saved input and the incoming grad, writes the grad
        kernels *= 2
    time += p.memory_time(t * fwd_bytes, kernels)
    total = s.layers * time
    if s.head:
        v = s.vocab
        total += (p.gemm_time(t, h, v) + p.gemm_time(v, h, t)) if bwd else p.gemm_time(t, v, h)
        # cross-entropy over fp32 logits: fwd reads bf16 logits, writes fp32 softmax; bwd writes grads
        total += p.memory_time(t * v * 6, 4)
        total += p.memory_time(t * h * 2 * 2, 1)  # final norm
    return total


def llm_attention(p: KernelProfile, s: LLMShape, passes: str) -> float:
    """Seconds of the attention core alone of a stage (what selective recomputation re-runs)."""
    return s.layers * _attention(p, s, passes == "bwd")


def _attention(p: KernelProfile, s: LLMShape, bwd: bool) -> float:
    d = s.head_dim
    if p.attention_kernel == "unfused":
        out = 0.0
        for L in s.seq_lens:
            # scores = Q K^T and out = P V per head: batched GEMMs over the full s x s (masked), then
            # scale-mask-softmax and dropout over s^2 fp16/bf16 scores (bytes: write scores, softmax
            # read + write, dropout read + write + 1-byte mask, read by P V = 6.5 passes of 2 bytes).
            gemms = 2 * (p.gemm_time(L, L, d) if not bwd else 2 * p.gemm_time(L, L, d))
            score_bytes = s.heads * L * L * 2 * (6.5 if not bwd else 7.5)
            out += s.heads * gemms + p.memory_time(score_bytes, 3)
        return out
    out = 0.0
    passes = "fwd_bwd" if bwd else "fwd"
    for L in s.seq_lens:
        fwd_flops = 4.0 * s.heads * L * L * d * 0.5
        if bwd:
            # measured fwd_bwd minus measured fwd: the backward alone
            t = fwd_flops * 3.5 / p.attention_rate("fwd_bwd", d, L) - fwd_flops / p.attention_rate("fwd", d, L)
            out += max(t, 2 * p.launch_s)
        else:
            out += max(fwd_flops / p.attention_rate(passes, d, L), p.launch_s)
    return out

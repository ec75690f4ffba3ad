"""Compute time of a forward/backward action: exact FLOPs over an efficiency curve.

Achieved FLOP/s of one op of F FLOPs is `peak * e_max * F / (F + F_half)` (saturating: small ops
waste most of the GPU). Over an action of `ops` equal-sized ops with F_total FLOPs this gives

    time = (F_total + ops * F_half) / (peak * e_max)

i.e. a per-op fixed cost plus a rate, which is also what `calibrate` fits (scipy curve_fit) from
measured action times, with two terms only a slow host needs (zero on the datasheet curve): a
fixed cost per action and a cost per attention call (packed attention looping over sequences). Attention FLOPs run at their own efficiency (`attention_weight` = how much
slower an attention FLOP is than a matmul FLOP). Without calibration the curve comes from the
datasheet (hardware preset) with Calculon-style defaults. A memory-bound floor (bytes over HBM
bandwidth) applies to optimizer steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from simulator.flops import Work
from simulator.hardware import ClusterSpec


@dataclass(frozen=True)
class EfficiencyCurve:
    peak_flops: float
    e_max: float
    half_flops: float  # F_half, FLOPs of one op at which half of e_max is reached
    attention_weight: float = 1.0
    overhead_s: float = 0.0  # fixed cost per action (launch, Python), fitted on slow hosts
    per_sequence_s: float = 0.0  # cost per attention call (a per-sequence loop, as on CPU), fitted
    # cost per element of input tensors the action prepares (the runtime draws every sample's pixel
    # patches and mel frames where a forward takes raw samples: encoders and the LLM's first stage)
    per_input_element_s: float = 0.0
    # the rank's own work per collective call issued inside the action (FSDP2's hooks, copy-in and
    # copy-out around each gather and reduce-scatter); the wait for the transfer is not in it
    per_inline_call_s: float = 0.0

    def time(self, matmul_flops: float, attention_flops: float, ops: int, sequences: int = 0,
             inputs: float = 0.0, calls: int = 0) -> float:
        if matmul_flops <= 0 and attention_flops <= 0:
            return 0.0
        work = matmul_flops + self.attention_weight * attention_flops + ops * self.half_flops
        return (self.overhead_s + sequences * self.per_sequence_s + inputs * self.per_input_element_s
                + calls * self.per_inline_call_s + work / (self.peak_flops * self.e_max))

    def to_dict(self) -> dict:
        return asdict(self)


def default_curve(cluster: ClusterSpec) -> EfficiencyCurve:
    g = cluster.gpu
    return EfficiencyCurve(
        peak_flops=g.peak_flops,
        e_max=g.matmul_efficiency,
        half_flops=g.matmul_half_gflop * 1e9,
        attention_weight=g.matmul_efficiency / g.attention_efficiency,
    )


# the scaled copies of the loaded profiles: (id of the loaded profile, scales) -> (that profile, its copy)
_SCALED: dict = {}


def _kernel_profile(name: str, peak_flops: float, compute_scale: float, memory_scale: float):
    """The kernel profile `name` on a variant of its GPU (hardware.GPUSpec.kernel_compute_scale /
    _memory_scale), one object per loaded profile: a profile keeps what it has costed (GEMM rates per
    shape bucket, attention per length, a block's terms per token count) for the simulations after,
    and a scaled copy made per simulation (every H200, A100 or B200 one) began each with none of it.
    Keyed by the loaded profile's identity, so a profile loaded again (load_kernel_profile.cache_clear,
    as an ablation that patches the kernel model does) gets a fresh copy."""
    from simulator.kernels import load_kernel_profile

    base = load_kernel_profile(name, peak_flops)
    if (compute_scale, memory_scale) == (1.0, 1.0):
        return base
    key = (id(base), compute_scale, memory_scale)
    got = _SCALED.get(key)
    if got is None or got[0] is not base:
        if len(_SCALED) >= 16:
            _SCALED.clear()
        got = _SCALED[key] = (base, base.scaled(compute_scale, memory_scale))
    return got[1]


@dataclass
class ComputeModel:
    cluster: ClusterSpec
    # "forward.vision" / "forward" / "backward.llm" / ... -> fitted curve; a module's own curve wins,
    # then the kind's, then the datasheet curve.
    curves: dict[str, EfficiencyCurve] | None = None
    # fitted (seconds per step, seconds per parameter[, seconds per FSDP-sharded layer, seconds per
    # unsharded layer]): optimizer steps over many small tensors cost per tensor, and a DTensor shard
    # far more than a plain tensor (CPU: dispatch overhead dominates the arithmetic).
    optimizer: tuple[float, ...] | None = None
    # Lock-stepped peers (FSDP, EP) wait for each other layer by layer, and the sum of per-layer
    # maxima exceeds the largest peer's total by this fraction of it (fitted; 0 on the datasheet).
    lock_skew: float = 0.0
    _default: EfficiencyCurve | None = field(default=None, repr=False)
    _kernel_cache: dict = field(default_factory=dict, repr=False)

    @property
    def kernels(self):
        """The cluster's kernel profile (simulator/kernels.py), or None (datasheet roofline fallback)."""
        if not self.cluster.kernels:
            return None
        got = self._kernel_cache.get("profile")
        if got is None:
            g = self.cluster.gpu
            got = self._kernel_cache["profile"] = _kernel_profile(self.cluster.kernels, g.peak_flops,
                                                                  g.kernel_compute_scale, g.kernel_memory_scale)
        return got

    def describe(self) -> str:
        """Which compute model answers, in words (printed with every simulation)."""
        if self.curves:
            return "calibrated efficiency curves (fitted from run traces)"
        prof = self.kernels
        if prof is not None:
            return prof.describe()
        return "datasheet roofline curve (fallback: no kernel profile for this hardware)"

    def _kernel_time(self, work: Work, passes: str, recompute: str = "none") -> float | None:
        prof = self.kernels
        if prof is None or work.shape is None:
            return None
        # by identity: Work objects are cached (one per distinct microbatch, the shape inside it), and
        # hashing a BlockShape (its sequence lengths and stack) per lookup cost more than the lookup; a
        # second, by-value level found almost nothing that the identity missed (equal shapes come from
        # equal microbatches, which share one Work)
        fast = (id(work.shape), passes, recompute)
        hit = self._kernel_cache.get(fast)
        if hit is not None and hit[1] is work.shape:
            return hit[0]
        from simulator.kernels import llm_attention, llm_pass

        got = llm_pass(prof, work.shape, passes)
        if passes == "bwd" and recompute == "full":
            # Megatron / torch checkpointing re-runs each block's forward (not the head, not the
            # work outside the blocks)
            got += llm_pass(prof, work.shape, "fwd", blocks_only=True)
        elif passes == "bwd" and recompute == "selective":
            got += llm_attention(prof, work.shape, "fwd")
        elif passes == "bwd" and recompute == "half":
            # torchtitan's selective checkpointing: every other block whole (layer policy) or every
            # other matmul and the element-wise ops (op policy): half of the blocks' forward again
            got += 0.5 * llm_pass(prof, work.shape, "fwd", blocks_only=True)
        self._kernel_cache[fast] = (got, work.shape)
        return got

    def trim_kernel_times(self, most: int) -> None:
        """Forget the kernel times kept (`_kernel_time`) once more than `most` are: a model that outlives
        the shapes it priced (a planner's, kept per process) would otherwise keep each one alive."""
        cache = self._kernel_cache
        if len(cache) > most:
            profile = cache.get("profile")
            cache.clear()
            if profile is not None:
                cache["profile"] = profile

    def curve(self, kind: str, module: str = "") -> EfficiencyCurve:
        if self.curves:
            for key in (f"{kind}.{module}", kind):
                if key in self.curves:
                    return self.curves[key]
        if self._default is None:
            self._default = default_curve(self.cluster)
        return self._default

    def fitted(self, kind: str, module: str = "") -> bool:
        return bool(self.curves) and (f"{kind}.{module}" in self.curves or kind in self.curves)

    def action_time(self, work: Work, kind: str, recompute: str = "none", module: str = "",
                    inputs: float = 0.0, calls: int = 0) -> float:
        """Seconds of compute of a forward or backward action (backward includes its recomputation,
        whose FLOPs `work` already holds for the run's recompute policy); `inputs`: elements of
        raw input tensors a forward prepares (flops.input_elements); `calls`: collective calls the
        action issues in line (their transfers are the collective model's)."""
        if not self.fitted(kind, module):
            # A calibrated curve (fitted from traces) wins; else the kernel profile; else the datasheet.
            t = self._kernel_time(work, "fwd" if kind == "forward" else "bwd", recompute)
            if t is not None:
                return t
        fwd = self.curve("forward", module)
        if kind == "forward":
            return fwd.time(work.matmul_flops, work.attention_flops, work.ops, work.sequences, inputs, calls)
        rec = 0.0
        if recompute == "half":
            rec = 0.5 * fwd.time(work.matmul_flops, work.attention_flops, work.ops, work.sequences)
        elif recompute != "none" and (work.recompute_matmul or work.recompute_attention):
            ops = work.ops if recompute == "full" else work.layers
            rec = fwd.time(work.recompute_matmul, work.recompute_attention, ops, work.sequences)
        if self.fitted("backward", module):
            # A fitted backward curve is fitted against the forward FLOPs of the same action.
            c = self.curve("backward", module)
            return c.time(work.matmul_flops, work.attention_flops, work.ops, work.sequences, calls=calls) + rec
        c = self.curve("backward")
        return c.time(work.backward_matmul, work.backward_attention, 2 * work.ops, 2 * work.sequences,
                      calls=calls) + rec

    def best_rate(self, module: str = "") -> float:
        """The highest FLOP/s this model lets a forward or backward reach: the kernel profile's best GEMM
        rate, else the efficiency curve's peak (what `simulator/quota.py` measures a module's use by)."""
        prof = self.kernels
        if prof is not None and not self.fitted("forward", module):
            return prof._best
        c = self.curve("forward", module)
        return c.peak_flops * c.e_max

    def optimizer_time(self, params_on_rank: float, sharded_layers: float = 0.0, plain_layers: float = 0.0) -> float:
        """AdamW: read param, grad, two moments and write param and moments, fp32: 28 bytes/param.
        Fitted: a constant, a cost per parameter and (when fitted) per layer held, sharded or not."""
        if self.optimizer is not None:
            t = self.optimizer[0] + self.optimizer[1] * params_on_rank
            if len(self.optimizer) >= 4:
                t += self.optimizer[2] * sharded_layers + self.optimizer[3] * plain_layers
            return t
        g = self.cluster.gpu
        prof = self.kernels
        if prof is not None:
            return prof.memory_time(28.0 * params_on_rank)
        return 28.0 * params_on_rank / (g.memory_bandwidth * g.memory_efficiency)

"""Per-modality cost of one sample, in seconds: what omni's reordering, long/short threshold and joint
schedule balance, and what any other planner or the simulator can ask for a single sample.

An encoder's cost over one sample is a sum over its attention sequences (a vision temporal group of
h*w patches, an audio window of at most `max_positions` positions) of

    linear * s + quadratic * s^2 + per_sequence

per training pass (forward + backward): linear for the projections, MLP, patch embed / convs and
merger / projector, quadratic for the attention core. The LLM's cost of a sample is its exact
training FLOPs (costs.llm_flops over the sample as one causal sequence) over an achieved rate.

Coefficients come from `omnibench/specs/costs.py` (exact FLOPs) divided by an achieved FLOP/s:
- analytic defaults: one nominal rate for every module (relative costs are what balancing needs);
- calibrated: the simulator's fitted efficiency curves (`omnibench calibrate` profile), so attention
  FLOPs run at their fitted relative speed and per-sequence loop costs (CPU varlen) count. The
  curves are the simulator's own objects (`simulator.calibrate.Profile`), not a second formula.
No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from omnibench.specs import costs
from omnibench.specs.model import AudioEncoderSpec, MultimodalSpec, VisionEncoderSpec
from workloads.sample import ENCODER_OF, Sample

NOMINAL_FLOPS = 1e12  # analytic default: 1 TFLOP/s achieved, every module alike


class CostModelError(ValueError):
    """A bad calibration source; the message names it."""


@dataclass(frozen=True)
class Coefficients:
    """Seconds of one training pass (forward + backward) per unit, for one module."""

    linear: float  # per position (patch / audio position / LLM token)
    quadratic: float  # per attention (query, key) pair
    per_sequence: float = 0.0  # per attention sequence (a varlen loop iteration over all layers)

    def sequence(self, s: int, causal: bool = False) -> float:
        pairs = s * (s + 1) / 2 if causal else float(s) * s
        return self.linear * s + self.quadratic * pairs + self.per_sequence


def attention_sequences(sample: Sample, module: str, model: MultimodalSpec) -> list[int]:
    """The attention sequence lengths `module` runs over for one sample (empty if it has no input)."""
    out: list[int] = []
    for seg in sample.segments:
        if ENCODER_OF.get(seg.modality) != module:
            continue
        if module == "vision":
            t, h, w = seg.grid_thw
            if t * h * w == 0 and seg.encoder_seq_len:  # a segment without a grid: one sequence
                out.append(seg.encoder_seq_len)
            else:
                out += [h * w] * t
        else:
            enc = model.audio
            limit = enc.max_positions if enc is not None else 1500
            out += costs.audio_windows([seg.mel_frames or 2 * seg.encoder_seq_len], limit)
    return out


def _flops_coefficients(model: MultimodalSpec, module: str) -> tuple[float, float, float, float]:
    """(linear matmul FLOPs per position, attention FLOPs per pair) of a training pass, and the same
    split of the forward alone, probed from costs.py so the formulas stay in one place."""
    if module == "llm":
        one = costs.llm_flops(model.llm, [1])
        # One position is one causal pair: the attention core is exact per pair, the rest linear.
        core = one.parts.get("attention_core", 0.0)
        fwd_lin = one.forward - core
        tot_lin = one.total - 3 * core
        return tot_lin, 3 * core, fwd_lin, core
    enc = model.encoders[module]
    if isinstance(enc, VisionEncoderSpec):
        m = enc.merge
        f = costs.vision_flops(enc, [(1, m, m)])
        n = m * m
    else:
        assert isinstance(enc, AudioEncoderSpec)
        f = costs.audio_flops(enc, [4 * enc.pool])  # 2 * pool positions, one window
        n = 2 * enc.pool
    core = f.parts.get("attention_core", 0.0)
    pairs = n * n
    fwd_lin = (f.forward - core) / n
    tot_lin = (f.total - 3 * core) / n  # backward of the core is 2x its forward
    return tot_lin, 3 * core / pairs, fwd_lin, core / pairs


class CostModel:
    """Training-pass seconds per sample and module; `forward_share` splits them into fwd / bwd."""

    def __init__(self, model: MultimodalSpec, coefficients: dict[str, Coefficients],
                 forward_share: dict[str, float], source: str):
        self.model = model
        self.coefficients = coefficients
        self.forward_share = forward_share
        self.source = source

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def analytic(model: MultimodalSpec, flops_per_s: float = NOMINAL_FLOPS) -> CostModel:
        return _analytic(model, flops_per_s)

    @staticmethod
    def from_curves(model: MultimodalSpec, curves: dict, source: str = "calibrated") -> CostModel:
        """From fitted efficiency curves keyed like the simulator's ("forward.vision", "backward",
        ...; module key first, then the kind's): any object with peak_flops, e_max,
        attention_weight and per_sequence_s. A module with no curve keeps the analytic default
        scaled to the calibrated forward rate."""
        coeffs, share = {}, {}
        for module in ["llm", *model.encoders]:
            tot_lin, tot_quad, fwd_lin, fwd_quad = _flops_coefficients(model, module)
            fwd = _curve(curves, "forward", module)
            if fwd is None:
                raise CostModelError(f"calibration: no forward curve for {module} (keys: {', '.join(curves)})")
            rate = fwd.peak_flops * fwd.e_max
            layers = model.llm.layers if module == "llm" else model.encoders[module].layers
            f_lin, f_quad = fwd_lin / rate, fwd_quad * fwd.attention_weight / rate
            f_seq = fwd.per_sequence_s * layers
            bwd = _curve(curves, "backward", module, exact=True)
            if bwd is not None:  # fitted against the forward FLOPs of the same action
                b_rate = bwd.peak_flops * bwd.e_max
                b_lin, b_quad = fwd_lin / b_rate, fwd_quad * bwd.attention_weight / b_rate
                b_seq = bwd.per_sequence_s * layers
            else:
                b_lin, b_quad, b_seq = (tot_lin - fwd_lin) / rate, (tot_quad - fwd_quad) * fwd.attention_weight / rate, 2 * f_seq
            coeffs[module] = Coefficients(f_lin + b_lin, f_quad + b_quad, f_seq + b_seq)
            share[module] = (f_lin + f_quad) / max(1e-30, f_lin + f_quad + b_lin + b_quad)
        return CostModel(model, coeffs, share, source)

    @staticmethod
    def from_profile(model: MultimodalSpec, path: str | Path) -> CostModel:
        """From a calibration profile written by `omnibench calibrate` (its fitted compute curves)."""
        from simulator.calibrate import CalibrationError, Profile  # torch-free; only when a profile is given

        try:
            profile = Profile.load(path)
        except CalibrationError as e:
            raise CostModelError(str(e)) from None
        if not profile.compute:
            raise CostModelError(f"calibration: {path} has no fitted compute curves")
        return CostModel.from_curves(model, profile.compute, source=f"calibrated from {path}")

    @staticmethod
    def from_simulator(model: MultimodalSpec, hardware: str = "h100") -> CostModel:
        """The simulator's own compute model for a hardware preset (its kernel profile where the
        preset has one, else the datasheet curve), fitted per module to linear + quadratic +
        per-sequence seconds over single sequences of 256 to 16,384 positions: what omni plans with
        unless a calibration profile is given, so the planner and the simulator price work alike."""
        return _from_simulator(model, hardware)

    # -- queries --------------------------------------------------------------------------------
    def encoder(self, sample: Sample, module: str) -> float:
        """Seconds of one training pass of `module` over `sample` (0 if it has no such input)."""
        c = self.coefficients.get(module)
        if c is None:
            return 0.0
        return sum(c.sequence(s) for s in attention_sequences(sample, module, self.model))

    def encoder_sequence(self, module: str, seq_lens: Iterable[int]) -> float:
        c = self.coefficients[module]
        return sum(c.sequence(s) for s in seq_lens)

    def llm(self, sample: Sample) -> float:
        return self.llm_tokens(sample.llm_tokens)

    def llm_tokens(self, tokens: int) -> float:
        return self.coefficients["llm"].sequence(tokens, causal=True) if tokens else 0.0

    def encoders(self, sample: Sample) -> float:
        return sum(self.encoder(sample, m) for m in self.model.encoders)

    def total(self, sample: Sample) -> float:
        return self.encoders(sample) + self.llm(sample)

    def forward(self, module: str, seconds: float) -> float:
        """The forward part of a training-pass cost (the rest is backward)."""
        return seconds * self.forward_share.get(module, 1 / 3)

    def describe(self) -> dict:
        return {"source": self.source, **{m: vars(c) | {"forward_share": self.forward_share[m]}
                                          for m, c in self.coefficients.items()}}


def _curve(curves: dict, kind: str, module: str, exact: bool = False):
    if f"{kind}.{module}" in curves:
        return curves[f"{kind}.{module}"]
    return None if exact else curves.get(kind)


@lru_cache(maxsize=64)
def _analytic(model: MultimodalSpec, flops_per_s: float) -> CostModel:
    coeffs, share = {}, {}
    for module in ["llm", *model.encoders]:
        tot_lin, tot_quad, fwd_lin, fwd_quad = _flops_coefficients(model, module)
        coeffs[module] = Coefficients(tot_lin / flops_per_s, tot_quad / flops_per_s)
        share[module] = (fwd_lin + fwd_quad) / (tot_lin + tot_quad)
    return CostModel(model, coeffs, share, f"analytic (costs.py FLOPs at {flops_per_s:.3g} FLOP/s)")


FIT_LENGTHS = (256, 1024, 4096, 16384)


@lru_cache(maxsize=16)
def _from_simulator(model: MultimodalSpec, hardware: str) -> CostModel:
    from simulator.compute import ComputeModel  # torch-free
    from simulator.flops import audio_work, llm_work, vision_work
    from simulator.hardware import load_cluster

    compute = ComputeModel(load_cluster(hardware, 8))
    coeffs, share = {}, {}
    for module in ["llm", *model.encoders]:
        rows, mid = [], None
        for n in FIT_LENGTHS:
            # A sample's cost is what it adds to a microbatch: the time of two sequences minus one
            # (the action's fixed cost, kernel launches of a pass, is paid once per microbatch).
            if module == "llm":
                works = [llm_work(model.llm, [n] * j, range(model.llm.layers), True, True) for j in (1, 2)]
                pairs = n * (n + 1) / 2
            elif module == "vision":
                m = model.vision.merge
                x = max(m, n // m // m * m)
                works = [vision_work(model.vision, [(1, m, x)] * j) for j in (1, 2)]
                n = m * x
                pairs = float(n) * n
            else:
                n = min(n, model.audio.max_positions)
                works = [audio_work(model.audio, [2 * n] * j) for j in (1, 2)]
                pairs = float(n) * n
            f, b = (compute.action_time(works[1], kind, module=module) - compute.action_time(works[0], kind, module=module)
                    for kind in ("forward", "backward"))
            rows.append((n, pairs, f + b))
            if mid is None or n <= 4096:
                mid = (f, b)
        lin, quad, per = _least_squares(rows)
        coeffs[module] = Coefficients(lin, quad, per)
        share[module] = mid[0] / (mid[0] + mid[1])
    return CostModel(model, coeffs, share, f"simulator compute model ({compute.describe()}) on {hardware}")


def _least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Non-negative fit of t = a*n + b*pairs + c (normal equations; a negative term is dropped)."""
    def solve(cols: list[int]) -> list[float]:
        xs = [[(r[0], r[1], 1.0)[c] for c in cols] for r in rows]
        ys = [r[2] for r in rows]
        k = len(cols)
        a = [[sum(x[i] * x[j] for x in xs) for j in range(k)] for i in range(k)]
        v = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(k)]
        for i in range(k):  # Gauss-Jordan on a tiny system
            p = max(range(i, k), key=lambda r: abs(a[r][i]))
            a[i], a[p], v[i], v[p] = a[p], a[i], v[p], v[i]
            for r in range(k):
                if r != i and a[i][i]:
                    f = a[r][i] / a[i][i]
                    a[r] = [x - f * y for x, y in zip(a[r], a[i], strict=True)]
                    v[r] -= f * v[i]
        return [v[i] / a[i][i] if a[i][i] else 0.0 for i in range(k)]

    cols = [0, 1, 2]
    while True:
        sol = solve(cols)
        if all(x >= 0 for x in sol) or len(cols) == 1:
            out = [0.0, 0.0, 0.0]
            for c, x in zip(cols, sol, strict=True):
                out[c] = max(0.0, x)
            return out[0], out[1], out[2]
        worst = min(zip(sol, cols, strict=True))[1]
        cols = [c for c in cols if c != worst]


def load_cost_model(model: MultimodalSpec, calibration: str | None = None, hardware: str = "") -> CostModel:
    """The cost model a planner uses: calibrated when a profile path is given, else the simulator's
    compute model for `hardware`, else analytic."""
    if calibration:
        return CostModel.from_profile(model, calibration)
    if hardware:
        return CostModel.from_simulator(model, hardware)
    return CostModel.analytic(model)

"""Calibration (fit the simulator's cost models to measured run traces) and validation (simulate each
run's own Plan and compare with what was measured).

Compute: per action kind (forward, backward) and per (kind, module), `time = overhead + (F_matmul + w * F_attention +
ops * F_half) / (peak * e_max)` over the traced actions, fitted with scipy's curve_fit (bounded,
non-negative); backward is fitted against the *forward* FLOPs of the same stage and microbatch, so
the factor 2 and any recomputation are in the fit. Optimizer steps: `time = a + b * parameters
on the rank`. Collectives: `time = alpha * steps + moved /
beta` (NCCL-style latency per algorithm step plus bytes over bandwidth) over the traced grad_syncs
and pipeline p2p, each collective instance taken at its fastest participant (the others also wait
for stragglers). A profile is JSON with its provenance (device, torch version, date, run folders).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import curve_fit, lsq_linear

from omnibench.plan import Action
from omnibench.specs.model import MultimodalSpec
from simulator.collectives import CollectiveModel
from simulator.compute import ComputeModel, EfficiencyCurve
from simulator.engine import Engine, SimOptions, SimulationError, simulate
from simulator.hardware import ClusterSpec, load_cluster
from simulator.traces import RunRecord, plan_for_step, read_run

ROBUST_LOSS = "soft_l1"  # see fit_compute


class CalibrationError(ValueError):
    """Not enough measured data to fit, or a bad profile file; the message names what is missing."""


@dataclass
class Profile:
    hardware: str
    compute: dict[str, EfficiencyCurve] = field(default_factory=dict)
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)  # placement -> (alpha, beta)
    optimizer: tuple[float, float] | None = None  # (seconds per step, seconds per parameter on the rank)
    provenance: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)  # goodness of fit per model, points used

    def compute_model(self, cluster: ClusterSpec) -> ComputeModel:
        return ComputeModel(cluster, dict(self.compute) or None, self.optimizer)

    def collective_model(self, cluster: ClusterSpec) -> CollectiveModel:
        return CollectiveModel(cluster, fitted=dict(self.collectives))

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware,
            "compute": {k: v.to_dict() for k, v in self.compute.items()},
            "collectives": {k: {"alpha_s": a, "beta_Bps": b} for k, (a, b) in self.collectives.items()},
            "optimizer": None if self.optimizer is None else
            {"overhead_s": self.optimizer[0], "seconds_per_param": self.optimizer[1]},
            "provenance": self.provenance,
            "fit": self.fit,
        }

    def save(self, path: str | Path) -> None:
        from simulator.traces import write_json_atomic

        write_json_atomic(Path(path), self.to_dict())

    @staticmethod
    def load(path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise CalibrationError(f"calibration: no such profile {str(path)!r}")
        try:
            d = json.loads(p.read_text())
            return Profile(
                hardware=d["hardware"],
                compute={k: EfficiencyCurve(**v) for k, v in d.get("compute", {}).items()},
                collectives={k: (float(v["alpha_s"]), float(v["beta_Bps"])) for k, v in d.get("collectives", {}).items()},
                optimizer=None if not d.get("optimizer") else
                (float(d["optimizer"]["overhead_s"]), float(d["optimizer"]["seconds_per_param"])),
                provenance=d.get("provenance", {}),
                fit=d.get("fit", {}),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise CalibrationError(f"calibration: {p} is not a profile ({e})") from None


def _model_of(run: RunRecord) -> MultimodalSpec:
    from omnibench.specs.presets import get_model, model_from_dict

    spec = run.config.get("model")
    if isinstance(spec, dict):
        return model_from_dict(spec, f"{run.path}/config.json model")
    return get_model(spec or run.plans[0].model)


def _cluster_of(run: RunRecord, hardware: str | None) -> ClusterSpec:
    name = hardware or run.hardware
    if name is None:
        raise CalibrationError(f"{run.path}: device {run.device!r} matches no hardware preset; pass --hardware")
    return load_cluster(str(name), run.plans[0].world_size)


def _warmup_step(run: RunRecord) -> int | None:
    """The first step pays one-time costs (allocations, lazy init): left out of fits when others exist."""
    steps = sorted({sp.step for sp in run.spans})
    return steps[0] if len(steps) > 1 else None


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 1.0


def _compute_points(runs: list[RunRecord], hardware: str | None, profile: Profile) -> dict[str, list[tuple]]:
    """(matmul FLOPs, attention FLOPs, ops, sequences, seconds of compute) per traced forward/backward.

    A measured span holds the action's intra-module communication too; what the engine would add
    for it under `profile` (its fitted collectives) is subtracted, so it is not counted twice.

    FSDP and EP lock data-parallel peers together inside an action (per-layer all-gathers and
    all-to-alls), so a measured span also holds the wait for the slowest peer. Such actions are
    matched across their lock group (same step, kind, module, stage, occurrence) and counted once:
    the duration of the last peer to start (it waited for nobody), against the largest FLOPs of the
    group, which is how the engine costs a locked action.
    """
    pts: dict[str, list[tuple]] = defaultdict(list)
    for run in runs:
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        engines: dict[int, Engine] = {}
        warmup = _warmup_step(run)
        groups: dict[tuple, list] = defaultdict(list)
        seen: dict[tuple, int] = defaultdict(int)
        for sp in sorted(run.spans, key=lambda x: (x.rank, x.start)):
            if sp.kind not in ("forward", "backward") or sp.duration <= 0 or sp.step == warmup:
                continue
            plan = plan_for_step(run, sp.step)
            if plan is None or sp.module not in plan.layouts:
                continue
            eng = engines.get(id(plan))
            if eng is None:
                eng = engines[id(plan)] = Engine(plan, model, cluster, profile.compute_model(cluster),
                                                 profile.collective_model(cluster))
            try:
                sig = eng._signature(sp.module, sp.rank, sp.microbatch)
            except (SimulationError, KeyError, IndexError):  # a span the plan does not hold
                continue
            stage = 0
            if sp.module == "llm" and sp.rank in eng.index["llm"].coords:
                stage = eng.index["llm"].coords[sp.rank]["pp"]
            w = eng.work(sp.module, stage, sig)
            exposed = eng._compute_op(sp.rank, Action(sp.kind, sp.module, sp.microbatch, stage),
                                      _Identity()).exposed
            lock = eng._lock_group(sp.module, sp.rank)
            base = (sp.step, sp.kind, sp.module, stage, lock if lock is not None else (sp.rank,))
            n = seen[(base, sp.rank)]
            seen[(base, sp.rank)] += 1
            groups[(*base, n)].append((sp.start, sp.duration - exposed, w))
        for key, members in groups.items():
            kind, module = key[1], key[2]
            last = max(members, key=lambda m: m[0])
            w = max((m[2] for m in members), key=lambda x: x.flops)
            if last[1] <= 0 or w.flops <= 0:
                continue  # all communication (an empty microbatch's dummy forward): nothing to fit
            row = (w.matmul_flops, w.attention_flops, w.ops, w.sequences, last[1])
            pts[kind].append(row)
            pts[f"{kind}.{module}"].append(row)
    return pts


class _Identity(dict):
    """Every rank its own class (calibration looks at real ranks, not collapsed ones)."""

    def __missing__(self, key):
        return key


def fit_compute(points: list[tuple], peak_flops: float) -> tuple[EfficiencyCurve, dict]:
    """Fit (overhead, 1/rate, attention weight, F_half, per-sequence cost) to measured action times.

    The model is linear in (overhead, 1/rate, w/rate, F_half/rate, per-sequence), so a bounded
    linear least squares gives the start; scipy's curve_fit then refines it with a robust loss.
    """
    a = np.array(points, dtype=float)
    mm, attn, ops, seqs, y = a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4]
    scale = y.mean()
    weight = 1.0 / np.maximum(y, scale * 1e-3)  # relative residuals
    design = np.stack([np.ones_like(y), mm, attn, ops, seqs], axis=1)
    norm = np.maximum(np.abs(design).max(axis=0), 1e-30)
    lin = lsq_linear(design / norm * weight[:, None], y * weight, bounds=(0, np.inf))
    c0, c1, c2, c3, c4 = lin.x / norm
    c1 = max(c1, 1e-30)

    def f(x, overhead, inv_rate, attn_w, half, per_seq):
        m, at, o, q = x
        return overhead + q * per_seq + inv_rate * (m + attn_w * at + o * half)

    hi = [max(y), np.inf, 50.0, 1e13, max(y)]
    p0 = [min(c0, hi[0]), c1, min(max(c2 / c1, 0.05), 50.0), min(c3 / c1, hi[3]), min(c4, hi[4])]
    try:
        # Relative residuals and a robust loss: on a shared host a few actions are slowed several-fold
        # by other processes, and plain least squares would chase them.
        popt, _ = curve_fit(f, (mm, attn, ops, seqs), y, p0=p0, bounds=([0.0, 0.0, 0.05, 0.0, 0.0], hi),
                            sigma=1.0 / weight, loss=ROBUST_LOSS, f_scale=0.1, x_scale="jac", max_nfev=20000)
    except (RuntimeError, ValueError):
        popt = p0
    overhead, inv_rate, attn_w, half, per_seq = (float(v) for v in popt)
    e_max = 1.0 / (inv_rate * peak_flops) if inv_rate > 0 else 1.0
    curve = EfficiencyCurve(peak_flops, e_max, half, attn_w, overhead, per_seq)
    pred = f((mm, attn, ops, seqs), *popt)
    return curve, {"points": len(y), "r2": _r2(y, pred), "mape": float(np.mean(np.abs(pred - y) / y))}


def _comm_points(runs: list[RunRecord], hardware: str | None) -> list[tuple]:
    """(placement, steps, moved bytes, seconds) per collective instance (fastest participant)."""
    best: dict[tuple, tuple] = {}
    for run in runs:
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        gpn = cluster.gpus_per_node
        engines: dict[int, Engine] = {}
        occ: dict[tuple, int] = defaultdict(int)
        warmup = _warmup_step(run)
        for sp in sorted(run.spans, key=lambda s: (s.rank, s.start)):
            if sp.kind not in ("grad_sync", "send", "recv") or sp.duration <= 0 or sp.step == warmup:
                continue
            plan = plan_for_step(run, sp.step)
            if plan is None or sp.module not in plan.layouts:
                continue
            eng = engines.get(id(plan))
            if eng is None:
                eng = engines[id(plan)] = Engine(plan, model, cluster)
            if sp.kind == "grad_sync":
                lay = plan.layouts[sp.module]
                if sp.rank not in eng.index[sp.module].coords:
                    continue
                group = eng._grad_group(sp.module, sp.rank)
                n = len(group)
                if n < 2:
                    continue
                stage = eng.index[sp.module].coords[sp.rank].get("pp", 0)
                nbytes = SimOptions().grad_reduce_bytes * eng.stage_work(sp.module, stage).params / lay.tp
                steps, moved = (n - 1, (n - 1) / n * nbytes) if lay.fsdp else (2 * (n - 1), 2 * (n - 1) / n * nbytes)
                nodes = len({r // gpn for r in group})
                key = (str(run.path), sp.step, "grad_sync", sp.module, group)
            else:
                try:
                    nbytes = eng._p2p_bytes(sp.module, sp.rank, sp.microbatch)
                except Exception:
                    continue
                steps, moved, nodes = 1, nbytes, 1
                key = (str(run.path), sp.step, "p2p", sp.module, sp.what, sp.microbatch, sp.rank // 1)
            okey = key + (occ[(key, sp.rank)],)
            occ[(key, sp.rank)] += 1
            where = "intra" if nodes == 1 else "inter"
            cur = best.get(okey)
            if cur is None or sp.duration < cur[3]:
                best[okey] = (where, steps, moved, sp.duration)
    return list(best.values())


def _optimizer_points(runs: list[RunRecord], hardware: str | None) -> list[tuple[float, float]]:
    """(parameters on the rank, seconds) per traced optimizer step."""
    out = []
    for run in runs:
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        warmup = _warmup_step(run)
        params: dict[int, float] = {}
        plan = run.plans[0]  # layouts are the same every step (the runtime builds them once)
        eng = Engine(plan, model, cluster)
        for sp in run.spans:
            if sp.kind != "optimizer_step" or sp.step == warmup or sp.duration <= 0:
                continue
            if sp.rank not in params:
                params[sp.rank] = eng._params_on_rank(sp.rank)
            out.append((params[sp.rank], sp.duration))
    return out


def fit_optimizer(points: list[tuple[float, float]]) -> tuple[tuple[float, float], dict]:
    a = np.array(points, dtype=float)
    x, y = a[:, 0], a[:, 1]
    design = np.stack([np.ones_like(x), x], axis=1)
    norm = np.maximum(design.max(axis=0), 1e-30)
    lin = lsq_linear(design / norm, y, bounds=(0, np.inf))
    c = lin.x / norm
    pred = design @ c
    return (float(c[0]), float(c[1])), {"points": len(y), "r2": _r2(y, pred)}


def fit_collectives(points: list[tuple]) -> tuple[dict[str, tuple[float, float]], dict]:
    out, stats = {}, {}
    for where in ("intra", "inter"):
        rows = [(s, m, t) for w, s, m, t in points if w == where]
        if len(rows) < 2:
            continue
        a = np.array(rows, dtype=float)

        def f(x, alpha, inv_beta):
            return alpha * x[0] + inv_beta * x[1]

        popt, _ = curve_fit(f, (a[:, 0], a[:, 1]), a[:, 2], p0=[1e-4, 1e-9], bounds=([0, 0], [1.0, 1.0]),
                            sigma=np.maximum(a[:, 2], 1e-6), loss="soft_l1", f_scale=0.1, max_nfev=20000)
        alpha, inv_beta = float(popt[0]), float(popt[1])
        beta = 1.0 / inv_beta if inv_beta > 0 else 1e15
        out[where] = (alpha, beta)
        pred = f((a[:, 0], a[:, 1]), *popt)
        stats[where] = {"points": len(rows), "r2": _r2(a[:, 2], pred)}
    return out, stats


def calibrate(run_dirs: list[str], hardware: str | None = None) -> Profile:
    if not run_dirs:
        raise CalibrationError("calibrate: give at least one run folder")
    runs = [read_run(d) for d in run_dirs]
    if not any(r.spans for r in runs):
        raise CalibrationError("calibrate: the runs hold no trace spans (trace.json) to fit")
    base = _cluster_of(runs[0], hardware)
    hw = hardware or runs[0].hardware
    prof = Profile(hardware=str(hw))
    # Collectives first (grad syncs and p2p are pure communication), then compute with the
    # communication the engine would add taken out of each span; the FSDP overlap depends on the
    # compute curve, so the compute fit runs twice.
    prof.collectives, stats = fit_collectives(_comm_points(runs, hardware))
    prof.fit.update({f"collectives.{k}": v for k, v in stats.items()})
    for _ in range(2):
        curves, fits = {}, {}
        for kind, pts in sorted(_compute_points(runs, hardware, prof).items()):
            # A module's own curve needs enough distinct sizes to pin its five parameters.
            if len(pts) < 5 or ("." in kind and len({p[:4] for p in pts}) < 8):
                continue
            curves[kind], fits[f"compute.{kind}"] = fit_compute(pts, base.gpu.peak_flops)
        prof.compute = curves
        prof.fit.update(fits)
    if not prof.compute:
        raise CalibrationError("calibrate: fewer than 5 traced forward/backward actions; nothing to fit")
    opt = _optimizer_points(runs, hardware)
    if len(opt) >= 3:
        prof.optimizer, prof.fit["optimizer"] = fit_optimizer(opt)
    prof.provenance = {
        "device": sorted({r.device for r in runs}),
        "torch": sorted({str(r.summary.get("torch", r.config.get("torch_version", "not recorded"))) for r in runs}),
        "dtype": sorted({str(r.summary.get("dtype", "not recorded")) for r in runs}),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "runs": [str(Path(d).resolve()) for d in run_dirs],
    }
    return prof


@dataclass
class Validation:
    run: str
    system: str
    world_size: int
    steps: int  # steps compared (the first, warm-up, step is left out when there are others)
    measured_s: float  # median step time over those steps (robust to a host's load spikes)
    simulated_s: float  # median simulated step time over the same steps
    tokens: float  # mean tokens per step
    note: str = ""

    @property
    def error(self) -> float:
        return (self.simulated_s - self.measured_s) / self.measured_s if self.measured_s > 0 else math.nan


def validate(run_dirs: list[str], profile: Profile | None = None, hardware: str | None = None) -> list[Validation]:
    """Simulate each step's own Plan; compare median step times over the steps whose Plan is known."""
    out = []
    for d in run_dirs:
        run = read_run(d)
        model = _model_of(run)
        cluster = _cluster_of(run, hardware or (profile.hardware if profile else None))
        steps = sorted(run.step_times)
        if len(steps) > 1:
            steps = steps[1:]
        measured, simulated, tokens = [], [], []
        for s in steps:
            plan = plan_for_step(run, s)
            if plan is None:
                continue
            res = simulate(plan, model, cluster, calibration=profile, options=SimOptions(check_memory=False))
            measured.append(run.step_times[s])
            simulated.append(res.step_time)
            tokens.append(res.tokens)
        if not measured:
            # Left out, never guessed: say why and go on with the other runs.
            out.append(Validation(str(d), run.plans[0].system, run.plans[0].world_size, 0, math.nan, math.nan,
                                  0.0, "skipped: no step with both a measured time and a known Plan"
                                  + (f" ({'; '.join(run.notes)})" if run.notes else "")))
            continue
        out.append(Validation(str(d), run.plans[0].system, run.plans[0].world_size, len(measured),
                              float(np.median(measured)), float(np.median(simulated)), float(np.mean(tokens)),
                              "; ".join(run.notes)))
    return out

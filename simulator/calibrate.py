"""Calibration (fit the simulator's cost models to measured run traces) and validation (simulate each
run's own Plan and compare with what was measured).

Compute: per action kind (forward, backward) and per (kind, module), `time = overhead + (F_matmul + w * F_attention +
ops * F_half) / (peak * e_max)` over the traced actions, fitted with scipy's curve_fit (bounded,
non-negative); backward is fitted against the *forward* FLOPs of the same stage and microbatch, so
the factor 2 is in the fit, while a recomputed forward (and a chunked encoder's second forward),
which the engine adds to a backward at the forward curve's rate, is taken out of each measured
backward first: calibration builds its engines with the run's recompute mode and chunk budget, as
validation does (`_options`, `_forward_again`). Optimizer steps: `time = a + b * parameters
on the rank`. Collectives: `time = alpha * steps + moved /
beta` (NCCL-style latency per algorithm step plus bytes over bandwidth) over the traced grad_syncs
and pipeline p2p, each collective instance taken at its fastest participant (the others also wait
for stragglers). A profile is JSON with its provenance (device, torch version, date, run folders, the commit
that fitted it, and per run what its record's provenance lacks). `memory_check` compares a run's
measured peaks with the simulator's memory estimate for the same Plans.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# scipy.optimize is imported by the fitting functions alone: at module level it cost every command that
# reads a profile (simulate, tune) 0.35 s of start-up
from omnibench.plan import BACKWARD, BOUNDARY, FORWARD, GRAD_SYNC, OPTIMIZER_STEP, RECV, SEND, Action
from omnibench.specs.model import MultimodalSpec
from simulator.collectives import CollectiveModel
from simulator.compute import ComputeModel, EfficiencyCurve
from simulator.engine import Engine, SimOptions, SimulationError, simulate
from simulator.hardware import ClusterSpec, load_cluster
from simulator.traces import RunRecord, TraceError, TraceSpan, plan_for_step, read_run

ROBUST_LOSS = "soft_l1"  # see fit_compute


class CalibrationError(ValueError):
    """Not enough measured data to fit, or a bad profile file; the message names what is missing."""


def _resolved_runs(provenance: dict, folder: Path) -> dict:
    """Provenance with its run folders as absolute paths (stored relative to the profile's folder)."""
    if "runs" not in provenance:
        return provenance
    return {**provenance, "runs": [str((folder / r).resolve()) for r in provenance["runs"]]}


@dataclass
class Profile:
    hardware: str
    compute: dict[str, EfficiencyCurve] = field(default_factory=dict)
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)  # placement -> (alpha, beta)
    # (seconds per step, seconds per parameter on the rank[, per FSDP-sharded layer, per plain layer])
    optimizer: tuple[float, ...] | None = None
    provenance: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)  # goodness of fit per model, points used
    # Whether intra-module communication overlaps compute on this hardware (CollectiveModel); the
    # runs' device decides it at calibration: False on CPU, where a rank has one thread.
    inline_overlap: bool = True
    lock_skew: float = 0.0  # ComputeModel.lock_skew

    def compute_model(self, cluster: ClusterSpec) -> ComputeModel:
        return ComputeModel(cluster, dict(self.compute) or None, self.optimizer, self.lock_skew)

    def collective_model(self, cluster: ClusterSpec) -> CollectiveModel:
        return CollectiveModel(cluster, fitted=dict(self.collectives), inline_overlap=self.inline_overlap)

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware,
            "compute": {k: v.to_dict() for k, v in self.compute.items()},
            "collectives": {k: {"alpha_s": a, "beta_Bps": b} for k, (a, b) in self.collectives.items()},
            "inline_overlap": self.inline_overlap,
            "lock_skew": self.lock_skew,
            "optimizer": None if self.optimizer is None else
            {"overhead_s": self.optimizer[0], "seconds_per_param": self.optimizer[1],
             **({"seconds_per_sharded_layer": self.optimizer[2], "seconds_per_plain_layer": self.optimizer[3]}
                if len(self.optimizer) >= 4 else {})},
            "provenance": self.provenance,
            "fit": self.fit,
        }

    def save(self, path: str | Path) -> None:
        from simulator.traces import write_json_atomic

        # Run folders are stored relative to the profile, so a clone at another path (CI, a colleague's
        # checkout) still tells in-sample from held-out runs; `load` resolves them back.
        d = self.to_dict()
        if "runs" in self.provenance:
            folder = Path(path).resolve().parent
            d["provenance"] = {**self.provenance,
                               "runs": [os.path.relpath(r, folder) for r in self.provenance["runs"]]}
        write_json_atomic(Path(path), d)

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
                optimizer=None if not d.get("optimizer") else _optimizer_from(d["optimizer"]),
                inline_overlap=bool(d.get("inline_overlap", True)),
                lock_skew=float(d.get("lock_skew", 0.0)),
                provenance=_resolved_runs(d.get("provenance", {}), p.resolve().parent),
                fit=d.get("fit", {}),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:  # JSONDecodeError is a ValueError
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e).splitlines()[0] if str(e) else ""
            raise CalibrationError(f"calibration: {p} is not a profile from `omnibench calibrate` "
                                   f"({type(e).__name__}: {what})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CalibrationError(f"calibration: cannot read {p} ({e})") from None


def _bad_metrics_line(folder: Path) -> str:
    """Where a run's per-step metrics stop being JSON objects of numbers: `file: line N ...`, or ""."""
    for name in ("steps.jsonl", "metrics.jsonl"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            return f"{path}: cannot read it ({e})"
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError(f"a JSON {type(row).__name__}, not an object")
                for k in ("step_time_s", "step_time", "time_s", "seconds", "step"):
                    if k in row:
                        float(row[k])
            except (ValueError, TypeError) as e:
                return f"{path}: line {n} is not one step's metrics ({str(e).splitlines()[0]})"
        return ""
    return ""


def _read_run(run_dir) -> RunRecord:
    """`read_run`, with a run whose steps.jsonl is not JSON lines of step metrics named as such (file and
    line) instead of the JSON parser's bare "Expecting value: line 1 column 1"."""
    try:
        return read_run(run_dir)
    except TraceError:
        raise
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        where = _bad_metrics_line(Path(run_dir))
        raise CalibrationError(where or f"{run_dir}: cannot read the run record ({type(e).__name__}: {e})") from None


def _optimizer_from(d: dict) -> tuple[float, ...]:
    base = (float(d["overhead_s"]), float(d["seconds_per_param"]))
    if "seconds_per_sharded_layer" in d:
        return (*base, float(d["seconds_per_sharded_layer"]), float(d["seconds_per_plain_layer"]))
    return base


def _model_of(run: RunRecord) -> MultimodalSpec:
    from omnibench.specs.presets import get_model, model_from_dict

    spec = run.config.get("model")
    if isinstance(spec, dict):
        return model_from_dict(spec, f"{run.path}/config.json model")
    return get_model(spec or run.plans[0].model)


def _cluster_of(run: RunRecord, hardware: str | ClusterSpec | None) -> ClusterSpec:
    if isinstance(hardware, ClusterSpec):  # a machine no preset names (a variant under study)
        return hardware.with_gpus(run.plans[0].world_size)
    name = hardware or run.hardware
    if name is None:
        raise CalibrationError(f"{run.path}: device {run.device!r} matches no hardware preset; pass --hardware")
    return load_cluster(str(name), run.plans[0].world_size)


def _options(run: RunRecord, stack: str = "eager") -> SimOptions:
    """How the run ran, as the engine needs it to cost the run's own Plans: its recompute mode and
    encoder chunk budget. Calibration and validation both build their engines from this, so a
    curve is fitted against exactly the work validation later charges it with."""
    return SimOptions(check_memory=False, recompute=run.recompute, stack=stack,
                      encoder_chunk_tokens=run.encoder_chunk_tokens, mixed_precision=run.mixed_precision)


def _forward_again(eng: Engine, work, module: str) -> float:
    """Seconds of forward the engine runs again inside a backward action of `module` (its
    recomputation under the run's policy, a chunked encoder's second forward per chunk), at the
    engine's current compute model. A measured backward span holds them; the engine adds them to
    the fitted backward curve (ComputeModel.action_time, Engine._compute_op), so a backward point
    leaves them out or they would be counted twice."""
    policy = eng.policy.get(module, "none")
    rec = 0.0
    if policy != "none":
        rec = (eng.compute.action_time(work, BACKWARD, policy, module)
               - eng.compute.action_time(work, BACKWARD, "none", module))
    again = eng.compute.action_time(work, FORWARD, "none", module) if work.chunks else 0.0
    return max(0.0, rec) + again


def _warmup_step(run: RunRecord) -> int | None:
    """The first step pays one-time costs (allocations, lazy init): left out of fits when others exist."""
    steps = sorted({sp.step for sp in run.spans})
    return steps[0] if len(steps) > 1 else None


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 1.0


def _has_cpu_times(run: RunRecord) -> bool:
    """Whether the run's compute spans carry the rank thread's CPU time (runtime records since cpu_s)
    and that time is the compute: on a CPU device only (on a GPU the thread launches and waits)."""
    if not run.device.lower().startswith("cpu"):
        return False
    compute = [sp for sp in run.spans if sp.kind in (FORWARD, BACKWARD)]
    return bool(compute) and all(sp.cpu is not None for sp in compute) and any(sp.cpu for sp in compute)


def _compute_points(runs: list[RunRecord], hardware: str | None, profile: Profile) -> dict[str, list[tuple]]:
    """(matmul FLOPs, attention FLOPs, ops, sequences, input elements, inline collective calls, seconds
    of compute) per traced forward/backward.

    Spans with the rank thread's CPU time (`cpu_s`, written by the runtime on CPU) give the
    action's compute directly: CPU time leaves out the waits for peers (FSDP/EP lock-step, inline
    collectives) and the time the host's other load took the core, and the engine itself makes
    lock-stepped peers wait for the slowest, so every rank's own figure is a point.

    Otherwise (GPU records, older records) the wall duration is used: what the engine would add
    for the action's intra-module communication under `profile` is subtracted (without overlap,
    also the reduce-scatter the last backward of an FSDP module runs inline), and lock-stepped
    actions are matched across their lock group (same step, kind, module, stage, occurrence) and
    counted once: the duration of the last peer to start (it waited for nobody), against the
    largest FLOPs of the group, which is how the engine costs a locked action.
    """
    pts: dict[str, list[tuple]] = defaultdict(list)
    for run in runs:
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        engines: dict[int, Engine] = {}
        warmup = _warmup_step(run)
        use_cpu = _has_cpu_times(run)
        groups: dict[tuple, list] = defaultdict(list)
        seen: dict[tuple, int] = defaultdict(int)
        for sp in sorted(run.spans, key=lambda x: (x.rank, x.start)):
            if sp.kind not in (FORWARD, BACKWARD) or sp.duration <= 0 or sp.step == warmup:
                continue
            plan = plan_for_step(run, sp.step)
            if plan is None or sp.module not in plan.layouts:
                continue
            eng = engines.get(id(plan))
            if eng is None:
                eng = engines[id(plan)] = Engine(plan, model, cluster, profile.compute_model(cluster),
                                                 profile.collective_model(cluster), _options(run))
            try:
                sig = eng._signature(sp.module, sp.rank, sp.microbatch)
                sp_group = len(eng._long_group(sp.module, sp.rank, sp.microbatch))
            except (SimulationError, KeyError, IndexError):  # a span the plan does not hold
                continue
            stage = 0
            if sp.module == "llm" and sp.rank in eng.index["llm"].coords:
                stage = eng.index["llm"].coords[sp.rank]["pp"]
            w = eng.work(sp.module, stage, sig, sp_group)
            action = Action(sp.kind, sp.module, sp.microbatch, stage)
            inputs = eng.input_elements(sp.module, sp.rank, action)
            op = eng._compute_op(sp.rank, action, _Identity())
            again = _forward_again(eng, w, sp.module) if sp.kind == BACKWARD else 0.0
            if use_cpu:
                if w.flops > 0 and sp.cpu and sp.cpu - again > 0:
                    row = (w.matmul_flops, w.attention_flops, w.ops, w.sequences, inputs, op.calls, sp.cpu - again)
                    pts[sp.kind].append(row)
                    pts[f"{sp.kind}.{sp.module}"].append(row)
                continue
            not_fitted = op.exposed + again  # what the engine charges beside this curve
            lay = plan.layouts[sp.module]
            if (not profile.inline_overlap and sp.kind == BACKWARD and lay.fsdp
                    and eng._reduces_in(sp.rank, sp.module, sp.microbatch)):
                not_fitted += eng.grad_sync_cost(sp.module, sp.rank, stage)
            lock = eng._lock_group(sp.module, sp.rank)
            base = (sp.step, sp.kind, sp.module, stage, lock if lock is not None else (sp.rank,))
            n = seen[(base, sp.rank)]
            seen[(base, sp.rank)] += 1
            groups[(*base, n)].append((sp.start, sp.duration - not_fitted, w, inputs, op.calls))
        for key, members in groups.items():
            kind, module = key[1], key[2]
            last = max(members, key=lambda m: m[0])
            w, inputs, calls = max(((m[2], m[3], m[4]) for m in members), key=lambda x: x[0].flops)
            if last[1] <= 0 or w.flops <= 0:
                continue  # all communication (an empty microbatch's dummy forward): nothing to fit
            row = (w.matmul_flops, w.attention_flops, w.ops, w.sequences, inputs, calls, last[1])
            pts[kind].append(row)
            pts[f"{kind}.{module}"].append(row)
    return pts


class _Identity(dict):
    """Every rank its own class (calibration looks at real ranks, not collapsed ones)."""

    def __missing__(self, key):
        return key


def fit_compute(points: list[tuple], peak_flops: float, robust: bool = True) -> tuple[EfficiencyCurve, dict]:
    """Fit (overhead, 1/rate, attention weight, F_half, per-sequence, per-input-element and per-
    inline-call costs) to measured action times; a point is (matmul FLOPs, attention FLOPs, ops,
    sequences[, input elements[, inline collective calls]], seconds).

    The model is linear in (overhead, 1/rate, w/rate, F_half/rate, per-sequence, per-input, per-
    call), so a bounded linear least squares gives the start; scipy's curve_fit then refines it
    with a robust loss. A regressor that is zero on every point gets a zero coefficient.
    """
    from scipy.optimize import curve_fit, lsq_linear

    a = np.array(points, dtype=float)
    x_cols = a[:, :-1]
    x_cols = np.column_stack([x_cols, np.zeros((len(a), 6 - x_cols.shape[1]))]) if x_cols.shape[1] < 6 else x_cols
    mm, attn, ops, seqs, inputs, calls = (x_cols[:, i] for i in range(6))
    y = a[:, -1]
    scale = y.mean()
    # Robust: relative residuals (a loaded host's slow outliers weigh little). Otherwise seconds, so
    # that the fit is right where a step's sum of actions needs it: on the large ones.
    weight = 1.0 / np.maximum(y, scale * 1e-3) if robust else np.full_like(y, 1.0 / scale)
    design = np.stack([np.ones_like(y), mm, attn, ops, seqs, inputs, calls], axis=1)
    absent = np.abs(design).max(axis=0) == 0  # e.g. no input elements in backward: coefficient 0
    norm = np.where(absent, 1.0, np.abs(design).max(axis=0))
    lin = lsq_linear(design / norm * weight[:, None], y * weight, bounds=(0, np.inf))
    c0, c1, c2, c3, c4, c5, c6 = np.where(absent, 0.0, lin.x / norm)
    c1 = max(c1, 1e-30)

    def f(x, overhead, inv_rate, attn_w, half, per_seq, per_input, per_call):
        m, at, o, q, i, k = x
        return overhead + q * per_seq + i * per_input + k * per_call + inv_rate * (m + attn_w * at + o * half)

    hi = [max(y), np.inf, 50.0, 1e13, max(y), 1e-300 if absent[5] else np.inf, 1e-300 if absent[6] else max(y)]
    p0 = [min(c0, hi[0]), c1, min(max(c2 / c1, 0.05), 50.0), min(c3 / c1, hi[3]), min(c4, hi[4]), c5,
          min(c6, hi[6])]
    x = (mm, attn, ops, seqs, inputs, calls)
    try:
        # Relative residuals and a robust loss: on a shared host a few actions are slowed several-fold
        # by other processes, and plain least squares would chase them.
        popt, _ = curve_fit(f, x, y, p0=p0, bounds=([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0], hi),
                            sigma=1.0 / weight, loss=ROBUST_LOSS if robust else "linear", f_scale=0.1,
                            x_scale="jac", max_nfev=20000)
    except (RuntimeError, ValueError):
        popt = p0
    overhead, inv_rate, attn_w, half, per_seq, per_input, per_call = (float(v) for v in popt)
    per_input = 0.0 if absent[5] else per_input
    per_call = 0.0 if absent[6] else per_call
    e_max = 1.0 / (inv_rate * peak_flops) if inv_rate > 0 else 1.0
    curve = EfficiencyCurve(peak_flops, e_max, half, attn_w, overhead, per_seq, per_input, per_call)
    pred = f(x, overhead, inv_rate, attn_w, half, per_seq, per_input, per_call)
    return curve, {"points": len(y), "r2": _r2(y, pred), "mape": float(np.mean(np.abs(pred - y) / y))}


_UNIT_ALPHA = (1.0, 1e30)  # probe links: cost = latency steps
_UNIT_BETA = (0.0, 1.0)  # cost = bytes the engine moves (after its size-dependent efficiency)


def _probes(cluster: ClusterSpec, inline_overlap: bool) -> tuple[CollectiveModel, CollectiveModel]:
    """Two collective models whose costs are the engine's own regressors of alpha and 1/beta: the
    engine's cost is linear in them (alpha * steps + moved / beta), so a fit to measured times over
    these two numbers is a fit of exactly the formula the simulator evaluates."""
    return tuple(CollectiveModel(cluster, fitted={"intra": u, "inter": u}, inline_overlap=inline_overlap)
                 for u in (_UNIT_ALPHA, _UNIT_BETA))


def _named_actions(plan, rank: int) -> dict[str, list[Action]]:
    out: dict[str, list[Action]] = defaultdict(list)
    for a in plan.actions.get(rank, []):
        out[str(a)].append(a)
    return out


def _message_key(a: Action, rank: int) -> tuple:
    """(module, kind, what, src, dst, src mb, dst mb) of a pipeline or boundary message, the same
    from the sending and the receiving side."""
    if a.kind in (SEND, RECV):
        src, dst = (rank, a.peer) if a.kind == SEND else (a.peer, rank)
        return (a.module, "p2p", a.what, src, dst, a.microbatch, a.microbatch)
    if a.direction == "send":
        return (a.module, BOUNDARY, a.what, rank, a.peer, a.microbatch, a.peer_microbatch)
    return (a.module, BOUNDARY, a.what, a.peer, rank, a.peer_microbatch, a.microbatch)


def _comm_points(runs: list[RunRecord], hardware: str | None, inline_overlap: bool = True) -> list[tuple]:
    """(placement, latency steps, moved bytes, seconds, source) per instance of pure communication.

    - A pipeline or boundary message: the send and the recv span are matched through the plan
      (span names are the actions' names); the transfer is the recv's end minus the later of the
      two starts (before that one side had not arrived). Records without recv spans (simulated
      traces) give the transfer as the send span itself.
    - A data-parallel gradient all-reduce without FSDP (grad_sync), at the participant that
      arrived last. FSDP grad_syncs are left out: the runtime reduce-scatters inside the last
      backward, so their spans hold no communication.
    Regressors come from costing the same operation with unit links (`_probes`).
    """
    out: list[tuple] = []
    for run in runs:
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        gpn = cluster.gpus_per_node
        p_alpha, p_beta = _probes(cluster, inline_overlap)
        warmup = _warmup_step(run)
        has_recv = any(sp.kind == RECV or (sp.kind == BOUNDARY and ", recv" in sp.name) for sp in run.spans)
        by_step: dict[int, list[TraceSpan]] = defaultdict(list)
        for sp in run.spans:
            if sp.step != warmup and sp.duration >= 0:
                by_step[sp.step].append(sp)
        for step, spans in sorted(by_step.items()):
            plan = plan_for_step(run, step)
            if plan is None:
                continue
            eng = Engine(plan, model, cluster, options=_options(run))
            eng_a = Engine(plan, model, cluster, collectives=p_alpha, options=_options(run))
            eng_b = Engine(plan, model, cluster, collectives=p_beta, options=_options(run))
            names = {r: _named_actions(plan, r) for r in plan.actions}
            taken: dict[tuple, int] = defaultdict(int)
            sends: dict[tuple, list] = defaultdict(list)
            recvs: dict[tuple, list] = defaultdict(list)
            syncs: dict[tuple, list] = defaultdict(list)
            for sp in sorted(spans, key=lambda s: (s.rank, s.start)):
                if sp.kind not in (SEND, RECV, BOUNDARY, GRAD_SYNC):
                    continue
                k = (sp.rank, sp.name)
                cands = names.get(sp.rank, {}).get(sp.name, [])
                if taken[k] >= len(cands):
                    continue
                a = cands[taken[k]]
                taken[k] += 1
                if a.kind == GRAD_SYNC:
                    lay = plan.layouts.get(a.module)
                    if lay is None or lay.fsdp or sp.rank not in eng.index[a.module].coords:
                        continue
                    group = eng._grad_group(a.module, sp.rank)
                    if len(group) > 1:
                        syncs[(a.module, group)].append((sp, a))
                    continue
                key = _message_key(a, sp.rank)
                sending = a.kind == SEND or (a.kind == BOUNDARY and a.direction == "send")
                (sends if sending else recvs)[key].append((sp, a))
            for key, items in sends.items():
                module, src, dst = key[0], key[3], key[4]
                where = "intra" if src // gpn == dst // gpn else "inter"
                for i, (sp, a) in enumerate(items):
                    if key[1] == "p2p":
                        nbytes = eng._p2p_bytes(module, src, a.microbatch)
                    else:
                        nbytes = eng._boundary_tokens(src, a) * model.llm.hidden * 2
                    if nbytes <= 0:
                        continue
                    if has_recv:
                        if i >= len(recvs.get(key, [])):
                            continue
                        rsp = recvs[key][i][0]
                        seconds = rsp.start + rsp.duration - max(sp.start, rsp.start)
                    else:
                        seconds = sp.duration
                    if seconds > 0:
                        out.append((where, p_alpha.send_recv(nbytes, src, dst), p_beta.send_recv(nbytes, src, dst),
                                    seconds, "p2p"))
            for (module, group), items in syncs.items():
                if len({sp.rank for sp, _ in items}) < len(group):
                    continue  # a participant's span is missing: the instance cannot be timed
                by_rank: dict[int, list] = defaultdict(list)
                for sp, _ in items:
                    by_rank[sp.rank].append(sp)
                for n in range(min(len(v) for v in by_rank.values())):
                    last = max((v[n] for v in by_rank.values()), key=lambda s: s.start)
                    stage = eng.index[module].coords[last.rank].get("pp", 0)
                    s_a = eng_a.grad_sync_cost(module, last.rank, stage)
                    s_b = eng_b.grad_sync_cost(module, last.rank, stage)
                    nodes = len({r // gpn for r in group})
                    if last.duration > 0 and (s_a or s_b):
                        out.append(("intra" if nodes == 1 else "inter", s_a, s_b, last.duration, "grad_sync"))
    return out


def _inline_points(runs: list[RunRecord], hardware: str | None, inline_overlap: bool) -> list[tuple]:
    """(placement, latency steps, moved bytes, seconds, "inline") per lock-stepped (FSDP / EP)
    compute instance of runs whose spans carry CPU time: the action's wall time on the peer that
    started last, beyond the largest CPU time in its lock group (the compute the engine makes the
    group wait for), is the communication the module ran inside it: gathers, reduce-scatters, hand-
    offs to the communication thread, the peers' layer-by-layer skew. Regressors: the engine's own
    exposed communication of that action under unit links (`_probes`), with, without overlap, the
    reduce-scatter an FSDP module runs inside its last backward."""
    out: list[tuple] = []
    for run in runs:
        if not _has_cpu_times(run):
            continue
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        gpn = cluster.gpus_per_node
        p_alpha, p_beta = _probes(cluster, inline_overlap)
        warmup = _warmup_step(run)
        engines: dict[int, tuple] = {}
        groups: dict[tuple, list] = defaultdict(list)
        seen: dict[tuple, int] = defaultdict(int)
        for sp in sorted(run.spans, key=lambda x: (x.rank, x.start)):
            if sp.kind not in (FORWARD, BACKWARD) or sp.step == warmup or sp.cpu is None:
                continue
            plan = plan_for_step(run, sp.step)
            if plan is None or sp.module not in plan.layouts:
                continue
            if id(plan) not in engines:
                engines[id(plan)] = (plan, Engine(plan, model, cluster, collectives=p_alpha, options=_options(run)),
                                     Engine(plan, model, cluster, collectives=p_beta, options=_options(run)))
            eng = engines[id(plan)][1]
            if sp.rank not in eng.index[sp.module].coords:
                continue
            lock = eng._lock_group(sp.module, sp.rank)
            if lock is None:
                continue
            stage = eng.index["llm"].coords[sp.rank]["pp"] if sp.module == "llm" else 0
            base = (sp.step, sp.kind, sp.module, stage, lock)
            n = seen[(base, sp.rank)]
            seen[(base, sp.rank)] += 1
            groups[(*base, n)].append(sp)
        for (step, kind, module, stage, lock, _), members in groups.items():
            if len({m.rank for m in members}) < len(lock):
                continue  # a peer's span is missing: the wait cannot be told apart
            plan, eng_a, eng_b = engines[id(plan_for_step(run, step))]
            last = max(members, key=lambda m: m.start)
            gap = last.duration - max(m.cpu for m in members)
            a = Action(kind, module, last.microbatch, stage)
            steps = eng_a._compute_op(last.rank, a, _Identity()).exposed
            moved = eng_b._compute_op(last.rank, a, _Identity()).exposed
            if (not inline_overlap and kind == BACKWARD and plan.layouts[module].fsdp
                    and eng_a._reduces_in(last.rank, module, last.microbatch)):
                steps += eng_a.grad_sync_cost(module, last.rank, stage)
                moved += eng_b.grad_sync_cost(module, last.rank, stage)
            if gap > 0 and steps > 0:
                where = "intra" if len({r // gpn for r in lock}) == 1 else "inter"
                out.append((where, steps, moved, gap, "inline", max(m.cpu for m in members)))
    return out


def _optimizer_points(runs: list[RunRecord], hardware: str | None) -> list[tuple]:
    """(parameters on the rank, FSDP-sharded layers, plain layers, seconds) per traced optimizer
    step (its CPU time when recorded: an optimizer step waits for nobody)."""
    out = []
    for run in runs:
        model = _model_of(run)
        cluster = _cluster_of(run, hardware)
        warmup = _warmup_step(run)
        held: dict[int, tuple] = {}
        plan = run.plans[0]  # layouts are the same every step (the runtime builds them once)
        eng = Engine(plan, model, cluster, options=_options(run))
        use_cpu = _has_cpu_times(run)
        for sp in run.spans:
            if sp.kind != OPTIMIZER_STEP or sp.step == warmup or sp.duration <= 0:
                continue
            if sp.rank not in held:
                held[sp.rank] = (eng._params_on_rank(sp.rank), *eng.layers_on_rank(sp.rank))
            seconds = sp.cpu if use_cpu and sp.cpu else sp.duration
            out.append((*held[sp.rank], seconds))
    return out


OPTIMIZER_TERMS = ("overhead", "per parameter", "per sharded layer", "per plain layer")


def _identifiable(design: np.ndarray) -> np.ndarray:
    """Columns the data pin down: each one, in order, must add to the rank of those kept before it (a
    column that is zero everywhere, or a multiple of earlier ones, e.g. sharded layers when no run
    had FSDP, is not)."""
    norm = np.maximum(np.abs(design).max(axis=0), 1e-300)
    keep = np.zeros(design.shape[1], dtype=bool)
    for j in range(design.shape[1]):
        trial = keep.copy()
        trial[j] = True
        if np.linalg.matrix_rank(design[:, trial] / norm[trial]) == trial.sum():
            keep = trial
    return keep


def fit_optimizer(points: list[tuple]) -> tuple[tuple[float, ...], dict]:
    """time = a + b * params + c * sharded layers + d * plain layers (non-negative, robust). A term no
    data constrains is fixed at 0 and named in the stats' "fixed_at_zero" (fitting it would give any
    value at all, e.g. 1e32 ms per sharded layer from runs without FSDP)."""
    from scipy.optimize import least_squares, lsq_linear

    a = np.array(points, dtype=float)
    y = a[:, -1]
    design = np.column_stack([np.ones_like(y), a[:, :-1]])
    keep = _identifiable(design)
    d = design[:, keep]
    norm = np.abs(d).max(axis=0)
    x = d / norm
    lin = lsq_linear(x, y, bounds=(0, np.inf))
    res = least_squares(lambda c: (x @ c - y) / np.maximum(y, 1e-6), lin.x, bounds=(0, np.inf),
                        loss=ROBUST_LOSS, f_scale=0.1)
    c = np.zeros(design.shape[1])
    c[keep] = res.x / norm
    pred = design @ c
    stats = {"points": len(y), "r2": _r2(y, pred), "mape": float(np.mean(np.abs(pred - y) / y))}
    fixed = [OPTIMIZER_TERMS[j] for j in range(design.shape[1]) if not keep[j]]
    if fixed:
        stats["fixed_at_zero"] = fixed
    return tuple(float(v) for v in c), stats


WEAK_R2 = 0.5  # a fitted curve explaining less of its points' variance than this is flagged
WEAK_MAPE = 0.25  # ... or one whose mean |error| over its points is above this


def _on_gpu(prof: Profile) -> bool:
    return any(str(d).startswith("cuda") for d in prof.provenance.get("device", []))


def fit_warnings(prof: Profile) -> list[str]:
    """One line per fit a user should not trust as it stands: a curve that explains little (R^2 below
    WEAK_R2 or mean |error| above WEAK_MAPE), an action kind that could not be fitted (its costs stay
    the datasheet's), a GPU curve faster than the GPU's peak, a term fixed at 0 because no run
    constrains it, and runs whose records do not say where they came from."""
    out = []
    lacking = [x for x in prof.provenance.get("runs_provenance", []) if x != "complete"]
    if lacking:
        fields = list(dict.fromkeys(f for x in lacking for f in x.split(", ")))  # in the order records list them
        out.append(f"provenance: {len(lacking)} of {len(prof.provenance['runs_provenance'])} runs do not record "
                   f"{', '.join(fields)}: the profile is only as verifiable as they are")
    for name, st in sorted(prof.fit.items()):
        if "not_fitted" in st:
            out.append(f"{name}: not fitted ({st['not_fitted']})")
            continue
        r2, mape = st.get("r2"), st.get("mape")
        weak = []
        # A low R^2 alone is no fault where the points barely vary and the error is small.
        if r2 is not None and r2 < WEAK_R2 and (mape is None or mape > WEAK_MAPE / 2):
            weak.append(f"R2 {r2:.2f} < {WEAK_R2}")
        if mape is not None and mape > WEAK_MAPE:
            weak.append(f"mean |error| {mape:.0%} > {WEAK_MAPE:.0%}")
        if weak:
            out.append(f"{name}: the fit explains little ({', '.join(weak)} over {st.get('points', '?')} points); "
                       "more runs with varied sizes would pin it")
        curve = prof.compute.get(name.removeprefix("compute."))
        if curve is not None and curve.e_max > 1.0 and _on_gpu(prof):
            out.append(f"{name}: fitted efficiency {curve.e_max:.2f} of the GPU's peak, which no kernel reaches: the "
                       "curve absorbs time the simulator charges elsewhere (e.g. a recomputed forward at the forward "
                       "curve's rate); trust the step times validation checks, not this curve's per-action times")
        if st.get("fixed_at_zero"):
            out.append(f"{name}: {', '.join(st['fixed_at_zero'])} fixed at 0: the runs do not vary "
                       f"{'it' if len(st['fixed_at_zero']) == 1 else 'them'} independently (e.g. one model "
                       "size only, or no run with FSDP)")
    return out


def fit_collectives(points: list[tuple], mean: bool = False) -> tuple[dict[str, tuple[float, float]], dict]:
    """alpha (seconds per latency step) and beta (bytes/s) per placement: time = alpha * steps +
    moved / beta, over relative residuals with a robust loss (a loaded host delays a few messages
    by whole scheduler slices); `mean`: plain least squares on seconds instead, for costs that
    enter every step many times over, so that their mean, not their typical value, is what counts."""
    from scipy.optimize import least_squares, lsq_linear

    out, stats = {}, {}
    for where in ("intra", "inter"):
        rows = [p for p in points if p[0] == where]
        if len(rows) < 2:
            continue
        a = np.array([(s, m, t) for _, s, m, t, *_ in rows], dtype=float)
        design, y = a[:, :2], a[:, 2]
        norm = np.maximum(np.abs(design).max(axis=0), 1e-30)
        x = design / norm
        if mean:
            coef = lsq_linear(x, y, bounds=(0, np.inf)).x
        else:
            lin = lsq_linear(x / y[:, None], np.ones_like(y), bounds=(0, np.inf))
            coef = least_squares(lambda c, x=x, y=y: (x @ c - y) / y, lin.x, bounds=(0, np.inf), loss=ROBUST_LOSS,
                                 f_scale=0.1).x
        alpha, inv_beta = (float(v) for v in coef / norm)
        out[where] = (alpha, 1.0 / inv_beta if inv_beta > 0 else 1e15)
        pred = design @ (coef / norm)
        sources = defaultdict(int)
        for p in rows:
            sources[p[4] if len(p) > 4 else "?"] += 1
        stats[where] = {"points": len(rows), "r2": _r2(y, pred), "mape": float(np.mean(np.abs(pred - y) / y)),
                        "sources": dict(sources)}
    return out, stats


def fit_inline(points: list[tuple]) -> tuple[dict[str, tuple[float, float]], float, dict]:
    """Inline communication of lock-stepped actions: gap = alpha * steps + moved / beta + skew *
    compute (the last term: peers waiting for each other layer by layer, in proportion to the
    work). Plain least squares on seconds: these waits enter every step many times over, so their
    mean is what a step time needs. Returns ({placement: (alpha, beta)}, skew, stats)."""
    from scipy.optimize import lsq_linear

    rows = [p for p in points if len(p) > 5]
    if len(rows) < 3:
        return {}, 0.0, {}
    out, stats = {}, {}
    a = np.array([(1.0 if p[0] == "intra" else 0.0, p[1], p[2], p[5], p[3]) for p in rows], dtype=float)
    intra = a[:, 0] == 1.0
    # one skew for all placements; alpha and 1/beta per placement
    cols = [a[:, 3]]
    names = []
    for where, mask in (("intra", intra), ("inter", ~intra)):
        if mask.any():
            cols += [a[:, 1] * mask, a[:, 2] * mask]
            names.append(where)
    design, y = np.column_stack(cols), a[:, 4]
    norm = np.maximum(np.abs(design).max(axis=0), 1e-30)
    coef = lsq_linear(design / norm, y, bounds=(0, np.inf)).x / norm
    pred = design @ coef
    skew = float(coef[0])
    for i, where in enumerate(names):
        alpha, inv_beta = float(coef[1 + 2 * i]), float(coef[2 + 2 * i])
        out[where] = (alpha, 1.0 / inv_beta if inv_beta > 0 else 1e15)
        m = intra if where == "intra" else ~intra
        stats[where] = {"points": int(m.sum()), "r2": _r2(y[m], pred[m]),
                        "mean_error_s": float(np.mean(pred[m] - y[m])), "lock_skew": skew}
    return out, skew, stats


def calibrate(run_dirs: list[str], hardware: str | None = None) -> Profile:
    if not run_dirs:
        raise CalibrationError("calibrate: give at least one run folder")
    runs = [_read_run(d) for d in run_dirs]
    if not any(r.spans for r in runs):
        raise CalibrationError("calibrate: the runs hold no trace spans (trace.json) to fit")
    base = _cluster_of(runs[0], hardware)
    hw = hardware or runs[0].hardware
    prof = Profile(hardware=str(hw))
    # A CPU rank runs one thread: its collectives block it (no overlap with compute).
    prof.inline_overlap = not all(r.device.lower().startswith("cpu") for r in runs)
    # Collectives first (p2p messages and plain all-reduces are pure communication), then compute
    # with the communication the engine would add taken out of each span where the span has no CPU
    # time; the FSDP overlap depends on the compute curve, so the compute fit runs twice.
    prof.collectives, stats = fit_collectives(_comm_points(runs, hardware, prof.inline_overlap))
    prof.fit.update({f"collectives.{k}": v for k, v in stats.items()})
    inline, skew, stats = fit_inline(_inline_points(runs, hardware, prof.inline_overlap))
    prof.collectives.update({f"{k}.inline": v for k, v in inline.items()})
    prof.lock_skew = skew
    prof.fit.update({f"collectives.{k}.inline": v for k, v in stats.items()})
    # CPU times hold no waits and no other work's time slices: plain least squares (the mean, which
    # sums of actions need); wall times keep the robust loss.
    from_cpu = all(_has_cpu_times(r) for r in runs)
    for _ in range(2):
        curves, fits = {}, {}
        for kind, pts in sorted(_compute_points(runs, hardware, prof).items()):
            # A module's own curve needs enough distinct sizes to pin its five parameters.
            if len(pts) < 7 or ("." in kind and len({p[:-1] for p in pts}) < 8):
                why = (f"{len(pts)} traced actions, fewer than 7" if len(pts) < 7
                       else f"{len({p[:-1] for p in pts})} distinct sizes, fewer than 8")
                if "." in kind:  # a module's own curve: the action kind's shared curve covers it
                    why += f"; the shared compute.{kind.split('.')[0]} curve covers it"
                else:
                    why += "; the simulator keeps the datasheet roofline for it"
                fits[f"compute.{kind}"] = {"points": len(pts), "not_fitted": why}
                continue
            curves[kind], fits[f"compute.{kind}"] = fit_compute(pts, base.gpu.peak_flops, robust=not from_cpu)
        prof.compute = curves
        prof.fit.update(fits)
    if not prof.compute:
        raise CalibrationError("calibrate: fewer than 5 traced forward/backward actions; nothing to fit")
    opt = _optimizer_points(runs, hardware)
    if len(opt) >= 3:
        prof.optimizer, prof.fit["optimizer"] = fit_optimizer(opt)
    else:
        prof.fit["optimizer"] = {"points": len(opt), "not_fitted": f"{len(opt)} traced optimizer steps, fewer than 3"}
    from omnibench.provenance import GPU_FIELDS, git_state, missing, record_provenance

    gpu = not all(r.device.lower().startswith("cpu") for r in runs)
    prof.provenance = {
        "code": git_state(),  # the checkout that fitted (the runs' own code is in "runs_provenance")
        # per run, in the order of "runs": what its record's provenance lacks of what a GPU record
        # needs (on CPU: commit and command only); "complete" where nothing is missing
        "runs_provenance": [", ".join(missing(record_provenance(d), GPU_FIELDS if gpu else ("commit", "command")))
                            or "complete" for d in run_dirs],
        "device": sorted({r.device for r in runs}),
        "torch": sorted({str(r.summary.get("torch", r.config.get("torch_version", "not recorded"))) for r in runs}),
        "dtype": sorted({str(r.summary.get("dtype", "not recorded")) for r in runs}),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "runs": [str(Path(d).resolve()) for d in run_dirs],
        "compute_from": "thread CPU time of each action" if from_cpu
        else "wall time of each action, intra-module communication taken out",
        "inline_overlap": prof.inline_overlap,
        "threads_per_rank": sorted({str(r.summary.get("threads_per_rank", "not recorded")) for r in runs}),
        # how much of the cores the runs had (validate's "host cpu/wall"; about 1 = quiet host)
        "host_cpu_share": _mean_share(runs),
        "bytes": "as the engine counts them (bf16 activations and parameters, fp32 gradients); an fp32 run "
                 "moves twice the activation bytes, which the fitted beta absorbs",
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
    # CPU time over wall time of the compared steps' actions that wait for nobody (optimizer steps,
    # compute of modules without lock-step peers): about 1 on a quiet host, lower where other work
    # took the cores (then measured times are the host's, not the run's). None without CPU times.
    cpu_share: float | None = None
    compute_model: str = ""  # which compute model answered (SimResult.compute_model)

    @property
    def error(self) -> float:
        return (self.simulated_s - self.measured_s) / self.measured_s if self.measured_s > 0 else math.nan


def validate(run_dirs: list[str], profile: Profile | None = None, hardware: str | ClusterSpec | None = None,
             stack: str = "eager") -> list[Validation]:
    """Simulate each step's own Plan; compare median step times over the steps whose Plan is known.
    `stack`: the software the kernel model assumes (SimOptions.stack; "eager" = this project's runtime)."""
    out = []
    for d in run_dirs:
        run = _read_run(d)
        model = _model_of(run)
        cluster = _cluster_of(run, hardware or (profile.hardware if profile else None))
        steps = sorted(run.step_times)
        if len(steps) > 1:
            steps = steps[1:]
        options = _options(run, stack)
        measured, simulated, tokens = [], [], []
        answered = ""
        for s in steps:
            plan = plan_for_step(run, s)
            if plan is None:
                continue
            res = simulate(plan, model, cluster, calibration=profile, options=options)
            measured.append(run.step_times[s])
            simulated.append(res.step_time)
            tokens.append(res.tokens)
            answered = res.compute_model
        if not measured:
            # Left out, never guessed: say why and go on with the other runs.
            out.append(Validation(str(d), run.plans[0].system, run.plans[0].world_size, 0, math.nan, math.nan,
                                  0.0, "skipped: no step with both a measured time and a known Plan"
                                  + (f" ({'; '.join(run.notes)})" if run.notes else "")))
            continue
        out.append(Validation(str(d), run.plans[0].system, run.plans[0].world_size, len(measured),
                              float(np.median(measured)), float(np.median(simulated)), float(np.mean(tokens)),
                              "; ".join(run.notes), _cpu_share(run, steps), answered))
    return out


def _mean_share(runs: list[RunRecord]) -> float | None:
    shares = [_cpu_share(r, sorted(r.step_times)[1:]) for r in runs]
    shares = [x for x in shares if x is not None]
    return round(float(np.mean(shares)), 3) if shares else None


def _cpu_share(run: RunRecord, steps: list[int]) -> float | None:
    if not _has_cpu_times(run):
        return None
    plan = run.plans[0]
    locked = {m for m, lay in plan.layouts.items() if len(lay.ranks) > 1 and (lay.fsdp or lay.ep > 1)}
    wall = cpu = 0.0
    for sp in run.spans:
        if sp.step in steps and sp.cpu is not None and (
                sp.kind == OPTIMIZER_STEP or (sp.kind in (FORWARD, BACKWARD) and sp.module not in locked)):
            wall += sp.duration
            cpu += sp.cpu
    return cpu / wall if wall > 0 else None


@dataclass
class ActionRow:
    """One (kind, module) of a run: seconds per step summed over ranks, measured vs simulated."""

    kind: str
    module: str
    measured_s: float  # wall time of the spans (holds waits for peers, for messages, for the host)
    measured_cpu_s: float | None  # CPU time of the rank threads in those spans, when recorded
    simulated_s: float  # compute stream: the action's cost incl. exposed inline communication;
    # send / boundary / grad_sync: the transfer on the p2p / collective stream; recv: not a span


def action_breakdown(run_dir: str, profile: Profile | None = None, hardware: str | None = None) -> list[ActionRow]:
    """Where measured and simulated time go, action kind by action kind (steps after the first)."""
    run = _read_run(run_dir)
    model = _model_of(run)
    cluster = _cluster_of(run, hardware or (profile.hardware if profile else None))
    steps = sorted(run.step_times)[1:] or sorted(run.step_times)
    wall: dict[tuple, float] = defaultdict(float)
    cpu: dict[tuple, float] = defaultdict(float)
    sim: dict[tuple, float] = defaultdict(float)
    done = 0
    for s in steps:
        plan = plan_for_step(run, s)
        if plan is None:
            continue
        done += 1
        for sp in run.spans:
            if sp.step == s:
                wall[(sp.kind, sp.module)] += sp.duration
                cpu[(sp.kind, sp.module)] += sp.cpu or 0.0
        res = simulate(plan, model, cluster, calibration=profile, options=_options(run))
        members = {r.rank: r.members for r in res.ranks}
        for sp in res.spans:
            kind = sp.action.kind if sp.stream != "compute" else sp.kind
            sim[(kind, sp.module)] += sp.duration * members.get(sp.rank, 1)
    if not done:
        raise CalibrationError(f"{run_dir}: no step with a known Plan to break down")
    has_cpu = _has_cpu_times(run)
    return [ActionRow(k[0], k[1], wall.get(k, 0.0) / done, cpu.get(k, 0.0) / done if has_cpu else None,
                      sim.get(k, 0.0) / done) for k in sorted(set(wall) | set(sim))]


@dataclass
class MemoryCheck:
    """One run's measured peak memory against the simulator's estimate for the same Plans."""

    run: str
    steps: int  # steps compared
    measured_bytes: float  # the largest per-step peak the run recorded (max allocated, reset per step)
    estimated_bytes: float  # the simulator's peak for the same steps' Plans (most loaded rank)

    @property
    def ratio(self) -> float:
        return self.estimated_bytes / self.measured_bytes if self.measured_bytes > 0 else math.nan


def memory_check(run_dir: str, hardware: str | ClusterSpec | None = None) -> MemoryCheck:
    """The memory estimate `run` checks before launch and `simulate` reports (`fits`), for each
    step's own Plan, model and recompute mode, against the peak the run measured in that step.
    Steps after the first: the first step's peak comes before AdamW has allocated its state (at its
    end), which the estimate, a steady step, holds."""
    run = _read_run(run_dir)
    model = _model_of(run)
    cluster = _cluster_of(run, hardware)
    peaks = {int(m["step"]): float(m["peak_memory_bytes"]) for m in run.metrics
             if m.get("peak_memory_bytes") is not None and "step" in m}
    if not peaks:
        raise CalibrationError(f"{run_dir}: steps.jsonl records no peak_memory_bytes")
    steps = sorted(peaks)[1:] or sorted(peaks)
    measured, estimated = 0.0, 0.0
    done = 0
    for s in steps:
        plan = plan_for_step(run, s)
        if plan is None:
            continue
        res = simulate(plan, model, cluster, options=_options(run))
        # like with like: the peak of live tensors against max_memory_allocated (not the allocator's
        # reserve and the context, which the fits check adds)
        allocated = max(r.memory_allocated for r in res.ranks)
        measured, estimated = max(measured, peaks[s]), max(estimated, allocated)
        done += 1
    if not done:
        raise CalibrationError(f"{run_dir}: no step with both a measured peak and a known Plan")
    return MemoryCheck(str(run_dir), done, measured, estimated)

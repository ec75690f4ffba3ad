"""Every result format the figures read, in one place (a format change is an edit here only).

Two kinds of record folder exist:

- a *run* (`omnibench run`, omnibench/runtime/records.py): `config.json` = {"run": RunSpec dict,
  "model": model spec dict}, `plan_step0.json` (a Plan), `steps.jsonl` (one JSON object per step:
  step, loss, step_time_s, tokens, tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu,
  bubble_fraction, exposed_comm_fraction, peak_memory_bytes, ...), `summary.json` (means over the
  timed steps) and `trace.json` (Chrome format: tid = rank, one "X" span per action, cat = kind,
  args = {step, module} and, in newer records, rank, kind, microbatch, stage, what, cpu_s; older records
  carry the microbatch only in the name, e.g. "forward(llm, mb0, stage0)"; newer ones also hold
  `plans.jsonl`, every step's Plan).
  An unfinished run keeps the suffix `.incomplete` and is refused.
- a *simulation* (`omnibench simulate`, omnibench/cli/simulate.py): `config.json` with
  "command": "simulate" (workload, systems, gpus, hardware, model, steps, tp, pp, ...),
  `results.json` (one row per (gpus, system): tokens_per_s(_per_gpu), mfu, bubble, exposed_comm,
  step_time_s, fits / error, per_step = one metrics dict per simulated step (with its batch index
  `step` and `layout` in newer records), layout = the tuned layout's label with --tuned),
  `steps.csv` (the per-step rows, flat; newer records),
  `trace_<system>_<gpus>.json` (Chrome format: pid = rank class, tid = stream index into
  ("compute", "collective", "p2p"), args = {kind, module, microbatch, rank}) and
  `plan_<system>_<gpus>_step<k>.json` (clusters up to 256 GPUs). A simulation still being written
  lives in a hidden `.<name>.<random>` folder and is refused.

Measured-vs-simulated pairs are not stored by `omnibench validate`; they are recomputed here with
the same function it calls (`simulator.calibrate.validate`). Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

INCOMPLETE = ".incomplete"
SIM_STREAMS = ("compute", "collective", "p2p")
COMPUTE_KINDS = ("forward", "backward", "optimizer_step")
BASELINES = ("homogeneous", "temporal", "colocated", "noncolocated", "spatial")  # every system omni is judged against

# `omnibench run` flags, by RunSpec field, that a command line needs to reproduce a run.
_RUN_FLAGS = ("workload", "model", "nproc", "steps", "seed", "tp", "pp", "cp", "ep", "dp", "microbatches",
              "encoder_tp", "encoder_ranks", "dp_shard", "global_batch_tokens", "length_scale", "batches_file")
_SIM_FLAGS = ("hardware", "model", "steps", "step_stride", "calibration", "tp", "pp", "cp", "ep", "dp", "dp_shard",
              "microbatches", "global_batch_tokens", "recompute", "seed", "tune_budget", "tune_fraction", "tune_steps",
              "memory_error")
# tp/pp/cp 0: the CLI's "each system's default layout" (a record with an explicit layout stores all three)
_SIM_DEFAULTS = {"hardware": "h100", "model": "omni-7b", "steps": 1, "calibration": None, "tp": 0, "pp": 0,
                 "cp": 0, "ep": 1, "dp": 0, "dp_shard": 0, "microbatches": 0, "global_batch_tokens": 0, "recompute": "auto",
                 "seed": 0, "step_stride": 1, "tune_budget": 0, "tune_fraction": None, "tune_steps": 1,
                 "memory_error": 0.0}
_MB = re.compile(r"\bmb(\d+)")


class PlotInputError(ValueError):
    """Inputs cannot make the requested figure; the message says what is missing, in one line."""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlotInputError(f"{path}: cannot read JSON ({type(e).__name__}: {e})") from None


# -- records ---------------------------------------------------------------------------------------
@dataclass
class RunRecord:
    """A real training run."""

    path: Path
    config: dict
    summary: dict
    steps: list[dict]
    plan_options: dict
    kind: str = "run"

    @property
    def spec(self) -> dict:
        return self.config.get("run", {})

    @property
    def system(self) -> str:
        return str(self.summary.get("system") or self.spec.get("system"))

    @property
    def workload(self) -> str:
        return Path(str(self.summary.get("workload") or self.spec.get("workload"))).stem

    @property
    def world_size(self) -> int:
        return int(self.summary.get("world_size") or self.spec.get("nproc") or 0)

    @property
    def trace_path(self) -> Path | None:
        p = self.path / "trace.json"
        return p if p.is_file() else None

    @property
    def command(self) -> str:
        from omnibench.specs.run import RunSpec

        spec = self.spec
        defaults = RunSpec(system=spec.get("system", "")).to_dict()
        parts = ["omnibench run", f"--system {spec.get('system')}"]
        for k in _RUN_FLAGS:
            v = spec.get(k)
            if v is None or (v == defaults.get(k) and k != "workload"):
                continue
            parts.append(f"--{k.replace('_', '-')} {v}")
        if spec.get("fsdp") is False:
            parts.append("--no-fsdp")
        for k, v in (spec.get("options") or {}).items():
            parts.append(f"--no-{k.replace('_', '-')}" if v is False else f"--option {k}={v}")
        dev = spec.get("extra", {}).get("device") or spec.get("device")
        if dev and dev != "auto":
            parts.append(f"--device {dev}")
        parts.append(f"--out {self.path}")
        return " ".join(parts)


@dataclass
class SimRecord:
    """One `omnibench simulate` invocation: every (cluster size, system) it simulated."""

    path: Path
    config: dict
    rows: list[dict]
    kind: str = "sim"
    # omni's plan options per (system, gpus): plan files are megabytes, read each once per record
    plan_options: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def workload(self) -> str:
        return Path(str(self.config.get("workload"))).stem

    @property
    def systems(self) -> list[str]:
        from omnibench.plots.style import order_systems

        return order_systems({r["system"] for r in self.rows})

    def trace_path(self, system: str, gpus: int) -> Path | None:
        p = self.path / f"trace_{system}_{gpus}.json"
        return p if p.is_file() else None

    def plan_path(self, system: str, gpus: int) -> Path | None:
        hits = sorted(self.path.glob(f"plan_{system}_{gpus}_step*.json"))
        return hits[0] if hits else None

    @property
    def command(self) -> str:
        c = self.config
        parts = ["omnibench simulate", f"--workload {c.get('workload')}",
                 f"--system {','.join(c.get('systems', []))}", f"--gpus {','.join(str(g) for g in c.get('gpus', []))}"]
        for k in _SIM_FLAGS:
            v = c.get(k)
            if k in c and v != _SIM_DEFAULTS[k] and not (c.get("tuned") and k in ("tp", "pp", "cp", "recompute")):
                parts.append(f"--{k.replace('_', '-')} {v}")
        if c.get("tuned"):
            parts.append("--tuned" + (" --check-convergence" if c.get("check_convergence") else "")
                         + (" --no-tune-guard" if c.get("tune_guard") is False else ""))
        parts += [f"--no-{k.replace('_', '-')}" for k, v in sorted((c.get("options") or {}).items()) if v is False]
        parts.append(f"--out {self.path.parent}")
        return " ".join(parts)


@dataclass
class Records:
    runs: list[RunRecord] = field(default_factory=list)
    sims: list[SimRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unfinished folders met while scanning a parent

    @property
    def all(self) -> list:
        return [*self.runs, *self.sims]

    def workloads(self) -> list[str]:
        seen: list[str] = []
        for r in self.all:
            if r.workload not in seen:
                seen.append(r.workload)
        return seen


def _is_run(folder: Path) -> bool:
    return (folder / "steps.jsonl").is_file() and (folder / "config.json").is_file()


def _is_sim(folder: Path) -> bool:
    return (folder / "results.json").is_file() and (folder / "config.json").is_file()


def _unfinished(folder: Path) -> str | None:
    if folder.name.endswith(INCOMPLETE):
        return (f"{folder} is an unfinished run (its folder still ends in {INCOMPLETE}); "
                "let it finish or re-run it")
    if folder.name.startswith(".") and folder.name not in (".", ".."):
        return f"{folder} is an unfinished simulation (hidden temporary folder); let it finish or re-run it"
    return None


def read_run(folder: Path) -> RunRecord:
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("run"), dict):
        raise PlotInputError(f"{folder}/config.json: not a run config (no 'run' entry)")
    missing = [k for k in ("system", "workload") if not isinstance(config["run"].get(k), str)]
    if missing:
        raise PlotInputError(f"{folder}/config.json: run.{missing[0]} is missing (a record from omnibench run has it)")
    summary = _read_json(folder / "summary.json") if (folder / "summary.json").is_file() else {}
    steps = []
    for i, line in enumerate((folder / "steps.jsonl").read_text().splitlines()):
        if line.strip():
            try:
                step = json.loads(line)
            except json.JSONDecodeError:
                raise PlotInputError(f"{folder}/steps.jsonl: line {i + 1} is not JSON") from None
            if not isinstance(step, dict) or not (_finite(step.get("step_time_s")) and step["step_time_s"] > 0):
                got = step.get("step_time_s") if isinstance(step, dict) else step
                raise PlotInputError(f"{folder}/steps.jsonl: line {i + 1}: step_time_s must be a positive number "
                                     f"of seconds, got {got!r}")
            if not _finite(step.get("tokens", 0)):
                raise PlotInputError(f"{folder}/steps.jsonl: line {i + 1}: tokens must be a number, "
                                     f"got {step.get('tokens')!r}")
            steps.append(step)
    if not steps:
        raise PlotInputError(f"{folder}/steps.jsonl: no steps recorded")
    options = {}
    plan = folder / "plan_step0.json"
    if plan.is_file():
        options = _read_json(plan).get("options", {}) or {}
    return RunRecord(folder, config, summary, steps, options)


SIM_CONFIG_KEYS = ("workload", "systems", "gpus", "hardware", "model")


def read_sim(folder: Path) -> SimRecord:
    config = _read_json(folder / "config.json")
    if not isinstance(config, dict) or config.get("command") != "simulate":
        raise PlotInputError(f"{folder}/config.json: not a simulation config (no \"command\": \"simulate\")")
    missing = [k for k in SIM_CONFIG_KEYS if k not in config]
    if missing:
        raise PlotInputError(f"{folder}/config.json: {missing[0]} is missing (a record from omnibench simulate has "
                             f"{', '.join(SIM_CONFIG_KEYS)})")
    rows = _read_json(folder / "results.json")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "gpus" in r and "system" in r for r in rows):
        raise PlotInputError(f"{folder}/results.json: expected a list of result rows, each with gpus and system")
    for i, r in enumerate(rows, 1):  # a hand-edited or damaged row must be named here, not fail inside a figure
        where = f"{folder}/results.json: row {i}"
        if not (isinstance(r["gpus"], int) and not isinstance(r["gpus"], bool) and r["gpus"] > 0):
            raise PlotInputError(f"{where}: gpus must be a positive integer, got {r['gpus']!r}")
        if not (isinstance(r["system"], str) and r["system"]):
            raise PlotInputError(f"{where}: system must be a name, got {r['system']!r}")
        if r.get("fits", False) and "error" not in r:  # a row that ran: the figures read its throughput
            for k in ("tokens_per_s", "tokens_per_s_per_gpu"):
                if not _finite(r.get(k)):
                    raise PlotInputError(f"{where} ({r['system']} at {r['gpus']} GPUs, fits): {k} must be a "
                                         f"finite number, got {r.get(k)!r}")
    return SimRecord(folder, config, rows)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def load(paths) -> Records:
    """Read record folders; a folder holding record folders (results/runs, results/sims, results/)
    is read one or two levels down. Unfinished folders named explicitly are refused."""
    recs = Records()
    for p in [Path(x) for x in paths]:
        why = _unfinished(p)
        if why:
            raise PlotInputError(why)
        if not p.exists():
            raise PlotInputError(f"record folder {str(p)!r} does not exist")
        if not p.is_dir():
            raise PlotInputError(f"{p} is not a record folder (expected a directory from omnibench run/simulate)")
        found = _scan(p, recs, depth=2)
        if not found:
            raise PlotInputError(f"{p} holds no run record (config.json + steps.jsonl) and no simulation record "
                                 "(config.json + results.json)")
    return recs


def _scan(p: Path, recs: Records, depth: int) -> int:
    if _is_run(p):
        recs.runs.append(read_run(p))
        return 1
    if _is_sim(p):
        recs.sims.append(read_sim(p))
        return 1
    if depth == 0:
        return 0
    n = 0
    for child in sorted(c for c in p.iterdir() if c.is_dir()):
        why = _unfinished(child)
        if why:
            if _is_run(child) or _is_sim(child) or (child / "progress.jsonl").exists() or child.name.endswith(
                    INCOMPLETE):
                recs.skipped.append(why)
            continue
        n += _scan(child, recs, depth - 1)
    return n


# -- omni's technique switches ---------------------------------------------------------------------
def technique_flags(options: dict) -> dict[str, bool]:
    """The on/off switches among a plan's options (omni's techniques are booleans there)."""
    return {k: v for k, v in sorted(options.items()) if isinstance(v, bool)}


def variant_label(system: str, options: dict) -> str:
    off = [k for k, v in technique_flags(options).items() if not v]
    if system != "omni" or not off:
        return system
    return "omni w/o " + " & ".join(k.replace("_", " ") for k in off)


def _sim_plan_options(rec: SimRecord, system: str, gpus: int) -> dict:
    if system != "omni":
        return {}
    key = (system, gpus)
    if key not in rec.plan_options:
        p = rec.plan_path(system, gpus)
        got = rec.config.get("options", {}) if p is None else _read_json(p).get("options", {})
        rec.plan_options[key] = dict(got or {})
    return rec.plan_options[key]


def memory_error(rec: SimRecord) -> float:
    """The memory error a simulation decided fits under (`simulate --memory-error`; 0 before it existed)."""
    return float(rec.config.get("memory_error") or 0.0)


def nominal(sims: list[SimRecord]) -> list[SimRecord]:
    """The simulations that decided what fits with the memory estimate as it is (no --memory-error):
    the only ones a comparison figure reads; the others are the memory-sensitivity figure's."""
    return [r for r in sims if not memory_error(r)]


# -- tables ----------------------------------------------------------------------------------------
THROUGHPUT_COLUMNS = ("source", "workload", "system", "variant", "gpus", "tokens_per_s", "tokens_per_s_per_gpu",
                      "tflops_per_gpu", "mfu", "step_time_s", "bubble", "exposed_comm", "record")


def plan_words(summary: dict) -> str:
    """A results row's `plan` (systems/common.py plan_summary) in a few words: which samples each encoder
    ran sequence-parallel and in groups of how many, LLM samples split over a cp group, samples resharded."""
    parts = []
    for module, e in (summary.get("encoders") or {}).items():
        scheme = {"all": "every sample", "long_short": "long samples only", "none": "no sample",
                  "auto": "auto"}.get(e.get("scheme"), e.get("scheme"))
        k = f" in SP groups of {e['sp_group_size']}" if e.get("scheme") != "none" else " sequence-parallel"
        parts.append(f"{module}: {scheme}{k} ({e.get('samples_in_groups', 0)} in groups, "
                     f"{e.get('samples_alone', 0)} alone)")
    if summary.get("llm_split_samples"):
        parts.append(f"LLM: {summary['llm_split_samples']} samples over cp groups of {summary.get('llm_split_group')}")
    if "resharded_samples" in summary:
        parts.append(f"{summary['resharded_samples']} samples resharded")
    if "encoder_order" in summary:
        parts.append(f"encoders {summary['encoder_order'].replace('_', ' ')}")
    return "; ".join(parts)


def throughput_table(recs: Records) -> pd.DataFrame:
    """One row per (record, system, cluster size) that ran (simulations that did not fit are left out
    and listed in `.attrs["left_out"]`)."""
    rows, left_out = [], []
    for r in recs.runs:
        s = r.summary
        timed = r.steps[1:] or r.steps
        tps = s.get("tokens_per_s") or sum(x["tokens"] for x in timed) / sum(x["step_time_s"] for x in timed)
        rows.append({
            "source": "run", "workload": r.workload, "system": r.system,
            "variant": variant_label(r.system, r.plan_options), "gpus": r.world_size, "tokens_per_s": tps,
            "tokens_per_s_per_gpu": s.get("tokens_per_s_per_gpu", tps / max(r.world_size, 1)),
            "tflops_per_gpu": s.get("tflops_per_gpu"), "mfu": s.get("mfu"),
            "step_time_s": s.get("mean_step_time_s"), "bubble": s.get("bubble_fraction"),
            "exposed_comm": s.get("exposed_comm_fraction"), "record": str(r.path),
            "options": technique_flags(r.plan_options),
        })
    for rec in recs.sims:
        for row in rec.rows:
            gpus, system = int(row["gpus"]), row["system"]
            if "error" in row or not row.get("fits", False):
                left_out.append(f"{system} at {gpus} GPUs ({rec.workload}): "
                                f"{row.get('error') or row.get('fit_message') or 'did not fit'}")
                continue
            opts = _sim_plan_options(rec, system, gpus)
            rows.append({
                "source": "sim", "workload": rec.workload, "system": system, "variant": variant_label(system, opts),
                "gpus": gpus, "tokens_per_s": row["tokens_per_s"], "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
                "tflops_per_gpu": row.get("tflops_per_gpu"), "mfu": row.get("mfu"),
                "step_time_s": row.get("step_time_s"), "bubble": row.get("bubble"),
                "exposed_comm": row.get("exposed_comm"), "record": str(rec.path), "options": technique_flags(opts),
                "layout": row.get("layout", ""), "steps": int(row.get("steps", 1)),
                "hardware": str(rec.config.get("hardware") or ""), "memory_error": memory_error(rec),
                "imbalance": row.get("imbalance"), "plan": plan_words(row.get("plan") or {}),
            })
    df = pd.DataFrame(rows, columns=[*THROUGHPUT_COLUMNS, "options", "layout", "steps", "hardware", "memory_error",
                                     "imbalance", "plan"])
    df.attrs["left_out"] = left_out
    return df


def steps_table(recs: Records) -> pd.DataFrame:
    """Per-step throughput: one row per (record, system, cluster size, step)."""
    rows = []
    for r in recs.runs:
        for i, s in enumerate(r.steps):
            rows.append({"source": "run", "workload": r.workload, "system": r.system, "gpus": r.world_size,
                         "step": int(s.get("step", i)), "tokens": s.get("tokens"), "step_time_s": s["step_time_s"],
                         "tokens_per_s": s.get("tokens_per_s", (s.get("tokens") or 0) / s["step_time_s"]),
                         "record": str(r.path), "layout": "", "ran": True, "why": ""})
    for rec in recs.sims:
        for row in rec.rows:
            for i, s in enumerate(row.get("per_step", [])):
                # A step that did not fit or could not plan at the record's layout: no throughput, and why.
                ran = bool(s.get("fits", True)) and "error" not in s
                rows.append({"source": "sim", "workload": rec.workload, "system": row["system"],
                             "gpus": int(row["gpus"]), "step": int(s.get("step", i)), "tokens": s.get("tokens"),
                             "step_time_s": s.get("step_time_s") if ran else None,
                             "tokens_per_s": s.get("tokens_per_s") if ran else None,
                             "record": str(rec.path), "layout": s.get("layout") or row.get("layout", ""),
                             "ran": ran, "why": "" if ran else (s.get("error") or s.get("fit_message") or "")})
    return pd.DataFrame(rows, columns=["source", "workload", "system", "gpus", "step", "tokens", "step_time_s",
                                       "tokens_per_s", "record", "layout", "ran", "why"])


def stream_of(rec, gpus: int | None = None):
    """(batch of a step, phase of a step) for the sample stream a record's steps were drawn from."""
    from workloads.stream import WorkloadStream

    if isinstance(rec, RunRecord):
        s = rec.spec
        if s.get("batches_file"):
            from workloads.sample import Batch, Sample

            raw = _read_json(Path(s["batches_file"]))
            batches = [Batch(int(b["step"]), [Sample.from_dict(x) for x in b["samples"]]) for b in raw]
            return (lambda step: batches[step % len(batches)]), (lambda step: "replayed")
        st = WorkloadStream(s["workload"], seed=s.get("seed", 0), global_batch_tokens=s["global_batch_tokens"],
                            length_scale=s.get("length_scale") or 1.0, max_sample_tokens=s.get("max_sample_tokens") or None)
    else:
        c = rec.config
        gbt = c.get("global_batch_tokens") or 8192 * int(gpus or c["gpus"][0])  # simulate's default
        st = WorkloadStream(c["workload"], seed=c.get("seed", 0), global_batch_tokens=gbt)
    return st.batch, (lambda step: st.mix(step).phase)


def mix_table(rec, steps, gpus: int | None = None) -> pd.DataFrame:
    """Share of each step's LLM tokens per modality, recomputed from the record's own sample stream."""
    from workloads.sample import MODALITIES

    source, phase = stream_of(rec, gpus)
    rows = []
    for step in steps:
        tok = dict.fromkeys(MODALITIES, 0)
        for sample in source(int(step)).samples:
            for seg in sample.segments:
                tok[seg.modality] += seg.llm_tokens
        total = sum(tok.values()) or 1
        ph = phase(int(step))
        rows += [{"step": int(step), "phase": ph, "modality": m, "share": tok[m] / total} for m in MODALITIES]
    return pd.DataFrame(rows, columns=["step", "phase", "modality", "share"])


def trace_table(rec, system: str | None = None, gpus: int | None = None, step: int | None = None) -> pd.DataFrame:
    """The spans of one step: rank, stream (compute | collective | p2p), kind, module, microbatch,
    start and duration in seconds (start relative to the step's first span)."""
    if isinstance(rec, RunRecord):
        path = rec.trace_path
        if path is None:
            raise PlotInputError(f"{rec.path}: no trace.json")
        events = _read_json(path).get("traceEvents", [])
        spans = []
        for ev in events:
            if ev.get("ph") != "X":
                continue
            args = ev.get("args", {}) or {}
            kind = ev.get("cat") or args.get("kind", "")
            m = _MB.search(str(ev.get("name", "")))
            spans.append({"rank": int(args.get("rank", ev.get("tid", 0))), "kind": kind,
                          "stream": "compute" if kind in COMPUTE_KINDS else ("p2p" if kind in (
                              "send", "recv", "boundary") else "collective"),
                          "module": args.get("module", ""),
                          "microbatch": int(args.get("microbatch", m.group(1) if m else -1)),
                          "stage": int(args.get("stage", 0)),
                          "name": ev.get("name", ""), "step": int(args.get("step", 0)),
                          "start": float(ev["ts"]) * 1e-6, "duration": float(ev["dur"]) * 1e-6})
        df = pd.DataFrame(spans)
        if df.empty:
            raise PlotInputError(f"{path}: no spans")
        steps = sorted(df.step.unique())
        if step is None:
            step = steps[1] if len(steps) > 1 else steps[0]  # step 0 pays one-time warm-up costs
        if step not in steps:
            raise PlotInputError(f"{path}: no step {step}; steps traced: {', '.join(map(str, steps))}")
        df = df[df.step == step].copy()
        label = f"{rec.system}, {rec.world_size} ranks, step {step} (measured)"
    else:
        systems = rec.systems
        system = system or systems[0]
        sizes = sorted({int(r["gpus"]) for r in rec.rows if r["system"] == system and rec.trace_path(system,
                                                                                                    int(r["gpus"]))})
        if not sizes:
            raise PlotInputError(f"{rec.path}: no trace for system {system!r}; traced systems: "
                                 f"{', '.join(s for s in systems if any(rec.trace_path(s, int(r['gpus'])) for r in rec.rows)) or 'none'}")
        gpus = gpus or sizes[0]  # the smallest cluster: big ones have thousands of ranks (and huge traces)
        path = rec.trace_path(system, gpus)
        if path is None:
            raise PlotInputError(f"{rec.path}: no trace of {system} at {gpus} GPUs; traced sizes: "
                                 f"{', '.join(map(str, sizes))}")
        doc = _read_json(path)
        members = {}
        for ev in doc.get("traceEvents", []):
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                m = re.search(r"\(x(\d+)\)", ev.get("args", {}).get("name", ""))
                members[ev["pid"]] = int(m.group(1)) if m else 1
        spans = []
        for ev in doc.get("traceEvents", []):
            if ev.get("ph") != "X":
                continue
            args = ev.get("args", {}) or {}
            tid = int(ev.get("tid", 0))
            spans.append({"rank": int(args.get("rank", ev.get("pid", 0))), "kind": args.get("kind", ev.get("cat")),
                          "stream": SIM_STREAMS[tid] if tid < len(SIM_STREAMS) else str(tid),
                          "module": args.get("module", ""), "microbatch": int(args.get("microbatch", -1)),
                          "name": ev.get("name", ""), "step": 0, "start": float(ev["ts"]) * 1e-6,
                          "duration": float(ev["dur"]) * 1e-6, "members": members.get(ev.get("pid"), 1)})
        df = pd.DataFrame(spans)
        if df.empty:
            raise PlotInputError(f"{path}: no spans")
        label = f"{system}, {gpus} GPUs, {df['rank'].nunique()} distinct ranks (simulated)"
    df["start"] -= df["start"].min()
    df.attrs["label"] = label
    df.attrs["source"] = str(path)
    return df.sort_values(["rank", "start"]).reset_index(drop=True)


def validation_table(runs: list[RunRecord], calibration: str | None = None) -> pd.DataFrame:
    """Measured vs simulated median step time per run: the same computation as `omnibench validate`."""
    from simulator.calibrate import Profile, validate

    prof = Profile.load(calibration) if calibration else None
    rows, left_out = [], []
    for r in runs:  # one run the simulator cannot replay must not hide the others
        try:
            rows += validate([str(r.path)], prof, None)
        except ValueError as e:
            left_out.append(f"{r.path.name}: {str(e).splitlines()[0]}")
    if not rows:
        raise PlotInputError("validation: no run could be simulated: " + "; ".join(left_out))
    df = pd.DataFrame([{"run": Path(v.run).name, "system": v.system, "ranks": v.world_size, "steps": v.steps,
                        "measured_s": v.measured_s, "simulated_s": v.simulated_s, "error": v.error,
                        "record": v.run} for v in rows])
    df.attrs["calibration"] = calibration or "datasheet figures (no calibration)"
    df.attrs["left_out"] = left_out
    return df

"""Traces in and out: the Perfetto (Chrome JSON) timeline a simulation writes, and the reader of a
real run's record folder that calibration and validation consume.

Everything about the runtime's on-disk format lives here, so a format change is one place.
A run folder (omnibench/runtime/records.py) holds:
- `config.json`: {"run": the resolved RunSpec, "model": the MultimodalSpec as a dict};
- `plans.jsonl`: every step's Plan, one `Plan.to_json` per line — what the steps really ran;
- `plan_step0.json` (`Plan.to_json`): the first step's Plan. Records written before plans.jsonl
  existed hold only this one, so the Plans of later steps are re-made here from the RunSpec (same
  planner, same deterministic workload stream, same batch source as omnibench/runtime/worker.py)
  and used only if re-planning step 0 reproduces plan_step0.json;
- `steps.jsonl`: one JSON object per step with `step` and `step_time_s`;
- `summary.json`: device, dtype;
- `trace.json`: Chrome format, `tid` = rank, one complete ("X") event per action, `name` =
  str(Action), `cat` = kind, args {step, rank, kind, module, microbatch, stage, what, cpu_s} (older
  records: args step and module only, microbatch / stage / what parsed from the name);
  `ts`/`dur` in microseconds.
Also accepted, for hand-made records: `plan.json`, `plans/*.json`, `metrics.jsonl`/`metrics.json`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from omnibench.plan import Plan

STREAMS = ("compute", "collective", "p2p")


class TraceError(ValueError):
    """A run folder lacks what calibration/validation need; the message names the file."""


# -- writing ---------------------------------------------------------------------------------------
def perfetto_events(result, members: bool = True, max_ranks: int | None = None) -> dict:
    """Chrome trace of a simulated step: one process per simulated rank, one thread per stream.

    `max_ranks` keeps the first (lowest) simulated ranks only, so an 8,192-rank timeline stays a
    file a browser opens; the trace's metadata says how many were left out.
    """
    events: list[dict] = []
    ranks = sorted(result.ranks, key=lambda st: st.rank)
    kept = ranks if max_ranks is None else ranks[:max_ranks]
    keep = {st.rank for st in kept}
    for st in kept:
        label = f"rank {st.rank}" + (f" (x{st.members})" if members and st.members > 1 else "")
        events.append({"ph": "M", "name": "process_name", "pid": st.rank, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": st.rank, "args": {"sort_index": st.rank}})
        for i, s in enumerate(STREAMS):
            events.append({"ph": "M", "name": "thread_name", "pid": st.rank, "tid": i, "args": {"name": s}})
    for sp in result.spans:
        if sp.rank not in keep:
            continue
        events.append({
            "ph": "X", "pid": sp.rank, "tid": STREAMS.index(sp.stream), "name": sp.name, "cat": sp.kind,
            "ts": sp.start * 1e6, "dur": sp.duration * 1e6,
            "args": {"kind": sp.kind, "module": sp.module, "microbatch": sp.microbatch, "rank": sp.rank},
        })
    meta = {"simulated_ranks": len(ranks), "ranks_in_trace": len(kept), "step_time_s": result.step_time}
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta}


def write_json_atomic(path: Path, obj, indent: int | None = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- reading ---------------------------------------------------------------------------------------
@dataclass
class TraceSpan:
    rank: int
    kind: str
    module: str
    microbatch: int
    start: float  # seconds
    duration: float
    step: int = -1
    stage: int = 0
    what: str = ""
    name: str = ""
    cpu: float | None = None  # CPU seconds of the rank's thread in the span (args.cpu_s), if recorded


@dataclass
class RunRecord:
    path: Path
    config: dict
    plans: list[Plan]
    step_times: dict[int, float]  # step -> seconds
    spans: list[TraceSpan] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def run_spec(self) -> dict:
        return self.config.get("run", self.config)

    @property
    def recompute(self) -> str:
        """The run's activation checkpointing; records from before `--recompute` ran none, and a
        spec never resolved by the launcher (built by hand) still says "auto": none on CPU."""
        mode = self.run_spec.get("recompute", "none")
        return "none" if mode == "auto" else mode

    @property
    def encoder_chunk_tokens(self) -> int:
        """The run's encoder chunk budget (omnibench/runtime/encoder_chunks.py); 0 for records from
        before it, and for "auto" (-1) never settled by a launcher."""
        return max(0, int(self.run_spec.get("encoder_chunk_tokens", 0) or 0))

    @property
    def mixed_precision(self) -> str:
        """How the run held the weights FSDP did not shard; records from before `--mixed-precision` autocast."""
        return self.run_spec.get("mixed_precision") or "autocast"

    @property
    def device(self) -> str:
        return str(self.summary.get("device") or self.run_spec.get("extra", {}).get("device")
                   or self.config.get("device", "cpu"))

    @property
    def hardware(self) -> str | None:
        """The hardware preset this run's device corresponds to, when one does."""
        if "hardware" in self.config:
            return str(self.config["hardware"])
        dev = f"{self.device} {self.summary.get('device_name', '')}".lower()  # "cuda:0 nvidia h100 80gb hbm3"
        if dev.startswith("cpu"):
            return "cpu-gloo"
        for name in ("h200", "h100", "a100"):
            if name in dev:
                return "a100-80g" if name == "a100" else name
        return None

    def measured_step_time(self, skip_first: bool = True) -> float:
        """Median step time, the first (warm-up) step left out when there are others."""
        steps = sorted(self.step_times)
        if skip_first and len(steps) > 1:
            steps = steps[1:]
        times = sorted(self.step_times[s] for s in steps)
        if not times:
            raise TraceError(f"{self.path}: no step times in its metrics")
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def _first(folder: Path, names: list[str]) -> Path | None:
    for n in names:
        hits = sorted(folder.glob(n))
        if hits:
            return hits[0]
    return None


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: cannot read JSON ({e})") from None


def _step_time(row: dict) -> float | None:
    for k in ("step_time_s", "step_time", "time_s", "seconds"):
        if k in row:
            return float(row[k])
    return None


_MB = re.compile(r"\bmb(\d+)")
_STAGE = re.compile(r"\bstage(\d+)")


def _replan(config: dict, plan0: Plan, steps: list[int]) -> tuple[list[Plan], str]:
    """Plans of later steps, re-made the way the runtime made them (torch-free twin of
    omnibench/runtime/worker.py's batch_source + parallel_spec). Returns (plans, note)."""
    spec = config.get("run")
    if not isinstance(spec, dict) or not config.get("model"):
        return [], "no RunSpec in config.json: only step 0's plan is known"
    try:
        from omnibench.specs.parallel import ParallelSpec
        from omnibench.specs.presets import model_from_dict
        from systems import get_planner
        from workloads.sample import Batch, Sample

        model = model_from_dict(config["model"], "config.json model")
        parallel = ParallelSpec(
            world_size=plan0.world_size, dp=spec.get("dp", 0), tp=spec.get("tp", 1), pp=spec.get("pp", 1),
            cp=spec.get("cp", 1), ep=spec.get("ep", 1), microbatches=spec.get("microbatches", 0),
            encoder_tp=spec.get("encoder_tp", 0), encoder_ranks=spec.get("encoder_ranks", 0),
            fsdp=spec.get("fsdp", True), dp_shard=spec.get("dp_shard", 0), options=dict(spec.get("options") or {}),
            freeze=tuple(spec.get("freeze") or ()),
        )
        if spec.get("batches_file"):
            raw = json.loads(Path(spec["batches_file"]).read_text())
            batches = [Batch(int(b["step"]), [Sample.from_dict(x) for x in b["samples"]]) for b in raw]

            def source(step):
                return batches[step % len(batches)]
        else:
            from workloads.stream import WorkloadStream

            source = WorkloadStream(
                spec["workload"], seed=spec.get("seed", 0), global_batch_tokens=spec["global_batch_tokens"],
                length_scale=spec.get("length_scale", 1.0), max_sample_tokens=spec.get("max_sample_tokens") or None,
            ).batch
        planner = get_planner(spec["system"])
        again = planner.plan(model, parallel, source(plan0.step))
        def same(a: Plan, b: Plan) -> bool:
            # Equal in everything that costs time: raw-size fields of samples (width, frames) may
            # change with the workload code's version without changing a single FLOP.
            da, db = json.loads(a.to_json()), json.loads(b.to_json())
            for d in (da, db):
                d.pop("notes", None)
                d["samples"] = [[(g["modality"], g["llm_tokens"], g["encoder_seq_len"], g["grid_thw"],
                                  g["mel_frames"]) for g in x["segments"]] for x in d["samples"]]
            return da == db

        if not same(again, plan0):
            return [], "re-planning step 0 from the RunSpec does not reproduce plan_step0.json"
        return [planner.plan(model, parallel, source(s)) for s in steps if s != plan0.step], ""
    except KeyError as e:
        return [], f"cannot re-plan later steps: the RunSpec in config.json lacks {e}"
    except (ValueError, OSError) as e:
        return [], f"cannot re-plan later steps: {e}"


def _unfinished(folder: Path) -> str:
    """How far an unfinished run got, from its config.json and progress.jsonl."""
    try:
        done = sum(1 for line in (folder / "progress.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        done = 0
    try:
        total = json.loads((folder / "config.json").read_text())["run"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{done} step(s) finished"
    return f"{done} of {total} steps finished"


def read_run(path: str | Path) -> RunRecord:
    folder = Path(path)
    if not folder.is_dir():
        raise TraceError(f"run folder {str(path)!r} does not exist")
    if folder.name.endswith(".incomplete"):  # omnibench/runtime/records.py: a run that never finished
        raise TraceError(f"{folder}: unfinished run ({_unfinished(folder)}); only a finished run's record can be "
                         "compared or fitted")
    cfg_path = _first(folder, ["config.json", "run.json", "resolved_config.json"])
    config = _load(cfg_path) if cfg_path else {}
    summary = _load(folder / "summary.json") if (folder / "summary.json").is_file() else {}
    plans: list[Plan] = []
    if (folder / "plans.jsonl").is_file():
        for n, line in enumerate((folder / "plans.jsonl").read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                plans.append(Plan.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{folder / 'plans.jsonl'}: line {n} is not a Plan ({e})") from None
    else:
        plan_files = (sorted(folder.glob("plan.json")) + sorted(folder.glob("plan_step*.json"))
                      + sorted(folder.glob("plans/*.json")))
        for p in plan_files:
            d = _load(p)
            for item in d if isinstance(d, list) else [d]:
                plans.append(Plan.from_dict(item))
    if not plans:
        raise TraceError(f"{folder}: no plan (plans.jsonl, plan_step0.json, plan.json or plans/*.json)")
    mpath = _first(folder, ["steps.jsonl", "metrics.jsonl", "metrics.json"])
    if mpath is None:
        raise TraceError(f"{folder}: no steps.jsonl (per-step metrics)")
    if mpath.suffix == ".jsonl":
        metrics = [json.loads(line) for line in mpath.read_text().splitlines() if line.strip()]
    else:
        d = _load(mpath)
        metrics = d.get("steps", []) if isinstance(d, dict) else d
    step_times = {}
    for i, row in enumerate(metrics):
        t = _step_time(row)
        if t is not None:
            step_times[int(row.get("step", i))] = t
    notes = []
    known = {p.step for p in plans}
    missing = [s for s in sorted(step_times) if s not in known]
    if missing and len(plans) == 1:
        more, note = _replan(config, plans[0], missing)
        plans += more
        if note:
            notes.append(note)
    spans: list[TraceSpan] = []
    tpath = _first(folder, ["trace.json", "*.trace.json", "trace/*.json", "traces/*.json"])
    if tpath is not None:
        d = _load(tpath)
        events = d.get("traceEvents", []) if isinstance(d, dict) else d
        for ev in events:
            if ev.get("ph") != "X":
                continue
            args = ev.get("args", {}) or {}
            kind = args.get("kind", ev.get("cat", ""))
            if not kind:
                continue
            name = str(ev.get("name", ""))
            mb = args.get("microbatch")
            if mb is None:
                m = _MB.search(name)
                mb = int(m.group(1)) if m else 0
            stage = args.get("stage")
            if stage is None:
                m = _STAGE.search(name)
                stage = int(m.group(1)) if m else 0
            what = args.get("what") or ("grad" if ", grad" in name else "act" if ", act" in name else "")
            rank = args.get("rank", ev.get("tid", ev.get("pid", 0)))
            spans.append(TraceSpan(
                rank=int(rank), kind=str(kind), module=str(args.get("module", "")), microbatch=int(mb),
                start=float(ev.get("ts", 0)) * 1e-6, duration=float(ev.get("dur", 0)) * 1e-6,
                step=int(args.get("step", -1)), stage=int(stage), what=str(what), name=name,
                cpu=float(args["cpu_s"]) if "cpu_s" in args else None,
            ))
    return RunRecord(folder, config, plans, step_times, spans, metrics, summary, notes)


def plan_for_step(run: RunRecord, step: int) -> Plan | None:
    """The Plan a step ran (None when it is not known: that step is left out, never guessed)."""
    for p in run.plans:
        if p.step == step:
            return p
    return None


def step_actions(run: RunRecord, step: int) -> dict[int, list[tuple]]:
    """rank -> [(Action, TraceSpan)] of one step: the runtime writes one span per planned action, in
    the order of `plan.actions[rank]`, so the two zip. A rank whose span count does not match its
    actions (a record from another runtime version) is left out, never guessed."""
    plan = plan_for_step(run, step)
    if plan is None:
        return {}
    mine: dict[int, list[TraceSpan]] = {}
    for sp in run.spans:
        if sp.step == step:
            mine.setdefault(sp.rank, []).append(sp)
    out = {}
    for rank, spans in mine.items():
        actions = plan.actions.get(rank, [])
        spans.sort(key=lambda s: s.start)
        if len(spans) != len(actions):
            continue
        if all(a.kind == s.kind and a.module == s.module for a, s in zip(actions, spans, strict=True)):
            out[rank] = list(zip(actions, spans, strict=True))
    return out

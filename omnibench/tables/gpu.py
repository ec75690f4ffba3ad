"""Tables from the GPU records (results/gpu/) and the H100 profiles (results/calibration/h100-*.json):
what each record says about where it came from, the runs' own figures, the fitted profile's and
the kernel profile's step-time errors, and the memory estimate against the measured peaks.

One GPU runs every system with the same single-rank Plan (no communication, no pipeline), so the
tables count Plans, not runs: four runs of one Plan are one data point measured four times.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from omnibench.provenance import GPU_FIELDS, REPO_ROOT, missing, record_provenance
from omnibench.tables import table

GPU_DIR = "results/gpu"
PROFILE = "results/calibration/h100-1gpu.json"
KERNELS = "results/calibration/h100-kernels.json"
KERNEL_SWEEPS = (KERNELS, "results/calibration/h200-kernels.json")
HARDWARE = "h100"
# The runs the kernel profile's model of this project's eager stack (simulator/kernels.py::Stack)
# was written against; the runs in the other `runs*/` folders came after it.
STACK_MODEL_SEEN = "results/gpu/runs/"
UNVERIFIABLE = "unverifiable (no provenance)"
GiB = 2**30


def _rel(path: Path | str) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _read(path: Path) -> dict | list:
    return json.loads(path.read_text())


def gpu_of(summary: dict) -> str:
    """Which GPU a record ran on: "H200" where its device says so, else "H100" (every GPU run before
    2026-11-29 was on an H100 80GB; the first records name no device)."""
    return "H200" if "H200" in str(summary.get("device_name") or "") else "H100"


def runs() -> tuple[dict, ...]:
    """The H100 run records under results/gpu/runs*/ (omnibench/tables/h200.py has the H200's)."""
    return tuple(r for r in all_runs() if r["gpu"] == "H100")


@lru_cache(maxsize=1)
def all_runs() -> tuple[dict, ...]:
    """Every run record under results/gpu/runs*/, with what the tables need from it."""
    return tuple(run_record(cfg.parent) for cfg in sorted((REPO_ROOT / GPU_DIR).glob("runs*/*/config.json")))


def rerun_records() -> tuple[dict, ...]:
    """Run records kept under a dated GPU folder (<date>-<machine>/runs/*/: commands rerun at a later
    commit), out of the `runs*/` folders the tables above read."""
    return tuple(run_record(c.parent) for c in sorted((REPO_ROOT / GPU_DIR).glob("20[0-9][0-9]-*/runs/*/config.json")))


def run_record(folder) -> dict:
    """One run record (a folder `omnibench run --out` wrote), with what the tables need from it."""
    run = _read(folder / "config.json")["run"]
    summary = _read(folder / "summary.json")
    return {
        "path": _rel(folder), "name": folder.name, "system": summary["system"], "workload": summary["workload"],
        "model": summary["model"], "recompute": summary.get("recompute", run.get("recompute", "none")),
        "compile": bool(summary.get("compile")), "chunk": max(0, int(run.get("encoder_chunk_tokens", 0) or 0)),
        "mixed_precision": run.get("mixed_precision") or "autocast",  # records before it existed: autocast
        "summary": summary, "provenance": record_provenance(folder), "gpu": gpu_of(summary),
    }


def verified(r: dict) -> bool:
    """Whether a run record carries every field a GPU figure needs (omnibench.provenance.GPU_FIELDS)."""
    return not missing(r["provenance"])


def _verification(rs: list[dict]) -> str:
    """Which of `rs` are unverifiable, in words (the tables quote records of both kinds)."""
    bad = [r for r in rs if not verified(r)]
    if not bad:
        return "Every run carries its provenance (commit, driver, GPU, command)."
    if len(bad) == len(rs):
        return f"Every run is {UNVERIFIABLE}."
    folders = sorted({r["path"].removeprefix(GPU_DIR + "/").split("/")[0] + "/" for r in bad})
    return (f"{len(bad)} of {len(rs)} runs are {UNVERIFIABLE} (those under {', '.join(f'`{x}`' for x in folders)}); "
            "the others carry commit, driver, GPU and command (`results/gpu/README.md`).")


def plan_label(r: dict) -> str:
    label = f"{r['workload']}, {r['model']}, recompute {r['recompute']}"
    if r["chunk"]:
        label += f", encoder chunks of {r['chunk']:,}"
    return label + (", --compile" if r["compile"] else "")


def not_modelled(r: dict) -> str | None:
    """Why a run is left out of every comparison with the simulator, or None."""
    if r["compile"]:
        return "`--compile`: the simulator costs the eager stack"
    return None


def modelled() -> list[dict]:
    return [r for r in runs() if not_modelled(r) is None]


@lru_cache(maxsize=1)
def _fitted_on() -> frozenset[str]:
    from simulator.calibrate import Profile

    return frozenset(_rel(p) for p in Profile.load(REPO_ROOT / PROFILE).provenance.get("runs", []))


@lru_cache(maxsize=2)
def _validations(profile: str | None) -> dict[str, object]:
    """run path -> simulator.calibrate.Validation under the fitted profile (or the kernel profile: None)."""
    from simulator.calibrate import Profile, validate

    rs = modelled()
    prof = Profile.load(REPO_ROOT / profile) if profile else None
    got = validate([str(REPO_ROOT / r["path"]) for r in rs], prof, HARDWARE)
    return {r["path"]: v for r, v in zip(rs, got, strict=True)}


@lru_cache(maxsize=1)
def _memory() -> dict[str, object]:
    from simulator.calibrate import memory_check

    return {r["path"]: memory_check(str(REPO_ROOT / r["path"]), HARDWARE) for r in modelled()}


def _by_plan(rs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rs:
        out.setdefault(plan_label(r), []).append(r)
    return out


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a} to {b}"


def _mae(rs: list[dict], vals: dict) -> float:
    return sum(abs(vals[r["path"]].error) for r in rs) / len(rs)


def _count(rs: list[dict]) -> str:
    n = len(_by_plan(rs))
    return f"{len(rs)} run{'s' if len(rs) != 1 else ''}, {n} Plan{'s' if n != 1 else ''}"


def _left_out() -> str:
    out = [f"`{r['path']}` ({not_modelled(r)})" for r in runs() if not_modelled(r)]
    return f"Left out: {'; '.join(out)}." if out else ""


def _split(rs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(runs of a Plan the profile was fitted on, runs of other Plans): a later run of a fitted Plan
    measures the same step again, it is not held out."""
    fit = _fitted_on()
    plans = {plan_label(r) for r in runs() if r["path"] in fit}
    return [r for r in rs if plan_label(r) in plans], [r for r in rs if plan_label(r) not in plans]


def _seen(rs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(runs of a Plan the kernel model of the eager stack was written against, runs of other Plans)."""
    plans = {plan_label(r) for r in runs() if (r["path"] + "/").startswith(STACK_MODEL_SEEN)}
    return [r for r in rs if plan_label(r) in plans], [r for r in rs if plan_label(r) not in plans]


@table("h100-validation")
def h100_validation() -> str:
    """Step time, simulated against measured, per Plan: the fitted profile and the kernel profile."""
    fitted, kernel = _validations(PROFILE), _validations(None)
    fit = _fitted_on()
    lines = [
        "| Plan (on one GPU every system runs the same one) | runs | fitted profile | measured s | "
        "fitted profile: simulated s (error) | kernel profile: simulated s (error) |",
        "|---|---|---|---|---|---|",
    ]
    for label, rs in _by_plan(modelled()).items():
        split = {("fitted" if r["path"] in fit else "held out") for r in rs}
        if split == {"fitted", "held out"}:
            split = {"fitted (a later run measured the same Plan again)"}
        systems = ", ".join(sorted(r["system"] for r in rs))
        cells = []
        for vals in (fitted, kernel):
            sim = _span([vals[r["path"]].simulated_s for r in rs], ".3f")
            err = _span([vals[r["path"]].error for r in rs], "+.1%")
            cells.append(f"{sim} ({err})")
        lines.append(f"| {label} | {len(rs)}: {systems} | {' and '.join(sorted(split))} | "
                     f"{_span([fitted[r['path']].measured_s for r in rs], '.3f')} | {cells[0]} | {cells[1]} |")
    ins, held = _split(modelled())
    seen, unseen = _seen(modelled())
    lines += [
        "",
        f"- Fitted profile (`{PROFILE}`: per-action efficiency curves fitted on the runs marked fitted, split "
        f"by Plan before fitting): mean \\|error\\| **{_mae(ins, fitted):.1%}** in-sample ({_count(ins)}), "
        f"**{_mae(held, fitted):.1%}** held out ({_count(held)}).",
        f"- Kernel profile (`h100-measured`, nothing fitted to these runs; its model of this project's eager "
        f"stack was written against `{STACK_MODEL_SEEN}`): **{_mae(seen, kernel):.1%}** on those "
        f"({_count(seen)}), **{_mae(unseen, kernel):.1%}** on the runs that came after it ({_count(unseen)}).",
        f"- {_verification(modelled())} `results/gpu/runs/` do not name their "
        f"GPU and are simulated as `{HARDWARE}` (their memory check saw 79.2 GiB, an H100 80GB's).",
    ]
    if _left_out():
        lines.append(f"- {_left_out()}")
    return "\n".join(lines)


@table("h100-fit-summary")
def h100_fit_summary() -> str:
    """One line: the fitted H100 profile's in-sample and held-out error."""
    fitted = _validations(PROFILE)
    ins, held = _split(modelled())
    return (f"{_mae(ins, fitted):.1%} in-sample ({_count(ins)}), {_mae(held, fitted):.1%} held out "
            f"({_count(held)})")


@table("h100-kernel-summary")
def h100_kernel_summary() -> str:
    """One line: the kernel profile's error on the runs its stack model was written against, and on the others."""
    kernel = _validations(None)
    seen, unseen = _seen(modelled())
    return (f"{_mae(seen, kernel):.1%} on the runs its model of the eager stack was written against ({_count(seen)}), "
            f"{_mae(unseen, kernel):.1%} on the runs that came after ({_count(unseen)})")


@table("h100-validation-runs")
def h100_validation_runs() -> str:
    """`omnibench validate` with the fitted profile, run by run."""
    fitted = _validations(PROFILE)
    fit = _fitted_on()
    lines = ["| run | Plan | split | steps | measured s | simulated s | error |", "|---|---|---|---|---|---|---|"]
    for r in modelled():
        v = fitted[r["path"]]
        lines.append(f"| `{r['path']}` | {plan_label(r)} | {'fitted' if r['path'] in fit else 'held out'} | "
                     f"{v.steps} | {v.measured_s:.4f} | {v.simulated_s:.4f} | {v.error:+.1%} |")
    ins, held = _split(modelled())
    lines += ["", f"Mean \\|error\\|: {_mae(ins, fitted):.1%} in-sample ({_count(ins)}), "
              f"{_mae(held, fitted):.1%} held out ({_count(held)}). {_left_out()}".rstrip()]
    return "\n".join(lines)


@table("h100-actions")
def h100_actions() -> str:
    """Per action, seconds per step: one run of each Plan, measured against both profiles."""
    from simulator.calibrate import Profile, action_breakdown

    prof = Profile.load(REPO_ROOT / PROFILE)
    fit = _fitted_on()
    lines = ["| Plan | split | action | measured s | fitted profile s (error) | kernel profile s (error) |",
             "|---|---|---|---|---|---|"]
    for label, rs in _by_plan(modelled()).items():
        path = str(REPO_ROOT / rs[0]["path"])
        a = {(x.kind, x.module): x for x in action_breakdown(path, prof, HARDWARE)}
        b = {(x.kind, x.module): x for x in action_breakdown(path, None, HARDWARE)}
        split = "fitted" if rs[0]["path"] in fit else "held out"
        for key in sorted(k for k in a if k[0] in ("forward", "backward", "optimizer_step") and a[k].measured_s > 0):
            m = a[key].measured_s
            lines.append(f"| {label} | {split} | {key[0]} {key[1]} | {m:.3f} | "
                         f"{a[key].simulated_s:.3f} ({a[key].simulated_s / m - 1:+.0%}) | "
                         f"{b[key].simulated_s:.3f} ({b[key].simulated_s / m - 1:+.0%}) |")
    return "\n".join(lines)


@table("h100-memory")
def h100_memory() -> str:
    """The memory estimate against the peaks measured on the GPU, per Plan."""
    mem = _memory()
    lines = ["| Plan | runs | measured peak GiB | estimate GiB | estimate / measured |", "|---|---|---|---|---|"]
    for label, rs in _by_plan(modelled()).items():
        ms = [mem[r["path"]] for r in rs]
        lines.append(f"| {label} | {len(rs)} | {_span([m.measured_bytes / GiB for m in ms], '.1f')} | "
                     f"{_span([m.estimated_bytes / GiB for m in ms], '.1f')} | {_span([m.ratio for m in ms], '.3f')} |")
    deepest = max((r["model"] for r in modelled()), key=lambda m: int(re.search(r"@(\d+)L", m).group(1))
                  if re.search(r"@(\d+)L", m) else 10**6)
    lines += ["", f"{_count(modelled())}; peaks: the largest per-step peak after the first step (max allocated, "
              "reset every step), the estimate the same steps' Plans give (`simulator.calibrate.memory_check`). "
              f"No record is of a full-depth model (the deepest: `{deepest}`). {_left_out()} "
              f"{_verification(modelled())}".rstrip()]
    return "\n".join(lines)


@table("h100-memory-range")
def h100_memory_range() -> str:
    """One line: how far above the measured GPU peaks the estimate is."""
    mem = _memory()
    ratios = [m.ratio - 1 for m in mem.values()]
    return f"{min(ratios):+.0%} to {max(ratios):+.0%} ({_count(modelled())}, no full-depth model)"


@table("h100-runs")
def h100_runs() -> str:
    """Every run recorded on the GPU, as its summary.json has it, and the runs the launcher refused."""
    lines = [f"{_verification(list(runs()))} Chunked encoders (`--encoder-chunk-tokens`) are the runs' "
             "`encoder chunks` in the model column.",
             "",
             "| record | system | workload | model | recompute | step ms | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | provenance |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs():
        s = r["summary"]
        model = r["model"] + (" (--compile)" if r["compile"] else "") + (f", encoder chunks of {r['chunk']:,}" if r["chunk"] else "")
        prov = r["provenance"]
        where = (f"`{prov['commit'][:10]}`" + (" (dirty)" if prov.get("dirty") else "")) if verified(r) else "unverifiable"
        lines.append(f"| `{r['path'].removeprefix(GPU_DIR + '/')}` | {r['system']} | {r['workload']} | {model} | "
                     f"{r['recompute']} | {s['mean_step_time_s'] * 1e3:,.0f} | {s['tokens_per_s_per_gpu']:,.0f} | "
                     f"{s['tflops_per_gpu']:.1f} | {s['mfu']:.1%} | {s['peak_memory_bytes'] / GiB:.1f} | {where} |")
    for figures in [REPO_ROOT / GPU_DIR / "gpu_figures.json", *sorted((REPO_ROOT / GPU_DIR).glob("20[0-9][0-9]-*/gpu_figures*.json"))]:
        if not figures.is_file():
            continue
        for row in _read(figures):
            if "error" not in row:
                continue
            what = "ran out of memory" if "OutOfMemoryError" in row["error"] else "refused"
            text = row["error"].split("; traceback in")[0].split(" If reserved but unallocated")[0]
            lines.append(f"| `{_rel(figures).removeprefix(GPU_DIR + '/')}` | {row['system']} | {row['workload']} | "
                         f"{what}: \"{text}\" | | | | | | | |")
    lines += ["", "Step ms, tokens/s and MFU: means over the steps after the first; MFU = model FLOPs (exact "
              "formula, no recomputation) / step time / 989 TFLOP/s."]
    return "\n".join(lines)


@table("h100-llm-stack")
def h100_llm_stack() -> str:
    """The harness's LLM-only step against a plain bf16 stack (benchmarks/gpu_llm_stack.py)."""
    d = _read(REPO_ROOT / GPU_DIR / "gpu_llm_stack.json")
    peak = d["peak_tflops"]
    lines = [f"**{UNVERIFIABLE}** (`{GPU_DIR}/gpu_llm_stack.json`, `{GPU_DIR}/llm_stack_compile.txt`).", "",
             "| | plain stack TFLOP/s (MFU) | harness, whole step (MFU) | ratio | harness, forward + backward only "
             "(MFU) | ratio |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        p, h = r["plain"], r["harness"]
        lines.append(f"| {'`--compile`' if r['compile'] else 'eager'} | {p['tflops']:.1f} ({p['tflops'] / peak:.1%}) | "
                     f"{h['tflops']:.1f} ({h['tflops'] / peak:.1%}) | {h['tflops'] / p['tflops']:.2f} | "
                     f"{h['fwd_bwd_tflops']:.1f} ({h['fwd_bwd_tflops'] / peak:.1%}) | "
                     f"{h['fwd_bwd_tflops'] / p['tflops']:.2f} |")
    text = REPO_ROOT / GPU_DIR / "llm_stack_compile.txt"
    if text.is_file():
        # the printed table of a second call with --compile (its fwd+bwd column was not measured then)
        for line in text.read_text().splitlines():
            f = line.split()
            if len(f) >= 6 and f[0] in ("False", "True"):
                lines.append(f"| {'`--compile`' if f[0] == 'True' else 'eager'} (second call) | {f[1]} ({f[2]}) | "
                             f"{f[3]} ({f[4]}) | {f[5]} | not measured | - |")
    return "\n".join(lines)


@table("h100-kernel-sweep")
def h100_kernel_sweep() -> str:
    """One line: what the committed kernel sweep holds."""
    return kernel_sweep(KERNELS)


def kernel_sweep(path: str) -> str:
    """One line: what the kernel sweep at `path` holds."""
    k = _read(REPO_ROOT / path)
    best = max(r["tflops"] for r in k["gemm"])
    bw = max(r["gbps"] for r in k["memory_bound"])
    return (f"{len(k['gemm'])} bf16 GEMM shapes (best {best:.0f} TFLOP/s), {len(k['attention'])} attention entries, "
            f"{len(k['memory_bound'])} memory-bound entries (best {bw:,.0f} GB/s), host launch "
            f"{k['launch']['host_per_kernel_s'] * 1e6:.1f} us per kernel; {k['elapsed_s']:.0f} s of GPU time "
            f"({k['device']['name']}, torch {k['torch']}, CUDA {k['cuda']}, {k['date'][:10]})")


def _file_facts(path: Path) -> dict:
    """What a GPU output file that is not a run record says about where it came from."""
    if path.suffix in (".txt", ".md"):
        first = path.read_text().splitlines()[:1]
        if first and first[0].startswith("provenance: "):
            return json.loads(first[0].removeprefix("provenance: "))
        return {}
    d = _read(path)
    if isinstance(d, list):  # gpu_figures.json: one row per run, each with its own provenance
        provs = [r.get("provenance") or {} for r in d]
        return {k: v for k, v in provs[0].items() if all(p.get(k) == v for p in provs)} if provs else {}
    if d.get("provenance"):
        return dict(d["provenance"])
    dev = d.get("device")
    facts = {"torch": d.get("torch"), "cuda": d.get("cuda"),
             "gpu_name": dev.get("name") if isinstance(dev, dict) else d.get("device_name") or
             (dev if isinstance(dev, str) and not dev.startswith(("cuda", "cpu")) else None),
             "gpu_memory_bytes": dev.get("memory_bytes") if isinstance(dev, dict) else None}
    return {k: v for k, v in facts.items() if v is not None}


def _provenance_row(name: str, prov: dict) -> str:
    def cell(k: str) -> str:
        v = prov.get(k)
        if v is None:
            return "-"
        if k == "commit":
            return f"`{v[:10]}`" + (" (dirty)" if prov.get("dirty") else "")
        if k == "gpu_memory_bytes":
            return f"{v / GiB:.1f} GiB"
        return f"`{v}`" if k == "command" else str(v)

    lacking = [f for f in missing(prov) if f != "dirty" or prov.get("commit") is None]
    status = "complete" if not lacking else f"{UNVERIFIABLE}: lacks {', '.join(lacking)}"
    return (f"| `{name}` | {cell('torch')} | {cell('cuda')} | {cell('driver')} | {cell('gpu_name')} | "
            f"{cell('gpu_memory_bytes')} | {cell('commit')} | {cell('command')} | {status} |")


@table("gpu-provenance")
def gpu_provenance() -> str:
    """Every GPU record and profile: what it records about where it came from."""
    lines = ["| record | torch | CUDA | driver | GPU | GPU memory | commit | command | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    root = REPO_ROOT / GPU_DIR
    records = [*all_runs(), *rerun_records()]
    for r in records:
        lines.append(_provenance_row(r["path"].removeprefix(GPU_DIR + "/") + "/", r["provenance"]))
    folders = {REPO_ROOT / r["path"] for r in records}
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".txt", ".md")
                    and p.name != "README.md" and not any(d in p.parents for d in folders)):
        lines.append(_provenance_row(_rel(f).removeprefix(GPU_DIR + "/"), _file_facts(f)))
    for sweep in KERNEL_SWEEPS:
        lines.append(_provenance_row(sweep, _file_facts(REPO_ROOT / sweep)))
    from simulator.calibrate import Profile

    prof = Profile.load(REPO_ROOT / PROFILE).provenance
    lacking = sum(x != "complete" for x in prof.get("runs_provenance", ["unknown"] * len(prof.get("runs", []))))
    code = prof.get("code") or {}
    lines += ["", f"`{PROFILE}` was fitted by `{(code.get('commit') or 'an unrecorded commit')[:10]}`"
              f"{' (dirty)' if code.get('dirty') else ''} from {len(prof.get('runs', []))} runs, {lacking} of them "
              f"without provenance: it is as {UNVERIFIABLE.split(' (')[0]} as they are.",
              "",
              f"Fields: those a GPU figure needs ({', '.join(GPU_FIELDS)}); `-`: not recorded. Where a record's "
              "`config.json` has no provenance, torch, its CUDA build tag, the GPU name and the device memory "
              "its memory check saw are read from its `summary.json` (`omnibench.provenance.record_provenance`); "
              "nothing is taken from outside the record."]
    return "\n".join(lines)


@table("h100-ablation")
def h100_ablation() -> str:
    """What each choice of the kernel model costs in error on the runs it was written against."""
    import importlib.util

    script = REPO_ROOT / "benchmarks" / "h100_runs_ablation.py"
    spec = importlib.util.spec_from_file_location("h100_runs_ablation", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rs, _ = _seen(modelled())
    workloads = sorted({r["workload"] for r in rs}, key=lambda w: w != "text_only")
    lines = ["| variant | mean \\|error\\| | " + " | ".join(workloads) + " |",
             "|---|---|" + "---|" * len(workloads)]
    for label, vals in mod.ablation([str(REPO_ROOT / r["path"]) for r in rs]):
        errs = {r["path"]: v.error for r, v in zip(rs, vals, strict=True)}
        mae = sum(abs(e) for e in errs.values()) / len(errs)
        cells = [_span([errs[r["path"]] for r in rs if r["workload"] == w], "+.0%") for w in workloads]
        lines.append(f"| {label} | {mae:.1%} | " + " | ".join(cells) + " |")
    lines += ["", f"`python benchmarks/h100_runs_ablation.py` on `{STACK_MODEL_SEEN}` ({_count(rs)}; "
              f"{UNVERIFIABLE}); one choice changed at a time against the full model."]
    return "\n".join(lines)


def _op_profile_measured(path: Path) -> list[dict]:
    """Per shape of gpu_op_profile.py's output: CUDA kernel ms per phase and category, with the
    profiler's own FWD range (printed as the line `FWD <ms> FWD`, not a kernel) taken out."""
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
        elif out and line.startswith("FWD ") and line.endswith(" FWD") and "range" not in out[-1]:
            out[-1]["range"] = float(line.split()[1])
    return out


@table("h100-op-profile")
def h100_op_profile() -> str:
    """Kernel time per phase measured by torch.profiler (results/gpu/op_profile.txt) against the kernel model."""
    from dataclasses import replace
    from types import SimpleNamespace

    from omnibench.specs.presets import get_model
    from simulator.flops import llm_work, vision_work
    from simulator.hardware import load_cluster
    from simulator.kernels import llm_pass, load_kernel_profile
    from simulator.work import eager_stack

    # the shapes benchmarks/gpu_op_profile.py runs
    spec = get_model("omni-7b@4L")
    cluster = load_cluster(HARDWARE, 1)
    prof = load_kernel_profile(cluster.kernels, cluster.gpu.peak_flops)
    one_rank = SimpleNamespace(fsdp=False, fsdp_size=1, tp=1)  # no FSDP: fp32 weights under autocast
    works = {"LLM 4 layers + chunked loss, 2 x 8,192 tokens": ("llm", llm_work(spec.llm, [8192, 8192],
                                                                              range(spec.llm.layers), True, True)),
             "ViT 32 layers, 19,872 patches in 12 groups of 1,656": ("vision", vision_work(spec.vision, [(2, 36, 46)] * 6))}
    measured = _op_profile_measured(REPO_ROOT / GPU_DIR / "op_profile.txt")
    lines = ["| shape | phase | measured ms (GEMM / attention / other) | kernel model ms | error |", "|---|---|---|---|---|"]
    for (label, (module, work)), m in zip(works.items(), measured, strict=True):
        # the engine's own description of how this project runs the module on one rank
        shape = replace(work.shape, stack=eager_stack(spec, module, one_rank))
        for phase, passes in (("FWD", "fwd"), ("BWD", "bwd")):
            other = m[f"{phase}.mem"] - (m.get("range", 0.0) if phase == "FWD" else 0.0)
            total = m[f"{phase}.gemm"] + m[f"{phase}.attn"] + other
            sim = llm_pass(prof, shape, passes) * 1e3
            lines.append(f"| {label if phase == 'FWD' else ''} | {'forward' if phase == 'FWD' else 'backward'} | "
                         f"{total:.1f} ({m[f'{phase}.gemm']:.1f} / {m[f'{phase}.attn']:.1f} / {other:.1f}) | "
                         f"{sim:.1f} | {sim / total - 1:+.1%} |")
    lines += ["", f"Measured: `{GPU_DIR}/op_profile.txt` ({UNVERIFIABLE}); kernel model: "
              "`simulator/kernels.py::llm_pass` on the same shapes with the eager stack of one rank."]
    return "\n".join(lines)


RECORDS_1127 = "results/gpu/2026-11-27-h100"


def _prov_line(prov: dict) -> str:
    commit = prov.get("commit") or "no commit"
    return (f"{prov.get('gpu_name')}, driver {prov.get('driver')}, torch {prov.get('torch')}, CUDA {prov.get('cuda')}, "
            f"commit `{commit[:10]}`{' with uncommitted changes' if prov.get('dirty') else ''}: `{prov.get('command')}`")


def _resolution(tries: list[dict]) -> float:
    shares = sorted({t["share"] for t in tries})
    return min(b - a for a, b in zip(shares, shares[1:], strict=False))


@table("h100-allocator")
def h100_allocator() -> str:
    """The caching allocator under memory pressure, measured on this runtime's steps (gpu_allocator.py)."""
    d = _read(REPO_ROOT / RECORDS_1127 / "allocator" / "gpu_allocator.json")
    lines = ["| Plan | allocated peak GiB | unpressured reserve / allocated | outside the allocator GiB | "
             "need under pressure / allocated | Y / X at the failed caps (their OOM messages) |", "|---|---|---|---|---|---|"]
    from simulator.memory import oom_figures

    for c in d["cases"]:
        # from each failure's message: the record's file read memory_allocated() after unwinding
        got = [oom_figures(f["message"]) for f in c["at_failure"]]
        fails = [g["stranded"] / g["allocated"] for g in got if g]
        lines.append(f"| {c['workload']}, {c['model']}, recompute {c['recompute']} | "
                     f"{c['uncapped']['max_allocated'] / GiB:.2f} | {c['unpressured_reserve_ratio']:.3f} | "
                     f"{c['outside_allocator_bytes'] / GiB:.2f} | {1 + c['stranded_share']:.4f} (stranded "
                     f"{c['stranded_share']:.1%}; reproduced: {'yes' if c['need_reproduced'] else 'no'}) | "
                     f"{_span([100 * x for x in fails], '.1f')}% |")
    lines += ["", f"Capacity torch reports: {d['total_memory_bytes']:,} bytes ({d['total_memory_gib']:.2f} GiB). "
              f"{len(d['cases'])} Plans, {d['cases'][0]['steps']} steps replayed at every cap after one warm-up step, "
              f"caps bisected to {_resolution(d['cases'][0]['tries']):.3%} of the allocated peak. The outside "
              f"figure of the second Plan was read in a process that had run the first. "
              f"{_prov_line(d['provenance'])} (`{RECORDS_1127}/allocator/gpu_allocator.json`)."]
    return "\n".join(lines)


def _llm_stack_case(a: dict) -> str:
    """gpu_llm_stack.py's case from its arguments: layers, tokens, sequence length, timed steps."""
    return (f"{a['layers']} Qwen2-7B layers, {a['tokens']:,} tokens per step in sequences of {a['seq']:,}, "
            f"{a['steps']}")


@table("h100-llm-stack-vs-plain")
def h100_llm_stack_vs_plain() -> str:
    """The LLM-only step against the plain bf16 stack, with provenance, and the plain stack under autocast."""
    d = _read(REPO_ROOT / RECORDS_1127 / "llm_stack" / "gpu_llm_stack.json")
    peak = d["peak_tflops"]
    lines = ["| | plain stack, bf16 weights | plain stack, fp32 weights under autocast | harness, whole step | "
             "harness, forward + backward | harness / plain | harness / plain under autocast |",
             "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        p, a, h = r["plain"], r.get("plain_autocast"), r["harness"]

        def cell(x):
            return f"{x:.1f} TFLOP/s ({x / peak:.1%})"

        under = f"{h['tflops'] / a['tflops']:.2f}" if a else "-"
        lines.append(f"| {'`--compile`' if r['compile'] else 'eager'} | {cell(p['tflops'])} | "
                     f"{cell(a['tflops']) if a else 'not measured'} | {cell(h['tflops'])} | {cell(h['fwd_bwd_tflops'])} | "
                     f"{h['tflops'] / p['tflops']:.2f} | {under} |")
    lines += ["", f"{_llm_stack_case(d['args'])} timed steps; MFU against {peak:.0f} TFLOP/s. The compiled row was not measured: "
              f"torch.compile of both stacks outlasted the part's 210 s. {_prov_line(d['provenance'])} "
              f"(`{RECORDS_1127}/llm_stack/gpu_llm_stack.json`)."]
    return "\n".join(lines)


@table("h100-stack-summary")
def h100_stack_summary() -> str:
    """One line: the figures of the records with provenance (the LLM-only step, the CUDA default) and the
    whole training step against the plain stack's (h100-whole-step)."""
    by_name = {r["path"]: r["summary"] for r in runs()}
    text = by_name["results/gpu/runs-2026-11-27/homogeneous-text_only"]
    default = by_name["results/gpu/runs-2026-11-28/colocated-mixed_video"]
    d = _read(REPO_ROOT / RECORDS_1128 / "llm_stack_master" / "gpu_llm_stack.json")
    row = next(r for r in d["rows"] if not r["compile"])
    base, peak = row["plain_step"]["tflops"], d["peak_tflops"]
    master, autocast = row["harness_master"]["tflops"], row["harness"]["tflops"]
    return (f"LLM-only {text['mfu']:.1%} MFU ({text['model']}, {text['mean_step_time_s'] * 1e3:.0f} ms per step); the "
            f"harness's whole training step {master / base:.3f} of a plain bf16 stack's whole step measured beside it "
            f"({master / peak:.1%} MFU) under `--mixed-precision master`, {autocast / base:.3f} under the default "
            f"autocast; the CUDA default on mixed_video {default['mfu']:.1%} MFU ({default['model']}, recompute "
            f"{default['recompute']})")


RECORDS_1127_B = "results/gpu/2026-11-27-h100-b"
RECORDS_1128 = "results/gpu/2026-11-28-h100"
# gpu_memory_phases.py's cases, in the order the table shows them, and what each run differs in
PHASE_FILES = [("llm", ""), ("mm", ""), ("omni-default", ""), ("mm-eager", "CUDA_MODULE_LOADING=EAGER"),
               ("mm-nchannels2", "NCCL_MAX_NCHANNELS=2")]
PHASES = ["CUDA context", "first bf16 GEMM", "NCCL process group", "model + optimizer built", "step 0"]


def _phases(name: str) -> dict:
    return _read(REPO_ROOT / RECORDS_1127_B / "phases" / f"memory_phases-{name}.json")


def nccl_group_costs() -> dict[str, float]:
    """From the NCCL log (results/gpu/2026-11-27-h100-b/nccl_groups.log, `benchmarks/gpu_nccl_memory.py`
    measures the same): the first process group and each further one-member group, GiB outside the allocator."""
    text = (REPO_ROOT / RECORDS_1127_B / "nccl_groups.log").read_text()
    outside = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^\s*(.+?): in use [0-9.]+ reserved [0-9.]+ outside ([0-9.]+)",
                                                                            text, re.M)}
    groups = sorted((int(k.split()[1]), v) for k, v in outside.items() if re.fullmatch(r"new_group \d+", k))
    steps = [b - a for (_, a), (_, b) in zip([(-1, outside["default pg all_reduce"])] + groups[:-1], groups, strict=True)]
    return {"context": outside["context"], "first": outside["default pg all_reduce"] - outside["context"],
            "per_group": sum(steps) / len(steps), "per_group_min": min(steps), "per_group_max": max(steps),
            "groups": len(steps)}


@table("h100-outside-allocator")
def h100_outside_allocator() -> str:
    """What this runtime's process holds on the GPU outside the caching allocator, phase by phase
    (gpu_memory_phases.py), and what one NCCL communicator costs (the NCCL log)."""
    lines = ["| Plan | setting | " + " | ".join(PHASES) + " | last step | growth after step 0 |",
             "|---|---|" + "---|" * (len(PHASES) + 2)]
    provs = []
    for name, setting in PHASE_FILES:
        d = _phases(name)
        by = {r["phase"]: r["outside"] / GiB for r in d["phases"]}
        steps = [r for r in d["phases"] if r["phase"].startswith("step ")]
        system, workload, model, recompute, _ = d["spec"]
        lines.append(f"| {system}, {workload}, {model}, recompute {recompute} | {setting or 'defaults'} | "
                     + " | ".join(f"{by[p]:.2f}" for p in PHASES)
                     + f" | {steps[-1]['outside'] / GiB:.2f} ({steps[-1]['phase']}) | "
                     f"{d['outside_growth_after_step0_bytes'] / GiB:+.2f} |")
        provs.append(d["provenance"])
    n = nccl_group_costs()
    p = provs[0]
    lines += ["", f"GiB outside the allocator (the driver's in-use figure, `mem_get_info`, less `memory_reserved`), "
              f"read after each phase of one process. One NCCL process group in a world of one (`nccl_groups.log`): "
              f"the first {n['first']:.2f} GiB, each of {n['groups']} further one-member groups created with "
              f"`device_id` given {n['per_group']:.3f} GiB ({n['per_group_min']:.3f}-{n['per_group_max']:.3f}). "
              f"{_prov_line(p)} (`{RECORDS_1127_B}/phases/`); the NCCL_MAX_NCHANNELS=2 row ran on the same tree, "
              f"carried without its manifest, so its record reads `{provs[-1]['commit'][:10]}` with uncommitted changes."]
    return "\n".join(lines)


@table("h100-chunk-profile")
def h100_chunk_profile() -> str:
    """One profiled step of encoder chunking against block recomputation (gpu_chunk_profile.py), before
    (2026-11-27) and after (2026-11-28) the chunks' host synchronisations were taken out."""
    lines = ["| records | variant | step wall s (profiled) | GPU busy s | GPU idle s | kernels | host synchronisations | "
             "host CPU s (profiler's self CPU total) | vision forward s | vision backward s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    provs = []
    for records in (RECORDS_1127_B, RECORDS_1128):
        d = _read(REPO_ROOT / records / "chunk_profile" / "chunk_profile.json")
        for v in d["variants"]:
            cpu = re.search(r"Self CPU time total: ([0-9.]+)(ms|s)", v["top_ops"])
            cpu_s = float(cpu.group(1)) / (1000 if cpu.group(2) == "ms" else 1) if cpu else float("nan")
            spans = v["span_seconds_by_module"]
            lines.append(f"| {records.removeprefix('results/gpu/')} | "
                         f"{v['variant']} (recompute {v['recompute']}) | {v['wall_s']:.2f} | {v['gpu_busy_s']:.2f} | "
                         f"{v['gpu_idle_s']:.2f} | {v['kernels']:,} | {sum(v['host_syncs'].values()):,} | {cpu_s:.2f} | "
                         f"{spans.get('vision:forward', 0):.2f} | {spans.get('vision:backward', 0):.2f} |")
        provs.append(f"{_prov_line(d['provenance'])} (`{records}/chunk_profile/chunk_profile.json`)")
    system, workload, model = d["case"]
    lines += ["", f"{system}, {workload}, {model}, {d['tokens']:,} tokens per step; one step after two warm-up steps, "
              f"under torch.profiler (CPU + CUDA). GPU busy: the union of the kernels' intervals. " + "; ".join(provs) + "."]
    return "\n".join(lines)


@table("h100-whole-step")
def h100_whole_step() -> str:
    """The LLM-only whole training step (AdamW included) of the harness under both ways of
    holding one rank's weights, against a plain bf16 stack's whole step measured in the same command."""
    return whole_step(RECORDS_1128)


def whole_step(records: str) -> str:
    """gpu_llm_stack.py --optimizer's record of `records`, as a table."""
    d = _read(REPO_ROOT / records / "llm_stack_master" / "gpu_llm_stack.json")
    peak = d["peak_tflops"]
    (row,) = [r for r in d["rows"] if not r["compile"]]
    base = row["plain_step"]["tflops"]
    lines = ["| step | what it holds | TFLOP/s | MFU | / plain whole step | ms per step | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    parts = [("plain stack, forward + backward", "bf16 weights, no optimizer", row["plain"]),
             ("plain stack, forward + backward", "fp32 weights under autocast, no optimizer", row["plain_autocast"]),
             ("plain stack, whole step", "bf16 weights, fp32 master, fused AdamW", row["plain_step"]),
             ("plain stack, whole step", "fp32 weights under autocast, fused AdamW", row["plain_autocast_step"]),
             ("harness, whole step", "`--mixed-precision autocast` (the default)", row["harness"]),
             ("harness, whole step", "`--mixed-precision master`", row["harness_master"])]
    for step, held, m in parts:
        lines.append(f"| {step} | {held} | {m['tflops']:.1f} | {m['tflops'] / peak:.1%} | {m['tflops'] / base:.3f} | "
                     f"{m['step_s'] * 1e3:.1f} | {m['peak_gib']:.1f} |")
    lines += ["", f"{_llm_stack_case(d['args'])} timed steps after warm-up, eager; TFLOP/s counts the forward and backward matmul FLOPs alone "
              f"(the optimizer's are not counted in any row); MFU against {peak:.0f} TFLOP/s. "
              f"{_prov_line(d['provenance'])} (`{records}/llm_stack_master/gpu_llm_stack.json`)."]
    return "\n".join(lines)


@table("h100-allgather-attention")
def h100_allgather_attention() -> str:
    """All-gather-KV context parallelism's attention on the GPU, bf16, against fp32 full attention."""
    d = _read(REPO_ROOT / RECORDS_1128 / "allgather_attention" / "gpu_allgather_attention.json")
    lines = ["| backend | members k | heads (q / kv) | sequences in the row | out | dq | dk | dv | within tolerance |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in d["cases"]:
        e = c.get("errors")
        cells = " | ".join(f"{e[n]:.1e}" for n in ("out", "dq", "dk", "dv")) if e else f"failed: {c['error']} | | |"
        lines.append(f"| {c['backend']} | {c['k']} | {c['heads']} / {c['kv_heads']} | "
                     f"{', '.join(f'{n:,}' for n in c['lengths'])} | {cells} | {'yes' if c['ok'] else 'no'} |")
    lines += ["", f"Largest error relative to the reference's largest value, tolerance {d['tolerance']:.0e}; one "
              f"process plays every member (its zigzag queries, the row's K/V in gather order, indexed as "
              f"`AllGatherKVAttention` does); head dim 128. {_prov_line(d['provenance'])} "
              f"(`{RECORDS_1128}/allgather_attention/gpu_allgather_attention.json`)."]
    return "\n".join(lines)


MIXED_PRECISION_RUNS = ("runs-2026-11-28/colocated-mixed_video-4L-autocast", "runs-2026-11-28/colocated-mixed_video-4L-master")


@table("h100-mixed-precision-runs")
def h100_mixed_precision_runs() -> str:
    """mixed_video on one H100 under both ways of holding the weights: step, MFU, peak, and the memory
    estimate (simulator/calibrate.py memory_check) against the peak."""
    from simulator.calibrate import memory_check

    by_name = {r["path"]: r for r in runs()}
    lines = ["| `--mixed-precision` | record | ms per step | MFU | peak allocated GiB | estimate GiB | estimate / peak |",
             "|---|---|---|---|---|---|---|"]
    for name in MIXED_PRECISION_RUNS:
        path = f"{GPU_DIR}/{name}"
        s = by_name[path]["summary"]
        m = memory_check(str(REPO_ROOT / path), "h100")
        held = json.loads((REPO_ROOT / path / "config.json").read_text())["run"]["mixed_precision"]
        lines.append(f"| {held} | `{name}` | {s['mean_step_time_s'] * 1e3:.0f} | {s['mfu']:.1%} | "
                     f"{m.measured_bytes / GiB:.1f} | {m.estimated_bytes / GiB:.1f} | {m.ratio:.3f} |")
    s = by_name[f"{GPU_DIR}/{MIXED_PRECISION_RUNS[0]}"]["summary"]
    lines += ["", f"colocated, {s['model']}, recompute {s['recompute']}, 5 steps (the first untimed), the same batches; "
              f"the commands are in each record (`results/gpu/README.md`)."]
    return "\n".join(lines)


@table("h100-nccl-memory")
def h100_nccl_memory() -> str:
    """What one NCCL communicator holds outside the allocator, per setting (benchmarks/gpu_nccl_memory.py)."""
    d = _read(REPO_ROOT / RECORDS_1128 / "nccl_memory" / "nccl_memory.json")
    names = {"defaults": "defaults (`device_id` given: every group's communicator created at once)",
             "LAZY=1": "no `device_id`: communicators created at a group's first collective"}
    lines = ["| setting | NCCL | CUDA context GiB | first group GiB | per further group, created GiB | "
             "per further group, after its first all-reduce GiB |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {names.get(r['setting'], '`' + r['setting'] + '`')} | {r['nccl']} | {r['context_gib']:.3f} | "
                     f"{r['first_group_gib']:.3f} | {r['per_group_created_gib']:.3f} | {r['per_group_used_gib']:.3f} |")
    lines += ["", f"One process per setting, a world of one rank, {d['groups']} further one-member groups; GiB outside "
              f"the caching allocator (`mem_get_info` in use less `memory_reserved`). {_prov_line(d['provenance'])} "
              f"(`{RECORDS_1128}/nccl_memory/nccl_memory.json`)."]
    return "\n".join(lines)

"""Tables from the first H200's records (results/gpu/runs-2026-11-29-h200, 2026-11-29-h200,
results/calibration/h200-kernels.json): the simulator's H200 checked on runs it never saw, under the
machine model it had (the H100's measured kernels, element-wise work at the HBM3e's bandwidth) and the
H200's own measured kernels; the kernel sweep beside the H100's, shape by shape; the LLM-only step.

Every H200 run but the default repeats an H100 record's command (`h100_twin`), so each H200/H100 ratio
is like for like in the Plan; the H100 records ran older code (the table names their commits).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from functools import lru_cache

from omnibench.tables import TableError, table
from omnibench.tables.gpu import (
    KERNELS,
    REPO_ROOT,
    GiB,
    _mae,
    _read,
    _validations,
    _verification,
    all_runs,
    kernel_sweep,
    modelled,
    plan_label,
    rerun_records,
    whole_step,
)

RECORDS_1129 = "results/gpu/2026-11-29-h200"
# three of the first H200 runs' commands again, at a later commit (a regression check of the CUDA path;
# kept out of `runs*/` so the tables above read the first runs alone)
RERUNS = "results/gpu/2026-11-29-h200-b/runs"
H200_KERNELS = "results/calibration/h200-kernels.json"
HARDWARE = "h200"
# the H200 as the simulator modelled it before its own sweep: the H100's measured kernels, element-wise
# work faster by the datasheets' bandwidths (4.8 / 3.35 TB/s), GEMMs and attention at the H100's rates
BEFORE_MEMORY_SCALE = 4.8 / 3.35


def h200_runs() -> list[dict]:
    return [r for r in all_runs() if r["gpu"] == "H200"]


def _before():
    """The h200 preset with the kernel model it had until 2026-11-29."""
    from simulator.hardware import load_cluster

    c = load_cluster(HARDWARE, 1)
    return replace(c, kernels="h100-measured", gpu=replace(c.gpu, kernel_memory_scale=BEFORE_MEMORY_SCALE))


@lru_cache(maxsize=2)
def _checks(before: bool) -> dict[str, object]:
    """run path -> simulator.calibrate.Validation of each H200 run under one of the two machine models."""
    from simulator.calibrate import validate

    rs = h200_runs()
    got = validate([str(REPO_ROOT / r["path"]) for r in rs], None, _before() if before else HARDWARE)
    return {r["path"]: v for r, v in zip(rs, got, strict=True)}


@lru_cache(maxsize=1)
def _memory() -> dict[str, object]:
    from simulator.calibrate import memory_check

    return {r["path"]: memory_check(str(REPO_ROOT / r["path"]), HARDWARE) for r in h200_runs()}


def _same_command(r: dict) -> tuple:
    """What a repeated command keeps: the system (one GPU's Plan is the same for every system only up to
    the encoders' data-parallel mode and assignment), the Plan, the way one rank holds its weights."""
    return r["system"], plan_label(r), r["mixed_precision"]


def h100_twin(r: dict) -> dict | None:
    """The H100 record whose command this H200 run repeated (with provenance; the latest), if any."""
    twins = [x for x in modelled() if _same_command(x) == _same_command(r) and x["provenance"].get("commit")]
    return twins[-1] if twins else None


def _host_bound(r: dict) -> bool:
    # encoder chunking: 8x the kernels and a host sync per chunk (h100-chunk-profile), a host the kernel
    # model does not cost; both GPUs read it about 45% under
    return bool(r["chunk"])


def _host_modelled() -> list[dict]:
    """The H200 runs whose host the simulator models: the ones its error is summed over."""
    return [r for r in h200_runs() if not _host_bound(r)]


@table("h200-held-out")
def h200_held_out() -> str:
    """The H200 runs against the simulator under both machine models, and the H200/H100 step ratios."""
    before, now, h100 = _checks(True), _checks(False), _validations(None)
    lines = ["| Plan | H200 step s | before: simulated s (error) | H200 kernels: simulated s (error) | "
             "H100 step s (its commit) | H100 / H200 measured | simulated before | simulated now |",
             "|---|---|---|---|---|---|---|---|"]
    for r in h200_runs():
        b, n = before[r["path"]], now[r["path"]]
        twin = h100_twin(r)
        t = h100.get(twin["path"]) if twin else None
        ratio = (f"{t.measured_s:.3f} (`{twin['provenance']['commit'][:7]}`) | {t.measured_s / n.measured_s:.3f} | "
                 f"{t.simulated_s / b.simulated_s:.3f} | {t.simulated_s / n.simulated_s:.3f}") if t else "- | - | - | -"
        mark = " (host-bound)" if _host_bound(r) else ""
        lines.append(f"| {plan_label(r)}{mark} | {n.measured_s:.3f} | {b.simulated_s:.3f} ({b.error:+.1%}) | "
                     f"{n.simulated_s:.3f} ({n.error:+.1%}) | {ratio} |")
    kept = _host_modelled()

    def worst(vals):
        return max((vals[r["path"]].error for r in kept), key=abs)

    lines += ["", f"Over the {len(kept)} Plans whose host the simulator models: mean |error| {_mae(kept, before):.1%} "
              f"(worst {worst(before):+.1%}) before, {_mae(kept, now):.1%} (worst {worst(now):+.1%}) with the H200's "
              "kernels. "
              "Before: the H100's measured kernels (`h100-measured`), element-wise work "
              f"{BEFORE_MEMORY_SCALE:.3f}x faster (4.8 / 3.35 TB/s), nothing fitted to an H200; now: the H200's own sweep "
              f"(`{H200_KERNELS}`), nothing fitted to these runs either. Step times: medians over each run's steps "
              "after the first (`python -m omnibench validate results/gpu/runs-2026-11-29-h200/* --hardware h200`); "
              "the H100 column is the record whose command the H200 run repeated, and its simulated ratios use the "
              "H100's measured kernels. The H100 records ran older code (their commits): a measured ratio holds "
              "what changed in the runtime between them, so it is like for like in the Plan, not in the code. "
              "Host-bound: encoder chunks of 4,096 patches run 8x the kernels with a host sync per chunk "
              "(h100-chunk-profile), which the kernel model does not cost; its H100 record predates the cut of "
              "those syncs (1,315 -> 75, h100-chunk-profile), so its measured ratio mixes that cut with the GPU. "
              f"{_verification(h200_runs())}"]
    return "\n".join(lines)


@table("h200-memory")
def h200_memory() -> str:
    """The simulator's allocated peak against max_memory_allocated on the H200, and the H100 twin's peak."""
    mem = _memory()
    lines = ["| Plan | measured peak GiB | estimate GiB | estimate / measured | H100 peak GiB (same Plan) |",
             "|---|---|---|---|---|"]
    for r in h200_runs():
        m = mem[r["path"]]
        twin = h100_twin(r)
        peak = f"{twin['summary']['peak_memory_bytes'] / GiB:.2f}" if twin else "-"
        lines.append(f"| {plan_label(r)} | {m.measured_bytes / GiB:.2f} | {m.estimated_bytes / GiB:.2f} | "
                     f"{m.ratio:.3f} | {peak} |")
    lines += ["", "Peaks: the largest per-step peak after the first step (max allocated, reset every step), and the "
              "simulator's live tensors for the same steps' Plans (`simulator.calibrate.memory_check`); the fits "
              "check adds the allocator's stranded share and what lives outside it."]
    return "\n".join(lines)


def _ratios(section: str, keep=lambda r: True) -> list[float]:
    """H100 time / H200 time for every entry of `section` both sweeps measured."""
    def key(r):
        if section == "gemm":
            return (r["m"], r["n"], r["k"], r["op"], r.get("origin"))
        if section == "attention":
            return (r["impl"], r["pass"], r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"])
        return (r["op"], r["numel"])

    a = {key(r): r for r in _read(REPO_ROOT / KERNELS)[section]}
    b = {key(r): r for r in _read(REPO_ROOT / H200_KERNELS)[section]}
    return [a[k]["time_s"] / b[k]["time_s"] for k in a if k in b and keep(a[k]) and b[k]["time_s"] > 0]


@table("h200-kernels")
def h200_kernels() -> str:
    """The two sweeps shape by shape: how much faster the H200 ran each kind of kernel."""
    def row(what, rs, assumed):
        q = statistics.quantiles(rs, n=10) if len(rs) >= 2 else [rs[0]] * 9
        return f"| {what} | {len(rs)} | {statistics.median(rs):.3f} | {q[0]:.2f} to {q[-1]:.2f} | {assumed} |"

    def elementwise(r):
        return not r["op"].startswith("adamw")

    lines = ["| kernels | shapes | H100 time / H200 time, median | 10th to 90th percentile | before (scaled H100) |",
             "|---|---|---|---|---|",
             row("bf16 GEMM, under 10 GFLOP", _ratios("gemm", lambda r: r["flops"] < 1e10), "1"),
             row("bf16 GEMM, 10 GFLOP and over", _ratios("gemm", lambda r: r["flops"] >= 1e10), "1"),
             row("flash attention (SDPA, varlen), forward and backward", _ratios("attention"), "1"),
             row("element-wise, 64 MiB and over", _ratios("memory_bound", lambda r: elementwise(r) and r["bytes"] >= 2**26),
                 f"{BEFORE_MEMORY_SCALE:.3f}"),
             row("element-wise, under 64 MiB", _ratios("memory_bound", lambda r: elementwise(r) and r["bytes"] < 2**26),
                 f"{BEFORE_MEMORY_SCALE:.3f}"),
             row("AdamW (foreach, fused)", _ratios("memory_bound", lambda r: not elementwise(r)), f"{BEFORE_MEMORY_SCALE:.3f}")]
    a, b = (_read(REPO_ROOT / p)["launch"] for p in (KERNELS, H200_KERNELS))
    lines.append(f"| host time to launch one kernel | 1 | {a['host_per_kernel_s'] / b['host_per_kernel_s']:.3f} | "
                 f"{a['host_per_kernel_s'] * 1e6:.1f} us on the H100's host, {b['host_per_kernel_s'] * 1e6:.1f} us on "
                 "the H200's | 1 |")
    lines += ["", f"The same `benchmarks/gpu_kernels.py` shapes on each GPU (`{KERNELS}`, `{H200_KERNELS}`); over 1 the "
              "H200 is faster. The launch figure is the host's (a VM), not the GPU's."]
    return "\n".join(lines)


@table("h200-kernel-sweep")
def h200_kernel_sweep() -> str:
    """One line: what the committed H200 kernel sweep holds."""
    return kernel_sweep(H200_KERNELS)


@table("h200-whole-step")
def h200_whole_step() -> str:
    """The LLM-only whole training step against a plain bf16 stack's, on the H200."""
    return whole_step(RECORDS_1129)


@table("h200-summary")
def h200_summary() -> str:
    """One line for the README: the held-out check and the H200's MFU figures."""
    kept = _host_modelled()
    by_name = {r["name"]: r["summary"] for r in h200_runs()}
    text, default = by_name["homogeneous-text_only"], by_name["omni-mixed_video"]
    mae = [_mae(kept, _checks(before)) for before in (True, False)]
    return (f"on {len(kept)} H200 runs it never saw, the simulator's step time was {mae[0]:.1%} off (mean) with the "
            f"H100's kernels scaled and is {mae[1]:.1%} with the H200's own; LLM-only {text['mfu']:.1%} MFU "
            f"({text['model']}), the CUDA default on mixed_video {default['mfu']:.1%} ({default['model']}, recompute "
            f"{default['recompute']}, the depth 139.8 GiB holds)")


@table("h200-rerun")
def h200_rerun() -> str:
    """The first H200 runs' commands run again at a later commit: the CUDA path's regression check."""
    from simulator.calibrate import validate

    first = {r["name"]: r for r in h200_runs()}
    again = [r for r in rerun_records() if r["path"].startswith(RERUNS + "/")]
    unmatched = [r["path"] for r in again if r["name"] not in first]
    if unmatched:
        raise TableError(f"{RERUNS}: {', '.join(unmatched)} repeat(s) no run of the first records (a rerun is named as "
                         "the record whose command it repeats)")
    pairs = [(first[r["name"]], r) for r in again]
    checked = _checks(before=False)  # the first H200 runs, as the held-out table reads them
    got = dict(zip((r["path"] for r in again), validate([str(REPO_ROOT / r["path"]) for r in again], None, HARDWARE),
                   strict=True))
    lines = ["| Plan | first run: step s (commit) | again: step s (commit) | again / first | peak GiB, first / again "
             "| again: simulated s (error) |", "|---|---|---|---|---|---|"]
    for a, b in pairs:
        va, vb = checked[a["path"]], got[b["path"]]
        lines.append(f"| {plan_label(b)} | {va.measured_s:.3f} (`{a['provenance']['commit'][:7]}`) | {vb.measured_s:.3f} "
                     f"(`{b['provenance']['commit'][:7]}`) | {vb.measured_s / va.measured_s:.3f} | "
                     f"{a['summary']['peak_memory_bytes'] / GiB:.2f} / {b['summary']['peak_memory_bytes'] / GiB:.2f} | "
                     f"{vb.simulated_s:.3f} ({vb.error:+.1%}) |")
    lines += ["", f"Step times: medians over each run's steps after the first (`python -m omnibench validate {RERUNS}/* "
              "--hardware h200`); peaks: max allocated over the steps. Simulated: the H200's own kernels, nothing "
              f"fitted. {_verification(again)}"]
    return "\n".join(lines)

"""What a training step needs when the GPU is nearly full, against what its live tensors peak at.

The simulator decides "does it fit" as the caching allocator decides it: a step needs its allocated
peak, plus the free space stranded inside segments that still hold live blocks, plus what lives
outside the allocator (CUDA context, libraries' kernels, NCCL buffers), compared with the capacity
torch reports (`simulator/memory.py::memory_needed`, `allocator_need`). This measures all three on the
GPU at hand, with this project's own runtime step (the Executor every `omnibench run` rank runs, one
rank, in this process):

- the device: the capacity torch reports (`total_memory`, what the OOM message calls "total
  capacity") and what the driver says is in use outside the allocator once the step has run;
- the unpressured reserve: max reserved / max allocated over the same steps (the simulator's
  FRAGMENTATION compares this figure with published max_reserved peaks);
- the need under pressure: the allocator capped with `torch.cuda.set_per_process_memory_fraction`
  (a cap on the memory it reserves, as a smaller GPU would be), bisected to the smallest cap under
  which the same steps all run; need / allocated - 1 is the stranded share. At each failed cap the
  state the OOM message reports (allocated X, reserved but unallocated Y, the process's memory outside
  the allocator) is kept too, as in the public messages of results/validation/allocator_oom_messages.csv.

    python benchmarks/gpu_allocator.py --out DIR [--cases llm,mm] [--steps 3]

Each case is `omnibench run`'s step for one model, workload and recompute mode (CASES); the steps
replay the same batches at every cap, after one warm-up step that creates the optimizer's state.
Writes DIR/gpu_allocator.json (with provenance) and prints one line per case. On a machine without
CUDA (`--device cpu`, tiny presets) it runs the same steps uncapped and says that pressure cannot be
measured there (what the test checks).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.provenance import provenance  # noqa: E402
from omnibench.runtime.executor import Executor, StepState  # noqa: E402
from omnibench.runtime.launch import resolve  # noqa: E402
from omnibench.runtime.run_inputs import batch_source, parallel_spec  # noqa: E402
from omnibench.runtime.worker import loss_tokens  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402
from omnibench.specs.run import RunSpec  # noqa: E402
from simulator.memory import oom_figures  # noqa: E402
from systems import get_planner  # noqa: E402

GiB = 2**30
# name -> (system, workload, model, recompute, global batch tokens): the one-H100 Plans of
# results/gpu (an LLM step of fixed shape; an encoder + LLM step whose packed lengths change per step)
CASES = {
    "llm": ("homogeneous", "text_only", "llm-7b@4L", "none", 16384),
    "mm": ("homogeneous", "mixed_video", "omni-7b@4L", "vision=full,audio=full", 16384),
}
CPU_CASES = {
    "llm": ("homogeneous", "text_only", "tiny-llm", "none", 512),
    "mm": ("homogeneous", "mixed_video", "tiny-omni", "vision=full,audio=full", 512),
}


class Step:
    """One rank's runtime (omnibench/runtime/executor.py) over a fixed list of Plans."""

    def __init__(self, case: tuple, steps: int, device: str, encoder_chunk_tokens: int = 0):
        system, workload, model, recompute, tokens = case
        self.spec = resolve(RunSpec(system=system, workload=workload, model=model, nproc=1, steps=steps + 1,
                                    recompute=recompute, global_batch_tokens=tokens, device=device,
                                    encoder_chunk_tokens=encoder_chunk_tokens))
        self.model = get_model(self.spec.model)
        planner = get_planner(system)
        parallel = parallel_spec(self.spec, 1)
        batches = batch_source(self.spec)
        self.plans = [planner.plan(self.model, parallel, batches(i)) for i in range(steps + 1)]
        dev = torch.device(self.spec.extra["device"], 0) if self.spec.extra["device"] == "cuda" else torch.device("cpu")
        dtype = torch.bfloat16 if self.spec.extra["dtype"] == "bf16" else torch.float32
        self.ex = Executor(self.model, self.plans[0], 0, dev, dtype, self.spec.seed, self.spec.lr,
                           timedelta(seconds=120), self.spec.optimizer, recompute=self.spec.recompute,
                           encoder_chunk_tokens=max(0, self.spec.encoder_chunk_tokens))
        self.counts = [loss_tokens(p, 0) for p in self.plans]
        self.t0 = time.perf_counter()
        self.cuda = dev.type == "cuda"

    def run(self, i: int) -> None:
        self.ex.run_step(self.plans[i], self.counts[i], self.t0)
        self.ex.spans.clear()

    def forget(self) -> None:
        """What an interrupted step leaves: its activations and gradients; the weights and the
        optimizer's state stay, as they would in a training loop that caught the error."""
        self.ex.state = StepState()
        self.ex.spans.clear()
        for m in self.ex.modules.values():
            for p in m.parameters():
                p.grad = None
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def trial(step: Step, cap_bytes: float | None, total: int) -> dict:
    """The timed steps (1..n) under a cap on what the allocator may reserve; None: uncapped."""
    step.forget()
    if step.cuda:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total) if cap_bytes else 1.0)
        torch.cuda.reset_peak_memory_stats()
    out = {"cap_bytes": cap_bytes}
    try:
        for i in range(1, len(step.plans)):
            step.run(i)
        if step.cuda:
            torch.cuda.synchronize()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        # cuBLAS or NCCL may word an allocation that failed under the cap as a RuntimeError
        if not isinstance(e, torch.OutOfMemoryError) and not any(
                w in str(e) for w in ("out of memory", "ALLOC_FAILED", "OutOfMemory")):
            raise
        # the state at the failure is the message's: by the time this block runs, unwinding the step
        # has freed its autograd graph, so memory_allocated() reads less than the allocator held
        message = str(e).splitlines()[0]
        figures = oom_figures(message) or {}
        out.update(ok=False, allocated=figures.get("allocated"), stranded=figures.get("stranded"),
                   outside=figures.get("outside"), message=message[:600])
        return out
    out["ok"] = True
    if step.cuda:
        out.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved())
    return out


def bisect_need(run_at, span: float, iters: int) -> tuple[float | None, list[dict]]:
    """The smallest headroom share (of the allocated peak) under which `run_at(share)["ok"]`, to
    span / 2**iters: `span` first, doubled (up to 1) until it runs; then no headroom at all, unless a
    share already failed; then bisected between the largest share that failed and the smallest that
    ran. Returns (share or None when nothing ran, every try with its share)."""
    tries = []
    hi, lo = span, 0.0
    while True:  # a cap the steps surely run under
        t = run_at(hi)
        tries.append({**t, "share": hi})
        if t["ok"] or hi >= 1.0:
            break
        lo, hi = hi, hi * 2  # the bisection starts above a share that already failed
    if not tries[-1]["ok"]:
        return None, tries
    if lo == 0.0:  # nothing has failed yet: no headroom at all first
        t = run_at(0.0)
        tries.append({**t, "share": 0.0})
        if t["ok"]:
            return 0.0, tries
    for _ in range(iters):
        mid = (lo + hi) / 2
        t = run_at(mid)
        tries.append({**t, "share": mid})
        lo, hi = (lo, mid) if t["ok"] else (mid, hi)
    return hi, tries


def measure(name: str, case: tuple, steps: int, device: str, span: float, iters: int) -> dict:
    try:
        return _measure(name, case, steps, device, span, iters)
    finally:  # whatever happened, the next case starts with the whole GPU and this case's model gone
        gc.collect()
        if device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()


def _measure(name: str, case: tuple, steps: int, device: str, span: float, iters: int) -> dict:
    step = Step(case, steps, device)
    row = {"case": name, "system": case[0], "workload": case[1], "model": step.spec.model,
           "recompute": step.spec.recompute, "global_batch_tokens": case[4], "steps": steps,
           "llm_tokens_per_step": [sum(s.llm_tokens for s in p.samples) for p in step.plans[1:]]}
    step.run(0)  # warm-up: the optimizer's state appears at its first step
    total = torch.cuda.get_device_properties(0).total_memory if step.cuda else 0
    free = trial(step, None, total)
    row["uncapped"] = free
    if not step.cuda:
        row["pressure"] = "not measured: the caching allocator and its cap exist on CUDA only"
        return row
    alloc = free["max_allocated"]
    row["unpressured_reserve_ratio"] = free["max_reserved"] / alloc
    # Outside the allocator: what the driver reports in use beyond the allocator's reserve (context,
    # cuBLAS workspaces, NCCL), read while the uncapped reserve is still held.
    gpu_free, gpu_total = torch.cuda.mem_get_info()
    row["outside_allocator_bytes"] = (gpu_total - gpu_free) - torch.cuda.memory_reserved()

    def run_at(share: float) -> dict:
        return trial(step, alloc * (1 + share), total)

    share, tries = bisect_need(run_at, span, iters)
    row["stranded_share"] = share  # None: it did not run even at the largest headroom tried
    if share is not None:
        row["need_reproduced"] = run_at(share)["ok"]  # the answer reproduces from the same state
        row["need_bytes"] = alloc * (1 + share)
    failed = [t for t in tries if not t["ok"]]
    row["at_failure"] = [{"share": t["share"], "allocated": t["allocated"], "reserved_unallocated": t["stranded"],
                          "outside": t["outside"], "y_over_x": t["stranded"] / t["allocated"] if t["allocated"] else None,
                          "message": t["message"]} for t in failed]
    row["tries"] = [{"share": t["share"], "ok": t["ok"]} for t in tries]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--cases", default="llm,mm", help=f"of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=3, help="steps replayed at every cap (after one warm-up)")
    ap.add_argument("--span", type=float, default=0.16, help="first headroom tried, as a share of the allocated peak")
    ap.add_argument("--iters", type=int, default=7, help="bisection steps between no headroom and --span")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: device=cuda but no CUDA device is visible (--device cpu runs the steps uncapped)")
    table = CASES if a.device == "cuda" else CPU_CASES
    names = a.cases.split(",")
    bad = [n for n in names if n not in table]
    if bad:
        sys.exit(f"error: cases: {', '.join(bad)} not among {', '.join(table)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=store, timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", 0) if a.device == "cuda" else None)
    out = {"provenance": provenance(torch.cuda.get_device_name() if a.device == "cuda" else "cpu", argv and
                                    ["benchmarks/gpu_allocator.py", *argv], cuda=a.device == "cuda"),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cases": []}
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out["total_memory_bytes"] = props.total_memory
        out["total_memory_gib"] = props.total_memory / GiB
    for name in names:
        row = measure(name, table[name], a.steps, a.device, a.span, a.iters)
        out["cases"].append(row)
        line = f"{name}: {row['model']} {row['workload']} recompute={row['recompute']}"
        if a.device == "cuda":
            line += (f": allocated {row['uncapped']['max_allocated'] / GiB:.2f} GiB, unpressured reserve x"
                     f"{row['unpressured_reserve_ratio']:.3f}, outside the allocator {row['outside_allocator_bytes'] / GiB:.2f} GiB, "
                     f"need under pressure " + (f"x{1 + row['stranded_share']:.4f} (stranded {row['stranded_share']:.2%}, "
                                                 f"reproduced: {row['need_reproduced']})" if row["stranded_share"] is not None
                                                 else "not found"))
        else:
            line += f": ran uncapped ({row['pressure']})"
        print(line, flush=True)
        if a.out:  # after every case: a call cut off keeps what it measured
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "gpu_allocator.json"), "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()

"""Step figures: throughput, FLOPs and MFU, bubble fraction, exposed communication, memory.

FLOP formula: exact matmul FLOPs per module from `omnibench.specs.costs.batch_flops` (forward +
backward, attention counted per real packed sequence: s(s+1)/2 query-key pairs causal for the LLM,
s^2 per ViT frame group / audio window), summed over the step's samples. TFLOPS/GPU = FLOPs /
step time / GPUs; MFU = TFLOPS/GPU / the device's dense bf16 peak (none on CPU: MFU is left out).
"""

from __future__ import annotations

import resource

import torch

from omnibench.plan import BACKWARD, FORWARD, METADATA, OPTIMIZER_STEP, Plan
from omnibench.specs.model import MultimodalSpec

# Dense bf16 peak TFLOP/s by device name fragment (NVIDIA datasheets, SXM parts, without sparsity:
# nvidia.com/en-us/data-center/h100, /h200, /a100).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
COMPUTE_KINDS = (FORWARD, BACKWARD, OPTIMIZER_STEP)


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process high-water mark


def batch_figures(model: MultimodalSpec, plan: Plan) -> dict:
    from omnibench.specs.costs import batch_flops, frozen_flops

    frozen = set(plan.options.get("freeze", ()))  # counted as the step runs them (no weight gradients)
    flops = {k: frozen_flops(f, k) if k in frozen else f for k, f in batch_flops(model, plan.samples).items()}
    return {
        "tokens": sum(s.llm_tokens for s in plan.samples),
        "samples": len(plan.samples),
        "flops": float(sum(f.forward + f.backward for f in flops.values())),
        "flops_by_module": {k: float(f.forward + f.backward) for k, f in flops.items()},
    }


def step_metrics(step: dict, spans_by_rank: dict[int, list[dict]], world: int, peak: float | None) -> dict:
    t = step["step_time_s"]
    busy, comm = [], []
    for spans in spans_by_rank.values():
        mine = [s for s in spans if s["step"] == step["step"]]
        b = sum(s["end"] - s["start"] for s in mine if s["kind"] in COMPUTE_KINDS)
        # The loaders' metadata exchanges run on their own thread, overlapping the previous step
        # (a wait for them is already in the step time, and shows as idle).
        c = sum(s["end"] - s["start"] for s in mine if s["kind"] not in COMPUTE_KINDS and s["kind"] != METADATA)
        busy.append(b)
        comm.append(c)
    tflops = step["flops"] / t / world / 1e12 if t > 0 else 0.0
    out = {
        **{k: step[k] for k in ("step", "loss", "step_time_s", "tokens", "samples", "flops", "flops_by_module",
                                "peak_memory_bytes", "plan")},
        "tokens_per_s": step["tokens"] / t,
        "tokens_per_s_per_gpu": step["tokens"] / t / world,
        "samples_per_s": step["samples"] / t,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        # Time a rank spends outside compute actions (waiting in p2p/boundary, grad sync, or idle).
        "bubble_fraction": sum(max(0.0, 1 - b / t) for b in busy) / len(busy) if t > 0 else 0.0,
        "exposed_comm_fraction": sum(c / t for c in comm) / len(comm) if t > 0 else 0.0,
        # The planner's CPU seconds for this step (rank 0's planner thread, overlapping the previous
        # step) and what the step waited for its loading and planning (in step_time_s)
        "planning_s": step.get("planning_s", 0.0),
        "waited_s": step.get("waited_s", 0.0),
    }
    return out

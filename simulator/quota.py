"""A module's compute time on a share of the device (spatial multiplexing, systems/spatial.py).

A compute action that runs on a quota q of the device (a GPU's SMs, a CPU's intra-op threads) beside
another module is timed from its time t on the whole device and its utilisation u there: the rate it
reaches over the best rate the device's compute model knows (the kernel profile's best GEMM rate; the
efficiency curve's `peak * e_max` without one). u * t is what its FLOPs would take at that best rate,
the part of the action that needs every SM it is given; it stretches by 1/q. The rest, (1 - u) * t,
is time the action leaves SMs idle (launches, memory-bound kernels, GEMM waves that do not fill the
device, attention below the GEMM rate); it is taken as unchanged:

    t(q) = u * t / q + (1 - u) * t

so two modules side by side gain what each leaves idle, and a module that fills the device (u = 1)
runs 1/q times longer. Launch costs do not change: each lane's host thread launches its own kernels.

Unmeasured. The rule charges no interference between the lanes (shared L2 and HBM bandwidth), treats
memory-bound kernels as needing no SMs (they saturate HBM bandwidth on a fraction of them, which the
other lane's memory-bound kernels then share) and attention's shortfall from the GEMM rate as idle
SMs (flash attention keeps every SM busy at its lower rate): it leans optimistic, towards what spatial
multiplexing gains. `benchmarks/gpu_quota_sweep.py` measures a module's forward and backward on SM
partitions (green contexts) and two modules side by side on a lent GPU; until it has run, nothing
here is fitted and docs/simulator-accuracy.md says so.
"""

from __future__ import annotations

from simulator.flops import Work


def action_flops(work: Work, kind: str, recompute: str) -> float:
    """The FLOPs a forward or backward action computes (a backward's recomputation included)."""
    if kind == "forward":
        return work.matmul_flops + work.attention_flops
    out = work.backward_matmul + work.backward_attention
    if recompute != "none":
        out += work.recompute_matmul + work.recompute_attention
    return out


def utilisation(seconds: float, flops: float, best_rate: float) -> float:
    """The share of the device an action of `flops` in `seconds` keeps busy (at most 1)."""
    if seconds <= 0.0 or best_rate <= 0.0:
        return 1.0
    return min(1.0, flops / seconds / best_rate)


def quota_time(seconds: float, utilised: float, quota: float) -> float:
    """The time of an action that takes `seconds` on the whole device, `utilised` of it, on `quota` of it."""
    if quota >= 1.0:
        return seconds
    return seconds * (1.0 + utilised * (1.0 / quota - 1.0))

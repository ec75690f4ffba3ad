"""Speed of the workload generator: samples of batch metadata per second, per named workload.

    python benchmarks/bench_workloads.py                      # every named workload
    python benchmarks/bench_workloads.py --workload omni_av --batch-size 8192 --steps 10

Counts full Sample/Segment objects (what systems and the simulator consume), built for
global batches of `--batch-size` samples, over steps spread across each workload's schedule;
prints one line per workload and the slowest figure last. Single process, single thread.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workloads import WorkloadStream, workload_names  # noqa: E402


def bench(
    name: str, batch_size: int, steps: int, repeats: int, length_scale: float
) -> tuple[float, float, float, int]:
    stream = WorkloadStream(name, seed=0, global_batch_size=batch_size, length_scale=length_scale)
    stream.batch(0)  # warm: pilot draws, segment cache
    total = stream.total_steps
    step_ids = [1 + (i * (total - 1)) // max(1, steps - 1) for i in range(steps)]
    best = best_cpu = 0.0
    segs = 0
    tokens = 0
    for _ in range(repeats):
        n = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for s in step_ids:
            b = stream.batch(s)
            n += len(b.samples)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        best = max(best, n / dt)
        best_cpu = max(best_cpu, n / max(dc, 1e-9))
    for s in step_ids[:2]:
        b = stream.batch(s)
        segs += sum(len(x.segments) for x in b.samples)
        tokens += b.llm_tokens
    return best, best_cpu, segs / (2 * batch_size), tokens // (2 * batch_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", action="append", help="workload name (repeatable); default: all")
    ap.add_argument("--batch-size", type=int, default=4096, help="samples per global batch")
    ap.add_argument("--steps", type=int, default=8, help="steps per repeat, spread over the schedule")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many repeats")
    ap.add_argument("--length-scale", type=float, default=1.0)
    args = ap.parse_args()
    names = args.workload or workload_names()
    print(
        f"python {platform.python_version()} on {platform.machine()}, batch {args.batch_size} samples, "
        f"{args.steps} steps x best of {args.repeats}, length_scale {args.length_scale:g}"
    )
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall figures suffer when loaded; "
        "CPU-time figures much less)"
    )
    print(
        f"{'workload':<14}{'samples/s':>12}{'samples/CPU-s':>15}{'segments/sample':>17}{'LLM tokens/sample':>19}"
    )
    rates = {}
    for name in names:
        rate, cpu, seg, tok = bench(name, args.batch_size, args.steps, args.repeats, args.length_scale)
        rates[name] = rate
        print(f"{name:<14}{rate:>12,.0f}{cpu:>15,.0f}{seg:>17.2f}{tok:>19,}")
    slowest = min(rates, key=rates.get)
    print(f"slowest (wall): {slowest} at {rates[slowest]:,.0f} samples/s")


if __name__ == "__main__":
    main()

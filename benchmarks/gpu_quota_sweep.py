"""Kernels on a share of the device, and two of them side by side: what spatial multiplexing's quota model
(simulator/quota.py) assumes, measured (standalone: torch only).

    python benchmarks/gpu_quota_sweep.py --out quota.json                  # on a GPU, ~1 minute
    python benchmarks/gpu_quota_sweep.py --device cpu --quick --out q.json # smoke test, seconds

Imports nothing from the project, so it can be copied to a GPU machine alone. On CUDA a share is a
green context of that many SMs (`torch.cuda.green_contexts`, CUDA 12.4+); on CPU it is that share of
the intra-op threads, set on the thread that runs the kernel (OpenMP's count is per calling thread).

- ``alone``: each kernel (bf16 GEMMs of a ViT-600M and a 7B LLM layer's shapes at small and large
  token counts, causal flash attention, LayerNorm and a copy) timed on the whole device and on
  shares of it; each row holds the time, the kernel's utilisation u on the whole device (its FLOP
  rate over the best GEMM rate measured in the same run; 0 for memory-bound kernels) and what the
  quota model predicts from them, ``u * t / q + (1 - u) * t``;
- ``pairs``: a ViT-shaped and an LLM-shaped kernel chain run one after the other on the whole device
  and side by side on complementary shares, for a few splits: the measured gain of running them at
  once, beside the model's.

Timing: CUDA events around a batch of back-to-back calls after warm-up (perf_counter on CPU), the
median of ``repeats`` batches. The simulator reads nothing from this file yet: its rows say how far
the model is off, and docs/simulator-accuracy.md names the model unmeasured until a run is committed.

Output schema (``schema: "omnibench-quota-sweep/1"``)::

    {schema, device: {kind, name, multiprocessors | threads}, torch, date, quick, shares,
     best_gemm_flops, alone: [{kernel, kind, flops, bytes, share, units, time_s, full_time_s, u, model_time_s}],
     pairs: [{first, second, share_first, sequential_s, concurrent_s, gain, model_gain}],
     skipped: [{what, reason}], elapsed_s}
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from datetime import date

import torch

SCHEMA = "omnibench-quota-sweep/1"
# (name, m, n, k): tokens x out x in of a layer's linears (ViT-600M: hidden 1280, MLP 5120; 7B: 4096 / 11008)
GEMMS = [
    ("vit_fc1_2k", 2048, 5120, 1280), ("vit_fc1_16k", 16384, 5120, 1280),
    ("llm_fc1_2k", 2048, 11008, 4096), ("llm_fc1_16k", 16384, 11008, 4096),
]
SHARES = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 1.0)
SPLITS = (0.25, 0.4, 0.5)


class Device:
    """Runs a callable on a share of the device and times it."""

    def __init__(self, kind: str):
        self.kind = kind
        self.cuda = kind == "cuda"
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            self.units, self.name = props.multi_processor_count, props.name
            from torch.cuda import green_contexts

            if not green_contexts.SUPPORTED:
                raise SystemExit("this torch has no CUDA green contexts: SM shares cannot be set")
            self._contexts: dict[int, object] = {}
        else:
            self.units, self.name = torch.get_num_threads(), "cpu"

    def units_of(self, share: float) -> int:
        n = max(1, round(share * self.units))
        if self.cuda:
            n = max(8, n - n % 8)  # green contexts hand out SMs in groups (8 on Hopper)
        return min(n, self.units)

    def _context(self, units: int):
        if units not in self._contexts:
            from torch.cuda.green_contexts import GreenContext

            self._contexts[units] = GreenContext.create(num_sms=units, device_id=0)
        return self._contexts[units]

    def timed(self, fn, units: int, calls: int, repeats: int) -> float:
        """Median seconds per call of `fn` on `units` SMs (threads)."""
        return statistics.median(self._batch(fn, units, calls) for _ in range(repeats))

    def _batch(self, fn, units: int, calls: int) -> float:
        if not self.cuda:
            before = torch.get_num_threads()
            torch.set_num_threads(units)
            try:
                fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                return (time.perf_counter() - t0) / calls
            finally:
                torch.set_num_threads(before)
        full = units >= self.units
        ctx = None if full else self._context(units)
        stream = torch.cuda.current_stream() if full else ctx.Stream()
        with torch.cuda.stream(stream):
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    def side_by_side(self, first, second, units: tuple[int, int], calls: int, repeats: int) -> float:
        """Median seconds of `calls` of `first` and of `second` running at once, each on its share."""
        def once() -> float:
            if self.cuda:
                streams = [self._context(u).Stream() for u in units]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for s, fn in zip(streams, (first, second), strict=True):
                    with torch.cuda.stream(s):
                        for _ in range(calls):
                            fn()
                torch.cuda.synchronize()
                return time.perf_counter() - t0
            barrier = threading.Barrier(2)

            def lane(fn, n):
                torch.set_num_threads(n)
                barrier.wait()
                for _ in range(calls):
                    fn()

            threads = [threading.Thread(target=lane, args=(fn, u)) for fn, u in zip((first, second), units, strict=True)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - t0

        once()
        return statistics.median(once() for _ in range(repeats))


def kernels(device: str, dtype, quick: bool) -> list[tuple[str, str, float, float, object]]:
    """(name, kind, flops, bytes, callable) of every kernel swept."""
    scale = 16 if quick else 1
    out = []
    for name, m, n, k in GEMMS:
        m, n, k = max(64, m // scale), n // (scale // 2 or 1), k // (scale // 2 or 1)
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append((name, "gemm", 2.0 * m * n * k, 0.0, lambda a=a, b=b: a @ b))
    seq = 512 if quick else 8192
    q = torch.randn(1, 32 if not quick else 2, seq, 128 if not quick else 64, device=device, dtype=dtype)
    out.append((f"attention_causal_{seq}", "attention", 2.0 * 2 * q.shape[1] * seq * seq * q.shape[3] / 2, 0.0,
                lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)))
    x = torch.randn(16384 // scale, 4096 // (scale // 2 or 1), device=device, dtype=dtype)
    ln = torch.nn.LayerNorm(x.shape[1], device=device, dtype=dtype)
    out.append(("layernorm_16k", "memory", 0.0, 2.0 * x.numel() * x.element_size(), lambda x=x, ln=ln: ln(x)))
    out.append(("copy_16k", "memory", 0.0, 2.0 * x.numel() * x.element_size(), lambda x=x: x.clone()))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, few calls (a smoke test)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = Device(args.device)
    dtype = torch.bfloat16 if dev.cuda else torch.float32
    calls, repeats = (2, 2) if args.quick else (20, 5)
    shares = (0.5, 1.0) if args.quick else SHARES
    swept = kernels(args.device, dtype, args.quick)
    full = {name: dev.timed(fn, dev.units, calls, repeats) for name, _, _, _, fn in swept}
    best = max(f / full[name] for name, kind, f, _, _ in swept if kind == "gemm")
    alone, skipped = [], []
    for name, kind, flops, nbytes, fn in swept:
        u = min(1.0, flops / full[name] / best) if flops else 0.0
        for share in shares:
            units = dev.units_of(share)
            try:
                t = dev.timed(fn, units, calls, repeats)
            except RuntimeError as e:
                skipped.append({"what": f"{name} on {units} units", "reason": str(e).splitlines()[0]})
                continue
            q = units / dev.units
            alone.append({"kernel": name, "kind": kind, "flops": flops, "bytes": nbytes, "share": q, "units": units,
                          "time_s": t, "full_time_s": full[name], "u": u,
                          "model_time_s": full[name] * (1.0 + u * (1.0 / q - 1.0))})
    by_name = {name: (fn, flops) for name, _, flops, _, fn in swept}
    pairs = []
    for first, second in (("vit_fc1_2k", "llm_fc1_16k"), ("layernorm_16k", "llm_fc1_16k")):
        f1, f2 = by_name[first][0], by_name[second][0]
        sequential = calls * (full[first] + full[second])
        u1 = min(1.0, by_name[first][1] / full[first] / best) if by_name[first][1] else 0.0
        u2 = min(1.0, by_name[second][1] / full[second] / best) if by_name[second][1] else 0.0
        for split in SPLITS[:1] if args.quick else SPLITS:
            units = (dev.units_of(split), dev.units_of(1.0 - split))
            try:
                concurrent = dev.side_by_side(f1, f2, units, calls, repeats)
            except RuntimeError as e:
                skipped.append({"what": f"{first} beside {second}", "reason": str(e).splitlines()[0]})
                continue
            q1, q2 = units[0] / dev.units, units[1] / dev.units
            model = max(calls * full[first] * (1 + u1 * (1 / q1 - 1)), calls * full[second] * (1 + u2 * (1 / q2 - 1)))
            pairs.append({"first": first, "second": second, "share_first": q1, "sequential_s": sequential,
                          "concurrent_s": concurrent, "gain": sequential / concurrent, "model_gain": sequential / model})
    result = {"schema": SCHEMA, "device": {"kind": dev.kind, "name": dev.name,
                                           ("multiprocessors" if dev.cuda else "threads"): dev.units},
              "torch": torch.__version__, "date": date.today().isoformat(), "quick": args.quick, "shares": list(shares),
              "best_gemm_flops": best, "alone": alone, "pairs": pairs, "skipped": skipped,
              "elapsed_s": time.perf_counter() - t_start}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for row in alone:
        print(f"{row['kernel']:>22} share {row['share']:.3f}: {row['time_s'] * 1e3:8.3f} ms "
              f"(model {row['model_time_s'] * 1e3:8.3f}, u {row['u']:.2f})")
    for row in pairs:
        print(f"{row['first']} | {row['second']} at {row['share_first']:.2f}: gain {row['gain']:.2f}x "
              f"(model {row['model_gain']:.2f}x)")
    return result


if __name__ == "__main__":
    main()

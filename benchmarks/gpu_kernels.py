"""Kernel microbenchmark sweep for the simulator's compute profile (standalone: torch only).

    python benchmarks/gpu_kernels.py --out h100-kernels.json            # on a GPU, ~3-4 minutes
    python benchmarks/gpu_kernels.py --device cpu --quick --out k.json  # smoke test, seconds

Imports nothing from the project, so it can be copied to a GPU machine alone. Measures what the
simulator's compute model needs (simulator/kernels.py reads the JSON):

- ``gemm``: bf16 matmuls of the (m, n, k) shapes that transformer layers produce (hidden 1024 to
  8192, tensor parallel 1 to 8, 1K to 32K tokens per microbatch; the QKV, attention-output, FC1,
  FC2 and logits linears, each as forward, data-gradient and weight-gradient GEMM with the
  transposes those really use), plus a square sweep;
- ``attention``: ``scaled_dot_product_attention`` with the flash backend on [b, h, s, d] bf16,
  causal, s 512 to 32K, d 64 / 128, forward and forward + backward; and
  ``torch.nn.attention.varlen.varlen_attn`` on packed sequences where it imports;
- ``memory_bound``: copy, add, mul, SiLU, GELU, LayerNorm, RMSNorm, softmax, dropout,
  cross-entropy and the AdamW step (foreach and fused), as bytes moved / time, by size;
- ``launch``: host time to issue one small kernel, GPU time of an empty-ish kernel, and one
  synchronize round trip.

Timing: CUDA events around a batch of back-to-back calls after warm-up (``time.perf_counter``
plus synchronize on CPU); each entry holds the median over ``repeats`` batches of the time per
call. FLOP conventions are written into the JSON (``conventions``) so a reader need not guess.

Output schema (``schema: "omnibench-kernel-profile/1"``)::

    {schema, provenance: {commit, dirty, torch, cuda, driver, gpu_name, gpu_memory_bytes,
                          gpu_capability, python, hostname, command},
     device: {kind, name, capability, memory_bytes, multiprocessors},
     torch, cuda, date, quick, dtype, timing, conventions,
     gemm:         [{m, n, k, op, origin, time_s, flops, tflops}],
     attention:    [{impl, pass, batch, heads, seq, head_dim, causal, time_s, flops, tflops}],
     memory_bound: [{op, numel, bytes, time_s, gbps}],
     launch:       {host_per_kernel_s, gpu_per_small_kernel_s, sync_round_trip_s},
     skipped:      [{section, what, reason}],
     elapsed_s}
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import inspect
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SCHEMA = "omnibench-kernel-profile/1"


class Timer:
    """Per-call time of ``fn`` on ``device``: median over ``repeats`` batches of ``iters`` calls."""

    def __init__(self, device: torch.device, target_s: float, repeats: int):
        self.device = device
        self.target_s = target_s
        self.repeats = repeats

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batch(self, fn, iters: int) -> float:
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    def __call__(self, fn) -> float:
        fn()  # warm-up: allocator, autotuning, lazy init
        self.sync()
        once = self._batch(fn, 1)
        iters = max(1, min(200, int(self.target_s / max(once, 1e-7))))
        return statistics.median(self._batch(fn, iters) for _ in range(self.repeats))


def gemm_shapes(quick: bool) -> list[tuple[int, int, int, str, str]]:
    """(m, n, k, op, origin): out = [m, n], reduction k; fwd / dgrad / wgrad of each linear."""
    if quick:
        hiddens, tps, tokens, vocabs = [64], [1, 2], [128], [512]
    else:
        hiddens, tps, tokens, vocabs = [1024, 2048, 4096, 8192], [1, 2, 4, 8], [1024, 4096, 16384, 32768], [51200, 152064]
    seen: set[tuple[int, int, int, str]] = set()
    out: list[tuple[int, int, int, str, str]] = []

    def add(m: int, n: int, k: int, op: str, origin: str) -> None:
        if (m, n, k, op) not in seen:
            seen.add((m, n, k, op))
            out.append((m, n, k, op, origin))

    for h in hiddens:
        for tp in tps:
            linears = {"qkv": (h, 3 * h // tp), "proj": (h // tp, h), "fc1": (h, 4 * h // tp), "fc2": (4 * h // tp, h)}
            linears.update({f"logits{v}": (h, v // tp) for v in vocabs if h >= 2048 or quick})
            for t in tokens:
                for name, (fan_in, fan_out) in linears.items():
                    origin = f"hidden={h} tp={tp} tokens={t} {name}"
                    add(t, fan_out, fan_in, "fwd", origin)      # y = x @ W^T
                    add(t, fan_in, fan_out, "dgrad", origin)    # dx = dy @ W
                    add(fan_out, fan_in, t, "wgrad", origin)    # dW = dy^T @ x
    squares = [64] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    for s in squares:
        add(s, s, s, "fwd", f"square {s}")
    return out


def run_gemm(dev, dtype, timer, quick, budget_s, skipped):
    rows = []
    t_start = time.perf_counter()
    shapes = gemm_shapes(quick)
    # Small shapes first so a budget cut drops only the largest ones.
    shapes.sort(key=lambda s: s[0] * s[1] * s[2])
    for m, n, k, op, origin in shapes:
        if time.perf_counter() - t_start > budget_s:
            skipped.append({"section": "gemm", "what": f"{m}x{n}x{k} {op}", "reason": "time budget"})
            continue
        try:
            if op == "fwd":
                a = torch.randn(m, k, device=dev, dtype=dtype)
                b = torch.randn(n, k, device=dev, dtype=dtype)
                fn = lambda a=a, b=b: torch.mm(a, b.t())  # noqa: E731
            elif op == "dgrad":
                a = torch.randn(m, k, device=dev, dtype=dtype)   # dy [tokens, fan_out]
                b = torch.randn(k, n, device=dev, dtype=dtype)   # W [fan_out, fan_in]
                fn = lambda a=a, b=b: torch.mm(a, b)  # noqa: E731
            else:
                a = torch.randn(k, m, device=dev, dtype=dtype)   # dy [tokens, fan_out]
                b = torch.randn(k, n, device=dev, dtype=dtype)   # x [tokens, fan_in]
                fn = lambda a=a, b=b: torch.mm(a.t(), b)  # noqa: E731
            t = timer(fn)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # pragma: no cover - device dependent
            skipped.append({"section": "gemm", "what": f"{m}x{n}x{k} {op}", "reason": str(exc).splitlines()[0][:200]})
            continue
        finally:
            a = b = fn = None  # noqa: F841
        flops = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "op": op, "origin": origin, "time_s": t,
                     "flops": flops, "tflops": flops / t / 1e12})
    return rows


def attention_flops(batch, heads, seq, head_dim, causal, passes):
    """Matmul FLOPs: QK^T and PV, 2*2*b*h*s^2*d forward (halved when causal); backward 2.5x
    forward (dQ, dK, dV, dP plus the recomputed QK^T), so forward + backward is 3.5x."""
    fwd = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return fwd * (3.5 if passes == "fwd_bwd" else 1.0)


def run_attention(dev, dtype, timer, quick, budget_s, skipped):
    rows = []
    t_start = time.perf_counter()
    seqs = [128, 256] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    head_dims = [64] if quick else [64, 128]
    heads_list = [2] if quick else [8, 32]
    tokens = 512 if quick else 32768
    backends = None
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend
        backends = [SDPBackend.FLASH_ATTENTION]
    for d in head_dims:
        for heads in heads_list:
            for s in seqs:
                b = max(1, tokens // s)
                for passes in ("fwd", "fwd_bwd"):
                    what = f"sdpa b={b} h={heads} s={s} d={d} {passes}"
                    if time.perf_counter() - t_start > budget_s:
                        skipped.append({"section": "attention", "what": what, "reason": "time budget"})
                        continue
                    try:
                        q, k, v = (torch.randn(b, heads, s, d, device=dev, dtype=dtype,
                                               requires_grad=passes == "fwd_bwd") for _ in range(3))
                        g = torch.randn(b, heads, s, d, device=dev, dtype=dtype)

                        def fn(q=q, k=k, v=v, g=g, passes=passes):
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                            if passes == "fwd_bwd":
                                o.backward(g)

                        if backends is not None:
                            from torch.nn.attention import sdpa_kernel
                            with sdpa_kernel(backends):  # flash only: fail rather than fall back
                                t = timer(fn)
                        else:
                            t = timer(fn)
                    except (RuntimeError, torch.OutOfMemoryError) as exc:  # pragma: no cover
                        skipped.append({"section": "attention", "what": what, "reason": str(exc).splitlines()[0][:200]})
                        continue
                    finally:
                        q = k = v = g = None  # noqa: F841
                    fl = attention_flops(b, heads, s, d, True, passes)
                    rows.append({"impl": "sdpa_flash" if backends else "sdpa", "pass": passes, "batch": b,
                                 "heads": heads, "seq": s, "head_dim": d, "causal": True,
                                 "time_s": t, "flops": fl, "tflops": fl / t / 1e12})
    rows += run_varlen(dev, dtype, timer, quick, seqs, head_dims, tokens, budget_s / 2, skipped)
    return rows


def run_varlen(dev, dtype, timer, quick, seqs, head_dims, tokens, budget_s, skipped):
    """``varlen_attn`` over packed equal-length sequences, causal (signature differs by version)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        skipped.append({"section": "attention", "what": "varlen_attn", "reason": f"not importable: {exc}"})
        return []
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal_kw = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal_kw = {"is_causal": True}
    else:
        skipped.append({"section": "attention", "what": "varlen_attn", "reason": "no causal argument"})
        return []
    rows = []
    t_start = time.perf_counter()
    heads = 2 if quick else 16
    for d in head_dims:
        for s in seqs:
            n_seq = max(1, tokens // s)
            total = n_seq * s
            for passes in ("fwd", "fwd_bwd"):
                what = f"varlen n={n_seq} h={heads} s={s} d={d} {passes}"
                if time.perf_counter() - t_start > budget_s:
                    skipped.append({"section": "attention", "what": what, "reason": "time budget"})
                    continue
                try:
                    q, k, v = (torch.randn(total, heads, d, device=dev, dtype=dtype,
                                           requires_grad=passes == "fwd_bwd") for _ in range(3))
                    g = torch.randn(total, heads, d, device=dev, dtype=dtype)
                    cu = torch.arange(0, total + 1, s, device=dev, dtype=torch.int32)

                    def fn(q=q, k=k, v=v, g=g, cu=cu, s=s, passes=passes):
                        o = varlen_attn(q, k, v, cu, cu, s, s, **causal_kw)
                        if passes == "fwd_bwd":
                            o.backward(g)

                    t = timer(fn)
                except Exception as exc:  # noqa: BLE001 - no kernel on this device / version
                    skipped.append({"section": "attention", "what": what, "reason": str(exc).splitlines()[0][:200]})
                    return rows
                finally:
                    q = k = v = g = None  # noqa: F841
                fl = attention_flops(n_seq, heads, s, d, True, passes)
                rows.append({"impl": "varlen_attn", "pass": passes, "batch": n_seq, "heads": heads, "seq": s,
                             "head_dim": d, "causal": True, "time_s": t, "flops": fl, "tflops": fl / t / 1e12})
    return rows


def memory_ops(dev, dtype, numel):
    """(name, bytes moved per call, fn) for memory-bound ops on ``numel`` elements."""
    es = torch.finfo(dtype).bits // 8
    hidden = 4096 if numel >= 4096 * 16 else 64
    rows_ = numel // hidden
    x = torch.randn(rows_, hidden, device=dev, dtype=dtype)
    y = torch.randn(rows_, hidden, device=dev, dtype=dtype)
    out = torch.empty_like(x)
    w = torch.ones(hidden, device=dev, dtype=dtype)
    n = rows_ * hidden
    ops = [
        ("copy", 2 * n * es, lambda: out.copy_(x)),
        ("add", 3 * n * es, lambda: torch.add(x, y, out=out)),
        ("mul", 3 * n * es, lambda: torch.mul(x, y, out=out)),
        ("silu", 2 * n * es, lambda: F.silu(x)),
        ("gelu", 2 * n * es, lambda: F.gelu(x, approximate="tanh")),
        ("layernorm", 2 * n * es, lambda: F.layer_norm(x, (hidden,), w, w)),
        ("softmax", 2 * n * es, lambda: torch.softmax(x, dim=-1)),
        ("dropout", 2 * n * es + n, lambda: F.dropout(x, 0.1, training=True)),
    ]
    if hasattr(F, "rms_norm"):
        ops.append(("rmsnorm", 2 * n * es, lambda: F.rms_norm(x, (hidden,), w)))
    return n, ops


def run_memory(dev, dtype, timer, quick, budget_s, skipped):
    rows = []
    t_start = time.perf_counter()
    sizes = [2 ** p for p in ((14,) if quick else range(14, 30, 2))]
    for numel in sizes:
        if time.perf_counter() - t_start > budget_s:
            skipped.append({"section": "memory_bound", "what": f"numel={numel}", "reason": "time budget"})
            continue
        try:
            n, ops = memory_ops(dev, dtype, numel)
            for name, nbytes, fn in ops:
                t = timer(fn)
                rows.append({"op": name, "numel": n, "bytes": nbytes, "time_s": t, "gbps": nbytes / t / 1e9})
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # pragma: no cover
            skipped.append({"section": "memory_bound", "what": f"numel={numel}", "reason": str(exc).splitlines()[0][:200]})
        ops = None
    rows += run_cross_entropy(dev, dtype, timer, quick, skipped)
    rows += run_adamw(dev, timer, quick, budget_s, skipped)
    return rows


def run_cross_entropy(dev, dtype, timer, quick, skipped):
    """Loss forward + backward on [tokens, vocab] logits: read logits, write grad (+ fp32 math)."""
    rows = []
    cases = [(64, 512)] if quick else [(2048, 51200), (8192, 51200), (4096, 152064)]
    for t_, v in cases:
        try:
            logits = torch.randn(t_, v, device=dev, dtype=dtype, requires_grad=True)
            target = torch.randint(0, v, (t_,), device=dev)

            def fn(logits=logits, target=target):
                F.cross_entropy(logits, target).backward()

            t = timer(fn)
            nbytes = 3 * logits.numel() * logits.element_size()  # read (fwd), read + write (bwd)
            rows.append({"op": f"cross_entropy_fwd_bwd_vocab{v}", "numel": logits.numel(), "bytes": nbytes,
                         "time_s": t, "gbps": nbytes / t / 1e9})
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # pragma: no cover
            skipped.append({"section": "memory_bound", "what": f"cross_entropy {t_}x{v}", "reason": str(exc).splitlines()[0][:200]})
    return rows


def run_adamw(dev, timer, quick, budget_s, skipped):
    """AdamW step over fp32 params in 64 tensors: reads p, g, m, v and writes p, m, v (28 B/param)."""
    rows = []
    totals = [2 ** 14] if quick else [2 ** 20, 2 ** 24, 2 ** 27]
    modes = [("foreach", {"foreach": True})]
    if dev.type == "cuda":
        modes.append(("fused", {"fused": True}))
    for total in totals:
        for mode, kw in modes:
            try:
                params = [torch.zeros(total // 64, device=dev, dtype=torch.float32, requires_grad=True) for _ in range(64)]
                for p in params:
                    p.grad = torch.randn_like(p)
                opt = torch.optim.AdamW(params, lr=1e-4, **kw)
                t = timer(opt.step)
                nbytes = 28 * total
                rows.append({"op": f"adamw_{mode}", "numel": total, "bytes": nbytes, "time_s": t, "gbps": nbytes / t / 1e9})
            except (RuntimeError, TypeError, torch.OutOfMemoryError) as exc:  # pragma: no cover
                skipped.append({"section": "memory_bound", "what": f"adamw_{mode} {total}", "reason": str(exc).splitlines()[0][:200]})
            params = opt = None
    return rows


def run_launch(dev, quick):
    """Host issue time per small kernel, GPU time per small kernel, and one synchronize round trip."""
    x = torch.zeros(1, device=dev)
    n = 200 if quick else 5000
    for _ in range(50):
        x.add_(1.0)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = (time.perf_counter() - t0) / n
    sync()
    gpu = host
    if dev.type == "cuda":
        # Queue far more work than the host can issue late, then time on the device only.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e7))
        start.record()
        for _ in range(n):
            x.add_(1.0)
        end.record()
        end.synchronize()
        gpu = start.elapsed_time(end) / 1e3 / n
    trips = []
    for _ in range(20 if quick else 200):
        t0 = time.perf_counter()
        x.add_(1.0)
        sync()
        trips.append(time.perf_counter() - t0)
    return {"host_per_kernel_s": host, "gpu_per_small_kernel_s": gpu, "sync_round_trip_s": statistics.median(trips),
            "kernels": n}


def device_info(dev):
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return {"kind": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count}
    return {"kind": "cpu", "name": "cpu", "capability": None, "memory_bytes": None,
            "multiprocessors": torch.get_num_threads()}


def _git(*args: str) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _commit_state() -> dict:
    """{"commit", "dirty"}: the project's own answer where this copy holds omnibench/provenance.py (it
    reads OMNIBENCH_GIT_MANIFEST: a machine's copy may carry a .git of an older commit under
    changes, and the manifest names the commit the tree really is), loaded by path so that the script
    still runs alone; else git's."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "omnibench", "provenance.py")
    if os.path.isfile(path):
        spec = importlib.util.spec_from_file_location("_omnibench_provenance", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.git_state()
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if sha else None
    return {"commit": sha, "dirty": None if status is None else bool(status)}


def provenance(dev, argv: list[str] | None) -> dict:
    """The same fields as omnibench/provenance.py (this script imports nothing from the project, so
    that it runs from a bare copy): commit (+ dirty), torch, CUDA, driver, GPU, the command; None
    where unknown (no git checkout, no NVIDIA driver, a CPU run)."""
    info = device_info(dev)
    return {
        **_commit_state(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "driver": _driver() if dev.type == "cuda" else None,
        "gpu_name": info["name"] if dev.type == "cuda" else None,
        "gpu_memory_bytes": info["memory_bytes"] if dev.type == "cuda" else None,
        "gpu_capability": info["capability"] if dev.type == "cuda" else None,
        "python": platform.python_version(), "hostname": socket.gethostname(),
        "command": shlex.join(["python", "benchmarks/gpu_kernels.py", *(sys.argv[1:] if argv is None else argv)]),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test in seconds")
    ap.add_argument("--budget-s", type=float, default=200.0, help="soft wall-time budget for all sections")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per entry (median)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device: CUDA is not available here; use --device cpu --quick for a smoke test")
    dtype = torch.bfloat16
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    target = 0.002 if args.quick else 0.02
    timer = Timer(dev, target_s=target, repeats=2 if args.quick else args.repeats)
    budget = args.budget_s
    skipped: list[dict] = []
    t0 = time.perf_counter()
    launch = run_launch(dev, args.quick)
    gemm = run_gemm(dev, dtype, timer, args.quick, 0.45 * budget, skipped)
    attention = run_attention(dev, dtype, timer, args.quick, 0.3 * budget, skipped)
    memory = run_memory(dev, dtype, timer, args.quick, 0.15 * budget, skipped)
    result = {
        "schema": SCHEMA,
        "provenance": provenance(dev, argv),
        "device": device_info(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "dtype": str(dtype).removeprefix("torch."),
        "timing": ("cuda events around a batch of calls after one warm-up; median over repeats of the "
                   "time per call" if dev.type == "cuda" else "perf_counter around a batch of calls"),
        "conventions": {
            "gemm": "out [m, n], reduction k, flops = 2*m*n*k; fwd y=x@W^T, dgrad dx=dy@W, wgrad dW=dy^T@x",
            "attention": "matmul flops: fwd 4*b*h*s^2*d, halved when causal; fwd_bwd = 3.5x fwd",
            "memory_bound": "bytes = tensors read + written once (dropout adds a 1-byte mask); "
                            "adamw: 28 bytes per fp32 param (p, g, m, v read; p, m, v written)",
            "launch": "host_per_kernel_s: CPU time to enqueue one small op in a loop; gpu_per_small_kernel_s: "
                      "device time per 1-element add with the queue kept full",
        },
        "gemm": gemm,
        "attention": attention,
        "memory_bound": memory,
        "launch": launch,
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - t0,
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    best = max((r["tflops"] for r in gemm), default=float("nan"))
    bw = max((r["gbps"] for r in memory), default=float("nan"))
    print(f"{result['device']['name']}: {len(gemm)} GEMMs (best {best:.1f} TFLOP/s), {len(attention)} attention, "
          f"{len(memory)} memory-bound (best {bw:.0f} GB/s), launch {launch['host_per_kernel_s'] * 1e6:.1f} us host; "
          f"{len(skipped)} skipped; {result['elapsed_s']:.1f} s -> {args.out}")
    if not math.isfinite(best):
        print("warning: no GEMM measured", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()

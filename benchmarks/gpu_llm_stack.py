"""The harness's LLM-only step against a plain bf16 torch stack of the same shapes, side by side.

The plain stack is what a reader would write by hand to measure the ceiling on one GPU: bf16
parameters, N Qwen2-7B decoder layers with the token embedding, torch's varlen_attn, a chunked
cross-entropy head, forward + backward, no optimizer, no framework. The harness runs
`omnibench run --system homogeneous --model llm-7b@<N>L` on the very same packed batches (fixed
sequences, replayed from a batches file) and its own summary gives its MFU. Both use the one FLOP
formula (omnibench.specs.costs.llm_flops: exact matmul FLOPs, causal attention pairs) and the
device's dense bf16 peak.

    python benchmarks/gpu_llm_stack.py --layers 4 --seq 8192 --tokens 16384 [--compile] [--out DIR]

Needs one CUDA GPU; prints one table and writes `gpu_llm_stack.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.models.attention import VarlenAttention, apply_rotary, rope_cos_sin  # noqa: E402
from omnibench.models.loss import linear_cross_entropy  # noqa: E402
from omnibench.provenance import provenance  # noqa: E402
from omnibench.runtime.metrics import peak_tflops  # noqa: E402
from omnibench.specs.costs import llm_flops  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402


class PlainLayer(nn.Module):
    def __init__(self, h, heads, kv, ffn):
        super().__init__()
        self.d = h // heads
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-6), nn.RMSNorm(h, eps=1e-6)
        self.wq, self.wk, self.wv = nn.Linear(h, h), nn.Linear(h, kv * self.d), nn.Linear(h, kv * self.d)
        self.wo = nn.Linear(h, h, bias=False)
        self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)
        self.attn = VarlenAttention("varlen")

    def forward(self, x, cos, sin, cu, m):
        t = x.shape[0]
        y = self.n1(x)
        q, k, v = (w(y).view(t, -1, self.d) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        x = x + self.wo(self.attn(q, k, v, cu, m, causal=True).reshape(t, -1))
        y = self.n2(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def plain_stack(llm, layers: int, compile: bool, dtype=torch.bfloat16) -> tuple[nn.Module, nn.Module, nn.ModuleList, nn.Module]:
    emb = nn.Embedding(llm.vocab, llm.hidden)
    blocks = nn.ModuleList(PlainLayer(llm.hidden, llm.heads, llm.kv_heads, llm.ffn) for _ in range(layers))
    norm, head = nn.RMSNorm(llm.hidden, eps=1e-6), nn.Linear(llm.hidden, llm.vocab, bias=False)
    for m in (emb, blocks, norm, head):
        m.to("cuda", dtype)
    if compile:
        for i, b in enumerate(blocks):
            blocks[i] = torch.compile(b)
    return emb, blocks, norm, head


def time_plain(llm, layers, seq, tokens, steps, compile, autocast: bool = False, optimizer: bool = False) -> dict:
    """`autocast`: fp32 weights cast per op to bf16, as the harness holds them on one rank (no FSDP),
    instead of bf16 weights: how much of the gap that arrangement alone explains. `optimizer`: the
    step ends with fused AdamW over fp32 weights (an fp32 master per bf16 weight, its gradient cast to
    fp32, the master copied back to the bf16 weight after the step), the whole training step."""
    emb, blocks, norm, head = plain_stack(llm, layers, compile, torch.float32 if autocast else torch.bfloat16)
    params = [p for m in (emb, blocks, norm, head) for p in m.parameters()]
    masters = params if autocast else [p.detach().float().requires_grad_() for p in params]
    adamw = torch.optim.AdamW(masters, lr=1e-5, weight_decay=0.0, fused=True) if optimizer else None
    n = tokens // seq
    ids = torch.randint(0, llm.vocab - 3, (tokens,), device="cuda")
    labels = torch.roll(ids, -1)
    pos = torch.arange(seq, device="cuda").repeat(n)
    cu = torch.arange(0, tokens + 1, seq, device="cuda", dtype=torch.int32)
    cos, sin = rope_cos_sin(pos, llm.dim_head, llm.rope_theta)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            x = emb(ids)
            for b in blocks:
                x = b(x, cos, sin, cu, seq)
            ce, count = linear_cross_entropy(norm(x), head.weight, labels)
        (ce / count).backward()
        if adamw is not None:
            if not autocast:
                for p, m in zip(params, masters, strict=True):
                    m.grad = p.grad.float()
                    p.grad = None
            adamw.step()
            adamw.zero_grad(set_to_none=True)
            if not autocast:
                with torch.no_grad():
                    torch._foreach_copy_(params, masters)
        else:
            for p in params:
                p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - start) / steps
    f = llm_flops(llm, [seq] * n, layers=range(layers))
    tflops = (f.forward + f.backward) / dt / 1e12
    return {"step_s": dt, "tflops": tflops, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def time_harness(model: str, seq, tokens, steps, compile, recompute, mixed_precision: str = "autocast") -> dict:
    n = tokens // seq
    samples = [{"sample_id": i, "source": "fixed", "segments": [{"modality": "text", "llm_tokens": seq}]}
               for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        batches = os.path.join(tmp, "batches.json")
        with open(batches, "w") as f:
            json.dump([{"step": i, "samples": samples} for i in range(steps)], f)  # the same batch every step
        cmd = [sys.executable, "-m", "omnibench", "run", "--system", "homogeneous", "--model", model,
               "--nproc", "1", "--steps", str(steps), "--batches-file", batches, "--recompute", recompute,
               "--out", os.path.join(tmp, "run"), "--json", "--mixed-precision", mixed_precision] + (["--compile"] if compile else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
        s = json.loads(done.stdout)
        with open(os.path.join(s["record"], "trace.json")) as f:
            events = json.load(f)["traceEvents"]
    # forward + backward actions alone (the plain stack has no optimizer step), timed steps only
    fwd_bwd = sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("args", {}).get("kind") in ("forward", "backward")
                  and e.get("args", {}).get("step", 0) > 0) / 1e6 / (steps - 1)
    flops = s["tflops_per_gpu"] * s["mean_step_time_s"]
    return {"step_s": s["mean_step_time_s"], "tflops": s["tflops_per_gpu"], "peak_gib": s["peak_memory_bytes"] / 2**30,
            "fwd_bwd_s": fwd_bwd, "fwd_bwd_tflops": flops / fwd_bwd if fwd_bwd else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also measure both with torch.compile")
    ap.add_argument("--compile-only", action="store_true", help="measure both with torch.compile only")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--out", default="")
    ap.add_argument("--autocast-plain", action="store_true",
                    help="also time the plain stack with fp32 weights under autocast (the harness's one-rank arrangement)")
    ap.add_argument("--optimizer", action="store_true",
                    help="also time both plain stacks' whole training step (fused AdamW over fp32 weights) and the "
                         "harness under --mixed-precision master (bf16 weights, fp32 master): whole step against "
                         "whole step")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: gpu_llm_stack needs a CUDA GPU")
    llm = get_model("qwen2-7b").llm
    peak = peak_tflops(torch.device("cuda"))
    model = f"llm-7b@{a.layers}L"
    rows = []

    def save() -> None:  # after every row: a call cut off keeps what it measured
        if not a.out:
            return
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_llm_stack.json"), "w") as f:
            json.dump({"provenance": provenance(torch.cuda.get_device_name(), cuda=True),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                       "peak_tflops": peak, "rows": rows}, f, indent=1)

    for compile in ([True] if a.compile_only else [False, True] if a.compile else [False]):
        torch.cuda.reset_peak_memory_stats()
        plain = time_plain(llm, a.layers, a.seq, a.tokens, a.steps, compile)
        torch.cuda.empty_cache()
        row = {"compile": compile, "plain": plain}
        rows.append(row)  # filled part by part, saved after each
        if a.autocast_plain:
            torch.cuda.reset_peak_memory_stats()
            row["plain_autocast"] = time_plain(llm, a.layers, a.seq, a.tokens, a.steps, compile, autocast=True)
            torch.cuda.empty_cache()
        if a.optimizer:
            for key, ac in (("plain_step", False), ("plain_autocast_step", True)):
                if ac and not a.autocast_plain:
                    continue
                torch.cuda.reset_peak_memory_stats()
                row[key] = time_plain(llm, a.layers, a.seq, a.tokens, a.steps, compile, autocast=ac, optimizer=True)
                torch.cuda.empty_cache()
        save()
        row["harness"] = time_harness(model, a.seq, a.tokens, a.steps + 1, compile, a.recompute)
        save()
        if a.optimizer:
            row["harness_master"] = time_harness(model, a.seq, a.tokens, a.steps + 1, compile, a.recompute, "master")
            save()
        print(f"compile={compile}: plain {plain['tflops']:.1f} TFLOP/s"
              + (f", plain under autocast {row['plain_autocast']['tflops']:.1f}" if a.autocast_plain else "")
              + (f", harness {row['harness']['tflops']:.1f}" if "error" not in row["harness"] else
                 f", harness failed: {row['harness']['error']}"), flush=True)
    print(f"{torch.cuda.get_device_name()} peak {peak} TFLOP/s; {model}, {a.tokens} tokens/step in "
          f"{a.tokens // a.seq} sequences of {a.seq}; harness recompute={a.recompute}")
    print("harness: its whole step (optimizer included) and its forward + backward actions alone")
    print(f"{'compile':>8} {'plain TFLOP/s':>14} {'plain MFU':>10} {'harness TFLOP/s':>16} {'harness MFU':>12} {'ratio':>6}"
          f" {'fwd+bwd MFU':>12} {'ratio':>6}")
    for r in rows:
        p, h = r["plain"], r["harness"]
        if "error" in h:
            print(f"{r['compile']!s:>8} {p['tflops']:14.1f} {p['tflops'] / peak:10.1%}  harness failed: {h['error']}")
            continue
        print(f"{r['compile']!s:>8} {p['tflops']:14.1f} {p['tflops'] / peak:10.1%} {h['tflops']:16.1f} "
              f"{h['tflops'] / peak:12.1%} {h['tflops'] / p['tflops']:6.2f} {h['fwd_bwd_tflops'] / peak:12.1%} "
              f"{h['fwd_bwd_tflops'] / p['tflops']:6.2f}")
    if a.optimizer:
        print("whole training steps (AdamW over fp32 weights included), TFLOP/s and MFU; ratios to the plain bf16 stack's")
        for r in rows:
            base = r["plain_step"]["tflops"]
            parts = [("plain bf16 + fp32 master", r["plain_step"]), ("plain fp32 under autocast", r.get("plain_autocast_step")),
                     ("harness autocast", r["harness"]), ("harness master", r.get("harness_master"))]
            for name, m in parts:
                if m is None:
                    continue
                if "error" in m:
                    print(f"  compile={r['compile']!s:5} {name:28} failed: {m['error']}")
                    continue
                print(f"  compile={r['compile']!s:5} {name:28} {m['tflops']:7.1f} {m['tflops'] / peak:7.1%} "
                      f"{m['tflops'] / base:6.3f}  step {m['step_s'] * 1e3:7.1f} ms  peak {m['peak_gib']:5.1f} GiB")


if __name__ == "__main__":
    main()

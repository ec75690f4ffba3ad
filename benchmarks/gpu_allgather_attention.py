"""All-gather-KV context parallelism's attention on a CUDA GPU in bf16, against fp32 full attention.

The CPU parity tests run `AllGatherKVAttention` through the per-sequence backends; on a GPU its
queries meet their keys in torch's varlen kernel with cu_seqlens_q != cu_seqlens_k and bottom-right
causal alignment (`VarlenAttention.segments`), which no CPU test can reach. One process plays every
member of a k-member group: the member's two zigzag pieces of the queries, the K/V of the whole row in
the member order `gather_chunks` yields, indexed by `_allgather_layout` exactly as the module does.
Outputs and the gradients of q, k and v (through the index, as the all-gather's backward sums them)
are compared with one fp32 causal attention over each whole sequence.

    python benchmarks/gpu_allgather_attention.py [--out DIR]

Prints one line per case (backend, k, heads, sequences) with the largest error relative to the
reference's largest value; writes gpu_allgather_attention.json under --out. Exit 1 when a case is
off by more than bf16's tolerance (2e-2) or fails to run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.models.attention import VarlenAttention  # noqa: E402
from omnibench.provenance import provenance  # noqa: E402
from omnibench.runtime.parallelize import _allgather_layout, zigzag_index  # noqa: E402

TOLERANCE = 2e-2


def reference(q, k, v, bounds):
    """fp32 causal attention per sequence (math), GQA by repeating K/V heads."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        scores = (qi @ ki.transpose(-1, -2)) * qi.shape[-1] ** -0.5
        mask = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        out[s:e] = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vi).transpose(0, 1)
    return out


def case(backend: str, k: int, heads: int, kv_heads: int, lengths: list[int], d: int = 128, seed: int = 0,
         device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    torch.manual_seed(seed)
    tokens = sum(lengths)
    assert tokens % (2 * k) == 0
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, kk, v = (torch.randn(tokens, h, d, device=device) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(tokens, heads, d, device=device)
    leaves = [t.clone().requires_grad_() for t in (q, kk, v)]
    ref = reference(*leaves, bounds)
    (ref * grad_out).sum().backward()
    ref_grads = [t.grad for t in leaves]

    low = [t.to(dtype).requires_grad_() for t in (q, kk, v)]
    core = VarlenAttention(backend)
    order = torch.cat([zigzag_index(tokens, k, m) for m in range(k)]).to(device)
    kv = torch.cat([low[1], low[2]], dim=1)[order]  # what gather_chunks yields: member 0's rows, then 1's, ...
    out = torch.empty(tokens, heads, d, device=device, dtype=dtype)
    loss = 0.0
    for m in range(k):
        rows = zigzag_index(tokens, k, m).to(device)
        cu_q, cu_k, keys = _allgather_layout(tuple(bounds), tokens, k, m)
        mine = kv.index_select(0, keys.to(device))
        o = core.segments(low[0].index_select(0, rows), mine[:, :kv_heads], mine[:, kv_heads:], cu_q, cu_k, True)
        out[rows] = o.detach()
        loss = loss + (o.float() * grad_out[rows]).sum()
    loss.backward()
    scale = ref.abs().max().item()
    errors = {"out": (out.float() - ref).abs().max().item() / scale}
    for name, g, r in zip(("dq", "dk", "dv"), (t.grad for t in low), ref_grads, strict=True):
        errors[name] = (g.float() - r).abs().max().item() / r.abs().max().item()
    return {"backend": backend, "k": k, "heads": heads, "kv_heads": kv_heads, "lengths": lengths,
            "errors": errors, "ok": max(errors.values()) <= TOLERANCE}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the same check in fp32 through the per-sequence backends, small cases (the script's own test)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: gpu_allgather_attention needs a CUDA GPU (or --device cpu)")
    cpu = a.device == "cpu"
    shapes = [
        (2, 28, 28, [4096]),
        (2, 28, 4, [4096]),  # Qwen2-7B's grouped-query heads
        (4, 28, 4, [1000, 3000, 96]),  # sequences that straddle the zigzag pieces
        (8, 32, 8, [8192, 4096, 1024, 3072]),
    ]
    if cpu:
        shapes = [(2, 4, 4, [64]), (2, 4, 2, [64]), (4, 4, 2, [20, 36, 8])]
    cases = []
    for backend in ("math", "sdpa") if cpu else ("varlen", "sdpa"):
        for k, heads, kv_heads, lengths in shapes:
            try:
                r = case(backend, k, heads, kv_heads, lengths, d=16 if cpu else 128, device=a.device,
                         dtype=torch.float32 if cpu else torch.bfloat16)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run this case is a result too
                r = {"backend": backend, "k": k, "heads": heads, "kv_heads": kv_heads, "lengths": lengths,
                     "error": f"{type(e).__name__}: {e}".splitlines()[0][:300], "ok": False}
            cases.append(r)
            errs = r.get("errors")
            print(f"{backend:7} k={k} heads {heads}/{kv_heads} seqs {lengths}: "
                  + (" ".join(f"{n} {v:.2e}" for n, v in errs.items()) if errs else r["error"])
                  + ("" if r["ok"] else "  <- FAIL"), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_allgather_attention.json"), "w") as f:
            name = "cpu" if cpu else torch.cuda.get_device_name()
            json.dump({"provenance": provenance(name, cuda=not cpu), "tolerance": TOLERANCE,
                       "cases": cases}, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in cases) else 1)


if __name__ == "__main__":
    main()

"""Why the per-sequence SDPA loop fell to the math kernel on CUDA: try each fused kernel alone on the
old call (strided [H, L, D] views, `enable_gqa`) and on the new one (contiguous, kv heads repeated).

    python benchmarks/gpu_sdpa_probe.py
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.provenance import provenance  # noqa: E402


def main():
    # the output is kept as a text file: its first line says where it came from
    print("provenance: " + json.dumps(provenance(torch.cuda.get_device_name(), cuda=True)), flush=True)
    t, hq, hkv, d = 4096, 28, 4, 128
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    old = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    rep = hq // hkv
    new = (q.transpose(0, 1).unsqueeze(0).contiguous(), k.transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0).contiguous(),
           v.transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0).contiguous())
    for label, args, gqa in (("old: strided views + enable_gqa", old, True), ("old layout, no gqa (kv repeated)", (old[0], *(x.repeat_interleave(rep, 0) for x in old[1:])), False),
                             ("old: contiguous + enable_gqa", tuple(x.contiguous() for x in old), True), ("new: contiguous, kv repeated", new, False)):
        for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel([kernel]):
                    F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=gqa)
                result = "ok"
            except RuntimeError as e:
                result = "refused: " + " ".join(str(e).split())[:160]
            print(f"{label:38s} {kernel.name:22s} {result}")


if __name__ == "__main__":
    main()

"""Where one GPU's time goes inside the harness's forward and backward, by kernel category.

Builds the project's own modules (omnibench.models) with fp32 weights under bf16 autocast, as a
one-rank run executes them, and sums the CUDA kernel time torch.profiler records per phase (FWD /
BWD, each ending in a synchronize) and per category: GEMM, attention, and everything else
(memory-bound element-wise, reduction and copy kernels). Two shapes:
- LLM: 4 Qwen2-7B layers + embedding + final norm + the chunked loss (loss.py), 2 x 8,192 tokens;
- ViT: the Qwen2-VL encoder of omni-7b on 6 videos of 2 x 36 x 46 patches (19,872 patches, 12
  attention groups of 1,656).
This checks the simulator's kernel model (simulator/kernels.py) part by part; it is not an input to it.
The FWD/BWD totals include the profiler's own range annotation, which the table leaves out.

    python benchmarks/gpu_op_profile.py          # needs one CUDA GPU; results/gpu/op_profile.txt
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnibench.models.attention import rope_cos_sin  # noqa: E402
from omnibench.models.llm import Transformer  # noqa: E402
from omnibench.models.loss import linear_cross_entropy  # noqa: E402
from omnibench.models.vision import VisionTransformer  # noqa: E402
from omnibench.provenance import provenance  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402


def category(name: str) -> str:
    n = name.lower()
    if any(x in n for x in ("flash", "fmha", "attention", "varlen")):
        return "attn"
    if any(x in n for x in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")):
        return "gemm"
    return "mem"


def kernel_times(fn, iters: int = 2) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    phases = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.name in ("FWD", "BWD")]
    total, by_name = defaultdict(float), defaultdict(float)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = e.time_range.start
        phase = next((name for name, a, b in phases if a <= start <= b), "?")
        ms = e.time_range.elapsed_us() / 1e3 / iters
        total[f"{phase}.{category(e.name)}"] += ms
        total[f"{phase}.n"] += 1 / iters
        by_name[(phase, e.name[:70])] += ms
    print(json.dumps({k: round(v, 2) for k, v in total.items()}))
    for (phase, name), ms in sorted(by_name.items(), key=lambda x: -x[1])[:30]:
        print(phase, round(ms, 2), name)
    sys.stdout.flush()


def main() -> None:
    record = torch.autograd.profiler.record_function
    sync = torch.cuda.synchronize
    spec, dev = get_model("omni-7b@4L"), "cuda"
    # the output is kept as a text file: its first line says where it came from
    print("provenance: " + json.dumps(provenance(torch.cuda.get_device_name(), cuda=True)), flush=True)

    llm = Transformer(spec.llm, "varlen").to(dev)
    cu = torch.tensor([0, 8192, 16384], dtype=torch.int32, device=dev)
    pos = torch.arange(8192, device=dev).repeat(2)
    ids = torch.randint(0, spec.llm.vocab, (16384,), device=dev)

    def llm_step():
        llm.zero_grad(set_to_none=True)
        with record("FWD"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = llm.embed(ids)
                cos, sin = rope_cos_sin(pos, spec.llm.dim_head, spec.llm.rope_theta)
                for layer in llm.layers.values():
                    h = layer(h, cos, sin, cu, 8192)
                loss, n = linear_cross_entropy(llm.norm(h), llm.output.weight, ids)
            sync()
        with record("BWD"):
            (loss / n).backward()
            sync()

    kernel_times(llm_step)
    llm.cpu()
    torch.cuda.empty_cache()

    vit = VisionTransformer(spec.vision, "varlen").to(dev)
    v = spec.vision
    grid = torch.tensor([[2, 36, 46]] * 6, device=dev)
    patches = torch.randn(int(grid.prod(1).sum()), v.in_channels * v.temporal_patch * v.patch_size**2, device=dev)

    def vit_step():
        vit.zero_grad(set_to_none=True)
        with record("FWD"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = vit(patches, grid)
            sync()
        with record("BWD"):
            out.float().square().mean().backward()
            sync()

    print(patches.shape[0])
    kernel_times(vit_step)


if __name__ == "__main__":
    main()

"""Speed of omnibench.models on this machine: varlen attention backends, and one training step.

    python benchmarks/models_bench.py [--threads 1] [--repeats 5]

Prints the best of --repeats runs in milliseconds (the machine is shared: the minimum is the
least disturbed figure). Attention: packed 4,096 tokens (6 sequences), 8 query / 2 kv heads of
64, forward + backward, per backend. Step: tiny-omni forward_loss + backward on a packed batch of
4 mixed samples, and the model FLOPs of that step from omnibench.specs.costs.
"""

from __future__ import annotations

import argparse
import time

import torch

from omnibench.models import build_model
from omnibench.models.attention import VarlenAttention
from omnibench.models.inputs import pack, synthesize
from omnibench.specs.costs import batch_flops
from omnibench.specs.presets import get_model
from workloads.sample import Sample, Segment


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out) * 1e3


def attention(repeats: int) -> None:
    lens = [1500, 900, 700, 500, 300, 196]
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 8, 64, generator=g, requires_grad=True)
    k = torch.randn(sum(lens), 2, 64, generator=g, requires_grad=True)
    v = torch.randn(sum(lens), 2, 64, generator=g, requires_grad=True)
    for backend in ("sdpa", "math"):
        attn = VarlenAttention(backend)

        def step(attn=attn):
            attn(q, k, v, cu, max(lens), causal=True).sum().backward()

        print(f"attention {backend:5s} causal fwd+bwd, {sum(lens)} tokens in {len(lens)} seqs: "
              f"{_time(step, repeats):8.1f} ms")


def train_step(repeats: int) -> None:
    spec = get_model("tiny-omni")
    model = build_model(spec, seed=0)
    samples = [
        Sample(1, "img", (Segment("text", 40), Segment("image", 391, 1564, grid_thw=(1, 34, 46)), Segment("text", 120))),
        Sample(2, "vid", (Segment("text", 30), Segment("video", 960, 3840, grid_thw=(4, 30, 32)), Segment("text", 80))),
        Sample(3, "aud", (Segment("text", 20), Segment("audio", 250, 500, mel_frames=1000), Segment("text", 60))),
        Sample(4, "txt", (Segment("text", 700),)),
    ]
    batch = pack([synthesize(s, spec) for s in samples])

    def step():
        loss_sum, n, aux = model.forward_loss(batch)
        (loss_sum / n + aux).backward()

    ms = _time(step, repeats)
    flops = sum(f.total for f in batch_flops(spec, samples).values())
    print(f"tiny-omni train step ({batch.tokens} LLM tokens, {len(samples)} samples): {ms:8.1f} ms, "
          f"{flops / 1e9:.2f} GFLOP model work -> {flops / ms / 1e6:.2f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    attention(args.repeats)
    train_step(args.repeats)


if __name__ == "__main__":
    main()

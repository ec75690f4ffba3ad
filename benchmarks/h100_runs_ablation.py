"""What each modelling choice costs in error on the measured one-H100 runs (results/gpu/runs).

    python benchmarks/h100_runs_ablation.py [--runs 'results/gpu/runs/*']

Runs `omnibench validate` (simulator.calibrate.validate, kernel profile h100-measured) once per
variant of the machine model and prints the mean |error| and each run's error. Variants change one
choice each against the full model:
- before: the fused (Megatron-style) memory-bound kernels for the LLM and the
  datasheet curve for the encoders (what `validate --hardware h100` gave before);
- fused stack: every module costed with fused kernels instead of this project's eager modules;
- logits loss: the loss head costed as full logits with its gradients in the backward, not the
  chunked linear + cross-entropy that computes them in the forward;
- bf16 residual: no fp32 residual stream and no autocast weight casts (as if FSDP held the model);
- encoders on the datasheet curve (no kernel-level cost for the ViT / audio encoder);
- full attention at its own length: the encoders' non-causal attention read off the causal rows at
  its own length instead of length x sqrt(2).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
from dataclasses import replace
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator import flops, kernels  # noqa: E402
from simulator.calibrate import validate  # noqa: E402
from simulator.engine import Engine  # noqa: E402


def stack_edit(**changes):
    real = Engine._eager_stack

    def patched(self, module, lay):
        return replace(real(self, module, lay), **changes)

    return mock.patch.object(Engine, "_eager_stack", patched)


def no_encoder_shapes():
    stack = contextlib.ExitStack()
    for name in ("vision_work", "audio_work"):
        real = getattr(flops, name)

        def patched(*a, _real=real, **kw):
            return replace(_real(*a, **kw), shape=None)

        stack.enter_context(mock.patch.object(flops, name, patched))
        stack.enter_context(mock.patch(f"simulator.work.{name}", patched))  # where the engine looks it up
    return stack


# (label, what it changes, stack) in the order printed; the first is the model as it is
VARIANTS = (
    ("full model", lambda: contextlib.nullcontext(), "eager"),
    ("before (fused kernels for the LLM, datasheet curve for the encoders)", no_encoder_shapes, "fused"),
    ("fused (Megatron-style) element-wise kernels for every module", contextlib.nullcontext, "fused"),
    ("logits loss (head gradients in the backward, fused cross-entropy)", lambda: stack_edit(loss="logits"), "eager"),
    ("bf16 residual, no autocast weight casts", lambda: stack_edit(residual_bytes=2, weight_cast=False), "eager"),
    ("encoders on the datasheet curve", no_encoder_shapes, "eager"),
    ("full attention read at its own length (not x sqrt 2)",
     lambda: mock.patch.object(kernels, "FULL_ATTENTION_STRETCH", 1.0), "eager"),
)


def ablation(runs: list[str]) -> list[tuple[str, list]]:
    """(label, validate's rows) per variant, each from a freshly loaded kernel profile (a loaded
    profile memoises its attention times, which the last variant changes)."""
    out = []
    for label, change, stack in VARIANTS:
        kernels.load_kernel_profile.cache_clear()
        with change():
            out.append((label, validate(runs, None, "h100", stack=stack)))
    kernels.load_kernel_profile.cache_clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="results/gpu/runs/*")
    args = ap.parse_args()
    for label, rows in ablation(sorted(glob.glob(args.runs))):
        errs = [v.error for v in rows if v.steps]
        mae = sum(abs(e) for e in errs) / len(errs)
        per = " ".join(f"{os.path.basename(v.run)} {v.error:+.0%}" for v in rows if v.steps)
        print(f"{label[:40]:40s} mean |error| {mae:5.1%}   {per}")


if __name__ == "__main__":
    main()

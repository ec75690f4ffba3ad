"""What each modelling choice costs in error on the measured one-H100 runs (results/gpu/runs).

    python benchmarks/h100_runs_ablation.py [--runs 'results/gpu/runs/*']

Runs `omnibench validate` (simulator.calibrate.validate, kernel profile h100-measured) once per
variant of the machine model and prints the mean |error| and each run's error. Variants change one
choice each against the full model:
- before issue-12 step 2: the fused (Megatron-style) memory-bound kernels for the LLM and the
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
        stack.enter_context(mock.patch(f"simulator.engine.{name}", patched))
    return stack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="results/gpu/runs/*")
    args = ap.parse_args()
    runs = sorted(glob.glob(args.runs))

    def show(label, cm=None, stack="eager"):
        with cm or contextlib.nullcontext():
            rows = validate(runs, None, "h100", stack=stack)
        errs = [v.error for v in rows if v.steps]
        mae = sum(abs(e) for e in errs) / len(errs)
        per = " ".join(f"{os.path.basename(v.run)} {v.error:+.0%}" for v in rows if v.steps)
        print(f"{label:36s} mean |error| {mae:5.1%}   {per}")

    show("full model")
    show("before (fused LLM, datasheet encoders)", no_encoder_shapes(), stack="fused")
    show("fused stack, every module", stack="fused")
    show("logits loss (head grads in backward)", stack_edit(loss="logits"))
    show("bf16 residual, no weight casts", stack_edit(residual_bytes=2, weight_cast=False))
    show("encoders on the datasheet curve", no_encoder_shapes())
    show("full attention at its own length", mock.patch.object(kernels, "FULL_ATTENTION_STRETCH", 1.0))


if __name__ == "__main__":
    main()

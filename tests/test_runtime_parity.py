"""Loss and parameter parity: every baseline system, run on 4 gloo ranks under several layouts,
trains exactly like a single process (same init, same batches) to 1e-4 in fp32."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from omnibench.models import build_model
from omnibench.models.inputs import pack, synthesize
from omnibench.runtime.launch import launch, resolve
from omnibench.specs.presets import get_model
from omnibench.specs.run import RunSpec
from workloads.sample import Batch, Sample, Segment

STEPS = 5
LR = 1e-3
LR_SGD = 0.5


def make_batches(steps: int, samples: int, seed: int = 0) -> list[Batch]:
    """Small mixed batches: text, image, video, audio and image+audio samples (tiny-omni sizes)."""
    rng = random.Random(seed)
    out, sid = [], 0
    for step in range(steps):
        batch = []
        for _ in range(samples):
            segs = [Segment("text", rng.randint(3, 12))]
            kind = rng.random()
            if kind < 0.3:
                h, w = rng.choice([(4, 4), (2, 4), (4, 6)])
                segs.append(Segment("image", h * w // 4, h * w, grid_thw=(1, h, w)))
            elif kind < 0.45:
                segs.append(Segment("video", 2 * 4, 2 * 16, grid_thw=(2, 4, 4)))
            elif kind < 0.7:
                frames = rng.choice([16, 24, 40])
                segs.append(Segment("audio", frames // 4, frames // 2, mel_frames=frames))
            elif kind < 0.8:
                segs.append(Segment("image", 4, 16, grid_thw=(1, 4, 4)))
                segs.append(Segment("audio", 4, 8, mel_frames=16))
            segs.append(Segment("text", rng.randint(4, 16)))
            batch.append(Sample(sid, "test", tuple(segs)))
            sid += 1
        out.append(Batch(step, batch))
    return out


def optimizer_for(model_name: str) -> str:
    # MoE: Adam turns float rounding on a near-zero gradient element (expert matmuls over differently
    # grouped tokens) into an lr-sized update of that element; SGD keeps parameter parity meaningful.
    return "sgd" if "moe" in model_name else "adamw"


def reference(model_name: str, batches: list[Batch]) -> tuple[list[float], dict[str, torch.Tensor]]:
    spec = get_model(model_name)
    model = build_model(spec, seed=0)
    if optimizer_for(model_name) == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=LR_SGD, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = []
    for b in batches:
        ce, n, _ = model.forward_loss(pack([synthesize(s, spec) for s in b.samples]))
        loss = ce / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    final = {k: v.detach().clone() for k, v in model.named_parameters()}
    # Parity must mean something: training has to move the weights well beyond the tolerance.
    assert max((final[k] - init[k]).abs().max().item() for k in init) > 2e-3
    return losses, final


_REFERENCE: dict = {}


def run_distributed(tmp_path, system: str, model: str, batches: list[Batch], nproc: int = 4, **layout):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "batches.json"
    path.write_text(json.dumps([{"step": b.step, "samples": [s.to_dict() for s in b.samples]} for b in batches]))
    opt = optimizer_for(model)
    spec = resolve(RunSpec(system=system, model=model, nproc=nproc, steps=len(batches), device="cpu",
                           optimizer=opt, lr=LR_SGD if opt == "sgd" else LR,
                           batches_file=str(path), out=str(tmp_path / "run"), dump_params=True, timeout_s=60,
                           **layout))
    folder = launch(spec)
    with open(os.path.join(folder, "steps.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    params: dict[str, torch.Tensor] = {}
    for r in range(nproc):
        params.update(torch.load(os.path.join(folder, f"params_rank{r}.pt")))
    return losses, params


def assert_parity(losses, params, ref_losses, ref_params):
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) < 1e-4, f"step {step}: loss {a} vs reference {b}"
    covered = set()
    for name, value in params.items():
        base, _, first = name.partition("@")
        ref = ref_params[base]
        if first:
            ref = ref[int(first) : int(first) + value.shape[0]]
        assert torch.allclose(value, ref, atol=1e-4, rtol=0), f"{name} differs by {(value - ref).abs().max()}"
        covered.add(base)
    missing = set(ref_params) - covered
    assert not missing, f"parameters no rank owns: {sorted(missing)[:5]}"


CELLS = [
    # (system, layout, model)
    ("homogeneous", {}, "tiny-omni"),
    ("homogeneous", {"tp": 2}, "tiny-omni"),
    ("homogeneous", {"pp": 2}, "tiny-omni"),
    ("homogeneous", {"cp": 2}, "tiny-omni"),
    ("homogeneous", {"ep": 2}, "tiny-omni-moe"),
    ("temporal", {}, "tiny-omni"),
    ("temporal", {"tp": 2}, "tiny-omni"),
    ("temporal", {"cp": 2}, "tiny-omni"),
    ("temporal", {"ep": 2}, "tiny-omni-moe"),
    ("colocated", {}, "tiny-omni"),
    ("colocated", {"tp": 2}, "tiny-omni"),
    ("colocated", {"pp": 2}, "tiny-omni"),
    ("colocated", {"cp": 2}, "tiny-omni"),
    ("colocated", {"ep": 2}, "tiny-omni-moe"),
    ("noncolocated", {}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "tp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "pp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "cp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "ep": 2}, "tiny-omni-moe"),
    # Encoders with their own tp group (gradients broadcast inside it), and plain replicated DP.
    ("colocated", {"encoder_tp": 2, "pp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "encoder_tp": 2}, "tiny-omni"),
    ("homogeneous", {"fsdp": False, "pp": 2}, "tiny-omni"),
    ("temporal", {"fsdp": False, "ep": 2}, "tiny-omni-moe"),
]
FAST = {("homogeneous", "pp"), ("colocated", "tp"), ("noncolocated", "cp"), ("temporal", "ep")}


def _id(cell) -> str:
    system, layout, _ = cell
    return system + "-" + ("-".join(f"{k}{v}" for k, v in layout.items()) or "dp")


def _marks(cell):
    system, layout, _ = cell
    keys = [k for k in layout if k != "encoder_ranks"] or ["dp"]
    return [] if (system, keys[0]) in FAST and len(keys) == 1 else [pytest.mark.slow]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cell", [pytest.param(c, id=_id(c), marks=_marks(c)) for c in CELLS])
def test_system_layout_matches_single_process(tmp_path, cell):
    system, layout, model = cell
    batches = make_batches(STEPS, samples=8)
    if model not in _REFERENCE:
        _REFERENCE[model] = reference(model, batches)
    losses, params = run_distributed(tmp_path, system, model, batches, **layout)
    assert_parity(losses, params, *_REFERENCE[model])


RECOMPUTE_CELLS = [
    ("homogeneous", {"pp": 2}, "full"),
    ("omni", {}, "full"),
    ("temporal", {"cp": 2}, "selective"),
    ("temporal", {"cp": 2}, "full"),  # encoders: Ulysses cores inside checkpointed, FSDP-sharded blocks
    ("colocated", {"tp": 2}, "vision=full,audio=full"),
    ("noncolocated", {"encoder_ranks": 2}, "full"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "cell", [pytest.param(c, id=f"{c[0]}-{c[2].replace(',', '+')}", marks=[] if i < 2 else [pytest.mark.slow])
             for i, c in enumerate(RECOMPUTE_CELLS)])
def test_activation_checkpointing_keeps_the_losses_and_parameters(tmp_path, cell):
    """--recompute trains exactly as without it: the same losses to 1e-5 as the same system and
    layout without checkpointing, and parity with the single process."""
    system, layout, mode = cell
    batches = make_batches(STEPS, samples=8)
    if "tiny-omni" not in _REFERENCE:
        _REFERENCE["tiny-omni"] = reference("tiny-omni", batches)
    losses, params = run_distributed(tmp_path / mode, system, "tiny-omni", batches, recompute=mode, **layout)
    plain, _ = run_distributed(tmp_path / "none", system, "tiny-omni", batches, recompute="none", **layout)
    assert max(abs(a - b) for a, b in zip(losses, plain, strict=True)) < 1e-5, (losses, plain)
    assert_parity(losses, params, *_REFERENCE["tiny-omni"])

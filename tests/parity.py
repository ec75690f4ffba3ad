"""The loss-parity harness: distributed runs compared with one process training the same model on the
same batches (same init, fp32, 1e-4 on every loss and parameter).

Every parity cell of the suite runs in the default `pytest` run, so a cell must be cheap: a test
module hands all its cells to `run_all`, which starts ONE set of gloo ranks for all of them
(`omnibench.runtime.launch.launch_many`: each run its own process group and record, Python and
torch started once per rank instead of once per cell), and each cell's test then checks its own
run. The module's tests share one xdist group (`pytest.mark.xdist_group`), so `pytest -n 2` launches
a module's runs once, on one worker, while the other worker runs other tests.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnibench.models import build_model
from omnibench.models.inputs import pack, synthesize
from omnibench.runtime import records
from omnibench.runtime.launch import RunFailed, launch_many, resolve
from omnibench.specs.presets import get_model
from omnibench.specs.run import RunSpec
from workloads.sample import Batch, Sample, Segment

STEPS = 3  # enough for the weights to move far beyond the tolerance (`reference` checks it)
NPROC = 4  # every layout below keeps data parallelism (dp >= 2) next to what it splits
LR = 1e-3
LR_SGD = 0.5
TOLERANCE = 1e-4


def make_batches(steps: int = STEPS, samples: int = 8, seed: int = 0) -> list[Batch]:
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


def optimizer_for(model_name: str, optimizer: str | None = None) -> str:
    """The optimizer a cell trains with: `optimizer` where the cell names one, else AdamW, and SGD
    for MoE models (Adam turns float rounding on a near-zero gradient element, from expert matmuls over
    differently grouped tokens, into an lr-sized update of that element).

    SGD is also the stricter check of the gradients: Adam's update is invariant to a constant scale of
    the gradient (m / sqrt(v)), so a gradient off by a factor (a mean over the wrong ranks) trains
    exactly like the right one, where SGD's lr * grad shows it in every parameter. And it is cheaper on
    FSDP's DTensor parameters (one op per parameter, against a dozen for Adam's per-tensor path)."""
    return optimizer or ("sgd" if "moe" in model_name else "adamw")


_REFERENCES: dict = {}
# A folder this test session's processes share (tests/conftest.py makes a fresh one per session): a
# reference one xdist worker computed is read by the other instead of computed again.
REFERENCES_ENV = "OMNIBENCH_TEST_REFERENCES"


def _key(model_name: str, batches: list[Batch], optimizer: str, freeze: tuple[str, ...] = ()) -> str:
    # without frozen modules the key is what it always was
    head = [model_name, optimizer, *([list(freeze)] if freeze else [])]
    return json.dumps([*head, [[s.to_dict() for s in b.samples] for b in batches]], sort_keys=True)


def reference(model_name: str, batches: list[Batch], optimizer: str | None = None,
              freeze: tuple[str, ...] = ()) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same init and batches: the losses and final parameters every cell must match
    (computed once per model and batches in a test session). Training on batches also gives the
    reference of each of their first n >= 2 (the same run stopped earlier), which is kept too.
    `freeze`: modules whose parameters take no gradient (`--freeze`), as PyTorch freezes them."""
    optimizer = optimizer_for(model_name, optimizer)
    freeze = tuple(freeze)
    key = _key(model_name, batches, optimizer, freeze)
    if key in _REFERENCES:
        return _REFERENCES[key]
    folder = os.environ.get(REFERENCES_ENV)
    if not folder:
        _train_reference(model_name, batches, None, optimizer, freeze)
        return _REFERENCES[key]
    path = Path(folder) / (hashlib.sha256(key.encode()).hexdigest() + ".pt")
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker computing the same reference: wait for it
        if path.is_file():
            _REFERENCES[key] = torch.load(path)
        else:
            _train_reference(model_name, batches, Path(folder), optimizer, freeze)
    return _REFERENCES[key]


def _train_reference(model_name: str, batches: list[Batch], folder: Path | None, optimizer: str,
                     freeze: tuple[str, ...] = ()) -> None:
    spec = get_model(model_name)
    model = build_model(spec, seed=0)
    for name in freeze:
        getattr(model, name).requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(trained, lr=LR_SGD, foreach=False)
    else:
        opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0, foreach=False)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = []
    for step, b in enumerate(batches):
        ce, n, _ = model.forward_loss(pack([synthesize(s, spec) for s in b.samples]))
        loss = ce / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        final = {k: v.detach().clone() for k, v in model.named_parameters()}
        # Parity must mean something: training has to move the weights well beyond the tolerance.
        moved = max((final[k] - init[k]).abs().max().item() for k in init) > 20 * TOLERANCE
        if step + 1 == len(batches):
            assert moved
        elif not moved or step == 0:
            continue
        key = _key(model_name, batches[: step + 1], optimizer, freeze)
        _REFERENCES[key] = list(losses), final
        if folder is not None:
            path = folder / (hashlib.sha256(key.encode()).hexdigest() + ".pt")
            if not path.is_file():
                torch.save(_REFERENCES[key], str(path) + f".{os.getpid()}.tmp")
                os.replace(str(path) + f".{os.getpid()}.tmp", path)


def assert_parity(losses, params, ref_losses, ref_params, tolerance: float = TOLERANCE):
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) < tolerance, f"step {step}: loss {a} vs reference {b}"
    covered = set()
    for name, value in params.items():
        base, _, first = name.partition("@")
        ref = ref_params[base]
        if first:
            ref = ref[int(first) : int(first) + value.shape[0]]
        assert torch.allclose(value, ref, atol=tolerance, rtol=0), f"{name} differs by {(value - ref).abs().max()}"
        covered.add(base)
    missing = set(ref_params) - covered
    assert not missing, f"parameters no rank owns: {sorted(missing)[:5]}"


@dataclass
class Run:
    """One distributed run of a parity cell: `key` names it in the results."""

    key: str
    system: str
    model: str
    batches: list[Batch]
    layout: dict = field(default_factory=dict)  # RunSpec fields: tp, pp, cp, ep, options, recompute, ...
    optimizer: str | None = None  # None: optimizer_for(model)


@dataclass
class Result:
    losses: list[float] | None = None
    params: dict[str, torch.Tensor] | None = None
    folder: Path | None = None
    error: str = ""  # why this run has no result (its launch failed, here or in an earlier run)

    def get(self) -> tuple[list[float], dict[str, torch.Tensor]]:
        assert self.losses is not None, self.error
        return self.losses, self.params


def run_all(tmp_path: Path, runs: list[Run], nproc: int = NPROC) -> dict[str, Result]:
    """Every run in one launch of `nproc` gloo ranks; each key's losses and full parameters. A run
    that fails stops the launch: it and the runs after it report why; the ones before keep theirs."""
    specs = []
    for i, r in enumerate(runs):
        path = tmp_path / f"batches{i}.json"
        path.write_text(json.dumps([{"step": b.step, "samples": [s.to_dict() for s in b.samples]} for b in r.batches]))
        opt = optimizer_for(r.model, r.optimizer)
        specs.append(resolve(RunSpec(system=r.system, model=r.model, nproc=nproc, steps=len(r.batches), device="cpu",
                                     optimizer=opt, lr=LR_SGD if opt == "sgd" else LR, batches_file=str(path),
                                     out=str(tmp_path / f"run{i}-{r.key}"), dump_params=True, timeout_s=120,
                                     **r.layout)))
    failure = ""
    try:
        launch_many(specs)
    except RunFailed as e:
        failure = str(e)
    out = {}
    for r, spec in zip(runs, specs, strict=True):
        folder = next((Path(p) for p in (spec.out, spec.out + records.INCOMPLETE)
                       if (Path(p) / "steps.jsonl").is_file()), None)
        if folder is None:
            out[r.key] = Result(error=f"run {r.key} did not finish: the launch of its group failed: {failure}")
            continue
        with open(folder / "steps.jsonl") as f:
            losses = [json.loads(line)["loss"] for line in f]
        params: dict[str, torch.Tensor] = {}
        for rank in range(nproc):
            params.update(torch.load(folder / f"params_rank{rank}.pt"))
        out[r.key] = Result(losses, params, folder)
    return out


def run_distributed(tmp_path: Path, system: str, model: str, batches: list[Batch], nproc: int = NPROC,
                    **layout) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One run on its own (its own launch): for the tests that compare one or two runs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run_all(tmp_path, [Run("run", system, model, batches, layout)], nproc)["run"].get()

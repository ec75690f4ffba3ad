"""Will this run fit the device? The simulator's per-rank memory estimate, asked before any rank starts.

`simulate`'s `fits` column and this check are one estimate (simulator/engine.py: the training
state of each rank's parameter shard, FSDP's gathered layers, and the activations each rank holds
as its schedule runs, under the recompute mode), applied to the run's own Plans on a cluster of
the local device's memory (on CPU: the host's available memory shared by the ranks). On CUDA:

- `--recompute auto` takes the cheapest mode that fits (none, then selective, then full);
- the default model (none given) is the CUDA default preset at the greatest LLM depth that fits
  (`omni-7b`, then `omni-7b@16L`, `@8L`, `@4L`, `@2L`): the real shapes at a depth one GPU holds;
- a run that still cannot fit is refused in one line with the estimate, the device's memory and
  the options that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omnibench.specs.model import SpecError
from omnibench.specs.run import RunSpec

GiB = 1024**3
HEADROOM = 0.92  # of the device's memory: allocator fragmentation and NCCL buffers beyond the estimate
# cheapest first; the encoders' activations (four patches per LLM token) are the largest, so they are
# recomputed before the LLM is. "selective" saves nothing under a flash-style core (costs.py).
RECOMPUTE_ORDER = ("none", "vision=full,audio=full", "full")
DEPTHS = (0, 16, 8, 4, 2)  # 0: the preset's own depth
ESTIMATE_STEPS = 4  # batches looked at: the largest sample of a few steps sets the peak


@dataclass(frozen=True)
class Estimate:
    peak_bytes: float
    rank: int
    model: str
    recompute: str

    def gib(self) -> float:
        return self.peak_bytes / GiB


def estimate(spec: RunSpec, model_name: str | None = None, recompute: str | None = None,
             tp: int | None = None, pp: int | None = None, memory_gib: float = 80.0) -> Estimate:
    """Peak bytes of the most loaded rank over the run's first batches, as `simulate` counts them."""
    from omnibench.runtime.launch import batch_source, parallel_spec
    from omnibench.specs.presets import get_model
    from simulator.engine import Engine, SimOptions
    from simulator.hardware import load_cluster
    from systems import get_planner

    name = model_name or spec.model
    mode = recompute or spec.recompute
    trial = replace(spec, model=name, recompute=mode, tp=tp or spec.tp, pp=pp or spec.pp)
    model = get_model(name)
    parallel = parallel_spec(trial, trial.nproc)
    parallel.validate(model)
    cluster = load_cluster("h100", trial.nproc)
    cluster = replace(cluster, gpu=replace(cluster.gpu, memory_gib=memory_gib))
    planner, batches = get_planner(trial.system), batch_source(trial)
    worst = Estimate(0.0, 0, name, mode)
    for step in range(min(trial.steps, ESTIMATE_STEPS)):
        plan = planner.plan(model, parallel, batches(step))
        result = Engine(plan, model, cluster, options=SimOptions(recompute=mode, check_memory=False)).run()
        top = max(result.ranks, key=lambda r: r.memory_bytes)
        if top.memory_bytes > worst.peak_bytes:
            worst = Estimate(top.memory_bytes, top.rank, name, mode)
    return worst


def device_memory_gib(device: str) -> float:
    """One GPU's memory; on CPU, the host memory available now, shared by every rank of the run."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GiB
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024 / GiB


def fit_to_device(spec: RunSpec, model_given: bool, memory_gib: float | None = None) -> tuple[RunSpec, str]:
    """The spec with `recompute` (and, on CUDA without a given model, the model depth) settled so
    the estimate fits; returns (spec, a note for the summary). Raises SpecError in one line when
    nothing fits. On CPU the ranks share the host's memory: each gets an equal part of what is
    available (a guard against a real preset on a laptop, not a precise check: CPU runs are fp32,
    the estimate counts bf16 activations)."""
    device = spec.extra.get("device", "cpu")
    if device != "cuda":
        model_given = True  # CPU defaults are the tiny presets; nothing to choose
    try:
        cap = memory_gib or device_memory_gib(device)
    except (OSError, KeyError, ValueError):
        return spec, ""  # no way to read the host's memory: no check
    if device != "cuda" and not memory_gib:
        cap /= max(1, spec.nproc)
    budget = HEADROOM * cap * GiB
    modes = RECOMPUTE_ORDER if spec.recompute == "auto" else (spec.recompute,)
    models = [spec.model] if model_given else _depths(spec.model)
    first = None
    for name in models:
        for mode in modes:
            est = estimate(spec, name, mode, memory_gib=cap)
            first = first or est
            if est.peak_bytes <= budget:
                if device != "cuda":
                    return replace(spec, model=name, recompute=mode), ""
                chosen = "" if model_given and spec.recompute != "auto" else " (chosen to fit)"
                note = (f"memory: {name} with recompute={mode} estimated at {est.gib():.1f} GiB on rank {est.rank} "
                        f"of {cap:.1f} GiB{chosen}")
                return replace(spec, model=name, recompute=mode), note
    where = "the device has" if device == "cuda" else "each of its ranks has about"
    raise SpecError(
        f"{first.model} with recompute={first.recompute} needs an estimated {first.gib():.1f} GiB on rank "
        f"{first.rank}, {where} {cap:.1f} GiB; " + _would_fit(spec, models[0], budget, cap)
    )


def _depths(name: str) -> list[str]:
    from omnibench.specs.presets import get_model

    layers = get_model(name).llm.layers
    return [name] + [f"{name}@{d}L" for d in DEPTHS if 0 < d < layers]


def _would_fit(spec: RunSpec, model: str, budget: float, cap: float) -> str:
    """The single changes that would fit: recompute modes, tp / pp within the ranks, shallower models."""
    tries = [dict(recompute=m) for m in RECOMPUTE_ORDER if m != spec.recompute]
    n = spec.nproc
    tries += [dict(tp=t) for t in (2, 4, 8) if t != spec.tp and n % t == 0 and t <= n]
    tries += [dict(pp=p) for p in (2, 4, 8) if p != spec.pp and n % p == 0 and p <= n]
    tries += [dict(model_name=m) for m in _depths(model)[1:]]
    fits = []
    for kw in tries:
        try:
            est = estimate(spec, **{"model_name": model, **kw}, memory_gib=cap)
        except (SpecError, ValueError):
            continue  # a layout this model or rank count does not allow
        if est.peak_bytes <= budget:
            key, value = next(iter(kw.items()))
            flag = "--model" if key == "model_name" else f"--{key}"
            fits.append(f"{flag} {value} ({est.gib():.1f} GiB)")
    return "would fit: " + ", ".join(fits) if fits else "nothing tried fits (recompute, tp, pp, a shallower model)"

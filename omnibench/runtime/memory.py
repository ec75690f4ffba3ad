"""Will this run fit the device? The simulator's per-rank memory estimate, asked before any rank starts.

`simulate`'s `fits` column and this check are one estimate (simulator/engine.py: the training
state of each rank's parameter shard, FSDP's gathered layers, and the activations each rank holds
as its schedule runs, under the recompute mode), applied to the run's own Plans on a cluster of
the local device's memory (on CPU: the host's available memory shared by the ranks). On CUDA:

- `--recompute auto` takes the cheapest mode that fits (omnibench/resolve.py, the one place every
  command settles a layout: none, then each set of modules recomputed in full, cheapest first, e.g.
  `vision=full` before `full`);
- `--encoder-chunk-tokens auto` (opt-in; the default is 0, off, until chunked runs are measured on a GPU) tries each mode first unchunked, then with encoder
  microbatches in chunks recomputed in the backward (`auto_chunk_tokens`: the largest power of two whose chunk
  activations take at most 1/8 of the device), so a long video that would not fit is chunked;
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
# of the device's memory: the estimate (RankStats memory_needed) already holds what the caching allocator
# cannot give back under pressure and what lives outside it (simulator/memory.py allocator_need: measured
# on an H100 for this runtime, a host's figures on CPU)
HEADROOM = 1.0
DEPTHS = (0, 16, 8, 4, 2)  # 0: the preset's own depth


CHUNK_SHARE = 8  # auto chunk budget: one chunk's encoder activations at most 1/8 of the device


@dataclass(frozen=True)
class Estimate:
    peak_bytes: float
    rank: int
    model: str
    recompute: str
    encoder_chunk_tokens: int = 0

    def gib(self) -> float:
        return self.peak_bytes / GiB


def auto_chunk_tokens(model_name: str, recompute: str, memory_gib: float) -> int:
    """The encoder chunk budget `auto` picks: the largest power of two (at least 256) whose chunk
    activations, under each encoder's recompute mode, take at most 1/CHUNK_SHARE of the device."""
    from omnibench.specs import costs
    from omnibench.specs.presets import get_model

    model = get_model(model_name)
    policy = costs.recompute_policy(recompute)
    per_token = 1.0
    if model.vision is not None:
        per_token = max(per_token, costs.vision_activation_bytes(model.vision, 1024, patch_embed=False,
                                                                 recompute=policy["vision"]) / 1024)
    if model.audio is not None:
        per_token = max(per_token, costs.audio_activation_bytes(model.audio, 1024, recompute=policy["audio"]) / 1024)
    n = int(memory_gib * GiB / CHUNK_SHARE / per_token)
    return max(256, 1 << max(0, n.bit_length() - 1))


def estimate(spec: RunSpec, model_name: str | None = None, recompute: str | None = None,
             tp: int | None = None, pp: int | None = None, memory_gib: float = 80.0,
             encoder_chunk_tokens: int | None = None) -> Estimate:
    """Peak bytes of the most loaded rank over the run's first batches, as `simulate` counts them."""
    from omnibench.resolve import ESTIMATE_STEPS, peak_memory
    from omnibench.runtime.run_inputs import batch_source, parallel_spec
    from omnibench.specs.presets import get_model

    name = model_name or spec.model
    mode = recompute or spec.recompute
    chunk = max(0, spec.encoder_chunk_tokens if encoder_chunk_tokens is None else encoder_chunk_tokens)
    trial = replace(spec, model=name, recompute=mode, tp=tp or spec.tp, pp=pp or spec.pp)
    model = get_model(name)
    parallel = parallel_spec(trial, trial.nproc)
    parallel.validate(model)
    batches = batch_source(trial)
    peak, rank = peak_memory(trial.system, model, parallel, [batches(s) for s in range(min(trial.steps, ESTIMATE_STEPS))],
                             _cluster(trial.nproc, memory_gib, trial.extra.get("device", "cpu")), chunk)
    from simulator.engine import drop_spare_engine

    drop_spare_engine()  # nothing here simulates the step it checked
    return Estimate(peak, rank, name, mode, chunk)


def _cluster(nproc: int, memory_gib: float, device: str = "cuda"):
    """The cluster a run is estimated on: the h100 preset's network, the device's memory; on CPU a
    host's process (simulator/memory.py HOST_DEVICE: no caching allocator, no CUDA context)."""
    from simulator.hardware import load_cluster
    from simulator.memory import HOST_DEVICE

    cluster = load_cluster("h100", nproc)
    gpu = replace(cluster.gpu, memory_gib=memory_gib, **({} if device == "cuda" else {"name": HOST_DEVICE}))
    return replace(cluster, gpu=gpu)


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
    models = [spec.model] if model_given else _depths(spec.model)
    # auto chunking only where a device is measured against: CPU runs never chunk unasked
    auto_chunk = spec.encoder_chunk_tokens == -1 and device == "cuda"
    chunk_fixed = max(0, spec.encoder_chunk_tokens)
    first = None
    for name in models:
        trial = replace(spec, model=name)
        res = _settle(trial, cap, budget, lambda mode, n=name: (0, auto_chunk_tokens(n, mode, cap)) if auto_chunk
                      else (chunk_fixed,))
        est = Estimate(res.peak_bytes, res.peak_rank, name, res.recompute, res.encoder_chunk_tokens)
        if first is None:
            first = est if spec.recompute != "auto" else _first_tried(trial, cap, chunk_fixed)
        if res.fits:
            fitted = replace(trial, recompute=res.recompute, encoder_chunk_tokens=res.encoder_chunk_tokens)
            if device != "cuda":
                return fitted, ""
            chosen = ("" if model_given and spec.recompute != "auto" and spec.encoder_chunk_tokens != -1
                      else " (chosen to fit)")
            chunk = res.encoder_chunk_tokens
            chunked = f", encoder chunks of {chunk} tokens" if chunk else ""
            note = (f"memory: {name} with recompute={res.recompute}{chunked} estimated at {est.gib():.1f} GiB on "
                    f"rank {est.rank} of {cap:.1f} GiB{chosen}")
            return fitted, note
    where = "the device has" if device == "cuda" else "each of its ranks has about"
    chunked = f" and encoder chunks of {first.encoder_chunk_tokens} tokens" if first.encoder_chunk_tokens else ""
    raise SpecError(
        f"{first.model} with recompute={first.recompute}{chunked} needs an estimated {first.gib():.1f} GiB on rank "
        f"{first.rank}, {where} {cap:.1f} GiB; " + _would_fit(spec, models[0], budget, cap)
    )


def _settle(spec: RunSpec, cap: float, budget: float, chunk_options):
    """omnibench/resolve.py's answer for this run's (already laid out) spec: recompute and chunks."""
    from omnibench.resolve import ESTIMATE_STEPS, resolve_layout
    from omnibench.runtime.run_inputs import batch_source, parallel_spec
    from omnibench.specs.presets import get_model
    from simulator.engine import drop_spare_engine

    batches = batch_source(spec)
    res = resolve_layout(spec.system, get_model(spec.model), parallel_spec(replace(spec, recompute="none"), spec.nproc),
                         [batches(s) for s in range(min(spec.steps, ESTIMATE_STEPS))],
                         _cluster(spec.nproc, cap, spec.extra.get("device", "cpu")),
                         tp=spec.tp, pp=spec.pp, cp=spec.cp, recompute=spec.recompute, budget_bytes=budget,
                         chunk_options=chunk_options, estimate=True)
    drop_spare_engine()  # the run trains the step; nothing simulates it
    return res


def _first_tried(spec: RunSpec, cap: float, chunk: int) -> Estimate:
    """What a refusal quotes under `auto`: the cheapest mode's estimate (none, unchunked)."""
    return estimate(spec, recompute="none", memory_gib=cap, encoder_chunk_tokens=chunk)


def _depths(name: str) -> list[str]:
    from omnibench.specs.presets import get_model

    layers = get_model(name).llm.layers
    return [name] + [f"{name}@{d}L" for d in DEPTHS if 0 < d < layers]


def _would_fit(spec: RunSpec, model: str, budget: float, cap: float) -> str:
    """The single changes that would fit: recompute modes, tp / pp within the ranks, shallower models."""
    from omnibench.resolve import recompute_modes
    from omnibench.runtime.run_inputs import batch_source
    from omnibench.specs.presets import get_model

    modes = recompute_modes(get_model(model), batch_source(spec)(0).samples, spec.freeze)
    tries = [dict(recompute=m) for m in modes if m != spec.recompute]
    if spec.encoder_chunk_tokens <= 0:
        mode = spec.recompute if spec.recompute != "auto" else "none"
        tries.append(dict(encoder_chunk_tokens=auto_chunk_tokens(model, mode, cap), recompute=mode))
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
            flags = " ".join(f"--model {v}" if k == "model_name" else f"--{k.replace('_', '-')} {v}"
                             for k, v in kw.items())
            fits.append(f"{flags} ({est.gib():.1f} GiB)")
    return "would fit: " + ", ".join(fits) if fits else "nothing tried fits (recompute, tp, pp, a shallower model)"

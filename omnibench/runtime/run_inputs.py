"""What the launcher and every rank derive from a resolved RunSpec: its ParallelSpec, its batches
by step, and the layouts this runtime cannot execute yet. No torch here; launch.py and worker.py
both import it, and neither imports the other's module level (worker.py never imports launch.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.run import RunSpec
from workloads.sample import Batch, Sample


def parallel_spec(spec: RunSpec, world: int) -> ParallelSpec:
    return ParallelSpec(
        world_size=world, dp=spec.dp, tp=spec.tp, pp=spec.pp, cp=spec.cp, cp_kind=spec.cp_kind, ep=spec.ep,
        microbatches=spec.microbatches, encoder_tp=spec.encoder_tp, encoder_sp=spec.encoder_sp,
        encoder_ranks=spec.encoder_ranks, fsdp=spec.fsdp, zero=spec.zero,
        dp_shard=spec.dp_shard,
        recompute=spec.recompute, mixed_precision=spec.mixed_precision, options=dict(spec.options),
        freeze=tuple(spec.freeze),
    )


def batch_source(spec: RunSpec) -> Callable[[int], Batch]:
    """Batches by step: replayed from --batches-file, else the workload stream (same on every rank)."""
    if spec.batches_file:
        batches = read_batches(spec.batches_file)
        return lambda step: batches[step % len(batches)]
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(
        spec.workload, seed=spec.seed, global_batch_tokens=spec.global_batch_tokens,
        length_scale=spec.length_scale, max_sample_tokens=spec.max_sample_tokens or None,
    )
    return stream.batch


BATCHES_FILE_SHAPE = ('a JSON list of batches, each {"step": int, "samples": [{"sample_id": int, "source": str, '
                      '"segments": [{"modality": ..., "llm_tokens": int, ...}]}]} (what Batch/Sample.to_dict write)')


def read_batches(path: str) -> list[Batch]:
    """--batches-file, checked whole before any rank starts: SpecError naming the file, the batch and
    sample, and the shape expected."""
    from omnibench.specs.model import SpecError
    from workloads.sample import MODALITIES

    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise SpecError(f"batches_file: cannot read {path} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"batches_file: {path} is not JSON ({e})") from None
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"batches_file: {path} must hold {BATCHES_FILE_SHAPE}; got {type(raw).__name__}"
                        + (" (empty)" if raw == [] else ""))
    out = []
    for i, b in enumerate(raw):
        where = f"batches_file: {path}: batch {i}"
        if not isinstance(b, dict) or not isinstance(b.get("samples"), list) or not b["samples"] or \
                isinstance(b.get("step"), bool) or not isinstance(b.get("step"), int):
            raise SpecError(f"{where} must be {{\"step\": int, \"samples\": [at least one sample]}}; "
                            f"expected {BATCHES_FILE_SHAPE}")
        samples = []
        for j, d in enumerate(b["samples"]):
            try:
                sample = Sample.from_dict(d)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise SpecError(f"{where}, sample {j}: not a sample ({type(e).__name__}: {e}); expected "
                                f"{BATCHES_FILE_SHAPE}") from None
            for seg in sample.segments:
                if seg.modality not in MODALITIES:
                    raise SpecError(f"{where}, sample {j}: modality must be one of {', '.join(MODALITIES)}; "
                                    f"got {seg.modality!r}")
                if any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                       for v in (seg.llm_tokens, seg.encoder_seq_len, seg.mel_frames, *seg.grid_thw)):
                    raise SpecError(f"{where}, sample {j}: llm_tokens, encoder_seq_len, mel_frames and grid_thw must be "
                                    f"integers >= 0; got {seg}")
            samples.append(sample)
        out.append(Batch(b["step"], samples))
    return out


def runtime_limits(model, parallel: ParallelSpec) -> None:
    """Layouts a planner (and the simulator) accepts but this runtime cannot execute yet."""
    from omnibench.specs.model import SpecError

    llm = model.llm
    if (llm.mlp, llm.norm, llm.positions) != ("swiglu", "rms", "rope"):
        raise SpecError(f"{llm.name}: the runtime builds Llama-style blocks only (mlp swiglu, norm rms, positions "
                        f"rope); got mlp {llm.mlp}, norm {llm.norm}, positions {llm.positions} (simulate it instead)")
    if parallel.pp > 1 and llm.tie_embeddings:
        raise SpecError(
            f"pp={parallel.pp} with tied embeddings ({llm.name}) is not supported by the runtime: the first and "
            "last stage would each train their own copy"
        )

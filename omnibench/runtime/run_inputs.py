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
        world_size=world, dp=spec.dp, tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep,
        microbatches=spec.microbatches, encoder_tp=spec.encoder_tp, encoder_ranks=spec.encoder_ranks, fsdp=spec.fsdp, dp_shard=spec.dp_shard,
        recompute=spec.recompute, options=dict(spec.options),
    )


def batch_source(spec: RunSpec) -> Callable[[int], Batch]:
    """Batches by step: replayed from --batches-file, else the workload stream (same on every rank)."""
    if spec.batches_file:
        with open(spec.batches_file) as f:
            raw = json.load(f)
        batches = [Batch(int(b["step"]), [Sample.from_dict(s) for s in b["samples"]]) for b in raw]
        return lambda step: batches[step % len(batches)]
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(
        spec.workload, seed=spec.seed, global_batch_tokens=spec.global_batch_tokens,
        length_scale=spec.length_scale, max_sample_tokens=spec.max_sample_tokens or None,
    )
    return stream.batch


def runtime_limits(model, parallel: ParallelSpec) -> None:
    """Layouts a planner (and the simulator) accepts but this runtime cannot execute yet."""
    from omnibench.specs.model import SpecError

    llm, tp, cp = model.llm, parallel.tp, parallel.cp
    # Ulysses context parallelism splits each tp rank's heads again over cp ranks.
    if (llm.heads // tp) % cp or (llm.kv_heads // tp) % cp:
        raise SpecError(
            f"cp={cp} must divide the LLM's heads per tp rank ({llm.heads}/{tp} query, {llm.kv_heads}/{tp} kv) "
            "for Ulysses attention (the runtime has no ring attention yet)"
        )
    if parallel.pp > 1 and llm.tie_embeddings:
        raise SpecError(
            f"pp={parallel.pp} with tied embeddings ({llm.name}) is not supported by the runtime: the first and "
            "last stage would each train their own copy"
        )

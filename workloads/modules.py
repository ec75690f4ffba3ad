"""Which encoders a workload runs: the modules its samples feed. A module that no sample of a workload
uses has no work to do in any step, so it shapes no layout (omnibench.resolve.model_for_workload)."""

from __future__ import annotations

from workloads.sample import ENCODER_OF
from workloads.spec import WorkloadSpec


def encoders_used(spec: WorkloadSpec) -> tuple[str, ...]:
    """The encoders ("vision", "audio", in that order) some sample of `spec` can feed: a replayed trace's
    segments, or the sources with weight in some phase of the schedule (a source no phase draws from
    never makes a sample)."""
    if spec.trace is not None:
        modalities = {seg[0] if isinstance(seg, tuple) else seg.modality
                      for segs in spec.trace.segments for seg in segs}
    else:
        drawn = [i for i in range(len(spec.sources)) if any(ph.weights[i] > 0 for ph in spec.schedule.phases)]
        modalities = {m for i in drawn for m in spec.sources[i].modalities}
    used = {ENCODER_OF[m] for m in modalities if m in ENCODER_OF}
    return tuple(m for m in ("vision", "audio") if m in used)

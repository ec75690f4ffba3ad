"""The workload generator: token rules, length distributions, mixture schedules, named
workloads, trace replay, and the seekable stream of global batches every system consumes.

Imports no torch (a test checks it): planners, the simulator and the CLI use it freely.

    from workloads import WorkloadStream, get_workload
    stream = WorkloadStream(get_workload("mixed_video"), seed=0, global_batch_tokens=2048,
                            length_scale=0.05)
    batch = stream.batch(step)
"""

from workloads.distributions import PRESETS, Dist, DistributionError, parse_dist
from workloads.registry import get_workload, list_workloads, load_spec_file, workload_names
from workloads.sample import ENCODER_OF, ID_STRIDE, MODALITIES, Batch, Sample, Segment
from workloads.spec import (
    MixPhase,
    ScheduleSpec,
    SourceSpec,
    WorkloadError,
    WorkloadSpec,
    spec_from_dict,
)
from workloads.stream import WorkloadStream, pack_sequences
from workloads.tokens import (
    HF_RULE,
    UTILS_RULE,
    TokenRuleError,
    VisionRule,
    audio_mel_frames,
    audio_tokens,
    image_grid_thw,
    image_tokens,
    smart_resize,
    video_frames,
    video_grid_thw,
    video_tokens,
)
from workloads.trace import TraceError, load_trace

__all__ = [
    "ENCODER_OF",
    "HF_RULE",
    "ID_STRIDE",
    "MODALITIES",
    "PRESETS",
    "UTILS_RULE",
    "Batch",
    "Dist",
    "DistributionError",
    "MixPhase",
    "Sample",
    "ScheduleSpec",
    "Segment",
    "SourceSpec",
    "TokenRuleError",
    "TraceError",
    "VisionRule",
    "WorkloadError",
    "WorkloadSpec",
    "WorkloadStream",
    "audio_mel_frames",
    "audio_tokens",
    "get_workload",
    "image_grid_thw",
    "image_tokens",
    "list_workloads",
    "load_spec_file",
    "load_trace",
    "pack_sequences",
    "parse_dist",
    "smart_resize",
    "spec_from_dict",
    "video_frames",
    "video_grid_thw",
    "video_tokens",
    "workload_names",
]

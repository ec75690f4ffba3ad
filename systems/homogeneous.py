"""Homogeneous: encoders live inside the LLM's first pipeline stage and inherit its layout.

Stands for Megatron-LM's LLaVA-style training: the vision/audio encoders sit on pipeline stage 0,
take the LLM's tensor and data parallelism, and run per LLM microbatch right before stage 0's
forward (their backward right after stage 0's backward) under the LLM's 1F1B schedule.

What it cannot do well: the encoders cannot get a layout of their own, so a small encoder runs at
the LLM's tp (wasteful all-reduces) and all encoder work lands on stage 0, which becomes the
slowest stage when a batch is media-heavy; later stages idle (bubbles) while stage 0 encodes.
"""

from __future__ import annotations

from omnibench.plan import Plan
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import finish, plan_encoders_in_stage0
from workloads.sample import Batch


class HomogeneousPlanner:
    name = "homogeneous"
    reads_recompute = False  # its plans are the same for every recompute mode (systems.offer_plan)

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan:
        return finish(
            plan_encoders_in_stage0(self.name, model, parallel, batch, encoder_tp=parallel.tp), parallel
        )

"""Temporal: every rank runs every module, one module at a time, on one shared mesh.

Stands for VeOmni (and the "temporal multiplexing" status quo that Mosaic names): encoders are
FSDP data-parallel over all ranks (no tensor parallelism), the LLM uses the same ranks, and each
microbatch runs encoder forward, LLM forward, LLM backward, encoder backward in sequence. With
LLM tp/cp > 1 a microbatch's encoder samples are split over that group's ranks and the outputs
exchanged across the boundary.

What it cannot do well: no overlap between modules and no pipeline parallelism (pp must be 1),
so a rank whose microbatch is media-heavy is slow while its data-parallel peers wait at the next
collective: dynamic workloads turn directly into stragglers.
"""

from __future__ import annotations

from omnibench.plan import Plan, PlanError
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import finish, plan_encoders_in_stage0
from workloads.sample import Batch


class TemporalPlanner:
    name = "temporal"

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan:
        if parallel.pp != 1:
            raise PlanError(f"pp: temporal runs one module at a time on every rank and has no pipeline; got pp={parallel.pp}, allowed: 1")
        return finish(plan_encoders_in_stage0(self.name, model, parallel, batch, encoder_tp=1))

"""Temporal: every rank runs every module, one module at a time, on one shared mesh.

Stands for VeOmni (and the "temporal multiplexing" status quo that Mosaic names):
- every module's parameters are FSDP-sharded over all ranks (encoders at tp 1, no pipeline);
- one Ulysses sequence-parallel degree for every module (VeOmni's `ulysses_parallel_size`): the
  LLM's context-parallel group (`cp`) is also each encoder's sequence-parallel group, so a
  microbatch's encoder samples run across that group, each member embedding 1/cp of the
  positions (two all-to-alls per block), and every member ends with the whole output the LLM
  rows it holds need (no boundary transfer inside a cp group);
- each microbatch runs encoder forward, LLM forward, LLM backward, encoder backward in sequence.

Its default layout (systems/defaults.py) is VeOmni's usual one: tp 1, pp 1, FSDP over all ranks,
the Ulysses degree the workload's longest sequences need. An explicit `--tp` is accepted (the LLM
takes tensor parallelism, encoders stay at tp 1 and split each microbatch's samples over the tp
ranks) but is not VeOmni.

What it cannot do well: no overlap between modules and no pipeline parallelism (pp must be 1),
so a rank whose microbatch is media-heavy is slow while its data-parallel peers wait at the next
collective: dynamic workloads turn directly into stragglers. Ulysses splits every sequence, short
ones too, so its all-to-alls are paid on every sample, not only on the long ones that need them.
"""

from __future__ import annotations

from omnibench.plan import Plan, PlanError
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import finish, plan_encoders_in_stage0
from workloads.sample import Batch


def check_veomni_layout(system: str, parallel: ParallelSpec, no_pipeline: str) -> None:
    """VeOmni's layout rules, which temporal and spatial share (one-line errors naming the field): pp 1, one
    Ulysses degree for every module, encoders with no tensor parallelism; `no_pipeline` says why pp must be 1."""
    if parallel.pp != 1:
        raise PlanError(f"pp: {system} {no_pipeline}; got pp={parallel.pp}, allowed: 1")
    if parallel.encoder_sp and parallel.encoder_sp != parallel.cp:
        raise PlanError(f"encoder_sp: {system} uses one Ulysses degree for every module (the LLM's cp group is the "
                        f"encoders' sp group); got encoder_sp={parallel.encoder_sp} with cp={parallel.cp}, "
                        f"allowed: 0 or {parallel.cp}")
    if parallel.encoder_tp > 1:
        raise PlanError(f"encoder_tp: {system}'s encoders are FSDP-sharded with no tensor parallelism; "
                        f"got encoder_tp={parallel.encoder_tp}, allowed: 0 or 1")


class TemporalPlanner:
    name = "temporal"
    reads_recompute = False  # its plans are the same for every recompute mode (systems.offer_plan)

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan:
        check_veomni_layout(self.name, parallel, "runs one module at a time on every rank and has no pipeline")
        return finish(plan_encoders_in_stage0(self.name, model, parallel, batch, encoder_tp=1, encoder_sp=parallel.cp),
                      parallel)

"""Collapsing ranks into classes (simulator/groups.py `classes`) must reach a stable partition: members
of one class exchange every message with peers of the same classes. Refinement carries a difference one
peer per round, so a long chain of peers (pipeline stages, boundary routes) needs as many rounds as it
is long; a class left unsplit holds ranks whose peers differ, and its one program then waits for a
message no class sends."""

from __future__ import annotations

import pytest

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from simulator.engine import Engine, simulate
from simulator.hardware import load_cluster
from systems import get_planner
from workloads.stream import WorkloadStream

pytestmark = pytest.mark.timeout(300)

# Optimus's GPT-175B with a ViT-22B (results/validation/models): at pp 8, tp 8 and two pipelines the
# difference between a tp group's first rank (it sends its encoder outputs over the boundary) and the
# others takes more than eight rounds to reach every stage
MODEL = "published/gpt-96L-12288h-96a-96kv-49152f-50257v-vit48L-6144h-48a-24576f"


def test_classes_are_a_stable_partition_and_a_long_pipeline_step_finishes():
    model = get_model(MODEL)
    batch = WorkloadStream("image_text_512_1536", seed=0, global_batch_tokens=65536).batch(0)
    plan = get_planner("omni").plan(model, ParallelSpec(world_size=128, tp=8, pp=8, microbatches=16,
                                                        recompute="full"), batch)
    cluster = load_cluster("h100", 128)
    classes = Engine(plan, model, cluster).classes()
    seen: dict[int, set] = {}
    for rank, rep in classes.items():
        peers = tuple(classes[a.peer] for a in plan.actions[rank] if a.kind in ("send", "recv", "boundary"))
        seen.setdefault(rep, set()).add(peers)
    assert all(len(v) == 1 for v in seen.values())
    assert simulate(plan, model, cluster).step_time > 0  # a deadlock raises SimulationError

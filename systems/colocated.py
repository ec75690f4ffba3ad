"""Colocated: encoders and LLM share every GPU but each module gets its own layout.

Stands for heterogeneous parallelism in the colocated role (Megatron MIMO `COLOCATED`): the
encoders run data parallel (optionally with their own tp, `--encoder-tp`) over all ranks while
the LLM keeps its dp/tp/pp/cp layout. A step has phases: encoder forward of the whole batch,
one boundary transfer (each sample's embeddings to the LLM ranks that consume them), the LLM's
1F1B, then the gradients back and the encoder backward.

What it cannot do well: the phases do not overlap, so LLM pipeline bubbles stay empty, and all
encoder activations of the step are alive at once through the LLM pass (memory).
"""

from __future__ import annotations

from omnibench.plan import BACKWARD, FORWARD, Action, Plan, PlanError, Route
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import (
    BoundaryIndex,
    active_encoders,
    assign_llm,
    balance,
    data_ranks,
    default_microbatches,
    encoder_costs_of,
    encoder_layout,
    finish,
    llm_layout,
    llm_stage_actions,
    make_routes,
    resolve_common,
    step_tail,
    weigh_of,
    with_dp_shard,
)
from workloads.sample import Batch


class ColocatedPlanner:
    name = "colocated"
    reads_recompute = False  # its plans are the same for every recompute mode (systems.offer_plan)

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan:
        resolve_common(model, parallel, batch)
        world = parallel.world_size
        enc_tp = parallel.encoder_tp or 1
        if world % enc_tp:
            raise PlanError(f"encoder_tp={enc_tp} does not divide world_size={world}")
        llm = llm_layout(parallel, range(world), interleaved=True)
        weigh = weigh_of(model, parallel)
        llm_mbs = assign_llm(batch, llm.dp, default_microbatches(parallel), llm.pp, weigh)
        m = len(llm_mbs[0])
        layouts = {"llm": llm}
        assignment: dict = {"llm": dict(zip(data_ranks(llm), llm_mbs, strict=True))}
        routes: list[Route] = []
        for module in model.encoders:
            enc = with_dp_shard(encoder_layout(module, range(world), tp=enc_tp, fsdp=parallel.fsdp, zero=parallel.zero), parallel)
            layouts[module] = enc
            work = list(encoder_costs_of(batch, module, weigh).items())
            # One encoder microbatch per rank: the whole batch's encoder work in one forward.
            parts = balance(work, enc.dp)
            assignment[module] = {r: [tuple(parts[k])] for k, r in enumerate(data_ranks(enc))}
            routes += make_routes(module, batch, llm, llm_mbs, enc, assignment[module])
        active = active_encoders(model, batch)
        index = BoundaryIndex(routes, llm)
        actions: dict[int, list[Action]] = {}
        for r in range(world):
            acts: list[Action] = []
            for mod in active:
                acts.append(Action(FORWARD, mod, 0))
                acts += index.send_acts(mod, r, 0)
            # Receive in the order the senders posted (module-major), as p2p matching is FIFO per pair.
            for mod in active:
                for j in range(m):
                    acts += index.recv_acts(mod, r, j)
            acts += llm_stage_actions(llm, r, m)
            for mod in reversed(active):
                for j in range(m):
                    acts += index.send_grads(mod, r, j)
            for mod in reversed(active):
                acts += index.recv_grads(mod, r, 0)
                acts.append(Action(BACKWARD, mod, 0))
            actions[r] = acts + step_tail(["llm", *active])
        plan = Plan(
            system=self.name,
            step=batch.step,
            world_size=world,
            model=model.name,
            samples=list(batch.samples),
            layouts=layouts,
            assignment=assignment,
            routes=routes,
            actions=actions,
            options={"microbatches": m, "encoder_tp": enc_tp, "encoder_microbatches": 1},
        )
        return finish(plan, parallel)

"""Noncolocated: encoders and LLM on disjoint GPUs; the encoders are a pipeline stage of their own.

Stands for DistTrain and Megatron MIMO `NON_COLOCATED`: the first `encoder_ranks` ranks run the
encoders (data parallel, optional `--encoder-tp`), the rest run the LLM with its own dp/tp/pp/cp.
Microbatch j of every LLM data rank (default 2 * (pp + 1) microbatches, so the encoder stage has
something to overlap) is encoded as round j on the encoder ranks (balanced over
them), streamed across the boundary to the LLM's stage 0, and its gradients come back after
stage 0's backward; the encoder ranks run 1F1B as stage "-1" of the pipeline, so encoding of
later microbatches overlaps the LLM's work on earlier ones (synchronous: no stale weights).

What it cannot do well: the split of GPUs is fixed for a nominal data mix (default from the
model's FLOPs per token, `nominal_encoder_share`); when a batch is more or less media-heavy than
that, one side waits for the other.
"""

from __future__ import annotations

from omnibench.plan import BACKWARD, FORWARD, Action, Plan, PlanError, Route
from omnibench.specs.model import MultimodalSpec, VisionEncoderSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import (
    BoundaryIndex,
    active_encoders,
    assign_llm,
    balance,
    data_ranks,
    encoder_costs_of,
    encoder_layout,
    finish,
    llm_layout,
    llm_stage_actions,
    make_routes,
    one_f_one_b,
    resolve_common,
    step_tail,
    weigh_of,
    with_dp_shard,
)
from workloads.sample import Batch

# Nominal mix the default split is sized for: half of the LLM's tokens come from encoders.
NOMINAL_MEDIA_SHARE = 0.5


def _layer_params(hidden: int, ffn: int, gated: bool) -> int:
    return 4 * hidden * hidden + (3 if gated else 2) * hidden * ffn


def nominal_encoder_share(model: MultimodalSpec) -> float:
    """Encoder share of a step's FLOPs for the nominal mix (parameter FLOPs per LLM token; the
    vision encoder sees 4 positions per LLM token, audio 2)."""
    llm = model.llm
    ffn = llm.moe.expert_ffn * llm.moe.top_k if llm.moe else llm.ffn
    llm_per_token = llm.layers * _layer_params(llm.hidden, ffn, True)
    enc_per_token = 0.0
    encs = model.encoders
    for enc in encs.values():
        positions = 4 if isinstance(enc, VisionEncoderSpec) else 2
        gated = isinstance(enc, VisionEncoderSpec) and enc.mlp == "swiglu"
        enc_per_token += NOMINAL_MEDIA_SHARE / len(encs) * positions * enc.layers * _layer_params(enc.hidden, enc.ffn, gated)
    return enc_per_token / (enc_per_token + llm_per_token)


def split_ranks(model: MultimodalSpec, parallel: ParallelSpec) -> int:
    """How many ranks the encoders get (the rest run the LLM)."""
    world, per = parallel.world_size, parallel.tp * parallel.pp * parallel.cp
    enc_tp = parallel.encoder_tp or 1
    if parallel.encoder_ranks:
        n = parallel.encoder_ranks
        if n >= world:
            raise PlanError(f"encoder_ranks={n} leaves no rank for the LLM (world_size={world})")
        if (world - n) % per:
            raise PlanError(f"encoder_ranks={n} leaves {world - n} LLM ranks, not a multiple of tp*pp*cp={per}")
        if parallel.dp and parallel.dp * per != world - n:
            raise PlanError(f"dp={parallel.dp}: dp*tp*pp*cp = {parallel.dp * per} but encoder_ranks={n} leaves {world - n}")
        if n % enc_tp:
            raise PlanError(f"encoder_tp={enc_tp} does not divide encoder_ranks={n}")
        return n
    if parallel.dp:
        n = world - parallel.dp * per
        if n < 1:
            raise PlanError(f"dp={parallel.dp}: dp*tp*pp*cp = {parallel.dp * per} leaves no rank for the encoders")
        return n
    target = nominal_encoder_share(model) * world
    options = [world - k * per for k in range(1, world // per + 1) if 0 < world - k * per and (world - k * per) % enc_tp == 0]
    if not options:
        raise PlanError(f"world_size={world}: noncolocated needs ranks for the encoders beyond tp*pp*cp={per}")
    return min(options, key=lambda n: (abs(n - target), n))


class NoncolocatedPlanner:
    name = "noncolocated"
    reads_recompute = False  # its plans are the same for every recompute mode (systems.offer_plan)

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan:
        resolve_common(model, parallel, batch)
        if not model.encoders:
            raise PlanError(f"model: noncolocated needs an encoder; {model.name} has none")
        world = parallel.world_size
        n_enc = split_ranks(model, parallel)
        enc_tp = parallel.encoder_tp or 1
        llm = llm_layout(parallel, range(n_enc, world))
        # The encoders are a pipeline stage too: enough microbatches to overlap them with the LLM.
        weigh = weigh_of(model, parallel)
        llm_mbs = assign_llm(batch, llm.dp, parallel.microbatches or 2 * (llm.pp + 1), llm.pp, weigh)
        m = len(llm_mbs[0])
        layouts = {"llm": llm}
        assignment: dict = {"llm": dict(zip(data_ranks(llm), llm_mbs, strict=True))}
        routes: list[Route] = []
        for module in model.encoders:
            enc = with_dp_shard(encoder_layout(module, range(n_enc), tp=enc_tp, fsdp=parallel.fsdp, zero=parallel.zero), parallel)
            layouts[module] = enc
            enc_mbs: dict[int, list[tuple[int, ...]]] = {r: [] for r in data_ranks(enc)}
            cost = encoder_costs_of(batch, module, weigh)
            for j in range(m):
                # Round j: microbatch j of every LLM data rank, balanced over the encoder ranks.
                work = [(i, cost[i]) for mbs in llm_mbs for i in mbs[j] if i in cost]
                parts = balance(work, enc.dp)
                for k, r in enumerate(data_ranks(enc)):
                    enc_mbs[r].append(tuple(parts[k]))
            assignment[module] = enc_mbs
            routes += make_routes(module, batch, llm, llm_mbs, enc, enc_mbs)
        active = active_encoders(model, batch)
        index = BoundaryIndex(routes, llm)
        actions: dict[int, list[Action]] = {}
        for r in range(n_enc):
            acts: list[Action] = []
            if active:
                # The encoders are stage 0 of a (pp + 1)-stage pipeline.
                for kind, j in one_f_one_b(0, llm.pp + 1, m):
                    if kind == "F":
                        for mod in active:
                            acts.append(Action(FORWARD, mod, j))
                            acts += index.send_acts(mod, r, j)
                    else:
                        for mod in reversed(active):
                            acts += index.recv_grads(mod, r, j)
                            acts.append(Action(BACKWARD, mod, j))
            actions[r] = acts + step_tail(active)
        for r in range(n_enc, world):

            def before(j: int, r: int = r) -> list[Action]:
                return [a for mod in active for a in index.recv_acts(mod, r, j)]

            def after(j: int, r: int = r) -> list[Action]:
                return [a for mod in reversed(active) for a in index.send_grads(mod, r, j)]

            actions[r] = llm_stage_actions(llm, r, m, before, after) + step_tail(["llm"])
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
            options={"microbatches": m, "encoder_tp": enc_tp, "encoder_ranks": n_enc},
        )
        return finish(plan, parallel)

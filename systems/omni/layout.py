"""Decoupled layouts: the LLM keeps its full 5D layout over every rank, each encoder gets its own
data-parallel layout over the same ranks, and long inputs get fixed sequence-parallel groups.

Placement. Ranks are numbered node by node (`gpus_per_node` consecutive ranks share NVLink). The
LLM mesh lists tp innermost, then cp, then dp, then pp, so tp and cp groups are runs of
consecutive ranks and land inside one node whenever tp*cp divides the node; encoder tp groups and
the long-input sequence-parallel groups are consecutive too. The traffic those groups carry every
layer (TP all-reduces, CP and Ulysses all-to-alls) then crosses NVLink, and only data-parallel
reductions and the encoder->LLM boundary cross the network. `placement_notes` says where every
group landed.

Encoder training state. By default (`encoder_dp=zero2`) every rank holds an encoder's whole weights
and only its slice of the fp32 master weights, AdamW moments and (after grad_sync's reduce-scatter)
gradients: ZeRO-2 over the encoder's data ranks (omnibench/runtime/zero.py). Weights stay whole
because FSDP would lock every rank's encoder forward to every other rank's layer by layer, and then
no rank could run encoder work inside its own pipeline bubble; what ZeRO shards is what a forward
never touches. ZeRO-2 moves DDP's bytes (a reduce-scatter, then an all-gather of the updated slice
instead of an all-reduce) and steps 1/n of the optimizer, so it beats DDP on memory and optimizer
time and costs nothing in the forward: the natural default. `fsdp` / `hsdp` (the baselines' mode)
shard the weights too, for memory, at the price of the joint pipeline (the planner then runs encoder
work all ahead in one order on every rank); `ddp` / `zero1` are there for comparison.

At thousands of GPUs ZeRO-2's reduce-scatter and all-gather are rings over every rank, and a ring
pays one hop latency per member: `hzero2` keeps ZeRO-2's whole weights but shards the state within
groups of a few nodes (the automatic HSDP shard group, systems/common.py `resolve_dp_shard`) and
replicates it across them, as Megatron-Core's partial distributed optimizer does
(`num_distributed_optimizer_instances`): gradients reduce-scattered within the group, the slice
all-reduced across the groups, the updated weights all-gathered within the group.
"""

from __future__ import annotations

from dataclasses import replace

from omnibench.plan import Layout, PlanError
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import encoder_layout, llm_layout, with_dp_shard
from systems.omni.options import ENCODER_STATE_MODES


def build_layouts(model: MultimodalSpec, parallel: ParallelSpec, encoder_dp: str = "zero2") -> dict[str, Layout]:
    world = parallel.world_size
    enc_tp = parallel.encoder_tp or 1
    if world % enc_tp:
        raise PlanError(f"encoder_tp={enc_tp} does not divide world_size={world}")
    layouts = {"llm": llm_layout(parallel, range(world))}
    mode = ENCODER_STATE_MODES[encoder_dp]
    # hsdp, hzero2: the automatic shard group unless the user gave one; the others: the whole group
    shard = replace(parallel, dp_shard=parallel.dp_shard if parallel.dp_shard > 0 else mode["dp_shard"])
    for module in model.encoders:
        lay = encoder_layout(module, range(world), tp=enc_tp, fsdp=mode["fsdp"], zero=mode["zero"])
        layouts[module] = with_dp_shard(lay, shard, hybrid_zero=encoder_dp == "hzero2")
    return layouts


def locks_encoders(layouts: dict[str, Layout]) -> bool:
    """Whether an encoder's forward waits for its peers layer by layer (FSDP / HSDP over > 1 rank)."""
    return any(lay.fsdp and lay.fsdp_size > 1 for name, lay in layouts.items() if name != "llm")


def sp_sizes(model: MultimodalSpec, parallel: ParallelSpec, module: str, enc: Layout) -> list[int]:
    """Group sizes a sequence-parallel sample of `module` may be split over, smallest first:
    [`encoder_sp`] when given, else every size > 1 that divides the encoder's heads (Ulysses splits
    heads) and its data ranks and fits in a node (the all-to-alls run every layer). The planner
    weighs them per batch: a larger group splits a long input further, a smaller one pays less
    exchange, and one the size of the LLM's cp x tp group holds the outputs its own ranks consume.
    Groups are consecutive ranks, so a size whose groups would straddle nodes is left out."""
    heads = model.encoders[module].heads
    if parallel.encoder_sp:
        k = parallel.encoder_sp
        if enc.dp % k:
            raise PlanError(f"encoder_sp={k} does not divide the {enc.dp} {module} data ranks")
        return [k] if k > 1 else []
    limit = min(enc.dp, max(1, parallel.gpus_per_node // enc.tp))
    node = parallel.gpus_per_node
    # consecutive groups stay inside nodes when k * tp divides the node (or spans whole nodes: small clusters)
    return [k for k in range(2, limit + 1)
            if heads % k == 0 and enc.dp % k == 0 and (node % (k * enc.tp) == 0 or (k * enc.tp) % node == 0)]


def node_of(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


def _where(groups: list[tuple[int, ...]], gpn: int) -> dict:
    nodes = [sorted({node_of(r, gpn) for r in g}) for g in groups]
    inside = sum(1 for n in nodes if len(n) == 1)
    shown = {f"{g[0]}..{g[-1]}" if len(g) > 1 else str(g[0]): n[0] if len(n) == 1 else n
             for g, n in list(zip(groups, nodes, strict=True))[:16]}
    return {"groups": len(groups), "inside_one_node": inside, "node_of_group": shown}


def placement_notes(layouts: dict[str, Layout], parallel: ParallelSpec, sp: dict[str, list]) -> dict:
    gpn = parallel.gpus_per_node
    llm = layouts["llm"]
    out: dict = {"gpus_per_node": gpn, "nodes": -(-parallel.world_size // gpn)}
    for dim in ("tp", "cp", "dp", "pp"):
        if getattr(llm, dim) > 1:
            out[f"llm_{dim}"] = _where(llm.groups(dim), gpn)
    if llm.hsdp:  # parameters sharded inside these groups, replicated across them
        out["llm_dp_shard"] = _where(llm.shard_groups(), gpn)
    for name, lay in layouts.items():
        if name == "llm":
            continue
        if lay.tp > 1:
            out[f"{name}_tp"] = _where(lay.groups("tp"), gpn)
        if sp.get(name):
            out[f"{name}_long_sp"] = _where([tuple(g) for g in sp[name]], gpn)
    return out

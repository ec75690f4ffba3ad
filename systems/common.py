"""Planning pieces every baseline shares (and `omni` can reuse): layouts, data assignment,
1F1B schedules, boundary routes and the actions that move tensors. No tensors here.

Conventions the runtime and the simulator rely on
- The LLM's *data rank* of a data-parallel group is its rank at (pp=0, cp=0, tp=0);
  `Plan.assignment["llm"]` is keyed by data ranks only (every sample exactly once). Every other
  rank of the group (other stages, cp and tp peers) runs the same microbatches.
- An encoder's data rank is its rank at (sp=0, tp=0) of an encoder dp index; encoder microbatches
  may be empty tuples (the runtime then runs a dummy forward so the module's collectives stay in
  step); every encoder rank runs the same number of encoder microbatches.
- Routes: one per (sample, consuming LLM rank); the consumers are the pp=0 ranks of the sample's
  data group (every cp and tp rank needs the embeddings). The source is the consumer itself when
  that rank computed the output (no transfer), else the encoder data rank (the tp leader).
- Gradients cross the boundary back only along each sample's *primary* route, the one to the
  consumer at cp=0, tp=0, whose source is always the encoder data rank; the encoder's tp peers
  get the gradient by broadcast inside encoder backward. On the LLM side the primary consumer
  holds the full gradient (tp peers hold identical copies; cp shards are summed inside LLM backward).
- Boundary messages group all routes of one (src, src microbatch, dst, dst microbatch) in
  sample-id order; senders post them right after the encoder forward, receivers right before the
  LLM forward that needs them.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace

from omnibench.plan import (
    BACKWARD,
    BOUNDARY,
    FORWARD,
    GRAD_SYNC,
    OPTIMIZER_STEP,
    RECV,
    SEND,
    Action,
    Layout,
    Plan,
    PlanError,
    Route,
    check_message_order,
    p2p_messages,
)
from omnibench.specs.model import FREEZABLE, MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from workloads.sample import ENCODER_OF, Batch, Sample

# ----------------------------------------------------------------------------------- layouts


def llm_layout(parallel: ParallelSpec, ranks: Sequence[int], interleaved: bool = False) -> Layout:
    """The LLM's layout over `ranks` (mesh order pp, dp, cp, tp), dp filled from what is left.

    `interleaved`: the caller schedules interleaved 1F1B (`llm_stage_actions`); any other caller
    refuses virtual_stages > 1 in one line."""
    if parallel.virtual_stages > 1 and not interleaved:
        raise PlanError(f"virtual_stages={parallel.virtual_stages}: interleaved 1F1B is planned by homogeneous and "
                        "colocated only (this system schedules its LLM stages itself)")
    per = parallel.tp * parallel.pp * parallel.cp
    n = len(ranks)
    if n % per:
        raise PlanError(f"tp*pp*cp = {per} does not divide the {n} ranks the LLM gets")
    dp = parallel.dp or n // per
    if dp * per != n:
        raise PlanError(
            f"dp: dp*tp*pp*cp = {dp}*{parallel.tp}*{parallel.pp}*{parallel.cp} = {dp * per} "
            f"but the LLM gets {n} ranks"
        )
    if parallel.expert_tp == 1 and (dp * parallel.cp * parallel.tp) % parallel.ep:
        raise PlanError(f"ep={parallel.ep} must divide dp*cp*tp = {dp * parallel.cp * parallel.tp} (expert_tp 1: "
                        "experts spread over the data and tensor ranks)")
    if parallel.expert_tp != 1 and (dp * parallel.cp) % parallel.ep:
        raise PlanError(f"ep={parallel.ep} must divide dp*cp = {dp * parallel.cp} (experts spread over data ranks)")
    lay = Layout(
        "llm", tuple(ranks), dp=dp, tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, ep=parallel.ep, fsdp=parallel.fsdp,
        zero=0 if parallel.fsdp else parallel.zero, vpp=parallel.virtual_stages, cp_kind=parallel.cp_kind,
        embedding_loss_stages=parallel.embedding_loss_stages, expert_tp=parallel.expert_tp,
    )
    return with_dp_shard(lay, parallel)


# HSDP default: a shard group spans at most this many nodes (and never fewer than this many ranks,
# so clusters of up to 64 ranks keep plain FSDP whatever their node size). torchtitan and Megatron
# runs at thousands of GPUs shard within one to a few nodes and replicate across; 8 nodes keeps the
# per-rank training state small for 7B-70B models while a ring step count stays in the tens.
AUTO_SHARD_NODES = 8
AUTO_SHARD_MIN_RANKS = 64


def auto_shard_span(gpus_per_node: int) -> int:
    """Ranks the automatic shard group may span (before dividing by tp): a cluster no larger than this
    gets one shard group, i.e. no HSDP or hybrid ZeRO."""
    return max(AUTO_SHARD_MIN_RANKS, AUTO_SHARD_NODES * gpus_per_node)


def resolve_dp_shard(parallel: ParallelSpec, layout: Layout, hybrid_zero: bool = False) -> int:
    """The `dp_shard` a module's layout gets: `parallel.dp_shard` when given (-1: plain FSDP), else the largest divisor
    of its FSDP group whose shard group spans at most AUTO_SHARD_NODES nodes (members sit `tp` ranks
    apart) and holds whole cp (sp) and ep groups; 0 when that is the whole group (plain FSDP).
    `hybrid_zero`: the same groups for a ZeRO-1/2 layout (omni's `encoder_dp=hzero2`); a ZeRO layout
    otherwise shards over its whole data-parallel group."""
    n = layout.fsdp_size
    if not (layout.fsdp or (hybrid_zero and layout.zero)) or n <= 1 or parallel.dp_shard == -1:
        return 0
    llm = layout.module == "llm"
    dims = "*".join(layout.fsdp_dims)
    if parallel.dp_shard:
        k = parallel.dp_shard
        if not llm and k >= n:
            return 0  # an encoder's FSDP group smaller than the LLM's shard group: plain FSDP
        if n % k:
            raise PlanError(f"dp_shard={k} does not divide the {n} ranks FSDP shards {layout.module} over ({dims}); "
                            f"allowed: 0 (automatic) or a divisor of {n}")
        return 0 if k == n else k
    unit = math.lcm(layout.cp, layout.ep) if llm else layout.sp
    target = max(1, auto_shard_span(parallel.gpus_per_node) // layout.tp)
    fits = [d for d in range(unit, n + 1, unit) if n % d == 0 and d <= target]
    k = max(fits) if fits else unit
    return 0 if k == n else k


def with_dp_shard(layout: Layout, parallel: ParallelSpec, hybrid_zero: bool = False) -> Layout:
    k = resolve_dp_shard(parallel, layout, hybrid_zero)
    return replace(layout, dp_shard=k) if k != layout.dp_shard else layout


def stage_of(layout: Layout, rank: int) -> int:
    return layout.coord(rank, "pp")


def _cached(layout: Layout, name: str, make):
    """`make()`, kept on the layout off its dataclass fields (as Layout keeps its coordinates and
    groups), so equality, hashing and JSON are unchanged: planners ask the same questions per rank many
    times."""
    got = layout.__dict__.get(name)
    if got is None:
        got = make()
        object.__setattr__(layout, name, got)
    return got


def data_rank(layout: Layout, rank: int) -> int:
    """The rank holding the assignment of `rank`'s data group (LLM: pp=cp=tp=0; encoders: sp=tp=0)."""
    table = _cached(layout, "_data_rank", dict)
    got = table.get(rank)
    if got is None:
        got = table[rank] = _data_ranks(layout)[layout.coord(rank, "dp")]
    return got


def _data_ranks(layout: Layout) -> list[int]:
    """Each data group's rank holding its assignment, by dp index (kept on the layout: read, not changed)."""
    def make() -> list[int]:
        if layout.module == "llm":
            return [layout.rank_at(pp=0, dp=d, cp=0, tp=0) for d in range(layout.dp)]
        return [layout.rank_at(dp=d, sp=0, tp=0) for d in range(layout.dp)]
    return _cached(layout, "_data_ranks", make)


def data_ranks(layout: Layout) -> list[int]:
    return list(_data_ranks(layout))  # a copy: callers may change theirs


def consumers(layout: Layout, dp_index: int) -> list[int]:
    """The LLM ranks that need a data group's embeddings: stage 0, every cp and tp rank."""
    return [layout.rank_at(pp=0, dp=dp_index, cp=c, tp=t) for c in range(layout.cp) for t in range(layout.tp)]


def encoder_layout(module: str, ranks: Sequence[int], tp: int = 1, sp: int = 1, fsdp: bool = True,
                   zero: int = 0) -> Layout:
    n = len(ranks)
    if n % (tp * sp):
        raise PlanError(f"encoder_tp*encoder_sp = {tp * sp} does not divide the {n} ranks {module} gets")
    return Layout(module, tuple(ranks), dp=n // (tp * sp), tp=tp, sp=sp, fsdp=fsdp, zero=0 if fsdp else zero)


# ---------------------------------------------------------------------------- data assignment


def balance(items: Iterable[tuple[int, float]], bins: int) -> list[list[int]]:
    """Longest-processing-time greedy split of (id, cost) into `bins` bins; deterministic.

    Ties break on id and bin index so every system gets the same split of the same batch.
    Each bin lists its ids in ascending order.
    """
    heap = [(0.0, 0, k) for k in range(bins)]  # (load, items, bin): a heap keeps 1,024-way splits fast
    out: list[list[int]] = [[] for _ in range(bins)]
    for i, cost in sorted(items, key=lambda x: (-x[1], x[0])):
        load, n, b = heap[0]
        out[b].append(i)
        heapq.heapreplace(heap, (load + cost, n + 1, b))  # the least bin, refilled: one sift, not two
    return [sorted(b) for b in out]


def default_microbatches(parallel: ParallelSpec) -> int:
    if parallel.microbatches:
        return parallel.microbatches
    return 2 * parallel.pp if parallel.pp > 1 else 1


def by_identity(objects: int, size: int = 64):
    """Decorator: `fn(*objs, *args)` answered once per the identities of its first `objects` arguments
    (a batch, its samples, a model) and the values of the rest. A tune plans and weighs the same batch at
    every layout it tries, and sums over its samples (tens of thousands at 8,192 GPUs) depend on the batch
    alone. The objects are kept alive with their answer, so an identity is never reused for another;
    the last `size` answers are kept. The objects must not change once made (batches and models do not:
    every planner and estimate only reads them)."""

    def decorate(fn):
        memo: dict = {}

        def wrapped(*a):
            objs, args = a[:objects], a[objects:]
            k = (tuple(map(id, objs)), args)
            hit = memo.get(k)
            if hit is not None and all(x is y for x, y in zip(hit[0], objs, strict=True)):
                return hit[1]
            if len(memo) >= size:
                memo.clear()
            out = fn(*a)
            memo[k] = (objs, out)
            return out

        wrapped.__wrapped__ = fn
        wrapped.__doc__ = fn.__doc__
        return wrapped

    return decorate


# How a planner weighs a batch's samples when it splits them over ranks (`--option balancer=NAME`, read by
# every system from ParallelSpec.options):
# - tokens: LLM tokens, and an encoder's positions plus its attention term (what the baselines' anchors
#   balance by: Megatron-LM and VeOmni pack and split by token counts);
# - analytic: each sample's exact training FLOPs (omnibench/specs/costs.py) at one nominal rate per
#   module (CostModel.analytic): what any planner can know before a step runs;
# - simulator: the simulator's own compute model of the hardware (CostModel.from_simulator): the step the
#   plan will be judged on, an oracle no real system has.
BALANCERS = ("tokens", "analytic", "simulator")


# every system's default: the same information for every planner (the harness's full-strength comparison);
# `--option balancer=tokens` gives the baselines as their anchors deploy them
DEFAULT_BALANCER = "analytic"


def weigh_of(model: MultimodalSpec, parallel: ParallelSpec, with_encoders: bool = False,
             default: str = DEFAULT_BALANCER) -> tuple:
    """The hashable description of how `parallel`'s planner weighs samples (`_weights`): the balancer,
    the model, whether a sample's encoder work runs on its LLM data ranks (homogeneous, temporal) and
    counts toward their balance, and the hardware the simulator balancer prices on."""
    opts = parallel.options or {}
    name = str(opts.get("balancer") or default)
    if name not in BALANCERS:
        raise PlanError(f"options.balancer must be one of {', '.join(BALANCERS)}; got {name!r}")
    if name == "tokens":
        return ("tokens",)
    return (name, model, with_encoders, str(opts.get("hardware") or "h100") if name == "simulator" else "")


@functools.lru_cache(maxsize=16)
def _cost_model(name: str, model: MultimodalSpec, hardware: str):
    from omnibench.specs.cost_model import load_cost_model

    # the one loader omni's planner uses too: analytic without a hardware, the simulator's model with one
    return load_cost_model(model, None, hardware if name == "simulator" else "")


@by_identity(1, size=16)
def _weights(batch: Batch, weigh: tuple) -> dict[int, float]:
    """sample id -> what the LLM's data split balances (`weigh_of`), in the batch's order."""
    if weigh[0] == "tokens":
        return llm_tokens_of(batch)
    name, model, with_encoders, hardware = weigh
    cm = _cost_model(name, model, hardware)
    return {s.sample_id: cm.llm(s) + (cm.encoders(s) if with_encoders else 0.0) for s in batch.samples}


@by_identity(1, size=8)
def llm_tokens_of(batch: Batch) -> dict[int, int]:
    """sample id -> its LLM tokens, in the batch's order (read only: shared by the batch's plans)."""
    return {s.sample_id: s.llm_tokens for s in batch.samples}


@by_identity(1, size=16)
def encoder_costs_of(batch: Batch, module: str, weigh: tuple = ("tokens",)) -> dict[int, float]:
    """sample id -> the cost `weigh` (`weigh_of`) gives `module`'s work on each sample with work for it
    (`encoder_cost` under tokens), in the batch's order (read only: shared by the batch's plans)."""
    if weigh[0] == "tokens":
        return {s.sample_id: encoder_cost(s, module) for s in batch.samples if s.encoder_seq_lens(module)}
    cm = _cost_model(weigh[0], weigh[1], weigh[3])
    return {s.sample_id: cm.encoder(s, module) for s in batch.samples if s.encoder_seq_lens(module)}


def assign_llm(batch: Batch, dp: int, microbatches: int, pp: int = 1,
               weigh: tuple = ("tokens",)) -> list[list[tuple[int, ...]]]:
    """Split the global batch over `dp` data groups (balanced by `weigh`: LLM tokens unless the plan's
    balancer says otherwise), then each group's samples into microbatches (balanced again). Every group
    gets the same number of microbatches, at most its sample count, so data-parallel collectives stay
    in step."""
    # A tune weighs many layouts of one data-parallel size on the same batch (tp x cp splits, recompute
    # modes, encoder knobs): the split is worked out once per (batch, dp, microbatches, pp), and each
    # plan gets lists of its own (the microbatches are tuples)
    return [list(group) for group in _assign_llm(batch, dp, microbatches, pp, weigh)]


@by_identity(1, size=16)
def _assign_llm(batch: Batch, dp: int, microbatches: int, pp: int,
                weigh: tuple = ("tokens",)) -> tuple[tuple[tuple[int, ...], ...], ...]:
    if len(batch.samples) < dp:
        raise PlanError(f"batch: {len(batch.samples)} samples cannot feed dp={dp} data-parallel ranks")
    tokens = _weights(batch, weigh)
    groups = balance(tokens.items(), dp)
    m = min(microbatches, min(len(g) for g in groups))
    if m < pp:
        raise PlanError(
            f"microbatches: only {m} microbatch(es) per data rank fit this batch but pp={pp} needs >= {pp}; "
            "use a larger batch or fewer stages"
        )
    return tuple(tuple(tuple(mb) for mb in balance(((i, tokens[i]) for i in g), m)) for g in groups)


@by_identity(1, size=16)
def _encoders_split(batch: Batch, module: str, dp: int, microbatches: int, pp: int, split: int,
                    weigh: tuple = ("tokens",)) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]:
    """Per LLM data group, per LLM microbatch (`_assign_llm`'s), its samples with work for `module`
    balanced over `split` encoder data ranks: what `plan_encoders_in_stage0` gives each, once per batch
    and split for every layout a tune weighs with it."""
    cost = encoder_costs_of(batch, module, _encoder_weigh(weigh))
    return tuple(tuple(tuple(tuple(part) for part in balance(((i, cost[i]) for i in mb if i in cost), split))
                       for mb in mbs) for mbs in _assign_llm(batch, dp, microbatches, pp, weigh))


def _encoder_weigh(weigh: tuple) -> tuple:
    """`weigh` for one encoder's own split (its LLM side's encoders-included flag has no meaning there)."""
    return weigh if weigh[0] == "tokens" else (weigh[0], weigh[1], False, weigh[3])


def encoder_cost(sample: Sample, module: str) -> float:
    # Linear in positions plus the attention term; only relative sizes matter for balancing.
    lens = sample.encoder_seq_lens(module)
    return float(sum(n + n * n / 4096 for n in lens))


def encoder_tokens(sample: Sample, module: str) -> int:
    """LLM tokens one sample's outputs of an encoder occupy (what crosses the boundary)."""
    return sum(seg.llm_tokens for seg in sample.segments if seg.encoder == module)


# ------------------------------------------------------------------------------------ routes


def make_routes(
    module: str,
    batch: Batch,
    llm: Layout,
    llm_mbs: list[list[tuple[int, ...]]],
    enc: Layout,
    enc_mbs: dict[int, list[tuple[int, ...]]],
    holders: dict[tuple[int, int], tuple[int, ...]] | None = None,
    leaders: dict[int, int] | None = None,
) -> list[Route]:
    """Routes for one encoder given where each sample is encoded (enc_mbs: encoder data rank ->
    microbatches) and consumed (llm_mbs: per LLM dp index).

    `holders[(src, mb)]`: every rank that ends that encoder microbatch with its whole output, at the
    same microbatch index (omni's sequence-parallel groups); a holder that is the sample's primary
    consumer (cp 0, tp 0, or `leaders[sample]`) is then its primary source too (no transfer, and the
    gradient comes back on the same rank), and any other consumer holding it reads its own copy."""
    where: dict[int, tuple[int, int]] = {}
    for src, mbs in enc_mbs.items():
        for j, mb in enumerate(mbs):
            for i in mb:
                where[i] = (src, j)
    by_id = {s.sample_id: s for s in batch.samples}
    routes = []
    base_holders: dict[int, set[int]] = {}  # per source rank (asked once per sample it encodes otherwise)
    for d, mbs in enumerate(llm_mbs):
        dsts = consumers(llm, d)
        for j, mb in enumerate(mbs):
            for i in mb:
                if i not in where:
                    continue
                src, src_mb = where[i]
                group = (holders or {}).get((src, src_mb))
                producers = group
                if producers is None:
                    producers = base_holders.get(src)
                    if producers is None:
                        producers = base_holders[src] = set(output_holders(enc, src))
                first = (leaders or {}).get(i, dsts[0])
                if group and first in group:
                    src = first
                tokens = encoder_tokens(by_id[i], module)
                for dst in dsts:
                    s = dst if (dst in producers and dst != first) else src
                    routes.append(Route(module, i, s, src_mb, dst, j, tokens))
    return routes


def output_holders(enc: Layout, src: int) -> list[int]:
    """Ranks that hold an encoder microbatch's whole output after its forward: the data rank's tp
    peers (they compute together) and, under Ulysses sequence parallelism, its sp peers (each
    embeds 1/sp of the positions, then the outputs are all-gathered)."""
    d = enc.coord(src, "dp")
    return [enc.rank_at(dp=d, sp=s, tp=t) for s in range(enc.sp) for t in range(enc.tp)]


def is_primary(route: Route, llm: Layout, leaders: dict[int, int] | None = None) -> bool:
    """The route that carries the gradient back. `leaders`: sample -> the one consumer that does,
    for samples an LLM context-parallel group of data ranks runs together (omni's long LLM samples)."""
    if leaders and route.sample_id in leaders:
        return route.dst_rank == leaders[route.sample_id]
    return llm.coord(route.dst_rank, "cp") == 0 and llm.coord(route.dst_rank, "tp") == 0


def long_llm_leaders(options: dict) -> dict[int, int]:
    """plan.options["long_short"]["llm_leaders"] as sample id -> leader rank ({} when absent)."""
    raw = (options or {}).get("long_short", {}).get("llm_leaders", {})
    return {int(k): int(v) for k, v in raw.items()}


def _messages(routes: Iterable[Route]) -> dict[tuple[int, int, int, int], list[Route]]:
    out: dict[tuple[int, int, int, int], list[Route]] = defaultdict(list)
    for r in routes:
        if r.src_rank != r.dst_rank:
            out[(r.src_rank, r.src_microbatch, r.dst_rank, r.dst_microbatch)].append(r)
    return out


class BoundaryIndex:
    """Boundary messages of a plan's routes, indexed for emitting actions in O(1) per lookup."""

    def __init__(self, routes: list[Route], llm: Layout, leaders: dict[int, int] | None = None):
        self.act_out: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(list)
        self.act_in: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(list)
        self.grad_out: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(list)
        self.grad_in: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(list)
        by_module: dict[str, list[Route]] = defaultdict(list)
        for r in routes:
            by_module[r.module].append(r)
        # is_primary's rule, with the LLM ranks at cp 0 and tp 0 listed once
        lead = {r for r in llm.ranks if llm.coord(r, "cp") == 0 and llm.coord(r, "tp") == 0}
        leaders = leaders or {}

        def primary(r: Route) -> bool:
            got = leaders.get(r.sample_id)
            return r.dst_rank in lead if got is None else r.dst_rank == got

        for module, rs in by_module.items():
            for (src, smb, dst, dmb) in sorted(_messages(rs)):
                self.act_out[(module, src, smb)].append((dst, dmb))
                self.act_in[(module, dst, dmb)].append((src, smb))
            for (src, smb, dst, dmb) in sorted(_messages(r for r in rs if primary(r))):
                self.grad_out[(module, dst, dmb)].append((src, smb))
                self.grad_in[(module, src, smb)].append((dst, dmb))
        for d in (self.act_in, self.grad_out):
            for k in d:
                d[k].sort(key=lambda x: (x[1], x[0]))

    def send_acts(self, module: str, rank: int, mb: int) -> list[Action]:
        return [
            Action(BOUNDARY, module, mb, what="act", peer=dst, direction="send", peer_microbatch=dmb)
            for dst, dmb in self.act_out.get((module, rank, mb), [])
        ]

    def recv_acts(self, module: str, rank: int, mb: int) -> list[Action]:
        return [
            Action(BOUNDARY, module, mb, what="act", peer=src, direction="recv", peer_microbatch=smb)
            for src, smb in self.act_in.get((module, rank, mb), [])
        ]

    def send_grads(self, module: str, rank: int, mb: int) -> list[Action]:
        return [
            Action(BOUNDARY, module, mb, what="grad", peer=src, direction="send", peer_microbatch=smb)
            for src, smb in self.grad_out.get((module, rank, mb), [])
        ]

    def recv_grads(self, module: str, rank: int, mb: int) -> list[Action]:
        return [
            Action(BOUNDARY, module, mb, what="grad", peer=dst, direction="recv", peer_microbatch=dmb)
            for dst, dmb in self.grad_in.get((module, rank, mb), [])
        ]


# ---------------------------------------------------------------------------------- schedules


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Non-interleaved 1F1B order of one stage: warm-up forwards, steady 1F1B, cool-down backwards."""
    warmup = min(stages - stage - 1, microbatches)
    order: list[tuple[str, int]] = [("F", j) for j in range(warmup)]
    f, b = warmup, 0
    while f < microbatches:
        order.append(("F", f))
        f += 1
        order.append(("B", b))
        b += 1
    order += [("B", j) for j in range(b, microbatches)]
    return order


def interleaved_1f1b(stage: int, stages: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B order of one pipeline rank (Narayanan et al. SC'21, sec. 2.2.2, as Megatron-LM
    schedules it): (kind, microbatch, chunk). Microbatches go through the chunks in groups of `stages`:
    the k-th forward runs chunk (k mod stages*chunks) // stages on microbatch
    (k // (stages*chunks)) * stages + k mod stages; backwards visit the chunks in reverse. Warm-up:
    2 (stages - stage - 1) + (chunks - 1) stages forwards (all of them when microbatches == stages)."""
    if microbatches % stages:
        raise PlanError(f"microbatches: interleaved 1F1B needs a multiple of pp={stages}; got {microbatches}")
    total = microbatches * chunks
    group = stages * chunks

    def unit(k: int, forward: bool) -> tuple[int, int]:
        c = (k % group) // stages
        return (k // group) * stages + k % stages, c if forward else chunks - 1 - c

    warmup = total if microbatches == stages else min(total, 2 * (stages - stage - 1) + (chunks - 1) * stages)
    order = [("F", *unit(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        order += [("F", *unit(warmup + i, True)), ("B", *unit(i, False))]
    order += [("B", *unit(k, False)) for k in range(total - warmup, total)]
    return order


def pipeline_neighbours(llm: Layout, rank: int, chunk: int = 0) -> tuple[int, int, int]:
    """(stage, previous stage's rank or -1, next stage's rank or -1) of an LLM rank's model chunk
    (virtual stage chunk * pp + pp coordinate; the rank's only stage without interleaving)."""
    c = llm.coords(rank)
    s = chunk * llm.pp + c["pp"]
    prev = llm.rank_at(**{**c, "pp": (s - 1) % llm.pp}) if s > 0 else -1
    nxt = llm.rank_at(**{**c, "pp": (s + 1) % llm.pp}) if s < llm.stages - 1 else -1
    return s, prev, nxt


@functools.lru_cache(maxsize=4096)
def shared_action(kind: str, module: str, microbatch: int = 0, stage: int = 0) -> Action:
    """One object for an action every rank of a step holds alike (Actions are immutable): a plan at
    scale would otherwise build the same step tail and stage compute actions once per rank."""
    return Action(kind, module, microbatch, stage)


def llm_forward_actions(j: int, stage: int, prev: int, nxt: int) -> list[Action]:
    """One LLM microbatch's forward on a stage: receive activations, compute, pass them on."""
    out = [Action(RECV, "llm", j, stage, "act", prev)] if prev >= 0 else []
    out.append(shared_action(FORWARD, "llm", j, stage))
    if nxt >= 0:
        out.append(Action(SEND, "llm", j, stage, "act", nxt))
    return out


def llm_backward_actions(j: int, stage: int, prev: int, nxt: int) -> list[Action]:
    """One LLM microbatch's backward on a stage: receive gradients, compute, pass them back."""
    out = [Action(RECV, "llm", j, stage, "grad", nxt)] if nxt >= 0 else []
    out.append(shared_action(BACKWARD, "llm", j, stage))
    if prev >= 0:
        out.append(Action(SEND, "llm", j, stage, "grad", prev))
    return out


def llm_stage_actions(
    llm: Layout, rank: int, microbatches: int, before_forward=None, after_backward=None
) -> list[Action]:
    """1F1B actions of one LLM rank with its pipeline sends/recvs; hooks add per-microbatch
    actions around stage 0's compute (encoder work, boundary transfers)."""
    if llm.vpp > 1:  # interleaved: each step of the order names the virtual stage (chunk) it runs
        neighbours = [pipeline_neighbours(llm, rank, c) for c in range(llm.vpp)]
        order = ((kind, j, neighbours[chunk]) for kind, j, chunk
                 in interleaved_1f1b(llm.coord(rank, "pp"), llm.pp, llm.vpp, microbatches))
    else:
        mine = pipeline_neighbours(llm, rank)
        order = ((kind, j, mine) for kind, j in one_f_one_b(mine[0], llm.pp, microbatches))
    out: list[Action] = []
    for kind, j, (s, prev, nxt) in order:
        if kind == "F":
            if before_forward is not None and s == 0:
                out += before_forward(j)
            out += llm_forward_actions(j, s, prev, nxt)
        else:
            out += llm_backward_actions(j, s, prev, nxt)
            if after_backward is not None and s == 0:
                out += after_backward(j)
    return out


def step_tail(modules: Iterable[str]) -> list[Action]:
    return [shared_action(GRAD_SYNC, m) for m in modules] + [shared_action(OPTIMIZER_STEP, "all")]


# ------------------------------------------------------------------------------------ checks


def check_p2p_order(plan: Plan) -> None:
    """Every ordered pair of ranks must post its messages (pipeline and boundary) in the same order
    on both sides: NCCL matches point-to-point messages first-in first-out per pair
    (`omnibench.plan.p2p_messages`). `Plan.validate(order=True)` checks it in its own pass."""
    check_message_order(*p2p_messages(plan))


def resolve_common(model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> None:
    parallel.validate(model)
    if not batch.samples:
        raise PlanError("batch: a step needs at least one sample")
    _check_encoders(batch, model)


@by_identity(2, size=8)
def _check_encoders(batch: Batch, model: MultimodalSpec) -> bool:
    """That the model has an encoder for every modality of the batch: once per batch and model (a tune
    plans one batch at every layout it weighs), an answer kept only when it passes."""
    encoders = model.encoders
    for s in batch.samples:
        for seg in s.segments:
            enc = ENCODER_OF.get(seg.modality)
            if enc is not None and enc not in encoders:
                raise PlanError(
                    f"model: {model.name} has no {enc} encoder for the batch's {seg.modality} samples; "
                    f"pick a model with one (e.g. tiny-omni) or a workload without {seg.modality}"
                )
    return True


def notes_for(plan: Plan) -> dict:
    """Figures a person reads first: per LLM data rank tokens, per encoder rank positions."""
    per_rank: dict[str, list[int]] = {}  # str keys: notes must survive a JSON round trip
    tokens = {s.sample_id: s.llm_tokens for s in plan.samples}
    for r, mbs in plan.assignment.get("llm", {}).items():
        per_rank[str(r)] = [sum(tokens[i] for i in mb) for mb in mbs]
    return {"llm_tokens_per_microbatch": per_rank}


def plan_summary(plan: Plan) -> dict:
    """What a plan decided, in a few numbers a results row can carry (the plan files are kept only for
    small clusters): per encoder the sequence-parallel scheme omni chose, its group size and how many
    samples ran in groups; how many LLM samples were split over a context-parallel group; how many
    samples resharding moved off their loader; the joint pipeline's order; and for every system how its
    batch was weighed (`options.balancer`, when a plan records it)."""
    notes = plan.notes or {}
    out: dict = {}
    encoders = {}
    for module, n in (notes.get("long_short") or {}).items():
        if isinstance(n, dict) and "scheme" in n:
            encoders[module] = {"scheme": n["scheme"], "sp_group_size": n.get("sp_group_size", 1),
                                "samples_in_groups": len(n.get("long_samples") or []) + int(n.get("group_samples") or 0),
                                "samples_alone": int(n.get("short_samples") or 0)}
    if encoders:
        out["encoders"] = encoders
    llm = notes.get("llm_long_short") or {}
    if isinstance(llm, dict) and llm.get("enabled"):
        out["llm_split_samples"] = len(llm.get("long_samples") or [])
        out["llm_split_group"] = llm.get("group_size", 1)
    reshard = notes.get("reshard") or {}
    if isinstance(reshard, dict) and reshard.get("enabled"):
        out["resharded_samples"] = reshard.get("samples_moved_off_loader", 0)
    schedule = notes.get("schedule") or {}
    if isinstance(schedule, dict) and "order" in schedule:
        out["encoder_order"] = schedule["order"] if schedule.get("joint_pipeline") else "before/after the LLM"
    if "cost_model" in notes:
        out["cost_model"] = notes["cost_model"]
    return out


# ------------------------------------------------------------------------ plan assembly


def active_encoders(model: MultimodalSpec, batch: Batch) -> list[str]:
    """Encoders with work in this batch (an idle encoder gets a layout but no actions)."""
    return [m for m in model.encoders if encoder_costs_of(batch, m)]


def plan_encoders_in_stage0(
    system: str, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch, encoder_tp: int,
    encoder_sp: int = 1,
) -> Plan:
    """Encoders run on the LLM's pipeline-stage-0 ranks, per LLM microbatch, just before it.

    Each LLM data group's microbatch j is encoded by the group's stage-0 ranks. Without encoder
    sequence parallelism (homogeneous: encoder_tp = LLM tp) its samples are split over the group's
    cp (and, when encoder_tp < LLM tp, tp) ranks as extra encoder data parallelism, encoder tp
    peers computing together. With `encoder_sp` = the LLM's cp (temporal, VeOmni's one Ulysses
    degree for every module) the encoder's sp group *is* the LLM's cp group: the microbatch's
    samples are split over the tp ranks only, and each cp group encodes its share together with
    Ulysses (every member embeds 1/sp of the positions and ends with the whole output).
    """
    resolve_common(model, parallel, batch)
    world = parallel.world_size
    llm = llm_layout(parallel, range(world), interleaved=True)
    if llm.tp % encoder_tp:
        raise PlanError(f"encoder_tp={encoder_tp} must divide the LLM's tp={llm.tp} when encoders share its ranks")
    # the encoders run on the data group's own stage-0 ranks before its LLM work: both count in its balance
    weigh = weigh_of(model, parallel, with_encoders=True)
    llm_mbs = assign_llm(batch, llm.dp, default_microbatches(parallel), llm.pp, weigh)
    m = len(llm_mbs[0])
    if encoder_sp > 1:
        if encoder_sp != llm.cp or encoder_tp != 1:
            raise PlanError(f"encoder_sp={encoder_sp}: encoders share the LLM's cp group as their sp group here, so "
                            f"encoder_sp must equal cp={llm.cp} with encoder_tp=1")
        for module, enc_spec in model.encoders.items():
            if enc_spec.heads % encoder_sp:
                raise PlanError(f"cp: {module} runs Ulysses over the LLM's cp group and cp={encoder_sp} does not "
                                f"divide its {enc_spec.heads} heads")
        # Mesh order (dp, sp, tp=1) over (LLM dp, tp) x cp: sp groups are the LLM's cp groups.
        stage0 = [llm.rank_at(pp=0, dp=d, cp=c, tp=t)
                  for d in range(llm.dp) for t in range(llm.tp) for c in range(llm.cp)]
        split = llm.tp  # encoder data ranks per LLM data group
    else:
        stage0 = [llm.rank_at(pp=0, dp=d, cp=c, tp=t)
                  for d in range(llm.dp) for c in range(llm.cp) for t in range(llm.tp)]
        split = llm.cp * (llm.tp // encoder_tp)  # encoder data ranks per LLM data group
    layouts = {"llm": llm}
    assignment: dict = {"llm": dict(zip(data_ranks(llm), llm_mbs, strict=True))}
    routes: list[Route] = []
    for module in model.encoders:
        enc = with_dp_shard(encoder_layout(module, stage0, tp=encoder_tp, sp=encoder_sp, fsdp=parallel.fsdp,
                                            zero=parallel.zero), parallel)
        layouts[module] = enc
        enc_mbs: dict[int, list[tuple[int, ...]]] = {r: [] for r in data_ranks(enc)}
        by_group = _encoders_split(batch, module, llm.dp, default_microbatches(parallel), llm.pp, split, weigh)
        for d, mbs in enumerate(by_group):
            for parts in mbs:
                for k in range(split):
                    enc_mbs[enc.rank_at(dp=d * split + k, sp=0, tp=0)].append(parts[k])
        assignment[module] = enc_mbs
        routes += make_routes(module, batch, llm, llm_mbs, enc, enc_mbs)
    active = active_encoders(model, batch)
    index = BoundaryIndex(routes, llm)
    actions: dict[int, list[Action]] = {}
    for r in range(world):

        def before(j: int, r: int = r) -> list[Action]:
            out = []
            for mod in active:
                out.append(Action(FORWARD, mod, j))
                out += index.send_acts(mod, r, j)
            for mod in active:
                out += index.recv_acts(mod, r, j)
            return out

        def after(j: int, r: int = r) -> list[Action]:
            out = []
            for mod in reversed(active):
                out += index.send_grads(mod, r, j)
            for mod in reversed(active):
                out += index.recv_grads(mod, r, j)
                out.append(Action(BACKWARD, mod, j))
            return out

        acts = llm_stage_actions(llm, r, m, before, after)
        on_stage0 = stage_of(llm, r) == 0
        actions[r] = acts + step_tail(["llm"] + (active if on_stage0 else []))
    return Plan(
        system=system,
        step=batch.step,
        world_size=world,
        model=model.name,
        samples=list(batch.samples),
        layouts=layouts,
        assignment=assignment,
        routes=routes,
        actions=actions,
        options={"microbatches": m, "encoder_tp": encoder_tp, **({"encoder_sp": encoder_sp} if encoder_sp > 1 else {})},
    )


def drop_frozen(plan: Plan, freeze: Sequence[str]) -> None:
    """`plan`'s actions as PyTorch runs modules whose parameters take no gradient (`ParallelSpec.freeze`),
    the one rule for every system: a frozen module reduces no gradients, and a rank that holds no module
    that trains steps no optimizer. A frozen encoder sits at the front of the model, so nothing upstream
    needs its input gradient: it runs no backward at all (its forward runs as under torch.no_grad), and no
    gradient crosses the boundary back to it or travels inside it. A frozen LLM still runs its backward
    for the input gradients a training encoder needs (only the weight gradients go). Sends and receives
    are dropped on both sides alike, so every message left keeps its match and its order."""
    frozen = set(freeze)
    if not frozen:
        return
    encoders = frozen - {"llm"}
    members = {m: set(lay.ranks) for m, lay in plan.layouts.items() if m not in frozen}

    def dropped(a: Action, trains: bool) -> bool:
        kind = a.kind
        if kind == OPTIMIZER_STEP:
            return not trains
        if a.module not in frozen:
            return False
        if kind == GRAD_SYNC:
            return True
        return a.module in encoders and (kind == BACKWARD or (kind in (SEND, RECV, BOUNDARY) and a.what == "grad"))

    for rank, acts in plan.actions.items():
        trains = any(rank in ranks for ranks in members.values())
        plan.actions[rank] = [a for a in acts if not dropped(a, trains)]
    plan.options["freeze"] = [m for m in FREEZABLE if m in frozen]


def finish(plan: Plan, parallel: ParallelSpec, order: bool = False) -> Plan:
    """The plan as `parallel` trains it (its frozen modules' work dropped, `drop_frozen`), with its notes,
    validated (`order`: its messages' order per pair of ranks too). Every planner ends here."""
    drop_frozen(plan, parallel.freeze)
    plan.notes = {**notes_for(plan), **plan.notes}
    plan.validate(order=order)
    return plan

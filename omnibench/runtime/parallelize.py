"""Apply a Layout's parallelism to a module from outside: TP, then CP and EP swaps, then activation
checkpointing, then FSDP2.

Order follows torchtitan's parallelize.py: tensor parallelism first (DTensor placements on the tp
mesh), then the context-parallel attention and expert-parallel dispatch wrappers (plain module
swaps), then activation checkpointing of blocks (so FSDP's unit is the checkpointed block and its
recompute re-gathers parameters the usual way), then FSDP2 `fully_shard` per block and at the root
over the data-parallel mesh, whose
gradient reduction is set to a *sum*: every rank's loss is already divided by the global
loss-token count, so data-parallel shards add up to the single-process gradient.

Written by hand where no library piece runs on the CPU: Ulysses attention over packed sequences
(the built-in `context_parallel` handles only the CUDA flash, memory-efficient and cuDNN SDPA ops,
torch/distributed/tensor/experimental/_context_parallel/_attention.py, not the CPU kernel) and the
MoE all-to-all dispatch.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

# ---------------------------------------------------------------------- context parallelism


class UlyssesAttention(nn.Module):
    """Ulysses sequence parallelism around a varlen attention core.

    Each cp rank holds a contiguous 1/cp chunk of the packed row with all heads; an all-to-all
    turns that into the whole row with 1/cp of the heads, the inner core attends over the full
    `cu_seqlens`, and a second all-to-all returns the rank's chunk with all heads. The all-to-alls
    are autograd-aware, so backward runs the mirror exchanges.
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, cp: int):
        super().__init__()
        self.inner = inner
        self.group = group
        self.cp = cp

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        # [T_local, H, D] -> cp blocks of heads -> exchange -> [cp * T_local, H / cp, D]
        x = x.reshape(t, self.cp, h // self.cp, d).transpose(0, 1).contiguous()
        out = all_to_all_single(torch.empty_like(x), x, group=self.group)
        return out.reshape(self.cp * t, h // self.cp, d)

    def _heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        tt, h, d = x.shape
        t = tt // self.cp
        x = x.reshape(self.cp, t, h, d).contiguous()
        out = all_to_all_single(torch.empty_like(x), x, group=self.group)
        return out.transpose(0, 1).reshape(t, self.cp * h, d)

    def forward(self, q, k, v, cu_seqlens, max_seqlen, causal):
        q, k, v = (self._seq_to_heads(x) for x in (q, k, v))
        out = self.inner(q, k, v, cu_seqlens, max_seqlen, causal)
        return self._heads_to_seq(out)


class _GatherChunks(torch.autograd.Function):
    """All-gather of equal chunks along dim 0; backward hands each member the sum over members of
    its chunk's gradient. Written here because torch.distributed.nn.functional.all_gather's backward
    on gloo scatters from *group* ranks as if they were global ones (fails for a group not holding
    ranks 0..k-1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        ctx.me = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if grad.is_cuda:
            out = grad.new_empty(ctx.n, *grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)  # gloo has no reduce_scatter
        return total[ctx.me * ctx.n : (ctx.me + 1) * ctx.n], None


def gather_chunks(x: torch.Tensor, group) -> torch.Tensor:
    """Every member's equal chunk of x along dim 0, in member order (autograd: gradients summed back)."""
    return _GatherChunks.apply(x, group)


def zigzag_rows(tokens: int, k: int, member: int) -> list[tuple[int, int]]:
    """The two row ranges member `member` of a k-member all-gather-KV group holds: pieces `member`
    and 2k - 1 - member of the row cut into 2k (`tokens` a multiple of 2k), so under causal masking
    every member's queries meet as many keys (as simulator/flops.py costs it)."""
    n = tokens // (2 * k)
    return [(member * n, (member + 1) * n), ((2 * k - 1 - member) * n, (2 * k - member) * n)]


def zigzag_index(tokens: int, k: int, member: int) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in zigzag_rows(tokens, k, member)])


def take_rows(x: torch.Tensor, chunk) -> torch.Tensor:
    """The rows of a packed row a context-parallel rank holds: all (None), a range (lo, hi), or an
    index tensor (all-gather-KV's two pieces)."""
    if chunk is None:
        return x
    if isinstance(chunk, torch.Tensor):
        return x.index_select(0, chunk.to(x.device))
    return x[chunk[0] : chunk[1]]


@functools.lru_cache(maxsize=64)
def _allgather_layout(bounds: tuple[int, ...], tokens: int, k: int, member: int):
    """(query segments, key segments as rows of the gathered K/V, their index) of `member`: per sequence
    and piece of the member, the queries it holds and the sequence's keys up to the piece's end. The
    same for every layer of a microbatch, so kept rather than rebuilt per attention call."""
    order = torch.cat([zigzag_index(tokens, k, m) for m in range(k)])
    where = torch.empty_like(order)
    where[order] = torch.arange(tokens)  # row -> its place in the gathered tensor
    cu_q, cu_k, keys, local = [0], [0], [], 0
    for a, b in zigzag_rows(tokens, k, member):
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            local += hi - lo
            cu_q.append(local)
            keys.append(where[s:hi])
            cu_k.append(cu_k[-1] + hi - s)
    return cu_q, cu_k, torch.cat(keys)


class AllGatherKVAttention(nn.Module):
    """All-gather-KV context parallelism around a varlen attention core (Llama 3, sec. 3.3.2).

    Each of the k members holds two opposite pieces of the packed row (`zigzag_rows`) with all
    heads. Before attention the members all-gather K and V (autograd-aware: the backward sums the
    K/V gradients back to their owners), and each attends its own queries to the keys of their
    sequences up to the query (bottom-right causal alignment, `VarlenAttention.segments`). Unlike
    Ulysses it has no rule on the head counts, and with grouped-query attention it moves only the
    K/V heads' bytes.
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, k: int, member: int):
        super().__init__()
        self.inner, self.group, self.k, self.member = inner, group, k, member

    def _layout(self, cu_seqlens: torch.Tensor, tokens: int):
        return _allgather_layout(tuple(cu_seqlens.tolist()), tokens, self.k, self.member)

    def forward(self, q, k, v, cu_seqlens, max_seqlen, causal):
        tokens = q.shape[0] * self.k
        cu_q, cu_k, keys = self._layout(cu_seqlens, tokens)
        keys = keys.to(q.device)
        kv = gather_chunks(torch.cat([k, v], dim=1), self.group)  # [tokens, 2 x kv heads, D], member order
        kv = kv.index_select(0, keys)
        h = k.shape[1]
        return self.inner.segments(q, kv[:, :h], kv[:, h:], cu_q, cu_k, causal)


def apply_cp(module: nn.Module, group: dist.ProcessGroup, cp: int, kind: str = "ulysses", member: int = 0) -> None:
    """Context parallelism around every block's attention core of `module`: Ulysses (the LLM's cp,
    temporal's encoder sp) or, for the LLM's `cp_kind="allgather"`, all-gathered K/V with this rank
    (`member` of the cp group) holding two opposite pieces of each row (`zigzag_rows`)."""
    for block in module.layers.values():
        if kind == "allgather":
            block.attention.core = AllGatherKVAttention(block.attention.core, group, cp, member)
        else:
            block.attention.core = UlyssesAttention(block.attention.core, group, cp)


# ----------------------------------------------------------------------- expert parallelism


class ExpertParallel(nn.Module):
    """Routed experts split over an ep group: all-to-all dispatch, local experts, all-to-all combine.

    Called like the experts it replaces: x [N, hidden] grouped by global expert id and the
    per-expert counts. This rank owns experts [rank*E/ep, (rank+1)*E/ep).
    """

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup, ep: int, ep_rank: int):
        super().__init__()
        e = experts.w1.shape[0]
        per = e // ep
        lo = ep_rank * per
        self.group, self.ep, self.per = group, ep, per
        local = type(experts).__new__(type(experts))
        nn.Module.__init__(local)
        for name in ("w1", "w2", "w3"):
            local.register_parameter(name, nn.Parameter(getattr(experts, name).detach()[lo : lo + per].clone()))
        self.local = local
        self.first_expert = lo

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.to(torch.int64)
        # counts_to[r, e]: tokens this rank sends to rank r's local expert e.
        send_counts = counts.view(self.ep, self.per)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_split = send_counts.sum(1).tolist()
        recv_split = recv_counts.sum(1).tolist()
        received = all_to_all_single(
            x.new_empty(sum(recv_split), x.shape[1]), x.contiguous(), recv_split, send_split, group=self.group
        )
        # Received rows are grouped by source rank, then local expert; regroup expert-major.
        rc = recv_counts.tolist()
        pieces = torch.split(received, [n for row in rc for n in row], dim=0)
        order = [src * self.per + e for e in range(self.per) for src in range(self.ep)]
        grouped = torch.cat([pieces[i] for i in order], dim=0) if pieces else received
        local_counts = recv_counts.sum(0)
        out = self.local(grouped, local_counts)
        # Undo the regrouping, then send every row back to the rank it came from.
        sizes = [rc[src][e] for e in range(self.per) for src in range(self.ep)]
        back = torch.split(out, sizes, dim=0)
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        by_source = torch.cat([back[inverse[i]] for i in range(len(order))], dim=0) if back else out
        return all_to_all_single(
            x.new_empty(sum(send_split), out.shape[1]), by_source.contiguous(), send_split, recv_split, group=self.group
        )


def apply_ep(llm: nn.Module, group: dist.ProcessGroup, ep: int, ep_rank: int) -> list[nn.Module]:
    """Swap every MoE layer's experts for the ep-sharded wrapper; returns the local expert modules."""
    local = []
    for block in llm.layers.values():
        if getattr(block, "moe", None) is not None:
            block.moe.experts = ExpertParallel(block.moe.experts, group, ep, ep_rank)
            local.append(block.moe.experts.local)
    return local


# ----------------------------------------------------------------------- tensor parallelism


def apply_tp(llm: nn.Module, tp_mesh) -> None:
    """Megatron-style TP per block: q/k/v and gate/up column-parallel, o and down row-parallel.

    Embeddings, norms, the router, experts and the output head stay replicated across tp ranks
    (each computes them in full; their gradients are identical, no reduction needed).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in llm.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
        }
        if getattr(block, "feed_forward", None) is not None:
            plan.update(
                {
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)


# ---------------------------------------------------------------------- activation checkpointing

RECOMPUTE = ("none", "selective", "full")
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def apply_ac(module: nn.Module, mode: str) -> None:
    """Activation checkpointing of `module.layers`, with the meaning `simulate --recompute` costs:

    - "full": every block keeps only its input and recomputes its forward during backward;
    - "selective": only the attention core is recomputed (Megatron's selective recomputation; with a
      flash-style core that saves little memory and costs one more attention forward);
    - "none": nothing.

    Non-reentrant checkpointing, as torchtitan's apply_ac: it composes with FSDP2's hooks, DTensor
    and the autograd-aware all-to-alls of Ulysses and expert parallelism.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {mode!r}")
    if mode == "none":
        return
    for name, block in list(module.layers.items()):
        if mode == "full":
            module.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
            continue
        holder = block.attention
        if isinstance(holder.core, UlyssesAttention):  # recompute the local attention, not the exchanges
            holder = holder.core
            holder.inner = checkpoint_wrapper(holder.inner, preserve_rng_state=False)
        else:
            holder.core = checkpoint_wrapper(holder.core, preserve_rng_state=False)


def apply_compile(module: nn.Module) -> None:
    """torch.compile each block on its own (torchtitan's per-block compile: one graph reused by
    every layer of the same shape, and FSDP's hooks stay outside the compiled regions)."""
    for name, block in list(module.layers.items()):
        module.layers[name] = torch.compile(block, fullgraph=False)


# ------------------------------------------------------------------------------------ FSDP


def apply_fsdp(root: nn.Module, blocks: list[nn.Module], mesh, mp_dtype: torch.dtype | None = None,
               extra: list[tuple[nn.Module, object]] = (), ignored: set | None = None) -> None:
    """FSDP2 per block, then the root; `extra` shards (module, mesh) pairs first (MoE experts over
    the expert-data-parallel mesh); `ignored` parameters stay out of FSDP (experts no other rank
    holds). Gradients are summed, not averaged (see module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else MixedPrecisionPolicy()
    sharded = []
    for module, m in extra:
        sharded.append(fully_shard(module, mesh=m, mp_policy=mp))
    for block in blocks:
        sharded.append(fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored))
    sharded.append(fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=ignored))
    for s in sharded:
        s.set_gradient_divide_factor(1.0)
        s.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def apply_encoder_tp(encoder: nn.Module, tp_mesh) -> list[str]:
    """Megatron-style TP for the encoders where their layers allow it; returns what stayed replicated.

    Audio (Whisper-style): q/k/v and fc1 column-parallel, o and fc2 row-parallel. Vision: the MLP
    (fc1 column, fc2 row) unless it is a fused SwiGLU; the fused qkv projection interleaves q, k and
    v per row block, so column sharding would not give whole heads: attention stays replicated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    replicated = []
    for block in encoder.layers.values():
        if hasattr(block, "fc1"):  # audio block
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            heads = block.attention.wq.out_features // block.attention.head_dim
            if heads % tp_mesh.size() == 0:  # else a shard would cut a head in two
                plan.update({
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(),
                })
            else:
                replicated.append("attention")
        else:
            plan = {}
            if getattr(block.mlp, "kind", "") != "swiglu":
                plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
            replicated.append("attention")
            if not plan:
                replicated.append("mlp")
        if plan:
            parallelize_module(block, tp_mesh, plan)
    return sorted(set(replicated))

"""The program of one simulated rank: its Plan actions turned into timed ops on three streams.

Streams. Each simulated rank has a compute stream (its process: forward/backward run in order),
a collective stream (grad_sync: FSDP reduce-scatter / all-reduce, overlapping later compute) and
a p2p stream (pipeline sends and boundary exchanges, overlapping compute). A compute action
expands its module's intra-module communication from the layout: TP all-reduces, CP/SP and EP
all-to-alls are on the critical path; FSDP all-gathers are prefetched one layer ahead, so only the
part a layer's compute does not hide is exposed. FSDP and EP also lock data-parallel peers together
layer by layer: such an action starts when all (distinct) peers have arrived and lasts as long as
the slowest peer's. Without overlap (`CollectiveModel.inline_overlap` False: a CPU rank is one
thread) every FSDP gather and every gradient reduction blocks the rank in line, one call per layer
plus the root.

HSDP (`Layout.dp_shard`): gathers, reduce-scatters and the layer-by-layer lock run over the shard
group only; grad_sync adds one all-reduce of the gradient shard across the replicate group.

ZeRO-1/2 (`Layout.zero`, without FSDP: Megatron's distributed optimizer, DeepSpeed ZeRO-1/2): the
forward and backward run on whole bf16 weights with no peer lock; grad_sync reduce-scatters the
gradients (instead of DDP's all-reduce), the optimizer steps the rank's 1/dp shard of the fp32
master weights and moments, and after the step an all-gather of the updated bf16 parameters
(`PARAM_GATHER`, on the collective stream) hands every rank whole weights again. Both stages cost
the same time here: the gradients are reduced once, at grad_sync (ZeRO-2's smaller gradient
footprint is memory's business, simulator/memory.py).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

from omnibench.plan import (
    BACKWARD,
    BOUNDARY,
    FORWARD,
    GRAD_SYNC,
    METADATA,
    OPTIMIZER_STEP,
    RECV,
    SEND,
    Action,
    lane_of,
)
from simulator.flops import (
    Work,
)
from simulator.quota import action_flops, quota_time, utilisation

# Op kind of ZeRO-1/2's all-gather of the updated bf16 parameters after the optimizer step: a
# collective on the rank's collective stream, like grad_sync (simulator/engine.py runs both alike).
PARAM_GATHER = "param_gather"


@dataclass(slots=True)
class _Op:
    action: Action
    kind: str
    duration: float = 0.0  # own compute (compute ops) or transfer time (comm ops)
    exposed: float = 0.0  # inline communication on the compute stream
    comm: float = 0.0  # inline communication total (for comm-stream busy time)
    lock_key: tuple | None = None  # lock-step / collective rendezvous key
    lock_n: int = 1  # distinct participants
    p2p_key: tuple | None = None  # the message a send, recv or boundary op passes or waits for
    # memory (simulator/memory.py): the op's high point over what was live before it, and what it
    # leaves (activations added or freed, gradients, buffers)
    mem_peak: float = 0.0
    mem_delta: float = 0.0
    blocking: bool = False  # a collective the rank waits for before its next action (no overlap)
    calls: int = 0  # collective calls a compute action issues in line


class ProgramMixin:
    """The Engine's action-to-op expansion (needs WorkMixin, GroupsMixin and MemoryMixin)."""

    def _compute_op(self, rank: int, a: Action, cls: dict[int, int]) -> _Op:
        module = a.module
        lay = self.plan.layouts[module]
        idx = self.index[module]
        long_group = self._long_group(module, rank, a.microbatch)
        work = self.work(module, a.stage if module == "llm" else 0, self._signature(module, rank, a.microbatch),
                         len(long_group))
        recompute = self.policy[module] if a.kind == BACKWARD else "none"
        if recompute == "selective" and self.options.selective == "half":
            recompute = "half"  # torchtitan's selective checkpointing (SimOptions.selective)
        inputs = self.input_elements(module, rank, a)
        # chunked encoders: each chunk runs its forward again inside the backward action
        again = self.compute.action_time(work, FORWARD, "none", module) if work.chunks and a.kind == BACKWARD else 0.0
        own = self._on_quota(a, work, recompute, self.compute.action_time(work, a.kind, recompute, module, inputs)
                             + again)
        op = _Op(a, a.kind, duration=own)
        if self.options.communication:
            comm = exposed = 0.0
            n_calls = 0  # collective calls issued in line (their CPU side is compute: see below)
            calls = 2 * work.layers
            tp_group = idx.group(rank, ("tp",))
            if work.tp_bytes and len(tp_group) > 1:
                t = calls * self.coll_inline.cost("all_reduce", work.tp_bytes / calls, tp_group)
                comm += t
                if self.options.tp_overlap and self.coll.inline_overlap:
                    # TE userbuffers / AsyncTP cut each TP GEMM into tp pieces and pass one piece's
                    # all-gather or reduce-scatter while the next computes: what the GEMMs cannot
                    # hide stays exposed, and the first piece always does
                    exposed += max(t / len(tp_group), t - own)
                else:
                    exposed += t
                n_calls += calls
            seq_dim = ("cp",) if module == "llm" else ("sp",)
            seq_group = long_group or idx.group(rank, seq_dim)
            kind = self._llm_cp_kind(bool(long_group)) if module == "llm" else ""
            ring = kind == "ring" and not long_group
            gather = kind == "allgather"
            if work.seq_bytes and len(seq_group) > 1 and gather:
                # All-gather KV: one all-gather of the layer's K/V before its attention (forward); the
                # backward reduce-scatters their gradients, and gathers again where it recomputes the
                # attention. Not overlapped (Llama 3 sec. 3.3.2: exposed, small next to attention).
                per = work.seq_bytes / work.layers
                t = self.coll_inline.cost("all_gather", per, seq_group)
                if a.kind == BACKWARD:
                    t = self.coll_inline.cost("reduce_scatter", per, seq_group) + (t if recompute != "none" else 0.0)
                comm += work.layers * t
                exposed += work.layers * t
                n_calls += work.layers * (2 if a.kind == BACKWARD and recompute != "none" else 1)
            elif work.seq_bytes and len(seq_group) > 1 and ring:
                # Ring attention: cp - 1 K/V hand-offs per layer to the next cp rank (backward: K/V again
                # and their gradients back, twice the bytes), each hidden behind one block's attention.
                steps = len(seq_group) - 1
                nbytes = work.seq_bytes / work.layers / steps * (2 if a.kind == BACKWARD else 1)
                i = seq_group.index(rank)
                t_step = self.coll_inline.send_recv(nbytes, rank, seq_group[(i + 1) % len(seq_group)])
                prof = self.compute.kernels
                hide = 0.0
                if prof is not None and work.shape is not None:
                    from simulator.kernels import ring_step_attention

                    hide = ring_step_attention(prof, work.shape, a.kind == BACKWARD)
                comm += work.layers * steps * t_step
                exposed += work.layers * steps * max(0.0, t_step - hide)
                n_calls += work.layers * steps
            elif work.seq_bytes and len(seq_group) > 1:
                t = work.layers * self.coll_inline.cost("all_to_all", work.seq_bytes / work.layers, seq_group)
                comm += t
                exposed += t
                n_calls += work.layers
            if module != "llm" and len(seq_group) > 1 and work.tokens:
                # Encoder sequence parallelism ends with every member holding the whole output: the
                # members' chunks all-gathered after the blocks, reduce-scattered back in the backward
                # (omnibench/runtime/long_short.py `_gather`): temporal's sp groups and omni's alike.
                op_name = "all_gather" if a.kind == FORWARD else "reduce_scatter"
                t = self.coll_inline.cost(op_name, self._sp_output_bytes(module, work, len(seq_group)), seq_group)
                comm += t
                exposed += t
                n_calls += 1
            shard = self._grad_group(module, rank)
            if work.ep_bytes and lay.ep > 1:
                scope = self._expert_scope(module, rank)
                i = scope.index(rank)
                ep_group = scope[i - i % lay.ep: i - i % lay.ep + lay.ep]
                moe = self.model.llm.moe
                t = calls * self.coll_inline.expert_all_to_all(work.ep_bytes / calls, ep_group, moe.experts, moe.top_k,
                                                               self.options.ep_dispatcher)
                comm += t
                exposed += t
                n_calls += calls
            if (not self.coll.inline_overlap and a.kind == BACKWARD and lay.fsdp and len(shard) > 1
                    and self._reduces_in(rank, module, a.microbatch)):
                n_calls += max(1, work.layers) + 1  # the reduce-scatters (the grad_sync op holds the last one's wait)
                if lay.hsdp:
                    n_calls += max(1, work.layers) + 1  # HSDP: each followed by the replicas' all-reduce
                if a.microbatch != self._last_backward(rank, module):
                    # an earlier microbatch's reductions block this one-thread rank in line
                    t = self.grad_sync_cost(module, rank, self._stage(module, rank, a))
                    comm += t
                    exposed += t
            # HSDP gathers inside the shard group only (the FSDP group itself without HSDP).
            shard = self._shard_group(module, rank) if lay.hsdp else shard
            if lay.fsdp and len(shard) > 1 and self._gathers(rank, module, a):
                comm, exposed, n_calls = self._fsdp_inline(rank, a, work, recompute, own, shard,
                                                           comm, exposed, n_calls)
            op.comm, op.exposed, op.calls = comm, exposed, n_calls
            if n_calls and self.compute.curves:
                # The rank's own work around each call (hooks, copies) runs on its compute stream: a
                # fitted curve's cost per call (the kernel profile and the datasheet curve charge none,
                # so their duration stays `own`, the same bits).
                op.duration = self._on_quota(a, work, recompute, self.compute.action_time(
                    work, a.kind, recompute, module, inputs, n_calls) + again)
        lock = self._lock_group(module, rank)
        if lock is not None and self.compute.lock_skew:
            op.duration *= 1.0 + self.compute.lock_skew
        if lock is not None:
            gid, n = self._members(lock, cls)
            if n > 1:
                op.lock_key = ("lock", a.kind, module, a.stage, gid)
                op.lock_n = n
        op.mem_peak, op.mem_delta = self._compute_memory(rank, a, work)
        return op

    def _fsdp_inline(self, rank: int, a: Action, work: Work, recompute: str, own: float, shard: tuple[int, ...],
                     comm: float, exposed: float, n_calls: int) -> tuple[float, float, int]:
        """A compute action's FSDP gathers (and per-microbatch reduce-scatters) on `shard`: `comm`, `exposed` and
        `n_calls` with them added."""
        module = a.module
        lay = self.plan.layouts[module]
        # bf16 all-gather of each layer's shard. With overlap (GPU) it is prefetched one
        # layer ahead: the first is exposed, later ones only where a layer's compute is
        # shorter than its gather. Without (one CPU thread per rank) FSDP2's gathers of
        # every layer and then the root each block the rank: the same bytes in n + 1 calls.
        # Experts are split over ep first; FSDP shards them over the rest (dp*cp/ep).
        dense = (work.params - work.expert_params) / lay.tp
        n = max(1, work.layers)
        calls = n if self.coll.inline_overlap else n + 1
        g = self._bucketed("all_gather", 2 * dense / calls, shard, self.options.fsdp_gather_bucket)
        if work.expert_params:
            edp = self._expert_group(rank, self._expert_scope(module, rank, shard), lay.ep)
            g += self.coll_inline.cost("all_gather", 2 * work.expert_params / self._expert_split(lay) / calls,
                                       edp)
        # chunked encoders gather per chunk, and in the backward again for each chunk's recompute
        reps = (work.chunks if a.kind == FORWARD else 2 * work.chunks) or 1
        if a.kind == BACKWARD and recompute == "full" and self.options.gather_for_recompute:
            reps += 1  # DeepSpeed ZeRO-3 releases a layer after its recomputed forward, gathers again
        comm += reps * calls * g
        n_calls += reps * calls
        # FSDP without no_sync also reduce-scatters each layer's gradients in every backward; grad_sync
        # holds the last microbatch's. Charged for this project's runtime and where a stack's options
        # say so (Composer); the other stacks' published step times are taken to hide those
        # reductions behind the backward, as their memory is counted without a whole-gradient copy
        r = 0.0
        if (a.kind == BACKWARD and self.coll.inline_overlap and a.microbatch != self._last_backward(rank, module)
                and module not in self.frozen and (self.options.fsdp_reduce_every_microbatch
                     or (self.memory_stack == "eager" and not self._defers_reduce(module)))):
            r = self._bucketed("reduce_scatter", self.options.grad_reduce_bytes * dense / n, shard,
                               self.options.fsdp_reduce_bucket, self.options.grad_reduce_bytes)
            comm += n * r
            n_calls += n
        if self.coll.inline_overlap:
            # the last layer's reduce-scatter finishes after the backward's compute; the first
            # layer's gather is exposed unless the pipeline schedule unshards the chunk ahead
            first = 0.0 if self._unshard_prefetched(rank) else reps * g
            exposed += first + (reps * n - reps) * max(0.0, g + r - own / (reps * n)) + r
        else:
            exposed += reps * calls * g
        return comm, exposed, n_calls

    def _on_quota(self, a: Action, work: Work, recompute: str, seconds: float) -> float:
        """`seconds` on the whole device, as the action runs on its quota (simulator/quota.py)."""
        if a.quota >= 1.0:
            return seconds
        used = utilisation(seconds, action_flops(work, a.kind, recompute), self.compute.best_rate(a.module))
        return quota_time(seconds, used, a.quota)

    def _bucketed(self, op: str, nbytes: float, group: tuple[int, ...], bucket: float, elem: float = 2.0) -> float:
        """One layer's FSDP collective of `nbytes`, issued in buckets of `bucket` parameters (`elem`
        bytes each) when the stack buckets it (SimOptions.fsdp_gather_bucket / _reduce_bucket)."""
        k = max(1, -(-int(nbytes / elem) // int(bucket))) if bucket > 0 else 1
        return k * self.coll_inline.cost(op, nbytes / k, group)

    def _sp_output_bytes(self, module: str, work: Work, k: int) -> float:
        """Bytes of a sequence-parallel encoder microbatch's gathered output (bf16): the vision
        merger's tokens at the LLM's width, or the audio blocks' hidden states (pooled after)."""
        enc = self.model.encoders[module]
        if module == "vision":
            return work.tokens * k / (enc.merge * enc.merge) * (enc.out_hidden or self.model.llm.hidden) * 2
        return work.tokens * k * enc.hidden * 2

    def _reduces_in(self, rank: int, module: str, microbatch: int) -> bool:
        """Whether this microbatch's backward reduce-scatters FSDP gradients: every one's, unless the stack
        accumulates whole gradients until the stage's last (`MemoryMixin._defers_reduce`); never a frozen
        module's (it has none)."""
        if module in self.frozen:
            return False
        return not self._defers_reduce(module) or microbatch == self._last_backward(rank, module)

    def _last_backward(self, rank: int, module: str) -> int:
        key = ("last_bwd", rank, module)
        got = self._sig_cache.get(key)
        if got is None:
            mbs = [a.microbatch for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD and a.module == module]
            got = self._sig_cache[key] = max(mbs) if mbs else -1
        return got

    @functools.cached_property
    def reshard_after_forward(self) -> bool:
        """Under pipelining, FSDP keeps parameters gathered between microbatches (torchtitan sets
        reshard_after_forward=False with pp > 1); a plan may say otherwise in its options."""
        default = self.plan.layouts["llm"].pp == 1 if "llm" in self.plan.layouts else True
        return bool(self.plan.options.get("reshard_after_forward", default))

    def _unshard_prefetched(self, rank: int) -> bool:
        """Whether a pipeline schedule that unshards chunks ahead (SimOptions.pp_prefetch_unshard) has
        this gather done before the action starts: every gathering action of the rank's step but its
        first (which nothing precedes to hide it behind). Asked once per gathering action (`_gathers`)."""
        if not self.options.pp_prefetch_unshard or self.reshard_after_forward:
            return False
        if rank in self._gathered_ranks:
            return True
        self._gathered_ranks.add(rank)
        return False

    def _gathers(self, rank: int, module: str, a: Action) -> bool:
        """Whether this compute action all-gathers its FSDP parameters: every action when FSDP
        reshards after forward, else only the first forward and the first backward of a stage."""
        if self.reshard_after_forward:
            return True
        key = (rank, module, a.stage, a.kind)
        if key in self._gathered:
            return False
        self._gathered.add(key)
        return True

    def program(self, rank: int, cls: dict[int, int]) -> list[_Op]:
        ops: list[_Op] = []
        seen: dict[tuple, int] = defaultdict(int)
        comm_on = self.options.communication
        hidden = self.model.llm.hidden
        tokens = self._boundary_of.get(rank)  # its boundary messages' tokens, as `classes` found them
        if tokens is None:
            tokens = [self._boundary_tokens(rank, a) for a in self.plan.actions[rank] if a.kind == BOUNDARY]
        boundary = iter(tokens)
        for a in self.plan.actions[rank]:
            if a.kind in (FORWARD, BACKWARD):
                op = self._compute_op(rank, a, cls)
                if op.lock_key is not None:
                    n = seen[op.lock_key]
                    seen[op.lock_key] += 1
                    op.lock_key = (*op.lock_key, n)
                ops.append(op)
            elif a.kind in (SEND, RECV):
                src, dst = (rank, a.peer) if a.kind == SEND else (a.peer, rank)
                # the sending stage names the message (a rank pair carries several under interleaving)
                sender = a.stage if a.kind == SEND else a.stage - 1 if a.what == "act" else a.stage + 1
                base = ("p2p", a.module, a.what, a.microbatch, sender, cls.get(src, src), cls.get(dst, dst))
                n = seen[base]
                seen[base] += 1
                cost = self.coll.send_recv(self._p2p_bytes(a.module, rank, a.microbatch), src, dst) if comm_on else 0.0
                ops.append(_Op(a, a.kind, duration=cost, p2p_key=(*base, n)))
            elif a.kind == BOUNDARY:
                key = self._boundary_key(rank, a, cls)
                n_tokens = next(boundary)
                if a.direction == "send":
                    nbytes = n_tokens * hidden * 2
                    cost = self.coll.send_recv(nbytes, rank, a.peer) if comm_on else 0.0
                    ops.append(_Op(a, "boundary_send", duration=cost, p2p_key=key))
                else:
                    ops.append(_Op(a, "boundary_recv", p2p_key=key))
            elif a.kind == GRAD_SYNC:
                module = a.module
                group = self._grad_group(module, rank)
                stage = self._stage(module, rank, a)
                cost = self.grad_sync_cost(module, rank, stage) if comm_on else 0.0
                lay = self.plan.layouts[module]
                if cost and self.coll.inline_overlap and (lay.fsdp or self.options.overlap_grad_reduce):
                    cost = self._behind_backward(cost, module, stage, ops)
                gid, n_members = self._members(group, cls)
                key = ("coll", module, stage, gid)
                n = seen[key]
                seen[key] += 1
                op = _Op(a, a.kind, duration=cost, lock_key=(*key, n), lock_n=n_members,
                         blocking=not self.coll.inline_overlap)
                # memory: the flat buffer a non-FSDP reduction allocates; ZeRO's gradient slice
                op.mem_delta = self._grad_sync_delta(module, rank)
                op.mem_peak = max(op.mem_delta, 0.0) + self._grad_sync_buffer(module, rank)
                ops.append(op)
            elif a.kind == METADATA:
                # The loaders' all-gather (padded to the largest contribution, which the planner put
                # on every member). Loaders prefetch: the next step's exchange runs on the loader's
                # own thread while this step computes, so it holds the collective stream, not compute.
                group = self._loader_group(rank, a.what)
                cost = self.coll.cost("all_gather", a.nbytes * len(group), group) if comm_on else 0.0
                gid, n_members = self._members(group, cls)
                key = ("meta", a.what, gid)
                n = seen[key]
                seen[key] += 1
                ops.append(_Op(a, a.kind, duration=cost, lock_key=(*key, n), lock_n=n_members))
            elif a.kind == OPTIMIZER_STEP:
                ops.append(_Op(a, a.kind, duration=self.compute.optimizer_time(self._stepped_params_on_rank(rank),
                                                                               *self.layers_on_rank(rank))))
                if comm_on:
                    ops += self._param_gathers(rank, cls, seen, ops)
        return concurrent_ops(ops) if self.plan.concurrent else ops

    def _synced_modules(self, rank: int) -> list[str]:
        return [a.module for a in self.plan.actions.get(rank, []) if a.kind == GRAD_SYNC]

    def _expert_scope(self, module: str, rank: int, default: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The ranks a module's experts are spread over: its data-parallel group (dp*cp), or under MoE
        parallel folding (Layout.expert_tp 1) the stage's dp*cp*tp ranks."""
        lay = self.plan.layouts[module]
        if module == "llm" and lay.expert_tp == 1 and lay.tp > 1:
            return self.index[module].group(rank, ("dp", "cp", "tp"))
        return default if default is not None else self._grad_group(module, rank)

    @staticmethod
    def _expert_split(lay) -> int:
        """Ranks one copy of the experts is cut over: ep, times tp unless the experts are folded."""
        return max(1, lay.ep) * (1 if lay.expert_tp == 1 else lay.tp)

    def _behind_backward(self, cost: float, module: str, stage: int, ops: list[_Op]) -> float:
        """What of a gradient reduction the rank still waits for when it runs bucket by bucket behind
        the backward (FSDP's per-layer reduce-scatters; DDP/ZeRO with overlap_grad_reduce): the last
        microbatch's backward of each model chunk hides all but the last layer's bucket."""
        lay = self.plan.layouts[module]
        chunks = lay.vpp if module == "llm" else 1
        layers = max(1, self.stage_work(module, stage).layers // chunks)
        backs = [op for op in ops if op.kind == BACKWARD and op.action.module == module][-chunks:]
        hide = sum(op.duration + op.exposed for op in backs) * (1 - 1 / layers)
        return max(cost / layers, cost - hide)

    def _param_gathers(self, rank: int, cls: dict[int, int], seen: dict, done: list[_Op]) -> list[_Op]:
        """ZeRO-1/2: after the step, one all-gather per module of its updated bf16 parameters over
        the data-parallel group (experts over the ranks holding the same experts), for every
        module this rank reduced gradients of. The next step's forward needs the weights, so the
        rank waits for it (blocking: its wait counts as exposed communication); with
        `overlap_param_gather` (Megatron's distributed optimizer) each layer's gather runs behind the
        next step's first forward, which hides all but the first layer's."""
        ops = []
        if not self._zero_without_fsdp:
            return ops
        for module in self._synced_modules(rank):
            lay = self.plan.layouts[module]
            group = self._grad_group(module, rank)
            if lay.fsdp or not lay.zero or len(group) < 2:
                continue
            if lay.hybrid:  # the slices live in the shard group: the gather runs there
                group = self._shard_group(module, rank)
            stage = self.index[module].coords[rank].get("pp", 0)
            w = self.stage_work(module, stage)
            dense = 2.0 * (w.params - w.expert_params) / lay.tp
            cost = self.coll.cost("all_gather", dense, group)
            if w.expert_params:
                experts = 2.0 * w.expert_params / self._expert_split(lay)
                scope = self._expert_scope(module, rank, group)
                cost += self.coll.cost("all_gather", experts, self._expert_group(rank, scope, lay.ep))
            if self.options.overlap_param_gather and self.coll.inline_overlap:
                first = next((op for op in done if op.kind == FORWARD and op.action.module == module), None)
                layers = max(1, w.layers)
                hide = (first.duration + first.exposed) * (1 - 1 / layers) if first is not None else 0.0
                cost = max(cost / layers, cost - hide)
            gid, n_members = self._members(group, cls)
            key = ("params", module, stage, gid)
            n = seen[key]
            seen[key] += 1
            ops.append(_Op(Action(GRAD_SYNC, module, what="params"), PARAM_GATHER, duration=cost,
                           lock_key=(*key, n), lock_n=n_members, blocking=True))
        return ops

    @functools.cached_property
    def _zero_without_fsdp(self) -> bool:
        """Whether some module runs ZeRO-1/2 (the only ones `_param_gathers` adds ops for)."""
        return any(lay.zero and not lay.fsdp for lay in self.plan.layouts.values())

    def grad_sync_cost(self, module: str, rank: int, stage: int) -> float:
        """`_grad_sync_cost`, worked out once per (module, stage, groups) where the rank enters only
        through its groups (no experts: their groups depend on the rank's place in its group)."""
        group = self._grad_group(module, rank)
        if len(group) < 2 or self.stage_work(module, stage).expert_params:
            return self._grad_sync_cost(module, rank, stage)
        groups = (group, *self.index[module].hsdp(rank)) if self.plan.layouts[module].hybrid else (group,)
        key = ("grad-sync", module, stage, *map(id, groups))
        hit = self._sig_cache.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[1], groups, strict=True)):
            return hit[0]
        got = self._grad_sync_cost(module, rank, stage)
        self._sig_cache[key] = (got, groups)  # the groups kept alive with it: their ids stay theirs
        return got

    def _grad_sync_cost(self, module: str, rank: int, stage: int) -> float:
        """Seconds of a module's data-parallel gradient reduction on `rank` (0 without peers).

        GPU: one reduce-scatter (FSDP, ZeRO-1/2) or all-reduce (DDP) of the stage's gradients.
        Without overlap (`inline_overlap` False, a CPU rank) FSDP2's reduce-scatters go one per layer
        plus the root, in line; a DDP all-reduce or a ZeRO reduce-scatter stays one flat (bucketed)
        call, as the runtime issues it."""
        lay = self.plan.layouts[module]
        group = self._grad_group(module, rank)
        if len(group) < 2:
            return 0.0
        w = self.stage_work(module, stage)
        nbytes = self.options.grad_reduce_bytes * w.params / lay.tp
        calls = 1 if self.coll.inline_overlap or not lay.fsdp else max(1, w.layers) + 1
        op_name = "reduce_scatter" if lay.fsdp or lay.zero else "all_reduce"
        # FSDP2 reduce-scatters from inside the backward (per layer): communication inside compute
        coll = self.coll_inline if lay.fsdp else self.coll
        dense = nbytes * (1 - w.expert_params / w.params) if w.params else nbytes
        if lay.hybrid:
            return self._hsdp_grad_sync_cost(module, rank, w, nbytes, dense, calls)
        if lay.fsdp and self.coll.inline_overlap:
            # FSDP reduce-scatters layer by layer (in the stack's buckets): at thousands of ranks each
            # call's ring latency counts
            n = max(1, w.layers)
            cost = n * self._bucketed(op_name, dense / n, group, self.options.fsdp_reduce_bucket,
                                      self.options.grad_reduce_bytes)
        else:
            cost = calls * coll.cost(op_name, dense / calls, group)
        if w.expert_params and lay.ep > 1:
            # Experts are split over ep (and tp unless folded); their grads reduce over the replicas.
            experts = self.options.grad_reduce_bytes * w.expert_params / self._expert_split(lay)
            cost += calls * coll.cost(op_name, experts / calls,
                                      self._expert_group(rank, self._expert_scope(module, rank, group), lay.ep))
        elif w.expert_params:
            cost += calls * coll.cost(op_name, (nbytes - dense) / calls, group)
        return cost

    def _hsdp_grad_sync_cost(self, module: str, rank: int, w: Work, nbytes: float, dense: float,
                             calls: int) -> float:
        """HSDP: reduce-scatter inside the shard group, then one all-reduce of the resulting shard
        over the replicate group (FSDP2 issues both per layer from the backward); hybrid ZeRO the
        same pair per bucket from grad_sync (omnibench/runtime/zero.py)."""
        lay = self.plan.layouts[module]
        coll = self.coll_inline if lay.fsdp else self.coll
        shard, rep = self._shard_group(module, rank), self._replicate_group(module, rank)
        cost = calls * (coll.cost("reduce_scatter", dense / calls, shard)
                        + coll.cost("all_reduce", dense / len(shard) / calls, rep))
        experts = nbytes - dense
        if w.expert_params:
            # Experts split over ep first, then sharded over the shard group's ranks holding them.
            eshard = self._expert_group(rank, shard, lay.ep) if lay.ep > 1 else shard
            per = experts / max(1, lay.ep)
            cost += calls * (coll.cost("reduce_scatter", per / calls, eshard)
                             + coll.cost("all_reduce", per / len(eshard) / calls, rep))
        return cost

    def layers_on_rank(self, rank: int) -> tuple[float, float]:
        """(FSDP-sharded, unsharded) layers of the modules this rank trains in the step (runs a
        backward of), each module's root (embeddings, head, patch/conv stems) counted as one more:
        what an optimizer step walks (AdamW skips parameters that got no gradient)."""
        sharded = plain = 0.0
        trained = {a.module for a in self.plan.actions.get(rank, []) if a.kind == BACKWARD} - self.frozen
        for m, lay in self.plan.layouts.items():
            idx = self.index[m]
            if rank not in idx.coords or m not in trained:
                continue
            w = self.stage_work(m, idx.coords[rank].get("pp", 0))
            if lay.fsdp and len(self._grad_group(m, rank)) > 1:
                sharded += w.layers + 1
            else:
                plain += w.layers + 1
        return sharded, plain


def concurrent_ops(ops: list[_Op]) -> list[_Op]:
    """A rank's ops with each concurrency group (`Action.concurrent`: lanes run side by side, each on its
    quota) as one compute op: it lasts as long as its longest lane (each lane's ops one after another,
    their own compute and exposed communication), and locks with its peers as its first locked op did
    (spatial's lanes lock over the same FSDP group: every rank runs the same phases). Memory: each lane
    may be at its high point while the other is, so the group's high point is the sum of the lanes'."""
    out: list[_Op] = []
    i, n = 0, len(ops)
    while i < n:
        op = ops[i]
        g = op.action.concurrent
        if g < 0 or op.kind not in (FORWARD, BACKWARD):
            out.append(op)
            i += 1
            continue
        j = i
        while j < n and ops[j].action.concurrent == g and ops[j].kind in (FORWARD, BACKWARD):
            j += 1
        members = ops[i:j]
        lanes: dict[str, list[_Op]] = {}
        for m in members:
            lanes.setdefault(lane_of(m.action), []).append(m)
        longest = max(lanes.values(), key=lambda lane: sum(m.duration + m.exposed for m in lane))
        merged = _Op(longest[0].action, longest[0].kind)
        merged.duration = sum(m.duration for m in longest)
        merged.exposed = sum(m.exposed for m in longest)
        merged.comm = sum(m.comm for m in members)
        merged.calls = sum(m.calls for m in members)
        locked = next((m for m in members if m.lock_key is not None), None)
        if locked is not None:
            merged.lock_key, merged.lock_n = locked.lock_key, locked.lock_n
        for lane in lanes.values():
            live = high = 0.0
            for m in lane:
                high = max(high, live + m.mem_peak)
                live += m.mem_delta
            merged.mem_peak += high
            merged.mem_delta += live
        out.append(merged)
        i = j
    return out

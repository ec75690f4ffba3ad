"""Actions that move tensors between ranks: pipeline sends and receives, the encoder->LLM boundary
exchange, and the data-parallel gradient reduction."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from omnibench.plan import (
    Action,
    Plan,
)
from omnibench.runtime.master import EXPERTS_SUFFIX, all_reduce_flat, local_shard
from systems.common import is_primary, long_llm_leaders


class CommunicationMixin:
    """The Executor's communication actions."""

    def _index_routes(self, plan: Plan) -> None:
        """Per step: the routes of each boundary message (module, src, src mb, dst, dst mb) in
        sample-id order, whether each is its sample's primary route, and each sample's primary
        source (who takes the gradient back)."""
        llm = plan.layouts["llm"]
        leaders = long_llm_leaders(plan.options)
        self.messages: dict[tuple, list[tuple]] = defaultdict(list)
        self.primary_src: dict[tuple[str, int], int] = {}
        for r in sorted(plan.routes, key=lambda r: r.sample_id):
            primary = is_primary(r, llm, leaders)
            self.messages[(r.module, r.src_rank, r.src_microbatch, r.dst_rank, r.dst_microbatch)].append((r, primary))
            if primary:
                self.primary_src[(r.module, r.sample_id)] = r.src_rank

    def _send_pipeline(self, a: Action) -> None:
        # Messages travel in the run's compute dtype, so both sides size their buffers alike.
        if a.what == "act":
            t = self.state.act_out[a.microbatch].detach().to(self.dtype).contiguous()
        else:
            t = self.state.act_in.pop(a.microbatch).grad.to(self.dtype).contiguous()
        self.state.pending.append((dist.isend(t, a.peer), t))

    def _recv_pipeline(self, a: Action) -> None:
        shape = (self._stage_input_tokens(a.microbatch), self.spec.llm.hidden)
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, a.peer)
        if a.what == "act":
            self.state.act_in[a.microbatch] = buf.requires_grad_(True)
        else:
            self.state.grad_in[a.microbatch] = buf

    def _boundary(self, a: Action) -> None:
        routes = self._message_routes(a)
        hidden = self.spec.llm.hidden
        if a.what == "act" and a.direction == "send":
            out, ids, tokens = self.state.enc_out[(a.module, a.microbatch)]
            by_id = dict(zip(ids, torch.split(out.detach(), tokens), strict=True))
            t = torch.cat([by_id[r.sample_id] for r in routes]).to(self.dtype).contiguous()
            self.state.pending.append((dist.isend(t, a.peer), t))
        elif a.what == "act":
            buf = torch.empty(sum(r.tokens for r in routes), hidden, dtype=self.dtype, device=self.device)
            dist.recv(buf, a.peer)
            for r, piece in zip(routes, torch.split(buf, [r.tokens for r in routes]), strict=True):
                self.state.emb[(a.module, r.sample_id)] = piece.detach().requires_grad_(a.module not in self.frozen)
        elif a.direction == "send":
            t = torch.cat([self.state.emb[(a.module, r.sample_id)] for r in routes]).to(self.dtype).contiguous()
            self.state.pending.append((dist.isend(t, a.peer), t))
        else:
            out, _, _ = self.state.enc_out[(a.module, a.microbatch)]
            buf = torch.empty(sum(r.tokens for r in routes), out.shape[1], dtype=self.dtype, device=self.device)
            dist.recv(buf, a.peer)
            for r, piece in zip(routes, torch.split(buf, [r.tokens for r in routes]), strict=True):
                self.state.enc_grad[(a.module, r.sample_id)] = piece

    def _message_routes(self, a: Action):
        """The routes one boundary message carries, in sample-id order (both sides agree)."""
        if a.direction == "send" and a.what == "act":
            src, smb, dst, dmb = self.rank, a.microbatch, a.peer, a.peer_microbatch
        elif a.what == "act":
            src, smb, dst, dmb = a.peer, a.peer_microbatch, self.rank, a.microbatch
        elif a.direction == "send":
            src, smb, dst, dmb = a.peer, a.peer_microbatch, self.rank, a.microbatch
        else:
            src, smb, dst, dmb = self.rank, a.microbatch, a.peer, a.peer_microbatch
        routes = self.messages.get((a.module, src, smb, dst, dmb), [])
        return [r for r, primary in routes if primary or a.what != "grad"]

    def _grad_sync(self, a: Action) -> None:
        """FSDP2 reduce-scattered in the last microbatch's backward; without FSDP the gradients are
        summed here: experts over the ranks holding the same experts, the rest over dp (x cp), by
        an all-reduce (DDP; of the fp32 main gradients under `--mixed-precision master`, master.py) or,
        under ZeRO-1/2, a reduce-scatter into each rank's slice (zero.py)."""
        module = self.modules.get(a.module)
        if module is None:
            return
        dim = "dpcp" if a.module == "llm" else "dp"
        g, ranks = self.groups.mine.get((a.module, dim), (None, ()))
        experts = self.expert_params if a.module == "llm" else []
        expert_ids = {id(p) for p in experts}
        states = getattr(self.optimizer, "states", {})
        held = states.get(a.module)
        if held is not None:  # ZeRO's reduce-scatter, or the fp32 main gradients' all-reduce
            held.reduce()
        elif not self.fsdp.get(a.module) and len(ranks) > 1:
            # a tensor-parallel DTensor gradient goes in through its local shard
            grads = [local_shard(p.grad) for p in module.parameters() if p.grad is not None and id(p) not in expert_ids]
            if grads:
                all_reduce_flat(grads, g)
        held_experts = states.get(a.module + EXPERTS_SUFFIX)
        if held_experts is not None:  # over the ranks holding the same experts (build.py `_expert_state`)
            held_experts.reduce()
        elif experts and not (self.fsdp.get(a.module) and len(self.groups.get("llm", "edp")[1]) > 1):
            eg, eranks = self.groups.get("llm", "edp")
            if len(eranks) > 1:
                for p in experts:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=eg)

"""Building the modules a rank runs: its LLM pipeline stage and its encoders, materialised from the
meta device, with TP, activation checkpointing, compile and FSDP applied in torchtitan's order; the
optimizer over what it holds."""

from __future__ import annotations

import torch
from torch import nn

from omnibench.models import init_weights
from omnibench.models.loss import linear_cross_entropy
from omnibench.models.multimodal import scatter_encoder_outputs
from omnibench.plan import (
    Layout,
)
from omnibench.runtime.groups import mesh_from
from omnibench.runtime.optim import make_optimizer  # noqa: F401 - the executor and tests take it from here
from omnibench.runtime.parallelize import (
    apply_ac,
    apply_compile,
    apply_cp,
    apply_encoder_tp,
    apply_ep,
    apply_fsdp,
    apply_tp,
    take_rows,
)


class LLMStage(nn.Module):
    """One pipeline stage of the LLM; stage 0 also embeds and scatters the encoder outputs."""

    def __init__(self, llm: nn.Module, first: bool, last: bool):
        super().__init__()
        self.llm = llm
        self.first, self.last = first, last

    def forward(self, x, position_ids, cu_seqlens, max_seqlen, enc_outs=None, cp_chunk=None, labels=None):
        """Hidden states for the next stage; on the last stage, with `labels`, the (sum-CE, count)
        of its tokens through the chunked head (omnibench.models.loss.linear_cross_entropy)."""
        if self.first:
            h = self.llm.embed(x)
            for positions, out in enc_outs or []:
                h = scatter_encoder_outputs(h, positions, out)
            h = take_rows(h, cp_chunk)
            x = h
        if labels is None:
            return self.llm(x, position_ids, cu_seqlens, max_seqlen)
        h = self.llm(x, position_ids, cu_seqlens, max_seqlen, head=False)
        return linear_cross_entropy(h, self.llm.output.weight, labels)


def split_stage(llm: nn.Module, stage: int, stages: int) -> nn.Module:
    """Keep only this stage's layers (torchtitan-style: delete the rest, names unchanged)."""
    n = len(llm.layers)
    bounds = [round(i * n / stages) for i in range(stages + 1)]
    keep = range(bounds[stage], bounds[stage + 1])
    for i in range(n):
        if i not in keep:
            del llm.layers[str(i)]
    if stage > 0:
        llm.tok_embeddings = None
    if stage < stages - 1:
        llm.norm = None
        llm.output = None
    return llm


class BuildMixin:
    """The Executor's module building (needs `spec`, `rank`, `groups`, `recompute`, `compile`)."""

    def _build_llm(self, llm: nn.Module, lay: Layout, dev: str) -> None:
        c = lay.coords(self.rank)
        self.stage, self.stages = c["pp"], lay.pp
        llm = split_stage(llm, self.stage, lay.pp)
        llm.to_empty(device=self.device)
        init_weights(llm, self.seed, prefix="llm.")
        self._freeze(llm, "llm")
        dpcp = self.groups.get("llm", "dpcp")
        self.fsdp["llm"] = lay.fsdp and len(dpcp[1]) > 1
        dp_mesh = None
        if lay.hsdp and self.fsdp["llm"]:
            p = self.stage
            rows = [[lay.rank_at(pp=p, dp=d, cp=cc, tp=t) for t in range(lay.tp)]
                    for d in range(lay.dp) for cc in range(lay.cp)]
            dp_mesh, tp_mesh = self._hsdp_meshes("llm", lay, rows, dev)
            if tp_mesh is not None:
                apply_tp(llm, tp_mesh)
        elif lay.tp > 1:
            tp = self.groups.get("llm", "tp")
            if self.fsdp["llm"]:
                # One 2D mesh: FSDP2 needs the dp and tp meshes to share a parent.
                p = self.stage
                grid = [[lay.rank_at(pp=p, dp=d, cp=cc, tp=t) for t in range(lay.tp)]
                        for d in range(lay.dp) for cc in range(lay.cp)]
                mesh = mesh_from([dpcp, tp], ("dpcp", "tp"), dev, grid)
                dp_mesh, tp_mesh = mesh["dpcp"], mesh["tp"]
            else:
                tp_mesh = mesh_from([tp], ("tp",), dev)
            apply_tp(llm, tp_mesh)
        elif self.fsdp["llm"]:
            dp_mesh = mesh_from([dpcp], ("dpcp",), dev)
        if lay.cp > 1:
            apply_cp(llm, self.groups.get("llm", "cp")[0], lay.cp, lay.cp_kind, c["cp"])
        extra, ignored = [], None
        self.expert_params: list = []  # ordered: collectives over them must match across ranks
        if lay.ep > 1:
            eg, eranks = self.groups.get("llm", "ep")
            local = apply_ep(llm, eg, lay.ep, eranks.index(self.rank))
            self.expert_params = [p for m in local for p in m.parameters()]
            edp = self.groups.get("llm", "edp")
            if self.fsdp["llm"] and len(edp[1]) > 1:
                # Experts shard over the ranks holding the same experts (expert data parallel); under
                # HSDP over those of the shard group, replicated across shard groups.
                emesh = self._expert_hsdp_mesh(lay, dpcp[1], dev) if lay.hsdp else mesh_from([edp], ("edp",), dev)
                extra = [(m, emesh) for m in local]
            else:
                ignored = set(self.expert_params)  # no other rank holds them, or grad_sync reduces them
        self._ac_and_compile(llm, "llm")
        stage = LLMStage(llm, self.stage == 0, self.stage == lay.pp - 1)
        if self.fsdp["llm"]:
            mp = self.dtype if self.dtype != torch.float32 else None
            apply_fsdp(stage, list(llm.layers.values()), dp_mesh, mp, extra, ignored)
        self.modules["llm"] = stage
        self.llm_layout = lay

    def _build_encoder(self, name: str, enc: nn.Module, lay: Layout, dev: str) -> None:
        enc.to_empty(device=self.device)
        init_weights(enc, self.seed, prefix=f"{name}.")
        self._freeze(enc, name)
        dp = self.groups.get(name, "dp")
        self.fsdp[name] = lay.fsdp and len(dp[1]) > 1
        dp_mesh = None
        rows = [[lay.rank_at(dp=d, sp=s, tp=t) for t in range(lay.tp)] for d in range(lay.dp) for s in range(lay.sp)]
        if lay.hsdp and self.fsdp[name]:
            dp_mesh, tp_mesh = self._hsdp_meshes(name, lay, rows, dev)
            if tp_mesh is not None:
                replicated = apply_encoder_tp(enc, tp_mesh)
                if replicated:
                    self.notes.append(f"{name}: tensor parallel over tp={lay.tp} except {', '.join(replicated)} "
                                      "(replicated)")
        elif lay.tp > 1:
            tp = self.groups.get(name, "tp")
            if self.fsdp[name]:
                mesh = mesh_from([dp, tp], ("dp", "tp"), dev, rows)
                dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
            else:
                tp_mesh = mesh_from([tp], ("tp",), dev)
            replicated = apply_encoder_tp(enc, tp_mesh)
            if replicated:
                self.notes.append(f"{name}: tensor parallel over tp={lay.tp} except {', '.join(replicated)} (replicated)")
        elif self.fsdp[name]:
            dp_mesh = mesh_from([dp], ("dp",), dev)
        if lay.sp > 1:
            # Ulysses for every block of this encoder, for good (temporal: every microbatch runs over
            # the sp group), before checkpointing and FSDP as the LLM's cp swap is.
            apply_cp(enc, self.groups.get(name, "sp")[0], lay.sp)
        self._ac_and_compile(enc, name)
        if self.fsdp[name]:
            mp = self.dtype if self.dtype != torch.float32 else None
            apply_fsdp(enc, list(enc.layers.values()), dp_mesh, mp)
        self.modules[name] = enc

    def _freeze(self, module: nn.Module, name: str) -> None:
        """A frozen module (ParallelSpec.freeze), before TP and FSDP wrap it (they keep each parameter's
        requires_grad): parameters that take no gradient, held in the compute dtype on a bf16 run (nothing
        updates them, so no fp32 copy is kept: what the simulator charges, costs.FROZEN_DTYPES)."""
        if name not in self.frozen:
            return
        if self.dtype != torch.float32:
            module.to(self.dtype)
        module.requires_grad_(False)
        self.notes.append(f"{name}: frozen (no gradients, no optimizer state, no gradient reduction)")

    def _make_optimizers(self, optimizer: str, lr: float):
        """The rank's optimizers: a ZeRO-sharded state (zero.py) for every module whose layout asks
        for ZeRO-1/2 over a data-parallel group of more than one rank; under `--mixed-precision master`
        in a bf16 run, bf16 weights with an fp32 master (master.py) for every other module FSDP does
        not hold; experts split over ep as `_expert_state` says; one plain optimizer for the rest."""
        from omnibench.runtime.master import EXPERTS_SUFFIX, MasterWeights
        from omnibench.runtime.zero import Optimizers, ShardedState

        states, plain = {}, []
        experts = {id(p) for p in getattr(self, "expert_params", [])}
        master = self.mixed_precision == "master" and self.dtype != torch.float32
        held = self._expert_state(optimizer, lr, master)
        if held is not None:
            states["llm" + EXPERTS_SUFFIX] = held
        for name, module in self.modules.items():
            if name in self.frozen:
                continue  # no gradient ever reaches it: no optimizer state, master copy or ZeRO bucket
            lay = self.layouts[name]
            group, ranks = self.groups.mine.get((name, "dpcp" if name == "llm" else "dp"), (None, ()))
            params = list(module.parameters())
            dense = [p for p in params if id(p) not in experts]
            loose = [p for p in params if id(p) in experts and held is None]  # experts no state holds apart
            if lay.zero and not self.fsdp.get(name) and len(ranks) > 1:
                replicate, across = None, ""
                if lay.hybrid:  # sharded within the shard group, replicated across the groups
                    group, ranks = self.groups.get(name, "dp_shard")
                    replicate, reps = self.groups.get(name, "dp_replicate")
                    across = f", replicated across {len(reps)} shard groups"
                # bf16 runs hold the replicated weights in bf16, the fp32 master in the shards
                states[name] = ShardedState(name, dense, group, lay.zero, optimizer, lr, param_dtype=self.dtype,
                                            replicate=replicate)
                self.notes.append(f"{name}: ZeRO-{lay.zero}, optimizer state{' and gradients' if lay.zero == 2 else ''} "
                                  f"sharded over {len(ranks)} data-parallel ranks{across}, weights replicated")
                plain += loose
            elif master and not self.fsdp.get(name) and dense:
                states[name] = MasterWeights(name, dense, group if len(ranks) > 1 else None, optimizer, lr,
                                             param_dtype=self.dtype)
                self.notes.append(f"{name}: bf16 weights, fp32 master and main gradients in the optimizer")
                plain += loose
            else:
                plain += [p for p in params if id(p) not in experts or held is None]
        if not states:
            return make_optimizer(optimizer, plain, lr) if plain else None
        return Optimizers(make_optimizer(optimizer, plain, lr) if plain else None, states)

    def _expert_state(self, optimizer: str, lr: float, master: bool):
        """The training state of the experts this rank holds apart from FSDP (expert parallel without
        FSDP over the expert data-parallel group), held as the LLM's dense weights are: ZeRO-sharded
        over the ranks that hold the same experts when the LLM runs ZeRO-1/2, bf16 weights with an fp32
        master under `--mixed-precision master` and wherever FSDP leaves them to this rank alone in a
        bf16 run; None (the plain optimizer: fp32, or fp32 under autocast) otherwise. The simulator
        charges experts the dense weights' dtypes (simulator/memory.py `_module_state`), so both hold
        18 bytes per expert parameter there."""
        from omnibench.runtime.master import EXPERTS_SUFFIX, MasterWeights
        from omnibench.runtime.zero import ShardedState

        params = list(getattr(self, "expert_params", []))
        lay = self.layouts.get("llm")
        if not params or lay is None or "llm" in self.frozen:
            return None
        group, ranks = self.groups.get("llm", "edp")
        group = group if len(ranks) > 1 else None
        if self.fsdp.get("llm"):
            if group is not None or self.dtype == torch.float32:
                return None  # FSDP shards them over the expert data-parallel group
            # FSDP leaves experts no other rank holds alone: bf16 weights and an fp32 master are what
            # its MixedPrecisionPolicy would give them on a group of one (fp32 ones would meet the
            # bf16 tokens FSDP's layers hand them)
            self.notes.append("llm experts: held by no other rank, bf16 weights with an fp32 master")
            return MasterWeights("llm" + EXPERTS_SUFFIX, params, None, optimizer, lr, param_dtype=self.dtype)
        if lay.zero and group is not None:
            self.notes.append(f"llm experts: ZeRO-{lay.zero} over the {len(ranks)} ranks holding the same experts")
            return ShardedState("llm" + EXPERTS_SUFFIX, params, group, lay.zero, optimizer, lr, param_dtype=self.dtype)
        if master or (lay.zero and self.dtype != torch.float32):
            self.notes.append("llm experts: bf16 weights, fp32 master and main gradients in the optimizer")
            return MasterWeights("llm" + EXPERTS_SUFFIX, params, group, optimizer, lr, param_dtype=self.dtype)
        return None

    def _ac_and_compile(self, module: nn.Module, name: str) -> None:
        """Between the TP/CP/EP swaps and FSDP, as torchtitan orders them (parallelize.py)."""
        apply_ac(module, self.recompute[name])
        if self.compile:
            apply_compile(module)

    def _hsdp_meshes(self, module: str, lay: Layout, rows: list[list[int]], dev: str):
        """HSDP meshes of a module: FSDP2's 2D ("dp_replicate", "dp_shard") mesh and, with tp, the tp
        mesh, both slices of one parent (FSDP2 needs them to share it). `rows`: this rank's FSDP
        group in order, each member as its tp ranks."""
        s = lay.shard_size
        self.notes.append(f"{module}: HSDP, parameters sharded over {s} ranks and replicated "
                          f"{lay.fsdp_size // s}x (dp_shard={s} of {lay.fsdp_size})")
        names = ("dp_replicate", "dp_shard")
        groups = [self.groups.get(module, "dp_replicate"), self.groups.get(module, "dp_shard")]
        grid = [rows[i : i + s] for i in range(0, len(rows), s)]  # [replica][shard][tp]
        if lay.tp > 1:
            mesh = mesh_from(groups + [self.groups.get(module, "tp")], (*names, "tp"), dev, grid)
            return mesh[names], mesh["tp"]
        return mesh_from(groups, names, dev, [[row[0] for row in g] for g in grid]), None

    def _expert_hsdp_mesh(self, lay: Layout, flat: tuple[int, ...], dev: str):
        """Experts under HSDP: ("dp_replicate", "edp_shard"), the ranks of each shard group holding
        this rank's experts, replicated across shard groups (the dense replicate groups)."""
        s, ep = lay.shard_size, lay.ep
        i = flat.index(self.rank) % s % ep
        grid = [[flat[r + i + m * ep] for m in range(s // ep)] for r in range(0, len(flat), s)]
        groups = [self.groups.get("llm", "dp_replicate"), self.groups.get("llm", "edp_shard")]
        return mesh_from(groups, ("dp_replicate", "edp_shard"), dev, grid)


"""What each action of a Plan costs in work: the microbatch behind an action, its signature (the
cost-relevant sequence lengths), and the `Work` of a module stage on it under the layout (tp, cp,
sp, ep), the recompute policy and the software stack that runs it."""

from __future__ import annotations

import functools

from omnibench.plan import (
    FORWARD,
    GRAD_SYNC,
    Action,
)
from omnibench.specs import costs
from simulator.flops import (
    Work,
    audio_work,
    input_elements,
    llm_work,
    stage_layers,
    vision_work,
)
from simulator.options import SimulationError
from workloads.sample import ENCODER_OF

# the modalities each encoder takes (workloads.sample.ENCODER_OF), as `Segment.encoder` maps them
_MODALITIES_OF = {enc: frozenset(m for m, e in ENCODER_OF.items() if e == enc) for enc in ("vision", "audio")}


class WorkMixin:
    """The Engine's data lookups (needs `plan`, `model`, `policy`, `options`, `index` and caches)."""

    @functools.cached_property
    def frozen(self) -> frozenset[str]:
        """Modules whose weights take no gradient (`--freeze`), as the plan records them
        (systems/common.py `drop_frozen`: a frozen encoder's plan holds no backward)."""
        return frozenset(self.plan.options.get("freeze", ()))

    @functools.cached_property
    def _samples_by_id(self) -> dict:
        """sample id -> Sample (what `Plan.sample` looks up, without its check per call)."""
        return {s.sample_id: s for s in self.plan.samples}

    def _data_rank(self, module: str, rank: int) -> int:
        """The rank whose assignment feeds `rank` (planners may list only one rank per data group)."""
        key = (module, rank)
        got = self._data_rank_cache.get(key)
        if got is not None:
            return got
        per = self.plan.assignment.get(module, {})
        found = rank
        if rank not in per and module in self.index:
            idx = self.index[module]
            c = idx.coords.get(rank)
            if c is not None:
                for r in idx.group(rank, tuple(d for d in idx.layout.mesh_dims if d != "dp")):
                    if r in per:
                        found = r
                        break
        self._data_rank_cache[key] = found
        return found

    def _microbatch(self, module: str, rank: int, mb: int) -> tuple[int, ...]:
        mbs = self.plan.assignment.get(module, {}).get(self._data_rank(module, rank), [])
        if mb >= len(mbs):
            raise SimulationError(f"rank {rank}: {module} microbatch {mb} has no assignment in the plan")
        return mbs[mb]

    def _signature(self, module: str, rank: int, mb: int) -> tuple:
        """The cost-relevant lengths of a microbatch: one shared tuple per distinct value (so the
        work of equal microbatches on different ranks is looked up by identity, never rehashed)."""
        sigs = self._rank_data(module, rank)[0]
        if mb >= len(sigs):
            raise SimulationError(f"rank {rank}: {module} microbatch {mb} has no assignment in the plan")
        return sigs[mb]

    def _rank_data(self, module: str, rank: int) -> tuple[list, list]:
        """(signature, raw input elements or None until asked) of each microbatch the rank's data rank
        is assigned, by microbatch index: one pair of lists per data rank, shared by the ranks it
        feeds (tp, cp and pipeline peers), so an action's data is an index into them."""
        per = self._rank_data_of.get(module)
        if per is None:
            per = self._rank_data_of[module] = {}
        got = per.get(rank)
        if got is None:
            data_rank = self._data_rank(module, rank)
            got = per.get(data_rank) if data_rank != rank else None
            if got is None:
                mbs = self.plan.assignment.get(module, {}).get(data_rank, [])
                by_id, intern = self._samples_by_id, self._sig_intern
                sigs = []
                for ids in mbs:
                    if module == "llm":
                        sig = tuple(by_id[i].llm_tokens for i in ids)
                    else:  # the segments its encoder takes (Segment.encoder, by modality, without a call per segment)
                        mods = _MODALITIES_OF[module]
                        if module == "vision":
                            sig = tuple(s.grid_thw for i in ids for s in by_id[i].segments if s.modality in mods)
                        else:
                            sig = tuple(s.mel_frames for i in ids for s in by_id[i].segments if s.modality in mods)
                    sigs.append(intern.setdefault((module, sig), sig))
                got = per[data_rank] = (sigs, [None] * len(sigs))
            per[rank] = got
        return got

    def input_elements(self, module: str, rank: int, a: Action) -> float:
        """Raw input elements a forward prepares: encoders and the LLM's first stage take raw
        samples (the runtime draws all of each sample's inputs there); 0 for other actions."""
        if a.kind != FORWARD or (module == "llm" and a.stage != 0):
            return 0.0
        inputs = self._rank_data(module, rank)[1]
        got = inputs[a.microbatch] if a.microbatch < len(inputs) else None
        if got is None:
            ids = self._microbatch(module, rank, a.microbatch)
            of = self._sample_inputs  # per sample: its LLM and encoder microbatches all ask
            for i in ids:
                if i not in of:
                    of[i] = input_elements(self._samples_by_id[i], self.model)
            got = inputs[a.microbatch] = float(sum(of[i] for i in ids))
        return got

    def _stage(self, module: str, rank: int, action: Action) -> int:
        if module == "llm":
            return self.index["llm"].coords[rank]["pp"] if action.kind == GRAD_SYNC else action.stage
        return 0

    def _llm_cp_kind(self, long_group: bool) -> str:
        """How the LLM attends across its context-parallel ranks: the layout's kind, or for omni's long
        samples their group's (plan.options["long_short"]["llm_cp_kind"]: Ulysses or all-gathered K/V)."""
        lay = self.plan.layouts["llm"]
        if long_group:
            return (self.plan.options.get("long_short") or {}).get("llm_cp_kind") or lay.cp_kind
        return lay.cp_kind

    def work(self, module: str, stage: int, sig: tuple, sp: int = 0) -> Work:
        fast = (id(sig), module, stage, sp)  # signatures are shared tuples (`_signature`)
        hit = self._work_cache.get(fast)
        if hit is not None and hit[1] is sig:
            return hit[0]
        key = (module, stage, sig, sp)
        got = self._work_cache.get(key)
        if got is None:
            lay = self.plan.layouts[module]
            if sp:  # omni's long input: one encoder microbatch split over a sequence-parallel group
                from dataclasses import replace as _replace

                lay = _replace(lay, sp=sp)
            stack, seq_parallel = self._kernel_stack(module, lay, sp)
            if module == "llm":
                llm = self.model.llm
                layers = stage_layers(llm.layers, lay.stages, stage, lay.embedding_loss_stages)
                # sp: omni's long LLM sample over a context-parallel group (systems/omni/llm_long_short.py)
                got = llm_work(llm, list(sig), layers, stage == 0, stage == lay.stages - 1, lay.tp, sp or lay.cp,
                               lay.ep, self.policy["llm"], self._llm_cp_kind(bool(sp)), lay.expert_tp, self.activation_stack,
                               stack, seq_parallel, frozen="llm" in self.frozen)
            elif module in ("vision", "audio"):
                # omni's long inputs (sp) are split by their group, not chunked (as the runtime does)
                chunk = self.options.encoder_chunk_tokens if not sp and lay.sp == 1 else 0
                make = vision_work if module == "vision" else audio_work
                got = make(getattr(self.model, module), list(sig), lay.tp, lay.sp, self.policy[module], chunk,
                           stack, seq_parallel)
            else:
                raise SimulationError(f"module must be llm, vision or audio; got {module!r}")
            self._work_cache[key] = got
        self._work_cache[fast] = (got, sig)
        return got

    def _kernel_stack(self, module: str, lay, sp: int) -> tuple:
        """The Work's kernel stack under the simulated software stack (SimOptions), and whether tp
        runs sequence-parallel: one shared Stack per (module, sp), `lay` being the module's layout
        under that sp (`work`), handed to the flops functions that make the shape (replacing it on
        each finished Work cost two dataclass copies per distinct microbatch)."""
        key = ("kernel-stack", module, sp)
        got = self._work_cache.get(key)
        if got is None:
            from dataclasses import replace as _replace

            from simulator.kernels import FUSED

            o = self.options
            stack = self._eager_stack(module, lay) if o.stack == "eager" else FUSED
            stack = _replace(stack, attention=o.attention, gemm=o.gemm_dtype, frozen=module in self.frozen)
            got = self._work_cache[key] = (stack, o.sequence_parallel and lay.tp > 1)
        return got

    def _eager_stack(self, module: str, lay):
        stack = eager_stack(self.model, module, lay, getattr(self.options, "mixed_precision", "autocast") == "master",
                            module in self.frozen)
        # one object per distinct stack: shapes holding equal stacks then hash and compare cheaply
        return self._work_cache.setdefault(("stack", stack), stack)

    def stage_work(self, module: str, stage: int) -> Work:
        """Parameters of what pipeline rank `stage` holds (no data): the work of an empty microbatch;
        under interleaved 1F1B the sum over the rank's model chunks (virtual stages stage + c * pp)."""
        lay = self.plan.layouts[module]
        if module != "llm" or lay.vpp == 1:
            return self.work(module, stage, ())
        key = ("rank-stages", stage)
        got = self._work_cache.get(key)
        if got is None:
            parts = [self.work(module, stage + c * lay.pp, ()) for c in range(lay.vpp)]
            got = Work(params=sum(w.params for w in parts), expert_params=sum(w.expert_params for w in parts),
                       layers=sum(w.layers for w in parts))
            self._work_cache[key] = got
        return got

    def _p2p_bytes(self, module: str, rank: int, mb: int) -> float:
        key = ("p2p", module, self._data_rank(module, rank), mb)
        got = self._sig_cache.get(key)
        if got is None:
            got = self._sig_cache[key] = self._p2p_bytes_of(module, rank, mb)
        return got

    def _p2p_bytes_of(self, module: str, rank: int, mb: int) -> float:
        sig = self._signature(module, rank, mb)
        lay = self.plan.layouts[module]
        if module == "llm":
            # each member of omni's long-sample group passes on its chunk of the row; Megatron's
            # scatter/gather (and sequence parallelism) sends each tp rank's 1/tp slice
            split = lay.tp if self.options.p2p_scatter_gather else 1
            return sum(sig) / (len(self._long_group(module, rank, mb)) or lay.cp) / split * self.model.llm.hidden * 2
        enc = self.model.encoders[module]
        w = self.work(module, 0, sig)
        return w.tokens * enc.hidden * 2


def eager_stack(model, module: str, lay, master: bool = False, frozen: bool = False):
    """How this project's runtime runs a module (omnibench/runtime/executor.py): FSDP holds it when
    its data-parallel group has more than one rank, with bf16 parameters (MixedPrecisionPolicy); ZeRO
    (omnibench/runtime/zero.py) holds its replicated weights in bf16 too, and so does `--mixed-precision
    master` (`master`: omnibench/runtime/master.py) every other module, and a frozen one (`frozen`, cast
    to bf16 once: omnibench/runtime/build.py); otherwise (one rank, DDP) its weights stay fp32 under
    autocast, cast per forward, and the LLM's fp32 token embedding makes the residual stream fp32.
    Encoders start from an autocast linear / conv, so theirs is bf16."""
    from simulator.kernels import Stack

    fsdp = lay.fsdp and lay.fsdp_size > 1  # the LLM's dp x cp, an encoder's dp x sp
    bf16 = fsdp or master or frozen or (not lay.fsdp and getattr(lay, "zero", 0) > 0 and lay.fsdp_size > 1)
    chunk = costs.loss_chunk_tokens(-(-model.llm.vocab // lay.tp)) if module == "llm" else 0
    return Stack(kind="eager", residual_bytes=4 if module == "llm" and not bf16 else 2,
                 weight_cast=not bf16, loss="chunked", loss_chunk_tokens=chunk)

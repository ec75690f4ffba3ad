"""omni: MegaScale-Omni's design as a planner.

Per step:
1. layouts (layout.py): the LLM keeps its full dp/tp/pp/cp/ep layout over every rank; each encoder
   gets its own data-parallel layout over the same ranks and fixed sequence-parallel groups for
   long inputs, all groups placed inside nodes where they fit;
2. costs: every sample's encoder and LLM cost from the shared cost model
   (omnibench/specs/cost_model.py; calibrated when `options.calibration` names a profile);
3. encoder sequence parallelism (long_short.py): per encoder, the step's scheme (long_short: samples
   costlier than the balanced per-rank share over a sequence-parallel group, the rest data-parallel;
   all: every sample over a group, packed per group; none), chosen from this step's costs;
   the LLM's own long samples over a context-parallel group of data ranks (llm_long_short.py), at
   any pp and cp;
4. loading (reorder.py): loaders start from a distributed sampler's round-robin shards and
   rebalance inside small groups from exchanged cost metadata. The runtime runs that exchange for
   real before planning (omnibench/runtime/loading.py: an all-gather inside each reorder group,
   then one over the data-parallel group sharing the post-reorder sample headers) and passes the
   result in as `loading`; without it the same exchange runs here in one process. Both are the
   Plan's leading `metadata` actions, so the simulator costs them;
5. encoding: short samples are encoded inside their loader's data group, long ones on their group;
6. resharding (reshard.py): the LLM assignment is balanced afresh by LLM cost and encoder outputs
   are routed to it (Plan.routes);
7. schedule (schedule.py): the encoder-LLM joint pipeline, from this step's costs.

Encoders' training state is ZeRO-2 over their data ranks by default (layout.py, `encoder_dp`; `tune`
also weighs HSDP and hybrid ZeRO-2, which keep the rings inside a few nodes at thousands of GPUs). Every
technique can be switched off on its own (options.py) for ablations. The Plan's notes record what
each step decided.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from omnibench.plan import METADATA, Action, Plan, PlanError, Route
from omnibench.process_groups import long_llm_groups as llm_groups
from omnibench.process_groups import sp_groups
from omnibench.specs.cost_model import CostModel, load_cost_model
from omnibench.specs.costs import recompute_policy
from omnibench.specs.model import MultimodalSpec
from omnibench.specs.parallel import ParallelSpec
from systems.common import (
    BoundaryIndex,
    active_encoders,
    balance,
    by_identity,
    data_rank,
    data_ranks,
    default_microbatches,
    finish,
    llm_tokens_of,
    make_routes,
    resolve_common,
    step_tail,
)
from systems.omni.layout import build_layouts, locks_encoders, placement_notes, sp_sizes
from systems.omni.llm_long_short import llm_group_size, place_llm_long
from systems.omni.long_short import (
    SCHEMES,
    Candidates,
    GroupCosts,
    _holds_bf16,
    checked_finish,
    choose,
    pack_by_due,
    split_long_short,
)
from systems.omni.options import OmniOptions
from systems.omni.reorder import (
    EncoderShare,
    LoaderSpec,
    Loading,
    header_bytes,
    in_process_loading,
    max_over_mean,
)
from systems.omni.reshard import level_microbatches, reshard
from systems.omni.schedule import (
    EncItem,
    align_sends,
    joint_timeline,
    lockstep_orders,
    step_floor,
    to_actions,
)
from workloads.sample import Batch

__all__ = ["OmniOptions", "OmniPlanner"]


@dataclass(frozen=True)
class _Floor:
    """One way of planning a batch up to its LLM microbatches: a floor under its estimated step (the
    first stage's LLM ops, `schedule.step_floor`, plus every rank's share of the encoder work at its
    cheapest where the way is weighed: `encoder_floor` in `_plan`), before its encoder placement is
    worked out."""
    step_s: float
    long_samples: int  # LLM samples split over a context-parallel group of data ranks
    always: bool  # options.llm_split "always": kept without weighing


@dataclass(frozen=True)
class _Draft:
    """One way of planning a batch (with or without the LLM split) up to its estimated step: enough to
    weigh the two ways, with the routes and actions (a third of a plan's cost) left to `build`."""
    estimated_step_s: float
    build: Callable[[], Plan]


# The LLM long-short split is kept only where the planner's estimate puts it this much ahead of the
# whole-sample plan: it costs a microbatch's activations and communicators the estimate does not see.
SPLIT_MARGIN = 0.01


def _split_pays(split_s: float, whole_s: float) -> bool:
    """Whether the split is kept: its estimated step shorter than the whole-sample way's by SPLIT_MARGIN.
    Monotone in both, so a floor under either side decides as the estimate would."""
    return split_s < (1 - SPLIT_MARGIN) * whole_s


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def _sp_sizes(model: MultimodalSpec, parallel: ParallelSpec, module: str, enc, opts: OmniOptions) -> list[int]:
    """Group sizes a sequence-parallel sample of `module` may be split over this step ([] : none;
    encoder TP rules SP out)."""
    on = opts.long_short_sp and opts.encoder_sp_scheme != "none" and enc.tp == 1
    return sp_sizes(model, parallel, module, enc) if on else []


def heaviest_first(mbs: list[list[int]], cost: dict[int, float]) -> list[tuple[int, ...]]:
    """A data rank's microbatches, costliest first. Every data rank's microbatch j runs in lock-step
    with the others' (FSDP gathers, cp and tp exchanges per layer), so the step pays the sum over j of
    the slowest rank's microbatch j; aligning every rank's heaviest at the same index minimises that
    sum (the rearrangement inequality)."""
    return [tuple(mb) for mb in sorted(mbs, key=lambda mb: (-sum(cost[i] for i in mb), mb))]


@by_identity(3, size=8)
def _per_batch(batch: Batch, model: MultimodalSpec, cm: CostModel) -> dict:
    """What every plan of `batch` works out alike under one cost model, whatever its layout: the samples'
    costs, the in-process loaders' exchange per LoaderSpec, each encoder's per-sample prices per group
    size and pricing (`priced`). A tune plans one batch at every layout it tries, and these were a third
    of omni's planning there. Filled as plans ask; every plan only reads what it finds (as the two ways
    of one `plan` call always shared them)."""
    return {}


def _samples_floor(llm, parallel: ParallelSpec, n_samples: int) -> int:
    """Samples every LLM data rank needs: enough for its pipeline microbatches."""
    return max(llm.pp, min(default_microbatches(parallel), n_samples // llm.dp))


class OmniPlanner:
    name = "omni"

    def __init__(self, cost_model: CostModel | None = None):
        self._cost_model = cost_model
        self._cache: dict = {}

    def cost_model(self, model: MultimodalSpec, opts: OmniOptions) -> CostModel:
        if self._cost_model is not None:
            return self._cost_model
        if opts.balancer == "tokens":
            raise PlanError("options.balancer: omni plans with per-sample costs in seconds (its long/short "
                            "threshold and joint schedule compare them); give analytic or simulator")
        # analytic: exact FLOPs at one nominal rate, what any planner knows before the step runs (the
        # hardware still prices its collectives: systems/omni/long_short.py GroupCosts); a profile fitted
        # from runs (`calibration`) is knowledge a real planner can have, and is used whenever given
        hardware = "" if opts.balancer == "analytic" else opts.hardware
        calibration = opts.calibration
        key = (model, calibration, hardware)
        if key not in self._cache:
            try:
                self._cache[key] = load_cost_model(model, calibration or None, hardware)
            except ValueError as e:
                raise PlanError(f"options.hardware: {str(e).splitlines()[0]}") from None
        return self._cache[key]

    def loader_spec(self, model: MultimodalSpec, parallel: ParallelSpec, n_samples: int,
                    layouts: dict | None = None) -> LoaderSpec:
        """What each data loader knows before it reads a sample (reorder.py)."""
        opts = OmniOptions.parse(parallel.options)
        layouts = layouts or build_layouts(model, parallel, opts.encoder_dp)
        llm = layouts["llm"]
        if n_samples < llm.dp:
            raise PlanError(f"batch: {n_samples} samples cannot feed dp={llm.dp} data-parallel ranks")
        loader0 = [r for r in llm.ranks if llm.coord(r, "dp") == 0]
        shares = [EncoderShare(m, len({data_rank(layouts[m], r) for r in loader0}), layouts[m].dp)
                  for m in model.encoders]
        return LoaderSpec(loaders=llm.dp, group_size=opts.reorder_group, reorder=opts.reorder and llm.dp > 1,
                          count_llm=not opts.reshard,
                          floor=0 if opts.reshard else _samples_floor(llm, parallel, n_samples),
                          encoders=tuple(shares), split=opts.loading)

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch,
             loading: Loading | None = None) -> Plan:
        """One step's Plan. `loading`: the loaders' shards after their real metadata exchange
        (the runtime); without it the same exchange is run here in one process.

        The LLM long-short split is weighed per batch, as the encoders' schemes are: splitting the
        long samples makes every data rank run one more microbatch in lock-step (FSDP) and holds
        more activations, which pays only where a long sample would otherwise set the step (long
        videos whose LLM sequence exceeds a data rank's share), not where a few samples just cross
        the share (mixed_video). The batch is planned both ways and the split kept only where its
        estimated step is shorter by more than SPLIT_MARGIN."""
        shared: dict = {}  # what both ways work out alike (costs, the loaders' exchange, prices)
        split_way = self._plan(model, parallel, batch, loading, shared=shared)
        floor_split = next(split_way)
        if not floor_split.long_samples or floor_split.always:
            return next(split_way).build()
        whole_way = self._plan(model, parallel, batch, loading, split_llm=False, shared=shared)
        floor_whole = next(whole_way)
        # Only the estimates decide, and a way whose floor already decides is never placed: the way with
        # the lower floor is drafted first, and the other only where its floor leaves the choice open
        # (estimates are _r-rounded and _r is monotone, so a floor rounded decides exactly as the
        # estimate would). The losing way's routes and actions are never built.
        if floor_split.step_s <= floor_whole.step_s:
            split = next(split_way)
            if _split_pays(split.estimated_step_s, _r(floor_whole.step_s)):
                return self._keep(split, floor_split.long_samples, split.estimated_step_s, _r(floor_whole.step_s),
                                  "whole", split=True)
            whole = next(whole_way)
        else:
            whole = next(whole_way)
            if not _split_pays(_r(floor_split.step_s), whole.estimated_step_s):
                return self._keep(whole, floor_split.long_samples, _r(floor_split.step_s), whole.estimated_step_s,
                                  "split", split=False)
            split = next(split_way)
        kept = _split_pays(split.estimated_step_s, whole.estimated_step_s)
        return self._keep(split if kept else whole, floor_split.long_samples, split.estimated_step_s,
                          whole.estimated_step_s, "", split=kept)

    @staticmethod
    def _keep(draft: _Draft, n_long: int, split_s: float, whole_s: float, floor_of: str, split: bool) -> Plan:
        """The kept way's Plan, its notes saying what the two ways estimated (`floor`: the way only
        bounded from below, its placement never worked out)."""
        plan = draft.build()
        estimated = {"split": split_s, "whole": whole_s, **({"floor": floor_of} if floor_of else {})}
        notes = plan.notes["llm_long_short"]
        notes["estimated_step_s"] = estimated
        if not split:
            at_least = "at least " if floor_of == "split" else ""
            notes["why_not"] = (f"splitting the {n_long} long sample(s) estimates {at_least}{split_s} s "
                                f"against {whole_s} s whole")
        return plan

    def _plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch, loading: Loading | None = None,
              split_llm: bool = True, shared: dict | None = None) -> Iterator[_Floor | _Draft]:
        """One way of planning the step, with or without the LLM long-short split, in two parts: the
        first `next()` works out the LLM microbatches and yields a `_Floor` under the way's estimated
        step, the second the encoder placement and schedule and yields a `_Draft` (`build()` makes its
        Plan). `shared`: a dict the planning of one batch hands to both ways, holding what does not
        depend on the split (the samples' costs, the in-process loaders' exchange, the encoder SP groups
        and their prices): filled by the first, read by the second."""
        way = _Way(self, model, parallel, batch, {} if shared is None else shared)
        way.layouts_and_costs()
        way.encoder_sp_schemes()
        way.load(loading)
        way.llm_long_short(split_llm)
        way.assign_llm()
        yield way.floor(split_llm)
        way.prepare_encoder_placement()
        way.schedule()
        yield _Draft(_r(way.timeline.step_s), way.build)

    @staticmethod
    def _group_pool(model, parallel, layouts, sp_by_size, opts) -> dict[str, list[int]]:
        """module -> the group sizes any step may name (each size's fixed groups of consecutive ranks:
        long_short.py, llm_long_short.py). The runtime builds every such group once, at start-up, and
        keeps it (omnibench/runtime/long_short.py); the simulator counts them all in a rank's memory."""
        pool = {}
        if opts.long_short_sp and opts.encoder_sp_scheme != "none":
            pool = {m: sorted(sp_by_size[m]) for m in model.encoders if sp_by_size.get(m)}
        if opts.llm_long_short:
            k = llm_group_size(model, parallel, layouts["llm"])[0]
            if k > 1:
                pool["llm"] = [k]
        return pool

    @staticmethod
    def _metadata_actions(spec: LoaderSpec, llm, loading: Loading, by_id) -> dict[int, list[Action]]:
        """The loaders' exchanges (reorder.py), at the head of every rank's actions: the reorder
        group's all-gather of cost metadata (padded to the largest dealt shard), then the all-gather
        of every loader's post-reorder sample headers that lets each rank build the same Plan."""
        dealt_max = -(-len(by_id) // spec.loaders)
        head = []
        if spec.reorder and min(spec.group_size, spec.loaders) > 1:
            head.append(Action(METADATA, "loader", what="reorder", nbytes=8 * spec.entry_width * dealt_max))
        if spec.loaders > 1:
            biggest = max(sum(header_bytes(by_id[i]) for i in shard) for shard in loading.shards)
            head.append(Action(METADATA, "loader", what="plan", nbytes=8 + biggest))
        return {r: list(head) for r in llm.ranks}

    @staticmethod
    def _stage_costs(cm: CostModel, llm, llm_mbs, llm_cost: dict[int, float], share: dict[int, int] | None = None
                     ) -> tuple[list[float], list[float]]:
        m = len(llm_mbs[0])
        split = llm.pp * llm.tp * llm.cp
        share = share or {}
        f, b = [], []
        for j in range(m):
            worst = max(sum(llm_cost[i] / share.get(i, 1) for i in mbs[j]) for mbs in llm_mbs) / split
            f.append(cm.forward("llm", worst))
            b.append(worst - cm.forward("llm", worst))
        return f, b


class _Way:
    """One way of planning a batch (`OmniPlanner._plan`: with or without the LLM long-short split), its
    steps in the order they run, each keeping what it settles for the ones after it. `shared`: what the
    planning of one batch hands to both ways (what does not depend on the split), filled by the first."""

    def __init__(self, planner: OmniPlanner, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch,
                 shared: dict):
        self.planner, self.model, self.parallel, self.batch, self.shared = planner, model, parallel, batch, shared

    def once(self, key, make, store: dict | None = None):
        """`make()`, worked out by the first of the batch's plans and read by the others (`store`:
        this call's two ways, or `per_batch`: every plan of the batch under this cost model)."""
        store = self.shared if store is None else store
        if key not in store:
            store[key] = make()
        return store[key]

    def layouts_and_costs(self) -> None:
        """Every module's layout (layout.py) and every sample's LLM and encoder cost."""
        model, parallel, batch = self.model, self.parallel, self.batch
        resolve_common(model, parallel, batch)
        opts = self.opts = OmniOptions.parse(parallel.options)
        cm = self.cm = self.planner.cost_model(model, opts)
        self.per_batch = _per_batch(batch, model, cm)
        # both ways alike
        layouts = self.layouts = self.once("layouts", lambda: build_layouts(model, parallel, opts.encoder_dp))
        llm = self.llm = layouts["llm"]
        self.locked = locks_encoders(layouts)
        for m in model.encoders:
            for group in layouts[m].groups("tp") if layouts[m].tp > 1 else []:
                if len({llm.coord(r, "pp") for r in group}) > 1:
                    raise PlanError(f"encoder_tp={layouts[m].tp}: {m} tp group {group} spans LLM pipeline stages; "
                                    f"use an encoder_tp that divides the ranks of one stage")
        self.world = parallel.world_size
        self.samples = batch.samples
        ids = self.ids = [s.sample_id for s in self.samples]
        by_id = self.by_id = {s.sample_id: s for s in self.samples}
        self.llm_cost, self.enc_cost = self.once("costs", lambda: (
            {i: cm.llm(by_id[i]) for i in ids},
            {m: {i: cm.encoder(by_id[i], m) for i in ids if by_id[i].encoder_seq_lens(m)} for m in model.encoders}),
            self.per_batch)
        self.active = active_encoders(model, batch)
        self.notes: dict = {"cost_model": cm.source}

    def encoder_sp_schemes(self) -> None:
        """Encoder sequence-parallel groups and the schemes to weigh (long_short.py)."""
        model, layouts, opts = self.model, self.layouts, self.opts
        # Candidates per encoder: (scheme, group size), each size's fixed groups of consecutive ranks.
        sp_by_size: dict[str, dict[int, list[tuple[int, ...]]]] = {}
        schemes: dict[str, list[tuple[str, int]]] = {}
        for m in model.encoders:
            sizes = _sp_sizes(model, self.parallel, m, layouts[m], opts)
            sp_by_size[m] = self.once(("sp_groups", m),
                                      lambda m=m, sizes=sizes: {k: sp_groups(layouts[m], k) for k in sizes})
            wanted = "none" if not opts.long_short_sp else opts.encoder_sp_scheme
            group_schemes = [x for x in SCHEMES if x != "none"] if wanted == "auto" else [wanted]
            schemes[m] = ([("none", 1)] if wanted in ("auto", "none") or not sizes else []) + [
                (x, k) for x in group_schemes if x != "none" for k in sizes]
        self.sp_by_size, self.schemes = sp_by_size, schemes
        parallel, cm = self.parallel, self.cm
        self.exchange = self.once("exchange", lambda: GroupCosts(model, cm, opts.hardware,
                                                                 recompute_policy(parallel.recompute),
                                                                 parallel.mixed_precision == "master",
                                                                 measured=opts.balancer != "analytic"))

    def load(self, loading: Loading | None) -> None:
        """Loading and reordering (reorder.py): the loaders' shards, exchanged here in one process unless
        the runtime passes its own exchange's (`loading`)."""
        llm, ids, parallel = self.llm, self.ids, self.parallel
        dp = self.dp = llm.dp
        spec = self.loader_spec = self.planner.loader_spec(self.model, parallel, len(ids), self.layouts)
        if loading is None:
            loading = self.once(("loading", spec), lambda: in_process_loading(spec, self.cm, self.samples),
                                self.per_batch)
        elif sorted(i for shard in loading.shards for i in shard) != sorted(ids) or len(loading.shards) != dp:
            raise PlanError(f"loading: the loaders' shards do not cover this batch's {len(ids)} samples over dp={dp}")
        self.loading = loading
        self.shards, self.before, self.after = loading.shards, loading.before, loading.after
        self.traffic = loading.traffic
        self.want_mb = default_microbatches(parallel)
        self.samples_floor = _samples_floor(llm, parallel, len(ids))
        self.enc_home = self.once("enc_home", self._homes)
        self.home = {i: d for d, shard in enumerate(self.shards) for i in shard}

    def _homes(self) -> dict[str, dict[int, list[int]]]:
        """Each LLM data group's encoder data ranks, per encoder."""
        llm, layouts = self.llm, self.layouts
        group_ranks: dict[int, list[int]] = defaultdict(list)
        for r in llm.ranks:
            group_ranks[llm.coord(r, "dp")].append(r)
        return {m: {d: sorted({data_rank(layouts[m], r) for r in group_ranks[d]}) for d in range(self.dp)}
                for m in self.model.encoders}

    def llm_long_short(self, split_llm: bool) -> None:
        """LLM long / short (llm_long_short.py): the long samples, each over a context-parallel group of
        data ranks, and the groups they go to."""
        opts, llm, dp = self.opts, self.llm, self.dp
        k_llm, self.llm_kind, self.k_why = (llm_group_size(self.model, self.parallel, llm)
                                            if opts.llm_long_short and split_llm
                                            else (1, "", "switched off" if not opts.llm_long_short else ""))
        self.k_llm = k_llm
        self.llm_split = split_long_short(self.llm_cost, dp, k_llm, k_llm > 1)
        self.long_llm = list(self.llm_split.long)
        self.on_llm_group = place_llm_long(self.long_llm, self.llm_cost, dp // k_llm, k_llm) if self.long_llm else []
        self.long_set = set(self.long_llm)

    def assign_llm(self) -> None:
        """LLM assignment (resharding): every data rank's microbatches, and each sample's LLM consumer."""
        llm, llm_cost, dp, k_llm, long_llm = self.llm, self.llm_cost, self.dp, self.k_llm, self.long_llm
        on_llm_group, long_set = self.on_llm_group, self.long_set
        start = [sum(llm_cost[i] for i in on_llm_group[d // k_llm]) / k_llm for d in range(dp)] if long_llm else None
        short_ids = self.short_ids = [i for i in self.ids if i not in long_set]
        if self.opts.reshard:
            llm_shards = reshard(short_ids, llm_cost, self.home, dp, 0 if long_llm else self.samples_floor, start)
        else:
            llm_shards = [[i for i in shard if i not in long_set] for shard in self.shards]
        if long_llm:
            # Every data rank runs the same number of microbatches (FSDP locks them): its group's long
            # samples, one each, then its short ones over the rest (possibly empty).
            n_long = [len(on_llm_group[d // k_llm]) for d in range(dp)]
            m_count = max(n_long) + self.want_mb
            llm_mbs = [[(i,) for i in on_llm_group[d // k_llm]]
                       + heaviest_first(balance(((i, llm_cost[i]) for i in shard), m_count - n_long[d]), llm_cost)
                       for d, shard in enumerate(llm_shards)]
        else:
            m_count = min(self.want_mb, min(len(s) for s in llm_shards))
            if m_count < llm.pp:
                raise PlanError(
                    f"microbatches: only {m_count} microbatch(es) per data rank fit this batch but pp={llm.pp} "
                    f"needs >= {llm.pp}; use a larger batch or fewer stages"
                )
            # Microbatches exist to bound activation memory, which grows with tokens: split each data
            # rank's samples by tokens (as the baselines do), which also leaves the costliest (longest)
            # samples together in the first microbatch on every rank, then level them (lock-step).
            tokens = llm_tokens_of(self.batch)
            llm_mbs = [heaviest_first(balance(((i, tokens[i]) for i in shard), m_count), llm_cost)
                       for shard in llm_shards]
            if llm.pp == 1 and m_count > 1 and llm.fsdp and llm.fsdp_size > 1:
                # microbatch j runs in lock-step over each FSDP shard group: level it (reshard.py)
                locks = [sorted({llm.coord(r, "dp") for r in g}) for g in llm.shard_groups() if llm.coord(g[0], "tp") == 0]
                llm_mbs = level_microbatches(llm_mbs, llm_cost, tokens, locks)
        self.m_count, self.llm_mbs = m_count, llm_mbs
        self.due = {i: j for mbs in llm_mbs for j, mb in enumerate(mbs) for i in mb}
        consumer = self.consumer = {i: d for d, mbs in enumerate(llm_mbs) for mb in mbs for i in mb}
        llm_data_ranks = self.llm_data_ranks = data_ranks(llm)  # data group d's rank at pp 0, cp 0, tp 0
        llm_leader: dict[int, int] = {}
        for g, sids in enumerate(on_llm_group):
            for i in sids:
                consumer[i] = g * k_llm
                llm_leader[i] = llm_data_ranks[g * k_llm]
        self.llm_leader = llm_leader
        self.llm_share = {i: k_llm for i in long_set}
        self.assignment: dict = {"llm": dict(zip(llm_data_ranks, llm_mbs, strict=True))}

    def consumer_rank(self, i: int) -> int:
        """The LLM rank whose route carries sample i's gradient back (cp 0, tp 0 of its data group)."""
        return self.llm_leader.get(i, self.llm_data_ranks[self.consumer[i]])

    def floor(self, split_llm: bool) -> _Floor:
        """The way's floor under its estimated step (`_Floor`), from its LLM microbatches' stage costs."""
        opts, parallel, llm, m_count = self.opts, self.parallel, self.llm, self.m_count
        self.f_stage, self.b_stage = self.planner._stage_costs(self.cm, llm, self.llm_mbs, self.llm_cost,
                                                               self.llm_share)
        # GroupCosts.cost: its configuration, and what of the layout it reads (the weights' dtype)
        self.pricing = (opts.hardware, parallel.recompute, parallel.mixed_precision == "master")
        self.price_cache: dict[tuple, dict[int, float]] = self.once(("prices", self.pricing), dict, self.per_batch)
        # The way's floor: the first stage's LLM ops alone (schedule.step_floor), or with every rank's
        # share of the encoder work the LLM ops cannot overlap on that rank. The second is summed in
        # another order than the timeline adds, so it is lowered by far more than their rounding can
        # differ: the terms are non-negative (costs, exchange seconds), each sum is within (n - 1) x
        # 1.1e-16 of exact, and 1e-9 covers up to ~4 million samples (a 131,072-GPU mixed_video batch at
        # 4,096 tokens per GPU holds 217,885). A floor must never pass the estimate. Only a way that is
        # weighed needs it: the whole-sample way, or a split way with samples to split.
        floor_s = step_floor(llm, m_count, self.f_stage, self.b_stage)
        weighed = not split_llm or (bool(self.long_llm) and opts.llm_split != "always")
        enc_s = self.once("encoder_floor", self.encoder_floor) if weighed else 0.0
        if enc_s > 0:
            floor_s = max(floor_s, (floor_s + enc_s) * (1 - 1e-9))
        return _Floor(floor_s, len(self.long_llm), opts.llm_split == "always")

    def priced(self, m: str, k: int) -> dict[int, float]:
        """Each sample's seconds on one rank (k = 1) or per member of a group of k (GroupCosts.cost)."""
        layouts, price_cache = self.layouts, self.price_cache
        key = (m, k, _holds_bf16(layouts[m], self.pricing[2]))
        if key not in price_cache:
            price_cache[key] = {i: self.exchange.cost(m, self.by_id[i], k, layouts[m]) for i in self.enc_cost[m]}
        return price_cache[key]

    def encoder_floor(self) -> float:
        """Rank-seconds of encoder work per rank under any placement `place` can choose: each sample
        at its cheapest (its cost on one rank, or k members at its price per member of a group of k),
        times the fewest ranks that run one encoder data rank's items (its tp peers run them too).
        The timeline runs every rank's items and its stage's LLM ops one after another, and its step
        is the slowest rank's, so it is at least their mean. 0 where some rank holds no LLM stage."""
        world, layouts = self.world, self.layouts
        if sorted(self.llm.ranks) != list(range(world)):
            return 0.0
        total = 0.0
        for m in self.model.encoders:
            copies = defaultdict(int)
            for r in range(world):
                copies[data_rank(layouts[m], r)] += 1
            cheapest = dict(self.enc_cost[m])
            for _, k in self.schemes[m] if self.exchange.measured else ():
                if k > 1 and self.sp_by_size[m].get(k):  # the sizes `candidates` prices members at
                    for i, member in self.priced(m, k).items():
                        cheapest[i] = min(cheapest[i], k * member)
            total += min(copies.values()) * sum(cheapest.values())
        return total / world

    def prepare_encoder_placement(self) -> None:
        """What `place` weighs that does not depend on the bubbles it starts from, nor (each sample's
        consumer) on the candidate's group size: worked out once for both placements (even,
        bubble-aware) and every candidate (at 131,072 GPUs a sixth of a plan went to them)."""
        llm, model, m_count = self.llm, self.model, self.m_count
        credit = {}
        slots = sum(self.f_stage) + sum(self.b_stage)
        for r in range(self.world):
            # A later stage idles ~s forward slots in warm-up and ~s backward slots in cool-down.
            credit[r] = llm.coord(r, "pp") * slots / max(1, m_count)
        self.credit = credit
        by_id, enc_cost = self.by_id, self.enc_cost
        self.enc_leaders = {m: data_ranks(self.layouts[m]) for m in model.encoders}
        self.enc_pos = {m: {i: sum(by_id[i].encoder_seq_lens(m)) for i in enc_cost[m]} for m in model.encoders}
        self.enc_short_home = {m: {i: self.enc_home[m][self.home[i]] for i in enc_cost[m]} for m in model.encoders}
        self.prefer_cache: dict[tuple[str, str, int], dict[int, int]] = {}
        self.consumer_home: dict[str, dict[int, int]] = {}
        self.candidate_cache: dict[str, Candidates] = {}

    def preferred(self, m: str, scheme: str, k: int) -> dict[int, int]:
        """Each sample's group to keep it on. long_short: by its loader, whose reorder counted it;
        otherwise by its LLM consumer, whose members then hold its outputs (no boundary transfer)."""
        key = (m, "long_short" if scheme == "long_short" else "consumer", k)
        got = self.prefer_cache.get(key)
        if got is None:
            enc_cost = self.enc_cost
            in_group = {r: g for g, grp in enumerate(self.sp_by_size[m].get(k, [])) for r in grp}
            if scheme == "long_short":
                short_home = self.enc_short_home[m]
                got = {i: in_group.get(short_home[i][0], -1) for i in enc_cost[m]}
            else:
                at = self.consumer_home.get(m)
                if at is None:  # each sample's LLM consumer as an encoder data rank, for every k
                    enc = self.layouts[m]
                    at = self.consumer_home[m] = {i: data_rank(enc, self.consumer_rank(i)) for i in enc_cost[m]}
                got = {i: in_group.get(at[i], -1) for i in enc_cost[m]}
            self.prefer_cache[key] = got
        return got

    def candidates(self, m: str) -> Candidates:
        """Every (scheme, group size) placement of encoder m weighed this step, with what they
        share worked out once for both placements (even, bubble-aware)."""
        got = self.candidate_cache.get(m)
        if got is None:
            exchange = self.exchange
            enc, pos = self.layouts[m], self.enc_pos[m]
            alone = self.priced(m, 1) if exchange.measured else None  # priced as the simulator will (long_short.py)
            got = self.candidate_cache[m] = Candidates(self.enc_cost[m], self.enc_leaders[m], self.enc_short_home[m],
                                                       self.due, alone, exchange.fixed(m, 1, enc))
            for scheme, k in self.schemes[m]:
                groups = self.sp_by_size[m].get(k, [])
                member = self.priced(m, k) if exchange.measured and groups else None
                got.add(scheme, groups, lambda i, m=m, k=k, pos=pos: exchange.seconds(m, pos[i], k),
                        self.preferred(m, scheme, k), member, exchange.fixed(m, k, enc))
        return got

    def place(self, bubble: dict[int, float]):
        """Every encoder's placement starting from `bubble` (each rank's idle seconds to fill):
        (assignment, route arguments, each rank's encoder items, notes per encoder, long microbatches per
        encoder, the SP groups chosen)."""
        assignment_enc: dict = {}
        routes: list[tuple] = []
        items: dict[int, list[EncItem]] = {r: [] for r in range(self.world)}
        long_notes: dict = {}
        enc_layout_notes = {}
        chosen_groups: dict[str, list[tuple[int, ...]]] = {}
        for m in self.model.encoders:
            pm, cands, checked = self._chosen_candidate(m, bubble)
            chosen_groups[m] = pm.groups if pm.on_group else []
            mbs, route_mbs, holders, long_mb = self._encoder_microbatches(m, pm, items)
            assignment_enc[m] = mbs
            routes.append((m, self.layouts[m], route_mbs, holders))  # made for the kept placement only
            enc_layout_notes[m] = self._encoder_notes(m, pm, cands, checked, bubble, holders)
            if long_mb:
                long_notes[m] = long_mb
        for r in range(self.world):  # tp peers of an encoder data rank run its work too
            for m in self.model.encoders:
                lay = self.layouts[m]
                lead = data_rank(lay, r)
                if lead != r:
                    items[r] += [it for it in items[lead] if it.module == m]
        return assignment_enc, routes, items, enc_layout_notes, long_notes, chosen_groups

    def _chosen_candidate(self, m: str, bubble: dict[int, float]):
        """(the placement of encoder m kept, every candidate weighed, the checked finish of each by id)."""
        enc, leaders, exchange = self.layouts[m], self.enc_leaders[m], self.exchange
        cands = self.candidates(m).place({r: -bubble[r] for r in leaders})
        checked: dict[int, float] = {}
        if exchange.measured:  # check the estimate's most loaded ranks at the simulator's prices
            start = {r: -bubble[r] for r in leaders}

            def price(ss, k, m=m, enc=enc):
                return exchange.microbatch_seconds(m, ss, k, enc)

            checked = {id(c): checked_finish(c, self.due, start, self.by_id.__getitem__, price) for c in cands}
            pm = choose(cands, lambda c, checked=checked: checked[id(c)])
        else:
            pm = choose(cands)
        return pm, cands, checked

    def _encoder_microbatches(self, m: str, pm, items: dict[int, list[EncItem]]):
        """Encoder m's microbatches per encoder data rank under placement `pm`, their items added to
        `items`: (microbatches, those routed from each rank, each group microbatch's holders, each rank's
        group microbatch indices)."""
        cm, due, exchange, enc_cost = self.cm, self.due, self.exchange, self.enc_cost
        leaders, pos = self.enc_leaders[m], self.enc_pos[m]
        groups = pm.groups
        k = len(groups[0]) if groups else 1
        member_s = self.priced(m, k) if exchange.measured and groups else None
        mbs: dict[int, list[tuple[int, ...]]] = {r: [] for r in leaders}
        route_mbs: dict[int, list[tuple[int, ...]]] = {r: [] for r in leaders}
        holders: dict[tuple[int, int], tuple[int, ...]] = {}
        long_mb: dict[str, list[int]] = {}
        for g, sids in pm.on_group.items():
            grp = groups[g]
            for mb in pack_by_due(sids, due):  # the same index on every member
                share = (sum(member_s[i] for i in mb) if member_s is not None
                         else sum(enc_cost[m][i] for i in mb) / len(grp))
                x = exchange.seconds(m, sum(pos[i] for i in mb), len(grp))
                holders[(grp[0], len(mbs[grp[0]]))] = grp
                for r in grp:
                    long_mb.setdefault(str(r), []).append(len(mbs[r]))
                    mbs[r].append(mb)
                    route_mbs[r].append(mb if r == grp[0] else ())
                    items[r].append(EncItem(m, len(mbs[r]) - 1, due[mb[0]], cm.forward(m, share) + x / 2,
                                            share - cm.forward(m, share) + x / 2, grp))
        for r in leaders:
            for mb in pack_by_due(pm.on_rank[r], due):
                c = sum(enc_cost[m][i] for i in mb)
                mbs[r].append(mb)
                route_mbs[r].append(mb)
                items[r].append(EncItem(m, len(mbs[r]) - 1, due[mb[0]], cm.forward(m, c), c - cm.forward(m, c)))
            if not mbs[r] and m in self.active:  # a dummy forward keeps this rank's gradients defined
                mbs[r].append(())
                route_mbs[r].append(())
                items[r].append(EncItem(m, 0, -1, 0.0, 0.0))
        if self.locked and m in self.active:  # FSDP: every rank makes the same number of encoder calls
            most = max(len(v) for v in mbs.values())
            for r in leaders:
                while len(mbs[r]) < most:
                    items[r].append(EncItem(m, len(mbs[r]), -1, 0.0, 0.0))
                    mbs[r].append(())
                    route_mbs[r].append(())
        return mbs, route_mbs, holders, long_mb

    def _encoder_notes(self, m: str, pm, cands, checked: dict[int, float], bubble: dict[int, float],
                       holders: dict) -> dict:
        """What the plan's notes say of encoder m's placement (long_short)."""
        leaders, pos, enc_cost = self.enc_leaders[m], self.enc_pos[m], self.enc_cost
        groups = pm.groups
        enc_load = {r: pm.loads[r] + bubble[r] for r in leaders}
        return {
            "scheme": pm.scheme,
            # every (scheme, group size) weighed: the additive estimate and, with the simulator's
            # compute model, the check of the most loaded ranks that decided
            "candidates": [{"scheme": c.scheme, "group_size": len(c.groups[0]) if c.groups else 1,
                            "estimated_s": _r(c.finish),
                            **({"checked_s": _r(checked[id(c)])} if id(c) in checked else {})} for c in cands],
            "threshold_s": _r(pm.split.threshold),
            "long_samples": [{"sample": i, "cost_s": _r(enc_cost[m][i]), "group": list(groups[g]),
                              "positions": pos[i]}
                             for g, sids in pm.on_group.items() for i in sids][:64],
            "group_samples": sum(len(v) for v in pm.on_group.values()),
            "group_microbatches": len(holders),
            "short_samples": len(pm.split.short),
            "sp_group_size": len(groups[0]) if groups else 1,
            "encoder_cost_per_rank_s": [_r(enc_load[r]) for r in leaders][:64],
            "max_over_mean": _r(max_over_mean(list(enc_load.values()))),
        }

    def schedule(self) -> None:
        """The schedule: candidates, estimated from this step's costs, the fastest kept."""
        llm, m_count, f_stage, b_stage = self.llm, self.m_count, self.f_stage, self.b_stage
        # Candidates, estimated from this step's costs: encoder work spread evenly and run all ahead
        # of the pipeline (the ablation), and, with the joint pipeline, both an even and a
        # bubble-aware spread (later stages take more) in the joint order. The fastest one is kept:
        # when encoder work dwarfs the bubbles, filling them just in time can stall the stages it
        # lands on, and the step keeps the all-ahead order.
        even = self.place({r: 0.0 for r in range(self.world)})
        phased = joint_timeline(llm, m_count, f_stage, b_stage, even[2], joint=False)
        timeline, chosen, placement = phased, even, "even"
        if self.locked:
            timeline = replace(phased, orders=lockstep_orders(llm, m_count, even[2], list(self.model.encoders)))
        elif self.opts.joint_pipeline:
            cands = [(even, "even"), (self.place(self.credit), "bubble_aware")] if llm.pp > 1 else [(even, "even")]
            for cand, name in cands:
                joint = joint_timeline(llm, m_count, f_stage, b_stage, cand[2], joint=True)
                if joint.step_s < timeline.step_s:
                    timeline, chosen, placement = joint, cand, name
        self.phased, self.timeline, self.chosen, self.placement = phased, timeline, chosen, placement

    def build(self) -> Plan:
        """The Plan of this way of planning the batch: routes, actions and notes."""
        llm, batch, by_id, active = self.llm, self.batch, self.by_id, self.active
        enc_assignment, route_args, items, enc_layout_notes, long_notes, sp_long = self.chosen
        routes: list[Route] = [rt for m, enc, route_mbs, holders in route_args
                               for rt in make_routes(m, batch, llm, self.llm_mbs, enc, route_mbs, holders,
                                                     self.llm_leader)]
        self.assignment.update(enc_assignment)
        index = BoundaryIndex(routes, llm, self.llm_leader)
        actions = to_actions(llm, self.timeline.orders, index, active)
        for r in actions:
            actions[r] += step_tail(["llm", *active])
        actions = align_sends(actions)
        meta = self.planner._metadata_actions(self.loader_spec, llm, self.loading, by_id)
        for r in actions:
            actions[r] = meta[r] + actions[r]
        tokens = llm_tokens_of(batch)
        llm_tokens = [round(sum(tokens[i] / self.llm_share.get(i, 1) for mb in mbs for i in mb))
                      for mbs in self.llm_mbs]
        llm_groups_all, long_llm_mbs = self._long_llm_groups()
        self.notes["llm_long_short"] = self._llm_long_short_notes()
        self._step_notes(routes, meta, enc_layout_notes, sp_long, llm_tokens)
        model, layouts, opts = self.model, self.layouts, self.opts
        plan = Plan(
            system=self.planner.name, step=batch.step, world_size=self.world, model=model.name,
            samples=list(self.samples), layouts=layouts, assignment=self.assignment, routes=routes, actions=actions,
            options={"microbatches": self.m_count,
                     "encoder_tp": layouts[next(iter(model.encoders))].tp if model.encoders else 1,
                     **opts.to_dict(),
                     "long_short": self._long_short_options(sp_long, long_notes, llm_groups_all, long_llm_mbs)},
            notes=self.notes,
        )
        return finish(plan, self.parallel, order=True)  # align_sends reorders sends: their order per pair checked too

    def _long_llm_groups(self) -> tuple[list, dict]:
        """(the LLM's long-sample groups this step uses, each member's long microbatch indices)."""
        llm, k_llm, on_llm_group = self.llm, self.k_llm, self.on_llm_group
        llm_groups_all = llm_groups(llm, k_llm) if k_llm > 1 and self.long_llm else []  # no communicators unused
        long_llm_mbs = {}
        for grp in llm_groups_all:  # every stage's members run the long microbatches
            d0 = llm.coord(grp[0], "dp")
            slots = list(range(len(on_llm_group[d0 // k_llm]))) if on_llm_group else []
            if slots:
                for r in grp:
                    long_llm_mbs[str(r)] = slots
        return llm_groups_all, long_llm_mbs

    def _llm_long_short_notes(self) -> dict:
        """What the plan's notes say of the LLM's long samples."""
        llm, k_llm, by_id = self.llm, self.k_llm, self.by_id
        return {
            "enabled": self.opts.llm_long_short, "group_size": k_llm, **({"why_not": self.k_why} if self.k_why else {}),
            **({"attention": self.llm_kind} if k_llm > 1 else {}),
            "threshold_s": _r(self.llm_split.threshold),
            "long_samples": [{"sample": i, "llm_tokens": by_id[i].llm_tokens, "cost_s": _r(self.llm_cost[i]),
                              "group": [llm.rank_at(pp=0, dp=g * k_llm + c, cp=0, tp=0) for c in range(k_llm)]}
                             for g, sids in enumerate(self.on_llm_group) for i in sids][:64],
            "short_samples": len(self.short_ids), "microbatches_per_rank": self.m_count,
        }

    def _step_notes(self, routes: list[Route], meta: dict, enc_layout_notes: dict, sp_long: dict,
                    llm_tokens: list[int]) -> None:
        """What the step decided, into the plan's notes: placement, encoder long-short, reorder, reshard,
        schedule, and which techniques changed anything."""
        opts, dp, locked, timeline = self.opts, self.dp, self.locked, self.timeline
        before, after = self.before, self.after
        moved = [rt for rt in routes if rt.src_rank != rt.dst_rank]
        reshard_moves = sum(1 for i in self.ids if self.consumer[i] != self.home[i])
        self.notes.update({
            "placement": placement_notes(self.layouts, self.parallel, sp_long),
            "long_short": enc_layout_notes,
            "reorder": {
                "enabled": opts.reorder, "group_size": min(opts.reorder_group, dp),
                "objective": "short encoder cost" if opts.reshard else "short encoder + LLM cost",
                "loader_cost_before_s": [_r(x) for x in before][:64],
                "loader_cost_after_s": [_r(x) for x in after][:64],
                "max_over_mean_before": _r(max_over_mean(before)), "max_over_mean_after": _r(max_over_mean(after)),
                "groups": copy.deepcopy(self.traffic[:16]),  # the batch's plans share `traffic` (_per_batch)
                "metadata_bytes_per_loader": {a.what: a.nbytes for a in meta[0]},
            },
            "reshard": {
                "enabled": opts.reshard, "samples_moved_off_loader": reshard_moves,
                "llm_tokens_per_data_rank": llm_tokens[:64],
                "tokens_max_over_mean": _r(max_over_mean(llm_tokens)),
                "boundary_routes_cross_rank": len(moved), "boundary_tokens_moved": sum(rt.tokens for rt in moved),
            },
            "schedule": {
                "joint_pipeline": opts.joint_pipeline and not locked,
                **({"why_not_joint": f"encoder_dp={opts.encoder_dp}: FSDP locks every rank's encoder calls together"}
                   if locked and opts.joint_pipeline else {}),
                "order": "lockstep" if locked else "joint" if timeline is not self.phased else "all_ahead",
                "encoder_placement": self.placement,
                "estimated_step_s": _r(timeline.step_s),
                "estimated_step_all_ahead_s": _r(self.phased.step_s),
                "encoder_actions_by_phase": {str(r): timeline.placed[r] for r in sorted(timeline.placed)[:16]},
            },
        })
        # Which techniques changed anything this step (a switch can be on and find nothing to do).
        in_bubbles = sum(v["warmup"] + v["cooldown"] for v in timeline.placed.values())
        self.notes["acted"] = {
            "reorder": bool(opts.reorder and _r(max_over_mean(after)) < _r(max_over_mean(before))),
            "reshard": bool(opts.reshard and reshard_moves),
            "long_short_sp": {m: len(v["long_samples"]) for m, v in enc_layout_notes.items() if v["long_samples"]},
            "llm_long_short": len(self.long_llm),
            "joint_pipeline": bool(not locked and timeline is not self.phased and in_bubbles),
        }

    def _long_short_options(self, sp_long: dict, long_notes: dict, llm_groups_all: list, long_llm_mbs: dict) -> dict:
        """The plan's `long_short` options: the group pool, this step's groups and long microbatches, and
        the LLM long samples' leaders."""
        llm_leader = self.llm_leader
        return {"pool": self.planner._group_pool(self.model, self.parallel, self.layouts, self.sp_by_size, self.opts),
                "groups": {**{m: [list(g) for g in gs] for m, gs in sp_long.items() if gs},
                           **({"llm": [list(g) for g in llm_groups_all]} if llm_groups_all else {})},
                "long_microbatches": {**long_notes, **({"llm": long_llm_mbs} if long_llm_mbs else {})},
                **({"llm_leaders": {str(i): r for i, r in llm_leader.items()},
                    "llm_data_ranks": self.k_llm, "llm_cp_kind": self.llm_kind} if llm_leader else {})}

"""The search itself (`_Search`): one tune's pruned, ordered space and what it has simulated and
learned; simulations in waves with their recompute retries, the LLM-layout phase by levels with the
correction it learns, the encoder knobs' descent, the neighbour descent, and an answer's check on
other steps (`_Search.guard`, which `_guarded` runs); the ParallelSpec fields a tune's arguments
give every layout (`_dp_fields`)."""

from __future__ import annotations

import math
from dataclasses import replace

from omnibench.plan import PlanError
from omnibench.specs.model import SpecError
from omnibench.tune.budget import DESCENT_ROUNDS, WAVE, WINDOW_CONTENDERS, WINDOW_MARGIN
from omnibench.tune.estimates import _train_flops, memory_estimate, time_estimate
from omnibench.tune.results import Trial
from omnibench.tune.seeds import Prior
from omnibench.tune.space import (
    CP_KINDS_SEARCHED,
    NEIGHBOUR_DP_MODES,
    Candidate,
    encoder_variants,
    llm_key,
    mode_key,
    modes_of,
    neighbour_layouts,
    recomputed_modules,
)


class _Search:
    """One tune's state: the pruned, ordered space, what has been simulated, what was learned."""

    def __init__(self, system, model, batches, cluster, profile, options, sweep, use_cache, log, known,
                 prior: Prior | None = None, stack: str = "eager", dp_fields: dict | None = None,
                 memory_error: float = 0.0, cp_kinds: tuple[str, ...] = CP_KINDS_SEARCHED):
        self.system, self.model, self.batches, self.cluster = system, model, batches, cluster
        self.stack, self.dp_fields, self.memory_error = stack, dict(dp_fields or {}), memory_error
        self.cp_kinds = tuple(cp_kinds)  # the context-parallel kinds the space holds: the descents keep to them
        self.mixed_precision = self.dp_fields.get("mixed_precision", "autocast")
        self.frozen = tuple(self.dp_fields.get("freeze", ()))  # every layout tried trains the same modules
        self.profile, self.options, self.sweep, self.use_cache, self.log = profile, options, sweep, use_cache, log
        self.world, self.gpn = cluster.num_gpus, cluster.gpus_per_node
        # what an estimate may reach: with the estimates assumed `memory_error` off (SimOptions), the
        # analytic bound is held to the same margin the simulator's verdict applies
        self.capacity = cluster.gpu.memory_bytes / (1.0 + memory_error)
        # the analytic estimates read the first batch (the batch's own list: their memos key by its identity)
        self.per_batch = batches[0].samples
        # the recompute choices of every batch tuned on (an encoder with work in any of them is one)
        self.modules = recomputed_modules(model, self.frozen, [s for b in batches for s in b.samples])
        self.modes = modes_of(self.modules)
        self.done: dict[Candidate, Trial] = {}
        # Learned while searching: per recompute mode, the smallest ratio of simulated peak memory to
        # the analytic bound seen so far. A layout whose bound times that ratio is over the device is
        # not simulated in that mode (the bound alone is loose: it misses the imbalance of a step).
        self.ratio: dict[str, float] = {}
        self._bound: dict[Candidate, float] = {}
        self._time: dict[Candidate, float] = {}
        if prior is not None:
            self.ratio.update(prior.ratio)
        for c, tr in (known or {}).items():  # a re-run (twice the budget) starts from what is known
            self._record(c, tr)

    def over(self, batches: list) -> _Search:
        """A fresh search with this one's settings (no log, nothing known) on `batches`."""
        return _Search(self.system, self.model, list(batches), self.cluster, self.profile, self.options, self.sweep,
                       self.use_cache, None, None, stack=self.stack, dp_fields=self.dp_fields,
                       memory_error=self.memory_error, cp_kinds=self.cp_kinds)

    # -- analytic side
    def bound(self, c: Candidate) -> float:
        if c not in self._bound:
            from simulator.memory import MEMORY_OF_STACK

            self._bound[c] = memory_estimate(self.system, self.model, self.world, self.gpn, c, self.per_batch,
                                             options=self.options,
                                             memory_stack=MEMORY_OF_STACK.get(self.stack, "eager"),
                                             device=self.cluster.gpu.name, mixed_precision=self.mixed_precision,
                                             frozen=",".join(self.frozen))
        return self._bound[c]

    def searched_mode(self, mode: str) -> str | None:
        """The mode of this search's space that recomputes what `mode` does (None: no such mode)."""
        key = mode_key(mode, self.modules)
        return next((m for m in self.modes if mode_key(m, self.modules) == key), None)

    def flops_rank(self, mode: str) -> float:
        return _train_flops(self.model, self.per_batch, mode, ",".join(self.frozen))

    def settle(self, c: Candidate) -> tuple[Trial | None, str]:
        """The fastest recompute mode (least recomputed FLOPs) whose analytic memory fits; else None
        and why ("memory", or the layout rule it breaks)."""
        for mode in sorted(self.modes, key=lambda m: (self.flops_rank(m), self.modes.index(m))):
            cand = replace(c, recompute=mode)
            try:
                cand.parallel(self.world, self.gpn).validate(self.model)
                est = self.bound(cand)
            except (SpecError, PlanError, ValueError) as e:
                return None, f"{cand.label()}: {str(e).splitlines()[0]}"
            if est <= self.capacity:
                return Trial(cand, estimate_gib=est / 2**30, estimate_s=self.time(cand)), ""
        return None, "memory"

    def time(self, c: Candidate) -> float:
        if c not in self._time:
            self._time[c] = time_estimate(self.system, self.model, self.world, self.gpn, c, self.per_batch,
                                          self.cluster, options=self.options, frozen=",".join(self.frozen))
        return self._time[c]

    def next_recompute(self, c: Candidate) -> Candidate | None:
        """The fastest mode that holds less memory than `c`'s (the bound strictly falls: retries end)."""
        here = self.bound(c)
        less = [m for m in self.modes if m != c.recompute and self.bound(replace(c, recompute=m)) < here]
        if not less:
            return None
        return replace(c, recompute=min(less, key=lambda m: (self.flops_rank(m), self.modes.index(m))))

    # -- simulated side
    def _record(self, c: Candidate, tr: Trial) -> None:
        self.done[c] = tr
        est = tr.estimate_gib * 2**30
        if tr.simulated and est > 0:
            self.ratio[c.recompute] = min(self.ratio.get(c.recompute, math.inf), tr.peak_gib * 2**30 / est)

    def _skip_to(self, c: Candidate) -> Candidate:
        """Past the modes the learned ratio says cannot fit (as long as a mode holding less exists)."""
        while c not in self.done:
            nxt = self.next_recompute(c)
            if nxt is None or self.bound(c) * self.ratio.get(c.recompute, 1.0) <= self.capacity:
                break
            c = nxt
        return c

    def _job(self, c: Candidate, batch):
        """`c` on `batch` as the simulate command runs a kept layout's step (same key in the step cache)."""
        from simulator.cache import StepJob, pack
        from simulator.engine import SimOptions

        parallel = replace(c.parallel(self.world, self.gpn, self.options), **self.fields_for(c))
        return StepJob(self.system, self.model, parallel, pack(batch), self.cluster, self.profile,
                       SimOptions(recompute=c.recompute, stack=self.stack, memory_error=self.memory_error,
                                  mixed_precision=parallel.mixed_precision),
                       use_cache=self.use_cache)

    def fields_for(self, c: Candidate) -> dict:
        """The tune's own ParallelSpec fields for `c`: a layout that names its data-parallel mode keeps it."""
        if not c.dp_mode:
            return self.dp_fields
        return {k: v for k, v in self.dp_fields.items() if k not in ("fsdp", "zero", "dp_shard")}

    def _evaluate(self, wave: list[Candidate]) -> list[Trial]:
        from simulator.cache import run_step

        outs = self.sweep.map(run_step, [self._job(c, b) for c in wave for b in self.batches])
        trials = []
        k = len(self.batches)
        for i, c in enumerate(wave):
            tr = Trial(c, estimate_gib=self.bound(c) / 2**30, estimate_s=self.time(c))
            mine = outs[i * k:(i + 1) * k]
            bad = next((o for o in mine if o.error), None)
            if bad is not None:  # a planner refusing a layout (e.g. interleaving not planned)
                tr.note = bad.error
                trials.append(tr)
                continue
            t = sum(o.result.step_time for o in mine)
            tokens = sum(o.result.tokens for o in mine)
            flops = sum(o.result.model_flops for o in mine)
            tr.simulated = True
            tr.step_s = t / k
            tr.tokens_per_s_per_gpu = tokens / t / self.world if t else 0.0
            tr.mfu = flops / t / self.world / self.cluster.gpu.peak_flops if t else 0.0
            tr.peak_gib = max(o.result.peak_needed for o in mine) / 2**30
            tr.fits = all(o.result.fits for o in mine)
            if not tr.fits:
                tr.note = next(o.result.fit_message for o in mine if not o.result.fits)
            trials.append(tr)
        return trials

    def wave(self, cands: list[Candidate]) -> list[Candidate]:
        """Simulate `cands` together (each past the modes the ratio rules out); answer the retries: the
        next recompute mode of each layout the simulator found too big (its estimate is the final
        word). What a wave decides uses only what earlier waves learned."""
        wave: list[Candidate] = []
        for c in cands:
            try:
                c = self._skip_to(c)
                self.bound(c)
            except (SpecError, PlanError, ValueError):
                continue  # a layout its system's rules refuse (noncolocated's encoder split): no trial
            if c not in self.done and c not in wave:
                wave.append(c)
        retries = []
        for c, tr in zip(wave, self._evaluate(wave) if wave else [], strict=True):
            self._record(c, tr)
            if self.log:
                self.log(tr)
            try:
                nxt = self.next_recompute(c)
            except (SpecError, PlanError, ValueError):
                nxt = None
            if tr.simulated and not tr.fits and nxt is not None:
                retries.append(nxt)
        return retries

    def run(self, pending: list[Candidate]) -> None:
        """Simulate `pending` in waves of WAVE, each layout's retries in the wave after its own."""
        pending = list(pending)
        while pending:
            pending = self.wave(pending[:WAVE]) + pending[WAVE:]

    # -- the LLM-layout phase: which layouts, in which order
    @staticmethod
    def levels(c: Candidate) -> dict[str, tuple]:
        """The dimensions whose levels change a layout's shape of work: pipeline depth, and the
        tensor x context x expert split of a stage (and how its context split attends)."""
        return {"pp": (c.pp,), "split": (c.tp, c.cp, c.ep, c.cp_kind if c.cp > 1 else "")}

    # a layout of the pruned space as it was enumerated (space.llm_key: the results and seeds use it too)
    llm_key = staticmethod(llm_key)

    def correction(self):
        """What the analytic time misses, learned from every simulated layout: log(simulated /
        analytic) = mean + an effect per pipeline level + an effect per split level (fitted by
        backfitting; a level not simulated yet has no effect). The analytic time knows neither each
        system's balancing nor what omni's joint pipeline hides, so its errors follow these levels."""
        obs = [(self.levels(tr.candidate), math.log(tr.step_s / tr.estimate_s)) for tr in self.done.values()
               if tr.simulated and tr.step_s > 0 and tr.estimate_s > 0]
        if not obs:
            return lambda c: 1.0
        mean = sum(y for _, y in obs) / len(obs)
        effect: dict[str, dict] = {"pp": {}, "split": {}}
        for _ in range(10):
            for dim in effect:
                other = next(d for d in effect if d != dim)
                acc: dict[tuple, list[float]] = {}
                for lv, y in obs:
                    acc.setdefault(lv[dim], []).append(y - mean - effect[other].get(lv[other], 0.0))
                effect[dim] = {k: sum(v) / len(v) for k, v in acc.items()}

        def factor(c: Candidate) -> float:
            lv = self.levels(c)
            return math.exp(mean + sum(effect[d].get(lv[d], 0.0) for d in effect))
        return factor

    def llm_phase(self, keep: list[Trial], budget: int, first: list[Candidate]) -> None:
        """Simulate `budget` layouts of `keep` (the pruned space with each layout's settled mode and
        analytic time, in analytic order), `first` in the first wave; then retries until none is
        left. The first wave is the analytically fastest layout, then the fastest of each level not
        yet in the wave, pipeline depths and tp x cp splits in turn; each later wave takes the
        layouts whose analytic time, times the correction learned so far, is smallest. A layout its
        planner refuses (interleaving in a system that does not interleave) costs no budget. The
        choice depends only on the trials so far (never on timing), so the search is the same for
        any worker count."""
        est = {self.llm_key(tr.candidate): tr for tr in keep}
        tried = {self.llm_key(c) for c in self.done} & set(est)
        refused = {k for k in tried if self._refused(k)}
        retries: list[Candidate] = []
        while True:
            room = min(WAVE - len(retries), budget - len(tried - refused))
            picks: list[Candidate] = []
            if room > 0:
                dead = self._refused_levels(tried, refused)
                todo = [k for k in est if k not in tried and k.virtual_stages not in dead]
                if not tried:
                    picks = [c for c in first if self.llm_key(c) in est][:room]
                    picks += [est[k].candidate for k in todo[:1] if est[k].candidate not in picks][:room - len(picks)]
                    for k in self._level_leaders(todo, picks):
                        if len(picks) < room:
                            picks.append(est[k].candidate)
                factor = self.correction()
                for k in sorted(todo, key=lambda k: (est[k].estimate_s * factor(k), k.label())):
                    if len(picks) >= room:
                        break
                    if est[k].candidate not in picks:
                        picks.append(est[k].candidate)
            if not picks and not retries:
                return
            tried |= {self.llm_key(c) for c in picks} & set(est)
            retries = self.wave(retries + picks)
            refused |= {self.llm_key(c) for c in picks if self._refused(self.llm_key(c))}

    @staticmethod
    def _refused_levels(tried: set, refused: set) -> set[int]:
        """Virtual-stage counts > 1 tried and refused every time (a planner that does not interleave):
        the rest of them would be refused too."""
        out = set()
        for v in {k.virtual_stages for k in refused if k.virtual_stages > 1}:
            if all(k in refused for k in tried if k.virtual_stages == v):
                out.add(v)
        return out

    def _refused(self, key: Candidate) -> bool:
        """Did the planner refuse this layout (in whatever recompute mode it was tried)?"""
        return any(self.llm_key(c) == key and not tr.simulated and tr.note for c, tr in self.done.items())

    def _level_leaders(self, ordered: list[Candidate], picked: list[Candidate]) -> list[Candidate]:
        """The first layout of `ordered` at each level no layout of `picked` has, pipeline depths
        and splits alternating."""
        leaders: dict[str, list[Candidate]] = {"pp": [], "split": []}
        for dim, out in leaders.items():
            seen = {self.levels(c)[dim] for c in picked}
            for k in ordered:
                if self.levels(k)[dim] not in seen:
                    seen.add(self.levels(k)[dim])
                    out.append(k)
        mixed: list[Candidate] = []
        for i in range(max(len(v) for v in leaders.values())):
            mixed += [v[i] for v in leaders.values() if i < len(v) and v[i] not in mixed]
        return mixed

    def neighbour_descent(self, base: Trial, notes: list[str]) -> Trial:
        """From `base`, the layouts one change away (`neighbour_layouts`; data-parallel modes only where the
        user fixed none), then the same around the fastest of them, until none is faster (at most
        DESCENT_ROUNDS rounds): a search by levels and waves can stop one change short of a faster layout
        (another recompute split, the other cp kind, ZeRO-1 for FSDP)."""
        cur = base
        dp_modes = NEIGHBOUR_DP_MODES if not {"fsdp", "zero"} & set(self.dp_fields) else ()
        for _ in range(DESCENT_ROUNDS):
            around = neighbour_layouts(cur.candidate, self.model, self.world, self.gpn, self.modes, self.options,
                                       dp_modes)
            variants = []
            for var in around:
                if var in self.done or (var.cp > 1 and var.cp_kind not in self.cp_kinds):
                    continue
                try:
                    var.parallel(self.world, self.gpn).validate(self.model)
                    self.bound(var)
                except (SpecError, PlanError, ValueError):
                    continue  # outside the system's rules: not a layout it can take
                variants.append(var)
            self.run(variants)
            near = [self.final(v) for v in around if v in self.done]
            better = sorted((t for t in near if t.fits and t.step_s < cur.step_s),
                            key=lambda t: (t.step_s, t.candidate.label()))
            if not better:
                return cur
            cur = better[0]
        notes.append(f"neighbour descent stopped after {DESCENT_ROUNDS} rounds at {cur.candidate.label()}")
        return cur

    def encoder_descent(self, base: Trial, notes: list[str]) -> None:
        """Around `base`, each encoder knob changed alone (`encoder_variants`), then the same around
        the fastest of them, until none is faster: the knobs interact (noncolocated's encoder share
        and encoder tp), so one round around the LLM layout stops short."""
        cur = base
        while True:
            variants = []
            for var in encoder_variants(self.system, self.model, self.world, cur.candidate, self.gpn, self.options):
                if var in self.done:
                    continue
                try:
                    var.parallel(self.world, self.gpn).validate(self.model)
                    self.bound(var)  # its system's own rules (noncolocated: encoder tp divides its ranks)
                except ValueError as e:
                    notes.append(f"{var.label()}: {str(e).splitlines()[0]}")
                    continue
                variants.append(var)
            self.run(variants)
            tried = [self.final(v) for v in variants]
            better = sorted((t for t in tried if t.fits and t.step_s < cur.step_s),
                            key=lambda t: (t.step_s, t.candidate.label()))
            if not better:
                return
            cur = better[0]

    def final(self, c: Candidate) -> Trial:
        """`c`'s trial after its recompute retries and ratio skips (the mode it ended at)."""
        while True:
            tr, nxt = self.done.get(c), self.next_recompute(c)
            if nxt is None or (tr is not None and not (tr.simulated and not tr.fits)):
                return tr or Trial(c)
            c = nxt

    def guard(self, trials: list[Trial], tuned: int = 1) -> tuple[Trial | None, list[tuple[str, int]], object, int]:
        """The first fitting trial of `trials` (fastest first, as a search returns them) that also runs
        every batch of this search (the window's steps the search was not tuned on), with the fits
        check the simulator applies; each one ruled out before it is marked (fits False, `guard_step`,
        the note says why) and listed as (label, the first step it could not run of those simulated
        for it). Also answers the batch that ruled out the fastest (where it needed the most memory;
        a planner's refusal first) and the step simulations run. The batch where a ruled-out layout
        needed the most is simulated first for each layout after it, alone: the burst that broke one
        layout usually breaks the next, which then costs one step, not the window. The survivor's
        `window_s` is its mean step over the whole window (its `tuned` steps' mean kept from the search)."""
        from simulator.cache import run_step

        killers: list[int] = []  # indices into self.batches
        ruled_out: list[tuple[str, int]] = []
        worst, runs = None, 0
        for tr in trials:
            if not tr.fits:
                continue
            failed, seconds = [], 0.0
            for group in (list(killers), [i for i in range(len(self.batches)) if i not in killers]):
                if not group:
                    continue
                outs = self.sweep.map(run_step, [self._job(tr.candidate, self.batches[i]) for i in group])
                runs += len(group)
                failed = [(i, o) for i, o in zip(group, outs, strict=True) if o.error or not o.result.fits]
                if failed:
                    break
                seconds += sum(o.result.step_time for o in outs)
            if not failed:
                tr.window_s = self._window_mean(tr, tuned, seconds)
                return tr, ruled_out, worst, runs
            ruled_out.append(self._rule_out(tr, *min(failed, key=lambda f: self.batches[f[0]].step)))
            burst, _ = max(failed, key=lambda f: (bool(f[1].error), f[1].result.peak_needed if f[1].result else 0.0))
            if burst not in killers:
                killers.append(burst)
            worst = self.batches[burst] if worst is None else worst
        return None, ruled_out, worst, runs

    def contend(self, survivor: Trial, trials: list[Trial], tuned: int,
                seeds: list[Trial] = ()) -> tuple[int, list[tuple[str, int]]]:
        """The window decides between the guard's `survivor`, the layouts the search timed within
        WINDOW_MARGIN of it on its `tuned` steps (at most WINDOW_CONTENDERS, fastest first) and every
        fitting one of `seeds` (so the answer is never slower over the window than a seed): each runs
        every batch of this search, and `window_s` (its mean step over the whole window) ranks them
        (`TuneResult.best`). A few regime steps are a proxy for a window: a layout slower on them can be
        faster over the window (a drifting mix changes which microbatch count pays). A contender that
        cannot run a step is marked as the guard marks a layout it rules out. Answers the simulations
        and the contenders ruled out, as (label, the first step it could not run)."""
        from simulator.cache import run_step

        # a layout that steps exactly as one already in (an encoder knob with no effect here) is not another
        seen = {(survivor.step_s, survivor.peak_gib)}
        near = []
        for t in sorted((t for t in trials if t is not survivor and t.fits and t.simulated
                         and t.step_s <= survivor.step_s * (1 + WINDOW_MARGIN)),
                        key=lambda t: (t.step_s, t.candidate.label())):
            if len(near) < WINDOW_CONTENDERS and (t.step_s, t.peak_gib) not in seen:
                seen.add((t.step_s, t.peak_gib))
                near.append(t)
        near += [t for t in seeds if t is not survivor and t not in near and t.fits and t.simulated]
        if not near or not self.batches:
            return 0, []
        k = len(self.batches)
        outs = self.sweep.map(run_step, [self._job(t.candidate, b) for t in near for b in self.batches])
        ruled_out = []
        for i, t in enumerate(near):
            mine = outs[i * k:(i + 1) * k]
            bad = next(((j, o) for j, o in enumerate(mine) if o.error or not o.result.fits), None)
            if bad is not None:
                ruled_out.append(self._rule_out(t, *bad))
            else:
                t.window_s = self._window_mean(t, tuned, sum(o.result.step_time for o in mine))
        return len(near) * k, ruled_out

    def _rule_out(self, t: Trial, index: int, outcome) -> tuple[str, int]:
        """Mark `t` as unable to run this search's batch `index` (`outcome` says why); its (label, step)."""
        t.fits, t.guard_step = False, self.batches[index].step
        t.note = f"step {t.guard_step}: {outcome.error or outcome.result.fit_message}"
        return t.candidate.label(), t.guard_step

    def _window_mean(self, t: Trial, tuned: int, seconds: float) -> float:
        """`t`'s mean step over the whole window: its `tuned` steps (`step_s`) and this search's batches,
        which took `seconds` in all."""
        return (t.step_s * tuned + seconds) / (tuned + len(self.batches))


def _dp_fields(dp_mode: str | None, mixed_precision: str = "autocast", freeze: tuple[str, ...] = ()) -> dict:
    """The ParallelSpec fields every simulated layout takes from the tune's arguments."""
    from omnibench.specs.parallel import dp_mode_fields
    from omnibench.specs.run import MIXED_PRECISION

    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}; got {mixed_precision!r}")
    out = dp_mode_fields(dp_mode) if dp_mode is not None else {}
    if mixed_precision != "autocast":
        out["mixed_precision"] = mixed_precision
    if freeze:
        out["freeze"] = tuple(freeze)
    return out

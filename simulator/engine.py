"""The engine: executes one Plan with costs, one process per *distinct* rank.

The Engine is put together from one file per idea:
- `simulator/work.py`: the work of each action (microbatch signature -> `Work` under the layout);
- `simulator/groups.py`: rank groups and the colour refinement that collapses identical ranks;
- `simulator/program.py`: a rank's actions as timed ops on its compute, collective and p2p streams,
  with the intra-module communication each compute action implies;
- `simulator/memory.py`: static training state and the activation timeline per rank;
- `simulator/result.py`: spans, per-class statistics and the step's metrics;
- this file: the discrete-event run that plays every class's program against the others (its
  simpy predecessor, `simulator/engine_simpy.py`, is kept as the reference it is tested against).

A collective completes when all its distinct participants have arrived; a recv completes when the
matching send's transfer has (the send starts once the recv is posted).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import time
from collections import defaultdict, deque
from dataclasses import replace

from omnibench.plan import (
    BACKWARD,
    BOUNDARY,
    FORWARD,
    GRAD_SYNC,
    METADATA,
    OPTIMIZER_STEP,
    RECV,
    SEND,
    Plan,
)
from omnibench.specs import costs
from omnibench.specs.model import MultimodalSpec
from simulator.collectives import CollectiveModel
from simulator.compute import ComputeModel
from simulator.flops import lengths_train_flops
from simulator.groups import GroupsMixin, LayoutIndex
from simulator.hardware import ClusterSpec, GiB
from simulator.memory import RESERVED_BYTES, MemoryMixin
from simulator.options import SimOptions, SimulationError
from simulator.planning import charge_planning
from simulator.program import PARAM_GATHER, ProgramMixin
from simulator.result import RankStats, SimResult, Span
from simulator.work import WorkMixin
from systems import cyclic_gc_paused

__all__ = ["RESERVED_BYTES", "Engine", "RankStats", "SimOptions", "SimResult", "SimulationError", "Span", "simulate"]


def _gc_paused(f):
    """`f` run with the cyclic GC paused (`systems.cyclic_gc_paused`)."""

    @functools.wraps(f)
    def paused(*args, **kwargs):
        with cyclic_gc_paused():
            return f(*args, **kwargs)

    return paused


class Engine(WorkMixin, GroupsMixin, ProgramMixin, MemoryMixin):
    @_gc_paused
    def __init__(self, plan: Plan, model: MultimodalSpec, cluster: ClusterSpec,
                 compute: ComputeModel | None = None, collectives: CollectiveModel | None = None,
                 options: SimOptions = SimOptions()):
        if cluster.num_gpus and plan.world_size > cluster.num_gpus:
            raise SimulationError(f"plan needs {plan.world_size} ranks; cluster has {cluster.num_gpus} GPUs")
        self.plan, self.model, self.cluster = plan, model, cluster
        self.compute = compute or ComputeModel(cluster)
        self.coll = collectives or CollectiveModel(cluster)
        self.coll_inline = self.coll.inline_model()  # FSDP/TP/CP/EP communication inside compute
        recompute = options.recompute if options.recompute != "none" else plan.options.get("recompute", "none")
        try:
            self.policy = costs.recompute_policy(recompute)  # per module
        except ValueError as e:
            raise SimulationError(str(e)) from None
        self.recompute = recompute
        from simulator.kernels import STACK_KINDS

        if options.stack not in STACK_KINDS:
            raise SimulationError(f"stack must be one of {', '.join(STACK_KINDS)}; got {options.stack!r}")
        self.options = options
        self.index = {m: LayoutIndex(lay) for m, lay in plan.layouts.items()}
        self._work_cache: dict = {}
        self._gathered: set = set()
        self._gathered_ranks: set[int] = set()  # ranks whose step has had its first gathering action
        self._member_cache: dict = {}
        self._loader_groups: dict[tuple, tuple[int, ...]] = {}
        self._edp_cache: dict = {}
        self._sp_group_of: dict[str, dict[int, tuple[int, ...]]] = {}
        self._member_ids: dict = {}
        self._sig_cache: dict = {}
        self._data_rank_cache: dict = {}
        self._params_cache: dict[tuple, object] = {}
        self._dp_modes: dict[str, dict[int, tuple[str, int]]] = {}
        self._dtypes_of: dict[tuple[str, str], object] = {}
        self._sample_inputs: dict[int, int] = {}  # sample id -> its raw input elements (work.py)
        self._static_of: dict[tuple, float] = {}  # a rank's static memory by what decides it (memory.py)
        self._boundary_of: dict[int, list[int]] = {}  # rank -> its boundary messages' tokens (groups.py `classes`)
        self._rank_data_of: dict[str, dict] = {}  # module -> rank -> its microbatches' data (work.py `_rank_data`)
        self._sig_intern: dict[tuple, tuple] = {}
        self._grad_tables: dict[str, dict[int, tuple[int, ...]]] = {}
        self._lock_of: dict[str, dict[int, tuple[int, ...] | None]] = {}
        self._long_mbs: dict[str, dict[int, set[int]]] = {}
        self.message_tokens: dict[tuple, int] = defaultdict(int)
        for r in plan.routes:
            self.message_tokens[(r.module, r.src_rank, r.src_microbatch, r.dst_rank, r.dst_microbatch)] += r.tokens
        # what `peak_needed` builds before any play, kept for a `run` of the same engine (`offer_engine`):
        # the classes, each class's program and its memory figures, and the seconds they took
        self._reps: tuple[dict[int, int], list[int], dict[int, int]] | None = None
        self._programs: dict[int, list] = {}
        self._memory_stats: dict[int, RankStats] = {}
        self._built_s = 0.0
        self.default_costs = compute is None and collectives is None

    def _memo(self, key: tuple, compute, *args):
        """compute(self, *args), worked out once per run under `key`."""
        got = self._params_cache.get(key)
        if got is None:
            got = self._params_cache[key] = compute(self, *args)
        return got

    def _module_params_on_rank(self, m: str, rank: int) -> float:
        # asked for by every compute op (weight copies, gradients) and the rank's static memory
        return self._memo((m, rank), MemoryMixin._module_params_on_rank, m, rank)

    # The memory model's conventions and per-rank lookups are fixed for a run (its options, kernel
    # profile and plan), yet asked for several times by every compute op: worked out once here
    # (simulator/memory.py computes them; a quarter of a 16,384-GPU step's programs went to them).
    memory_stack = functools.cached_property(MemoryMixin.memory_stack.fget)
    _memory_base = functools.cached_property(MemoryMixin._memory_base.fget)
    _state_stack = functools.cached_property(MemoryMixin._state_stack.fget)
    activation_stack = functools.cached_property(MemoryMixin.activation_stack.fget)

    def _dp_mode(self, module: str, rank: int) -> tuple[str, int]:
        # asked ~30 times per compute op: a table per module, keyed by the rank alone
        table = self._dp_modes.get(module)
        if table is None:
            table = self._dp_modes[module] = {}
        got = table.get(rank)
        if got is None:
            got = table[rank] = MemoryMixin._dp_mode(self, module, rank)
        return got

    def _dtypes(self, module: str, rank: int):
        # a function of the module and its data-parallel mode on the rank (and the run's stack)
        key = (module, self._dp_mode(module, rank)[0])
        got = self._dtypes_of.get(key)
        if got is None:
            got = self._dtypes_of[key] = MemoryMixin._dtypes(self, module, rank)
        return got

    def _model_parallel_params(self, module: str, rank: int) -> tuple[float, float]:
        return self._memo(("mp-params", module, rank), MemoryMixin._model_parallel_params, module, rank)

    @_gc_paused
    def run(self) -> SimResult:
        return self._run()

    def _classes(self) -> tuple[dict[int, int], list[int], dict[int, int]]:
        """(rank -> its class's representative, the representatives in order, members per class)."""
        if self._reps is None:
            cls = self.classes()
            members: dict[int, int] = defaultdict(int)
            for c in cls.values():
                members[c] += 1
            self._reps = cls, sorted(members), members
        return self._reps

    def _program_of(self, rep: int, cls: dict[int, int]) -> list:
        got = self._programs.get(rep)
        if got is None:
            got = self._programs[rep] = self.program(rep, cls)
        return got

    def _class_memory(self, rep: int, members: int, cls: dict[int, int]) -> RankStats:
        """A class's stats with its memory figures filled in (the rest are the play's), worked out once:
        `peak_needed` keeps them for the play."""
        st = self._memory_stats.get(rep)
        if st is None:
            st = self._memory_stats[rep] = RankStats(rank=rep, members=members)
            self._rank_memory(st, rep, *activation_peak(self._program_of(rep, cls)))
        return st

    @_gc_paused
    def peak_needed(self, over: float = math.inf) -> tuple[float, int]:
        """(bytes, rank): the most loaded class's `memory_needed` (the fits check's figure, `check_fit`;
        the first such class in rank order, as `max` over a result's ranks finds it) and its
        representative, without playing the step: memory depends on the order of a rank's actions,
        never on times. `over`: stop at the first class that needs more than it and answer that one
        (the step cannot fit `over`), the later classes' programs not built. What was built is kept
        for a `run` of this engine, which then only plays."""
        t0 = time.perf_counter()
        cls, reps, members = self._classes()
        worst, at = -math.inf, 0
        for r in reps:
            st = self._class_memory(r, members[r], cls)
            if st.memory_needed > worst:
                worst, at = st.memory_needed, r
                if worst > over:
                    break
        self._built_s += time.perf_counter() - t0
        return (worst, at) if reps else (0.0, 0)

    def _run(self) -> SimResult:
        t0 = time.perf_counter() - self._built_s  # a simulation's seconds include what peak_needed built for it
        cls, reps, members = self._classes()
        programs = {r: self._program_of(r, cls) for r in reps}
        stats = {r: self._class_memory(r, members[r], cls) for r in reps}
        self._programs, self._memory_stats = {}, {}  # the play's own now
        spans: list[Span] = []
        self._play(reps, programs, stats, spans)
        return self._result(reps, stats, spans, t0)

    def _play(self, reps: list[int], programs: dict[int, list], stats: dict[int, RankStats],
              spans: list[Span]) -> None:
        """Play every class's program against the others (`_Play`); fills `stats` (times) and `spans`."""
        _Play(reps, stats, spans).run(programs)

    def _result(self, reps: list[int], stats: dict[int, RankStats], spans: list[Span], t0: float) -> SimResult:
        plan = self.plan
        step = max((s.finish for s in stats.values()), default=0.0)
        ranks = [stats[r] for r in reps]
        capacity = self.cluster.gpu.memory_bytes
        tokens, model_flops, hardware_flops = _sample_totals(plan.samples, self.model, self.recompute, self.frozen)
        result = SimResult(
            system=plan.system,
            world_size=plan.world_size,
            step_time=step,
            tokens=tokens,
            samples=len(plan.samples),
            model_flops=model_flops,
            hardware_flops=hardware_flops,
            recompute=self.recompute,
            compute_model=self.compute.describe(),
            peak_flops=self.cluster.gpu.peak_flops,
            memory_capacity=capacity,
            ranks=ranks,
            spans=spans,
            classes=len(reps),
            sim_seconds=0.0,
        )
        if self.options.check_memory:
            check_fit(result, self.options.memory_error)
        result.sim_seconds = time.perf_counter() - t0
        return result


_TOTALS: dict = {}


def _sample_totals(samples: list, model: MultimodalSpec, recompute: str,
                   frozen: frozenset = frozenset()) -> tuple[int, float, float]:
    """A step's LLM tokens and its model and hardware FLOPs. A tune simulates the same batch at every
    layout it weighs, so they are worked out once per (samples, model, recompute), the samples known by
    identity (the entry keeps them alive, so no id is reused while it lives); the samples are walked
    once for all three. Keyed by each sample's identity, not the list's (as systems.common.by_identity
    keys a batch): every Plan holds its own copy of the batch's list."""
    key = (tuple(map(id, samples)), model, recompute, frozen)
    got = _TOTALS.get(key)
    if got is None:
        lens = costs.sample_lengths(samples)
        if len(_TOTALS) >= 8:  # the batches the other per-batch memos keep (cache.py, systems/common.py)
            _TOTALS.clear()
        got = _TOTALS[key] = (list(samples), sum(lens["llm"]), lengths_train_flops(model, lens, frozen=frozen),
                              lengths_train_flops(model, lens, recompute, frozen))
    return got[1], got[2], got[3]


def peer_wait(lags: list, a: float, b: float) -> float:
    """Seconds of [a, b] (a wait of the rank's compute stream on its communication) during which one of
    its collectives had arrived but waited for a slower peer: `lags` holds (arrival, all arrived) per
    such collective. That part of the wait is imbalance, the rest communication. Intervals over by `b`
    are dropped (consumed)."""
    got, reach = 0.0, a
    for lo, hi in sorted(lags):
        lo = lo if lo > reach else reach
        hi = hi if hi < b else b
        if hi > lo:
            got += hi - lo
            reach = hi
    lags[:] = [iv for iv in lags if iv[1] > b]
    return got


def check_fit(result: SimResult, memory_error: float = 0.0) -> SimResult:
    """Decide whether `result`'s step fits its GPU: the most loaded rank's `memory_needed` (its
    allocated peak, the space the caching allocator cannot give back under pressure, and what lives
    outside it, per stack and device: simulator/memory.py allocator_need), assumed `memory_error` off (+0.2: the estimate is 20%
    low, so a rank needs 1.2x it), against the device's memory. The unpressured reserve
    (`memory_bytes`) is reported beside it and decides nothing. Timing never depends on it, so a
    cached step is re-decided under another error without simulating it again."""
    result.fits, result.fit_message, result.fit_checked = True, "", True
    if not result.ranks:
        return result
    worst = max(result.ranks, key=lambda s: s.memory_needed)
    if worst.memory_needed * (1.0 + memory_error) > result.memory_capacity:
        result.fits = False
        result.fit_message = (
            f"does not fit: rank {worst.rank} needs {worst.memory_needed / GiB:.1f} GiB of "
            f"{result.memory_capacity / GiB:.1f} GiB under memory pressure ({worst.memory_allocated / GiB:.1f} "
            f"allocated; {worst.memory_bytes / GiB:.1f} reserved when unpressured)"
            + (f" (assuming the estimate is {abs(memory_error):.0%} {'low' if memory_error > 0 else 'high'})"
               if memory_error else "")
        )
    return result


def deadlock(stuck: list[int], spans: list[Span]) -> SimulationError:
    """The error of a play whose rank classes `stuck` never finished."""
    r = stuck[0]
    done = sum(1 for s in spans if s.rank == r and s.stream == "compute")
    return SimulationError(f"simulated deadlock: {len(stuck)} rank classes never finished (first: rank {r} after "
                           f"{done} compute actions); the plan's sends/recvs or collectives do not match")


class _Channel:
    """One message's state: whether its recv is posted, the senders waiting for that, the earliest
    end of a transfer of it (several ranks of one class may send it), and the ranks waiting for it."""

    __slots__ = ("index", "posted", "senders", "end", "waiters", "fire_at", "fired")

    def __init__(self, index: int):
        self.index = index
        self.posted = False
        self.senders: list = []
        self.end = math.inf
        self.waiters: list[int] = []
        self.fire_at = math.inf
        self.fired = False


class _Play:
    """One step's run: every class's program played against the others, filling `stats` and `spans`.

    Events are kept in time order on one heap, but only where a rank's process must wait for
    time to pass: a compute op's end, a message or lock it waits for. Everything else is worked
    out from times as soon as they are known (a collective's start is its last member's
    arrival; its members' ends follow), so a step costs about one heap entry per compute op
    rather than simpy's several events per action. Same semantics as the simpy loop
    (`simulator/engine_simpy.py`, the reference a test compares against): a rank's collective
    stream runs its collectives in issue order, each when all its distinct members have
    arrived; a rank's p2p stream runs transfers in the order they become ready (a send once
    its receiver has posted the recv); a recv completes when the first transfer of its message
    has; an optimizer step waits for the rank's outstanding communication.
    """

    def __init__(self, reps: list[int], stats: dict[int, RankStats], spans: list[Span]):
        self.reps, self.stats, self.spans = reps, stats, spans
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0  # the loop's clock: when the event being handled fires
        self.locks: dict[tuple, list] = {}  # key -> [arrived, max contribution, ready time, [(rank, op)]]
        self.colls: dict[tuple, list] = {}  # key -> [arrived, latest arrival, [(rank, op, holder, arrival)]]
        self.lags: dict[int, list] = {r: [] for r in reps}  # per rank: (arrival, all arrived) of collectives that waited
        self.chans: dict[tuple, _Channel] = {}
        self.chan_list: list[_Channel] = []
        self.p2p_free = dict.fromkeys(reps, 0.0)
        self.coll_free = dict.fromkeys(reps, 0.0)
        self.coll_next = dict.fromkeys(reps, 0.0)  # when the stream takes its next collective (its last one's end)
        self.coll_busy = dict.fromkeys(reps, False)
        self.coll_queue: dict[int, deque] = {r: deque() for r in reps}
        self.pend_max = dict.fromkeys(reps, 0.0)  # latest end of the rank's outstanding communication
        self.pend_open = dict.fromkeys(reps, 0)  # outstanding communication whose end is not known yet
        self.pend_wait = dict.fromkeys(reps, False)  # the rank's process waits for pend_open to reach 0
        self.finished: set[int] = set()

    def channel(self, key) -> _Channel:
        ch = self.chans.get(key)
        if ch is None:
            ch = self.chans[key] = _Channel(len(self.chan_list))
            self.chan_list.append(ch)
        return ch

    def transfer(self, rank, op, free, stream, kind, t) -> float:
        f = free[rank]
        start = f if f > t else t  # max(t, f) as simpy's loop takes it (int 0 stays int)
        d = op.duration
        end = start + d
        free[rank] = end
        self.stats[rank].comm_busy += d
        self.spans.append(Span(rank, stream, op.action, kind, start, d))
        return t + (end - t)  # when it is over, as simpy's timeout rounds it (bit-identical results)

    def delivered(self, ch: _Channel, end: float) -> None:
        if end < ch.end:
            ch.end = end
            if ch.waiters and end < ch.fire_at:
                ch.fire_at = end
                heapq.heappush(self.heap, (end, next(self.seq), ~ch.index))

    def resolved(self, rank, end) -> None:
        self.pend_open[rank] -= 1
        if end > self.pend_max[rank]:
            self.pend_max[rank] = end
        if not self.pend_open[rank] and self.pend_wait[rank]:
            self.pend_wait[rank] = False
            t, now = self.pend_max[rank], self.now
            heapq.heappush(self.heap, (t if t > now else now, next(self.seq), rank))

    def arrive(self, rank, op, holder, t) -> None:
        """`rank`'s collective stream reaches `op` at time t."""
        key = op.lock_key
        colls = self.colls
        rv = colls.get(key)
        if rv is None:
            rv = colls[key] = [0, t, []]
        rv[0] += 1
        if t > rv[1]:
            rv[1] = t
        rv[2].append((rank, op, holder, t))
        if rv[0] < op.lock_n:
            return
        del colls[key]
        ready = rv[1]
        for m, mop, h, tm in rv[2]:
            if ready > tm:
                self.lags[m].append((tm, ready))
            end = self.transfer(m, mop, self.coll_free, "collective", mop.kind, ready)
            h[0] = self.coll_next[m] = end
            if h[1]:  # its process waits for it (a blocking collective)
                heapq.heappush(self.heap, (end, next(self.seq), m))
            elif not mop.blocking:
                self.resolved(m, end)
            q = self.coll_queue[m]
            if q:
                nop, nh = q.popleft()
                self.arrive(m, nop, nh, end)
            else:
                self.coll_busy[m] = False

    def proc(self, rank, ops):
        """`rank`'s process: yields the time it next waits until (None: until something wakes it), and is
        sent the time it wakes at."""
        st, spans, heap, seq, locks, lags = self.stats[rank], self.spans, self.heap, self.seq, self.locks, self.lags
        push, channel, transfer, delivered = heapq.heappush, self.channel, self.transfer, self.delivered
        p2p_free, pend_max, pend_open, pend_wait = self.p2p_free, self.pend_max, self.pend_open, self.pend_wait
        now = yield None
        for op in ops:
            kind = op.kind
            if kind == FORWARD or kind == BACKWARD:
                key = op.lock_key
                if key is None:
                    start, dur = now, op.duration
                    now = yield now + (dur + op.exposed)
                else:
                    rv = locks.get(key)
                    if rv is None:
                        rv = locks[key] = [0, op.duration, 0.0, []]
                    elif op.duration > rv[1]:
                        rv[1] = op.duration
                    rv[0] += 1
                    if rv[0] < op.lock_n:
                        # the last member to arrive wakes this one at its op's end
                        rv[3].append((rank, op))
                        arrived = now
                        now = yield None
                        start, dur = rv[2], rv[1]
                        st.imbalance += start - arrived
                    else:
                        del locks[key]
                        start = rv[2] = now
                        dur = rv[1]
                        for w, wop in rv[3]:
                            push(heap, (now + (dur + wop.exposed), next(seq), w))
                        now = yield now + (dur + op.exposed)
                    st.imbalance += dur - op.duration  # the slowest peer's time sets the locked op's
                st.compute += op.duration
                by = st.compute_by_module
                by[op.action.module] = by.get(op.action.module, 0.0) + op.duration
                st.exposed_comm += op.exposed
                st.comm_busy += op.comm
                spans.append(Span(rank, "compute", op.action, kind, start, dur + op.exposed))
            elif kind == SEND:
                ch = channel(op.p2p_key)
                if ch.posted:  # NCCL p2p: the transfer starts once the receiver has posted its recv
                    end = transfer(rank, op, p2p_free, "p2p", SEND, now)
                    delivered(ch, end)
                    if end > pend_max[rank]:
                        pend_max[rank] = end
                else:
                    ch.senders.append((rank, op))
                    pend_open[rank] += 1
            elif kind == RECV or kind == "boundary_recv":
                ch = channel(op.p2p_key)
                if kind == RECV and not ch.posted:
                    ch.posted = True
                    for s, sop in ch.senders:
                        end = transfer(s, sop, p2p_free, "p2p", SEND, now)
                        delivered(ch, end)
                        self.resolved(s, end)
                    ch.senders = []
                if not ch.fired and ch.end > now:
                    ch.waiters.append(rank)
                    if ch.end < ch.fire_at:
                        ch.fire_at = ch.end
                        push(heap, (ch.end, next(seq), ~ch.index))
                    now = yield None
            elif kind == "boundary_send":
                end = transfer(rank, op, p2p_free, "p2p", BOUNDARY, now)
                delivered(channel(op.p2p_key), end)
                if end > pend_max[rank]:
                    pend_max[rank] = end
            elif kind == GRAD_SYNC or kind == METADATA or kind == PARAM_GATHER:
                holder = [None, False]  # [end, whether this process waits for it]
                if not op.blocking:
                    pend_open[rank] += 1
                if self.coll_busy[rank]:
                    self.coll_queue[rank].append((op, holder))
                else:
                    self.coll_busy[rank] = True
                    f = self.coll_next[rank]
                    self.arrive(rank, op, holder, f if f > now else now)
                if op.blocking:
                    wait_start = now
                    if holder[0] is None:
                        holder[1] = True
                        now = yield None
                    elif holder[0] > now:
                        now = yield holder[0]
                    waited = peer_wait(lags[rank], wait_start, now)
                    st.imbalance += waited
                    st.exposed_comm += (now - wait_start) - waited
            elif kind == OPTIMIZER_STEP:
                wait_start = now
                if pend_open[rank]:
                    pend_wait[rank] = True
                    now = yield None
                elif pend_max[rank] > now:
                    now = yield pend_max[rank]
                pend_max[rank] = 0.0
                waited = peer_wait(lags[rank], wait_start, now)
                st.imbalance += waited
                st.exposed_comm += (now - wait_start) - waited
                start = now
                now = yield now + op.duration
                st.optimizer += op.duration
                spans.append(Span(rank, "compute", op.action, kind, start, op.duration))
        if pend_open[rank]:
            pend_wait[rank] = True
            now = yield None
        elif pend_max[rank] > now:
            now = yield pend_max[rank]
        st.finish = now
        self.finished.add(rank)

    def run(self, programs: dict[int, list]) -> None:
        """Every class's process from time 0 until the heap is empty; a SimulationError names a class
        that never finished (the plan's sends/recvs or collectives do not match)."""
        heap, seq, chan_list = self.heap, self.seq, self.chan_list
        push, pop = heapq.heappush, heapq.heappop
        gens = {}
        for r in self.reps:
            g = gens[r] = self.proc(r, programs[r])
            next(g)
            push(heap, (0, next(seq), r))  # simpy starts its clock at int 0: spans keep it
        while heap:
            now, _, target = pop(heap)
            self.now = now
            if target >= 0:
                wake = (target,)
            else:
                ch = chan_list[~target]
                if ch.fired or ch.fire_at != now:
                    continue  # superseded by an earlier delivery of the same message
                ch.fired = True
                wake, ch.waiters = ch.waiters, []
            for r in wake:
                try:
                    t = gens[r].send(now)
                except StopIteration:
                    continue
                if t is not None:
                    push(heap, (t, next(seq), r))
        stuck = [r for r in self.reps if r not in self.finished]
        if stuck:
            raise deadlock(stuck, self.spans)



def activation_peak(ops: list) -> tuple[float, object]:
    """Peak bytes of a rank's memory timeline (simulator/memory.py) and the action at it: each op's
    high point over what was live before it (`_Op.mem_peak`: a forward's activations and its loss,
    a backward walked layer by layer, a grad_sync's buffer), then what it leaves (`mem_delta`).
    Depends on the order of actions only, not on times."""
    live = peak_live = 0.0
    peak_at = None
    for op in ops:
        kind = op.kind
        if kind == FORWARD or kind == BACKWARD or kind == GRAD_SYNC or kind == METADATA or kind == PARAM_GATHER:
            if live + op.mem_peak > peak_live:
                peak_live, peak_at = live + op.mem_peak, op.action
            live += op.mem_delta
    return peak_live, peak_at


_spare_engine: list[Engine] = []


def offer_engine(engine: Engine) -> None:
    """Hand `engine` (its plan's classes and programs built by `Engine.peak_needed`, not played) to the
    next `simulate` of the very same plan object under the same costs: a command that checks a layout's
    memory and then simulates that step (omnibench/resolve.py, with `systems.offer_plan` for the plan)
    then builds the step's programs once, not twice. One engine is kept; a newer offer replaces it."""
    _spare_engine[:] = [engine]


def drop_spare_engine() -> None:
    _spare_engine.clear()


def _take_spare_engine(plan: Plan, model: MultimodalSpec, cluster: ClusterSpec, options: SimOptions) -> Engine | None:
    """The offered engine if it was made for `plan` itself with the default costs of an equal model and
    cluster and equal options but for the fits check's (`check_memory`, `memory_error`: they decide
    nothing before the result), which then become `options`'. Taken or not, the offer is dropped."""
    try:
        e = _spare_engine.pop()
    except IndexError:  # none offered (or another thread took it)
        return None
    same = (e.plan is plan and e.default_costs and (e.model is model or e.model == model)
            and (e.cluster is cluster or e.cluster == cluster)
            and replace(e.options, check_memory=True, memory_error=0.0)
            == replace(options, check_memory=True, memory_error=0.0))
    if not same:
        return None
    e.options = options
    return e


def simulate(plan: Plan, model: MultimodalSpec, cluster: ClusterSpec, *, calibration=None,
             options: SimOptions = SimOptions()) -> SimResult:
    """Simulate one step of `plan`; `calibration` is a `simulator.calibrate.Profile` or None (datasheet)."""
    spare = _take_spare_engine(plan, model, cluster, options)  # dropped whether it serves or not
    if calibration is None and spare is not None:
        return charge_planning(spare.run(), plan)
    del spare
    compute = collectives = None
    if calibration is not None:
        compute = calibration.compute_model(cluster)
        collectives = calibration.collective_model(cluster)
    return charge_planning(Engine(plan, model, cluster, compute, collectives, options).run(), plan)

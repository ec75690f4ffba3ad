"""The simpy engine: executes one Plan with costs, one process per *distinct* rank.

The Engine is put together from one file per idea:
- `simulator/work.py`: the work of each action (microbatch signature -> `Work` under the layout);
- `simulator/groups.py`: rank groups and the colour refinement that collapses identical ranks;
- `simulator/program.py`: a rank's actions as timed ops on its compute, collective and p2p streams,
  with the intra-module communication each compute action implies;
- `simulator/memory.py`: static training state and the activation timeline per rank;
- `simulator/result.py`: spans, per-class statistics and the step's metrics;
- this file: the discrete-event run that plays every class's program against the others.

A collective completes when all its distinct participants have arrived; a recv completes when the
matching send's transfer has (the send starts once the recv is posted).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict, deque

import simpy

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
from simulator.flops import model_train_flops
from simulator.groups import GroupsMixin, LayoutIndex
from simulator.hardware import ClusterSpec, GiB
from simulator.memory import RESERVED_BYTES, MemoryMixin
from simulator.options import SimOptions, SimulationError
from simulator.program import ProgramMixin
from simulator.result import RankStats, SimResult, Span
from simulator.work import WorkMixin

__all__ = ["RESERVED_BYTES", "Engine", "RankStats", "SimOptions", "SimResult", "SimulationError", "Span", "simulate"]


class Engine(WorkMixin, GroupsMixin, ProgramMixin, MemoryMixin):
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
        self._member_cache: dict = {}
        self._loader_groups: dict[tuple, tuple[int, ...]] = {}
        self._edp_cache: dict = {}
        self._sp_group_of: dict[str, dict[int, tuple[int, ...]]] = {}
        self._member_ids: dict = {}
        self._sig_cache: dict = {}
        self._data_rank_cache: dict = {}
        self.message_tokens: dict[tuple, int] = defaultdict(int)
        for r in plan.routes:
            self.message_tokens[(r.module, r.src_rank, r.src_microbatch, r.dst_rank, r.dst_microbatch)] += r.tokens

    def run(self) -> SimResult:
        # Hundreds of thousands of small objects (events, spans) and no reference cycles worth
        # collecting: the cyclic GC would rescan them again and again (measured: 2x the run time).
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SimResult:
        t0 = time.perf_counter()
        plan = self.plan
        cls = self.classes()
        reps = sorted(set(cls.values()))
        members: dict[int, int] = defaultdict(int)
        for c in cls.values():
            members[c] += 1
        programs = {r: self.program(r, cls) for r in reps}

        env = simpy.Environment()
        spans: list[Span] = []
        stats = {r: RankStats(rank=r, members=members[r]) for r in reps}
        rendezvous: dict[tuple, list] = {}  # key -> [arrived, max contribution, event]
        channels: dict[tuple, list] = {}  # key -> [recv posted event, done event]
        # The collective and p2p streams of a rank are FIFO queues; each is kept as the time it is
        # next free (a simpy Resource per rank per stream costs more than the whole step at scale).
        free = {(r, stream): 0.0 for r in reps for stream in ("collective", "p2p")}

        def arrive(key, n, contribution):
            rv = rendezvous.get(key)
            if rv is None:
                rv = rendezvous[key] = [0, 0.0, env.event()]
            rv[0] += 1
            if contribution > rv[1]:
                rv[1] = contribution
            if rv[0] == n:
                rv[2].succeed(rv[1])
            return rv[2]

        def channel(key):
            ch = channels.get(key)
            if ch is None:
                ch = channels[key] = [env.event(), env.event()]
            return ch

        def transfer(rank, op, stream, kind, done):
            """Queue `op` on a stream now; returns the event of its end and triggers `done` then."""
            start = max(env.now, free[(rank, stream)])
            end = start + op.duration
            free[(rank, stream)] = end
            stats[rank].comm_busy += op.duration
            a = op.action
            spans.append(Span(rank, stream, a, kind, start, op.duration))
            ev = env.timeout(end - env.now)
            if done is not None:
                ev.callbacks.append(lambda _e, d=done: d.triggered or d.succeed())
            return ev

        def send(rank, op, pending):
            posted, done = channel(op.p2p_keys[0])
            # NCCL p2p: the transfer starts once the receiver has posted its recv.
            if posted.triggered:
                pending.append(transfer(rank, op, "p2p", SEND, done))
                return
            holder = env.event()
            pending.append(holder)

            def go(_e):
                transfer(rank, op, "p2p", SEND, done).callbacks.append(lambda _x: holder.succeed())

            posted.callbacks.append(go)

        queues = {r: deque() for r in reps}  # collectives issued but not started, per rank
        busy = dict.fromkeys(reps, False)

        def collective(rank, op, pending):
            holder = env.event()
            pending.append(holder)
            queues[rank].append((op, holder))
            if not busy[rank]:
                next_collective(rank)

        def next_collective(rank):
            q = queues[rank]
            if not q:
                busy[rank] = False
                return
            busy[rank] = True
            op, holder = q.popleft()
            ready = arrive(op.lock_key, op.lock_n, 0.0)

            def run_it(_e=None):
                ev = transfer(rank, op, "collective", op.kind, holder)
                ev.callbacks.append(lambda _x: next_collective(rank))

            if ready.triggered:
                run_it()
            else:
                ready.callbacks.append(run_it)

        def rank_proc(rank, ops):
            st = stats[rank]
            pending: list = []
            live = peak_live = 0.0
            peak_at = None
            for op in ops:
                kind = op.kind
                if kind == FORWARD or kind == BACKWARD:
                    dur = op.duration
                    if op.lock_key is not None:
                        ev = arrive(op.lock_key, op.lock_n, op.duration)
                        dur = ev.value if ev.triggered else (yield ev)
                    start = env.now
                    total = dur + op.exposed
                    yield env.timeout(total)
                    st.compute += op.duration
                    st.exposed_comm += op.exposed
                    st.comm_busy += op.comm
                    a = op.action
                    spans.append(Span(rank, "compute", a, kind, start, total))
                    if live + op.mem_peak > peak_live:  # memory: the op's high point, what it leaves
                        peak_live, peak_at = live + op.mem_peak, op.action
                    live += op.mem_delta
                elif kind == SEND:
                    send(rank, op, pending)
                elif kind == RECV:
                    posted, done = channel(op.p2p_keys[0])
                    if not posted.triggered:
                        posted.succeed()
                    if not done.triggered:
                        yield done
                elif kind == "boundary_send":
                    _, done = channel(op.p2p_keys[0])
                    pending.append(transfer(rank, op, "p2p", BOUNDARY, done))
                elif kind == "boundary_recv":
                    done = channel(op.p2p_keys[0])[1]
                    if not done.triggered:
                        yield done
                elif kind == GRAD_SYNC or kind == METADATA:
                    if live + op.mem_peak > peak_live:  # memory: a grad_sync's flat buffer
                        peak_live, peak_at = live + op.mem_peak, op.action
                    live += op.mem_delta
                    collective(rank, op, pending)
                    if op.blocking:
                        wait_start = env.now
                        yield pending.pop()
                        st.exposed_comm += env.now - wait_start
                elif kind == OPTIMIZER_STEP:
                    wait_start = env.now
                    if pending:
                        yield simpy.AllOf(env, pending)
                    pending = []
                    st.exposed_comm += env.now - wait_start
                    start = env.now
                    yield env.timeout(op.duration)
                    st.optimizer += op.duration
                    a = op.action
                    spans.append(Span(rank, "compute", a, kind, start, op.duration))
            if pending:
                yield simpy.AllOf(env, pending)
            st.finish = env.now
            self._rank_memory(st, rank, peak_live, peak_at)

        procs = [env.process(rank_proc(r, programs[r])) for r in reps]
        env.run()
        stuck = [r for r, p in zip(reps, procs, strict=True) if not p.triggered]
        if stuck:
            r = stuck[0]
            done = sum(1 for s in spans if s.rank == r and s.stream == "compute")
            raise SimulationError(
                f"simulated deadlock: {len(stuck)} rank classes never finished (first: rank {r} after "
                f"{done} compute actions); the plan's sends/recvs or collectives do not match"
            )
        step = max((s.finish for s in stats.values()), default=0.0)
        ranks = [stats[r] for r in reps]
        capacity = self.cluster.gpu.memory_bytes
        result = SimResult(
            system=plan.system,
            world_size=plan.world_size,
            step_time=step,
            tokens=sum(s.llm_tokens for s in plan.samples),
            samples=len(plan.samples),
            model_flops=model_train_flops(self.model, plan.samples),
            hardware_flops=model_train_flops(self.model, plan.samples, self.recompute),
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
            worst = max(ranks, key=lambda s: s.memory_bytes)
            if worst.memory_bytes > capacity:
                result.fits = False
                result.fit_message = (
                    f"does not fit: rank {worst.rank} needs {worst.memory_bytes / GiB:.1f} GiB of "
                    f"{capacity / GiB:.1f} GiB"
                )
        result.sim_seconds = time.perf_counter() - t0
        return result


def simulate(plan: Plan, model: MultimodalSpec, cluster: ClusterSpec, *, calibration=None,
             options: SimOptions = SimOptions()) -> SimResult:
    """Simulate one step of `plan`; `calibration` is a `simulator.calibrate.Profile` or None (datasheet)."""
    compute = collectives = None
    if calibration is not None:
        compute = calibration.compute_model(cluster)
        collectives = calibration.collective_model(cluster)
    return Engine(plan, model, cluster, compute, collectives, options).run()

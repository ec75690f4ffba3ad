"""The simpy run loop the engine had before its fast path: the reference `Engine._play` is tested
against (tests/test_simulator_scale.py), kept as it was (one simpy process per simulated rank,
simpy events for every transfer, rendezvous and stream hand-off) apart from the activation
timeline, which both loops take from `simulator.engine.activation_peak`.

    SimpyEngine(plan, model, cluster, options=...).run()   # same result as Engine(...).run()
"""

from __future__ import annotations

from collections import deque

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
)
from simulator.engine import Engine, deadlock, peer_wait
from simulator.program import PARAM_GATHER
from simulator.result import RankStats, Span


class SimpyEngine(Engine):
    def _play(self, reps: list[int], programs: dict[int, list], stats: dict[int, RankStats],
              spans: list[Span]) -> None:
        env = simpy.Environment()
        meet = _Rendezvous(env)
        arrive, channel = meet.arrive, meet.channel
        # The collective and p2p streams of a rank are FIFO queues; each is kept as the time it is
        # next free (a simpy Resource per rank per stream costs more than the whole step at scale).
        free = {(r, stream): 0.0 for r in reps for stream in ("collective", "p2p")}

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
            posted, done = channel(op.p2p_key)
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
        lags: dict[int, list] = {r: [] for r in reps}  # (arrival, all arrived) of collectives that waited
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
            arrived = env.now
            ready = arrive(op.lock_key, op.lock_n, 0.0)

            def run_it(_e=None):
                if env.now > arrived:
                    lags[rank].append((arrived, env.now))
                ev = transfer(rank, op, "collective", op.kind, holder)
                ev.callbacks.append(lambda _x: next_collective(rank))

            if ready.triggered:
                run_it()
            else:
                ready.callbacks.append(run_it)

        def rank_proc(rank, ops):
            st = stats[rank]
            pending: list = []
            for op in ops:
                kind = op.kind
                if kind == FORWARD or kind == BACKWARD:
                    dur = op.duration
                    if op.lock_key is not None:
                        arrived = env.now
                        ev = arrive(op.lock_key, op.lock_n, op.duration)
                        dur = ev.value if ev.triggered else (yield ev)
                        st.imbalance += env.now - arrived
                        st.imbalance += dur - op.duration  # the slowest peer's time sets the locked op's
                    start = env.now
                    total = dur + op.exposed
                    yield env.timeout(total)
                    st.compute += op.duration
                    by = st.compute_by_module
                    by[op.action.module] = by.get(op.action.module, 0.0) + op.duration
                    st.exposed_comm += op.exposed
                    st.comm_busy += op.comm
                    a = op.action
                    spans.append(Span(rank, "compute", a, kind, start, total))
                elif kind == SEND:
                    send(rank, op, pending)
                elif kind == RECV:
                    posted, done = channel(op.p2p_key)
                    if not posted.triggered:
                        posted.succeed()
                    if not done.triggered:
                        yield done
                elif kind == "boundary_send":
                    _, done = channel(op.p2p_key)
                    pending.append(transfer(rank, op, "p2p", BOUNDARY, done))
                elif kind == "boundary_recv":
                    done = channel(op.p2p_key)[1]
                    if not done.triggered:
                        yield done
                elif kind == GRAD_SYNC or kind == METADATA or kind == PARAM_GATHER:
                    collective(rank, op, pending)
                    if op.blocking:
                        wait_start = env.now
                        yield pending.pop()
                        waited = peer_wait(lags[rank], wait_start, env.now)
                        st.imbalance += waited
                        st.exposed_comm += (env.now - wait_start) - waited
                elif kind == OPTIMIZER_STEP:
                    wait_start = env.now
                    if pending:
                        yield simpy.AllOf(env, pending)
                    pending = []
                    waited = peer_wait(lags[rank], wait_start, env.now)
                    st.imbalance += waited
                    st.exposed_comm += (env.now - wait_start) - waited
                    start = env.now
                    yield env.timeout(op.duration)
                    st.optimizer += op.duration
                    a = op.action
                    spans.append(Span(rank, "compute", a, kind, start, op.duration))
            if pending:
                yield simpy.AllOf(env, pending)
            st.finish = env.now

        procs = [env.process(rank_proc(r, programs[r])) for r in reps]
        env.run()
        stuck = [r for r, p in zip(reps, procs, strict=True) if not p.triggered]
        if stuck:
            raise deadlock(stuck, spans)


class _Rendezvous:
    """Where ranks meet: collectives and locked ops by key (each an event that fires, with the largest
    contribution, once all `n` members have arrived) and p2p messages (a recv-posted and a done event)."""

    def __init__(self, env):
        self.env = env
        self.rendezvous: dict[tuple, list] = {}  # key -> [arrived, max contribution, event]
        self.channels: dict[tuple, list] = {}  # key -> [recv posted event, done event]

    def arrive(self, key, n, contribution):
        rv = self.rendezvous.get(key)
        if rv is None:
            rv = self.rendezvous[key] = [0, 0.0, self.env.event()]
        rv[0] += 1
        if contribution > rv[1]:
            rv[1] = contribution
        if rv[0] == n:
            rv[2].succeed(rv[1])
        return rv[2]

    def channel(self, key):
        ch = self.channels.get(key)
        if ch is None:
            ch = self.channels[key] = [self.env.event(), self.env.event()]
        return ch

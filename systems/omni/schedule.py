"""The encoder-LLM joint pipeline: each rank's action order for one step.

The LLM runs non-interleaved 1F1B. Under it, a rank on pipeline stage s idles for about s
forward slots before its first microbatch arrives (warm-up) and s backward slots after its last
backward while the earlier stages finish (cool-down). The joint schedule places encoder work in
those gaps instead of running all encoder forwards before the pipeline and all encoder backwards
after it:

- a list scheduler walks the pipeline with this step's estimated costs (cost model): LLM stage ops
  of one stage start together (FSDP, tp and cp lock a stage's ranks layer by layer); before each
  op, every rank of the stage fills its idle gap with encoder work that fits: forwards in order of
  the LLM microbatch they feed, then backwards whose gradients are back;
- encoder forwards feeding LLM microbatch j that are still pending when stage 0 is about to run j
  are forced in first (stage 0 cannot start without them); backwards left over run right after
  the rank's last LLM op, which is the cool-down gap of stages > 0;
- long (sequence-parallel) inputs run on their whole group at the start of the step and their
  backwards at the end, in the same order on every member (their all-to-alls are collectives of
  the group, and the step's ends are the only points where no member can be waiting on another
  for pipeline data).

The order is recomputed every step from that step's samples. Because the estimated timeline
respects every dependency the runtime has (pipeline p2p, boundary messages, stage locks), the
order cannot deadlock; `align_sends` then moves sends (non-blocking) so every rank pair posts
its messages in the order the receiver expects them, as point-to-point matching is FIFO per pair.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from omnibench.plan import BACKWARD, BOUNDARY, FORWARD, RECV, SEND, Action, Layout
from systems.common import (
    BoundaryIndex,
    llm_backward_actions,
    llm_forward_actions,
    one_f_one_b,
    pipeline_neighbours,
)


@dataclass(slots=True, unsafe_hash=True)  # one per encoder microbatch and rank: never changed once made
class EncItem:
    module: str
    microbatch: int
    due: int  # LLM microbatch its outputs feed (-1: a dummy forward with no samples)
    fwd: float  # estimated seconds on this rank
    bwd: float
    group: tuple[int, ...] = ()  # sequence-parallel group of a long input, () for short


@dataclass
class Timeline:
    orders: dict[int, list[tuple]]  # rank -> ("enc_f"|"enc_b", EncItem) | ("llm", "F"|"B", j)
    step_s: float  # estimated step time
    placed: dict[int, dict[str, int]]  # rank -> encoder actions in warmup / steady / cooldown


def _stage_ranks(llm: Layout) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(llm.pp)]
    for r in llm.ranks:
        out[llm.coord(r, "pp")].append(r)
    return out


def _long_items(items: dict[int, list[EncItem]]) -> list[tuple[tuple[int, ...], EncItem]]:
    seen, out = set(), []
    for r in sorted(items):
        for it in items[r]:
            if it.group and (it.group, it.module, it.microbatch) not in seen:
                seen.add((it.group, it.module, it.microbatch))
                out.append((it.group, it))
    return sorted(out, key=lambda x: (x[0], x[1].microbatch, x[1].module))


def step_floor(llm: Layout, m: int, f: list[float], b: list[float]) -> float:
    """A floor under `joint_timeline(llm, m, f, b, items, joint)`'s step for any encoder work `items`
    and either order: the first stage runs every microbatch's forward and backward one after another,
    each starting no earlier than the one before ended. Summed in that stage's 1F1B order from 0, as the
    timeline adds them (floating-point addition is monotone, so the floor holds to the last bit)."""
    t = 0.0
    for kind, j in one_f_one_b(0, llm.pp, m):
        t += f[j] if kind == "F" else b[j]
    return t


def joint_timeline(llm: Layout, m: int, f: list[float], b: list[float], items: dict[int, list[EncItem]],
                   joint: bool = True) -> Timeline:
    """Orders per rank. `f[j]`, `b[j]`: one stage's forward/backward seconds of LLM microbatch j
    (the slowest data group's); `items[r]`: encoder work on rank r. joint=False runs every encoder
    forward before the pipeline and every backward after it (the ablation)."""
    stages = _stage_ranks(llm)
    ranks = sorted(items)
    t = {r: 0.0 for r in ranks}
    orders: dict[int, list[tuple]] = {r: [] for r in ranks}
    due_end: dict[int, float] = defaultdict(float)
    pending_f = {r: sorted((it for it in items[r] if not it.group), key=lambda it: (it.due, it.module))
                 for r in ranks}
    pending_b: dict[int, list[tuple[float, EncItem]]] = {r: [] for r in ranks}  # (ready time, item)
    bwd_of: dict[int, dict[int, list[EncItem]]] = defaultdict(lambda: defaultdict(list))  # due -> rank -> items
    for r in ranks:
        for it in pending_f[r]:
            bwd_of[it.due][r].append(it)

    def run_fwd(r: int, it: EncItem) -> None:
        t[r] += it.fwd
        orders[r].append(("enc_f", it))
        due_end[it.due] = max(due_end[it.due], t[r])

    for group, it in _long_items(items):  # sequence-parallel work: whole group, step start
        start = max(t[r] for r in group)
        for r in group:
            t[r] = start
            run_fwd(r, it)
    for r in ranks:  # dummy forwards (no samples): free, first
        for it in [x for x in pending_f[r] if x.due < 0]:
            run_fwd(r, it)
        pending_f[r] = [x for x in pending_f[r] if x.due >= 0]
    if not joint:
        for r in ranks:
            for it in pending_f[r]:
                run_fwd(r, it)
            pending_f[r] = []
    first_llm: dict[int, int] = {}
    ops = [one_f_one_b(s, llm.pp, m) for s in range(llm.pp)]
    ptr = [0] * llm.pp
    done: dict[tuple[int, str, int], float] = {}
    while any(ptr[s] < len(ops[s]) for s in range(llm.pp)):
        best = None
        for s in range(llm.pp):
            if ptr[s] >= len(ops[s]):
                continue
            kind, j = ops[s][ptr[s]]
            if kind == "F":
                dep = (s - 1, "F", j) if s > 0 else None
            else:
                dep = (s + 1, "B", j) if s < llm.pp - 1 else (s, "F", j)
            if dep is not None and dep not in done:
                continue
            ready = max(done.get(dep, 0.0), max(t[r] for r in stages[s]))
            if best is None or ready < best[0]:
                best = (ready, s, kind, j, dep)
        assert best is not None, "1F1B orders always have a runnable op"
        _, s, kind, j, dep = best
        if s == 0 and kind == "F":
            for r in ranks:  # stage 0 needs microbatch j's embeddings now
                while pending_f[r] and pending_f[r][0].due <= j:
                    run_fwd(r, pending_f[r].pop(0))
        start = max(done.get(dep, 0.0), due_end.get(j, 0.0) if (s == 0 and kind == "F") else 0.0,
                    max(t[r] for r in stages[s]))
        if joint:
            for r in stages[s]:
                _fill_gap(r, start, t, orders, pending_f, pending_b, run_fwd)
        end = start + (f[j] if kind == "F" else b[j])
        for r in stages[s]:
            t[r] = end
            orders[r].append(("llm", kind, j))
        done[(s, kind, j)] = end
        ptr[s] += 1
        if s == 0 and kind == "B":
            for r, its in bwd_of[j].items():
                pending_b[r] += [(end, it) for it in its]
    last_llm = {r: len(orders[r]) for r in ranks}
    for r in ranks:
        for ready, it in sorted(pending_b[r], key=lambda x: (x[0], x[1].due, x[1].module)):
            t[r] = max(t[r], ready) + it.bwd
            orders[r].append(("enc_b", it))
        for it in [x for x in items[r] if x.due < 0 and not x.group]:
            orders[r].append(("enc_b", it))
    for group, it in reversed(_long_items(items)):
        ready = max(t[r] for r in group)
        for r in group:
            t[r] = ready + it.bwd
            orders[r].append(("enc_b", it))
    placed = {}
    for r in ranks:
        first_llm[r] = next((k for k, op in enumerate(orders[r]) if op[0] == "llm"), len(orders[r]))
        counts = {"warmup": 0, "steady": 0, "cooldown": 0}
        for pos, op in enumerate(orders[r]):
            if op[0] == "llm" or op[1].due < 0:
                continue
            where = "warmup" if pos < first_llm[r] else "cooldown" if pos >= last_llm[r] else "steady"
            counts[where] += 1
        placed[r] = counts
    return Timeline(orders, max(t.values()) if t else 0.0, placed)


def lockstep_orders(llm: Layout, m: int, items: dict[int, list[EncItem]], modules: list[str]) -> dict[int, list[tuple]]:
    """Orders for encoders whose every call is a collective of all their ranks (FSDP / HSDP): each
    rank runs the same number of microbatches per encoder (the planner pads with empty ones), all
    forwards before its LLM work, module by module in microbatch order, and all backwards after it
    in the same order (the last backward, the highest microbatch, is where FSDP reduce-scatters).
    A rank can then never wait in an encoder collective for a peer that waits on it: every LLM
    dependency of a peer (pipeline messages, the boundary) is posted before that peer's encoder
    backwards, and sends do not block."""
    orders: dict[int, list[tuple]] = {}
    for r, its in items.items():
        s = llm.coord(r, "pp")
        mine = sorted(its, key=lambda it: (modules.index(it.module), it.microbatch))
        orders[r] = ([("enc_f", it) for it in mine] + [("llm", kind, j) for kind, j in one_f_one_b(s, llm.pp, m)]
                     + [("enc_b", it) for it in mine])
    return orders


def _fill_gap(r, start, t, orders, pending_f, pending_b, run_fwd) -> None:
    """Encoder work that fits in rank r's idle time before `start`: forwards first (soonest due)."""
    while True:
        if pending_f[r] and t[r] + pending_f[r][0].fwd <= start:
            run_fwd(r, pending_f[r].pop(0))
            continue
        ready = [x for x in pending_b[r] if x[0] <= t[r] and t[r] + x[1].bwd <= start]
        if not ready:
            return
        x = min(ready, key=lambda x: (x[0], x[1].due, x[1].module))
        pending_b[r].remove(x)
        t[r] += x[1].bwd
        orders[r].append(("enc_b", x[1]))


def to_actions(llm: Layout, orders: dict[int, list[tuple]], index: BoundaryIndex, active: list[str]) -> dict[int, list[Action]]:
    out: dict[int, list[Action]] = {}
    for r, order in orders.items():
        s, prev, nxt = pipeline_neighbours(llm, r)
        acts: list[Action] = []
        for op in order:
            if op[0] == "enc_f":
                it = op[1]
                acts.append(Action(FORWARD, it.module, it.microbatch))
                acts += index.send_acts(it.module, r, it.microbatch)
            elif op[0] == "enc_b":
                it = op[1]
                acts += index.recv_grads(it.module, r, it.microbatch)
                acts.append(Action(BACKWARD, it.module, it.microbatch))
            elif op[1] == "F":
                j = op[2]
                if s == 0:
                    for mod in active:
                        acts += index.recv_acts(mod, r, j)
                acts += llm_forward_actions(j, s, prev, nxt)
            else:
                j = op[2]
                acts += llm_backward_actions(j, s, prev, nxt)
                if s == 0:
                    for mod in reversed(active):
                        acts += index.send_grads(mod, r, j)
        out[r] = acts
    return out


def _key(rank: int, a: Action, sending: bool) -> tuple:
    """The identity of one message, the same on its sender and its receiver."""
    if a.kind in (SEND, RECV):
        return ("p2p", a.module, a.what, a.microbatch)
    if (a.what == "act") == sending:  # sender of acts / receiver of grads holds the encoder microbatch
        return ("boundary", a.module, a.what, a.microbatch, a.peer_microbatch)
    return ("boundary", a.module, a.what, a.peer_microbatch, a.microbatch)


def align_sends(actions: dict[int, list[Action]]) -> dict[int, list[Action]]:
    """Delay sends (non-blocking, so only ever later) until every earlier message the receiver
    expects from this rank has been posted: per pair, sends follow the receiver's recv order."""
    expected: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for r, acts in actions.items():
        for a in acts:
            if a.kind == RECV or (a.kind == BOUNDARY and a.direction == "recv"):
                expected[(a.peer, r)].append(_key(r, a, sending=False))
    return {r: _align_rank(r, acts, expected) for r, acts in actions.items()}


def _align_rank(r: int, acts: list[Action], expected: dict[tuple[int, int], list[tuple]]) -> list[Action]:
    pos: dict[int, int] = defaultdict(int)
    held: dict[int, dict[tuple, Action]] = defaultdict(dict)
    new: list[Action] = []
    for a in acts:
        if not (a.kind == SEND or (a.kind == BOUNDARY and a.direction == "send")):
            new.append(a)
            continue
        peer, key = a.peer, _key(r, a, sending=True)
        queue = expected[(r, peer)]
        if not held[peer] and pos[peer] < len(queue) and queue[pos[peer]] == key:
            new.append(a)  # already in the receiver's order: the common case
            pos[peer] += 1
            continue
        held[peer][key] = a
        while pos[peer] < len(queue) and queue[pos[peer]] in held[peer]:
            new.append(held[peer].pop(queue[pos[peer]]))
            pos[peer] += 1
    leftover = [a for h in held.values() for a in h.values()]
    if leftover:
        raise ValueError(f"actions[{r}]: {leftover[0]} has no matching recv")
    return new

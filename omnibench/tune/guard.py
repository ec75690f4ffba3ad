"""The guard: the steps of a window a search is tuned on (`regime_batches`), and its answer checked on
every other step of the window it will be kept for, ruled out for the next fastest where it cannot
run one (`_guarded`)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from omnibench.specs.model import MultimodalSpec
from omnibench.tune.results import TuneResult
from omnibench.tune.search import _dp_fields, _Search
from omnibench.tune.space import CP_KINDS_SEARCHED


def regime_batches(batches: list, k: int) -> list:
    """`k` of `batches` (a window of steps) spread over how bursty they are: sorted by the largest
    sample (LLM tokens plus encoder positions: what one rank must hold whole), then by the batch's
    encoder positions, the calmest, the burstiest and evenly between (k=3: calmest, median,
    burstiest); in step order. k=1 keeps the window's first batch (a deployment tuned at its start)."""
    if k >= len(batches):
        return list(batches)
    if k <= 1:
        return list(batches[:1])

    def weight(b) -> tuple[int, int]:
        largest = total = 0
        for s in b.samples:
            enc = sum(seg.encoder_seq_len for seg in s.segments)
            largest = max(largest, s.llm_tokens + enc)
            total += enc
        return largest, total

    ranked = sorted(range(len(batches)), key=lambda i: (weight(batches[i]), i))
    picks = sorted({ranked[round(j * (len(ranked) - 1) / (k - 1))] for j in range(k)})
    return [batches[i] for i in picks]


GUARD_ROUNDS = 2  # searches again with a ruled-out layout's burst among the tuned batches, at most this often


def _package():
    """The package `omnibench.tune` as its importers see it, looked up when called (an import would be a
    circle: the package imports this module). GUARD_ROUNDS here, and `tune` and `tune_converged` in
    converge.py, are read through it, so a patch of one of them on the package (a test's monkeypatch)
    takes effect as it did when the package was one module."""
    return sys.modules[__package__]


def _guarded(search, system: str, model: MultimodalSpec, batches: list, cluster, guard_batches: list,
             kw: dict) -> TuneResult:
    """`search(system, model, batches, cluster, **kw)` (a tune), then its answer checked on every batch
    of `guard_batches` that is not among `batches` (`_Search.guard`, with the search's own memory error
    and stack): a layout that cannot run one of them is ruled out and the next fastest simulated one
    is checked, so the answer runs every step of the window it will be kept for. When every simulated
    layout is ruled out, the batch that ruled out the fastest joins the tuned batches and the search
    runs again (from scratch: its trials were timed on other batches), at most GUARD_ROUNDS times;
    then a one-line ValueError names the step. The regime picks (`regime_batches`) are a proxy for
    the window's bursts; the simulator knows which steps fit (omni on bursty_mix at 1,024 GPUs, tuned
    on 3 regime steps: 80.0 of 80.0 GiB at step 12, dropped from the comparison). The survivor then
    contends with the layouts nearly as fast on the tuned steps over the whole window (`_Search.contend`);
    `TuneResult.best` is the fastest over it."""
    from omnibench.sweep import Sweep
    from simulator.cache import pack

    own = kw.get("sweep") is None
    sweep = kw.get("sweep") or Sweep(workers=1)
    kw = {**kw, "sweep": sweep}
    tuned = list(batches)
    guarded: list[tuple[str, int]] = []
    runs, seconds = 0, 0.0
    rounds = 0
    try:
        while True:
            res = search(system, model, tuned, cluster, **kw)
            t0 = time.perf_counter()
            seen = {pack(b).digest for b in tuned}
            window = []
            for b in guard_batches:
                digest = pack(b).digest
                if digest not in seen:
                    seen.add(digest)
                    window.append(b)
            res.guard_steps = [b.step for b in window]
            steps = ", ".join(str(b.step) for b in tuned)
            if res.best is None and rounds:  # the burst added is more than any layout holds
                raise ValueError(f"tune: no layout of {system} on {cluster.num_gpus} GPUs runs step {tuned[-1].step} "
                                 f"(tuned on steps {steps}; ruled out before: "
                                 + ", ".join(f"{lab} at step {k}" for lab, k in guarded) + ")")
            survivor, out = res.best, []
            if survivor is not None and window:
                dp_fields = _dp_fields(kw.get("dp_mode"), kw.get("mixed_precision", "autocast"), kw.get("freeze", ()))
                check = _Search(system, model, window, cluster, kw.get("profile"), kw.get("options"), sweep,
                                kw.get("use_cache", True), None, None, stack=kw.get("stack", "eager"),
                                dp_fields=dp_fields, memory_error=kw.get("memory_error", 0.0),
                                cp_kinds=kw.get("cp_kinds", CP_KINDS_SEARCHED))
                before = res.seed_note()  # the search's note, on the tuned steps (before any runs the window)
                survivor, out, worst, n = check.guard(list(res.trials), len(tuned))
                guarded += out
                runs += n
                if survivor is not None:
                    seeds = [t for _, t in res.seeded if t is not None]
                    n, contenders_out = check.contend(survivor, res.trials, len(tuned), seeds)
                    runs += n
                    guarded += contenders_out
                    if contenders_out:
                        res.notes.append("window: ruled out " + ", ".join(f"{lab} (step {k})"
                                                                          for lab, k in contenders_out))
                    if res.best is not survivor:
                        res.notes.append(f"window: {res.best.candidate.label()} runs the window's steps in "
                                         f"{res.best.window_s:.3f} s a step, {survivor.candidate.label()} (the "
                                         f"fastest on the tuned steps) in {survivor.window_s:.3f} s")
                    if kw.get("descent", True) and kw.get("encoder_search", True):
                        runs += _window_descent(res, check, tuned)
                    # the seed note of the search, judged again over the window
                    if before in res.notes:
                        res.notes.remove(before)
                    if (note := res.seed_note()) is not None:
                        res.notes.append(note)
                res.trials.sort(key=lambda t: (not t.fits, t.step_s, t.candidate.label()))
                if out:
                    res.notes.append("guard: ruled out " + ", ".join(f"{lab} (step {k})" for lab, k in out)
                                     + (f"; {survivor.candidate.label()} runs every step" if survivor else ""))
            seconds += res.seconds + time.perf_counter() - t0
            if survivor is not None or (res.best is None and not out):
                res.guarded, res.guard_simulations, res.seconds = guarded, runs, seconds
                return res
            if rounds == _package().GUARD_ROUNDS:
                lab, k = out[0]
                why = next(t.note for t in res.trials if t.candidate.label() == lab)
                raise ValueError(f"tune: no layout of {system} on {cluster.num_gpus} GPUs that the search simulated "
                                 f"runs every step of the window (tuned on steps {steps}; the fastest, {lab}, "
                                 f"at {why})")
            tuned = tuned + [worst]
            if "known" in kw:  # trials timed on the batches before: not this search's verdicts
                kw["known"] = None
            rounds += 1
    finally:
        if own:
            sweep.close()


def _window_descent(res: TuneResult, check: _Search, tuned: list) -> int:
    """The neighbour descent (`_Search.neighbour_descent`) around the window's answer, each layout timed
    over the whole window (the `tuned` steps and `check`'s): the search's own descent ran around its
    fastest layout on the tuned steps, which the guard may have ruled out, so the layout it kept had no
    descent of its own (spatial on bursty_mix: a fallback that recomputes the LLM in full, 14% slower
    than a layout one change further that holds the burst). A layout faster over the window joins
    `res.trials` with its tuned-step time (`step_s`) and its window mean (`window_s`), and is then
    `res.best`. Answers the step simulations it ran."""
    base = res.best
    whole = check.over(list(tuned) + list(check.batches))
    # what the window has judged already: its mean over the window as the step, or ruled out
    for t in res.trials:
        if t.window_s > 0:
            whole.done[t.candidate] = replace(t, step_s=t.window_s)
        elif t.guard_step is not None:
            whole.done[t.candidate] = replace(t)
    known = set(whole.done)
    said: list[str] = []
    found = whole.neighbour_descent(whole.done[base.candidate], said)
    res.notes += [f"window {note}" for note in said]
    runs = len(set(whole.done) - known) * len(whole.batches)
    if found.candidate == base.candidate:
        return runs
    # its steps on the tuned batches alone (the step cache answers them: the descent ran them)
    mine = next((t for t in res.trials if t.candidate == found.candidate), None)
    if mine is None:
        mine = check.over(tuned)._evaluate([found.candidate])[0]
        runs += len(tuned)
        res.trials.append(mine)
        res.evaluated[found.candidate] = mine
        res.simulated += 1
    mine.window_s = found.step_s
    res.notes.append(f"window descent: {found.candidate.label()} runs the window's steps in {found.step_s:.3f} s "
                     f"a step, {base.candidate.label()} (the window's answer before it) in {base.window_s:.3f} s")
    return runs

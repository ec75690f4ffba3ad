"""`omnibench reproduce` tells where it is (stage k of N, what it runs, time left), resumes where it
stopped, says when something was not produced (exit 1), and leaves no temporary folder behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_runtime_cli import alive

from omnibench.cli import report

SYSTEMS = ["homogeneous", "temporal", "colocated", "noncolocated", "omni"]

REPO = Path(__file__).resolve().parent.parent


def _cheap_stages(bad: Path):
    def stages(runs_dir, sims_dir, systems, quick, repeat=1, tune_budget=0, sweep=None, extended=False):
        return [
            report.Stage("a", "list the workloads", ["workloads", "list"], 2.0),
            report.Stage("b", "a stage that fails until its input exists",
                         ["plot", "throughput", str(bad), "--out", str(sims_dir)], 2.0),
            report.Stage("c", "list the models", ["models", "list"], 2.0),
        ]
    return stages


@pytest.mark.timeout(180)
def test_reproduce_prints_each_stage_with_time_left_and_resumes_only_what_did_not_finish(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    bad = tmp_path / "nothing-here"
    monkeypatch.setattr(report, "_stages", _cheap_stages(bad))
    runs, sims, log = tmp_path / "runs", tmp_path / "sims", []
    report._produce(runs, sims, ["omni"], quick=True, resume=False, log=log)
    out = capsys.readouterr()
    assert "[1/3] list the workloads (about 6 s left)" in out.out
    assert "[2/3] a stage that fails" in out.out and "[3/3] list the models" in out.out
    assert "failed" in out.err
    assert sorted(json.loads((sims / "reproduce-stages.json").read_text())) == ["a", "c"]
    assert [x.startswith("FAILED") for x in log] == [False, True, False]

    log = []
    report._produce(runs, sims, ["omni"], quick=True, resume=True, log=log)
    out = capsys.readouterr()
    assert "resuming: 2 of 3 stages already done" in out.out
    assert "[1/3]" not in out.out and "[2/3]" in out.out and "[3/3]" not in out.out
    assert len(log) == 1


def test_time_left_comes_from_the_measured_stages_and_each_kind_keeps_its_own_pace(tmp_path, monkeypatch):
    """A stage the committed reproduce timed is estimated at its measured time (else its formula), and
    the CPU runs' pace (faster than estimated here) does not shorten the simulations' estimate."""
    times = tmp_path / "reproduce-stages.csv"
    times.write_text("stage,seconds,note\r\nrun-x,4.0,\r\ntuned-y,300.0,\r\n")
    monkeypatch.setattr(report, "STAGE_TIMES", times)
    stages = report._measured([report.Stage("run-x", "", [], 10.0), report.Stage("tuned-y", "", [], 100.0),
                               report.Stage("sim-z", "", [], 50.0)])
    assert [st.estimate_s for st in stages] == [4.0, 300.0, 50.0]
    # the run took half its estimate: the runs left are paced at 0.5, the simulations at 1 (none run yet)
    spent, estimated = {"run": 2.0, "sim": 0.0}, {"run": 4.0, "sim": 0.0}
    assert report._time_left(stages, spent, estimated) == 2.0 + 300.0 + 50.0
    spent["sim"], estimated["sim"] = 600.0, 300.0  # then a simulation took twice its estimate
    assert report._time_left(stages[1:], spent, estimated) == 2 * (300.0 + 50.0)
    raw = [report.Stage("run-x", "", [], 10.0)]
    assert [st.estimate_s for st in report._measured(raw, quick=True)] == [10.0]  # --quick's run-x does less
    monkeypatch.setattr(report, "STAGE_TIMES", tmp_path / "absent.csv")  # nothing measured: the formulas
    assert [st.estimate_s for st in report._measured(raw)] == [10.0]


def test_the_committed_stage_times_name_every_stage_of_the_default_plan(tmp_path):
    """The progress line's estimates are the committed reproduce's times: a stage added or renamed
    without a measured time would fall back to a formula that was 2x off."""
    stages = report._stages(tmp_path / "runs", tmp_path / "sims", SYSTEMS, quick=False)
    measured = report._stage_seconds(report.STAGE_TIMES)
    missing = [st.key for st in stages if st.key not in measured]
    assert not missing, f"results/reproduce-stages.csv has no time for {missing}: time a reproduce and commit its CSV"


def test_reproduce_reuse_without_the_data_for_a_figure_exits_1_naming_it(tmp_path, capsys):
    for d in ("runs/reproduce", "sims/reproduce"):
        (tmp_path / d).mkdir(parents=True)
    # an earlier reproduce's figures (an --extended size among them): with no data for them now they must
    # not stay behind looking current (the documents' tables read the CSVs)
    figs = tmp_path / "figures"
    figs.mkdir()
    stale = [figs / f"{name}.{ext}" for name in ("dynamic", "breakdown_4096", "timeline_measured")
             for ext in ("png", "pdf", "csv")]
    for f in stale:
        f.write_text("from an earlier run")
    with pytest.raises(SystemExit) as e:
        report.reproduce(tmp_path, quick=True, reuse=True)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "figure(s) not drawn" in err and "dynamic" in err and "--resume" in err
    assert (tmp_path / "figures" / "workload.png").is_file()  # what can be drawn still is
    assert not [f.name for f in stale if f.exists()]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; workers use prctl")
def test_a_simulation_stopped_by_sigterm_leaves_no_folder_behind(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "omnibench", "simulate", "-w", "mixed_video", "--gpus",
                             "1024,2048,4096,8192", "--tp", "4", "--recompute", "full", "--out", str(tmp_path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    # the folder being written exists and the sweep's pool has started (on a loaded host the folder can
    # appear before the pool's workers do)
    while (not (list(tmp_path.glob("*.incomplete")) and _children(proc.pid)) and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()  # still simulating
    workers = _children(proc.pid)  # the sweep's pool
    proc.send_signal(signal.SIGTERM)
    # a bound against a hang, not a speed check: quiet, it exits in 0.3 s; on 2 cores at load 10 (the
    # pool's workers stopped mid-simulation, the folder removed) it took more than 30 s once
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    # and no worker outlives it (idle ones used to wait on their queue for good)
    deadline = time.monotonic() + 30  # hang guard while the kernel ends them
    while alive(workers, "omnibench") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers and not alive(workers, "omnibench")


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_reproduce_repeat_runs_each_measured_run_again_under_its_own_folder(tmp_path):
    stages = report._stages(tmp_path / "runs", tmp_path / "sims", ["homogeneous", "omni"], quick=True, repeat=3)
    keys = [st.key for st in stages]
    for s in ("homogeneous", "omni"):
        assert [k for k in keys if k.startswith(f"run-{s}-mixed_video")] == [
            f"run-{s}-mixed_video", f"run-{s}-mixed_video-r1", f"run-{s}-mixed_video-r2"]
    outs = [st.args[st.args.index("--out") + 1] for st in stages if st.key.startswith("run-omni-mixed_video")]
    assert len(set(outs)) == 3


def test_reproduce_tunes_each_system_once_per_workload_and_size_and_reuses_it_for_the_dynamic_and_ablation():
    from pathlib import Path as P

    sims = P("/x/sims")
    stages = report._stages(P("/x/runs"), sims, SYSTEMS, quick=False)
    tuned = [st for st in stages if st.key.startswith("tuned-") and not st.key.endswith("-as-deployed")]
    cache = str(sims / "tuned-layouts.json")
    # each tuned cell again with the baselines as deployed (split by tokens), at the same tuned layouts: the
    # same command (its tune cache key, its seeds) but for the baselines' list, the balancer and the folder
    deployed = {st.key.removesuffix("-as-deployed"): st for st in stages if st.key.endswith("-as-deployed")}
    assert deployed and set(deployed) <= {st.key for st in tuned}
    for key, st in deployed.items():
        full = next(t for t in tuned if t.key == key).args
        a = st.args
        assert a[a.index("--system") + 1] == ",".join(s for s in SYSTEMS if s != "omni")
        assert a[a.index("--out") + 1] == str(sims / "as-deployed") and a[-2:] == ["--option", "balancer=tokens"]
        assert [x for i, x in enumerate(a[:-2]) if i not in (a.index("--system") + 1, a.index("--out") + 1)] == \
            [x for i, x in enumerate(full) if i not in (full.index("--system") + 1, full.index("--out") + 1)]
        assert stages.index(st) == stages.index(next(t for t in tuned if t.key == key)) + 1
    for st in tuned:
        a = st.args
        # the first tune and the ablations that read its answer at the full budget, every later one seeded
        unseeded = st.key.startswith(("tuned-mixed_video-", "tuned-omni-no-")) and "h200" not in st.key
        assert "--tuned" in a and a[a.index("--tune-budget") + 1] == str(report.TUNE_BUDGET // (1 if unseeded else 2))
        assert ("--seed-from" in a) != unseeded
        if not unseeded:
            assert a[a.index("--seed-from") + 1] == str(sims / "seeds" / f"{st.key}.json") and st.prepare
        assert "--tune-fraction" not in a and "--check-convergence" in a  # one wave of layouts, checked at 2x
        assert a[a.index("--tune-cache") + 1] == cache  # one cache: a layout is tuned once, then read
    sweep = {st.args[st.args.index("--workload") + 1]: st for st in tuned if "omni-no" not in st.key
             and st.args[st.args.index("--hardware") + 1] == "h100"}
    assert set(sweep) == {*report.STATIC_WORKLOADS, "bursty_mix", "drifting_video"}
    for st in sweep.values():
        assert st.args[st.args.index("--gpus") + 1] == "1024"
        assert st.args[st.args.index("--system") + 1] == ",".join(SYSTEMS)
    bursty = sweep["bursty_mix"].args
    assert bursty[bursty.index("--steps") + 1] == "16" and bursty[bursty.index("--tune-steps") + 1] == "3"
    assert "--step-stride" in sweep["drifting_video"].args and "--tune-steps" in sweep["drifting_video"].args
    assert all("--tune-steps" not in sweep[w].args for w in report.STATIC_WORKLOADS)  # step 0's batch
    ablation = [st for st in tuned if "omni-no" in st.key]
    assert [st.args[st.args.index("--system") + 1] for st in ablation] == ["omni"] * len(report.SIM_ABLATIONS)
    assert {a for st in ablation for a in st.args if a.startswith("--no-")} == {f"--no-{t}" for t in
                                                                               report.SIM_ABLATIONS}
    # after the sweep of mixed_video, at its first size, with its flags: omni's layout is already in the cache
    assert all(stages.index(st) > stages.index(sweep["mixed_video"]) for st in ablation)
    assert all(st.args[st.args.index("--gpus") + 1] == "1024" for st in ablation)
    keyed = ("--tune-fraction", "--check-convergence", "--hardware", "--model")
    for st in ablation:
        assert [a for a in st.args if a in keyed] == [a for a in sweep["mixed_video"].args if a in keyed]
    small = report._stages(P("/x/runs"), sims, SYSTEMS, quick=False, tune_budget=9)
    assert {st.args[st.args.index("--tune-budget") + 1] for st in small if st.key.startswith("tuned-")} == {"9", "4"}
    share = report._stages(P("/x/runs"), sims, SYSTEMS, quick=False, tune_budget=0)  # 0: a share of each space
    assert all(st.args[st.args.index("--tune-fraction") + 1] == str(report.TUNE_FRACTION) and "--tune-budget" not in
               st.args for st in share if st.key.startswith("tuned-"))


def test_every_seeded_stage_reads_the_answers_of_the_stages_before_it_and_keeps_them_when_resumed(tmp_path):
    from dataclasses import asdict, replace

    from omnibench.cli.simulate import read_seeds
    from omnibench.tune import Candidate

    sims = tmp_path / "sims"
    stages = report._stages(tmp_path / "runs", sims, SYSTEMS, quick=False)
    first = next(st for st in stages if st.key.startswith("tuned-mixed_video-"))
    seeded = [st for st in stages if st.prepare is not None]
    assert seeded and all(stages.index(st) > stages.index(first) for st in seeded)
    assert {st.key.split("-")[0] for st in seeded} == {"tuned", "memory", "conditions", "largest"}
    won = Candidate("omni", tp=1, cp=4, microbatches=1, recompute="vision=full,audio=full")
    cache = sims / "tuned-layouts.json"
    sims.mkdir(parents=True)
    # its answer and runner-up (the entry's prior: its fastest distinct layouts), not its third
    top = [won, replace(won, microbatches=2), replace(won, cp=2)]
    entry = {"system": "omni", "workload": "mixed_video", "gpus": 1024, "hardware": "h100", "model": "omni-7b",
             "memory_error": 0.0, "candidate": asdict(won), "prior": {"top": [asdict(c) for c in top]}}
    cache.write_text(json.dumps({"a": entry, "b": {**entry, "memory_error": 0.2, "prior": None,
                                                   "candidate": asdict(replace(won, tp=2))}}))
    st = seeded[0]
    st.prepare()
    path = Path(st.args[st.args.index("--seed-from") + 1])
    got = read_seeds([path], "omni-7b")  # a layout tuned under a memory error is no seed
    assert [sd.candidate for sd in got] == top[:report.SEEDS_PER_TUNE] and {sd.world for sd in got} == {1024}
    assert [sd.source for sd in got] == ["mixed_video 1,024 h100", "mixed_video 1,024 h100 (runner-up)"]
    cache.write_text(json.dumps({}))  # what a later stage added no longer changes this stage's seeds
    st.prepare()
    assert read_seeds([path], "omni-7b") == got
    largest = [st for st in stages if st.key.startswith("largest-")]
    assert [st.args[st.args.index("--gpus") + 1] for st in largest] == [str(n) for _, n in report.LARGEST]


def test_reproduce_passes_its_sweep_options_to_every_simulation_and_to_no_measured_run():
    from pathlib import Path as P

    args = report.SweepArgs(tune_fraction=0.5, workers=3, ray="auto", no_cache=True)
    stages = report._stages(P("/x/runs"), P("/x/sims"), SYSTEMS, quick=False, sweep=args)
    for st in stages:
        a = ["calibrate"] if callable(st.args) else st.args  # calibrate's args list the finished runs
        if a[0] == "simulate":
            assert "--workers=3" in a and a[a.index("--ray") + 1] == "auto" and "--no-cache" in a
        else:
            assert "--workers=3" not in a and "--ray" not in a  # measured runs run alone


def test_reproduce_writes_the_convergence_of_every_tune(tmp_path):
    cache = tmp_path / "tuned-layouts.json"
    conv = {"budget": 26, "budget_2x": 52, "best_s": 2.0, "best_s_2x": 1.98, "moved": 0.0101, "converged": True}
    cache.write_text(json.dumps({
        "k1": {"system": "omni", "workload": "mixed_video", "gpus": 1024, "label": "tp1 pp1 cp4 mb1 rc-full",
               "space": 102, "simulated": 60, "tune_seconds": 80.0, "tuned_at_steps": [0], "convergence": conv},
        "k2": {"system": "temporal", "workload": "mixed_video", "gpus": 1024, "label": "tp1 pp1 cp4 mb1 rc-none",
               "space": 12, "simulated": 12, "tune_seconds": 9.0, "tuned_at_steps": [0],
               "convergence": {**conv, "moved": 0.05, "converged": False}},
        "old": {"label": "an entry from before the convergence check"}}))
    rows = report.convergence_rows(cache)
    assert [(r["system"], r["converged"]) for r in rows] == [("omni", True), ("temporal", False)]
    assert rows[0]["moved"] == 0.0101 and rows[0]["layout"] == "tp1 pp1 cp4 mb1 rc-full"
    assert report.convergence_rows(tmp_path / "absent.json") == []


@pytest.mark.timeout(180)
def test_an_ablation_whose_kept_layout_stops_fitting_is_an_answer_not_a_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    big = ["simulate", "--workload", "mixed_video", "--system", "omni", "--gpus", "16", "--model", "omni-7b@4L",
           "--tp", "2", "--recompute", "none", "--global-batch-tokens", str(16 * 65536), "--out", str(tmp_path / "o"),
           "--json"]

    def stages(runs_dir, sims_dir, systems, quick, repeat=1, tune_budget=None, sweep=None, extended=False):
        return [report.Stage("abl", "an ablation that does not fit", big, 2.0, no_fit_is_an_answer=True),
                report.Stage("plain", "a simulation that does not fit", big, 2.0)]

    monkeypatch.setattr(report, "_stages", stages)
    runs, sims, log = tmp_path / "runs", tmp_path / "sims", []
    report._produce(runs, sims, ["omni"], quick=True, resume=False, log=log)
    got = capsys.readouterr()
    out, err = " ".join(got.out.split()), " ".join(got.err.split())  # the console wraps at its width
    assert "nothing fits: does not fit: rank" in out and "the ablation's answer" in out
    assert list(json.loads((sims / "reproduce-stages.json").read_text())) == ["abl"]  # the other one failed
    assert json.loads((sims / "reproduce-notes.json").read_text())["abl"].startswith("does not fit: rank")
    assert "GiB of 79.2 GiB" in err and [x.startswith("FAILED") for x in log] == [False, True]


def test_extended_adds_every_cell_the_default_plan_leaves_out_after_it_and_repeats_none():
    """`reproduce --extended`: the static workloads at 4,096 and 8,192 H100s and every
    workload on 1,024 H200s, after every default stage (so a `--resume` after a default reproduce runs only
    them, seeded by all of it), each cell once over both plans."""
    from pathlib import Path as P

    sims = P("/x/sims")
    default = report._stages(P("/x/runs"), sims, SYSTEMS, quick=False)
    stages = report._stages(P("/x/runs"), sims, SYSTEMS, quick=False, extended=True)
    assert [st.key for st in stages[: len(default)]] == [st.key for st in default]
    extra = stages[len(default):]
    assert extra and all(st.key.startswith("extended-") for st in extra)

    def cell(st):
        a = st.args
        return a[a.index("--workload") + 1], int(a[a.index("--gpus") + 1]), a[a.index("--hardware") + 1]

    tuned = [st for st in default if st.key.startswith(("tuned-", "largest-")) and "omni-no" not in st.key]
    before = {cell(st) for st in tuned}
    cells = [cell(st) for st in extra]
    assert len(set(cells)) == len(cells) and not set(cells) & before
    dynamic = set(report.DYNAMIC_RUNS)
    want = {(wl, n, "h100") for wl in report.STATIC_WORKLOADS for n in report.EXTENDED_GPUS} - before
    want |= {(wl, 1024, "h200") for wl in (*report.STATIC_WORKLOADS, *dynamic)} - before
    assert set(cells) == want
    for st in extra:
        a = st.args
        wl, _, hw = cell(st)
        assert a[a.index("--seed-from") + 1] == str(sims / "seeds" / f"{st.key}.json") and st.prepare
        assert "--check-convergence" in a and a[a.index("--system") + 1] == ",".join(SYSTEMS)
        assert a[a.index("--out") + 1] == str(sims / "h200" if hw == "h200" else sims)  # each machine its figure
        assert ("--steps" in a) == (wl in dynamic)

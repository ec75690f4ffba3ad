"""`omnibench run` end to end through the CLI: bad layouts refused before any process starts; a
failing, killed or interrupted run stops every rank and says in one line which rank failed first
(or which signal stopped it) and where its `.incomplete` record is; record folders complete only on
success.

No assertion here is about elapsed time: waits carry generous limits that only guard against hangs
(the launcher's own bound is STOP_GRACE_S after it notices), and the outcome is what is checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnibench.runtime import records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def omnibench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "omnibench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args,field",
    [
        (["--tp", "3"], "tp"),
        (["--nproc", "4", "--dp", "3"], "dp"),
        (["--pp", "8"], "pp"),
        (["--ep", "2"], "ep"),
        (["--nproc", "6", "--cp", "3"], "cp="),
        (["--system", "noncolocated", "--nproc", "4", "--encoder-ranks", "4"], "encoder_ranks"),
        (["--system", "nosuch"], "system"),
        (["--model", "tiny-llm"], "vision encoder"),
        (["--cp", "2", "--cp-kind", "ring"], "cp_kind"),
    ],
    ids=["tp-heads", "world-mismatch", "pp-deeper-than-layers", "ep-dense-model", "cp-heads", "noncolocated-no-llm",
         "unknown-system", "model-without-encoder", "cp-kind-ring"],
)
def test_impossible_layout_exits_2_with_one_line_naming_the_field(tmp_path, args, field):
    if "--system" not in args:
        args = ["--system", "homogeneous", *args]
    out = tmp_path / "run"
    res = omnibench("run", "--device", "cpu", "--out", str(out), *args)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0], res.stderr
    assert not out.exists() and not os.path.exists(str(out) + records.INCOMPLETE)


@pytest.mark.timeout(180)
def test_a_rank_that_raises_ends_the_run_with_one_line_naming_it_and_its_traceback(tmp_path):
    out = tmp_path / "run"
    # The process-group timeout (600 s) is far beyond this call's limit (150 s): the run ends because the
    # launcher stops the other rank, not because a collective timed out.
    res = omnibench("run", "--system", "homogeneous", "--device", "cpu", "--nproc", "2", "--steps", "20",
                    "--inject-failure", "1:1", "--timeout", "600", "--out", str(out), timeout=150)
    assert res.returncode == 1
    assert res.stderr.count("injected failure on rank 1 at step 1") == 1, res.stderr
    report = Path(f"{out}{records.INCOMPLETE}") / "errors" / "rank1.txt"
    assert error_lines(res.stderr) == [
        f"error: rank 1 failed: InjectedFailure: injected failure on rank 1 at step 1; traceback in {report}"]
    assert "Traceback" not in res.stderr
    text = report.read_text()
    assert "Traceback" in text and "raise InjectedFailure" in text
    # The record folder of a failed run never looks finished.
    assert not out.exists()
    assert os.path.isdir(str(out) + records.INCOMPLETE)


@pytest.mark.timeout(180)
def test_default_run_writes_a_complete_record_with_metrics_plan_and_trace(tmp_path):
    out = tmp_path / "run"
    res = omnibench("run", "--system", "colocated", "--device", "cpu", "--steps", "3", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["record"] == str(out)
    assert not os.path.exists(str(out) + records.INCOMPLETE)
    names = set(os.listdir(out))
    assert {"config.json", "plan_step0.json", "steps.jsonl", "summary.json", "trace.json"} <= names
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["loss"] > 0 and s["tokens_per_s"] > 0 and s["flops"] > 0 and 0 <= s["bubble_fraction"] <= 1
        assert s["planning_s"] > 0 and 0 <= s["waited_s"] <= s["step_time_s"]
    # Step 0 waits for all of its planning (one thread's CPU seconds never exceed its wall seconds);
    # later steps are planned on the planner thread while the step before computes.
    assert steps[0]["waited_s"] >= steps[0]["planning_s"]
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    tracks = {e["tid"] for e in trace if e["ph"] == "X"}
    assert tracks == {0, 1}
    plan = json.loads((out / "plan_step0.json").read_text())
    per_rank = {int(r): len(a) for r, a in plan["actions"].items()}
    for r in (0, 1):
        step0 = [e for e in trace if e["ph"] == "X" and e["tid"] == r and e["args"]["step"] == 0]
        assert len(step0) == per_rank[r]  # one span per planned action
    # Every step's Plan is recorded (one per line, in step order), the first also on its own.
    plans = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    assert [p["step"] for p in plans] == [0, 1, 2] and plans[0] == plan
    # Spans name their action in args: what the simulator's reader needs without parsing names.
    for e in (e for e in trace if e["ph"] == "X"):
        args = e["args"]
        assert set(args) >= {"step", "rank", "kind", "module", "microbatch", "stage", "what", "cpu_s"}
        assert args["rank"] == e["tid"] and args["kind"] == e["cat"] and args["cpu_s"] >= 0
    for step, p in enumerate(plans):
        for r in (0, 1):
            names = [e["name"] for e in sorted((e for e in trace if e["ph"] == "X" and e["tid"] == r
                                                and e["args"]["step"] == step), key=lambda e: e["ts"])]
            assert names == [_action_name(a) for a in p["actions"][str(r)]]
    summary_file = json.loads((out / "summary.json").read_text())
    assert summary_file["torch"] and summary_file["threads_per_rank"] == 1


def _action_name(d: dict) -> str:
    from omnibench.plan import Action

    return str(Action(**d))


def test_an_interrupted_run_keeps_its_incomplete_suffix(tmp_path):
    final = str(tmp_path / "run")
    work = records.start(final)
    assert work.endswith(records.INCOMPLETE) and not os.path.exists(final)
    assert records.complete(work) == final and os.path.isdir(final) and not os.path.exists(work)


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# How a background job of a non-interactive shell starts (CI scripts, `cmd &`): SIGINT ignored. Python
# keeps an inherited SIG_IGN, so such a launcher never gets KeyboardInterrupt.
IGNORE_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                 "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.fixture
def start_run(tmp_path):
    """Starts a 2-rank run far longer than any test waits and returns, once every rank is past its first
    step, (launcher, record folder, rank -> pid). Two ranks: one to fail or be stopped, one to lose its
    peer (a launch of 4 cost these six tests about 40 s more on 2 cores). Whatever is still running at
    teardown is killed, so a failing test leaves no load behind for the rest of the suite."""
    started: list[tuple[subprocess.Popen, dict[int, int]]] = []

    def start(*args: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen, Path, dict[int, int]]:
        out = tmp_path / "run"
        cmd = ["-m", "omnibench", "run", "--system", "homogeneous", "--device", "cpu", "--nproc", "2",
               "--steps", "1000", "--timeout", "600", "--out", str(out), *args]
        cmd = [sys.executable, *(["-c", IGNORE_SIGINT] if sigint_ignored else []), *cmd]
        env = {**os.environ, "PYTHONPATH": REPO, "COLUMNS": "200"}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ranks: dict[int, int] = {}
        started.append((proc, ranks))
        progress = Path(f"{out}{records.INCOMPLETE}") / "progress.jsonl"
        deadline = time.monotonic() + 180  # hang guard: a 2-rank start takes seconds, more on a loaded host
        while not (progress.exists() and progress.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the run never reported a step: {proc.communicate()[1][-2000:]}")
            time.sleep(0.1)
        ranks.update(rank_pids(out))
        return proc, out, ranks

    yield start
    for proc, ranks in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in alive(ranks.values()):
            os.kill(pid, signal.SIGKILL)


def rank_pids(out: Path) -> dict[int, int]:
    found = subprocess.run(["pgrep", "-f", f"omnibench.runtime.worker .*{out}"], capture_output=True, text=True)
    ranks = {}
    for pid in map(int, found.stdout.split()):
        with open(f"/proc/{pid}/environ") as f:
            env = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
        ranks[int(env["RANK"])] = pid
    return ranks


def alive(pids, command: str = "omnibench.runtime.worker") -> list[int]:
    """The pids still running `command` (a rank by default; a zombie has ended: only its exit status
    is left, and a pid reused by another program is not ours)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read()
        except FileNotFoundError:
            continue
        if state != "Z" and command in cmdline:
            out.append(pid)
    return out


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; ranks use prctl")


@linux_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig,args,sigint_ignored",
    [(signal.SIGINT, [], True), (signal.SIGINT, ["--json"], False), (signal.SIGTERM, ["--json"], False)],
    ids=["sigint-from-a-background-shell", "sigint-json", "sigterm-json"],
)
def test_a_signalled_launcher_stops_every_rank_and_names_the_incomplete_record(start_run, sig, args, sigint_ignored):
    proc, out, ranks = start_run(*args, sigint_ignored=sigint_ignored)
    assert sorted(ranks) == [0, 1]
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)  # hang guard only
    assert proc.returncode == 128 + sig, stderr
    assert error_lines(stderr) == [f"error: interrupted by {sig.name}; the partial record is in {out}{records.INCOMPLETE}"]
    assert stdout == ""
    assert not out.exists() and Path(f"{out}{records.INCOMPLETE}").is_dir()
    assert alive(ranks.values()) == []  # the launcher reaped every rank before it exited


@linux_only
@pytest.mark.timeout(300)
def test_a_rank_killed_with_sigkill_is_named_and_the_others_are_stopped(start_run):
    proc, out, ranks = start_run("--json")
    os.kill(ranks[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)  # hang guard only
    assert proc.returncode == 1, stderr
    # Not one of the ranks that lost their peer: the one that was killed.
    assert error_lines(stderr) == [f"error: rank 1 was killed by SIGKILL; the partial record is in {out}{records.INCOMPLETE}"]
    assert stdout == ""
    assert not out.exists() and Path(f"{out}{records.INCOMPLETE}").is_dir()
    assert alive(ranks.values()) == []


@linux_only
@pytest.mark.timeout(300)
def test_a_launcher_killed_outright_takes_its_ranks_with_it(start_run):
    proc, out, ranks = start_run("--json")
    proc.kill()
    proc.communicate(timeout=120)
    # Nobody is left to stop the ranks: the kernel does, as the launcher dies (worker.py: PR_SET_PDEATHSIG).
    deadline = time.monotonic() + 60  # hang guard while the kernel tears them down
    while alive(ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(ranks.values()) == []
    assert not out.exists() and Path(f"{out}{records.INCOMPLETE}").is_dir()


@linux_only
@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_long_before_the_collective_timeout_not_the_ranks_waiting_on_it(start_run):
    """SIGSTOP on rank 1: the healthy ranks wait for it in a collective (--timeout 600 s, longer than this
    test may take), so only the launcher's watch of the ranks can end the run, and it must blame rank 1."""
    proc, out, ranks = start_run("--json")
    os.kill(ranks[1], signal.SIGSTOP)
    stdout, stderr = proc.communicate(timeout=240)  # hang guard only: the collective timeout is 600 s
    assert proc.returncode == 1, stderr
    assert error_lines(stderr) == [
        f"error: rank 1 stopped making progress: it was stopped by a signal (SIGSTOP or SIGTSTP) for 2 s while the "
        f"other ranks waited for it; the partial record is in {out}{records.INCOMPLETE}"]
    assert alive(ranks.values()) == []  # the stopped rank too (SIGTERM + SIGCONT, then SIGKILL)


@linux_only
@pytest.mark.timeout(300)
def test_an_interrupted_runs_folder_says_what_ran_and_is_never_written_into_again(start_run):
    proc, out, ranks = start_run("--json")
    work = Path(f"{out}{records.INCOMPLETE}")
    # A second run into the same --out while the first is live: refused, nothing of the first touched.
    second = omnibench("run", "--system", "temporal", "--device", "cpu", "--steps", "1", "--out", str(out))
    assert second.returncode == 2 and error_lines(second.stderr) == [
        f"error: out: {out} is in use: another run (pid {proc.pid}) is writing {work}; wait for it or give another "
        "--out"]
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and not out.exists()
    # What ran, how, from which code, and every step that finished.
    config = json.loads((work / "config.json").read_text())
    assert config["finished"] is False and config["run"]["system"] == "homogeneous" and config["run"]["steps"] == 1000
    assert config["provenance"]["command"].startswith("omnibench run --system homogeneous")
    assert {"commit", "dirty", "torch", "hostname"} <= set(config["provenance"])
    finished = [json.loads(line) for line in (work / "progress.jsonl").read_text().splitlines()]
    assert finished and [s["step"] for s in finished] == list(range(len(finished)))
    assert all({"loss", "step_time_s", "tokens", "plan"} <= set(s) for s in finished)
    plans = (work / "plans.jsonl").read_text().splitlines()
    assert len(plans) >= len(finished) and json.loads(plans[0])["step"] == 0
    # The stale folder is never reused, and validate / calibrate say what it is.
    again = omnibench("run", "--system", "homogeneous", "--device", "cpu", "--steps", "1", "--out", str(out))
    assert again.returncode == 2 and "is left from an unfinished run" in again.stderr
    for cmd in (["validate", str(work)], ["calibrate", str(work), "--out", str(out.parent / "p.json")]):
        res = omnibench(*cmd)
        assert res.returncode == 2, res.stderr
        assert "unfinished run" in res.stdout and "of 1000 steps finished" in res.stdout, res.stdout
        assert "no plan" not in res.stdout + res.stderr

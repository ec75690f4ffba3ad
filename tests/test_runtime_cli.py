"""`omnibench run` end to end through the CLI: bad layouts refused before any process starts, a
failing rank ends the run within seconds with its error printed once, record folders complete
only on success."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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
    ],
    ids=["tp-heads", "world-mismatch", "pp-deeper-than-layers", "ep-dense-model", "cp-heads", "noncolocated-no-llm",
         "unknown-system", "model-without-encoder"],
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


@pytest.mark.timeout(120)
def test_a_rank_that_raises_ends_the_run_within_seconds_with_its_error_once(tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    res = omnibench("run", "--system", "homogeneous", "--device", "cpu", "--nproc", "2", "--steps", "20",
                    "--inject-failure", "1:1", "--timeout", "300", "--out", str(out))
    elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert res.stderr.count("injected failure on rank 1 at step 1") == 1, res.stderr
    assert "rank 1 failed" in res.stderr
    # Far below the 300 s process-group timeout: the launcher stops the healthy rank itself.
    assert elapsed < 60
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


@pytest.mark.timeout(120)
def test_a_run_interrupted_mid_way_stays_incomplete_and_leaves_no_ranks_behind(tmp_path):
    import signal

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "omnibench", "run", "--system", "homogeneous", "--device", "cpu",
                             "--steps", "200", "--out", str(out), "--json"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = tmp_path / ("run" + records.INCOMPLETE) / "progress.jsonl"
    deadline = time.monotonic() + 90
    while not (progress.exists() and progress.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert progress.exists(), "the run never reported a step"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert not out.exists() and (tmp_path / ("run" + records.INCOMPLETE)).is_dir()
    ranks = subprocess.run(["pgrep", "-f", f"omnibench.runtime.worker .*{out}"], capture_output=True, text=True)
    assert ranks.stdout.strip() == ""

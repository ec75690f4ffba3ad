"""omni through the CLI: `omnibench plan` shows what each technique decided, the ablation flags reach
the planner, bad options fail with one line, and `omnibench run --system omni` trains."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def omnibench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnibench", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(60)
def test_plan_shows_long_short_reorder_reshard_and_schedule():
    res = omnibench("plan", "--system", "omni", "--workload", "mixed_video", "--nproc", "4")
    assert res.returncode == 0, res.stderr
    for word in ("long_short", "threshold_s", "reorder", "max_over_mean_after", "reshard",
                 "llm_tokens_per_data_rank", "schedule", "encoder_actions_by_phase", "placement"):
        assert word in res.stdout, word


@pytest.mark.timeout(60)
def test_ablation_flags_reach_the_plan():
    res = omnibench("plan", "--system", "omni", "--nproc", "4", "--pp", "2", "--no-joint-pipeline", "--no-reorder",
                    "--no-reshard", "--no-long-short-sp", "--no-llm-long-short", "--option", "reorder_group=2", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    opts = plan["options"]
    assert (opts["joint_pipeline"], opts["reorder"], opts["reshard"], opts["long_short_sp"],
            opts["llm_long_short"]) == (False,) * 5
    assert opts["reorder_group"] == 2
    assert plan["notes"]["schedule"]["order"] == "all_ahead"
    assert plan["notes"]["reshard"]["samples_moved_off_loader"] == 0


@pytest.mark.timeout(60)
def test_bad_option_is_one_line_error():
    res = omnibench("plan", "--system", "omni", "--nproc", "4", "--option", "reorder_group=lots")
    assert res.returncode == 2
    assert "reorder_group must be a positive integer" in res.stderr + res.stdout
    res = omnibench("plan", "--system", "omni", "--nproc", "4", "--option", "novel")
    assert res.returncode == 2
    assert "--option must look like key=value" in res.stderr + res.stdout


@pytest.mark.timeout(120)
def test_run_omni_with_an_ablation_records_it_and_the_loaders_metadata_exchange(tmp_path):
    out = tmp_path / "run"
    res = omnibench("run", "--system", "omni", "--device", "cpu", "--nproc", "2", "--steps", "2", "--workload",
                    "mixed_video", "--no-reshard", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    assert json.loads((out / "config.json").read_text())["run"]["options"] == {"reshard": False}
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("cat") == "metadata"]
    seen = {(e["args"]["rank"], e["args"]["step"], e["name"]) for e in spans}
    assert seen == {(r, s, f"metadata(loader, {w})") for r in (0, 1) for s in (0, 1) for w in ("reorder", "plan")}
    assert all(e["dur"] > 0 for e in spans)
    for r in (0, 1):  # step 1's exchange ran on the loader track while step 0 computed
        step0 = [e for e in events if e.get("ph") == "X" and e["args"]["rank"] == r and e["args"]["step"] == 0
                 and e["cat"] != "metadata"]
        ahead = [e for e in spans if e["args"]["rank"] == r and e["args"]["step"] == 1]
        assert min(e["ts"] for e in ahead) < max(e["ts"] + e["dur"] for e in step0)
        assert {e["tid"] for e in ahead} == {100_000 + r} and all(e["tid"] == r for e in step0)
    plan = json.loads((out / "plan_step0.json").read_text())
    head = [a for a in plan["actions"]["0"][:2]]
    assert [(a["kind"], a["what"]) for a in head] == [("metadata", "reorder"), ("metadata", "plan")]
    assert all(a["nbytes"] > 0 for a in head)


@pytest.mark.timeout(60)
def test_plan_shows_the_llm_long_short_split_and_its_switch():
    res = omnibench("plan", "--system", "omni", "--workload", "long_video", "--nproc", "4", "--tp", "1", "--json",
                    "--option", "llm_split=always")  # tiny sizes: the per-batch estimate would keep samples whole
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    notes = plan["notes"]["llm_long_short"]
    assert notes["group_size"] == 2 and notes["long_samples"] and plan["notes"]["acted"]["llm_long_short"] > 0
    assert plan["options"]["long_short"]["llm_leaders"]
    res = omnibench("plan", "--system", "omni", "--workload", "long_video", "--nproc", "4", "--tp", "1", "--json",
                    "--option", "llm_long_short=false")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["notes"]["llm_long_short"]["long_samples"] == []


@pytest.mark.timeout(60)
def test_plan_takes_the_cp_kind_and_a_bad_llm_split_is_a_one_line_error():
    res = omnibench("plan", "--system", "homogeneous", "--nproc", "4", "--cp", "2", "--cp-kind", "allgather", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["layouts"]["llm"]["cp_kind"] == "allgather"
    res = omnibench("plan", "--system", "omni", "--nproc", "4", "--option", "llm_split=sometimes")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(lines) == 1 and "llm_split" in lines[0] and "auto, always" in lines[0], res.stderr

"""`omnibench workloads list | show | batch` through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from omnibench.cli import app
from workloads import workload_names

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["workloads", *args])


def test_list_names_every_workload_with_description():
    r = _run("list", "--json")
    assert r.exit_code == 0
    items = json.loads(r.stdout)
    assert sorted(items) == workload_names()
    assert all(items.values())
    r = _run("list")
    assert r.exit_code == 0 and "mixed_video" in r.stdout and "llava_ov" in r.stdout


def test_show_json_is_one_document_showing_the_mix_drift_of_mixed_video():
    r = _run("show", "mixed_video", "--steps", "200", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)  # nothing else on stdout
    assert d["workload"] == "mixed_video" and d["steps_drawn"] == 200
    first, last = d["first_window"], d["last_window"]
    assert (
        last["modalities"]["video"]["share_of_samples"]
        > first["modalities"]["video"]["share_of_samples"] + 0.15
    )
    assert (
        last["modalities"]["video"]["llm_tokens_p50"] > 1.5 * first["modalities"]["video"]["llm_tokens_p50"]
    )
    w0, w1 = d["mix_over_steps"][0]["weights"], d["mix_over_steps"][-1]["weights"]
    assert w1["long_video"] > w0["long_video"] and w1["caption"] < w0["caption"]
    video = d["overall"]["modalities"]["video"]
    assert (
        video["llm_tokens"]["p10"]
        <= video["llm_tokens"]["p50"]
        <= video["llm_tokens"]["p90"]
        <= video["llm_tokens"]["p99"]
        <= video["llm_tokens"]["max"]
    )
    assert video["encoder_seq_len"]["p50"] == pytest.approx(4 * video["llm_tokens"]["p50"], rel=0.05)
    work = d["overall"]["batch_variation"]["encoder_work_tflop"]
    assert work["max"] >= work["min"] > 0 and work["max_over_min"] >= 1 and work["cv"] > 0
    assert "FLOPs" in d["encoder_work_definition"]
    assert len(d["per_batch"]) == 200


def test_show_human_output_has_the_tables():
    r = _run("show", "omni_av", "--steps", "40", "--global-batch-tokens", "32768", "--length-scale", "0.5")
    assert r.exit_code == 0, r.output
    for text in (
        "mixture by phase",
        "pretrain_8k",
        "long_context_32k",
        "LLM tokens per segment",
        "encoder sequence length",
        "how much batches differ",
        "first window",
        "audio",
    ):
        assert text in r.stdout


def test_show_unknown_workload_is_a_one_line_error_with_exit_code_2():
    r = _run("show", "nope")
    assert r.exit_code == 2
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "unknown name 'nope'" in lines[0] and "mixed_video" in lines[0]


def test_show_bad_option_value_is_a_one_line_error():
    r = _run("show", "text_only", "--length-scale", "-1")
    assert r.exit_code == 2 and "length_scale" in r.output


def test_show_plot_writes_a_figure(tmp_path):
    out = tmp_path / "fig.png"
    r = _run("show", "bursty_mix", "--steps", "30", "--global-batch-tokens", "16384", "--plot", str(out))
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 20_000 and out.read_bytes()[:4] == b"\x89PNG"


def test_show_accepts_a_trace_file(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"segments": [{"modality": "audio", "seconds": 30}]}) + "\n")
    r = _run("show", str(p), "--steps", "3", "--global-batch-size", "4", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["overall"]["modalities"]["audio"]["llm_tokens"]["p50"] == 750


def test_batch_prints_the_steps_samples_as_json_lines():
    r = _run("batch", "omni_av", "--step", "5", "--global-batch-size", "7")
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 7 and rows[0]["sample_id"] == 5 * (1 << 20)
    from workloads import Sample, WorkloadStream

    expected = WorkloadStream("omni_av", global_batch_size=7).batch(5).samples
    assert [Sample.from_dict(x) for x in rows] == expected


@pytest.mark.parametrize("cmd", ["list", "show", "batch"])
def test_every_command_has_help_with_examples(cmd):
    r = _run(cmd, "--help")
    assert r.exit_code == 0 and "Examples" in r.stdout and "omnibench workloads" in r.stdout


def test_show_start_draws_consecutive_steps():
    r = _run(
        "show", "bursty_mix", "--start", "40", "--steps", "25", "--global-batch-tokens", "8192", "--json"
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [p["step"] for p in d["per_batch"]] == list(range(40, 65))

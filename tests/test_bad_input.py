"""Bad input gets exit status 2 and one line naming the field (and the file or folder), never a
traceback, and never a result built on it: one test per kind of bad input that needs no
running ranks (the faults of running runs are in test_runtime_cli.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_errors import invoke, one_error_line

from omnibench.runtime import records

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]




# -- model, hardware and workload files: numbers that are not finite or not in range ------------------
LLM = 'name = "x"\nlayers = 2\nhidden = 64\nheads = 4\nkv_heads = 4\nffn = 128\nvocab = 100\n'


@pytest.mark.parametrize(("extra", "needle"), [
    ("rope_theta = nan", "llm.rope_theta must be a finite number"),
    ("rope_theta = inf", "llm.rope_theta must be a finite number"),
    ("norm_eps = -1", "llm.norm_eps must be > 0"),
    ("head_dim = -2", "llm.head_dim must be >= 0"),
], ids=["rope-nan", "rope-inf", "eps-negative", "head-dim-negative"])
def test_a_model_file_with_a_number_out_of_range_is_refused_naming_the_file_and_field(tmp_path, extra, needle):
    path = tmp_path / "m.toml"
    path.write_text("[llm]\n" + LLM + extra + "\n")
    line = one_error_line(invoke("models", "show", str(path)), needle)
    assert str(path) in line


def test_model_errors_name_the_fields_the_user_set_not_derived_ones(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[llm]\n" + LLM.replace("hidden = 64", "hidden = 100") + "\n")
    line = one_error_line(invoke("models", "show", str(path)), "llm.hidden / llm.heads (100 / 4 = 25")
    assert "head dim (" not in line.split("llm.hidden")[0]
    path.write_text("[llm]\n" + LLM + "[llm.moe]\nexperts = 0\ntop_k = 1\nexpert_ffn = 8\n")
    one_error_line(invoke("models", "show", str(path)), "llm.moe.experts must be >= 1")


@pytest.mark.parametrize(("line", "needle"), [
    ("peak_tflops = nan", "gpu.peak_tflops must be a positive finite number"),
    ("memory_bandwidth_gbs = inf", "gpu.memory_bandwidth_gbs must be a positive finite number"),
], ids=["peak-nan", "bandwidth-inf"])
def test_a_hardware_file_with_nan_or_inf_is_refused_naming_the_file_and_field(tmp_path, line, needle):
    import re

    text = (REPO / "simulator" / "data" / "hardware" / "h100.toml").read_text()
    key = line.split(" = ")[0]
    text, n = re.subn(rf"^{key}\s*=.*$", line, text, count=1, flags=re.M)
    assert n == 1
    path = tmp_path / "hw.toml"
    path.write_text(text)
    out = one_error_line(invoke("simulate", "-w", "mixed_video", "-s", "homogeneous", "--gpus", "8", "--hardware",
                                str(path), "--out", str(tmp_path / "sims")), needle)
    assert str(path) in out
    assert not (tmp_path / "sims").exists() or not list((tmp_path / "sims").iterdir())


WORKLOAD = """name = "w"
total_steps = 100
{top}
[sources.caption]
text_tokens = "sharegpt4v_caption_tokens"
images = 1
image_pixels = "coco_pixels"
[schedule]
kind = "constant"
weights = {{ caption = 1.0 }}
{schedule}
"""


@pytest.mark.parametrize(("top", "schedule", "needle"), [
    ("", "length = { caption = 1e300 }", "schedule.length.caption: must be a number in (0, 1000]"),
    ("max_sample_tokens = 100000000000000000", "", "max_sample_tokens: must be a positive integer (at most"),
    ("max_sample_tokens = 1e17", "", "max_sample_tokens: must be a positive integer"),
], ids=["length-1e300", "cap-1e17-int", "cap-1e17-float"])
def test_a_workload_file_with_an_absurd_size_is_refused_naming_the_file_and_field(tmp_path, top, schedule, needle):
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD.format(top=top, schedule=schedule))
    line = one_error_line(invoke("workloads", "show", str(path), "--steps", "2"), needle)
    assert str(path) in line


# -- flags ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "needle"), [
    (["--encoder-sp", "-1"], "encoder_sp must be 0 (the system's default) or a positive integer, got -1"),
    (["--encoder-sp", "3"], "encoder_sp=3 does not divide vision heads (16)"),
    (["--encoder-tp", "-2"], "encoder_tp"),
], ids=["encoder-sp-negative", "encoder-sp-heads", "encoder-tp-negative"])
def test_bad_encoder_layout_flags_of_simulate_are_one_line_naming_the_field(tmp_path, flags, needle):
    one_error_line(invoke("simulate", "-w", "mixed_video", "-s", "omni", "--gpus", "16", *flags, "--out",
                          str(tmp_path)), needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("gpus", "needle"), [
    ("99999999999", "gpus must be a comma-separated list of positive integers (at most 1,048,576)"),
    ("64,,128", "which has an empty item"),
    ("500000", "gpus: 500,000 GPUs make a global batch of 8,192 x 500,000"),
], ids=["too-many", "empty-item", "batch-from-gpus"])
def test_bad_gpu_counts_are_refused_naming_gpus_not_a_derived_field(tmp_path, gpus, needle):
    line = one_error_line(invoke("simulate", "-w", "mixed_video", "--gpus", gpus, "--out", str(tmp_path)), needle)
    assert not line.startswith("error: global_batch_tokens")
    assert list(tmp_path.iterdir()) == []


def test_tune_and_plan_refuse_absurd_rank_counts_in_one_line():
    one_error_line(invoke("tune", "-s", "homogeneous", "-w", "mixed_video", "--gpus", "99999999999"),
                   "gpus must be at most 1,048,576")
    one_error_line(invoke("plan", "--system", "homogeneous", "--nproc", "99999999999"), "nproc must be")
    one_error_line(invoke("run", "--system", "homogeneous", "--nproc", "99999999999"), "nproc must be at most 1,024")


@pytest.mark.parametrize("command", [
    ["run", "--system", "homogeneous", "--device", "cpu"],
    ["plan", "--system", "omni"],
    ["simulate", "-w", "mixed_video", "--gpus", "8"],
], ids=["run", "plan", "simulate"])
def test_an_option_without_equals_is_refused_in_one_line(tmp_path, command):
    one_error_line(invoke(*command, "--option", "foo", "--out" if command[0] != "plan" else "--json",
                          *([str(tmp_path / "o")] if command[0] != "plan" else [])), "--option must look like key=value")


@pytest.mark.parametrize(("content", "needle"), [
    (None, "batches_file: cannot read"),
    ("{not json", "is not JSON"),
    ('{"step": 0}', "must hold a JSON list of batches"),
    ('[{"step": 0, "samples": [{"sample_id": 1}]}]', "batch 0, sample 0: not a sample"),
    ('[{"step": 0, "samples": []}]', "batch 0 must be"),
    ('[{"step": 0, "samples": [{"sample_id": 1, "source": "s", "segments": [{"modality": "smell", "llm_tokens": 3}]}]}]',
     "modality must be one of"),
], ids=["missing", "not-json", "not-a-list", "not-a-sample", "no-samples", "bad-modality"])
def test_a_missing_or_malformed_batches_file_is_refused_before_any_rank_starts(tmp_path, content, needle):
    path = tmp_path / "batches.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "run"
    line = one_error_line(invoke("run", "--system", "homogeneous", "--device", "cpu", "--batches-file", str(path),
                                 "--out", str(out)), needle)
    assert str(path) in line
    assert not out.exists() and not Path(f"{out}{records.INCOMPLETE}").exists()


# -- --out: a file in the way, a folder nobody can write ----------------------------------------------
def _unwritable(tmp_path: Path) -> Path:
    """A folder no process can create: its parent is a file (works as root too, unlike chmod)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "out"


@pytest.mark.parametrize("kind", ["a-file", "unwritable"])
def test_run_and_simulate_refuse_an_out_that_is_a_file_or_unwritable(tmp_path, kind):
    out = _unwritable(tmp_path) if kind == "unwritable" else tmp_path / "taken"
    if kind == "a-file":
        out.write_text("")
    for command in (["run", "--system", "homogeneous", "--device", "cpu"], ["simulate", "-w", "mixed_video", "--gpus", "8"]):
        line = one_error_line(invoke(*command, "--out", str(out)), "error: out: ")
        assert ("is a file" in line) if kind == "a-file" else ("cannot write in" in line or "a-file is a file" in line)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through folder permissions")
def test_simulate_refuses_a_read_only_out_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_error_line(invoke("simulate", "-w", "mixed_video", "--gpus", "8", "--out", str(ro)), "cannot write in")
    finally:
        ro.chmod(0o755)


def test_calibrate_checks_its_out_before_fitting(tmp_path, monkeypatch):
    import simulator.calibrate

    fitted = []
    monkeypatch.setattr(simulator.calibrate, "calibrate", lambda *a, **k: fitted.append(a))
    one_error_line(invoke("calibrate", str(tmp_path), "--out", str(_unwritable(tmp_path) / "p.json")), "cannot write in")
    one_error_line(invoke("calibrate", str(tmp_path), "--out", str(tmp_path)), "is a folder")
    assert fitted == []  # refused before the fit, which an unwritable profile would lose


# -- records: two simulations in one second, strict JSON, folders never reused --------------------------
def test_two_simulations_into_one_out_at_once_both_keep_their_records(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "omnibench", "simulate", "-w", "image_sft", "--gpus", "8", "--global-batch-tokens",
           "32768", "--out", str(tmp_path), "--json"]
    procs = [subprocess.Popen([*cmd, "-s", s], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in ("homogeneous", "homogeneous", "temporal")]
    outs = [p.communicate(timeout=170) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-1000:] for o in outs]
    made = sorted(json.loads(o[0])["record"] for o in outs)
    assert len(set(made)) == 3 and all(Path(m).is_dir() for m in made)
    assert sum("-homogeneous-" in Path(m).name for m in made) == 2 and sum("-temporal-" in m for m in made) == 1


def test_claiming_a_record_name_skips_taken_and_half_written_ones(tmp_path):
    from omnibench.cli.simulate import _claim

    (tmp_path / "rec").mkdir()
    (tmp_path / "rec-2.incomplete").mkdir()
    assert _claim(tmp_path, "rec") == tmp_path / "rec-3" and (tmp_path / "rec-3.incomplete").is_dir()
    assert _claim(tmp_path, "rec") == tmp_path / "rec-4"


def test_record_json_is_strict_a_non_finite_number_is_null(tmp_path):
    path = tmp_path / "summary.json"
    records._write(str(path), {"final_loss": float("nan"), "steps": [{"loss": float("inf")}, {"loss": 1.5}]})

    def refuse(name):
        raise AssertionError(f"bare {name} in {path}")

    got = json.loads(path.read_text(), parse_constant=refuse)
    assert got == {"final_loss": None, "steps": [{"loss": None}, {"loss": 1.5}]}


def test_a_run_folder_is_never_reused_stale_or_in_use(tmp_path):
    final = str(tmp_path / "run")
    work = records.start(final)
    with pytest.raises(FileExistsError, match=rf"in use: another run \(pid {os.getpid()}\)"):
        records.start(final)
    records.release(work)  # the run ended unfinished: its folder is stale now
    with pytest.raises(FileExistsError, match="left from an unfinished run"):
        records.start(final)
    shutil.rmtree(work)
    assert records.complete(records.start(final)) == final
    assert sorted(os.listdir(final)) == []  # no lock or heartbeat left in a finished record
    with pytest.raises(FileExistsError, match="already exists"):
        records.start(final)


# -- several record folders: the bad one is named ------------------------------------------------------
def test_a_bad_config_among_several_record_folders_is_named(tmp_path):
    from omnibench.plots.load import PlotInputError, load

    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps({"command": "simulate", "workload": "mixed_video",
                                                  "systems": ["omni"], "gpus": [8], "hardware": "h100",
                                                  "model": "omni-7b"}))
    (good / "results.json").write_text(json.dumps([{"gpus": 8, "system": "omni", "fits": True, "tokens_per_s": 8.0,
                                                   "tokens_per_s_per_gpu": 1.0}]))
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    (bad / "config.json").write_text(json.dumps({"command": "simulate"}))
    with pytest.raises(PlotInputError, match=f"{bad}/config.json: workload is missing"):
        load([tmp_path])
    (bad / "config.json").write_text("{")
    with pytest.raises(PlotInputError, match=f"{bad}/config.json: cannot read JSON"):
        load([good, bad])

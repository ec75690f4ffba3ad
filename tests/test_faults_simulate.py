"""Faults and bad input on `simulate`, `tune`, `validate` and `calibrate`: one line naming the flag or
file, exit 2 (exit 1 for a full disk), never a traceback, nothing made before the input is checked, no
record that looks complete after a failed write, no prior result lost, a quiet exit after a stopped
process pool, and a step cache that never answers one step with another's outcome."""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path

import pytest
from cli_errors import invoke, one_error_line

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "results" / "validation" / "megatron_a100.csv"
# the smallest simulation the commands take: one system, one size, the 7B model's default layout
SMALL = ["-w", "mixed_video", "-s", "homogeneous", "--gpus", "8", "--workers", "1"]




def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# -- simulate: a full disk, the tune cache's place, input checked before anything is made -----------------
def test_a_full_disk_while_simulate_writes_its_record_is_one_line_and_leaves_no_record(tmp_path, monkeypatch):
    import simulator.traces as traces

    real = traces.write_json_atomic

    def full(path, obj, indent=1):
        if Path(path).name == "results.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj, indent)

    monkeypatch.setattr(traces, "write_json_atomic", full)
    out = tmp_path / "sims"
    line = one_error_line(invoke("simulate", *SMALL, "--out", out), "no space left on the device", code=1)
    assert "writing" in line and str(out) in line
    assert leftovers(out) == []  # neither a record nor its .incomplete folder


@pytest.mark.parametrize("where", ["parent-is-a-file", "a-folder"])
def test_simulate_tuned_with_a_tune_cache_it_cannot_write_is_refused_before_the_tune(tmp_path, monkeypatch, where):
    from omnibench.cli import simulate as sim_cli

    monkeypatch.setattr(sim_cli, "_search", lambda *a, **k: pytest.fail("tuned before checking --tune-cache"))
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "tc.json" if where == "parent-is-a-file" else tmp_path
    out = tmp_path / "sims"
    one_error_line(invoke("simulate", *SMALL, "--tuned", "--tune-budget", "2", "--tune-cache", path, "--out", out),
                   "tune-cache:")
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"), reason="mounts a read-only tmpfs")
def test_simulate_tuned_with_a_tune_cache_on_a_read_only_file_system_is_one_line(tmp_path):
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        line = one_error_line(invoke("simulate", *SMALL, "--tuned", "--tune-budget", "2", "--tune-cache",
                                     ro / "tc.json", "--out", tmp_path / "sims"), "tune-cache: cannot write in")
        assert "Read-only file system" in line
    finally:
        subprocess.run(["umount", str(ro)])


def test_a_repeated_system_is_simulated_once_and_named_once(tmp_path):
    r = invoke("simulate", *SMALL[:2], "-s", "homogeneous,homogeneous", *SMALL[4:], "--out", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert [x["system"] for x in got["results"]] == ["homogeneous"]
    assert "homogeneous+homogeneous" not in got["record"] and "-homogeneous-" in Path(got["record"]).name


@pytest.mark.parametrize(("args", "needle"), [
    (["-m", "{bad}"], "cannot parse model file"),
    (["-w", "nosuch"], "workload: unknown name 'nosuch'"),
    (["--option", "nokey=1"], "option: options.nokey: unknown option"),
    (["--calibration", "{prof}"], "calibration:"),
    (["-s", ","], "system must be one of"),
    (["--gpus", "0"], "gpus must be"),
    (["--gpus", "-8"], "gpus must be"),
    (["--gpus", str(1 << 21)], "gpus must be"),
    (["--steps", "0"], "steps must be a positive integer"),
    (["--workers", "0"], "workers must be a positive integer"),
    (["--workers", "-1"], "workers must be a positive integer"),
], ids=["bad-model-file", "unknown-workload", "unknown-option-key", "garbage-profile", "empty-system-list",
        "gpus-0", "gpus-negative", "gpus-huge", "steps-0", "workers-0", "workers-negative"])
def test_bad_simulate_input_is_refused_before_the_out_folder_is_made(tmp_path, args, needle):
    bad = tmp_path / "bad.toml"
    bad.write_text("junk\n")
    prof = tmp_path / "prof.json"
    prof.write_text('{"hardware": "h100", "compute": [1]}')
    args = [a.format(bad=bad, prof=prof) for a in args]
    base = dict(zip(SMALL[::2], SMALL[1::2], strict=True))
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    out = tmp_path / "NEW"
    line = one_error_line(invoke("simulate", *[x for kv in base.items() for x in kv], "--out", out), needle)
    if "calibration" in needle:
        assert str(prof) in line
    assert not out.exists()


# -- the tune cache: a file that is not one is never overwritten, a damaged entry never trusted ------------
def test_a_tune_cache_that_is_not_a_json_object_is_refused_and_kept(tmp_path):
    path = tmp_path / "tc.json"
    for text, needle in (("[1, 2]", "is not a tune cache"), ('{"a": 1', "cannot read")):
        path.write_text(text)
        one_error_line(invoke("simulate", *SMALL, "--tuned", "--tune-budget", "2", "--tune-cache", path, "--out",
                              tmp_path / "sims"), f"tune-cache: {path}" if "not a" in needle else needle)
        assert path.read_text() == text


def test_a_damaged_tune_cache_entry_is_tuned_again_and_replaced(tmp_path):
    path = tmp_path / "tc.json"
    args = ["simulate", *SMALL, "--tuned", "--tune-budget", "2", "--tune-cache", path, "--out", tmp_path, "--json"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    good = json.loads(path.read_text())
    (key, entry), = good.items()
    assert oct(path.stat().st_mode & 0o777) != "0o600"  # made as open() makes files
    for damaged in ({"bogus": 1}, {**entry["candidate"], "system": "temporal"}):
        path.write_text(json.dumps({key: {**entry, "candidate": damaged}}))
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["results"][0]["tune_seconds"] > 0  # tuned, not read back
        assert json.loads(path.read_text())[key]["candidate"] == entry["candidate"]


# -- --ray: a bad or unreachable address is named in one line, fast -------------------------------------
@pytest.mark.parametrize(("address", "needle"), [
    ("notanaddress", "ray must be auto, local, ray://host:port"),
    ("127.0.0.1:1", "cannot reach the Ray cluster at --ray 127.0.0.1:1"),
    ("ray://127.0.0.1:1", "--ray ray://127.0.0.1:1"),
    ("host:99999", "ray must be"),
])
@pytest.mark.parametrize("command", ["simulate", "tune"])
def test_a_bad_ray_address_is_one_line_naming_the_flag(tmp_path, address, needle, command):
    pytest.importorskip("ray")
    import time

    args = [*SMALL, "--out", tmp_path / "sims"] if command == "simulate" else \
        ["-s", "homogeneous", "-w", "mixed_video", "--gpus", "8"]
    t = time.monotonic()
    one_error_line(invoke(command, *args, "--ray", address), needle)
    assert time.monotonic() - t < 30
    assert not (tmp_path / "sims").exists()


def test_ray_asked_for_where_it_is_not_installed_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    one_error_line(invoke("simulate", *SMALL, "--ray", "local", "--out", tmp_path / "sims"),
                   "needs Ray, which is not installed here")


# -- a process pool stopped by an error or Ctrl-C leaves nothing for the interpreter's exit to join -------
def test_an_aborted_pool_leaves_no_live_manager_thread_for_the_exit_hook(tmp_path):
    import time
    from concurrent.futures import process

    from omnibench.sweep import Sweep

    with pytest.raises(KeyboardInterrupt):
        with Sweep(2) as sweep:
            for _ in range(4):
                sweep._pool.submit(time.sleep, 5)
            raise KeyboardInterrupt
    # concurrent.futures' exit hook writes to each live manager thread's wake-up pipe while that thread
    # may be closing it ("Exception ignored in _python_exit ... Bad file descriptor")
    alive = [t for t in list(process._threads_wakeups) if t.is_alive()]
    assert not alive and not [t for t in threading.enumerate() if "ExecutorManager" in type(t).__name__]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals a child process")
def test_ctrl_c_on_a_pooled_simulate_exits_quietly_without_a_record(tmp_path):
    import signal
    import subprocess
    import time

    out = tmp_path / "sims"
    p = subprocess.Popen([sys.executable, "-m", "omnibench", "simulate", "-w", "mixed_video", "-s",
                          "homogeneous,temporal", "--gpus", "64", "--tuned", "--tune-budget", "40", "--workers", "2",
                          "--no-cache", "--out", str(out)], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(6)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = err.decode()
    if p.returncode == 0:
        pytest.skip("finished before the signal")
    assert p.returncode == 130 and "Exception ignored" not in text and "Traceback" not in text, text
    assert leftovers(out) == []


# -- validate --published: flags checked before the rows are simulated ---------------------------------
@pytest.fixture
def no_rows_simulated(monkeypatch):
    import simulator.published as published

    monkeypatch.setattr(published, "check_row", lambda *a, **k: pytest.fail("a row was simulated"))


@pytest.mark.parametrize("where", ["a-folder", "parent-is-a-file"])
def test_validate_markdown_it_cannot_write_is_refused_before_the_work(tmp_path, no_rows_simulated, where):
    (tmp_path / "file").write_text("x")
    md = tmp_path if where == "a-folder" else tmp_path / "file" / "table.md"
    one_error_line(invoke("validate", "--published", PUBLISHED, "--markdown", md), "markdown:")


def test_validate_markdown_on_a_full_disk_is_one_line_and_keeps_the_old_table(tmp_path, monkeypatch):
    import simulator.published as published
    from omnibench.cli import common

    name = published.load_published(PUBLISHED)[0].name
    md = tmp_path / "table.md"
    md.write_text("the previous table\n")

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(common.os, "fdopen", lambda *a, **k: type("F", (), {"__enter__": lambda s: s,
                                                                           "__exit__": lambda s, *e: None,
                                                                           "write": full})())
    one_error_line(invoke("validate", "--published", PUBLISHED, "--rows", f"^{name}$", "--markdown", md),
                   "no space left on the device", code=1)
    assert md.read_text() == "the previous table\n"
    assert [p.name for p in tmp_path.iterdir()] == ["table.md"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--rows", "["], "rows: '[' is not a regular expression"),
    (["--workers", "0"], "workers must be a positive integer"),
    (["--workers", "-1"], "workers must be a positive integer"),
], ids=["rows-not-a-regex", "workers-0", "workers-negative"])
def test_bad_validate_published_flags_are_one_line(tmp_path, no_rows_simulated, args, needle):
    one_error_line(invoke("validate", "--published", PUBLISHED, *args), needle)


@pytest.mark.parametrize(("content", "needle"), [
    (b"\x7fELF\x02\x01\x01\x00\xd0\xff garbage", "is not a text CSV file"),
    (b"name,source\n" + b"x" * 200_000 + b",y\n", "is not a CSV file (field larger than field limit"),
], ids=["binary", "field-too-large"])
def test_a_published_file_that_is_not_a_csv_is_named(tmp_path, content, needle):
    path = tmp_path / "p.csv"
    path.write_bytes(content)
    one_error_line(invoke("validate", "--published", path), needle)


def test_a_published_measurement_that_is_not_finite_is_refused(tmp_path):
    text = PUBLISHED.read_text().splitlines()
    header = text[0].split(",")
    col = next(c for c in ("tflops_per_gpu", "step_time_s", "mfu") if c in header)
    i = header.index(col)
    row = next(ln for ln in text[1:] if ln.strip() and not ln.startswith("#") and ln.split(",")[i].strip())
    cells = row.split(",")
    cells[i] = "nan"
    path = tmp_path / "p.csv"
    path.write_text(text[0] + "\n" + ",".join(cells) + "\n")
    one_error_line(invoke("validate", "--published", path), f"{col} must be a positive number, got 'nan'")


def test_validate_flags_of_published_only_need_published(tmp_path):
    one_error_line(invoke("validate", tmp_path, "--markdown", tmp_path / "t.md"), "markdown: applies to --published")


# -- validate and calibrate over run records ----------------------------------------------------------
@pytest.fixture
def run_record(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from test_simulator_calibrate import TRUE, write_record
    finally:
        sys.path.remove(str(REPO / "tests"))
    d = tmp_path / "run0"
    write_record(d, "homogeneous", 3, 6, TRUE)
    return d


@pytest.mark.parametrize("command", ["validate", "calibrate"])
def test_a_garbage_steps_jsonl_is_named_with_its_line(tmp_path, run_record, command):
    (run_record / "steps.jsonl").write_text('{"step": 0, "step_time_s": 0.5}\ngarbage\n')
    args = [command, run_record] + (["--out", tmp_path / "p.json"] if command == "calibrate" else [])
    line = one_error_line(invoke(*args), "line 2 is not one step's metrics")
    assert str(run_record / "steps.jsonl") in line
    assert not (tmp_path / "p.json").exists()


def test_calibrate_on_a_full_disk_is_one_line_and_leaves_no_profile(tmp_path, run_record, monkeypatch):
    import simulator.traces as traces

    def full(path, obj, indent=1):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(traces, "write_json_atomic", full)
    out = tmp_path / "p.json"
    one_error_line(invoke("calibrate", run_record, "--out", out), "no space left on the device", code=1)
    assert not out.exists()


def test_validate_over_folders_with_no_finished_run_is_one_line(tmp_path):
    (tmp_path / "x.incomplete").mkdir()
    one_error_line(invoke("validate", tmp_path / "x.incomplete"), "no finished run among the folders given")
    one_error_line(invoke("validate", tmp_path), "no plan")


@pytest.mark.parametrize(("text", "needle"), [
    ('{"hardware": "h100", "compute": [1]}', "AttributeError"),
    ('{"hardware": "h100", "collectives": {"x": {"alpha_s": "abc", "beta_Bps": 1}}}', "ValueError"),
    ("[]", "TypeError"),
    ("garbage", "JSONDecodeError"),
], ids=["compute-a-list", "alpha-a-word", "a-list", "not-json"])
def test_a_garbage_calibration_profile_is_named(tmp_path, run_record, text, needle):
    prof = tmp_path / "prof.json"
    prof.write_text(text)
    line = one_error_line(invoke("validate", run_record, "--calibration", prof), "calibration:")
    assert str(prof) in line and needle in line


# -- the step cache: an entry is trusted only under its own key ------------------------------------------
def test_swapped_step_cache_entries_are_misses_and_are_rewritten(tmp_path):
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from simulator import cache
    from simulator.engine import SimOptions
    from simulator.hardware import load_cluster
    from workloads.stream import WorkloadStream

    def job(tp: int) -> cache.StepJob:
        batch = WorkloadStream("mixed_video", seed=0, global_batch_tokens=16 * 4096).batch(0)
        return cache.StepJob("homogeneous", get_model("omni-7b@4L"), ParallelSpec(world_size=16, tp=tp), batch,
                             load_cluster("h100", 16), options=SimOptions(recompute="full"))

    store = cache.SimCache(tmp_path)
    a, b = job(2), job(4)
    fresh_a, fresh_b = cache.run_step(a, store), cache.run_step(b, store)
    assert fresh_a.result.step_time != fresh_b.result.step_time
    pa, pb = store._path(cache.key(a)), store._path(cache.key(b))
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)
    again = cache.run_step(a, store)
    assert not again.cached and again.result.step_time == fresh_a.result.step_time
    assert cache.run_step(a, store).cached  # rewritten under its own key
    assert store.get(cache.key(b)) is None  # still the other's bytes: never trusted

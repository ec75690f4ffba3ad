"""Faults of `omnibench run` and `omnibench plan`: a value that cannot work (a timeout that is not a
finite number of seconds, a record folder behind a symbolic link that leads nowhere, a torchrun
environment that is not one) is refused in one line naming the field and the allowed values, exit
status 2, before anything is made on disk; a full disk ends the run in one line naming the file and
"no space left on the device", exit status 1, with no record that looks finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from omnibench.cli import app
from omnibench.runtime import launch as launch_module
from omnibench.runtime import records

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
RUN = ("run", "--system", "homogeneous", "--device", "cpu", "--steps", "1")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def error_line(r, needle: str, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output  # no traceback
    assert "Traceback" not in r.output, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.output
    return lines[0]


def nothing_made(out: Path) -> None:
    assert not os.path.lexists(out) and not os.path.lexists(f"{out}{records.INCOMPLETE}")


@pytest.fixture
def no_training(monkeypatch):
    """Any run that gets as far as starting ranks fails the test at once (instead of training for a while)."""
    def refuse(*a, **k):
        raise AssertionError("the run was launched")

    monkeypatch.setattr(launch_module, "launch", refuse)


# -- --timeout: finite, at least a second, at most a day --------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e20", "0", "-5", "0.5"])
def test_a_timeout_that_is_not_a_sane_number_of_seconds_is_refused_before_anything_is_made(tmp_path, value):
    out = tmp_path / "run"
    line = error_line(invoke(*RUN, "--timeout", value, "--out", str(out)), "timeout must be a finite number")
    assert "86,400 (a day)" in line and line.endswith(f"got {float(value)!r}")
    nothing_made(out)


def test_a_config_file_timeout_of_nan_is_refused_the_same_way(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('system = "homogeneous"\ntimeout = nan\n')
    out = tmp_path / "run"
    error_line(invoke("run", "--device", "cpu", "--config", str(config), "--out", str(out)), "got nan")
    nothing_made(out)


# -- --out: a symbolic link that leads nowhere, a record that exists ----------------------------------
@pytest.mark.parametrize("kind", ["dangling", "loop", "finished-record"])
def test_an_out_that_cannot_become_the_record_is_refused_before_training(tmp_path, no_training, kind):
    out = tmp_path / "run"
    if kind == "dangling":
        out.symlink_to(tmp_path / "nowhere")
        needle = f"is a symbolic link to {tmp_path / 'nowhere'}, which does not exist"
    elif kind == "loop":
        out.symlink_to(out)
        needle = "is a symbolic link that loops"
    else:
        out.mkdir()
        (out / "summary.json").write_text("{}")
        needle = "already exists"
    line = error_line(invoke(*RUN, "--out", str(out)), needle)
    assert line.startswith(f"error: out: {out} ")
    assert not os.path.lexists(f"{out}{records.INCOMPLETE}")
    assert os.path.islink(out) or (out / "summary.json").read_text() == "{}"  # left as it was


def test_records_start_refuses_a_dangling_link_too(tmp_path):
    out = tmp_path / "run"
    out.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match="symbolic link"):
        records.start(str(out))
    assert not os.path.lexists(f"{out}{records.INCOMPLETE}")


# -- messages quote the value whole ----------------------------------------------------------------
@pytest.mark.parametrize(("args", "needle"), [
    (("--device", "tpu"), "device must be one of auto, cpu, cuda; got 'tpu'"),
    (("--dtype", "fp64"), "dtype must be one of auto, fp32, bf16; got 'fp64'"),
    (("--mixed-precision", "fp8"), "mixed_precision must be one of autocast, master; got 'fp8'"),
    (("--recompute", "bogus"), "got 'bogus' (or auto)"),
], ids=["device", "dtype", "mixed-precision", "recompute"])
def test_a_value_out_of_its_list_is_quoted_whole_with_the_allowed_values(tmp_path, args, needle):
    line = error_line(invoke(*RUN, *args, "--out", str(tmp_path / "run")), needle)
    assert line.endswith(needle)


def test_plan_quotes_a_bad_value_whole():
    line = error_line(invoke("plan", "--system", "omni", "--encoder-chunk-tokens", "abc"), "got 'abc'")
    assert line.endswith("got 'abc'")


def test_error_text_keeps_quotes_and_unwraps_a_key_error():
    from omnibench.cli.run import error_text

    assert error_text(KeyError("model: got 'x'")) == "model: got 'x'"
    assert error_text(ValueError("got 'tpu'")) == "got 'tpu'"


# -- absurd counts and malformed inputs ------------------------------------------------------------
@pytest.mark.parametrize(("args", "needle"), [
    (("--steps", "99999999999"), "steps must be at most 100,000"),
    (("--inject-failure", "a:b"), "inject_failure must be 'rank:step'"),
], ids=["steps-huge", "inject-failure-not-numbers"])
def test_run_refuses_absurd_or_malformed_values_before_any_rank_starts(tmp_path, args, needle):
    out = tmp_path / "run"
    error_line(invoke(*RUN, *args, "--out", str(out)), needle)
    nothing_made(out)


def test_a_config_file_that_is_not_utf8_text_is_refused_naming_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_bytes(b"\xff\xfe system = 1")
    line = error_line(invoke("run", "--device", "cpu", "--config", str(config)), "not UTF-8 text")
    assert str(config) in line


def test_plan_refuses_a_step_beyond_its_bound():
    error_line(invoke("plan", "--system", "omni", "--step", "99999999999999999999"),
               "step must be an integer from 0 to 1,000,000,000")


# -- a torchrun environment that is not one --------------------------------------------------------
@pytest.mark.parametrize(("env", "needle"), [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE must be an integer >= 1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer from 0 to 1"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "got '5'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"}, "MASTER_PORT must be"),
], ids=["world-size-word", "rank-word", "rank-beyond-world", "port-word"])
def test_a_malformed_torchrun_environment_is_refused_naming_the_variable(tmp_path, monkeypatch, env, needle):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMNIBENCH_LAUNCHER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    line = error_line(invoke(*RUN, "--out", str(out)), needle)
    assert line.startswith("error: environment: ")
    nothing_made(out)


def test_a_torchrun_rank_whose_rank_0_never_comes_ends_in_one_line(tmp_path, monkeypatch):
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("OMNIBENCH_LAUNCHER", raising=False)
    out = tmp_path / "run"
    error_line(invoke(*RUN, "--timeout", "1", "--out", str(out)), "rank 0 did not create", code=1)


# -- a full disk -------------------------------------------------------------------------------------
# An open() under which the files whose names start with one of OMNIBENCH_TEST_DISK_FULL's fail to write
# as on a full disk, like write(2) does.
FULL_OPEN = '''
import builtins, errno, os

_names = tuple(n for n in os.environ.get("OMNIBENCH_TEST_DISK_FULL", "").split(",") if n)
_open = builtins.open


class _Full:
    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def _full_open(file, mode="r", *a, **k):
    f = _open(file, mode, *a, **k)
    if _names and "w" in mode and os.path.basename(str(file)).startswith(_names):
        return _Full(f)
    return f
'''
# Loaded into every process of the run (the launcher and its ranks) through PYTHONPATH: that open() in
# place of the builtin one.
DISK_FULL = FULL_OPEN + "\nbuiltins.open = _full_open\n"


def test_a_full_disk_when_the_launcher_writes_the_record_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import builtins

    monkeypatch.setenv("OMNIBENCH_TEST_DISK_FULL", "config.json")
    full = {}
    exec(FULL_OPEN, full)  # the ranks' full-disk open, in this process only
    monkeypatch.setattr(builtins, "open", full["_full_open"])
    out = tmp_path / "run"
    line = error_line(invoke(*RUN, "--out", str(out)), "no space left on the device", code=1)
    assert line == f"error: writing {out}{records.INCOMPLETE}/config.json: no space left on the device"
    nothing_made(out)  # nothing ran: the folder would only block the next run into this --out


def test_a_full_disk_in_a_rank_is_one_line_naming_the_file_and_leaves_no_finished_record(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DISK_FULL)
    out = tmp_path / "run"
    # rank 0's last record file fails, and so does its error report: it must still reach the launcher
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "COLUMNS": "300",
           "OMNIBENCH_TEST_DISK_FULL": "plan_step0.json,rank0.txt"}
    res = subprocess.run([sys.executable, "-m", "omnibench", *RUN, "--nproc", "2", "--timeout", "60",
                          "--out", str(out)], capture_output=True, text=True, timeout=170, cwd=REPO, env=env)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    work = f"{out}{records.INCOMPLETE}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: rank 0 failed: writing {work}/plan_step0.json: no space left on the device; "
                     f"the partial record is in {work}"], res.stderr
    assert not os.path.lexists(out)
    names = set(os.listdir(work))
    assert "plan_step0.json" not in names and not any(n.endswith(".tmp") for n in names)
    assert json.loads(Path(work, "config.json").read_text())["finished"] is False
    assert records.lock_holder(work) is None  # stale, not held: the message says where it is


def test_an_unreadable_error_report_is_skipped_not_a_traceback(tmp_path):
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text("not json\n")
    (tmp_path / "errors" / "rank1.txt").write_text(json.dumps({"time": 1.0, "lost_peer": False,
                                                               "error": "E: x"}) + "\n")
    reports = launch_module._error_reports(str(tmp_path))
    assert list(reports) == [1] and reports[1][2] == "E: x"


# -- a signal before any rank started ----------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_launcher_sets_up_stops_in_one_line_and_keeps_nothing(tmp_path, monkeypatch, signum):
    begin = records.begin

    def begin_then_signalled(*a, **k):
        begin(*a, **k)
        os.kill(os.getpid(), signum)  # as if Ctrl-C or a scheduler's SIGTERM came while provenance ran git

    class Signalled(Exception):
        pass

    def raise_instead(*_):  # where the launcher does not catch it, fail the test rather than end pytest
        raise Signalled

    monkeypatch.setattr(records, "begin", begin_then_signalled)
    previous = signal.signal(signal.SIGTERM, raise_instead)
    try:
        out = tmp_path / "run"
        line = error_line(invoke(*RUN, "--out", str(out)), "no rank had started", code=128 + signum)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert line.startswith(f"error: interrupted by {signal.Signals(signum).name}")
    nothing_made(out)

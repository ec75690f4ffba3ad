"""Faults around what `plot`, `report`, `reproduce` and `workloads show` write: a full disk, an output
place that cannot be written (checked before any drawing), damaged record folders, a reproduce killed
outright (its stage's process dies with it, and `--resume` copes with what the stage left). Each gets
one `error:` line (exit 2 for bad input, 1 for the environment), never a traceback or a truncated file."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_errors import invoke, one_error_line
from test_runtime_cli import alive

from omnibench.cli import report as report_cli

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; uses prctl")




def write_sim(root: Path, name: str = "sim", rows: list | None = None, **config) -> Path:
    """A small simulation record in `simulate`'s format: two systems at 8 GPUs (enough for the
    throughput figure), no traces."""
    folder = root / name
    folder.mkdir(parents=True)
    cfg = {"command": "simulate", "workload": "mixed_video", "systems": ["homogeneous", "omni"], "gpus": [8],
           "hardware": "h100", "model": "omni-7b", **config}
    if rows is None:
        rows = [{"gpus": 8, "system": s, "fits": True, "tokens_per_s": t, "tokens_per_s_per_gpu": t / 8,
                 "step_time_s": 65536 / t, "mfu": 0.3, "bubble": 0.1, "exposed_comm": 0.05}
                for s, t in (("homogeneous", 20000.0), ("omni", 30000.0))]
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "results.json").write_text(json.dumps(rows))
    return folder


@pytest.fixture
def sim(tmp_path) -> Path:
    return write_sim(tmp_path / "sims")


def _unwritable(tmp_path: Path) -> Path:
    """A folder no process can create: its parent is a file (works as root too, unlike chmod)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "out"


def leftovers(folder: Path) -> list[str]:
    """Temporary or partial files left in `folder` (atomic_write's are hidden `.NAME.*.tmp`)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp"))


@pytest.fixture
def full_disk(monkeypatch):
    """`full_disk(n)`: from now on the disk takes n more bytes in all, then every write fails with
    ENOSPC after writing what fitted (as a real full disk does: the file is left truncated)."""

    class Budget:
        left = 0

    class Filling(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if Budget.left >= len(data):
                Budget.left -= len(data)
                return self.f.write(data)
            self.f.write(data[:Budget.left])
            self.f.flush()
            Budget.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def close(self):
            self.f.close()

    real_open, real_fdopen = builtins.open, os.fdopen

    def writing_mode(mode) -> bool:
        return any(c in str(mode) for c in "wax+")

    def fake_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return Filling(f) if writing_mode(mode) and not isinstance(file, int) else f

    def fake_fdopen(fd, mode="r", *a, **k):
        f = real_fdopen(fd, mode, *a, **k)
        return Filling(f) if writing_mode(mode) else f

    def fill(n: int) -> None:
        Budget.left = n
        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(os, "fdopen", fake_fdopen)

    return fill


# -- a full disk ---------------------------------------------------------------------------------------
def test_report_on_a_full_disk_says_what_it_was_writing_and_keeps_the_earlier_page(sim, tmp_path, full_disk):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.html").write_text("the earlier page")
    full_disk(20_000)  # the page inlines its figures: hundreds of kB
    line = one_error_line(invoke("report", sim, "--out", out), "no space left on the device", code=1)
    assert f"writing {out / 'report.html'}" in line
    assert (out / "report.html").read_text() == "the earlier page"  # not a truncated new one
    assert leftovers(out) == []


def test_plot_on_a_full_disk_leaves_no_partial_figure(sim, tmp_path, full_disk):
    out = tmp_path / "figs"
    out.mkdir()
    full_disk(1_000)
    line = one_error_line(invoke("plot", "throughput", sim, "--out", out), "no space left on the device", code=1)
    assert str(out / "throughput.png") in line
    assert sorted(p.name for p in out.iterdir()) == []


def test_workloads_show_plot_on_a_full_disk_leaves_no_partial_figure(tmp_path, full_disk):
    path = tmp_path / "mix.png"
    full_disk(1_000)
    line = one_error_line(invoke("workloads", "show", "mixed_video", "--steps", "2", "--plot", path),
                          "no space left on the device", code=1)
    assert str(path) in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_workloads_show_json_into_a_full_device_is_one_line_not_a_traceback():
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "omnibench", "workloads", "show", "mixed_video", "--steps", "2",
                            "--json"], stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=150)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: writing standard output: no space left on the device"


# -- output places checked before any drawing ---------------------------------------------------------
@pytest.fixture
def no_drawing(monkeypatch):
    """Fails the test if a figure is drawn: the output place must be refused first."""
    from omnibench.plots import report as page

    def refuse(*a, **k):
        raise AssertionError("drew figures before checking --out")

    monkeypatch.setattr(page, "draw_all", refuse)
    monkeypatch.setattr(report_cli, "draw", refuse)
    monkeypatch.setattr(report_cli, "reproduce", refuse)


@pytest.mark.parametrize("command", ["report", "plot", "reproduce"])
def test_an_out_that_cannot_be_written_is_refused_before_any_work(sim, tmp_path, no_drawing, command):
    args = {"report": ["report", sim], "plot": ["plot", "throughput", sim], "reproduce": ["reproduce"]}[command]
    line = one_error_line(invoke(*args, "--out", _unwritable(tmp_path)), "error: out: ")
    assert "cannot write in" in line or "is a file" in line


@pytest.mark.parametrize("command", ["report", "plot", "reproduce"])
def test_an_out_that_is_a_file_is_refused_before_any_work(sim, tmp_path, no_drawing, command):
    taken = tmp_path / "notes.txt"
    taken.write_text("keep me")
    args = {"report": ["report", sim], "plot": ["plot", "throughput", sim], "reproduce": ["reproduce"]}[command]
    one_error_line(invoke(*args, "--out", taken), f"out: {taken} is a file")
    assert taken.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through folder permissions")
def test_report_refuses_a_read_only_out_folder_before_drawing(sim, tmp_path, no_drawing):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_error_line(invoke("report", sim, "--out", ro), "cannot write in")
    finally:
        ro.chmod(0o755)


def test_report_out_naming_an_html_file_writes_that_page(sim, tmp_path):
    page = tmp_path / "pages" / "mine.html"
    r = invoke("report", sim, "--out", page)
    assert r.exit_code == 0, r.output
    assert page.is_file() and page.read_text().startswith("<!doctype html>")
    assert leftovers(page.parent) == []


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_an_out_through_a_symlink_that_leads_nowhere_is_named_as_such(sim, tmp_path, no_drawing, link):
    path = tmp_path / "link"
    os.symlink(path if link == "loop" else tmp_path / "gone" / "x", path)
    for args in (["report", sim], ["plot", "throughput", sim]):
        one_error_line(invoke(*args, "--out", path / "sub"), f"out: {path} is a symbolic link")


def test_plot_checks_the_kind_and_name_before_the_out_folder(sim, tmp_path, no_drawing):
    one_error_line(invoke("plot", "histogram", sim, "--out", _unwritable(tmp_path)), "KIND must be one of")
    one_error_line(invoke("plot", "throughput", sim, "--name", "a/b", "--out", tmp_path), "name: a file name")
    assert not (tmp_path / "a").exists()


def test_a_missing_calibration_is_refused_before_the_report_is_drawn(sim, tmp_path, no_drawing):
    one_error_line(invoke("report", sim, "--calibration", tmp_path / "nope.json", "--out", tmp_path / "out"),
                   "calibration: no such profile")


def test_workloads_show_checks_its_plot_file_before_drawing_the_steps(tmp_path, monkeypatch):
    import workloads.stats

    def refuse(*a, **k):
        raise AssertionError("drew the steps before checking --plot")

    monkeypatch.setattr(workloads.stats, "collect", refuse)
    (tmp_path / "a-folder.png").mkdir()
    one_error_line(invoke("workloads", "show", "mixed_video", "--plot", tmp_path / "a-folder.png"),
                   "plot: ")
    one_error_line(invoke("workloads", "show", "mixed_video", "--plot", _unwritable(tmp_path) / "x.png"),
                   "cannot write in")
    one_error_line(invoke("workloads", "show", "mixed_video", "--plot", tmp_path / "x.gif"), "must end in .png")


def test_workloads_show_plot_makes_a_missing_parent(tmp_path):
    path = tmp_path / "new" / "deeper" / "mix.svg"
    r = invoke("workloads", "show", "mixed_video", "--steps", "2", "--plot", path, "--json")
    assert r.exit_code == 0, r.output
    assert path.is_file() and leftovers(path.parent) == []


# -- damaged records: named, not a traceback from inside a figure ------------------------------------
GOOD = {"gpus": 8, "system": "omni", "fits": True, "tokens_per_s": 1.0, "tokens_per_s_per_gpu": 0.125}


@pytest.mark.parametrize(("row", "needle"), [
    ({**GOOD, "gpus": "eight"}, "row 1: gpus must be a positive integer"),
    ({**GOOD, "tokens_per_s": None}, "tokens_per_s must be a finite number"),
    ({**GOOD, "tokens_per_s_per_gpu": "fast"}, "tokens_per_s_per_gpu must be a finite number"),
    ({k: v for k, v in GOOD.items() if k != "tokens_per_s"}, "tokens_per_s must be a finite number"),
], ids=["gpus-text", "throughput-null", "per-gpu-text", "throughput-missing"])
def test_a_damaged_results_row_is_named_with_its_file(tmp_path, row, needle):
    folder = write_sim(tmp_path, rows=[row])
    for args in (["plot", "throughput", folder], ["report", folder]):
        line = one_error_line(invoke(*args, "--out", tmp_path / "out"), needle)
        assert f"{folder}/results.json" in line


def test_a_damaged_step_line_of_a_run_is_named_with_its_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run": {"system": "omni", "workload": "mixed_video"}}))
    (run / "steps.jsonl").write_text(json.dumps({"step": 0, "step_time_s": None, "tokens": 10}) + "\n")
    line = one_error_line(invoke("plot", "throughput", run, "--out", tmp_path / "out"), "line 1: step_time_s")
    assert f"{run}/steps.jsonl" in line


# -- reproduce killed outright; --resume after it ------------------------------------------------------
@linux_only
def test_a_reproduce_killed_outright_takes_its_running_stage_with_it(tmp_path):
    """The stage's command is a stand-in that records its pid and sleeps far longer than the test
    waits: only the kernel (the parent-death signal `reproduce` asks for) can end it in time."""
    pidfile = tmp_path / "stage.pid"
    shim = tmp_path / "python"
    shim.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    shim.chmod(0o755)
    script = ("import sys; from pathlib import Path; from omnibench.cli import report; "
              "out = Path(sys.argv[1]); sys.executable = sys.argv[2]; "
              "report._stages = lambda *a, **k: [report.Stage('run-x', 'a stage', ['workloads', 'list'], 1.0)]; "
              "report._produce(out / 'runs', out / 'sims', ['omni'], quick=True, resume=False, log=[])")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out"), str(shim)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    stage = None
    try:
        deadline = time.monotonic() + 120  # hang guard: the stage starts within seconds, more on a loaded host
        while not (pidfile.is_file() and pidfile.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the stage never started: {proc.communicate()[1][-2000:]}")
            time.sleep(0.05)
        stage = int(pidfile.read_text())
        assert alive([stage], "sleep") == [stage]
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30  # hang guard while the kernel ends it
        while alive([stage], "sleep") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive([stage], "sleep") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        if stage is not None and alive([stage], "sleep"):
            os.kill(stage, signal.SIGKILL)


def _run_stage(runs: Path, name: str = "omni-mixed_video", steps: str = "3") -> report_cli.Stage:
    return report_cli.Stage(f"run-{name}", f"run {name}", ["run", "--system", "omni", "--workload", "mixed_video",
                                                             "--nproc", "2", "--steps", steps, "--out",
                                                             str(runs / name), "--json"], 1.0)


def _finished_run(folder: Path, steps: int = 3) -> None:
    """What a finished `omnibench run` leaves (the parts `--resume` reads)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"run": {"system": "omni", "workload": "mixed_video", "nproc": 2,
                                                            "steps": steps, "options": {}}}))
    (folder / "steps.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": 0.5, "tokens": 100}) + "\n"
                                                for s in range(steps)))
    (folder / "summary.json").write_text(json.dumps({"system": "omni", "workload": "mixed_video"}))


@pytest.fixture
def stages(tmp_path, monkeypatch):
    """reproduce's plan replaced by run stages; its commands recorded, each succeeding, none started."""
    runs, sims = tmp_path / "out" / "runs", tmp_path / "out" / "sims"
    ran: list[list[str]] = []

    def omnibench(args):
        ran.append(args)
        out = Path(args[args.index("--out") + 1])
        _finished_run(out)
        return True, ""

    monkeypatch.setattr(report_cli, "_omnibench", omnibench)

    def plan(*names_and_steps):
        st = [_run_stage(runs, n, s) for n, s in names_and_steps]
        monkeypatch.setattr(report_cli, "_stages", lambda *a, **k: st)
        sims.mkdir(parents=True)
        (sims / "reproduce-stages.json").write_text("{}")  # killed before the ledger said a stage was done
        return runs, sims

    return plan, ran


def test_resume_keeps_a_stage_whose_run_finished_after_reproduce_was_killed(stages, capsys):
    plan, ran = stages
    runs, sims = plan(("omni-mixed_video", "3"))
    _finished_run(runs / "omni-mixed_video")
    killed_simulation = sims / "memory" / "20260101-000000-bursty_mix.incomplete"  # the next stage's, killed
    killed_simulation.mkdir(parents=True)
    log: list[str] = []
    report_cli._produce(runs, sims, ["omni"], quick=True, resume=True, log=log)
    assert ran == []  # not run again (it would refuse: "out: ... already exists")
    assert "kept" in capsys.readouterr().out
    assert list(json.loads((sims / "reproduce-stages.json").read_text())) == ["run-omni-mixed_video"]
    assert not killed_simulation.exists()
    assert not [line for line in log if line.startswith("FAILED")]


@pytest.mark.parametrize("left", ["unfinished", "other-steps", "a-file"])
def test_resume_replaces_what_is_not_the_stages_finished_run(stages, capsys, left):
    plan, ran = stages
    runs, sims = plan(("omni-mixed_video", "3"))
    folder = runs / "omni-mixed_video"
    if left == "unfinished":
        _finished_run(folder)
        (folder / "summary.json").unlink()
    elif left == "other-steps":
        _finished_run(folder, steps=5)  # a reproduce without --quick made it
    else:
        runs.mkdir(parents=True)
        folder.write_text("")
    log: list[str] = []
    report_cli._produce(runs, sims, ["omni"], quick=True, resume=True, log=log)
    assert len(ran) == 1 and "replacing" in capsys.readouterr().out
    assert json.loads((folder / "config.json").read_text())["run"]["steps"] == 3


def test_resume_says_what_to_do_when_a_stages_folder_cannot_be_replaced(stages, monkeypatch):
    plan, ran = stages
    runs, sims = plan(("omni-mixed_video", "3"))
    _finished_run(runs / "omni-mixed_video", steps=5)

    def refuse(path, *a, **k):
        if Path(path) == runs / "omni-mixed_video":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    import shutil

    real = shutil.rmtree
    monkeypatch.setattr(report_cli.shutil, "rmtree", refuse)
    with pytest.raises(SystemExit) as e:
        report_cli._produce(runs, sims, ["omni"], quick=True, resume=True, log=[])
    assert e.value.code == 1 and ran == []


def test_resume_over_a_damaged_ledger_is_one_line_with_what_to_do(tmp_path):
    sims = tmp_path / "out" / "sims" / "reproduce"
    sims.mkdir(parents=True)
    (sims / "reproduce-stages.json").write_text('{"run-omni": 3.')
    r = invoke("reproduce", "--quick", "--resume", "--out", tmp_path / "out")
    line = one_error_line(r, "is not a stage ledger")
    assert "run without --resume" in line


@pytest.mark.parametrize(("command", "in_the_way"), [
    (["report"], "report.html"), (["plot", "throughput"], "throughput.pdf"), (["reproduce"], "report.html"),
    (["reproduce"], "figures"),
], ids=["report-page-a-folder", "plot-pdf-a-folder", "reproduce-page-a-folder", "reproduce-figures-a-file"])
def test_a_file_or_folder_in_the_way_of_an_output_is_refused_before_any_work(sim, tmp_path, no_drawing, command,
                                                                             in_the_way):
    out = tmp_path / "out"
    out.mkdir()
    if in_the_way == "figures":
        (out / in_the_way).write_text("")
    else:
        (out / in_the_way).mkdir()
    args = [*command, sim] if command[0] != "reproduce" else command
    one_error_line(invoke(*args, "--out", out), f"out: {out / in_the_way} is a f")


def test_a_damaged_tune_cache_is_one_line_saying_what_to_do(tmp_path):
    cache = tmp_path / "tuned-layouts.json"
    cache.write_text('{"key": {"system": "om')
    with pytest.raises(SystemExit) as e:
        report_cli.write_seeds(cache, tmp_path / "seeds" / "x.json")
    assert e.value.code == 1
    assert not (tmp_path / "seeds").exists()

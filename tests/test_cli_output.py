"""Output that survives a pipe: no table cuts a name or a path; help lists every registered system."""

from __future__ import annotations

import io

from rich.table import Table
from typer.testing import CliRunner

from omnibench.cli import app
from omnibench.cli.common import PipeSafeConsole

LONG_PATH = "/scratch/" + "/".join(["a-rather-long-folder-name"] * 6) + "/20261123-094340-mixed_video-omni-7b-h100"


def _table() -> Table:
    t = Table(title="results")
    for col in ("GPUs", "system", "tokens/s", "tok/s/GPU", "TFLOPS/GPU", "exposed comm", "record"):
        t.add_column(col)
    t.add_row("1024", "tiny-omni-moe-long-name", "1,234,567", "1,205", "151.8", "10.8%", LONG_PATH)
    return t


def test_a_table_written_to_a_file_keeps_every_name_header_and_path_whole():
    buf = io.StringIO()  # not a terminal, and no COLUMNS: what `omnibench ... > out.txt` gets
    con = PipeSafeConsole(file=buf, _environ={})
    con.print(_table())
    text = buf.getvalue()
    assert "…" not in text
    for whole in (LONG_PATH, "tiny-omni-moe-long-name", "tokens/s", "exposed comm", "TFLOPS/GPU"):
        assert whole in text
    assert len([ln for ln in text.splitlines() if LONG_PATH in ln]) == 1  # on one line, not wrapped


def test_a_table_in_a_narrow_terminal_folds_long_cells_instead_of_cutting_them():
    buf = io.StringIO()
    con = PipeSafeConsole(file=buf, force_terminal=True, width=40, color_system=None, _environ={})
    t = Table()
    t.add_column("record")
    t.add_row(LONG_PATH)
    con.print(t)
    text = buf.getvalue()
    assert "…" not in text and len(text.splitlines()) > 5  # folded over several lines
    cells = [ln.strip("│ ") for ln in text.splitlines() if ln.startswith("│")]
    assert "".join(cells) == LONG_PATH


def test_run_and_plan_help_list_every_registered_system():
    from systems import available_systems

    for command in ("run", "plan"):
        r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert " | ".join(available_systems()) in r.output, r.output
    assert "omni" in available_systems()


def test_a_tp_that_does_not_divide_the_heads_names_the_allowed_values():
    import pytest

    from omnibench.specs.model import SpecError
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model

    with pytest.raises(SpecError, match=r"tp=3 .* allowed tp: 1, 2$"):
        ParallelSpec(world_size=4, tp=3).validate(get_model("tiny-omni"))


def test_the_top_level_help_gives_each_command_a_short_entry():
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "120"}
    done = subprocess.run([sys.executable, "-m", "omnibench", "--help"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    box = done.stdout[done.stdout.index("╭─ Commands"):]
    rows = [ln for ln in box.splitlines()[1:] if ln.startswith("│")]
    entries: dict[str, int] = {}
    name = ""
    for ln in rows:
        first = ln[1:].split()
        if first and ln[2] != " ":
            name = first[0]
        entries[name] = entries.get(name, 0) + 1
    assert "reproduce" in entries and max(entries.values()) <= 3, entries


def test_a_flag_has_no_value_type_in_help_and_an_option_keeps_its_own():
    r = CliRunner().invoke(app, ["reproduce", "--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    quick, workers = (next(ln for ln in r.output.splitlines() if ln.startswith(f"│ {flag} "))
                      for flag in ("--quick", "--workers"))
    assert "<" not in quick and "<int>" in workers, (quick, workers)


def test_tune_help_shows_its_options_under_panels():
    import re

    from omnibench.cli.tune import TUNE_PANELS

    r = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    titles = re.findall(r"╭─ (.+?) ─", r.output)
    assert sorted(titles) == sorted([*TUNE_PANELS, "Options"]), titles  # Options: --help alone

"""The CLI's bad-input contract, checked the same way by every fault test: exit status 2 (or the given
one), no traceback, and exactly one `error:` line that holds each expected needle."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from omnibench.cli import app


def invoke(*args) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(r: Result, *needles: str, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.output
    for needle in needles:
        assert needle in lines[0], r.output
    return lines[0]

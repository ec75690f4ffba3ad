"""`omnibench models list | show` prints presets with parameter counts; unknown names fail in one line."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from omnibench.cli import models as models_cli

pytestmark = pytest.mark.timeout(60)


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keep `models` a sub-command even when it is the only group
        pass

    models_cli.register(app)
    return app


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    monkeypatch.setattr(models_cli.console, "width", 200)  # the shared console sized itself at import


def test_models_list_shows_presets_and_sizes():
    result = CliRunner().invoke(_app(), ["models", "list"])
    assert result.exit_code == 0, result.output
    for text in ("tiny-omni-moe", "omni-7b", "qwen2-vl-7b", "8.29B", "31.84B"):
        assert text in result.output


def test_models_show_prints_each_module():
    result = CliRunner().invoke(_app(), ["models", "show", "omni-moe-30b"])
    assert result.exit_code == 0, result.output
    for text in ("qwen3-30b-a3b", "vit-675m", "whisper-large-enc", "active params", "3.35B"):
        assert text in result.output


def test_models_show_unknown_name_fails_with_allowed_names():
    result = CliRunner().invoke(_app(), ["models", "show", "nope"])
    assert result.exit_code == 2
    assert "unknown model 'nope'" in result.output and "tiny-omni" in result.output
    assert "Traceback" not in result.output

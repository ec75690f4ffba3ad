"""The `omnibench` command (typer + rich).

Each command group lives in its own module exposing `register(app)`; this file only assembles
them, so adding a command never touches another command's code.
"""

from __future__ import annotations

import importlib

import typer
from typer.core import TyperOption

_value_type = getattr(TyperOption, "display_type_rich", None)  # typer >= 0.29; earlier ones print no flag type


def _flag_type(self, ctx):
    """No value type for a flag: recent typer releases print one (`<bool>`) beside options that take no value."""
    return None if self.is_flag else _value_type(self, ctx)


if _value_type is not None:
    TyperOption.display_type_rich = _flag_type

app = typer.Typer(
    name="omnibench",
    help="Benchmark harness for training multimodal LLMs (encoders + LLM) under dynamic workloads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# Each module registers its command group; `omnibench --help` lists the commands in typer's own order
# (the `workloads` and `models` sub-groups after the commands).
_COMMAND_MODULES = [
    "omnibench.cli.workloads",
    "omnibench.cli.models",
    "omnibench.cli.run",
    "omnibench.cli.simulate",
    "omnibench.cli.tune",
    "omnibench.cli.report",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()

"""Helpers shared by CLI commands: one-line errors for bad input, a shared rich console."""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

PIPE_WIDTH = 4096  # columns when output goes to a file or pipe: wide enough that nothing is cut or wrapped


class PipeSafeConsole(Console):
    """A rich console whose output survives a pipe: written to a file or pipe (and no COLUMNS set) it
    is PIPE_WIDTH wide, so tables take their natural width and no name, number or path is cut at 80
    columns; in a terminal, a table cell too long for its column folds onto the next line instead of
    ending in an ellipsis."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and "COLUMNS" not in self._environ and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)

    def print(self, *objects, **kwargs) -> None:
        for obj in objects:
            if isinstance(obj, Table):
                for col in obj.columns:
                    if col.overflow == "ellipsis":
                        col.overflow = "fold"
        super().print(*objects, **kwargs)


console = PipeSafeConsole()
err_console = PipeSafeConsole(stderr=True)

# --dp-shard on run, plan and simulate.
DpShard = Annotated[int, typer.Option(
    "--dp-shard", help="HSDP: ranks each FSDP shard group holds (replicated across groups); 0: automatic "
    "(within 8 nodes) when no --dp-mode or --dp-mode hsdp is given (an explicit --dp-mode fsdp never shards "
    "within nodes); -1: the whole group (plain FSDP).")]


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error (naming the field and allowed values) and exit; never a traceback."""
    # Escaped: messages quote user input and library errors, whose brackets are not rich markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)

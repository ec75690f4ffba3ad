"""Helpers shared by CLI commands: one-line errors for bad input, a shared rich console."""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)

# --dp-shard on run, plan and simulate.
DpShard = Annotated[int, typer.Option(
    "--dp-shard", help="HSDP: ranks each FSDP shard group holds (replicated across groups); 0: automatic "
    "(within 8 nodes); -1: the whole group (plain FSDP).")]


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error (naming the field and allowed values) and exit; never a traceback."""
    # Escaped: messages quote user input and library errors, whose brackets are not rich markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)

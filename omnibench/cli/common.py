"""Helpers shared by CLI commands: one-line errors for bad input, a shared rich console."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

# `--option` of run and simulate: one line at 120 columns; a wrong value's error lists the allowed ones
# (systems/omni/options.py)
OPTION_HELP = "key=value, repeatable, e.g. encoder_dp=hzero2 (omni)"
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

MAX_GPUS = 1 << 20  # ranks of a planned or simulated cluster: far beyond any built; more would never finish
MAX_LOCAL_RANKS = 1024  # processes `run` starts on one machine (torchrun for more)


def batch_error(e: Exception, gpus: int, global_batch_tokens: int) -> str:
    """A workload stream's refusal of a batch, naming the flag the user set: without
    --global-batch-tokens the batch follows the GPU count (8,192 tokens per GPU)."""
    text = str(e).splitlines()[0]
    if global_batch_tokens or not text.startswith("global_batch_tokens"):
        return text
    return (f"gpus: {gpus:,} GPUs make a global batch of 8,192 x {gpus:,} = {8192 * gpus:,} tokens, more than the "
            f"workload stream can form ({text}); use fewer GPUs or set --global-batch-tokens")


# Said once, in the description of each command with --tp/--pp/--cp (each option's own help is one line).
DEFAULT_LAYOUT_TEXT = (
    "Layout: without --tp, --pp and --cp each system runs its anchor's usual layout (systems/defaults.py): "
    "homogeneous, colocated, noncolocated and omni Megatron-style (tp: the largest inside a node that divides the "
    "heads, pp only where the model state needs it); temporal VeOmni's (tp 1, pp 1, FSDP over all ranks, cp: one "
    "Ulysses degree for encoders and LLM, the smallest that splits the longest sample into one rank's share of the "
    "batch). Any of the three given, the others are 1.")
RECOMPUTE_TEXT = (
    "Memory: --recompute auto (the default) takes the cheapest recomputation per module that fits: none, then each "
    "set of modules recomputed in full, cheapest first (e.g. vision=full,audio=full before full), by the simulator's "
    "memory estimate of the first batches; the output says which. One function settles layout and recompute for "
    "plan, run, simulate and tune (omnibench/resolve.py).")
TP_HELP = "LLM tensor-parallel degree; 0: default layout."
PP_HELP = "LLM pipeline stages; 0: default layout."
CP_HELP = "LLM context-parallel degree; 0: default layout."
RECOMPUTE_HELP = "auto | none | selective | full | vision=full,..."

# --freeze on run, plan, simulate and tune.
FREEZE_HELP = "Modules that do not train (comma list): vision, audio, llm."


def freeze_option(text: str, named=None, model=None) -> tuple[str, ...]:
    """--freeze as ParallelSpec.freeze: the modules in their order, checked against `named` (the model the
    user named) and kept to those of `model` (the one that runs, less the encoders the workload never
    feeds) when given; a bad name, or every module frozen, ends the command in one line."""
    from omnibench.specs.model import SpecError, freeze_for_model, parse_freeze

    try:
        frozen = parse_freeze(text)
        return freeze_for_model(frozen, named, model) if named is not None else frozen
    except SpecError as e:
        fail(str(e))


# --dp-shard on run, plan and simulate.
DpShard = Annotated[int, typer.Option(
    "--dp-shard", help="HSDP shard group; 0: automatic, -1: plain FSDP.")]


def in_panels(command, panels: dict[str, tuple[str, ...]]):
    """`command` with each of its options shown under the help panel that names it (panel -> parameter
    names); a parameter of `command` in no panel, or a name it lacks, is an error here, so a new option
    is placed when it is added. An option shared between commands (`DpShard`) must sit under the same
    panel in each."""
    import inspect
    from typing import get_type_hints

    hints = get_type_hints(command, include_extras=True)
    options = {}  # parameter -> its OptionInfo (a typer.Context parameter is none)
    for name, param in inspect.signature(command).parameters.items():
        infos = [param.default, *getattr(hints.get(name), "__metadata__", ())]
        info = next((i for i in infos if isinstance(i, typer.models.OptionInfo)), None)
        if info is not None:
            options[name] = info
    placed = {name: panel for panel, names in panels.items() for name in names}
    missing = sorted(set(options) - set(placed))
    extra = sorted(set(placed) - set(options))
    if missing or extra:
        raise ValueError(f"{command.__name__}: options in no help panel: {missing}; panels name unknown ones: {extra}")
    for name, panel in placed.items():
        options[name].rich_help_panel = panel
    return command


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error (naming the field and allowed values) and exit; never a traceback."""
    # Escaped: messages quote user input and library errors, whose brackets are not rich markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def writable_folder(path: str | Path, field: str = "out") -> Path:
    """`path` as a folder this process can write in (made if missing), checked before any work
    starts; else a one-line failure naming the field (a file in the way, no permission, read-only)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        fail(f"{field}: {p} is a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".omnibench-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        fail(f"{field}: cannot write in {p} ({e.strerror or e})")
    return p


def writable_file(path: str | Path, field: str = "out") -> Path:
    """`path` as a file this process can create or replace, checked before the work that fills it."""
    p = Path(path)
    if p.is_dir():
        fail(f"{field}: {p} is a folder; give a file name")
    writable_folder(p.parent if str(p.parent) else Path("."), field)
    return p


def os_error_line(e: OSError, what: str | Path) -> str:
    """One line for an OSError met while writing `what`: the cause in words (a full disk named as such)."""
    cause = "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return f"writing {what}: {cause}"


@contextmanager
def writing(what: str | Path, code: int = 1) -> Iterator[None]:
    """Writes inside the block that fail (a full disk, a folder made read-only meanwhile) end the command
    with one line naming what was being written, never a traceback."""
    try:
        yield
    except OSError as e:
        fail(os_error_line(e, getattr(e, "filename", None) or what), code)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it, renamed over it once complete, so a
    full disk or a kill leaves the previous file (or none), never a truncated one."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent if str(p.parent) else ".", prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
        os.replace(tmp, p)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise

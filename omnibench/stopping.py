"""SIGTERM ends a command through its cleanup, even when the interpreter drops the signal's exception.

A Python signal handler runs in the main thread between bytecodes, so its exception is raised
wherever that thread happens to be. When that is a finalizer (a simpy process's generator closed by
the garbage collector, any `__del__`), the interpreter prints "Exception ignored in ..." and drops
the exception: the command would run on and publish a record it was told to abandon (seen on CI:
`simulate` stopped by SIGTERM exited 0 with its folder written). So the handler also remembers the
signal, and the command calls `raise_if_stopped()` at the points where it commits work (each sweep
item, before publishing a record), which raises the exit again.
"""

from __future__ import annotations

import signal
import sys

_stopped: int | None = None  # the signal number once SIGTERM has arrived


def _on_sigterm(signum, frame) -> None:
    global _stopped
    _stopped = signum
    sys.exit(128 + signum)


def raise_if_stopped() -> None:
    """SystemExit(128 + SIGTERM) when SIGTERM has arrived since `exit_on_sigterm`, else nothing."""
    if _stopped is not None:
        sys.exit(128 + _stopped)


def install():
    """From now on SIGTERM raises SystemExit(143) and is remembered; returns the previous handler."""
    global _stopped
    _stopped = None
    return signal.signal(signal.SIGTERM, _on_sigterm)


class exit_on_sigterm:
    """`with exit_on_sigterm():` SIGTERM raises SystemExit(143) in the main thread and is remembered
    for `raise_if_stopped()`; the previous handler comes back on leaving."""

    def __enter__(self) -> exit_on_sigterm:
        self._previous = install()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _stopped
        signal.signal(signal.SIGTERM, self._previous)
        _stopped = None  # the signal was this block's: code after it (a later command in-process) runs on


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the process that started it ends, however it ends
    (SIGKILL, the OOM killer, a SIGTERM its children never see): the runtime's ranks and the sweeps'
    pool workers would otherwise outlive it. Exits at once if `parent` ended before the request was
    in place. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)

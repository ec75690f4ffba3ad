"""A spawned gloo rank's start and end, for tests that drive torch.distributed by hand (the launcher's
ranks do the same in omnibench/runtime/worker.py).

Every group gets a timeout, so a lost peer fails the test instead of hanging it. A rank leaves with
barrier, `destroy_process_group`, then `os._exit(0)`: gloo's worker threads can outlive Python's
shutdown and abort a rank whose work all succeeded (SIGABRT, "terminate called without an active
exception"; pytorch/pytorch#190489): with torch 2.13 on CPU, 9 of 30 runs without a barrier, 1 of 60
with barrier + `destroy_process_group`, none of 60 with `os._exit(0)` after both."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)


def join_group(rank: int, world: int, init: str | None = None, store=None) -> None:
    """This process as `rank` of a gloo group of `world`: rendezvous at `init` (a file:// URL) or `store`."""
    dist.init_process_group("gloo", init_method=init, store=store, rank=rank, world_size=world, timeout=TIMEOUT)


def leave_group() -> None:
    """Wait for every rank, tear the group down and exit now (what the rank wrote is already closed)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

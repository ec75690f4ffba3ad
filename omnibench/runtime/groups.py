"""The process groups and device meshes a rank needs for the layouts of a Plan."""

from __future__ import annotations

import torch
import torch.distributed as dist

from omnibench.plan import Layout
from omnibench.process_groups import process_groups


class Groups:
    """Every process group the layouts need, created once in the same order on every rank
    (new_group is collective over the world); each rank keeps the ones it belongs to."""

    def __init__(self, layouts: dict[str, Layout], rank: int, timeout):
        self.rank = rank
        self.mine: dict[tuple, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._timeout = timeout
        for key, ranks in process_groups(layouts):
            self._new(key, ranks)

    def _new(self, key, ranks):
        g = dist.new_group(list(ranks), timeout=self._timeout)
        if self.rank in ranks:
            self.mine[key] = (g, tuple(ranks))

    def get(self, module: str, dim: str) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
        return self.mine[(module, dim)]


def mesh_from(groups, names: tuple[str, ...], device: str, grid: list | None = None):
    """A DeviceMesh over existing groups (1D, or N-D with `grid` the nested list of ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0][0], device, mesh_dim_names=names)
    return DeviceMesh.from_group([g for g, _ in groups], device, mesh=torch.tensor(grid), mesh_dim_names=names)

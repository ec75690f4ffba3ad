"""The process groups and device meshes a rank needs for the layouts of a Plan."""

from __future__ import annotations

import torch
import torch.distributed as dist

from omnibench.plan import (
    Layout,
)


class Groups:
    """Every process group the layouts need, created once in the same order on every rank
    (new_group is collective over the world); each rank keeps the ones it belongs to."""

    def __init__(self, layouts: dict[str, Layout], rank: int, timeout):
        self.rank = rank
        self.mine: dict[tuple, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._timeout = timeout
        for name in sorted(layouts):
            lay = layouts[name]
            if name == "llm":
                for key, ranks_list in self._llm_groups(lay).items():
                    for ranks in ranks_list:
                        self._new(("llm", key), ranks)
            else:
                # "dp": the gradient (FSDP) group, dp x sp; "sp": Ulysses groups (temporal's encoders).
                for ranks in lay.fsdp_groups():
                    self._new((name, "dp"), ranks)
                for ranks in lay.groups("tp"):
                    self._new((name, "tp"), ranks)
                if lay.sp > 1:
                    for ranks in lay.groups("sp"):
                        self._new((name, "sp"), ranks)
                if lay.hsdp:
                    for key, ranks_list in self._hsdp_groups(lay, lay.fsdp_groups()).items():
                        for ranks in ranks_list:
                            self._new((name, key), ranks)

    def _new(self, key, ranks):
        g = dist.new_group(list(ranks), timeout=self._timeout)
        if self.rank in ranks:
            self.mine[key] = (g, tuple(ranks))

    @staticmethod
    def _llm_groups(lay: Layout) -> dict[str, list[tuple[int, ...]]]:
        out: dict[str, list[tuple[int, ...]]] = {"tp": lay.groups("tp"), "cp": lay.groups("cp"), "dpcp": [], "ep": [], "edp": []}
        for p in range(lay.pp):
            for t in range(lay.tp):
                flat = [lay.rank_at(pp=p, dp=d, cp=c, tp=t) for d in range(lay.dp) for c in range(lay.cp)]
                out["dpcp"].append(tuple(flat))
                ep = lay.ep
                out["ep"] += [tuple(flat[i : i + ep]) for i in range(0, len(flat), ep)]
                out["edp"] += [tuple(flat[i::ep]) for i in range(ep)]
        if lay.hsdp:
            out.update(Groups._hsdp_groups(lay, out["dpcp"]))
        return out

    @staticmethod
    def _hsdp_groups(lay: Layout, fsdp_groups: list[tuple[int, ...]]) -> dict[str, list[tuple[int, ...]]]:
        """HSDP (Layout.dp_shard): each FSDP group split into shard groups of `shard_size` consecutive
        members, the replicate groups across them (members holding the same shard), and, with
        experts split over ep, the members of a shard group holding the same experts."""
        s, ep = lay.shard_size, lay.ep if lay.module == "llm" else 1
        out: dict[str, list[tuple[int, ...]]] = {"dp_shard": [], "dp_replicate": [], "edp_shard": []}
        for flat in fsdp_groups:
            chunks = [flat[i : i + s] for i in range(0, len(flat), s)]
            out["dp_shard"] += chunks
            out["dp_replicate"] += [flat[j::s] for j in range(s)]
            if ep > 1:
                out["edp_shard"] += [c[i::ep] for c in chunks for i in range(ep)]
        return out

    def get(self, module: str, dim: str) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
        return self.mine[(module, dim)]


def mesh_from(groups, names: tuple[str, ...], device: str, grid: list | None = None):
    """A DeviceMesh over existing groups (1D, or N-D with `grid` the nested list of ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0][0], device, mesh_dim_names=names)
    return DeviceMesh.from_group([g for g, _ in groups], device, mesh=torch.tensor(grid), mesh_dim_names=names)

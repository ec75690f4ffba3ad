"""The data loaders' real metadata exchange, run before each step is planned (omni).

A rank's loader reads only the samples a distributed sampler deals its LLM data rank (positions
d, d + dp, ... of the step's index list; ranks with the same dp coordinate load the same ones).
It turns them into cost metadata, all-gathers that metadata inside its reorder group only, and
runs the group's deterministic decision (systems/omni/reorder.py), which every member computes
identically. It then loads the samples it was given, by position. A second all-gather, over the
LLM data-parallel group, shares every loader's post-reorder sample headers: each rank builds the
same global Plan from them (resharding, long/short split, schedule need the whole step's costs).

Loaders prefetch: step s+1's exchange runs on the rank's planner thread (worker.py), over its own
gloo groups on CPU, while step s computes; only the first step's runs in line. Both exchanges are the Plan's
leading `metadata` actions; their measured spans are handed to the executor, which records them
instead of running them again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from omnibench.plan import Layout, loader_group
from systems.omni.reorder import Loading, dealt, decide, metadata
from workloads.sample import Batch, Sample

Timing = tuple[float, float, float]  # (start, end, thread CPU seconds), start/end relative to t0


class LoaderExchange:
    """The process groups and the per-step exchange of one rank's loader.

    `planner` supplies `loader_spec(model, parallel, n_samples, layouts)` and `cost_model(model,
    options)`; construct on every rank in the same order (new_group is collective)."""

    def __init__(self, planner, model, parallel, layouts: dict[str, Layout], rank: int, timeout):
        from systems.omni.options import OmniOptions

        self.planner, self.model, self.parallel, self.layouts = planner, model, parallel, layouts
        self.rank = rank
        self.llm = layouts["llm"]
        self.options = OmniOptions.parse(parallel.options)
        self.cost_model = planner.cost_model(model, self.options)
        self.groups: dict[str, tuple[dist.ProcessGroup | None, tuple[int, ...]]] = {}
        for what in ("reorder", "plan"):
            made: dict[tuple[int, ...], dist.ProcessGroup] = {}
            for r in self.llm.ranks:
                g = loader_group(self.llm, r, what, self.options.reorder_group)
                if len(g) > 1 and g not in made:
                    # Loaders talk over CPU (gloo) whatever the training backend, as data loaders do.
                    made[g] = dist.new_group(list(g), timeout=timeout, backend="gloo")
            mine = loader_group(self.llm, rank, what, self.options.reorder_group)
            self.groups[what] = (made.get(mine), mine)

    def run(self, step: int, dataset: Sequence[Sample], t0: float) -> tuple[Batch, Loading, dict[str, Timing]]:
        """This step's loading: `dataset` is the step's index list (read by position only)."""
        n = len(dataset)
        spec = self.planner.loader_spec(self.model, self.parallel, n, self.layouts)
        loader = self.llm.coords(self.rank)["dp"]
        mine = [(k, dataset[k]) for k in dealt(n, loader, spec.loaders)]
        timings: dict[str, Timing] = {}

        start, cpu = time.perf_counter(), time.thread_time()
        # a global split (loading=global) gathers every loader's metadata, over the plan exchange's group
        pg, ranks = self.groups["plan" if spec.split == "global" else "reorder"]
        members = [self.llm.coords(r)["dp"] for r in ranks]
        if (spec.reorder or spec.split == "global") and pg is not None:
            if members != spec.group_of(loader):
                raise RuntimeError(f"reorder group {members} differs from the loader spec's {spec.group_of(loader)}")
            gathered = self._gather_metadata(spec, pg, len(ranks), metadata(spec, self.cost_model, mine), n)
            decision = decide(spec, members, gathered)
            timings["reorder"] = (start - t0, time.perf_counter() - t0, time.thread_time() - cpu)
        else:
            decision = decide(spec, [loader], [metadata(spec, self.cost_model, mine)])
        # Load what the group gave this loader, by position.
        mine = [(decision.positions[i], dataset[decision.positions[i]]) for i in decision.shards[loader]]

        start, cpu = time.perf_counter(), time.thread_time()
        payload = {"loader": loader, "samples": mine, "before": decision.before[loader],
                   "after": decision.after[loader], "traffic": decision.traffic if loader == members[0] else None}
        pg, ranks = self.groups["plan"]
        if pg is not None:
            payloads: list = [None] * len(ranks)
            dist.all_gather_object(payloads, payload, group=pg)
            timings["plan"] = (start - t0, time.perf_counter() - t0, time.thread_time() - cpu)
        else:
            payloads = [payload]
        payloads.sort(key=lambda p: p["loader"])
        by_position = {k: s for p in payloads for k, s in p["samples"]}
        if sorted(by_position) != list(range(n)):
            raise RuntimeError(f"step {step}: the loaders' exchanged samples do not cover the step's {n} samples")
        traffic = [p["traffic"] for p in payloads if p["traffic"] is not None] if spec.reorder else []
        loading = Loading(shards=[[s.sample_id for _, s in p["samples"]] for p in payloads],
                          before=[p["before"] for p in payloads], after=[p["after"] for p in payloads],
                          traffic=traffic)
        return Batch(step, [by_position[k] for k in range(n)]), loading, timings

    def _gather_metadata(self, spec, pg, size: int, entries: list, n: int) -> list[list[tuple[float, ...]]]:
        # Every loader's dealt shard has at most ceil(n / loaders) samples: pad to that, mark with -1.
        if any(abs(e[1]) >= 2**53 for e in entries):
            raise RuntimeError("sample ids must stay below 2**53 to travel as float64 metadata")
        rows = -(-n // spec.loaders)
        t = torch.full((rows, spec.entry_width), -1.0, dtype=torch.float64)
        if entries:
            t[: len(entries)] = torch.tensor(entries, dtype=torch.float64)
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t, group=pg)
        return [[tuple(row) for row in o.tolist() if row[0] >= 0] for o in out]

"""The six training systems, each a *planner*: (model, parallel, batch) -> Plan. No tensors here.

A planner module defines a class with `name` and `plan(model, parallel, batch) -> Plan` and
registers it in `_PLANNERS` below.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
from dataclasses import replace
from typing import Protocol

from omnibench.plan import Plan
from omnibench.specs.model import MultimodalSpec, SpecError
from omnibench.specs.parallel import ParallelSpec
from workloads.sample import Batch


class Planner(Protocol):
    name: str
    # False where no plan reads `parallel.recompute` (only the engine prices it): a spare plan then serves
    # a call that differs from its maker in the recompute mode alone (`_take_spare`)
    reads_recompute: bool

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan: ...


# name -> "module:Class"; order is the order systems are listed and plotted.
_PLANNERS: dict[str, str] = {
    "homogeneous": "systems.homogeneous:HomogeneousPlanner",
    "temporal": "systems.temporal:TemporalPlanner",
    "colocated": "systems.colocated:ColocatedPlanner",
    "noncolocated": "systems.noncolocated:NoncolocatedPlanner",
    "omni": "systems.omni:OmniPlanner",
    "spatial": "systems.spatial:SpatialPlanner",
}

SYSTEMS: tuple[str, ...] = ("homogeneous", "temporal", "colocated", "noncolocated", "omni", "spatial")

# `--option` keys a system reads beside omni's (systems/omni/options.py `OmniOptions`, whose `balancer`
# every system reads): `--option` names every system's, so each parser leaves the others' keys alone
QUOTA_OPTION = "quota"  # spatial: the encoders' share of the GPU while both lanes run
OPTION_KEYS: dict[str, tuple[str, ...]] = {"spatial": (QUOTA_OPTION,)}


def foreign_option_keys(system: str) -> dict[str, str]:
    """key -> the system it belongs to, for the `--option` keys of systems other than `system`."""
    return {k: s for s, keys in OPTION_KEYS.items() if s != system for k in keys}


def available_systems() -> list[str]:
    return [s for s in SYSTEMS if s in _PLANNERS]


def get_planner(name: str) -> Planner:
    if name not in _PLANNERS:
        raise SpecError(f"system must be one of {', '.join(available_systems()) or '(none yet)'}; got {name!r}")
    mod, cls = _PLANNERS[name].split(":")
    planner_cls = getattr(importlib.import_module(mod), cls)
    if not getattr(planner_cls.plan, "_without_cyclic_gc", False):
        # on the class, once: instances stay plain (picklable) objects
        planner_cls.plan = _without_cyclic_gc(planner_cls.plan)
    return planner_cls()


# One plan that its maker planned only to see that it plans (`systems.defaults.with_default_layout`)
# and let go of: the next call planning the same inputs takes it instead of planning again (at
# 131,072 GPUs a plan is ~30 s of CPU, and `simulate` plans the step it checked the layout with).
# A single slot, dropped by any call that does not take it, so a plan is never held past the next.
_spare: list[tuple] = []


def offer_plan(planner: Planner, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch, plan: Plan) -> None:
    """Hand `plan` (which `planner` made from these inputs, and which its caller keeps no reference
    to and has not changed; an engine offered with it, simulator.engine.offer_engine, only reads it) to the
    next `plan` call with equal inputs (equal but for the recompute mode where the planner does not read
    it: `Planner.reads_recompute`)."""
    _spare[:] = [(type(planner), _config(planner), model, parallel, batch, plan)]


def drop_spare_plan() -> None:
    """Let the spare plan go (the next call plans)."""
    _spare.clear()


def _config(planner) -> object:
    # the planner's own state that shapes a plan: omni's cost model when one is passed in
    return getattr(planner, "_cost_model", None)


def _take_spare(planner, model, parallel, batch) -> Plan | None:
    if not _spare:
        return None
    kind, config, m, p, b, plan = _spare.pop()
    if not getattr(planner, "reads_recompute", True):
        from omnibench.specs.costs import recompute_policy

        try:
            recompute_policy(parallel.recompute)  # a mode the planner would refuse is still refused
        except ValueError:
            return None
        p = replace(p, recompute=parallel.recompute)
    if (kind is type(planner) and config is _config(planner) and (m is model or m == model)
            and (p is parallel or p == parallel) and (b is batch or b == batch)):
        return plan
    return None


@contextlib.contextmanager
def cyclic_gc_paused():
    """The cyclic GC paused inside the block (nested blocks leave it to the outermost). A plan and its
    simulation are hundreds of thousands of small objects at scale (actions, routes; rank tables,
    messages, spans) and no reference cycles worth collecting: the GC would rescan them again and again
    while they are made (a third of a 16,384-rank omni plan's time, twice a simulation's; at 32,768 GPUs
    one full collection in the engine's set-up cost 0.3 s). Planners (`_without_cyclic_gc`), the engine
    (simulator/engine.py) and a tune's step (simulator/cache.py, both in one pause) use it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _without_cyclic_gc(plan):
    """`plan` with the cyclic GC paused for the call (`cyclic_gc_paused`), as the simulator's run is.
    A spare plan of the same inputs (`offer_plan`) is taken instead of planning."""

    @functools.wraps(plan)
    def planned(self, model, parallel, batch, *args, **kwargs) -> Plan:
        spare = _take_spare(self, model, parallel, batch)
        if spare is not None and not args and not kwargs:
            return spare
        with cyclic_gc_paused():
            return plan(self, model, parallel, batch, *args, **kwargs)

    planned._without_cyclic_gc = True
    return planned

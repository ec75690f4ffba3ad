"""The five training systems, each a *planner*: (model, parallel, batch) -> Plan. No tensors here.

A planner module defines a class with `name` and `plan(model, parallel, batch) -> Plan` and
registers it in `_PLANNERS` below.
"""

from __future__ import annotations

import functools
import gc
import importlib
from typing import Protocol

from omnibench.plan import Plan
from omnibench.specs.model import MultimodalSpec, SpecError
from omnibench.specs.parallel import ParallelSpec
from workloads.sample import Batch


class Planner(Protocol):
    name: str

    def plan(self, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch) -> Plan: ...


# name -> "module:Class"; order is the order systems are listed and plotted.
_PLANNERS: dict[str, str] = {
    "homogeneous": "systems.homogeneous:HomogeneousPlanner",
    "temporal": "systems.temporal:TemporalPlanner",
    "colocated": "systems.colocated:ColocatedPlanner",
    "noncolocated": "systems.noncolocated:NoncolocatedPlanner",
    "omni": "systems.omni:OmniPlanner",
}

SYSTEMS: tuple[str, ...] = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")


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


def _without_cyclic_gc(plan):
    """A plan is hundreds of thousands of small objects at scale (actions, routes) and no reference
    cycles worth collecting: the cyclic GC would rescan them again and again while they are built
    (a third of a 16,384-rank omni plan's time). Paused for the call, as the simulator's run is."""

    @functools.wraps(plan)
    def planned(*args, **kwargs) -> Plan:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return plan(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    planned._without_cyclic_gc = True
    return planned

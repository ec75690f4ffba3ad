"""What a step's planning costs, and what of it the step waits for.

Every system's runtime plans step s+1 on a planner thread of each rank while step s computes
(omnibench/runtime/worker.py: omni's loaders exchange metadata on that thread first), so planning
delays a step only where it takes longer than the step it overlaps. The simulator plays steps one at
a time, so the step a plan overlaps is taken to be as long as its own: the charge is
max(0, planning - step), waited at the head of the step by every rank. Step 0 of a run plans in line,
once, like the rest of start-up: not charged.

A planner's CPU time grows with the step's samples (each is weighed, placed and routed) and with the
ranks (the Plan holds every rank's actions, and every rank builds the whole Plan). Measured per system
by `python benchmarks/planning_cost.py` on the development host (one Python thread; the fastest of 3
repeats per cell, 4 static workloads x 256 / 1,024 / 4,096 GPUs: results/planning_cost.json), fitted as
seconds = a x samples + b x GPUs; the fit's mean |error| over those cells is 15-23% per system (max
51%). A planner with no measurement (a system added later) is charged the dearest measured one's.
These are measurements of the planners, not fitted to published runs: not in simulator/fitted.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnibench.plan import Plan
    from simulator.result import SimResult

# system -> (seconds per sample, seconds per GPU) of planner CPU
PLANNER_CPU: dict[str, tuple[float, float]] = {
    "homogeneous": (5.2e-6, 22.5e-6),
    "temporal": (7.2e-6, 36.1e-6),
    "colocated": (25.0e-6, 25.2e-6),
    "noncolocated": (26.6e-6, 19.1e-6),
    "omni": (37.7e-6, 70.2e-6),
}


def planning_seconds(system: str, samples: int, gpus: int) -> float:
    """The planner CPU seconds one step of `samples` over `gpus` ranks takes (this module's model)."""
    a, b = PLANNER_CPU.get(system) or max(PLANNER_CPU.values())
    return a * samples + b * gpus


def exposed_planning(planning_s: float, step_s: float) -> float:
    """What of `planning_s` the step waits for, planned under a step as long as `step_s`."""
    return max(0.0, planning_s - step_s)


def charge_planning(result: SimResult, plan: Plan) -> SimResult:
    """`result` with its step's planning costed: the exposed part added to the step time."""
    result.planning = planning_seconds(plan.system, result.samples, result.world_size)
    result.planning_exposed = exposed_planning(result.planning, result.step_time)
    result.step_time += result.planning_exposed
    return result

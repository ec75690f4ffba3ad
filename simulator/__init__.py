"""The calibrated discrete-event simulator: hardware presets, NCCL-like collective costs, compute
efficiency curves, an event-heap engine (engine.py; engine_simpy.py, the simpy one it is checked against)
that executes a Plan over distinct ranks only, and calibration
and validation against run traces. Imports no torch (directly or transitively).
"""

from simulator.engine import SimOptions, SimResult, SimulationError, simulate
from simulator.hardware import ClusterSpec, HardwareError, available_presets, load_cluster

__all__ = [
    "ClusterSpec",
    "HardwareError",
    "SimOptions",
    "SimResult",
    "SimulationError",
    "available_presets",
    "load_cluster",
    "simulate",
]

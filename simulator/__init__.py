"""The calibrated discrete-event simulator: hardware presets, NCCL-like collective costs, compute
efficiency curves, a simpy engine that executes a Plan over distinct ranks only, and calibration
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

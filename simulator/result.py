"""What one simulated step yields: spans per stream, statistics per simulated rank class, and the
step's metrics (throughput, MFU/HFU with their FLOP formulas, bubble, exposed communication, peak
memory)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from omnibench.plan import (
    BACKWARD,
    FORWARD,
    Action,
)
from simulator.hardware import GiB


@dataclass(slots=True)
class Span:
    rank: int  # representative rank of the class
    stream: str  # "compute" | "collective" | "p2p"
    action: Action
    kind: str
    start: float
    duration: float

    @property
    def name(self) -> str:
        return str(self.action)

    @property
    def module(self) -> str:
        return self.action.module

    @property
    def microbatch(self) -> int:
        return self.action.microbatch


# What `fits` compares with the device, said beside every verdict (engine.check_fit)
FITS_RULE = ("fits: peak_memory_needed_gib (what the step holds under memory pressure) x (1 + memory_error) <= "
             "memory_capacity_gib; peak_memory_gib is the peak a run would reserve, at most the capacity when it "
             "fits, and peak_memory_unpressured_gib what it would reserve with memory to spare")


@dataclass
class RankStats:
    rank: int
    members: int  # ranks this class stands for
    finish: float = 0.0
    compute: float = 0.0  # own compute time (sum of its actions' costs)
    exposed_comm: float = 0.0  # compute stream blocked on communication (its transfer, not a peer's lateness)
    imbalance: float = 0.0  # compute stream waiting for slower data-parallel peers (at a collective or lock)
    optimizer: float = 0.0
    comm_busy: float = 0.0  # time the collective and p2p streams were busy
    memory_bytes: float = 0.0  # the allocator's unpressured reserve and what lives outside it (published peaks')
    memory_static: float = 0.0
    memory_allocated: float = 0.0  # peak of live tensors (torch.cuda.max_memory_allocated's measure)
    memory_reserved: float = 0.0  # the caching allocator's peak reserve (max_memory_reserved's)
    memory_needed: float = 0.0  # what the step needs under memory pressure: the fits check's figure
    memory_peak_at: str = ""  # the action during which the peak happens
    compute_by_module: dict = field(default_factory=dict)  # module -> own compute seconds


@dataclass
class SimResult:
    system: str
    world_size: int
    step_time: float
    tokens: int
    samples: int
    model_flops: float  # useful FLOPs of the step (fwd + bwd, no recomputation), stated below
    peak_flops: float  # per GPU
    memory_capacity: float
    ranks: list[RankStats]
    spans: list[Span]
    classes: int
    sim_seconds: float
    fits: bool = True
    fit_message: str = ""
    fit_checked: bool = False  # whether `fits` was decided (engine.check_fit); else it says nothing
    flop_formula: str = ("costs.batch_flops: exact forward + backward matmul FLOPs of every module (a frozen one's "
                          "as the step runs it, costs.frozen_flops), attention over the real packed lengths, no "
                          "recomputation")
    # The same counter with the run's recomputation added (what the GPU executes): the numerator
    # of hardware TFLOP/s (Megatron's "teraFLOP/s per GPU", Korthikanti et al.'s HFU).
    hardware_flops: float = 0.0
    recompute: str = "none"
    compute_model: str = ""  # which compute model answered (kernel profile, calibrated, or datasheet fallback)
    hardware_flop_formula: str = ("costs.batch_flops(recompute=<policy>).total: model FLOPs plus the "
                                  "recomputed forward")
    planning: float = 0.0  # the planner's CPU seconds for this step (simulator/planning.py)
    planning_exposed: float = 0.0  # what of it every rank waits for at the head of the step (in step_time)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time > 0 else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.world_size / 1e12 if self.step_time > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU counting the recomputed forward (equals tflops_per_gpu without recompute)."""
        flops = self.hardware_flops or self.model_flops
        return flops / self.step_time / self.world_size / 1e12 if self.step_time > 0 else 0.0

    @property
    def hfu(self) -> float:
        return self.hardware_tflops_per_gpu * 1e12 / self.peak_flops

    def _mean(self, f) -> float:
        n = sum(r.members for r in self.ranks)
        return sum(f(r) * r.members for r in self.ranks) / n if n else 0.0

    @property
    def bubble(self) -> float:
        """Mean fraction of the step a rank's compute stream is idle (not computing, not blocked on comm, not
        waiting for a slower peer): pipeline bubbles, boundary waits, the step's end."""
        if self.step_time <= 0:
            return 0.0
        return self._mean(lambda r: max(0.0, 1 - (r.compute + r.exposed_comm + r.imbalance + r.optimizer
                                                  + self.planning_exposed) / self.step_time))

    @property
    def exposed_comm(self) -> float:
        return self._mean(lambda r: r.exposed_comm / self.step_time) if self.step_time > 0 else 0.0

    @property
    def imbalance(self) -> float:
        """Mean fraction of the step a rank's compute stream waits for slower data-parallel peers."""
        return self._mean(lambda r: r.imbalance / self.step_time) if self.step_time > 0 else 0.0

    def compute_by_module(self) -> dict[str, float]:
        """Mean seconds per rank each module's forward/backward occupied the compute stream."""
        n = sum(r.members for r in self.ranks) or 1
        weight = {r.rank: r.members for r in self.ranks}
        out: dict[str, float] = defaultdict(float)
        for sp in self.spans:
            if sp.stream == "compute" and sp.kind in (FORWARD, BACKWARD):
                out[sp.module] += sp.duration * weight[sp.rank] / n
        return dict(out)

    def breakdown(self) -> dict[str, float]:
        """Where a rank's step goes, in seconds averaged over ranks (each class weighted by the ranks it
        stands for): its own encoder and LLM compute, the optimizer step, communication the compute
        stream waited for (exposed), waiting for slower peers (imbalance), waiting for the step's
        planning (planning), and idle time (pipeline bubbles, waiting for the boundary: the step minus
        everything else); `idle_max`/`idle_min` are the idlest and the
        busiest rank's idle seconds, so a reader sees imbalance apart from bubbles."""
        if not self.ranks:
            return {}
        n = sum(r.members for r in self.ranks)
        out = dict.fromkeys(("encoder", "llm", "optimizer", "exposed_comm", "imbalance", "planning", "idle"), 0.0)
        idles = []
        for r in self.ranks:
            enc = sum(v for m, v in r.compute_by_module.items() if m != "llm")
            llm = r.compute_by_module.get("llm", 0.0)
            idle = max(0.0, self.step_time - (r.compute + r.exposed_comm + r.imbalance + r.optimizer
                                              + self.planning_exposed))
            idles.append(idle)
            for k, v in (("encoder", enc), ("llm", llm), ("optimizer", r.optimizer),
                         ("exposed_comm", r.exposed_comm), ("imbalance", r.imbalance),
                         ("planning", self.planning_exposed), ("idle", idle)):
                out[k] += v * r.members / n
        out["idle_max"], out["idle_min"] = max(idles), min(idles)
        return out

    @property
    def peak_memory(self) -> float:
        """The most loaded rank's unpressured reserve and context (RankStats.memory_bytes)."""
        return max((r.memory_bytes for r in self.ranks), default=0.0)

    @property
    def peak_reported(self) -> float:
        """The most loaded rank's peak as a run on this device would reserve it, so that it and `fits` are
        one consistent pair: a step that fits never reserves more than the device holds (under pressure
        the caching allocator hands its cache back before it goes over; what it cannot hand back is
        `peak_needed`, the figure fits is decided on), and one that does not fit reports the larger of its
        need and its unpressured reserve, over the device. Unchecked: the unpressured reserve."""
        if not self.fit_checked:
            return self.peak_memory
        if self.fits:
            return min(self.peak_memory, self.memory_capacity)
        return max(self.peak_memory, self.peak_needed)

    @property
    def peak_needed(self) -> float:
        """The most loaded rank's need under memory pressure (RankStats.memory_needed): what fits is decided on."""
        return max((r.memory_needed for r in self.ranks), default=0.0)

    def metrics(self) -> dict:
        return {
            "system": self.system,
            "world_size": self.world_size,
            "fits": self.fits,
            "fit_message": self.fit_message,
            "step_time_s": self.step_time,
            "tokens": self.tokens,
            "samples": self.samples,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "flop_formula": self.flop_formula,
            "recompute": self.recompute,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "hfu": self.hfu,
            "hardware_flop_formula": self.hardware_flop_formula,
            "compute_model": self.compute_model,
            "bubble": self.bubble,
            "exposed_comm": self.exposed_comm,
            "imbalance": self.imbalance,
            "planning_s": self.planning,
            "planning_exposed_s": self.planning_exposed,
            "peak_memory_gib": self.peak_reported / GiB,
            "peak_memory_needed_gib": self.peak_needed / GiB,
            "peak_memory_unpressured_gib": self.peak_memory / GiB,
            "memory_capacity_gib": self.memory_capacity / GiB,
            "fits_rule": FITS_RULE,
            "compute_s_by_module": self.compute_by_module(),
            "breakdown_s": self.breakdown(),
            "distinct_ranks": self.classes,
            "sim_seconds": self.sim_seconds,
        }

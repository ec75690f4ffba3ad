"""What a search answers: each layout tried (`Trial`), and the search's result (`TuneResult`: the
simulated trials fastest first, the default layout's, the notes, what it learned, how its seeds and
its guard fared)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from omnibench.tune.budget import WAVE
from omnibench.tune.seeds import Prior
from omnibench.tune.space import Candidate, llm_key

if TYPE_CHECKING:
    from omnibench.tune.converge import Convergence


@dataclass
class Trial:
    candidate: Candidate
    estimate_gib: float = 0.0  # analytic memory lower bound
    estimate_s: float = 0.0  # analytic step time (ordering only)
    simulated: bool = False
    step_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    peak_gib: float = 0.0
    fits: bool = False
    note: str = ""  # why it was pruned / refused
    # tune's guard_batches: the first step of the window simulated for it that it could not run (fits is then False)
    guard_step: int | None = None
    # tune's guard_batches: the mean step over the whole window, for the layouts the guard ran on all of it
    window_s: float = 0.0

    def row(self) -> dict:
        return {"layout": self.candidate.label(), **asdict(self.candidate),
                **{k: v for k, v in asdict(self).items() if k != "candidate"}}


@dataclass
class TuneResult:
    system: str
    world: int
    enumerated: int
    pruned_memory: int
    refused: int
    simulated: int
    trials: list[Trial]  # simulated ones, fastest first (fitting before not fitting)
    default: Trial
    seconds: float
    notes: list[str] = field(default_factory=list)
    budget: int = 0  # layouts simulated in the LLM-layout phase (before retries and encoder knobs)
    space: int = 0  # layouts left after pruning: what a proportional budget is a fraction of
    steps: list[int] = field(default_factory=list)  # the batches every layout was timed on
    convergence: Convergence | None = None
    evaluated: dict = field(default_factory=dict, repr=False)  # Candidate -> Trial: all tried, for a re-run

    ratio: dict = field(default_factory=dict, repr=False)  # the memory ratios learned per recompute mode
    # the seeds this search was given, each as mapped to its cluster (None: outside its space), and
    # each mapped seed's trial after its recompute retries
    seeds: list = field(default_factory=list)
    seeded: list = field(default_factory=list)  # [(Seed, Trial | None)]
    # tune's guard_batches: the window steps checked beyond `steps`; each layout the guard ruled out, as
    # (label, the first of those steps it could not run), fastest first; the step simulations it ran
    guard_steps: list[int] = field(default_factory=list)
    guarded: list[tuple[str, int]] = field(default_factory=list)
    guard_simulations: int = 0

    @property
    def windowed(self) -> bool:
        """Whether the guard ran layouts over the whole window (then `best` is the fastest over it)."""
        return any(t.window_s > 0 for t in self.trials)

    def time_of(self, t: Trial) -> float:
        """What `best` is judged by: the mean step over the window where the guard ran one, else over
        the tuned steps."""
        return t.window_s if self.windowed else t.step_s

    @property
    def seeds_best(self) -> Trial | None:
        """The fastest fitting seed as simulated here (over the window where the guard ran them: every
        fitting seed contends, `_Search.contend`)."""
        ok = [t for _, t in self.seeded if t is not None and t.fits and (t.window_s > 0 or not self.windowed)]
        return min(ok, key=lambda t: (self.time_of(t), t.candidate.label())) if ok else None

    def seed_note(self) -> str | None:
        """How the answer compares with its fastest seed, in the note the search leaves."""
        if self.seeds_best is None or self.best is None:
            return None
        gain = self.time_of(self.seeds_best) / self.time_of(self.best) - 1
        return (f"beat its fastest seed ({self.seeds_best.candidate.label()}) by {gain:.1%}" if gain > 0 else
                f"the answer is a seed ({self.best.candidate.label()}): the search found nothing faster")

    @property
    def best(self) -> Trial | None:
        """The fastest fitting layout: over the window where the guard ran some on all of it (`window_s`),
        else on the tuned steps."""
        ok = [t for t in self.trials if t.fits]
        window = [t for t in ok if t.window_s > 0]
        if window:
            return min(window, key=lambda t: (t.window_s, t.candidate.label()))
        return ok[0] if ok else None

    def prior(self, top: int = WAVE // 2) -> Prior:
        """This search as the starting point of a larger cluster's: its `top` fastest distinct layouts."""
        out: list[Candidate] = []
        for t in ([self.best] if self.best is not None else []) + self.trials:  # the answer first
            if t.fits and len(out) < top and all(llm_key(t.candidate) != llm_key(c) for c in out):
                out.append(t.candidate)
        return Prior(self.world, out, dict(self.ratio))

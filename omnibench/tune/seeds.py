"""Where a search starts beside its own first picks: a smaller cluster's answer (`Prior`), the layouts
that won for the same system elsewhere (`Seed`), and each mapped onto this search's cluster (`_scaled`,
`_seeded`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from omnibench.plan import PlanError
from omnibench.specs.model import SpecError
from omnibench.tune.space import Candidate, llm_key

if TYPE_CHECKING:
    from omnibench.tune.search import _Search


@dataclass
class Prior:
    """What the same system's search on a smaller cluster (same workload) found: its fastest layouts
    and the memory ratios it learned. Per-GPU work is the same at every size (the global batch grows
    with the cluster), so a larger search starts from them: their layouts in its first wave, their
    ratios as its own (omni at 4,096 GPUs otherwise spent its first wave on recompute "none", which
    the bound allows and the simulator refuses)."""

    world: int
    top: list[Candidate]
    ratio: dict[str, float]

    def row(self) -> dict:
        return {"world": self.world, "top": [asdict(c) for c in self.top], "ratio": dict(self.ratio)}

    @staticmethod
    def from_row(row: dict) -> Prior:
        return Prior(int(row["world"]), [Candidate(**c) for c in row["top"]], dict(row["ratio"]))


@dataclass(frozen=True)
class Seed:
    """A layout that won for the same system elsewhere: another workload, cluster size or grid cell
    (`source` says which), on `world` GPUs. A seeded search simulates every seed that its layout rules
    and memory bound admit, in its first wave, so its answer is never slower than a seed; a layout
    near the memory limit that the analytic order ranks late (omni's tp 1 / cp 4 on the condition
    grid's video-heavy cells, 78 of 80 GiB) is then not missed by a small budget."""

    candidate: Candidate
    world: int
    source: str = ""

    def row(self) -> dict:
        return {"candidate": asdict(self.candidate), "world": self.world, "source": self.source,
                "label": self.candidate.label()}

    @staticmethod
    def from_row(row: dict) -> Seed:
        return Seed(Candidate(**row["candidate"]), int(row["world"]), str(row.get("source", "")))


def _scaled(c: Candidate, world_from: int, world: int, settled: dict) -> Candidate | None:
    """A smaller cluster's layout `c` on `world` GPUs: the same LLM layout in the mode this search
    settled for it, the same encoder knobs, the encoders' share of ranks scaled with the cluster;
    None where the layout is not in this search's pruned space."""
    base = llm_key(c)
    if base not in settled:
        return None
    out = replace(c, recompute=settled[base].recompute)
    if c.encoder_ranks:
        per = c.tp * c.pp * c.cp
        n = round(c.encoder_ranks * world / world_from / per) * per
        out = replace(out, encoder_ranks=n if 0 < n < world else 0)
    return out


def _seeded(seed: Seed, search: _Search, settled: dict) -> Candidate | None:
    """`seed` on this search's cluster: its LLM layout (it must be in the pruned space), its encoder
    knobs (the encoders' share of ranks scaled with the cluster), in its own recompute mode where the
    analytic bound allows it here, else in the mode this search settled for the layout; None where
    the layout is outside this search's space."""
    c = _scaled(seed.candidate, seed.world, search.world, settled)
    if c is None:
        return None
    # the seed's own mode under the name this search gives it (a mode that recomputes an encoder with
    # no work here is the one without it)
    own = replace(c, recompute=search.searched_mode(seed.candidate.recompute) or seed.candidate.recompute)
    for cand in (own, c):
        try:
            cand.parallel(search.world, search.gpn).validate(search.model)
            if cand.recompute not in search.modes or search.bound(cand) > search.capacity:
                continue
        except (SpecError, PlanError, ValueError):
            continue
        return cand
    return None

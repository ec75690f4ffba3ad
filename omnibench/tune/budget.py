"""How much a search simulates: its budget (a fraction of the layouts left after pruning, at least
MIN_BUDGET: `resolve_budget`), the waves it simulates them in, and the rounds of its descents."""

from __future__ import annotations

import math

BUDGET_FRACTION = 0.25  # of the layouts left after pruning, simulated in the LLM-layout phase
MIN_BUDGET = 4
DEFAULT_BUDGET = 0  # 0: BUDGET_FRACTION of the space
ENCODER_ROUNDS = 1  # best LLM layouts whose encoder knobs are searched afterwards
DESCENT_ROUNDS = 8  # rounds of the neighbour descent around the best layout (each: its one-change neighbours)
# the guard's window decides between its answer and the layouts within this margin of it on the tuned steps,
# at most this many (each runs every step of the window: the cost is contenders x window steps)
WINDOW_MARGIN = 0.10
WINDOW_CONTENDERS = 4
WAVE = 8  # layouts simulated together; a constant, so results never depend on the worker count


def resolve_budget(budget: int, fraction: float, space: int) -> int:
    """Layouts simulated in the LLM phase: `budget` when given, else `fraction` of the pruned space
    (at least MIN_BUDGET, at most all of it)."""
    if budget:
        return budget
    return min(space, max(MIN_BUDGET, math.ceil(fraction * space)))

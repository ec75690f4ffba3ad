"""Loss and parameter parity: every baseline system, run on 4 gloo ranks under several layouts,
trains exactly like a single process (same init, same batches) to 1e-4 in fp32.

All cells run in the default test run: each group's runs share one launch of ranks (tests/parity.py).
They train with SGD (OPTIMIZER): a gradient off by a constant factor would train exactly alike under
Adam (tests/parity.py `optimizer_for`); Adam's sharded state is tests/test_runtime_zero.py's.

Two steps (LAYOUT_STEPS), not the harness's three: SGD keeps no state, so the second loss (taken with
the weights the first step's gradients moved) and the final parameters (moved by both steps'
gradients) check everything a third step would, on the same kinds of batches.
"""

from __future__ import annotations

import pytest
from parity import (  # noqa: F401 - re-exported: other parity modules import the harness from here too
    STEPS,
    Run,
    assert_parity,
    make_batches,
    reference,
    run_all,
    run_distributed,
)

OPTIMIZER = "sgd"
LAYOUT_STEPS = 2


def layout_batches():
    return make_batches(LAYOUT_STEPS)


CELLS = [
    # (system, layout, model)
    ("homogeneous", {}, "tiny-omni"),
    ("homogeneous", {"tp": 2}, "tiny-omni"),
    ("homogeneous", {"pp": 2}, "tiny-omni"),
    ("homogeneous", {"cp": 2}, "tiny-omni"),
    ("homogeneous", {"cp": 2, "cp_kind": "allgather"}, "tiny-omni"),  # two opposite pieces of the row per rank
    ("homogeneous", {"ep": 2}, "tiny-omni-moe"),
    ("temporal", {}, "tiny-omni"),
    ("temporal", {"tp": 2}, "tiny-omni"),
    ("temporal", {"cp": 2}, "tiny-omni"),
    ("temporal", {"ep": 2}, "tiny-omni-moe"),
    ("colocated", {}, "tiny-omni"),
    ("colocated", {"tp": 2}, "tiny-omni"),
    ("colocated", {"pp": 2}, "tiny-omni"),
    ("colocated", {"cp": 2}, "tiny-omni"),
    ("colocated", {"cp": 2, "cp_kind": "allgather", "pp": 2}, "tiny-omni"),
    ("colocated", {"ep": 2}, "tiny-omni-moe"),
    ("noncolocated", {}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "tp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "pp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "cp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "ep": 2}, "tiny-omni-moe"),
    # Encoders with their own tp group (gradients broadcast inside it), and plain replicated DP.
    ("colocated", {"encoder_tp": 2, "pp": 2}, "tiny-omni"),
    ("noncolocated", {"encoder_ranks": 2, "encoder_tp": 2}, "tiny-omni"),
    ("homogeneous", {"fsdp": False, "pp": 2}, "tiny-omni"),
    ("temporal", {"fsdp": False, "ep": 2}, "tiny-omni-moe"),
    # Spatial multiplexing: each phase's encoder and LLM lanes on threads of their own, side by side.
    ("spatial", {"microbatches": 2}, "tiny-omni"),
    ("spatial", {"cp": 2, "microbatches": 3, "options": {"quota": "0.5"}}, "tiny-omni"),
]

# Cells that run the same code as another cell, in the slow run only (each in a launch of its own):
# temporal at dp and at ep 2 plans exactly homogeneous's steps there (the same layouts, assignment,
# routes and actions on every batch; the same resolved run spec but its name; neither has a loader
# exchange, and the ranks never read the system's name), so the ranks run what those cells run.
SLOW_CELLS = {"temporal-dp", "temporal-ep2"}

RECOMPUTE_CELLS = [
    ("homogeneous", {"pp": 2}, "full"),
    ("omni", {}, "full"),
    ("temporal", {"cp": 2}, "selective"),
    ("temporal", {"cp": 2}, "full"),  # encoders: Ulysses cores inside checkpointed, FSDP-sharded blocks
    ("homogeneous", {"cp": 2, "cp_kind": "allgather"}, "full"),  # the recomputed attention gathers K/V again
    ("colocated", {"tp": 2}, "vision=full,audio=full"),
    ("noncolocated", {"encoder_ranks": 2}, "full"),
]


def _id(cell) -> str:
    system, layout, _ = cell
    return system + "-" + ("-".join(f"{v}" if k == "cp_kind" else f"{k}{v}" for k, v in layout.items()) or "dp")


def _recompute_id(cell) -> str:
    kind = f"-{cell[1]['cp_kind']}" if "cp_kind" in cell[1] else ""
    return f"{cell[0]}{kind}-{cell[2].replace(',', '+')}"


def _twin(cell) -> tuple[str, dict]:
    """The run a recompute cell compares with: its system and layout without checkpointing. Where that
    is one of CELLS (whose recompute, auto, is none on the CPU), the layout run serves."""
    system, layout, _ = cell
    same = [c for c in CELLS if (c[0], c[1], c[2]) == (system, layout, "tiny-omni") and _id(c) not in SLOW_CELLS]
    if same:
        return _id(same[0]), {}
    return _id((system, layout, "tiny-omni")) + "-recompute-none", {**layout, "recompute": "none"}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout cell, every recompute cell and the runs without checkpointing they compare with
    that are not layout cells, in one launch."""
    batches = layout_batches()
    runs = [Run(_id(c), c[0], c[2], batches, c[1], OPTIMIZER) for c in CELLS if _id(c) not in SLOW_CELLS]
    for c in RECOMPUTE_CELLS:
        system, layout, mode = c
        runs.append(Run(_recompute_id(c), system, "tiny-omni", batches, {**layout, "recompute": mode}, OPTIMIZER))
        key, twin = _twin(c)
        if twin and key not in {r.key for r in runs}:
            runs.append(Run(key, system, "tiny-omni", batches, twin, OPTIMIZER))
    return run_all(tmp_path_factory.mktemp("layouts"), runs)


@pytest.mark.timeout(1200)  # the first cell's setup launches all of them
@pytest.mark.xdist_group("parity-layouts")
@pytest.mark.parametrize("cell", [pytest.param(c, id=_id(c), marks=[pytest.mark.slow] if _id(c) in SLOW_CELLS else [])
                                  for c in CELLS])
def test_system_layout_matches_single_process(layout_runs, cell, tmp_path):
    system, layout, model = cell
    key = _id(cell)
    run = layout_runs[key] if key in layout_runs else \
        run_all(tmp_path, [Run(key, system, model, layout_batches(), layout, OPTIMIZER)])[key]
    losses, params = run.get()
    assert_parity(losses, params, *reference(model, layout_batches(), OPTIMIZER))


@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("parity-layouts")  # layout_runs: one launch with the layout cells
@pytest.mark.parametrize("cell", [pytest.param(c, id=_recompute_id(c)) for c in RECOMPUTE_CELLS])
def test_activation_checkpointing_keeps_the_losses_and_parameters(layout_runs, cell):
    """--recompute trains exactly as without it: the same losses to 1e-5 as the same system and
    layout without checkpointing, and parity with the single process."""
    losses, params = layout_runs[_recompute_id(cell)].get()
    plain, _ = layout_runs[_twin(cell)[0]].get()
    assert max(abs(a - b) for a, b in zip(losses, plain, strict=True)) < 1e-5, (losses, plain)
    assert_parity(losses, params, *reference("tiny-omni", layout_batches(), OPTIMIZER))

"""Every constant of the cost model that was fitted to published results, in one place.

The cost code reads these through `fitted(name)` (a hardware file through `field = "fitted:NAME"`);
nothing else in `simulator/` may carry a number fitted to measured runs
(`tests/test_fitted_constants.py` fails on one). Each entry says what it was fitted on, by which
command, and its error on the rows it was fitted on and on rows it never saw, read off the committed
validation table (`results/validation/published_table.json`, the same test recomputes them).
A constant measured directly (a datasheet, a kernel profile, an allocator's out-of-memory message) is
not fitted and is not here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FittedConstant:
    name: str
    value: float
    meaning: str
    fitted_on: str  # the rows (results/validation/published_runs.csv) and the command that fits it
    # which table rows measure its error, by (split, hardware prefix, memory?): see `rows_of`
    hardware: tuple[str, ...]
    memory: bool  # its error is the peak-memory error (else the step-time error)
    in_sample: float  # mean |error| on the calibration rows it was fitted on
    out_of_sample: float  # mean |error| on the held-out rows of the same scope
    caveat: str = ""


_SCALE = ("the share of the kernel profile's GEMM and attention rates the GPU holds through a training step "
          "(sustained clocks under its power limit)")

FITTED: dict[str, FittedConstant] = {c.name: c for c in (
    FittedConstant(
        "kernel_compute_scale.a100", 0.835, _SCALE + "; A100 40 GB and 80 GB",
        "the A100 calibration rows of results/validation/published_runs.csv (three sources): "
        "python benchmarks/fit_published_machine.py", ("a100-80g", "a100-40g"), False, 0.0704, 0.0876),
    FittedConstant(
        "kernel_compute_scale.v100", 1.065, _SCALE + "; the A100-shaped profile is pessimistic on Volta",
        "the V100 calibration rows (one source): python benchmarks/fit_published_machine.py", ("v100-32g",),
        False, 0.0069, 0.1459, caveat="fitted on one source's rows (one calibration row): no other source checks it; "
                                      "the fit command now gives 1.081 (its row read as Megatron-LM 2021 runs it)"),
    FittedConstant(
        "kernel_compute_scale.h100-500w", 0.660, _SCALE + "; the H100 96 GB HBM2e at a 500 W cap",
        "the h100-500w calibration rows (one source, torchtitan's benchmarks): "
        "python benchmarks/fit_published_machine.py",
        ("h100-500w",), False, 0.0999, 0.1004,
        caveat="fitted on one source's rows: its held-out rows are the same source's, no other source checks it; "
               "fitted while that source's compiled 70B/405B runs were costed with eager kernels: read as compiled "
               "(their software column) its calibration error rose from 9.9% to 13.6%, and is 10.0% with the 405B "
               "pipelined rows cut into the microbatches their stack cuts (rule 3 of results/validation/README.md); "
               "the fit command has not been rerun with that rule"),
    FittedConstant(
        "fragmentation", 1.175,
        "reserved / allocated bytes at the peak when memory is plentiful (the caching allocator's split "
        "and cached blocks), one factor for every stack and GPU",
        "the calibration rows that publish a peak (torchtitan's max_reserved readings): "
        "python benchmarks/published_memory.py", ("",), True, 0.0266, 0.0514,
        caveat="every published peak is torchtitan's: its held-out rows are the same source's; the command, reading "
               "each row as its simulate command runs it (the CSV's micro batch), now fits 1.220: not adopted yet, "
               "as it moves every reported peak (the runtime's own included) and needs the checks against measured "
               "GPU peaks rerun"),
)}


def fitted(name: str) -> float:
    """The value of fitted constant `name` (KeyError naming the known ones otherwise)."""
    if name not in FITTED:
        raise KeyError(f"no fitted constant {name!r}; known: {', '.join(FITTED)}")
    return FITTED[name].value


def rows_of(constant: FittedConstant, rows: list[dict], split: str) -> list[dict]:
    """The rows of the validation table (`published_table.json` "rows") that measure `constant`'s error in
    `split`: those on its hardware (every GPU for ""), with a published peak for a memory constant. Encoder +
    LLM rows are left out, as the table reports them apart: their data shapes rest on fill rules of their
    own, so their error is no measure of a machine or allocator constant."""
    return [r for r in rows if r["split"] == split and any(r["hardware"].startswith(h) for h in constant.hardware)
            and (not constant.memory or r.get("published_memory_gib") is not None)
            and (constant.memory or r.get("flop_formula") != "unstated") and not r.get("multimodal")]


def mean_abs_error(constant: FittedConstant, rows: list[dict], split: str) -> float | None:
    got = rows_of(constant, rows, split)
    key = "memory_error" if constant.memory else "error"
    return sum(abs(r[key]) for r in got) / len(got) if got else None

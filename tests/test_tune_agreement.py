"""`omnibench tune` and `simulate --tuned` answer the same layout, at the same step time, for the same inputs:
one search behind both commands."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from omnibench.cli import app

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("system", ["temporal", "omni"])
def test_tune_and_simulate_tuned_give_the_same_answer(system):
    runner = CliRunner()
    common = ["--system", system, "--workload", "mixed_video", "--gpus", "16", "--json"]  # the step cache shared
    tuned = runner.invoke(app, ["tune", *common, "--budget", "4"])
    simulated = runner.invoke(app, ["simulate", *common, "--tuned", "--tune-budget", "4"])
    assert tuned.exit_code == 0 and simulated.exit_code == 0, (tuned.output, simulated.output)
    best = json.loads(tuned.stdout)["best"]
    row = json.loads(simulated.stdout)["results"][0]
    assert row["layout"] == best["layout"]
    assert row["step_time_s"] == pytest.approx(best["step_s"], rel=1e-9)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(best["tokens_per_s_per_gpu"], rel=1e-9)

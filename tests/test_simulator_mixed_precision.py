"""`--mixed-precision master` in the simulator (SimOptions.mixed_precision, ParallelSpec.mixed_precision):
a module FSDP does not shard holds bf16 weights with an fp32 master and fp32 main gradients, 2 bytes
more per parameter than fp32 weights under autocast, no per-forward weight casts and a bf16 residual
stream; FSDP-held modules are untouched; `simulate`, `run`'s check and validation of a record all
see it (the GPU record it was checked on: tests/test_gpu_records.py, within 0.1% of the peak)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from omnibench.cli import app
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields
from omnibench.specs.presets import get_model
from simulator.engine import Engine, SimOptions
from simulator.hardware import load_cluster
from simulator.work import eager_stack
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

pytestmark = pytest.mark.timeout(240)


def _engine(mixed_precision: str, world: int = 1, mode: str = "ddp", recompute: str = "none") -> Engine:
    spec = get_model("llm-7b@4L")
    batch = Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(2 * world)])
    plan = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=world, **dp_mode_fields(mode)), batch)
    return Engine(plan, spec, load_cluster("h100", world),
                  options=SimOptions(check_memory=False, mixed_precision=mixed_precision, recompute=recompute))


def test_one_rank_holds_two_bytes_more_per_parameter_and_no_weight_casts():
    auto, master = _engine("autocast"), _engine("master")
    params = sum(auto._model_parallel_params("llm", 0))
    assert master._static_memory(0) - auto._static_memory(0) == pytest.approx(2 * params)
    assert auto._casts("llm", 0) and not master._casts("llm", 0)
    a, m = auto.run(), master.run()
    assert m.step_time < a.step_time  # no fp32 weight casts, norms and residual adds at half the bytes
    # without recomputation the bf16 residual stream keeps less than the state adds (the peak falls);
    # under full recomputation the activations are small and the state decides (the GPU run's case)
    assert m.ranks[0].memory_bytes < a.ranks[0].memory_bytes
    a, m = _engine("autocast", recompute="full").run(), _engine("master", recompute="full").run()
    assert m.ranks[0].memory_bytes > a.ranks[0].memory_bytes


def test_ddp_over_four_ranks_is_held_the_same_way():
    auto, master = _engine("autocast", 4), _engine("master", 4)
    params = sum(auto._model_parallel_params("llm", 0))
    assert master._static_memory(0) - auto._static_memory(0) == pytest.approx(2 * params)


def test_fsdp_modules_are_untouched():
    a, m = _engine("autocast", 4, "fsdp").run(), _engine("master", 4, "fsdp").run()
    assert m.step_time == a.step_time and m.ranks[0].memory_bytes == a.ranks[0].memory_bytes


def test_the_eager_stack_of_a_master_module_is_bf16():
    spec = get_model("llm-7b@4L")
    lay = get_planner("homogeneous").plan(spec, ParallelSpec(world_size=1),
                                          Batch(0, [Sample(0, "t", (Segment("text", 64),))])).layouts["llm"]
    assert (eager_stack(spec, "llm", lay).residual_bytes, eager_stack(spec, "llm", lay).weight_cast) == (4, True)
    assert (eager_stack(spec, "llm", lay, True).residual_bytes, eager_stack(spec, "llm", lay, True).weight_cast) == (2, False)


def test_runs_check_estimates_the_arrangement_it_will_run():
    from omnibench.resolve import peak_memory

    spec = get_model("llm-7b@4L")
    par = ParallelSpec(world_size=1, recompute="full")  # the state decides (see the first test)
    batches = [Batch(0, [Sample(i, "t", (Segment("text", 4096),)) for i in range(2)])]
    auto, _ = peak_memory("homogeneous", spec, par, batches, load_cluster("h100", 1))
    master, _ = peak_memory("homogeneous", spec, replace(par, mixed_precision="master"), batches, load_cluster("h100", 1))
    assert master > auto


def test_parallel_spec_refuses_an_unknown_arrangement():
    from omnibench.specs.model import SpecError

    with pytest.raises(SpecError, match="mixed_precision must be one of autocast, master; got 'fp16'"):
        ParallelSpec(world_size=1, mixed_precision="fp16").validate(get_model("llm-7b@4L"))


def _one_error_line(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.output


def test_simulate_takes_it_and_refuses_what_it_cannot_mean(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    assert "--mixed-precision" in r.output
    base = ["simulate", "-w", "text_only", "-s", "homogeneous", "-m", "llm-7b@4L", "--gpus", "8", "--tp", "1",
            "--pp", "1", "--cp", "1", "--dp-mode", "ddp", "--recompute", "full", "--out", str(tmp_path), "--json"]
    _one_error_line(CliRunner().invoke(app, base + ["--mixed-precision", "fp16"]),
                    "mixed-precision must be one of autocast, master; got 'fp16'")
    _one_error_line(CliRunner().invoke(app, base + ["--mixed-precision", "master", "--stack", "fused"]),
                    "mixed-precision master is this project's runtime's (--stack eager)")
    import json

    rows, configs = {}, {}
    for mp in ("autocast", "master"):
        out = tmp_path / mp
        r = CliRunner().invoke(app, [*base[:-3], "--out", str(out), "--mixed-precision", mp])
        assert r.exit_code == 0, r.output
        (folder,) = out.iterdir()
        (row,) = json.loads((folder / "results.json").read_text())
        rows[mp], configs[mp] = row, json.loads((folder / "config.json").read_text())
    # the record says which arrangement it simulated, and the two differ where they should:
    # 2 bytes more per parameter under full recomputation, and no weight casts (a shorter step)
    assert (configs["autocast"]["mixed_precision"], configs["master"]["mixed_precision"]) == ("autocast", "master")
    assert rows["master"]["peak_memory_gib"] > rows["autocast"]["peak_memory_gib"]
    assert rows["master"]["step_time_s"] < rows["autocast"]["step_time_s"]


def test_a_run_spec_carries_it_to_the_runs_estimate():
    """`run`'s memory check (omnibench/runtime/memory.py estimate) simulates the arrangement the run asks
    for: RunSpec.mixed_precision reaches the ParallelSpec the estimate plans with."""
    from omnibench.runtime.memory import estimate
    from omnibench.runtime.run_inputs import parallel_spec
    from omnibench.specs.run import RunSpec

    spec = RunSpec(system="homogeneous", workload="text_only", model="llm-7b@4L", nproc=1, steps=1,
                   recompute="full", dtype="bf16", global_batch_tokens=8192, length_scale=1.0,
                   extra={"device": "cuda"})
    assert parallel_spec(replace(spec, mixed_precision="master"), 1).mixed_precision == "master"
    auto = estimate(spec).peak_bytes
    master = estimate(replace(spec, mixed_precision="master")).peak_bytes
    from omnibench.specs.costs import model_params

    params = model_params(get_model("llm-7b@4L"))["total"]
    # 2 bytes more state per parameter, less a little of the activations (a bf16 residual stream)
    assert 1.8 * params < master - auto <= 2 * params


def test_an_fp32_run_refuses_master_in_one_line():
    from omnibench.runtime.launch import resolve
    from omnibench.specs.model import SpecError
    from omnibench.specs.run import RunSpec

    with pytest.raises(SpecError, match="mixed_precision master .* needs dtype bf16"):
        resolve(RunSpec(system="homogeneous", device="cpu", mixed_precision="master"))
    _one_error_line(CliRunner().invoke(app, ["run", "--system", "homogeneous", "--mixed-precision", "master",
                                             "--device", "cpu", "--steps", "1", "--out", "/nonexistent/never"]),
                    "needs dtype bf16")


def test_run_refuses_an_unknown_arrangement_in_one_line():
    _one_error_line(CliRunner().invoke(app, ["run", "--system", "homogeneous", "--mixed-precision", "fp16",
                                             "--device", "cpu", "--steps", "1"]),
                    "mixed_precision must be one of autocast, master; got 'fp16")


def test_omnis_planner_prices_encoders_as_the_arrangement_holds_them():
    """omni's placement prices (systems/omni/long_short.py GroupCosts) read the same bf16 / autocast
    choice as the simulator: an encoder under DDP casts its fp32 weights per forward under autocast,
    not under master, so a microbatch costs less under master; FSDP-held encoders are bf16 either way."""
    from systems.omni.layout import build_layouts
    from systems.omni.long_short import GroupCosts

    model = get_model("omni-7b@4L")
    # large enough that its element-wise work is bound by bytes, not by kernel launches
    image = Sample(0, "i", (Segment("image", 4096, 16384, grid_thw=(1, 128, 128)),))
    for encoder_dp, differs in (("ddp", True), ("fsdp", False)):
        lay = build_layouts(model, ParallelSpec(world_size=8), encoder_dp)["vision"]
        auto, master = (GroupCosts(model, None, "h100", {}, master=m).microbatch_seconds("vision", [image], 1, lay)
                        for m in (False, True))
        assert (master < auto) if differs else (master == auto), (encoder_dp, auto, master)


def test_tunes_memory_bound_holds_the_arrangement():
    """tune's analytic memory bound (omnibench/tune/estimates.py memory_estimate) charges a replicated module (one
    rank) 2 bytes more per parameter under master, as the simulator does; FSDP-held modules are
    untouched. (The bound reads the system's own data-parallel mode, not --dp-mode: a lower bound.)"""
    from omnibench.tune import Candidate, memory_estimate

    spec = get_model("llm-7b@4L")
    samples = [Sample(i, "t", (Segment("text", 4096),)) for i in range(8)]
    c = Candidate("homogeneous", recompute="full")
    params = sum(_engine("autocast")._model_parallel_params("llm", 0))
    one, eight = ([memory_estimate("homogeneous", spec, n, 8, c, samples[:n], mixed_precision=m)
                   for m in ("autocast", "master")] for n in (1, 8))
    # 2 bytes per parameter allocated, and the allocator's share of them (simulator/memory.py memory_needed)
    assert 2 * params <= one[1] - one[0] <= 2.5 * params
    assert eight[1] == eight[0]


def test_tune_and_simulate_tuned_search_under_it(tmp_path):
    """`tune --mixed-precision master` and `simulate --tuned --mixed-precision master` search with the
    arrangement (its own tune cache key: an autocast answer is never reused for it) and simulate the
    answer under it."""
    import json

    base = ["-w", "text_only", "-s", "homogeneous", "-m", "llm-7b@4L", "--gpus", "1", "--workers", "1"]
    best = {}
    for mp in ("autocast", "master"):
        r = CliRunner().invoke(app, ["tune", *base, "--budget", "2", "--mixed-precision", mp, "--json"])
        assert r.exit_code == 0, r.output
        best[mp] = json.loads(r.output)["default"]
    assert best["master"]["estimate_gib"] > best["autocast"]["estimate_gib"], best
    assert best["master"]["peak_gib"] != best["autocast"]["peak_gib"], best
    _one_error_line(CliRunner().invoke(app, ["tune", *base, "--mixed-precision", "fp16"]),
                    "mixed-precision must be one of autocast, master; got 'fp16'")
    out = tmp_path / "sims"
    r = CliRunner().invoke(app, ["simulate", *base, "--tuned", "--tune-budget", "2", "--mixed-precision", "master",
                                 "--out", str(out), "--tune-cache", str(tmp_path / "cache.json")])
    assert r.exit_code == 0, r.output
    (folder,) = out.iterdir()
    assert json.loads((folder / "config.json").read_text())["mixed_precision"] == "master"
    keys = list(json.loads((tmp_path / "cache.json").read_text()))
    assert keys and all("|mixed_precision=master" in k for k in keys), keys

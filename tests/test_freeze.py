"""`--freeze MODULES`: modules whose parameters take no gradient, end to end.

The runtime trains exactly like one process with the same modules frozen (and leaves the frozen
parameters as they were initialised); every planner drops a frozen encoder's backward, gradient
reduction and gradient boundary, and a frozen module's optimizer step; the simulator charges what is
left (less memory, a shorter step); the commands take the option and record it.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_errors import invoke, one_error_line
from parity import Run, assert_parity, make_batches, reference, run_all

from omnibench.plan import BACKWARD, BOUNDARY, GRAD_SYNC, OPTIMIZER_STEP
from omnibench.specs.model import SpecError, freeze_for_model, parse_freeze
from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import SYSTEMS, get_planner

ENCODERS = ("vision", "audio")
OPTIMIZER = "sgd"  # a gradient off by a factor shows in every parameter (tests/parity.py optimizer_for)
STEPS = 2
NPROC = 2

# (key, system, layout): frozen encoders under FSDP, a frozen LLM under omni (its encoders train through
# the LLM's input gradients), and noncolocated's encoder rank holding nothing that trains (no optimizer step)
CELLS = [
    ("homogeneous-encoders", "homogeneous", {"freeze": ENCODERS}),
    ("omni-llm", "omni", {"freeze": ("llm",)}),
    ("noncolocated-encoders", "noncolocated", {"freeze": ENCODERS, "encoder_ranks": 1}),
]


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory):
    batches = make_batches(STEPS)
    runs = [Run(key, system, "tiny-omni", batches, layout, OPTIMIZER) for key, system, layout in CELLS]
    return run_all(tmp_path_factory.mktemp("freeze"), runs, nproc=NPROC)


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("parity-freeze")
@pytest.mark.parametrize("cell", CELLS, ids=[c[0] for c in CELLS])
def test_frozen_modules_train_like_one_process_and_keep_their_initial_weights(frozen_runs, cell):
    key, _, layout = cell
    losses, params = frozen_runs[key].get()
    batches = make_batches(STEPS)
    assert_parity(losses, params, *reference("tiny-omni", batches, OPTIMIZER, layout["freeze"]))
    init = dict(torch.nn.Module.named_parameters(_initial_model()))
    frozen = [n for n in params if n.split(".")[0] in layout["freeze"]]
    assert frozen
    changed = [n for n in frozen if not torch.equal(params[n], init[n].detach())]
    assert not changed, f"frozen parameters moved: {changed[:5]}"
    trained = [n for n in params if n.split(".")[0] not in layout["freeze"]]
    assert any(not torch.equal(params[n], init[n].detach()) for n in trained)  # the rest did train
    config = json.loads((frozen_runs[key].folder / "config.json").read_text())
    assert config["run"]["freeze"] == list(layout["freeze"])


def _initial_model():
    from omnibench.models import build_model

    return build_model(get_model("tiny-omni"), seed=0)


# --------------------------------------------------------------------------------- planners, simulator

GPUS = 8


@pytest.fixture(scope="module")
def sim_inputs():
    from simulator.hardware import load_cluster
    from workloads.stream import WorkloadStream

    # omni_av feeds both encoders; a 4-layer LLM keeps each simulation to a few hundredths of a second
    batch = WorkloadStream("omni_av", seed=0, global_batch_tokens=8192 * GPUS).batch(0)
    return get_model("omni-7b@4L"), batch, load_cluster("h100", GPUS)


def _simulate(system: str, inputs, freeze: tuple[str, ...] = (), recompute: str = "none"):
    from simulator.engine import Engine, SimOptions

    model, batch, cluster = inputs
    plan = get_planner(system).plan(
        model, ParallelSpec(world_size=GPUS, recompute=recompute, freeze=freeze), batch
    )
    engine = Engine(plan, model, cluster, options=SimOptions(recompute=recompute, check_memory=False))
    return plan, engine, engine.run()


@pytest.mark.parametrize("system", SYSTEMS)
def test_frozen_encoders_plan_no_backward_and_simulate_smaller_and_faster(system, sim_inputs):
    plan0, engine0, trained = _simulate(system, sim_inputs)
    plan, _, frozen = _simulate(system, sim_inputs, ENCODERS)
    plan.validate(order=True)  # every send still has its recv, in the same order per pair
    assert plan.options["freeze"] == list(ENCODERS)
    for rank, acts in plan.actions.items():
        for a in acts:
            if a.module in ENCODERS:
                assert a.kind not in (BACKWARD, GRAD_SYNC), f"rank {rank}: {a}"
                assert not (a.kind == BOUNDARY and a.what == "grad"), f"rank {rank}: {a}"
        holds_llm = rank in plan.layouts["llm"].ranks
        assert any(a.kind == OPTIMIZER_STEP for a in acts) == holds_llm, f"rank {rank}"
        assert any(a.kind == BACKWARD and a.module == "llm" for a in acts) == holds_llm
    # the unfrozen plan had encoder backwards, so the test above can fail
    assert any(a.kind == BACKWARD and a.module in ENCODERS for acts in plan0.actions.values() for a in acts)
    assert frozen.step_time < trained.step_time
    before = {r.rank: r.memory_allocated for r in trained.ranks}
    after = {r.rank: r.memory_allocated for r in frozen.ranks}
    for rank in before.keys() & after.keys():
        state = [engine0._module_state(m, rank) for m in ENCODERS if rank in plan0.layouts[m].ranks]
        saved = sum(s.grads + s.optimizer for s in state)
        assert before[rank] - after[rank] >= saved, rank
    assert max(after.values()) < max(before.values())


def test_a_frozen_llm_keeps_its_backward_for_the_encoders_and_drops_its_weight_gradients(sim_inputs):
    _, _, trained = _simulate("homogeneous", sim_inputs)
    plan, engine, frozen = _simulate("homogeneous", sim_inputs, ("llm",))
    kinds = {(a.kind, a.module) for acts in plan.actions.values() for a in acts}
    assert (BACKWARD, "llm") in kinds and (BACKWARD, "vision") in kinds and (GRAD_SYNC, "vision") in kinds
    assert (GRAD_SYNC, "llm") not in kinds
    assert frozen.step_time < trained.step_time
    assert max(r.memory_allocated for r in frozen.ranks) < max(r.memory_allocated for r in trained.ranks)
    # its backward: the input gradients alone (about half the matmul FLOPs), so fewer model FLOPs
    assert frozen.model_flops < trained.model_flops
    state = engine._module_state("llm", 0)
    assert state.grads == state.optimizer == 0 and state.params > 0


def test_recomputing_a_frozen_encoder_changes_nothing(sim_inputs):
    _, _, plain = _simulate("omni", sim_inputs, ENCODERS)
    _, _, recomputed = _simulate("omni", sim_inputs, ENCODERS, "vision=full,audio=full")
    assert recomputed.step_time == plain.step_time
    assert max(r.memory_allocated for r in recomputed.ranks) == max(r.memory_allocated for r in plain.ranks)


def test_tunes_memory_bound_sees_the_frozen_modules():
    from omnibench import tune

    model, c = get_model("omni-7b@4L"), tune.Candidate("temporal")
    from workloads.stream import WorkloadStream

    samples = WorkloadStream("omni_av", seed=0, global_batch_tokens=8192 * GPUS).batch(0).samples
    full = tune.memory_estimate("temporal", model, GPUS, 8, c, samples)
    assert tune.memory_estimate("temporal", model, GPUS, 8, c, samples, frozen="vision,audio") < full
    assert tune.memory_estimate("temporal", model, GPUS, 8, c, samples, frozen="llm") < full
    assert tune._dp_fields(None, "autocast", ("vision",)) == {"freeze": ("vision",)}


def test_freeze_is_checked_once_at_the_edge():
    assert parse_freeze("llm, vision") == ("vision", "llm")
    with pytest.raises(SpecError, match="--freeze: unknown module 'x'; allowed: vision, audio, llm"):
        parse_freeze("vision,x")
    vl = get_model("qwen2-vl-7b")
    with pytest.raises(SpecError, match="unknown module 'audio' for qwen2-vl-7b; allowed: vision, llm"):
        freeze_for_model(("audio",), vl, vl)
    with pytest.raises(SpecError, match="nothing would train"):
        ParallelSpec(world_size=8, freeze=("vision", "llm")).validate(vl)
    # an encoder the workload never feeds is left out of the model, and of what is frozen
    omni = get_model("omni-7b")
    assert freeze_for_model(("vision", "audio"), omni, get_model("omni-7b@no-audio")) == ("vision",)


# ------------------------------------------------------------------------------------------- commands


def test_simulate_freeze_records_it_and_costs_less(tmp_path):
    args = [
        "simulate",
        "-w",
        "image_sft",
        "-s",
        "temporal",
        "--gpus",
        "8",
        "--model",
        "omni-7b@4L",
        "--global-batch-tokens",
        "65536",
        "--recompute",
        "none",
        "--json",
        "--no-trace",
    ]
    r = invoke(*args, "--out", tmp_path / "a")
    frozen = invoke(*args, "--freeze", "vision", "--out", tmp_path / "b")
    assert r.exit_code == 0 and frozen.exit_code == 0, r.output + frozen.output
    row, frow = json.loads(r.output)["results"][0], json.loads(frozen.output)["results"][0]
    assert frow["freeze"] == ["vision"] and "freeze" not in row
    assert frow["step_time_s"] < row["step_time_s"] and frow["peak_memory_gib"] < row["peak_memory_gib"]
    rec = tmp_path / "b" / json.loads(frozen.output)["record"].split("/")[-1]
    assert json.loads((rec / "config.json").read_text())["freeze"] == ["vision"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--freeze", "bogus"], ["--freeze", "'bogus'", "vision, audio, llm"]),
        (["--freeze", "vision,llm"], ["--freeze", "nothing would train"]),  # image_sft: omni-7b@no-audio
    ],
)
def test_simulate_bad_freeze_is_one_line(tmp_path, args, needles):
    r = invoke("simulate", "-w", "image_sft", "-s", "temporal", "--gpus", "8", "--out", tmp_path, *args)
    one_error_line(r, *needles)
    assert not any(tmp_path.iterdir())


def test_plan_freeze_vision_shows_no_vision_backward():
    r = invoke("plan", "--system", "colocated", "--nproc", "4", "--freeze", "vision", "--recompute", "none")
    assert r.exit_code == 0, r.output
    assert "frozen: vision" in r.output and "'freeze': ['vision']" in r.output
    assert "forward(vision" in r.output and "backward(llm" in r.output
    assert "backward(vision" not in r.output and "grad_sync(vision" not in r.output
    assert "vision, mb0, grad" not in r.output

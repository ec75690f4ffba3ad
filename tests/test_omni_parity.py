"""omni trains exactly like a single process (fp32, 4 gloo ranks, 1e-4), with every technique on and
with each one switched off, on batches that exercise them: long videos and audio clips that take the
sequence-parallel path (Ulysses inside one attention sequence, or whole frame groups / windows per
rank), and skewed loads that make resharding move samples.

Every case runs in the default test run (but SLOW_CASES, which run what another case runs); they share
one launch of ranks (tests/parity.py), and train with SGD (OPTIMIZER: a gradient off by a constant factor shows, where Adam's update would hide it)."""

from __future__ import annotations

import random

import pytest
from parity import Run, assert_parity, make_batches, reference, run_all

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.presets import get_model
from systems import get_planner
from workloads.sample import Batch, Sample, Segment

STEPS = 3
# The ablation and layout cases train two of long_batches' steps: those already take both sequence-
# parallel paths, change the audio group's size between steps and make resharding move samples (the
# third adds a second long video, and is the dearest step); the LLM split cells keep all three.
CASE_STEPS = 2
OPTIMIZER = "sgd"


def long_batches(steps: int = STEPS, seed: int = 1) -> list[Batch]:
    """The parity harness's small mixed batches, each with one long video (and, on odd steps, one
    long audio clip) whose encoder cost is far above a rank's balanced share."""
    base = make_batches(steps, samples=8, seed=seed)
    rng = random.Random(seed)
    out = []
    for b in base:
        sid = 10_000 + b.step * 10
        extra = [Sample(sid, "long_video", (Segment("text", 5), Segment("video", 45, 180, grid_thw=(3, 6, 10)),
                                              Segment("text", rng.randint(4, 9))))]
        if b.step % 2:
            frames = 3000 + 2 * rng.randint(0, 50)
            extra.append(Sample(sid + 1, "long_audio", (Segment("text", 4), Segment("audio", frames // 4, frames // 2,
                                                                                       mel_frames=frames),
                                                        Segment("text", 6))))
        if b.step == 2:  # many frame groups / 30 s windows: split over the group without any exchange
            extra.append(Sample(sid + 2, "long_video", (Segment("text", 3), Segment("video", 32, 128, grid_thw=(8, 4, 4)),
                                                        Segment("text", 5))))
            extra.append(Sample(sid + 3, "long_audio", (Segment("text", 3), Segment("audio", 3000, 6000, mel_frames=12000),
                                                        Segment("text", 5))))
        out.append(Batch(b.step, list(b.samples) + extra))
    return out


# At tiny-omni's sizes an all-to-all's latency outweighs any encoder work, so the per-batch choice
# (`encoder_sp_scheme=auto`) would keep every sample data-parallel: these tests name the scheme.
# The LLM split likewise (`llm_split=always`: at these sizes its estimate never pays).
LONG_SHORT = {"encoder_sp_scheme": "long_short", "llm_split": "always"}


def _plan(batch: Batch, **options):
    parallel = ParallelSpec(world_size=4, options={**LONG_SHORT, **options})
    return get_planner("omni").plan(get_model("tiny-omni"), parallel, batch)


def test_long_batches_take_both_sequence_parallel_paths_and_resharding_moves_samples():
    from omnibench.runtime.long_short import split_whole_sequences

    batches = long_batches()
    plans = [_plan(b) for b in batches]
    kinds = set()
    for p in plans:
        for module, notes in p.notes["long_short"].items():
            for x in notes["long_samples"]:
                segs = [s for s in p.sample(x["sample"]).segments if s.encoder == module]
                lens = [g[1] * g[2] for g in (s.grid_thw for s in segs) for _ in range(g[0])] if module == "vision" \
                    else [w for s in segs for w in (1500,) * (s.mel_frames // 2 // 1500) + ((s.mel_frames // 2) % 1500,) if w]
                kinds.add((module, split_whole_sequences(lens, len(x["group"])) is None))
    assert kinds == {("vision", True), ("vision", False), ("audio", True), ("audio", False)}
    # group sizes change between steps: the runtime builds a step's groups when first named
    assert len({p.notes["long_short"]["audio"]["sp_group_size"] for p in plans}) > 1
    assert all(p.notes["long_short"]["vision"]["long_samples"] for p in plans)
    assert any(p.notes["long_short"]["audio"]["long_samples"] for p in plans)
    assert any(p.notes["reshard"]["samples_moved_off_loader"] > 0 for p in plans)


CASES = [
    pytest.param({}, {}, id="all-on"),
    pytest.param({"encoder_sp_scheme": "all"}, {}, id="sp-for-all"),
    pytest.param({"encoder_sp_scheme": "all"}, {"cp": 2}, id="sp-for-all-cp2"),
    pytest.param({"encoder_sp_scheme": "auto"}, {"pp": 2}, id="sp-auto-pp2"),
    # At pp 1 the joint pipeline has no bubbles to fill: without it omni plans the cases' two steps exactly
    # as all-on does (the same layouts, assignment, routes and actions): in the slow run only.
    pytest.param({"joint_pipeline": False}, {}, id="no-joint-pipeline", marks=pytest.mark.slow),
    pytest.param({"reorder": False}, {}, id="no-reorder"),
    pytest.param({"reorder_group": 2}, {}, id="two-reorder-groups"),
    # the baselines' split of the whole batch (the cumulative ablation's loading): every loader's metadata
    pytest.param({"reorder": False, "loading": "global"}, {}, id="global-loading"),
    pytest.param({"reshard": False}, {}, id="no-reshard"),
    pytest.param({"long_short_sp": False}, {}, id="no-long-short-sp"),
    pytest.param({"llm_long_short": False}, {}, id="no-llm-long-short"),
    pytest.param({}, {"pp": 2}, id="all-on-pp2"),
    pytest.param({"joint_pipeline": False}, {"pp": 2}, id="no-joint-pipeline-pp2"),
    pytest.param({}, {"tp": 2}, id="all-on-tp2"),
    pytest.param({}, {"encoder_tp": 2, "pp": 2}, id="all-on-encoder-tp2-pp2"),
    pytest.param({}, {"cp": 2}, id="all-on-cp2"),
    pytest.param({}, {"cp": 2, "pp": 2}, id="all-on-cp2-pp2"),
]
def case_batches() -> list[Batch]:
    return long_batches()[:CASE_STEPS]


def long_short_batches() -> list[Batch]:
    """The batches of the omni-vs-homogeneous and temporal runs ("all-on" is the omni one): long_batches'
    three, then long_batches' fifth as the fourth step: the two long audio clips in one group's
    microbatch (and no long LLM sample) that no other step has. The fourth of long_batches is skipped:
    it plans as the second does (a long video on 2 ranks, a long audio clip on 4, a long LLM sample)
    and its long audio clip made it one of the dearest steps to run."""
    five = long_batches(5)
    return five[:3] + [Batch(3, five[4].samples)]


LONG_SHORT_STEPS = 4
SLOW_CASES = {p.id for p in CASES if p.marks}  # each in a launch of its own, in the slow run


# The LLM long-short split under the layout's own cp and pp (test_llm_long_short_at_any_cp_and_pp_...):
# (model, layout, cp kind the plan must choose); "kv4" is tiny-omni with 4 kv heads (KV4 below). Over
# long_batches' STEPS batches: step 0 has no long LLM sample (no LLM group named), steps 1 and 2 one each.
LLM_SPLIT_CELLS = [
    pytest.param("kv4", {"cp": 2}, "ulysses", id="cp2"),
    pytest.param("kv4", {"pp": 2}, "ulysses", id="pp2"),
    pytest.param("tiny-omni", {"cp": 2}, "allgather", id="cp2-allgather"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The model names LLM_SPLIT_CELLS use, as the runs and references take them."""
    path = tmp_path_factory.mktemp("models") / "kv4.toml"
    path.write_text(KV4)
    return {"kv4": str(path), "tiny-omni": "tiny-omni"}


@pytest.fixture(scope="module")
def omni_runs(tmp_path_factory, models):
    """Every case (but SLOW_CASES), omni against homogeneous over four steps, and the LLM split under cp
    and pp, in one launch. The "all-on" case is the four-step omni run (the same options and layout; its first three
    batches are long_batches' three), checked against the single process over all four steps."""
    runs = [Run(c.id, "omni", "tiny-omni", case_batches(), {"options": {**LONG_SHORT, **c.values[0]}, **c.values[1]},
                OPTIMIZER) for c in CASES if c.id != "all-on" and c.id not in SLOW_CASES]
    four = long_short_batches()
    runs += [Run("long-short-omni", "omni", "tiny-omni", four, {"options": dict(LONG_SHORT)}, OPTIMIZER),
             Run("long-short-homogeneous", "homogeneous", "tiny-omni", four, {}, OPTIMIZER),  # its default: tp 2
             Run("temporal-cp2", "temporal", "tiny-omni", four, {"cp": 2}, OPTIMIZER)]
    runs += [Run(f"llm-split-{c.id}", "omni", models[c.values[0]], long_batches(), {"options": LONG_SHORT,
                                                                                    **c.values[1]}, OPTIMIZER)
             for c in LLM_SPLIT_CELLS]
    return run_all(tmp_path_factory.mktemp("omni"), runs)


@pytest.mark.timeout(1200)  # the first case's setup launches all of them
@pytest.mark.xdist_group("parity-omni")
@pytest.mark.parametrize("options,layout", CASES)
def test_omni_matches_single_process(omni_runs, request, tmp_path, options, layout):
    case = request.node.callspec.id
    if case == "all-on":
        batches = long_short_batches()
        losses, params = omni_runs["long-short-omni"].get()
    else:
        batches = case_batches()
        run = omni_runs[case] if case in omni_runs else run_all(tmp_path, [Run(
            case, "omni", "tiny-omni", batches, {"options": {**LONG_SHORT, **options}, **layout}, OPTIMIZER)])[case]
        losses, params = run.get()
    assert_parity(losses, params, *reference("tiny-omni", batches, OPTIMIZER))


@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("parity-omni")
def test_llm_long_short_matches_homogeneous_over_four_steps(omni_runs):
    """omni's LLM long-short split (systems/omni/llm_long_short.py): long LLM samples run on a
    context-parallel group of two data ranks (Ulysses), the other ranks run short ones, including
    empty microbatches that keep FSDP in step; losses match homogeneous to 1e-4 over 4 steps."""
    batches = long_short_batches()
    plans = [_plan(b) for b in batches]
    assert sum(len(p.notes["llm_long_short"]["long_samples"]) for p in plans) >= 3
    assert any(() in mbs for p in plans for mbs in p.assignment["llm"].values())  # an empty microbatch
    omni, _ = omni_runs["long-short-omni"].get()
    homo, _ = omni_runs["long-short-homogeneous"].get()
    assert len(omni) == len(homo) == LONG_SHORT_STEPS
    for step, (a, b) in enumerate(zip(omni, homo, strict=True)):
        assert abs(a - b) < 1e-4, f"step {step}: omni {a} vs homogeneous {b}"


@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("parity-omni")
def test_temporal_with_ulysses_sp_2_trains_like_homogeneous_over_four_steps(omni_runs):
    """temporal at cp 2 (encoders FSDP-sharded over all 4 ranks and run with Ulysses over the cp
    group, long videos and audio clips included) against homogeneous at its own default (tp 2):
    the same losses to 1e-4 over 4 steps and the same parameters after them."""
    batches = long_short_batches()
    plan = get_planner("temporal").plan(get_model("tiny-omni"), ParallelSpec(world_size=4, cp=2), batches[1])
    assert plan.layouts["audio"].sp == plan.layouts["vision"].sp == 2 and plan.layouts["vision"].fsdp
    assert any(mb for mbs in plan.assignment["audio"].values() for mb in mbs)  # long audio clips take the sp path
    (temporal, t_params), (homo, h_params) = omni_runs["temporal-cp2"].get(), omni_runs["long-short-homogeneous"].get()
    assert len(temporal) == len(homo) == LONG_SHORT_STEPS
    for step, (a, b) in enumerate(zip(temporal, homo, strict=True)):
        assert abs(a - b) < 1e-4, f"step {step}: temporal {a} vs homogeneous {b}"
    assert set(t_params) == set(h_params)
    for name, value in t_params.items():
        assert (value - h_params[name]).abs().max() < 1e-4, name


def test_llm_long_short_shows_in_the_plan_and_switches_off():
    b = long_batches(2)[1]
    on, off = _plan(b), _plan(b, llm_long_short=False)
    long = on.notes["llm_long_short"]["long_samples"]
    assert long and long[0]["group"] == [0, 1]
    leader = on.options["long_short"]["llm_leaders"]
    sid = long[0]["sample"]
    assert leader == {str(sid): 0}
    assert all((sid,) in on.assignment["llm"][r] for r in (0, 1))  # listed on both members
    assert on.options["long_short"]["long_microbatches"]["llm"] == {"0": [0], "1": [0]}
    assert off.notes["llm_long_short"]["long_samples"] == [] and "llm" not in off.options["long_short"]["groups"]
    # Encoder gradients go back from the leader only.
    from systems.common import is_primary

    llm = on.layouts["llm"]
    primary = [r for r in on.routes if r.sample_id == sid and is_primary(r, llm, {sid: 0})]
    assert {r.dst_rank for r in primary} == {0}


def test_plan_notes_say_which_techniques_acted():
    p = _plan(long_batches(2)[1])
    acted = p.notes["acted"]
    assert acted["llm_long_short"] == 1 and acted["long_short_sp"]
    assert set(acted) == {"reorder", "reshard", "long_short_sp", "llm_long_short", "joint_pipeline"}
    off = _plan(long_batches(2)[1], llm_long_short=False, long_short_sp=False, reorder=False, reshard=False)
    assert off.notes["acted"] == {"reorder": False, "reshard": False, "long_short_sp": {}, "llm_long_short": 0,
                                  "joint_pipeline": off.notes["acted"]["joint_pipeline"]}


# tiny-omni's LLM has 2 kv heads: too few for Ulysses over a long-sample group of 2 data ranks x cp 2.
KV4 = """name = "tiny-omni-kv4"
vision = "tiny-vit"
audio = "tiny-whisper"

[llm]
name = "tiny-llm-kv4"
layers = 4
hidden = 64
heads = 8
kv_heads = 4
ffn = 128
vocab = 512
rope_theta = 10000.0
"""


@pytest.mark.timeout(1200)  # the launch is omni_runs's (parity-omni)
@pytest.mark.xdist_group("parity-omni")
@pytest.mark.parametrize(("model", "layout", "attention"), LLM_SPLIT_CELLS)
def test_llm_long_short_at_any_cp_and_pp_matches_single_process(omni_runs, models, request, model, layout,
                                                                 attention):
    """The LLM long-short split under the layout's own cp (a long sample over 2 data ranks x cp 2:
    Ulysses over 4 ranks, replacing the cp group's exchange; with tiny-omni's 2 kv heads no Ulysses
    group of 4 exists, so the group all-gathers K/V, each member holding two opposite pieces of the
    row) and with pipeline stages (every stage's members of the group run the long microbatch;
    chunks travel stage to stage)."""
    model = models[model]
    batches = long_batches()
    plans = [get_planner("omni").plan(get_model(model), ParallelSpec(world_size=4, options=LONG_SHORT, **layout), b)
             for b in batches]
    assert sum(len(p.notes["llm_long_short"]["long_samples"]) for p in plans) >= 2
    split = [p for p in plans if p.notes["llm_long_short"]["long_samples"]]
    assert all(len(p.options["long_short"]["groups"]["llm"][0]) == 2 * layout.get("cp", 1) for p in split)
    assert {p.options["long_short"]["llm_cp_kind"] for p in split} == {attention}
    # a batch without long samples names no LLM group (no communicators built for nothing)
    assert all("llm" not in p.options["long_short"]["groups"] for p in plans if p not in split)
    assert_parity(*omni_runs[f"llm-split-{request.node.callspec.id}"].get(), *reference(model, batches, OPTIMIZER))

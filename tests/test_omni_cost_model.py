"""The shared per-modality cost model: linear + quadratic encoder costs from costs.py's exact FLOPs,
LLM costs from costs.py, and calibrated coefficients from a simulator calibration profile."""

from __future__ import annotations

import json

import pytest

from omnibench.specs import costs
from omnibench.specs.cost_model import CostModel, CostModelError, attention_sequences, load_cost_model
from omnibench.specs.presets import get_model
from workloads.sample import Sample, Segment

MODEL = get_model("omni-7b")


def video(t: int, h: int = 16, w: int = 16) -> Sample:
    return Sample(1, "v", (Segment("text", 4), Segment("video", t * h * w // 4, t * h * w, grid_thw=(t, h, w))))


def audio(frames: int) -> Sample:
    return Sample(2, "a", (Segment("audio", frames // 4, frames // 2, mel_frames=frames),))


def test_encoder_cost_is_linear_in_frame_groups_and_quadratic_in_group_size():
    cm = CostModel.analytic(MODEL)
    one, four = cm.encoder(video(1), "vision"), cm.encoder(video(4), "vision")
    assert four == pytest.approx(4 * one, rel=1e-9)  # groups attend separately: linear in their count
    small, big = cm.encoder(video(1, 16, 16), "vision"), cm.encoder(video(1, 32, 32), "vision")
    assert big > 4 * small  # 4x the positions in one group: more than 4x (attention is quadratic)


def test_analytic_costs_are_costs_py_training_flops():
    cm = CostModel.analytic(MODEL, flops_per_s=1.0)
    v = costs.vision_flops(MODEL.vision, [(3, 20, 28)])
    assert cm.encoder(video(3, 20, 28), "vision") == pytest.approx(v.forward + v.backward, rel=1e-6)
    a = costs.audio_flops(MODEL.audio, [3000])
    assert cm.encoder(audio(3000), "audio") == pytest.approx(a.forward + a.backward, rel=0.02)  # conv edges
    s = Sample(3, "t", (Segment("text", 777),))
    f = costs.llm_flops(MODEL.llm, [777])
    assert cm.llm(s) == pytest.approx(f.forward + f.backward, rel=1e-6)
    assert cm.forward("llm", cm.llm(s)) == pytest.approx(f.forward, rel=1e-6)


def test_audio_attention_runs_per_30_second_window():
    assert attention_sequences(audio(2 * 3000 + 400), "audio", MODEL) == [1500, 1500, 200]


class _Curve:
    def __init__(self, rate: float, attention_weight: float = 1.0, per_sequence_s: float = 0.0):
        self.peak_flops, self.e_max = rate, 1.0
        self.attention_weight, self.per_sequence_s = attention_weight, per_sequence_s


def test_calibrated_curves_change_relative_costs():
    base = CostModel.analytic(MODEL)
    slow_vision = CostModel.from_curves(MODEL, {"forward": _Curve(1e12), "forward.vision": _Curve(1e11)})
    s = video(2)
    ratio_base = base.encoder(s, "vision") / base.llm(s)
    ratio_cal = slow_vision.encoder(s, "vision") / slow_vision.llm(s)
    assert ratio_cal == pytest.approx(10 * ratio_base, rel=1e-6)
    loop = CostModel.from_curves(MODEL, {"forward": _Curve(1e12, per_sequence_s=1e-3)})
    assert loop.encoder(video(4), "vision") - base.encoder(video(4), "vision") == pytest.approx(
        4 * 3 * 1e-3 * MODEL.vision.layers, rel=1e-6)  # per attention sequence, forward + 2x backward


def test_profile_from_calibrate_is_read(tmp_path):
    from simulator.calibrate import Profile
    from simulator.compute import EfficiencyCurve

    curve = EfficiencyCurve(peak_flops=5e11, e_max=0.5, half_flops=0.0, attention_weight=2.0)
    path = tmp_path / "profile.json"
    Profile(hardware="cpu-gloo", compute={"forward": curve}).save(path)
    cm = load_cost_model(MODEL, str(path))
    assert "calibrated" in cm.source
    s = Sample(3, "t", (Segment("text", 100),))
    assert cm.llm(s) > CostModel.analytic(MODEL).llm(s)  # 2.5e11 FLOP/s achieved vs the 1e12 default


def test_bad_profile_is_refused_with_its_name(tmp_path):
    path = tmp_path / "nope.json"
    path.write_text(json.dumps({"hardware": "x", "compute": {}}))
    with pytest.raises(CostModelError, match="no fitted compute curves"):
        load_cost_model(MODEL, str(path))
    with pytest.raises(CostModelError, match="no such profile"):
        load_cost_model(MODEL, str(tmp_path / "missing.json"))


def test_simulator_cost_model_prices_a_sample_like_the_simulator():
    """omni plans with the simulator's compute model when given a hardware preset: a sample's cost is
    what it adds to a microbatch there (within 15% of the simulator's own difference: the kernel
    profile's small-shape efficiency is not linear + quadratic)."""
    from omnibench.specs.cost_model import CostModel
    from omnibench.specs.presets import get_model
    from simulator.compute import ComputeModel
    from simulator.flops import llm_work
    from simulator.hardware import load_cluster

    model = get_model("omni-7b")
    cm = CostModel.from_simulator(model, "h100")
    assert "simulator compute model" in cm.source
    compute = ComputeModel(load_cluster("h100", 8))
    for n in (512, 3000, 12000):
        one, two = (llm_work(model.llm, [n] * j, range(model.llm.layers), True, True) for j in (1, 2))
        want = sum(compute.action_time(two, k, module="llm") - compute.action_time(one, k, module="llm")
                   for k in ("forward", "backward"))
        assert abs(cm.llm_tokens(n) / want - 1) < 0.15, (n, cm.llm_tokens(n), want)
    longer = cm.llm_tokens(8000) / cm.llm_tokens(4000)
    assert longer > 2.0  # the attention term makes a long sample more than proportionally costly


def test_simulate_plans_omni_with_the_simulators_costs(tmp_path):
    from omnibench.cli.simulate import planner_options

    assert planner_options("omni", {}, "h100") == {"hardware": "h100"}
    assert planner_options("omni", {"calibration": "x.json"}, "h100") == {"calibration": "x.json"}
    assert planner_options("homogeneous", {}, "h100") == {}

"""Model, hardware and workload files with absurd values: refused when the file is read, in one line naming
the file, the field and the allowed range (exit status 2), never a traceback, a hang or a result built on
them; and the bounds pass every model, machine and workload the project ships or publishes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_errors import invoke, one_error_line

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
LLM = 'name = "x"\nlayers = {layers}\nhidden = 64\nheads = 4\nkv_heads = 4\nffn = 128\nvocab = 100\n'




def llm_file(tmp_path: Path, layers: str, extra: str = "") -> Path:
    path = tmp_path / "m.toml"
    path.write_text("[llm]\n" + LLM.format(layers=layers) + extra)
    return path


# -- model files --------------------------------------------------------------------------------------------
def test_a_layer_count_past_any_integer_is_refused_when_the_model_file_is_read(tmp_path):
    path = llm_file(tmp_path, "99999999999999999999")
    line = one_error_line(invoke("plan", "--system", "homogeneous", "--nproc", "2", "--workload", "text_only",
                                 "--model", str(path)), "llm.layers must be in [1, 1,024]")
    assert str(path) in line


def test_a_billion_layers_is_refused_before_any_plan_is_built(tmp_path):
    path = llm_file(tmp_path, "1000000000")
    one_error_line(invoke("models", "show", str(path)), "llm.layers must be in [1, 1,024], got 1,000,000,000")
    line = one_error_line(invoke("plan", "--system", "homogeneous", "--nproc", "2", "--workload", "text_only",
                                 "--model", str(path)), "llm.layers must be in [1, 1,024]")
    assert str(path) in line


def test_a_model_at_the_bounds_is_still_planned(tmp_path):
    path = llm_file(tmp_path, "1024")
    r = invoke("plan", "--system", "homogeneous", "--nproc", "2", "--workload", "text_only", "--model", str(path))
    assert r.exit_code == 0, r.output


def test_every_shipped_and_published_model_and_workload_is_within_the_bounds():
    from omnibench.specs.presets import LLM_PRESETS, get_model, list_models, validate_model
    from simulator import published

    for name in list_models() + list(LLM_PRESETS):
        validate_model(get_model(name))
    for table in ("published_runs.csv", "megatron_a100.csv"):
        for row in published.load_published(REPO / "results" / "validation" / table):
            validate_model(published.model_of(row))
    for command in (["models", "list"], ["workloads", "list"]):
        r = invoke(*command)
        assert r.exit_code == 0, r.output
    from workloads.distributions import parse_dist
    from workloads.registry import get_workload, list_workloads
    from workloads.spec import SOURCE_LIMITS

    for name in list_workloads():
        workload = get_workload(name)
        for source in workload.sources:  # none of their distributions cut by a limit
            raw = workload.raw["sources"][source.name]
            for key in set(SOURCE_LIMITS) & set(raw):
                assert getattr(source, key) == parse_dist(raw[key], key), (name, source.name, key)


ENCODERS = 'llm = "tiny-llm"\n[{part}]\nname = "e"\nlayers = 1\nhidden = {hidden}\nheads = {heads}\nffn = 8\n{extra}'


@pytest.mark.parametrize(("text", "needle"), [
    (ENCODERS.format(part="vision", hidden=64, heads=0, extra=""), "vision.heads must be >= 1, got 0"),
    (ENCODERS.format(part="audio", hidden=64, heads=0, extra=""), "audio.heads must be >= 1, got 0"),
    (ENCODERS.format(part="vision", hidden=-64, heads=4, extra=""), "vision.hidden must be >= 1, got -64"),
    (ENCODERS.format(part="audio", hidden=64, heads=4, extra="max_positions = 100000000000000000000"),
     "audio.max_positions must be in [1, 1,048,576]"),
    (ENCODERS.format(part="vision", hidden=64, heads=4, extra="patch_size = 100000000000"),
     "vision.patch_size must be in [1, 1,024]"),
    ("[llm]\n" + LLM.format(layers=2) + "rope_theta = 1e308\n", "llm.rope_theta must be in (0, 1e+12], got 1e+308"),
    ("[llm]\n" + LLM.format(layers=2).replace("ffn = 128", "ffn = -5") + "[llm.moe]\nexperts = 4\ntop_k = 2\n"
     "expert_ffn = 8\n", "llm.ffn must be >= 0"),
    ("[llm]\n" + LLM.format(layers=2) + "[llm.moe]\nexperts = 4\ntop_k = 2\nexpert_ffn = 8\naux_loss_coef = 1e308\n",
     "llm.moe.aux_loss_coef must be in [0, 1]"),
    ("[llm]\n" + LLM.format(layers=2) + "[llm.moe]\nexperts = 100000\ntop_k = 2\nexpert_ffn = 8\n",
     "llm.moe.experts must be in [1, 4,096]"),
    ("[llm]\n" + LLM.format(layers="4.0"), "llm.layers has the wrong type (float: 4.0); expected an integer"),
    ("", "llm is required"),
], ids=["vision-heads-0", "audio-heads-0", "vision-hidden-negative", "audio-positions-1e20", "patch-1e11",
        "rope-1e308", "moe-ffn-negative", "aux-loss-1e308", "experts-100000", "layers-float", "empty-file"])
def test_a_model_file_with_an_absurd_value_is_refused_naming_the_file_and_field(tmp_path, text, needle):
    path = tmp_path / "m.toml"
    path.write_text(text)
    line = one_error_line(invoke("models", "show", str(path)), needle)
    assert str(path) in line


def test_a_model_file_that_is_a_folder_is_named_as_one(tmp_path):
    path = tmp_path / "m.toml"
    path.mkdir()
    one_error_line(invoke("models", "show", str(path)), f"model file {path} is a folder")


# -- hardware files -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "needle"), [
    ("peak_tflops", "1e308", "gpu.peak_tflops must be a positive finite number in [1e-06, 1,000,000], got 1e+308"),
    ("peak_tflops", "1e-300", "gpu.peak_tflops must be a positive finite number in [1e-06, 1,000,000]"),
    ("memory_gib", "1e308", "gpu.memory_gib must be a positive finite number in (0, 65,536]"),
    ("gpus_per_node", "100000000000000000000", "gpus_per_node must be a positive integer in [1, 4,096]"),
    ("latency_us", "1e308", "intra.latency_us must be a finite number in [0, 1,000,000]"),
    ("nics_per_node", "100000000000", "inter.nics_per_node must be a positive integer in [1, 16,384]"),
    ("name", "5", "name must be a string, got 5"),
    ("gpus_per_node", "8\nnum_gpus = 100000000000000000000", "num_gpus must be 0 (sized later) or a positive integer"),
], ids=["peak-1e308", "peak-1e-300", "memory-1e308", "gpus-per-node-1e20", "latency-1e308", "nics-1e11", "name-int",
        "num-gpus-1e20"])
def test_a_hardware_file_with_an_absurd_value_is_refused_before_simulating(tmp_path, key, value, needle):
    text = (REPO / "simulator" / "data" / "hardware" / "h100.toml").read_text()
    text, n = re.subn(rf"^{key}\s*=.*$", f"{key} = {value}", text, count=1, flags=re.M)
    assert n == 1
    path = tmp_path / "hw.toml"
    path.write_text(text)
    out = tmp_path / "sims"
    line = one_error_line(invoke("simulate", "-w", "text_only", "-s", "homogeneous", "--gpus", "8", "--hardware",
                                 str(path), "--out", str(out)), needle)
    assert str(path) in line
    assert not out.exists() or not list(out.iterdir())


def test_every_shipped_machine_is_within_the_bounds():
    from simulator.hardware import available_presets, load_cluster

    for name in available_presets():
        load_cluster(name, 8)


# -- workload files -----------------------------------------------------------------------------------------
WORKLOAD = """name = "w"
total_steps = {steps}
{vision}
[sources.s]
text_tokens = 10
{source}
[sources.t]
text_tokens = 20
[schedule]
{schedule}
"""
CONSTANT = 'kind = "constant"\nweights = { s = 1.0, t = 1.0 }'
BURSTY = ('kind = "bursty"\n[[schedule.regimes]]\nweights = {{ s = 1.0 }}\nmean_steps = {mean}\nweight = {weight}\n'
          '[[schedule.regimes]]\nweights = {{ t = 1.0 }}\nmean_steps = 5\n')


@pytest.mark.parametrize(("fields", "needle"), [
    (dict(source="images = 1000000000\nimage_pixels = \"coco_pixels\""),
     "sources.s.images: must be at most 1,024 per sample, got 1e+09"),
    (dict(source="images = 1e300\nimage_pixels = \"coco_pixels\""), "sources.s.images: must be at most 1,024"),
    (dict(source="images = 1\nimage_pixels = 1e300"), "sources.s.image_pixels: must be at most 1,073,741,824 pixels"),
    (dict(source="audios = 1\naudio_seconds = 1e300"), "sources.s.audio_seconds: must be at most 1,000,000 seconds"),
    (dict(source="videos = 1\nvideo_seconds = { kind = \"pareto\", x_min = 1e9, alpha = 1.5 }"),
     "sources.s.video_seconds: must be at most 1,000,000 seconds, got 1e+09"),
    (dict(source="audios = 1\naudio_seconds = 1\n[sources.u]\ntext_tokens = 1e300"),
     "sources.u.text_tokens: must be at most 16,777,216 tokens"),
    (dict(vision="[vision]\nimage_max_pixels = inf"), "vision.image_max_pixels: must be an integer in [1, "),
    (dict(vision="[vision]\nimage_max_pixels = 1000000.5"), "vision.image_max_pixels: must be an integer"),
    (dict(vision="[vision]\nfps = 1e300"), "vision.fps: must be a number in (0, 1000]"),
    (dict(schedule=BURSTY.format(mean="inf", weight=1)), "schedule.regimes[0].mean_steps: must be a number in [0, "),
    (dict(schedule=BURSTY.format(mean=5, weight="nan")), "schedule.regimes[0].weight: must be a finite number >= 0"),
    (dict(steps="100000000000000000000000"), "total_steps: must be a positive integer (at most 1,000,000,000)"),
], ids=["images-1e9", "images-1e300", "pixels-1e300", "audio-1e300", "pareto-from-1e9", "text-1e300", "rule-inf",
        "rule-fraction", "fps-1e300", "mean-steps-inf", "weight-nan", "total-steps-1e23"])
def test_a_workload_file_with_an_absurd_size_is_refused_naming_the_file_and_field(tmp_path, fields, needle):
    values = dict(steps=100, vision="", source="", schedule=CONSTANT) | fields
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD.format(**values))
    line = one_error_line(invoke("workloads", "show", str(path), "--steps", "2"), needle)
    assert str(path) in line


def test_an_unbounded_tail_is_cut_at_the_limit_so_no_draw_is_absurd(tmp_path):
    from workloads.registry import get_workload

    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD.format(steps=100, vision="", schedule=CONSTANT,
                                    source='audios = 1\naudio_seconds = { kind = "lognormal", median = 10, sigma = 60 }'))
    assert get_workload(str(path)).sources[0].audio_seconds.hi == 1_000_000
    r = invoke("workloads", "show", str(path), "--steps", "2")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


# -- layout flags -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "value"), [("--encoder-tp", "-2"), ("--encoder-ranks", "-3")])
def test_a_negative_encoder_layout_is_refused_in_one_line(flag, value):
    one_error_line(invoke("plan", "--system", "noncolocated", "--nproc", "4", "--model", "tiny-omni", flag, value),
                   f"{flag[2:].replace('-', '_')} must be 0 (the system's default) or a positive integer, got {value}")

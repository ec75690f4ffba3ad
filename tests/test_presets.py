"""Model presets: published sizes, tiny presets fit the runtime's needs, files load with clear errors."""

from __future__ import annotations

import pytest
import torch

from omnibench.models import MultimodalModel
from omnibench.specs.costs import audio_params, llm_params, model_params, vision_params
from omnibench.specs.model import SpecError
from omnibench.specs.presets import (
    AUDIO_PRESETS,
    LLM_PRESETS,
    MODEL_PRESETS,
    VISION_PRESETS,
    get_model,
    list_models,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "count, published",
    [
        (lambda: llm_params(LLM_PRESETS["qwen2-7b"]), 7.62e9),
        (lambda: llm_params(LLM_PRESETS["dense-72b"]), 72.7e9),
        (lambda: llm_params(LLM_PRESETS["qwen3-30b-a3b"]), 30.5e9),
        (lambda: llm_params(LLM_PRESETS["qwen3-30b-a3b"], active=True), 3.3e9),
        (lambda: vision_params(VISION_PRESETS["vit-675m"]), 675e6),
        (lambda: vision_params(VISION_PRESETS["internvit-300m"], merger=False), 304e6),
        (lambda: vision_params(VISION_PRESETS["internvit-6b"], merger=False), 5.54e9),
        (lambda: audio_params(AUDIO_PRESETS["whisper-large-enc"], projector=False), 635e6),
    ],
    ids=["qwen2-7b", "dense-72b", "qwen3-30b-total", "qwen3-30b-active", "vit-675m", "internvit-300m", "internvit-6b",
         "whisper"],
)
def test_parameter_counts_within_two_percent_of_published(count, published):
    assert count() == pytest.approx(published, rel=0.02)


@pytest.mark.parametrize("name", ["omni-7b", "omni-moe-30b", "vl-72b", "internvl-78b"])
def test_real_model_built_on_meta_device_has_the_spec_parameter_count(name):
    spec = get_model(name)
    with torch.device("meta"):
        model = MultimodalModel(spec)
    assert sum(p.numel() for p in model.parameters()) == model_params(spec)["total"]


def test_tiny_presets_fit_the_runtime_layouts():
    for name in ("tiny-llm", "tiny-vl", "tiny-omni", "tiny-omni-moe"):
        spec = get_model(name)
        llm = spec.llm
        assert llm.heads % 2 == 0 and llm.kv_heads % 2 == 0 and llm.layers >= 4 and llm.hidden <= 128
        if llm.moe:
            assert llm.moe.experts % 2 == 0
        assert model_params(spec)["total"] < 3_000_000
        for enc in spec.encoders.values():
            assert enc.out_hidden == llm.hidden and enc.heads % 2 == 0
    assert get_model("tiny-omni-moe").llm.moe is not None
    assert get_model("tiny-vl").audio is None and get_model("tiny-omni").audio is not None


def test_composed_presets_project_encoders_to_the_llm_width():
    for spec in MODEL_PRESETS.values():
        for enc in spec.encoders.values():
            assert enc.out_hidden == spec.llm.hidden
    assert get_model("qwen3-30b-a3b").llm.moe.experts == 128  # bare LLM name -> text-only model


def test_unknown_model_lists_allowed_names():
    with pytest.raises(SpecError) as err:
        get_model("gpt-5")
    for name in ("tiny-omni", "qwen2-vl-7b", "omni-moe-30b"):
        assert name in str(err.value)
    assert set(list_models()) >= {"tiny-llm", "tiny-vl", "tiny-omni", "tiny-omni-moe", "omni-7b", "qwen2-7b"}


def test_model_loads_from_toml_and_yaml(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text(
        'name = "my-vl"\nvision = "tiny-vit"\n[llm]\nname = "x"\nlayers = 2\nhidden = 32\nheads = 4\n'
        "kv_heads = 2\nffn = 64\nvocab = 100\n[llm.moe]\nexperts = 4\ntop_k = 2\nexpert_ffn = 16\n"
    )
    spec = get_model(toml)
    assert spec.name == "my-vl" and spec.llm.moe.experts == 4 and spec.vision.out_hidden == 32
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text("llm: tiny-llm\naudio:\n  name: a\n  layers: 1\n  hidden: 32\n  heads: 2\n  ffn: 64\n")
    spec = get_model(str(yaml_file))
    assert spec.llm == LLM_PRESETS["tiny-llm"] and spec.audio.out_hidden == 64


@pytest.mark.parametrize(
    "body, field",
    [
        ("llm:\n  name: x\n  layers: 2\n  hidden: 32\n  heads: 4\n  kv_heads: 3\n  ffn: 8\n  vocab: 50\n", "kv_heads"),
        ("llm:\n  name: x\n  layers: two\n  hidden: 32\n  heads: 4\n  kv_heads: 2\n  ffn: 8\n  vocab: 50\n", "llm.layers"),
        ("llm: tiny-llm\nvision:\n  name: v\n  layers: 1\n  hidden: 32\n  heads: 2\n  ffn: 8\n  mlp: relu\n", "vision.mlp"),
        ("llm: tiny-llm\nvision:\n  name: v\n  layers: 1\n  hidden: 32\n  heads: 2\n  ffn: 8\n  depth: 3\n", "vision.depth"),
        ("llm: tiny-lm\n", "llm"),
        ("llm: tiny-llm\ncolour: red\n", "colour"),
    ],
)
def test_bad_model_file_names_the_field(tmp_path, body, field):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(SpecError, match=field):
        get_model(path)


def test_specs_presets_and_costs_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; import omnibench.specs.presets, omnibench.specs.costs; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

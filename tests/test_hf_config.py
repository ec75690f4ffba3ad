"""`--model config.json`: a Hugging Face config read with transformers' own config classes gives the shapes the
presets copy from the same configs; what no preset covers is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from omnibench.cli import app  # noqa: E402
from omnibench.specs.costs import model_params  # noqa: E402
from omnibench.specs.model import SpecError  # noqa: E402
from omnibench.specs.presets import get_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HF = Path(__file__).parent / "data" / "hf"


def _shape(spec) -> dict:
    """A component's fields without its name (the presets name theirs, a config is named by its folder)."""
    return {k: v for k, v in dataclasses.asdict(spec).items() if k != "name"}


@pytest.mark.parametrize(("folder", "preset"), [
    ("Qwen2-VL-7B-Instruct", "qwen2-vl-7b"),  # the legacy flat format: the decoder's fields at the top
    ("Qwen3-30B-A3B", "qwen3-30b-a3b"),  # MoE, head_dim apart from hidden / heads, q/k norm, no q/k/v bias
    ("Qwen2-7B", "qwen2-7b"),
    ("internvl-8b-hf", "internvl-8b"),  # InternViT (pixel shuffle 0.5: the 2x2 merge) feeding Qwen2-7B
])
def test_a_config_gives_the_shapes_of_the_preset_copied_from_it(folder, preset):
    spec, want = get_model(HF / folder / "config.json"), get_model(preset)
    assert spec.name == folder
    assert _shape(spec.llm) == _shape(want.llm)
    assert set(spec.encoders) == set(want.encoders)
    for module, enc in spec.encoders.items():
        assert _shape(enc) == _shape(want.encoders[module]), module
    assert model_params(spec)["total"] == model_params(want)["total"]
    assert get_model(HF / folder).llm == spec.llm  # the checkpoint folder names its config.json


@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "qwen2_5_vl"}, "model_type qwen2_5_vl is not covered: its ViT attends in windows"),
    ({"model_type": "llava"}, "model_type llava is not covered: its CLIP tower"),
    ({"model_type": "gemma"}, "model_type gemma is not covered; allowed: qwen2, qwen3, qwen3_moe, llama, qwen2_vl"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window attention (use_sliding_window"),
    # a covered multimodal type is no pass for its decoder: GPT-OSS's experts and Mistral's window are refused
    ({"model_type": "internvl", "text_config": {"model_type": "gpt_oss"}}, "a gpt_oss decoder is not covered"),
    ({"model_type": "internvl", "text_config": {"model_type": "mistral"}}, "a mistral decoder is not covered"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act gelu is not covered"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "dense layers among MoE ones"),
    ({"hidden_size": 64}, "model file "),  # no model_type: transformers' own message, one line
])
def test_what_no_preset_covers_is_refused_in_one_line(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SpecError, match=None) as e:
        get_model(path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_cli_shows_and_simulates_a_config_as_its_preset():
    runner = CliRunner()
    config = str(HF / "Qwen2-VL-7B-Instruct" / "config.json")
    shown = runner.invoke(app, ["models", "show", config], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    assert "Qwen2-VL-7B-Instruct  8.29B parameters" in shown.output
    args = ["simulate", "--system", "omni", "--workload", "image_sft", "--gpus", "16", "--json"]
    by_config = runner.invoke(app, args + ["--model", config])
    by_preset = runner.invoke(app, args + ["--model", "qwen2-vl-7b"])
    assert by_config.exit_code == 0 and by_preset.exit_code == 0, (by_config.output, by_preset.output)
    got, want = (json.loads(r.stdout)["results"][0] for r in (by_config, by_preset))
    assert got["step_time_s"] == want["step_time_s"] and got["peak_memory_gib"] == want["peak_memory_gib"]
    refused = runner.invoke(app, args[:-1] + ["--model", str(HF / "Qwen2.5-VL-7B-Instruct")])
    assert refused.exit_code == 2 and "is not covered" in refused.output
    assert "Traceback" not in refused.output

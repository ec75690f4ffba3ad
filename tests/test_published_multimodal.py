"""Encoder + LLM rows of the published validation set (results/validation/published_runs.csv): the
`image_text_<I>_<T>` workloads that give their samples' shapes, the model files of their encoders, the
reader's columns for them (each one a `simulate` option), and their place in the committed table (held out
by the split rule, their statistics apart from the text-LLM rows')."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from omnibench.specs.presets import get_model
from simulator.fitted import FITTED, rows_of
from simulator.published import (
    ENCODER_COLUMNS,
    PublishedCheck,
    PublishedError,
    command_of,
    groups,
    load_published,
    merge_table,
    model_slug,
    parse_table,
)
from tests.cli_errors import invoke, one_error_line
from workloads.registry import get_workload
from workloads.stream import WorkloadStream

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "results" / "validation" / "published_runs.csv"
TABLE = ROOT / "results" / "validation" / "published_table.md"
JSON = ROOT / "results" / "validation" / "published_table.json"
SWIFT = "mswift-qwen2.5-vl-7b-full-tp2-2xa100"  # a frozen ViT in the first pipeline stage, 2 GPUs
FSDP = "optimus-vit3b-gpt11b-fsdp-8xa100"  # every module sharded over every rank, run in turn


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in load_published(CSV)}


@pytest.mark.parametrize(("image_tokens", "text_tokens", "grid"), [
    (512, 1536, (1, 32, 64)),  # the squarest grid of 512 tokens: 16 x 32
    (1280, 768, (1, 64, 80)),
    (1, 5, (1, 2, 2)),
    (149, 1, (1, 2, 298)),  # a prime: one row of tokens, within the generator's 1:150
])
def test_an_image_text_workload_gives_every_sample_its_named_shape(image_tokens, text_tokens, grid):
    n = image_tokens + text_tokens
    batch = WorkloadStream(get_workload(f"image_text_{image_tokens}_{text_tokens}"), seed=0,
                           global_batch_tokens=4 * n).batch(3)
    assert len(batch.samples) == 4
    for s in batch.samples:
        image, text = s.segments
        assert (image.modality, image.llm_tokens, image.encoder_seq_len, image.grid_thw) == \
            ("image", image_tokens, 4 * image_tokens, grid)
        assert (text.modality, text.llm_tokens) == ("text", text_tokens)


@pytest.mark.parametrize(("name", "needles"), [
    ("image_text_211_3", ["211 image tokens make no grid", "a count with a divisor"]),
    ("image_text_0_3", ["unknown name 'image_text_0_3'", "image_text_<I>_<T>", "each >= 1"]),
    ("image_text_4_0", ["unknown name 'image_text_4_0'"]),
    ("image_text_512", ["unknown name 'image_text_512'"]),
    ("image_text_1048576_1", ["I + T <= 1,048,576"]),
])
def test_a_bad_image_text_name_is_one_line(name, needles):
    one_error_line(invoke("workloads", "show", name), *needles)


def test_each_encoder_rows_model_file_loads_with_its_vit(rows):
    encoder_rows = [r for r in rows.values() if r.multimodal]
    assert len({model_slug(r) for r in encoder_rows}) >= 3
    for r in encoder_rows:
        m = get_model(f"published/{model_slug(r)}")
        v = m.vision
        assert v is not None and v.out_hidden == r.hidden == m.llm.hidden, r.name
        assert (v.layers, v.hidden, v.heads, v.ffn, v.mlp) == (r.vision_layers, r.vision_hidden, r.vision_heads,
                                                                r.vision_ffn, r.vision_mlp), r.name
        assert v.norm == ("rms" if r.vision_mlp == "swiglu" else "layer") and (v.patch_size, v.merge) == (14, 2)


def test_an_encoder_rows_command_names_its_workload_system_and_frozen_modules(rows):
    def option(argv, flag):
        return argv[argv.index(flag) + 1] if flag in argv else None

    swift, fsdp, text = command_of(rows[SWIFT]), command_of(rows[FSDP]), command_of(rows["tt-8b-fsdp8"])
    assert [option(swift, f) for f in ("--workload", "--system", "--freeze")] == \
        ["image_text_1280_768", "homogeneous", "vision"]
    assert [option(fsdp, f) for f in ("--workload", "--system", "--freeze", "--dp-mode")] == \
        ["image_text_512_1536", "temporal", None, "fsdp"]
    assert [option(text, f) for f in ("--workload", "--system", "--freeze")] == ["pretrain_8192", "homogeneous", None]
    assert all(option(command_of(r), "--system") == r.system for r in rows.values())


def _table_with(tmp_path, name: str, **changed) -> Path:
    with CSV.open(newline="") as fh:
        reader = csv.DictReader(fh)
        row = next(r for r in reader if r["name"] == name)
        columns = list(reader.fieldnames)
    path = tmp_path / "rows.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerow({**row, **changed})
    return path


@pytest.mark.parametrize(("name", "changed", "needle"), [
    (SWIFT, {"image_tokens": ""}, "gives image_tokens"),
    (SWIFT, {"vision_layers": ""}, "vision_layers must be a positive integer"),
    (SWIFT, {"vision_mlp": "relu"}, "vision_mlp must be one of gelu, quick_gelu, swiglu"),
    (SWIFT, {"vision_heads": "17"}, "vision_heads 17 must divide vision_hidden 1280"),
    (SWIFT, {"image_tokens": "2048"}, "image_tokens 2048 must be below seq 2048"),
    (SWIFT, {"freeze": "eyes"}, "freeze: unknown module 'eyes'; allowed: vision, audio, llm"),
    (SWIFT, {"system": "pipelined"}, "system must be one of homogeneous, temporal"),
    ("tt-8b-fsdp8", {"freeze": "vision"}, "freeze names modules of an encoder + LLM row"),
])
def test_a_bad_encoder_column_names_its_row_and_column(tmp_path, name, changed, needle):
    with pytest.raises(PublishedError, match="rows.csv row 1 .*" + needle.replace("+", r"\+")):
        load_published(_table_with(tmp_path, name, **changed))


def test_a_table_written_before_the_encoder_columns_still_loads(tmp_path):
    with CSV.open(newline="") as fh:
        reader = csv.DictReader(fh)
        text = [r for r in reader if not r["image_tokens"]][:3]
        columns = [c for c in reader.fieldnames if c not in ENCODER_COLUMNS]
    path = tmp_path / "older.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(text)
    got = load_published(path)
    assert [r.name for r in got] == [r["name"] for r in text]
    assert all(r.system == "homogeneous" and not r.multimodal and not r.freeze for r in got)


def test_encoder_rows_are_held_out_and_reported_apart(rows):
    _, table_rows, failed = parse_table(TABLE.read_text())
    encoder = {r.name for r in rows.values() if r.multimodal}
    assert encoder and all(rows[n].split == "heldout" for n in encoder)  # new sources: held out whole
    assert {r.name for r in table_rows if r.multimodal} | {n for n, _ in failed if n in encoder} == encoder
    g = groups(table_rows)
    assert g["split"]["multimodal"].rows == sum(r.multimodal for r in table_rows)
    assert g["split"]["heldout"].rows == sum(r.split == "heldout" and not r.multimodal and not r.unstated
                                             for r in table_rows)
    committed = json.loads(JSON.read_text())["rows"]
    assert {r["name"] for r in committed if r["multimodal"]} == {r.name for r in table_rows if r.multimodal}
    for constant in FITTED.values():  # no machine or allocator constant's error is measured on them
        assert not any(r["multimodal"] for split in ("calibration", "heldout")
                       for r in rows_of(constant, committed, split))


def test_rows_put_into_the_table_in_place_take_their_place_and_the_statistics_follow(rows):
    text, table = TABLE.read_text(), json.loads(JSON.read_text())
    order = list(rows.values())
    assert merge_table(text, table, [], [], order) == (text, table)  # nothing new: the committed table
    row = rows[SWIFT]
    fresh = PublishedCheck(row=row, measured_s=4.1, simulated_s=2.05, fits=True, fit_message="",
                           peak_memory_gib=70.0, mfu=0.4, hfu_tflops=100.0)
    md, merged = merge_table(text, table, [fresh], [], order)
    _, now, _ = parse_table(md)
    assert [r.name for r in now] == [r.name for r in parse_table(text)[1]]
    assert next(r for r in now if r.name == SWIFT).simulated_s == 2.05
    assert next(r for r in merged["rows"] if r["name"] == SWIFT)["simulated_s"] == 2.05
    assert merged["split"]["multimodal"] == groups(now)["split"]["multimodal"].to_dict()
    md, merged = merge_table(text, table, [], [(row, "why not")], order)
    assert (SWIFT, "why not") in parse_table(md)[2] and SWIFT not in {r["name"] for r in merged["rows"]}
    assert {"name": SWIFT, "error": "why not"} in merged["failed"]


def test_a_model_file_whose_encoder_the_workload_never_feeds_simulates(rows, tmp_path):
    """The record folder is named after the model's last path part: `published/<name>@no-vision` and
    `dir/model.toml@no-vision` (text workloads drop the unfed encoder) name no folder of their own."""
    r = invoke("simulate", "-w", "pretrain_2048", "-s", "homogeneous", "--gpus", "8", "-m",
               f"published/{model_slug(rows[SWIFT])}", "--json", "--workers", "1", "--out", tmp_path, "--no-trace")
    assert r.exit_code in (0, 1), r.output
    record = Path(json.loads(r.output)["record"])
    assert record.parent == tmp_path and record.name.endswith(f"{model_slug(rows[SWIFT])}@no-vision-h100")

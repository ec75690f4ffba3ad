"""Shape of the published validation set `results/validation/published_runs.csv`.

The file is data transcribed from publications; these checks catch a broken or incomplete edit:
a missing column, a value outside the agreed vocabulary, a row with no or two measured figures, a row
that cites nothing, a layout that cannot tile its GPUs, or a set too thin to validate against.
"""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

CSV = Path(__file__).resolve().parents[1] / "results" / "validation" / "published_runs.csv"
COLUMNS = ("name, source, table, url, split, hardware, gpus, model_kind, layers, hidden, heads, kv_heads, ffn, "
           "glu, vocab, experts, top_k, expert_ffn, vision_layers, vision_hidden, vision_heads, vision_ffn, vision_mlp, "
           "seq, image_tokens, tp, pp, vpp, cp, cp_kind, ep, dp_mode, global_batch, micro_batch, recompute, freeze, "
           "precision, system, stack, software, tflops_per_gpu, mfu, step_time_s, tokens_per_s_per_gpu, flop_formula, "
           "peak_memory_gib, verified, notes").split(", ")
MEASURED = ("tflops_per_gpu", "mfu", "step_time_s", "tokens_per_s_per_gpu")
ALLOWED = {
    "split": {"calibration", "heldout"},
    "model_kind": {"gpt", "llama", "moe"},
    "dp_mode": {"ddp", "zero1", "zero2", "fsdp", "hsdp"},
    "stack": {"megatron", "nemo", "torchtitan", "deepspeed", "fsdp", "other"},
    "recompute": {"none", "selective", "full"},
    "precision": {"bf16", "fp16", "fp8"},
    "verified": {"yes", "no"},
    "glu": {"yes", "no"},
    "cp_kind": {"", "ring", "allgather-kv", "ulysses"},
    "flop_formula": {"", "megatron-hfu", "megatron-mfu", "unstated"},
    "system": {"", "homogeneous", "temporal", "colocated", "noncolocated", "omni"},
    "freeze": {"", "vision", "audio", "vision,audio", "llm", "vision,llm", "audio,llm"},
    "vision_mlp": {"", "gelu", "quick_gelu", "swiglu"},
}
# an encoder + LLM row gives its image encoder and the image tokens of each sample, a text row none of them
ENCODER_INTEGERS = ("vision_layers", "vision_hidden", "vision_heads", "vision_ffn", "image_tokens")
HARDWARE_PREFIXES = ("v100-", "a100-", "h100", "h800", "h200", "b200", "gb200")
INTEGERS = ("gpus", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "tp", "pp", "vpp", "cp", "ep",
            "global_batch", "micro_batch")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with CSV.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == tuple(COLUMNS), "columns differ from results/validation/README.md"
        return list(reader)


def test_every_row_has_allowed_values_and_one_measured_figure(rows):
    names = Counter(r["name"] for r in rows)
    assert not [n for n, c in names.items() if c > 1], "duplicate row names"
    for r in rows:
        where = r["name"]
        for col, allowed in ALLOWED.items():
            assert r[col] in allowed, f"{where}: {col}={r[col]!r} not in {sorted(allowed)}"
        assert r["hardware"].startswith(HARDWARE_PREFIXES), f"{where}: hardware {r['hardware']!r}"
        for col in ("name", "source", "table", "url"):
            assert r[col].strip(), f"{where}: {col} is empty"
        assert r["url"].startswith("https://"), f"{where}: url {r['url']!r}"
        for col in INTEGERS:
            assert r[col].isdigit() and int(r[col]) >= 1, f"{where}: {col}={r[col]!r} is not a positive integer"
        given = [c for c in MEASURED if r[c].strip()]
        assert len(given) == 1, f"{where}: exactly one of {MEASURED} must be given, got {given}"
        assert float(r[given[0]]) > 0
        assert bool(r["flop_formula"]) == (given[0] in ("tflops_per_gpu", "mfu")), \
            f"{where}: flop_formula goes with a FLOP rate (tflops_per_gpu or mfu) and only with one"
        if r["peak_memory_gib"]:
            assert 0 < float(r["peak_memory_gib"]) <= 141, f"{where}: peak memory {r['peak_memory_gib']}"


def test_layouts_tile_the_gpus(rows):
    for r in rows:
        g, tp, pp, cp = (int(r[c]) for c in ("gpus", "tp", "pp", "cp"))
        assert g % (tp * pp * cp) == 0, f"{r['name']}: tp*pp*cp does not divide gpus"
        dp = g // (tp * pp * cp)
        assert int(r["global_batch"]) % dp == 0, f"{r['name']}: global batch not a multiple of dp={dp}"
        assert int(r["hidden"]) % int(r["heads"]) == 0 and int(r["heads"]) % int(r["kv_heads"]) == 0, r["name"]
        if r["model_kind"] == "moe":
            assert r["experts"] and r["top_k"] and r["expert_ffn"], f"{r['name']}: MoE row without experts/top_k"
        else:
            assert not r["experts"], f"{r['name']}: experts on a dense row"


def test_an_encoder_row_gives_its_encoder_and_image_and_a_text_row_none(rows):
    for r in rows:
        given = [c for c in ENCODER_INTEGERS + ("vision_mlp",) if r[c]]
        if not given:
            assert not r["freeze"], f"{r['name']}: freeze on a row without an encoder"
            continue
        assert len(given) == len(ENCODER_INTEGERS) + 1, f"{r['name']}: encoder columns given in part: {given}"
        for col in ENCODER_INTEGERS:
            assert r[col].isdigit() and int(r[col]) >= 1, f"{r['name']}: {col}={r[col]!r}"
        assert int(r["image_tokens"]) < int(r["seq"]), f"{r['name']}: the image fills the whole sequence"
        assert int(r["vision_hidden"]) % int(r["vision_heads"]) == 0, r["name"]
        assert r["system"], f"{r['name']}: an encoder row names the system that places its encoder"
        assert "unpublished:" in r["notes"], f"{r['name']}: say what the source does not give"


def test_the_set_is_broad_enough(rows):
    verified = [r for r in rows if r["verified"] == "yes"]
    assert len(verified) >= 30
    assert len({r["source"] for r in verified}) >= 6
    assert {r["split"] for r in verified} == {"calibration", "heldout"}
    calibration = sum(r["split"] == "calibration" for r in rows)
    assert calibration <= len(rows) / 3 + 1, "calibration rows must stay a minority"
    gens = {r["hardware"].split("-")[0] for r in verified}
    assert {"v100", "a100", "h100"} <= gens | {h[:4] for h in gens}
    assert max(int(r["gpus"]) for r in verified) >= 10_000 and min(int(r["gpus"]) for r in verified) <= 8
    assert any(r["model_kind"] == "moe" for r in verified)
    assert sum(bool(r["peak_memory_gib"]) for r in verified) >= 10


def test_split_is_the_stated_rule():
    """results/validation/README.md: only the calibration-eligible sources have calibration rows, and in
    each of them the 1st, 4th, 7th, ... row in file order is calibration. Editing `split` by hand fails here."""
    eligible = {"torchtitan-bench", "llm-foundry", "narayanan2021", "shoeybi2019"}
    seen: Counter = Counter()
    for r in rows_in_order():
        if r["source"] in eligible:
            expected = "calibration" if seen[r["source"]] % 3 == 0 else "heldout"
            seen[r["source"]] += 1
        else:
            expected = "heldout"
        assert r["split"] == expected, f"{r['name']}: split {r['split']} but the stated rule gives {expected}"


def rows_in_order() -> list[dict]:
    with CSV.open(newline="") as fh:
        return list(csv.DictReader(fh))

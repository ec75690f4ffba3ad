"""The committed validation table (results/validation/published_table.md) cannot go stale: it names the
command that wrote it, its statistics follow from its rows, and a fixed subset of its rows (small
clusters, one or more of each hardware preset, stack, precision and context-parallel kind) is what
the simulator gives today. The whole table is rewritten by `python benchmarks/published_validation.py`
(which runs the command below over every row)."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.published import check_row, load_published, parse_table, render, table_row

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "results" / "validation" / "published_runs.csv"
TABLE = ROOT / "results" / "validation" / "published_table.md"
COMMAND = ("python -m omnibench validate --published results/validation/published_runs.csv "
           "--markdown results/validation/published_table.md")
# 1 to 64 GPUs, each simulated in well under a second; the last two are encoder + LLM rows
SUBSET = (
    "tt-8b-fsdp8",  # H100 500 W, torchtitan eager, selective checkpointing
    "tt-8b-fsdp8-compile-fp8",  # torch.compile + Float8
    "tt-8b-fsdp4-cp2-64k",  # all-gather-KV context parallelism
    "tt-8b-fsdp32-h200",  # H200
    "mpt-7b-8xh100",  # Composer FSDP on H100
    "mpt-7b-8xa100-40g",  # A100 40 GB
    "megatron-1.7b-32gpu",  # Megatron-LM on A100 80 GB, unfused attention, DDP
    "megatron-v1-4.2b-4gpu",  # V100, tensor parallel
    "nemo-llama2-7b-8gpu",  # NeMo fp8, distributed optimizer
    "nemo-llama3-8b-8gpu",  # ring context parallelism
    "mbridge-llama3-8b-8gpu-fsdp",  # Megatron-FSDP
    "tt-a100-llama2-13b-noac",  # torchtitan on A100
    "mbridge-b200-llama3-8b-8gpu",  # B200: the H100 profile scaled by datasheet ratios, fp8
    "mbridge-gb200-llama3-8b-8gpu",  # GB200 NVL72
    "mswift-qwen2.5-vl-7b-full-tp2-2xa100",  # encoder + LLM: a frozen ViT in the first pipeline stage
    "optimus-vit3b-gpt11b-fsdp-8xa100",  # encoder + LLM under FSDP, one module at a time (temporal)
)


@pytest.fixture(scope="module")
def committed():
    return parse_table(TABLE.read_text())


def test_the_table_names_the_command_that_wrote_it(committed):
    command, rows, failed = committed
    assert command == COMMAND
    names = {r.name for r in load_published(CSV)}
    assert {r.name for r in rows} | {n for n, _ in failed} == names, "the table does not cover every row of the CSV"


def test_the_tables_statistics_follow_from_its_rows(committed):
    command, rows, failed = committed
    assert render(rows, command, failed) == TABLE.read_text()


@pytest.mark.timeout(120)
def test_a_fixed_subset_of_rows_is_what_the_simulator_gives_today(committed):
    _, rows, _ = committed
    by_name = {r.name: r for r in rows}
    csv_rows = {r.name: r for r in load_published(CSV)}
    stale = []
    for name in SUBSET:
        fresh = table_row(check_row(csv_rows[name]))
        if fresh != by_name[name]:
            stale.append(f"committed {by_name[name].line()}\n    today {fresh.line()}")
    assert not stale, "results/validation/published_table.md is stale; rerun python benchmarks/published_validation.py:\n" \
        + "\n".join(stale)

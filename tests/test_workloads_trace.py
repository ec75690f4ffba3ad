"""Trace replay: a JSONL of real sample sizes becomes a workload; bad lines fail loudly."""

from __future__ import annotations

import json

import pytest

from workloads import TraceError, WorkloadStream, get_workload, image_tokens, load_trace, video_tokens

LINES = [
    {"segments": [{"modality": "image", "width": 640, "height": 480}, {"modality": "text", "tokens": 120}]},
    {"source": "asr", "segments": [{"modality": "audio", "seconds": 30}, {"modality": "text", "tokens": 40}]},
    {"segments": [{"modality": "text", "tokens": 900}]},
    {
        "source": "av",
        "segments": [
            {"modality": "video", "width": 640, "height": 360, "seconds": 10, "audio": True},
            {"modality": "text", "tokens": 10},
        ],
    },
]
TOKENS = [391 + 120, 750 + 40, 900, 2990 + 250 + 10]


def _write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_trace_samples_get_the_same_token_rules(tmp_path):
    spec = load_trace(_write(tmp_path, LINES), order="sequential")
    b = WorkloadStream(spec, global_batch_size=4).batch(0)
    assert [s.llm_tokens for s in b.samples] == TOKENS
    assert [s.source for s in b.samples] == ["trace", "asr", "trace", "av"]
    assert b.samples[0].segments[0].llm_tokens == image_tokens(640, 480)
    v, a = b.samples[3].segments[:2]
    assert v.llm_tokens == video_tokens(640, 360, 10) and a.modality == "audio" and a.seconds == 10


def test_trace_path_works_wherever_a_workload_name_is_accepted(tmp_path):
    p = _write(tmp_path, LINES)
    assert get_workload(str(p)).trace is not None
    assert WorkloadStream(str(p), global_batch_size=3).batch(0).samples


def test_sequential_order_walks_the_file_and_wraps(tmp_path):
    spec = load_trace(_write(tmp_path, LINES), order="sequential")
    st = WorkloadStream(spec, global_batch_size=3)
    seq = [s.llm_tokens for step in range(4) for s in st.batch(step).samples]
    assert seq == (TOKENS * 3)[:12]


def test_sequential_token_budget_is_seekable_and_continues_where_last_step_ended(tmp_path):
    spec = load_trace(_write(tmp_path, LINES), order="sequential")
    budget = 3300
    walk = WorkloadStream(spec, global_batch_tokens=budget)
    got = [[s.llm_tokens for s in walk.batch(step).samples] for step in range(6)]
    flat = [t for b in got for t in b]
    assert flat == (TOKENS * 10)[: len(flat)]
    assert all(sum(b) <= budget for b in got)
    jump = WorkloadStream(spec, global_batch_tokens=budget)
    assert [s.llm_tokens for s in jump.batch(5).samples] == got[5]


def test_random_order_samples_with_replacement_deterministically(tmp_path):
    spec = load_trace(_write(tmp_path, LINES))
    a = WorkloadStream(spec, seed=1, global_batch_size=400).batch(3)
    b = WorkloadStream(spec, seed=1, global_batch_size=400).batch(3)
    toks = [s.llm_tokens for s in a.samples]
    assert toks == [s.llm_tokens for s in b.samples]
    assert set(toks) == set(TOKENS) and len(toks) == 400
    budget = WorkloadStream(spec, seed=1, global_batch_tokens=20000).batch(0)
    assert budget.llm_tokens <= 20000 and len({s.sample_id for s in budget.samples}) == len(budget.samples)


def test_trace_respects_length_scale(tmp_path):
    spec = load_trace(_write(tmp_path, LINES), order="sequential")
    small = WorkloadStream(spec, global_batch_size=4, length_scale=0.25).batch(0)
    assert small.samples[1].llm_tokens == 187 + 10  # 7.5 s of audio (750 mel -> 375 -> 187) + 40 * 0.25
    assert small.llm_tokens < sum(TOKENS) / 2


@pytest.mark.parametrize(
    "bad,field",
    [
        ('{"segments": [{"modality": "image", "width": 640}]}', "segments[0].height: missing"),
        (
            '{"segments": [{"modality": "image", "width": -3, "height": 4}]}',
            "segments[0].width: expected an integer",
        ),
        ('{"segments": [{"modality": "smell", "tokens": 3}]}', "segments[0].modality: must be one of"),
        (
            '{"segments": [{"modality": "text", "tokens": 3, "lang": "en"}]}',
            "segments[0]: unknown key(s) lang",
        ),
        (
            '{"segments": [{"modality": "audio", "seconds": "long"}]}',
            "segments[0].seconds: expected a number",
        ),
        ('{"segments": []}', "segments: expected a non-empty list"),
        ('{"segments": [{"modality": "text", "tokens": 3}]', "not valid JSON"),
        ('{"segments": [{"modality": "image", "width": 5000, "height": 10}]}', "aspect ratio"),
    ],
)
def test_malformed_line_names_file_line_and_field(tmp_path, bad, field):
    p = _write(tmp_path, [LINES[0], LINES[1], bad, LINES[2]])
    with pytest.raises(TraceError) as e:
        load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: ") and field in msg


def test_empty_trace_and_bad_order_are_rejected(tmp_path):
    with pytest.raises(TraceError, match="no samples"):
        load_trace(_write(tmp_path, ["", "  "]))
    with pytest.raises(TraceError, match="order: must be one of random, sequential"):
        load_trace(_write(tmp_path, LINES), order="shuffled")

"""WorkloadStream: deterministic, seekable batches; schedules that change the mix over training."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from workloads import (
    ID_STRIDE,
    WorkloadError,
    WorkloadStream,
    get_workload,
    list_workloads,
    pack_sequences,
    spec_from_dict,
    workload_names,
)

REQUIRED = {"text_only", "image_sft", "mixed_video", "long_video", "omni_av", "llava_ov"}


def _key(batch):
    return [(s.sample_id, s.source, s.segments) for s in batch.samples]


def test_import_workloads_does_not_import_torch():
    code = "import sys, workloads, workloads.stats; print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torch', 'transformers')))))"
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []


def test_named_workloads_include_the_required_ones_and_all_stream():
    names = set(workload_names())
    assert REQUIRED <= names
    assert set(list_workloads()) == names
    for name in names:
        spec = get_workload(name)
        assert spec.description and spec.total_steps > 0
        batch = WorkloadStream(spec, global_batch_tokens=8192, length_scale=0.1).batch(spec.total_steps - 1)
        assert batch.samples and batch.llm_tokens <= 8192


def test_same_seed_and_step_give_same_batch_regardless_of_history():
    a = WorkloadStream("omni_av", seed=3, global_batch_tokens=16384, length_scale=0.2)
    b = WorkloadStream("omni_av", seed=3, global_batch_tokens=16384, length_scale=0.2)
    for s in range(5):
        a.batch(s)
    # b jumps straight to step 850 (past the stage boundary) and walks backwards
    assert _key(b.batch(850)) == _key(a.batch(850))
    assert _key(b.batch(4)) == _key(a.batch(4))


def test_batches_are_identical_in_a_fresh_process():
    code = (
        "from workloads import WorkloadStream;"
        "b = WorkloadStream('mixed_video', seed=11, global_batch_tokens=20000).batch(123);"
        "print(sum(s.llm_tokens * (i + 1) for i, s in enumerate(b.samples)), len(b.samples))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    b = WorkloadStream("mixed_video", seed=11, global_batch_tokens=20000).batch(123)
    assert out == [str(sum(s.llm_tokens * (i + 1) for i, s in enumerate(b.samples))), str(len(b.samples))]


def test_different_seeds_or_steps_give_different_batches():
    s0 = WorkloadStream("image_sft", seed=0, global_batch_size=64)
    s1 = WorkloadStream("image_sft", seed=1, global_batch_size=64)
    assert _key(s0.batch(5)) != _key(s1.batch(5))
    assert [s.segments for s in s0.batch(5).samples] != [s.segments for s in s0.batch(6).samples]


def test_sample_ids_unique_across_steps_and_deterministic():
    st = WorkloadStream("llava_ov", global_batch_tokens=30000, length_scale=0.5)
    ids = [s.sample_id for step in range(0, 1000, 37) for s in st.batch(step).samples]
    assert len(ids) == len(set(ids))
    b = st.batch(7)
    assert [s.sample_id for s in b.samples] == [7 * ID_STRIDE + i for i in range(len(b.samples))]


def test_token_budget_fills_but_never_exceeds_global_batch_tokens():
    st = WorkloadStream("mixed_video", global_batch_tokens=65536)
    for step in range(0, 1000, 97):
        b = st.batch(step)
        assert b.llm_tokens <= 65536
        assert b.llm_tokens > 0.5 * 65536
        assert all(s.llm_tokens <= 32768 for s in b.samples)  # the workload's cap


def test_global_batch_size_gives_exact_sample_count():
    b = WorkloadStream("text_only", global_batch_size=333).batch(2)
    assert len(b.samples) == 333


def test_max_sample_tokens_drops_longer_samples():
    st = WorkloadStream("long_video", global_batch_size=200, max_sample_tokens=4000)
    assert max(s.llm_tokens for s in st.batch(0).samples) <= 4000
    with pytest.raises(WorkloadError, match="max_sample_tokens"):
        WorkloadStream("long_video", global_batch_size=50, max_sample_tokens=10).batch(0)


def test_length_scale_shrinks_tokens_but_keeps_source_mix():
    full = WorkloadStream("omni_av", global_batch_size=3000)
    tiny = WorkloadStream("omni_av", global_batch_size=3000, length_scale=0.05)
    bf, bt = full.batch(10), tiny.batch(10)
    assert bt.llm_tokens < 0.25 * bf.llm_tokens
    # Same source shares as the full-size run (both lose the same long samples to the caps).
    cf = Counter(s.source for s in bf.samples)
    ct = Counter(s.source for s in bt.samples)
    for name in full.spec.source_names:
        assert abs(ct[name] - cf[name]) / 3000 < 0.025, name
    med_full = np.median([s.llm_tokens for s in bf.samples if s.source == "speech"])
    med_tiny = np.median([s.llm_tokens for s in bt.samples if s.source == "speech"])
    assert med_tiny < 0.15 * med_full


def test_segments_follow_token_rules():
    for s in WorkloadStream("omni_av", global_batch_size=500).batch(900).samples:
        for seg in s.segments:
            t, h, w = seg.grid_thw
            if seg.modality in ("image", "video"):
                assert seg.encoder_seq_len == t * h * w and seg.llm_tokens == t * h * w // 4
                assert h % 2 == 0 and w % 2 == 0
                if seg.modality == "video":
                    assert seg.frames == 2 * t and 4 <= seg.frames <= 768
            elif seg.modality == "audio":
                assert (
                    seg.encoder_seq_len == seg.mel_frames // 2 and seg.llm_tokens == seg.encoder_seq_len // 2
                )
            else:
                assert seg.encoder_seq_len == 0 and seg.llm_tokens > 0


def test_omni_av_has_video_with_its_audio_track():
    samples = WorkloadStream("omni_av", global_batch_size=400).batch(0).samples
    av = [s for s in samples if s.source == "video_av"]
    assert av
    for s in av:
        video, audio = s.segments[0], s.segments[1]
        assert (video.modality, audio.modality) == ("video", "audio")
        assert video.seconds == audio.seconds


def test_llava_ov_has_interleaved_multi_image_conversations_in_onevision_stage():
    st = WorkloadStream("llava_ov", global_batch_size=300)
    first = st.batch(0).samples
    assert {s.source for s in first} <= {"general", "doc_chart", "math", "ocr", "language"}
    late = st.batch(900).samples
    multi = [s for s in late if s.source == "multi_image"]
    assert {s.source for s in late} >= {"multi_image", "video"}
    assert any(sum(seg.modality == "image" for seg in s.segments) >= 3 for s in multi)
    mods = [seg.modality for seg in max(multi, key=lambda s: len(s.segments)).segments]
    assert mods[0] == "text" and mods[1] == "image" and "text" in mods[2:-1]  # text between images


def test_changing_schedule_moves_weights_and_lengths_over_training():
    st = WorkloadStream("mixed_video", global_batch_size=2000)
    m0, m1 = st.mix(0), st.mix(999)
    names = st.spec.source_names
    lv = names.index("long_video")
    assert m1.weights[lv] > 5 * m0.weights[lv]
    assert np.isclose(st.mix(500).weights.sum(), 1.0)

    def video_seconds(step):
        return np.median(
            [
                seg.seconds
                for s in st.batch(step).samples
                for seg in s.segments
                if s.source == "long_video" and seg.modality == "video"
            ]
        )

    assert video_seconds(999) > 2 * video_seconds(0)  # length multiplier 0.5 -> 1.5


def test_total_steps_override_places_steps_in_the_schedule():
    short = WorkloadStream("mixed_video", global_batch_size=8, total_steps=100)
    assert np.allclose(
        short.mix(100).weights, WorkloadStream("mixed_video", global_batch_size=8).mix(1000).weights
    )


def test_staged_schedule_switches_mix_and_cap_at_stage_boundary():
    st = WorkloadStream("omni_av", global_batch_size=200)
    assert st.mix(799).phase == "pretrain_8k" and st.mix(800).phase == "long_context_32k"
    assert max(s.llm_tokens for s in st.batch(799).samples) <= 8192
    assert st.sample_cap(st.mix(800)) == 32768


def test_bursty_schedule_switches_regimes_deterministically_from_seed():
    a = WorkloadStream("bursty_mix", seed=5, global_batch_size=4)
    phases = [a.mix(s).phase for s in range(1000)]
    assert len(set(phases)) == 3
    switches = sum(x != y for x, y in zip(phases, phases[1:], strict=False))
    assert 10 < switches < 200
    b = WorkloadStream("bursty_mix", seed=5, global_batch_size=4)
    assert [b.mix(s).phase for s in reversed(range(1000))][::-1] == phases
    c = WorkloadStream("bursty_mix", seed=6, global_batch_size=4)
    assert [c.mix(s).phase for s in range(1000)] != phases



def test_drifting_video_raises_the_long_video_share_steadily_over_training():
    st = WorkloadStream("drifting_video", seed=3, global_batch_tokens=1 << 21)

    def long_share(steps):
        samples = [x for s in steps for x in st.batch(s).samples]
        by_tokens = sum(x.llm_tokens for x in samples if x.source == "long_video") / sum(x.llm_tokens for x in samples)
        return sum(x.source == "long_video" for x in samples) / len(samples), by_tokens

    early, middle, late = long_share(range(0, 8)), long_share(range(496, 504)), long_share(range(992, 1000))
    assert early[0] < 0.08 and late[0] > 0.2  # samples: 5% -> 25% by the schedule
    assert early[1] < middle[1] < late[1] and late[1] > early[1] + 0.25  # tokens: long videos come to dominate
    assert st.mix(0).phase.endswith(" 0%") and st.mix(999).phase.endswith("100%")  # a drift, never a jump

def _spec_dict():
    return {
        "name": "tiny",
        "description": "test",
        "total_steps": 10,
        "sources": {
            "cap": {"text_tokens": 20, "images": 1, "image_pixels": "coco_pixels"},
            "talk": {"text_tokens": {"kind": "uniform", "low": 5, "high": 50}},
        },
        "schedule": {"kind": "constant", "weights": {"cap": 3, "talk": 1}},
    }


def test_workload_files_in_toml_yaml_json_are_accepted_wherever_a_name_is(tmp_path):
    import yaml

    d = _spec_dict()
    (tmp_path / "w.json").write_text(json.dumps(d))
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(d))
    (tmp_path / "w.toml").write_text(
        'name = "tiny"\ndescription = "test"\ntotal_steps = 10\n'
        '[sources.cap]\ntext_tokens = 20\nimages = 1\nimage_pixels = "coco_pixels"\n'
        '[sources.talk]\ntext_tokens = { kind = "uniform", low = 5, high = 50 }\n'
        '[schedule]\nkind = "constant"\nweights = { cap = 3, talk = 1 }\n'
    )
    keys = [
        _key(WorkloadStream(str(tmp_path / f"w.{ext}"), global_batch_size=50).batch(3))
        for ext in ("json", "yaml", "toml")
    ]
    assert keys[0] == keys[1] == keys[2]
    share = Counter(
        s.source for s in WorkloadStream(str(tmp_path / "w.json"), global_batch_size=4000).batch(0).samples
    )
    assert abs(share["cap"] / 4000 - 0.75) < 0.03


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"schedule": {"kind": "wavy"}}, "schedule.kind: must be one of constant, changing, staged, bursty"),
        ({"schedule": {"kind": "constant", "weights": {"nope": 1}}}, "schedule.weights.nope: unknown source"),
        ({"total_steps": 0}, "total_steps: must be a positive integer"),
        ({"sources": {"x": {"images": 1}}}, "sources.x: with images, give exactly one of"),
        ({"sources": {"x": {"text_tokens": "bogus"}}}, "sources.x.text_tokens: unknown preset 'bogus'"),
        ({"colour": 1}, "workload: unknown key(s) colour"),
        (
            {"schedule": {"kind": "staged", "stages": [{"weights": {"cap": 1}, "until": 0.5}]}},
            "schedule.stages: 'until' must increase and the last stage must end at 1.0",
        ),
    ],
)
def test_bad_workload_spec_errors_name_the_field(patch, message):
    d = _spec_dict() | patch
    with pytest.raises(WorkloadError) as e:
        spec_from_dict(d)
    assert message in str(e.value)


def test_unknown_workload_name_lists_allowed_names():
    with pytest.raises(WorkloadError) as e:
        get_workload("nope")
    assert "unknown name 'nope'" in str(e.value) and "mixed_video" in str(e.value)


def test_stream_rejects_bad_settings():
    with pytest.raises(WorkloadError, match="exactly one of"):
        WorkloadStream("text_only")
    with pytest.raises(WorkloadError, match="length_scale"):
        WorkloadStream("text_only", global_batch_size=4, length_scale=0)
    with pytest.raises(WorkloadError, match="step"):
        WorkloadStream("text_only", global_batch_size=4).batch(-1)


def test_pack_sequences_respects_max_seq_len():
    b = WorkloadStream("image_sft", global_batch_tokens=60000).batch(0)
    bins = pack_sequences(b.samples, 8192)
    assert sorted(i for x in bins for i in x) == list(range(len(b.samples)))
    assert all(sum(b.samples[i].llm_tokens for i in x) <= 8192 for x in bins)


@pytest.mark.parametrize("scale", [0.05, 0.2])
def test_length_scale_shrinks_every_modality_by_about_the_same_factor(scale):
    def mean_tokens(stream):
        per: dict[str, list[int]] = {}
        for step in (0, 400, 999):
            for s in stream.batch(step).samples:
                for seg in s.segments:
                    per.setdefault(seg.modality, []).append(seg.llm_tokens)
        return {m: float(np.mean(v)) for m, v in per.items()}

    full = mean_tokens(WorkloadStream("omni_av", global_batch_size=3000))
    tiny = mean_tokens(WorkloadStream("omni_av", global_batch_size=3000, length_scale=scale))
    assert set(full) == set(tiny) == {"text", "image", "video", "audio"}
    for m in full:
        ratio = tiny[m] / full[m]
        assert scale / 2 < ratio < scale * 2, (m, ratio)

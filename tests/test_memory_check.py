"""The memory check before launch: the simulator's per-rank estimate decides recompute and depth on
CUDA, and a run that cannot fit is refused in one line before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from omnibench.runtime.memory import HEADROOM, estimate, fit_to_device
from omnibench.specs.model import SpecError
from omnibench.specs.run import RunSpec

pytestmark = pytest.mark.timeout(120)


def _cuda_spec(**kw) -> RunSpec:
    """A resolved single-GPU spec as the launcher would make it on an H100 machine."""
    base = RunSpec(system="homogeneous", workload="mixed_video", model="omni-7b", nproc=1, steps=2,
                   length_scale=1.0, global_batch_tokens=16384, extra={"device": "cuda"})
    return replace(base, **kw)


def test_auto_takes_the_deepest_model_and_cheapest_recompute_that_fit_one_gpu():
    spec, note = fit_to_device(_cuda_spec(recompute="auto"), model_given=False, memory_gib=80.0)
    assert spec.model.startswith("omni-7b@") and spec.recompute in ("none", "selective", "full")
    est = estimate(spec, memory_gib=80.0)
    assert est.peak_bytes <= HEADROOM * 80 * 2**30
    assert "chosen to fit" in note and spec.model in note
    # one layer deeper, or one recompute mode cheaper, would not have fit
    deeper = {"omni-7b@2L": "omni-7b@4L", "omni-7b@4L": "omni-7b@8L", "omni-7b@8L": "omni-7b@16L"}[spec.model]
    assert estimate(spec, deeper, "full", memory_gib=80.0).peak_bytes > HEADROOM * 80 * 2**30


def test_a_given_model_that_cannot_fit_is_refused_with_the_options_that_would():
    with pytest.raises(SpecError) as e:
        fit_to_device(_cuda_spec(model="omni-7b@8L", recompute="none"), model_given=True, memory_gib=80.0)
    msg = str(e.value)
    assert "\n" not in msg
    assert "omni-7b@8L with recompute=none needs an estimated" in msg and "the device has 80.0 GiB" in msg
    assert "would fit: --recompute full" in msg


def test_more_memory_admits_what_less_refuses():
    spec = _cuda_spec(model="omni-7b@4L", recompute="full")
    fitted, _ = fit_to_device(spec, model_given=True, memory_gib=141.0)
    assert fitted.recompute == "full"
    with pytest.raises(SpecError):
        fit_to_device(spec, model_given=True, memory_gib=24.0)


def test_run_refuses_a_model_too_large_for_the_host_before_any_rank_starts(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "omnibench", "run", "--system", "homogeneous", "--model", "omni-72b", "--device", "cpu",
         "--nproc", "2", "--steps", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=100,
    )
    assert done.returncode == 2
    lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "omni-72b@no-audio with recompute=none needs an estimated" in lines[0], done.stderr
    assert not out.exists() and not (tmp_path / "run.incomplete").exists()


def test_auto_chunks_the_encoders_when_a_long_video_would_not_fit_otherwise():
    """long_video at omni-7b@4L on one 80 GB GPU with recompute=none: unchunked the ViT's activations
    of the longest video do not fit; `--encoder-chunk-tokens auto` chunks them (off, the default, refuses
    naming the chunk budget that would fit)."""
    spec = _cuda_spec(workload="long_video", model="omni-7b@4L", recompute="none", encoder_chunk_tokens=-1)
    with pytest.raises(SpecError, match="would fit: .*--encoder-chunk-tokens"):
        fit_to_device(replace(spec, encoder_chunk_tokens=0), model_given=True, memory_gib=80.0)
    fitted, note = fit_to_device(spec, model_given=True, memory_gib=80.0)
    assert fitted.encoder_chunk_tokens > 0 and fitted.recompute == "none"
    assert f"encoder chunks of {fitted.encoder_chunk_tokens} tokens" in note and "chosen to fit" in note
    chunked = estimate(fitted, memory_gib=80.0)
    plain = estimate(replace(fitted, encoder_chunk_tokens=0), memory_gib=80.0)
    assert chunked.peak_bytes <= HEADROOM * 80 * 2**30 < plain.peak_bytes


def test_auto_leaves_encoders_unchunked_when_they_fit():
    fitted, _ = fit_to_device(_cuda_spec(model="omni-7b@2L", recompute="full", encoder_chunk_tokens=-1),
                              model_given=True, memory_gib=141.0)
    assert fitted.encoder_chunk_tokens == 0


def test_bad_chunk_budget_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="encoder_chunk_tokens must be"):
        RunSpec(system="omni", encoder_chunk_tokens=-3).validate()


H100_GIB = 85_017_493_504 / 2**30  # torch's capacity of the H100 80GB HBM3 the GPU records ran on


def test_the_check_refuses_what_ran_out_of_memory_on_an_h100_and_admits_what_ran():
    """The one-H100 runs of 2026-11-27 (results/gpu/2026-11-27-h100/gpu_figures-call1.json): the
    CUDA default for omni on omni_av (omni-7b@8L, full recomputation) ran out of memory at 71.8 GiB
    allocated, 2.3 GiB stranded and 4.7 GiB outside the allocator of 79.18; omni-7b@8L on mixed_video
    and image_sft ran (63.6 and 64.0 GiB allocated). The check decides on the allocator's measured need."""
    oom = _cuda_spec(system="omni", workload="omni_av", model="omni-7b@8L", recompute="full")
    with pytest.raises(SpecError, match="omni-7b@8L with recompute=full needs an estimated"):
        fit_to_device(oom, model_given=True, memory_gib=H100_GIB)
    for workload in ("mixed_video", "image_sft"):
        ran = _cuda_spec(system="omni", workload=workload, model="omni-7b@8L", recompute="full")
        fitted, _ = fit_to_device(ran, model_given=True, memory_gib=H100_GIB)
        assert fitted.model == "omni-7b@8L" and fitted.recompute == "full"
    # left to choose, the default no longer takes the depth that ran out of memory
    chosen, note = fit_to_device(replace(oom, model="omni-7b", recompute="auto"), model_given=False,
                                 memory_gib=H100_GIB)
    assert chosen.model != "omni-7b@8L" or chosen.recompute != "full", note

"""The all-gather-KV attention check (benchmarks/gpu_allgather_attention.py) plays every member of a
context-parallel group in one process; on CPU it runs the same layouts through the per-sequence
backends in fp32, so the script and the member layout it checks cannot rot between GPU runs, and
a wrong layout (a member's keys cut at the wrong row) is caught."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_allgather_attention", ROOT / "benchmarks" / "gpu_allgather_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_on_cpu_every_member_matches_full_attention(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_allgather_attention.py", "--device", "cpu", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_allgather_attention.json").read_text())
    assert len(out["cases"]) == 6 and all(c["ok"] for c in out["cases"])
    assert all(max(c["errors"].values()) < 1e-5 for c in out["cases"])  # fp32: only rounding
    assert out["provenance"]["command"].startswith("python benchmarks/gpu_allgather_attention.py")


@pytest.mark.timeout(60)
def test_keys_cut_one_row_short_fail_the_check(monkeypatch):
    mod = _script()
    real = mod._allgather_layout

    def short(bounds, tokens, k, member):
        cu_q, cu_k, keys = real(bounds, tokens, k, member)
        return cu_q, [0] + [c - 1 for c in cu_k[1:2]] + cu_k[2:], keys  # the first segment misses its last key
    monkeypatch.setattr(mod, "_allgather_layout", short)
    r = mod.case("math", 2, 4, 2, [64], d=16, device="cpu", dtype=torch.float32)
    assert not r["ok"]

"""Varlen attention: backends agree with a dense block-diagonal masked reference, never mix sequences.

Only the "sdpa" and "math" backends run on CPU; the "flash" backend (flash-attn on CUDA) is not
exercised here.
"""

from __future__ import annotations

import pytest
import torch

from omnibench.models.attention import VarlenAttention, flash_available, resolve_backend

pytestmark = pytest.mark.timeout(60)



def _dense_reference(q, k, v, cu, causal):
    """One softmax over all T tokens with a block-diagonal (and causal) mask; GQA by repeating kv."""
    t, hq, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    seq = torch.zeros(t, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        seq[a:b] = i
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= torch.ones(t, t, dtype=torch.bool).tril()
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _qkv(lens, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_backend_matches_block_diagonal_masked_reference(backend, causal, heads):
    q, k, v, cu = _qkv([5, 1, 11, 3], hq=heads[0], hkv=heads[1])
    got = VarlenAttention(backend)(q, k, v, cu, 11, causal=causal)
    torch.testing.assert_close(got, _dense_reference(q, k, v, cu, causal), rtol=1e-5, atol=1e-5)


def test_gradients_match_reference():
    q, k, v, cu = _qkv([6, 9])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    VarlenAttention("sdpa")(*leaves, cu, 9, causal=True).square().sum().backward()
    _dense_reference(*ref_leaves, cu, True).square().sum().backward()
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_packed_sequences_never_attend_across_boundaries():
    q, k, v, cu = _qkv([4, 6, 5])
    attn = VarlenAttention("sdpa")
    base = attn(q, k, v, cu, 6, causal=False)
    k2, v2 = k.clone(), v.clone()
    k2[4:10] += 3.0  # change only the middle sequence's keys and values
    v2[4:10] -= 2.0
    moved = attn(q, k2, v2, cu, 6, causal=False)
    torch.testing.assert_close(moved[:4], base[:4])
    torch.testing.assert_close(moved[10:], base[10:])
    assert not torch.allclose(moved[4:10], base[4:10])


def test_head_counts_come_from_tensor_shapes_so_tp_shards_work():
    # A TP shard holding 2 of 4 query heads and 1 of 2 kv heads gives the matching slice of the full result.
    q, k, v, cu = _qkv([7, 3], hq=4, hkv=2)
    attn = VarlenAttention("sdpa")
    full = attn(q, k, v, cu, 7, causal=True)
    shard = attn(q[:, :2], k[:, :1], v[:, :1], cu, 7, causal=True)
    torch.testing.assert_close(shard, full[:, :2])


def test_backend_chosen_by_argument_then_environment(monkeypatch):
    monkeypatch.setenv("OMNIBENCH_ATTN", "math")
    assert VarlenAttention().backend == "math"
    assert VarlenAttention("sdpa").backend == "sdpa"
    monkeypatch.setenv("OMNIBENCH_ATTN", "bogus")
    with pytest.raises(ValueError, match="auto, flash, sdpa, math"):
        VarlenAttention()


def test_auto_backend_runs_sdpa_on_cpu():
    q, k, v, cu = _qkv([3, 4])
    assert resolve_backend("auto") == "auto"
    torch.testing.assert_close(
        VarlenAttention("auto")(q, k, v, cu, 4, causal=True), VarlenAttention("sdpa")(q, k, v, cu, 4, causal=True)
    )


@pytest.mark.skipif(flash_available(), reason="flash-attn is available here")
def test_flash_backend_refused_without_cuda_and_flash_attn():
    with pytest.raises(ValueError, match="flash"):
        VarlenAttention("flash")

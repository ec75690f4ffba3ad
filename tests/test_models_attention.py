"""Varlen attention: backends agree with a dense block-diagonal masked reference, never mix sequences.

Only the "sdpa" and "math" backends run on CPU; on a CUDA machine the "varlen" (torch's varlen_attn)
and fused-only "sdpa" paths are checked against the CPU path too. The "flash" backend (the flash-attn
package) is not exercised here.
"""

from __future__ import annotations

import pytest
import torch

from omnibench.models.attention import VarlenAttention, flash_available, resolve_backend, varlen_available

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
    with pytest.raises(ValueError, match="auto, flash, varlen, sdpa, math"):
        VarlenAttention()


def _aten_ops(fn) -> set[str]:
    """The aten ops `fn()` dispatches (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


@pytest.mark.parametrize("segments", [False, True], ids=["packed", "segments"])
def test_sdpa_on_cpu_runs_the_flash_kernel_never_the_scores(segments):
    """SDPA given 3-D [H, L, D] inputs silently runs its math kernel (H x L x L scores, 10x slower at
    1,500 tokens): the CPU path must hand it 4-D ones, forward and backward. `segments` is the
    all-gather-K/V path (queries over a longer key range, bottom-right causal mask)."""
    q, k, v, cu = _qkv([6, 9])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    attn = VarlenAttention("sdpa")

    def step():
        if segments:
            out = attn.segments(leaves[0][:8], *leaves[1:], [0, 3, 8], [0, 6, 15], causal=True)
        else:
            out = attn(*leaves, cu, 9, causal=True)
        out.square().sum().backward()

    ops = _aten_ops(step)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops, sorted(ops)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in ops, sorted(ops)
    assert not ops & {"_softmax", "_safe_softmax", "bmm"}, sorted(ops)


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


def _cuda_case(backend):
    q, k, v, cu = _qkv([300, 7, 129], hq=8, hkv=2, d=64, seed=3)
    leaves = [x.cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    out = VarlenAttention(backend)(*leaves, cu.cuda(), 300, causal=True)
    out.float().square().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]  # the CPU path, fp32
    ref = VarlenAttention("sdpa")(*ref_leaves, cu, 300, causal=True)
    ref.square().sum().backward()
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad.float().cpu(), b.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not varlen_available(), reason="needs CUDA and torch's varlen_attn")
def test_torch_varlen_backend_on_cuda_matches_the_cpu_path_with_gqa():
    _cuda_case("varlen")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sdpa_backend_on_cuda_runs_fused_kernels_only_and_matches_the_cpu_path():
    # _fused_sdpa forbids the math kernel: a layout the fused kernels refuse would raise here
    _cuda_case("sdpa")


def test_varlen_backend_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="varlen"):
        VarlenAttention("varlen")

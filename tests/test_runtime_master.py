"""`--mixed-precision master` (omnibench/runtime/master.py): a module FSDP does not shard keeps bf16
weights and its fp32 master and main gradients in the optimizer. The step is AdamW on the fp32 master
over the gradients of every microbatch summed in fp32 (not in bf16), the weights are the master
rounded to bf16 after every step, and under DDP the fp32 main gradients are what is all-reduced; whole
runs (DDP over 2 gloo ranks, and tensor parallel over 2, bf16 on CPU) train as the autocast arrangement does."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group
from parity import Run, make_batches, reference, run_all
from test_runtime_zero import _data, _toy  # the ZeRO tests' toy model and per-rank data

pytestmark = pytest.mark.timeout(240)


def _expected(parts: list[list[int]], steps: int = 3) -> list[torch.Tensor]:
    """By hand: per step, the bf16 model (the fp32 master rounded) runs every part's data; the bf16
    gradients are summed in fp32; fp32 AdamW steps the master."""
    master = _toy()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    for step in range(steps):
        low = _toy().to(torch.bfloat16)
        with torch.no_grad():
            for w, m in zip(low.parameters(), master.parameters(), strict=True):
                w.copy_(m)
        total = [torch.zeros_like(p) for p in master.parameters()]
        for part in parts[step]:
            low.zero_grad(set_to_none=True)
            low(_data(step, part).to(torch.bfloat16)).float().pow(2).sum().backward()
            for t, w in zip(total, low.parameters(), strict=True):
                t += w.grad.float()
        for p, t in zip(master.parameters(), total, strict=True):
            p.grad = t
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in master.parameters()]


def test_microbatches_accumulate_in_fp32_and_the_weights_are_the_rounded_master():
    from omnibench.runtime.master import MasterWeights

    model = _toy()
    state = MasterWeights("toy", list(model.parameters()), None, "adamw", 1e-2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in state.master)
    parts = [[0, 1, 2]] * 3
    for step in range(3):
        for part in parts[step]:
            model(_data(step, part).to(torch.bfloat16)).float().pow(2).sum().backward()
        assert all(p.grad is None for p in model.parameters())  # moved into the fp32 main gradients
        assert all(g.dtype == torch.float32 for g in state.main)
        state.reduce()  # a group of one: nothing to reduce
        state.step()
    want = _expected(parts)
    for m, w, p in zip(state.master, want, model.parameters(), strict=True):
        assert torch.allclose(m, w, atol=1e-6), (m - w).abs().max()
        assert torch.equal(p, m.to(torch.bfloat16))
    assert all(g is None for g in state.main)


def test_a_module_without_gradients_is_not_stepped():
    from omnibench.runtime.master import MasterWeights

    model = _toy()
    state = MasterWeights("toy", list(model.parameters()), None, "adamw", 1e-2)
    before = [m.detach().clone() for m in state.master]
    state.reduce()
    state.step()
    assert all(torch.equal(a, b) for a, b in zip(before, state.master, strict=True))


def _ddp_worker(rank: int, world: int, init: str, out: str) -> None:
    from omnibench.runtime.master import MasterWeights

    join_group(rank, world, init)
    model = _toy()
    state = MasterWeights("toy", list(model.parameters()), dist.group.WORLD, "adamw", 1e-2)
    for step in range(3):
        model(_data(step, rank).to(torch.bfloat16)).float().pow(2).sum().backward()
        state.reduce()
        state.step()
    torch.save([m.detach() for m in state.master], os.path.join(out, f"rank{rank}.pt"))
    leave_group()


@pytest.mark.timeout(120)
def test_ddp_all_reduces_the_fp32_main_gradients():
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'store')}"
        mp.spawn(_ddp_worker, args=(2, init, out), nprocs=2, join=True)
        got = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    want = _expected([[0, 1]] * 3)
    for r in range(2):
        for m, w in zip(got[r], want, strict=True):
            assert torch.allclose(m, w, atol=1e-6), (r, (m - w).abs().max())


@pytest.mark.xdist_group("runtime_master")
def test_whole_runs_train_like_autocast(tmp_path):
    """Homogeneous without FSDP on 2 gloo ranks (DDP), bf16: the master arrangement's losses and final
    (master) parameters stay within bf16 noise of the autocast arrangement's and of the fp32 reference,
    and the run says which modules it held so."""
    batches = make_batches()
    runs = [Run(mp_, "homogeneous", "tiny-omni", batches,
                {"fsdp": False, "dtype": "bf16", "mixed_precision": mp_}) for mp_ in ("autocast", "master")]
    # tensor-parallel weights are DTensors: their local shards must become bf16 too
    runs.append(Run("master-tp2", "homogeneous", "tiny-omni", batches,
                    {"fsdp": False, "tp": 2, "dtype": "bf16", "mixed_precision": "master"}))
    res = run_all(tmp_path, runs, nproc=2)
    ref_losses, ref_params = reference("tiny-omni", batches)
    (la, pa), (lm, pm) = res["autocast"].get(), res["master"].get()
    for a, m, r in zip(la, lm, ref_losses, strict=True):
        assert abs(m - a) < 2e-2 and abs(m - r) < 3e-2, (a, m, r)
    off = max((ref_params[k] - v).abs().max().item() for k, v in pm.items())
    assert off < 1e-2  # Adam's steps are ~lr = 1e-3 each: within a few steps' worth of the reference
    assert max((pa[k] - v).abs().max().item() for k, v in pm.items()) < 1e-2
    assert all(v.dtype == torch.float32 for v in pm.values())
    lt, pt = res["master-tp2"].get()
    assert all(abs(t - m) < 2e-2 for t, m in zip(lt, lm, strict=True)), (lt, lm)
    assert max((pm[k] - v).abs().max().item() for k, v in pt.items()) < 1e-2
    for key, dumped in (("master", pm), ("master-tp2", pt)):
        # what the run dumps is the fp32 master, not the bf16 weights (every matrix has values bf16
        # cannot hold), tensor-parallel DTensors included
        assert all((v != v.bfloat16().float()).any() for v in dumped.values() if v.ndim == 2), key
        notes = (res[key].folder / "summary.json").read_text()
        assert "llm: bf16 weights, fp32 master" in notes, key


@pytest.mark.xdist_group("runtime_master")
def test_expert_parallel_runs_hold_experts_like_the_dense_weights(tmp_path):
    """Experts split over ep 2 on 2 gloo ranks (no other rank holds the same experts), bf16: under
    `--mixed-precision master` without FSDP, and under FSDP (which leaves such experts to their rank),
    they get bf16 weights with an fp32 master (build.py `_expert_state`), as the simulator charges
    them, and both runs train like the fp32 reference."""
    batches = make_batches()
    runs = [Run("ep-master", "homogeneous", "tiny-omni-moe", batches,
                {"fsdp": False, "ep": 2, "dtype": "bf16", "mixed_precision": "master"}),
            Run("ep-fsdp", "homogeneous", "tiny-omni-moe", batches, {"ep": 2, "dtype": "bf16"})]
    res = run_all(tmp_path, runs, nproc=2)
    ref_losses, ref_params = reference("tiny-omni-moe", batches)
    for key in ("ep-master", "ep-fsdp"):
        losses, params = res[key].get()
        assert all(abs(x - r) < 3e-2 for x, r in zip(losses, ref_losses, strict=True)), (key, losses, ref_losses)
        experts = {k: v for k, v in params.items() if "@" in k}
        assert experts, key
        assert all((v != v.bfloat16().float()).any() for v in experts.values() if v.ndim >= 2), key
        assert "llm experts: " in (res[key].folder / "summary.json").read_text(), key


@pytest.mark.xdist_group("runtime_master")
def test_expert_parallel_zero_shards_the_experts_state_over_their_data_ranks(tmp_path):
    """ep 2 on 4 gloo ranks without FSDP under ZeRO-1 (fp32): each pair of ranks holding the same
    experts shards their optimizer state between them (build.py `_expert_state`, the expert data-parallel
    group the simulator shards them over) and the run matches the one-process reference exactly."""
    from parity import assert_parity

    batches = make_batches()
    res = run_all(tmp_path, [Run("ep-zero", "temporal", "tiny-omni-moe", batches,
                                 {"fsdp": False, "zero": 1, "ep": 2})], nproc=4)
    losses, params = res["ep-zero"].get()
    assert_parity(losses, params, *reference("tiny-omni-moe", batches))
    assert "llm experts: ZeRO-1 over the 2 ranks holding the same experts" in \
        (res["ep-zero"].folder / "summary.json").read_text()

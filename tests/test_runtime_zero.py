"""ZeRO-1 and ZeRO-2 (omnibench/runtime/zero.py, `Layout.zero`): a module whose weights data
parallelism replicates keeps only its slice of the optimizer state (and, under ZeRO-2, of the
gradients after grad_sync), and trains exactly like a single process: the sharded AdamW step over
buckets that cut parameters apart, and whole systems on 4 gloo ranks over 2 steps to 1e-4 (the second
loss follows one sharded AdamW update, and the final parameters two, the second one from the sharded
moments the first left: a third step would check nothing more)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import join_group, leave_group
from parity import Run, assert_parity, make_batches, reference, run_all
from test_omni_parity import long_batches

STEPS = 2


def _toy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _data(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g)


def _train(rank: int, world: int, stage: int, out: str, shard: int = 0) -> None:
    """Three sharded AdamW steps of the toy model as `rank` of the default group (of `world` ranks)."""
    from omnibench.runtime.zero import ShardedState

    model = _toy()
    group, replicate = dist.group.WORLD, None
    if shard:  # hybrid: shard groups of `shard` consecutive ranks, replicated across them
        shards = [dist.new_group(list(range(i, i + shard))) for i in range(0, world, shard)]
        reps = [dist.new_group(list(range(j, world, shard))) for j in range(shard)]
        group, replicate = shards[rank // shard], reps[rank % shard]
    # 9-element buckets: the 35 + 7 + 21 + 3 parameters straddle bucket edges and the last bucket is short.
    state = ShardedState("toy", list(model.parameters()), group, stage, "adamw", 1e-2, bucket_elems=9,
                         replicate=replicate)
    sizes = {}
    for step in range(3):
        model(_data(step, rank)).pow(2).sum().backward()
        state.reduce()
        sizes[step] = [p.grad is not None for p in model.parameters()]
        state.step()
        state.zero_grad()
    torch.save({"params": [p.detach() for p in model.parameters()], "grads_kept": sizes,
                "master": state.master.numel()}, os.path.join(out, f"rank{rank}.pt"))


# (id, stage, world, shard): each trains in a default process group of its own (its own rendezvous
# file) of `world` ranks, one after the other in the same spawned processes (Python and torch started
# once); the last one has every rank, and leave_group ends them.
SHARDED = [("zero1", 1, 2, 0), ("zero2", 2, 2, 0), ("hybrid-zero2", 2, 4, 2)]


def _worker(rank: int, out: str) -> None:
    for i, (case, stage, world, shard) in enumerate(SHARDED):
        if rank >= world:
            continue
        folder = os.path.join(out, case)
        join_group(rank, world, f"file://{os.path.join(folder, 'store')}")
        _train(rank, world, stage, folder, shard)
        if i == len(SHARDED) - 1:
            leave_group()
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_runs():
    """Every SHARDED case, in one spawn of as many ranks as the largest needs: each case's rank files."""
    with tempfile.TemporaryDirectory() as out:
        for case, *_ in SHARDED:
            os.mkdir(os.path.join(out, case))
        mp.spawn(_worker, args=(out,), nprocs=SHARDED[-1][2], join=True)
        yield {case: [torch.load(os.path.join(out, case, f"rank{r}.pt")) for r in range(world)]
               for case, _, world, _ in SHARDED}


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("sharded-adamw")  # one worker, so the one spawn (sharded_runs)
@pytest.mark.parametrize("stage,world,shard", [c[1:] for c in SHARDED], ids=[c[0] for c in SHARDED])
def test_sharded_adamw_over_buckets_matches_one_process(sharded_runs, request, stage, world, shard):
    """Two ranks, each with its own data: the ZeRO step equals AdamW over the summed gradients in
    one process; each rank's master holds half the (padded) parameters; ZeRO-2 drops the full
    gradients at the reduction, ZeRO-1 keeps them until the step ends. Hybrid (4 ranks, shard groups
    of 2 replicated twice): the same step, each master still half of the parameters."""
    ref = _toy()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    for step in range(3):
        sum(ref(_data(step, r)).pow(2).sum() for r in range(world)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = sharded_runs[request.node.callspec.id]
    assert len(got) == world
    n = shard or world
    for r in range(world):
        for p, q in zip(got[r]["params"], ref.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6), (r, (p - q).abs().max())
        assert got[r]["master"] == sum(-(-min(9, 66 - lo) // n) for lo in range(0, 66, 9))
        assert all(all(kept) == (stage == 1) for kept in got[r]["grads_kept"].values())


CELLS = [
    # (system, layout, batches): every dp mode on omni's encoders, and ZeRO on the LLM and on other systems.
    pytest.param("omni", {"options": {"encoder_dp": "zero2"}}, "long", id="omni-encoders-zero2"),
    pytest.param("omni", {"options": {"encoder_dp": "fsdp"}, "pp": 2}, "long", id="omni-encoders-fsdp-pp2"),
    pytest.param("omni", {"options": {"encoder_dp": "zero1"}, "pp": 2}, "long", id="omni-encoders-zero1-pp2"),
    pytest.param("omni", {"options": {"encoder_dp": "ddp"}}, "long", id="omni-encoders-ddp"),
    pytest.param("omni", {"options": {"encoder_dp": "hzero2"}, "dp_shard": 2}, "long", id="omni-encoders-hzero2"),
    pytest.param("omni", {"fsdp": False, "zero": 2, "cp": 2}, "long", id="omni-llm-zero2-cp2"),
    pytest.param("homogeneous", {"fsdp": False, "zero": 2, "pp": 2}, "mixed", id="homogeneous-zero2-pp2"),
    pytest.param("colocated", {"fsdp": False, "zero": 1, "tp": 2, "encoder_tp": 2}, "mixed",
                 id="colocated-zero1-tp2-encoder-tp2"),
    pytest.param("temporal", {"fsdp": False, "zero": 2, "cp": 2}, "mixed", id="temporal-zero2-cp2"),
]


def _batches(kind: str):
    return long_batches(STEPS) if kind == "long" else make_batches(STEPS, samples=8)


BF16 = {"dtype": "bf16", "fsdp": False, "zero": 2}  # test_zero_on_bf16_weights_trains_close_to_fp32


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """Every cell, and the bf16 run, in one launch of 4 gloo ranks (tests/parity.py)."""
    runs = [Run(c.id, c.values[0], "tiny-omni", _batches(c.values[2]), c.values[1]) for c in CELLS]
    runs.append(Run("bf16", "omni", "tiny-omni", _batches("mixed"), BF16))
    return run_all(tmp_path_factory.mktemp("zero"), runs)


@pytest.mark.timeout(1200)  # the first cell's setup launches all of them
@pytest.mark.xdist_group("parity-zero")
@pytest.mark.parametrize("system,layout,batches", CELLS)
def test_zero_modes_train_like_one_process(zero_runs, request, system, layout, batches):
    result = zero_runs[request.node.callspec.id]
    losses, params = result.get()
    assert_parity(losses, params, *reference("tiny-omni", _batches(batches)))
    notes = (result.folder / "summary.json").read_text()
    zero = layout.get("zero") or {"zero1": 1, "zero2": 2, "hzero2": 2}.get(layout.get("options", {}).get("encoder_dp"), 0)
    if zero:
        assert f"ZeRO-{zero}" in notes
    if layout.get("options", {}).get("encoder_dp") == "hzero2":
        assert "sharded over 2 data-parallel ranks, replicated across 2 shard groups" in notes


@pytest.mark.timeout(1200)  # the launch is zero_runs's
@pytest.mark.xdist_group("parity-zero")
def test_zero_on_bf16_weights_trains_close_to_fp32(zero_runs):
    """A bf16 run (CPU here) holds ZeRO modules' weights in bf16 with fp32 masters and fp32 main
    gradients: its losses stay within bf16 rounding of the fp32 single process."""
    ref, _ = reference("tiny-omni", _batches("mixed"))
    losses, _ = zero_runs["bf16"].get()
    notes = (zero_runs["bf16"].folder / "summary.json").read_text()
    assert "llm: ZeRO-2" in notes and "vision: ZeRO-2" in notes
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 2e-3


@pytest.mark.timeout(180)
def test_run_takes_dp_mode_and_refuses_unknown_ones(tmp_path):
    from test_runtime_cli import omnibench

    bad = omnibench("run", "--system", "homogeneous", "--dp-mode", "zero3")
    assert bad.returncode != 0 and "dp_mode must be one of ddp, zero1, zero2, fsdp, hsdp" in bad.stderr
    assert "Traceback" not in bad.stderr
    mixed = omnibench("run", "--system", "homogeneous", "--dp-mode", "zero1", "--dp-shard", "2")
    assert mixed.returncode != 0 and "needs --dp-mode hsdp" in mixed.stderr
    ok = omnibench("run", "--system", "homogeneous", "--device", "cpu", "--nproc", "2", "--steps", "1",
                   "--dp-mode", "zero1", "--out", str(tmp_path / "run"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    notes = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "llm: ZeRO-1" in json.dumps(notes)

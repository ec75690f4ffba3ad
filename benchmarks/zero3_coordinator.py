"""How far DeepSpeed ZeRO-3's own code path (as of the Narayanan et al. 2021 runs) explains the ZeRO-3
rows of published_runs.csv (Table 2 of arXiv 2104.04473): a replay of its parameter coordinator, one
sub-module at a time, on this simulator's kernel and NCCL cost models. A study: nothing here changes how
`validate --published` costs the rows (README, "Rows not modelled honestly").

    python benchmarks/zero3_coordinator.py [--table results/validation/published_runs.csv] [--rows zero3]

What the replay takes from the code (microsoft/DeepSpeed, the same in every release v0.3.13 of
2021-03-16 to v0.5.0 of 2021-08; line numbers at v0.3.14, 2021-04-08, the release before the paper):
- one all-gather per parameter (`partition_parameters.py` `_allgather_param`, called by `_all_gather`
  with async_op=True from `stage3.py` `fetch_sub_module` and `prefetch_next_sub_modules`): the message is
  one parameter; `stage3_prefetch_bucket_size` (5e7) is how many elements are prefetched, not a message;
- `torch.cuda.synchronize()` before every such gather (partition_parameters.py:625) and after every
  fetch that found parameters missing or in flight (`_synchronize_communication`, stage3.py:491): a
  gather cannot start before the device has drained, so it overlaps at most the compute of the
  sub-modules launched after it was issued and before the next fetch;
- prefetch only when nothing is in flight and fewer than `stage3_max_live_parameters` (1e9) elements
  are gathered (stage3.py `prefetch_next_sub_modules`); a module is kept after use if it is used again
  within `stage3_max_reuse_distance` (1e9) elements (`_keep_for_later`), which is how the backward
  finds the last sub-modules of a recomputed layer still gathered;
- parameters under `stage3_param_persistence_threshold` (1e5 elements: biases, LayerNorms here) are
  never partitioned (stage3.py `persistent_parameters`);
- the list forms of the collectives: DeepSpeed builds one `narrow` view per rank (partition_parameters
  `_allgather_param`, `_reduce_scatter_gradient`), and torch.distributed's NCCL group copies the
  gathered buffer out to each rank's tensor one `copy_` at a time (ProcessGroupNCCL::allgather, and the
  inputs in one at a time for reduce_scatter; PyTorch 1.7-1.8): host work linear in the ranks per call;
- gradients: `contiguous_gradients` defaults to False under stage 3 (zero/constants.py
  ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT), and then `reduce_ipg_grads` all-reduces each 5e8-
  element bucket on the compute stream (`buffered_reduce_fallback`); with it True (DeepSpeedExamples'
  Megatron ZeRO-3 configs set it) each parameter is reduce-scattered on the reduction stream.
The paper gives no DeepSpeed version or configuration: the defaults above are the fill rule's.

Costs: GEMMs and the unfused attention from the row's kernel profile (the A100 preset, scaled as
`validate` scales it), collectives from `CollectiveModel` (NCCL's ring), host work per rank per list
collective `--host-us` (default: the profile's host time per launched op, one `copy_` per rank).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.collectives import CollectiveModel  # noqa: E402
from simulator.compute import ComputeModel  # noqa: E402
from simulator.hardware import load_cluster  # noqa: E402
from simulator.kernels import BlockShape, Stack, _attention, llm_pass  # noqa: E402
from simulator.published import load_published, measured  # noqa: E402

# DeepSpeed v0.3.14 ZeRO-3 defaults (deepspeed/runtime/zero/constants.py)
PREFETCH_BUCKET = 5e7
MAX_LIVE = 1e9
MAX_REUSE = 1e9
REDUCE_BUCKET = 5e8
ORDER = ("qkv", "dense", "fc1", "fc2")  # the gathered sub-modules of a Megatron GPT layer, forward order


@dataclass
class Replay:
    step_s: float
    compute_s: float  # the kernels alone
    host_s: float  # host work of the list collectives
    comm_s: float  # NCCL time of every gather and reduction
    gathers: int


def layer_costs(row, cluster):
    """Per sub-module forward / backward seconds and parameter counts of one layer at the row's micro batch."""
    prof = ComputeModel(cluster).kernels
    h, s, t = row.hidden, row.seq, row.micro_batch * row.seq
    shape = BlockShape(hidden=h, heads=row.heads, kv_heads=row.heads, head_dim=h // row.heads, ffn=row.ffn,
                       vocab=row.vocab, seq_lens=(s,) * row.micro_batch, layers=1, head=False, mlp="gelu",
                       norm="layer", rope=False, causal=True, stack=Stack(attention="unfused"))
    shapes = {"qkv": (3 * h, h), "dense": (h, h), "fc1": (row.ffn, h), "fc2": (h, row.ffn)}
    fwd = {m: prof.gemm_time(t, fo, fi) for m, (fo, fi) in shapes.items()}
    bwd = {m: prof.gemm_time(t, fi, fo) + prof.gemm_time(fo, fi, t) for m, (fo, fi) in shapes.items()}
    # the attention core (no parameters: no fetch, no sync) runs between qkv and dense
    fwd["qkv"] += _attention(prof, shape, False)
    bwd["qkv"] += _attention(prof, shape, True)
    # norms, bias-dropout-adds and GELU (persistent parameters: no fetch) with the layer's last GEMM
    fwd["fc2"] += llm_pass(prof, shape, "fwd") - sum(fwd.values())
    bwd["fc2"] += llm_pass(prof, shape, "bwd") - sum(bwd.values())
    return fwd, bwd, {m: fo * fi for m, (fo, fi) in shapes.items()}


def replay(row, host_per_rank: float | None = None, reduce: str = "allreduce") -> Replay:
    """One step of one rank: forward, then per layer (last first) the recomputed forward and the backward."""
    cluster = load_cluster(row.hardware, row.gpus)
    coll = CollectiveModel(cluster)
    prof = ComputeModel(cluster).kernels
    hr = prof.launch_s if host_per_rank is None else host_per_rank
    n, ranks = row.gpus, tuple(range(row.gpus))
    fwd, bwd, numel = layer_costs(row, cluster)
    trace = [("f", i, m) for i in range(row.layers) for m in ORDER]
    for i in reversed(range(row.layers)):
        trace += [("r", i, m) for m in ORDER] + [("b", i, m) for m in reversed(ORDER)]
    # distance (elements) from each trace position to the next use of the same parameter
    nxt, reuse = {}, [None] * len(trace)
    for k in range(len(trace) - 1, -1, -1):
        p = trace[k][1:]
        reuse[k] = nxt.get(p)
        nxt[p] = k
    prefix = [0.0]
    for e in trace:
        prefix.append(prefix[-1] + numel[e[2]])

    status: dict = {}
    inflight: list = []
    live = 0.0
    host = compute = comm_dev = host_work = comm = 0.0  # host clock, compute / comm stream free times
    gathers = 0
    bucket, pending = 0.0, []

    def gather(p) -> None:
        nonlocal host, comm_dev, host_work, comm, gathers
        host = max(host, compute, comm_dev)  # torch.cuda.synchronize() in _allgather_param
        host += n * hr / 2  # DeepSpeed: a narrow per rank, then the collective is issued
        c = coll.cost("all_gather", 2.0 * numel[p[1]], ranks)
        comm_dev = max(host, comm_dev) + c
        host += n * hr / 2  # ProcessGroupNCCL: a copy_ per rank out of the flat buffer
        host_work += n * hr
        comm += c
        gathers += 1

    def reduce_bucket() -> None:
        nonlocal host, compute, comm_dev, host_work, comm, bucket, pending
        if not pending:
            return
        if reduce == "allreduce":  # buffered_reduce_fallback: one all-reduce per bucket, compute stream
            c = coll.cost("all_reduce", 2.0 * bucket, ranks)
            compute = max(compute, host) + c
            comm += c
        else:  # contiguous_gradients: a reduce-scatter per parameter on the reduction stream
            host = max(host, comm_dev)  # reduction_stream.synchronize() before the next bucket
            for m in pending:
                host += n * hr
                host_work += n * hr
                c = coll.cost("reduce_scatter", 2.0 * numel[m], ranks)
                comm_dev = max(comm_dev, compute, host) + c
                comm += c
        bucket, pending = 0.0, []

    kernels = 0.0
    for k, e in enumerate(trace):
        p = e[1:]
        st = status.get(p, "missing")
        if st == "missing":
            gather(p)
            status[p], st = "inflight", "inflight"
            inflight.append(p)
            live += numel[e[2]]
        if st == "inflight":
            host = max(host, compute, comm_dev)  # _synchronize_communication
            for q in inflight:
                status[q] = "available"
            inflight = []
        if not inflight and live < MAX_LIVE:  # prefetch_next_sub_modules
            got = 0.0
            for e2 in trace[k + 1:]:
                q = e2[1:]
                if status.get(q, "missing") == "missing":
                    gather(q)
                    status[q] = "inflight"
                    inflight.append(q)
                    live += numel[e2[2]]
                    got += numel[e2[2]]
                    if got >= PREFETCH_BUCKET:
                        break
        c = fwd[e[2]] if e[0] in "fr" else bwd[e[2]]
        compute = max(host, compute) + c
        kernels += c
        j = reuse[k]
        if j is None or prefix[j] - prefix[k + 1] >= MAX_REUSE:  # release_sub_module
            status[p] = "missing"
            live -= numel[e[2]]
        if e[0] == "b":
            if bucket + numel[e[2]] > REDUCE_BUCKET:
                reduce_bucket()
            bucket += numel[e[2]]
            pending.append(e[2])
    reduce_bucket()
    return Replay(max(host, compute, comm_dev), kernels, host_work, comm, gathers)


VARIANTS = (("kernels only", 0.0, "allreduce"), ("+ host, defaults", None, "allreduce"),
            ("+ host, contiguous", None, "reduce_scatter"), ("+ 2x host, defaults", "2x", "allreduce"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="results/validation/published_runs.csv")
    ap.add_argument("--rows", default="^zero3-", help="regular expression over row names (default: the ZeRO-3 rows)")
    a = ap.parse_args()
    try:
        pat = re.compile(a.rows)
    except re.error as exc:
        ap.error(f"--rows: not a regular expression ({exc})")
    rows = [r for r in load_published(a.table) if pat.search(r.name) and r.stack == "deepspeed"]
    if not rows:
        ap.error(f"--rows: no deepspeed row matches {a.rows!r}")
    print("DeepSpeed v0.3.14 ZeRO-3 coordinator replayed; error = replay / published - 1")
    print(f"{'row':24s} {'published s':>11} " + " ".join(f"{v[0]:>20s}" for v in VARIANTS)
          + f" {'kernels s':>9} {'NCCL s':>7} {'host s':>7} {'gathers':>7}")
    fit = []
    for row in rows:
        meas = measured(row)
        cells, base = [], None
        for _, host, red in VARIANTS:
            hr = None if host is None else (2 * ComputeModel(load_cluster(row.hardware, row.gpus)).kernels.launch_s
                                             if host == "2x" else host)
            got = replay(row, hr, red)
            base = base or got
            cells.append(f"{got.step_s:9.1f} ({got.step_s / meas - 1:+6.1%})")
        ref = replay(row)
        fit.append((row, meas, base.compute_s))
        print(f"{row.name:24s} {meas:11.1f} " + " ".join(f"{c:>20s}" for c in cells)
              + f" {ref.compute_s:9.1f} {ref.comm_s:7.1f} {ref.host_s:7.1f} {ref.gathers:7d}")
    print("\nWhat the published times leave for everything but the kernels (published - kernels), against the "
          "bytes each GPU moves\n(3 gathers + 1 reduction of 2-byte parameters, 8 P) and the ranks:")
    for row, meas, kern in fit:
        params = 12 * row.layers * row.hidden ** 2
        print(f"  {row.name:24s} {meas - kern:7.1f} s  {8 * params / 1e12:5.2f} TB  "
              f"{8 * params / (meas - kern) / 1e9:5.1f} GB/s if serial")


if __name__ == "__main__":
    main()

"""The simulator's peak memory per GPU against published runs (results/validation/published_runs.csv).

Every row of the CSV ran, so none may be predicted not to fit; 20 rows (torchtitan's H100 and H200
benchmarks) publish their peak memory, as the caching allocator's `max_reserved` (torchtitan's
device memory monitor). Each row is simulated as a user would describe it: its model shape (llama:
GQA + SwiGLU of the row's ffn; gpt: multi-head attention and the same 8h^2 MLP weights as a gated MLP
of width 8h/3, as simulator/published.py builds it; moe: the row's experts), its layout, data-parallel
mode, micro batch and recomputation, fixed-length text of the row's sequence length, planned by
`homogeneous`, with the memory conventions of its software stack (simulator/memory.py
MEMORY_STACKS, `memory_stack` below): torchtitan -> "torchtitan" (with torch.compile where the
row says so, its loss compiled too in the 2025 runs, its Triton RMSNorm in the April 2024 A100
table); llm-foundry -> "composer" (PyTorch FSDP's fp32 shards, MPT's blocks as Korthikanti counts
them); Megatron-Bridge -> "nemo" (fp32 main gradients; FP8 weights in FP8); Megatron-LM, NeMo 24.07,
DeepSpeed, MegaScale, Llama 3 -> "megatron" (bf16 main gradients, Megatron-LM's default),
"megatron-2021" for the 2019-22 papers' runs (unfused attention; DeepSpeed ZeRO-3 gathering module by
module); "+fp8" where Transformer Engine's FP8 linears ran.

Filled the same way for every row, never per row:
- torchtitan pipelined rows with an unpublished micro batch: torchtitan's default of as many
  microbatches as pipeline stages (config_manager.py at 9dec370: `pipeline_parallel_microbatches`
  defaults to the pp degree), so micro batch = local batch / pp;
- all-gather-KV context parallelism is simulated as ring (same tokens per rank; the gathered K/V of
  one layer is transient and smaller than a block's recomputation).

Rows larger than `--max-gpus` are simulated at fewer data-parallel replicas with the same per-rank
work: the same microbatches per rank and the same sharding degree of the training state (memory per
rank depends on nothing else). Prints one line per row and the summary; `--json` writes the rows.

    python benchmarks/published_memory.py                  # the 20 rows with a published peak
    python benchmarks/published_memory.py --all            # every row: does it fit?
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnibench.specs.model import LLMSpec, MoESpec, MultimodalSpec  # noqa: E402
from omnibench.specs.parallel import ParallelSpec, dp_mode_fields  # noqa: E402

CSV = ROOT / "results" / "validation" / "published_runs.csv"
GiB = 2**30

# Memory of the GPUs the CSV names where no hardware preset exists here (the capacity is all this script
# needs of them): torchtitan's benchmark H100s are "96GB HBM2e" (benchmarks/llama3_h100_202412_torchtitan.md);
# A100 40 GB and V100 32 GB by their datasheets.
CAPACITY_GIB = {"h100-500w": 96.0, "a100-40g": 40.0, "v100-32g": 32.0}
BASE_PRESET = {"h100-500w": "h100", "a100-40g": "a100-80g", "v100-32g": "a100-80g"}
MEMORY_STACK = {"torchtitan": "torchtitan", "fsdp": "composer", "megatron": "megatron", "nemo": "nemo",
                "deepspeed": "megatron", "other": "megatron"}
# NeMo 24.07's performance runs came from the NeMo(-Megatron) launcher, whose performance example
# scripts reduce gradients in bf16 (`+training.model.optim.grad_sync_dtype=bf16`,
# NVIDIA/NeMo-Framework-Launcher examples/training/llama/h100/*.sh): Megatron-LM's bf16 main grads.
# Megatron-Bridge's performance recipes start from bf16_mixed (grad_reduce_in_fp32) and, in FP8,
# keep FP8 weights (fp8_param_gather; scripts/performance/utils/helpers.py at da5a1bee8).
BF16_GRAD_SOURCES = ("nemo-perf",)
# Megatron-LM before flash attention: the 2019-22 papers' runs (and DeepSpeed inside that codebase)
UNFUSED_ATTENTION_SOURCES = ("shoeybi2019", "narayanan2021", "korthikanti2022")


@dataclass
class Row:
    raw: dict

    def __getattr__(self, k):
        return self.raw[k]

    def i(self, k: str, default: int = 1) -> int:
        v = (self.raw.get(k) or "").strip()
        return int(v) if v else default


def model_of(r: Row) -> MultimodalSpec:
    h, layers, heads = r.i("hidden"), r.i("layers"), r.i("heads")
    kv = r.i("kv_heads", heads)
    vocab = r.i("vocab")
    if r.model_kind == "gpt":
        ffn = max(8, round(8 * h / 3 / 8) * 8)
        llm = LLMSpec(name=r.name, layers=layers, hidden=h, heads=heads, kv_heads=heads, ffn=ffn, vocab=vocab,
                      qkv_bias=False, tie_embeddings=True)
    else:
        moe = None
        head_dim = 128 if "head_dim=128" in r.notes else 0
        if r.model_kind == "moe":
            moe = MoESpec(experts=r.i("experts"), top_k=r.i("top_k"), expert_ffn=r.i("expert_ffn"))
        llm = LLMSpec(name=r.name, layers=layers, hidden=h, heads=heads, kv_heads=kv, ffn=r.i("ffn"), vocab=vocab,
                      head_dim=head_dim, qkv_bias=False, moe=moe)
    return MultimodalSpec(name=r.name, llm=llm)


def memory_stack(r: Row) -> str:
    """The memory conventions of the row's software, as its source dates it (one rule per source kind)."""
    stack = MEMORY_STACK.get(r.stack, "megatron")
    if stack == "megatron" and r.source in UNFUSED_ATTENTION_SOURCES:
        stack = "megatron-2021"
    if stack == "nemo" and r.source in BF16_GRAD_SOURCES:
        stack = "megatron"
    if stack == "torchtitan" and "compile" in r.notes + r.table:
        # the torchtitan commit the source names: from May 2025 torch.compile covers the loss too
        stack = "torchtitan-compile-loss" if "2025" in r.table else "torchtitan-compile"
    elif stack == "torchtitan" and "docs/performance.md" in r.table and r.i("hidden") in (4096, 5120):
        # the April 2024 A100 table: its Llama 2 13B and Llama 3 8B configs ran torchtitan's Triton
        # RMSNorm (train_configs at 1ea476e9f, the commit that published the table); the 70B ones did not
        stack = "torchtitan-fused-norm"
    if r.precision == "fp8" and stack in ("megatron", "nemo"):
        stack += "+fp8"  # Transformer Engine's FP8 linears
    return stack


def micro_batch(r: Row) -> int:
    mb = r.i("micro_batch")
    dp = r.i("gpus") // (r.i("tp") * r.i("pp") * r.i("cp"))
    local = r.i("global_batch") // dp
    if r.stack == "torchtitan" and r.i("pp") > 1 and "micro_batch" in r.notes.split("unpublished:")[-1]:
        mb = max(1, local // r.i("pp"))
    return mb


def simulate_row(r: Row, max_gpus: int) -> dict:
    from simulator.engine import Engine, SimOptions
    from simulator.hardware import load_cluster
    from systems import get_planner
    from workloads.sample import Batch, Sample, Segment

    gpus, tp, pp, cp = r.i("gpus"), r.i("tp"), r.i("pp"), r.i("cp")
    dp = gpus // (tp * pp * cp)
    mb = micro_batch(r)
    per_rank = r.i("global_batch") // dp // mb  # microbatches per data rank
    mode = r.dp_mode or "ddp"
    shard = dp * cp  # the data-parallel group the state is sharded over (experts: / ep)
    sim_dp = dp
    while sim_dp * tp * pp * cp > max_gpus and sim_dp % 2 == 0 and sim_dp > 2:
        sim_dp //= 2
    world = sim_dp * tp * pp * cp
    model = model_of(r)
    seq = r.i("seq")
    fields = dp_mode_fields(mode)
    fields["dp_shard"] = -1
    parallel = ParallelSpec(world_size=world, dp=sim_dp, tp=tp, pp=pp, cp=cp, ep=r.i("ep"),
                            cp_kind="ulysses" if cp == 1 else "ring", virtual_stages=r.i("vpp"),
                            microbatches=per_rank, recompute=r.recompute or "none", **fields)
    parallel.validate(model)
    batch = Batch(0, [Sample(i, "t", (Segment("text", seq),)) for i in range(sim_dp * per_rank * mb)])
    plan = get_planner("homogeneous").plan(model, parallel, batch)
    hw = BASE_PRESET.get(r.hardware, r.hardware)
    cluster = load_cluster(hw, world)
    if r.hardware in CAPACITY_GIB:
        cluster = replace(cluster, gpu=replace(cluster.gpu, memory_gib=CAPACITY_GIB[r.hardware]))
    stack = memory_stack(r)

    class RowEngine(Engine):
        def _dp_mode(self, module, rank):  # the row's sharding degree at fewer simulated replicas
            m, n = super()._dp_mode(module, rank)
            return (m, n * shard // (sim_dp * cp)) if n > 1 else (m, n)

    fields = dict(recompute=r.recompute or "none", check_memory=False, stack="fused", communication=False)
    if "memory_stack" in SimOptions.__dataclass_fields__:  # (absent before the per-stack memory model)
        fields["memory_stack"] = stack
    opts = SimOptions(**fields)
    res = RowEngine(plan, model, cluster, options=opts).run()
    worst = max(res.ranks, key=lambda s: s.memory_bytes)
    cap = cluster.gpu.memory_bytes
    return {"peak_gib": worst.memory_bytes / GiB,
            "reserved_gib": getattr(worst, "memory_reserved", worst.memory_bytes - 2**30) / GiB,
            "capacity_gib": cap / GiB, "fits": worst.memory_bytes <= cap, "sim_gpus": world, "micro_batch": mb,
            "stack": stack, "peak_rank": worst.rank, "peak_at": getattr(worst, "memory_peak_at", ""),
            "static_gib": worst.memory_static / GiB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(CSV))
    ap.add_argument("--all", action="store_true", help="every row (does it fit?), not only published peaks")
    ap.add_argument("--max-gpus", type=int, default=1024)
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--json", default="")
    ap.add_argument("--explain", action="store_true", help="the peak rank, its static bytes, the action at the peak")
    args = ap.parse_args(argv)
    rows = [Row(x) for x in csv.DictReader(open(args.csv))]
    if not args.all:
        rows = [r for r in rows if r.peak_memory_gib]
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r.name in keep]
    out = []
    for r in rows:
        t0 = time.perf_counter()
        try:
            got = simulate_row(r, args.max_gpus)
        except Exception as e:  # a row the planner or simulator cannot express: reported, not hidden
            got = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        got.update(name=r.name, split=r.split, published_gib=float(r.peak_memory_gib) if r.peak_memory_gib else None,
                   seconds=time.perf_counter() - t0)
        out.append(got)
        if "error" in got:
            print(f"{r.name:40s} {r.split:11s} not simulated: {got['error']}", flush=True)
            continue
        pub = got["published_gib"]
        err = f"{(got['peak_gib'] - pub) / pub:+6.1%}" if pub else "      "
        print(f"{r.name:40s} {r.split:11s} {got['stack']:10s} mb {got['micro_batch']:2d} est {got['peak_gib']:6.1f} GiB"
              f" (reserved {got['reserved_gib']:5.1f}) published {pub or float('nan'):5.1f} {err}"
              f" of {got['capacity_gib']:5.0f} {'fits' if got['fits'] else 'DOES NOT FIT'} [{got['seconds']:.0f} s]"
              + (f" rank {got['peak_rank']} static {got['static_gib']:.1f} at {got['peak_at']}" if args.explain else ""),
              flush=True)
    done = [g for g in out if "error" not in g]
    with_pub = [g for g in done if g["published_gib"]]
    for split in ("calibration", "heldout"):
        errs = [(g["reserved_gib"] - g["published_gib"]) / g["published_gib"] for g in with_pub if g["split"] == split]
        if errs:
            print(f"{split}: {len(errs)} rows with a published peak, mean |error| of the reserved estimate "
                  f"{sum(abs(e) for e in errs) / len(errs):.1%}, worst {max(errs, key=abs):+.1%}")
    cal = [g for g in with_pub if g["split"] == "calibration"]
    if cal:
        import math

        from simulator import memory

        FRAGMENTATION = getattr(memory, "FRAGMENTATION", 1.0)

        # reserved / allocated that best fits the calibration rows (geometric mean of published / allocated)
        k = math.exp(sum(math.log(g["published_gib"] / (g["reserved_gib"] / FRAGMENTATION)) for g in cal) / len(cal))
        print(f"fragmentation fitted on the {len(cal)} calibration rows: {k:.3f} (simulator/memory.py uses "
              f"{FRAGMENTATION})")
    print(f"predicted not to fit: {sum(not g['fits'] for g in done)} of {len(done)} simulated rows; "
          f"not simulated: {len(out) - len(done)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

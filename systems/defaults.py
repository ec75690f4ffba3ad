"""Each system's default layout: the one its public anchor usually runs, not one shared default.

`run`, `plan`, `simulate` and `tune` (its starting point) use it when the user gives none of
--tp / --pp / --cp; any of them given, the others are 1 (explicit flags override defaults).

- homogeneous, colocated, noncolocated, omni: Megatron-LM's LLM layout. homogeneous stands for
  Megatron-LM's LLaVA training, colocated and noncolocated for Megatron MIMO and DistTrain (both
  built on Megatron's LLM parallelism), omni for MegaScale-Omni (a 5D Megatron-style LLM layout
  whose encoders take a layout of their own). Tensor parallelism inside a node, leaving at least
  two data-parallel replicas (`megatron_tp`), pipeline stages only where the model's state does
  not fit without them (`megatron_pp`), no cp.
  The encoders keep each system's own default (homogeneous: the LLM's tp; the others: tp 1).
- temporal: VeOmni's. tp 1 and pp 1, every module FSDP-sharded over all ranks, and one Ulysses
  degree for encoders and LLM (`ulysses_sp`) sized for the workload's longest sequence.
- spatial: temporal's, since it multiplexes temporal's layout in space (systems/spatial.py); two
  microbatches when none are given.

No torch here; a default that does not plan for the given world size, model and batch falls back
to tp 1 / pp 1 / cp 1 with a note saying why (`with_default_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from omnibench.plan import PlanError
from omnibench.specs.model import MultimodalSpec, SpecError
from omnibench.specs.parallel import ParallelSpec
from workloads.sample import Batch, Sample

MEGATRON_SYSTEMS = ("homogeneous", "colocated", "noncolocated", "omni")
MAX_TP = 8  # Megatron keeps tp inside one NVLink domain; 8 GPUs on every node preset here
DEVICE_BYTES = 85_017_493_504  # an H100 80GB as torch reports it (simulator/data/hardware/h100.toml), when the caller knows no device
# Megatron's distributed optimizer: bf16 weights and fp32 main gradients on every rank of the model
# slice, fp32 master weights and Adam's two moments sharded over the data-parallel ranks.
UNSHARDED_BYTES_PER_PARAM = 2 + 4
SHARDED_BYTES_PER_PARAM = 12
STATE_SHARE = 0.5  # of device memory the model state may take (the rest: activations, buffers)


@dataclass(frozen=True)
class DefaultLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    why: str = ""

    def label(self) -> str:
        return f"tp {self.tp}, pp {self.pp}, cp {self.cp}"


def _divides_heads(model: MultimodalSpec, k: int, encoders: bool = False) -> bool:
    llm = model.llm
    ok = llm.heads % k == 0 and llm.kv_heads % k == 0
    return ok and (not encoders or all(e.heads % k == 0 for e in model.encoders.values()))


def megatron_tp(model: MultimodalSpec, world: int, gpus_per_node: int) -> int:
    """The largest tp that stays inside a node (at most MAX_TP) and divides the LLM's heads, kv heads
    and the ranks: Megatron-LM's usual choice (e.g. Qwen2-7B's 28 / 4 heads: tp 4). Capped at half
    the ranks, so at least two data-parallel replicas remain (what the workload's batches are
    balanced over; a 2-rank CPU run keeps tp 1)."""
    cap = min(MAX_TP, gpus_per_node, max(1, world // 2))
    return max(t for t in range(1, cap + 1) if world % t == 0 and _divides_heads(model, t))


def megatron_pp(model: MultimodalSpec, world: int, tp: int, memory_bytes: float = DEVICE_BYTES) -> int:
    """The fewest pipeline stages (a power of two, at most the LLM's depth, dividing world / tp) with
    which one rank's model state fits STATE_SHARE of the device under Megatron's distributed
    optimizer (UNSHARDED_BYTES_PER_PARAM of its slice plus SHARDED_BYTES_PER_PARAM over dp)."""
    from omnibench.specs import costs

    params = costs.model_params(model)["total"]
    pp, best = 1, 1
    while pp <= model.llm.layers and world % (tp * pp) == 0:
        dp = world // (tp * pp)
        state = params / (tp * pp) * (UNSHARDED_BYTES_PER_PARAM + SHARDED_BYTES_PER_PARAM / dp)
        best = pp
        if state <= STATE_SHARE * memory_bytes:
            return pp
        pp *= 2
    return best


def ulysses_sp(model: MultimodalSpec, world: int, gpus_per_node: int, samples: Sequence[Sample]) -> tuple[int, str]:
    """VeOmni's `ulysses_parallel_size` for a workload: the smallest degree k that splits the longest
    sample's LLM tokens into at most one rank's even share of the batch (total tokens / ranks), among
    those that divide the LLM's heads and kv heads and every encoder's heads (Ulysses splits heads;
    encoders and LLM share the degree), the ranks, and a node (the all-to-alls run every layer).
    1 when no sample is longer than the share; the largest allowed k when none is enough."""
    if not samples:
        return 1, "no batch to size it for"
    longest = max(s.llm_tokens for s in samples)
    share = sum(s.llm_tokens for s in samples) / world
    allowed = [k for k in range(1, min(gpus_per_node, world) + 1)
               if world % k == 0 and _divides_heads(model, k, encoders=True)]
    for k in allowed:
        if longest / k <= share:
            return k, f"longest sample {longest} tokens / sp {k} <= {share:.0f} tokens per rank"
    k = allowed[-1]
    return k, f"longest sample {longest} tokens over {share:.0f} per rank; sp {k} is the most the heads and a node allow"


def default_layout(system: str, model: MultimodalSpec, world: int, gpus_per_node: int = 8,
                   samples: Sequence[Sample] = (), memory_bytes: float = DEVICE_BYTES) -> DefaultLayout:
    """The layout `system`'s anchor would run on `world` ranks (module docstring)."""
    if system in ("temporal", "spatial"):  # spatial runs temporal's layout, its modules side by side
        sp, why = ulysses_sp(model, world, gpus_per_node, samples)
        return DefaultLayout(1, 1, sp, f"VeOmni-style, FSDP over all ranks, Ulysses sp {sp} for encoders and "
                                       f"LLM: {why}")
    if system in MEGATRON_SYSTEMS:
        tp = megatron_tp(model, world, gpus_per_node)
        pp = megatron_pp(model, world, tp, memory_bytes)
        need = "no pp needed" if pp == 1 else f"pp {pp} for the model state to fit {STATE_SHARE:.0%} of a GPU"
        return DefaultLayout(tp, pp, 1, f"Megatron-style, tp {tp} inside a node, {need}")
    return DefaultLayout(why="no anchor layout known: tp 1, pp 1, cp 1")


def with_default_layout(system: str, model: MultimodalSpec, parallel: ParallelSpec, batch: Batch,
                        memory_bytes: float = DEVICE_BYTES, check=None) -> tuple[ParallelSpec, str]:
    """`parallel` with `system`'s default tp / pp / cp, checked by planning `batch` (and by `check`,
    e.g. the runtime's limits). Where that fails, the same with tp halved until it plans, else
    tp 1 / pp 1 / cp 1 (whose own error, if any, is the planner's to raise later), with a note why."""
    from systems import get_planner, offer_plan

    d = default_layout(system, model, parallel.world_size, parallel.gpus_per_node, batch.samples, memory_bytes)
    tries = [(d.tp, d.pp, d.cp)]
    tp = d.tp
    while tp > 1:
        tp //= 2
        tries.append((tp, d.pp, d.cp))
    tries.append((1, 1, 1))
    first_error = ""
    for tp, pp, cp in dict.fromkeys(tries):
        cand = replace(parallel, tp=tp, pp=pp, cp=cp)
        try:
            cand.validate(model)
            if check is not None:
                check(model, cand)
            planner = get_planner(system)
            plan = planner.plan(model, cand, batch)
        except (SpecError, PlanError, ValueError) as e:
            first_error = first_error or str(e).splitlines()[0]
            continue
        offer_plan(planner, model, cand, batch, plan)  # the caller's own plan of this step is then this one
        if (tp, pp, cp) == (d.tp, d.pp, d.cp):
            return cand, f"{system}'s default: {d.why}"
        return cand, (f"{system}'s default layout ({d.label()}) does not plan here ({first_error}); "
                      f"fell back to tp {tp}, pp {pp}, cp {cp}")
    return replace(parallel, tp=1, pp=1, cp=1), f"{system}: no layout plans here ({first_error})"

"""omni's switches, read once from `ParallelSpec.options` (CLI: --no-joint-pipeline, --no-reorder,
--no-reshard, --no-long-short-sp, --no-llm-long-short, --option key=value) and validated here."""

from __future__ import annotations

from dataclasses import dataclass, fields

from omnibench.plan import PlanError
from omnibench.specs.parallel import DP_MODES
from systems.common import BALANCERS, DEFAULT_BALANCER  # how every system weighs samples in a split

BOOL_KEYS = ("joint_pipeline", "reorder", "reshard", "long_short_sp", "llm_long_short")
SP_SCHEMES = ("auto", "long_short", "all", "none")
# Where the loaders' shards come from (reorder.py): sampler, a distributed sampler's round robin (which the
# grouped reorder then rebalances, when on); global, the split homogeneous and temporal make of the same batch
# (systems/common.py `balance` by the balancer's LLM-plus-encoder cost), what a coordinator that sees every
# sample would hand out: the baselines' loading, for an ablation that isolates what decoupling itself buys
LOADINGS = ("sampler", "global")
LLM_SPLIT_RULES = ("auto", "always")
# The encoders' state modes: the data-parallel modes' ParallelSpec fields, and hzero2, ZeRO-2 sharded
# within the automatic shard group of a few nodes and replicated across the groups (layout.py)
ENCODER_STATE_MODES = {**DP_MODES, "hzero2": dict(fsdp=False, zero=2, dp_shard=0)}
CHOICES = {"encoder_dp": tuple(ENCODER_STATE_MODES), "encoder_sp_scheme": SP_SCHEMES, "llm_split": LLM_SPLIT_RULES,
           "balancer": BALANCERS, "loading": LOADINGS}


@dataclass(frozen=True)
class OmniOptions:
    joint_pipeline: bool = True  # encoder fwd/bwd inside the LLM pipeline's bubbles
    reorder: bool = True  # decentralized grouped reordering in the data loaders
    reshard: bool = True  # adaptive resharding of encoder outputs to LLM data ranks
    long_short_sp: bool = True  # long inputs split over an encoder sequence-parallel group
    llm_long_short: bool = True  # long LLM samples over a context-parallel group of data ranks (any pp, cp)
    reorder_group: int = 8  # loader ranks exchanging cost metadata together (no global coordinator)
    # The loaders' starting shards (LOADINGS). global replaces the grouped reorder, so it needs reorder off
    loading: str = "sampler"
    # How each encoder's data parallelism holds its training state (omnibench.specs.parallel.DP_MODES):
    # zero2 (default) / zero1 shard the optimizer state (and the gradients) but keep whole weights, so an
    # encoder's forward never waits for a peer and the joint pipeline can put it in any bubble; ddp
    # replicates everything; fsdp / hsdp shard the weights too, which locks every rank's encoder calls to
    # every other rank's (the joint pipeline then runs encoder work all ahead, in the same order on every rank);
    # hzero2 is ZeRO-2 within shard groups of a few nodes, replicated across them (whole weights, so no lock;
    # rings of tens of ranks instead of the whole world).
    encoder_dp: str = "zero2"
    # Which encoder samples run sequence-parallel (long_short.py): auto (chosen per batch and encoder from
    # the step's costs), long_short (only those above the balanced per-rank share), all (every sample, packed
    # per group: VeOmni's scheme), none.
    encoder_sp_scheme: str = "auto"
    # When the LLM long-short split acts (llm_long_short on): auto (per batch, where the planner's estimated
    # step is shorter with it than without: systems/omni/__init__.py SPLIT_MARGIN), always (every sample
    # above the balanced share, whatever the estimate: tests at tiny sizes, where latency outweighs the work)
    llm_split: str = "auto"
    # How samples are weighed when a batch is split (every system reads it; systems/common.py BALANCERS):
    # analytic (every system's default) prices them by exact FLOPs at one nominal rate, scaled to the
    # hardware's speed; simulator by the simulator's own compute model of the hardware (or `calibration`'s
    # profile): an oracle; tokens (the baselines' anchors) is refused by omni, which compares seconds
    balancer: str = DEFAULT_BALANCER
    calibration: str = ""  # calibration profile (omnibench calibrate) for the cost model
    # Without a profile: the simulator's compute model for this hardware preset, so omni decides with
    # the costs the simulator will charge (`simulate` and `tune` pass their --hardware); "": costs.py
    # FLOPs at a nominal 1 TFLOP/s (relative costs only; the CPU runs' default).
    hardware: str = ""

    @staticmethod
    def parse(raw: dict) -> OmniOptions:
        from systems import foreign_option_keys

        known = {f.name for f in fields(OmniOptions)}
        foreign = foreign_option_keys("omni")
        out = {}
        for key, value in (raw or {}).items():
            k = key.replace("-", "_")
            if k in foreign:
                continue  # another system's switch (`--option` names every system's)
            if k not in known:
                raise PlanError(f"options.{key}: unknown option; allowed: {', '.join(sorted(known))} (omni), "
                                + ", ".join(f"{k} ({s})" for k, s in sorted(foreign.items())))
            if k in BOOL_KEYS:
                value = _bool(key, value)
            elif k == "reorder_group":
                try:
                    value = int(value)
                except (TypeError, ValueError):
                    raise PlanError(f"options.reorder_group must be a positive integer, got {value!r}") from None
                if value < 1:
                    raise PlanError(f"options.reorder_group must be a positive integer, got {value!r}")
            elif k in CHOICES:
                value = str(value).strip().lower().replace("-", "_")
                if value not in CHOICES[k]:
                    raise PlanError(f"options.{key} must be one of {', '.join(CHOICES[k])}; got {value!r}")
            else:
                value = str(value)
            out[k] = value
        if out.get("loading") == "global" and out.get("reorder", True):
            # refused rather than switched off here: a record's options then say what its plan did
            raise PlanError("options.loading=global splits the whole batch before any loader reorders: give "
                            "reorder=false (--no-reorder) with it")
        return OmniOptions(**out)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _bool(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise PlanError(f"options.{key} must be one of true, false; got {value!r}")


def options_from_flags(no_joint_pipeline: bool = False, no_reorder: bool = False, no_reshard: bool = False,
                       no_long_short_sp: bool = False, option: list[str] | None = None,
                       no_llm_long_short: bool = False) -> dict:
    """ParallelSpec.options from the CLI's ablation flags and repeatable `--option key=value`."""
    out: dict = {}
    for item in option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PlanError(f"--option must look like key=value, got {item!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    for flag, key in ((no_joint_pipeline, "joint_pipeline"), (no_reorder, "reorder"), (no_reshard, "reshard"),
                      (no_long_short_sp, "long_short_sp"), (no_llm_long_short, "llm_long_short")):
        if flag:
            out[key] = False
    return out

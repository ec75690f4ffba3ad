"""Hardware and network presets as data: a GPU, a node of N GPUs joined by NVLink, nodes joined by a
rail-optimised or fat-tree network.

Presets live in `simulator/data/hardware/<name>.toml`; a user cluster is a TOML or YAML file with
the same fields (a new GPU is new data, not new code). Units in files are the datasheet's (TFLOP/s,
GiB, GB/s, microseconds); inside the simulator everything is SI (FLOP/s, bytes, B/s, seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import tomllib
import yaml

DATA_DIR = Path(__file__).parent / "data" / "hardware"
TOPOLOGIES = ("rail-optimised", "fat-tree")
COLLECTIVE_MODELS = ("nccl", "simple")
GiB = 1024**3

# The largest value of each number a hardware file holds: each far above any machine built or announced
# (so every real one passes) and low enough that the simulator's times and bytes stay finite (1e308
# TFLOP/s is inf FLOP/s once in SI units).
MAX_CLUSTER_GPUS = 1 << 20  # as `--gpus` (omnibench/cli/common.py MAX_GPUS): far beyond any cluster built
MAX_NODE_GPUS = 4096  # GPUs joined by one NVLink domain: 8 (HGX), 72 (GB200 NVL72), 576 announced
MAX_NICS = 4 * MAX_NODE_GPUS  # one NIC per GPU is the rule
MAX_TFLOPS = 1_000_000  # dense bf16 per GPU: 989 (H100), 2,250 (B200)
MAX_MEMORY_GIB = 65_536  # per GPU: 80 (H100), 288 GB (B300)
MAX_BANDWIDTH_GBS = 1_000_000  # HBM 8,000 (B200), NVLink 900 per direction, a NIC 50-100
MAX_HALF_GFLOP = 1_000_000  # the efficiency curve's half point: 0.6 GFLOP (H100)
MAX_KERNEL_SCALE = 1000  # a variant's rate over the profiled GPU's: 0.7 to 2.5 in the presets
MAX_LATENCY_US = 1_000_000  # one second; links take 1 to 100 us
MAX_OVERSUBSCRIPTION = 1024  # fat-tree cores: 1 (full bisection) to 4
# The slowest rate (TFLOP/s, GB/s) a file may give: a MFLOP/s or a kB/s, below any device (the CPU preset
# has 0.05 TFLOP/s and 10 GB/s); slower ones make steps of 1e300 seconds, shown as 0 tokens/s.
MIN_RATE = 1e-6


class HardwareError(ValueError):
    """A hardware/cluster field holds an impossible value; the message names the field."""


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_tflops: float  # dense bf16
    memory_gib: float
    memory_bandwidth_gbs: float
    # Default compute efficiency curve eff(F) = matmul_efficiency * F / (F + matmul_half_gflop), F the
    # FLOPs of one op in GFLOP. Defaults: about 800 of 989 TFLOP/s for a large H100 matmul (794.5
    # TFLOP/s bf16, 80.3%: the maximum achievable matmul FLOPS table in S. Bekman's Machine Learning
    # Engineering, github.com/stas00/ml-engineering, compute/accelerator), and Calculon's fall-off for
    # small ops (0.95/0.9/0.6 at 128/16/1 GFLOP: the matrix efficiency table of its system files,
    # github.com/calculon-ai/calculon systems/h100_80g_nvl8.json; taken here relative to the large-op
    # rate, which this curve meets within 3% with a 0.6 GFLOP half point).
    matmul_efficiency: float = 0.81
    matmul_half_gflop: float = 0.6
    attention_efficiency: float = 0.55  # flash attention reaches less of peak than a GEMM
    memory_efficiency: float = 0.85
    # A variant of the GPU its kernel profile was measured on (simulator/kernels.py): the profile's
    # GEMM and attention rates times `kernel_compute_scale` (clocks held under a power cap), its
    # element-wise bandwidth times `kernel_memory_scale` (another HBM: this preset's bandwidth over
    # the profiled device's). 1.0: the profiled GPU itself.
    kernel_compute_scale: float = 1.0
    kernel_memory_scale: float = 1.0

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    @property
    def memory_bandwidth(self) -> float:
        return self.memory_bandwidth_gbs * 1e9


@dataclass(frozen=True)
class LinkSpec:
    """One class of link: NVLink inside a node (`intra`) or the NIC network between nodes (`inter`)."""

    bandwidth_gbs: float  # per GPU, per direction
    latency_us: float
    efficiency: float = 1.0  # fraction of the link rate a large collective reaches
    nics_per_node: int = 0  # inter only
    topology: str = "rail-optimised"  # inter only
    oversubscription: float = 1.0  # fat-tree: core oversubscription (1.0 = full bisection)
    # intra only: bus bandwidth of NCCL's NVLink SHARP (NVLS) all-reduce inside a node, GB/s
    # (NVSwitch reduces in the switch); 0 = the node has no NVLS
    nvls_busbw_gbs: float = 0.0

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.efficiency

    @property
    def latency(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpu: GPUSpec
    gpus_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    num_gpus: int = 0  # 0: not sized yet (a preset); `with_gpus` sizes it
    description: str = ""
    # Kernel profile (simulator/kernels.py): a name in simulator/data/kernels/ or a .json path
    # (relative paths from the repository root). "": none, compute falls back to the datasheet curve.
    kernels: str = ""
    # "nccl": NCCL's algorithms and protocols (simulator/collectives.py); "simple": one latency per
    # step plus bytes over bandwidth (gloo on CPU, whose figures calibration fits)
    collectives: str = "nccl"
    # A rack-scale NVLink domain (GB200 NVL72: gpus_per_node = 72) allocated in trays of this many
    # GPUs: a job larger than one domain is placed in equal segments of whole trays, the largest
    # divisor of its tray count that fits a domain (Slurm's --segment, as Megatron-Bridge's launcher
    # asks for it), so `with_gpus` makes the segment the node. 0: nodes are filled in order.
    tray_gpus: int = 0

    def with_kernels(self, kernels: str) -> ClusterSpec:
        """The same cluster with another kernel profile ("" = the datasheet roofline fallback)."""
        if kernels:
            from simulator.kernels import load_kernel_profile

            try:
                load_kernel_profile(kernels, self.gpu.peak_flops)
            except ValueError as e:
                raise HardwareError(f"kernels: {e}") from None
        return replace(self, kernels=kernels)

    def with_gpus(self, num_gpus: int) -> ClusterSpec:
        if not isinstance(num_gpus, int) or num_gpus < 1:
            raise HardwareError(f"gpus must be a positive integer, got {num_gpus!r}")
        if self.tray_gpus and num_gpus > self.gpus_per_node:
            # segments of whole trays: 256 GPUs of GB200 NVL72 = 64 trays = 4 domains of 16 trays (64 GPUs)
            trays = -(-num_gpus // self.tray_gpus)
            per_domain = self.gpus_per_node // self.tray_gpus
            segment = max(d for d in range(1, per_domain + 1) if trays % d == 0) * self.tray_gpus
            nics = max(1, round(self.inter.nics_per_node * segment / self.gpus_per_node))  # NICs stay per GPU
            return replace(self, num_gpus=num_gpus, gpus_per_node=segment,
                           inter=replace(self.inter, nics_per_node=nics))
        return replace(self, num_gpus=num_gpus)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def validate(self) -> None:
        """Every number finite and in range (a NaN passes `v <= 0`, so finiteness is checked first)."""
        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def bound(v) -> str:
            return f"{v:,}" if isinstance(v, int) else f"{v:g}"

        def pos(where: str, v, top: int, integer: bool = False) -> None:
            ok = isinstance(v, int) and not isinstance(v, bool) if integer else number(v)
            if not ok or not 0 < v <= top:
                kind, low = ("a positive integer", "[1") if integer else ("a positive finite number", "(0")
                raise HardwareError(f"{where} must be {kind} in {low}, {bound(top)}], got {v!r}")

        def rate(where: str, v, top: int) -> None:
            if not number(v) or not MIN_RATE <= v <= top:
                raise HardwareError(f"{where} must be a positive finite number in [{bound(MIN_RATE)}, {bound(top)}], "
                                    f"got {v!r}")

        for where, v in (("name", self.name), ("description", self.description), ("gpu.name", self.gpu.name)):
            if not isinstance(v, str):
                raise HardwareError(f"{where} must be a string, got {v!r}")

        def share(where: str, v) -> None:
            if not number(v) or not 0 < v <= 1:
                raise HardwareError(f"{where} must be in (0, 1], got {v!r}")

        def between(where: str, v, low: float, top: int) -> None:
            if not number(v) or not low <= v <= top:
                raise HardwareError(f"{where} must be a finite number in [{bound(low)}, {bound(top)}], got {v!r}")

        pos("gpus_per_node", self.gpus_per_node, MAX_NODE_GPUS, integer=True)
        if (not isinstance(self.num_gpus, int) or isinstance(self.num_gpus, bool)
                or not 0 <= self.num_gpus <= MAX_CLUSTER_GPUS):
            raise HardwareError(f"num_gpus must be 0 (sized later) or a positive integer at most {MAX_CLUSTER_GPUS:,}, "
                                f"got {self.num_gpus!r}")
        rate("gpu.peak_tflops", self.gpu.peak_tflops, MAX_TFLOPS)
        pos("gpu.memory_gib", self.gpu.memory_gib, MAX_MEMORY_GIB)
        rate("gpu.memory_bandwidth_gbs", self.gpu.memory_bandwidth_gbs, MAX_BANDWIDTH_GBS)
        pos("gpu.matmul_half_gflop", self.gpu.matmul_half_gflop, MAX_HALF_GFLOP)
        for f in ("kernel_compute_scale", "kernel_memory_scale"):
            pos(f"gpu.{f}", getattr(self.gpu, f), MAX_KERNEL_SCALE)

        for f in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
            share(f"gpu.{f}", getattr(self.gpu, f))
        for where, link in (("intra", self.intra), ("inter", self.inter)):
            rate(f"{where}.bandwidth_gbs", link.bandwidth_gbs, MAX_BANDWIDTH_GBS)
            between(f"{where}.latency_us", link.latency_us, 0, MAX_LATENCY_US)
            share(f"{where}.efficiency", link.efficiency)
        pos("inter.nics_per_node", self.inter.nics_per_node, MAX_NICS, integer=True)
        if self.tray_gpus and (not isinstance(self.tray_gpus, int) or isinstance(self.tray_gpus, bool)
                               or self.tray_gpus < 0 or self.gpus_per_node % self.tray_gpus):
            raise HardwareError(f"tray_gpus must be 0 or a positive divisor of gpus_per_node "
                                f"({self.gpus_per_node}), got {self.tray_gpus!r}")
        if self.collectives not in COLLECTIVE_MODELS:
            raise HardwareError(f"collectives must be one of {', '.join(COLLECTIVE_MODELS)}; got {self.collectives!r}")
        between("intra.nvls_busbw_gbs", self.intra.nvls_busbw_gbs, 0, MAX_BANDWIDTH_GBS)
        if self.inter.topology not in TOPOLOGIES:
            raise HardwareError(f"inter.topology must be one of {', '.join(TOPOLOGIES)}; got {self.inter.topology!r}")
        between("inter.oversubscription", self.inter.oversubscription, 1, MAX_OVERSUBSCRIPTION)


def available_presets() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.toml"))


FITTED_PREFIX = "fitted:"  # a field's value read from simulator/fitted.py, by name


def _fitted_value(where: str, value):
    """`value`, or the fitted constant it names (`"fitted:NAME"`: simulator/fitted.py)."""
    if isinstance(value, str) and value.startswith(FITTED_PREFIX):
        from simulator.fitted import FITTED

        name = value.removeprefix(FITTED_PREFIX)
        if name not in FITTED:
            raise HardwareError(f"{where} = {value!r} names no fitted constant; known: {', '.join(FITTED)}")
        return FITTED[name].value
    return value


def _build(data: dict, where: str) -> ClusterSpec:
    if not isinstance(data, dict):
        raise HardwareError(f"{where}: expected a table of cluster fields")
    top = {f.name for f in fields(ClusterSpec)} - {"gpu", "intra", "inter"}
    sections = {"gpu": GPUSpec, "intra": LinkSpec, "inter": LinkSpec}
    for key in data:
        if key not in top and key not in sections:
            allowed = ", ".join(sorted(top | set(sections)))
            raise HardwareError(f"{where}: unknown field {key!r}; allowed: {allowed}")
    parts = {}
    for sec, cls in sections.items():
        body = data.get(sec)
        if not isinstance(body, dict):
            raise HardwareError(f"{where}: missing section [{sec}]")
        names = {f.name for f in fields(cls)}
        for key in body:
            if key not in names:
                raise HardwareError(f"{where}: unknown field {sec}.{key}; allowed: {', '.join(sorted(names))}")
        if sec == "gpu" and "name" not in body:
            body = {**body, "name": str(data.get("name", "gpu"))}
        body = {key: _fitted_value(f"{where}: {sec}.{key}", v) for key, v in body.items()}
        try:
            parts[sec] = cls(**body)
        except TypeError as e:  # a required field is missing
            missing = str(e).split("argument")[-1].strip(": '")
            raise HardwareError(f"{where}: missing field {sec}.{missing}") from None
    kwargs = {k: data[k] for k in top if k in data}
    kwargs.setdefault("name", Path(where).stem)
    if "gpus_per_node" not in kwargs:
        raise HardwareError(f"{where}: missing field gpus_per_node")
    cluster = ClusterSpec(gpu=parts["gpu"], intra=parts["intra"], inter=parts["inter"], **kwargs)
    try:
        cluster.validate()
        if not isinstance(cluster.kernels, str):
            raise HardwareError(f"kernels must be a profile name or a .json path, got {cluster.kernels!r}")
        if cluster.kernels:
            cluster = cluster.with_kernels(cluster.kernels)
    except HardwareError as e:
        raise HardwareError(f"{where}: {e}") from None
    return cluster


def load_cluster(name_or_path: str, num_gpus: int | None = None) -> ClusterSpec:
    """A preset name (`h100`, `h200`, `a100-80g`, `cpu-gloo`) or a TOML/YAML file of the same fields."""
    path = Path(name_or_path)
    if path.suffix in (".toml", ".yaml", ".yml", ".json"):
        if path.is_dir():
            raise HardwareError(f"hardware: {name_or_path!r} is a folder, not a hardware file")
        if path.exists() and not path.is_file():
            raise HardwareError(f"hardware: {name_or_path!r} is not a regular file")
        if not path.is_file():
            raise HardwareError(f"hardware: no such file {name_or_path!r}")
    else:
        path = DATA_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise HardwareError(
                f"hardware must be one of {', '.join(available_presets())} or a .toml/.yaml file; got {name_or_path!r}"
            )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise HardwareError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise HardwareError(f"{path}: cannot read: not text (not UTF-8)") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise HardwareError(f"{path}: cannot parse: {str(e).splitlines()[0]}") from None
    except RecursionError:
        # the parsers recurse once per nested table or list
        raise HardwareError(f"{path}: cannot parse: nested too deeply") from None
    cluster = _build(data, str(path))
    return cluster.with_gpus(num_gpus) if num_gpus is not None else cluster

"""Named software stacks: what a training framework runs, as simulation options.

`omnibench simulate --stack NAME` picks one; the mechanism flags (`--sequence-parallel`,
`--overlap-grad-reduce`, `--overlap-param-gather`, `--tp-overlap`, `--attention`,
`--grad-reduce-dtype`, `--fp8`, `--ep-dispatcher`) each set one mechanism over it, under the names
Megatron-LM gives them. A published run is simulated through exactly this: its software column holds
these flags (simulator/published.py), never a rule keyed by who published it.

Each stack is read off its framework's code and documents (results/validation/README.md, "How a row is
modelled", the software table):

- eager: this project's runtime (omnibench/runtime): PyTorch modules op by op under autocast.
- fused: the same runtime's layouts costed with Megatron-LM's fused kernels (`simulator/kernels.py`).
- megatron-2021: Megatron-LM of 2019-22 (Shoeybi et al., Narayanan et al., Korthikanti et al.): fused
  kernels, attention through s x s score matrices in HBM (no flash attention), DP all-reduce after the
  backward, pipeline sends scattered over the tp ranks (Narayanan et al. SC'21 sec. 4.1).
- megatron-core: Megatron-Core with Transformer Engine (2024-25): flash attention, sequence parallelism,
  the distributed optimizer's gradient reduce-scatter and parameter all-gather overlapped.
- nemo: NeMo 2 / Megatron-Bridge recipes: megatron-core plus TP communication overlap (userbuffers),
  FP8 weights kept in FP8 in FP8 recipes (fp8_param_gather).
- megatron-flash: a Megatron-derived stack with sequence parallelism and flash attention, nothing
  overlapped unless the flags say so (a Megatron-derived in-house stack whose overlaps its users state).
- torchtitan: PyTorch eager blocks (fp32 norm and RoPE math), SDPA flash attention, FSDP2, TP with
  sequence-parallel norms; selective checkpointing recomputes half of each block's forward
  (`selective_ac_option` "op" or "2"); torch.distributed.pipelining unshards the next stages ahead.
  torchtitan-compile: the blocks under torch.compile; torchtitan-compile-loss: the loss compiled too
  (components/loss.py from May 2025); torchtitan-fused-norm: eager blocks with its Triton RMSNorm.
- composer: MosaicML Composer + LLM Foundry: PyTorch FSDP with flash attention and low-precision
  LayerNorm, gradients reduce-scattered in every microbatch's backward (no no_sync under FSDP).
- deepspeed-zero3: Megatron's GPT model under DeepSpeed ZeRO-3 (Narayanan et al.'s comparison):
  megatron-2021's kernels, parameters gathered in prefetch buckets of 5e7 and gradients reduced in
  buckets of 5e8 (the ZeRO-3 config defaults), gathered again for a recomputed forward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from simulator.options import SimOptions

# Hopper or later: FP8 tensor cores (hardware presets whose names start so)
FP8_HARDWARE = ("h100", "h200", "h800", "b200", "gb200")


@dataclass(frozen=True)
class SoftwareStack:
    """One framework's choices: its kernels, its memory conventions, and the SimOptions fields
    (simulator/options.py) it sets away from their defaults."""

    summary: str
    kernels: str  # simulator/kernels.py Stack: "eager" | "fused"
    memory: str = ""  # simulator/memory.py MEMORY_STACKS; "" follows the kernels (eager | megatron)
    # Megatron-Core cuts a pipeline whose stages do not divide the layers with the embedding and the
    # loss counted as a layer each (account_for_embedding/loss_in_pipeline_split)
    split_counts_embedding_loss: bool = False
    options: tuple[tuple[str, object], ...] = ()  # (SimOptions field, value)

    @property
    def attention(self) -> str:
        return str(dict(self.options).get("attention", ""))


def _stack(summary: str, kernels: str, memory: str = "", split: bool = False, **options) -> SoftwareStack:
    unknown = sorted(set(options) - {f.name for f in fields(SimOptions)})
    if unknown:
        raise ValueError(f"software stack {summary!r}: {unknown[0]} is not a SimOptions field")
    return SoftwareStack(summary, kernels, memory, split, tuple(options.items()))


_MEGATRON_CORE = dict(kernels="fused", memory="megatron", split=True, attention="flash", sequence_parallel=True,
                      overlap_grad_reduce=True, overlap_param_gather=True, p2p_scatter_gather=True)
_TORCHTITAN = dict(kernels="eager", memory="torchtitan", attention="flash", sequence_parallel=True, selective="half",
                   p2p_scatter_gather=True, pp_prefetch_unshard=True)

SOFTWARE_STACKS: dict[str, SoftwareStack] = {
    "eager": _stack("this project's runtime: PyTorch ops under autocast", "eager"),
    "fused": _stack("this runtime's layouts with Megatron-LM's fused kernels", "fused"),
    "megatron-2021": _stack("Megatron-LM 2019-22: unfused attention, nothing overlapped", "fused",
                            memory="megatron-2021", split=True, attention="unfused", p2p_scatter_gather=True),
    "megatron-core": _stack("Megatron-Core + Transformer Engine: SP, overlapped distributed optimizer",
                            **_MEGATRON_CORE),
    "nemo": _stack("NeMo 2 / Megatron-Bridge: megatron-core plus TP comm overlap",
                   **{**_MEGATRON_CORE, "memory": "nemo", "tp_overlap": True}),
    "megatron-flash": _stack("Megatron-derived with SP and flash attention, nothing overlapped", "fused",
                             memory="megatron", attention="flash", sequence_parallel=True, p2p_scatter_gather=True),
    "torchtitan": _stack("torchtitan eager: FSDP2, SDPA, half-forward selective AC", **_TORCHTITAN),
    "torchtitan-compile": _stack("torchtitan with torch.compile'd blocks",
                                 **{**_TORCHTITAN, "kernels": "fused", "memory": "torchtitan-compile"}),
    "torchtitan-compile-loss": _stack("torchtitan with compiled blocks and loss",
                                      **{**_TORCHTITAN, "kernels": "fused", "memory": "torchtitan-compile-loss"}),
    "torchtitan-fused-norm": _stack("torchtitan eager with its Triton RMSNorm",
                                    **{**_TORCHTITAN, "memory": "torchtitan-fused-norm"}),
    "composer": _stack("Composer/LLM Foundry: FSDP reducing every microbatch", "fused", memory="composer",
                       attention="flash", fsdp_reduce_every_microbatch=True, p2p_scatter_gather=True),
    "deepspeed-zero3": _stack("DeepSpeed ZeRO-3 over Megatron's GPT (2021)", "fused", memory="megatron-2021",
                              attention="unfused", fsdp_gather_bucket=5e7, fsdp_reduce_bucket=5e8,
                              gather_for_recompute=True, p2p_scatter_gather=True),
}

ATTENTIONS = ("flash", "unfused")
# stacks that keep Megatron-LM's main-gradient buffer (where --grad-reduce-in-bf16 means something)
MEGATRON_FAMILY = ("fused", "megatron-2021", "megatron-core", "nemo", "megatron-flash")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
EP_DISPATCHERS = ("alltoall", "deepep")
# the mechanism flags: SimOptions fields a user turns on over the stack's choice
SWITCHES = ("sequence_parallel", "overlap_grad_reduce", "overlap_param_gather", "tp_overlap")


class StackError(ValueError):
    """A stack name or mechanism flag that does not apply; the message names the flag and what is allowed."""


@dataclass(frozen=True)
class Software:
    """A stack with the user's mechanism flags: what `simulate --stack ... [flags]` runs."""

    stack: str = "eager"
    attention: str = ""  # "": the stack's
    grad_reduce_dtype: str = ""  # "": the stack's (fp32 main gradients everywhere but where a flag says)
    fp8: bool = False
    ep_dispatcher: str = "alltoall"
    switches: tuple[str, ...] = ()  # the SWITCHES the user turned on

    def check(self, hardware: str = "") -> Software:
        """This software, or StackError naming the flag at fault."""
        if self.stack not in SOFTWARE_STACKS:
            raise StackError(f"stack must be one of {', '.join(SOFTWARE_STACKS)}; got {self.stack!r}")
        if self.attention not in ("", *ATTENTIONS):
            raise StackError(f"attention must be one of {', '.join(ATTENTIONS)}; got {self.attention!r}")
        if self.grad_reduce_dtype not in ("", *GRAD_REDUCE_DTYPES):
            raise StackError(f"grad-reduce-dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)}; "
                             f"got {self.grad_reduce_dtype!r}")
        if self.grad_reduce_dtype == "bf16" and self.stack not in MEGATRON_FAMILY:
            raise StackError(f"grad-reduce-dtype bf16 is Megatron's --grad-reduce-in-bf16: give --stack "
                             f"{', '.join(MEGATRON_FAMILY)}; got --stack {self.stack}")
        if self.ep_dispatcher not in EP_DISPATCHERS:
            raise StackError(f"ep-dispatcher must be one of {', '.join(EP_DISPATCHERS)}; got {self.ep_dispatcher!r}")
        if self.fp8 and hardware and not _is_file(hardware) and not fp8_capable(hardware):
            raise StackError(f"fp8: FP8 tensor cores need Hopper or later ({', '.join(FP8_HARDWARE)}); "
                             f"got --hardware {hardware}")
        if self.fp8 and self.stack == "eager":
            raise StackError("fp8: this runtime (--stack eager) trains in bf16; give a stack that runs FP8 linears "
                             "(fused, megatron-core, nemo, torchtitan-compile, ...)")
        return self

    @property
    def preset(self) -> SoftwareStack:
        return SOFTWARE_STACKS[self.stack]

    def memory_base(self) -> str:
        p = self.preset
        base = p.memory or ("megatron" if p.kernels == "fused" else "eager")
        if (self.attention or p.attention) == "unfused" and base == "megatron":
            base = "megatron-2021"  # the s x s scores, softmax and dropout outputs of unfused attention
        if self.grad_reduce_dtype == "bf16" and base in ("megatron", "nemo"):
            base = "megatron-bf16-grads"
        return base

    def sim_fields(self) -> dict:
        """SimOptions fields (simulator/options.py) of this software."""
        p = self.preset
        out = dict(p.options)
        out.update(dict.fromkeys(self.switches, True))
        out["stack"] = p.kernels
        if self.attention:
            out["attention"] = self.attention
        # "" keeps the kernels' own conventions (eager, or Megatron's, scores and all under an unfused
        # attention profile): what `--stack eager|fused` charges unless a flag changes the memory
        out["memory_stack"] = self.memory_base() if (p.memory or self.attention or self.grad_reduce_dtype) else ""
        if self.grad_reduce_dtype == "bf16":
            out["grad_reduce_bytes"] = 2  # the reduction moves bf16 gradients too
        out["gemm_dtype"] = "fp8" if self.fp8 else "bf16"
        out["ep_dispatcher"] = self.ep_dispatcher
        return out

    def flags(self) -> list[str]:
        """The `simulate` arguments that select this software."""
        out = ["--stack", self.stack]
        out += [f"--{name.replace('_', '-')}" for name in self.switches]
        if self.attention:
            out += ["--attention", self.attention]
        if self.grad_reduce_dtype:
            out += ["--grad-reduce-dtype", self.grad_reduce_dtype]
        if self.fp8:
            out.append("--fp8")
        if self.ep_dispatcher != "alltoall":
            out += ["--ep-dispatcher", self.ep_dispatcher]
        return out



def software_of(stack: str = "eager", *, attention: str = "", grad_reduce_dtype: str = "", fp8: bool = False,
                ep_dispatcher: str = "alltoall", hardware: str = "", **switches: bool | None) -> Software:
    """The Software of `simulate`'s flags (a switch None or False: the stack's choice), checked."""
    # fp32 main gradients are every stack's default: given explicitly they change nothing
    grad = "" if grad_reduce_dtype == "fp32" else grad_reduce_dtype or ""
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise StackError(f"switch must be one of {', '.join(SWITCHES)}; got {unknown[0]!r}")
    on = tuple(name for name in SWITCHES if switches.get(name))
    return Software(stack=stack, attention=attention or "", grad_reduce_dtype=grad, fp8=fp8,
                    ep_dispatcher=ep_dispatcher or "alltoall", switches=on).check(hardware)


def parse_flags(argv: list[str]) -> Software:
    """The Software of a list of `simulate` flags (`Software.flags`' inverse; a published row's software column)."""
    kw: dict = {}
    switches: dict = {}
    it = iter(argv)
    for tok in it:
        name = tok.removeprefix("--")
        if name in ("stack", "attention", "grad-reduce-dtype", "ep-dispatcher"):
            value = next(it, None)
            if value is None:
                raise StackError(f"{tok} needs a value")
            kw[name.replace("-", "_")] = value
        elif name == "fp8":
            kw["fp8"] = True
        elif name.replace("-", "_") in SWITCHES:
            switches[name.replace("-", "_")] = True
        else:
            raise StackError(f"software flag {tok!r} is not one of --stack, --attention, --grad-reduce-dtype, --fp8, "
                             f"--ep-dispatcher, --{', --'.join(s.replace('_', '-') for s in SWITCHES)}")
    return software_of(**kw, **switches)


def fp8_capable(gpu_name: str) -> bool:
    """A hardware preset's or a GPU's name that says Hopper or later (FP8 tensor cores)."""
    name = gpu_name.lower()
    return name.startswith(FP8_HARDWARE) or any(g in name for g in FP8_HARDWARE)


def _is_file(hardware: str) -> bool:
    return hardware.endswith((".toml", ".yaml", ".yml", ".json"))


def stacks_help() -> str:
    return "; ".join(f"{name}: {s.summary}" for name, s in SOFTWARE_STACKS.items())


def splits_embedding_loss(software: Software, layers: int, pp: int, virtual_stages: int = 1) -> bool:
    """ParallelSpec.embedding_loss_stages under `software`: a Megatron-Core stack cuts a pipeline whose
    pp x virtual stages do not divide the layers with the embedding and the loss as a layer each, where
    that divides (the recipes' account_for_embedding/loss_in_pipeline_split)."""
    stages = pp * virtual_stages
    return (software.preset.split_counts_embedding_loss and pp > 1 and layers % stages != 0
            and (layers + 2) % stages == 0)

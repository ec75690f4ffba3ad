"""What a simulation is asked to do (`SimOptions`) and how it fails (`SimulationError`)."""

from __future__ import annotations

from dataclasses import dataclass


class SimulationError(ValueError):
    """The plan cannot be simulated (deadlock, missing data); the message says where."""


@dataclass(frozen=True)
class SimOptions:
    recompute: str = "none"  # "none" | "full" | "selective"; default: plan.options["recompute"]
    grad_reduce_bytes: int = 4  # FSDP2 reduce_dtype fp32
    communication: bool = True  # False: free communication (the compute-bound schedule)
    check_memory: bool = True
    # the software running the blocks (simulator/kernels.py::Stack): "eager" is this project's runtime
    # (its modules op by op under autocast, the chunked loss); "fused" is Megatron-LM's fused kernels
    stack: str = "eager"
    # encoder microbatches in chunks of at most this many encoder tokens (patches, audio positions),
    # each recomputed in the backward, as omnibench/runtime/encoder_chunks.py runs them; 0: not chunked
    encoder_chunk_tokens: int = 0
    # What else the software stack does (defaults: this project's runtime). `validate --published` sets
    # them from each row's stack (simulator/published.py::options_of).
    attention: str = ""  # "" the kernel profile's own | "flash" | "unfused" (s x s scores through HBM)
    gemm_dtype: str = "bf16"  # "fp8": the blocks' linear layers on FP8 tensor cores (Transformer Engine, Float8)
    sequence_parallel: bool = False  # Megatron SP: norms, dropout and residual adds over 1/tp of the tokens
    overlap_grad_reduce: bool = False  # DDP/ZeRO gradients reduced bucket by bucket behind the backward
    overlap_param_gather: bool = False  # ZeRO: the updated weights gathered behind the next forward
    tp_overlap: bool = False  # TP collectives overlapped with the GEMMs (TE userbuffers, torchtitan AsyncTP)

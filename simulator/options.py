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
    # whose memory conventions to charge (simulator/memory.py MEMORY_STACKS): "" follows `stack`
    # (eager: this project's runtime, fused: Megatron-LM); "torchtitan", "torchtitan-compile",
    # "torchtitan-compile-loss", "megatron", "composer" describe other stacks' published runs
    memory_stack: str = ""

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
    # "torchtitan-compile-loss", "megatron", "composer", ... describe other frameworks
    memory_stack: str = ""
    # What else the software stack does (defaults: this project's runtime). `simulate --stack NAME` and its
    # mechanism flags set them (simulator/stacks.py), for a published run's software too.
    attention: str = ""  # "" the kernel profile's own | "flash" | "unfused" (s x s scores through HBM)
    gemm_dtype: str = "bf16"  # "fp8": the blocks' linear layers on FP8 tensor cores (Transformer Engine, Float8)
    sequence_parallel: bool = False  # Megatron SP: norms, dropout and residual adds over 1/tp of the tokens
    overlap_grad_reduce: bool = False  # DDP/ZeRO gradients reduced bucket by bucket behind the backward
    overlap_param_gather: bool = False  # ZeRO: the updated weights gathered behind the next forward
    tp_overlap: bool = False  # TP collectives overlapped with the GEMMs (TE userbuffers, torchtitan AsyncTP)
    # what "selective" recomputation re-runs: "attention" (Megatron: the attention core) or "half"
    # (torchtitan: every other block, or every other matmul and the element-wise ops: half the forward)
    selective: str = "attention"
    # FSDP reduce-scatters gradients in every microbatch's backward (PyTorch FSDP without no_sync,
    # as Composer runs it), not only in the last one's
    fsdp_reduce_every_microbatch: bool = False
    # parameters per FSDP / ZeRO-3 all-gather and per reduce-scatter call; 0: one call per layer (FSDP
    # wraps each block). DeepSpeed ZeRO-3 gathers in prefetch buckets of 5e7 parameters and reduces in
    # buckets of 5e8 (its stage3_prefetch_bucket_size / reduce_bucket_size defaults): on a group of
    # thousands of ranks every call pays the ring's latency, once per hop
    fsdp_gather_bucket: float = 0.0
    fsdp_reduce_bucket: float = 0.0
    # under full recomputation a sharded layer is gathered for its recomputed forward and again for
    # its backward (DeepSpeed ZeRO-3 releases parameters after every forward, the recomputed one
    # included); FSDP gathers once for both
    gather_for_recompute: bool = False
    # pipeline sends carry each tp rank's 1/tp of the activation (Megatron's scatter/gather optimisation,
    # Narayanan et al. SC'21 sec. 4.1; a sequence-parallel stage output), not the whole of it
    p2p_scatter_gather: bool = False
    # under pipelining with FSDP (parameters kept gathered between microbatches), the schedule unshards
    # a model chunk ahead of its first use: torch.distributed.pipelining's runtime inserts UNSHARD actions
    # for the next stages (`_add_unshard_reshard`, max_active_stages 3) behind the current compute, so
    # only the rank's first chunk of the step waits for its gather. Off: each chunk's first forward and
    # first backward gather their first layer in line (this project's runtime)
    pp_prefetch_unshard: bool = False
    # this project's runtime in a bf16 run, modules FSDP does not shard (one rank, DDP): "autocast" fp32
    # weights cast per op (fp32 gradients, an fp32 residual stream in the LLM) | "master" bf16 weights with
    # an fp32 master and fp32 main gradients (omnibench/runtime/master.py): 2 bytes more per parameter,
    # no weight casts, a bf16 residual stream
    mixed_precision: str = "autocast"
    # how MoE tokens reach their experts (simulator/collectives.py::expert_all_to_all): "alltoall" sends
    # every token copy on its own; "deepep" sends a token to each remote node once and forwards it over NVLink
    ep_dispatcher: str = "alltoall"
    # how wrong the memory estimate is assumed to be when deciding what fits: a rank fits when its
    # estimated peak times (1 + memory_error) is within the GPU's memory (-0.2: the estimate is 20%
    # high; +0.2: 20% low). The reported peak stays the estimate. For sensitivity studies.
    memory_error: float = 0.0

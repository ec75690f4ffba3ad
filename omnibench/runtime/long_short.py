"""Executing omni's long inputs: one encoder microbatch split over a sequence-parallel group, and
one long LLM sample split over a context-parallel group of data ranks (`llm_group`, `llm_group_cp`;
the executor chunks the row, the planner's systems/omni/llm_long_short.py says which).

The plan marks, per encoder and rank, which encoder microbatches run over a group ("long" in the
options' names, though under omni's SP-for-all scheme every sample does:
`plan.options["long_short"]["long_microbatches"]`); every member of the fixed group
(`plan.options["long_short"]["groups"]`) runs that microbatch, one or several samples packed into
one row, together:

- when the sample's attention sequences (vision frame groups, audio 30 s windows) split into k
  contiguous runs of whole sequences within 25% of an even share, each member takes one run and
  the blocks need no exchange at all (attention never crosses a sequence);
- otherwise (one sequence dominates) each member embeds a contiguous 1/k of the positions (padded
  to a multiple of k with one extra, isolated attention sequence whose outputs are dropped) and
  every block's attention core is wrapped in Ulysses (omnibench.runtime.parallelize.
  UlyssesAttention: all-to-all to whole sequence x 1/k heads, the usual varlen core over the full
  cu_seqlens, all-to-all back), so the result is exact either way;
- the chunks are all-gathered (autograd-aware: the backward hands each member its chunk's
  gradient) and every member finishes the module (vision: the 2x2 merger runs per chunk, as merge
  windows never straddle a chunk; audio: pool, norm and projector on the gathered sequence, run by
  every member so all hold gradients for all parameters) and holds the whole output: a member that
  consumes a sample on the LLM side reads its own copy, the plan's routes name who sends the rest.

Backward needs no special path: the executor's encoder backward runs `backward(out, grad)` with each
sample's routed gradient on its primary source (encoder_actions.py) and zeros elsewhere, which walks
the same collectives in reverse on every member. The members' partial gradients of the replicated
parameters add up in grad_sync (ZeRO's reduce-scatter, DDP's all-reduce, or FSDP's own).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from omnibench.models.inputs import dummy_sample, pack, synthesize
from omnibench.models.vision import vision_cu_seqlens, vision_position_ids, vision_rope
from omnibench.runtime.parallelize import AllGatherKVAttention, UlyssesAttention, gather_chunks
from omnibench.specs.costs import audio_windows
from systems.common import encoder_tokens


class LongShortRuntime:
    """Process groups of omni's sequence-parallel and long-sample groups. A step's plan may name groups
    of another size than earlier steps (the planner weighs group sizes per batch), but only groups of its
    pool (`plan.options["long_short"]["pool"]`: every size any step may name, each size's fixed groups of
    consecutive ranks). `create` builds the whole pool once, collectively, before the first step, and
    every step uses those groups: no communicator is created during training (on a GPU NCCL takes
    seconds to set one up), and a rank holds one per size it can be grouped at (0.38 GiB each on an
    H100), which is what the simulator's memory check counts (`simulator.memory.communicators`)."""

    def __init__(self, rank: int, timeout):
        self.rank, self.timeout = rank, timeout
        self.built: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.groups: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}

    @staticmethod
    def create(plan, rank: int, timeout) -> LongShortRuntime | None:
        if "long_short" not in plan.options:
            return None
        rt = LongShortRuntime(rank, timeout)
        rt.build_pool(plan)
        rt.prepare(plan)
        return rt

    def build_pool(self, plan) -> None:
        from omnibench.process_groups import pool_groups

        for key in pool_groups(plan.layouts, plan.options["long_short"]["pool"]):
            self.built[key] = dist.new_group(list(key), timeout=self.timeout)

    def prepare(self, plan) -> None:
        """This step's groups: this rank's per module, each from the pool."""
        cfg = plan.options.get("long_short", {}).get("groups", {})
        self.groups = {}
        for module in sorted(cfg):
            for ranks in cfg[module]:
                key = tuple(ranks)
                if key not in self.built:
                    raise RuntimeError(f"step {plan.step}: the plan names the {module} group {list(key)}, "
                                       "which is not in the group pool built at start-up")
                if self.rank in key:
                    self.groups[module] = (self.built[key], key)

    def handles(self, plan, module: str, microbatch: int) -> bool:
        cfg = plan.options.get("long_short", {})
        return microbatch in cfg.get("long_microbatches", {}).get(module, {}).get(str(self.rank), ())

    def llm_group(self, plan, microbatch: int) -> tuple[dist.ProcessGroup, tuple[int, ...]] | None:
        """omni's long LLM sample (systems/omni/llm_long_short.py): the context-parallel group that
        runs this LLM microbatch together, or None for a data-parallel microbatch."""
        return self.groups["llm"] if self.handles(plan, "llm", microbatch) else None

    def forward(self, ex, a) -> None:
        module, mb = a.module, a.microbatch
        ids = ex._enc_microbatch(module, mb)
        group, ranks = self.groups[module]
        encode_over_group(ex, module, mb, ids, group, ranks, swap_cores=True, outputs_on_all=True)


def call_as_forward(module, fn, *args):
    """`fn(*args)` run as `module`'s forward, through `module.__call__`, so the hooks on the module
    fire: under FSDP2 (temporal's encoders) the root's pre-forward gathers the parameters outside the
    blocks (patch embedding, merger, projector) and its backward hooks reduce their gradients."""
    module.forward = fn  # an instance attribute shadows the class's forward for this call
    try:
        return module(*args)
    finally:
        del module.forward


def encode_over_group(ex, module: str, mb: int, ids, group, ranks: tuple[int, ...], *, swap_cores: bool,
                      outputs_on_all: bool) -> None:
    """One encoder microbatch (its samples packed into one row) over a sequence-parallel group.

    omni (`swap_cores=True`): the cores swapped for Ulysses per call (or no exchange where whole
    sequences split evenly). temporal (`swap_cores=False`): the blocks' cores are Ulysses for good
    (executor `_build_encoder`). `outputs_on_all`: every member keeps the outputs (both systems
    today), else only the group's first rank. A sample's gradient comes back on one member only."""

    k, c = len(ranks), ranks.index(ex.rank)
    samples = [ex.plan.sample(i) for i in ids] or [dummy_sample(module)]
    packed = pack([synthesize(s, ex.spec, device=ex.device) for s in samples]).to(ex.device)
    enc = ex.modules[module]
    if module == "vision":
        def run(patches, grid):
            return vision_forward_sp(enc, patches, grid, group, k, c, swap_cores=swap_cores)

        out = call_as_forward(enc, run, packed.pixel_patches, packed.grid_thw)
    else:
        def run(mel, mel_lens):
            return audio_forward_sp(enc, mel, mel_lens, group, k, c, swap_cores=swap_cores)

        out = call_as_forward(enc, run, packed.mel, packed.mel_lens)
    tokens = [encoder_tokens(s, module) for s in samples] if ids else []
    if ids and out.shape[0] != sum(tokens):
        raise RuntimeError(f"{module} samples {list(ids)}: {out.shape[0]} output tokens, plan expects {sum(tokens)}")
    if ids and (outputs_on_all or c == 0):
        ex.state.enc_out[(module, mb)] = (out, list(ids), tokens)
        for i, piece in zip(ids, torch.split(out, tokens), strict=True):
            ex.state.emb[(module, i, "local")] = piece
    else:
        ex.state.enc_out[(module, mb)] = (out, [], [])  # backward: zeros through the same collectives


@contextmanager
def ulysses(layer, group, k: int):
    """`layer`'s attention core exchanged for a Ulysses one over `group` for the duration."""
    core = layer.attention.core
    try:
        layer.attention.core = UlyssesAttention(core, group, k)
        yield
    finally:
        layer.attention.core = core


def ulysses_layer(layer, args: tuple, group, k: int):
    """One block under Ulysses. A fully checkpointed block (parallelize.apply_ac) recomputes its
    forward in the backward, after this call returns: the exchange is set up inside the
    checkpointed function, so the recomputation attends through the same exchange."""
    inner = getattr(layer, "_checkpoint_wrapped_module", None)
    if inner is None:
        with ulysses(layer, group, k):
            return layer(*args)

    def run(*a):
        with ulysses(inner, group, k):
            return inner(*a)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)


@contextmanager
def llm_group_cp(stage, group, k: int, kind: str = "ulysses", member: int = 0):
    """Context parallelism over omni's long-sample group for one LLM microbatch: every attention core
    of the stage (found under any checkpoint / FSDP wrapping) wrapped for the microbatch's forward or
    backward (the backward's recomputation, if any, must see the same exchange): Ulysses, or
    all-gathered K/V (`kind="allgather"`, this rank `member` of the group) where Ulysses cannot split
    the heads (systems/omni/llm_long_short.py)."""
    from omnibench.models.llm import Attention

    swapped = [m for m in stage.modules() if isinstance(m, Attention)]
    cores = [m.core for m in swapped]
    try:
        for m, core in zip(swapped, cores, strict=True):
            # under the layout's own cp the core already exchanges over the cp group, whose ranks are
            # members of this group too: the group's exchange replaces it (one degree, k = dp x cp ranks)
            inner = core.inner if isinstance(core, (UlyssesAttention, AllGatherKVAttention)) else core
            m.core = (AllGatherKVAttention(inner, group, k, member) if kind == "allgather"
                      else UlyssesAttention(inner, group, k))
        yield
    finally:
        for m, core in zip(swapped, cores, strict=True):
            m.core = core


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    return gather_chunks(x, group)


def split_whole_sequences(lengths: list[int], k: int, slack: float = 1.25) -> list[tuple[int, int]] | None:
    """Contiguous runs of whole attention sequences, one per member, or None when the most loaded
    run would exceed `slack` x an even share (then Ulysses splits inside the sequences)."""
    total = sum(lengths)
    if k <= 1 or total == 0:
        return None
    bounds, start, acc = [], 0, 0
    for c in range(k - 1):
        target = total * (c + 1) / k
        end = start
        while end < len(lengths) and abs(acc + lengths[end] - target) <= abs(acc - target):
            acc += lengths[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, len(lengths)))
    runs = [sum(lengths[a:b]) for a, b in bounds]
    return bounds if max(runs) <= slack * total / k else None


def _gather_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather rows of unequal counts (padded to the largest), in member order."""
    most = max(sizes)
    padded = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])]) if x.shape[0] < most else x
    parts = torch.split(_gather(padded, group), most)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def _block(layer, args: tuple, group, k: int, swap_cores: bool):
    return ulysses_layer(layer, args, group, k) if swap_cores else layer(*args)


def vision_forward_sp(enc, patches: torch.Tensor, grid_thw: torch.Tensor, group, k: int, c: int,
                      swap_cores: bool = True) -> torch.Tensor:
    """The vision encoder over a group of k ranks, this one holding chunk c. `swap_cores`: the blocks'
    attention cores are plain (wrapped in Ulysses per call here, or left alone where whole frame
    groups split evenly); False: they are Ulysses already, so the positions always split evenly."""
    spec = enc.spec
    window = spec.merge**2
    grid = grid_thw.long()
    cos, sin = vision_rope(vision_position_ids(grid, spec.merge), spec.hidden // spec.heads)
    cu, max_seqlen = vision_cu_seqlens(grid)
    n = patches.shape[0]
    lengths = [h * w for t, h, w in grid.tolist() for _ in range(t)]
    runs = split_whole_sequences(lengths, k) if swap_cores else None
    if runs is not None:
        # The frame groups split evenly: each member attends over whole groups of its own, with no
        # exchange inside the blocks (attention never crosses a group).
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        lo, hi = offsets[runs[c][0]], offsets[runs[c][1]]
        mine = lengths[runs[c][0] : runs[c][1]]
        local_cu = F.pad(torch.tensor(mine, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)).to(patches.device)
        h = enc.patch_embed(patches[lo:hi])
        cs, sn = cos[lo:hi].to(h.device), sin[lo:hi].to(h.device)
        for layer in enc.layers.values():
            h = layer(h, cs, sn, local_cu, max(mine, default=0))
        sizes = [(offsets[b] - offsets[a]) // window for a, b in runs]
        return _gather_uneven(enc.merger(h), sizes, group)
    pad = (-n) % (k * window)
    if pad:  # one isolated extra sequence, so every member holds the same number of whole merge windows
        patches = torch.cat([patches, patches.new_zeros(pad, patches.shape[1])])
        cos = torch.cat([cos, cos.new_ones(pad, cos.shape[1])])
        sin = torch.cat([sin, sin.new_zeros(pad, sin.shape[1])])
        cu = torch.cat([cu, cu.new_tensor([n + pad])])
        max_seqlen = max(max_seqlen, pad)
    per = (n + pad) // k
    lo, hi = c * per, (c + 1) * per
    cu = cu.to(patches.device)
    h = enc.patch_embed(patches[lo:hi])
    cos, sin = cos[lo:hi].to(h.device), sin[lo:hi].to(h.device)
    for layer in enc.layers.values():
        h = _block(layer, (h, cos, sin, cu, max_seqlen), group, k, swap_cores)
    out = _gather(enc.merger(h), group)
    # Padded: drop the extra sequence's outputs, as a copy (a view returned through an FSDP module's
    # forward is one an in-place op could cut off from FSDP's backward hook; torch warns about it).
    return out[: n // window].clone() if pad else out


def audio_forward_sp(enc, mel: torch.Tensor, mel_lens, group, k: int, c: int, swap_cores: bool = True) -> torch.Tensor:
    """The audio encoder over a group of k ranks (`swap_cores` as in vision_forward_sp)."""
    spec = enc.spec
    lens = [int(x) for x in (mel_lens.tolist() if torch.is_tensor(mel_lens) else mel_lens)]
    x = mel.to(enc.conv1.weight.dtype)
    feats = []
    for seg in torch.split(x, lens, dim=0):
        if seg.shape[0] < 2:
            continue
        # The convs are cheap next to the blocks: every member runs them over the whole input and
        # keeps its chunk (its gradient then reaches only the chunk's positions).
        h = F.gelu(enc.conv1(seg.t().unsqueeze(0)))
        feats.append(F.gelu(enc.conv2(h))[0].t()[: seg.shape[0] // 2])
    windows = audio_windows(lens, spec.max_positions)
    h = torch.cat(feats)
    table = _sinusoids(spec.max_positions, spec.hidden, h.device).to(h.dtype)
    h = h + table[torch.cat([torch.arange(w, device=h.device) for w in windows])]
    n = h.shape[0]
    runs = split_whole_sequences(windows, k) if swap_cores else None
    if runs is not None:  # whole 30 s windows per member: no exchange inside the blocks
        offsets = [0, *torch.tensor(windows).cumsum(0).tolist()]
        mine = windows[runs[c][0] : runs[c][1]]
        part = h[offsets[runs[c][0]] : offsets[runs[c][1]]]
        local_cu = F.pad(torch.tensor(mine, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)).to(h.device)
        for layer in enc.layers.values():
            part = layer(part, local_cu, max(mine, default=0))
        full = _gather_uneven(part, [offsets[b] - offsets[a] for a, b in runs], group)
    else:
        pad = (-n) % k
        seqs = list(windows) + ([pad] if pad else [])
        if pad:
            h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
        cu = F.pad(torch.tensor(seqs, device=h.device).cumsum(0, dtype=torch.int32), (1, 0))
        per = (n + pad) // k
        part = h[c * per : (c + 1) * per]
        for layer in enc.layers.values():
            part = _block(layer, (part, cu, max(seqs)), group, k, swap_cores)
        full = _gather(part, group)[:n]
    # Every member finishes the module (cheap) so every member's head parameters get a gradient,
    # zero except on the first rank, and grad_sync's all-reduce sees the same tensors everywhere.
    starts = F.pad(torch.tensor(windows).cumsum(0), (1, 0))[:-1].tolist()
    keep = torch.cat([torch.arange(s, s + (w // spec.pool) * spec.pool) for s, w in zip(starts, windows, strict=True)])
    pooled = full[keep.to(full.device)].view(-1, spec.pool, full.shape[-1]).mean(dim=1)
    return enc.projector(enc.norm(pooled))


def _sinusoids(length: int, channels: int, device):
    from omnibench.models.audio import sinusoids

    return sinusoids(length, channels, device=device)

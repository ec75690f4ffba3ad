"""The Plan: what a system decided for one training step, as plain data.

A system is a planner: `plan(model, parallel, batch) -> Plan`. The runtime executes a Plan
with real tensors; the simulator executes the same Plan with costs. Keep it printable, diffable
and JSON-serialisable; no torch here.

Vocabulary
- module: "vision", "audio" (encoders) or "llm".
- layout: the ranks a module runs on and how they form a mesh (dp, tp, pp, cp, ep, sp).
  Ranks are listed in mesh order, innermost dim last: ("pp", "dp", "cp", "tp") for the LLM,
  ("dp", "sp", "tp") for encoders, so `ranks[i]` has mesh coordinates `unravel(i, shape)`.
- microbatch: index into a module's per-rank list of microbatches (`Plan.assignment`).
- route: which rank produces a sample's encoder output and which LLM rank consumes it,
  the encoder->LLM *boundary*.
- actions: per rank, the ordered list it executes. Intra-module collectives (TP all-reduce,
  FSDP all-gather, CP/SP all-to-all, EP dispatch) happen inside forward/backward and are not
  separate actions; everything that crosses ranks between compute actions is one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from itertools import product

from workloads.sample import Sample

# Action kinds.
FORWARD = "forward"  # module stage forward on a microbatch
BACKWARD = "backward"  # module stage backward on a microbatch
SEND = "send"  # pipeline p2p inside a module: what="act" (fwd) | "grad" (bwd); peer set
RECV = "recv"
BOUNDARY = "boundary"  # encoder->LLM exchange of one encoder microbatch's outputs: what="act" | "grad"
GRAD_SYNC = "grad_sync"  # data-parallel gradient reduction of a module (FSDP reduce-scatter / all-reduce)
OPTIMIZER_STEP = "optimizer_step"
# Data loaders' all-gather of per-sample metadata before the step's compute (module "loader"):
# what="reorder" inside a reorder group of loaders (`loader_group`), what="plan" over the LLM data
# ranks (every loader's post-reorder samples, so every rank builds the same Plan). `nbytes`: what
# each member contributes. The runtime's loaders run them before the Plan exists, on a loader
# thread during the previous step (in line for the first); they sit at the head of the Plan so the
# simulator costs them (overlapping the step's compute) and the trace shows them.
METADATA = "metadata"
ACTION_KINDS = (FORWARD, BACKWARD, SEND, RECV, BOUNDARY, GRAD_SYNC, OPTIMIZER_STEP, METADATA)
# the `Plan.options` key of a plan whose actions run in concurrency groups (what the planner decided on them)
CONCURRENCY_OPTION = "spatial"

LLM_MESH_DIMS = ("pp", "dp", "cp", "tp")
# How context parallelism splits attention: Ulysses all-to-alls (the runtime's), a ring of K/V blocks,
# or an all-gather of K/V before each attention (Llama 3, torchtitan's default rotate method)
CP_KINDS = ("ulysses", "ring", "allgather")
RUNTIME_CP_KINDS = ("ulysses", "allgather")  # what the runtime runs; ring is simulated only
ENCODER_MESH_DIMS = ("dp", "sp", "tp")


class PlanError(ValueError):
    """A planner or a layout request produced something impossible; message names the field."""


@dataclass(frozen=True)
class Layout:
    module: str
    ranks: tuple[int, ...]
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # experts split over ep ranks drawn from dp*cp (MoE only)
    sp: int = 1  # Ulysses sequence parallel (encoders)
    fsdp: bool = True  # dp shards parameters (FSDP2, ZeRO-3) rather than replicating them
    # Without FSDP, the ZeRO stage that shards the training state over the data-parallel group
    # (`fsdp_dims`) while every rank keeps whole bf16 weights: 0 none (DDP: gradients all-reduced,
    # every rank steps the whole optimizer), 1 the fp32 master weights and optimizer state (Megatron's
    # distributed optimizer, DeepSpeed ZeRO-1: gradients reduce-scattered, updated weights
    # all-gathered after the step), 2 also the gradients (ZeRO-2: a rank keeps only its shard's).
    # The forward never waits for peers, unlike FSDP's layer-by-layer gathers.
    zero: int = 0
    # HSDP: FSDP shards parameters within groups of `dp_shard` consecutive ranks of each FSDP group
    # (`fsdp_groups`) and replicates them across those groups (gradients: reduce-scatter inside the
    # shard group, all-reduce of the shard across the replicate group). 0: one shard group over the
    # whole FSDP group (plain FSDP), which is also what a plan written before this field means.
    # Under ZeRO-1/2 the same groups make a hybrid ZeRO (Megatron-Core's partial distributed optimizer,
    # `num_distributed_optimizer_instances`): the training state sharded within each shard group and
    # replicated across them; the updated weights are all-gathered within the shard group.
    dp_shard: int = 0
    # Interleaved 1F1B (LLM only): each pipeline rank holds `vpp` model chunks; virtual stage
    # c * pp + (pp coordinate) is chunk c of that rank, and an LLM action's `stage` is the virtual one.
    vpp: int = 1
    # LLM context parallelism: "ulysses" (the runtime's), "ring" or "allgather" (all-gather K/V, as
    # Llama 3 and torchtitan run it; both simulated only)
    cp_kind: str = "ulysses"
    # LLM pipelines: the embedding and the loss count as one layer each when the layers are cut into
    # (virtual) stages (Megatron's account_for_embedding/loss_in_pipeline_split): the first stage holds
    # the embedding and one layer fewer, the last the loss and one layer fewer (simulated only)
    embedding_loss_stages: bool = False
    # MoE (LLM): 0 the experts are tensor-parallel like the dense MLP and ep is drawn from dp*cp; 1
    # Megatron's MoE parallel folding with expert tensor parallelism 1: every expert whole on its rank,
    # ep drawn from the dp*cp*tp ranks of a stage, each rank dispatching its 1/tp of the tokens
    # (sequence parallel) (simulated only)
    expert_tp: int = 0

    # Derived sizes are cached on the instance (cached_property writes its __dict__, as `_tables`
    # does): the simulator asks for them per action. Fields, equality, hashing and JSON are unchanged.
    @cached_property
    def stages(self) -> int:
        """Pipeline stages the LLM's layers are cut into (virtual stages under interleaving)."""
        return self.pp * self.vpp

    @cached_property
    def mesh_dims(self) -> tuple[str, ...]:
        return LLM_MESH_DIMS if self.module == "llm" else ENCODER_MESH_DIMS

    @cached_property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The data-like dims FSDP shards over (torchtitan: dp_shard x cp); encoders: dp x sp."""
        return ("dp", "cp") if self.module == "llm" else ("dp", "sp")

    @cached_property
    def fsdp_size(self) -> int:
        a, b = self.fsdp_dims
        return getattr(self, a) * getattr(self, b)

    @cached_property
    def shard_size(self) -> int:
        """Ranks one copy of the parameters is sharded over (the whole FSDP group unless HSDP)."""
        return self.dp_shard if 0 < self.dp_shard < self.fsdp_size else self.fsdp_size

    @cached_property
    def hybrid(self) -> bool:
        """Sharded within shard groups and replicated across them: HSDP, or hybrid ZeRO-1/2."""
        return (self.fsdp or self.zero > 0) and self.shard_size < self.fsdp_size

    @cached_property
    def hsdp(self) -> bool:
        return self.fsdp and self.hybrid

    @property
    def dp_mode(self) -> str:
        """How data parallelism holds the training state: ddp, zero1, zero2, fsdp or hsdp (a hybrid
        ZeRO says zero1 / zero2: the same state, sharded over `shard_size` ranks; see `hybrid`)."""
        if self.fsdp:
            return "hsdp" if self.hsdp else "fsdp"
        return ("ddp", "zero1", "zero2")[self.zero]

    def fsdp_groups(self) -> list[tuple[int, ...]]:
        """Every FSDP group (one per coordinate of the other dims), members in mesh order."""
        a, b = self.fsdp_dims
        strides = self._tables()[1]
        inner = [i * strides[a] + j * strides[b] for i in range(getattr(self, a)) for j in range(getattr(self, b))]
        return [tuple(self.ranks[base + x] for x in inner) for base in self._bases([a, b])]

    def _bases(self, dims: list[str]) -> list[int]:
        """Flat mesh index of every combination of the dims other than `dims` (those at 0), in
        mesh order: the first member of each group spanning `dims`."""
        strides = self._tables()[1]
        others = [d for d in self.mesh_dims if d not in dims]
        return [sum(strides[d] * v for d, v in zip(others, vals, strict=True))
                for vals in product(*(range(getattr(self, d)) for d in others))]

    def shard_groups(self) -> list[tuple[int, ...]]:
        """HSDP shard groups: runs of `shard_size` consecutive members of each FSDP group."""
        s = self.shard_size
        return [g[i : i + s] for g in self.fsdp_groups() for i in range(0, len(g), s)]

    def replicate_groups(self) -> list[tuple[int, ...]]:
        """HSDP replicate groups: the members of one FSDP group holding the same shard."""
        s = self.shard_size
        return [g[j::s] for g in self.fsdp_groups() for j in range(s)]

    @cached_property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in self.mesh_dims)

    @cached_property
    def size(self) -> int:
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n

    def _tables(self) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
        # Planners ask for coordinates of every rank many times: compute them once per layout
        # (kept off the dataclass fields, so equality, hashing and JSON are unchanged).
        cached = self.__dict__.get("_cache")
        if cached is None:
            dims, shape = self.mesh_dims, self.mesh_shape
            strides, acc = {}, 1
            for d, n in zip(reversed(dims), reversed(shape), strict=True):
                strides[d] = acc
                acc *= n
            coords = {}
            for idx, r in enumerate(self.ranks):
                coords[r] = {d: (idx // strides[d]) % getattr(self, d) for d in dims}
            cached = (coords, strides)
            object.__setattr__(self, "_cache", cached)
        return cached

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank in this layout."""
        return dict(self._tables()[0][rank])

    def coord_table(self) -> dict[int, dict[str, int]]:
        """Every rank's mesh coordinates: the layout's own table, shared (read it, never change it)."""
        return self._tables()[0]

    def coord(self, rank: int, dim: str) -> int:
        """One mesh coordinate of a global rank (`coords(rank)[dim]` without copying the mapping)."""
        return self._tables()[0][rank][dim]

    def rank_at(self, **coords: int) -> int:
        strides = self._tables()[1]
        i = 0
        for d, v in coords.items():
            i += strides[d] * v
        return self.ranks[i]

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """The ranks sharing every coordinate with `rank` except `dim` (its `dim` group). All of a
        dim's groups are built once per layout: per-rank construction made planning and simulating
        quadratic in the world size (every rank asking for its group of ~world/k ranks)."""
        by_dim = self.__dict__.get("_groups")
        if by_dim is None:
            by_dim = {}
            object.__setattr__(self, "_groups", by_dim)
        index = by_dim.get(dim)
        if index is None:
            index = by_dim[dim] = {r: g for g in self.groups(dim) for r in g}
        return index[rank]

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """All `dim` groups of this layout (every rank in exactly one)."""
        step = self._tables()[1][dim]
        inner = [i * step for i in range(getattr(self, dim))]
        return [tuple(self.ranks[base + x] for x in inner) for base in self._bases([dim])]

    def validate(self) -> None:
        if len(set(self.ranks)) != len(self.ranks):
            raise PlanError(f"layout.{self.module}.ranks: duplicate ranks {self.ranks}")
        if self.size != len(self.ranks):
            shape = " x ".join(f"{d}={getattr(self, d)}" for d in self.mesh_dims)
            raise PlanError(
                f"layout.{self.module}: mesh {shape} = {self.size} ranks but {len(self.ranks)} given"
            )
        if self.zero not in (0, 1, 2) or (self.zero and self.fsdp):
            raise PlanError(f"layout.{self.module}.zero: {self.zero} must be 0, 1 or 2, and 0 under fsdp "
                            "(FSDP already shards everything)")
        if self.expert_tp not in (0, 1) or (self.expert_tp and (self.dp * self.cp * self.tp) % self.ep):
            raise PlanError(f"layout.{self.module}.expert_tp: {self.expert_tp} must be 0 or 1, and with 1 ep={self.ep} "
                            f"must divide dp*cp*tp = {self.dp * self.cp * self.tp}")
        if self.cp_kind not in CP_KINDS:
            raise PlanError(f"layout.{self.module}.cp_kind: must be one of {', '.join(CP_KINDS)}, got {self.cp_kind!r}")
        if self.vpp < 1 or (self.vpp > 1 and (self.module != "llm" or self.pp < 2)):
            raise PlanError(f"layout.{self.module}.vpp: {self.vpp} must be 1, or > 1 on the LLM with pp >= 2")
        n, dims = self.fsdp_size, "*".join(self.fsdp_dims)
        if self.dp_shard < 0 or (self.dp_shard and n % self.dp_shard):
            raise PlanError(f"layout.{self.module}.dp_shard: {self.dp_shard} must be 0 (the whole FSDP group) "
                            f"or a divisor of {dims} = {n}")
        if self.hsdp and self.ep > 1 and self.shard_size % self.ep:
            raise PlanError(f"layout.{self.module}.dp_shard: {self.dp_shard} must be a multiple of ep={self.ep} "
                            "(a shard group holds whole expert groups)")


# Action and Route: slots, as a plan at scale holds millions of them; not frozen, because a frozen
# dataclass sets every field through object.__setattr__, which made building them 5x dearer (a
# twentieth of a tune's time at 8,192 GPUs). Nothing changes one once made: eq and hash are the frozen ones.
@dataclass(slots=True, unsafe_hash=True)
class Action:
    kind: str
    module: str
    microbatch: int = 0
    stage: int = 0
    what: str = ""  # "act" | "grad" for send/recv/boundary
    peer: int = -1  # send/recv partner rank
    # Boundary only (added for the runtime): "send" | "recv" on this rank, and the microbatch the
    # message belongs to on the peer (encoder microbatch on the LLM side and vice versa).
    direction: str = ""
    peer_microbatch: int = -1
    nbytes: int = 0  # metadata only: bytes this rank contributes to the all-gather
    # Spatial multiplexing (systems/spatial.py): the compute actions of one concurrency group (the same
    # `concurrent` >= 0, listed together on a rank) run at once, each lane (`lane_of`) in its listed order
    # on its `quota`, the share of the device it is given (a GPU's SMs, a CPU's intra-op threads); the
    # group ends when every lane has. -1: the action runs alone on the whole device, after the one before.
    concurrent: int = -1
    quota: float = 1.0

    def __str__(self) -> str:
        s = f"{self.kind}({self.module}"
        if self.kind not in (GRAD_SYNC, OPTIMIZER_STEP, METADATA):
            s += f", mb{self.microbatch}"
            if self.module == "llm" or self.stage:
                s += f", stage{self.stage}"
        if self.what:
            s += f", {self.what}"
        if self.direction:
            s += f", {self.direction}"
        if self.peer >= 0:
            s += f", peer={self.peer}"
            if self.peer_microbatch >= 0:
                s += f" mb{self.peer_microbatch}"
        if self.concurrent >= 0:
            s += f", group{self.concurrent} q{self.quota:.2f}"
        return s + ")"


def lane_of(action: Action) -> str:
    """The lane an action of a concurrency group runs in: the LLM's, or the encoders' (which run one
    after another in it)."""
    return "llm" if action.module == "llm" else "encoders"


def _action_dict(a: Action) -> dict:
    d = asdict(a)
    if a.concurrent < 0:  # a plan without spatial multiplexing keeps its JSON as it was
        del d["concurrent"], d["quota"]
    return d


def loader_group(llm: Layout, rank: int, what: str, group_size: int) -> tuple[int, ...]:
    """The ranks a metadata exchange of `rank` runs over: its LLM data-parallel group ("plan"), or
    the chunk of `group_size` consecutive data ranks of it holding its own ("reorder"). Ranks with
    the same dp coordinate load the same samples, so each (pp, cp, tp) slice exchanges on its own."""
    group = llm.group(rank, "dp")
    if what == "plan":
        return group
    g = max(1, min(group_size, llm.dp))
    start = llm.coords(rank)["dp"] // g * g
    return group[start : start + g]


@dataclass(slots=True, unsafe_hash=True)  # as Action: slots, not frozen
class Route:
    """One sample's encoder output crossing the boundary for one encoder module."""

    module: str  # encoder: "vision" | "audio"
    sample_id: int
    src_rank: int
    src_microbatch: int  # encoder microbatch on src_rank
    dst_rank: int
    dst_microbatch: int  # LLM microbatch on dst_rank
    tokens: int  # LLM tokens this output occupies (after merge/pool)


@dataclass
class Plan:
    system: str
    step: int
    world_size: int
    model: str  # model preset/spec name
    samples: list[Sample]
    layouts: dict[str, Layout]
    # assignment[module][rank] = list of microbatches, each a tuple of sample ids.
    # For the LLM, samples in a microbatch are packed into one row (cu_seqlens keeps them apart).
    assignment: dict[str, dict[int, list[tuple[int, ...]]]]
    routes: list[Route]
    actions: dict[int, list[Action]]
    options: dict = field(default_factory=dict)  # system knobs that shaped this plan
    notes: dict = field(default_factory=dict)  # what the system decided, for people (and figures)

    # -- queries -------------------------------------------------------------------------
    def sample(self, sample_id: int) -> Sample:
        if not hasattr(self, "_by_id"):
            self._by_id = {s.sample_id: s for s in self.samples}
        return self._by_id[sample_id]

    def microbatches(self, module: str, rank: int) -> list[tuple[int, ...]]:
        return self.assignment.get(module, {}).get(rank, [])

    @property
    def concurrent(self) -> bool:
        """Whether actions of this plan run side by side in concurrency groups (`Action.concurrent`): the
        planner that groups them says so in `options` (systems/spatial.py), so no pass over the actions
        is needed to know."""
        return CONCURRENCY_OPTION in self.options

    # -- checks ----------------------------------------------------------------------------
    def validate(self, order: bool = False) -> None:
        """Structural checks every planner's output must pass (executors trust a valid plan); `order`:
        also that every ordered pair of ranks posts its messages in the same order on both sides
        (`check_p2p_order`), checked in the same pass."""
        ranks = set(range(self.world_size))
        for name, lay in self.layouts.items():
            lay.validate()
            if not set(lay.ranks) <= ranks:
                raise PlanError(f"layout.{name}.ranks: {lay.ranks} outside world size {self.world_size}")
        ids = [s.sample_id for s in self.samples]
        for module, per_rank in self.assignment.items():
            if module != "llm":
                continue
            # A long LLM sample run by a context-parallel group of data ranks (omni) is listed on each.
            shared = set(self.options.get("long_short", {}).get("llm_leaders", {}))
            once = [i for mbs in per_rank.values() for mb in mbs for i in mb if str(i) not in shared]
            listed = {i for mbs in per_rank.values() for mb in mbs for i in mb if str(i) in shared}
            seen = sorted(once + list(listed))
            if seen != sorted(ids):
                raise PlanError("assignment.llm: every sample must be assigned to exactly one LLM data rank")
        # Every send has its matching recv (boundary sends too); indexed so this stays linear in size,
        # in one pass over the actions (a plan at scale holds hundreds of thousands). With `order`, the
        # messages of every pair of ranks in the pass that lists them per pair: where they agree on both
        # sides every send is matched.
        if self.concurrent:
            check_concurrency(self)
        if order:
            sent, got = p2p_messages(self, check_kinds=True)
            if sent == got:
                return
        recvs: set[tuple] = set()
        sends: list[tuple[int, Action]] = []
        kinds = set(ACTION_KINDS)
        for rank, acts in self.actions.items():
            for b in acts:
                kind = b.kind
                if kind == RECV:
                    recvs.add((RECV, rank, b.peer, b.microbatch, b.what))
                elif kind == BOUNDARY:
                    if b.direction == "recv":
                        recvs.add((BOUNDARY, rank, b.peer, b.module, b.what, b.microbatch, b.peer_microbatch))
                    elif b.direction == "send":
                        sends.append((rank, b))
                elif kind == SEND:
                    sends.append((rank, b))
                elif kind not in kinds:
                    raise PlanError(f"actions[{rank}]: unknown kind {kind!r}; allowed: {', '.join(ACTION_KINDS)}")
        for rank, a in sends:
            if a.kind == SEND:
                if (RECV, a.peer, rank, a.microbatch, a.what) not in recvs:
                    raise PlanError(f"actions[{rank}]: {a} has no matching recv on rank {a.peer}")
            elif (BOUNDARY, a.peer, rank, a.module, a.what, a.peer_microbatch, a.microbatch) not in recvs:
                raise PlanError(f"actions[{rank}]: {a} has no matching boundary recv on rank {a.peer}")
        if order:
            check_message_order(sent, got)

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "system": self.system,
            "step": self.step,
            "world_size": self.world_size,
            "model": self.model,
            "samples": [s.to_dict() for s in self.samples],
            "layouts": {k: asdict(v) for k, v in self.layouts.items()},
            "assignment": {
                m: {str(r): [list(mb) for mb in mbs] for r, mbs in per.items()} for m, per in self.assignment.items()
            },
            "routes": [asdict(r) for r in self.routes],
            "actions": {str(r): [_action_dict(a) for a in acts] for r, acts in self.actions.items()},
            "options": self.options,
            "notes": self.notes,
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict) -> Plan:
        return Plan(
            system=d["system"],
            step=int(d["step"]),
            world_size=int(d["world_size"]),
            model=d["model"],
            samples=[Sample.from_dict(s) for s in d["samples"]],
            layouts={k: Layout(**{**v, "ranks": tuple(v["ranks"])}) for k, v in d["layouts"].items()},
            assignment={
                m: {int(r): [tuple(mb) for mb in mbs] for r, mbs in per.items()} for m, per in d["assignment"].items()
            },
            routes=[Route(**r) for r in d["routes"]],
            actions={int(r): [Action(**a) for a in acts] for r, acts in d["actions"].items()},
            options=d.get("options", {}),
            notes=d.get("notes", {}),
        )

    @staticmethod
    def from_json(text: str) -> Plan:
        return Plan.from_dict(json.loads(text))


def p2p_messages(plan: Plan, check_kinds: bool = False) -> tuple[dict[tuple, list[tuple]], dict[tuple, list[tuple]]]:
    """The messages each ordered pair of ranks (sender, receiver) posts, in order, on the sending side
    and on the receiving one (pipeline sends/recvs and boundary exchanges). NCCL matches point-to-point
    messages first-in first-out per pair. Interleaved 1F1B on 2 stages sends activations and gradients
    both ways between the same pair; Megatron-LM posts each step's pair of exchanges as one batched
    send/recv, so there only the order within each direction of tensors (activations, gradients) has to
    agree: such pairs are keyed by it too. `check_kinds`: an action of a kind not in ACTION_KINDS is
    refused on the way."""
    kinds = set(ACTION_KINDS) if check_kinds else None
    sent: dict[tuple, list[tuple]] = {}
    got: dict[tuple, list[tuple]] = {}
    split = "llm" in plan.layouts and plan.layouts["llm"].vpp > 1
    for rank, acts in plan.actions.items():
        for a in acts:
            kind = a.kind
            if kind == BOUNDARY:
                if a.direction == "send":
                    key = (rank, a.peer, "")
                    msg = ("boundary", a.module, a.what, a.microbatch, a.peer_microbatch)
                    out = sent
                elif a.direction == "recv":
                    key = (a.peer, rank, "")
                    msg = ("boundary", a.module, a.what, a.peer_microbatch, a.microbatch)
                    out = got
                else:
                    continue
            elif kind == SEND:
                key = (rank, a.peer, a.what if split else "")
                msg = ("p2p", a.module, a.what, a.microbatch, a.microbatch)
                out = sent
            elif kind == RECV:
                key = (a.peer, rank, a.what if split else "")
                msg = ("p2p", a.module, a.what, a.microbatch, a.microbatch)
                out = got
            else:
                if kinds is not None and kind not in kinds:
                    raise PlanError(f"actions[{rank}]: unknown kind {kind!r}; allowed: {', '.join(ACTION_KINDS)}")
                continue
            got_list = out.get(key)
            if got_list is None:
                out[key] = [msg]
            else:
                got_list.append(msg)
    return sent, got


def check_message_order(sent: dict[tuple, list[tuple]], got: dict[tuple, list[tuple]]) -> None:
    """That each pair of ranks lists the same messages in the same order on both sides (`p2p_messages`'
    two halves); the first pair that does not is named."""
    if sent != got:
        for pair in set(sent) | set(got):
            if sent.get(pair, []) != got.get(pair, []):
                raise PlanError(f"actions: messages {pair[0]} -> {pair[1]} are posted in different orders on each side")


def check_concurrency(plan: Plan) -> None:
    """Concurrency groups (`Action.concurrent`) are well formed: forward/backward actions only, each group
    listed together on its rank, every quota in (0, 1], one quota per lane, and the lanes' quotas summing
    to at most the whole device."""
    for rank, acts in plan.actions.items():
        done: set[int] = set()
        current = -1
        quotas: dict[str, float] = {}
        for a in acts:
            g = a.concurrent
            if g != current:
                if current >= 0:
                    done.add(current)
                    _check_quotas(rank, current, quotas)
                quotas = {}
                current = g
            if g < 0:
                continue
            if g in done:
                raise PlanError(f"actions[{rank}]: concurrency group {g} is not listed together")
            if a.kind not in (FORWARD, BACKWARD):
                raise PlanError(f"actions[{rank}]: {a}: only forward and backward run in a concurrency group")
            if not 0.0 < a.quota <= 1.0:
                raise PlanError(f"actions[{rank}]: {a}: quota must be in (0, 1], got {a.quota}")
            lane = lane_of(a)
            if quotas.setdefault(lane, a.quota) != a.quota:
                raise PlanError(f"actions[{rank}]: concurrency group {g} gives the {lane} lane two quotas")
        if current >= 0:
            _check_quotas(rank, current, quotas)


def _check_quotas(rank: int, group: int, quotas: dict[str, float]) -> None:
    if sum(quotas.values()) > 1.0 + 1e-9:
        raise PlanError(f"actions[{rank}]: concurrency group {group}: quotas {quotas} sum to more than the device")

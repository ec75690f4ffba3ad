"""Start a run: resolve defaults, refuse impossible layouts before any process starts, spawn the
ranks the way torchrun does (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT), watch
them, and turn the first failure into one error.

Inside an existing torchrun environment (`torchrun ... -m omnibench run ...`) this process *is*
a rank: it runs its share and rank 0 completes the record folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from omnibench.specs.parallel import ParallelSpec
from omnibench.specs.run import RunSpec
from workloads.sample import Batch, Sample

CPU_DEFAULT_MODEL = "tiny-omni"
CUDA_DEFAULT_MODEL = "omni-7b"
CUDA_TOKENS_PER_GPU = 16384  # global batch per GPU on CUDA when none is given (torchtitan's default is 8K x 2)


class RunFailed(RuntimeError):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank, self.text = rank, text


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch/cuda means the CPU path
        return 0


def under_torchrun() -> bool:
    """True inside a torchrun-started rank (not one of our own spawned ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get("OMNIBENCH_LAUNCHER") != "1"


def resolve(spec: RunSpec) -> RunSpec:
    """Fill every 0/auto default for this machine (see RunSpec) and validate."""
    spec.validate()
    gpus = _cuda_count() if spec.device in ("auto", "cuda") else 0
    if spec.device == "cuda" and not gpus:
        from omnibench.specs.model import SpecError

        raise SpecError("device=cuda but no CUDA device is visible")
    cuda = gpus > 0
    from omnibench.specs.presets import list_models

    model = spec.model or (CPU_DEFAULT_MODEL if not cuda else _cuda_default(list_models()))
    extra = dict(spec.extra)
    extra.update(
        device="cuda" if cuda else "cpu",
        backend="nccl" if cuda else "gloo",
        dtype=("bf16" if cuda else "fp32") if spec.dtype == "auto" else spec.dtype,
        threads=max(1, (os.cpu_count() or 1) // max(1, spec.nproc or 2)),
    )
    nproc = spec.nproc or (gpus if cuda else 2)
    if cuda and nproc > gpus and not under_torchrun():
        from omnibench.specs.model import SpecError

        raise SpecError(f"nproc={nproc} but {gpus} CUDA device(s) are visible: NCCL runs one rank per GPU (it "
                        f"refuses two ranks on one device); use --nproc {gpus} or fewer, or --device cpu")
    if under_torchrun():
        nproc = int(os.environ["WORLD_SIZE"])  # torchrun decided how many ranks there are
        if spec.nproc and spec.nproc != nproc:
            from omnibench.specs.model import SpecError

            raise SpecError(f"nproc={spec.nproc} but torchrun started WORLD_SIZE={nproc} ranks")
    return replace(
        spec,
        model=model,
        nproc=nproc,
        # CPU: tiny samples so a step takes a fraction of a second; GPU: the workload as written.
        length_scale=spec.length_scale or (1.0 if cuda else 0.02),
        global_batch_tokens=spec.global_batch_tokens or (CUDA_TOKENS_PER_GPU * nproc if cuda else 1536),
        # "auto" on CUDA is settled by the memory check (fit_to_device), which knows the device
        recompute="none" if spec.recompute == "auto" and not cuda else spec.recompute,
        max_sample_tokens=spec.max_sample_tokens or (0 if cuda else 384),
        extra=extra,
    )


def _cuda_default(names: list[str]) -> str:
    return CUDA_DEFAULT_MODEL if CUDA_DEFAULT_MODEL in names else next(n for n in names if not n.startswith("tiny"))


def parallel_spec(spec: RunSpec, world: int) -> ParallelSpec:
    return ParallelSpec(
        world_size=world, dp=spec.dp, tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep,
        microbatches=spec.microbatches, encoder_tp=spec.encoder_tp, encoder_ranks=spec.encoder_ranks, fsdp=spec.fsdp, dp_shard=spec.dp_shard,
        recompute=spec.recompute, options=dict(spec.options),
    )


def batch_source(spec: RunSpec) -> Callable[[int], Batch]:
    """Batches by step: replayed from --batches-file, else the workload stream (same on every rank)."""
    if spec.batches_file:
        with open(spec.batches_file) as f:
            raw = json.load(f)
        batches = [Batch(int(b["step"]), [Sample.from_dict(s) for s in b["samples"]]) for b in raw]
        return lambda step: batches[step % len(batches)]
    from workloads.stream import WorkloadStream

    stream = WorkloadStream(
        spec.workload, seed=spec.seed, global_batch_tokens=spec.global_batch_tokens,
        length_scale=spec.length_scale, max_sample_tokens=spec.max_sample_tokens or None,
    )
    return stream.batch


def runtime_limits(model, parallel: ParallelSpec) -> None:
    """Layouts a planner (and the simulator) accepts but this runtime cannot execute yet."""
    from omnibench.specs.model import SpecError

    llm, tp, cp = model.llm, parallel.tp, parallel.cp
    # Ulysses context parallelism splits each tp rank's heads again over cp ranks.
    if (llm.heads // tp) % cp or (llm.kv_heads // tp) % cp:
        raise SpecError(
            f"cp={cp} must divide the LLM's heads per tp rank ({llm.heads}/{tp} query, {llm.kv_heads}/{tp} kv) "
            "for Ulysses attention (the runtime has no ring attention yet)"
        )
    if parallel.pp > 1 and llm.tie_embeddings:
        raise SpecError(
            f"pp={parallel.pp} with tied embeddings ({llm.name}) is not supported by the runtime: the first and "
            "last stage would each train their own copy"
        )


def check_layout(spec: RunSpec) -> None:
    """Plan step 0 in this process: every impossible layout fails here with a one-line error."""
    from omnibench.specs.presets import get_model
    from systems import get_planner

    model = get_model(spec.model)
    parallel = parallel_spec(spec, spec.nproc)
    parallel.validate(model)
    runtime_limits(model, parallel)
    get_planner(spec.system).plan(model, parallel, batch_source(spec)(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: RunSpec, on_progress: Callable[[dict], None] | None = None) -> str:
    """Run `spec` (already resolved); returns the completed record folder."""
    from omnibench.runtime import records

    final = records.new_run_dir(spec.out, spec.system, spec.workload)
    if under_torchrun():
        return _as_torchrun_rank(spec, final)
    work = records.start(final)
    env = {**os.environ, "OMNIBENCH_LAUNCHER": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(spec.nproc), "OMP_NUM_THREADS": str(spec.extra.get("threads", 1)),
           "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH", "")]))}
    spec_json = json.dumps(spec.to_dict())
    procs = []
    for r in range(spec.nproc):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "omnibench.runtime.worker", spec_json, work],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True,
        ))
    seen = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            seen = _report_progress(work, seen, on_progress)
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                _stop(procs)
                raise _first_error(work, bad, [codes[r] for r in bad])
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    _report_progress(work, seen, on_progress)
    return records.complete(work)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report_progress(work: str, seen: int, cb) -> int:
    path = os.path.join(work, "progress.jsonl")
    if cb is None or not os.path.exists(path):
        return seen
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines[seen:]:
        try:
            cb(json.loads(line))
        except json.JSONDecodeError:
            return seen  # a line still being written; read it next time
        seen += 1
    return seen


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 3
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _first_error(work: str, bad: list[int], codes: list[int]) -> RunFailed:
    folder = os.path.join(work, "errors")
    found = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("rank") and name.endswith(".txt"):
                with open(os.path.join(folder, name)) as f:
                    stamp, _, text = f.read().partition("\n")
                found.append((float(stamp), int(name[4:-4]), text))
    if not found:
        return RunFailed(bad[0], f"exited with code {codes[0]} without an error report (killed, or it failed "
                                 "before it could start; see its output above)")
    _, rank, text = min(found)
    return RunFailed(rank, text.strip())


def _as_torchrun_rank(spec: RunSpec, final: str) -> str:
    from omnibench.runtime import records
    from omnibench.runtime.worker import run_rank
    from omnibench.specs.presets import get_model

    if not spec.out:
        final = records.torchrun_run_dir(os.path.dirname(final), spec.system, spec.workload, spec.timeout_s)
    work = final + records.INCOMPLETE
    if int(os.environ["RANK"]) == 0:
        if os.path.exists(work):
            shutil.rmtree(work)
        os.makedirs(work)
    else:
        deadline = time.time() + spec.timeout_s
        while not os.path.isdir(work) and time.time() < deadline:
            time.sleep(0.05)
    run_rank(spec, get_model(spec.model), work)
    if int(os.environ["RANK"]) == 0:
        return records.complete(work)
    return final

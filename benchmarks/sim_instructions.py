"""What planning and simulating one step cost in instructions, this tree against another.

    python benchmarks/sim_instructions.py --against /tmp/wt-base                     # omni mixed_video, 1,024 GPUs
    python benchmarks/sim_instructions.py --gpus 4096 --against /tmp/wt-base
    python benchmarks/sim_instructions.py --system homogeneous --workload image_sft --against /tmp/wt-base

The CPU seconds of `sim_scale.py` and `tune_speed.py` move with the host: on the shared 2-core machine the
same tree's 131,072-GPU step read 65 to 91 s within one evening, more than most cuts take off. This counts
instructions instead: each phase runs in its own process under valgrind's callgrind (`valgrind --tool=
callgrind`), with the hash seed fixed (PYTHONHASHSEED=0) and address-space randomisation off (`setarch -R`),
so a tree's count is the same from run to run (within about 0.5%: the heap a phase starts from depends on
what ran before it) whatever else the host does. Three processes per tree: the set-up alone (imports, the
batch, the cluster), then with `resolve_layout` and the planner (the step planned once, as `sim_scale.py`
plans it: `--recompute full`, the default layout), then with the simulation as well (`simulate`, which
frees its engine before it returns); each phase's count is the difference. Instructions are not seconds
(a cache miss costs many), but a cut that removes instructions and keeps the same data removes time.

Needs valgrind and setarch (util-linux); callgrind runs ~50x slower than the process: a 1,024-GPU omni
step takes about a minute per tree, 4,096 GPUs about four.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("setup", "plan", "sim")
SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")


def child(phase: str, system: str, workload: str, gpus: int) -> None:
    """One step of `system` up to `phase`, as sim_scale.py's `one` runs it (no timers, no profile)."""
    sys.path.insert(0, os.getcwd())  # the tree being measured (its checkout is the working folder)
    import systems
    from omnibench.cli.simulate import planner_options
    from omnibench.resolve import resolve_layout
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from simulator.engine import SimOptions, simulate
    from simulator.hardware import load_cluster
    from systems import get_planner
    from workloads.stream import WorkloadStream

    model = get_model("omni-7b")
    cluster = load_cluster("h100", gpus)
    batch = WorkloadStream(workload, seed=0, global_batch_tokens=4096 * gpus).batch(0)
    given = ParallelSpec(world_size=gpus, gpus_per_node=cluster.gpus_per_node,
                         options=planner_options(system, {}, "h100"))
    with systems.cyclic_gc_paused():
        if phase in ("plan", "sim"):
            parallel = resolve_layout(system, model, given, [batch], cluster, recompute="full").parallel
            plan = get_planner(system).plan(model, parallel, batch)
        if phase == "sim":
            simulate(plan, model, cluster, options=SimOptions(recompute=parallel.recompute))
    sys.stdout.flush()
    os._exit(0)  # the process's own teardown is no phase's


def count(tree: str, phase: str, system: str, workload: str, gpus: int) -> int:
    """Instructions of one child process run in `tree` under callgrind."""
    cmd = ["setarch", "-R", "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
           os.path.abspath(__file__), "--child", phase, "--system", system, "--workload", workload,
           "--gpus", str(gpus)]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": tree}
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    m = re.search(r"Collected\s*:\s*(\d+)", res.stderr)
    if res.returncode != 0 or not m:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{tree}: the {phase} phase failed under callgrind: {tail}")
    return int(m.group(1))


def phases(tree: str, system: str, workload: str, gpus: int) -> dict[str, float]:
    """Millions of instructions of planning and of simulating in `tree`."""
    setup, plan, sim = (count(tree, p, system, workload, gpus) for p in PHASES)
    return {"plan": (plan - setup) / 1e6, "sim": (sim - plan) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="", help="another checkout to count beside this one")
    ap.add_argument("--system", default="omni")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.system, args.workload, args.gpus)
        return
    if args.system not in SYSTEMS:
        raise SystemExit(f"--system: {args.system!r} is not one of {', '.join(SYSTEMS)}")
    sys.path.insert(0, ROOT)
    from workloads.registry import workload_names

    if args.workload not in workload_names():
        raise SystemExit(f"--workload: {args.workload!r} is not one of {', '.join(workload_names())}")
    if args.gpus < 8 or args.gpus % 8:
        raise SystemExit(f"--gpus: a multiple of 8 (whole nodes), got {args.gpus}")
    trees = [ROOT] + ([os.path.abspath(args.against)] if args.against else [])
    for t in trees[1:]:
        if not os.path.isfile(os.path.join(t, "omnibench", "__main__.py")):
            raise SystemExit(f"--against: {t} is not an omnibench checkout (no omnibench/__main__.py)")
    for tool in ("valgrind", "setarch"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool}: not found (this benchmark counts instructions under valgrind's callgrind)")
    print(f"{args.system}, omni-7b, {args.workload}, {args.gpus:,} H100s, default layout, full recompute, 4,096 tokens/GPU")
    print("millions of instructions per phase (callgrind, PYTHONHASHSEED=0, setarch -R)")
    rows = {t: phases(t, args.system, args.workload, args.gpus) for t in trees}
    for t, r in rows.items():
        print(f"{t:40s} plan {r['plan']:10,.0f}   sim {r['sim']:10,.0f}")
    if args.against:
        a, b = rows[trees[0]], rows[trees[1]]
        print(f"this tree / {trees[1]}: plan {a['plan'] / b['plan']:.3f}, sim {a['sim'] / b['sim']:.3f}")


if __name__ == "__main__":
    main()

"""The simulator's own cost against cluster size, side by side in one run.

    python benchmarks/sim_scale.py [--gpus 1024,16384,131072] [--limit-s 600]
    python benchmarks/sim_scale.py --gpus 16384 --profile 30     # where the time goes (cProfile: layout, plan, sim)
    python benchmarks/sim_scale.py --reference --gpus 1024,4096  # the simpy loop (SimpyEngine)
    python benchmarks/sim_scale.py --recompute auto --gpus 1024,16384  # the command as typed: recompute settled

One omni `mixed_video` step with full recomputation (the reference case) per size, each in
a fresh process so its peak memory (max RSS) is its own, and then all five systems at 1,024 GPUs
(each at its default layout, full recomputation) in one process. Per size: workload generation
("batch"), the layout (`resolve_layout` as `simulate --recompute full` calls it: the default
layout, checked by planning the step), planning (the check's plan handed over, `systems.offer_plan`;
`--plan-twice` plans again, as before), simulation (`sim`:
`sim_seconds`; under `--recompute auto` the step's programs are built in the layout phase's memory
check, which `sim_seconds` counts and the `sim` column does not), their total, max RSS, and the total's ratio to the 1,024-GPU total (wall / CPU). Every phase is
given in wall seconds and in CPU seconds of the process: on a shared host the wall clock also
counts other work, the CPU time does not. `--recompute auto` times the command as a user types it
instead: the layout phase then also checks each cheaper recompute mode's memory (omnibench/resolve.py),
and the step plays the engine that checked the chosen one. Targets printed beside the figures: 16,384 GPUs in
<= 10 s and <= 4x the 1,024 time, 131,072 in <= 60 s and <= 4 GB, all five at 1,024 in <= 5 s
together. A size that runs past `--limit-s` is reported as such, not guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYSTEMS = ("homogeneous", "temporal", "colocated", "noncolocated", "omni")
PHASES = ("batch", "layout", "plan", "sim")


def one(system: str, gpus: int, workload: str, model_name: str, reference: bool = False, profile: int = 0,
        plan_twice: bool = False, recompute: str = "full") -> dict:
    """Generate, check the default layout, plan and simulate one step; wall and CPU seconds."""
    import resource

    import systems
    from omnibench.cli.simulate import planner_options
    from omnibench.resolve import resolve_layout
    from omnibench.specs.parallel import ParallelSpec
    from omnibench.specs.presets import get_model
    from simulator.engine import Engine, SimOptions, simulate
    from simulator.hardware import load_cluster
    from systems import get_planner
    from workloads.stream import WorkloadStream

    engine = Engine
    if reference:
        from simulator.engine_simpy import SimpyEngine as engine
    model = get_model(model_name)
    cluster = load_cluster("h100", gpus)
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile(time.process_time)

    def timed(name, f):
        w, c = time.perf_counter(), time.process_time()
        # the layout check holds the step's planning (its plan is handed over): profiled with it
        if prof is not None and name in ("layout", "plan", "sim"):
            prof.enable()
        out = f()
        if prof is not None:
            prof.disable()
        wall[name], cpu[name] = time.perf_counter() - w, time.process_time() - c
        return out

    batch = timed("batch", lambda: WorkloadStream(workload, seed=0, global_batch_tokens=4096 * gpus).batch(0))
    # as `simulate --recompute full` settles it: omni plans with the hardware's cost model, the
    # default layout checked by planning the step (resolve_layout), which then plans it once more
    # unless that check's plan is handed over (systems.offer_plan; `--plan-twice` refuses it)
    given = ParallelSpec(world_size=gpus, gpus_per_node=cluster.gpus_per_node,
                         options=planner_options(system, {}, "h100"))
    # in one pause of the cyclic GC, as `simulate` holds one over a step's layout, planning and simulation
    with systems.cyclic_gc_paused():
        parallel = timed("layout", lambda: resolve_layout(system, model, given, [batch], cluster,
                                                          recompute=recompute)).parallel
        if plan_twice:
            systems.drop_spare_plan()
        plan = timed("plan", lambda: get_planner(system).plan(model, parallel, batch))
        opts = SimOptions(recompute=parallel.recompute)
        # `simulate` plays the engine that checked the chosen mode's memory (recompute auto), as the command does
        r = timed("sim", lambda: engine(plan, model, cluster, options=opts).run() if reference
                  else simulate(plan, model, cluster, options=opts))
    out = {"system": system, "gpus": gpus, "layout": f"tp {parallel.tp}, pp {parallel.pp}, cp {parallel.cp}",
           "recompute": parallel.recompute,
           "wall": wall, "cpu": cpu, "total_s": sum(wall.values()), "total_cpu_s": sum(cpu.values()),
           "step_s": r.step_time, "distinct": r.classes, "actions": sum(len(a) for a in plan.actions.values()),
           "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if prof is not None:
        import io
        import pstats

        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile)
        out["profile"] = s.getvalue()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1024,16384,131072")
    ap.add_argument("--workload", default="mixed_video")
    ap.add_argument("--model", default="omni-7b")
    ap.add_argument("--limit-s", type=int, default=600, help="per size; a size past it is reported, not guessed")
    ap.add_argument("--reference", action="store_true", help="simulate with the simpy loop (SimpyEngine)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions of layout + plan + sim per size")
    ap.add_argument("--no-five", action="store_true", help="skip the five systems at 1,024 GPUs")
    ap.add_argument("--plan-twice", action="store_true",
                    help="plan the step again after the layout check (as before systems.offer_plan)")
    ap.add_argument("--recompute", default="full", choices=("full", "auto"),
                    help="full: the reference case (every module recomputed); auto: the command as typed (each cheaper mode's memory "
                         "checked in the layout phase, the chosen mode's engine played)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        system, gpus = args.child.split(":")
        print(json.dumps(one(system, int(gpus), args.workload, args.model, args.reference, args.profile,
                             args.plan_twice, args.recompute)))
        return
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start (wall times scale with "
          f"it; CPU times much less)")
    how = "full recompute" if args.recompute == "full" else "recompute auto (the command as typed)"
    print(f"omni, {args.model}, {args.workload}, h100, default layout, {how}, 4,096 tokens/GPU"
          + (", simpy reference loop" if args.reference else "") + (", planned twice" if args.plan_twice else ""))
    print("seconds per phase as wall / CPU")
    print(f"{'GPUs':>7} {'batch':>11} {'layout':>11} {'plan':>11} {'sim':>11} {'total':>13} {'x1024':>10} "
          f"{'RSS GiB':>8} {'distinct':>9} {'actions':>10}  target")
    base = None
    for n in [int(x) for x in args.gpus.split(",")]:
        cmd = [sys.executable, __file__, "--child", f"omni:{n}", "--workload", args.workload, "--model", args.model,
               "--profile", str(args.profile), "--recompute", args.recompute] + (["--reference"] if args.reference else []) \
            + (["--plan-twice"] if args.plan_twice else [])
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit_s, check=True)
        except subprocess.TimeoutExpired:
            print(f"{n:>7}  did not finish in {args.limit_s} s")
            continue
        except subprocess.CalledProcessError as e:
            print(f"{n:>7}  failed: {(e.stderr or '').strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = (r["total_s"], r["total_cpu_s"]) if n == 1024 else base
        ratio = f"{r['total_s'] / base[0]:.1f}/{r['total_cpu_s'] / base[1]:.1f}" if base else "-"
        target = {16384: "<= 10 s, <= 4x", 131072: "<= 60 s, <= 4 GB"}.get(n, "")
        cells = " ".join(f"{r['wall'][p]:>5.2f}/{r['cpu'][p]:<5.2f}" for p in PHASES)
        print(f"{n:>7} {cells} {r['total_s']:>6.2f}/{r['total_cpu_s']:<6.2f} {ratio:>10} {r['max_rss_gib']:>8.2f} "
              f"{r['distinct']:>9} {r['actions']:>10}  {target}", flush=True)
        if args.profile:
            print(r["profile"])
    if args.no_five:
        return
    w, c = time.perf_counter(), time.process_time()
    rows = [one(s, 1024, args.workload, args.model, args.reference, plan_twice=args.plan_twice,
                recompute=args.recompute) for s in SYSTEMS]
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    print(f"all five systems at 1,024 GPUs: {wall:.2f} s wall / {cpu:.2f} s CPU together (target <= 5 s): "
          + ", ".join(f"{r['system']} {r['total_s']:.2f}/{r['total_cpu_s']:.2f}" for r in rows))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

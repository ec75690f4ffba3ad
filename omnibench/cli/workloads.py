"""`omnibench workloads list | show | batch`: the named workloads, what they look like over a
run, and the exact samples of one step (no torch)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from omnibench.cli.common import atomic_write, console, fail, os_error_line, writable_file, writing

# Options shared by `show` and `batch` (one definition each).
WorkloadName = Annotated[str, typer.Argument(help="Named workload, or a TOML/YAML/JSON spec or JSONL trace path.")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Stream seed.")]
GlobalBatchTokens = Annotated[
    int, typer.Option("--global-batch-tokens", min=1, help="Token budget of a global batch (LLM tokens).")
]
GlobalBatchSize = Annotated[
    int | None,
    typer.Option("--global-batch-size", min=1, help="Samples per global batch (replaces the token budget)."),
]
LengthScale = Annotated[float, typer.Option("--length-scale", help="Multiply raw sizes before token rules.")]
MaxSampleTokens = Annotated[
    int | None, typer.Option("--max-sample-tokens", min=1, help="Drop-and-redraw samples longer than this.")
]
TotalSteps = Annotated[
    int | None, typer.Option("--total-steps", min=1, help="Override the workload's nominal training length.")
]

_SHOW_EXAMPLES = """
Examples:

  omnibench workloads show mixed_video

  omnibench workloads show mixed_video --steps 200 --json

  omnibench workloads show llava_ov --global-batch-tokens 65536 --plot llava_ov.png

  omnibench workloads show my_mix.toml --total-steps 5000 --length-scale 0.1

  omnibench workloads show my_trace.jsonl --global-batch-size 256

  omnibench workloads show bursty_mix --start 0 --steps 300   # consecutive steps: see the bursts
"""


def _emit(text: str) -> None:
    """Write to standard output; a full disk or a reader gone (`> /dev/full`, `| head`) ends the command
    with one line, exit 1, never a traceback."""
    import os

    try:
        sys.stdout.write(text)
        sys.stdout.flush()  # here, inside the check: buffered output would fail at exit, past any handler
    except OSError as e:
        # what could not be written is dropped: the interpreter's last flush at exit must not fail again
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        what = "standard output (its reader is gone)" if isinstance(e, BrokenPipeError) else "standard output"
        fail(os_error_line(e, what), code=1)


def _stream(name, seed, global_batch_tokens, global_batch_size, length_scale, max_sample_tokens, total_steps):
    from workloads import WorkloadError, WorkloadStream

    try:
        if global_batch_size is not None:
            global_batch_tokens = None
        return WorkloadStream(
            name,
            seed=seed,
            global_batch_tokens=global_batch_tokens,
            global_batch_size=global_batch_size,
            length_scale=length_scale,
            max_sample_tokens=max_sample_tokens,
            total_steps=total_steps,
        )
    except WorkloadError as exc:
        fail(str(exc))


def _f(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return f"{x:,}"


def _print_summary(s: dict) -> None:
    b = s["batch"]
    mode = (
        f"global_batch_tokens={b['global_batch_tokens']:,}"
        if b["global_batch_tokens"]
        else f"global_batch_size={b['global_batch_size']:,}"
    )
    console.print(f"[bold]{s['workload']}[/]: {s['description']}", highlight=False)
    console.print(
        f"origin {s['origin']} | schedule {s['schedule']['kind']} | {s['steps_drawn']} steps drawn over "
        f"total_steps={s['total_steps']:,} | seed {s['seed']} | {mode} | length_scale {b['length_scale']:g} | "
        f"max_sample_tokens {_f(b['max_sample_tokens'])}",
        highlight=False,
    )

    phases = s["schedule"]["phases"]
    sources = sorted({k for p in phases for k in p["weights"]})
    t = Table(title="mixture by phase (sample weights; length x = raw-size multiplier)")
    t.add_column("phase")
    for src in sources:
        t.add_column(src, justify="right")
    t.add_column("extra")
    for p in phases:
        extra = []
        if "until_step" in p:
            extra.append(f"until step {p['until_step']:,}")
        if "mean_steps" in p:
            extra.append(f"mean {p['mean_steps']:g} steps")
        if "max_sample_tokens" in p:
            extra.append(f"cap {p['max_sample_tokens']:,} tok")
        t.add_row(
            p["name"],
            *[
                (
                    f"{p['weights'].get(src, 0):.2f}"
                    + (f" x{p['length'][src]:g}" if src in p.get("length", {}) else "")
                )
                for src in sources
            ],
            ", ".join(extra),
        )
    console.print(t)

    pts = s["mix_over_steps"]
    if len(pts) > 1 and s["schedule"]["kind"] != "constant":
        t = Table(title="mixture over the drawn steps")
        t.add_column("step", justify="right")
        t.add_column("phase")
        names = list(pts[0]["weights"])
        for n in names:
            t.add_column(n, justify="right")
        idx = sorted({round(i * (len(pts) - 1) / 4) for i in range(5)})
        if s["schedule"]["kind"] == "bursty":  # show every regime change among the drawn steps
            idx = [0] + [i for i in range(1, len(pts)) if pts[i]["phase"] != pts[i - 1]["phase"]][:12]
        for i in idx:
            p = pts[i]
            t.add_row(f"{p['step']:,}", p["phase"], *[f"{p['weights'][n]:.2f}" for n in names])
        console.print(t)
        if s["schedule"]["kind"] in ("bursty", "staged"):
            from collections import Counter

            share = Counter(p["phase"] for p in pts)
            changes = sum(a["phase"] != b["phase"] for a, b in zip(pts, pts[1:], strict=False))
            console.print(
                "share of drawn steps per phase: "
                + ", ".join(f"{k} {100 * v / len(pts):.0f}%" for k, v in share.most_common())
                + f"; {changes} changes between drawn steps",
                highlight=False,
            )

    o = s["overall"]
    pcols = ("p10", "p50", "p90", "p99", "max")
    t = Table(title=f"LLM tokens per segment, all {o['batches']} batches ({o['samples']:,} samples)")
    for col in ("modality", "samples %", "tokens %") + pcols:
        t.add_column(col, justify="left" if col == "modality" else "right")
    for m, e in o["modalities"].items():
        t.add_row(
            m,
            f"{100 * e['share_of_samples']:.1f}",
            f"{100 * e['share_of_llm_tokens']:.1f}",
            *[f"{e['llm_tokens'][k]:,}" for k in pcols],
        )
    console.print(t)
    t = Table(title="encoder sequence length per segment (positions before the merge/pooling)")
    for col in ("modality", "segments") + pcols:
        t.add_column(col, justify="left" if col == "modality" else "right")
    for m, e in o["modalities"].items():
        if "encoder_seq_len" in e:
            t.add_row(m, f"{e['segments']:,}", *[f"{e['encoder_seq_len'][k]:,}" for k in pcols])
    console.print(t)

    t = Table(title="how much batches differ (per global batch)")
    for col in ("quantity", "min", "mean", "max", "max/min", "CV"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for k, v in o["batch_variation"].items():
        t.add_row(
            k.replace("_", " "), _f(v["min"]), _f(v["mean"]), _f(v["max"]), _f(v["max_over_min"]), _f(v["cv"])
        )
    console.print(t)
    console.print(f"[dim]encoder work: {s['encoder_work_definition']}[/]", highlight=False)

    a, z = s["first_window"], s["last_window"]
    t = Table(
        title=f"first window (steps {a['steps'][0]:,}-{a['steps'][1]:,}) -> last window "
        f"(steps {z['steps'][0]:,}-{z['steps'][1]:,})"
    )
    for col in ("modality", "samples %", "LLM tok %", "LLM tok p50", "LLM tok p90"):
        t.add_column(col, justify="left" if col == "modality" else "right")
    for m in sorted(set(a["modalities"]) | set(z["modalities"])):
        ea, ez = a["modalities"].get(m), z["modalities"].get(m)

        def pair(key, scale=1.0, fmt="{:.1f}", ea=ea, ez=ez):
            va = fmt.format(ea[key] * scale) if ea else "-"
            vz = fmt.format(ez[key] * scale) if ez else "-"
            return f"{va} -> {vz}"

        t.add_row(
            m,
            pair("share_of_samples", 100),
            pair("share_of_llm_tokens", 100),
            pair("llm_tokens_p50", 1, "{:,.0f}"),
            pair("llm_tokens_p90", 1, "{:,.0f}"),
        )
    wa, wz = a["batch_variation"]["encoder_work_tflop"], z["batch_variation"]["encoder_work_tflop"]
    t.add_row(
        "encoder work/batch",
        "",
        "",
        f"mean {_f(wa['mean'])} -> {_f(wz['mean'])} TFLOP",
        f"CV {_f(wa['cv'])} -> {_f(wz['cv'])}",
    )
    console.print(t)


def _plot(summary: dict, rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd
    import seaborn as sns

    from workloads.sample import MODALITIES

    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    mods = np.asarray(MODALITIES, dtype=object)[rows.seg_mod]
    order = [m for m in MODALITIES if m in set(mods.tolist())]
    palette = dict(zip(MODALITIES, sns.color_palette("deep", len(MODALITIES)), strict=True))
    seg = pd.DataFrame({"modality": mods, "llm_tokens": rows.seg_tok, "encoder_seq_len": rows.seg_enc})
    seg = seg[seg.llm_tokens > 0]
    sns.ecdfplot(
        data=seg,
        x="llm_tokens",
        hue="modality",
        hue_order=order,
        palette=palette,
        log_scale=True,
        ax=axes[0, 0],
    )
    axes[0, 0].set_title("LLM tokens per segment (ECDF)")
    enc = seg[seg.modality != "text"]
    if len(enc):
        sns.ecdfplot(
            data=enc,
            x="encoder_seq_len",
            hue="modality",
            hue_order=[m for m in order if m != "text"],
            palette=palette,
            log_scale=True,
            ax=axes[0, 1],
        )
    axes[0, 1].set_title("encoder sequence length per segment (ECDF)")

    pts = summary["mix_over_steps"]
    steps = [p["step"] for p in pts]
    names = list(pts[0]["weights"])
    ys = np.array([[p["weights"][n] for p in pts] for n in names])
    axes[1, 0].stackplot(steps, ys, labels=names, colors=sns.color_palette("muted", len(names)), alpha=0.85)
    axes[1, 0].set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    axes[1, 0].set_ylim(0, 1)
    axes[1, 0].set_xlabel("step")
    axes[1, 0].set_ylabel("sample weight")
    axes[1, 0].set_title(f"mixture over steps ({summary['schedule']['kind']} schedule)")
    axes[1, 0].legend(loc="upper left", fontsize="small", ncol=2, framealpha=0.8)

    pb = pd.DataFrame(summary["per_batch"])
    long = pd.concat(
        [
            pd.DataFrame({"step": pb.step, "TFLOP": pb.vision_work_tflop, "encoder": "vision"}),
            pd.DataFrame({"step": pb.step, "TFLOP": pb.audio_work_tflop, "encoder": "audio"}),
        ]
    )
    long = long[long.groupby("encoder").TFLOP.transform("sum") > 0]
    if len(long):
        sns.lineplot(data=long, x="step", y="TFLOP", hue="encoder", ax=axes[1, 1], linewidth=1)
        axes[1, 1].legend(loc="upper left", fontsize="small", framealpha=0.8, title="encoder")
    ax2 = axes[1, 1].twinx()
    ax2.plot(pb.step, pb.llm_tokens, color="0.5", linewidth=0.8, alpha=0.6, label="LLM tokens")
    ax2.set_ylabel("LLM tokens per batch", color="0.4")
    ax2.grid(False)
    axes[1, 1].set_title("per-batch encoder work (fwd TFLOP) and LLM tokens")
    b = summary["batch"]
    mode = (
        f"{b['global_batch_tokens']:,} tokens/batch"
        if b["global_batch_tokens"]
        else f"{b['global_batch_size']:,} samples/batch"
    )
    fig.suptitle(
        f"{summary['workload']}: {summary['description']}\n{mode}, length_scale {b['length_scale']:g}, "
        f"seed {summary['seed']}, {summary['steps_drawn']} steps over {summary['total_steps']:,}",
        fontsize=11,
    )
    fig.tight_layout()
    import io

    # rendered in memory, then written whole or not at all: a full disk leaves no truncated figure
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lower().lstrip("."), dpi=110)
    plt.close(fig)
    with writing(path):
        try:
            atomic_write(path, buf.getvalue())
        except OSError as e:
            e.filename = str(path)  # the figure, not atomic_write's temporary file beside it
            raise


def register(app: typer.Typer) -> None:
    wl = typer.Typer(
        help="Workloads: list the named ones, show one's mix and length distributions over a run, "
        "print a step's batch.\n\nExamples:\n\n  omnibench workloads list\n\n"
        "  omnibench workloads show mixed_video --steps 200 --json\n\n"
        "  omnibench workloads batch omni_av --step 900 --global-batch-tokens 32768",
        no_args_is_help=True,
    )
    app.add_typer(wl, name="workloads")

    @wl.command("list")
    def list_cmd(
        as_json: bool = typer.Option(False, "--json", help="Print {name: description} as JSON."),
    ) -> None:
        """Every named workload with a one-line description.

        Any command that takes a workload NAME also takes a path to a TOML/YAML/JSON workload
        file or a JSONL trace, and two fixed-shape families by name: pretrain_<N> (every sample N
        text tokens) and image_text_<I>_<T> (every sample one image of I LLM tokens, then T text
        tokens), the shapes of the published runs `validate --published` simulates.

        Examples:

          omnibench workloads list

          omnibench workloads list --json
        """
        from workloads import list_workloads

        items = list_workloads()
        if as_json:
            _emit(json.dumps(items, indent=2) + "\n")
            return
        t = Table(title="named workloads", caption="also by name: pretrain_<N> (N text tokens a sample), "
                  "image_text_<I>_<T> (one I-token image, then T text tokens)")
        t.add_column("name")
        t.add_column("description")
        for name, desc in items.items():
            t.add_row(name, desc)
        console.print(t)

    @wl.command("show", epilog=_SHOW_EXAMPLES)
    def show_cmd(
        name: WorkloadName,
        steps: int = typer.Option(
            100, "--steps", min=1, help="Steps to draw, spread evenly over total_steps."
        ),
        start: int | None = typer.Option(
            None, "--start", min=0, help="Draw consecutive steps from this one instead of spreading them."
        ),
        seed: Seed = 0,
        global_batch_tokens: GlobalBatchTokens = 131072,
        global_batch_size: GlobalBatchSize = None,
        length_scale: LengthScale = 1.0,
        max_sample_tokens: MaxSampleTokens = None,
        total_steps: TotalSteps = None,
        as_json: bool = typer.Option(
            False, "--json", help="Print the summary as one JSON document on stdout."
        ),
        plot: Path | None = typer.Option(
            None,
            "--plot",
            help="Write a figure (PNG/PDF/SVG) of the distributions per modality and the mix over steps.",
        ),
    ) -> None:
        """Mixture per phase, per-modality share of samples and tokens, length percentiles of LLM
        tokens and encoder sequences, how much batches differ, and first vs last window."""
        from workloads.stats import collect, sample_steps, summarize

        if plot is not None:  # before drawing the steps, which a figure that cannot be written would lose
            if plot.suffix.lower() not in (".png", ".pdf", ".svg"):
                fail(f"plot: file must end in .png, .pdf or .svg, got {plot.name!r}")
            writable_file(plot, "plot")
        stream = _stream(
            name, seed, global_batch_tokens, global_batch_size, length_scale, max_sample_tokens, total_steps
        )
        from workloads import WorkloadError

        try:
            drawn = sample_steps(steps, stream.total_steps, start)
            rows = collect(stream, drawn)
            summary = summarize(stream, drawn, rows)
        except WorkloadError as exc:
            fail(str(exc))
        if plot is not None:
            _plot(summary, rows, plot)
        if as_json:
            _emit(json.dumps(summary) + "\n")
            return
        _print_summary(summary)
        if plot is not None:
            console.print(f"figure written to {plot}", highlight=False)

    @wl.command("batch")
    def batch_cmd(
        name: WorkloadName,
        step: int = typer.Option(0, "--step", min=0, help="Training step."),
        seed: Seed = 0,
        global_batch_tokens: GlobalBatchTokens = 131072,
        global_batch_size: GlobalBatchSize = None,
        length_scale: LengthScale = 1.0,
        max_sample_tokens: MaxSampleTokens = None,
        total_steps: TotalSteps = None,
    ) -> None:
        """Print the global batch of one step as JSON lines, one sample per line (the exact
        samples every system and the simulator get for that step).

        Examples:

          omnibench workloads batch mixed_video --step 10 --global-batch-tokens 8192

          omnibench workloads batch omni_av --step 900 --global-batch-size 4 | jq .source
        """
        stream = _stream(
            name, seed, global_batch_tokens, global_batch_size, length_scale, max_sample_tokens, total_steps
        )
        from workloads import WorkloadError

        try:
            batch = stream.batch(step)
        except WorkloadError as exc:
            fail(str(exc))
        _emit("".join(json.dumps(s.to_dict()) + "\n" for s in batch.samples))

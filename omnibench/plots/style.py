"""One look for every figure: a fixed colour per system, per module and per modality, sizes that
stay legible at column width (3.3 in) and double column (6.9 in), and PNG + PDF output."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # figures are files; never open a window (CLI, tests, headless machines)

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

# Order is the order systems are listed and plotted (systems.SYSTEMS); colours come from seaborn's
# colour-blind palette and never change with which systems a figure happens to show.
SYSTEM_ORDER = ("homogeneous", "temporal", "colocated", "noncolocated", "omni", "spatial")
_CB = sns.color_palette("colorblind", 10)
SYSTEM_COLORS = {
    "homogeneous": _CB[7],  # grey: the status-quo baseline
    "temporal": _CB[0],
    "colocated": _CB[2],
    "noncolocated": _CB[4],
    "omni": _CB[3],  # the one the paper is about stands out
    "spatial": _CB[9],
}
MODULE_COLORS = {"vision": _CB[0], "audio": _CB[2], "llm": _CB[1], "all": _CB[7]}
# Modalities get the palette entries no system uses, so a modality is never read as a system.
MODALITY_COLORS = {"text": _CB[5], "image": _CB[1], "video": _CB[6], "audio": _CB[8]}
# Waiting on a slower data-parallel peer: a hue apart from the modules' and the greys of the other parts.
IMBALANCE_COLOR = _CB[8]

COLUMN_IN = 3.3
DOUBLE_IN = 6.9
DPI = 200


def system_color(system: str):
    return SYSTEM_COLORS.get(system, _CB[9])


def module_color(module: str):
    return MODULE_COLORS.get(module, _CB[8])


def order_systems(systems) -> list[str]:
    """Known systems in their fixed order, then anything else alphabetically."""
    known = [s for s in SYSTEM_ORDER if s in systems]
    return known + sorted(s for s in set(systems) if s not in SYSTEM_ORDER)


def apply_theme() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=0.95)
    plt.rcParams.update({
        "figure.dpi": 100,
        "savefig.bbox": "tight",
        "savefig.pad_inches": 0.02,
        "axes.titlesize": 8.5,
        "axes.labelsize": 8,
        "xtick.labelsize": 7,
        "ytick.labelsize": 7,
        "legend.fontsize": 6.5,
        "legend.title_fontsize": 7,
        "pdf.fonttype": 42,  # TrueType in PDFs: editable text, accepted by paper submission systems
        "ps.fonttype": 42,
    })


def save(fig, out_dir: str | Path, name: str, prov: dict | None = None) -> list[Path]:
    """Write `<name>.png` (dpi 200) and `<name>.pdf`, each naming in its metadata the commit (and
    dirty flag) and the command that drew it (`provenance.figure_provenance`); return both paths."""
    import io

    from omnibench.cli.common import atomic_write
    from omnibench.provenance import figure_provenance

    prov = prov or figure_provenance()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    # Both rendered in memory before either file is touched, each then written whole or not at all: a
    # full disk leaves the earlier file (or none) in its place, never a truncated one.
    png, pdf = io.BytesIO(), io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI, metadata=png_metadata(prov))
    fig.savefig(pdf, format="pdf", metadata=pdf_metadata(prov))
    for path, data in zip(paths, (png, pdf), strict=True):
        try:
            atomic_write(path, data.getvalue())
        except OSError as e:
            e.filename = str(path)  # the figure, not atomic_write's temporary file beside it
            raise
    return paths


def png_metadata(prov: dict) -> dict:
    """PNG text chunks: the standard Software / Source / Comment keys, and machine-readable ones."""
    from omnibench.provenance import provenance_text

    return {"Software": f"omnibench {prov.get('omnibench') or ''}".strip(), "Source": provenance_text(prov),
            "Comment": prov.get("command", ""), "omnibench:commit": str(prov.get("commit")),
            "omnibench:dirty": str(prov.get("dirty")), "omnibench:command": prov.get("command", "")}


def pdf_metadata(prov: dict) -> dict:
    """PDF document info (standard keys only): Creator, and the provenance line as Subject."""
    from omnibench.provenance import provenance_text

    return {"Creator": f"omnibench {prov.get('omnibench') or ''}".strip(), "Subject": provenance_text(prov),
            "Keywords": f"commit={prov.get('commit')} dirty={prov.get('dirty')}"}


def lighten(color, amount: float = 0.5):
    """`color` mixed with white (variants of one system keep its hue)."""
    import matplotlib.colors as mc

    r, g, b = mc.to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)

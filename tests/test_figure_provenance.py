"""A reader of any figure can tell which code and command made it: every PNG and PDF names the commit
(and whether the checkout had uncommitted changes) and the command in its metadata, and report.html
says the same at the top, under every figure and at the end (inline PNGs carry it too)."""

from __future__ import annotations

import base64
import io
import json
import re
import zlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from omnibench.plots import style  # noqa: E402
from omnibench.provenance import figure_provenance, git_state  # noqa: E402

pytestmark = pytest.mark.timeout(120)
PROV = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True, "omnibench": "0.1.0",
        "command": "omnibench plot throughput results/sims/x --out figs"}


def _pdf_text(data: bytes) -> str:
    """The PDF's document info and any compressed streams, as text (matplotlib writes the info plain)."""
    text = data.decode("latin-1")
    for m in re.finditer(rb"stream\r?\n(.*?)endstream", data, flags=re.S):
        try:
            text += zlib.decompress(m.group(1)).decode("latin-1")
        except zlib.error:
            pass
    return text


def test_a_saved_figure_names_its_commit_dirty_flag_and_command_in_png_and_pdf_metadata(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 2])
    png, pdf = style.save(fig, tmp_path, "f", prov=PROV)
    plt.close(fig)
    meta = Image.open(png).text
    assert meta["omnibench:commit"] == PROV["commit"] and meta["omnibench:dirty"] == "True"
    assert meta["omnibench:command"] == PROV["command"] and meta["Comment"] == PROV["command"]
    assert "commit 0123456789ab with uncommitted changes" in meta["Source"]
    info = _pdf_text(pdf.read_bytes())
    assert "commit 0123456789ab with uncommitted changes" in info and PROV["command"] in info
    assert f"commit={PROV['commit']} dirty=True" in info


def test_without_an_explicit_provenance_a_figure_names_this_checkout_and_this_process_command(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 2])
    png, _ = style.save(fig, tmp_path, "f")
    plt.close(fig)
    meta = Image.open(png).text
    here = git_state()
    assert meta["omnibench:commit"] == str(here["commit"]) and meta["omnibench:dirty"] == str(here["dirty"])
    assert meta["omnibench:command"] == figure_provenance()["command"]


def test_report_html_names_commit_and_command_on_the_page_under_each_figure_and_in_its_images(tmp_path):
    from omnibench.plots.load import Records
    from omnibench.plots.report import Section, write_html

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 2])
    import pandas as pd

    from omnibench.plots.figures import Drawn

    drawn = Drawn(fig=fig, name="x", caption="a caption", table=pd.DataFrame({"a": [1]}))
    path = tmp_path / "report.html"
    write_html([Section("One figure", drawn)], Records(), path, prov=PROV)
    page = path.read_text()
    line = "made by `omnibench plot throughput results/sims/x --out figs` at omnibench commit 0123456789ab with " \
           "uncommitted changes"
    assert page.count(line) >= 3  # top of the page, under the figure, at the end
    img = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1)
    meta = Image.open(io.BytesIO(base64.b64decode(img))).text
    assert meta["omnibench:commit"] == PROV["commit"] and meta["omnibench:command"] == PROV["command"]


def test_plot_command_writes_its_own_command_line_into_the_figure(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-m", "omnibench", "plot", "workload", "--workload", "image_sft", "--out",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    meta = Image.open(tmp_path / "workload.png").text
    assert meta["omnibench:command"] == f"omnibench plot workload --workload image_sft --out {tmp_path}"
    assert json.loads(json.dumps(meta))  # plain text, nothing binary

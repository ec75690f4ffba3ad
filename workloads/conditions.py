"""A grid of synthetic workloads that moves one condition at a time, to find where decoupling the
encoders from the LLM pays:

- encoder share: the share of samples that carry a video (the rest are text-only SFT samples), which
  sets how much of a step is encoder work;
- length variance: the lognormal sigma of the videos' durations around a fixed median (20 s, clipped
  to 2 s - 3 min as LLaVA-Video-178K's buckets are), which sets how unequal samples are.

Cluster size is the third condition; the simulations choose it. `write_grid(folder)` writes one TOML
per cell; each is an ordinary workload file (`omnibench simulate --workload <file>`), named so that
`parse_cell` reads its coordinates back. No torch.
"""

from __future__ import annotations

import re
from pathlib import Path

VIDEO_SHARES = (0.1, 0.3, 0.6, 0.9)
SIGMAS = (0.25, 1.0)
MEDIAN_SECONDS = 20.0
_NAME = re.compile(r"^cond_video(\d{2,3})_sigma(\d{3})$")


def cell_name(video_share: float, sigma: float) -> str:
    return f"cond_video{round(100 * video_share):02d}_sigma{round(100 * sigma):03d}"


def parse_cell(name: str) -> tuple[float, float] | None:
    """(video share, sigma) of a grid cell's workload name, or None for any other workload."""
    m = _NAME.match(Path(name).stem)
    return (int(m.group(1)) / 100, int(m.group(2)) / 100) if m else None


def cell_toml(video_share: float, sigma: float) -> str:
    if not 0 < video_share < 1:
        raise ValueError(f"video_share must be between 0 and 1 (exclusive), got {video_share!r}")
    if not 0 < sigma <= 3:
        raise ValueError(f"sigma must be in (0, 3], got {sigma!r}")
    text = 1.0 - video_share
    return f'''# Synthetic condition cell (workloads/conditions.py): {100 * video_share:.0f}% video samples, video
# durations lognormal (median {MEDIAN_SECONDS:g} s, sigma {sigma:g}, 2 s - 3 min); the rest text-only SFT samples.
name = "{cell_name(video_share, sigma)}"
description = "Condition grid: {100 * video_share:.0f}% video samples, video length sigma {sigma:g}."
total_steps = 1000
max_sample_tokens = 32768

[vision]
preset = "utils"

[sources.text]
text_tokens = "sft_text_tokens"

[sources.video]
text_tokens = "video_text_tokens"
videos = 1
video_seconds = {{ kind = "lognormal", median = {MEDIAN_SECONDS:g}, sigma = {sigma:g}, min = 2, max = 180 }}

[schedule]
kind = "constant"
weights = {{ text = {text:.4g}, video = {video_share:.4g} }}
'''


def write_grid(folder: str | Path, video_shares=VIDEO_SHARES, sigmas=SIGMAS) -> list[Path]:
    """One workload file per (video share, sigma) cell in `folder`; returns their paths in grid order."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for sigma in sigmas:
        for share in video_shares:
            p = out / f"{cell_name(share, sigma)}.toml"
            p.write_text(cell_toml(share, sigma))
            paths.append(p)
    return paths

"""README's results are generated: a figure a simulation or a run gives (a ratio such as 0.98x, a lead
in per cent, a throughput) stands between table markers, written by `python -m omnibench.tables` from the
committed records, never typed into the prose around them, where it would outlive the records."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

GENERATED = re.compile(r"<!-- table:[^>]*-->.*?<!-- /table -->", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# what a result looks like: omni / a baseline, a lead or a lag in per cent, a throughput
RESULT = re.compile(r"\b\d+\.\d+x\b|\b\d+(-\d+)?% (faster|slower|ahead|behind)\b|\b\d[\d,]* tokens/s")
# a published figure is quoted with its source
PUBLISHED = re.compile(r"\breports?\b|\bpublished\b")


def results_in_prose(text: str) -> list[str]:
    prose = CODE.sub("", GENERATED.sub("", text))
    out = []
    for para in re.split(r"\n\s*\n", prose):
        for sentence in re.split(r"(?<=[.;:])\s+", para):
            if RESULT.search(sentence) and not PUBLISHED.search(sentence):
                out.append(" ".join(sentence.split()))
    return out


def test_readme_types_no_result_outside_generated_tables():
    found = results_in_prose((REPO / "README.md").read_text())
    assert not found, "\n".join(found)


def test_the_check_finds_a_typed_result_and_lets_generated_and_published_ones_be():
    text = ("omni is 0.97x of spatial here.\n\nSimulated: <!-- table:x -->0.98x<!-- /table -->.\n\n"
            "MegaScale-Omni reports 1.27x-7.57x.\n\nIn code: `4,509 tokens/s`, `0.90x`.\n")
    assert results_in_prose(text) == ["omni is 0.97x of spatial here."]

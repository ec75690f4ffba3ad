"""The comparison figures `reproduce` draws never mix machines nor memory errors: a speedup, throughput
or breakdown is of one hardware's nominal simulations (`nominal()` leaves --memory-error records out),
the memory figure sets the errors side by side, and the report gives each machine its own sections.
Simulation records come from the real `omnibench simulate` (omni-7b@4L, 16 GPUs, no recomputation: on
80 GB some systems fit and some do not, so a memory error moves the verdict)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from typer.testing import CliRunner

from omnibench.cli import app, report
from omnibench.plots import figures
from omnibench.plots.load import PlotInputError, load, memory_error, nominal
from omnibench.plots.report import draw_all

pytestmark = pytest.mark.timeout(300)
runner = CliRunner()
SYSTEMS = "homogeneous,temporal,colocated,noncolocated,omni"


def _simulate(out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["simulate", "--workload", "mixed_video", "--system", SYSTEMS, "--gpus", "16", "--tp", "2",
                            "--recompute", "none", "--model", "omni-7b@4L", "--out", str(out), "--json", *extra])
    assert r.exit_code == 0, r.output
    return Path(json.loads(r.output[r.output.index("{"):])["record"])


@pytest.fixture(scope="module")
def recs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("sims")
    return {"h100": _simulate(out), "h200": _simulate(out, "--hardware", "h200"),
            "-0.4": _simulate(out / "memory", "--memory-error", "-0.4"),
            "-0.2": _simulate(out / "memory", "--memory-error", "-0.2")}


def _close(d):
    plt.close(d.fig)
    return d


def test_nominal_leaves_out_every_simulation_decided_under_a_memory_error(recs):
    loaded = load(list(recs.values())).sims
    assert sorted(memory_error(r) for r in loaded) == [-0.4, -0.2, 0.0, 0.0]
    assert {str(r.path) for r in nominal(loaded)} == {str(recs["h100"]), str(recs["h200"])}


def test_speedup_refuses_records_of_several_machines_and_draws_the_one_asked_for(recs):
    both = load([recs["h100"], recs["h200"]])
    with pytest.raises(PlotInputError, match="several hardware.*--hardware"):
        figures.speedup(both)
    alone = _close(figures.speedup(load([recs["h200"]]))).table
    picked = _close(figures.speedup(both, "h200")).table
    assert picked.equals(alone)
    assert not picked.equals(_close(figures.speedup(both, "h100")).table)  # another machine, another answer
    with pytest.raises(PlotInputError, match="no simulation on hardware 'a100'"):
        figures.speedup(both, "a100")
    for fn in (figures.throughput, figures.breakdown):
        with pytest.raises(PlotInputError, match="several hardware"):
            fn(both)


def test_a_memory_error_record_moves_no_comparison_figure(recs):
    alone = load([recs["h100"]])
    with_errors = load([recs["h100"], recs["-0.4"], recs["-0.2"]])
    assert _close(figures.speedup(with_errors)).table.equals(_close(figures.speedup(alone)).table)
    assert _close(figures.throughput(with_errors)).table.equals(_close(figures.throughput(alone)).table)
    assert _close(figures.breakdown(with_errors)).table.equals(_close(figures.breakdown(alone)).table)
    with pytest.raises(PlotInputError, match="only --memory-error ones"):
        figures.speedup(load([recs["-0.2"]]))


def test_the_memory_figure_puts_omni_over_the_best_baseline_at_each_error_beside_the_nominal(recs):
    d = _close(figures.memory_sensitivity(load(list(recs.values()))))
    t = d.table
    assert list(t.memory_error) == [-0.4, -0.2, 0.0] and set(t.hardware) == {"h100"}  # h200 has no error run
    nominal_speedup = _close(figures.speedup(load([recs["h100"]]))).table.speedup.iloc[0]
    assert t.speedup.iloc[2] == pytest.approx(nominal_speedup)
    # each error names the systems whose layout it stops fitting; a smaller estimate fits more of them
    for key, row in zip(("-0.4", "-0.2", "h100"), t.itertuples(), strict=True):
        rows = json.loads((recs[key] / "results.json").read_text())
        assert set(filter(None, row.did_not_fit.split(", "))) == {r["system"] for r in rows if not r["fits"]}
    assert len(t.did_not_fit.iloc[0].split(", ")) < len(t.did_not_fit.iloc[2].split(", "))
    with pytest.raises(PlotInputError, match="memory needs simulations under a memory error"):
        figures.memory_sensitivity(load([recs["h100"]]))


def test_the_report_gives_each_machine_its_own_comparison_and_the_errors_their_own_figure(recs):
    sections = draw_all(load(list(recs.values())))
    titles = [s.title for s in sections if s.drawn]
    for s in sections:
        if s.drawn:
            plt.close(s.drawn.fig)
    assert "omni speedup over the best baseline (h100)" in titles
    assert "omni speedup over the best baseline (h200)" in titles
    assert "How the verdict moves when memory is mispredicted" in titles
    assert not any("h100" in t and "h200" in t for t in titles)


def test_reproduce_adds_the_largest_cluster_a_second_machine_the_memory_errors_and_the_condition_grid(tmp_path):
    sims = tmp_path / "sims"
    stages = report._stages(tmp_path / "runs", sims, SYSTEMS.split(","), quick=False)

    def arg(st, flag):
        return st.args[st.args.index(flag) + 1]

    sims_ = {st.key: st for st in stages if st.key.startswith(("tuned-", "largest-")) and "omni-no" not in st.key}
    largest = [st for st in sims_.values() if st.key.startswith("largest-")]
    assert [(arg(st, "--workload"), int(arg(st, "--gpus"))) for st in largest] == list(report.LARGEST)
    # alone, seeded with its workload's answers at the sizes before it, at the seeded budget
    assert all("--seed-from" in st.args and arg(st, "--tune-budget") == str(report.TUNE_BUDGET // 2)
               for st in largest)
    assert stages.index(largest[0]) > max(stages.index(st) for st in sims_.values() if st not in largest)  # last
    second = [st for st in sims_.values() if arg(st, "--hardware") == report.SECOND_HARDWARE]
    assert {arg(st, "--workload") for st in second} == set(report.SECOND_HARDWARE_WORKLOADS)
    assert all(arg(st, "--out") == str(sims / report.SECOND_HARDWARE) for st in second)
    memory = [st for st in stages if st.key.startswith("memory-")]
    assert {(arg(st, "--workload"), float(arg(st, "--memory-error"))) for st in memory} == {
        (wl, e) for wl in report.MEMORY_WORKLOADS for e in report.MEMORY_ERRORS}
    assert all(arg(st, "--out") == str(sims / "memory") for st in memory)  # never beside the nominal records
    assert all("--memory-error" not in st.args for st in sims_.values())
    cells = [st for st in stages if st.key.startswith("conditions-")]
    assert cells and all(callable(st.args) for st in cells)
    first = cells[0].args()  # the cell's workload file is written when its stage starts
    assert Path(arg_of(first, "--workload")).is_file()
    assert all("--seed-from" in st.args() for st in cells)  # seeded with every answer before them
    assert {arg_of(st.args(), "--model") for st in cells} == set(report.CONDITION_MODELS)


def arg_of(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]

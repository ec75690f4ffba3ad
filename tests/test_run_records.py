"""Records a user can load and trust, and a run config file: a flat
steps.csv beside steps.jsonl, provenance in config.json, the user's permissions, a unique folder
per torchrun run; `omnibench run --config run.toml` with command-line flags overriding the file."""

from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys
from datetime import timedelta

import pytest

from omnibench.runtime import records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN_TOML = """\
# a run config, torchtitan-style tables; keys are `omnibench run` option names
[job]
system = "temporal"
workload = "image_sft"
device = "cpu"

[parallelism]
nproc = 2

[training]
steps = 4
seed = 3
"""


def omnibench(*args: str, cwd=REPO, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "omnibench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def run_from_config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    (tmp / "run.toml").write_text(RUN_TOML)
    out = tmp / "run"
    res = omnibench("run", "--config", str(tmp / "run.toml"), "--steps", "2", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    return tmp, out


@pytest.mark.timeout(180)
def test_a_run_config_file_sets_the_run_and_command_line_flags_override_it(run_from_config):
    tmp, out = run_from_config
    config = json.loads((out / "config.json").read_text())
    run = config["run"]
    assert (run["system"], run["workload"], run["nproc"], run["seed"]) == ("temporal", "image_sft", 2, 3)
    assert run["steps"] == 2  # --steps 2 on the command line beats steps = 4 in the file
    assert run["extra"]["config_file"] == str(tmp / "run.toml")
    assert len((out / "steps.jsonl").read_text().splitlines()) == 2


@pytest.mark.timeout(180)
def test_a_run_record_holds_a_flat_steps_csv_equal_to_steps_jsonl(run_from_config):
    _, out = run_from_config
    rows = list(csv.DictReader((out / "steps.csv").open()))
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [s["step"] for s in steps]
    for r, s in zip(rows, steps, strict=True):
        assert float(r["loss"]) == s["loss"] and float(r["tokens_per_s"]) == s["tokens_per_s"]
        assert sum(float(r[k]) for k in r if k.startswith("flops_")) == pytest.approx(s["flops"])
        assert not any(v.startswith(("{", "[")) for v in r.values())  # flat: no nested cell


@pytest.mark.timeout(180)
def test_a_run_record_stores_provenance_and_has_the_users_permissions(run_from_config):
    _, out = run_from_config
    prov = json.loads((out / "config.json").read_text())["provenance"]
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert prov["commit"] == head and isinstance(prov["dirty"], bool)
    assert prov["torch"] and prov["python"] and prov["hostname"] and prov["device"] == "cpu x2 ranks"
    assert prov["command"].startswith("omnibench run --config ") and "--steps 2" in prov["command"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o666 & ~umask}


@pytest.mark.parametrize(("toml", "needle"), [
    ('system = "omni"\nnosuch = 1\n', "unknown key 'nosuch'"),
    ('system = "omni"\nsteps = "five"\n', "steps in"),
    ('system = "omni"\n[a]\nsteps = 2\n[b]\nsteps = 3\n', "sets steps a second time"),
    ("system = \n", "not valid TOML"),
])
def test_a_bad_run_config_is_one_line_naming_the_key(tmp_path, toml, needle):
    (tmp_path / "run.toml").write_text(toml)
    res = omnibench("run", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run"))
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: config:") and needle in lines[0], res.stderr
    assert not (tmp_path / "run").exists()


def test_under_torchrun_every_rank_gets_rank_0s_time_stamped_folder_and_two_runs_differ(tmp_path, monkeypatch):
    import torch.distributed as dist

    names = []
    for _ in range(2):  # two torchrun runs with the same static rendezvous: each has its own agent store
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=30))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(master.port))
        got = []
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            got.append(records.torchrun_run_dir(str(tmp_path), "omni", "mixed_video", timeout_s=30))
        assert got[0] == got[1]
        os.makedirs(got[0])  # the run happened: the next one must not reuse the name
        names.append(os.path.basename(got[0]))
        del master
    assert names[0] != names[1]
    for n in names:
        assert not n.startswith("none") and "-omni-mixed_video" in n and n[:8].isdigit()

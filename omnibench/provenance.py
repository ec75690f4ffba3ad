"""What every record says about where it came from, and how record folders are written.

`provenance()` is stored in every run's and simulation's `config.json` under "provenance": the git
commit of the checkout the code ran from (and whether it had uncommitted changes), the package,
torch and Python versions, the full command line, the host and the device. Nothing here imports
torch (simulations must stay light): its version is read from the installed package's metadata.
A run on CUDA (and every GPU benchmark script) adds `cuda_facts()`: torch's CUDA build, the NVIDIA
driver, the GPU's name, memory and compute capability; only those import torch, when asked.

`missing()` names what a record's provenance lacks of `GPU_FIELDS`, the facts a GPU figure needs
before a table may quote it (records written before these fields existed lack some or all).

`figure_provenance()` is what every figure carries (omnibench/plots): the commit (and dirty flag) of
the code that drew it and the command that did, in the PNG/PDF metadata and under it on a report.

`publish()` gives a finished record folder the permissions of any file the user creates (their
umask), whether it was written through `tempfile` (0700 / 0600) or plain `open` (0644).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(root: Path = REPO_ROOT) -> dict:
    """{"commit": sha or None, "dirty": bool or None}: None where the code is not a git checkout.

    A copy of a checkout can say which commit it is without its own .git, or with a .git of an older
    commit under uncommitted changes, as a GPU machine's copy of the working tree may have:
    `OMNIBENCH_GIT_MANIFEST` names a file written at the source by `write_manifest` (the commit, then
    every file of its tree with its blob). Where it is given and valid, the commit is the manifest's,
    and `dirty` says whether any file it lists differs here (`changed_files` names them); the local
    git's own answer, if any, is kept as "git_head". "commit_source" says the answer is the manifest's."""
    listed = _manifest_state(root)
    local = _git_head(root)
    if listed["commit"] is not None:
        return {**listed, **({"git_head": local} if local["commit"] and local["commit"] != listed["commit"] else {})}
    return local


def _git_head(root: Path) -> dict:
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


MANIFEST_ENV = "OMNIBENCH_GIT_MANIFEST"


def write_manifest(path: Path | str, root: Path = REPO_ROOT) -> str:
    """At the checkout: the commit (first line), then every file of its tree as `mode blob<TAB>path`
    (`git ls-tree -r -z HEAD`: what was committed, not what is staged). Refuses a checkout with
    uncommitted changes to tracked files, whose tree is not the commit's. Returns the commit."""
    run = dict(capture_output=True, text=True, check=True)
    if subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip():
        raise RuntimeError("write_manifest: the checkout has uncommitted changes; commit them first")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], **run).stdout.strip()
    lines = []
    for entry in subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "-z", "HEAD"], **run).stdout.split("\0"):
        meta, _, name = entry.partition("\t")
        fields = meta.split()
        if len(fields) == 3 and fields[1] == "blob" and "\n" not in name:
            lines.append(f"{fields[0]} {fields[2]}\t{name}")
    Path(path).write_text(head + "\n" + "".join(line + "\n" for line in lines))
    return head


def blob_sha(data: bytes) -> str:
    """What `git hash-object` gives a file's content."""
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _manifest_state(root: Path) -> dict:
    path = os.environ.get(MANIFEST_ENV)
    if not path:
        return {"commit": None, "dirty": None}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {"commit": None, "dirty": None}
    commit, changed = (lines[0].strip() if lines else ""), []
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return {"commit": None, "dirty": None}
    for line in lines[1:]:
        meta, _, name = line.partition("\t")
        fields = meta.split()
        if len(fields) != 2:
            continue
        f = root / name
        try:
            data = os.readlink(f).encode() if fields[0] == "120000" else f.read_bytes()
        except OSError:
            changed.append(name)
            continue
        if blob_sha(data) != fields[1]:
            changed.append(name)
    return {"commit": commit, "dirty": bool(changed), "commit_source": f"{MANIFEST_ENV} (every tracked file hashed against it)",
            **({"changed_files": changed[:20]} if changed else {})}


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it again (`omnibench ...` for the console script or -m)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and (Path(argv[0]).name in ("omnibench", "__main__.py") or argv[0].endswith("omnibench/__main__.py")):
        argv[0] = "omnibench"
    elif argv and argv[0].endswith(".py"):
        argv.insert(0, "python")  # a script: benchmarks/gpu_*.py
    return shlex.join(argv)


def provenance(device: str, argv: list[str] | None = None, cuda: bool = False) -> dict:
    """Where a record came from; `cuda`: the record was measured on CUDA, add `cuda_facts()`."""
    out = {
        **git_state(),
        "omnibench": _version("omnibench"),
        "torch": _version("torch"),
        "python": platform.python_version(),
        "command": command_line(argv),
        "hostname": socket.gethostname(),
        "device": device,
    }
    if cuda:
        out.update(cuda_facts())
    return out


# What a GPU record must carry before a table quotes its figures.
GPU_FIELDS = ("commit", "dirty", "torch", "cuda", "driver", "gpu_name", "gpu_memory_bytes", "command")


def missing(prov: dict | None, fields: tuple[str, ...] = GPU_FIELDS) -> list[str]:
    """The fields of `fields` that `prov` does not hold (absent or None; dirty=False is a value)."""
    prov = prov or {}
    return [f for f in fields if prov.get(f) is None]


def _cuda_of_torch(version: str | None) -> str | None:
    """torch's CUDA build from its wheel tag: "2.11.0+cu130" -> "13.0"; None for a CPU build."""
    tag = (version or "").partition("+")[2]
    if not tag.startswith("cu") or not tag[2:].isdigit() or len(tag) < 5:
        return None
    return f"{int(tag[2:-1])}.{tag[-1]}"


def record_provenance(folder: Path | str) -> dict:
    """What a run record says about where it came from: config.json's "provenance", completed where
    a field is absent by what older records kept elsewhere (`sources` names the file of each one
    filled so): summary.json's torch version, its CUDA build tag (2.11.0+cu130: CUDA 13.0) and GPU
    name, and the device memory the CUDA memory check wrote into its note ("... of 79.2 GiB",
    rounded). Nothing is inferred from outside the folder."""
    folder = Path(folder)

    def read(name: str) -> dict:
        try:
            return json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return {}

    prov = dict(read("config.json").get("provenance") or {})
    summary = read("summary.json")
    sources = {}
    filled = {"torch": summary.get("torch"), "cuda": _cuda_of_torch(summary.get("torch")),
              "gpu_name": summary.get("device_name") if summary.get("device_name") not in (None, "cpu") else None}
    for note in summary.get("notes") or []:
        m = re.search(r"of ([0-9.]+) GiB", note) if note.startswith("memory:") else None
        if m and str(summary.get("device", "")).startswith("cuda"):
            filled["gpu_memory_bytes"] = int(float(m.group(1)) * 2**30)
    for k, v in filled.items():
        if prov.get(k) is None and v is not None:
            prov[k] = v
            sources[k] = "summary.json" + (" (the memory check's note, rounded to 0.1 GiB)" if k == "gpu_memory_bytes"
                                           else " (torch's build tag)" if k == "cuda" else "")
    if sources:
        prov["sources"] = sources
    return prov


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (e.g. "550.54.15"): what `nvidia-smi` reports, else the
    kernel module's own line in /proc; None where neither exists (no NVIDIA driver, or not Linux).
    torch reports only the CUDA version its build targets, not the driver that runs it."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return driver_in_proc(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None


def driver_in_proc(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's first line: "NVRM version: NVIDIA UNIX x86_64
    Kernel Module  550.54.15  Tue Mar  5 ..." -> "550.54.15"."""
    for word in text.splitlines()[0].split() if text else []:
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None


def cuda_facts(device_index: int = 0) -> dict:
    """torch's CUDA build, the driver, and the GPU a CUDA record ran on (name, memory, capability,
    how many are visible). On a machine without CUDA every value is None (count 0): a caller that
    asks there gets the fields, empty, rather than a guess."""
    import torch

    out = {"cuda": torch.version.cuda, "driver": None, "gpu_name": None, "gpu_memory_bytes": None,
           "gpu_capability": None, "gpu_count": 0}
    if not torch.cuda.is_available():
        return out
    props = torch.cuda.get_device_properties(device_index)
    out.update({"driver": driver_version(), "gpu_name": props.name, "gpu_memory_bytes": int(props.total_memory),
                "gpu_capability": f"{props.major}.{props.minor}", "gpu_count": torch.cuda.device_count()})
    return out


def figure_provenance(argv: list[str] | None = None) -> dict:
    """{"commit", "dirty", "command", "omnibench"}: the code and command that drew a figure."""
    return {**git_state(), "command": command_line(argv), "omnibench": _version("omnibench")}


def provenance_text(prov: dict) -> str:
    """One line for a page or a figure's metadata: `<command>` at commit <sha> (uncommitted changes)."""
    commit = prov.get("commit")
    code = f"commit {commit[:12]}" if commit else "code outside a git checkout"
    if prov.get("dirty"):
        code += " with uncommitted changes"
    return f"made by `{prov.get('command', '')}` at omnibench {code}"


def write_csv(path: Path | str, rows: list[dict], columns: list[str]) -> None:
    """A flat table: one row per dict, `columns` in order (missing values empty); nested values are
    left out by choosing `columns`, never serialised into a cell."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    os.replace(tmp, path)


def publish(folder: Path | str) -> None:
    """Folder and files readable as the user's umask allows (0755 / 0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    folder = Path(folder)
    os.chmod(folder, 0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(folder):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~umask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~umask)

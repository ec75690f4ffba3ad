"""What every record says about where it came from, and how record folders are written.

`provenance()` is stored in every run's and simulation's `config.json` under "provenance": the git
commit of the checkout the code ran from (and whether it had uncommitted changes), the package,
torch and Python versions, the full command line, the host and the device. Nothing here imports
torch (simulations must stay light): its version is read from the installed package's metadata.

`figure_provenance()` is what every figure carries (omnibench/plots): the commit (and dirty flag) of
the code that drew it and the command that did, in the PNG/PDF metadata and under it on a report.

`publish()` gives a finished record folder the permissions of any file the user creates (their
umask), whether it was written through `tempfile` (0700 / 0600) or plain `open` (0644).
"""

from __future__ import annotations

import csv
import os
import platform
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
    """{"commit": sha or None, "dirty": bool or None}: None where the code is not a git checkout."""
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


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it again (`omnibench ...` for the console script or -m)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and (Path(argv[0]).name in ("omnibench", "__main__.py") or argv[0].endswith("omnibench/__main__.py")):
        argv[0] = "omnibench"
    return shlex.join(argv)


def provenance(device: str, argv: list[str] | None = None) -> dict:
    return {
        **git_state(),
        "omnibench": _version("omnibench"),
        "torch": _version("torch"),
        "python": platform.python_version(),
        "command": command_line(argv),
        "hostname": socket.gethostname(),
        "device": device,
    }


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

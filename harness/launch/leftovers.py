"""What a killed run leaves behind, and how the next run (or `harness.check --clean`)
removes it.

A local run keeps its scratch in `$TMPDIR/ddlbench-<run_id>.pid<launcher pid>-<random>/`.
Before it makes an emulated network, it writes that network's token there (`network`).
So every namespace, bridge and veth is named with the token (harness.launch.netem), and
the folder ties the token to its owner's pid.

A launcher that ends in any way but SIGKILL removes all of it itself. After a SIGKILL,
the ranks die with their launcher (PDEATHSIG) and the folder stays behind. A folder whose
owner pid is dead is stale: the next local run and `python -m harness.check --clean`
remove its network and then the folder, and say what they removed. Nothing of a live
run is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from harness.launch import netem

NETWORK = "network"  # in the run's folder: the token of its emulated network
OWNED = re.compile(r"^ddlbench-.+\.pid(\d+)-[^/]+$")


def folder_prefix(run_id: str) -> str:
    """The prefix of this launcher's run folder: the run and its owner's pid."""
    return f"ddlbench-{run_id}.pid{os.getpid()}-"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def stale(root: str | os.PathLike | None = None) -> list[Path]:
    """Run folders under `root` (the temporary folder) whose owner is dead."""
    root = Path(root or tempfile.gettempdir())
    found = []
    for path in sorted(root.glob("ddlbench-*")):
        owner = OWNED.match(path.name)
        if owner and path.is_dir() and not alive(int(owner.group(1))):
            found.append(path)
    return found


def clean(root: str | os.PathLike | None = None) -> list[str]:
    """Remove what runs whose owner died left behind; what was removed, one entry each."""
    removed = []
    for folder in stale(root):
        token = folder / NETWORK
        if token.is_file():
            removed += netem.remove(token.read_text().strip())
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"folder {folder}")
    return removed


def say_cleaned(removed: list[str]) -> str:
    """One line for the user: what was removed (empty: nothing)."""
    return (f"removed what killed runs left behind: {'; '.join(removed)}" if removed else "")

"""Where this process's cgroup lives, and how its files read (for ``hostmem``, ``hostcpu``).

``<root>/proc/self/cgroup`` gives the path: the ``0::/path`` line (v2, mounted at
``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on hybrid hosts) and, for cgroup v1,
the line whose controllers include the one asked for (mounted at
``/sys/fs/cgroup/<controller>``). Inside a container without a cgroup namespace the
path names the host's hierarchy (``/docker/<id>``) while the mount shows the
container's own cgroup at its root; walking from the path up to the mount
(:func:`cgroup_levels`) reaches that root, so a container's limits are found either way.

Every input is a file under ``root``, so a test describes any host with a folder.
"""
from __future__ import annotations

from pathlib import Path


def v2_mounts(root: Path) -> tuple[Path, Path]:
    """Where a cgroup v2 hierarchy may be mounted: the unified mount, then a hybrid
    host's ``unified`` folder."""
    return root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"


def read_int(path: Path) -> int | None:
    """The integer a cgroup file starts with; None for "max", a missing file or
    garbage."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
        return None
    if text == "max":
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def proc_cgroup_paths(root: Path, controller: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 path of ``controller``) from ``<root>/proc/self/cgroup``."""
    try:
        text = (root / "proc" / "self" / "cgroup").read_text()
    except FileNotFoundError:
        return None, None
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_levels(mount: Path, cgpath: str) -> list[Path]:
    """``mount/cgpath`` and each parent up to ``mount``, deepest first, existing only."""
    rel = [p for p in cgpath.strip().split("/") if p and p not in (".", "..")]
    out = []
    for i in range(len(rel), -1, -1):
        d = mount.joinpath(*rel[:i])
        if d.is_dir():
            out.append(d)
    return out

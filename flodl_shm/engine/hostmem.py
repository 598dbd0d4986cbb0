"""How much memory this host has, as a process *here* sees it — true in containers.

``psutil.virtual_memory()`` reports the whole machine even inside a Docker or
Kubernetes container (giampaolo/psutil#2100): a 2 GiB container on a 24 GiB host
reads ~24 GiB available and the first model-sized allocation is OOM-killed. So
``host_memory()`` combines three sources and says where each figure came from:

- ``/proc/meminfo`` (through psutil when ``root`` is ``"/"``): ``MemTotal``,
  ``MemAvailable``, ``SwapTotal``, ``SwapFree`` — the kernel's view of the machine;
- the memory cgroup of this process (v2 ``memory.max`` / ``memory.high`` /
  ``memory.current``, or v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``),
  walking from this process's cgroup up to the hierarchy's root and keeping the
  level with the least headroom (a pod limit above a container without one still
  binds);
- ``statvfs`` of ``/dev/shm`` (size and free space of the tmpfs our arena lives in).

**The figures.** ``available = min(MemAvailable, cgroup headroom)`` where
``headroom = limit − (usage − inactive_file)``: page cache the kernel would
reclaim before OOM-killing the cgroup (``inactive_file`` in ``memory.stat``) is
counted as available, exactly as ``MemAvailable`` counts the host's reclaimable
cache (and as kubelet's "working set" does). ``total = min(MemTotal, limit)``.
A v1 limit of 2^60 bytes or more ("no limit": the kernel writes
9223372036854771712) and a v2 ``max`` mean unlimited (``cgroup_limit is None``).
Swap figures are the host's (a cgroup swap limit is not applied).

**Where the cgroup lives** (``cgroups.py``): ``<root>/proc/self/cgroup`` gives the
path of the v2 hierarchy and of v1's ``memory`` controller (mounted at
``/sys/fs/cgroup/memory``). v2 is used when any level of its path has ``memory.max``
or ``memory.current``; otherwise v1. The walk from the path up to the mount finds a
container's limit with or without a cgroup namespace.

**Faking a host (tests).** Every input is a file under ``root``: pass a folder that
holds ``proc/meminfo``, ``proc/self/cgroup`` and ``sys/fs/cgroup/...`` to describe
any host. With ``root != "/"``, ``/proc/meminfo`` is parsed directly (psutil always
reads the real one). ``/dev/shm`` is ``<root>/dev/shm`` (or ``shm_dir``); since a
faked ``/dev/shm`` is an ordinary folder on some other file system, its size can
be stated with ``shm_total_bytes=``: the free space is then what tmpfs would
report, ``shm_total_bytes`` minus the blocks the folder's files hold (so removing a
file frees its bytes, as on a real tmpfs), unless ``shm_free_bytes=`` is given too.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .cgroups import cgroup_levels, proc_cgroup_paths, read_int, v2_mounts

#: v1 limits at or above this are the kernel's "no limit" (it writes 2^63 − 4096).
UNLIMITED_V1 = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """A snapshot of this host's memory as a process here sees it. All sizes in bytes.

    Attributes:
        total: RAM this process can ever use: ``min(MemTotal, cgroup_limit)``.
        available: RAM it can allocate now without swapping or an OOM kill:
            ``min(MemAvailable, cgroup_limit − (cgroup_usage − cgroup_reclaimable))``.
        host_total / host_available: ``MemTotal`` / ``MemAvailable`` of the machine.
        cgroup_version: 1, 2, or None when no memory cgroup was found.
        cgroup_path: the cgroup folder with the least headroom (this process's own
            cgroup when no level has a limit), None without a memory cgroup.
        cgroup_limit: the tightest limit from this process's cgroup up to the root;
            None when unlimited at every level.
        cgroup_usage: memory charged to ``cgroup_path`` (page cache and tmpfs included).
        cgroup_reclaimable: its ``inactive_file`` page cache (reclaimable).
        cgroup_headroom: the least ``limit − (usage − inactive_file)`` over the levels
            that have a limit; None when unlimited.
        swap_total / swap_free: the host's swap.
        shm_dir: the folder measured as ``/dev/shm``.
        shm_total / shm_free: its size and free space (0 when it does not exist).
        sources: figure name -> where it was read (for diagnostics).
    """

    total: int
    available: int
    host_total: int
    host_available: int
    cgroup_version: int | None
    cgroup_path: str | None
    cgroup_limit: int | None
    cgroup_usage: int | None
    cgroup_reclaimable: int
    cgroup_headroom: int | None
    swap_total: int
    swap_free: int
    shm_dir: str
    shm_total: int
    shm_free: int
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def limited_by_cgroup(self) -> bool:
        """True when the cgroup, not the machine, bounds ``available``."""
        head = self.cgroup_headroom
        return head is not None and head < self.host_available

    def to_dict(self) -> dict:
        """JSON-ready: every field."""
        return asdict(self)


@dataclass(frozen=True)
class _Cgroup:
    version: int
    path: str            # the level with the least headroom (or the process's own)
    limit: int | None    # the tightest limit over all levels
    usage: int | None
    reclaimable: int
    headroom: int | None
    limit_source: str
    usage_source: str


def host_memory(root: str | os.PathLike = "/", *, shm_dir: str | os.PathLike | None = None,
                shm_total_bytes: int | None = None,
                shm_free_bytes: int | None = None) -> HostMemory:
    """Measure this host's memory as a process here sees it (see the module doc).

    Args:
        root: folder standing in for ``/`` (``proc/``, ``sys/fs/cgroup/``, ``dev/shm``).
        shm_dir: the ``/dev/shm`` to measure; default ``<root>/dev/shm``.
        shm_total_bytes: the size of ``shm_dir`` when it is not a real tmpfs (tests);
            free space is then that size minus the blocks its files hold.
        shm_free_bytes: the free space of ``shm_dir``, overriding any other figure.

    Raises:
        FileNotFoundError: ``<root>/proc/meminfo`` is missing (a faked root must have one).
        ValueError: a figure is negative or ``meminfo`` lacks ``MemTotal``/``MemAvailable``.
    """
    root = Path(root)
    sources: dict[str, str] = {}
    real_root = root.resolve() == Path("/")
    if real_root:
        import psutil

        vm = psutil.virtual_memory()
        sw = psutil.swap_memory()
        host_total, host_avail = int(vm.total), int(vm.available)
        swap_total, swap_free = int(sw.total), int(sw.free)
        sources["host_total"] = "psutil (/proc/meminfo MemTotal)"
        sources["host_available"] = "psutil (/proc/meminfo MemAvailable)"
        sources["swap"] = "psutil (/proc/meminfo SwapTotal/SwapFree)"
    else:
        mi = _read_meminfo(root / "proc" / "meminfo")
        for key in ("MemTotal", "MemAvailable"):
            if key not in mi:
                raise ValueError(f"{root / 'proc' / 'meminfo'} has no {key} line; a faked "
                                 f"meminfo needs MemTotal and MemAvailable (in kB)")
        host_total, host_avail = mi["MemTotal"], mi["MemAvailable"]
        swap_total, swap_free = mi.get("SwapTotal", 0), mi.get("SwapFree", 0)
        sources["host_total"] = f"{root / 'proc' / 'meminfo'} MemTotal"
        sources["host_available"] = f"{root / 'proc' / 'meminfo'} MemAvailable"
        sources["swap"] = f"{root / 'proc' / 'meminfo'} SwapTotal/SwapFree"

    cg = _find_cgroup(root)
    total, available = host_total, host_avail
    sources["total"] = "MemTotal"
    sources["available"] = "MemAvailable"
    if cg is not None:
        sources["cgroup_limit"] = cg.limit_source
        sources["cgroup_usage"] = cg.usage_source
        if cg.limit is not None:
            if cg.limit < total:
                total = cg.limit
                sources["total"] = f"cgroup v{cg.version} limit"
            if cg.headroom < available:
                available = cg.headroom
                sources["available"] = (f"cgroup v{cg.version} limit − (usage − inactive_file) "
                                        f"at {cg.path}")
    else:
        sources["cgroup_limit"] = "no memory cgroup found"

    sdir = Path(shm_dir) if shm_dir is not None else root / "dev" / "shm"
    shm_total, shm_free = _shm_figures(sdir, shm_total_bytes, shm_free_bytes, sources)

    return HostMemory(
        total=int(total), available=int(available),
        host_total=int(host_total), host_available=int(host_avail),
        cgroup_version=cg.version if cg else None,
        cgroup_path=cg.path if cg else None,
        cgroup_limit=cg.limit if cg else None,
        cgroup_usage=cg.usage if cg else None,
        cgroup_reclaimable=cg.reclaimable if cg else 0,
        cgroup_headroom=cg.headroom if cg else None,
        swap_total=int(swap_total), swap_free=int(swap_free),
        shm_dir=str(sdir), shm_total=int(shm_total), shm_free=int(shm_free),
        sources=sources,
    )


def folder_used_bytes(folder: str | os.PathLike) -> int:
    """Bytes the regular files directly in ``folder`` occupy (allocated blocks),
    which is what a tmpfs subtracts from its free space."""
    used = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if e.is_file(follow_symlinks=False):
            used += st.st_blocks * 512
    return used


# -- /dev/shm --------------------------------------------------------------------------


def _shm_figures(sdir: Path, total_override: int | None, free_override: int | None,
                 sources: dict[str, str]) -> tuple[int, int]:
    for name, v in (("shm_total_bytes", total_override), ("shm_free_bytes", free_override)):
        if v is not None and int(v) < 0:
            raise ValueError(f"{name}={v} must be >= 0 bytes")
    total = free = 0
    src = f"statvfs({sdir})"
    if total_override is None or free_override is None:
        try:
            st = os.statvfs(sdir)
            total = st.f_blocks * st.f_frsize
            free = st.f_bavail * st.f_frsize
        except FileNotFoundError:
            src = f"{sdir} does not exist"
    if total_override is not None:
        total = int(total_override)
        free = max(0, total - folder_used_bytes(sdir))
        src = f"stated size {total} B; free = size − files in {sdir}"
    if free_override is not None:
        free = int(free_override)
        src += "; free stated"
    sources["shm"] = src
    return total, free


# -- /proc/meminfo ---------------------------------------------------------------------


def _read_meminfo(path: Path) -> dict[str, int]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: host_memory(root=...) reads meminfo from the root it is "
            f"given; put a meminfo there (MemTotal/MemAvailable in kB) or use root='/'"
        ) from None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            n = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1].lower() == "kb":
            n *= 1024
        if n < 0:
            raise ValueError(f"{path}: {key} = {n} is negative")
        out[key.strip()] = n
    return out


# -- cgroups ---------------------------------------------------------------------------


def _read_stat(path: Path, *keys: str) -> int:
    """The first of ``keys`` found in a ``memory.stat`` file; 0 when absent."""
    try:
        lines = path.read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return 0
    vals: dict[str, int] = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            try:
                vals[parts[0]] = int(parts[1])
            except ValueError:
                pass
    for k in keys:
        if k in vals:
            return max(0, vals[k])
    return 0


def _find_cgroup(root: Path) -> _Cgroup | None:
    v2path, v1path = proc_cgroup_paths(root, "memory")
    if v2path is not None:
        for mount in v2_mounts(root):
            cg = _cgroup_v2(mount, v2path)
            if cg is not None:
                return cg
    if v1path is not None:
        return _cgroup_v1(root / "sys/fs/cgroup/memory", v1path)
    return None


@dataclass(frozen=True)
class _Level:
    path: Path
    limit: int | None
    limit_file: str
    usage: int | None
    usage_file: str
    reclaimable: int

    @property
    def headroom(self) -> int:
        return max(0, (self.limit or 0) - max(0, (self.usage or 0) - self.reclaimable))


def _combine(version: int, levels: list[_Level], mount: Path, unlimited: str) -> _Cgroup:
    """Tightest limit and least headroom over ``levels`` (deepest first)."""
    limited = [lv for lv in levels if lv.limit is not None]
    if not limited:
        own = levels[0]
        return _Cgroup(version, str(own.path), None, own.usage, own.reclaimable, None,
                       f"unlimited ({unlimited} from {own.path} up to {mount})", own.usage_file)
    tight = min(limited, key=lambda lv: lv.limit)
    bind = min(limited, key=lambda lv: lv.headroom)
    return _Cgroup(version, str(bind.path), tight.limit, bind.usage, bind.reclaimable,
                   bind.headroom, tight.limit_file, bind.usage_file)


def _cgroup_v2(mount: Path, cgpath: str) -> _Cgroup | None:
    levels = []
    for d in cgroup_levels(mount, cgpath):
        if not ((d / "memory.max").exists() or (d / "memory.current").exists()):
            continue
        limits = [(v, f) for f in ("memory.max", "memory.high")
                  if (v := read_int(d / f)) is not None]
        limit, fname = min(limits) if limits else (None, "memory.max")
        levels.append(_Level(d, limit, str(d / fname), read_int(d / "memory.current"),
                             str(d / "memory.current"),
                             _read_stat(d / "memory.stat", "inactive_file")))
    return _combine(2, levels, mount, "memory.max is 'max'") if levels else None


def _cgroup_v1(mount: Path, cgpath: str) -> _Cgroup | None:
    levels = []
    for d in cgroup_levels(mount, cgpath):
        if not ((d / "memory.limit_in_bytes").exists() or (d / "memory.usage_in_bytes").exists()):
            continue
        limit = read_int(d / "memory.limit_in_bytes")
        if limit is not None and limit >= UNLIMITED_V1:
            limit = None
        levels.append(_Level(d, limit, str(d / "memory.limit_in_bytes"),
                             read_int(d / "memory.usage_in_bytes"),
                             str(d / "memory.usage_in_bytes"),
                             _read_stat(d / "memory.stat", "total_inactive_file", "inactive_file")))
    return _combine(1, levels, mount, "memory.limit_in_bytes >= 2^60") if levels else None

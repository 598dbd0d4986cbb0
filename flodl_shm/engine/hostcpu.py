"""How many CPUs this process can keep busy — true in containers.

``os.sched_getaffinity`` counts the cores the scheduler may run this process on. A
cpuset (``docker --cpuset-cpus``) narrows it; a CPU *quota* does not: a container
given ``docker --cpus=2``, or a Kubernetes pod with ``limits.cpu: 2``, on a 64-core
node sees all 64 cores, and may use two cores' worth of time per scheduling period.
Sized by the affinity, each of 4 ranks would run 16 torch threads and spin for its
peers as if it had a core of its own, and the kernel's CFS bandwidth control would
stall the whole container for the rest of every period it overran (throttling).

``available_cores()`` is the smaller of the affinity and the quota rounded up (2.5
CPUs' worth: 3 cores busy at a time), at least 1. It sizes the ranks' torch threads
(``spawn``: this count // ranks, unless ``OMP_NUM_THREADS`` says otherwise) and
tells a rank whether it has a core of its own to spin on (``waiting.py``).

**The quota.** cgroup v2: ``cpu.max`` holds ``"<quota> <period>"`` in microseconds,
``"max <period>"`` when unlimited. cgroup v1: ``cpu.cfs_quota_us`` (``-1``:
unlimited) over ``cpu.cfs_period_us``. Every level from this process's cgroup up to
the hierarchy's root may set one (a pod's above its container's); the tightest binds.
v2 is read when any level of its path has ``cpu.max``, else v1's ``cpu`` controller
(mounted at ``/sys/fs/cgroup/cpu``; ``cpu,cpuacct`` hosts link it there). Where the
cgroup lives, and how a test fakes a host with a folder: ``cgroups.py``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .cgroups import cgroup_levels, proc_cgroup_paths, read_int, v2_mounts


@dataclass(frozen=True)
class CpuQuota:
    """The tightest CPU quota over this process's cgroup and its ancestors.

    Attributes:
        cores: CPUs' worth of time per period (quota / period), e.g. 2.0 or 0.5.
        source: the file that sets it (for messages).
    """

    cores: float
    source: str


def cpu_quota(root: str | os.PathLike = "/") -> CpuQuota | None:
    """This process's CPU quota, or None where no cgroup level sets one (or no cgroup
    is found). ``root``: the folder that stands for ``/`` (tests)."""
    root = Path(root)
    v2path, v1path = proc_cgroup_paths(root, "cpu")
    if v2path is not None:
        for mount in v2_mounts(root):
            levels = [d for d in cgroup_levels(mount, v2path) if (d / "cpu.max").exists()]
            if levels:
                return _tightest([(_v2_quota(d / "cpu.max"), str(d / "cpu.max"))
                                  for d in levels])
    if v1path is not None:
        mount = root / "sys/fs/cgroup/cpu"
        return _tightest([(_v1_quota(d), str(d / "cpu.cfs_quota_us"))
                          for d in cgroup_levels(mount, v1path)
                          if (d / "cpu.cfs_quota_us").exists()])
    return None


def available_cores(root: str | os.PathLike = "/") -> int:
    """The CPUs this process can keep busy at once: its affinity, capped by its
    cgroup's CPU quota rounded up; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota.cores))
    return max(1, cores)


def _tightest(quotas: list[tuple[float | None, str]]) -> CpuQuota | None:
    """The least of the levels' quotas (cores, file), None where no level sets one."""
    limited = [(cores, src) for cores, src in quotas if cores is not None]
    if not limited:
        return None
    cores, src = min(limited)
    return CpuQuota(cores, src)


def _v2_quota(path: Path) -> float | None:
    """CPUs' worth of a v2 ``cpu.max`` ("<quota> <period>"); None for "max" or garbage."""
    try:
        quota, period = path.read_text().split()[:2]
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):  # "max 100000", unreadable, malformed
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _v1_quota(level: Path) -> float | None:
    """CPUs' worth of a v1 level's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None
    for -1 (unlimited) or garbage."""
    quota_us = read_int(level / "cpu.cfs_quota_us")
    period_us = read_int(level / "cpu.cfs_period_us")
    if quota_us is None or period_us is None or quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us

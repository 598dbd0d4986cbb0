"""Helpers shared by the engine tests (imported, not a conftest: no autouse magic)."""
from __future__ import annotations

import os

import psutil

from flodl_shm.segment import list_segments


def our_segments() -> list[str]:
    """fshm_ segments owned by this test process (spawn supervisors / FakeCohorts here)."""
    return [s.name for s in list_segments() if s.owner_pid == os.getpid()]


def live_children() -> list[psutil.Process]:
    """Child processes of this test process still running (ranks must all be reaped).

    multiprocessing's resource tracker is excluded: the "spawn" start method starts
    it once per interpreter and it lives until the interpreter exits, by design.
    """
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in p.cmdline()):
                continue
            out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out

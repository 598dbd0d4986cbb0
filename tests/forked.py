"""Children forked from the test process: a cluster host (``cluster_util.HostProcess``)
or a c10d rank (``c10d_driver.run_group``).

Forked from the (single-threaded, fork-safe) test process, a child already holds torch,
numba's loaded kernels and this package: it skips the seconds a fresh interpreter
spends importing them, and a ``spawn`` inside it forks its rank server as a user's
script does. Start-up itself keeps its own tests (test_spawn_startup.py, the torchrun
tests)."""
from __future__ import annotations

import os
import stat
import sys
import time


def drop_inherited_sockets() -> None:
    """In a fresh child: point every inherited socket descriptor (a controller's
    listening socket, a test's hand-driven links) at /dev/null, so only the test process
    holds them and a controller that closes or dies is seen as before. The numbers stay
    taken, so no inherited object can later close a reused one."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd != devnull and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.dup2(devnull, fd)
        except OSError:
            pass  # the listing's own descriptor, already closed


def leave(code: int) -> None:
    """End a child without running the test process's exit handlers."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def wait_children(pids: list[int], deadline: float) -> tuple[dict[int, int], list[int]]:
    """Reap ``pids``: (exit codes by pid, as ``Popen.returncode`` reads them; the pids
    still running at ``deadline``, which are then SIGKILLed and reaped)."""
    codes: dict[int, int] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    stuck = [pid for pid in pids if pid not in codes]
    for pid in stuck:
        os.kill(pid, 9)
        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return codes, stuck

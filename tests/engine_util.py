"""Helpers shared by the engine tests (imported, not a conftest: no autouse magic)."""
from __future__ import annotations

import os

import psutil

from flodl_shm.engine.segment import list_segments


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


def assert_no_leaks(grace: float = 5.0) -> None:
    """No shared-memory segment of this process and no rank process left (ranks get
    ``grace`` seconds to be reaped)."""
    import time

    assert our_segments() == [], "the run left shared-memory segments behind"
    deadline = time.monotonic() + grace
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_children() == [], "the run left rank processes behind"


def processes_gone(pids, timeout: float = 15.0) -> bool:
    """Whether every pid in ``pids`` is gone (or a zombie) within ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_running(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_spawn_driver(tmp_path, nprocs: int = 2, wait_for: str = "ready",
                       env: dict | None = None):
    """Start ``tests/spawn_driver.py`` with ``nprocs`` ranks in a session of its own (a
    terminal's foreground group) and return ``(process, pids)`` once the file
    ``tmp_path / wait_for`` lists ``nprocs`` pids (``"ready"``: the ranks are in their
    loop). ``env`` adds variables (e.g. ``DRIVER_SLOW_IMPORT_FILE``)."""
    import signal
    import subprocess
    import sys
    import time

    here = os.path.dirname(os.path.abspath(__file__))
    listed = tmp_path / wait_for
    full_env = dict(os.environ, DRIVER_READY_FILE=str(tmp_path / "ready"), **(env or {}))
    proc = subprocess.Popen([sys.executable, os.path.join(here, "spawn_driver.py"), str(nprocs)],
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if listed.exists() and len(listed.read_text().split()) >= nprocs:
            return proc, [int(p) for p in listed.read_text().split()]
        if proc.poll() is not None:
            raise AssertionError(f"driver exited early: {proc.communicate()}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    raise AssertionError(f"the driver's ranks never listed themselves in {listed}")


def refused_in_flight(comm, in_flight, intruder):
    """Start ``in_flight()`` (a collective on ``comm``) on a thread of its own; once its
    round is in flight, call ``intruder()`` here, which must raise the Comm's
    one-thread-at-a-time RuntimeError. Returns the thread and the list its result
    goes into (let the peers finish the round, then join it)."""
    import threading
    import time

    import pytest

    got: list = []
    thread = threading.Thread(target=lambda: got.append(in_flight()))
    thread.start()
    deadline = time.monotonic() + 30
    while not comm._in_round and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match=r"in a collective already, called from another "
                                           r"thread.*from one thread at a time"):
        intruder()
    return thread, got

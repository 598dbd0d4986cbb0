"""Reaping leaked segments decides owner liveness by the owner's lock on its control
segment, which holds across PID namespaces (containers sharing /dev/shm), not by
``os.kill(pid, 0)``, which does not.

A live owner in another process whose pid looks dead here (an owner pid that no
process of this namespace has, as another container's pid would be) keeps its arena
while it holds the lock, and loses it once it dies.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flodl_shm.engine.segment import (Segment, list_segments, pid_alive, reap_dead_owner_segments,
                                      segment_name, unlink_name)

from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(120)
FOREIGN_PID = 2 ** 22 + 4321  # above pid_max's default: no process here ever has it

OWNER = f"""
import sys
from flodl_shm.engine.arena import Arena
arena = Arena.create(2, owner_pid={FOREIGN_PID})
print(arena.handle.session, flush=True)
sys.stdin.read()  # hold the arena (and its lock) until told to go
"""


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    assert_no_leaks()


def _sessions(pid: int, session: str):
    return [s for s in list_segments() if s.owner_pid == pid and s.session == session]


def test_live_owner_whose_pid_looks_dead_keeps_its_arena():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    session = None
    try:
        session = owner.stdout.readline().strip()
        assert session, "the owner process did not create its arena"
        segs = _sessions(FOREIGN_PID, session)
        assert len(segs) == 8  # ctl, res, out, tap, d0, d1, p0, p1
        assert all(s.locked and s.owner_alive for s in segs)
        reaped = reap_dead_owner_segments()
        assert not [s for s in reaped if s.session == session], "a live owner's arena was reaped"
        assert len(_sessions(FOREIGN_PID, session)) == 8
        # the owner dies without cleaning up: its lock goes with it, and the next reap
        # takes the arena
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        assert not any(s.owner_alive for s in _sessions(FOREIGN_PID, session))
        reaped = reap_dead_owner_segments()
        assert {s.name for s in reaped if s.session == session} == \
            {s.name for s in segs}
        assert _sessions(FOREIGN_PID, session) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for s in _sessions(FOREIGN_PID, session or "-"):
            unlink_name(s.name)


def test_a_zombie_owner_s_arena_is_reaped():
    """A sweep driver that SIGKILLs a job and keeps its ``Popen`` without ``wait()``
    leaves the owner a zombie: ``os.kill(pid, 0)`` still succeeds, so its arena was
    taken for a live owner's and never reaped (by the next start or ``ram --reap``)."""
    code = OWNER.replace(f"owner_pid={FOREIGN_PID}", "owner_pid=None")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    session = None
    try:
        session = owner.stdout.readline().strip()
        assert len(_sessions(owner.pid, session)) == 8
        os.kill(owner.pid, signal.SIGKILL)
        # until the kernel has made it a zombie (no wait() here) and released its lock
        # (the last reference to a mapped file can go a moment after the exit)
        for _ in range(500):
            with open(f"/proc/{owner.pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            if zombie and not any(s.locked for s in _sessions(owner.pid, session)):
                break
            time.sleep(0.01)
        else:
            pytest.fail("the owner did not become a zombie without its lock")
        assert pid_alive(owner.pid) is False  # os.kill(pid, 0) still succeeds
        assert not any(s.owner_alive for s in _sessions(owner.pid, session))
        reaped = reap_dead_owner_segments()
        assert len([s for s in reaped if s.session == session]) == 8
        assert _sessions(owner.pid, session) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()
        for s in _sessions(owner.pid, session or "-"):
            unlink_name(s.name)


def test_unlocked_session_with_a_live_pid_is_left_alone():
    """Without the lock, a pid alive here still protects the session (an owner of an
    older version, or a reused pid): the pid check is a second condition, never the
    only one that reaps."""
    seg = Segment.create(segment_name(os.getpid(), "0ddba11f", "ctl"), 4096)  # no lock
    try:
        assert [s.locked for s in list_segments() if s.name == seg.name] == [False]
        assert seg.name not in {s.name for s in reap_dead_owner_segments()}
        assert seg.name in {s.name for s in list_segments()}
    finally:
        seg.close()
        seg.unlink()


def test_a_segment_reaped_the_instant_it_was_created_is_reported(monkeypatch):
    """An owner that takes its lock on a segment another namespace's reaper already
    unlinked (the instant between create and lock) says so instead of running on a
    name nobody can attach to."""
    import flodl_shm.engine.segment as S

    name = segment_name(os.getpid(), "5eed5eed", "ctl")
    real_lock = S.fcntl.flock

    def reaped_meanwhile(fd, op):
        if op == S.fcntl.LOCK_EX:
            unlink_name(name)  # what the foreign reaper did just before
        return real_lock(fd, op)

    monkeypatch.setattr(S.fcntl, "flock", reaped_meanwhile)
    with pytest.raises(FileNotFoundError, match="reaped by another process"):
        Segment.create(name, 4096, lock=True)
    assert name not in {s.name for s in list_segments()}


_SEGMENT_PAST_A_FILE_SIZE_LIMIT = """
import os, resource
from flodl_shm.engine.segment import Segment, list_segments
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files of 1 MiB at most
try:
    Segment.create(f"fshm_{os.getpid()}_abcd1234_probe", 8 << 20)
except OSError as e:
    print(type(e).__name__, e.errno, e)
print(len([s for s in list_segments() if s.owner_pid == os.getpid()]))
"""


def test_a_segment_past_the_file_size_limit_names_the_limit_not_dev_shm_space():
    """A probe under `ulimit -f` read '/dev/shm has 23.5 GiB free but segment ... needs
    8.0 MiB more. Free space in /dev/shm': the limit was the process's own."""
    import errno

    out = subprocess.run([sys.executable, "-c", _SEGMENT_PAST_A_FILE_SIZE_LIMIT],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    said, left = out.stdout.strip().splitlines()
    assert said.startswith(f"OSError {errno.EFBIG} ") and "ShmSpaceError" not in said
    assert ("needs 8.0 MiB, past this process's file-size limit (1.0 MiB: `ulimit -f`"
            in said), said
    assert left == "0", "the segment is removed"


_SEGMENT_PAST_AN_ADDRESS_SPACE_LIMIT = """
import os, resource
from flodl_shm.engine.segment import Segment, list_segments
from flodl_shm.engine.tensor_codec import fresh_array
import psutil
vm = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
try:
    Segment.create(f"fshm_{os.getpid()}_abcd1234_probe", 256 << 20)
except OSError as e:
    print(type(e).__name__, e.errno, e)
try:
    fresh_array(64 << 20, "float32")  # a result buffer: 256 MiB
except OSError as e:
    print(type(e).__name__, e.errno, e)
print(len([s for s in list_segments() if s.owner_pid == os.getpid()]))
"""


def test_a_segment_past_the_address_space_limit_names_the_limit():
    """A probe under `ulimit -v` read `[Errno 12] Cannot allocate memory` from the
    mapping, naming neither the segment, its size nor the limit."""
    import errno

    out = subprocess.run([sys.executable, "-c", _SEGMENT_PAST_AN_ADDRESS_SPACE_LIMIT],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    said, result, left = out.stdout.strip().splitlines()
    assert said.startswith(f"OSError {errno.ENOMEM} [Errno {errno.ENOMEM}] shared-memory "
                           f"segment fshm_"), said
    assert "(256.0 MiB) could not be mapped: this process's virtual-memory limit is " in said
    assert "(`ulimit -v`, RLIMIT_AS)" in said and "`ulimit -v unlimited`" in said, said
    # (in a real spawn the first mapping refused was a result buffer's)
    assert result.startswith(f"OSError {errno.ENOMEM} [Errno {errno.ENOMEM}] a collective's "
                             f"result buffer (256.0 MiB) could not be mapped: this process's "
                             f"virtual-memory limit"), result
    assert left == "0", "the segment is removed"

"""One POSIX shared-memory segment: who creates it, who attaches, who unlinks.

Modelled on CPython's ``multiprocessing/shared_memory.py`` (same ``shm_open``
primitive), with three differences that matter for a training runtime:

- **No resource tracker.** Python 3.11's tracker unlinks a segment when *any*
  attaching process exits and prints spurious "leaked shared_memory" warnings.
  Here the creator alone unlinks, explicitly; crash cleanup is by name instead:
  every segment is named ``fshm_<owner pid>_<session>_<what>`` so a later run (or
  ``python -m flodl_shm ram --reap``) removes the segments of owners that are gone.
- **Owner liveness by lock, not by pid.** The owner holds an exclusive ``flock``
  on its control segment (``Segment.create(..., lock=True)``) from creation until
  its descriptor closes, which the kernel does when it dies, however it dies. A
  reaper skips every session whose control segment is locked: that works across
  PID namespaces (two containers sharing ``/dev/shm``), where ``os.kill(pid, 0)``
  sees another container's live owner as dead, or an unrelated process as alive.
  The pid check stays as a second condition only (an unlocked session whose pid is
  alive here is left alone: an owner of an older version, or a pid reused).
- **Growth.** ``reserve(nbytes)`` grows the file with ``posix_fallocate``: tmpfs
  reports a full ``/dev/shm`` as a clean ``ENOSPC`` error here, instead of the
  SIGBUS a process gets later when it touches a sparse page that has no backing.
  Mappings are re-made at the new size; old mappings stay valid (same pages)
  until nothing references them.
- **Pre-faulting.** Mappings use ``MAP_POPULATE`` so the page-table cost (~2 s/GiB
  of first touch on these VMs) is paid when the mapping is made, not inside a
  timed collective.

A ``Segment`` pickles as its name (``__reduce__``): a spawned rank re-attaches.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import _posixshmem

from ..errors import ShmSpaceError, plural

logger = logging.getLogger("flodl_shm")

PREFIX = "fshm_"
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^fshm_(\d+)_([0-9a-f]+)_([A-Za-z0-9_.-]+)$")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def shm_free_bytes(shm_dir: Path = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def shm_total_bytes(shm_dir: Path = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize


def fmt_bytes(n: float) -> str:
    """Binary-unit rendering used in every size message: 1.5 GiB, 64 MiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def space_error(need: int, free: int, what: str, *, more: bool = False) -> ShmSpaceError:
    """``what`` needs ``need`` bytes of /dev/shm (``more``: on top of what it holds)."""
    return ShmSpaceError(
        f"/dev/shm has {fmt_bytes(free)} free but {what} needs {fmt_bytes(need)}"
        f"{' more' if more else ''}. "
        f"Free space in /dev/shm (leaked segments: `python -m flodl_shm ram --reap`), or "
        f"give it more room: in Docker `docker run --shm-size={_suggest(need)} ...` (the "
        f"default is 64 MB), in Kubernetes a memory-backed emptyDir on /dev/shm"
    )


def _suggest(need: int) -> str:
    gib = max(1, -(-int(need * 1.5) // (1 << 30)))
    return f"{gib}g"


def new_session_id() -> str:
    return secrets.token_hex(4)


def segment_name(owner_pid: int, session: str, what: str) -> str:
    return f"{PREFIX}{owner_pid}_{session}_{what}"


@dataclass(frozen=True)
class SegmentInfo:
    """A segment found in /dev/shm: its name, owner pid, session, size in bytes, and
    whether its session's control segment was locked by a live owner when listed."""

    name: str
    owner_pid: int
    session: str
    what: str
    nbytes: int
    locked: bool = False

    @property
    def owner_alive(self) -> bool:
        """The owner holds its session's lock (in any PID namespace), or a process
        with its pid is alive here."""
        return self.locked or pid_alive(self.owner_pid)


def _ctl_name(owner_pid: int, session: str) -> str:
    return segment_name(owner_pid, session, "ctl")


def lock_held(path: Path) -> bool | None:
    """Whether another open file description holds a ``flock`` on ``path`` (its
    owner is alive); ``None`` when ``path`` cannot be opened (gone, not ours)."""
    fd = _try_lock(path, fcntl.LOCK_SH)
    if fd is None or fd == -1:
        return None if fd is None else True
    os.close(fd)  # also drops the probe's own shared lock
    return False


def _try_lock(path: Path, op: int) -> int | None:
    """``path`` opened and locked with ``op`` (``LOCK_SH`` / ``LOCK_EX``) without
    waiting: its fd; ``None`` when it cannot be opened, -1 when a conflicting lock is
    held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    return fd


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` runs here. A zombie (exited, not yet waited for by
    its parent: a sweep driver that killed a job and keeps its ``Popen``) does not: it
    holds no lock and no mapping any more, though ``os.kill(pid, 0)`` still succeeds."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc to ask: the signal check stands
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows
    # the last ')'
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def list_segments(shm_dir: Path = SHM_DIR) -> list[SegmentInfo]:
    """Our segments (``fshm_*``) currently in ``shm_dir``."""
    out = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return out
    for e in entries:
        m = _NAME_RE.match(e.name)
        if not m:
            continue
        try:
            size = e.stat(follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            continue
        out.append(SegmentInfo(e.name, int(m.group(1)), m.group(2), m.group(3), size))
    locked = {}
    for seg in out:
        key = (seg.owner_pid, seg.session)
        if key not in locked:
            locked[key] = bool(lock_held(shm_dir / _ctl_name(*key)))
    out = [SegmentInfo(s.name, s.owner_pid, s.session, s.what, s.nbytes,
                       locked[(s.owner_pid, s.session)]) for s in out]
    return sorted(out, key=lambda s: s.name)


def _unlink_in(shm_dir: Path, name: str) -> bool:
    if shm_dir == SHM_DIR:
        return unlink_name(name)
    try:  # a test stand-in folder
        (shm_dir / name).unlink()
        return True
    except FileNotFoundError:
        return False


def unlink_name(name: str) -> bool:
    """Unlink one segment by name; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def reap_dead_owner_segments(shm_dir: Path = SHM_DIR) -> list[SegmentInfo]:
    """Unlink every ``fshm_`` segment whose owner is gone; returns them.

    A session is reaped only when nobody holds the lock on its control segment (the
    reaper takes that lock itself while it unlinks, so an owner cannot start holding
    it meanwhile) and no process with the owner's pid is alive here."""
    sessions: dict[tuple[int, str], list[SegmentInfo]] = {}
    for seg in list_segments(shm_dir):
        sessions.setdefault((seg.owner_pid, seg.session), []).append(seg)
    reaped = []
    for (pid, session), segs in sessions.items():
        if any(s.locked for s in segs) or pid_alive(pid):
            continue
        fd = _try_lock(shm_dir / _ctl_name(pid, session), fcntl.LOCK_EX)
        if fd == -1:
            continue  # an owner took the lock since the listing
        try:
            for seg in segs:
                if _unlink_in(shm_dir, seg.name):
                    reaped.append(seg)
        finally:
            if fd is not None:
                os.close(fd)
    if reaped:
        logger.info("reaped %s of dead owners (%s)", plural(len(reaped), "shared-memory segment"),
                    fmt_bytes(sum(s.nbytes for s in reaped)))
    return reaped


class Segment:
    """A named POSIX shared-memory segment mapped into this process.

    ``Segment.create(name, nbytes)`` makes it (exclusive; the creator unlinks;
    ``lock=True`` also holds an exclusive ``flock`` on it until ``close``: the
    owner's proof of life for reapers); ``Segment.attach(name)`` maps an existing one. ``buf`` is the current mapping
    (an ``mmap``); after ``reserve`` grows the segment, ``buf`` is a new, larger
    mapping of the same file. Nothing here is registered with Python's resource
    tracker.
    """

    def __init__(self, name: str, fd: int, nbytes: int, created: bool) -> None:
        self.name = name
        self._fd = fd
        self.created = created
        self._mmap: mmap.mmap | None = None
        self.nbytes = 0
        self._map(nbytes)

    # -- construction ----------------------------------------------------------
    @classmethod
    def create(cls, name: str, nbytes: int, *, lock: bool = False) -> "Segment":
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if lock:
                _lock_new(fd, name)
            _fallocate(fd, max(int(nbytes), mmap.PAGESIZE), name)
            seg = cls(name, fd, max(int(nbytes), mmap.PAGESIZE), True)
        except BaseException:
            os.close(fd)
            unlink_name(name)
            raise
        return seg

    @classmethod
    def attach(cls, name: str) -> "Segment":
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
        try:
            size = os.fstat(fd).st_size
            return cls(name, fd, size, False)
        except BaseException:
            os.close(fd)
            raise

    def __reduce__(self):
        return (Segment.attach, (self.name,))

    # -- mapping ---------------------------------------------------------------
    def _map(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"segment {self.name}: cannot map {nbytes} bytes")
        # The previous mapping is dropped, not closed: numpy/torch views a caller
        # still holds keep it (and its pages) alive until they die.
        try:
            self._mmap = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise map_error(f"shared-memory segment {self.name}", nbytes) from e
            raise
        self.nbytes = nbytes

    @property
    def buf(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mmap

    def file_size(self) -> int:
        return os.fstat(self._fd).st_size

    def refresh(self) -> bool:
        """Re-map if another process grew the segment; True when the mapping changed."""
        size = self.file_size()
        if size > self.nbytes:
            self._map(size)
            return True
        return False

    def reserve(self, nbytes: int) -> bool:
        """Grow the segment to at least ``nbytes`` (never shrinks); True if it grew.

        Safe to call from several processes at once with the same target: the file
        only ever grows, and each caller re-maps at the resulting size.
        """
        if nbytes <= self.nbytes:
            return False
        size = self.file_size()
        if size < nbytes:
            _fallocate(self._fd, nbytes, self.name)
        self._map(max(nbytes, self.file_size()))
        return True

    def close(self) -> None:
        """Drop this process's mapping and descriptor (views keep pages alive)."""
        self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid until unmapped)."""
        unlink_name(self.name)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {fmt_bytes(self.nbytes)}, created={self.created})"


def map_error(what: str, nbytes: int) -> OSError:
    """The error for a mapping of ``what`` (a segment, a result buffer) refused with
    ENOMEM: this process's address-space limit (``ulimit -v``) when one is set, named
    with the fix; else memory itself."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        return OSError(errno.ENOMEM, (
            f"{what} ({fmt_bytes(nbytes)}) could not be mapped: this process's "
            f"virtual-memory limit is {fmt_bytes(limit)} (`ulimit -v`, RLIMIT_AS), and "
            f"torch, numba and the mappings of every segment count against it; raise it "
            f"(`ulimit -v unlimited` before starting the job) or train a smaller model"))
    return OSError(errno.ENOMEM, (
        f"{what} ({fmt_bytes(nbytes)}) could not be mapped: the system is out of memory "
        f"for it (or a memory cgroup's limit was reached); free memory or train a smaller "
        f"model"))


def _lock_new(fd: int, name: str) -> None:
    """Take the owner's lock on a just-created segment and check that no reaper (one
    that saw it unlocked, from a PID namespace where this pid looks dead) unlinked it
    in the instant between its creation and the lock."""
    fcntl.flock(fd, fcntl.LOCK_EX)  # a reaper holds it for an instant at most
    if not SHM_DIR.is_dir():
        return  # no /dev/shm view of the names to check against
    try:
        same = os.stat(SHM_DIR / name).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        raise FileNotFoundError(
            f"shared-memory segment {name} was reaped by another process the instant it "
            f"was created (a reaper in another PID namespace saw its owner as dead); "
            f"start again")


def _fallocate(fd: int, nbytes: int, name: str) -> None:
    before = os.fstat(fd).st_size
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.EFBIG:  # not /dev/shm's space: this process's file-size limit
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit == resource.RLIM_INFINITY:  # then the filesystem's own largest file
                raise OSError(errno.EFBIG, f"shared-memory segment {name} needs "
                              f"{fmt_bytes(nbytes)}, more than one file of this /dev/shm "
                              f"may hold; train a smaller model") from e
            raise OSError(errno.EFBIG, (
                f"shared-memory segment {name} needs {fmt_bytes(nbytes)}, past this "
                f"process's file-size limit ({fmt_bytes(limit)}: `ulimit -f`, RLIMIT_FSIZE, "
                f"which covers /dev/shm files too); raise it (`ulimit -f unlimited` before "
                f"starting the job) or train a smaller model")) from e
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            # Never shrink back: another process may already map the larger size.
            raise space_error(nbytes - before, shm_free_bytes(), f"segment {name}",
                              more=True) from None
        raise

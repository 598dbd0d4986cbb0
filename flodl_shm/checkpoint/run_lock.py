"""One run at a time per checkpoint series: an exclusive lock on ``<series>.lock``.

Two runs given the same save path would write one series between them: the second
one's ``overwrite`` deletes the bundles the first is still writing, their windows
interleave in the same file names, and both report success. So the process that
launches a run holds this lock on the series for the whole run, and a second run on
the same series is refused before it touches a file (``SeriesInUse``, naming the
holder's pid, host and start time).

Ownership
=========

The lock is an ``fcntl.flock`` on the file ``<series base>.lock`` (``runs/ckpt`` ->
``runs/ckpt.lock``), taken without waiting. It belongs to the open file of the
process that acquired it:

- **Released by the kernel** when that process exits, however it exits (a crash, a
  SIGKILL): there is never a stale lock to clear by hand. A ``.lock`` file left by
  a crash is only a file; the next run locks it and removes it at its end.
- **Re-entrant within the process**: the demo takes it before it writes its run
  folder, then its ``Trainer.run`` takes it again; the holder counts and releases at
  the outermost exit.
- **Shared with forked children** (the ranks inherit the open file), which never
  release it: only the acquiring process does (the count is per pid). A child can
  outlive a holder that died without releasing it (a killed rank's DataLoader worker,
  until it notices), holding the lock: an acquirer that finds the holder named in the
  file gone from this host waits up to ``INHERITED_LOCK_WAIT_S`` for such processes to
  exit, then refuses naming them. A holder that releases it while children still run
  removes the file all the same (they share its open file, so its exclusive lock is
  granted): the children then hold a lock on a removed file, which keeps no run out.
  The holders release after the work that writes the series: the launcher once its
  ranks were joined, a rank once its function returned.
- **Shared by the hosts of one job.** Hosts of a cluster whose save paths lie on one
  shared file system (NFS) would otherwise refuse each other: a lock taken with a
  ``job`` identity (the Trainer's: a digest of the cluster's session salt; LocalSGD's:
  a token its rank 0 draws) is held *shared* (``LOCK_SH``) once its holder has written
  its line, and a process of the same job takes a shared lock on the same file beside
  it. Every process of the job then holds the series: another job is refused for as
  long as any of them runs, whichever ends first (a host that went on without a lock of
  its own let another job take the series while it still wrote there). A process that
  joins reads the line again once it holds the lock: the line it read before may be a
  dead holder's, left for a run of another job that had locked the file and not yet
  written its own. With a ``member`` too (the Trainer's: the host's first rank), each
  process also holds its member's own lock (``<series>.member-<member>.lock``), so the
  same host launched twice is refused, whoever holds the series' lock (the demo's
  ``--overwrite`` had deleted a running host's checkpoints), and a host relaunched
  after its process was killed joins at once.
- **Released at the end of its process's work** when nothing exited it: ``LocalSGD``'s
  lead rank holds the lock of a series it saves into for the rest of its life, and
  ``release_held`` lets it go when the rank's function returns (``launch/rank.py``)
  or at interpreter exit (``atexit``, e.g. under torchrun).
- **Removed by its last holder, under the lock.** A holder that leaves takes the lock
  exclusive first (``LOCK_EX``, without waiting): it gets it only when no other process
  of its job still shares it, and only then removes the file. A job's first holder that
  leaves before the others writes the job over its line, with the folders it made, for
  the refusals to name and for the last one to remove. An acquirer that finds the
  path gone or pointing at another file after its ``flock`` (the holder removed it in
  between) opens it again, so two runs never hold locks on two different files of one
  path.
  Folders the lock created for itself go too when they are empty by then: a run
  refused before it wrote anything leaves no trace.

The file holds one JSON line (pid, host, start time, job, member) for the refusal
message and the job check: the first holder's, which the processes sharing the lock
leave as it is.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import SeriesInUse
from ._atomic import disk_full_hint

logger = logging.getLogger("flodl_shm")

__all__ = ["RunLock", "cluster_job", "lock_holder", "release_held", "run_lock_path"]

class _Held(NamedTuple):
    """A lock this process took: who took it, its open file, how deep it is held, the
    folders it created (deepest first), and whether it joined another process of its
    job (``RunLock.shared``)."""

    pid: int
    fd: int
    depth: int
    made: tuple[Path, ...]
    shared: bool = False
    job: str | None = None


#: lock files this process holds, by resolved path
_HELD: dict[str, _Held] = {}


def release_held() -> None:
    """Release every run lock this process holds, however deep (a rank whose function
    returned, an interpreter at exit)."""
    for key, held in list(_HELD.items()):
        if held.pid == os.getpid():
            _release(key)


atexit.register(release_held)


def cluster_job(salt: bytes | None, controller) -> str:
    """The job identity the hosts of one cluster lock with: a digest of the session salt
    they all hold (never the salt itself), else of the controller's address."""
    return hashlib.blake2b(salt or str(controller).encode(), digest_size=8,
                           person=b"flodl_shm.lock").hexdigest()


def run_lock_path(save_path: "str | os.PathLike[str]") -> Path:
    """``<series base>.lock``: the series' lock file (``series.series_base``)."""
    base = _series_base(save_path)
    return base.with_name(base.name + ".lock")


def _series_base(save_path: "str | os.PathLike[str]") -> Path:
    """``series.series_base`` (imported here: that module imports this one)."""
    from .series import series_base

    return series_base(save_path)


class RunLock:
    """Hold the run lock of the series at ``save_path`` (a context manager).

    Raises ``SeriesInUse`` on entry when another process holds it, unless that process
    took it for the same ``job`` (another host of this job, on a shared file system):
    then this one shares it (``shared`` is True), and the series stays locked against
    other jobs until the last of them leaves.
    """

    def __init__(self, save_path: "str | os.PathLike[str]", job: str | None = None,
                 member: int | None = None) -> None:
        self.path = run_lock_path(save_path)
        self.job = job
        self.member = member
        self.shared = False
        self._key = os.path.realpath(self.path)
        self._save_path = save_path
        self._member_lock: RunLock | None = None

    def __enter__(self) -> "RunLock":
        held = _HELD.get(self._key)
        if held is not None and held.pid == os.getpid():
            _HELD[self._key] = held._replace(depth=held.depth + 1)
            self.shared = held.shared
            return self
        _check_folders(self.path)
        while True:
            made = tuple(d for d in (self.path.parent, *self.path.parent.parents)
                         if not d.exists())  # deepest first
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a read-only or virtual filesystem (/proc), no permission
                _remove_empty(made)
                raise OSError(e.errno, f"cannot create the folder {self.path.parent} "
                              f"({e.strerror}), where the run lock {self.path.name} and the "
                              f"series' checkpoints go; save into a folder this user can "
                              f"write") from e
            try:
                fd, shared = self._acquire()
                break
            except FileNotFoundError:  # a run that ended removed the folder meanwhile
                continue
            except BaseException:
                _remove_empty(made)
                raise
        if shared:
            made = ()  # (the first holder's: the last to leave removes them, if empty)
        try:
            self._enter_member()
        except BaseException:
            _release_fd(self._key, fd, made)
            raise
        _HELD[self._key] = _Held(os.getpid(), fd, 1, made, shared, self.job)
        self.shared = shared
        return self

    def _joins(self, info: dict) -> bool:
        """Whether the lock whose line is ``info`` is this job's (a member launched
        twice is refused by its member's lock)."""
        return self.job is not None and info.get("job") == self.job

    def _enter_member(self) -> None:
        """Hold this member's own lock (every member of a job, the series' first holder
        too): a second launch of it is refused, whoever holds the series' lock."""
        if self.member is None:
            return
        base = _series_base(self._save_path)
        lock = RunLock(base.with_name(f"{base.name}.member-{self.member}"))  # no sharing
        try:
            lock.__enter__()
        except SeriesInUse as e:
            raise SeriesInUse(os.fspath(self.path),
                              f"this job's member {self.member} runs already: {e.holder}",
                              self.job, self.member) from None
        self._member_lock = lock

    def _acquire(self) -> tuple[int, bool]:
        """Open and lock the file (see the module doc); returns its descriptor and
        whether the lock is shared with another process of this job (whose line the
        file holds) rather than taken."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                raise OSError(e.errno, f"cannot create the run lock {self.path}: "
                              f"{e.strerror}: the series' folder must be writable, for the "
                              f"lock and the checkpoints a run writes there; make "
                              f"{self.path.parent} writable, or save into another folder "
                              f"(its bundles can be copied there to go on from them)") from e
            try:
                shared = self._lock(fd)
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder removed it after we opened it: take the new one
        if shared:
            return fd, True
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "job": self.job, "member": self.member}) + "\n"
                            ).encode(), 0)
        except OSError as e:  # a full disk: give the lock back, and say which file
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)
            raise OSError(e.errno, f"cannot write the run lock {self.path}: {e.strerror}"
                          f"{disk_full_hint(e)}") from e
        if self.job is not None:
            try:  # the line is written: the job's other hosts may share the lock now
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # (lost in the conversion: another run took it)
                info = _holder_info(fd)
                os.close(fd)
                raise SeriesInUse(os.fspath(self.path), _describe(info), info.get("job"),
                                  info.get("member")) from None
        return fd, False

    def _share(self, fd: int, info: dict) -> tuple[bool, dict]:
        """Take a shared lock on ``fd`` beside this job's holder, whose line is ``info``
        (read before any lock; another job's, or none: nothing is taken), waiting up to ``HOLDER_LINE_WAIT_S`` for it to turn its
        exclusive lock into a shared one (it does right after writing its line; it holds
        it exclusively for a moment while it leaves, too). Returns (whether this process
        joined, the line as it is now). The line is read again once the lock is held:
        the one read before may have been a dead holder's, left for a run of another job
        that locked the file and had not yet written its own; then the lock is let go.
        A live holder of this job that keeps it exclusive for longer (a version of this
        module that never shared it) leaves this process to go on without a lock of its
        own, as those versions did, which is said."""
        if not self._joins(info):
            return False, info
        deadline = time.monotonic() + HOLDER_LINE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
                continue
            now = _holder_info(fd)  # (written under an exclusive lock: complete)
            if self._joins(now):
                return True, now
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False, now
        now = _holder_info(fd)
        if not self._joins(now) or _holder_gone(now) or now.get("pid") is None:
            return False, now
        logger.warning("the run lock %s is held exclusively by %s, of this job, which does not "
                       "share it (another flodl_shm version there?): going on without a lock "
                       "of this process's, so another job could take the series once that "
                       "one ends while this one still writes there; run one version on every "
                       "host", self.path, _describe(now))
        return True, now

    def _lock(self, fd: int) -> bool:
        """Lock the open file ``fd``: exclusively when no one holds it (returns False),
        shared beside another member of this job (returns True); else raise
        ``SeriesInUse`` naming the holder."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            pass
        joined, info = self._share(fd, _holder_info(fd))
        if joined:
            return True
        gone = _holder_gone(info)
        if gone:
            held, info = _outwait_inheritors(fd, self.path, info)
            if held:
                return False
            joined, info = self._share(fd, info)  # (a live new holder, of this job?)
            if joined:
                return True
            gone = _holder_gone(info)  # (another acquirer may hold it by now)
        raise SeriesInUse(os.fspath(self.path), _describe(info, fd if gone else None),
                          info.get("job"), info.get("member"))

    def __exit__(self, *exc) -> None:
        member, self._member_lock = self._member_lock, None
        try:  # (the member's first: the series' last holder then removes empty folders)
            if member is not None:
                member.__exit__(*exc)
        finally:
            held = _HELD.get(self._key)
            if held is not None and held.pid == os.getpid():  # (else: release_held did)
                if held.depth > 1:
                    _HELD[self._key] = held._replace(depth=held.depth - 1)
                else:
                    _release(self._key)


def _release(key: str) -> None:
    """Give up the lock file ``key``: remove it while this process holds it alone (no
    other process of its job shares it), then close it, which drops the lock."""
    held = _HELD.pop(key)
    if held.job is not None and not held.shared:
        _hand_over_line(held.fd, held.made)
    _release_fd(key, held.fd, held.made)


def _hand_over_line(fd: int, made: tuple[Path, ...]) -> None:
    """The line of a job's lock whose writer leaves, while it still holds the lock: the
    job without a process, and the folders the writer made for the lock (others of the
    job may go on sharing it: a refusal then names them, a process of the job may still
    join them, and the last to leave removes those folders). Written by the line's
    writer only, while it holds the lock (no acquirer writes it meanwhile), over the
    old line, padded, never truncated first: a reader never finds it empty."""
    info = _read_info(fd)
    line = {"pid": None, "host": info.get("host"), "started": info.get("started"),
            "job": info.get("job"), "member": None, "made": [os.fspath(d) for d in made]}
    data = (json.dumps(line) + "\n").encode()
    try:
        size = os.fstat(fd).st_size
        os.pwrite(fd, data + b" " * max(0, size - len(data)), 0)
    except OSError:  # (a full disk: the old line names a gone holder, said as such)
        pass


def _release_fd(key: str, fd: int, made: tuple[Path, ...] = ()) -> None:
    """:func:`_release` of the lock held on ``fd`` (and the folders ``made`` for it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (already so without a job)
        # (the path is this file while a lock is held on it; a host that went on without
        # one, beside a holder that did not share, checks that it still is)
        last = os.stat(key).st_ino == os.fstat(fd).st_ino
    except (BlockingIOError, FileNotFoundError):  # the job's others hold it on: theirs
        last = False
    if last and not made:  # (a sharer that leaves last: the first holder's, from its line)
        made = tuple(Path(d) for d in _read_info(fd).get("made") or ())
    try:
        if last:
            os.unlink(key)
    except FileNotFoundError:
        pass
    except OSError as e:  # a folder made read-only since: the file stays, the lock goes
        logger.warning("could not remove the run lock %s (%s); it is released, and the "
                       "next run takes it over", key, e)
    finally:
        os.close(fd)
    if last:
        _remove_empty(made)


def file_in_the_way(folder: "str | os.PathLike[str]") -> "Path | None":
    """The file that keeps ``folder`` from being a folder or from being created: the
    folder itself or the first of its existing parents, when that one is not a folder
    (None when the folder exists or can be made under its first existing parent)."""
    folder = Path(folder)
    for d in (folder, *folder.parents):  # deepest first, up to the first that exists
        if d.exists():
            return None if d.is_dir() else d
    return None


def _check_folders(lock: Path) -> None:
    """Raise ``NotADirectoryError`` naming the file when a folder of ``lock``'s path is
    a file, rather than mkdir's ``FileExistsError`` / ``NotADirectoryError``."""
    d = file_in_the_way(lock.parent)
    if d is not None:
        raise NotADirectoryError(
            f"{d} is a file, not a folder: the run lock {lock} and the series' "
            f"checkpoints cannot go under it; give a save path in a folder (one "
            f"that does not exist yet is created)")


def _remove_empty(folders: tuple[Path, ...]) -> None:
    """Remove ``folders`` (deepest first) while they are empty."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            return


def lock_holder(lock: "str | os.PathLike[str]") -> str:
    """Who holds the lock file ``lock``, as the refusal names it (read without locking)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return "a process that has released it since"
    try:
        return _describe(_read_info(fd))
    finally:
        os.close(fd)


def _read_info(fd: int) -> dict:
    """The holder's line (pid, host, start time, job), or {} before it is written."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


#: how long an acquirer waits for the holder's line: a holder writes it right after its
#: flock, and its job decides whether this process may go on (another host of its job)
HOLDER_LINE_WAIT_S = 2.0


def _holder_info(fd: int) -> dict:
    """The holder's line, waiting up to ``HOLDER_LINE_WAIT_S`` for a holder that has
    locked the file but not written it yet ({} if it never does)."""
    deadline = time.monotonic() + HOLDER_LINE_WAIT_S
    info = _read_info(fd)
    while not info and time.monotonic() < deadline:
        time.sleep(0.005)
        info = _read_info(fd)
    return info


def _describe(info: dict, inherited_fd: int | None = None) -> str:
    """'pid N on host H since T', or a plainer phrase; with ``inherited_fd`` (the lock
    file, open: its holder is gone), who holds it still."""
    if info.get("pid") is None and info.get("job") is not None:  # (_hand_over_line)
        return (f"the processes of another run's job, which took it on host "
                f"{info.get('host')} since {info.get('started')}: the process that took it "
                f"has ended, the others of its job hold it until they end")
    try:
        who = f"pid {info['pid']} on host {info['host']} since {info['started']}"
    except KeyError:
        return "a process that has not written its details yet"
    if inherited_fd is None:
        return who
    pids = _processes_holding(inherited_fd)
    found = f"pids {', '.join(map(str, pids))}" if pids else "none found on this host"
    if info.get("job") is not None:
        return (f"{who}, which is no longer running; the other processes of its job, or "
                f"processes it started (a DataLoader worker, say), hold the lock on (those "
                f"holding the lock file open: {found}): wait for them to end")
    return (f"{who}, which is no longer running; processes it started (a DataLoader worker, "
            f"say) still hold the lock file open ({found}), and hold the lock with it: stop "
            f"them")


#: how long an acquirer waits for the processes that inherited a lock from a holder that
#: is gone (a rank killed under torchrun leaves its DataLoader workers for a few seconds:
#: they hold its lock file open, and the lock with it, until they notice and exit)
INHERITED_LOCK_WAIT_S = 30.0


def _holder_gone(info: dict) -> bool:
    """Whether the holder named in the lock file is a process of this host that is no
    longer running (the lock is then held by processes that inherited its open file)."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # alive, another user's; no pid at all
        return False
    return False


def _outwait_inheritors(fd: int, path: Path, info: dict) -> tuple[bool, dict]:
    """Wait up to ``INHERITED_LOCK_WAIT_S`` for the processes that hold the lock of a
    holder that is gone to exit. Returns (True, ``info``) once ``fd`` holds the lock, or
    (False, the holder's line as it is now): when the time is up, or at once when another
    acquirer, alive, took the lock meanwhile (its line names it: this acquirer then
    shares it or is refused as with any live holder, not after the rest of the wait)."""
    pids = ", ".join(map(str, _processes_holding(fd))) or "none found on this host"
    if info.get("job") is None:
        logger.warning("the run lock %s is held by processes that pid %s started (%s) and "
                       "that outlive it; waiting up to %g s for them to exit", path,
                       info.get("pid"), pids, INHERITED_LOCK_WAIT_S)
    else:
        logger.warning("the run lock %s names pid %s, which is no longer running; processes "
                       "it started or the other processes of its job hold it on (%s); "
                       "waiting up to %g s for them to exit", path, info.get("pid"), pids,
                       INHERITED_LOCK_WAIT_S)
    deadline = time.monotonic() + INHERITED_LOCK_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True, info
        except BlockingIOError:
            now = _read_info(fd)  # (empty while a new holder writes its line)
            if now and now.get("pid") != info.get("pid") and not _holder_gone(now):
                return False, now
    return False, _read_info(fd) or info


def _processes_holding(fd: int) -> list[int]:
    """The other processes of this host (those this user may inspect) that hold the
    file open on ``fd`` open too."""
    want = os.fstat(fd)
    me, out = os.getpid(), []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == me:
            continue
        try:
            links = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for link in links:
            try:
                st = os.stat(f"/proc/{pid}/fd/{link}")
            except OSError:
                continue
            if st.st_ino == want.st_ino and st.st_dev == want.st_dev:
                out.append(pid)
                break
    return out

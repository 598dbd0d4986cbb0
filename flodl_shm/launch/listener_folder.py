"""The folder of a rank server's listening socket, and the removal of leftover ones.

Each start of a rank connects to the rank server through a Unix socket file. That file
lives in a folder of its own in the temp dir, ``fshm_rank_server_<launcher pid>_<random>``
(``tempfile.mkdtemp``: mode 0700, this user's only), not in multiprocessing's per-process
``pymp-*`` folder, which only a normal interpreter exit removes. A socket's path holds at
most 107 bytes: where the temp dir's path is too long for that (a scheduler's per-job
``TMPDIR``), the folder goes to ``/tmp`` instead (``base``).

Ownership
=========

- **Created** by the launcher when it starts its rank server (``create``), and recorded
  as live in this process until it is removed.
- **Removed** by the launcher once every rank has started (``remove``): the server keeps
  its open socket, but nothing connects any more. A launcher killed from then on leaves
  nothing in the temp dir.
- **Leftovers** come from a launcher killed (SIGKILL, the OOM killer) while its ranks
  started, or from an exception raised into the launcher between two steps of its own
  clean-up (a storm of Ctrl-C). Every ``create`` first removes the folders whose launcher
  is gone (its pid runs no process here), and this process's own folders that no live
  server of it holds: the name says whose a folder is. Folders of another user, or of a
  live process, stay.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading

from ..engine.segment import pid_alive

PREFIX = "fshm_rank_server_"
SOCKET = "sock"  # the socket file's name in the folder
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)_[A-Za-z0-9_]+")
# the longest base that leaves room for "/<PREFIX><pid>_<8 random>/<SOCKET>" in a
# socket address (sun_path: 108 bytes with its terminating NUL; pids up to 7 digits)
_BASE_MAX = 107 - len(f"/{PREFIX}1234567_abcdefgh/{SOCKET}")

_lock = threading.Lock()  # create and reap one at a time: a reap never sees a new folder
_live: set[str] = set()   # this process's folders whose server may still take a rank


def _after_fork_in_child() -> None:
    """A fork's child starts with a fresh lock (a thread of the parent may have held it
    at the fork) and no live folder (the parent's are the parent's)."""
    global _lock
    _lock = threading.Lock()
    _live.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def base() -> str:
    """Where the socket folders go: the temp dir, or ``/tmp`` where the temp dir's path
    leaves no room for a socket's path."""
    temp = tempfile.gettempdir()
    return temp if len(os.fsencode(temp)) <= _BASE_MAX else "/tmp"


def create() -> str:
    """A fresh socket folder of this process (leftovers reaped first); its path. The
    socket's path is ``os.path.join(folder, SOCKET)``."""
    where = base()
    with _lock:
        reap(where)
        folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_", dir=where)
        _live.add(folder)
    return folder


def remove(folder: str) -> None:
    """Remove ``folder`` and its socket file, as far as they exist. It stops being this
    process's live folder first, so a removal cut short leaves it to the next reap."""
    with _lock:
        _live.discard(folder)
    shutil.rmtree(folder, ignore_errors=True)


def launcher_pid(name: str) -> int | None:
    """The pid of the launcher whose socket folder is named ``name``; None for a name
    that is not a socket folder's."""
    m = _NAME.fullmatch(name)
    return None if m is None else int(m[1])


def reap(where: str | None = None) -> list[str]:
    """Remove the socket folders in ``where`` (default: ``base()``) of launchers that
    are gone, and this process's own that no live server holds; returns their paths.
    Only this user's folders; best effort (whatever the file system refuses stays)."""
    me, uid = os.getpid(), os.getuid()
    try:
        entries = list(os.scandir(where or base()))
    except OSError:
        return []
    removed = []
    for entry in entries:
        pid = launcher_pid(entry.name)
        if pid is None:
            continue
        if (entry.path in _live) if pid == me else pid_alive(pid):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not entry.is_dir(follow_symlinks=False):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed

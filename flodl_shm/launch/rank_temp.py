"""A rank's multiprocessing temp folder (``pymp-*``): who makes it, who removes it.

multiprocessing keeps the sockets of a process's own forkserver and resource sharer (a
DataLoader with ``multiprocessing_context="forkserver"``, a tensor sent to a spawned
worker or back from a forked one) in a temp folder it makes on first use
(``multiprocessing.util.get_temp_dir``) and removes in its exit handler. A rank leaves by
``os._exit``, which skips that handler, and a process killed by a signal runs nothing at
all: a rank killed, and its DataLoader worker killed with it, each left its folder.

- **Made on first use, as multiprocessing does** (``name_after_the_rank``): in a rank
  and in every process it forks, the folder's name carries the rank's pid (``folder_stem``:
  ``pymp-R``, the pid in five base-36 digits, two random ones); a rank that never needs
  one makes none. A process forked after the rank made its folder shares it (it inherits
  the choice). The name is as long as multiprocessing's own (``pymp-`` and 8 random
  characters), so a socket's path in it is no longer: a Unix socket's path holds at most
  107 bytes, and a name 16 characters longer failed a DataLoader's batch under a long
  temp dir. multiprocessing's random names are lowercase, so none reads as a rank's.
- **The rank removes its own** on its way out (``remove_own``), once its descendants
  ended; a forked process that exits normally removes its own (multiprocessing's
  handler).
- **The supervisor removes those of a killed rank** (``remove_left_by``): its own and
  its forks', found by the rank's pid in the name, once the rank is reaped. A folder
  whose pid runs again (another process now has it) is left alone, and only a folder of
  this user is touched.

A folder the rank inherited from the process it was forked from (the rank server's, if
that made one) stays that process's.
"""
from __future__ import annotations

import os
import random
import shutil
import stat
import tempfile
from multiprocessing import process as mp_process
from multiprocessing import util as mp_util
from typing import Iterable

from ..engine.segment import pid_alive

#: A rank's folder is named ``FOLDER_PREFIX``, the rank's pid in ``PID_DIGITS`` base-36
#: digits (Linux pids are below 2**22 < 36**5), then ``RANDOM_DIGITS`` random ones.
FOLDER_PREFIX = "pymp-R"
PID_DIGITS = 5
RANDOM_DIGITS = 2
_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def folder_stem(pid: int) -> str:
    """The start of the names of rank ``pid``'s folders: ``FOLDER_PREFIX`` and the pid."""
    digits = ""
    for _ in range(PID_DIGITS):
        pid, d = divmod(pid, 36)
        digits = _DIGITS[d] + digits
    return FOLDER_PREFIX + digits


def _make_folder(rank_pid: int) -> str:
    """A new folder of this user's only, named for rank ``rank_pid`` (a free name among
    the 1,296 its random digits give; multiprocessing's own kind of name if none is)."""
    stem = os.path.join(tempfile.gettempdir(), folder_stem(rank_pid))
    for _ in range(64):
        path = stem + "".join(random.choices(_DIGITS, k=RANDOM_DIGITS))
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
    return tempfile.mkdtemp(prefix="pymp-")


def name_after_the_rank() -> str | None:
    """In a rank, as it starts: from now on multiprocessing makes its temp folder, here
    and in what this rank forks, under a name that carries this rank's pid (the module
    doc). Returns the folder the rank has from the process it was forked from, if any:
    that process's to remove."""
    rank_pid = os.getpid()

    def get_temp_dir() -> str:  # multiprocessing.util.get_temp_dir, named for the rank
        config = mp_process.current_process()._config
        tempdir = config.get("tempdir")
        if tempdir is None:
            tempdir = _make_folder(rank_pid)
            mp_util.info("created temp directory %s", tempdir)
            mp_util.Finalize(None, mp_util._remove_temp_dir, args=(shutil.rmtree, tempdir),
                             exitpriority=-100)
            config["tempdir"] = tempdir
        return tempdir

    mp_util.get_temp_dir = get_temp_dir
    return mp_process.current_process()._config.get("tempdir")


def remove_own(inherited: str | None) -> None:
    """Remove this rank's temp folder (not one ``inherited`` from its parent)."""
    mine = mp_process.current_process()._config.get("tempdir")
    if mine and mine != inherited:
        shutil.rmtree(mine, ignore_errors=True)


def remove_left_by(pids: Iterable[int]) -> None:
    """Remove the temp folders of ranks ``pids`` that ended without removing their own
    (killed). Call once they are reaped; a pid that runs again is another process's."""
    stems = {folder_stem(pid) for pid in pids if not pid_alive(pid)}
    if not stems:
        return
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    uid = os.getuid()
    length = len(FOLDER_PREFIX) + PID_DIGITS + RANDOM_DIGITS
    for name in names:
        if len(name) != length or name[:-RANDOM_DIGITS] not in stems:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)  # (a symlink is no folder here: never followed)
        except OSError:
            continue
        if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)

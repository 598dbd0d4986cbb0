"""Crash-safe file commits: unique locked temp file + fsync + atomic rename + directory fsync.

Every checkpoint artifact (``.fdl``, ``.outer.fdl``, ``.meta.json``,
``.death.json``, converter output) is committed through :func:`atomic_write`, so
a reader sees either the previous complete file or the new complete file, never
a torn one:

1. the bytes go to a temp file of its own in the same directory,
   ``<name>.<pid>.<random>.tmp``, created with ``O_EXCL`` (two writers of one
   path never share a temp file) and ``flock``-ed for as long as it exists
   under that name;
2. the temp file is flushed and ``fsync``-ed (the data is on disk before the
   name points at it);
3. ``os.replace`` renames it over ``<path>`` (atomic on POSIX within one
   filesystem; of two concurrent writers, the last rename wins whole);
4. the parent directory is ``fsync``-ed (the rename itself survives a power
   loss).

On any failure the temp file is removed and the previous ``<path>`` is left
untouched. A process killed mid-write leaves its temp file behind, unlocked
(the kernel drops a dead process's locks). Readers never open temp files, and
every commit first removes the **stale** temps of its path
(:func:`remove_stale_temps`): those nobody holds the lock of that are either
non-empty (a live writer locks before its first byte), older than
``STALE_TEMP_AGE_S`` (covering the instant between a writer's create and its
lock) or written by a pid that no longer runs on this host, and any unlocked
``<name>.tmp`` (the fixed temp name of earlier releases). A live writer's temp
is never removed.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import BinaryIO, Callable, Sequence, TypeVar

from ..errors import plural

T = TypeVar("T")

logger = logging.getLogger("flodl_shm")

TMP_SUFFIX = ".tmp"
#: the longest suffix a commit's temp file adds to the final file's name
#: (``.<pid>.<8 hex>.tmp``; a pid of up to 7 digits, as Linux's largest pid_max)
LONGEST_TEMP_SUFFIX = ".4194304.ffffffff" + TMP_SUFFIX
WRITE_BUFFER = 1 << 20
#: An unlocked, empty temp file younger than this may belong to a writer between its
#: create and its lock; older (or non-empty) unlocked temps are stale.
STALE_TEMP_AGE_S = 30.0


def path_limit(folder: Path, name: str, default: int) -> int:
    """``os.pathconf`` ``name`` (``"PC_NAME_MAX"``, ``"PC_PATH_MAX"``) of the nearest
    existing folder at or above ``folder`` (``default`` where the file system does not
    say)."""
    for d in (folder, *folder.parents):
        try:
            return os.pathconf(d, name)
        except FileNotFoundError:
            continue  # (not made yet: its parent's file system will hold it)
        except (OSError, ValueError):  # (a path too long, a file system that does not say)
            return default
    return default


def temp_name_pattern(name: str) -> "re.Pattern[str]":
    """Matches the temp files of a commit of the file named ``name``:
    ``<name>.<pid>.<hex>.tmp``, and the fixed ``<name>.tmp`` of earlier releases."""
    return re.compile(re.escape(name) + r"(?:\.\d+\.[0-9a-f]+)?" + re.escape(TMP_SUFFIX) + "$")


def disk_full_hint(e: OSError) -> str:
    """What to do about a write that failed on a full disk, to append to its message
    ("" for any other error)."""
    return " (the disk is full: free some space, or save elsewhere)" \
        if e.errno == errno.ENOSPC else ""


def fsync_dir(directory: "str | os.PathLike[str]") -> None:
    """fsync a directory so a rename inside it is durable (best effort where the
    platform can't open directories)."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_locked_temp(final: Path) -> tuple[int, Path]:
    """A new temp file next to ``final``, created exclusively and ``flock``-ed."""
    for _ in range(64):
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
        except OSError as e:  # name the file the caller asked for, not our temp
            raise type(e)(e.errno, e.strerror, os.fspath(final)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            # a filesystem without flock (some FUSE/NFS setups): write unlocked; sweepers
            # cannot lock it either, so they leave it alone
            logger.debug("cannot flock checkpoint temp file %s (%s); writing it unlocked", tmp, e)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd, tmp
    raise FileExistsError(f"could not create a unique temp file next to {final}")


def _is_stale(path: Path, fd: int, legacy: bool) -> bool:
    """Whether the temp file open as ``fd`` belongs to no live writer (we hold its lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live writer holds it (or the filesystem cannot tell: keep it)
    st = os.fstat(fd)
    try:
        if os.stat(path).st_ino != st.st_ino:
            return False  # renamed away and replaced meanwhile: not the file we locked
    except FileNotFoundError:
        return False
    if legacy:
        return True  # the fixed name of earlier releases: no writer of this one uses it
    return (st.st_size > 0 or time.time() - st.st_mtime > STALE_TEMP_AGE_S
            or not _writer_alive(path.name))


def _writer_alive(temp_name: str) -> bool:
    """Whether the process whose pid a temp's name carries (``<name>.<pid>.<hex>.tmp``)
    still runs on this host: an empty temp of a dead writer is stale at once, without
    waiting out ``STALE_TEMP_AGE_S`` (a run that ended sooner left it for good)."""
    parts = temp_name.rsplit(".", 3)
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return True  # no pid to ask about: leave it to the age rule
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's) or cannot be asked about
    return True


def remove_stale_temps(path: "str | os.PathLike[str]",
                       listing: "Sequence[str] | None" = None) -> list[Path]:
    """Remove the temp files that dead writers of ``path`` left behind; returns them.

    A temp file is stale when no process holds its lock and it is non-empty
    (a writer locks before writing), older than ``STALE_TEMP_AGE_S``, or its writer
    (the pid in its name) is gone from this host. Live writers' temps are left
    alone; errors are logged, never raised.

    Args:
        path: the committed file whose temps to clean (e.g. ``runs/ckpt-r00000012.fdl``).
        listing: the names in ``path``'s folder, when the caller cleans several files
            of it (read once: a folder of 20,000 files took 2 ms a listing); default:
            read here.
    """
    final = Path(os.fspath(path))
    folder = final.parent if str(final.parent) else Path(".")
    pattern = temp_name_pattern(final.name)
    try:
        names = [n for n in (os.listdir(folder) if listing is None else listing)
                 if n.startswith(final.name) and pattern.match(n)]  # (a temp's name starts so)
    except OSError:
        return []
    removed = []
    for name in names:
        tmp = folder / name
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # gone already (committed or cleaned by someone else)
        try:
            if _is_stale(tmp, fd, legacy=name == final.name + TMP_SUFFIX):
                os.unlink(tmp)
                removed.append(tmp)
        except OSError as e:
            logger.warning("could not remove stale checkpoint temp file %s: %s", tmp, e)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %s of %s left by killed writers",
                    plural(len(removed), "stale temp file"), final)
    return removed


def _os_error_within(e: BaseException, depth: int = 8) -> OSError | None:
    """The OS's error an exception was raised from or while handling, if any."""
    for _ in range(depth):
        e = e.__cause__ or e.__context__
        if e is None:
            return None
        if isinstance(e, OSError):
            return e
    return None


def atomic_write(path: "str | os.PathLike[str]", write: Callable[[BinaryIO], T]) -> T:
    """Commit ``path`` atomically with the bytes ``write(fileobj)`` produces.

    First removes the stale temps of ``path`` (:func:`remove_stale_temps`).
    ``write`` receives a buffered binary file object (1 MiB buffer; large writes
    go straight to the OS) positioned at 0 of a fresh, locked temp file
    (``<path>.<pid>.<random>.tmp``); it may wrap it (e.g. in a ``GzipFile``) but
    must not close it. Returns whatever ``write`` returns. Raises whatever
    ``write`` or the OS raises, after removing the temp file; the old ``path``
    is never modified on failure. Concurrent writers of one path each commit
    a whole file; the last rename wins.
    """
    final = Path(os.fspath(path))
    remove_stale_temps(final)
    lock_fd, tmp = _create_locked_temp(final)
    try:
        try:
            # the lock lives on lock_fd until after the rename: the temp is never unlocked
            # under its name while this writer is alive
            fh = os.fdopen(os.dup(lock_fd), "wb", buffering=WRITE_BUFFER)
            try:
                result = write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            except BaseException:
                try:
                    fh.close()  # (its flush of what is left fails again: one error is news)
                except OSError:
                    pass
                raise
            fh.close()
            os.replace(tmp, final)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            # a writer that wraps the OS's error (torch.save's zip writer raises its own
            # RuntimeError, the OSError only in its context) still fails as that OSError
            cause = e if isinstance(e, OSError) else _os_error_within(e)
            if cause is not None and cause.errno is not None and cause.filename is None:
                # the OS's write error names no file: name the one being written
                raise OSError(cause.errno, f"{cause.strerror} while writing {final}"
                                           f"{disk_full_hint(cause)}") from e
            raise
    finally:
        os.close(lock_fd)
    fsync_dir(final.parent if str(final.parent) else ".")
    return result


def atomic_write_bytes(path: "str | os.PathLike[str]", data: bytes) -> None:
    """Commit ``data`` to ``path`` atomically (see :func:`atomic_write`)."""

    atomic_write(path, lambda fh: fh.write(data))

"""Crash-safe file commits: temp file + fsync + atomic rename + directory fsync.

Every checkpoint artifact (``.fdl``, ``.outer.fdl``, ``.meta.json``,
``.death.json``) is committed through :func:`atomic_write`, so a reader sees
either the previous complete file or the new complete file, never a torn one:

1. the bytes go to ``<path>.tmp`` (opened with ``O_TRUNC``, so a leftover temp
   file from a crashed writer is overwritten, never appended to);
2. the temp file is flushed and ``fsync``-ed (the data is on disk before the
   name points at it);
3. ``os.replace`` renames it over ``<path>`` (atomic on POSIX within one
   filesystem);
4. the parent directory is ``fsync``-ed (the rename itself survives a power
   loss).

On any failure the temp file is removed and the previous ``<path>`` is left
untouched. A process killed between steps leaves at most a stale ``<path>.tmp``,
which readers never look at and the next write to ``<path>`` replaces.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

T = TypeVar("T")

TMP_SUFFIX = ".tmp"
WRITE_BUFFER = 1 << 20


def tmp_path_for(path: "str | os.PathLike[str]") -> Path:
    """The temp sibling a commit of ``path`` writes first: ``<path>.tmp``."""
    p = Path(os.fspath(path))
    return p.with_name(p.name + TMP_SUFFIX)


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


def atomic_write(path: "str | os.PathLike[str]", write: Callable[[BinaryIO], T]) -> T:
    """Commit ``path`` atomically with the bytes ``write(fileobj)`` produces.

    ``write`` receives a buffered binary file object (1 MiB buffer; large writes
    go straight to the OS) positioned at 0 of ``<path>.tmp``; it may wrap it
    (e.g. in a ``GzipFile``) but must not close it. Returns
    whatever ``write`` returns. Raises whatever ``write`` or the OS raises, after
    removing the temp file; the old ``path`` is never modified on failure.
    """
    final = Path(os.fspath(path))
    tmp = tmp_path_for(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb", buffering=WRITE_BUFFER) as fh:
            result = write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(final.parent if str(final.parent) else ".")
    return result


def atomic_write_bytes(path: "str | os.PathLike[str]", data: bytes) -> None:
    """Commit ``data`` to ``path`` atomically (see :func:`atomic_write`)."""

    atomic_write(path, lambda fh: fh.write(data))

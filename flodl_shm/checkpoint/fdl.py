"""flodl's ``.fdl`` checkpoint format: read, write from raw bytes, load into a module.

Byte layout (flodl 0.7.0 ``nn/checkpoint.rs``, docs/checkpoints.md, "The `.fdl` format"), all
little-endian::

    magic            4   b"FDLC"
    version          u32 2 written; 1..=2 read (v1 = flodl 0.1.x naming, same layout)
    structural_hash  32  raw bytes; all zero = "no hash" (never checked)
    entry_count      u32
    entry * count:
        name_len     u32 (<= 64 KiB)
        name         name_len bytes of UTF-8 (decoded lossily)
        ndim         u32 (<= 64)
        dims         ndim x i64
        dtype_tag    u8  1 f16, 2 bf16, 3 f32, 4 f64, 5 i32, 6 i64
        byte_count   u64 (= numel x element size)
        bytes        byte_count raw little-endian elements, C order

A path ending in ``.gz`` holds the whole stream gzip-compressed (decided by the
final path, never the temp name). Every write is a crash-safe commit (temp file
+ fsync + atomic rename + directory fsync, see ``_atomic``), so a reader sees
the previous checkpoint or the new one, never a torn file.

Duplicate names are legal on disk; on load the later entry wins (this is why
consensus checkpoints use positional ``p{i}`` / ``b{j}`` keys).

Writing from raw bytes (``write_fdl_raw`` / ``FdlWriter``) never rebuilds
tensors: payload buffers go straight to the file. This module imports torch
only inside the functions that exchange torch tensors.
"""
from __future__ import annotations

import enum
import gzip
import logging
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from ..errors import CheckpointError
from ..frame import tensor_array
from ._atomic import atomic_write

logger = logging.getLogger("flodl_shm")

FDL_MAGIC = b"FDLC"
#: Version this build writes. v1 (flodl 0.1.x naming) and v2 share one layout.
FDL_VERSION = 2
#: Highest version this build reads.
FDL_MAX_VERSION = 2
#: Size of the structural-hash field; all-zero means "no hash".
HASH_LEN = 32
#: Bound on an entry name: keys are code identifiers, anything bigger is corruption.
MAX_NAME_LEN = 64 * 1024
#: Bound on a tensor's rank in an entry header.
MAX_NDIM = 64
#: gzip level flodl uses (flate2's default).
GZIP_LEVEL = 6

_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1
_HEADER = struct.Struct("<4sI32sI")
_READ_CHUNK = 16 << 20
#: Piece size when inflating a gzip payload only to skip it.
_SKIP_CHUNK = 1 << 20
#: Smallest entry on disk: name length, an empty name, ndim 0, the dtype tag, the byte count.
MIN_ENTRY_BYTES = 4 + 4 + 1 + 8
#: Most entries a file may declare. Real models hold thousands of tensors; a count beyond
#: this is corruption or an attack, and each entry costs the reader ~200 bytes of memory.
MAX_ENTRIES = 1 << 20
#: deflate's largest expansion: a gzip stream of C bytes inflates to fewer than 1032 x C.
GZIP_MAX_RATIO = 1032


class FdlDtype(enum.IntEnum):
    """Checkpoint dtype tags (a different table from the wire's DTYPE_F32/DTYPE_BF16)."""

    F16 = 1
    BF16 = 2
    F32 = 3
    F64 = 4
    I32 = 5
    I64 = 6

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def label(self) -> str:
        return _LABEL[self]

    @classmethod
    def from_tag(cls, tag: int, where: str = "") -> "FdlDtype":
        try:
            return cls(tag)
        except ValueError:
            known = ", ".join(f"{t.value} = {t.label}" for t in cls)
            raise CheckpointError(
                f"corrupt checkpoint: unknown dtype tag: {tag}{where} (known tags: {known})"
            ) from None


_ITEMSIZE = {FdlDtype.F16: 2, FdlDtype.BF16: 2, FdlDtype.F32: 4, FdlDtype.F64: 8,
             FdlDtype.I32: 4, FdlDtype.I64: 8}
_LABEL = {FdlDtype.F16: "f16", FdlDtype.BF16: "bf16", FdlDtype.F32: "f32",
          FdlDtype.F64: "f64", FdlDtype.I32: "i32", FdlDtype.I64: "i64"}
# numpy views of the raw bytes (bf16 has no numpy dtype: raw uint16 bits).
_NUMPY = {FdlDtype.F16: np.dtype("<f2"), FdlDtype.BF16: np.dtype("<u2"),
          FdlDtype.F32: np.dtype("<f4"), FdlDtype.F64: np.dtype("<f8"),
          FdlDtype.I32: np.dtype("<i4"), FdlDtype.I64: np.dtype("<i8")}


def _torch():
    import torch

    return torch


def torch_dtype_for_tag(tag: int):
    """The torch dtype a checkpoint tag decodes to."""
    torch = _torch()
    return {FdlDtype.F16: torch.float16, FdlDtype.BF16: torch.bfloat16,
            FdlDtype.F32: torch.float32, FdlDtype.F64: torch.float64,
            FdlDtype.I32: torch.int32, FdlDtype.I64: torch.int64}[FdlDtype.from_tag(tag)]


def tag_for_torch_dtype(dtype, name: str = "") -> FdlDtype:
    """The checkpoint tag of a torch dtype; ``CheckpointError`` for dtypes .fdl can't hold."""
    torch = _torch()
    table = {torch.float16: FdlDtype.F16, torch.bfloat16: FdlDtype.BF16,
             torch.float32: FdlDtype.F32, torch.float64: FdlDtype.F64,
             torch.int32: FdlDtype.I32, torch.int64: FdlDtype.I64}
    try:
        return table[dtype]
    except KeyError:
        what = f"tensor {name!r}" if name else "tensor"
        cast = ("store its real and imaginary parts as floats (torch.view_as_real(t)); "
                ".float() would drop the imaginary part" if dtype.is_complex else
                "cast it first (e.g. .to(torch.int64) or .float())")
        raise CheckpointError(
            f"{what} has dtype {dtype}, which the .fdl format cannot store (it holds float16, "
            f"bfloat16, float32, float64, int32, int64); {cast}, or leave it out"
        ) from None


def is_gzip_path(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` names a gzip-compressed checkpoint (it ends in ``.gz``)."""
    return os.fspath(path).endswith(".gz")


def parse_structural_hash(value: "None | str | bytes") -> bytes:
    """Normalise a structural hash: ``None`` -> 32 zero bytes; 64 hex chars or 32 raw bytes."""
    if value is None:
        return bytes(HASH_LEN)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) != HASH_LEN:
            raise CheckpointError(
                f"structural hash has {len(raw)} bytes; it must be exactly {HASH_LEN} "
                f"(or {HASH_LEN * 2} hex chars)"
            )
        return raw
    if isinstance(value, str):
        if len(value) != HASH_LEN * 2:
            raise CheckpointError(
                f"structural hash {value!r}: expected {HASH_LEN * 2} hex chars, got {len(value)}"
            )
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise CheckpointError(f"structural hash {value!r} is not hexadecimal") from None
    raise CheckpointError(f"structural hash must be hex text or bytes, got {type(value).__name__}")


# --- entries ----------------------------------------------------------------------


@dataclass(eq=False)
class RawEntry:
    """One entry to write: a name, i64 dims, a checkpoint dtype tag and the raw bytes.

    ``data`` is any contiguous buffer (bytes, numpy array, memoryview); it is
    written as is, never copied into a tensor.
    """

    name: str
    shape: tuple[int, ...]
    dtype_tag: int
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        self.dtype_tag = int(FdlDtype.from_tag(int(self.dtype_tag), f" in entry {self.name!r}"))
        mv = self.data if isinstance(self.data, memoryview) else memoryview(self.data)
        if mv.ndim != 1 or mv.format != "B":
            if not mv.c_contiguous:
                raise CheckpointError(f"entry {self.name!r}: data must be a contiguous buffer")
            mv = mv.cast("B")
        self.data = mv
        _check_entry_header(self.name, self.shape, self.dtype_tag, mv.nbytes)


def _check_entry_header(name: str, shape: Sequence[int], tag: int, nbytes: int) -> None:
    encoded = name.encode("utf-8")
    if len(encoded) > MAX_NAME_LEN:
        raise CheckpointError(
            f"entry name of {len(encoded)} bytes exceeds the .fdl limit of {MAX_NAME_LEN} bytes; "
            f"use a shorter key"
        )
    if len(shape) > MAX_NDIM:
        raise CheckpointError(
            f"entry {name!r} has {len(shape)} dims; the .fdl format allows at most {MAX_NDIM}"
        )
    for d, n in enumerate(shape):
        if n < 0 or n > _I64_MAX:
            raise CheckpointError(f"entry {name!r}: dim[{d}] = {n} is not a valid size")
    dtype = FdlDtype.from_tag(tag, f" in entry {name!r}")
    want = math.prod(shape) * dtype.itemsize
    if nbytes != want:
        raise CheckpointError(
            f"entry {name!r}: {nbytes} bytes of data but shape {list(shape)} x "
            f"{dtype.label} ({dtype.itemsize} bytes) needs {want} bytes"
        )


@dataclass(eq=False, slots=True)
class FdlEntry:
    """One entry as read from a file.

    ``data`` holds the raw bytes when the file was read with data; ``offset`` is
    the payload's byte offset in the (uncompressed) stream. Slotted: a file's
    entry table costs memory in proportion to its entry count, which
    ``MAX_ENTRIES`` and the file's size bound.
    """

    name: str
    shape: tuple[int, ...]
    dtype_tag: int
    nbytes: int
    offset: int
    data: Optional[bytearray] = field(default=None, repr=False)

    @property
    def dtype(self) -> FdlDtype:
        return FdlDtype(self.dtype_tag)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_numpy(self) -> np.ndarray:
        """The payload as a numpy array of its shape (bf16 as uint16 bits), no copy."""
        if self.data is None:
            raise CheckpointError(f"entry {self.name!r} was read without its data")
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape)

    def to_tensor(self):
        """A CPU torch tensor of the entry's dtype and shape, sharing the entry's bytes."""
        torch = _torch()
        if self.data is None:
            raise CheckpointError(f"entry {self.name!r} was read without its data")
        dt = torch_dtype_for_tag(self.dtype_tag)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=dt)
        return torch.frombuffer(self.data, dtype=dt).reshape(self.shape)


@dataclass
class FdlFile:
    """A parsed ``.fdl``: its version, structural hash and entries in file order."""

    version: int
    structural_hash: bytes
    entries: list[FdlEntry]

    @property
    def hash_hex(self) -> Optional[str]:
        """Lowercase hex of the structural hash, ``None`` when it is all zero."""
        return self.structural_hash.hex() if any(self.structural_hash) else None

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def by_name(self) -> dict[str, FdlEntry]:
        """Name -> entry, the later of duplicate names winning (flodl's load rule)."""
        return {e.name: e for e in self.entries}


# --- writing ----------------------------------------------------------------------


class FdlWriter:
    """Stream a ``.fdl`` body into a binary file object, one entry at a time.

    The header is written on construction with the promised entry count; each
    :meth:`write_entry` emits one entry; :meth:`finish` checks the promise was
    kept. Payload buffers are written as they are (no copy into tensors);
    ``write_entry_chunks`` lets a caller produce one entry's bytes in pieces
    (e.g. a bf16 -> f32 upcast through a small scratch buffer).
    """

    def __init__(self, fh: BinaryIO, count: int, structural_hash: "None | str | bytes" = None,
                 version: int = FDL_VERSION) -> None:
        if not 0 <= count <= _U32_MAX:
            raise CheckpointError(f"a .fdl holds at most {_U32_MAX} entries, got {count}")
        if version not in range(1, FDL_MAX_VERSION + 1):
            raise CheckpointError(f"cannot write .fdl version {version} (1..={FDL_MAX_VERSION})")
        self._fh = fh
        self._count = count
        self._written = 0
        self.bytes_written = 0
        self._put(_HEADER.pack(FDL_MAGIC, version, parse_structural_hash(structural_hash), count))

    def _put(self, buf) -> None:
        self._fh.write(buf)
        self.bytes_written += memoryview(buf).nbytes

    def _entry_header(self, name: str, shape: Sequence[int], tag: int, nbytes: int) -> None:
        if self._written >= self._count:
            raise CheckpointError(
                f"entry {name!r} is entry #{self._written + 1} but the header promised "
                f"{self._count} entries"
            )
        _check_entry_header(name, shape, tag, nbytes)
        encoded = name.encode("utf-8")
        head = struct.pack(f"<I{len(encoded)}sI{len(shape)}q", len(encoded), encoded,
                           len(shape), *shape)
        self._put(head + struct.pack("<BQ", tag, nbytes))

    def write_entry(self, name: str, shape: Sequence[int], dtype_tag: int, data) -> None:
        """Write one entry whose bytes are the contiguous buffer ``data``."""
        mv = data if isinstance(data, memoryview) else memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        self._entry_header(name, tuple(int(d) for d in shape), int(dtype_tag), mv.nbytes)
        if mv.nbytes:
            self._put(mv)
        self._written += 1

    def write_entry_chunks(self, name: str, shape: Sequence[int], dtype_tag: int, nbytes: int,
                           chunks: Iterable) -> None:
        """Write one entry whose ``nbytes`` bytes come from the buffers ``chunks`` yields."""
        self._entry_header(name, tuple(int(d) for d in shape), int(dtype_tag), nbytes)
        got = 0
        for c in chunks:
            mv = c if isinstance(c, memoryview) else memoryview(c)
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")
            got += mv.nbytes
            if got > nbytes:
                raise CheckpointError(f"entry {name!r}: chunks overran the declared {nbytes} bytes")
            self._put(mv)
        if got != nbytes:
            raise CheckpointError(f"entry {name!r}: chunks gave {got} bytes, declared {nbytes}")
        self._written += 1

    def finish(self) -> int:
        """Check every promised entry was written; returns the stream's byte count."""
        if self._written != self._count:
            raise CheckpointError(
                f"the header promised {self._count} entries but {self._written} were written"
            )
        return self.bytes_written


def write_fdl_stream(path: "str | os.PathLike[str]", count: int,
                     body: Callable[[FdlWriter], None],
                     structural_hash: "None | str | bytes" = None) -> int:
    """Commit a ``.fdl`` at ``path`` whose ``count`` entries ``body(writer)`` writes.

    gzip when ``path`` ends in ``.gz``. The commit is atomic (temp + fsync +
    rename + dir fsync); on any error the temp file is removed, the previous
    file is untouched and the error propagates. Returns the uncompressed size.
    """
    gz = is_gzip_path(path)

    def _write(fh: BinaryIO) -> int:
        if gz:
            with gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as zf:
                w = FdlWriter(zf, count, structural_hash)
                body(w)
                return w.finish()
        w = FdlWriter(fh, count, structural_hash)
        body(w)
        return w.finish()

    return atomic_write(path, _write)


def write_fdl_raw(path: "str | os.PathLike[str]", entries: Sequence[RawEntry],
                  structural_hash: "None | str | bytes" = None) -> int:
    """Commit ``entries`` (already-serialized bodies) as a ``.fdl`` at ``path``.

    Byte-identical to what flodl's ``save_checkpoint_from_raw_file`` writes; the
    payload buffers go to the file without being copied. Returns the
    uncompressed stream size.
    """
    entries = list(entries)

    def body(w: FdlWriter) -> None:
        for e in entries:
            w.write_entry(e.name, e.shape, e.dtype_tag, e.data)

    return write_fdl_stream(path, len(entries), body, structural_hash)


def _tensor_bytes(t) -> memoryview:
    """Raw little-endian bytes of a CPU tensor (a view when it is contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor_array(t.reshape(-1), np.uint8))


def save_tensors(path: "str | os.PathLike[str]", named: Sequence[tuple[str, object]],
                 structural_hash: "None | str | bytes" = None) -> int:
    """Commit ``(name, tensor)`` pairs as a ``.fdl`` (each in its own dtype).

    ``CheckpointError`` names any tensor whose dtype .fdl can't hold.
    """
    entries = []
    for name, t in named:
        tag = tag_for_torch_dtype(t.dtype, name)
        entries.append(RawEntry(name, tuple(t.shape), tag, _tensor_bytes(t)))
    return write_fdl_raw(path, entries, structural_hash)


def save_module(module, path: "str | os.PathLike[str]",
                structural_hash: "None | str | bytes" = None) -> int:
    """Save ``module``'s parameters then persistent buffers by qualified name
    (flodl's ``save_checkpoint`` order), loadable with :func:`load_module`."""
    state = module.state_dict()
    params = [n for n, _ in module.named_parameters() if n in state]
    pset = set(params)
    named = [(n, state[n]) for n in params] + [(n, t) for n, t in state.items() if n not in pset]
    return save_tensors(path, named, structural_hash)


# --- reading ----------------------------------------------------------------------


class _Source:
    """A binary stream, its uncompressed position, and what it can hold.

    ``size`` is a plain file's size (``None`` for gzip); ``limit`` bounds the
    uncompressed bytes the stream can possibly hold: the size of a plain file,
    ``GZIP_MAX_RATIO`` x the compressed size for gzip.
    """

    def __init__(self, fh: BinaryIO, size: Optional[int], seekable: bool, limit: int,
                 label: str) -> None:
        self.fh = fh
        self.size = size
        self.seekable = seekable
        self.limit = limit
        self.label = label  # the file, for the errors
        self.pos = 0

    def read_exact(self, n: int, what: str) -> bytes:
        buf = self.fh.read(n)
        got = len(buf)
        self.pos += got
        if got != n:
            if self.pos == 0:  # nothing at all
                raise CheckpointError(f"{self.label} is empty: not a .fdl checkpoint (a write "
                                      f"that never finished, or the wrong file)")
            raise CheckpointError(
                f"corrupt checkpoint: {self.label} ends inside {what} (needed {n} bytes, "
                f"{got} present)"
            )
        return buf

    def payload(self, n: int, keep: bool, where: str) -> Optional[bytearray]:
        """Consume an ``n``-byte payload; its bytes when ``keep``, else skip it (a plain
        file seeks past it; gzip inflates it in ``_READ_CHUNK`` pieces, keeping none)."""
        def truncated(present: int) -> CheckpointError:
            return CheckpointError(f"corrupt checkpoint: payload truncated: header claims {n} "
                                   f"bytes, {max(present, 0)} present{where}")

        if self.size is not None and n > self.size - self.pos:
            raise truncated(self.size - self.pos)
        if not keep and self.seekable:
            self.fh.seek(n, os.SEEK_CUR)
            self.pos += n
            return None
        # More than the stream can hold: count what is there, keep none of it.
        keep = keep and n <= self.limit - self.pos
        if keep and self.size is not None:
            # n is bounded by the bytes the file holds: allocate once, read in place.
            buf = bytearray(n)
            got = self.fh.readinto(buf) if n else 0
        else:
            # Untrusted length on a stream of unknown size (gzip): grow with the bytes
            # actually present so a header claiming 2^60 bytes fails at EOF, not on malloc.
            buf = bytearray() if keep else None
            got = 0
            while got < n:
                chunk = self.fh.read(min(n - got, _READ_CHUNK if keep else _SKIP_CHUNK))
                if not chunk:
                    break
                got += len(chunk)
                if keep:
                    buf += chunk
        self.pos += got
        if got != n:
            raise truncated(got)
        return buf


def _open_source(path: Path):
    """(raw file, gzip wrapper or None, _Source) for ``path``: plain files are seekable
    and sized."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint {path}: {e}") from e
    size = os.fstat(raw.fileno()).st_size
    if is_gzip_path(path):
        zf = gzip.GzipFile(fileobj=raw, mode="rb")
        return raw, zf, _Source(zf, None, False, size * GZIP_MAX_RATIO, str(path))
    return raw, None, _Source(raw, size, True, size, str(path))


class FdlReader:
    """Read a ``.fdl`` (or ``.fdl.gz``) one entry at a time.

    Opening reads and checks the file header (magic, version, structural hash,
    entry count); :meth:`entries` then yields the entries in file order without
    holding them, so memory does not grow with the entry count. Use as a
    context manager::

        with FdlReader(path) as r:
            for e in r.entries(lambda e: e.name in wanted):   # keep only these payloads
                ...

    Bounds checked before anything is allocated: the entry count is at most
    ``MAX_ENTRIES`` and at most what the file's size can hold
    (``MIN_ENTRY_BYTES`` per entry; for gzip, ``GZIP_MAX_RATIO`` x its size);
    every name, rank and byte count as in :func:`read_fdl`. After the last
    declared entry the stream must end: trailing bytes are a ``CheckpointError``
    naming the entry count. Every error is a ``CheckpointError``.

    Args:
        path: the file; gzip when the name ends in ``.gz``.
    """

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = Path(os.fspath(path))
        self._raw, self._zf, self.src = _open_source(self.path)
        try:
            with self._as_checkpoint_errors():
                self.version, self.structural_hash, self.count = self._read_header()
        except BaseException:
            self.close()
            raise

    @property
    def seekable(self) -> bool:
        """Whether payloads can be skipped and re-read by offset (a plain file)."""
        return self.src.seekable

    @property
    def hash_hex(self) -> Optional[str]:
        """Lowercase hex of the structural hash, ``None`` when it is all zero."""
        return self.structural_hash.hex() if any(self.structural_hash) else None

    def _as_checkpoint_errors(self):
        return _CheckpointErrors(self.path)

    def _read_header(self) -> tuple[int, bytes, int]:
        src, label = self.src, str(self.path)
        magic = src.read_exact(4, "the magic")
        if magic != FDL_MAGIC:
            what = ("; it looks like a JSON file (a bundle's .meta.json or .names.json?): "
                    "pass the bundle's .fdl" if magic[:1] in (b"{", b"[") else "")
            raise CheckpointError(
                f"invalid checkpoint {label}: bad magic {magic!r} (expected .fdl checkpoint "
                f"starting with {FDL_MAGIC!r}){what}"
            )
        (version,) = struct.unpack("<I", src.read_exact(4, "the version"))
        if version == 0 or version > FDL_MAX_VERSION:
            raise CheckpointError(
                f"unsupported checkpoint version {version} in {label} (this build supports "
                f"1..={FDL_MAX_VERSION})"
            )
        structural_hash = src.read_exact(HASH_LEN, "the structural hash")
        (count,) = struct.unpack("<I", src.read_exact(4, "the entry count"))
        if count > MAX_ENTRIES:
            raise CheckpointError(
                f"corrupt checkpoint: entry count {count} exceeds the limit of {MAX_ENTRIES} "
                f"entries ({label}); a larger model must be split across several files"
            )
        room = src.limit - src.pos
        if count * MIN_ENTRY_BYTES > room:
            what = ("follow the header" if src.seekable
                    else f"can follow the header in {src.limit // GZIP_MAX_RATIO} bytes of gzip")
            raise CheckpointError(
                f"corrupt checkpoint: entry count {count} needs at least "
                f"{count * MIN_ENTRY_BYTES} bytes ({MIN_ENTRY_BYTES} per entry) but at most "
                f"{room} {what} (room for {room // MIN_ENTRY_BYTES} entries) ({label})"
            )
        return version, structural_hash, count

    def entries(self, keep: "bool | Callable[[FdlEntry], bool]" = False) -> Iterator[FdlEntry]:
        """Yield every entry in file order, then check that the stream ends there.

        Args:
            keep: whether to read each payload into ``entry.data``: a bool for all
                entries, or a callable that sees each entry's header (name, shape,
                dtype, byte count; no data yet) and decides. It may raise to stop
                before the payload is read. Payloads not kept are skipped (a plain
                file is not read past its headers).
        """
        decide = keep if callable(keep) else (lambda e: keep)
        with self._as_checkpoint_errors():
            yield from self._entries(decide)

    def _entries(self, decide: Callable[[FdlEntry], bool]) -> Iterator[FdlEntry]:
        src, label, count = self.src, str(self.path), self.count
        for i in range(count):
            where = f" (entry #{i} of {count} in {label})"
            (name_len,) = struct.unpack("<I", src.read_exact(4, f"entry #{i}'s name length"))
            if name_len > MAX_NAME_LEN:
                raise CheckpointError(
                    f"corrupt checkpoint: entry name length {name_len} exceeds "
                    f"{MAX_NAME_LEN}{where}"
                )
            name = src.read_exact(name_len, f"entry #{i}'s name").decode("utf-8",
                                                                          errors="replace")
            where = f" (entry #{i} {name!r} of {count} in {label})"
            (ndim,) = struct.unpack("<I", src.read_exact(4, f"entry {name!r}'s rank"))
            if ndim > MAX_NDIM:
                raise CheckpointError(
                    f"corrupt checkpoint: tensor rank {ndim} exceeds {MAX_NDIM}{where}"
                )
            shape = struct.unpack(f"<{ndim}q", src.read_exact(8 * ndim, f"entry {name!r}'s dims"))
            if any(d < 0 for d in shape):
                raise CheckpointError(
                    f"corrupt checkpoint: negative dim in shape {list(shape)}{where}")
            (tag,) = src.read_exact(1, f"entry {name!r}'s dtype tag")
            dtype = FdlDtype.from_tag(tag, where)
            (nbytes,) = struct.unpack("<Q", src.read_exact(8, f"entry {name!r}'s byte count"))
            want = math.prod(shape) * dtype.itemsize
            if nbytes != want:
                raise CheckpointError(
                    f"corrupt checkpoint: header claims {nbytes} bytes but shape {list(shape)} x "
                    f"{dtype.label} needs {want}{where}"
                )
            entry = FdlEntry(name, tuple(shape), int(dtype), nbytes, src.pos)
            entry.data = src.payload(nbytes, bool(decide(entry)), where)
            yield entry
        self._check_end()

    def _check_end(self) -> None:
        src, label, count = self.src, str(self.path), self.count
        if src.seekable:
            extra = src.size - src.pos
            if extra:
                raise CheckpointError(
                    f"corrupt checkpoint: {extra} trailing bytes after the {count} declared "
                    f"entries ({label}); the entry count in the header does not match the file"
                )
            return
        # A compressed stream must end here too; reaching its end makes gzip verify the
        # CRC and length trailer. Nothing past the declared entries is inflated.
        if src.fh.read(1):
            raise CheckpointError(
                f"corrupt checkpoint: the stream continues after the {count} declared entries "
                f"({label}); the entry count in the header does not match the file"
            )

    def close(self) -> None:
        """Close the file."""
        if self._zf is not None:
            self._zf.close()
        self._raw.close()

    def __enter__(self) -> "FdlReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _CheckpointErrors:
    """Turn the I/O and gzip errors of reading ``path`` into ``CheckpointError``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, (OSError, EOFError, zlib.error)):
            raise CheckpointError(f"corrupt checkpoint {self.path}: {exc}") from exc
        return False


def read_fdl(path: "str | os.PathLike[str]", *, with_data: bool = True) -> FdlFile:
    """Parse the ``.fdl`` (or ``.fdl.gz``) at ``path``.

    With ``with_data=False`` payloads are skipped (headers, shapes, dtypes and
    sizes only; a plain file is not read past its headers) but truncation is
    still detected. Raises ``CheckpointError`` for a corrupt, truncated or
    unsupported file (bad magic, version, an entry count over ``MAX_ENTRIES`` or
    more than the file can hold, name length over 64 KiB, rank over 64, unknown
    dtype tag, "payload truncated: header claims N bytes, M present", bytes
    after the declared entries). To walk a large file without holding its
    entry table, use :class:`FdlReader`.
    """
    with FdlReader(path) as reader:
        entries = list(reader.entries(with_data))
        return FdlFile(reader.version, reader.structural_hash, entries)


# --- loading into tensors -----------------------------------------------------------


@dataclass
class LoadReport:
    """What a load did.

    Attributes:
        loaded: checkpoint keys copied into the model, in model order.
        missing: model keys with no checkpoint entry (left at their current values).
        unexpected: checkpoint keys the model has no slot for (ignored), in file order.
    """

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> list[str]:
        """flodl's name for ``unexpected``."""
        return self.unexpected

    @property
    def complete(self) -> bool:
        """Every model slot was loaded and every checkpoint entry was used."""
        return not self.missing and not self.unexpected


@dataclass
class _Target:
    key: str
    tensor: object
    kind: str  # "parameter" / "buffer"
    label: str


def _label(t: _Target) -> str:
    return f"{t.kind} {t.key!r}" + (f" ({t.label})" if t.label and t.label != t.key else "")


def load_targets(path: "str | os.PathLike[str]", targets: Sequence[_Target],
                 structural_hash: "None | str | bytes" = None) -> LoadReport:
    """Load the ``.fdl`` at ``path`` into ``targets`` by key (see :func:`load_checkpoint_file`).

    One pass over the headers checks each entry against its slot *before* its
    payload is read, so a file declaring a huge tensor for a small slot fails
    at that header, having allocated nothing. A plain file's payloads are then
    read straight into the slots. A gzip stream cannot be re-read by offset:
    the payloads of matching entries are staged during the pass (at most the
    slots' own size; entries without a slot are inflated and dropped) and copied
    in only once the whole stream, CRC included, has been verified.
    """
    torch = _torch()
    if sys.byteorder != "little":
        raise CheckpointError(".fdl payloads are little-endian; this host is big-endian")
    p = Path(os.fspath(path))
    slots = {t.key: t for t in targets}
    with FdlReader(p) as reader:
        if structural_hash is not None:
            expected = parse_structural_hash(structural_hash)
            if any(reader.structural_hash) and any(expected) \
                    and reader.structural_hash != expected:
                raise CheckpointError(
                    f"checkpoint architecture mismatch: file={reader.structural_hash.hex()} "
                    f"model={expected.hex()} ({p}); load it into the model it was saved from"
                )
        stage = not reader.seekable
        unexpected: dict[str, None] = {}

        def admit(e: FdlEntry) -> bool:
            t = slots.get(e.name)
            if t is None:
                unexpected[e.name] = None
                return False
            model_shape = tuple(t.tensor.shape)
            if e.shape != model_shape:
                raise CheckpointError(
                    f"{_label(t)}: shape mismatch: checkpoint={list(e.shape)} "
                    f"model={list(model_shape)} ({p}); the checkpoint was saved from a "
                    f"different architecture"
                )
            return stage

        chosen: dict[str, FdlEntry] = {}
        for e in reader.entries(admit):
            if e.name in slots:
                chosen[e.name] = e  # a later duplicate wins; the earlier's bytes are freed
        # Everything is validated: only now is the model touched.
        report = LoadReport(unexpected=list(unexpected))
        plan = []
        for t in targets:
            e = chosen.get(t.key)
            if e is None:
                report.missing.append(t.key)
            else:
                plan.append((t, e))
                report.loaded.append(t.key)
        with torch.no_grad():
            for t, e in plan:
                _copy_entry_into(reader.src, e, t.tensor, p)
        return report


def _copy_entry_into(src: _Source, e: FdlEntry, dst, path: Path) -> None:
    file_dtype = torch_dtype_for_tag(e.dtype_tag)
    direct = (e.data is None and dst.device.type == "cpu" and dst.dtype == file_dtype
              and dst.is_contiguous() and e.nbytes > 0)
    if direct:
        # Read straight into the destination's storage: no staging copy.
        view = tensor_array(dst.detach().reshape(-1), np.uint8)
        src.fh.seek(e.offset)
        got = src.fh.readinto(memoryview(view))
        if got != e.nbytes:
            raise CheckpointError(
                f"corrupt checkpoint {path}: payload truncated: header claims {e.nbytes} bytes, "
                f"{got} present (entry {e.name!r}; the file changed while loading?)"
            )
        return
    if e.data is None:
        src.fh.seek(e.offset)
        buf = bytearray(e.nbytes)
        got = src.fh.readinto(buf) if e.nbytes else 0
        if got != e.nbytes:
            raise CheckpointError(
                f"corrupt checkpoint {path}: payload truncated: header claims {e.nbytes} bytes, "
                f"{got} present (entry {e.name!r})"
            )
        e = FdlEntry(e.name, e.shape, e.dtype_tag, e.nbytes, e.offset, buf)
    dst.copy_(e.to_tensor())


def load_checkpoint_file(path: "str | os.PathLike[str]",
                         params: Sequence[tuple[str, object]],
                         buffers: Sequence[tuple[str, object]] = (),
                         structural_hash: "None | str | bytes" = None) -> LoadReport:
    """Load a ``.fdl`` into ``(key, tensor)`` parameter and buffer slots, by key.

    Each slot whose key is in the file must have the entry's exact shape (else
    ``CheckpointError``, raised before any slot is modified); its values are
    copied in place (cast to the slot's dtype, kept on its device), so
    optimizers holding the tensors stay valid. Duplicate keys in the file: the
    later entry wins. ``structural_hash`` (hex or bytes) is checked only when it
    and the file's are both non-zero. Returns a :class:`LoadReport`.
    """
    targets = [_Target(k, t, "parameter", k) for k, t in params]
    targets += [_Target(k, t, "buffer", k) for k, t in buffers]
    return load_targets(path, targets, structural_hash)


def load_module(module, path: "str | os.PathLike[str]",
                structural_hash: "None | str | bytes" = None) -> LoadReport:
    """Load a by-name ``.fdl`` (e.g. written by :func:`save_module` or flodl's
    ``save_checkpoint_file``) into ``module``'s named parameters and buffers."""
    return load_checkpoint_file(path, list(module.named_parameters()),
                                list(module.named_buffers()), structural_hash)


__all__ = [
    "FDL_MAGIC",
    "FDL_MAX_VERSION",
    "FDL_VERSION",
    "GZIP_MAX_RATIO",
    "HASH_LEN",
    "MAX_ENTRIES",
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "MIN_ENTRY_BYTES",
    "FdlDtype",
    "FdlEntry",
    "FdlFile",
    "FdlReader",
    "FdlWriter",
    "LoadReport",
    "RawEntry",
    "is_gzip_path",
    "load_checkpoint_file",
    "load_module",
    "load_targets",
    "parse_structural_hash",
    "read_fdl",
    "save_module",
    "save_tensors",
    "tag_for_torch_dtype",
    "torch_dtype_for_tag",
    "write_fdl_raw",
    "write_fdl_stream",
]

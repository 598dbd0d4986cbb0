"""The RoundFrame stream codec: flodl 0.7.0's byte layout, authenticated.

Layout (all little-endian; ``docs/wire.md`` has a worked hex example)::

    0   u32  magic 0xF10D17F1
    4   u32  tensor count            (<= 65536)
    8   u8   kind                    (0 = Model, 1 = Control)
    9   f64  weight                  (finite, >= 0)
    then per tensor:
        u8 dtype tag (0 = f32, 1 = bf16) | u8 ndim | ndim x u32 dims | u64 nbytes | nbytes raw
    then
        8 bytes: HMAC-SHA256(key = 16-byte session salt, everything above)[:8]

On a stream of frames each frame is preceded by a u32 length prefix
(``write_len_prefix``). Every length is checked against the frame ceiling (1 GiB by
default, ``FLODL_SHM_MAX_FRAME_BYTES`` or ``set_frame_ceiling``) *before* anything
is allocated, and payload buffers are allocated lazily (untouched pages cost no
RAM), so a hostile length can never make a reader commit memory it was not sent.
A longer frame is no error on the relay <-> controller link: ``link.Link`` sends
it as several frames of at most the ceiling and reassembles it.

Writers stream payloads straight from their buffers (no whole-frame
concatenation); readers ``readinto`` preallocated buffers. MAC-before-use: payloads
reach the caller only after the footer verified.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import math
import os
import struct
from typing import BinaryIO

import numpy as np

from ..errors import FrameError
from ..frame import (
    MAX_ROUND_FRAME_TENSORS,
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_frame,
    dtype_name,
    elem_size,
)

__all__ = [
    "ROUND_FRAME_MAGIC",
    "SESSION_SALT_BYTES",
    "TAG_BYTES",
    "HEADER_BYTES",
    "LEN_PREFIX_BYTES",
    "DEFAULT_FRAME_CEILING",
    "frame_ceiling",
    "set_frame_ceiling",
    "check_salt",
    "frame_wire_len",
    "frame_tag",
    "write_round_frame",
    "write_len_prefix",
    "write_framed_round",
    "read_round_frame",
    "read_len_prefix",
    "read_framed_round",
    "read_framed_round_into",
    "encode_framed_round",
]

ROUND_FRAME_MAGIC = 0xF10D17F1
SESSION_SALT_BYTES = 16
TAG_BYTES = 8
HEADER_BYTES = 17
LEN_PREFIX_BYTES = 4
READ_CHUNK = 64 << 20
DEFAULT_FRAME_CEILING = 1 << 30
_U32_MAX = 0xFFFFFFFF
_SMALL_PAYLOAD = 64 << 10  # payloads below this are coalesced with the header writes

_HDR = struct.Struct("<IIBd")
_TENSOR_META = struct.Struct("<BB")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_ceiling_override: int | None = None


def frame_ceiling() -> int:
    """The largest frame (and length prefix) this process accepts, in bytes."""
    if _ceiling_override is not None:
        return _ceiling_override
    env = os.environ.get("FLODL_SHM_MAX_FRAME_BYTES")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(
                f"FLODL_SHM_MAX_FRAME_BYTES={env!r} is not an integer byte count"
            ) from None
        if value <= 0:
            raise ValueError(f"FLODL_SHM_MAX_FRAME_BYTES={value} must be > 0")
        return value
    return DEFAULT_FRAME_CEILING


def set_frame_ceiling(nbytes: int | None) -> None:
    """Install a process-wide frame ceiling (``None`` restores the default/env value)."""
    global _ceiling_override
    if nbytes is not None and int(nbytes) <= 0:
        raise ValueError(f"frame ceiling must be > 0 bytes, got {nbytes}")
    _ceiling_override = None if nbytes is None else int(nbytes)


def check_salt(salt) -> bytes:
    """The 16-byte session salt as ``bytes``; ``FrameError`` for anything else."""
    # bytes(16) would silently make a zero key and bytes("...") raises TypeError:
    # only buffers are salts.
    if isinstance(salt, (int, str)):
        raise FrameError(
            f"session salt must be {SESSION_SALT_BYTES} bytes, got a {type(salt).__name__}; "
            f"pass bytes (bytes.fromhex(...) for the 32-hex-digit form)"
        )
    try:
        b = bytes(salt)
    except TypeError:
        raise FrameError(
            f"session salt must be {SESSION_SALT_BYTES} bytes, got a {type(salt).__name__}"
        ) from None
    if len(b) != SESSION_SALT_BYTES:
        raise FrameError(
            f"session salt must be {SESSION_SALT_BYTES} bytes, got {len(b)}; "
            f"generate one with os.urandom(16) and share it with every host"
        )
    return b


def frame_wire_len(frame: RoundFrame) -> int:
    """Exact encoded length: 17 + sum(2 + 4*ndim + 8 + nbytes) + 8."""
    n = HEADER_BYTES + TAG_BYTES
    for p in frame.tensors:
        n += 2 + 4 * len(p.shape) + 8 + p.nbytes
    return n


def _tensor_meta(p: TensorPayload) -> bytes:
    nd = len(p.shape)
    return (_TENSOR_META.pack(p.dtype, nd) + struct.pack(f"<{nd}I", *p.shape)
            + _U64.pack(p.nbytes))


# --- writer ------------------------------------------------------------------------


def frame_tag(frame: RoundFrame, salt) -> bytes:
    """The frame's 8-byte tag, computed without writing it anywhere.

    A reducer that sends one consensus to many peers hashes it once with this and
    passes ``tag=`` to ``write_round_frame`` for every peer.
    """
    key = check_salt(salt)
    check_frame(frame)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(_HDR.pack(ROUND_FRAME_MAGIC, len(frame.tensors), int(frame.kind), frame.weight))
    for p in frame.tensors:
        mac.update(_tensor_meta(p))
        mac.update(p.data)
    return mac.digest()[:TAG_BYTES]


def write_round_frame(stream: BinaryIO, frame: RoundFrame, salt, *,
                      tag: bytes | None = None) -> int:
    """Write ``frame`` to ``stream`` (tagged with ``salt``); returns bytes written.

    The frame is validated completely before the first byte is written, so a
    malformed frame never tears the stream. Large payloads are written straight
    from their buffers; the small pieces around them are coalesced. ``tag`` is a
    precomputed ``frame_tag(frame, salt)`` (skips hashing the payloads again).
    """
    key = check_salt(salt)
    check_frame(frame)
    if tag is not None and len(tag) != TAG_BYTES:
        raise FrameError(f"a precomputed frame tag has {TAG_BYTES} bytes, got {len(tag)}")
    mac = None if tag is not None else hmac.new(key, digestmod=hashlib.sha256)
    pending = bytearray(_HDR.pack(ROUND_FRAME_MAGIC, len(frame.tensors), int(frame.kind),
                                  frame.weight))
    written = 0

    def flush_pending() -> None:
        nonlocal written
        if pending:
            if mac is not None:
                mac.update(pending)
            stream.write(bytes(pending))
            written += len(pending)
            pending.clear()

    for p in frame.tensors:
        pending += _tensor_meta(p)
        if p.nbytes < _SMALL_PAYLOAD:
            pending += p.data
        else:
            flush_pending()
            if mac is not None:
                mac.update(p.data)
            stream.write(p.data)
            written += p.nbytes
    flush_pending()
    if mac is not None:
        tag = mac.digest()[:TAG_BYTES]
    stream.write(tag)
    written += TAG_BYTES
    return written


def write_len_prefix(stream: BinaryIO, n: int, ceiling: int | None = None) -> None:
    """Write the u32 LE length prefix of a frame of ``n`` bytes."""
    limit = frame_ceiling() if ceiling is None else ceiling
    if n < 0:
        raise FrameError(f"length prefix {n} is negative")
    if n > limit:
        raise FrameError(
            f"frame of {n} bytes exceeds the frame ceiling of {limit} bytes; raise "
            f"FLODL_SHM_MAX_FRAME_BYTES or split the model into several frames"
        )
    if n > _U32_MAX:
        raise FrameError(f"frame of {n} bytes does not fit a u32 length prefix")
    stream.write(_U32.pack(n))


def write_framed_round(stream: BinaryIO, frame: RoundFrame, salt,
                       ceiling: int | None = None) -> int:
    """Length prefix, then the frame. Returns the bytes written (prefix included)."""
    check_frame(frame)
    n = frame_wire_len(frame)
    write_len_prefix(stream, n, ceiling)
    return LEN_PREFIX_BYTES + write_round_frame(stream, frame, salt)


# --- reader ------------------------------------------------------------------------


def _alloc_payload(nbytes: int) -> np.ndarray:
    """Allocate a payload buffer. np.empty leaves pages untouched until written, so a
    declared-but-unsent length commits no memory. Tests wrap this to audit sizes."""
    return np.empty(nbytes, dtype=np.uint8)


class StreamEnded(FrameError):
    """The stream ended inside a frame or its length prefix (the sender exited or was
    killed, or the connection was cut): no bytes of a later frame were read. A
    ``FrameError`` like every other way a read can fail; ``got`` and ``declared``: the
    bytes read of the frame's declared length (None where no length was declared: the
    length prefix itself ended, or a frame read without one)."""

    def __init__(self, message: str, got: int, declared: int | None) -> None:
        super().__init__(message)
        self.got = got
        self.declared = declared


class _StreamEnded(Exception):
    """Internal: the stream (or the length budget) ran out inside a read."""

    def __init__(self, got: int, budget_exhausted: bool) -> None:
        super().__init__(got)
        self.got = got
        self.budget_exhausted = budget_exhausted


class _Source:
    """readinto-based exact reads with an optional byte budget (the length prefix)."""

    def __init__(self, stream: BinaryIO, budget: int | None) -> None:
        self.stream = stream
        self.budget = budget
        self.consumed = 0
        self._readinto = getattr(stream, "readinto", None)

    def read_into(self, buf: memoryview) -> None:
        """Fill ``buf`` exactly, or raise _StreamEnded with the bytes obtained."""
        want = len(buf)
        got = 0
        while got < want:
            room = want - got
            if self.budget is not None:
                left = self.budget - self.consumed
                if left <= 0:
                    raise _StreamEnded(got, True)
                room = min(room, left)
            room = min(room, READ_CHUNK)
            view = buf[got:got + room]
            if self._readinto is not None:
                n = self._readinto(view)
            else:
                chunk = self.stream.read(room)
                n = len(chunk) if chunk else 0
                view[:n] = chunk
            if not n:
                raise _StreamEnded(got, False)
            got += n
            self.consumed += n

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def remaining(self) -> int | None:
        return None if self.budget is None else self.budget - self.consumed


def _read_part(src: _Source, n: int, what: str, framed: bool) -> bytes:
    try:
        return src.read(n)
    except _StreamEnded as e:
        raise _ended(src, what, e, framed) from None


def _ended(src: _Source, what: str, e: _StreamEnded, framed: bool) -> FrameError:
    """The error of a read that ran out: past the declared length (a ``FrameError``:
    the stream is desynced), or at the stream's end (``StreamEnded``)."""
    if e.budget_exhausted:
        return FrameError(
            f"{what} read failed: the frame is longer than the {src.budget} bytes its length "
            f"prefix declared (the declared length ended inside the frame); sender/reader "
            f"wire drift - stream is desynced"
        )
    if framed:
        return StreamEnded(
            f"stream ended inside a len-framed RoundFrame body ({what} read failed after "
            f"{src.consumed} of {src.budget} declared bytes; peer died mid-frame)",
            src.consumed, src.budget)
    return StreamEnded(f"{what} read failed: stream ended mid-frame after {src.consumed} bytes",
                       src.consumed, None)


def _parse_frame(src: _Source, key: bytes, ceiling: int, framed: bool,
                 sink=None) -> tuple[RoundFrame | None, bytes]:
    """Parse one frame; returns (frame or None at a clean EOF, the verified tag)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    head = bytearray(HEADER_BYTES)
    try:
        src.read_into(memoryview(head)[:8])
    except _StreamEnded as e:
        if not framed:
            return None, b""  # clean EOF (also a partial header), as flodl does
        raise _ended(src, "frame header", e, framed) from None
    try:
        src.read_into(memoryview(head)[8:])
    except _StreamEnded as e:
        raise _ended(src, "frame header", e, framed) from None
    magic, count, kind_byte, weight = _HDR.unpack(head)
    if magic != ROUND_FRAME_MAGIC:
        raise FrameError(f"frame magic 0x{magic:08x} != 0x{ROUND_FRAME_MAGIC:08x}")
    if count > MAX_ROUND_FRAME_TENSORS:
        raise FrameError(
            f"frame claims {count} tensors (> {MAX_ROUND_FRAME_TENSORS}); corrupt or hostile peer"
        )
    kind = RoundKind.from_wire(kind_byte)
    if not math.isfinite(weight) or weight < 0.0:
        raise FrameError(f"frame weight {weight} is not a finite non-negative realized-work mass")
    mac.update(head)
    total = 0
    tensors: list[TensorPayload] = []
    for i in range(count):
        meta = _read_part(src, 2, f"tensor[{i}] meta", framed)
        dtype, ndim = meta[0], meta[1]
        dims_raw = _read_part(src, 4 * ndim, f"tensor[{i}] shape", framed)
        nb_raw = _read_part(src, 8, f"tensor[{i}] nbytes", framed)
        mac.update(meta)
        mac.update(dims_raw)
        mac.update(nb_raw)
        shape = struct.unpack(f"<{ndim}I", dims_raw)
        (nbytes,) = _U64.unpack(nb_raw)
        total += nbytes
        if total > ceiling:
            raise FrameError(
                f"tensor[{i}] pushes frame past the {ceiling} byte ceiling; corrupt or hostile "
                f"peer, or a model that has outgrown the frame ceiling (FLODL_SHM_MAX_FRAME_BYTES)"
            )
        esize = elem_size(dtype)
        numel = math.prod(shape)
        if nbytes != numel * esize:
            raise FrameError(
                f"tensor[{i}] declares {nbytes} payload bytes but shape {list(shape)} "
                f"({dtype_name(dtype)}) has numel {numel}: expected {numel * esize} bytes"
            )
        left = src.remaining()
        if left is not None and nbytes > left:
            raise FrameError(
                f"tensor[{i}] read failed: it declares {nbytes} payload bytes but only {left} "
                f"remain of the {src.budget} bytes its length prefix declared; sender/reader "
                f"wire drift - stream is desynced"
            )
        buf = _alloc_payload(nbytes) if sink is None else sink(i, dtype, shape, nbytes)
        try:
            src.read_into(memoryview(buf))
        except _StreamEnded as e:
            raise _ended(src, f"tensor[{i}] data", e, framed) from None
        mac.update(buf)
        tensors.append(TensorPayload(dtype, shape, buf))
    try:
        tag = src.read(TAG_BYTES)
    except _StreamEnded as e:
        if e.budget_exhausted:
            raise _ended(src, "frame HMAC footer", e, framed) from None
        raise StreamEnded(
            "frame HMAC footer read failed: stream truncated mid-frame (or a sender without "
            "frame tags)", src.consumed, src.budget) from None
    want = mac.digest()[:TAG_BYTES]
    if not hmac.compare_digest(tag, want):
        raise FrameError(
            f"RoundFrame HMAC verification failed (computed 0x{want.hex()}, wire carried "
            f"0x{tag.hex()}): the tag disagrees - session salt mismatch, tampered frame, or "
            f"payload corruption"
        )
    return RoundFrame(tensors, weight, kind), tag


def read_round_frame(stream: BinaryIO, salt, ceiling: int | None = None) -> RoundFrame | None:
    """Read one unprefixed frame; ``None`` at a clean end of stream before it."""
    key = check_salt(salt)
    limit = frame_ceiling() if ceiling is None else ceiling
    return _parse_frame(_Source(stream, None), key, limit, framed=False)[0]


def read_len_prefix(stream: BinaryIO, ceiling: int | None = None) -> int | None:
    """Read a u32 LE length prefix; ``None`` at a clean end of stream."""
    limit = frame_ceiling() if ceiling is None else ceiling
    src = _Source(stream, None)
    raw = bytearray(LEN_PREFIX_BYTES)
    try:
        src.read_into(memoryview(raw))
    except _StreamEnded as e:
        if e.got == 0:
            return None
        raise StreamEnded(f"length prefix read failed: stream ended after {e.got} of 4 bytes",
                          e.got, None) from None
    (n,) = _U32.unpack(raw)
    if n > limit:
        raise FrameError(
            f"length prefix {n} exceeds the frame ceiling of {limit} bytes; corrupt or hostile "
            f"peer (or raise FLODL_SHM_MAX_FRAME_BYTES if a model outgrew it)"
        )
    return n


def read_framed_round(stream: BinaryIO, salt, ceiling: int | None = None) -> RoundFrame | None:
    """Read a length-prefixed frame, strictly.

    ``None`` at a clean end of stream before the prefix. A prefix that promises
    more bytes than the frame holds, or fewer, is a named ``FrameError``; bytes of
    the next frame are never consumed.
    """
    return read_framed_round_into(stream, salt, None, ceiling)[0]


def read_framed_round_into(stream: BinaryIO, salt, sink, ceiling: int | None = None
                           ) -> tuple[RoundFrame | None, bytes]:
    """``read_framed_round`` reading each payload into ``sink(i, dtype, shape, nbytes)``.

    The sink returns a writable buffer of exactly ``nbytes`` (e.g. a slice of a
    reused staging area or of shared memory); ``None`` allocates as usual. Returns
    (frame, tag): the frame's payloads are the sink's buffers, and the tag lets a
    caller bind the frame to an authenticated record header.

    MAC-before-use: the sink's buffers hold unauthenticated bytes until this
    returns; on any ``FrameError`` the caller must discard what the sink received.
    """
    key = check_salt(salt)
    limit = frame_ceiling() if ceiling is None else ceiling
    n = read_len_prefix(stream, limit)
    if n is None:
        return None, b""
    if n == 0:
        raise FrameError(
            "stream ended inside a len-framed RoundFrame body (a zero-length prefix): "
            "sender/reader wire drift"
        )
    src = _Source(stream, n)
    frame, tag = _parse_frame(src, key, limit, framed=True, sink=sink)
    left = src.remaining()
    if left:
        raise FrameError(
            f"RoundFrame consumed {left} bytes fewer than its length prefix declared "
            f"({n}); sender/reader wire drift - stream is desynced"
        )
    return frame, tag


def encode_framed_round(frame: RoundFrame, salt) -> bytes:
    """The prefixed frame as one bytes object (tests, small control messages)."""
    buf = io.BytesIO()
    write_framed_round(buf, frame, salt)
    return buf.getvalue()

"""The relay <-> controller link: an authenticated, framed TCP connection.

Handshake (the session secret — the 16-byte salt — never crosses the wire)::

    relay      -> controller   CHANNEL_MAGIC u32 | PROTOCOL_VERSION u16 | 0 u16 | nonce_r[16]
    controller -> relay        CHANNEL_MAGIC u32 | PROTOCOL_VERSION u16 | 0 u16 | nonce_c[16]
                               | proof_c = HMAC(salt, "flodl_shm controller" | nonce_r | nonce_c)
    relay      -> controller   proof_r = HMAC(salt, "flodl_shm relay" | nonce_c | nonce_r)
                               (or PROOF_REFUSED when proof_c failed: see below)
                               then a CTRL record  {"type": "hello", host, ranks, world_size, ...}
    controller -> relay        a CTRL record {"type": "hello_ack"} or {"type": "reject", reason}

Each side proves it knows the salt by answering the other's fresh nonce; a
recorded session cannot be replayed (the nonces change). Both derive a link key
``HMAC(salt, "flodl_shm link" | nonce_r | nonce_c)[:16]``. A relay whose secret
differs sends the fixed ``PROOF_REFUSED`` bytes instead of a proof before it
closes, so both ends name the wrong secret (it reveals nothing keyed).
The control messages and their fields are listed in ``control.py``.

Records (after the handshake)::

    0  u32 RECORD_MAGIC | 4 u16 version | 6 u8 kind | 7 u8 flags | 8 u64 seq | 16 u64 length
    24 tag[8] = HMAC(link key, header[0:24] | binding)[:8]
    32 payload (length bytes)

``seq`` counts records per direction from 0, so a record cannot be replayed,
dropped or reordered without detection. For CTRL records (compact JSON) the
binding is the payload itself. For frame records the payload is a
length-prefixed RoundFrame (``wire``), whose own footer authenticates it with the
session salt; the binding is that footer tag, so the header and the frame are
tied together while the frame is hashed once (a controller sends one consensus
to every host with a single hash pass). A frame longer than the frame ceiling
travels as a ``frame_parts`` control record followed by several frame records of
at most the ceiling each (``split_frame``); ``Link.recv`` reassembles it into the
caller's sink and returns the whole frame, so callers never see the parts. Any failure — a bad tag, a wrong seq, a
length above the ceiling — is a ``FrameError``: the connection is dropped and its
host failed; nothing it sent reaches a consensus. A connection that ends inside a record
(the peer killed, the connection cut) is a ``RecordCut``, a ``ConnectionError`` like one
that ends between records.

A record that has started must be read to its end (a reader that gave up halfway would
take the rest for the next record), so ``Link.recv``'s ``timeout`` bounds only the wait
for a record's first byte. What bounds the rest is ``idle``: the longest silence
allowed inside a record (the parts of a split frame included) before the link counts as
broken, and ``abort``, an event that ends the wait at once (the controller's
shutdown). Either raises ``RecordStalled``, a ``ConnectionError``: a peer frozen
mid-record (stopped, its host hung) fails like a peer gone.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import os
import socket
import struct
import threading
import time
from typing import Callable

import numpy as np

from ..errors import FrameError, HandshakeRejected, plural
from ..frame import (MAX_ROUND_FRAME_TENSORS, RoundFrame, RoundKind, TensorPayload, dtype_name,
                     elem_size)
from .control import Ctrl, ctrl_message, ctrl_type
from .wire import (HEADER_BYTES, LEN_PREFIX_BYTES, TAG_BYTES, StreamEnded, check_salt,
                   frame_ceiling, frame_tag, frame_wire_len, read_framed_round_into,
                   write_len_prefix, write_round_frame)

CHANNEL_MAGIC = 0xF10D17E1   # "CPU-reduce data channel" (flodl's channel-select magic)
RECORD_MAGIC = 0xF10D17D0
PROTOCOL_VERSION = 1
NONCE_BYTES = 16
PROOF_BYTES = 32
MAX_CTRL_BYTES = 1 << 20
HANDSHAKE_TIMEOUT = 10.0
#: what a relay sends in place of its proof when the controller's proof failed
PROOF_REFUSED = b"flodl_shm: proof refused\0\0\0\0\0\0\0\0"
_PIECE_META = 2 + 4 + 8  # a 1-D part piece: dtype, ndim, one dim, nbytes

_HELLO = struct.Struct("<IHH16s")
_RECORD = struct.Struct("<IHBBQQ")
RECORD_HEADER = _RECORD.size + TAG_BYTES


class Kind(enum.IntEnum):
    CTRL = 2        # compact JSON control message
    FRAME_UP = 3    # a host's partial (relay -> controller)
    FRAME_DOWN = 4  # the consensus (controller -> relay)


def _timeouts() -> float:
    scale = float(os.environ.get("FLODL_NET_TIMEOUT_SCALE", "1.0"))
    if not (scale >= 0.1):
        raise ValueError(f"FLODL_NET_TIMEOUT_SCALE={scale} must be a number >= 0.1")
    return scale


def handshake_deadline_s() -> float:
    """Seconds a handshake may take (``HANDSHAKE_TIMEOUT`` x ``FLODL_NET_TIMEOUT_SCALE``)."""
    return HANDSHAKE_TIMEOUT * _timeouts()


def _mac(key: bytes, *parts: bytes) -> bytes:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        m.update(p)
    return m.digest()


class RecordStalled(ConnectionError):
    """A peer stopped sending in the middle of a record, or stopped taking what this end
    sends (``Link.send_idle``; module doc): the link is broken, as if the peer had
    gone."""


class RecordCut(ConnectionError):
    """The connection ended in the middle of a record, after ``got`` of its ``length``
    bytes: the peer exited or was killed, or the connection was cut. The link is
    broken, as if the peer had gone between records."""

    def __init__(self, peer: str, got: int, length: int) -> None:
        super().__init__(f"{peer} closed the connection in the middle of a record (after {got} "
                         f"of its {length} bytes): it exited or was killed, or the connection "
                         f"was cut")
        self.got = got
        self.length = length


class _RecordSilence:
    """How long the rest of a started record may keep its reader waiting: ``idle``
    seconds without a byte (None: no bound), or until ``abort`` is set (None: never).
    The socket is polled every ``POLL_S`` while either can end the wait."""

    POLL_S = 0.5

    def __init__(self, peer: str, idle: float | None, abort: threading.Event | None) -> None:
        self.peer = peer
        self.idle = idle
        self.abort = abort
        self.poll_s = (None if idle is None and abort is None
                       else self.POLL_S if idle is None else min(self.POLL_S, idle))
        self.last = time.monotonic()

    def progressed(self) -> None:
        self.last = time.monotonic()

    def waited(self) -> None:
        """A poll found nothing: raise ``RecordStalled`` once the wait is over."""
        if self.abort is not None and self.abort.is_set():
            raise RecordStalled(f"stopped while {self.peer} was in the middle of a record")
        if self.idle is not None and time.monotonic() - self.last > self.idle:
            raise RecordStalled(f"{self.peer} stopped sending in the middle of a record: "
                                f"nothing for {self.idle:g} s (its host stopped or hung)")


#: a record read with no bound on its silences (``Link.recv`` without idle or abort)
_UNBOUNDED = _RecordSilence("", None, None)


class _SockReader:
    """readinto over a socket, with EOF as 0 (what the wire reader expects); a poll
    that finds nothing asks ``silence`` whether to go on waiting."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.silence = _UNBOUNDED

    def readinto(self, buf) -> int:
        while True:
            try:
                k = self.sock.recv_into(buf)
            except socket.timeout:
                self.silence.waited()
                continue
            except InterruptedError:
                continue
            self.silence.progressed()
            return k


class _SockWriter:
    def __init__(self, link: "Link") -> None:
        self.link = link

    def write(self, data) -> int:
        self.link._sendall(data)
        return len(data)


def _recv_exact(sock: socket.socket, n: int, what: str, deadline: float | None,
                silence: _RecordSilence = _UNBOUNDED) -> bytes:
    """``n`` bytes: by ``deadline`` (a handshake's), else as long as ``silence`` allows
    (the socket's timeout is then the silence's poll)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: no data for {handshake_deadline_s():g} s")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            if deadline is None:
                silence.waited()
            continue
        silence.progressed()
        if k == 0:
            raise ConnectionError(f"{what}: the peer closed the connection")
        got += k
    return bytes(buf)


def split_frame(frame: RoundFrame, ceiling: int) -> list[RoundFrame]:
    """``frame`` as consecutive part frames of at most ``ceiling`` encoded bytes each.

    Each part carries 1-D pieces of the tensors' bytes in order (a piece never
    crosses a tensor's end; empty tensors get no piece), with the frame's weight and
    kind. No bytes are copied: pieces are views of the frame's buffers. A frame
    that fits is returned as the single element of the list.

    Args:
        frame: the frame to split.
        ceiling: the largest encoded part, in bytes (``frame_ceiling()`` on a link).
    """
    if frame_wire_len(frame) <= ceiling:
        return [frame]
    room0 = ceiling - HEADER_BYTES - TAG_BYTES
    widest = max(elem_size(p.dtype) for p in frame.tensors)
    if room0 < _PIECE_META + widest:
        raise FrameError(f"a frame ceiling of {ceiling} bytes cannot carry even one element per "
                         f"part (at least {HEADER_BYTES + TAG_BYTES + _PIECE_META + widest} bytes "
                         f"are needed); raise FLODL_SHM_MAX_FRAME_BYTES")
    parts: list[RoundFrame] = []
    pieces: list[TensorPayload] = []
    room = room0
    for p in frame.tensors:
        esize = elem_size(p.dtype)
        off = 0
        while off < p.nbytes:
            take = min(p.nbytes - off, (room - _PIECE_META) // esize * esize)
            if take <= 0 or len(pieces) == MAX_ROUND_FRAME_TENSORS:
                parts.append(RoundFrame(pieces, frame.weight, frame.kind))
                pieces, room = [], room0
                continue
            pieces.append(TensorPayload(p.dtype, (take // esize,), p.data[off:off + take]))
            room -= _PIECE_META + take
            off += take
    if pieces:
        parts.append(RoundFrame(pieces, frame.weight, frame.kind))
    return parts


class OutgoingFrame:
    """A frame ready to send on any link: split at the ceiling and hashed once.

    A controller sending one consensus to every host prepares it once
    (``OutgoingFrame(frame, salt)``) and passes it to each link's ``send_frame``.

    Args:
        frame: the frame.
        salt: the session salt (tags every part).
        tag: ``frame_tag(frame, salt)`` if already known (unsplit frames only).
    """

    def __init__(self, frame: RoundFrame, salt: bytes, tag: bytes | None = None) -> None:
        self.frame = frame
        parts = split_frame(frame, frame_ceiling())
        self.parts = [(p, tag if (tag is not None and p is frame) else frame_tag(p, salt))
                      for p in parts]
        self.header = None
        if len(parts) > 1:
            self.header = ctrl_message(
                Ctrl.FRAME_PARTS, parts=len(parts), kind=int(frame.kind), weight=frame.weight,
                dtypes=[p.dtype for p in frame.tensors],
                shapes=[list(p.shape) for p in frame.tensors])


class Link:
    """One authenticated connection; a single writer and a single reader thread each.

    Attributes:
        peer: "host:port" of the other end (for messages).
    """

    def __init__(self, sock: socket.socket, salt: bytes, key: bytes, peer: str) -> None:
        self.sock = sock
        self.salt = salt
        self.key = key
        self.peer = peer
        self._send_seq = 0
        self._recv_seq = 0
        self._reader = _SockReader(sock)
        self._writer = _SockWriter(self)
        #: the longest a send may wait for the peer to take a byte before the link counts
        #: as broken (``RecordStalled``); None: as long as it takes. The controller sets
        #: its round deadline here: a host that stops reading (frozen, its network black-
        #: holed) must not hold the consensus of every other host.
        self.send_idle: float | None = None
        sock.settimeout(None)

    # -- sending -------------------------------------------------------------------
    def _header(self, kind: Kind, flags: int, length: int, binding: bytes) -> bytes:
        head = _RECORD.pack(RECORD_MAGIC, PROTOCOL_VERSION, int(kind), flags, self._send_seq,
                            length)
        self._send_seq += 1
        return head + _mac(self.key, head, binding)[:TAG_BYTES]

    def send_ctrl(self, msg: dict) -> None:
        """Send a control message (``control.py`` lists the types)."""
        payload = json.dumps(msg, separators=(",", ":")).encode()
        if len(payload) > MAX_CTRL_BYTES:
            raise FrameError(f"control message {msg.get('type')!r} of {len(payload)} bytes "
                             f"exceeds the {MAX_CTRL_BYTES}-byte limit of a control record")
        self._sendall(self._header(Kind.CTRL, 0, len(payload), payload) + payload)

    def send_frame(self, kind: Kind, frame: RoundFrame | OutgoingFrame, *, flags: int = 0,
                   tag: bytes | None = None) -> None:
        """Send a frame: one record, or a ``frame_parts`` record and one record per
        part when it is longer than the frame ceiling. ``frame`` may be an
        ``OutgoingFrame`` prepared once for many links; ``tag`` is
        ``frame_tag(frame, salt)`` if already known."""
        out = frame if isinstance(frame, OutgoingFrame) else OutgoingFrame(frame, self.salt, tag)
        if out.header is not None:
            self.send_ctrl(out.header)
        for part, ptag in out.parts:
            n = frame_wire_len(part)
            self._sendall(self._header(kind, flags, 4 + n, ptag))
            write_len_prefix(self._writer, n)
            write_round_frame(self._writer, part, self.salt, tag=ptag)

    def _sendall(self, data) -> None:
        """``sock.sendall``, bounded by ``send_idle`` when set: a peer that takes no byte
        for that long breaks the link (``RecordStalled``; what it took of the record is
        unknown, so the link cannot be used again)."""
        idle = self.send_idle
        if idle is None:
            self.sock.sendall(data)
            return
        view = memoryview(data).cast("B")
        try:  # (what the socket takes at once needs no timeout: a small record, all of it)
            sent = self.sock.send(view, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        if sent == len(view):
            return
        last = time.monotonic()
        self.sock.settimeout(min(_RecordSilence.POLL_S, idle))
        try:
            while sent < len(view):
                try:
                    sent += self.sock.send(view[sent:])
                except socket.timeout:
                    if time.monotonic() - last > idle:
                        raise RecordStalled(
                            f"{self.peer} stopped reading: it took nothing for {idle:g} s "
                            f"(its host stopped or hung, or the network between dropped "
                            f"everything)") from None
                    continue
                last = time.monotonic()
        finally:
            try:
                self.sock.settimeout(None)
            except OSError:  # closed meanwhile (by another thread)
                pass

    # -- receiving -------------------------------------------------------------------
    def recv(self, sink: Callable | None = None, *, timeout: float | None = None,
             idle: float | None = None, abort: threading.Event | None = None
             ) -> tuple[Kind, int, dict | RoundFrame] | None:
        """The next record: (kind, flags, dict for CTRL / RoundFrame for frames).

        ``None`` at a clean end of stream before a record. ``timeout`` bounds the wait
        for the record's first byte (``TimeoutError``); once a record has started it is
        read to the end (abandoning it would desync the stream), unless it falls
        silent for ``idle`` seconds or ``abort`` is set (``RecordStalled``: the link is
        then broken). ``sink`` directs frame payloads (see
        ``wire.read_framed_round_into``); a frame sent in parts (``frame_parts``) is
        reassembled into the sink's buffers and returned whole.
        """
        silence = (_UNBOUNDED if idle is None and abort is None
                   else _RecordSilence(self.peer, idle, abort))
        self._reader.silence = silence
        try:
            got = self._recv_record(sink, timeout, silence)
            if got is None or got[0] != Kind.CTRL or got[2]["type"] != Ctrl.FRAME_PARTS:
                return got
            return self._recv_parts(got[2], sink, silence)
        finally:
            try:
                self.sock.settimeout(None)  # sends block as long as they take
            except OSError:  # closed meanwhile (by another thread): nothing to reset
                pass

    def _recv_parts(self, msg: dict, sink: Callable | None, silence: _RecordSilence
                    ) -> tuple[Kind, int, RoundFrame]:
        """Read the part records a ``frame_parts`` message announced into whole tensors."""
        what = f"split frame from {self.peer}"
        try:
            nparts = int(msg["parts"])
            kind_byte, weight = int(msg["kind"]), float(msg["weight"])
            dtypes = [int(d) for d in msg["dtypes"]]
            shapes = [tuple(int(n) for n in s) for s in msg["shapes"]]
            sizes = [math.prod(s) * elem_size(d) for d, s in zip(dtypes, shapes)]
        except (KeyError, TypeError, ValueError) as e:
            raise FrameError(f"{what}: malformed frame_parts message {msg!r}: {e}") from None
        total = sum(sizes)
        if (len(dtypes) != len(shapes) or not 2 <= nparts <= max(2, total)
                or len(shapes) > MAX_ROUND_FRAME_TENSORS or any(n < 0 for s in shapes for n in s)
                or total > nparts * frame_ceiling()):
            raise FrameError(f"{what}: inconsistent frame_parts message (parts {nparts}, "
                             f"{len(shapes)} tensors of {total} bytes, frame ceiling "
                             f"{frame_ceiling()})")
        bufs = [(np.empty(n, np.uint8) if sink is None else sink(i, dtypes[i], shapes[i], n))
                for i, n in enumerate(sizes)]
        cur = [0, 0]  # tensor index, byte offset in it

        def piece_sink(j, dtype, shape, nbytes):
            i, off = cur
            while i < len(sizes) and off == sizes[i]:
                i, off = i + 1, 0
            if i == len(sizes) or dtype != dtypes[i] or len(shape) != 1 or off + nbytes > sizes[i]:
                raise FrameError(f"{what}: piece {j} ({dtype_name(dtype)} {list(shape)}) does not "
                                 f"continue tensor {i} of the announced schema")
            cur[0], cur[1] = i, off + nbytes
            return memoryview(bufs[i]).cast("B")[off:off + nbytes]

        rec_kind = flags = None
        for k in range(nparts):
            got = self._recv_record(piece_sink, None, silence, started=True)
            if got is None or got[0] == Kind.CTRL or (rec_kind is not None
                                                      and (got[0], got[1]) != (rec_kind, flags)):
                raise FrameError(f"{what}: part {k} of {nparts} is missing or of another record "
                                 f"kind ({None if got is None else got[0].name})")
            rec_kind, flags, part = got
            if int(part.kind) != kind_byte or part.weight != weight:
                raise FrameError(f"{what}: part {k} carries kind {int(part.kind)} weight "
                                 f"{part.weight}, the announcement {kind_byte} {weight}")
        i, off = cur
        while i < len(sizes) and off == sizes[i]:
            i, off = i + 1, 0
        if i != len(sizes):
            raise FrameError(f"{what}: the parts ended inside tensor {i} ({off} of {sizes[i]} "
                             f"bytes)")
        tensors = [TensorPayload(d, s, b) for d, s, b in zip(dtypes, shapes, bufs)]
        return rec_kind, flags, RoundFrame(tensors, weight, RoundKind.from_wire(kind_byte))

    def _recv_record(self, sink: Callable | None, timeout: float | None,
                     silence: _RecordSilence, started: bool = False
                     ) -> tuple[Kind, int, dict | RoundFrame] | None:
        """One record as it is on the wire (``recv`` without the reassembly);
        ``started``: a part of a split frame, whose first byte ``silence`` bounds too."""
        head = bytearray(RECORD_HEADER)
        view = memoryview(head)
        got = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        first = not started
        while got < RECORD_HEADER:
            if first and deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no record from {self.peer} within {timeout:g} s")
                self.sock.settimeout(min(left, 0.5))
            else:
                self.sock.settimeout(None if first else silence.poll_s)
            try:
                k = self.sock.recv_into(view[got:])
            except socket.timeout:
                if not first:
                    silence.waited()
                continue
            except (ConnectionResetError, BrokenPipeError):
                if got == 0:
                    return None
                raise
            if k == 0:
                if got == 0:
                    return None
                raise RecordCut(self.peer, got, RECORD_HEADER)
            got += k
            first = False
            silence.progressed()
        self.sock.settimeout(silence.poll_s)
        magic, version, kind, flags, seq, length = _RECORD.unpack_from(head)
        if magic != RECORD_MAGIC:
            raise FrameError(f"record magic 0x{magic:08x} != 0x{RECORD_MAGIC:08x} from {self.peer}")
        if version != PROTOCOL_VERSION:
            raise FrameError(f"record version {version} != {PROTOCOL_VERSION} from {self.peer}")
        try:
            kind = Kind(kind)
        except ValueError:
            raise FrameError(f"unknown record kind {kind} from {self.peer}") from None
        if seq != self._recv_seq:
            raise FrameError(f"record seq {seq} from {self.peer}, expected {self._recv_seq}: "
                             f"a record was dropped, replayed or reordered")
        self._recv_seq += 1
        tag = bytes(head[_RECORD.size:])
        if kind == Kind.CTRL:
            if length > MAX_CTRL_BYTES:
                raise FrameError(f"control record of {length} bytes from {self.peer} exceeds "
                                 f"{MAX_CTRL_BYTES}")
            payload = _recv_exact(self.sock, length, f"control record from {self.peer}", None,
                                  silence)
            if not hmac.compare_digest(_mac(self.key, head[:_RECORD.size], payload)[:TAG_BYTES],
                                       tag):
                raise FrameError(f"control record from {self.peer} failed its tag (wrong session "
                                 f"secret, tampering or corruption)")
            try:
                msg = json.loads(payload)
            except ValueError as e:
                raise FrameError(f"control record from {self.peer} is not JSON: {e}") from None
            if not isinstance(msg, dict):
                raise FrameError(f"control record from {self.peer} is not a JSON object")
            msg["type"] = ctrl_type(msg, self.peer)
            return kind, flags, msg
        if length > frame_ceiling() + 4:
            # (a sender splits its frames at its own ceiling: the two ends' differ)
            raise FrameError(f"frame record of {length} bytes from {self.peer} exceeds the frame "
                             f"ceiling of {frame_ceiling()} bytes here; give the controller "
                             f"and every host the same FLODL_SHM_MAX_FRAME_BYTES")
        try:
            frame, ftag = read_framed_round_into(self._reader, self.salt, sink)
        except StreamEnded as e:  # (inside the length prefix, or inside the frame after it)
            got = e.got if e.declared is None else LEN_PREFIX_BYTES + e.got
            raise RecordCut(self.peer, RECORD_HEADER + got, RECORD_HEADER + length) from None
        if frame is None:
            raise RecordCut(self.peer, RECORD_HEADER, RECORD_HEADER + length)
        if 4 + frame_wire_len(frame) != length:
            raise FrameError(f"frame record from {self.peer} declared {length} bytes, carried "
                             f"{4 + frame_wire_len(frame)}")
        if not hmac.compare_digest(_mac(self.key, head[:_RECORD.size], ftag)[:TAG_BYTES], tag):
            raise FrameError(f"frame record from {self.peer} failed its header tag (replayed or "
                             f"spliced frame)")
        return kind, flags, frame

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# --- handshakes ---------------------------------------------------------------------


def _link_key(salt: bytes, nonce_r: bytes, nonce_c: bytes) -> bytes:
    return _mac(salt, b"flodl_shm link", nonce_r, nonce_c)[:16]


def client_handshake(sock: socket.socket, salt: bytes, hello: dict, peer: str, *,
                     on_ack: Callable[[dict], None] | None = None) -> Link:
    """Relay side: prove the secret, check the controller's proof, announce the host;
    ``on_ack`` gets the controller's ``hello_ack`` message (its fields: ``control.py``)."""
    salt = check_salt(salt)
    deadline = time.monotonic() + handshake_deadline_s()
    nonce_r = os.urandom(NONCE_BYTES)
    sock.sendall(_HELLO.pack(CHANNEL_MAGIC, PROTOCOL_VERSION, 0, nonce_r))
    reply = _recv_exact(sock, _HELLO.size + PROOF_BYTES, f"handshake reply from {peer}", deadline)
    magic, version, _, nonce_c = _HELLO.unpack_from(reply)
    if magic != CHANNEL_MAGIC:
        raise FrameError(f"handshake: {peer} answered magic 0x{magic:08x}, not a flodl_shm "
                         f"controller (0x{CHANNEL_MAGIC:08x})")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"handshake: controller at {peer} speaks protocol version {version}, "
                         f"we speak {PROTOCOL_VERSION}")
    want = _mac(salt, b"flodl_shm controller", nonce_r, nonce_c)
    if not hmac.compare_digest(reply[_HELLO.size:], want):
        try:  # tell the controller, so it names the wrong secret too
            sock.sendall(PROOF_REFUSED)
        except OSError:
            pass
        raise FrameError(f"handshake: the controller at {peer} failed to prove the session secret "
                         f"(the two ends hold different secrets: give the controller and every "
                         f"host the same --secret-file, or spawn the same salt=)")
    sock.sendall(_mac(salt, b"flodl_shm relay", nonce_c, nonce_r))
    link = Link(sock, salt, _link_key(salt, nonce_r, nonce_c), peer)
    link.send_ctrl(ctrl_message(Ctrl.HELLO, **hello))
    got = link.recv(timeout=handshake_deadline_s())
    if got is None:
        raise HandshakeRejected(f"handshake: the controller at {peer} closed the connection "
                                f"without acknowledging our hello")
    kind, _, msg = got
    if kind != Kind.CTRL or msg["type"] not in (Ctrl.HELLO_ACK, Ctrl.REJECT):
        raise FrameError(f"handshake: expected hello_ack from {peer}, got {kind.name} {msg}")
    if msg["type"] == Ctrl.REJECT:
        raise HandshakeRejected(f"the controller at {peer} refused this host: {msg.get('reason')}")
    if on_ack is not None:
        on_ack(msg)
    return link


def server_handshake(sock: socket.socket, salt: bytes, peer: str,
                     admit: Callable[[dict, "Link"], str | None],
                     ack: dict | None = None) -> tuple[Link, dict]:
    """Controller side: check the relay's proof and hello. ``admit(hello, link)``
    validates and registers the host atomically, returning a refusal reason or None;
    only an admitted host is acknowledged, with ``ack``'s fields in the ``hello_ack``.
    Raises on failure (after telling the relay why, when it proved the secret)."""
    deadline = time.monotonic() + handshake_deadline_s()
    first = _recv_exact(sock, _HELLO.size, f"handshake from {peer}", deadline)
    magic, version, _, nonce_r = _HELLO.unpack_from(first)
    if magic != CHANNEL_MAGIC:
        raise FrameError(f"handshake from {peer}: channel magic 0x{magic:08x} != "
                         f"0x{CHANNEL_MAGIC:08x} (connection routed to the wrong port?)")
    nonce_c = os.urandom(NONCE_BYTES)
    sock.sendall(_HELLO.pack(CHANNEL_MAGIC, PROTOCOL_VERSION, 0, nonce_c)
                 + _mac(salt, b"flodl_shm controller", nonce_r, nonce_c))
    if version != PROTOCOL_VERSION:
        raise FrameError(f"handshake from {peer}: protocol version {version} != "
                         f"{PROTOCOL_VERSION}")
    try:
        proof = _recv_exact(sock, PROOF_BYTES, f"handshake proof from {peer}", deadline)
    except ConnectionError:
        raise FrameError(f"handshake from {peer}: the peer closed the connection instead of "
                         f"proving the session secret (a relay holding a different secret, "
                         f"or not a flodl_shm relay)") from None
    if proof == PROOF_REFUSED:
        raise FrameError(f"handshake from {peer}: the relay refused this controller's proof of "
                         f"the session secret: the two ends hold different secrets (give the "
                         f"controller and every host the same --secret-file, or spawn the same "
                         f"salt=)")
    if not hmac.compare_digest(proof, _mac(salt, b"flodl_shm relay", nonce_c, nonce_r)):
        raise FrameError(f"handshake from {peer}: the relay failed to prove the session secret "
                         f"(a different salt / secret file)")
    link = Link(sock, salt, _link_key(salt, nonce_r, nonce_c), peer)
    got = link.recv(timeout=max(0.1, deadline - time.monotonic()))
    if got is None or got[0] != Kind.CTRL or got[2]["type"] != Ctrl.HELLO:
        raise FrameError(f"handshake from {peer}: expected a hello record, got {got}")
    hello = got[2]
    reason = admit(hello, link)
    if reason is not None:
        try:
            link.send_ctrl(ctrl_message(Ctrl.REJECT, reason=reason))
        finally:
            link.close()
        refused = HandshakeRejected(f"refused host {hello.get('host')!r} from {peer}: {reason}")
        refused.key = (str(hello.get("host")), reason)  # (the controller's log throttle)
        raise refused
    link.send_ctrl(ctrl_message(Ctrl.HELLO_ACK, **(ack or {})))
    return link, hello


def parse_addr(addr) -> tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` -> (host, port); ValueError naming the input."""
    host = port = None
    if isinstance(addr, (tuple, list)) and len(addr) == 2:
        host, port = str(addr[0]), int(addr[1])
    elif isinstance(addr, str) and ":" in addr:
        head, _, tail = addr.rpartition(":")
        try:
            host, port = head.strip("[]") or "127.0.0.1", int(tail)
        except ValueError:
            pass
    if port is None:
        raise ValueError(f"address {addr!r} must be 'host:port'" if isinstance(addr, str)
                         else f"address {addr!r} must be 'host:port' or a (host, port) tuple")
    if not 0 <= port <= 65535:
        raise ValueError(f"address {addr!r}: port {port} is outside 0-65535 (0: any free port "
                         f"when binding)")
    return host, port


def connect(addr, *, attempts: int = 60, delay: float = 0.5,
            on_wait: Callable[[OSError, float], None] | None = None,
            stop: threading.Event | None = None) -> socket.socket:
    """Connect with retries (the controller may start after the relay); TCP_NODELAY.

    The retries go on for ``(attempts - 1) * delay`` seconds, ``delay`` apart: a
    connect that times out (a listener whose queue is full, a host that drops the
    packets) counts against that time too, so they end when they said they would.
    ``on_wait(error, seconds)``: called once, at the first failed attempt, with the
    error and how long the retries may go on (say so: a wrong port looks like a hang).
    ``stop``: set, it ends the retries at once (``ConnectionAbortedError``).
    The retry delay scales with ``FLODL_NET_TIMEOUT_SCALE`` like every deadline."""
    host, port = parse_addr(addr)
    delay *= _timeouts()
    budget = max(0, attempts - 1) * delay
    deadline = time.monotonic() + budget
    last: Exception | None = None
    tries = 0
    for tries in range(1, max(1, attempts) + 1):
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection(
                (host, port), timeout=min(handshake_deadline_s(), max(1.0, left)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            last = e
            if tries == 1 and budget > 0 and on_wait is not None:
                on_wait(e, budget)
            if tries == attempts or time.monotonic() >= deadline:
                break
            pause = min(delay, max(0.0, deadline - time.monotonic()))  # (the last, on time)
            if stop is None:
                time.sleep(pause)
            elif stop.wait(pause):
                raise ConnectionAbortedError(f"stopped while connecting to {host}:{port}")
    raise ConnectionError(f"could not connect to {host}:{port} within {budget:g} s "
                          f"({plural(tries, 'attempt')}; the last: {last})")

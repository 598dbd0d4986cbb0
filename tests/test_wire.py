"""The RoundFrame stream codec: layout (checked against docs/wire.md byte for
byte), authentication, the frame ceiling, length-prefix strictness and the named
header errors of notes/flodl-spec.md §1.7-1.8."""
from __future__ import annotations

import hashlib
import hmac
import io
import re
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from flodl_shm import DTYPE_BF16, DTYPE_F32, FrameError, RoundFrame, RoundKind, TensorPayload
from flodl_shm.cluster import wire

pytestmark = pytest.mark.timeout(60)

SALT = bytes([0x42] * 16)
OTHER_SALT = bytes([0x43] * 16)
DOC = Path(__file__).resolve().parents[1] / "docs" / "wire.md"


def f32_frame(values, weight: float = 1.0, kind: RoundKind = RoundKind.MODEL) -> RoundFrame:
    arr = np.asarray(values, np.float32)
    return RoundFrame([TensorPayload(DTYPE_F32, arr.shape, arr)], weight, kind)


def frame_bytes(frame: RoundFrame, salt: bytes = SALT) -> bytes:
    buf = io.BytesIO()
    n = wire.write_round_frame(buf, frame, salt)
    assert n == len(buf.getvalue()) == wire.frame_wire_len(frame)
    return buf.getvalue()


def raw_frame(*, magic: int = wire.ROUND_FRAME_MAGIC, count: int | None = None, kind: int = 0,
              weight: float = 1.0, tensors=(), salt: bytes = SALT) -> bytes:
    """Hand-built frame bytes with any header values (bypasses the writer's checks).

    ``tensors``: (dtype, shape, payload bytes, declared nbytes or None) tuples.
    """
    body = struct.pack("<IIBd", magic, len(tensors) if count is None else count, kind, weight)
    for dtype, shape, payload, nbytes in tensors:
        body += struct.pack(f"<BB{len(shape)}IQ", dtype, len(shape), *shape,
                            len(payload) if nbytes is None else nbytes)
        body += payload
    return body + hmac.new(salt, body, hashlib.sha256).digest()[:8]


def prefixed(body: bytes, n: int | None = None) -> bytes:
    return struct.pack("<I", len(body) if n is None else n) + body


# --- docs/wire.md worked example -----------------------------------------------------


def doc_hex_example() -> tuple[bytes, bytes]:
    """(prefix, frame) parsed from the ```hex block of docs/wire.md, checking every
    ``@offset`` comment against the running offset of the bytes before it."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```hex\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/wire.md must hold exactly one ```hex block"
    prefix, frame = bytearray(), bytearray()
    for line in blocks[0].splitlines():
        data, _, comment = line.partition("#")
        chunk = bytes.fromhex(data)
        if "length prefix" in comment:
            prefix += chunk
            continue
        at = re.match(r"\s*@(\d+)\b", comment)
        assert at, f"line without an @offset: {line!r}"
        assert int(at.group(1)) == len(frame), f"offset comment disagrees: {line!r}"
        frame += chunk
    return bytes(prefix), bytes(frame)


def test_docs_worked_example_is_what_the_code_writes() -> None:
    prefix, frame = doc_hex_example()
    spec_vector = bytes.fromhex(
        "f1170df1 01000000 00 000000000000f03f 00 01 02000000 0800000000000000 "
        "0000803f 00000040 1960f1ead97d18ae".replace(" ", ""))
    assert frame == spec_vector  # the doc carries notes/flodl-spec.md's test vector
    assert prefix == bytes.fromhex("2f000000") and len(frame) == 47
    example = f32_frame([1.0, 2.0])
    assert frame_bytes(example) == frame
    assert wire.encode_framed_round(example, SALT) == prefix + frame
    got = wire.read_framed_round(io.BytesIO(prefix + frame), SALT)
    assert got == example


def test_docs_bf16_variant_claim() -> None:
    arr = np.array([0x3F80, 0x4000], np.uint16)
    b = frame_bytes(RoundFrame([TensorPayload(DTYPE_BF16, (2,), arr)]))
    _, f32 = doc_hex_example()
    assert b[17] == 1 and b[23:31] == struct.pack("<Q", 4) and b[31:35] == bytes.fromhex("803f0040")
    assert b[:17] == f32[:17] and b[-8:] != f32[-8:]


# --- round trips ---------------------------------------------------------------------


def test_round_trip_mixed_frame() -> None:
    rng = np.random.default_rng(3)
    big = rng.standard_normal(50_000).astype(np.float32)  # > 64 KiB: streamed, not coalesced
    frame = RoundFrame([
        TensorPayload(DTYPE_F32, (2, 3), np.arange(6, dtype=np.float32)),
        TensorPayload(DTYPE_BF16, (4,), np.array([1, 2, 3, 0xFFFF], np.uint16)),
        TensorPayload(DTYPE_F32, (), np.array([7.0], np.float32)),
        TensorPayload(DTYPE_F32, (0, 5), b""),
        TensorPayload(DTYPE_F32, big.shape, big),
    ], weight=0.0, kind=RoundKind.CONTROL)
    for read in (wire.read_round_frame, wire.read_framed_round):
        data = frame_bytes(frame) if read is wire.read_round_frame else \
            wire.encode_framed_round(frame, SALT)
        got = read(io.BytesIO(data), SALT)
        assert got == frame
        assert got.kind is RoundKind.CONTROL and got.weight == 0.0


def test_empty_frame_round_trips() -> None:
    frame = RoundFrame([], 2.5)
    assert len(frame_bytes(frame)) == 25
    assert wire.read_round_frame(io.BytesIO(frame_bytes(frame)), SALT) == frame


def test_back_to_back_frames_then_clean_eof() -> None:
    frames = [f32_frame([float(i)] * (i + 1), weight=i) for i in range(4)]
    stream = io.BytesIO(b"".join(wire.encode_framed_round(f, SALT) for f in frames))
    assert [wire.read_framed_round(stream, SALT) for _ in frames] == frames
    assert wire.read_framed_round(stream, SALT) is None
    assert wire.read_framed_round(stream, SALT) is None


def test_clean_eof_returns_none() -> None:
    assert wire.read_framed_round(io.BytesIO(b""), SALT) is None
    assert wire.read_len_prefix(io.BytesIO(b"")) is None
    assert wire.read_round_frame(io.BytesIO(b""), SALT) is None
    with pytest.raises(FrameError, match="length prefix read failed.*2 of 4"):
        wire.read_framed_round(io.BytesIO(b"\x2f\x00"), SALT)


def test_reads_from_a_socket_in_small_pieces() -> None:
    """A real socket delivering the stream a few bytes at a time (short reads)."""
    frames = [f32_frame(np.linspace(0, 1, 1000)), f32_frame([3.0], weight=4.0)]
    data = b"".join(wire.encode_framed_round(f, SALT) for f in frames)
    a, b = socket.socketpair()
    with a, b:
        def send() -> None:
            for i in range(0, len(data), 7):
                a.sendall(data[i:i + 7])
            a.shutdown(socket.SHUT_WR)

        th = threading.Thread(target=send)
        th.start()
        stream = b.makefile("rb", buffering=0)
        got = [wire.read_framed_round(stream, SALT) for _ in range(3)]
        th.join(10)
    assert got == frames + [None]


def test_streams_without_readinto_are_read() -> None:
    class ReadOnly:
        def __init__(self, data: bytes) -> None:
            self._b = io.BytesIO(data)

        def read(self, n: int) -> bytes:
            return self._b.read(min(n, 5))

    frame = f32_frame([1.0, -2.0, 3.0])
    assert wire.read_framed_round(ReadOnly(wire.encode_framed_round(frame, SALT)), SALT) == frame


# --- authentication ---------------------------------------------------------------


def test_other_salt_is_refused_because_the_tag_disagrees() -> None:
    data = frame_bytes(f32_frame([1.0, 2.0]), OTHER_SALT)
    with pytest.raises(FrameError, match="HMAC verification failed.*the tag disagrees"):
        wire.read_round_frame(io.BytesIO(data), SALT)
    with pytest.raises(FrameError, match="tag disagrees"):
        wire.read_framed_round(io.BytesIO(prefixed(data)), SALT)


@pytest.mark.parametrize("offset", [4 + 9, 4 + 31, 4 + 38, 4 + 39, 4 + 46])
def test_any_altered_byte_fails_the_tag(offset: int) -> None:
    data = bytearray(wire.encode_framed_round(f32_frame([1.0, 2.0]), SALT))
    data[offset] ^= 0x01
    with pytest.raises(FrameError, match="HMAC verification failed"):
        wire.read_framed_round(io.BytesIO(bytes(data)), SALT)


def test_truncated_footer_is_named() -> None:
    data = frame_bytes(f32_frame([1.0, 2.0]))[:-3]
    with pytest.raises(FrameError, match="HMAC footer read failed"):
        wire.read_round_frame(io.BytesIO(data), SALT)


@pytest.mark.parametrize("salt", [16, "42" * 16, b"short", None, bytes(17)])
def test_bad_salts_are_refused(salt) -> None:
    with pytest.raises(FrameError, match="session salt must be 16 bytes"):
        wire.write_round_frame(io.BytesIO(), f32_frame([1.0]), salt)
    with pytest.raises(FrameError, match="session salt must be 16 bytes"):
        wire.read_framed_round(io.BytesIO(b""), salt)


# --- header validation --------------------------------------------------------------


def test_bad_magic_is_named() -> None:
    data = raw_frame(magic=0xDEADBEEF)
    with pytest.raises(FrameError, match="frame magic 0xdeadbeef != 0xf10d17f1"):
        wire.read_round_frame(io.BytesIO(data), SALT)


def test_too_many_tensors_is_named_before_reading_them() -> None:
    data = raw_frame(count=65537)
    with pytest.raises(FrameError, match=r"frame claims 65537 tensors \(> 65536\)"):
        wire.read_framed_round(io.BytesIO(prefixed(data)), SALT)
    with pytest.raises(FrameError, match="at most 65536"):
        wire.write_round_frame(io.BytesIO(), RoundFrame([TensorPayload(0, (0,), b"")] * 65537),
                               SALT)


def test_unknown_kind_is_named() -> None:
    with pytest.raises(FrameError, match="unknown RoundKind wire byte 7"):
        wire.read_round_frame(io.BytesIO(raw_frame(kind=7)), SALT)


@pytest.mark.parametrize("weight", [float("nan"), -1.0, -0.5e-300, float("inf"), float("-inf")])
def test_bad_weight_is_named(weight: float) -> None:
    with pytest.raises(FrameError, match="is not a finite non-negative realized-work mass"):
        wire.read_round_frame(io.BytesIO(raw_frame(weight=weight)), SALT)


def test_negative_zero_weight_is_accepted() -> None:
    got = wire.read_round_frame(io.BytesIO(raw_frame(weight=-0.0)), SALT)
    assert got.weight == 0.0 and got.tensors == []


def test_payload_byte_count_must_match_shape() -> None:
    data = raw_frame(tensors=[(DTYPE_F32, (4,), bytes(8), None)])
    with pytest.raises(FrameError, match="numel 4: expected 16 bytes"):
        wire.read_round_frame(io.BytesIO(data), SALT)


def test_unknown_dtype_tag_is_named() -> None:
    data = raw_frame(tensors=[(5, (2,), bytes(8), None)])
    with pytest.raises(FrameError, match="unsupported wire dtype tag 5"):
        wire.read_round_frame(io.BytesIO(data), SALT)


def test_writer_validates_before_the_first_byte() -> None:
    bad = [
        RoundFrame([TensorPayload(DTYPE_F32, (4,), bytes(8))]),
        RoundFrame([TensorPayload(DTYPE_F32, (2,), bytes(8))], weight=float("nan")),
        RoundFrame([TensorPayload(3, (2,), bytes(8))]),
    ]
    for frame in bad:
        for write in (wire.write_round_frame, wire.write_framed_round):
            out = io.BytesIO()
            with pytest.raises(FrameError):
                write(out, frame, SALT)
            assert out.getvalue() == b"", write


# --- frame ceiling ---------------------------------------------------------------


def test_prefix_above_the_ceiling_is_refused_before_allocating(payload_allocations) -> None:
    body = frame_bytes(f32_frame(np.zeros(1000)))
    with pytest.raises(FrameError, match=r"length prefix 4039 exceeds the frame ceiling of 4000"):
        wire.read_framed_round(io.BytesIO(prefixed(body)), SALT, ceiling=4000)
    hostile = prefixed(b"", n=0xFFFFFFFF)
    with pytest.raises(FrameError, match="exceeds the frame ceiling"):
        wire.read_framed_round(io.BytesIO(hostile), SALT)  # default ceiling: 1 GiB
    assert payload_allocations == []


def test_ceiling_from_env_and_setter(monkeypatch, payload_allocations) -> None:
    data = wire.encode_framed_round(f32_frame(np.zeros(100)), SALT)  # 4 + 437 bytes
    monkeypatch.setenv("FLODL_SHM_MAX_FRAME_BYTES", "400")
    assert wire.frame_ceiling() == 400
    with pytest.raises(FrameError, match="ceiling of 400"):
        wire.read_framed_round(io.BytesIO(data), SALT)
    with pytest.raises(FrameError, match="exceeds the frame ceiling of 400"):
        wire.write_framed_round(io.BytesIO(), f32_frame(np.zeros(100)), SALT)
    try:
        wire.set_frame_ceiling(1000)
        assert wire.frame_ceiling() == 1000
        assert wire.read_framed_round(io.BytesIO(data), SALT) == f32_frame(np.zeros(100))
    finally:
        wire.set_frame_ceiling(None)
    assert wire.frame_ceiling() == 400
    monkeypatch.delenv("FLODL_SHM_MAX_FRAME_BYTES")
    assert wire.frame_ceiling() == wire.DEFAULT_FRAME_CEILING == 1 << 30
    assert payload_allocations == [400]
    monkeypatch.setenv("FLODL_SHM_MAX_FRAME_BYTES", "lots")
    with pytest.raises(ValueError, match="FLODL_SHM_MAX_FRAME_BYTES='lots'"):
        wire.frame_ceiling()


def test_hostile_tensor_length_is_refused_before_allocating(payload_allocations) -> None:
    """An unprefixed frame whose tensor claims 16 GiB: the running total is
    checked against the ceiling before the buffer is made."""
    data = raw_frame(tensors=[(DTYPE_F32, (1 << 16, 1 << 16), b"", 4 << 32)])
    with pytest.raises(FrameError, match=r"tensor\[0\] pushes frame past the 1073741824 byte"):
        wire.read_round_frame(io.BytesIO(data), SALT)
    two = raw_frame(tensors=[(DTYPE_F32, (600,), bytes(2400), None)] * 2)
    with pytest.raises(FrameError, match=r"tensor\[1\] pushes frame past the 4000 byte"):
        wire.read_round_frame(io.BytesIO(two), SALT, ceiling=4000)
    assert payload_allocations == [2400]


def test_tensor_longer_than_the_prefix_is_refused_before_allocating(payload_allocations) -> None:
    body = raw_frame(tensors=[(DTYPE_F32, (1 << 20,), b"", 4 << 20)])  # declares 4 MiB, sends none
    with pytest.raises(FrameError, match=r"tensor\[0\] read failed: it declares 4194304 payload"):
        wire.read_framed_round(io.BytesIO(prefixed(body)), SALT)
    assert payload_allocations == []


def test_write_len_prefix_bounds() -> None:
    out = io.BytesIO()
    wire.write_len_prefix(out, 47)
    assert out.getvalue() == bytes.fromhex("2f000000")
    with pytest.raises(FrameError, match="exceeds the frame ceiling of 100"):
        wire.write_len_prefix(io.BytesIO(), 101, ceiling=100)
    with pytest.raises(FrameError, match="does not fit a u32"):
        wire.write_len_prefix(io.BytesIO(), 1 << 32, ceiling=1 << 40)
    with pytest.raises(FrameError, match="negative"):
        wire.write_len_prefix(io.BytesIO(), -1)


# --- prefix / body drift -----------------------------------------------------------


def test_prefix_declaring_more_than_the_frame() -> None:
    body = frame_bytes(f32_frame([1.0, 2.0]))
    stream = io.BytesIO(prefixed(body, len(body) + 10) + bytes(10))
    with pytest.raises(FrameError, match="consumed 10 bytes fewer than its length prefix"):
        wire.read_framed_round(stream, SALT)


def test_prefix_declaring_less_than_the_frame() -> None:
    body = frame_bytes(f32_frame([1.0, 2.0]))
    stream = io.BytesIO(prefixed(body, len(body) - 10) + body)
    with pytest.raises(FrameError) as e:
        wire.read_framed_round(stream, SALT)
    assert "read failed" in str(e.value) or "ended inside" in str(e.value)
    assert stream.tell() <= 4 + len(body) - 10  # never a byte past the declared length


@pytest.mark.parametrize("cut", [3, 17, 30, 40, 46])
def test_prefix_shorter_at_every_field(cut: int) -> None:
    body = frame_bytes(f32_frame([1.0, 2.0]))
    stream = io.BytesIO(prefixed(body, cut) + body)
    with pytest.raises(FrameError, match="read failed|ended inside"):
        wire.read_framed_round(stream, SALT)
    assert stream.tell() <= 4 + cut


def test_stream_ending_inside_a_framed_body() -> None:
    data = wire.encode_framed_round(f32_frame([1.0, 2.0]), SALT)
    for cut in (6, 20, 35, len(data) - 1):
        with pytest.raises(FrameError, match="ended inside a len-framed|footer read failed"):
            wire.read_framed_round(io.BytesIO(data[:cut]), SALT)


def test_zero_length_prefix_is_an_error() -> None:
    with pytest.raises(FrameError, match="zero-length prefix"):
        wire.read_framed_round(io.BytesIO(prefixed(b"")), SALT)

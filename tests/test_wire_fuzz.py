"""Fuzzing the frame reader: random bytes, mutated valid frames, and hostile
frames that even carry a correct tag. Whatever arrives, the reader returns a
frame, returns None (clean end of stream) or raises FrameError - never another
exception - and never allocates a payload buffer above the ceiling. A frame it
does return is exactly what the sender wrote (it re-encodes to the bytes read).
"""
from __future__ import annotations

import hashlib
import hmac
import io
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_shm import FrameError, RoundFrame, RoundKind, TensorPayload
from flodl_shm.cluster import wire

pytestmark = pytest.mark.timeout(120)

SALT = bytes(range(16))
CEILING = 2048
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@st.composite
def frames(draw) -> RoundFrame:
    tensors = []
    for _ in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from([0, 1]))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * (4 if dtype == 0 else 2)
        tensors.append(TensorPayload(dtype, shape, draw(st.binary(min_size=nbytes,
                                                                  max_size=nbytes))))
    weight = draw(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False))
    return RoundFrame(tensors, weight, draw(st.sampled_from(list(RoundKind))))


EXTREMES = [b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", CEILING + 1), struct.pack("<I", 65537),
            struct.pack("<d", float("nan")), struct.pack("<d", -1.0), b"\x80"]


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` after one to four random edits: flips, extreme overwrites, cuts,
    insertions, deletions."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "extreme", "cut", "insert", "delete"]))
        pos = draw(st.integers(0, len(buf)))
        if op == "flip" and pos < len(buf):
            buf[pos] ^= draw(st.integers(1, 255))
        elif op == "extreme":
            patch = draw(st.sampled_from(EXTREMES))
            buf[pos:pos + len(patch)] = patch
        elif op == "cut":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            del buf[pos:pos + draw(st.integers(1, 16))]
    return bytes(buf)


def read_all(read, data: bytes, reencode) -> None:
    """Read frames from ``data`` until None or an error; check the contract."""
    stream = io.BytesIO(data)
    for _ in range(8):
        start = stream.tell()
        try:
            got = read(stream, SALT, ceiling=CEILING)
        except FrameError:
            return
        if got is None:
            return
        assert isinstance(got, RoundFrame)
        assert reencode(got) == data[start:stream.tell()]


def encode(frame: RoundFrame) -> bytes:
    buf = io.BytesIO()
    wire.write_round_frame(buf, frame, SALT)
    return buf.getvalue()


def framed(frame: RoundFrame) -> bytes:
    return wire.encode_framed_round(frame, SALT)


def fuzz_both(data_framed: bytes, data_plain: bytes, allocations: list[int]) -> None:
    read_all(wire.read_framed_round, data_framed, framed)
    read_all(wire.read_round_frame, data_plain, encode)
    assert all(n <= CEILING for n in allocations), max(allocations)


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes(data: bytes, payload_allocations) -> None:
    fuzz_both(data, data, payload_allocations)


@FUZZ
@given(tail=st.binary(max_size=400), n=st.integers(0, 600))
def test_random_bytes_behind_a_valid_magic_and_prefix(tail: bytes, n: int,
                                                      payload_allocations) -> None:
    body = struct.pack("<I", wire.ROUND_FRAME_MAGIC) + tail
    fuzz_both(struct.pack("<I", n) + body, body, payload_allocations)


@FUZZ
@given(data=st.data(), frame=frames())
def test_mutated_valid_frames(data, frame: RoundFrame, payload_allocations) -> None:
    good_framed, good_plain = framed(frame), encode(frame)
    stream = good_framed + framed(RoundFrame([], 1.0))  # a second frame behind it
    fuzz_both(data.draw(mutated(stream)), data.draw(mutated(good_plain)), payload_allocations)


@st.composite
def authenticated_hostile(draw) -> bytes:
    """Frames from a peer that knows the salt but lies in every field."""
    count = draw(st.integers(0, 4))
    body = struct.pack("<IIBd", wire.ROUND_FRAME_MAGIC, count, draw(st.integers(0, 2)),
                       draw(st.floats(allow_nan=True, allow_infinity=True)))
    for _ in range(count):
        ndim = draw(st.integers(0, 3))
        dims = [draw(st.integers(0, 0xFFFFFFFF) | st.integers(0, 8)) for _ in range(ndim)]
        nbytes = draw(st.integers(0, (1 << 64) - 1) | st.integers(0, 64))
        body += struct.pack(f"<BB{ndim}IQ", draw(st.integers(0, 255) | st.just(0)), ndim, *dims,
                            nbytes)
        body += draw(st.binary(max_size=64))
    return body + hmac.new(SALT, body, hashlib.sha256).digest()[:8]


@FUZZ
@given(body=authenticated_hostile())
def test_authenticated_hostile_frames(body: bytes, payload_allocations) -> None:
    fuzz_both(struct.pack("<I", len(body)) + body, body, payload_allocations)


def test_each_mutation_family_is_a_named_error(payload_allocations) -> None:
    """One hand-made example per family the fuzzers produce, with its message."""
    frame = RoundFrame([TensorPayload(0, (2,), np.ones(2, np.float32))])
    good = framed(frame)
    variants = {
        "tag": good[:-1] + bytes([good[-1] ^ 1]),
        "magic": good[:4] + b"\x00" + good[5:],
        "ceiling": good[:4 + 23] + struct.pack("<Q", CEILING + 1) + good[4 + 31:],
        "drift": struct.pack("<I", len(good)) + good[4:] + b"\x00\x00\x00\x00",
    }
    for name, data in variants.items():
        with pytest.raises(FrameError) as e:
            wire.read_framed_round(io.BytesIO(data), SALT, ceiling=CEILING)
        assert {"tag": "HMAC", "magic": "magic", "ceiling": "ceiling",
                "drift": "fewer than"}[name] in str(e.value)
    assert wire.read_framed_round(io.BytesIO(good), SALT, ceiling=CEILING) == frame
    assert payload_allocations == [8, 8, 8]  # tag, drift, good: never the 2049

"""Tensors <-> RoundFrames: the conversion behaviour flodl 0.7.0's tests pin
(seeds/002: tensor round trips, bf16 verbatim and upcast, dtype and byte-count
rejection, fused scale = tensor.mul bit for bit)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_shm import (
    DTYPE_BF16,
    DTYPE_F32,
    FrameError,
    RoundFrame,
    RoundKind,
    TensorPayload,
    round_frame_to_tensors,
    tensors_to_round_frame,
)
from flodl_shm.frame import check_frame, describe_schema, payload_to_tensor, tensor_to_payload
from flodl_shm.kernels import scale_payload_bytes

pytestmark = pytest.mark.timeout(60)

SEED_VALS = [0.7314426, -1.9023375, 3.017882e-3, -42.52386]
SEED_W = 0.8349217


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_f32_round_trip_keeps_shape_and_values() -> None:
    data = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    t = torch.tensor(data).reshape(2, 3)
    frame = tensors_to_round_frame([t], DTYPE_F32)
    assert len(frame.tensors) == 1
    p = frame.tensors[0]
    assert (p.dtype, p.shape, p.nbytes) == (DTYPE_F32, (2, 3), 6 * 4)
    assert (frame.weight, frame.kind) == (1.0, RoundKind.MODEL)
    (back,) = round_frame_to_tensors(frame)
    assert back.dtype == torch.float32 and tuple(back.shape) == (2, 3)
    assert back.flatten().tolist() == data


def test_bf16_round_trip_halves_the_bytes_and_decodes_to_f32() -> None:
    data = [1.0, -2.5, 0.0, 42.0, 0.125, -256.0]  # all bf16-exact
    t = torch.tensor(data).reshape(2, 3)
    frame = tensors_to_round_frame([t], DTYPE_BF16)
    assert frame.tensors[0].dtype == DTYPE_BF16
    assert frame.tensors[0].nbytes == 6 * 2
    (back,) = round_frame_to_tensors(frame)
    assert back.dtype == torch.float32 and tuple(back.shape) == (2, 3)
    assert back.flatten().tolist() == data


def test_bf16_encode_is_torch_cast_bit_for_bit() -> None:
    t = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1)) * 1e3
    p = tensors_to_round_frame([t], DTYPE_BF16).tensors[0]
    assert bytes(p.data) == raw(t.to(torch.bfloat16))
    (back,) = round_frame_to_tensors(RoundFrame([p]))
    assert torch.equal(back, t.to(torch.bfloat16).float())


def test_bf16_tensor_is_verbatim_on_bf16_wire_and_upcast_on_f32_wire() -> None:
    t = torch.tensor([1.5, -3.0]).to(torch.bfloat16)
    frame = tensors_to_round_frame([t], DTYPE_BF16)
    assert bytes(frame.tensors[0].data) == raw(t)
    f32_frame = tensors_to_round_frame([t], DTYPE_F32)
    assert f32_frame.tensors[0].dtype == DTYPE_F32
    assert round_frame_to_tensors(f32_frame)[0].tolist() == [1.5, -3.0]


def test_bf16_tensor_verbatim_keeps_nan_payload_bits() -> None:
    """Verbatim means no second cast: even a signalling-NaN pattern passes as is."""
    bits = torch.tensor([0x7F81, 0x3F80, -0x7F], dtype=torch.int16)  # -0x7F = 0xFF81
    t = bits.view(torch.bfloat16)
    assert bytes(tensors_to_round_frame([t], DTYPE_BF16).tensors[0].data) == raw(bits)


@pytest.mark.parametrize("dtype,name", [(torch.float64, "Float64"), (torch.float16, "Float16"),
                                        (torch.int64, "Int64"), (torch.int32, "Int32")])
def test_rejects_non_f32_dtypes_naming_both(dtype: torch.dtype, name: str) -> None:
    t = torch.tensor([1.0, 2.0]).to(dtype)
    for wire in (DTYPE_F32, DTYPE_BF16):
        with pytest.raises(FrameError) as e:
            tensors_to_round_frame([torch.zeros(1), t], wire)
        msg = str(e.value)
        assert name in msg and "Float32" in msg and "tensor[1]" in msg, msg


def test_rejects_non_tensors() -> None:
    with pytest.raises(FrameError, match=r"tensor\[0\] is a list"):
        tensors_to_round_frame([[1.0, 2.0]], DTYPE_F32)


def test_rejects_unknown_wire_dtype() -> None:
    with pytest.raises(FrameError, match="unsupported wire dtype tag 2"):
        tensors_to_round_frame([torch.zeros(2)], 2)


def test_shape_byte_mismatch_names_numel_and_expected() -> None:
    bogus = RoundFrame([TensorPayload(DTYPE_F32, (4,), bytes(8))])
    with pytest.raises(FrameError) as e:
        round_frame_to_tensors(bogus)
    msg = str(e.value)
    assert "numel" in msg and "expected" in msg and "16" in msg and "8" in msg, msg
    with pytest.raises(FrameError, match="numel"):
        round_frame_to_tensors(RoundFrame([TensorPayload(DTYPE_BF16, (2, 2), bytes(16))]))
    with pytest.raises(FrameError, match="numel"):
        check_frame(bogus)


def test_unknown_payload_dtype_is_refused_at_decode() -> None:
    with pytest.raises(FrameError, match="unsupported wire dtype tag 9"):
        round_frame_to_tensors(RoundFrame([TensorPayload(9, (2,), bytes(8))]))


# --- fused scale -------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tag", [(torch.float32, DTYPE_F32), (torch.bfloat16, DTYPE_BF16)])
def test_fused_byte_scale_matches_mul_scalar(dtype: torch.dtype, tag: int) -> None:
    t = torch.tensor(SEED_VALS).to(dtype)
    expected = raw(t.mul(SEED_W))
    fused = bytearray(raw(t))
    scale_payload_bytes(fused, tag, np.float32(SEED_W))
    assert bytes(fused) == expected, f"dtype {dtype}"
    # the send-side fused encode gives the same bytes
    assert bytes(tensor_to_payload(t, tag, scale=SEED_W).data) == expected


def test_fused_scale_across_wires_is_mul_then_encode() -> None:
    """tensor_to_payload(t, wire, scale=w) == encoding t.mul(w), for every pairing."""
    t32 = torch.tensor(SEED_VALS)
    t16 = t32.to(torch.bfloat16)
    cases = [
        (t32, DTYPE_BF16, raw(t32.mul(SEED_W).to(torch.bfloat16))),
        # a bf16 tensor scales in bf16 (rounding) before its upcast to the f32 wire
        (t16, DTYPE_F32, raw(t16.mul(SEED_W).float())),
    ]
    for t, wire, want in cases:
        assert bytes(tensor_to_payload(t, wire, scale=SEED_W).data) == want, (t.dtype, wire)


# --- payload / tensor boundaries -----------------------------------------------------


def test_encode_handles_views_grad_and_zero_dims() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = [base.t(), base[:, ::2], torch.tensor(5.0, requires_grad=True),
               torch.zeros(0, 3)]
    for wire in (DTYPE_F32, DTYPE_BF16):
        frame = tensors_to_round_frame(tensors, wire)
        assert [p.shape for p in frame.tensors] == [(4, 3), (3, 2), (), (0, 3)]
        back = round_frame_to_tensors(frame)
        for got, want in zip(back, tensors):
            assert torch.equal(got, want.detach()), (wire, want)


def test_decoded_tensors_do_not_alias_the_payload() -> None:
    p = tensor_to_payload(torch.tensor([1.0, 2.0]), DTYPE_F32)
    t = payload_to_tensor(p)
    t.add_(10.0)
    assert np.frombuffer(p.data, np.float32).tolist() == [1.0, 2.0]


def test_decode_into_destination() -> None:
    p = tensor_to_payload(torch.tensor([[1.0, 2.0], [3.0, -4.0]]), DTYPE_BF16)
    out = torch.full((4,), 99.0)
    got = payload_to_tensor(p, out=out)
    assert got.shape == (2, 2) and got.data_ptr() == out.data_ptr()
    assert out.tolist() == [1.0, 2.0, 3.0, -4.0]
    with pytest.raises(FrameError, match="numel 4"):
        payload_to_tensor(p, out=torch.empty(3))
    with pytest.raises(FrameError, match="float32"):
        payload_to_tensor(p, out=torch.empty(4, dtype=torch.float64))


def test_payload_and_frame_validation() -> None:
    with pytest.raises(FrameError, match=r"dim\[1\] = 4294967296 doesn't fit in u32"):
        TensorPayload(DTYPE_F32, (1, 1 << 32), b"")
    with pytest.raises(FrameError, match="256 dims"):
        TensorPayload(DTYPE_F32, (1,) * 256, bytes(4))
    with pytest.raises(FrameError, match="unknown RoundKind wire byte 3"):
        RoundFrame([], 1.0, 3)
    for w in (float("nan"), -1.0, float("inf")):
        with pytest.raises(FrameError, match="finite non-negative"):
            check_frame(RoundFrame([], w))


def test_payload_equality_is_by_value() -> None:
    a = TensorPayload(DTYPE_F32, [2], np.array([1.0, 2.0], np.float32))
    b = TensorPayload(DTYPE_F32, (2,), bytearray(np.array([1.0, 2.0], np.float32).tobytes()))
    assert a == b and RoundFrame([a], 2.0) == RoundFrame([b], 2.0)
    assert RoundFrame([a], 2.0) != RoundFrame([b], 1.0)
    assert RoundFrame([a]) != RoundFrame([b], kind=RoundKind.CONTROL)
    assert a != TensorPayload(DTYPE_F32, (1, 2), a.data)


def test_a_schema_in_words_lists_its_shapes_with_their_dtypes_where_they_differ() -> None:
    """What the mismatch errors of one host and of the controller say of a round."""
    assert describe_schema("MODEL", [(DTYPE_F32, (10,)), (DTYPE_F32, (3, 2))]) == \
        "MODEL round, 2 tensors f32 shapes [10], [3,2]"
    assert describe_schema("MODEL", [(DTYPE_F32, (10,)), (DTYPE_BF16, ())]) == \
        "MODEL round, 2 tensors f32 [10], bf16 []"
    assert describe_schema("CONTROL", []) == "CONTROL round without tensors"
    assert describe_schema("MODEL", [(DTYPE_BF16, (i,)) for i in range(10)]) == (
        "MODEL round, 10 tensors bf16 shapes [0], [1], [2], [3], [4], [5], [6], [7], ... "
        "(10 tensors)")

"""Round frames: the unit every collective exchanges.

A ``RoundFrame`` is an ordered list of ``TensorPayload`` (a wire dtype tag, a shape
and the raw little-endian element bytes) plus the sender's realized-work ``weight``
and the round's ``kind``. It mirrors flodl 0.7.0's RoundFrame (docs/wire.md);
``flodl_shm.cluster.wire`` gives its byte layout on a stream.

Wire dtypes: ``DTYPE_F32`` (tag 0, 4-byte elements) and ``DTYPE_BF16`` (tag 1,
2-byte elements). Tensors cross this boundary as:

- f32 tensor -> f32 payload: the bytes, copied once;
- f32 tensor -> bf16 payload: round-to-nearest-even, bit-identical to torch's cast
  for every non-NaN value (a NaN becomes a quiet NaN keeping its sign);
- bf16 tensor -> bf16 payload: the bits verbatim (no second rounding);
- bf16 tensor -> f32 payload: upcast exactly (a bf16-staged tensor on an f32 wire
  keeps the cohort's frame schema instead of desyncing it);
- any other dtype: ``FrameError`` naming it and the supported ones.

Decoding always returns float32 CPU tensors.
"""
from __future__ import annotations

import ctypes
import enum
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from . import kernels
from .errors import FrameError, plural

DTYPE_F32 = 0
DTYPE_BF16 = 1

_ELEM_SIZE = {DTYPE_F32: 4, DTYPE_BF16: 2}
_DTYPE_NAME = {DTYPE_F32: "f32", DTYPE_BF16: "bf16"}

#: The realized-work masses a collective round accepts: 0, or a normal float32 in
#: [MASS_MIN, MASS_MAX]. The consensus is Σ(wᵣ·Tᵣ) times the float32 reciprocal of
#: Σwᵣ: a mass below MASS_MIN has no finite one (every element became inf or NaN),
#: one above MASS_MAX is inf as a float32 scale (0·inf: NaN).
MASS_MIN = float(np.finfo(np.float32).tiny)
MASS_MAX = float(np.finfo(np.float32).max)


def shown_number(x) -> str:
    """``x`` for an error message: as ``:g`` shows it, or, for an int beyond a float's
    range, its first digits and its length."""
    try:
        return f"{x:g}"
    except OverflowError:
        digits = str(abs(x))
        return f"{'-' if x < 0 else ''}{digits[:4]}... ({len(digits)} digits)"


def mass_error(weight: float) -> FrameError:
    """The error for a round's ``weight`` that is not a mass (see ``MASS_MIN``); an int
    beyond a float's range too."""
    if not 0.0 <= weight < math.inf:
        shown = shown_number(weight) if type(weight) is int else weight
        return FrameError(f"weight {shown} is not a finite non-negative realized-work mass")
    return FrameError(
        f"weight {shown_number(weight)} is outside the masses a float32 round carries: 0, or "
        f"{MASS_MIN:.4g} to {MASS_MAX:.4g} (below, the divisor 1/Σw overflows; above, "
        f"w·T does). Rescale the weights (e.g. divide every rank's by a common "
        f"constant such as the expected samples per window)")


#: Bound on a frame's tensor count (a hostile count is refused before any parsing).
MAX_ROUND_FRAME_TENSORS = 65536
#: Bound on a tensor's rank (the wire stores ndim in one byte).
MAX_NDIM = 255
_U32_MAX = 0xFFFFFFFF


class RoundKind(enum.IntEnum):
    """What a round carries. ``MODEL`` rounds are realized-work averages (params or
    buffers; fed to the checkpoint forge and the outer optimizer). ``CONTROL`` rounds
    are plain sums (count gathers, broadcasts), always on an f32 wire."""

    MODEL = 0
    CONTROL = 1

    @classmethod
    def from_wire(cls, byte: int) -> "RoundKind":
        try:
            return cls(byte)
        except ValueError:
            raise FrameError(f"unknown RoundKind wire byte {byte} (0 = Model, 1 = Control)") from None


_WIRE_KINDS = frozenset(int(k) for k in RoundKind)


def elem_size(dtype: int) -> int:
    """Bytes per element of a wire dtype tag; ``FrameError`` for an unknown tag."""
    try:
        return _ELEM_SIZE[dtype]
    except (KeyError, TypeError):
        raise FrameError(f"unsupported wire dtype tag {dtype!r} (0 = f32, 1 = bf16)") from None


def dtype_name(dtype: int) -> str:
    return _DTYPE_NAME.get(dtype, f"tag{dtype}")


#: the most shapes ``describe_schema`` lists
SCHEMA_SHAPES_SHOWN = 8


def describe_schema(kind: str, tensors: Sequence[tuple[int, Sequence[int]]]) -> str:
    """A round's schema as an error shows it: ``kind`` (a ``RoundKind`` name) and each
    tensor's (wire dtype, shape): "MODEL round, 2 tensors f32 shapes [10], [3,2]", or,
    where the dtypes differ, "MODEL round, 2 tensors f32 [10], bf16 [3,2]"; at most
    ``SCHEMA_SHAPES_SHOWN`` shapes, then their count."""
    if not tensors:
        return f"{kind} round without tensors"
    dtypes = {dtype for dtype, _ in tensors}
    shown = tensors[:SCHEMA_SHAPES_SHOWN]
    one = len(dtypes) == 1
    items = ", ".join(("" if one else f"{dtype_name(dtype)} ")
                      + "[" + ",".join(map(str, shape)) + "]" for dtype, shape in shown)
    if len(tensors) > len(shown):
        items += f", ... ({len(tensors)} tensors)"
    what = f"{dtype_name(next(iter(dtypes)))} shapes " if one else ""
    return f"{kind} round, {plural(len(tensors), 'tensor')} {what}{items}"


def _as_bytes_view(data) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise FrameError("payload data must be a contiguous buffer")
        mv = mv.cast("B")
    return mv


@dataclass(eq=False)
class TensorPayload:
    """One tensor on the wire: dtype tag, shape, raw little-endian element bytes.

    ``data`` accepts any contiguous buffer (bytes, bytearray, numpy array,
    memoryview) and is held as a flat ``memoryview`` of unsigned bytes, without
    copying. Equality compares dtype, shape and bytes.
    """

    dtype: int
    shape: tuple[int, ...]
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(d) for d in self.shape)
        except TypeError:
            raise FrameError(f"payload shape must be a sequence of ints, got {self.shape!r}") from None
        for d, n in enumerate(shape):
            if n < 0 or n > _U32_MAX:
                raise FrameError(f"payload dim[{d}] = {n} doesn't fit in u32 (0 ..= {_U32_MAX})")
        if len(shape) > MAX_NDIM:
            raise FrameError(f"payload has {len(shape)} dims; the wire allows at most {MAX_NDIM}")
        self.shape = shape
        self.data = _as_bytes_view(self.data)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def expected_nbytes(self) -> int:
        """numel × element size of the declared dtype (FrameError on an unknown tag)."""
        return self.numel * elem_size(self.dtype)

    def check(self, index: int = 0) -> None:
        """Raise ``FrameError`` unless the byte count matches shape and dtype."""
        want = self.expected_nbytes()
        if self.nbytes != want:
            raise FrameError(
                f"tensor[{index}]: payload holds {self.nbytes} bytes but shape "
                f"{list(self.shape)} has numel {self.numel} x {elem_size(self.dtype)} bytes "
                f"({dtype_name(self.dtype)}) = expected {want} bytes"
            )

    def as_array(self, index: int = 0) -> np.ndarray:
        """The payload as a flat numpy view: float32 for f32, uint16 bits for bf16."""
        self.check(index)
        np_dtype = np.float32 if self.dtype == DTYPE_F32 else np.uint16
        return np.frombuffer(self.data, dtype=np_dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorPayload):
            return NotImplemented
        return self.dtype == other.dtype and self.shape == other.shape and self.data == other.data


@dataclass(eq=False)
class RoundFrame:
    """An ordered list of tensor payloads with the sender's realized-work mass.

    Rank -> reducer: ``weight`` is this contribution's mass wᵣ and the tensors carry
    wᵣ·Tᵣ. Reducer -> rank: ``weight`` is the accepted mass Σwᵣ and the tensors the
    consensus Σ(wᵣ·Tᵣ)/Σwᵣ; 0.0 means nothing was realized (keep local state).
    """

    tensors: list[TensorPayload] = field(default_factory=list)
    weight: float = 1.0
    kind: RoundKind = RoundKind.MODEL

    def __post_init__(self) -> None:
        self.tensors = list(self.tensors)
        self.kind = RoundKind.from_wire(int(self.kind))
        self.weight = float(self.weight)

    def payload_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoundFrame):
            return NotImplemented
        return (self.kind == other.kind and self.weight == other.weight
                and self.tensors == other.tensors)


# --- tensors <-> frames -----------------------------------------------------------

_SCRATCH_ELEMS = 4096
_SCRATCH = np.empty(_SCRATCH_ELEMS, np.float32)  # the kernels' API slot; not written


def _torch():
    import torch

    return torch


def torch_dtype_name(dt) -> str:
    """torch dtype -> flodl's capitalised name: torch.float64 -> "Float64"."""
    names = {
        "float64": "Float64", "float32": "Float32", "float16": "Float16 (Half)",
        "bfloat16": "BFloat16", "int64": "Int64", "int32": "Int32", "int16": "Int16",
        "int8": "Int8", "uint8": "UInt8", "bool": "Bool", "complex64": "ComplexFloat",
        "complex128": "ComplexDouble",
    }
    short = str(dt).replace("torch.", "")
    return names.get(short, short)


def tensor_array(t, dtype) -> np.ndarray:
    """A numpy array over the memory of ``t`` (a contiguous CPU tensor), its bytes read
    as ``dtype`` (``np.uint16`` for bfloat16 bits, ``np.uint8`` for raw bytes).

    Unlike ``Tensor.numpy()``, which marks the tensor's storage not resizable for good
    (a caller's ``t.resize_()`` after a collective raised, where gloo's does not), it
    leaves the tensor as it was. The array keeps the tensor alive; the tensor must not
    be resized while the array is in use."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return np.empty(0, dtype)
    if not t.is_contiguous():  # its bytes are not one run: a caller's mistake, said here
        raise ValueError(f"tensor_array needs a contiguous tensor, got stride {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    raw.tensor = t  # the array's base keeps the memory alive
    return np.frombuffer(raw, dtype)


def check_tensor_dtype(t, index: int, broadcast: bool = False):
    """FrameError unless ``t`` is a float32 or bfloat16 tensor (``broadcast``: the
    tensor of a broadcast, whose fix is a float32 view of its bytes, not a cast)."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise FrameError(f"tensor[{index}] is a {type(t).__name__}, not a torch.Tensor")
    if t.dtype in (torch.float32, torch.bfloat16):
        return
    name = f"tensor[{index}] dtype {torch_dtype_name(t.dtype)} ({t.dtype})"
    if broadcast:
        raise FrameError(
            f"{name} not supported: a broadcast carries Float32 / BFloat16 tensors. For "
            f"the exact bytes of any dtype, broadcast a float32 view of them, "
            f"t.view(torch.float32) (its last dimension's bytes a multiple of 4), or use "
            f"torch.distributed.broadcast on a \"flodl_shm\" process group, which takes "
            f"every dtype; .float() would round a Float64")
    raise FrameError(
        f"{name} not supported (only Float32 / BFloat16 tensors can be averaged); cast it "
        f"with .float() first")


def tensor_to_payload(t, dtype: int, index: int = 0, scale: float = 1.0) -> TensorPayload:
    """Encode one float32/bfloat16 tensor as a payload of wire dtype ``dtype``.

    ``scale`` (f32) is fused into the conversion: the result is bit-identical to
    encoding ``t.mul(scale)``.
    """
    torch = _torch()
    check_tensor_dtype(t, index)
    elem_size(dtype)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    shape = tuple(t.shape)
    n = t.numel()
    if t.dtype == torch.float32:
        src = tensor_array(t.reshape(-1), np.float32)
        if dtype == DTYPE_F32:
            out = np.empty(n, np.float32)
            if scale == 1.0:
                np.copyto(out, src)
            else:
                kernels.f32_scaled_copy(src, out, scale)
        else:
            out = np.empty(n, np.uint16)
            if scale == 1.0:
                kernels.f32_to_bf16(src, out)
            else:
                kernels.f32_to_bf16_scaled(src, out, scale, _SCRATCH)
    else:  # bfloat16
        bits = tensor_array(t.reshape(-1), np.uint16)
        if dtype == DTYPE_BF16:
            out = np.empty(n, np.uint16)
            if scale == 1.0:
                np.copyto(out, bits)
            else:
                kernels.bf16_scaled_copy(bits, out, scale, _SCRATCH)
        else:
            out = np.empty(n, np.float32)
            if scale == 1.0:
                kernels.bf16_to_f32(bits, out)
            else:  # t.mul(scale) rounds to bf16 before the upcast: so must we
                kernels.bf16_scaled_to_f32(bits, out, scale)
    return TensorPayload(dtype, shape, out)


def tensors_to_round_frame(tensors: Sequence, dtype: int = DTYPE_F32) -> RoundFrame:
    """Encode tensors into a ``MODEL`` frame of weight 1.0 on wire dtype ``dtype``."""
    return RoundFrame([tensor_to_payload(t, dtype, i) for i, t in enumerate(tensors)], 1.0,
                      RoundKind.MODEL)


def payload_to_tensor(p: TensorPayload, index: int = 0, out=None):
    """Decode one payload into a float32 tensor of its shape.

    With ``out`` (a contiguous float32 tensor of the payload's numel) the decode
    lands there (bf16 upcasts straight into it); otherwise a fresh tensor is made
    with exactly one copy of the bytes.
    """
    torch = _torch()
    src = p.as_array(index)
    if out is None:
        out = torch.empty(p.shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != p.numel or not out.is_contiguous():
        raise FrameError(
            f"tensor[{index}]: decode destination must be a contiguous float32 tensor of "
            f"numel {p.numel}, got {out.dtype} numel {out.numel()}"
        )
    dst = tensor_array(out.view(-1), np.float32)
    if p.dtype == DTYPE_F32:
        np.copyto(dst, src)
    else:
        kernels.bf16_to_f32(src, dst)
    return out.view(p.shape) if tuple(out.shape) != p.shape else out


def round_frame_to_tensors(frame: RoundFrame) -> list:
    """Decode every payload to a float32 CPU tensor (bf16 upcast exactly)."""
    return [payload_to_tensor(p, i) for i, p in enumerate(frame.tensors)]


def check_frame(frame: RoundFrame) -> None:
    """FrameError unless the frame is well-formed (count, kind, weight, byte counts).

    On the hot path of every frame round: the common case is a few comparisons, and
    the detailed checks (with their messages) run only for a frame that fails them."""
    tensors = frame.tensors
    if len(tensors) > MAX_ROUND_FRAME_TENSORS:
        raise FrameError(
            f"frame carries {len(tensors)} tensors; at most {MAX_ROUND_FRAME_TENSORS} "
            f"fit one frame"
        )
    if not 0.0 <= frame.weight < math.inf:  # also false for NaN
        raise FrameError(
            f"frame weight {frame.weight} is not a finite non-negative realized-work mass"
        )
    if int(frame.kind) not in _WIRE_KINDS:
        RoundKind.from_wire(int(frame.kind))  # raises, naming the byte
    for i, p in enumerate(tensors):
        try:
            size = _ELEM_SIZE[p.dtype]
        except (KeyError, TypeError):
            size = 0
        if not size or p.data.nbytes != math.prod(p.shape) * size:
            p.check(i)  # raises, naming the counts


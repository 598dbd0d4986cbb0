"""Copy tensor data into and out of shared memory by address, with conversion.

Going through ``tensor.detach().numpy()`` costs ~1-3 µs per tensor, which alone
would blow a 4 KiB round's budget; ``tensor.data_ptr()`` and ``numel()`` cost
~0.1 µs each. These kernels take the raw address of a contiguous CPU tensor
(validated by the caller: dtype, device, contiguity, numel) and build the array
view inside compiled code.

Encoders write one tensor's contribution into its wire slot with the scale fused
in (bit-identical to encoding ``t.mul(scale)``); decoders write a consensus slice
into a float32 tensor (bf16 upcast exactly, no intermediate buffer).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic, overload

from .codec import bf16_scaled_copy, bf16_to_f32, f32_scaled_copy, f32_to_bf16, f32_to_bf16_scaled
from .reduce import drift_pass


@intrinsic
def _voidptr(typingctx, addr):
    """int64 address -> void* (the caller guarantees it points at live memory)."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.voidptr(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return sig, codegen


@njit(inline="always")
def f32_at(addr, n):
    return carray(_voidptr(addr), (n,), np.float32)


@njit(inline="always")
def u16_at(addr, n):
    return carray(_voidptr(addr), (n,), np.uint16)


@njit(inline="always")
def u8_at(addr, n):
    return carray(_voidptr(addr), (n,), np.uint8)


@njit(inline="always")
def i64_at(addr, n):
    return carray(_voidptr(addr), (n,), np.int64)


@njit(cache=True, nogil=True)
def encode_f32_to_f32(addr, n, dst, scale):
    src = f32_at(addr, n)
    if scale == 1.0:
        for i in range(n):
            dst[i] = src[i]
    else:
        f32_scaled_copy(src, dst, scale)


@njit(cache=True, nogil=True)
def encode_f32_to_bf16(addr, n, dst, scale, scratch):
    src = f32_at(addr, n)
    if scale == 1.0:
        f32_to_bf16(src, dst)
    else:
        f32_to_bf16_scaled(src, dst, scale, scratch)


@njit(cache=True, nogil=True)
def encode_bf16_to_bf16(addr, n, dst, scale, scratch):
    src = u16_at(addr, n)
    if scale == 1.0:
        for i in range(n):
            dst[i] = src[i]
    else:
        bf16_scaled_copy(src, dst, scale, scratch)


@njit(cache=True, nogil=True)
def encode_bf16_to_f32(addr, n, dst, scale, scratch, scratch16):
    """bf16 tensor on an f32 wire: scale with one bf16 rounding (like ``t.mul(s)`` on a
    bf16 tensor), then upcast exactly."""
    src = u16_at(addr, n)
    if scale == 1.0:
        bf16_to_f32(src, dst)
        return
    step = scratch16.shape[0]
    for c0 in range(0, n, step):
        c1 = min(c0 + step, n)
        part = scratch16[:c1 - c0]
        bf16_scaled_copy(src[c0:c1], part, scale, scratch)
        bf16_to_f32(part, dst[c0:c1])


@njit(cache=True, nogil=True)
def decode_f32_into(src, addr):
    n = src.shape[0]
    dst = f32_at(addr, n)
    for i in range(n):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def decode_bf16_into(src, addr):
    n = src.shape[0]
    bf16_to_f32(src, f32_at(addr, n))


def _widen_into(src, dst):
    """``dst[:] = src`` widened to float32 (compiled per source dtype, below)."""


@overload(_widen_into)
def _widen_into_impl(src, dst):
    if src.dtype == types.uint16:
        return lambda src, dst: bf16_to_f32(src, dst)

    def copy(src, dst):
        for k in range(src.shape[0]):
            dst[k] = src[k]
    return copy


@njit(cache=True, nogil=True)
def decode_scatter(src, addrs, ntensors, sums):
    """Write the consecutive segments of a consensus (float32, or uint16 bf16 bits widened
    exactly) into the float32 tensors at ``addrs`` (laid out as ``eager_encode_round``'s:
    addresses, element counts, then 1 for a bfloat16 tensor); bfloat16 tensors are
    skipped for the caller. Returns how many were skipped.

    With a float64 ``sums`` of ``[ntensors, 3]`` (``[0, 3]``: none), also adds each float32
    tensor ``i``'s ``(Σ old², Σ new², Σ (old - new)²)`` to row ``i``, taken in the pass
    that writes the consensus (new) over the tensor's values (old): a replica's drift
    without a snapshot or a second pass (``reduce.drift_pass``)."""
    off = 0
    skipped = 0
    for i in range(ntensors):
        n = addrs[ntensors + i]
        if addrs[2 * ntensors + i]:
            skipped += 1
        else:
            dst = f32_at(addrs[i], n)
            if sums.shape[0]:
                drift_pass(dst, src[off:off + n], sums[i], True)
            else:
                _widen_into(src[off:off + n], dst)
        off += n
    return skipped


@njit(cache=True, nogil=True)
def overlapping_spans(starts, numels):
    """Indices, ascending, of the float32 spans (``starts[i]`` bytes, ``numels[i]``
    elements) that overlap another span. Sorted by start, a span overlaps an earlier one
    when it starts before the furthest end so far, and a later one when it ends after the
    next start."""
    n = starts.shape[0]
    order = np.argsort(starts, kind="mergesort")
    hit = np.zeros(n, np.bool_)
    furthest = starts[order[0]] + 4 * numels[order[0]] if n else 0
    count = 0
    for j in range(1, n):
        a, b = order[j - 1], order[j]
        if starts[b] < furthest:
            hit[b] = True
        if starts[a] + 4 * numels[a] > starts[b]:
            hit[a] = True
        furthest = max(furthest, starts[b] + 4 * numels[b])
    for i in range(n):
        count += hit[i]
    out = np.empty(count, np.int64)
    k = 0
    for i in range(n):
        if hit[i]:
            out[k] = i
            k += 1
    return out


def warm_up() -> None:
    buf = np.zeros(8, np.float32)
    b16 = np.zeros(8, np.uint16)
    s = np.zeros(4, np.float32)
    s16 = np.zeros(4, np.uint16)
    a = buf.ctypes.data
    a16 = b16.ctypes.data
    for scale in (1.0, 0.5):
        encode_f32_to_f32(a, 8, np.zeros(8, np.float32), scale)
        encode_f32_to_bf16(a, 8, np.zeros(8, np.uint16), scale, s)
        encode_bf16_to_bf16(a16, 8, np.zeros(8, np.uint16), scale, s)
        encode_bf16_to_f32(a16, 8, np.zeros(8, np.float32), scale, s, s16)
    decode_f32_into(np.zeros(8, np.float32), a)
    decode_bf16_into(np.zeros(8, np.uint16), a)
    addrs = np.array([a, 8, 0], np.int64)
    overlapping_spans(addrs[:1], addrs[1:2])
    for sums in (np.zeros((0, 3)), np.zeros((1, 3))):
        decode_scatter(np.zeros(8, np.float32), addrs, 1, sums)
        decode_scatter(np.zeros(8, np.uint16), addrs, 1, sums)

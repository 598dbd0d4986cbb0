"""bf16 <-> f32 codec and fused scaling, as numba kernels.

Rules (flodl 0.7.0's codec; docs/wire.md):

- f32 -> bf16 rounds to nearest, ties to even, on the raw bits:
  ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` in 32-bit unsigned arithmetic.
  This equals torch's own cast for every non-NaN input (overflow rounds to ±inf
  naturally). A NaN becomes a *quiet* NaN that keeps its sign,
  ``(bits >> 16) | 0x0040``, so it can never round into ±inf.
- bf16 -> f32 is exact: ``bits << 16``.
- A scaled encode multiplies in f32 first and rounds once:
  ``RNE(f32(x) * factor)``, bit-identical to ``tensor.mul(factor)`` in torch.

bf16 data is handled as ``uint16`` arrays (raw bits); f32 data as ``float32``.
Every kernel writes into arrays the caller passes in (no allocation), runs on the
calling thread only (parallelism comes from ranks, not threads) and releases the
GIL (``nogil``) so a relay or writer thread can run beside it.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._bits import bits_f32, f32_bits

_EXP_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_ROUND_BIAS = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_QUIET = np.uint32(0x0040)
_SIXTEEN = np.uint32(16)

# Width matters: numba types uint32 arithmetic as 64-bit, and 64-bit lanes halve
# the SIMD width of every loop below (measured 2.5x slower in cache). Each
# intermediate is therefore truncated back to uint32 explicitly, which lets LLVM
# keep the whole round-to-nearest-even in 32-bit lanes (the wraparound of the
# 32-bit add can only happen for NaN inputs, which take the other branch).


# Note for editors: reduce.py compiles these helpers into its own
# cached kernels, and numba invalidates a cache entry only when the kernel's OWN
# source file changes. After editing a helper here, touch reduce.py (or delete
# the numba cache dir) or those kernels keep the old machine code.


@njit(inline="always")
def bf16_bits_rne(b):
    """Round the f32 bit pattern ``b`` (uint32) to bf16 bits (as uint32)."""
    rounded = np.uint32(np.uint32(b + _ROUND_BIAS) + ((b >> _SIXTEEN) & _ONE)) >> _SIXTEEN
    quiet = np.uint32((b >> _SIXTEEN) | _QUIET)  # NaN: quiet it, keep the sign
    return quiet if np.uint32(b & _EXP_MASK) > _INF_BITS else np.uint32(rounded)


@njit(inline="always")
def to_bf16(x):
    """float32 scalar -> bf16 bits (uint16), RNE with the NaN rule above."""
    return np.uint16(bf16_bits_rne(f32_bits(x)))


@njit(inline="always")
def from_bf16(h):
    """bf16 bits (uint16) -> the float32 it denotes, exactly."""
    return bits_f32(np.uint32(np.uint32(h) << _SIXTEEN))


@njit(inline="always")
def _same_buffer(src, dst):
    """True when src and dst are the same memory (an in-place call).

    Such a call must not run the two-array loop: LLVM guards its vector body with
    a runtime "src and dst do not overlap" check, an array aliased with itself
    fails it, and the whole call falls back to scalar code (measured 4-8x
    slower). The one-array loop has nothing to check.
    """
    return (src.ctypes.data == dst.ctypes.data and src.shape[0] == dst.shape[0]
            and src.strides[0] == dst.strides[0])


@njit(cache=True, nogil=True)
def f32_to_bf16(src, dst):
    """``dst[i] = bf16(src[i])`` with RNE; src float32, dst uint16, same length."""
    for i in range(src.shape[0]):
        dst[i] = to_bf16(src[i])


@njit(cache=True, nogil=True)
def bf16_to_f32(src, dst):
    """``dst[i] = f32(src[i])`` exactly; src uint16, dst float32, same length."""
    for i in range(src.shape[0]):
        dst[i] = from_bf16(src[i])


@njit(cache=True, nogil=True)
def f32_scaled_copy(src, dst, factor):
    """``dst[i] = src[i] * factor`` in f32 (factor is cast to f32 first).

    ``src`` and ``dst`` may be the same array (in-place scaling).
    """
    f = np.float32(factor)
    if _same_buffer(src, dst):
        for i in range(dst.shape[0]):
            dst[i] = dst[i] * f
        return
    for i in range(src.shape[0]):
        dst[i] = src[i] * f


@njit(cache=True, nogil=True)
def f32_to_bf16_scaled(src, dst, factor, scratch):
    """``dst[i] = RNE(src[i] * f32(factor))``: one rounding from f32 to bf16.

    ``scratch`` is accepted for signature compatibility and not used (the
    product's bits are taken with a register bit-cast, not staged in memory).
    """
    f = np.float32(factor)
    for i in range(src.shape[0]):
        dst[i] = to_bf16(src[i] * f)


@njit(cache=True, nogil=True)
def bf16_scaled_copy(src, dst, factor, scratch):
    """``dst[i] = RNE(f32(src[i]) * f32(factor))`` on uint16 bf16 arrays.

    ``src`` and ``dst`` may be the same array (in-place scaling). ``scratch`` is
    accepted for signature compatibility and not used.
    """
    f = np.float32(factor)
    if _same_buffer(src, dst):
        for i in range(dst.shape[0]):
            dst[i] = to_bf16(from_bf16(dst[i]) * f)
        return
    for i in range(src.shape[0]):
        dst[i] = to_bf16(from_bf16(src[i]) * f)


@njit(cache=True, nogil=True)
def bf16_scaled_to_f32(src, dst, factor):
    """``dst[i] = f32(RNE(f32(src[i]) * f32(factor)))``: a bf16 tensor scaled in
    bf16 (exactly what ``t.mul(factor)`` gives on a bf16 tensor), then upcast.

    src uint16 bf16 bits, dst float32.
    """
    f = np.float32(factor)
    for i in range(src.shape[0]):
        dst[i] = from_bf16(to_bf16(from_bf16(src[i]) * f))


"""bf16 <-> f32 codec and fused scaling, as numba kernels.

Rules (flodl 0.7.0, ``notes/flodl-spec.md`` §6):

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

_EXP_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_ROUND_BIAS = np.uint32(0x7FFF)
_ONE = np.uint32(1)
_QUIET = np.uint32(0x0040)
_SIXTEEN = np.uint32(16)


@njit(inline="always")
def bf16_bits_rne(b):
    """Round the f32 bit pattern ``b`` (uint32) to bf16 bits (as uint32)."""
    if (b & _EXP_MASK) > _INF_BITS:  # NaN: quiet it, keep the sign
        return (b >> _SIXTEEN) | _QUIET
    return (b + _ROUND_BIAS + ((b >> _SIXTEEN) & _ONE)) >> _SIXTEEN


@njit(cache=True, nogil=True)
def f32_to_bf16(src, dst):
    """``dst[i] = bf16(src[i])`` with RNE; src float32, dst uint16, same length."""
    bits = src.view(np.uint32)
    for i in range(src.shape[0]):
        dst[i] = np.uint16(bf16_bits_rne(bits[i]))


@njit(cache=True, nogil=True)
def bf16_to_f32(src, dst):
    """``dst[i] = f32(src[i])`` exactly; src uint16, dst float32, same length."""
    out = dst.view(np.uint32)
    for i in range(src.shape[0]):
        out[i] = np.uint32(src[i]) << _SIXTEEN


@njit(cache=True, nogil=True)
def f32_scaled_copy(src, dst, factor):
    """``dst[i] = src[i] * factor`` in f32 (factor is cast to f32 first)."""
    f = np.float32(factor)
    for i in range(src.shape[0]):
        dst[i] = src[i] * f


@njit(cache=True, nogil=True)
def f32_to_bf16_scaled(src, dst, factor, scratch):
    """``dst[i] = RNE(src[i] * f32(factor))``: one rounding from f32 to bf16.

    ``scratch`` is a small float32 work array (any length >= 1); the product is
    staged there so its bits can be rounded without a scalar bit-cast.
    """
    f = np.float32(factor)
    ch = scratch.shape[0]
    sbits = scratch.view(np.uint32)
    n = src.shape[0]
    for c0 in range(0, n, ch):
        m = min(ch, n - c0)
        sc = src[c0 : c0 + m]
        dc = dst[c0 : c0 + m]
        for i in range(m):
            scratch[i] = sc[i] * f
        for i in range(m):
            dc[i] = np.uint16(bf16_bits_rne(sbits[i]))


@njit(cache=True, nogil=True)
def bf16_scaled_copy(src, dst, factor, scratch):
    """``dst[i] = RNE(f32(src[i]) * f32(factor))`` on uint16 bf16 arrays.

    ``src`` and ``dst`` may be the same array (in-place scaling).
    """
    f = np.float32(factor)
    ch = scratch.shape[0]
    sbits = scratch.view(np.uint32)
    n = src.shape[0]
    for c0 in range(0, n, ch):
        m = min(ch, n - c0)
        sc = src[c0 : c0 + m]
        dc = dst[c0 : c0 + m]
        for i in range(m):
            sbits[i] = np.uint32(sc[i]) << _SIXTEEN
        for i in range(m):
            scratch[i] = scratch[i] * f
        for i in range(m):
            dc[i] = np.uint16(bf16_bits_rne(sbits[i]))

"""Weighted-sum kernels: accumulate, finalize, and the engine's multi-source reduce.

All arithmetic is f32 (bf16 inputs are widened exactly, bf16 outputs are rounded
once, RNE, NaN quieted with its sign). Sums run in a fixed order - the order of
the sources the caller passes - so every process that reduces the same inputs
gets the same bits.

Kernel shape matters more than anything here (``notes/perf-probe.md``): a loop
that walks ranks in its *inner* loop does not vectorise and runs ~9x slower than
``np.add``. So the multi-source reduce walks the slice in L1-sized chunks and,
per chunk, streams one whole source at a time through a contiguous f32 scratch:
every inner loop is a plain unit-stride loop LLVM vectorises, and the scratch
stays hot in L1 while the sources stream from memory once.

Callers pass every output and scratch array in; nothing allocates.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .codec import bf16_bits_rne

_SIXTEEN = np.uint32(16)


@njit(cache=True, nogil=True)
def accumulate_f32(acc, src, w):
    """``acc[i] += f32(w) * src[i]``; acc and src float32."""
    f = np.float32(w)
    for i in range(acc.shape[0]):
        acc[i] += f * src[i]


@njit(cache=True, nogil=True)
def accumulate_bf16(acc, src, w, scratch):
    """``acc[i] += f32(w) * f32(src[i])``; acc float32, src uint16 bf16 bits."""
    f = np.float32(w)
    ch = scratch.shape[0]
    sbits = scratch.view(np.uint32)
    n = acc.shape[0]
    for c0 in range(0, n, ch):
        m = min(ch, n - c0)
        sc = src[c0 : c0 + m]
        ac = acc[c0 : c0 + m]
        for i in range(m):
            sbits[i] = np.uint32(sc[i]) << _SIXTEEN
        for i in range(m):
            ac[i] += f * scratch[i]


@njit(cache=True, nogil=True)
def finalize_f32(acc, out, inv):
    """``out[i] = acc[i] * f32(inv)``; out float32 (may alias acc)."""
    f = np.float32(inv)
    for i in range(acc.shape[0]):
        out[i] = acc[i] * f


@njit(cache=True, nogil=True)
def finalize_bf16(acc, out, inv, scratch):
    """``out[i] = RNE(acc[i] * f32(inv))``; acc float32, out uint16 bf16 bits."""
    f = np.float32(inv)
    ch = scratch.shape[0]
    sbits = scratch.view(np.uint32)
    n = acc.shape[0]
    for c0 in range(0, n, ch):
        m = min(ch, n - c0)
        ac = acc[c0 : c0 + m]
        oc = out[c0 : c0 + m]
        for i in range(m):
            scratch[i] = ac[i] * f
        for i in range(m):
            oc[i] = np.uint16(bf16_bits_rne(sbits[i]))


# --- the engine's multi-source reduce ---------------------------------------------
#
# ``srcs`` is a tuple of 1-D arrays (one per accepted contribution, in rank order);
# ``[start, stop)`` is the element range this call reduces; ``inv`` the f32
# reciprocal of the accepted mass (1.0 for plain sums). The sum is
# ((s0 + s1) + s2) + ... in f32, then one multiply by inv.
#
# Every inner loop indexes a freshly sliced array from 0: numba's negative-index
# wraparound check on ``a[start + i]`` stops LLVM from vectorising (measured 5x
# slower), while ``a[start:stop][i]`` with ``i`` in ``range(m)`` vectorises.


@njit(cache=True, nogil=True)
def reduce_f32(srcs, out, start, stop, inv, acc):
    """f32 sources -> f32 ``out[start:stop] = (sum of srcs) * inv``."""
    f = np.float32(inv)
    nsrc = len(srcs)
    ch = acc.shape[0]
    for c0 in range(start, stop, ch):
        c1 = min(c0 + ch, stop)
        m = c1 - c0
        o = out[c0:c1]
        s0 = srcs[0][c0:c1]
        if nsrc == 1:
            for i in range(m):
                o[i] = s0[i] * f
            continue
        s1 = srcs[1][c0:c1]
        if nsrc == 2:
            for i in range(m):
                o[i] = (s0[i] + s1[i]) * f
            continue
        for i in range(m):
            acc[i] = s0[i] + s1[i]
        for k in range(2, nsrc - 1):
            sk = srcs[k][c0:c1]
            for i in range(m):
                acc[i] += sk[i]
        sl = srcs[nsrc - 1][c0:c1]
        for i in range(m):
            o[i] = (acc[i] + sl[i]) * f


@njit(cache=True, nogil=True)
def _sum_bf16_chunk(srcs, c0, c1, acc, tmp):
    """acc[:c1-c0] = sum over srcs of f32(src[c0:c1]), in source order."""
    m = c1 - c0
    tbits = tmp.view(np.uint32)
    abits = acc.view(np.uint32)
    s0 = srcs[0][c0:c1]
    for i in range(m):
        abits[i] = np.uint32(s0[i]) << _SIXTEEN
    for k in range(1, len(srcs)):
        sk = srcs[k][c0:c1]
        for i in range(m):
            tbits[i] = np.uint32(sk[i]) << _SIXTEEN
        for i in range(m):
            acc[i] += tmp[i]


@njit(cache=True, nogil=True)
def reduce_bf16(srcs, out, start, stop, inv, acc, tmp):
    """bf16 sources -> bf16 ``out[start:stop] = RNE((sum of f32(srcs)) * inv)``."""
    f = np.float32(inv)
    ch = acc.shape[0]
    abits = acc.view(np.uint32)
    for c0 in range(start, stop, ch):
        c1 = min(c0 + ch, stop)
        m = c1 - c0
        _sum_bf16_chunk(srcs, c0, c1, acc, tmp)
        for i in range(m):
            acc[i] = acc[i] * f
        o = out[c0:c1]
        for i in range(m):
            o[i] = np.uint16(bf16_bits_rne(abits[i]))


@njit(cache=True, nogil=True)
def reduce_bf16_to_f32(srcs, out, start, stop, inv, acc, tmp):
    """bf16 sources -> f32 ``out[start:stop] = (sum of f32(srcs)) * inv`` (no rounding)."""
    f = np.float32(inv)
    ch = acc.shape[0]
    for c0 in range(start, stop, ch):
        c1 = min(c0 + ch, stop)
        m = c1 - c0
        _sum_bf16_chunk(srcs, c0, c1, acc, tmp)
        o = out[c0:c1]
        for i in range(m):
            o[i] = acc[i] * f

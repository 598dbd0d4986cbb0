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
from numba import njit, types
from numba.extending import overload

from .codec import from_bf16, to_bf16


# ``load``/``store`` read and write one element of an f32 array (float32) or a
# bf16 one (uint16 bits) as an f32 value; numba picks the body from the array's
# dtype at compile time, so one reduce loop serves every wire dtype pair.


def load(a, i):  # pragma: no cover - replaced by the overload inside numba
    """``a[i]`` as float32 (bf16 bits widened exactly)."""
    raise NotImplementedError("numba-only helper")


def store(a, i, x):  # pragma: no cover - replaced by the overload inside numba
    """``a[i] = x`` (rounded RNE when ``a`` holds bf16 bits)."""
    raise NotImplementedError("numba-only helper")


@overload(load)
def _load_impl(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: from_bf16(a[i])
    return lambda a, i: a[i]


@overload(store)
def _store_impl(a, i, x):
    if a.dtype == types.uint16:
        def impl(a, i, x):
            a[i] = to_bf16(x)
    else:
        def impl(a, i, x):
            a[i] = x
    return impl


@njit(cache=True, nogil=True)
def accumulate_f32(acc, src, w):
    """``acc[i] += f32(w) * src[i]``; acc and src float32."""
    f = np.float32(w)
    for i in range(acc.shape[0]):
        acc[i] += f * src[i]


@njit(cache=True, nogil=True)
def accumulate_bf16(acc, src, w, scratch):
    """``acc[i] += f32(w) * f32(src[i])``; acc float32, src uint16 bf16 bits.

    ``scratch`` is accepted for signature compatibility and not used.
    """
    f = np.float32(w)
    for i in range(acc.shape[0]):
        acc[i] += f * from_bf16(src[i])


@njit(cache=True, nogil=True)
def finalize_f32(acc, out, inv):
    """``out[i] = acc[i] * f32(inv)``; out float32 (may alias acc)."""
    f = np.float32(inv)
    for i in range(acc.shape[0]):
        out[i] = acc[i] * f


@njit(cache=True, nogil=True)
def finalize_bf16(acc, out, inv, scratch):
    """``out[i] = RNE(acc[i] * f32(inv))``; acc float32, out uint16 bf16 bits.

    ``scratch`` is accepted for signature compatibility and not used.
    """
    f = np.float32(inv)
    for i in range(acc.shape[0]):
        out[i] = to_bf16(acc[i] * f)


# --- the engine's multi-source reduce ---------------------------------------------
#
# ``srcs`` is a tuple of 1-D arrays (one per accepted contribution, in rank order);
# ``[start, stop)`` is the element range this call reduces; ``inv`` the f32
# reciprocal of the accepted mass (1.0 for plain sums). The sum is
# ((s0 + s1) + s2) + ... in f32, then one multiply by inv, then (bf16 output) one
# rounding. ``acc`` is an f32 scratch of any length >= 1 (L1-sized is best); the
# range is walked in chunks of its length and, per chunk, one source at a time.
#
# Every inner loop indexes a freshly sliced array from 0: numba's negative-index
# wraparound check on ``a[start + i]`` stops LLVM from vectorising (measured 5x
# slower), while ``a[start:stop][i]`` with ``i`` in ``range(m)`` vectorises.


@njit(nogil=True)
def _reduce(srcs, out, start, stop, inv, acc):
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
                store(o, i, load(s0, i) * f)
            continue
        s1 = srcs[1][c0:c1]
        if nsrc == 2:
            for i in range(m):
                store(o, i, (load(s0, i) + load(s1, i)) * f)
            continue
        for i in range(m):
            acc[i] = load(s0, i) + load(s1, i)
        for k in range(2, nsrc - 1):
            sk = srcs[k][c0:c1]
            for i in range(m):
                acc[i] += load(sk, i)
        sl = srcs[nsrc - 1][c0:c1]
        for i in range(m):
            store(o, i, (acc[i] + load(sl, i)) * f)


@njit(cache=True, nogil=True)
def reduce_f32(srcs, out, start, stop, inv, acc):
    """f32 sources -> f32 ``out[start:stop] = (sum of srcs) * inv``."""
    _reduce(srcs, out, start, stop, inv, acc)


@njit(cache=True, nogil=True)
def reduce_bf16(srcs, out, start, stop, inv, acc, tmp):
    """bf16 sources -> bf16 ``out[start:stop] = RNE((sum of f32(srcs)) * inv)``.

    ``tmp`` is accepted for signature compatibility and not used.
    """
    _reduce(srcs, out, start, stop, inv, acc)


@njit(cache=True, nogil=True)
def reduce_bf16_to_f32(srcs, out, start, stop, inv, acc, tmp):
    """bf16 sources -> f32 ``out[start:stop] = (sum of f32(srcs)) * inv`` (no rounding).

    ``tmp`` is accepted for signature compatibility and not used.
    """
    _reduce(srcs, out, start, stop, inv, acc)

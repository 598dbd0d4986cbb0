"""Weighted-sum kernels: accumulate, finalize, and the engine's multi-source reduce.

All arithmetic is f32 (bf16 inputs are widened exactly, bf16 outputs are rounded
once, RNE, NaN quieted with its sign). Sums run in a fixed order - the order of
the sources the caller passes - so every process that reduces the same inputs
gets the same bits.

Kernel shape matters more than anything here (BENCHMARKS.md, "Kernels"): a loop
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


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def drift_pass(old, new, out, write):
    """``out += (Σ old², Σ new², Σ (old - new)²)`` in f64, in one pass: the sums of a
    replica's drift ``||old - new|| / ||new||``; with ``write``, ``old[:] = new`` in the
    same pass (each element read once and written once: the write-back of a consensus).
    ``old`` float32; ``new`` float32 or bf16 bits (uint16, widened exactly); ``out``
    float64[3]. The sums may be reassociated (vectorised): a metric, not a reduce whose
    bits must match across ranks."""
    a = 0.0
    b = 0.0
    c = 0.0
    for i in range(old.shape[0]):
        y = load(new, i)
        x = np.float64(old[i])
        if write:  # (loop-invariant: compiled as two loops)
            old[i] = y
        z = np.float64(y)
        d = x - z
        a += x * x
        b += z * z
        c += d * d
    out[0] += a
    out[1] += b
    out[2] += c


@njit(cache=True, nogil=True)
def drift_sums(pre, post, out):
    """``out += (Σ pre², Σ post², Σ (pre - post)²)``: ``drift_pass`` without the write."""
    drift_pass(pre, post, out, False)


# --- the engine's multi-source reduce ---------------------------------------------
#
# ``srcs`` is a tuple of 1-D arrays (one per accepted contribution, in rank order);
# ``[start, stop)`` is the element range this call reduces; ``inv`` the f32
# reciprocal of the accepted mass (1.0 for plain sums). The sum is
# ((s0 + s1) + s2) + ... in f32, then one multiply by inv, then (bf16 output) one
# rounding. ``acc`` is an f32 scratch of any length >= 1 (L1-sized is best): the
# range is walked in chunks of its length.
#
# Shape, measured on 2-core EPYC (BENCHMARKS.md, "Kernels"):
# - up to four sources are summed in ONE loop (o = (((a + b) + c) + d) * inv):
#   four input streams in flight at once keep the memory system busy, where one
#   pass per source over a chunk ran 1.5-2x slower at 64 MiB;
# - beyond four, the first four go to ``acc``, later sources are folded in
#   three at a time, and the last one to three are summed with ``acc`` straight
#   into the output;
# - every inner loop indexes a freshly sliced array from 0: numba's negative-index
#   wraparound check on ``a[start + i]`` stops LLVM from vectorising (5x slower).


@njit(nogil=True, cache=True)
def _emit1(o, a, f):
    for i in range(o.shape[0]):
        store(o, i, load(a, i) * f)


@njit(nogil=True, cache=True)
def _emit2(o, a, b, f):
    for i in range(o.shape[0]):
        store(o, i, (load(a, i) + load(b, i)) * f)


@njit(nogil=True, cache=True)
def _emit3(o, a, b, c, f):
    for i in range(o.shape[0]):
        store(o, i, ((load(a, i) + load(b, i)) + load(c, i)) * f)


@njit(nogil=True, cache=True)
def _emit4(o, a, b, c, d, f):
    for i in range(o.shape[0]):
        store(o, i, (((load(a, i) + load(b, i)) + load(c, i)) + load(d, i)) * f)


@njit(nogil=True, cache=True)
def _fold3(acc, a, b, c):
    for i in range(acc.shape[0]):
        acc[i] = ((acc[i] + load(a, i)) + load(b, i)) + load(c, i)


@njit(nogil=True, cache=True)
def _reduce(srcs, out, start, stop, inv, acc):
    f = np.float32(inv)
    one = np.float32(1.0)
    nsrc = len(srcs)
    ch = acc.shape[0]
    for c0 in range(start, stop, ch):
        c1 = min(c0 + ch, stop)
        o = out[c0:c1]
        if nsrc == 1:
            _emit1(o, srcs[0][c0:c1], f)
        elif nsrc == 2:
            _emit2(o, srcs[0][c0:c1], srcs[1][c0:c1], f)
        elif nsrc == 3:
            _emit3(o, srcs[0][c0:c1], srcs[1][c0:c1], srcs[2][c0:c1], f)
        elif nsrc == 4:
            _emit4(o, srcs[0][c0:c1], srcs[1][c0:c1], srcs[2][c0:c1], srcs[3][c0:c1], f)
        else:
            a = acc[: c1 - c0]
            _emit4(a, srcs[0][c0:c1], srcs[1][c0:c1], srcs[2][c0:c1], srcs[3][c0:c1], one)
            k = 4
            while nsrc - k > 3:
                _fold3(a, srcs[k][c0:c1], srcs[k + 1][c0:c1], srcs[k + 2][c0:c1])
                k += 3
            left = nsrc - k
            if left == 1:
                _emit2(o, a, srcs[k][c0:c1], f)
            elif left == 2:
                _emit3(o, a, srcs[k][c0:c1], srcs[k + 1][c0:c1], f)
            else:
                _emit4(o, a, srcs[k][c0:c1], srcs[k + 1][c0:c1], srcs[k + 2][c0:c1], f)


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

"""The compiled half of ``protocol.py``: one call per protocol step.

A 4 KiB round must finish in a few microseconds; every Python-level numpy access
costs ~100 ns and every call ~0.3 µs, so each step of the round state machine is
one fused kernel here: write the round header and publish the arrival; spin on
the arrivals and, once complete, validate every accepted header against the first
and sum the accepted mass; reduce the eager slots.

Word offsets come from ``flodl_shm/kernels/control_block.py``, the one definition of the control block.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .control_block import (DEAD_EXITED, FLAG_ELIDED, FLAGS_AGREED, G_ABORT, G_DOORBELL,
                     G_SLEEPERS, GLOBAL_WORDS, H_DTYPE, H_FLAGS, H_KIND, H_NBYTES, H_NELEM,
                     H_NTENSORS, H_ROUND, H_SCHEMA_HASH, H_SCHEMA_WORDS, H_WEIGHT, HDR_WORDS,
                     R_ARRIVED, R_DEAD, R_HDR, RANK_WORDS)
from .atomics import cpu_relax, fetch_add, load_acquire, store_release
from .codec import bf16_bits_rne, bf16_to_f32
# result codes of arrive() and the fused rounds (>= 0: the first rank still missing);
# re-exported so the engine reads them as RK.OK, RK.WAKE, ...
from .codes import ABORT, EXITED, MISMATCH, OK, OUT_OF_STEP, WAKE  # noqa: F401
from .tensorio import (encode_bf16_to_bf16, encode_bf16_to_f32, encode_f32_to_bf16,
                       encode_f32_to_f32, f32_at)

# info slots filled by arrive()
I_ACCEPTED = 0   # bitmask of accepted ranks (world <= 63)
I_CONTRIB = 1    # bitmask of accepted, non-elided ranks
I_REF = 2        # first accepted rank (the reference header)
I_CULPRIT = 3    # the rank that disagreed / exited / is out of step
I_KIND = 4       # the reference header's fields, for the caller's RoundView
I_FLAGS = 5
I_DTYPE = 6
I_NTENSORS = 7
I_NBYTES = 8
I_NELEM = 9
I_NWORDS = 10
I_WORDS = 11


@njit(inline="always")
def _hdr(r, rnd):
    return GLOBAL_WORDS + r * RANK_WORDS + R_HDR + (rnd & 1) * HDR_WORDS


@njit(cache=True, nogil=True)
def publish_round(ctl, ctl_f64, ctl32, rank, rnd, kind, flags, dtype, weight, ntensors,
                  nbytes, nelem, shash, nwords):
    """Write rank's header for ``rnd`` and publish its arrival; returns sleepers."""
    b = _hdr(rank, rnd)
    ctl[b + H_KIND] = kind
    ctl[b + H_FLAGS] = flags
    ctl[b + H_DTYPE] = dtype
    ctl_f64[b + H_WEIGHT] = weight
    ctl[b + H_NTENSORS] = ntensors
    ctl[b + H_NBYTES] = nbytes
    ctl[b + H_NELEM] = nelem
    ctl[b + H_SCHEMA_HASH] = shash
    ctl[b + H_SCHEMA_WORDS] = nwords
    ctl[b + H_ROUND] = rnd
    store_release(ctl, GLOBAL_WORDS + rank * RANK_WORDS + R_ARRIVED, rnd)
    fetch_add(ctl32, 2 * G_DOORBELL, 1)
    return load_acquire(ctl, G_SLEEPERS)


@njit(cache=True, nogil=True)
def _validate(ctl, ctl_f64, world, rnd, me, info, mass):
    accepted = 0
    contrib = 0
    ref = -1  # no accepted rank yet
    total = 0.0
    for r in range(world):
        base = GLOBAL_WORDS + r * RANK_WORDS
        if load_acquire(ctl, base + R_ARRIVED) >= rnd:
            accepted |= 1 << r
            b = _hdr(r, rnd)
            if ref < 0:
                ref = r
            if not (ctl[b + H_FLAGS] & FLAG_ELIDED):
                contrib |= 1 << r
            total += ctl_f64[b + H_WEIGHT]
        elif r != me and load_acquire(ctl, base + R_DEAD) == DEAD_EXITED:
            info[I_CULPRIT] = r
            return EXITED
    info[I_ACCEPTED] = accepted
    info[I_CONTRIB] = contrib
    info[I_REF] = ref
    mass[0] = total
    if ref < 0:
        return OUT_OF_STEP
    rb = _hdr(ref, rnd)
    if ctl[rb + H_ROUND] != rnd:
        info[I_CULPRIT] = ref
        return OUT_OF_STEP
    info[I_KIND] = ctl[rb + H_KIND]
    info[I_FLAGS] = ctl[rb + H_FLAGS]
    info[I_DTYPE] = ctl[rb + H_DTYPE]
    info[I_NTENSORS] = ctl[rb + H_NTENSORS]
    info[I_NBYTES] = ctl[rb + H_NBYTES]
    info[I_NELEM] = ctl[rb + H_NELEM]
    info[I_NWORDS] = ctl[rb + H_SCHEMA_WORDS]
    for r in range(ref + 1, world):
        if not (accepted >> r) & 1:
            continue
        b = _hdr(r, rnd)
        if (ctl[b + H_ROUND] != rnd or ctl[b + H_KIND] != ctl[rb + H_KIND]
                or ctl[b + H_DTYPE] != ctl[rb + H_DTYPE]
                or ctl[b + H_NTENSORS] != ctl[rb + H_NTENSORS]
                or ctl[b + H_NBYTES] != ctl[rb + H_NBYTES]
                or ctl[b + H_NELEM] != ctl[rb + H_NELEM]
                or ctl[b + H_SCHEMA_HASH] != ctl[rb + H_SCHEMA_HASH]
                or ctl[b + H_SCHEMA_WORDS] != ctl[rb + H_SCHEMA_WORDS]
                or (ctl[b + H_FLAGS] & FLAGS_AGREED) != (ctl[rb + H_FLAGS] & FLAGS_AGREED)):
            info[I_CULPRIT] = r
            if ctl[b + H_ROUND] != rnd:
                return OUT_OF_STEP
            return MISMATCH
    return OK


@njit(cache=True, nogil=True)
def arrive(ctl, ctl_f64, world, rnd, me, iters, info, mass):
    """Spin until every rank arrived at ``rnd`` or is dead, then validate.

    Returns OK (info/mass filled), ABORT, MISMATCH, EXITED, OUT_OF_STEP, or the
    first missing rank (>= 0) when ``iters`` ran out.
    """
    it = 0
    while True:
        if load_acquire(ctl, G_ABORT) != 0:
            return ABORT
        missing = OK
        for r in range(world):
            base = GLOBAL_WORDS + r * RANK_WORDS
            if load_acquire(ctl, base + R_ARRIVED) < rnd:
                if load_acquire(ctl, base + R_DEAD) == 0:
                    missing = r
                    break
        if missing == OK:
            return _validate(ctl, ctl_f64, world, rnd, me, info, mass)
        if it >= iters:
            return missing
        it += 1
        cpu_relax()


@njit(cache=True, nogil=True)
def reduce_eager_f32(eager, slot_bytes, rnd, world, contrib, off, nelem, out, inv, acc):
    """f32 eager reduce: ``out[:nelem] = (sum over contributors in rank order) * inv``.

    ``eager`` is the whole eager area (uint8); rank r's slot for round rnd starts at
    ``(2r + rnd%2) * slot_bytes``; its payload at ``off`` within the slot.
    """
    f = np.float32(inv)
    par = rnd & 1
    if contrib == 0:
        out[:nelem] = 0
        return
    ch = acc.shape[0]
    for c0 in range(0, nelem, ch):
        c1 = min(c0 + ch, nelem)
        m = c1 - c0
        k = 0
        for r in range(world):
            if not (contrib >> r) & 1:
                continue
            start = (2 * r + par) * slot_bytes + off
            src = eager[start:start + 4 * nelem].view(np.float32)[c0:c1]
            if k == 0:
                for i in range(m):
                    acc[i] = src[i]
            else:
                for i in range(m):
                    acc[i] += src[i]
            k += 1
        o = out[c0:c1]
        for i in range(m):
            o[i] = acc[i] * f


@njit(cache=True, nogil=True)
def reduce_eager_bf16(eager, slot_bytes, rnd, world, contrib, off, nelem, out, inv, acc, tmp):
    """bf16 eager reduce into uint16 ``out`` (one RNE rounding of sum * inv)."""
    f = np.float32(inv)
    par = rnd & 1
    ch = acc.shape[0]
    abits = acc.view(np.uint32)
    tbits = tmp.view(np.uint32)
    if contrib == 0:
        out[:nelem] = 0
        return
    for c0 in range(0, nelem, ch):
        c1 = min(c0 + ch, nelem)
        m = c1 - c0
        k = 0
        for r in range(world):
            if not (contrib >> r) & 1:
                continue
            start = (2 * r + par) * slot_bytes + off
            src = eager[start:start + 2 * nelem].view(np.uint16)[c0:c1]
            if k == 0:
                for i in range(m):
                    abits[i] = np.uint32(src[i]) << np.uint32(16)
            else:
                for i in range(m):
                    tbits[i] = np.uint32(src[i]) << np.uint32(16)
                for i in range(m):
                    acc[i] += tmp[i]
            k += 1
        for i in range(m):
            acc[i] = acc[i] * f
        o = out[c0:c1]
        for i in range(m):
            o[i] = np.uint16(bf16_bits_rne(abits[i]))


@njit(cache=True, nogil=True)
def eager_round(ctl, ctl_f64, ctl32, eager, slot_bytes, world, me, rnd, kind, flags, dtype,
                weight, ntensors, nbytes, nelem, shash, nwords, iters, info, mass, out_f32,
                out_u16, acc, tmp):
    """A whole small round in one call: publish, spin for the arrivals, validate, reduce
    (``FLAGS_AGREED`` of every accepted header must match the first's).

    The contribution must already be in this rank's eager slot. On OK the consensus
    is in ``out_f32[:nelem]`` (f32 wire) or ``out_u16[:nelem]`` (bf16) and the
    accepted mass in ``mass[0]``. WAKE means peers are asleep on the doorbell: the
    caller wakes them and finishes with the blocking path; a rank >= 0 means the spin
    ran out; other codes as ``arrive``.
    """
    if publish_round(ctl, ctl_f64, ctl32, me, rnd, kind, flags, dtype, weight, ntensors,
                     nbytes, nelem, shash, nwords) > 0:
        return WAKE
    code = arrive(ctl, ctl_f64, world, rnd, me, iters, info, mass)
    if code != OK:
        return code
    m = mass[0]
    inv = np.float32(1.0)
    if kind == 0 and m > 0.0:
        inv = np.float32(1.0 / m)
    if dtype == 0:
        reduce_eager_f32(eager, slot_bytes, rnd, world, info[I_CONTRIB], nwords * 8, nelem,
                         out_f32, inv, acc)
    else:
        reduce_eager_bf16(eager, slot_bytes, rnd, world, info[I_CONTRIB], nwords * 8, nelem,
                          out_u16, inv, acc, tmp)
    return OK


# f32 words of the ``work`` array of ``eager_encode_round``: reduce accumulator, reduce
# temporary, encode scratch (f32), then encode scratch16 (uint16, half the words)
WORK_CHUNK = 4096
WORK_WORDS = 3 * WORK_CHUNK + WORK_CHUNK // 2


@njit(cache=True, nogil=True)
def eager_encode_round(ctl, eager, slot_bytes, world, me, info, mass, work, addrs, count, scale,
                       rnd, kind, flags, dtype, weight, ntensors, nbytes, nelem, shash, nwords,
                       iters, out_f32, out_u16, out_addr, upcast):
    """``eager_round`` preceded by the copy-in of ``count`` tensors, by address.

    ``addrs`` holds, for the round's ``ntensors`` tensors: their addresses, then their
    element counts, then 1 where the source is bfloat16 (else float32). The first
    ``count`` tensors go, times ``scale`` (bit-identical to encoding ``t.mul(scale)``),
    into their places in this rank's eager slot (whose schema words the caller
    wrote); ``count`` 0 means the payload is already written (or elided). The f32
    output is ``out_f32``, or the ``nelem`` float32 at ``out_addr`` when non-zero (a
    fresh tensor's memory). On OK with ``upcast`` and a bf16 wire, the consensus is
    also widened into the f32 output. ``work`` is ``WORK_WORDS`` f32 of scratch. The
    static arguments come first (one tuple on the caller's side), and the control
    block's f64/i32 views are made here, to keep the call's dispatch cheap.
    Codes as ``eager_round``.
    """
    ctl_f64 = ctl.view(np.float64)
    ctl32 = ctl.view(np.int32)
    acc = work[:WORK_CHUNK]
    tmp = work[WORK_CHUNK:2 * WORK_CHUNK]
    scratch = work[2 * WORK_CHUNK:3 * WORK_CHUNK]
    scratch16 = work[3 * WORK_CHUNK:].view(np.uint16)
    dst = out_f32 if out_addr == 0 else f32_at(out_addr, nelem)
    base = (2 * me + (rnd & 1)) * slot_bytes + nwords * 8
    off = 0
    if dtype == 0:
        dst32 = eager[base:base + 4 * nelem].view(np.float32)
        for i in range(count):
            n = addrs[ntensors + i]
            if addrs[2 * ntensors + i]:
                encode_bf16_to_f32(addrs[i], n, dst32[off:off + n], scale, scratch, scratch16)
            else:
                encode_f32_to_f32(addrs[i], n, dst32[off:off + n], scale)
            off += n
    else:
        dst16 = eager[base:base + 2 * nelem].view(np.uint16)
        for i in range(count):
            n = addrs[ntensors + i]
            if addrs[2 * ntensors + i]:
                encode_bf16_to_bf16(addrs[i], n, dst16[off:off + n], scale, scratch)
            else:
                encode_f32_to_bf16(addrs[i], n, dst16[off:off + n], scale, scratch)
            off += n
    code = eager_round(ctl, ctl_f64, ctl32, eager, slot_bytes, world, me, rnd, kind, flags,
                       dtype, weight, ntensors, nbytes, nelem, shash, nwords, iters, info, mass,
                       dst, out_u16, acc, tmp)
    if code == OK and upcast and dtype != 0:
        bf16_to_f32(out_u16[:nelem], dst[:nelem])
    return code


@njit(inline="always")
def _eager_single_f32(src, dst, keep_on_empty, scale, ctl, ctl_f64, ctl32, eager, slot_bytes,
                      world, me, rnd, kind, flags, weight, shash, nwords, iters, info, mass,
                      acc):
    """The body of ``eager_inplace_f32`` / ``eager_copy_f32`` (see them)."""
    n = src.shape[0]
    base = (2 * me + (rnd & 1)) * slot_bytes + nwords * 8
    slot = eager[base:base + 4 * n].view(np.float32)
    if flags & FLAG_ELIDED:
        pass  # contributes nothing (a broadcast's reader): nobody reads the slot
    elif scale == 1.0:
        for i in range(n):
            slot[i] = src[i]
    else:
        f = np.float32(scale)
        for i in range(n):
            slot[i] = src[i] * f
    if publish_round(ctl, ctl_f64, ctl32, me, rnd, kind, flags, 0, weight, 1, 4 * n, n, shash,
                     nwords) > 0:
        return WAKE
    code = arrive(ctl, ctl_f64, world, rnd, me, iters, info, mass)
    if code != OK:
        return code
    m = mass[0]
    if keep_on_empty and kind == 0 and not m > 0.0:
        return OK  # nothing realized: keep the local tensor
    inv = np.float32(1.0)
    if kind == 0 and m > 0.0:
        inv = np.float32(1.0 / m)
    reduce_eager_f32(eager, slot_bytes, rnd, world, info[I_CONTRIB], nwords * 8, n, dst, inv,
                     acc)
    return OK


@njit(cache=True, nogil=True)
def eager_inplace_f32(addr, n, scale, ctl, ctl_f64, ctl32, eager, slot_bytes, world, me, rnd,
                      kind, flags, weight, shash, nwords, iters, info, mass, acc):
    """The whole small in-place average of ONE contiguous f32 tensor, in one call.

    Copies ``tensor * scale`` (at ``addr``, ``n`` elements) into this rank's eager slot
    (whose schema words the caller wrote), publishes, spins for the arrivals,
    validates, and - when the round realized work (MODEL with mass > 0, or CONTROL) -
    reduces the consensus straight back into the tensor. Codes as ``eager_round``; on
    anything but OK the contribution is published and the caller finishes the round.
    """
    src = f32_at(addr, n)
    return _eager_single_f32(src, src, True, scale, ctl, ctl_f64, ctl32, eager, slot_bytes,
                             world, me, rnd, kind, flags, weight, shash, nwords, iters, info,
                             mass, acc)


@njit(cache=True, nogil=True)
def eager_copy_f32(addr, n, scale, dst_addr, ctl, ctl_f64, ctl32, eager, slot_bytes, world, me,
                   rnd, kind, flags, weight, shash, nwords, iters, info, mass, acc):
    """``eager_inplace_f32`` reducing into the ``n`` f32 at ``dst_addr`` (a fresh result)
    instead of the source, always (a round with no accepted mass yields what
    ``eager_round`` yields: the plain sum of the contributions)."""
    return _eager_single_f32(f32_at(addr, n), f32_at(dst_addr, n), False, scale, ctl, ctl_f64,
                             ctl32, eager, slot_bytes, world, me, rnd, kind, flags, weight,
                             shash, nwords, iters, info, mass, acc)


def warm_up() -> None:
    world = 2
    ctl = np.zeros(GLOBAL_WORDS + world * RANK_WORDS, np.int64)
    f64 = ctl.view(np.float64)
    c32 = ctl.view(np.int32)
    info = np.zeros(I_WORDS, np.int64)
    mass = np.zeros(1, np.float64)
    for r in range(world):
        publish_round(ctl, f64, c32, r, 0, 0, 0, 0, 1.0, 1, 8, 2, 7, 4)
    arrive(ctl, f64, world, 0, 0, 0, info, mass)
    eager = np.zeros(4 * 64, np.uint8)
    acc = np.zeros(8, np.float32)
    tmp = np.zeros(8, np.float32)
    reduce_eager_f32(eager, 64, 0, world, 3, 0, 2, np.zeros(2, np.float32), 1.0, acc)
    reduce_eager_bf16(eager, 64, 0, world, 3, 0, 2, np.zeros(2, np.uint16), 1.0, acc, tmp)
    for r in range(world):
        eager_round(ctl, f64, c32, eager, 64, world, r, 1, 0, 0, 0, 1.0, 1, 8, 2, 7, 1, 0,
                    info, mass, np.zeros(2, np.float32), np.zeros(2, np.uint16), acc, tmp)
    addrs = np.zeros(3, np.int64)
    work = np.zeros(WORK_WORDS, np.float32)
    for r in range(world):
        for dtype in (0, 1):
            eager_encode_round(ctl, eager, 64, world, r, info, mass, work, addrs, 0, 1.0, 3, 0,
                               0, dtype, 1.0, 1, 8, 2, 7, 1, 0, np.zeros(2, np.float32),
                               np.zeros(2, np.uint16), 0, True)
    t = np.zeros(2, np.float32)
    dst = np.zeros(2, np.float32)  # held here: the kernel writes through its address
    for r in range(world):
        eager_inplace_f32(t.ctypes.data, 2, 1.0, ctl, f64, c32, eager, 64, world, r, 4, 0, 0,
                          1.0, 7, 1, 0, info, mass, acc)
        eager_copy_f32(t.ctypes.data, 2, 1.0, dst.ctypes.data, ctl, f64, c32, eager, 64,
                       world, r, 5, 0, 0, 1.0, 7, 1, 0, info, mass, acc)

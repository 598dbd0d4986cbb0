"""The compiled half of ``protocol.py``: one call per protocol step.

A 4 KiB round must finish in a few microseconds; every Python-level numpy access
costs ~100 ns and every call ~0.3 µs, so each step of the round state machine is
one fused kernel here: write the round header and publish the arrival; spin on
the arrivals and, once complete, validate every accepted header against the first
and sum the accepted mass; reduce the eager slots.

Word offsets come from ``flodl_shm/kernels/control_block.py``, the one definition of the control block.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from numba import njit, types

from .control_block import (DEAD_EXITED, FLAG_BROADCAST, FLAG_ELIDED, FLAGS_AGREED, G_ABORT,
                            G_DOORBELL, G_SLEEPERS, GLOBAL_WORDS, H_DTYPE, H_FLAGS, H_KIND,
                            H_NBYTES, H_NELEM, H_NTENSORS, H_ROUND, H_SCHEMA_HASH,
                            H_SCHEMA_WORDS, H_WEIGHT, HDR_WORDS, R_ARRIVED, R_DEAD, R_HDR,
                            RANK_WORDS)
from .atomics import cpu_relax, fetch_add, load_acquire, os_yield, store_release
from .codec import bf16_bits_rne, bf16_to_f32
# result codes of arrive() and the fused rounds (>= 0: the first rank still missing);
# re-exported so the engine reads them as RK.OK, RK.WAKE, ...
from .codes import ABORT, EXITED, MISMATCH, NOT_ROOT, OK, OUT_OF_STEP, WAKE  # noqa: F401
from .tensorio import (decode_scatter, encode_bf16_to_bf16, encode_bf16_to_f32,
                       encode_f32_to_bf16, encode_f32_to_f32, f32_at, i64_at, u8_at)

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
def arrive(ctl, ctl_f64, world, rnd, me, iters, yields, info, mass):
    """Spin until every rank arrived at ``rnd`` or is dead, then validate.

    The wait spins ``iters`` times, then gives the core away (``sched_yield``) up to
    ``yields`` times between checks: where ranks outnumber cores the missing rank is
    usually runnable on this very core, and a yield from compiled code hands it over
    without first leaving the call for the Python waiter.

    Returns OK (info/mass filled), ABORT, MISMATCH, EXITED, OUT_OF_STEP, or the
    first missing rank (>= 0) when the spins and yields ran out.
    """
    it = 0
    budget = iters + yields
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
        if it >= budget:
            return missing
        it += 1
        if it > iters:
            os_yield()
        else:
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
def copy_eager_f32(eager, slot_bytes, rnd, src, off, nelem, out):
    """A broadcast: ``out[:nelem]`` = rank ``src``'s f32 eager payload, bit for bit (a
    copy, not a reduce times 1.0, which would quiet a signaling NaN)."""
    start = (2 * src + (rnd & 1)) * slot_bytes + off
    s = eager[start:start + 4 * nelem].view(np.uint32)
    o = out[:nelem].view(np.uint32)
    for i in range(nelem):
        o[i] = s[i]


@njit(cache=True, nogil=True)
def sole_contributor(contrib, world):
    """The rank whose bit is the only one set in ``contrib``, else -1."""
    if contrib == 0 or contrib & (contrib - 1) != 0:
        return -1
    for r in range(world):
        if (contrib >> r) & 1:
            return r
    return -1


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
                weight, ntensors, nbytes, nelem, shash, nwords, iters, yields, info, mass,
                out_f32, out_u16, acc, tmp):
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
    code = arrive(ctl, ctl_f64, world, rnd, me, iters, yields, info, mass)
    if code != OK:
        return code
    m = mass[0]
    inv = np.float32(1.0)
    if kind == 0 and m > 0.0:
        inv = np.float32(1.0 / m)
    root = sole_contributor(info[I_CONTRIB], world) if flags & FLAG_BROADCAST else -1
    if dtype == 0 and root >= 0:
        copy_eager_f32(eager, slot_bytes, rnd, root, nwords * 8, nelem, out_f32)
    elif dtype == 0:
        reduce_eager_f32(eager, slot_bytes, rnd, world, info[I_CONTRIB], nwords * 8, nelem,
                         out_f32, inv, acc)
    else:
        reduce_eager_bf16(eager, slot_bytes, rnd, world, info[I_CONTRIB], nwords * 8, nelem,
                          out_u16, inv, acc, tmp)
    return OK


# f32 words of the ``work`` scratch of the fused calls: reduce accumulator, reduce
# temporary, encode scratch (f32), then encode scratch16 (uint16, half the words)
WORK_CHUNK = 4096
WORK_WORDS = 3 * WORK_CHUNK + WORK_CHUNK // 2

# -- the call block and the plan words ---------------------------------------------
# numba's dispatch costs ~70 ns per argument, and a fused call once took two dozen (a
# third of a 4 KiB round's CPU). So what a call needs besides its per-call values lives
# in two private int64 arrays: the engine's call block (``CALL_WORDS``: the arena's
# addresses and the spin budget in, the round's outcome out) and each round plan's
# words (``P_*``: its header fields, schema words and tensor address table).
C_MASS = I_WORDS          # the accepted mass of the last call (float64 bits)
C_SPIN = I_WORDS + 1      # spin budget in iterations (the Waiter's; a caught round doubles it)
C_MIN_SPIN = I_WORDS + 2  # the budget's bounds
C_MAX_SPIN = I_WORDS + 3
C_CTL = I_WORDS + 4       # address and int64 words of the control block
C_CTL_WORDS = I_WORDS + 5
C_EAGER = I_WORDS + 6     # address and bytes of the eager area (every rank's two slots)
C_EAGER_BYTES = I_WORDS + 7
C_SLOT_BYTES = I_WORDS + 8
C_WORLD = I_WORDS + 9
C_ME = I_WORDS + 10
C_WORK = I_WORDS + 11     # address of WORK_WORDS float32 of scratch
C_SCHEMA = I_WORDS + 12   # 2 words: the id of the plan whose schema each slot parity holds
C_YIELDS = I_WORDS + 14   # sched_yield calls after the spin (0 unless ranks outnumber cores)
CALL_WORDS = I_WORDS + 15

P_ID = 0                  # unique per plan (0: none): the slot-schema cache key
P_KIND = 1
P_DTYPE = 2
P_NTENSORS = 3
P_NBYTES = 4
P_NELEM = 5
P_SHASH = 6
P_NWORDS = 7
P_WORDS = 8               # the schema words, then the address table (3 * ntensors)


@njit(inline="always")
def _call_views(blk):
    """The control block (with its f64 and i32 views), the eager area, info and mass."""
    ctl = i64_at(blk[C_CTL], blk[C_CTL_WORDS])
    eager = u8_at(blk[C_EAGER], blk[C_EAGER_BYTES])
    return (ctl, ctl.view(np.float64), ctl.view(np.int32), eager, blk[:I_WORDS],
            blk[C_MASS:C_MASS + 1].view(np.float64))


@njit(inline="always")
def _put_schema(blk, pl, eager, rnd):
    """COPY-IN setup of an eager round: the slot of ``rnd``'s parity holds ``pl``'s
    schema words (rewritten only when it last held another plan's)."""
    par = rnd & 1
    if blk[C_SCHEMA + par] != pl[P_ID]:
        nw = pl[P_NWORDS]
        start = (2 * blk[C_ME] + par) * blk[C_SLOT_BYTES]
        words = eager[start:start + 8 * nw].view(np.int64)
        for i in range(nw):
            words[i] = pl[P_WORDS + i]
        blk[C_SCHEMA + par] = pl[P_ID]


@njit(inline="always")
def _spin_caught(blk):
    """``Waiter.note_spin(True)``: the spin caught the round, so double the budget."""
    blk[C_SPIN] = min(blk[C_MAX_SPIN], max(blk[C_MIN_SPIN], 2 * blk[C_SPIN]))


@njit(cache=True, nogil=True)
def eager_encode_round(blk, pl, rnd, weight, flags, count, scale, out_addr, upcast, out_f32,
                       out_u16):
    """``eager_round`` of plan ``pl`` preceded by its COPY-IN setup (``_put_schema``) and
    the copy-in of the first ``count`` tensors of its address table.

    The table (``pl[P_WORDS + nwords:]``) holds, for the round's ``ntensors`` tensors:
    their addresses, then their element counts, then 1 where the source is bfloat16
    (else float32). The first ``count`` go, times ``scale`` (bit-identical to encoding
    ``t.mul(scale)``), into their places in this rank's eager slot; ``count`` 0 means
    the payload is already written (or elided). The f32 output is ``out_f32``, or the
    ``nelem`` float32 at ``out_addr`` when non-zero (a fresh tensor's memory). On OK
    with ``upcast`` and a bf16 wire, the consensus is also widened into the f32 output.
    Codes as ``eager_round``; the accepted mass in ``blk[C_MASS]``.
    """
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    work = f32_at(blk[C_WORK], WORK_WORDS)
    acc = work[:WORK_CHUNK]
    tmp = work[WORK_CHUNK:2 * WORK_CHUNK]
    scratch = work[2 * WORK_CHUNK:3 * WORK_CHUNK]
    scratch16 = work[3 * WORK_CHUNK:].view(np.uint16)
    _put_schema(blk, pl, eager, rnd)
    me = blk[C_ME]
    slot_bytes = blk[C_SLOT_BYTES]
    dtype = pl[P_DTYPE]
    nt = pl[P_NTENSORS]
    nelem = pl[P_NELEM]
    nwords = pl[P_NWORDS]
    addrs = pl[P_WORDS + nwords:]
    dst = out_f32 if out_addr == 0 else f32_at(out_addr, nelem)
    base = (2 * me + (rnd & 1)) * slot_bytes + nwords * 8
    off = 0
    if dtype == 0:
        dst32 = eager[base:base + 4 * nelem].view(np.float32)
        for i in range(count):
            n = addrs[nt + i]
            if addrs[2 * nt + i]:
                encode_bf16_to_f32(addrs[i], n, dst32[off:off + n], scale, scratch, scratch16)
            else:
                encode_f32_to_f32(addrs[i], n, dst32[off:off + n], scale)
            off += n
    else:
        dst16 = eager[base:base + 2 * nelem].view(np.uint16)
        for i in range(count):
            n = addrs[nt + i]
            if addrs[2 * nt + i]:
                encode_bf16_to_bf16(addrs[i], n, dst16[off:off + n], scale, scratch)
            else:
                encode_f32_to_bf16(addrs[i], n, dst16[off:off + n], scale, scratch)
            off += n
    code = eager_round(ctl, ctl_f64, ctl32, eager, slot_bytes, blk[C_WORLD], me, rnd,
                       pl[P_KIND], flags, dtype, weight, nt, pl[P_NBYTES], nelem, pl[P_SHASH],
                       nwords, blk[C_SPIN], blk[C_YIELDS], info, mass, dst, out_u16, acc, tmp)
    if code == OK:
        _spin_caught(blk)
        if upcast and dtype != 0:
            bf16_to_f32(out_u16[:nelem], dst[:nelem])
    return code


@njit(cache=True, nogil=True)
def eager_tensors_round(blk, pl, rnd, weight, scale, out_f32, out_u16, sums):
    """``eager_encode_round`` of every tensor of plan ``pl``'s address table, then, when
    the round realized work (CONTROL, or MODEL with mass > 0), the consensus written
    back into the float32 ones (``tensorio.decode_scatter``, adding their drift to
    ``sums``: ``[ntensors, 3]`` float64, or ``[0, 3]`` for none); bfloat16 sources are
    left to the caller. An in-place ``all_reduce_`` of several tensors in one call.
    Codes as ``eager_round``: on OK the float32 tensors hold the consensus, or were
    left untouched (MODEL, mass 0: ``blk[C_MASS]`` tells)."""
    code = eager_encode_round(blk, pl, rnd, weight, 0, pl[P_NTENSORS], scale, 0, False, out_f32,
                              out_u16)
    if code != OK:
        return code
    if pl[P_KIND] == 0 and not blk[C_MASS:C_MASS + 1].view(np.float64)[0] > 0.0:
        return OK
    addrs = pl[P_WORDS + pl[P_NWORDS]:]
    if pl[P_DTYPE] == 0:
        decode_scatter(out_f32, addrs, pl[P_NTENSORS], sums)
    else:
        decode_scatter(out_u16, addrs, pl[P_NTENSORS], sums)
    return OK


@njit(cache=True, nogil=True)
def barrier_round(blk, pl, rnd):
    """The round of an empty CONTROL plan ``pl`` (a barrier): publish its header, spin
    for every rank, validate. What ``eager_encode_round`` does for such a plan, without
    its copy-in and reduce set-up (which cost a barrier about 80 ns of its ~200), and
    with three arguments instead of eleven. Codes as ``eager_round``."""
    _put_schema(blk, pl, _call_views(blk)[3], rnd)
    return _publish_and_arrive(blk, pl, rnd, 0, 0.0)


@njit(inline="always")
def _publish_and_arrive(blk, pl, rnd, flags, weight):
    """Publish this rank's header of plan ``pl`` for ``rnd`` with ``flags`` and mass
    ``weight`` (its payload, if any, already in the slot), spin for every rank and
    validate; a caught round doubles the spin budget. Codes as ``eager_round``."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    me = blk[C_ME]
    if publish_round(ctl, ctl_f64, ctl32, me, rnd, pl[P_KIND], flags, pl[P_DTYPE], weight,
                     pl[P_NTENSORS], pl[P_NBYTES], pl[P_NELEM], pl[P_SHASH],
                     pl[P_NWORDS]) > 0:
        return WAKE
    code = arrive(ctl, ctl_f64, blk[C_WORLD], rnd, me, blk[C_SPIN], blk[C_YIELDS], info, mass)
    if code == OK:
        _spin_caught(blk)
    return code


@njit(cache=True, nogil=True)
def per_rank_round(blk, pl, rnd, values):
    """The CONTROL round of ``Comm.all_reduce_per_rank_f64`` in one call: the float64
    ``values`` (``pl``'s ``nelem`` of them, at most ``WORK_CHUNK``) go into this rank's
    eager slot as float32; publish, spin, validate; then the float32 sums over the
    contributors, in rank order, come back into ``values`` widened to float64. Codes as
    ``eager_round``; on any code but OK ``values`` still holds the input (the caller
    finishes the round and reduces)."""
    eager, info = _call_views(blk)[3:5]
    _put_schema(blk, pl, eager, rnd)
    slot_bytes = blk[C_SLOT_BYTES]
    nelem = pl[P_NELEM]
    nwords = pl[P_NWORDS]
    base = (2 * blk[C_ME] + (rnd & 1)) * slot_bytes + nwords * 8
    slot = eager[base:base + 4 * nelem].view(np.float32)
    for i in range(nelem):
        slot[i] = np.float32(values[i])
    code = _publish_and_arrive(blk, pl, rnd, 0, 0.0)
    if code != OK:
        return code
    work = f32_at(blk[C_WORK], WORK_WORDS)
    sums = work[WORK_CHUNK:WORK_CHUNK + nelem]
    reduce_eager_f32(eager, slot_bytes, rnd, blk[C_WORLD], info[I_CONTRIB], nwords * 8, nelem,
                     sums, 1.0, work[:WORK_CHUNK])
    for i in range(nelem):
        values[i] = sums[i]
    return OK


@njit(inline="always")
def _eager_single_f32(blk, pl, src, dst, keep_on_empty, scale, rnd, flags, weight, root):
    """The body of ``eager_inplace_f32`` / ``eager_copy_f32`` (see them)."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    _put_schema(blk, pl, eager, rnd)
    n = src.shape[0]
    nwords = pl[P_NWORDS]
    slot_bytes = blk[C_SLOT_BYTES]
    me = blk[C_ME]
    base = (2 * me + (rnd & 1)) * slot_bytes + nwords * 8
    slot = eager[base:base + 4 * n].view(np.float32)
    if flags & FLAG_ELIDED:
        pass  # contributes nothing (a broadcast's reader): nobody reads the slot
    elif root == me and src.ctypes.data != dst.ctypes.data:
        # a broadcast's root into a fresh result: one pass writes both, bit for bit.
        # Copied from the slot after the round instead, the result cost twice a memcpy
        # at 256 KiB: the readers are reading the same lines from another core then
        sb = src.view(np.uint32)
        s32 = slot.view(np.uint32)
        db = dst.view(np.uint32)
        for i in range(n):
            v = sb[i]
            s32[i] = v
            db[i] = v
    elif scale == 1.0:
        for i in range(n):
            slot[i] = src[i]
    else:
        f = np.float32(scale)
        for i in range(n):
            slot[i] = src[i] * f
    kind = pl[P_KIND]
    code = _publish_and_arrive(blk, pl, rnd, flags, weight)  # (n is the plan's nelem)
    if code != OK:
        return code
    if root >= 0:
        if info[I_CONTRIB] != 1 << root:
            return NOT_ROOT  # the caller raises, naming what the ranks disagree on
        if root != me:  # (the root's tensor or result holds the slot's bits already)
            copy_eager_f32(eager, slot_bytes, rnd, root, nwords * 8, n, dst)
        return OK
    m = mass[0]
    if keep_on_empty and kind == 0 and not m > 0.0:
        return OK  # nothing realized: keep the local tensor
    inv = np.float32(1.0)
    if kind == 0 and m > 0.0:
        inv = np.float32(1.0 / m)
    reduce_eager_f32(eager, slot_bytes, rnd, blk[C_WORLD], info[I_CONTRIB], nwords * 8, n, dst,
                     inv, f32_at(blk[C_WORK], WORK_CHUNK))
    return OK


@njit(cache=True, nogil=True)
def eager_inplace_f32(blk, pl, addr, rnd, weight, scale):
    """The whole small in-place average of ONE contiguous f32 tensor of plan ``pl`` (at
    ``addr``), in one call.

    Writes the slot's schema words when needed, copies ``tensor * scale`` into this
    rank's eager slot, publishes, spins for the arrivals, validates, and - when the
    round realized work (MODEL with mass > 0, or CONTROL) - reduces the consensus
    straight back into the tensor. Codes as ``eager_round``; on anything but OK the
    contribution is published and the caller finishes the round.
    """
    src = f32_at(addr, pl[P_NELEM])
    return _eager_single_f32(blk, pl, src, src, True, scale, rnd, 0, weight, -1)


@njit(cache=True, nogil=True)
def eager_arrays_f32(blk, pl, src, dst, rnd, weight):
    """``eager_copy_f32`` (no scale, no broadcast) over f32 arrays instead of addresses:
    ``src`` (the plan's ``nelem`` values, e.g. a frame's payload) is copied in and the
    round reduced into ``dst``. An array over foreign memory has no cheap address in
    Python (``ctypes.data`` costs about 2 µs), so the frame API passes the arrays."""
    return _eager_single_f32(blk, pl, src, dst, False, 1.0, rnd, 0, weight, -1)


@njit(cache=True, nogil=True)
def eager_copy_f32(blk, pl, addr, dst_addr, rnd, flags, weight, scale, root):
    """``eager_inplace_f32`` reducing into the f32 at ``dst_addr`` (a fresh result)
    instead of the source, always (a round with no accepted mass yields what
    ``eager_round`` yields: the plain sum of the contributions); ``flags`` as
    ``publish_round``'s. ``root`` >= 0: a broadcast round from that local rank, which
    returns NOT_ROOT (reducing nothing) unless the root is its only contributor."""
    n = pl[P_NELEM]
    return _eager_single_f32(blk, pl, f32_at(addr, n), f32_at(dst_addr, n), False, scale, rnd,
                             flags, weight, root)


def call_block(ctl: np.ndarray, eager: np.ndarray, slot_bytes: int, world: int, me: int,
               work: np.ndarray, spin: int, min_spin: int, max_spin: int) -> np.ndarray:
    """A call block over these arrays (the caller keeps them alive as long as it)."""
    blk = np.zeros(CALL_WORDS, np.int64)
    blk[C_SPIN], blk[C_MIN_SPIN], blk[C_MAX_SPIN] = spin, min_spin, max_spin
    blk[C_CTL], blk[C_CTL_WORDS] = ctl.ctypes.data, ctl.shape[0]
    blk[C_EAGER], blk[C_EAGER_BYTES] = eager.ctypes.data, eager.nbytes
    blk[C_SLOT_BYTES], blk[C_WORLD], blk[C_ME] = slot_bytes, world, me
    assert work.dtype == np.float32 and work.shape[0] >= WORK_WORDS
    blk[C_WORK] = work.ctypes.data
    return blk


def plan_words(pid: int, kind: int, dtype: int, ntensors: int, nbytes: int, nelem: int,
               shash: int, words: np.ndarray) -> np.ndarray:
    """A plan's words (``P_*``), with a zeroed address table of ``3 * ntensors``."""
    pl = np.zeros(P_WORDS + len(words) + 3 * ntensors, np.int64)
    pl[:P_WORDS] = (pid, kind, dtype, ntensors, nbytes, nelem, shash, len(words))
    pl[P_WORDS:P_WORDS + len(words)] = words
    return pl


def warm_up() -> None:
    world = 2
    ctl = np.zeros(GLOBAL_WORDS + world * RANK_WORDS, np.int64)
    f64 = ctl.view(np.float64)
    c32 = ctl.view(np.int32)
    info = np.zeros(I_WORDS, np.int64)
    mass = np.zeros(1, np.float64)
    for r in range(world):
        publish_round(ctl, f64, c32, r, 0, 0, 0, 0, 1.0, 1, 8, 2, 7, 4)
    arrive(ctl, f64, world, 0, 0, 0, 0, info, mass)
    eager = np.zeros(4 * 64, np.uint8)
    acc = np.zeros(8, np.float32)
    tmp = np.zeros(8, np.float32)
    reduce_eager_f32(eager, 64, 0, world, 3, 0, 2, np.zeros(2, np.float32), 1.0, acc)
    reduce_eager_bf16(eager, 64, 0, world, 3, 0, 2, np.zeros(2, np.uint16), 1.0, acc, tmp)
    copy_eager_f32(eager, 64, 0, 1, 0, 2, np.zeros(2, np.float32))
    sole_contributor(2, world)
    work = np.zeros(WORK_WORDS, np.float32)
    out = np.zeros(16, np.float32)
    blks = [call_block(ctl, eager, 64, world, r, work, 0, 0, 0) for r in range(world)]
    words = np.array([1, 0, 0, 1, 2], np.int64)
    u16 = out.view(np.uint16)
    for i, dtype in enumerate((0, 1)):
        pl = plan_words(i + 1, 0, dtype, 1, 8, 2, 7, words)
        for r in range(world):
            eager_encode_round(blks[r], pl, 2 + i, 1.0, 0, 0, 1.0, 0, True, out, u16)
    pl = plan_words(3, 0, 0, 1, 8, 2, 7, words)
    t = np.zeros(2, np.float32)
    dst = np.zeros(2, np.float32)  # held here: the kernel writes through its address
    for r in range(world):
        eager_inplace_f32(blks[r], pl, t.ctypes.data, 4, 1.0, 1.0)
    for r in range(world):
        eager_copy_f32(blks[r], pl, t.ctypes.data, dst.ctypes.data, 5, 0, 1.0, 1.0, -1)
    empty = plan_words(4, 1, 0, 0, 0, 0, 9, words[:0])
    for r in range(world):
        barrier_round(blks[r], empty, 6)
    per_rank = plan_words(7, 1, 0, 1, 8, 2, 7, words)
    values = np.zeros(2, np.float64)
    for r in range(world):
        per_rank_round(blks[r], per_rank, 9, values)
    pl = plan_words(5, 0, 0, 1, 8, 2, 7, words)
    pl[P_WORDS + len(words):] = (t.ctypes.data, 2, 0)  # one f32 tensor: address, numel
    for r in range(world):
        eager_tensors_round(blks[r], pl, 7, 1.0, 1.0, out, u16, np.zeros((0, 3)))
    pl = plan_words(6, 0, 0, 1, 8, 2, 7, words)
    for r in range(world):
        eager_arrays_f32(blks[r], pl, t, dst, 8, 1.0)


class FusedCalls(NamedTuple):
    """Fused calls as compiled functions of the one signature the engine calls them with.

    Calling a numba function types every argument to pick its compiled version (about
    50 ns a call beyond the unboxing, a sixth of a whole barrier's compiled work);
    these skip that. So they take arguments of exactly these types and no others: the
    engine's call block and a plan's words (1-D C int64 arrays), Python ints and
    floats, for ``per_rank`` the Comm's own 1-D C float64 staging array, and for
    ``arrays_f32`` 1-D C float32 arrays, aligned and writable (a frame's payload and its
    reply's memory).
    """

    barrier: Callable        # barrier_round(blk, pl, rnd)
    per_rank: Callable       # per_rank_round(blk, pl, rnd, values)
    inplace_f32: Callable    # eager_inplace_f32(blk, pl, addr, rnd, weight, scale)
    copy_f32: Callable       # eager_copy_f32(blk, pl, addr, out, rnd, flags, weight, scale, root)
    arrays_f32: Callable     # eager_arrays_f32(blk, pl, src, dst, rnd, weight)


@functools.cache
def fused_calls() -> FusedCalls:
    """The engine's fused calls, compiled (or loaded from the cache) once per process."""
    words, i64, f64 = types.int64[::1], types.int64, types.float64
    return FusedCalls(
        barrier=barrier_round.compile((words, words, i64)),
        per_rank=per_rank_round.compile((words, words, i64, types.float64[::1])),
        inplace_f32=eager_inplace_f32.compile((words, words, i64, i64, f64, f64)),
        copy_f32=eager_copy_f32.compile((words, words, i64, i64, i64, i64, f64, f64, i64)),
        arrays_f32=eager_arrays_f32.compile((words, words, types.float32[::1],
                                             types.float32[::1], i64, f64)))

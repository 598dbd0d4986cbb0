"""The compiled calls of the part collectives: all-gather and reduce-scatter rounds.

**All-gather** (``FLAG_GATHER``, one host): an eager round in which every rank
contributes a part of the plan's ``nelem`` float32 words (raw bits: the caller may carry
any dtype's bytes as float32) and every rank leaves with all parts. Nothing is summed,
so nothing is rounded: a signaling NaN stays signaling.

``eager_gather_f32`` is the whole round in one call: the rank copies its part into its
eager slot, publishes, spins for the arrivals, validates, then copies every peer's slot
into its output (its own part straight from its input, unless its input is that part of
its output already, as FSDP passes it). A peer's slot of round N is rewritten in round
N + 2 only, after every rank finished N + 1 (``protocol.py``'s double-buffering
argument), so every read of it is done before. A part larger than the slot goes in
rounds of a slot each (``Comm.all_gather_into_tensor``).

**A direct all-gather** (``FLAG_GATHER | FLAG_DIRECT``: ``engine/direct.py``): parts of
64-256 KiB, where ranks do not outnumber cores, skip the slots. ``direct_gather_f32``
publishes the address of the rank's part instead of the part, then, after the arrival
spin, copies its own part into its output and reads each peer's straight from that
peer's input into its output (``process_vm_readv``), publishes its done word and waits
for every rank's, so no rank leaves while a peer still reads its input. A copy into a
slot that the peers copied out in an earlier round first takes every line back from
their caches: 128 KiB took 16-21 µs to copy into such a slot, 3-4 µs into one nobody
reads (``tools/probe_cross_core.py``). A cross-memory read pins the pages it reads
instead, so it wins in a band only: on 2 ranks a 256 KiB output took 18.5 µs against
25.8 through the slots, 1 MiB 60 against 54, and on 4 ranks on 2 cores every size ran
1.4-2.1 times slower (BENCHMARKS.md, "Fifty-second session").

**Reduce-scatter** (``FLAG_SCATTER``, one host): an eager round of the whole input,
``world`` parts of the output's size, in which each rank reduces only its own part:
``eager_reduce_scatter_f32`` copies the input into the rank's slot, publishes, spins,
validates, then sums part ``me`` of every contributor's slot in rank order, times the
round's ``1 / mass`` (MODEL) or 1 (CONTROL), into its output (``rounds.reduce_eager_f32``:
the bits ``all_reduce_`` gives that part). An all-reduce of the input reduces every part
on every rank: ``world`` times the sums. An input larger than the slot goes in rounds
that each carry a chunk of every part.

They return the codes of ``rounds.eager_round`` (this rank published; the caller
finishes the wait, then calls ``copy_parts`` / ``reduce_part``); the gather also NOT_ROOT
when a rank that arrived did not contribute (the caller raises: a gather needs every
part).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from numba import njit, types

from .cma import MAX_PIECES, _call, _copy_bits, _done
from .codes import NOT_ROOT, OK, UNREACHABLE
from .control_block import (FLAG_DIRECT, FLAG_GATHER, FLAG_SCATTER, GLOBAL_WORDS, R_PID,
                            RANK_WORDS)
from .rounds import (C_ME, C_SLOT_BYTES, C_WORK, C_WORLD, I_CONTRIB, I_CULPRIT, P_KIND,
                     P_NELEM, P_NWORDS, WORK_CHUNK, _call_views, _publish_and_arrive,
                     _put_schema, reduce_eager_f32)
from .tensorio import f32_at


@njit(inline="always")
def _every_rank(world):
    return (1 << world) - 1


@njit(inline="always")
def _f32_bits(addr, n):
    return f32_at(addr, n).view(np.uint32)


@njit(inline="always")
def _copy_parts(blk, off, n, src, dst, stride, rnd, contrib):
    """Every rank's part of an eager gather round ``rnd`` (``n`` float32) into the output
    at ``dst``, rank r's at ``dst + 4 * stride * r``: this rank's from ``src``, the
    others' from their eager slots (``off`` bytes in). NOT_ROOT when ``contrib`` (the
    contributors' mask) misses a rank."""
    eager = _call_views(blk)[3]
    world = blk[C_WORLD]
    me = blk[C_ME]
    if contrib != _every_rank(world):
        return NOT_ROOT
    slot_bytes = blk[C_SLOT_BYTES]
    for r in range(world):
        part = dst + 4 * stride * r
        if r == me:
            if part != src:
                _copy_bits(src, part, n)
            continue
        b = (2 * r + (rnd & 1)) * slot_bytes + off
        theirs = eager[b:b + 4 * n].view(np.uint32)
        mine = _f32_bits(part, n)
        for i in range(n):
            mine[i] = theirs[i]
    return OK


@njit(cache=True, nogil=True)
def copy_parts(blk, off, n, src, dst, stride, rnd, contrib):
    """``eager_gather_f32``'s copies after an arrival wait the caller finished (see the
    module docstring): OK, or NOT_ROOT when a rank did not contribute."""
    return _copy_parts(blk, off, n, src, dst, stride, rnd, contrib)


@njit(cache=True, nogil=True)
def eager_gather_f32(blk, pl, src, dst, stride, rnd):
    """A whole small all-gather of plan ``pl`` (``pl[P_NELEM]`` float32 words a rank) in
    one call: this rank's part at address ``src`` into its eager slot, published with
    FLAG_GATHER; the arrival spin and validation; then every part into the output, rank
    r's at ``dst + 4 * stride * r`` (``copy_parts``). Codes: see the module docstring."""
    eager, info = _call_views(blk)[3:5]
    _put_schema(blk, pl, eager, rnd)
    n = pl[P_NELEM]
    off = pl[P_NWORDS] * 8
    base = (2 * blk[C_ME] + (rnd & 1)) * blk[C_SLOT_BYTES] + off
    slot = eager[base:base + 4 * n].view(np.uint32)
    part = _f32_bits(src, n)
    for i in range(n):
        slot[i] = part[i]
    code = _publish_and_arrive(blk, pl, rnd, FLAG_GATHER, 0.0)
    if code != OK:
        return code
    return _copy_parts(blk, off, n, src, dst, stride, rnd, info[I_CONTRIB])


@njit(inline="always")
def _read_parts(blk, off, n, src, dst, stride, rnd, iov):
    """``direct_gather_f32``'s steps after its arrival wait, every rank a contributor
    (see it)."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    world = blk[C_WORLD]
    me = blk[C_ME]
    own = dst + 4 * stride * me
    if own != src:
        _copy_bits(src, own, n)
    slot_bytes = blk[C_SLOT_BYTES]
    for k in range(1, world):  # (from the next rank on: the ranks read different peers)
        r = (me + k) % world
        b = (2 * r + (rnd & 1)) * slot_bytes + off
        iov[0] = dst + 4 * stride * r
        iov[2 * MAX_PIECES] = eager[b:b + 8].view(np.int64)[0]
        iov[1] = iov[2 * MAX_PIECES + 1] = 4 * n
        if _call(False, ctl[GLOBAL_WORDS + r * RANK_WORDS + R_PID], iov, 1, 1) != 4 * n:
            info[I_CULPRIT] = r
            return UNREACHABLE
    return _done(blk, ctl, ctl32, rnd)


@njit(cache=True, nogil=True)
def read_parts(blk, off, n, src, dst, stride, rnd, iov):
    """``direct_gather_f32``'s steps after an arrival wait the caller finished, in which
    every rank contributed (``RoundEngine.check_gather`` raised otherwise)."""
    return _read_parts(blk, off, n, src, dst, stride, rnd, iov)


@njit(cache=True, nogil=True)
def direct_gather_f32(blk, pl, src, dst, stride, rnd, iov):
    """A whole direct all-gather of plan ``pl`` in one call: this rank's part's
    address ``src`` in its eager slot (after the schema words), published with
    FLAG_GATHER | FLAG_DIRECT; the arrival spin and validation; then this rank's part
    into its output (rank r's at ``dst + 4 * stride * r``) and every peer's part read
    from that peer's input (``process_vm_readv``); done[me] published and every rank's
    done awaited, so no rank leaves while a peer still reads its input. Codes: the
    arrival's, NOT_ROOT (a rank missing), UNREACHABLE (I_CULPRIT), SLICES_PENDING."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    _put_schema(blk, pl, eager, rnd)
    off = pl[P_NWORDS] * 8
    b = (2 * blk[C_ME] + (rnd & 1)) * blk[C_SLOT_BYTES] + off
    eager[b:b + 8].view(np.int64)[0] = src
    code = _publish_and_arrive(blk, pl, rnd, FLAG_GATHER | FLAG_DIRECT, 0.0)
    if code != OK:
        return code
    if info[I_CONTRIB] != _every_rank(blk[C_WORLD]):
        return NOT_ROOT
    return _read_parts(blk, off, pl[P_NELEM], src, dst, stride, rnd, iov)


@njit(inline="always")
def _reduce_part(blk, off, m, dst, rnd, kind, contrib, mass):
    """Part ``me`` (``m`` float32) of every contributor's slot, summed in rank order,
    times ``1 / mass`` (MODEL with mass) or 1, into the float32 at ``dst``."""
    eager = _call_views(blk)[3]
    inv = 1.0
    if kind == 0 and mass > 0.0:
        inv = 1.0 / mass
    reduce_eager_f32(eager, blk[C_SLOT_BYTES], rnd, blk[C_WORLD], contrib,
                     off + 4 * m * blk[C_ME], m, f32_at(dst, m), inv,
                     f32_at(blk[C_WORK], WORK_CHUNK))


@njit(cache=True, nogil=True)
def reduce_part(blk, off, m, dst, rnd, kind, contrib, mass):
    """``eager_reduce_scatter_f32``'s reduce after an arrival wait the caller finished
    (its contributors' mask ``contrib`` and accepted ``mass``)."""
    _reduce_part(blk, off, m, dst, rnd, kind, contrib, mass)


@njit(cache=True, nogil=True)
def eager_reduce_scatter_f32(blk, pl, src, stride, dst, rnd, weight):
    """A whole small reduce-scatter of plan ``pl`` in one call: ``world`` parts of
    ``k = pl[P_NELEM] / world`` float32, rank r's at ``src + 4 * stride * r``, into this
    rank's eager slot, published with FLAG_SCATTER and mass ``weight``; the arrival spin
    and validation; then this rank's part of the sum into the ``k`` float32 at ``dst``
    (``reduce_part``). ``stride`` is ``k`` for a whole input; a chunk of a larger one
    takes the chunk of each part. Codes as ``rounds.eager_round``'s."""
    eager, info, mass = _call_views(blk)[3:6]
    _put_schema(blk, pl, eager, rnd)
    world = blk[C_WORLD]
    k = pl[P_NELEM] // world
    off = pl[P_NWORDS] * 8
    base = (2 * blk[C_ME] + (rnd & 1)) * blk[C_SLOT_BYTES] + off
    slot = eager[base:base + 4 * k * world].view(np.uint32)
    for r in range(world):
        part = _f32_bits(src + 4 * stride * r, k)
        into = slot[r * k:(r + 1) * k]
        for i in range(k):
            into[i] = part[i]
    code = _publish_and_arrive(blk, pl, rnd, FLAG_SCATTER, weight)
    if code != OK:
        return code
    _reduce_part(blk, off, k, dst, rnd, pl[P_KIND], info[I_CONTRIB], mass[0])
    return OK


class PartCalls(NamedTuple):
    """The part collectives' compiled calls, typed once (``rounds.FusedCalls``' reason:
    numba's dispatch types every argument of every call). Arguments: 1-D C int64 arrays
    for the call block and the plan words; Python ints for the rest."""

    eager: Callable         # eager_gather_f32(blk, pl, src, dst, stride, rnd)
    copy_parts: Callable    # copy_parts(blk, off, n, src, dst, stride, rnd, contrib)
    #: eager_reduce_scatter_f32(blk, pl, src, stride, dst, rnd, weight); weight a float
    reduce_scatter: Callable
    #: reduce_part(blk, off, m, dst, rnd, kind, contrib, mass); mass a Python float
    reduce_part: Callable
    direct: Callable        # direct_gather_f32(blk, pl, src, dst, stride, rnd, iov)
    #: read_parts(blk, off, n, src, dst, stride, rnd, iov)
    read_parts: Callable


@functools.cache
def part_calls() -> PartCalls:
    """The part collectives' calls, compiled (or loaded from the cache) once per process."""
    words, i64, f64 = types.int64[::1], types.int64, types.float64
    return PartCalls(
        eager=eager_gather_f32.compile((words, words, i64, i64, i64, i64)),
        copy_parts=copy_parts.compile((words, i64, i64, i64, i64, i64, i64, i64)),
        reduce_scatter=eager_reduce_scatter_f32.compile((words, words, i64, i64, i64, i64,
                                                         f64)),
        reduce_part=reduce_part.compile((words, i64, i64, i64, i64, i64, i64, f64)),
        direct=direct_gather_f32.compile((words, words, i64, i64, i64, i64, words)),
        read_parts=read_parts.compile((words, i64, i64, i64, i64, i64, i64, words)))


def warm_up() -> None:
    part_calls()

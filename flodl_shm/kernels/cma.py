"""Cross-memory attach: a rank reads and writes a peer process's private memory.

Linux's ``process_vm_readv`` / ``process_vm_writev`` copy between two address spaces
in one pass, with no shared-memory staging in between. They need the same permission
as ``ptrace`` attach (same user; under Yama's ``ptrace_scope`` 1 only a descendant or
a declared tracer), which ``engine/direct.py`` verifies once per cohort before it
relies on them. Within one process (ranks run as threads) they read the process's own
memory, which is always allowed.

The calls are bound by symbol name (resolved when the compiled code is loaded), not
by address, so the kernels stay cacheable across processes.

``reduce_slice_direct`` is the whole reduce of one rank's slice of a direct round:
for each cache-sized chunk it reads every contributor's chunk (its own from memory,
the peers' through ``process_vm_readv``), sums them in rank order with each rank's
scale, and writes the result into its own destination and, through
``process_vm_writev``, into every peer's; or, when every peer's tensors lie in memory
this process has mapped (their shared parameter blocks), with plain loads and stores.
``broadcast_slice_direct`` is a direct broadcast's share of one rank: it copies one
slice of the root's tensors into every reader's, so every rank moves 1/world of the
bytes (a reader alone would move all of them). ``deliver_broadcast`` is a direct
broadcast's steps after its arrival wait (REDUCED and DONE of ``engine/direct.py``) in
one call, and ``direct_broadcast_f32`` the whole round of one float32 tensor: its
Python steps cost about 20 µs a round, more than the copies of a 256 KiB tensor.
``direct_reduce_f32`` is the whole direct reduce of float32 tensors in one call: its
Python steps took about 25 µs of an 84 µs round of 512 KiB on 2 ranks.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .atomics import bind_libc, fetch_add, load_acquire, store_release
from .codes import NOT_ROOT, OK, PEERS_MAPPED, SLICES_PENDING, UNREACHABLE
from .control_block import (FLAG_DIRECT, G_DOORBELL, G_SLEEPERS, GLOBAL_WORDS, H_SCALE,
                            R_DONE, R_PARAMS_BASE, R_PARAMS_BYTES, R_PID, RANK_WORDS)
from .rounds import (C_ME, C_SLOT_BYTES, C_SPIN, C_WORLD, I_ACCEPTED, I_CONTRIB, I_CULPRIT,
                     P_KIND, P_NELEM, P_NWORDS, P_WORDS, _call_views, _hdr,
                     _publish_and_arrive, _put_schema)
from .signals import spin_slices
from .tensorio import f32_at

#: whether this platform has cross-memory attach at all
AVAILABLE = bind_libc("process_vm_readv", "process_vm_writev")

#: f32 elements per chunk: a chunk and its accumulator stay in L2 between the reads,
#: the sum and the writes
CHUNK = 1 << 16
#: f32 elements per chunk of a mapped reduce (no staging copy: the accumulator alone
#: stays in L1/L2 between the reads and the writes)
MAPPED_CHUNK = 1 << 14
#: f32 elements up to which a broadcast's root copies its own result (not its tensors:
#: ``broadcast_from_root``) whole, then delivers a slice half a reader's
#: (``_root_light_slice``), where each rank would otherwise deliver an equal one and the
#: readers would write the root's result too. 2 ranks, medians within the ranks
#: (BENCHMARKS.md, "Fifty-first session"): 256 KiB 27-29 -> 21-22 µs (a quiet stretch),
#: 1 MiB 97-132 -> 66-92, 4 MiB 305-335 -> 274, 16 MiB 1,742-1,849 -> 1,647-1,858; at
#: 64 MiB, where every copy runs at the memory bus's speed, the root's whole copy is
#: slower (8.4-8.8 -> 9.0-9.5 ms)
ROOT_WHOLE_MAX = 1 << 22
#: pieces of tensors one chunk of a direct reduce gathers, so that one call per peer
#: and direction moves the chunk of a round of many small tensors (a call per tensor
#: cost about 1.5 µs each: 16 tensors of 16 KiB on 2 ranks, BENCHMARKS.md "Forty-fifth
#: session")
MAX_PIECES = 64
#: int64 words of the scratch ``iov`` array: up to ``MAX_PIECES`` local iovecs (address,
#: bytes), then as many remote ones
IOV_WORDS = 4 * MAX_PIECES
#: byte offset of the remote iovecs in ``iov``
_REMOTE = 16 * MAX_PIECES


def _vm_call(name):
    @intrinsic
    def call(typingctx, pid, local_iov, nlocal, remote_iov, nremote):
        sig = types.int64(pid, local_iov, nlocal, remote_iov, nremote)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(i64, [ir.IntType(32), i64, i64, i64, i64, i64])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            pid32 = builder.trunc(args[0], ir.IntType(32))
            return builder.call(fn, [pid32, args[1], args[2], args[3], args[4],
                                     ir.Constant(i64, 0)])

        return sig, codegen

    return call


_readv = _vm_call("process_vm_readv")
_writev = _vm_call("process_vm_writev")


@njit(inline="always")
def _transfer(write, pid, local, remote, nbytes, iov):
    """Copy ``nbytes`` between local address ``local`` and ``pid``'s ``remote``;
    True when every byte moved."""
    iov[0] = local
    iov[1] = nbytes
    iov[2 * MAX_PIECES] = remote
    iov[2 * MAX_PIECES + 1] = nbytes
    return _call(write, pid, iov, 1, 1) == nbytes


@njit(inline="always")
def _call(write, pid, iov, nlocal, nremote):
    """One ``process_vm_writev`` (``write``) or ``process_vm_readv`` of the first
    ``nlocal`` local and ``nremote`` remote iovecs of ``iov``; the bytes moved."""
    a = iov.ctypes.data
    if write:
        return _writev(np.int64(pid), a, np.int64(nlocal), a + _REMOTE, np.int64(nremote))
    return _readv(np.int64(pid), a, np.int64(nlocal), a + _REMOTE, np.int64(nremote))


@njit(cache=True, nogil=True)
def probe(pid, addr, iov, word):
    """Read, then write back, the 8-byte word at ``pid``'s ``addr`` (its probe word,
    which nothing else touches): 1 when both directions are permitted, else 0."""
    if not _transfer(False, pid, word.ctypes.data, addr, 8, iov):
        return 0
    if not _transfer(True, pid, word.ctypes.data, addr, 8, iov):
        return 0
    return 1


@njit(inline="always")
def _spans(numels, start, stop):
    """The parts of frame elements [start, stop) that each tensor holds (the frame is the
    tensors end to end, ``numels`` elements each): rows of (tensor, first, end) in the
    tensor's own element indices, tensors the slice misses left out."""
    nt = numels.shape[0]
    out = np.empty((nt, 3), np.int64)
    k = 0
    off = 0
    for t in range(nt):
        n = numels[t]
        a = max(start, off) - off
        b = min(stop, off + n) - off
        off += n
        if b > a:
            out[k, 0] = t
            out[k, 1] = a
            out[k, 2] = b
            k += 1
    return out[:k]


@njit(inline="always")
def _row_in_block(srcs, dsts, i, numels, lo, size):
    """Whether row ``i`` of a direct round's address tables (``srcs``/``dsts``, a row of
    ``numels.shape[0]`` tensors per rank) lies in the ``size`` bytes of a shared
    parameter block at ``lo``, sources and destinations (an empty tensor's address is 0:
    it reads nothing, wherever it points)."""
    nt = numels.shape[0]
    for t in range(nt):
        s, d, n = srcs[i * nt + t], dsts[i * nt + t], 4 * numels[t]
        if n and not (lo <= s and lo <= d and s + n <= lo + size and d + n <= lo + size):
            return False
    return size > 0


@njit(cache=True, nogil=True)
def row_in_block(srcs, dsts, i, numels, lo, size):
    """``_row_in_block`` for the Python steps of a direct round (``DirectRounds``)."""
    return _row_in_block(srcs, dsts, i, numels, lo, size)


@njit(inline="always")
def _next_chunk(spans, k, pos, ch, pieces):
    """The next chunk of a slice's ``spans`` (``_spans``), from span ``k`` at element
    ``pos`` of its tensor: up to ``ch`` elements in up to ``MAX_PIECES`` pieces of
    tensors, written to ``pieces`` as rows of (tensor, first element, elements). Returns
    the span and element after it, the pieces and their elements."""
    ns = spans.shape[0]
    npc = 0
    total = 0
    while k < ns and npc < MAX_PIECES and total < ch:
        m = min(spans[k, 2] - pos, ch - total)
        pieces[npc, 0] = spans[k, 0]
        pieces[npc, 1] = pos
        pieces[npc, 2] = m
        npc += 1
        total += m
        pos += m
        if pos == spans[k, 2]:
            k += 1
            if k < ns:
                pos = spans[k, 1]
    return k, pos, npc, total


@njit(inline="always")
def _accumulate(acc, src, m, s, first):
    """``acc[:m] (=|+=) f32(src[:m] * s)``: one rank's chunk into the running sum, in
    rank order (``first``: the first rank of the sum)."""
    if first:
        if s == 1.0:
            for i in range(m):
                acc[i] = src[i]
        else:
            for i in range(m):
                acc[i] = src[i] * s
    elif s == 1.0:
        for i in range(m):
            acc[i] += src[i]
    else:
        for i in range(m):
            acc[i] += src[i] * s


@njit(cache=True, nogil=True)
def reduce_slice_direct(me, pids, srcs, dsts, scales, numels, start, stop, inv, acc, tmp, iov,
                        mapped):
    """Reduce elements [start, stop) of a direct round and deliver them to every rank.

    ``pids`` (int64, one per accepted rank in rank order; ``me`` indexes this rank),
    ``srcs``/``dsts`` (int64, ``len(pids) x ntensors`` addresses, row per rank),
    ``scales`` (f64 per rank), ``numels`` (int64 per tensor). Element k of the frame is
    element k - offset of the tensor that holds it. The result is
    ``(sum over ranks in order of f32(x * scale)) * inv`` in f32: bit-identical to the
    shared-memory path, which scales at copy-in and sums in rank order. Returns -1 on
    success, else the index (into ``pids``) of the rank whose memory could not be read
    or written.

    ``mapped``: every address is this process's (the peers' tensors lie in shared
    parameter blocks mapped here): plain loads and stores, no calls, no staging copy.
    A chunk of every source is read before that chunk of any destination is written,
    so in place is safe either way.
    """
    nr = pids.shape[0]
    nt = numels.shape[0]
    ch = acc.shape[0]
    f = np.float32(inv)
    spans = _spans(numels, start, stop)
    pieces = np.empty((MAX_PIECES, 3), np.int64)
    k = 0
    pos = spans[0, 1] if spans.shape[0] else 0
    while k < spans.shape[0]:  # a chunk at a time, its pieces end to end in ``acc``
        k, pos, npc, total = _next_chunk(spans, k, pos, ch, pieces)
        for r in range(nr):
            s = np.float32(scales[r])
            if mapped or r == me:
                off = 0
                for p in range(npc):
                    t, c0, m = pieces[p, 0], pieces[p, 1], pieces[p, 2]
                    _accumulate(f32_at(acc.ctypes.data + 4 * off, m),
                                f32_at(srcs[r * nt + t] + 4 * c0, m), m, s, r == 0)
                    off += m
            else:  # the chunk's pieces of rank r's sources, end to end into tmp: one call
                iov[0] = tmp.ctypes.data
                iov[1] = 4 * total
                for p in range(npc):
                    iov[2 * MAX_PIECES + 2 * p] = srcs[r * nt + pieces[p, 0]] + 4 * pieces[p, 1]
                    iov[2 * MAX_PIECES + 2 * p + 1] = 4 * pieces[p, 2]
                if _call(False, pids[r], iov, 1, npc) != 4 * total:
                    return r
                _accumulate(acc, tmp, total, s, r == 0)
        off = 0
        for p in range(npc):
            t, c0, m = pieces[p, 0], pieces[p, 1], pieces[p, 2]
            out = f32_at(dsts[me * nt + t] + 4 * c0, m)
            part = f32_at(acc.ctypes.data + 4 * off, m)
            for i in range(m):
                out[i] = part[i] * f
            iov[2 * p] = out.ctypes.data  # (this rank's pieces: the writes' local iovecs)
            iov[2 * p + 1] = 4 * m
            off += m
        for r in range(nr):
            if r == me:
                continue
            if mapped:
                for p in range(npc):
                    t, c0, m = pieces[p, 0], pieces[p, 1], pieces[p, 2]
                    out = f32_at(dsts[me * nt + t] + 4 * c0, m)
                    peer = f32_at(dsts[r * nt + t] + 4 * c0, m)
                    for i in range(m):
                        peer[i] = out[i]
                continue
            for p in range(npc):
                iov[2 * MAX_PIECES + 2 * p] = dsts[r * nt + pieces[p, 0]] + 4 * pieces[p, 1]
                iov[2 * MAX_PIECES + 2 * p + 1] = 4 * pieces[p, 2]
            if _call(True, pids[r], iov, npc, npc) != 4 * total:
                return r
    return -1


@njit(cache=True, nogil=True)
def broadcast_slice_direct(me, root, pids, srcs, dsts, numels, start, stop, iov, root_whole):
    """Deliver elements [start, stop) of a direct broadcast to every reader.

    ``pids`` (int64, one per accepted rank in rank order; ``me`` and ``root`` index it),
    ``srcs`` (int64, the root's ``ntensors`` source addresses, in its process),
    ``dsts`` (int64, ``len(pids) x ntensors`` destination addresses, row per rank),
    ``numels`` (int64 per tensor). A reader first reads each chunk of the root's
    sources into its own destination (``process_vm_readv``); the root uses its source.
    Either then writes that chunk into every other rank's destination
    (``process_vm_writev``; the root's own with a plain copy), while it is still in
    cache. A chunk gathers the pieces of up to ``MAX_PIECES`` small tensors: one call per
    peer and direction moves them all. A root's destination that is its source (an
    in-place broadcast) is not written, nor any root's destination when ``root_whole``
    (the root copies it whole itself). Bits are copied, never computed (a signaling NaN
    stays signaling). Returns -1 on success, else the index (into ``pids``) of the rank
    whose memory could not be read or written.
    """
    nr = pids.shape[0]
    nt = numels.shape[0]
    spans = _spans(numels, start, stop)
    pieces = np.empty((MAX_PIECES, 3), np.int64)
    local = np.empty(MAX_PIECES, np.int64)  # (the root's source, a reader's destination)
    k = 0
    pos = spans[0, 1] if spans.shape[0] else 0
    while k < spans.shape[0]:
        k, pos, npc, total = _next_chunk(spans, k, pos, CHUNK, pieces)
        for p in range(npc):
            t, c0 = pieces[p, 0], pieces[p, 1]
            local[p] = (srcs[t] if me == root else dsts[me * nt + t]) + 4 * c0
        if me != root:  # the chunk's pieces of the root's sources into this reader's own
            for p in range(npc):
                iov[2 * p] = local[p]
                iov[2 * MAX_PIECES + 2 * p] = srcs[pieces[p, 0]] + 4 * pieces[p, 1]
                iov[2 * p + 1] = iov[2 * MAX_PIECES + 2 * p + 1] = 4 * pieces[p, 2]
            if _call(False, pids[root], iov, npc, npc) != 4 * total:
                return root
        for r in range(nr):
            if r == me and r != root:
                continue  # (a reader's own: read into it above)
            q = 0  # the pieces rank r takes from this rank, and their bytes
            nbytes = 0
            for p in range(npc):
                t, c0, m = pieces[p, 0], pieces[p, 1], pieces[p, 2]
                if r == root and (root_whole or dsts[root * nt + t] == srcs[t]):
                    continue
                remote = dsts[r * nt + t] + 4 * c0
                if r == me:  # the root's own result
                    _copy_bits(local[p], remote, m)
                    continue
                iov[2 * q] = local[p]
                iov[2 * MAX_PIECES + 2 * q] = remote
                iov[2 * q + 1] = iov[2 * MAX_PIECES + 2 * q + 1] = 4 * m
                q += 1
                nbytes += 4 * m
            if q and _call(True, pids[r], iov, q, q) != nbytes:
                return r
    return -1


@njit(inline="always")
def _copy_bits(src, dst, n):
    """Copy ``n`` f32 elements from address ``src`` to address ``dst``, bit for bit."""
    s = f32_at(src, n).view(np.uint32)
    d = f32_at(dst, n).view(np.uint32)
    for i in range(n):
        d[i] = s[i]


@njit(inline="always")
def _slice_of(nelem, parts, index):
    """``arena.slice_bounds(nelem, parts, index)``: slices of whole 16-element (64-byte)
    lines, the last one taking the remainder."""
    per = ((nelem + parts * 16 - 1) // (parts * 16)) * 16 if nelem else 0
    start = min(nelem, index * per)
    stop = nelem if index == parts - 1 else min(nelem, start + per)
    return start, stop


@njit(inline="always")
def _root_light_slice(nelem, world, reader, is_root):
    """The slice a rank delivers in a broadcast whose root copies its own result whole:
    ``world`` ranks share ``2 * world - 1`` parts of whole 16-element lines, the root one
    (the first), each reader two (``reader``: its index among the readers), the last one
    taking the remainder. On 2 ranks the root copies all of its result and writes a
    third of it to the reader, which reads two thirds: a plain copy costs about a third of
    a cross-memory copy of the same bytes here, so both finish at about the same time."""
    parts = 2 * world - 1
    if is_root:
        return _slice_of(nelem, parts, 0)
    start = _slice_of(nelem, parts, 1 + 2 * reader)[0]
    return start, _slice_of(nelem, parts, 2 + 2 * reader)[1]


@njit(inline="always")
def _done(blk, ctl, ctl32, rnd):
    """DONE of a direct round's compiled call: publish this rank's done word, ring the
    doorbell, and spin for every slice. OK, or SLICES_PENDING (peers sleep, or a slice is
    still missing: the caller wakes them and waits the blocking way)."""
    me = blk[C_ME]
    store_release(ctl, GLOBAL_WORDS + me * RANK_WORDS + R_DONE, rnd)
    fetch_add(ctl32, 2 * G_DOORBELL, 1)
    if load_acquire(ctl, G_SLEEPERS) > 0:
        return SLICES_PENDING
    if spin_slices(ctl, blk[C_WORLD], rnd, me, blk[C_SPIN]) != OK:
        return SLICES_PENDING
    return OK


@njit(inline="always")
def _deliver(blk, off, numels, rnd, root, accepted, iov):
    """``deliver_broadcast``'s body (see it)."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    world = blk[C_WORLD]
    me = blk[C_ME]
    slot_bytes = blk[C_SLOT_BYTES]
    nt = numels.shape[0]
    par = rnd & 1
    k = 0
    for r in range(world):
        k += (accepted >> r) & 1
    ranks = np.empty(k, np.int64)
    pids = np.empty(k, np.int64)
    dsts = np.empty(k * nt, np.int64)
    i = 0
    mine = 0
    from_root = 0
    for r in range(world):
        if not (accepted >> r) & 1:
            continue
        ranks[i] = r
        pids[i] = ctl[GLOBAL_WORDS + r * RANK_WORDS + R_PID]
        b = (2 * r + par) * slot_bytes + off
        table = eager[b:b + 16 * nt].view(np.int64)
        for t in range(nt):
            dsts[i * nt + t] = table[nt + t]
        if r == me:
            mine = i
        if r == root:
            from_root = i
        i += 1
    b = (2 * root + par) * slot_bytes + off
    srcs = eager[b:b + 8 * nt].view(np.int64)  # (rewritten in round rnd + 2 only)
    nelem = 0
    apart = False  # the root's destinations are not its sources: a result of its own
    for t in range(nt):
        nelem += numels[t]
        apart |= dsts[from_root * nt + t] != srcs[t]
    root_whole = apart and nelem <= ROOT_WHOLE_MAX
    if not root_whole:  # every rank delivers a slice (the root's: from its tensors)
        start, stop = _slice_of(nelem, world, me)
    else:  # the root copies its own result whole, and delivers a lighter slice
        if me == root:
            for t in range(nt):
                if dsts[mine * nt + t] != srcs[t]:
                    _copy_bits(srcs[t], dsts[mine * nt + t], numels[t])
        start, stop = _root_light_slice(nelem, world, me if me < root else me - 1,
                                        me == root)
    bad = broadcast_slice_direct(mine, from_root, pids, srcs, dsts, numels, start, stop, iov,
                                 root_whole)
    if bad >= 0:
        info[I_CULPRIT] = ranks[bad]
        return UNREACHABLE
    return _done(blk, ctl, ctl32, rnd)


@njit(cache=True, nogil=True)
def deliver_broadcast(blk, off, numels, rnd, root, accepted, iov):
    """A direct broadcast's REDUCED and DONE (``engine/direct.py``) for the engine's call
    block ``blk``, after round ``rnd``'s arrival wait accepted the ranks of ``accepted``
    (a mask; local rank ``root`` among them, its only contributor): read every accepted
    rank's address table (``off`` bytes into its eager slot of the round's parity: the
    sources, then the destinations of tensors of ``numels`` elements) and its pid,
    deliver this rank's slice (``broadcast_slice_direct``), publish done[me] = ``rnd``
    and spin for every slice. Returns OK (every slice delivered), UNREACHABLE (a peer's
    memory could not be reached; its rank in ``blk``'s I_CULPRIT word; the done word is
    not published) or SLICES_PENDING (done published; peers sleep or a slice is still
    missing: the caller wakes them and waits the blocking way)."""
    return _deliver(blk, off, numels, rnd, root, accepted, iov)


@njit(cache=True, nogil=True)
def direct_broadcast_f32(blk, pl, src, dst, rnd, flags, root, iov):
    """A whole direct broadcast of ONE contiguous float32 tensor of plan ``pl`` (the
    words of ``rounds``) from local rank ``root``, in one call: the plan's schema words
    in this rank's eager slot when they are not there yet, then its address table (the
    source at ``src``: the root's tensor, ignored elsewhere; the destination at
    ``dst``), its scale 1.0 and its header with ``flags`` (FLAG_DIRECT | FLAG_BROADCAST,
    FLAG_ELIDED on a reader), published; the arrival spin and validation; then
    ``deliver_broadcast``. Codes: the arrival's as ``rounds.eager_round``'s (this rank
    published; the caller finishes the wait and delivers), NOT_ROOT when the arrivals
    name another contributor set than ``root`` (the caller raises), else
    ``deliver_broadcast``'s."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    _put_schema(blk, pl, eager, rnd)
    me = blk[C_ME]
    nwords = pl[P_NWORDS]
    b = (2 * me + (rnd & 1)) * blk[C_SLOT_BYTES] + nwords * 8
    table = eager[b:b + 16].view(np.int64)
    table[0] = src
    table[1] = dst
    ctl_f64[_hdr(me, rnd) + H_SCALE] = 1.0
    code = _publish_and_arrive(blk, pl, rnd, flags, 0.0)
    if code != OK:
        return code
    if info[I_CONTRIB] != 1 << root:
        return NOT_ROOT
    # the tensor's element count, from the plan's address table (addresses, counts, ...)
    counts = P_WORDS + nwords + 1
    return _deliver(blk, nwords * 8, pl[counts:counts + 1], rnd, root, info[I_ACCEPTED], iov)


@njit(cache=True, nogil=True)
def direct_reduce_f32(blk, pl, srcs_in, dsts_in, rnd, weight, scale, keep_on_empty, acc, tmp,
                      iov, maps):
    """A whole direct reduce of the contiguous float32 tensors of plan ``pl`` in one call
    (``engine/direct.py``): the plan's schema words in this rank's eager slot when they
    are not there yet, its address table (the sources at ``srcs_in``, the destinations
    at ``dsts_in``: the same addresses in place), its ``scale`` and its header with
    FLAG_DIRECT and mass ``weight``, published; the arrival spin and validation; then,
    unless the round accepted no mass and ``keep_on_empty`` (a MODEL round in place: the
    tensors stay), this rank's slice reduced out of every accepted rank's sources into
    every accepted rank's destinations (``reduce_slice_direct``, the scratch ``acc``/
    ``tmp`` of ``CHUNK`` elements), its done word and the spin for every slice.

    ``maps`` holds, for each local rank r, this process's mapping of r's shared
    parameter block: its address (0: not mapped) and bytes at ``2r`` and ``2r + 1``; its
    last word counts the rounds reduced through them. When every peer's tensors lie in
    its block and the mappings cover the blocks, the slice is reduced through them with
    plain loads and stores (``MAPPED_CHUNK`` elements a chunk).

    Codes: the arrival's as ``rounds.eager_round``'s (this rank published; the caller
    finishes the wait and the round); PEERS_MAPPED (arrived: every peer's tensors lie in
    its shared parameter block, which ``maps`` does not cover: the caller maps it);
    UNREACHABLE (a peer's memory could not be reached; its rank in I_CULPRIT; the done
    word is not published), SLICES_PENDING (done published, the slices not all: the
    caller wakes the sleepers and waits), else OK."""
    ctl, ctl_f64, ctl32, eager, info, mass = _call_views(blk)
    _put_schema(blk, pl, eager, rnd)
    me = blk[C_ME]
    world = blk[C_WORLD]
    slot_bytes = blk[C_SLOT_BYTES]
    nwords = pl[P_NWORDS]
    nt = srcs_in.shape[0]
    par = rnd & 1
    b = (2 * me + par) * slot_bytes + nwords * 8
    table = eager[b:b + 16 * nt].view(np.int64)
    for t in range(nt):
        table[t] = srcs_in[t]
        table[nt + t] = dsts_in[t]
    ctl_f64[_hdr(me, rnd) + H_SCALE] = scale
    code = _publish_and_arrive(blk, pl, rnd, FLAG_DIRECT, weight)
    if code != OK:
        return code
    m = mass[0]
    kind = pl[P_KIND]
    if keep_on_empty and kind == 0 and not m > 0.0:
        return OK
    inv = 1.0
    if kind == 0 and m > 0.0:
        inv = np.float64(np.float32(1.0 / m))  # (the reciprocal RoundView.inv holds)
    accepted = info[I_ACCEPTED]
    k = 0
    for r in range(world):
        k += (accepted >> r) & 1
    ranks = np.empty(k, np.int64)
    pids = np.empty(k, np.int64)
    scales = np.empty(k, np.float64)
    srcs = np.empty(k * nt, np.int64)
    dsts = np.empty(k * nt, np.int64)
    counts = P_WORDS + nwords + nt  # the tensors' element counts, in the plan's table
    numels = pl[counts:counts + nt]
    i = 0
    mine = 0
    in_blocks = k > 1
    covered = True
    for r in range(world):
        if not (accepted >> r) & 1:
            continue
        base_r = GLOBAL_WORDS + r * RANK_WORDS
        ranks[i] = r
        pids[i] = ctl[base_r + R_PID]
        scales[i] = ctl_f64[_hdr(r, rnd) + H_SCALE]
        o = (2 * r + par) * slot_bytes + nwords * 8
        row = eager[o:o + 16 * nt].view(np.int64)
        for t in range(nt):
            srcs[i * nt + t] = row[t]
            dsts[i * nt + t] = row[nt + t]
        if r == me:
            mine = i
        elif in_blocks:
            lo, size = ctl[base_r + R_PARAMS_BASE], ctl[base_r + R_PARAMS_BYTES]
            in_blocks = _row_in_block(srcs, dsts, i, numels, lo, size)
            covered = covered and maps[2 * r] != 0 and size <= maps[2 * r + 1]
        i += 1
    if in_blocks:
        if not covered:
            return PEERS_MAPPED
        for i in range(k):
            r = ranks[i]
            if r != me:
                shift = maps[2 * r] - ctl[GLOBAL_WORDS + r * RANK_WORDS + R_PARAMS_BASE]
                for t in range(nt):
                    srcs[i * nt + t] += shift
                    dsts[i * nt + t] += shift
        maps[2 * world] += 1
        acc = acc[:MAPPED_CHUNK]
    start, stop = _slice_of(pl[P_NELEM], world, me)
    bad = reduce_slice_direct(mine, pids, srcs, dsts, scales, numels, start, stop, inv, acc,
                              tmp, iov, in_blocks)
    if bad >= 0:
        info[I_CULPRIT] = ranks[bad]
        return UNREACHABLE
    return _done(blk, ctl, ctl32, rnd)


class DirectCalls(NamedTuple):
    """The direct broadcast's compiled calls, typed once (``rounds.FusedCalls``' reason:
    numba's dispatch types every argument of every call). Arguments of exactly these
    types: 1-D C int64 arrays for the call block, plan words, ``numels`` and ``iov``;
    Python ints for the rest."""

    deliver: Callable    # deliver_broadcast(blk, off, numels, rnd, root, accepted, iov)
    broadcast_f32: Callable  # direct_broadcast_f32(blk, pl, src, dst, rnd, flags, root, iov)
    #: direct_reduce_f32(blk, pl, srcs, dsts, rnd, weight, scale, keep_on_empty, acc, tmp,
    #: iov, maps); ``srcs``/``dsts``/``maps`` 1-D C int64 arrays, ``weight``, ``scale``
    #: Python floats, ``keep_on_empty`` a bool, ``acc``/``tmp`` 1-D C float32 arrays
    reduce_f32: Callable


@functools.cache
def direct_calls() -> DirectCalls:
    """The direct broadcast's calls, compiled (or loaded from the cache) once per
    process."""
    words, i64, f32s = types.int64[::1], types.int64, types.float32[::1]
    return DirectCalls(
        deliver=deliver_broadcast.compile((words, i64, words, i64, i64, i64, words)),
        broadcast_f32=direct_broadcast_f32.compile((words, words, i64, i64, i64, i64, i64,
                                                    words)),
        reduce_f32=direct_reduce_f32.compile((words, words, words, words, i64, types.float64,
                                              types.float64, types.boolean, f32s, f32s,
                                              words, words)))


def warm_up() -> None:
    import os

    iov = np.zeros(IOV_WORDS, np.int64)
    word = np.zeros(1, np.int64)
    probe(os.getpid(), word.ctypes.data, iov, np.zeros(1, np.int64))
    x = np.ones(8, np.float32)
    y = np.zeros(8, np.float32)
    pids = np.array([os.getpid(), os.getpid()], np.int64)
    srcs = np.array([x.ctypes.data, x.ctypes.data], np.int64)
    dsts = np.array([y.ctypes.data, y.ctypes.data], np.int64)
    for mapped in (False, True):
        reduce_slice_direct(0, pids, srcs, dsts, np.ones(2), np.array([8], np.int64), 0, 8,
                            0.5, np.zeros(4, np.float32), np.zeros(4, np.float32), iov, mapped)
    broadcast_slice_direct(1, 0, pids, srcs[:1], dsts, np.array([8], np.int64), 0, 8, iov,
                           False)
    row_in_block(srcs, dsts, 1, np.array([8], np.int64), int(x.ctypes.data), 32)
    direct_calls()

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
bytes (a reader alone would move all of them).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .atomics import bind_libc
from .tensorio import f32_at

#: whether this platform has cross-memory attach at all
AVAILABLE = bind_libc("process_vm_readv", "process_vm_writev")

#: f32 elements per chunk: a chunk and its accumulator stay in L2 between the reads,
#: the sum and the writes
CHUNK = 1 << 16
#: int64 words of the scratch ``iov`` array: two iovecs (local, remote)
IOV_WORDS = 4


def _vm_call(name):
    @intrinsic
    def call(typingctx, pid, local_iov, remote_iov):
        sig = types.int64(pid, local_iov, remote_iov)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(i64, [ir.IntType(32), i64, i64, i64, i64, i64])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            one = ir.Constant(i64, 1)
            pid32 = builder.trunc(args[0], ir.IntType(32))
            return builder.call(fn, [pid32, args[1], one, args[2], one, ir.Constant(i64, 0)])

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
    iov[2] = remote
    iov[3] = nbytes
    a = iov.ctypes.data
    if write:
        got = _writev(np.int64(pid), a, a + 16)
    else:
        got = _readv(np.int64(pid), a, a + 16)
    return got == nbytes


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
    for k in range(spans.shape[0]):
        t, a, b = spans[k, 0], spans[k, 1], spans[k, 2]
        for c0 in range(a, b, ch):
            m = min(c0 + ch, b) - c0
            for r in range(nr):
                s = np.float32(scales[r])
                if mapped or r == me:
                    src = f32_at(srcs[r * nt + t] + 4 * c0, m)
                else:
                    if not _transfer(False, pids[r], tmp.ctypes.data, srcs[r * nt + t] + 4 * c0,
                                     4 * m, iov):
                        return r
                    src = tmp
                _accumulate(acc, src, m, s, r == 0)
            out = f32_at(dsts[me * nt + t] + 4 * c0, m)
            for i in range(m):
                out[i] = acc[i] * f
            for r in range(nr):
                if r == me:
                    continue
                if mapped:
                    peer = f32_at(dsts[r * nt + t] + 4 * c0, m)
                    for i in range(m):
                        peer[i] = out[i]
                elif not _transfer(True, pids[r], out.ctypes.data, dsts[r * nt + t] + 4 * c0,
                                   4 * m, iov):
                    return r
    return -1


@njit(cache=True, nogil=True)
def broadcast_slice_direct(me, root, pids, srcs, dsts, numels, start, stop, iov):
    """Deliver elements [start, stop) of a direct broadcast to every reader.

    ``pids`` (int64, one per accepted rank in rank order; ``me`` and ``root`` index it),
    ``srcs`` (int64, the root's ``ntensors`` source addresses, in its process),
    ``dsts`` (int64, ``len(pids) x ntensors`` destination addresses, row per rank),
    ``numels`` (int64 per tensor). A reader first reads each chunk of the root's
    sources into its own destination (``process_vm_readv``); the root uses its source.
    Either then writes that chunk into every other rank's destination
    (``process_vm_writev``; the root's own with a plain copy), while it is still in
    cache. A root's destination that is its source (an in-place broadcast) is not
    written. Bits are copied, never computed (a signaling NaN stays signaling). Returns
    -1 on success, else the index (into ``pids``) of the rank whose memory could not be
    read or written.
    """
    nr = pids.shape[0]
    nt = numels.shape[0]
    spans = _spans(numels, start, stop)
    for k in range(spans.shape[0]):
        t, a, b = spans[k, 0], spans[k, 1], spans[k, 2]
        root_dst = dsts[root * nt + t]
        for c0 in range(a, b, CHUNK):
            n = min(c0 + CHUNK, b) - c0
            if me == root:
                local = srcs[t] + 4 * c0
            else:
                local = dsts[me * nt + t] + 4 * c0
                if not _transfer(False, pids[root], local, srcs[t] + 4 * c0, 4 * n, iov):
                    return root
            for r in range(nr):
                if r == me and r != root:
                    continue  # (a reader's own: read into it above)
                remote = dsts[r * nt + t] + 4 * c0
                if r == root and root_dst == srcs[t]:
                    continue  # in place: the root's tensor is the source
                if r == me:  # the root's own result
                    _copy_bits(local, remote, n)
                elif not _transfer(True, pids[r], local, remote, 4 * n, iov):
                    return r
    return -1


@njit(inline="always")
def _copy_bits(src, dst, n):
    """Copy ``n`` f32 elements from address ``src`` to address ``dst``, bit for bit."""
    s = f32_at(src, n).view(np.uint32)
    d = f32_at(dst, n).view(np.uint32)
    for i in range(n):
        d[i] = s[i]


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
    broadcast_slice_direct(1, 0, pids, srcs[:1], dsts, np.array([8], np.int64), 0, 8, iov)

"""Direct rounds: large reduces that move data between the ranks' private tensors.

A bulk round of the shared-memory path (``protocol.py``) passes every byte through
shared memory three times: each rank copies its tensor into its bulk region, the
slice reducers write the result region, every rank copies the result back out. A
**direct round** skips the shared copies: rank j reads slice j of every contributor's
tensor straight from that process (``process_vm_readv``, ``kernels/cma.py``), sums it
chunk by chunk in cache, and writes the result into its own destination and into
every peer's (``process_vm_writev``). Per rank that is about one read and one write of
the tensor, where the shared path costs about two of each.

Who may use it
==============

Direct rounds need two things the shared path does not:

- **A dead rank stops the cohort.** The shared path keeps every contribution in
  shared memory until all slices are done, so a survivor can re-reduce a dead rank's
  slice. A direct round's contributions live in private memory that dies with its
  process, so it runs only in arenas whose owner declared that a death ends the
  cohort (``Arena.create(direct=True)``: ``spawn`` with ``max_failures=0``, the c10d
  backend); ``FLODL_SHM_DIRECT=0`` in the owner's environment turns it off.
- **Permission to attach.** The calls need ptrace-attach rights between the ranks.
  Whether they have them is found out once, by a probe between two barriers
  (``Comm.settle_direct_rounds``, below): the first eligible round runs it before
  it starts, unless a caller ran it earlier (``LocalSGD``, which places its
  parameters in shared blocks only where rounds run direct). Every rank reaches the
  same verdict, and no round runs the shared path just to find out (it would grow
  the bulk and result regions to its size for the arena's life).

A round is eligible when every rank agrees on it from the round's schema alone: a
float32 wire, no outer-optimizer step, no checkpoint tap, one host (no relay), and a
payload of at least the arena's ``G_DIRECT_MIN`` (256 KiB; ``arena.direct_min_bytes``),
eager-sized or not (a reduce: such a plan is not ``RoundPlan.fused``), or at least its
``G_DIRECT_BROADCAST_MIN`` (32 KiB, or 1 MiB where ranks outnumber cores;
``arena.direct_broadcast_min_bytes``), eager-sized or not (a broadcast). The arena's
owner writes both words at creation (the environment variables
``FLODL_SHM_DIRECT_MIN_BYTES`` and ``FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES`` set them), so
ranks whose environments differ still agree. ``FLAG_DIRECT`` is in the agreed
flags, so ranks that disagreed would get a ``SchemaMismatchError``, never a torn result.

The states of one rank
======================

::

    UNPROBED   not settled yet.
       |       ``Comm.settle_direct_rounds`` (the first eligible round calls it, every
       |       rank agreeing that the round is eligible): after a barrier (every rank
       |       has published its pid and probe word) each rank reads and writes back
       |       every peer's private probe word (``R_PROBE``) and records the token round
       |       in R_DIRECT (or -(round + 1) on failure). After a second barrier each
       |       rank reads every rank's R_DIRECT: all equal to the token -> READY, else
       |       UNAVAILABLE. Same words, read after the same wait: the same verdict.
       v
    READY      eligible rounds are direct rounds; UNAVAILABLE: they stay shared.

One direct round ``N``
======================

::

    PUBLISHED  rank r writes, after its schema words in its eager slot of parity N%2,
       |       the addresses of its source tensors then of its destinations, its scale
       |       in H_SCALE, and publishes its header with FLAG_DIRECT (arrived[r] = N).
       |       No payload is copied anywhere.
    ARRIVED    every rank waits for every arrival (the arrival wait of protocol.py,
       |       with its validation); a MODEL round with no accepted mass ends here
       |       for the in-place call (every rank keeps its tensors).
    REDUCED    rank j reduces slice j of the frame (kernels/cma.py): for each chunk it
       |       reads the chunk of every accepted rank's source, in rank order, scales
       |       and sums it, multiplies by 1/mass, writes its own destination and every
       |       peer's. Then it publishes done[j] = N.
    DONE       every rank waits for every done[.] >= N, then returns: its destination
               holds every slice.

Why no rank reads or writes memory its owner is already reusing:

- rank r's source slice j is read only by rank j, before j publishes done[j]; its
  destination slice j is written only by rank j, before done[j]. Rank r leaves round
  N only after every done[.] >= N, so once its call returns nobody touches its
  tensors: the caller may overwrite them at once.
- In place (source = destination): rank j reads a chunk of every source before it
  writes that chunk of any destination, and nobody else touches slice j.
- The address table sits in the eager slot of the round's parity, rewritten in round
  N+2 only, after every rank finished N+1 (the eager double-buffering argument of
  ``protocol.py``).

MAPPED: tensors in shared parameter blocks
==========================================

A rank may keep the tensors it averages in its shared parameter block, the arena's
``p<r>`` segment (``Comm.shared_tensors``; ``LocalSGD`` does so where it pays), and
publishes the block's address and size in its ``R_PARAMS_BASE`` / ``R_PARAMS_BYTES``.
In REDUCED, a reducer whose accepted peers' address tables all point into their
blocks maps those blocks (once) and rewrites the tables as its own addresses of them;
``kernels.cma.reduce_slice_direct(..., mapped=True)`` then does the same reduce with
plain loads and stores: no calls, no page pinning, no staging copy. Any address
outside its rank's block sends the reducer through the calls instead, so ranks may
differ in placement and every reducer still computes the same bits. The protocol, its states and its
failure rules are the ones above: only where the bytes are read from changes.

A direct broadcast (FLAG_DIRECT | FLAG_BROADCAST, READY only) publishes the same
table; after the arrival wait rank j delivers slice j: a reader reads it from the
root's tensors straight into its own destination, the root takes it from its own
tensors, and either writes it into every other rank's destination (the root's too,
unless the root's destination is its source). Each rank moves
1/world of the bytes, where a reader that read everything alone would move all of
them. A root with a result of its own (``broadcast_from_root``) of at most
``kernels.cma.ROOT_WHOLE_MAX`` elements copies it whole itself, then delivers a slice
half as long as a reader's (the readers share the rest), so that its copy and its
writes take about as long as a reader's reads. Every rank then publishes done[j] and
leaves once every slice is done, so the root's tensors are never changed under a
reader. A dead rank's slice is never delivered: the others raise, as in a direct
reduce. The steps after the arrival wait
are one compiled call (``kernels.cma.deliver_broadcast``), and a broadcast of one
float32 tensor is one call from its publication on (``direct_broadcast_f32``): done in
Python, their steps cost about 20 µs a round.

A direct all-gather (FLAG_DIRECT | FLAG_GATHER, READY only, parts of
``GATHER_PART_MIN``-``GATHER_PART_MAX`` bytes where ranks do not outnumber cores)
publishes one word: the address of the rank's part. After the arrival wait each rank
copies its own part into its output and reads every peer's part straight from that
peer's input into its output, then publishes done[j] and leaves once every rank is
done, so no input is changed under a reader (``kernels.parts.direct_gather_f32``, one
call from its publication on). A peer that arrived without a part, or not at all, makes
the gather raise as the eager one does.

A direct reduce without a fault hook is one compiled call too
(``kernels.cma.direct_reduce_f32``, ``DirectRounds.run``): PUBLISHED through DONE, where
the Python steps cost about 25 µs of an 84 µs round of 512 KiB on 2 ranks. It reduces
through mapped shared blocks as well, with the mappings the Python steps made (their
addresses and sizes in ``DirectRounds._maps``; the arrays of ``_views`` keep them
mapped), and gathers the chunk's pieces of many small tensors into one cross-memory
call per peer and direction. What it cannot finish (a late peer, sleepers, a failure,
peers whose blocks are not mapped here yet or grew past their mappings: PEERS_MAPPED) it
hands back after its arrival or its done word, and the Python steps finish the round.

Failure: a peer whose memory cannot be reached mid-round (its process died), or a dead
reducer whose slice is missing, makes the rank that finds out raise. It first gives the
arena's owner up to ``OWNER_VERDICT_S`` to fence the dead rank and stop the cohort
(then it raises ``CohortAborted``, and ``spawn``'s ``RankFailed`` names the rank that
died, not the survivor that noticed), and runs the caller's liveness check (the c10d
backend's names the dead peer); else a ``RuntimeError`` names the rank. Nothing is
taken over.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from . import arena as A
from ..errors import CohortAborted
from ..frame import DTYPE_F32
from ..kernels import cma as C
from ..kernels import signals
from ..kernels.codes import NOT_ROOT, OK, PEERS_MAPPED, SLICES_PENDING, UNREACHABLE
from ..kernels.parts import part_calls
from .waiting import WORK_BYTES_PER_S, futex_wake

UNPROBED, READY, UNAVAILABLE = "unprobed", "ready", "unavailable"

#: how long a rank that lost a peer mid-round waits for the owner to stop the cohort
OWNER_VERDICT_S = 2.0

#: bytes of one rank's part from which, and up to which, an all-gather is a direct round
#: (where ranks do not outnumber cores). 2 ranks, four alternations, the max of the
#: ranks' medians (BENCHMARKS.md, "Fifty-second session"), by the whole output: 128 KiB
#: (parts of 64 KiB) 15.1 -> 11.9 µs, 256 KiB 25.8 -> 18.5, 512 KiB 43.8 -> 34.1; 64 KiB
#: even (9.4, 9.2), 1 MiB slower (54-59 -> 60), as is every size on 4 ranks on 2 cores
#: (1.4-2.1x)
GATHER_PART_MIN = 64 << 10
GATHER_PART_MAX = 256 << 10


class ClosedDirectRounds:
    """What a closed engine holds in place of its ``DirectRounds``, which references the
    engine back (a cycle that kept a destroyed group's mappings until the garbage
    collector ran): no round is direct, so a late call reaches the closed Comm's error."""

    state = UNAVAILABLE
    min_bytes = broadcast_min_bytes = 1 << 62  # no round is direct

    @staticmethod
    def mode(plan, flags: int) -> int:
        return 0


class DirectRounds:
    """One rank's direct-round state and driver (owned by its ``RoundEngine``)."""

    def __init__(self, engine) -> None:
        self.eng = engine
        arena = engine.arena
        allowed = (bool(arena.ctl[A.G_DIRECT]) and C.AVAILABLE and not engine.relay_mode
                   and engine.rank >= 0)
        self.state = UNPROBED if allowed else UNAVAILABLE
        #: payload bytes from which an eligible reduce, and a broadcast, is direct: the
        #: arena owner's words (``arena.direct_min_bytes``,
        #: ``arena.direct_broadcast_min_bytes``), the same for every rank
        self.min_bytes = int(arena.ctl[A.G_DIRECT_MIN])
        self.broadcast_min_bytes = int(arena.ctl[A.G_DIRECT_BROADCAST_MIN])
        #: this process's mappings of the ranks' shared parameter blocks, for the
        #: compiled call: address and bytes of rank r's at 2r and 2r + 1 (0: not mapped
        #: yet), then the count of rounds it reduced through them; ``_views`` holds the
        #: mappings those addresses point into
        self._maps = np.zeros(2 * engine.world + 1, np.int64)
        self._views: dict[int, np.ndarray] = {}
        self._mapped_here = 0  # mapped rounds reduced by the Python steps
        self._iov = np.zeros(C.IOV_WORDS, np.int64)
        self._scratch: np.ndarray | None = None
        if engine.rank >= 0:
            # the word peers read and write back in the probe: nothing else uses it
            self._probe_word = np.zeros(1, np.int64)
            arena.ctl[A.rank_base(engine.rank) + A.R_PROBE] = self._probe_word.ctypes.data

    # -- eligibility ---------------------------------------------------------------
    def eligible(self, plan, flags: int) -> bool:
        """Whether a round of ``plan`` with these agreed ``flags`` (FLAG_OUTER, FLAG_TAP,
        FLAG_BROADCAST, FLAG_GATHER) is one a READY host runs direct (every rank answers
        the same: the schema alone, whatever the state)."""
        if flags & A.FLAG_GATHER:  # (a plan of one part; the broadcast threshold is
            # 1 MiB where ranks outnumber cores: no gather runs direct there)
            return (max(GATHER_PART_MIN, self.broadcast_min_bytes) <= plan.nbytes
                    <= GATHER_PART_MAX)
        least = self.broadcast_min_bytes if flags & A.FLAG_BROADCAST else self.min_bytes
        return not (plan.dtype != DTYPE_F32 or plan.nbytes < least
                    or flags & (A.FLAG_OUTER | A.FLAG_TAP) or not self.holds_addresses(plan))

    def holds_addresses(self, plan) -> bool:
        """Whether a direct round of ``plan`` has room for its tensors' address table:
        two words a tensor, after the schema words, in the rank's eager slot (a round of
        tens of thousands of tensors has not, and takes the shared path)."""
        return plan.off + 16 * plan.ntensors <= self.eng.arena.eager_bytes

    def mode(self, plan, flags: int) -> int:
        """The direct flag a round of ``plan`` with these agreed ``flags`` carries:
        FLAG_DIRECT when settled READY and eligible, else 0."""
        return A.FLAG_DIRECT if self.state == READY and self.eligible(plan, flags) else 0

    # -- UNPROBED: the probe between Comm.settle_direct_rounds's barriers ---------------
    def try_peers(self, rnd: int, ranks) -> None:
        """The probe, with token ``rnd`` (between ``Comm.settle_direct_rounds``'s
        barriers): read and write back the probe word of every rank of ``ranks`` but
        this one; record ``rnd`` in this rank's R_DIRECT when all could be reached, else
        -(rnd + 1)."""
        ctl, me = self.eng.ctl, self.eng.rank
        ok = True
        word = np.zeros(1, np.int64)
        for r in ranks:
            if r == me:
                continue
            b = A.rank_base(r)
            pid, addr = int(ctl[b + A.R_PID]), int(ctl[b + A.R_PROBE])
            if not addr or not C.probe(pid, addr, self._iov, word):
                ok = False
                break
        ctl[A.rank_base(me) + A.R_DIRECT] = rnd if ok else -(rnd + 1)

    def settle(self, rnd: int, ranks) -> None:
        """Once every rank of ``ranks`` recorded its verdict of ``rnd`` (``try_peers``,
        then a barrier): READY when each reached every other, else UNAVAILABLE. Every
        rank reads the same words, so every rank reaches the same verdict."""
        ctl = self.eng.ctl
        ok = all(int(ctl[A.rank_base(r) + A.R_DIRECT]) == rnd for r in ranks)
        self.state = READY if ok else UNAVAILABLE
        if not ok:
            self.eng.lose_direct_rounds()

    # -- READY: one direct round ---------------------------------------------------------
    def _publish(self, plan, rnd: int, weight: float, scale: float, flags: int,
                 srcs: np.ndarray, dsts: np.ndarray, hook):
        """PUBLISHED then ARRIVED: the address table, the scale, the header; returns the
        round's view after the arrival wait."""
        eng = self.eng
        nt = plan.ntensors
        eng.prepare(rnd, plan, False)  # schema words in the eager slot (for diagnostics)
        table = eng.eager_region(rnd)[plan.off:plan.off + 16 * nt].view(np.int64)
        table[:nt] = srcs
        table[nt:] = dsts
        eng.ctl_f64[A.header_base(eng.rank, rnd) + A.H_SCALE] = scale
        if hook is not None:
            hook("before_copy_in", rnd)
        eng.publish(rnd, plan.kind, flags, plan.dtype, weight, nt, plan.nbytes, plan.nelem,
                    plan.shash, plan.nwords)
        if hook is not None:
            hook("arrived", rnd)
        view = eng.await_arrivals(rnd)  # nothing was copied in: no work to spin for
        eng.last_accepted = view.accepted_mask
        return view

    def _table(self, r: int, rnd: int, plan) -> np.ndarray:
        """Rank r's address table of round ``rnd``: its sources then its destinations."""
        region = self.eng.arena.eager_slot(r, rnd)
        return region[plan.off:plan.off + 16 * plan.ntensors].view(np.int64)

    @property
    def mapped_rounds(self) -> int:
        """Direct rounds whose slice this rank reduced through mapped shared parameter
        blocks (no cross-memory calls)."""
        return self._mapped_here + int(self._maps[-1])

    def run(self, plan, rnd: int, weight: float, scale: float, srcs: np.ndarray,
            dsts: np.ndarray, keep_on_empty: bool,
            hook: Callable[[str, int], None] | None = None) -> float:
        """Round ``rnd`` of ``plan`` as a direct round (the caller took the round number):
        ``srcs``/``dsts`` are int64 arrays of the addresses of ``plan.ntensors``
        contiguous float32 tensors of the plan's shapes (the same array when in place),
        alive and untouched by the caller until this returns. ``keep_on_empty``: a MODEL
        round with no accepted mass leaves the destinations untouched (else they get the
        plain sum, as the shared path gives). Returns the accepted mass.

        Without a fault ``hook`` the round is one compiled call from its publication to
        its last slice in the common case (``kernels.cma.direct_reduce_f32``); a late
        peer, sleepers, peers' shared blocks not mapped here yet, a failure: the Python
        steps finish it, as they run the whole round under a hook."""
        if hook is not None:
            view = self._publish(plan, rnd, weight, scale, A.FLAG_DIRECT, srcs, dsts, hook)
            return self._reduce(plan, rnd, view, keep_on_empty, hook)
        eng = self.eng
        acc, tmp = self._buffers()
        code = C.direct_calls().reduce_f32(eng.call_block, plan.call, srcs, dsts, rnd, weight,
                                           scale, keep_on_empty, acc, tmp, self._iov,
                                           self._maps)
        if code == OK:
            return eng.last_mass
        if code in (UNREACHABLE, SLICES_PENDING):
            self._delivered(code, rnd, plan)
            return eng.last_mass
        # (PEERS_MAPPED: arrived already, this wait returns at once)
        view = eng.await_arrivals(rnd) if code == PEERS_MAPPED else eng.settle_eager(code, rnd)
        eng.last_accepted = view.accepted_mask
        return self._reduce(plan, rnd, view, keep_on_empty, None)

    def _reduce(self, plan, rnd: int, view, keep_on_empty: bool, hook) -> float:
        """REDUCED and DONE of ``run`` after its arrival wait (``view``): this rank's
        slice out of every accepted rank's sources, as their address tables name them."""
        eng = self.eng
        me, nt = eng.rank, plan.ntensors
        if keep_on_empty and plan.kind == 0 and not view.mass > 0.0:
            return view.mass
        accepted = view.accepted
        k = len(accepted)
        pids = np.empty(k, np.int64)
        scales = np.empty(k, np.float64)
        all_srcs = np.empty(k * nt, np.int64)
        all_dsts = np.empty(k * nt, np.int64)
        ctl, f64 = eng.ctl, eng.ctl_f64
        for i, r in enumerate(accepted):
            pids[i] = ctl[A.rank_base(r) + A.R_PID]
            scales[i] = f64[A.header_base(r, rnd) + A.H_SCALE]
            table = self._table(r, rnd, plan)
            all_srcs[i * nt:(i + 1) * nt] = table[:nt]
            all_dsts[i * nt:(i + 1) * nt] = table[nt:]
        start, stop = A.slice_bounds(plan.nelem, eng.world, me)
        if hook is not None:
            hook("reduce", rnd)
        acc, tmp = self._buffers()
        numels = plan.addrs[nt:2 * nt]  # (int64, the plan's own words)
        mapped = self._map_peers(accepted, nt, numels, all_srcs, all_dsts)
        if mapped:
            self._mapped_here += 1
            acc = acc[:C.MAPPED_CHUNK]
        bad = C.reduce_slice_direct(accepted.index(me), pids, all_srcs, all_dsts, scales,
                                    numels, start, stop, view.inv, acc, tmp, self._iov, mapped)
        if bad >= 0:
            self._unreachable(rnd, accepted[bad], int(pids[bad]))
        self._finish(rnd, plan)
        return view.mass

    def _map_peers(self, accepted, nt: int, numels: np.ndarray, srcs: np.ndarray,
                   dsts: np.ndarray) -> bool:
        """MAPPED: when every accepted peer's tables point into its shared parameter
        block, rewrite them (in place) as this process's addresses of those blocks and
        return True; otherwise leave them as they are (the calls reach them) and return
        False. This rank's own row is in its own address space already."""
        ctl, me = self.eng.ctl, self.eng.rank
        local = []
        for i, r in enumerate(accepted):
            if r == me:
                continue
            b = A.rank_base(r)
            size = int(ctl[b + A.R_PARAMS_BYTES])
            base = int(ctl[b + A.R_PARAMS_BASE])
            if not C.row_in_block(srcs, dsts, i, numels, base, size):
                return False
            view = self.eng.arena.params_view(r, size)
            # (the compiled call reads these from now on; the view keeps the mapping)
            self._views[r] = view
            self._maps[2 * r:2 * r + 2] = view.ctypes.data, view.shape[0]
            local.append((slice(i * nt, (i + 1) * nt), base, view.ctypes.data))
        for row, base, mapped in local:
            srcs[row] += mapped - base
            dsts[row] += mapped - base
        return True

    def broadcast(self, plan, rnd: int, root: int, srcs: np.ndarray | None,
                  dsts: np.ndarray, hook: Callable[[str, int], None] | None = None) -> None:
        """Round ``rnd`` as a direct broadcast from local rank ``root`` (``srcs``: the
        root's tensors; ignored elsewhere). Every rank delivers its slice of the frame
        (``kernels.cma.broadcast_slice_direct``): a reader reads it from the root's
        tensors into its own ``dsts``, the root takes it from its ``srcs``, and either
        writes it into every other reader's ``dsts``. The root also copies its own
        ``dsts`` whole (none when they are its ``srcs``: an in-place broadcast). Then
        every rank waits for every slice, so the root's tensors stay untouched until
        every reader is done, and a reader's hold every slice when the call returns."""
        mine = self.eng.rank == root
        flags = A.FLAG_DIRECT | A.FLAG_BROADCAST | (0 if mine else A.FLAG_ELIDED)
        view = self._publish(plan, rnd, 0.0, 1.0, flags, srcs if mine else dsts, dsts, hook)
        self.eng.check_broadcast(rnd, view.accepted_mask, view.contrib_mask, root)
        if hook is not None:
            hook("reduce", rnd)
        self._deliver(plan, rnd, root, view.accepted_mask)

    def broadcast_one(self, plan, rnd: int, root: int, src: int, dst: int) -> None:
        """``broadcast`` of ONE contiguous float32 tensor, as one compiled call in the
        common case (``kernels.cma.direct_broadcast_f32``): from the root's tensor at
        address ``src`` (ignored elsewhere) into this rank's destination at ``dst`` (the
        root's own ``src`` for an in-place broadcast). A late peer, sleepers, a failure:
        the blocking steps finish the round, as in ``broadcast``."""
        eng = self.eng
        flags = A.FLAG_DIRECT | A.FLAG_BROADCAST | (0 if eng.rank == root else A.FLAG_ELIDED)
        code = C.direct_calls().broadcast_f32(eng.call_block, plan.call, src, dst, rnd, flags,
                                              root, self._iov)
        if code == OK:
            return
        if code in (UNREACHABLE, SLICES_PENDING):
            self._delivered(code, rnd, plan)
            return
        if code == NOT_ROOT:
            eng.check_broadcast(rnd, eng.last_accepted, eng.last_contributors(), root)
        view = eng.settle_eager(code, rnd)
        eng.check_broadcast(rnd, view.accepted_mask, view.contrib_mask, root)
        self._deliver(plan, rnd, root, view.accepted_mask)

    def gather(self, plan, rnd: int, src: int, dst: int, stride: int) -> None:
        """Round ``rnd`` as a direct all-gather of ``plan.nelem`` float32 a rank
        (``kernels.parts.direct_gather_f32``): every rank reads every peer's part at its
        ``src`` straight into its output, rank r's at ``dst + 4 * stride * r``."""
        eng = self.eng
        calls = part_calls()
        code = calls.direct(eng.call_block, plan.call, src, dst, stride, rnd, self._iov)
        if code == OK:
            return
        if code in (UNREACHABLE, SLICES_PENDING):
            self._delivered(code, rnd, plan)
            return
        if code == NOT_ROOT:  # arrived, a part missing: raises
            eng.check_gather(rnd, eng.last_accepted, eng.last_contributors())
        view = eng.settle_eager(code, rnd)
        eng.check_gather(rnd, view.accepted_mask, view.contrib_mask)
        code = calls.read_parts(eng.call_block, plan.off, plan.nelem, src, dst, stride, rnd,
                                self._iov)
        if code != OK:
            self._delivered(code, rnd, plan)

    def _deliver(self, plan, rnd: int, root: int, accepted: int) -> None:
        """REDUCED and DONE of a direct broadcast whose arrivals accepted ``accepted``
        (``kernels.cma.deliver_broadcast``), finished the blocking way when needed."""
        nt = plan.ntensors
        code = C.direct_calls().deliver(self.eng.call_block, plan.off, plan.addrs[nt:2 * nt],
                                        rnd, root, accepted, self._iov)
        if code != OK:
            self._delivered(code, rnd, plan)

    def _delivered(self, code: int, rnd: int, plan) -> None:
        """The end of a delivery that did not finish in its compiled call: raise for an
        unreachable peer, else wake sleepers and wait for every slice."""
        eng = self.eng
        if code == UNREACHABLE:
            r = eng.culprit
            self._unreachable(rnd, r, int(eng.ctl[A.rank_base(r) + A.R_PID]))
        futex_wake(eng.doorbell.addr)
        self._await_slices(rnd, plan)

    def _finish(self, rnd: int, plan) -> None:
        """DONE: publish this rank's done word, then wait for every slice (a dead
        rank's is never delivered: the round raises, naming it)."""
        self.eng.doorbell.publish(A.rank_base(self.eng.rank) + A.R_DONE, rnd)
        self._await_slices(rnd, plan)

    def _await_slices(self, rnd: int, plan) -> None:
        eng, me = self.eng, self.eng.rank
        eng.waiter.wait(lambda it: signals.spin_slices(eng.ctl, eng.world, rnd, me, it),
                        what="waiting for the direct round's slices", rnd=rnd,
                        missing_of=lambda: eng.missing_slices(rnd),
                        on_missing=lambda j: self._dead_reducer(rnd, j),
                        work_s=plan.nbytes / WORK_BYTES_PER_S)

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        if self._scratch is None:
            self._scratch = np.empty(2 * C.CHUNK, np.float32)
        return self._scratch[:C.CHUNK], self._scratch[C.CHUNK:]

    def _owner_verdict(self, rnd: int, r: int) -> None:
        """Local rank ``r`` failed this round: give the arena's owner (``spawn``'s
        supervisor) up to ``OWNER_VERDICT_S`` to fence it and stop the cohort, so the
        error that surfaces names the rank that died, not this survivor. Raises
        ``CohortAborted`` once the cohort stops; the caller's liveness check raises
        first where it knows better (the c10d backend names the dead peer)."""
        ctl = self.eng.ctl
        deadline = time.monotonic() + OWNER_VERDICT_S
        while True:
            if int(ctl[A.G_ABORT]):
                raise CohortAborted(f"the cohort is shutting down: local rank {r} failed "
                                    f"during direct round {rnd}")
            self.eng.waiter.liveness()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _unreachable(self, rnd: int, r: int, pid: int) -> None:
        """A peer's memory could not be read or written mid-round: its process is gone
        or attach rights were withdrawn."""
        self._owner_verdict(rnd, r)
        raise RuntimeError(
            f"round {rnd}: local rank {r}'s tensors (pid {pid}) could not be read or "
            f"written: its process is gone or no longer permits cross-memory attach. A "
            f"direct round cannot finish without it; restart the job from the last "
            f"checkpoint (set FLODL_SHM_DIRECT=0 to use shared-memory copies instead)")

    def _dead_reducer(self, rnd: int, j: int) -> bool:
        """A slice still missing: raise if its reducer is dead (nobody takes it over)."""
        if self.eng.ctl[A.rank_base(j) + A.R_DEAD]:
            self._owner_verdict(rnd, j)
            raise RuntimeError(
                f"round {rnd}: local rank {j} died before delivering its slice of a direct "
                f"round; the round cannot complete (restart from the last checkpoint)")
        return False


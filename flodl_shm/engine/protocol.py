"""The round state machine of the host engine: who publishes what, who waits for what.

One collective call on every rank is one **round** ``N`` (0, 1, 2, ... in call order;
every rank of the cohort makes the same sequence of calls). A round moves through
these states; each arrow is a word in the control block (``arena.py``), written
with a release store and read with acquire loads (``kernels/signals.py``):

::

    COPY-IN    rank r writes its contribution: into its eager slot of parity N%2
               (small rounds) or into its bulk region d<r> (large rounds), and its
               round header of parity N%2 (kind, flags, dtype, weight, schema).
       |
    ARRIVED    r publishes  arrived[r] = N.
       |       every rank waits until each rank has arrived[.] >= N or is dead.
       v       The accepted set of N is {r : arrived[r] >= N}, read after that wait.
    VALIDATED  every rank compares the accepted headers; any disagreement in kind,
       |       dtype, tensor count, shapes or reduce path raises SchemaMismatchError
       |       on every rank (they all read the same headers), before any payload
       |       is read.
       |
       |-- eager (small) rounds: every rank reduces all accepted contributions
       |   itself, in rank order, into private memory. Done: one sync point.
       |
       `-- bulk (large) rounds: reduce-scatter then all-gather.
    REDUCED    rank j reduces slice j of every accepted contribution into the
       |       shared result region and publishes  done[j] = N.  A dead rank's slice
       |       is claimed by one survivor with a CAS on claim[j] = (N << 16) | taker
       |       and reduced by it (bit-identical: same inputs, same order).
       |   [cluster: the relay waits for every slice, ships the host partial
       |    (sums, never divided) to the controller and publishes consensus = N
       |    after writing the cohort consensus over the result region.]
    GATHERED   every rank waits for every done[.] >= N (or consensus >= N) and
               copies the consensus out (or returns views of it).

Why a round cannot be confused with the next (buffer reuse):

- *Eager slots are double-buffered by parity.* Rank r writes slot N%2 again only
  in round N+2, which it enters after finishing N+1, which needed every live rank
  to arrive at N+1, i.e. to have finished round N (all reads of slot N%2 done).
- *Round headers are double-buffered* by the same argument.
- *A bulk region is single-buffered.* Rank r leaves round N only after every
  done[j] >= N, i.e. after every slice reducer finished reading r's region; a
  taker claims a slice exclusively (CAS), so no second reader lingers.
- *The result region is single-buffered.* Slice reducers write round N+1 only
  after the arrival wait of N+1, i.e. after every live rank finished round N's
  copy-out (and released its views: the zero-copy contract).
- *A broadcast (FLAG_BROADCAST, one host) reduces nothing.* Every rank copies the
  root's payload (its eager slot, or its bulk region d<root>) straight into private
  result memory. Bulk: each reader publishes done[reader] = N after its copy, and
  the root leaves round N only once every reader is done or dead, so d<root> is
  not rewritten under a reader; the result region is not used. The root must be the
  only contributor: a root that died before arriving makes every survivor raise
  naming it, ranks naming different roots raise SchemaMismatchError.
- *A direct round (FLAG_DIRECT) publishes no payload.* Its slice reducers read the
  contributors' private tensors and write every rank's destination; its states and
  buffer-reuse argument are in ``direct.py``. Before the first eligible round, a
  probe between two barriers (``Comm.settle_direct_rounds``) checks that ranks may.
- Words are monotone (arrived/done only grow), so ``>= N`` is the test and a fast
  rank one round ahead never looks like a slow one.

Dead ranks: only the arena's owner (the supervisor) sets dead[r], and only after
r's process has exited, so a dead rank's arrival word is final. A rank that died
after arriving is accepted (its work was realized); one that died before is not.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import math
import weakref
from typing import Callable

import numpy as np

from . import arena as A
from ..errors import CohortAborted, PeerDied, ReduceStall, SchemaMismatchError, plural
from ..frame import DTYPE_F32, RoundKind, describe_schema, dtype_name, elem_size
from ..kernels import codec as K
from ..kernels import reduce as R
from ..kernels import rounds as RK
from ..kernels import signals
from ..kernels import tensorio as TIO
from ..kernels.codes import is_terminal
from .direct import UNAVAILABLE, DirectRounds
from .outer_in_reduce import OuterInReduce
from .waiting import (WORK_BYTES_PER_S, YIELD_BUDGET_S, YIELDS_PER_CALL, Doorbell, Waiter,
                      futex_wake)

#: after a rank's own deadline on a cluster round: how long it waits for the
#: controller's verdict (which names the ranks that never delivered)
RELAY_VERDICT_S = 5.0

_OK = RK.OK
SCRATCH_ELEMS = RK.WORK_CHUNK  # f32 elements per reduce scratch (16 KiB: L1-resident)
DIRECT_CHUNK = 1 << 18  # elements reduced before their copy to the caller (1 MiB: in L2)


def schema_words(kind: int, dtype: int, shapes: list[tuple[int, ...]]) -> np.ndarray:
    """The schema description stored in front of a payload (int64 words)."""
    words = [len(shapes), int(dtype), int(kind)]
    for s in shapes:
        words.append(len(s))
        words.extend(int(d) for d in s)
    return np.asarray(words, dtype=np.int64)


def schema_hash(words: np.ndarray) -> int:
    digest = hashlib.blake2b(words.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def decode_schema_words(words: np.ndarray) -> tuple[int, int, list[tuple[int, ...]]]:
    n, dtype, kind = int(words[0]), int(words[1]), int(words[2])
    shapes = []
    i = 3
    for _ in range(n):
        nd = int(words[i])
        shapes.append(tuple(int(d) for d in words[i + 1:i + 1 + nd]))
        i += 1 + nd
    return kind, dtype, shapes


_plan_ids = itertools.count(1)  # RoundPlan.pid (0: no plan)


class RoundPlan:
    """Everything about a round that depends only on (kind, dtype, shapes): cached per
    engine (``RoundEngine.plan``), so a repeated call rebuilds nothing.

    ``call`` is what the fused calls read of the plan (``kernels/rounds.py``, ``P_*``):
    its header fields, schema words and address table. ``addrs`` (a view of the table,
    int64, ``3 * ntensors``: the tensors' addresses, their element counts, then 1 per
    bfloat16 source) is the fused round's per-call input; the caller refills the
    addresses and source flags before every fused round (through ``addr_words``).
    ``pid`` is unique to the plan (which schema an eager slot holds).
    """

    __slots__ = ("kind", "dtype", "shapes", "words", "shash", "offs", "numels", "nelem",
                 "nbytes", "off", "total", "eager_fits", "fused", "addrs", "addr_words",
                 "ntensors", "nwords", "pid", "call", "bf16_sources", "__weakref__")

    def __init__(self, kind: int, dtype: int, shapes: list[tuple[int, ...]],
                 eager_bytes: int) -> None:
        self.kind = kind
        self.dtype = dtype
        self.shapes = shapes
        self.words = schema_words(kind, dtype, shapes)
        self.shash = schema_hash(self.words)
        self.offs, self.numels, self.nelem = frame_layout(shapes)
        self.nbytes = self.nelem * elem_size(dtype)
        self.off = len(self.words) * 8
        self.total = self.off + self.nbytes
        self.eager_fits = self.total <= eager_bytes
        #: whether a reduce of this plan runs as one fused eager call: it fits the eager
        #: slot and is not a direct round (``RoundEngine.new_plan`` decides; a broadcast
        #: asks ``eager_fits`` and its own threshold)
        self.fused = self.eager_fits
        self.ntensors = len(shapes)
        self.nwords = len(self.words)
        self.pid = next(_plan_ids)
        self.call = RK.plan_words(self.pid, kind, dtype, self.ntensors, self.nbytes,
                                  self.nelem, self.shash, self.words)
        self.addrs = self.call[RK.P_WORDS + self.nwords:]
        self.addrs[self.ntensors:2 * self.ntensors] = self.numels
        #: ``addrs`` as a memoryview: the per-call refill sets items through it, a
        #: fraction of a numpy item assignment's cost
        self.addr_words = memoryview(self.addrs)
        self.bf16_sources = 0  # bfloat16 tensors among the last gathered (``gather``)


class RoundView:
    """What every rank agrees on about round ``rnd`` after the arrival wait."""

    __slots__ = ("rnd", "kind", "dtype", "flags", "ntensors", "nbytes", "nelem", "nwords",
                 "accepted_mask", "contrib_mask", "mass", "inv")

    def __init__(self, rnd, kind, dtype, flags, ntensors, nbytes, nelem, nwords,
                 accepted_mask, contrib_mask, mass, inv) -> None:
        self.rnd = rnd
        self.kind = kind
        self.dtype = dtype
        self.flags = flags
        self.ntensors = ntensors
        self.nbytes = nbytes
        self.nelem = nelem
        self.nwords = nwords        # schema words in front of each payload
        self.accepted_mask = accepted_mask  # ranks whose contribution is in (arrived >= rnd)
        self.contrib_mask = contrib_mask    # accepted and not elided
        self.mass = mass            # sum of accepted weights (f64, rank order)
        self.inv = inv              # f32 reciprocal of mass (1.0 for sums / zero mass)

    @property
    def bulk(self) -> bool:
        return bool(self.flags & A.FLAG_BULK)

    @property
    def payload_offset(self) -> int:
        return self.nwords * 8

    @property
    def accepted(self) -> list[int]:
        return _ranks_of(self.accepted_mask)

    @property
    def contributors(self) -> list[int]:
        return _ranks_of(self.contrib_mask)


def _ranks_of(mask: int) -> list[int]:
    """The ranks whose bits ``mask`` sets, ascending (up to its highest bit, not 64: a
    direct round reads them on every call)."""
    return [r for r in range(mask.bit_length()) if (mask >> r) & 1]


def _controller_silent(stall: ReduceStall) -> ReduceStall:
    """A cluster round's stall when neither the consensus nor the controller's verdict
    came: an answering controller stalls the round before the ranks' own deadline and
    names who never delivered, so the likely cause is the controller itself (a probe's
    SIGSTOPped controller was blamed on the other host's healthy ranks)."""
    others = list(stall.missing)
    # (a host that holds the whole world has no other hosts' ranks to suspect)
    otherwise = f". Otherwise the ranks on other hosts ({others}) did not deliver" if others \
        else ""
    return ReduceStall(
        f"round {stall.round} stalled: no consensus from the controller within the "
        f"{stall.timeout:g} s collective timeout, and no verdict from it "
        f"{RELAY_VERDICT_S:g} s later (a controller that is answering stalls the round "
        f"first, naming the ranks that never delivered). The controller is likely not "
        f"answering (its process stopped or overloaded, or cut off from this host): check it "
        f"and its output{otherwise}",
        round=stall.round, missing=stall.missing, timeout=stall.timeout, global_ranks=True)


def _host_speaker(ctl: np.ndarray, world: int, rank: int) -> Callable[[tuple, bool], bool]:
    """``Waiter.speaks`` of local rank ``rank``: whether it is the one of its host that
    logs a long wait for the local ranks ``missing`` (every local rank, when ``remote``:
    they wait for other hosts), where its peers that wait with it would log the same:
    the lowest local rank that is neither missing nor dead. (A function of the arena's
    words, not a method of the engine: the engine's waiter holds it, and a cycle would
    keep a destroyed group's mappings until the garbage collector's next pass.)"""
    def speaks(missing: tuple, remote: bool) -> bool:
        for r in range(world):
            if (remote or r not in missing) and not ctl[A.rank_base(r) + A.R_DEAD]:
                return r == rank
        return True
    return speaks


class RoundEngine:
    """Drives the control-block protocol for one participant of one arena.

    ``rank`` is the local rank (0..world-1); a relay observes with ``rank=-1``.
    Knows nothing about torch: payloads are numpy views.
    """

    def __init__(self, arena: A.Arena, rank: int, *, timeout: float | None,
                 spin_iters: int, liveness: Callable[[], None]) -> None:
        self.arena = arena
        self.rank = rank
        self.world = arena.world
        self.ctl = arena.ctl
        self.ctl_f64 = arena.ctl_f64
        self.ctl32 = arena.ctl32
        self.doorbell = Doorbell(arena.ctl)
        self.waiter = Waiter(self.doorbell, spin_iters, timeout, liveness)
        if rank < 0:  # the relay waits for every round, as long as the ranks train
            self.waiter.notice_s = 0.0
        else:
            self.waiter.speaks = _host_speaker(arena.ctl, self.world, rank)
        # scratch of the fused eager round; its first two chunks double as the
        # reduce accumulator and temporary of the other steps (never used at once)
        self._work = np.empty(RK.WORK_WORDS, np.float32)
        self._acc = self._work[:SCRATCH_ELEMS]
        self._tmp = self._work[SCRATCH_ELEMS:2 * SCRATCH_ELEMS]
        self._eager_all = arena.eager_area()
        # private reduce outputs of eager rounds, both views of one buffer
        eager_out = np.empty(arena.eager_bytes, np.uint8)
        self.eager_f32 = eager_out.view(np.float32)
        self.eager_u16 = eager_out.view(np.uint16)
        # the fused calls' inputs and outcome (kernels/rounds.py, C_*): it holds the
        # addresses of arrays this engine keeps, and the spin budget the Waiter adapts
        w = self.waiter
        self._call = RK.call_block(self.ctl, self._eager_all, arena.eager_bytes, self.world,
                                   rank, self._work, w.spin_iters, w.min_spin, w.max_spin)
        w.share_spin(self._call[RK.C_SPIN:RK.C_SPIN + 1])
        self._fused = RK.fused_calls()  # typed once: their calls skip numba's dispatch
        self._info = self._call[:RK.I_WORDS]
        # its words read as Python ints through a memoryview: a window reads the accepted
        # mask right after training, where one numpy item read costs several microseconds
        self._info_words = memoryview(self._info)
        self._mass = self._call[RK.C_MASS:RK.C_MASS + 1].view(np.float64)
        self._mass_cell = memoryview(self._mass)  # reads as a Python float, cheaply
        self.relay_mode = bool(arena.ctl[A.G_RELAY])
        #: tests only: ``hook(phase, round)`` called at fault-injection points
        self.fault_hook: Callable[[str, int], None] | None = None
        #: the outer optimizer (one host), stepped by each slice reducer on its slice
        self.outer = OuterInReduce(arena)
        self.own_slice: tuple[int, int] | None = None  # written to ``into`` last round
        self._plans: dict[tuple, RoundPlan] = {}
        self._eager_payloads: dict = {}   # (plan, parity) -> typed payload view
        #: large rounds through the ranks' private memory, when the arena allows them
        self.direct = DirectRounds(self)
        #: plans whose reduces would fit the eager slot but may run direct (``new_plan``)
        self._direct_sized: weakref.WeakSet = weakref.WeakSet()

    @property
    def last_accepted(self) -> int:
        """The accepted-rank mask of the last completed arrival (every arrival check
        writes it into the call block's info words)."""
        return self._info_words[RK.I_ACCEPTED]

    @last_accepted.setter
    def last_accepted(self, mask: int) -> None:
        self._info_words[RK.I_ACCEPTED] = int(mask)

    @property
    def call_block(self) -> np.ndarray:
        """The compiled calls' block of this engine (``kernels/rounds.py``, C_*): the
        direct rounds' compiled steps take it too."""
        return self._call

    @property
    def last_mass(self) -> float:
        """The accepted mass of the last completed arrival (its call-block word)."""
        return self._mass_cell[0]

    @property
    def culprit(self) -> int:
        """The rank the last compiled step that failed named (its I_CULPRIT word)."""
        return self._info_words[RK.I_CULPRIT]

    # -- plans ----------------------------------------------------------------------
    def yield_when_waiting(self) -> None:
        """Ranks outnumber this host's cores: a wait that is not over at once gives
        the core away before it sleeps, in the fused calls' compiled wait
        (``YIELDS_PER_CALL`` yields), then in the ``Waiter`` (``YIELD_BUDGET_S``, or
        as long as a bulk round's awaited copy takes)."""
        self.waiter.yield_budget = YIELD_BUDGET_S
        self._call[RK.C_YIELDS] = YIELDS_PER_CALL

    def plan(self, kind: int, dtype: int, shapes) -> RoundPlan:
        """The cached plan of a round of ``kind``/``dtype`` over ``shapes`` (a tuple of
        shape tuples or ``torch.Size``: hashed and compared as tuples)."""
        key = (kind, dtype, shapes)
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) > 64:
                self._plans.clear()
            got = self.new_plan(kind, dtype, shapes)
            self._plans[key] = got
        return got

    def new_plan(self, kind: int, dtype: int, shapes) -> RoundPlan:
        """A plan of its own (not the cache's) of a round of ``kind``/``dtype`` over
        ``shapes``; its reduces are fused eager calls unless they may run direct."""
        plan = RoundPlan(kind, dtype, [tuple(int(d) for d in s) for s in shapes],
                         self.arena.eager_bytes)
        direct = self.direct
        # (a round with an outer step or a checkpoint tap is not direct, but not fused
        # either: ``Comm._fusable`` refuses it, so the plain round's verdict holds)
        if plan.eager_fits and direct.state != UNAVAILABLE and direct.eligible(plan, 0):
            plan.fused = False
            self._direct_sized.add(plan)
        return plan

    def lose_direct_rounds(self) -> None:
        """The direct path turned out unavailable: the plans that were to run direct
        run as fused eager calls again."""
        for plan in self._direct_sized:
            plan.fused = plan.eager_fits
        self._direct_sized.clear()

    def prepare(self, rnd: int, plan: RoundPlan, bulk: bool,
                payload: bool = True) -> np.ndarray | None:
        """COPY-IN setup: make round ``rnd``'s region hold ``plan``'s schema words.

        Returns the bulk region (its words are always rewritten: other round types,
        e.g. byte rounds, share it; ``payload`` False: a rank that publishes no payload,
        e.g. a broadcast's reader, only needs room for the words), or None for an eager
        round, whose slot of the round's parity is rewritten only when it last held
        another plan (only this engine writes its eager slots)."""
        if bulk:
            region = self.bulk_region(plan.total if payload else plan.off)
            region[:plan.off].view(np.int64)[:] = plan.words
            return region
        held = RK.C_SCHEMA + (rnd & 1)
        if self._call[held] != plan.pid:
            self.eager_region(rnd)[:plan.off].view(np.int64)[:] = plan.words
            self._call[held] = plan.pid
        return None

    # -- COPY-IN destinations ------------------------------------------------------
    def eager_payload(self, rnd: int, plan: RoundPlan) -> np.ndarray:
        """This rank's payload area of round ``rnd``'s eager slot for ``plan``, typed like
        the wire (float32, or uint16 bf16 bits); cached per plan and parity."""
        key = (plan, rnd & 1)
        got = self._eager_payloads.get(key)
        if got is None:
            if len(self._eager_payloads) > 64:
                self._eager_payloads.clear()
            raw = self.eager_region(rnd)[plan.off:plan.total]
            got = raw.view(np.float32 if plan.dtype == DTYPE_F32 else np.uint16)
            self._eager_payloads[key] = got
        return got

    def eager_region(self, rnd: int) -> np.ndarray:
        return self.arena.eager_slot(self.rank, rnd)

    def bulk_region(self, nbytes: int) -> np.ndarray:
        self.arena.grow_data(self.rank, nbytes)
        return self.arena.data_view(self.rank, nbytes)

    # -- ARRIVED -------------------------------------------------------------------
    def publish(self, rnd: int, kind: int, flags: int, dtype: int, weight: float,
                ntensors: int, nbytes: int, nelem: int, shash: int, nwords: int) -> None:
        """Write this rank's round header, then publish its arrival."""
        if RK.publish_round(self.ctl, self.ctl_f64, self.ctl32, self.rank, rnd, kind, flags,
                            dtype, weight, ntensors, nbytes, nelem, shash, nwords) > 0:
            futex_wake(self.doorbell.addr)

    def missing_arrivals(self, rnd: int) -> tuple[int, ...]:
        c = self.ctl
        return tuple(r for r in range(self.world)
                     if c[A.rank_base(r) + A.R_ARRIVED] < rnd
                     and not c[A.rank_base(r) + A.R_DEAD])

    def await_arrivals(self, rnd: int, what: str = "waiting for ranks to arrive",
                       nbytes: int = 0) -> RoundView:
        """Wait for every rank's arrival at ``rnd`` (``nbytes``: the payload each copied
        in before arriving, which sets how long a late peer is spun for)."""
        ctl, f64, world, me, info, mass = (self.ctl, self.ctl_f64, self.world, self.rank,
                                           self._info, self._mass)
        # no compiled yields: the Waiter yields itself once the spin missed
        code = self.waiter.wait(lambda it: RK.arrive(ctl, f64, world, rnd, me, it, 0, info,
                                                     mass),
                                what=what, rnd=rnd,
                                missing_of=lambda: self.missing_arrivals(rnd),
                                work_s=nbytes / WORK_BYTES_PER_S)
        if code != RK.OK:
            raise self._arrival_error(code, rnd)
        (acc_mask, contrib, _ref, _culprit, kind, flags, dtype, ntensors, nbytes, nelem,
         nwords) = info.tolist()
        m = float(mass[0])
        if self.relay_mode or kind != RoundKind.MODEL or m <= 0.0:
            inv = 1.0
        else:
            inv = float(np.float32(1.0 / m))
        return RoundView(rnd, kind, dtype, flags, ntensors, nbytes, nelem, nwords, acc_mask,
                         contrib, m, inv)

    def _arrival_error(self, code: int, rnd: int) -> Exception:
        culprit = int(self._info[RK.I_CULPRIT])
        if code == RK.EXITED:
            return RuntimeError(
                f"round {rnd}: rank {culprit} already left (it returned from its function, "
                f"or destroyed its process group) while this rank waits for it in a "
                f"collective: every rank must make the same sequence of collective calls"
            )
        accepted = [r for r in range(self.world)
                    if self.ctl[A.rank_base(r) + A.R_ARRIVED] >= rnd]
        if code == RK.MISMATCH:
            return self._mismatch(rnd, accepted)
        got = int(self.ctl[A.header_base(culprit, rnd) + A.H_ROUND]) if culprit >= 0 else -1
        return RuntimeError(
            f"round {rnd}: rank {culprit}'s header is for round {got}; the control block is "
            f"out of step (a rank skipped or repeated a collective, or two Comms drive the "
            f"same rank)"
        )

    # -- VALIDATED (error path) ------------------------------------------------------
    def _describe(self, r: int, rnd: int) -> str:
        c = self.ctl
        b = A.header_base(r, rnd)
        flags = int(c[b + A.H_FLAGS])
        nwords = int(c[b + A.H_SCHEMA_WORDS])
        kind = RoundKind(int(c[b + A.H_KIND])).name if int(c[b + A.H_KIND]) in (0, 1) else "?"
        path = "zero-copy" if flags & A.FLAG_ZERO_COPY else ("bulk" if flags & A.FLAG_BULK
                                                               else "eager")
        if flags & A.FLAG_DIRECT:
            path = "direct"
        if flags & A.FLAG_BROADCAST:
            path = f"broadcast, {path}"
        if flags & A.FLAG_GATHER:
            path = f"all-gather, {path}"
        if flags & A.FLAG_SCATTER:
            path = f"reduce-scatter, {path}"
        ntensors = int(c[b + A.H_NTENSORS])
        dtype = int(c[b + A.H_DTYPE])
        try:
            region = self._payload_region(r, rnd, flags, nwords * 8)
            _, _, sh = decode_schema_words(region[:nwords * 8].view(np.int64))
            schema = describe_schema(kind, [(dtype, shape) for shape in sh])
        except Exception:  # a description must never mask the mismatch itself
            schema = f"{kind} round, {plural(ntensors, 'tensor')} {dtype_name(dtype)} shapes ?"
        if ntensors == 0 and dtype != DTYPE_F32:  # Comm._refused's round
            return (f"rank {r}: refused its call before the round (a refusal round: that "
                    f"rank's own error says why)")
        if ntensors == 0:  # what a barrier() sends
            return (f"rank {r}: {kind} round without tensors (as barrier() sends, and as a "
                    f"rank's first direct-sized float32 reduce sends two first, to settle the "
                    f"direct path), {path} path")
        return f"rank {r}: {schema}, {int(c[b + A.H_NBYTES])} bytes, {path} path"

    def _mismatch(self, rnd: int, accepted: list[int]) -> SchemaMismatchError:
        lines = "\n  ".join(self._describe(r, rnd) for r in accepted)
        return SchemaMismatchError(
            f"round {rnd}: ranks contributed different frame schemas (every rank must call "
            f"the same collective with tensors of the same count, shapes and dtype, and the "
            f"same bf16_wire setting):\n  {lines}"
        )

    # -- payload access ----------------------------------------------------------------
    def _payload_region(self, r: int, rnd: int, flags: int, nbytes: int) -> np.ndarray:
        if flags & A.FLAG_BULK:
            return self.arena.data_view(r, nbytes)
        return self.arena.eager_slot(r, rnd)

    def payload(self, view: RoundView, r: int) -> np.ndarray:
        """Rank r's payload for the round as a typed flat array (float32 or uint16)."""
        off = view.payload_offset
        region = self._payload_region(r, view.rnd, view.flags, off + view.nbytes)
        raw = region[off:off + view.nbytes]
        return raw.view(np.float32 if view.dtype == DTYPE_F32 else np.uint16)

    # -- REDUCED ---------------------------------------------------------------------
    def barrier_round(self, rnd: int, _weight: float, plan: RoundPlan) -> float:
        """:meth:`eager_round` of the empty CONTROL ``plan`` (a barrier), its fast case
        one compiled call with three arguments; returns the accepted mass (0)."""
        code = self._fused.barrier(self._call, plan.call, rnd)
        if code == _OK:
            return self._mass_cell[0]
        view = self.settle_eager(code, rnd)
        self.reduce_eager(view, self.eager_f32)
        return view.mass

    def per_rank_round(self, rnd: int, plan: RoundPlan, values: np.ndarray) -> None:
        """The CONTROL round of ``Comm.all_reduce_per_rank_f64`` over ``plan``
        (``plan.nelem`` float32 on the wire): ``values``, the Comm's own float64
        staging, go in and their sums over the accepted ranks come back into it. One
        compiled call in the fast case."""
        code = self._fused.per_rank(self._call, plan.call, rnd, values)
        if code == _OK:
            return
        view = self.settle_eager(code, rnd)
        sums = self.eager_f32[:plan.nelem]
        self.reduce_eager(view, sums)
        values[:] = sums

    def eager_round(self, plan: RoundPlan, rnd: int, flags: int, weight: float, *,
                    count: int = 0, scale: float = 1.0, out_f32: np.ndarray | None = None,
                    out_u16: np.ndarray | None = None, out_addr: int = 0,
                    upcast: bool = False) -> float:
        """A small round: copy in (the first ``count`` tensors of ``plan.addrs``; 0 when
        the payload is already in the eager slot or elided), publish, wait, validate,
        reduce into the f32 output (f32 wire) or ``out_u16`` (bf16 bits; widened into
        the f32 output too when ``upcast``); returns the accepted mass. The f32 output
        is ``out_f32``, or the ``plan.nelem`` float32 at ``out_addr`` when non-zero
        (e.g. a fresh tensor), or else ``eager_f32``. The fast case is one compiled
        call; sleeping peers or a late rank fall back to the blocking path.
        """
        if out_f32 is None:
            out_f32 = self.eager_f32
        if out_u16 is None:
            out_u16 = self.eager_u16  # aliases eager_f32: upcast only into other memory
        code = RK.eager_encode_round(self._call, plan.call, rnd, weight, flags, count, scale,
                                     out_addr, upcast, out_f32, out_u16)
        if code == _OK:
            return self._mass_cell[0]
        view = self.settle_eager(code, rnd)
        if out_addr:
            out_f32 = _f32_at(out_addr, plan.nelem)
        if plan.dtype == DTYPE_F32:
            self.reduce_eager(view, out_f32)
        else:
            self.reduce_eager(view, out_u16)
            if upcast:
                K.bf16_to_f32(out_u16[:plan.nelem], out_f32[:plan.nelem])
        return view.mass

    def tensors_round(self, rnd: int, weight: float, plan: RoundPlan, scale: float,
                      sums: np.ndarray) -> float:
        """An in-place small round over every tensor of ``plan``'s address table (filled
        by ``TensorCodec.gather``): copy-in times ``scale``, the round, and, when it
        realized work, the consensus written back into the float32 tensors with their
        drift added to ``sums`` (``[0, 3]``: none): one compiled call in the fast case,
        the blocking path's reduce and the same write-back otherwise. The bfloat16
        tensors are left to the caller (the consensus stays in ``eager_f32`` /
        ``eager_u16``). Returns the accepted mass."""
        code = RK.eager_tensors_round(self._call, plan.call, rnd, weight, scale,
                                      self.eager_f32, self.eager_u16, sums)
        if code == _OK:
            return self._mass_cell[0]
        view = self.settle_eager(code, rnd)
        cons = self.eager_f32 if plan.dtype == DTYPE_F32 else self.eager_u16
        self.reduce_eager(view, cons)
        if plan.kind != RoundKind.MODEL or view.mass > 0.0:
            TIO.decode_scatter(cons, plan.addrs, plan.ntensors, sums)
        return view.mass

    def zero_copy_round(self, rnd: int, weight: float, plan: RoundPlan) -> float:
        """:meth:`eager_round` of a zero-copy frame already in this rank's eager slot."""
        return self.eager_round(plan, rnd, A.FLAG_ZERO_COPY, weight)

    def arrays_round(self, rnd: int, weight: float, plan: RoundPlan, src: np.ndarray,
                     dst: np.ndarray) -> float:
        """A small f32 round of one tensor given as arrays: ``src`` (``plan.nelem``
        float32, aligned, writable memory: one compiled type) copied in, the consensus
        reduced into ``dst`` whatever the mass (as the general round does). Returns the
        accepted mass."""
        code = self._fused.arrays_f32(self._call, plan.call, src, dst, rnd, weight)
        if code == _OK:
            return self._mass_cell[0]
        view = self.settle_eager(code, rnd)
        self.reduce_eager(view, dst)
        return view.mass

    def inplace_round(self, rnd: int, weight: float, addr: int, plan: RoundPlan,
                      scale: float, out: int = 0, flags: int = 0, root: int = -1) -> float:
        """The whole small average of one contiguous f32 tensor (at ``addr``,
        ``plan.nelem`` elements, f32 wire; the plan's schema already in the slot): one
        compiled call in the fast case. In place when ``out`` is 0 (a MODEL round that
        realized nothing then leaves the tensor untouched), else into the ``plan.nelem``
        f32 at address ``out`` (a fresh result, written whatever the mass, as the
        general round does; with ``flags`` a broadcast's: FLAG_BROADCAST, and
        FLAG_ELIDED on the readers, which copy nothing in, and ``root`` its local root,
        checked to be the only contributor). Returns the accepted mass."""
        if not out:
            code = self._fused.inplace_f32(self._call, plan.call, addr, rnd, weight, scale)
        else:
            code = self._fused.copy_f32(self._call, plan.call, addr, out, rnd, flags, weight,
                                     scale, root)
        if code == _OK:
            return self._mass_cell[0]
        if code == RK.NOT_ROOT:
            self.check_broadcast(rnd, self.last_accepted, self.last_contributors(), root)
        view = self.settle_eager(code, rnd)
        if root >= 0:
            self.check_broadcast(rnd, view.accepted_mask, view.contrib_mask, root)
        if not out:
            if plan.kind == RoundKind.MODEL and not view.mass > 0.0:
                return view.mass
            out = addr
        self.reduce_eager(view, _f32_at(out, plan.nelem))
        return view.mass

    def settle_eager(self, code: int, rnd: int) -> RoundView:
        """A fused eager call published but could not finish (peers asleep, a late
        rank, a mismatch): wake sleepers or raise, then wait the blocking way (whose
        ``Waiter.wait`` judges whether a longer spin would have caught the round)."""
        if code == RK.WAKE:
            futex_wake(self.doorbell.addr)
        elif is_terminal(code):
            raise self._arrival_error(code, rnd)
        return self.await_arrivals(rnd)

    def reduce_eager(self, view: RoundView, out: np.ndarray) -> None:
        """Eager rounds: reduce every contribution into private ``out`` (typed like the
        wire: float32, or uint16 bf16 bits); a broadcast's one contribution is copied
        bit for bit."""
        root = (RK.sole_contributor(view.contrib_mask, self.world)
                if view.flags & A.FLAG_BROADCAST else -1)
        if view.dtype == DTYPE_F32 and root >= 0:
            RK.copy_eager_f32(self._eager_all, self.arena.eager_bytes, view.rnd, root,
                              view.nwords * 8, view.nelem, out)
        elif view.dtype == DTYPE_F32:
            RK.reduce_eager_f32(self._eager_all, self.arena.eager_bytes, view.rnd, self.world,
                                view.contrib_mask, view.nwords * 8, view.nelem, out, view.inv,
                                self._acc)
        else:
            RK.reduce_eager_bf16(self._eager_all, self.arena.eager_bytes, view.rnd, self.world,
                                 view.contrib_mask, view.nwords * 8, view.nelem, out, view.inv,
                                 self._acc, self._tmp)

    def reduce_into(self, view: RoundView, out: np.ndarray, start: int, stop: int,
                    partial: bool = False, srcs: tuple | None = None) -> None:
        """Reduce elements [start, stop) of the contributions into ``out``.

        ``out`` is float32, or uint16 (bf16 bits) when the wire is bf16 and the
        result is a consensus; ``partial`` (cluster host sums) always writes f32.
        ``srcs`` are the contributions' payloads when the caller already built them.
        """
        if stop <= start:
            return
        if srcs is None:
            srcs = tuple(self.payload(view, r) for r in view.contributors)
        if not srcs:
            out[start:stop] = 0
            return
        if view.dtype == DTYPE_F32:
            R.reduce_f32(srcs, out, start, stop, view.inv, self._acc)
        elif partial or out.dtype == np.float32:
            R.reduce_bf16_to_f32(srcs, out, start, stop, view.inv, self._acc, self._tmp)
        else:
            R.reduce_bf16(srcs, out, start, stop, view.inv, self._acc, self._tmp)

    def result_array(self, view: RoundView) -> np.ndarray:
        """The shared result region typed for this round's reduce output."""
        if self.relay_mode:  # f32 host partial, later overwritten by the consensus
            raw = self.arena.result_view(view.nelem * 4)
            return raw[:view.nelem * 4].view(np.float32)
        esize = elem_size(view.dtype)
        raw = self.arena.result_view(view.nelem * esize)
        return raw[:view.nelem * esize].view(np.float32 if view.dtype == DTYPE_F32
                                             else np.uint16)

    def consensus_array(self, view: RoundView) -> np.ndarray:
        """The consensus of a bulk round in the wire dtype (valid after GATHERED)."""
        esize = elem_size(view.dtype)
        raw = self.arena.result_view(view.nelem * (4 if self.relay_mode else esize))
        return raw[:view.nelem * esize].view(np.float32 if view.dtype == DTYPE_F32
                                             else np.uint16)

    def reduce_slice(self, view: RoundView, j: int, into: np.ndarray | None = None) -> None:
        """Reduce slice ``j`` into the result region and publish it.

        ``into`` (a private flat f32 array of the whole frame) also receives the
        slice's consensus, chunk by chunk while each chunk is still in cache: the
        caller then copies out only the other slices, saving a memory read of its own.
        """
        start, stop = A.slice_bounds(view.nelem, self.world, j)
        out = self.result_array(view)
        outer = self.outer.applies(view, self.relay_mode)
        if into is not None and self.fault_hook is None and not outer and not self.relay_mode:
            srcs = tuple(self.payload(view, r) for r in view.contributors)
            for c0 in range(start, stop, DIRECT_CHUNK):
                c1 = min(c0 + DIRECT_CHUNK, stop)
                self.reduce_into(view, out, c0, c1, srcs=srcs)
                if view.dtype == DTYPE_F32:
                    np.copyto(into[c0:c1], out[c0:c1])
                else:
                    K.bf16_to_f32(out[c0:c1], into[c0:c1])
            self.doorbell.publish(A.rank_base(j) + A.R_DONE, view.rnd)
            self.own_slice = (start, stop)
            return
        self.own_slice = None
        if self.fault_hook is None:
            self.reduce_into(view, out, start, stop, partial=self.relay_mode)
        else:  # tests: let a fault land between the two halves of the slice
            mid = (start + stop) // 2
            self.reduce_into(view, out, start, mid, partial=self.relay_mode)
            self.fault_hook("reduce", view.rnd)
            self.reduce_into(view, out, mid, stop, partial=self.relay_mode)
        if outer:
            self.outer.step_slice(view, out, start, stop)
        self.doorbell.publish(A.rank_base(j) + A.R_DONE, view.rnd)

    def _take_over(self, view: RoundView, j: int) -> bool:
        """Claim and reduce slice ``j`` if the rank responsible for it is dead."""
        if self.rank < 0:
            return False
        c = self.ctl
        idx = A.rank_base(j) + A.R_CLAIM
        cur = int(signals.load(c, idx))
        responsible = j if (cur >> 16) < view.rnd else (cur & 0xFFFF)
        if not c[A.rank_base(responsible) + A.R_DEAD]:
            return False
        if int(c[A.rank_base(j) + A.R_DONE]) >= view.rnd:
            return True
        mine = (view.rnd << 16) | self.rank
        if int(signals.cas(c, idx, cur, mine)) != cur:
            return True  # someone else claimed it first; re-check
        self.reduce_slice(view, j)
        return True

    # -- broadcast (one host) -------------------------------------------------------------
    #
    # A broadcast round (FLAG_BROADCAST) reduces nothing: the root's payload, published
    # once in its eager slot or bulk region, is copied out by every rank. Bulk case: each
    # reader publishes done[reader] = N after its copy; the root leaves the round only
    # once every reader is done or dead, so its region is never rewritten (round N+1)
    # while a reader still reads it. Readers need no wait after their copy: nothing they
    # own is read by anyone. The result region is not touched.

    def last_contributors(self) -> int:
        """The contributor mask (accepted, not elided) of the last arrival wait."""
        return self._info_words[RK.I_CONTRIB]

    def check_broadcast(self, rnd: int, accepted: int, contrib: int, root: int) -> None:
        """Raise unless local rank ``root`` is round ``rnd``'s only contributor: a root
        that is not accepted died before publishing (``PeerDied`` naming it: a peer's
        death, not a fault of this rank's); any other contributor set means the ranks
        disagree on the root (SchemaMismatchError)."""
        if contrib == 1 << root:
            return
        if not (accepted >> root) & 1:
            c = self.ctl
            rank = int(c[A.G_FIRST_RANK]) + root
            pid = int(c[A.rank_base(root) + A.R_PID])
            raise PeerDied(
                f"round {rnd}: the broadcast's root, rank {rank} (pid {pid}), died before "
                f"publishing its tensors; there is nothing to broadcast", rank, pid)
        got = [r for r in range(self.world) if (contrib >> r) & 1]
        raise SchemaMismatchError(
            f"round {rnd}: ranks disagree on the broadcast root: local rank(s) {got} "
            f"published as root, this rank expects local rank {root} (every rank must pass "
            f"the same root)")

    def check_gather(self, rnd: int, accepted: int, contrib: int) -> None:
        """Raise unless every rank contributed to all-gather round ``rnd``: a rank that
        is not accepted died before publishing its part (``PeerDied`` naming it); one
        that arrived without a part called another collective (SchemaMismatchError)."""
        every = (1 << self.world) - 1
        if contrib == every:
            return
        missing = [r for r in range(self.world) if not (accepted >> r) & 1]
        if missing:
            r = missing[0]
            rank = int(self.ctl[A.G_FIRST_RANK]) + r
            pid = int(self.ctl[A.rank_base(r) + A.R_PID])
            raise PeerDied(f"round {rnd}: rank {rank} (pid {pid}) died before publishing its "
                           f"part of the all-gather; no rank has every part", rank, pid)
        raise SchemaMismatchError(
            f"round {rnd}: local rank(s) {[r for r in range(self.world) if not (contrib >> r) & 1]}"
            f" published no part of the all-gather (every rank must call it)")

    def broadcast_copy(self, view: RoundView, root: int, out: np.ndarray | None) -> None:
        """Bulk broadcast: copy root's payload into ``out`` (flat, wire-typed, private;
        None: the root of an in-place broadcast, which has nothing to copy), then
        publish done[self] = round (the root's region may be rewritten after it)."""
        if out is not None:
            src = self.payload(view, root)
            hook = self.fault_hook
            if hook is None:
                np.copyto(out[:view.nelem], src)
            else:  # tests: let a fault land between the two halves of the copy
                mid = view.nelem // 2
                np.copyto(out[:mid], src[:mid])
                hook("mid_copy_out", view.rnd)
                np.copyto(out[mid:view.nelem], src[mid:])
            del src
        self.doorbell.publish(A.rank_base(self.rank) + A.R_DONE, view.rnd)

    def await_readers(self, view: RoundView) -> None:
        """The root of a bulk broadcast: wait until every rank copied its payload out
        (done[.] >= round) or is dead, spinning for as long as that copy takes. A dead
        reader's done word is raised to the round by the root (compare-and-swap, never
        lowered: a survivor may already be in a later round's takeover of that rank's
        slice)."""
        ctl, world, rnd = self.ctl, self.world, view.rnd

        def dead_reader(j: int) -> bool:
            if not ctl[A.rank_base(j) + A.R_DEAD]:
                return False
            idx = A.rank_base(j) + A.R_DONE
            cur = int(signals.load(ctl, idx))
            while cur < rnd:
                got = int(signals.cas(ctl, idx, cur, rnd))
                if got == cur:
                    break
                cur = got
            return True

        self.waiter.wait(lambda it: signals.spin_slices(ctl, world, rnd, self.rank, it),
                         what="waiting for the broadcast's readers to copy the root's tensors",
                         rnd=rnd, missing_of=lambda: self.missing_slices(rnd),
                         on_missing=dead_reader, work_s=view.nbytes / WORK_BYTES_PER_S)

    def missing_slices(self, rnd: int) -> tuple[int, ...]:
        return tuple(j for j in range(self.world)
                     if self.ctl[A.rank_base(j) + A.R_DONE] < rnd)

    def await_slices(self, view: RoundView) -> None:
        ctl, world, rnd = self.ctl, self.world, view.rnd
        first = max(self.rank, 0)
        self.waiter.wait(lambda it: signals.spin_slices(ctl, world, rnd, first, it),
                         what="waiting for reduce slices", rnd=rnd,
                         missing_of=lambda: self.missing_slices(rnd),
                         on_missing=lambda j: self._take_over(view, j),
                         work_s=view.nbytes / WORK_BYTES_PER_S)

    # -- GATHERED (cluster) ------------------------------------------------------------
    def await_consensus(self, view: RoundView) -> float:
        """Cluster rounds: wait for the relay's consensus; returns the cohort mass."""
        ctl, rnd = self.ctl, view.rnd
        try:
            self.waiter.wait(lambda it: signals.spin_word_ge(ctl, A.G_CONSENSUS, rnd, it),
                             what="waiting for the cluster consensus from the relay", rnd=rnd,
                             missing_of=self._remote_ranks, global_missing=True)
        except CohortAborted:
            self.raise_relay_error(rnd)
            raise
        except ReduceStall as e:
            # the controller times the round against this host's timeout and names the
            # ranks that never delivered; its verdict reaches the relay a moment later
            self._await_relay_verdict(rnd)
            if int(ctl[A.G_CONSENSUS]) < rnd:
                silent = _controller_silent(e)
                # no rank of this host can go on without the controller: recorded as the
                # host's link failure (the others stop at once, and the launcher stops the
                # host whatever its max_failures: a rank that gave up on the controller is
                # no death the cohort goes on without)
                if not ctl[A.G_RELAY_ERROR]:
                    self.arena.set_relay_error(A.RELAY_STALL, str(silent), rnd, e.missing,
                                               e.timeout)
                raise silent from None
        return float(self.arena.ctl_f64[A.G_CONSENSUS_MASS])

    def _remote_ranks(self) -> tuple[int, ...]:
        """The global ranks on other hosts (who a late consensus waits on)."""
        first, world = int(self.ctl[A.G_FIRST_RANK]), int(self.ctl[A.G_GLOBAL_WORLD])
        return tuple(r for r in range(world) if not first <= r < first + self.world)

    def _await_relay_verdict(self, rnd: int) -> None:
        """Up to ``RELAY_VERDICT_S``: return once the consensus arrived, raise the
        relay's recorded error (the controller's stall) once there is one."""
        import time

        deadline = time.monotonic() + RELAY_VERDICT_S
        while time.monotonic() < deadline and int(self.ctl[A.G_CONSENSUS]) < rnd:
            self.raise_relay_error(rnd)
            time.sleep(0.02)
        self.raise_relay_error(rnd)

    def raise_relay_error(self, rnd: int) -> None:
        """Raise the relay's recorded failure (ReduceStall for a stall), if any."""
        got = self.arena.relay_error()
        if got is None:
            return
        code, info = got
        if code == A.RELAY_STALL:
            raise ReduceStall(f"round {info['round']} stalled across hosts: {info['text']}",
                              round=int(info["round"]), missing=tuple(info["missing"]),
                              timeout=info.get("timeout"), global_ranks=True)
        raise ConnectionError(f"round {rnd}: this host lost the cohort: {info['text']}")


def _f32_at(addr: int, n: int) -> np.ndarray:
    """``n`` float32 at ``addr`` (live memory the caller owns) as a numpy array."""
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr))


def frame_layout(shapes: list[tuple[int, ...]]) -> tuple[list[int], list[int], int]:
    """(element offsets, numels, total elements) of tensors laid end to end."""
    offs, numels = [], []
    total = 0
    for s in shapes:
        n = math.prod(s)
        offs.append(total)
        numels.append(n)
        total += n
    return offs, numels, total

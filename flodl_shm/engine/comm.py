"""``Comm``: the collectives one rank calls (mirrors flodl's CpuReduceClient).

Weighted semantics: a rank contributes tensors already scaled by its mass wᵣ
(``all_reduce_scaled`` fuses that scale into the copy into shared memory) and the
mass itself; every rank receives Σ(wᵣ·Tᵣ)/Σwᵣ over the accepted contributions,
accumulated in f32 in rank order (bit-identical on every rank), plus the accepted
mass Σwᵣ. A ``MODEL`` round whose accepted mass is 0 returns the raw sum (zeros)
with mass 0: callers keep their local state. ``CONTROL`` rounds are plain sums on
an f32 wire.

Buffer lifetimes:

- tensors returned by ``all_reduce_*``, ``broadcast_from_root`` and
  ``all_reduce(frame)`` are the caller's to keep: memory no later round touches while
  anything of it (a tensor, view, storage, ``.numpy()`` array or memoryview) is alive.
  Once the caller dropped every reference, a later call may reuse that memory for its
  own result (``tensor_codec.ResultPool``: warm pages instead of fresh page faults);
  a raw ``data_ptr()`` kept past the tensor's life is not a reference;
- **armed staging slots** (``set_pinned_decode(True)`` + ``arm_pinned_decode(slot)``):
  the next MODEL reply decodes into that slot's reusable f32 buffers and the
  returned tensors alias them — the next reply decoded into the same slot
  overwrites them (single consumer: finish with round N's tensors before the next
  armed round of that slot). Slots never share buffers;
- **zero-copy** (``zero_copy_inputs`` + ``all_reduce_zero_copy``): the input
  tensors live in this rank's shared bulk region and the consensus views in the
  shared result region. Both stay valid until this rank's next collective call;
  after it they may hold another round's data. Copy what must outlive that.

Where it lives: ``Comm`` (this module) holds a rank's state, its settings, the outer
optimizer's and the checkpoint tap's hooks, the round reports, the barrier and the
direct rounds' settlement; its collectives are its parts, one module each:

- ``comm_reduces.py``: the reduces (frames, tensor-returning, in place) and the
  per-rank gather;
- ``comm_broadcasts.py``: ``broadcast_from_root`` and ``broadcast_``;
- ``comm_zero_copy.py``: tensors in shared memory (zero-copy inputs, the shared
  parameter block);
- ``comm_rounds.py``: how a call becomes a round, from one compiled call through
  direct rounds to the general round (eager slots or bulk regions).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import numpy as np
import torch

from . import arena as A
from ..kernels.rounds import WORK_CHUNK as PER_RANK_FUSED_MAX
from ..frame import DTYPE_F32
from .checkpoint_tap import TapClient
from .comm_broadcasts import BroadcastCalls
from .comm_parts import GatherScatterCalls
from .comm_reduces import ReduceCalls
from .comm_rounds import _CONTROL, _MODEL, RoundPaths
from .comm_zero_copy import ZeroCopyCalls
from .direct import READY, UNAVAILABLE, UNPROBED, ClosedDirectRounds
from .hostmem import HostMemory
from .protocol import RoundEngine
from .round_report import RoundReports
from .staging import (  # noqa: F401 - the slot constants are part of this module's API too
    DECODE_SLOT_BUFFERS,
    DECODE_SLOT_PARAMS,
    StagingDecision,
    check_slot,
)
from .tensor_codec import TensorCodec, flat_f32
from .waiting import oversubscribed, spin_iterations

logger = logging.getLogger("flodl_shm")


class Comm(ReduceCalls, BroadcastCalls, GatherScatterCalls, ZeroCopyCalls, RoundPaths):
    """The collectives of one rank on one host arena (and, through the host's relay,
    of the whole cohort). Create through ``spawn`` or ``testing.FakeCohort``.

    Attributes:
        rank: global rank; local_rank: index on this host;
        world_size: ranks in the cohort; local_world_size: ranks on this host.
    """

    def __init__(self, arena: A.Arena, local_rank: int, *, global_rank: int | None = None,
                 world_size: int | None = None, timeout: float | None = None,
                 liveness: Callable[[], None] | None = None,
                 spin_iters: int | None = None, memory: HostMemory | None = None) -> None:
        if not 0 <= local_rank < arena.world:
            raise ValueError(f"local_rank {local_rank} must be < local world size {arena.world}")
        self.arena = arena
        self.local_rank = local_rank
        self.local_world_size = arena.world
        first = int(arena.ctl[A.G_FIRST_RANK])
        self.rank = first + local_rank if global_rank is None else int(global_rank)
        self.world_size = int(arena.ctl[A.G_GLOBAL_WORLD]) if world_size is None else int(world_size)
        if spin_iters is None:
            spin_iters = spin_iterations(arena.world)
        self._engine = RoundEngine(arena, local_rank, timeout=timeout, spin_iters=spin_iters,
                                   liveness=liveness or (lambda: None))
        if oversubscribed(arena.world):
            self._engine.yield_when_waiting()
        waiter = self._engine.waiter
        waiter.who, waiter.first_rank = f"rank {self.rank}", self.rank - local_rank
        self._round = 0
        self._broken: str | None = None
        self._in_round = 0  # thread id of the general/direct round in flight (_one_at_a_time)
        self._bf16 = False
        self._pinned = False
        self._armed: int | None = None
        self._codec = TensorCodec(arena.world, memory)
        self._zero_copy: tuple | None = None  # (plan, in the eager slot, round) of the inputs
        self._zc_inputs: dict = {}  # (plan, slot parity or "bulk") -> (region, views)
        self._zc_outputs: dict = {}  # plan -> (memory, consensus views)
        self._zc_plan: tuple | None = None  # (wire dtype, shapes, plan) of the last inputs
        # all_reduce_per_rank_f64's (its plan, whether it is one compiled call): one
        # attribute, not two. A Comm keeps to 29 instance attributes:
        # a 30th made every fused 4 KiB call ~130 ns slower on CPython 3.11 (its attribute
        # reads lose their fast path); tests/test_perf_guard.py holds the count
        per_rank_plan = self._engine.plan(_CONTROL, DTYPE_F32, ((self.world_size,),))
        self._per_rank = (per_rank_plan,
                          per_rank_plan.eager_fits and self.world_size <= PER_RANK_FUSED_MAX)
        self._barrier_plan = self._engine.plan(_CONTROL, DTYPE_F32, ())
        self._outer_installed = False
        self._outer_claims = 0
        self._fast: tuple | None = None  # (shape, kind, plan) of the last fused in-place call
        self._reports = RoundReports(arena)
        self._tap = TapClient(arena, self._engine, rank=self.rank, local_rank=local_rank)
        self._drift_checked: tuple[np.ndarray | None, int] = (None, 0)
        self._all_local = (1 << arena.world) - 1  # every local rank's bit
        first = self.rank - self.local_rank
        self._every_local = tuple(range(first, first + self.local_world_size))
        self._reported = -1  # the last round this rank sent a report with
        self._report_values: Sequence[float] = ()
        arena.ctl[A.rank_base(local_rank) + A.R_PID] = _getpid()

    # -- settings ----------------------------------------------------------------
    @property
    def bf16_wire(self) -> bool:
        return self._bf16

    @contextlib.contextmanager
    def longer_waits(self, extra_s: float):
        """Within the block, a wait of this rank gives up ``extra_s`` seconds later than
        the timeout says: for a round whose peer itself waits, with the same timeout, on
        something further away (a host leader in the exchange between hosts), so that the
        peer's own deadline fires first and it can say what it waited for."""
        waiter = self._engine.waiter
        before = waiter.timeout
        if before is not None:
            waiter.timeout = before + float(extra_s)
        try:
            yield
        finally:
            waiter.timeout = before

    def set_bf16_wire(self, on: bool) -> None:
        """Send MODEL rounds as bf16 (half the bytes); sums still accumulate in f32.

        May change between rounds; every rank must use the same setting in a round
        (a mix is a SchemaMismatchError on every rank)."""
        self._bf16 = bool(on)

    def set_pinned_decode(self, on: bool) -> None:
        """Enable slot-tagged reusable decode staging (see module doc), subject to the
        RAM gate: at the first armed decode, ``decide_pinned_decode`` budgets six model
        copies per local rank against the memory available at rank start and logs its
        decision at INFO; when it refuses, armed replies decode into fresh memory."""
        self._pinned = bool(on)
        if not on:
            self._armed = None

    @property
    def staging_decision(self) -> StagingDecision | None:
        """The RAM gate's decision (None until the first armed decode)."""
        return self._codec.gate

    @property
    def pinned_decode(self) -> bool:
        return self._pinned

    def arm_pinned_decode(self, slot: int) -> None:
        """Decode the NEXT MODEL reply into ``slot``'s staging (one shot; no-op when
        pinned decode is off). The next MODEL round takes the arm whatever it is: an
        in-place one (``all_reduce_``) decodes nothing, and a later reply is not armed."""
        slot = check_slot(slot)
        if self._pinned:
            self._armed = slot

    # -- outer optimizer and checkpoints ------------------------------------------
    def set_outer(self, outer) -> None:
        """Install the outer optimizer stepped on every round sent with ``outer=True``.

        On a single host each rank steps the slice of the params frame it reduces,
        with the previous global and the momentum kept in shared memory (never the
        whole model on every rank); on a cluster the controller steps it. Every rank
        must install the same optimizer. ``None`` or a stateless ``OuterAvg`` makes
        ``outer=True`` a plain reduce.
        """
        stateful = outer is not None and getattr(outer, "has_momentum", False)
        self._engine.outer.optimizer = outer if stateful else None
        self._outer_installed = stateful
        self._outer_claims += 1

    def outer_claim(self) -> int:
        """How many times an outer optimizer was installed (``set_outer``): a caller that
        installed one compares it later to know its state is still the Comm's."""
        return self._outer_claims

    def load_outer_momentum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Restore the outer momentum (``load_outer_momentum``'s tensors, in params
        order) before the first outer round after a resume."""
        self.load_outer_state(momentum=tensors)

    def load_outer_state(self, *, prev: Sequence[torch.Tensor] | None = None,
                         momentum: Sequence[torch.Tensor] | None = None) -> None:
        """Seed the next outer round as the first of a run (every rank, same values).

        Args:
            prev: the previous global (one tensor per parameter, params order) the next
                outer round steps from; ``None``: the consensus itself (a zero first step).
            momentum: the outer momentum to continue from; ``None``: fresh momentum.
        """
        self._engine.outer.seed(None if prev is None else flat_f32(prev),
                                None if momentum is None else flat_f32(momentum))

    def outer_momentum(self) -> np.ndarray | None:
        """A copy of the outer momentum (flat f32) the next outer round continues from:
        the last outer round's, or the loaded one before the first; None if neither."""
        return self._engine.outer.momentum()

    def outer_prev(self) -> np.ndarray | None:
        """A copy of the global the next outer round steps from (flat f32): the last
        outer round's result, or the seeded prev before the first; None if neither."""
        return self._engine.outer.prev()

    def controller_outer_round(self) -> int | None:
        """On a cluster whose controller steps a stateful outer optimizer, where its
        outer momentum starts: the sync round of the checkpoint it loaded the momentum
        from, or -1 for fresh momentum. None on one host, when the controller steps no
        outer optimizer, or loaded a momentum without its round. The relay learns it at
        its handshake, before it relays any round: read it after a cross-host round."""
        word = int(self.arena.ctl[A.G_CONTROLLER_OUTER])
        return None if word == 0 else word - 2

    def controller_outer(self) -> dict | None:
        """On a cluster, the outer optimizer the controller steps, as its handshake said:
        ``{"kind": "none"}`` or ``{"kind": "nesterov", "lr": LR, "momentum": MU}``. None
        on one host, or before the relay's handshake: read it after a cross-host round."""
        kind = int(self.arena.ctl[A.G_CONTROLLER_OUTER_KIND])
        if kind == 0:
            return None
        if kind == 1:
            return {"kind": "none"}
        return {"kind": "nesterov", "lr": float(self.arena.ctl_f64[A.G_CONTROLLER_OUTER_LR]),
                "momentum": float(self.arena.ctl_f64[A.G_CONTROLLER_OUTER_MU])}

    def arm_checkpoint(self, path, schema, meta=None, *,
                       tells_controller: bool | None = None) -> None:
        """Capture the next MODEL rounds (the params frame, then the buffers frame: up to
        ``schema.tensor_count()`` tensors) as a consensus checkpoint at ``path``.

        Every rank must arm at the same point of its program. The frames go to the
        arena owner's forge (``engine/checkpoint_tap.py``), which writes ``path`` (and the outer
        momentum next to it) off the training path, then ``meta`` (a
        ``CheckpointMeta``) as the bundle's ``.meta.json`` commit marker. A round
        whose accepted mass is 0 cancels the cycle (nothing was realized).

        ``tells_controller``: on a cluster, whether this rank arms the controller's forge
        too; exactly one live rank of the cohort must (default: global rank 0, which
        must then be alive; a caller that tracks deaths names the lowest live rank).
        """
        tells = self.rank == 0 if tells_controller is None else bool(tells_controller)
        self._tap.arm(path, schema, meta, self._round - 1, tells)

    def post_checkpoint(self, path, schema, tensors: Sequence[torch.Tensor], *, mass: float,
                        meta=None, momentum: np.ndarray | None = None) -> None:
        """Post a consensus this rank holds to the arena owner's forge as a checkpoint
        (not a collective: one rank calls it). On a cluster this writes the host's own
        copy; the controller's forge writes its copy of frames :meth:`arm_checkpoint`
        captured.

        The forge writes ``path`` (and ``momentum``, the outer momentum in params order
        as one flat float32 vector, next to it) off the training path, then ``meta``
        as the bundle's ``.meta.json`` commit marker, exactly as for frames captured by
        :meth:`arm_checkpoint`. Use it when the decision to checkpoint comes after the
        round: right after an in-place MODEL round every replica holds the consensus,
        so the lowest live rank posts its own. The tensors travel in the wire dtype
        (bfloat16 with ``set_bf16_wire(True)``: the consensus is bf16-exact then).

        Args:
            path: the bundle's model path (``<stem>.fdl``).
            schema: the model's ``ModelSchema``; ``tensors`` are its params then its
                averaged buffers, in its order.
            tensors: the consensus.
            mass: the round's accepted mass (> 0).
            meta: a ``CheckpointMeta`` (None: no ``.meta.json``).
            momentum: the outer momentum, or None.
        """
        self._tap.post_consensus(path, schema, tensors, mass=mass, meta=meta,
                                 momentum=momentum, bf16=self._bf16,
                                 last_round=self._round - 1)

    def set_fault_hook(self, hook: Callable[[str, int], None] | None) -> None:
        """Tests only: call ``hook(phase, round)`` at the fault-injection points
        ("before_copy_in", "mid_copy_in", "arrived", "reduce", "mid_copy_out") so a
        test can kill this rank at a precise moment of a bulk round."""
        self._engine.fault_hook = hook

    def last_accepted_ranks(self) -> list[int]:
        """Global ranks of this host whose contribution the last round accepted.

        On one host that is the whole accepted set. On a cluster it covers this host's
        ranks only; remote ranks are known to the controller (its ``dead_ranks``)."""
        return list(self.last_accepted())

    def last_accepted(self) -> tuple[int, ...]:
        """:meth:`last_accepted_ranks` as a tuple (the same one every round that accepted
        every local rank: a training window's sync reads it)."""
        mask = self._engine.last_accepted
        if mask == self._all_local:
            return self._every_local
        first = self.rank - self.local_rank
        return tuple([first + i for i in range(self.local_world_size) if (mask >> i) & 1])

    def _write_report(self, values: Sequence[float]) -> None:
        if self._engine.relay_mode:
            raise ValueError(
                "round reports cover the ranks of one host, but this Comm's rounds cross "
                "hosts through a relay: gather per-rank values with all_reduce_per_rank_f64 "
                "instead")
        self._reports.write(self.local_rank, self._round, values)
        self._reported = self._round
        self._report_values = values  # for a settle that runs before the round

    def last_reports(self) -> np.ndarray:
        """The reports of the last collective (``all_reduce_(report=...)``): a
        ``[local world, REPORT_VALUES]`` float64 table, row r = local rank r's values
        (zeros after its own, and for a rank the round did not accept: check
        :meth:`last_accepted_ranks`).

        Raises:
            RuntimeError: the last collective carried no report from this rank (read
                them right after the call, before the next collective), or an accepted
                rank sent none.
        """
        return self._reports.read(self._reported_round("last_reports"),
                                  self._engine.last_accepted)

    def last_report_rows(self) -> tuple[tuple[float, ...], ...]:
        """:meth:`last_reports` as one tuple of ``REPORT_VALUES`` floats per local rank,
        without numpy (a training window reads them when a numpy call costs several
        times a ``struct`` one). Same values, same checks."""
        return self._reports.rows(self._reported_round("last_report_rows"),
                                  self._engine.last_accepted)

    def _reported_round(self, what: str) -> int:
        """The last round, which must have carried this rank's report."""
        rnd = self._round - 1
        if self._reported != rnd or rnd < 0:
            raise RuntimeError(
                f"{what}() reads the reports of the last collective, which carried "
                "none from this rank: pass report= to all_reduce_ and read them before the "
                "next collective call")
        return rnd

    @property
    def round(self) -> int:
        """The number of the next collective round."""
        return self._round

    # -- the barrier ---------------------------------------------------------------
    def barrier(self) -> None:
        """Return once every live rank has entered the barrier."""
        eng = self._engine
        if self._broken is None and not eng.relay_mode and eng.fault_hook is None:
            # ``_eager_call`` inlined (its checks are ``_fusable``'s for a CONTROL round):
            # a barrier is about a microsecond, and the call frame costs a third of it
            rnd = self._round
            self._round = rnd + 1
            try:
                eng.barrier_round(rnd, 0.0, self._barrier_plan)
            except BaseException as e:
                self._fail(rnd, e)
                raise
        else:
            self._run(self._barrier_plan, 0.0, None)

    @property
    def spans_hosts(self) -> bool:
        """Whether the rounds go through this host's relay to a controller (``spawn`` with
        ``controller=``): several hosts, or one host joined to a controller. Round
        reports and the in-reduce outer step are single-host features."""
        return bool(self._engine.relay_mode)

    # -- direct rounds -------------------------------------------------------------
    @property
    def direct_rounds_available(self) -> bool:
        """Whether large float32 rounds may run as direct rounds (``engine/direct.py``):
        one host, an arena whose owner declared that a death ends the cohort (``spawn``
        with ``max_failures=0``, the c10d backend), and not found unavailable (ranks
        not permitted to attach to each other, ``FLODL_SHM_DIRECT=0``)."""
        return self._engine.direct.state != UNAVAILABLE

    @property
    def direct_min_bytes(self) -> int:
        """Payload bytes from which an eligible reduce runs as a direct round: the arena
        owner's word (``FLODL_SHM_DIRECT_MIN_BYTES`` where it created the arena, else
        256 KiB), the same on every rank."""
        return self._engine.direct.min_bytes

    @property
    def direct_broadcast_min_bytes(self) -> int:
        """Payload bytes from which a one-host float32 broadcast runs as a direct round
        (the readers copy the root's tensors straight into their own): 32 KiB, or 1 MiB
        where the host's ranks outnumber its cores; the same on every rank of a host."""
        return self._engine.direct.broadcast_min_bytes

    def direct_round_holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a direct round has room for the address table of a float32 reduce of
        ``tensors`` (two words a tensor in the rank's eager slot: a round of tens of
        thousands of tensors takes the shared path, whatever its bytes)."""
        plan = self._engine.plan(_MODEL, DTYPE_F32, tuple(tuple(t.shape) for t in tensors))
        return self._engine.direct.holds_addresses(plan)

    def settle_direct_rounds(self) -> bool:
        """Find out now whether direct rounds may run, and return whether they may (a
        collective: every rank of the host calls it, and every rank gets the same
        answer).

        The first large float32 round calls it when nothing did before: the probe
        runs between two barriers (``engine/direct.py``), so no round takes the shared
        path just to find out, and the bulk and result regions stay as small as the
        rounds that use them (with ``LocalSGD``'s parameters in shared memory, none do).
        ``LocalSGD`` calls it early: it places its parameters in shared blocks only
        where the rounds run direct. A no-op once settled.
        """
        direct = self._engine.direct
        if direct.state == UNPROBED:
            # one thread at a time, as the round that needs it: a second thread's round
            # slipped its own between the probe's barriers and broke the Comm
            self._one_at_a_time(self._probe_direct_rounds)
        return direct.state == READY

    def _probe_direct_rounds(self) -> None:
        """``settle_direct_rounds``'s probe, between two barriers."""
        direct, eng = self._engine.direct, self._engine
        # settled by a round that carries a report: the report goes with that round,
        # which now comes after the barriers
        carried = self._report_values if self._reported == self._round else None
        token = self._round
        self.barrier()  # every rank has published its pid and probe word
        direct.try_peers(token, range(eng.world))
        self.barrier()  # every rank has recorded its verdict of ``token``
        direct.settle(token, range(eng.world))
        if carried is not None:
            self._write_report(carried)

    # -- the end -------------------------------------------------------------------
    def leave(self) -> None:
        """Mark this rank as gone for good, then wake the waiters: a peer still waiting
        for it in a collective raises naming it (it left; every rank must make the same
        calls) instead of waiting out its timeout or taking it for dead. For a rank whose
        process group is destroyed (``spawn``'s supervisor marks its ranks as they
        return); call it before :meth:`close`. A Comm whose round failed does not
        leave: its peers see its exit as the failure it is, and name the ranks they
        waited for."""
        if self._broken is None:
            self.arena.mark_exited(self.local_rank)

    def close(self) -> None:
        """Release this rank's mappings (the arena's owner unlinks the segments). A
        collective called afterwards raises ``RuntimeError`` (it would run on memory no
        peer reads any more)."""
        self._broken = ("it was closed (its process group, cohort or spawn ended); create "
                        "a new one")
        self._codec.clear()
        # DirectRounds references the engine back: without that cycle the engine, and
        # the arena's mappings it holds, go with the last reference, not at the next
        # pass of the garbage collector
        self._engine.direct = ClosedDirectRounds()
        self.arena.close()

    def __repr__(self) -> str:
        return (f"Comm(rank={self.rank}/{self.world_size}, local={self.local_rank}/"
                f"{self.local_world_size}, round={self._round}, bf16_wire={self._bf16})")


def _getpid() -> int:
    import os

    return os.getpid()

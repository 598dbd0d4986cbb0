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

Reduce paths: a contribution of at most ``eager_bytes`` (schema words included)
travels through the double-buffered eager slots and every rank reduces it itself
(one synchronisation point); larger ones use the bulk regions with reduce-scatter
then all-gather, so no process reads all P inputs. See ``protocol.py``. On one host
with ``max_failures=0``, float32 ones from 256 KiB, eager-sized or not, are direct
rounds instead (``direct.py``): each rank reduces its slice straight out of the ranks'
tensors, with no shared copies.

Cost: a call whose tensors are small contiguous CPU tensors and whose frame fits the
eager slot runs as ONE compiled call (copy-in by address, publish, wait, validate,
reduce straight into the result memory): the Python around it is a plan lookup by
shapes (``RoundEngine.plan``) and the address list. Everything else (large frames,
non-contiguous tensors, checkpoint taps, outer rounds, clusters) takes the general
round (``_run``). The torch <-> wire conversions live in ``tensor_codec.py``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Sequence

import numpy as np
import torch

from . import arena as A
from ..errors import CohortAborted, FrameError
from ..kernels.rounds import WORK_CHUNK as PER_RANK_FUSED_MAX
from ..kernels.tensorio import overlapping_spans
from ..frame import (
    DTYPE_BF16,
    DTYPE_F32,
    MASS_MAX,
    MASS_MIN,
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_frame,
    mass_error,
    shown_number,
    tensor_array,
)
from .checkpoint_tap import TapClient
from .direct import READY, UNAVAILABLE, UNPROBED, ClosedDirectRounds
from .gathered import GatheredTensors
from .hostmem import HostMemory
from .protocol import RoundEngine, RoundPlan
from .round_report import RoundReports
from .staging import (  # noqa: F401 - the slot constants are part of this module's API too
    DECODE_SLOT_BUFFERS,
    DECODE_SLOT_PARAMS,
    StagingDecision,
    check_slot,
)
from .tensor_codec import (
    F32,
    NO_DRIFT,
    POOL_MIN_BYTES,
    TensorCodec,
    add_drift,
    check_tensors,
    decode_gathered,
    decode_into_tensor,
    drift_snapshot,
    flat_f32,
    flat_part,
    refuse_one_tensor,
    wire_views,
)
from .waiting import oversubscribed, spin_iterations

logger = logging.getLogger("flodl_shm")

_MODEL = int(RoundKind.MODEL)
_CONTROL = int(RoundKind.CONTROL)

#: a zero-copy frame lives in the eager slot (every rank then reads every rank's frame)
#: while the ranks' frames together stay under this many bytes; else in the bulk region,
#: whose round reads each frame once, a slice per rank. Zero-copy rounds on 2 cores
#: (BENCHMARKS.md, "Forty-third session"), eager against bulk: 2 ranks 256 KiB 20-21 µs
#: against 29, 512 KiB 46-54 against 33-34, 1 MiB 110-134 against 52-54; 4 ranks 128 KiB
#: 64-68 against 72-74, 256 KiB 139-143 against 80-81, 1 MiB 604-607 against 209-224
ZERO_COPY_EAGER_READ_BYTES = 1 << 20


def _check_drift(drift, ntensors: int) -> None:
    """ValueError unless ``drift`` is a writable, C-contiguous float64 numpy array of
    shape ``(ntensors, 3)`` (``all_reduce_``'s drift sums)."""
    if not (isinstance(drift, np.ndarray) and drift.dtype == np.float64
            and drift.shape == (ntensors, 3) and drift.flags.writeable
            and drift.flags.c_contiguous):
        got = (f"{drift.dtype} array of shape {drift.shape}" if isinstance(drift, np.ndarray)
               else type(drift).__name__)
        raise ValueError(f"drift must be a writable, C-contiguous float64 numpy array of "
                         f"shape (len(tensors), 3) = ({ntensors}, 3), got a {got}: allocate "
                         f"it with np.zeros(({ntensors}, 3))")


def _staged(t: torch.Tensor, staged: list, scale: float = 1.0) -> torch.Tensor:
    """A contiguous float32 CPU copy of ``t`` (of ``t.mul(scale)``: a bfloat16 tensor
    scaled with one bfloat16 rounding, as the shared path's copy-in scales it) for a
    direct round, noted in ``staged`` (pairs written back after an in-place round)."""
    src = t.detach() if scale == 1.0 else t.detach().mul(scale)
    copy = src.to(device="cpu", dtype=torch.float32, copy=True,
                  memory_format=torch.contiguous_format)
    staged.append((t, copy))
    return copy


def _integral(value) -> bool:
    """An int, an int enum or a numpy integer; not a bool, a float or anything else
    (``int()`` of those would take a weight for a kind or 1.5 for rank 1)."""
    return type(value) is int or (isinstance(value, (int, np.integer))
                                  and not isinstance(value, bool))


_F32_MAX = float(np.finfo(np.float32).max)
_F64 = np.dtype(np.float64)

#: ``_written(tensors)`` (a sequence of tensors): tell autograd that an in-place
#: collective changed them, as torch's own in-place ops do. Their values are written
#: through their addresses, which autograd cannot see: a tensor saved for backward, then
#: reduced or broadcast in place, fed backward its new values silently; with its version
#: counter moved, backward raises "one of the variables needed for gradient computation
#: has been modified by an inplace operation". (torch's C function: the public
#: ``torch.autograd.graph.increment_version`` wraps it in a Python frame that costs as
#: much again.)
_written = getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version
_STRIDED = torch.strided


def _scale_error(scale: float) -> FrameError:
    """The error for a ``scale`` that is not a finite float32 (NaN, infinite, or beyond
    float32's range: the kernels scale in float32), which every round path refuses
    (every rank's consensus would be NaN or inf, with its full mass, and no error)."""
    return FrameError(f"scale {scale} is not a finite float32 (at most {_F32_MAX:.4g} in "
                      f"size): every rank's consensus would be NaN or inf; pass a finite "
                      f"scale in range (a NaN one often comes from a 0/0 upstream)")


def _as_number(value) -> float:
    """``float(value)``, but text is no number here (``float("2")`` parses it: a weight
    read from a config file unconverted); ``TypeError`` or ``ValueError`` for none,
    ``OverflowError`` for an int beyond a float's range."""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError("text is not a number")
    return float(value)


def _as_scale(scale) -> float:
    """``scale`` as a float the kernels can scale by; ``FrameError`` for one beyond
    float32's range (an int beyond a float's too), ``TypeError`` for no number (text
    included)."""
    try:  # (free in CPython 3.11 until something raises)
        value = _as_number(scale)
    except OverflowError:  # an int beyond a float's range
        raise _scale_error(shown_number(scale)) from None
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number (what this rank's tensors are multiplied "
                        f"by before the round), got {type(scale).__name__} {scale!r:.60}"
                        ) from None
    if not -_F32_MAX <= value <= _F32_MAX:
        raise _scale_error(value)
    return value


def _kind(kind) -> int:
    """A round kind as an int; ValueError when it is none (``RoundKind``'s own for an
    int of no kind; a float or a bool, e.g. a weight passed where the kind goes, is no
    kind either: ``int(1.0)`` would make a weighted round a plain sum)."""
    if kind is RoundKind.MODEL:  # the default: skip the enum's int conversion
        return _MODEL
    if not _integral(kind):
        raise ValueError(f"kind must be a RoundKind (RoundKind.MODEL or RoundKind.CONTROL), "
                         f"got {kind!r} where the round kind goes (a weight passed by "
                         f"position?): pass weight=... by name")
    k = int(kind)
    if k != _MODEL and k != _CONTROL:
        raise ValueError(f"kind {kind!r} is not a RoundKind: pass RoundKind.MODEL (a model "
                         f"round, the default) or RoundKind.CONTROL")
    return k


def _checked_shapes(shapes) -> tuple[tuple[int, ...], ...]:
    """``zero_copy_inputs``' shapes as a tuple of int tuples; TypeError / ValueError naming
    one that is not a sequence of non-negative ints (a -1 gave an empty tensor, a 2.5 a
    tensor of 2)."""
    if shapes is None or isinstance(shapes, (str, bytes, torch.Tensor)):
        raise TypeError(f"zero_copy_inputs takes a list of shapes (one per tensor, e.g. "
                        f"[(3, 4), (4,)]), got {type(shapes).__name__}")
    out = []
    for i, s in enumerate(shapes):
        try:
            dims = tuple(s)
        except TypeError:
            raise TypeError(f"shape {i} is {s!r}: a shape is a tuple of ints, e.g. (3, 4) "
                            f"or (4,)") from None
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                   for d in dims):
            raise ValueError(f"shape {i} is {dims!r}: every dimension is an int >= 0")
        out.append(tuple(int(d) for d in dims))
    return tuple(out)


class Comm:
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
        self._engine.outer = outer if stateful else None
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
        eng = self._engine
        eng.outer_prev_loaded = None if prev is None else flat_f32(prev)
        eng.outer_loaded = None if momentum is None else flat_f32(momentum)
        eng.outer_steps = 0

    def outer_momentum(self) -> np.ndarray | None:
        """A copy of the outer momentum (flat f32) the next outer round continues from:
        the last outer round's, or the loaded one before the first; None if neither."""
        return self._outer_vector(self._engine.outer_loaded, RoundEngine.outer_momentum)

    def outer_prev(self) -> np.ndarray | None:
        """A copy of the global the next outer round steps from (flat f32): the last
        outer round's result, or the seeded prev before the first; None if neither."""
        return self._outer_vector(self._engine.outer_prev_loaded, RoundEngine.outer_prev)

    def _outer_vector(self, seeded: np.ndarray | None,
                      written: Callable[[RoundEngine], np.ndarray]) -> np.ndarray | None:
        eng = self._engine
        if eng.outer is None:
            return None
        if eng.outer_steps == 0:
            return None if seeded is None else seeded.copy()
        return written(eng).copy()

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

    # -- collectives -------------------------------------------------------------
    def all_reduce(self, frame: RoundFrame) -> RoundFrame:
        """Frame-level reduce: the payloads carry wᵣ·Tᵣ and ``frame.weight`` wᵣ; the reply
        carries the consensus (same schema) with ``weight`` = accepted mass."""
        reply = self._hot_frame(frame)
        if reply is not None:
            return reply
        check_frame(frame)
        payloads = frame.tensors
        dtype = payloads[0].dtype if payloads else DTYPE_F32
        if len(payloads) > 1:
            for p in payloads:
                if p.dtype != dtype:
                    raise FrameError("all tensors of one frame must share a wire dtype, got "
                                     f"{sorted({q.dtype for q in payloads})} (0 = f32, 1 = bf16)")
        kind = _kind(frame.kind)  # validated by check_frame
        eng = self._engine
        plan = eng.plan(kind, dtype, tuple([p.shape for p in payloads]))
        np_dtype = np.float32 if dtype == DTYPE_F32 else np.uint16
        # the reply's payloads are slices of one array the round reduces into, which no
        # earlier reply still references (the codec's result pool)
        out = self._codec.results.take(plan.nelem, np_dtype)
        fused = plan.fused and self._fusable(kind, False)
        src = _payload_array(payloads) if fused and dtype == DTYPE_F32 else None
        if src is not None:
            # copy-in, round and reduce into the reply: one compiled call
            mass = self._eager_call(frame.weight, eng.arrays_round, plan, src, out)
            self._fast = (payloads[0].shape, kind, plan)  # (``_hot_frame`` reads it)
        elif fused:
            _write_payloads(payloads, eng.eager_payload(self._round, plan), plan, np_dtype)
            if dtype == DTYPE_F32:  # the payload is in the slot: publish, wait, reduce
                mass = self._eager_call(frame.weight, lambda rnd, w: eng.eager_round(
                    plan, rnd, 0, w, out_f32=out))
            else:
                mass = self._fused_round(plan, frame.weight, 0, 1.0, None, 0, False)
                np.copyto(out, eng.eager_u16[:plan.nelem])
        elif dtype == DTYPE_F32 and self._direct_mode(plan, False) == A.FLAG_DIRECT:
            held = _gather_payloads(payloads, plan)  # (alive until the round is done)
            mass = self._direct_call(held, plan, frame.weight, 1.0, torch.from_numpy(out),
                                     gathered=True)
        else:
            def write(dst: np.ndarray, plan: RoundPlan) -> None:
                _write_payloads(payloads, dst, plan, np_dtype)

            cons, mass = self._run(plan, frame.weight, write, out=out)
            if cons is not out:
                np.copyto(out, cons[:plan.nelem])
        raw = memoryview(out).cast("B")
        if len(payloads) == 1:
            return _reply_frame([_reply_payload(dtype, plan.shapes[0], raw)], mass, frame.kind)
        esize = 4 if dtype == DTYPE_F32 else 2
        return _reply_frame([_reply_payload(dtype, s, raw[off * esize:(off + n) * esize])
                             for s, off, n in zip(plan.shapes, plan.offs, plan.numels)],
                            mass, frame.kind)

    def _hot_frame(self, frame: RoundFrame) -> RoundFrame | None:
        """``all_reduce``'s hot case, a loop's repeated frame of one small float32 payload
        in writable, aligned memory: the plan a first such frame (or a one-tensor call
        of the same kind and shape) cached, checked as ``check_frame``, ``_fusable`` and
        ``_begin`` check it, in one frame; the reply as the general path builds it.
        Else None: the general path decides, and names a bad frame."""
        fast = self._fast
        eng = self._engine
        if (fast is None or self._broken is not None or eng.relay_mode
                or eng.fault_hook is not None):
            return None
        try:  # (free in CPython 3.11 until something raises)
            payloads = frame.tensors
            kind = frame.kind
            w = frame.weight
            # (a RoundKind: a float or bool kind equal to the cached one is refused by the
            # general path's ``_kind``, which every rank reaches whatever it cached)
            if (type(payloads) is not list or len(payloads) != 1 or type(w) is not float
                    or not (MASS_MIN <= w <= MASS_MAX or w == 0.0) or type(kind) is not RoundKind
                    or kind != fast[1] or kind == _MODEL and self._tap.armed is not None):
                return None
            p = payloads[0]
            plan = fast[2]
            data = p.data
            if (type(p.dtype) is not int or p.dtype != DTYPE_F32 or p.shape != fast[0]
                    or type(data) is not memoryview or data.readonly
                    or data.nbytes != plan.nbytes or not (plan.fused and plan.nelem)):
                return None
            src = np.frombuffer(data, np.float32)
            if not src.flags.aligned:
                return None
        except Exception:  # (a frame the general path names)
            return None
        out = (np.empty(plan.nelem, np.float32) if plan.nbytes < POOL_MIN_BYTES
               else self._codec.results.take(plan.nelem, np.float32))
        rnd = self._round
        self._round = rnd + 1
        try:
            mass = eng.arrays_round(rnd, w, plan, src, out)
        except BaseException as e:
            self._fail(rnd, e)
            raise
        return _reply_frame([_reply_payload(DTYPE_F32, plan.shapes[0],
                                            memoryview(out).cast("B"))], mass, kind)

    def all_reduce_scaled(self, tensors: Sequence[torch.Tensor], scale: float,
                          kind: RoundKind | int = RoundKind.MODEL,
                          weight: float = 1.0, *, outer: bool = False
                          ) -> tuple[list[torch.Tensor], float]:
        """Send ``tensors · scale`` (scale fused into the copy-in, bit-identical to
        ``tensor.mul(scale)``) with mass ``weight``; returns (consensus, accepted mass).

        ``outer=True`` marks the params round of a window: the installed outer
        optimizer (``set_outer``) steps the consensus into the new global before it is
        returned (every rank must pass the same flag)."""
        if kind is RoundKind.MODEL and not outer:
            got = self._hot_result(tensors, weight, scale)
            if got is not None:
                return [got[0]], got[1]
        kind = _kind(kind)
        if not outer:
            got = self._single_fast(tensors, kind, weight, scale)
            if got is not None:
                return [got[0]], got[1]
        dtype = DTYPE_BF16 if (self._bf16 and kind == _MODEL) else DTYPE_F32
        armed = self._armed if kind == _MODEL else None
        self._armed = None
        scale = _as_scale(scale)
        outer = outer and kind == _MODEL
        plan = self._fused_plan(tensors, kind, dtype, outer)
        if plan is not None:
            res, out, addr = self._codec.fused_result(plan, armed)
            return res, self._fused_round(plan, weight, len(tensors), scale, out, addr, True)
        plan = self._direct_gathered(tensors, kind, dtype, outer)
        gathered = plan is not None  # (every tensor's address gathered, none staged)
        if not gathered:
            plan = self._engine.plan(kind, dtype, tuple(check_tensors(tensors)))
        if gathered or self._direct_mode(plan, outer) == A.FLAG_DIRECT:
            flat = self._codec.flat_result(plan.nelem, armed)
            mass = self._direct_call(tensors, plan, weight, scale, flat, gathered=gathered)
            return self._codec.views(flat, plan), mass

        def write(dst: np.ndarray, plan: RoundPlan) -> None:
            self._codec.encode(tensors, dst, plan, dtype, scale, self._engine.fault_hook,
                               self._round)

        # the result memory goes to the round: this rank's own slice lands in it while
        # the reduce still has it in cache, only the other slices are copied after
        flat = self._codec.flat_result(plan.nelem, armed)
        out = tensor_array(flat, np.float32)
        cons, mass = self._run(plan, weight, write, outer=outer, into=out)
        self._copy_out_except_own(cons, dtype, flat)
        return self._codec.views(flat, plan), mass

    def all_reduce_weighted(self, tensors: Sequence[torch.Tensor],
                            kind: RoundKind | int = RoundKind.MODEL,
                            weight: float = 1.0, *, outer: bool = False
                            ) -> tuple[list[torch.Tensor], float]:
        """Tensors already scaled by the caller; returns (Σ/Σw, accepted mass Σw), as
        float32 tensors (for bfloat16 inputs too: the f32 consensus, not rounded again)."""
        if kind is RoundKind.MODEL and not outer:
            got = self._hot_result(tensors, weight, 1.0)
            if got is not None:
                return [got[0]], got[1]
        if not outer:
            got = self._single_fast(tensors, _kind(kind), weight, 1.0)
            if got is not None:
                return [got[0]], got[1]
        return self.all_reduce_scaled(tensors, 1.0, kind, weight, outer=outer)

    def all_reduce_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Equal-weight mean over the accepted ranks, as float32 tensors (for bfloat16
        inputs too: ``.to(torch.bfloat16)`` gives what :meth:`all_reduce_` writes)."""
        got = self._hot_result(tensors, 1.0, 1.0)
        if got is not None:
            return [got[0]]
        got = self._single_fast(tensors, _MODEL, 1.0, 1.0)
        if got is not None:
            return [got[0]]
        return self.all_reduce_scaled(tensors, 1.0, RoundKind.MODEL, 1.0)[0]

    def _hot_result(self, tensors: Sequence[torch.Tensor], weight, scale
                    ) -> tuple[torch.Tensor, float] | None:
        """The hot case of the three tensor-returning reduces of a MODEL round without
        outer step, a training loop's repeated call over one small float32 tensor: the
        plan ``_hot_plan`` cached, a valid weight and scale, a result below the pooled
        sizes. ``_single_fast``'s round with its frames inlined (``_single_plan``,
        ``_single_result``, ``_single_round``, ``_begin``), as in ``all_reduce_``:
        0.7-0.8 µs of a 5.5 µs call at 4 KiB. Returns (result, accepted mass), or None:
        the general path decides, and names a bad argument."""
        plan = self._hot_plan(tensors)
        if plan is None or plan.nbytes >= POOL_MIN_BYTES:
            return None
        try:  # (free in CPython 3.11 until something raises)
            # as floats (a float16 inf compared as given passes float32's bounds: its own
            # precision rounds them to inf); text, which float() parses, raises TypeError
            w = weight if type(weight) is float else _as_number(weight)
            s = scale if type(scale) is float else _as_number(scale)
            if not ((MASS_MIN <= w <= MASS_MAX or w == 0.0) and -_F32_MAX <= s <= _F32_MAX):
                return None
            t = tensors[0]
            addr = t.data_ptr()  # (an mkldnn tensor has none: the general path names it)
        except (TypeError, ValueError, ArithmeticError, RuntimeError):
            return None
        res = torch.empty_like(t)  # t: contiguous f32; cheaper than numpy + from_numpy
        rnd = self._round
        self._round = rnd + 1
        try:
            mass = self._engine.inplace_round(rnd, w, addr, plan, s, res.data_ptr())
        except BaseException as e:
            self._fail(rnd, e)
            raise
        return res, mass

    def _single_fast(self, tensors: Sequence[torch.Tensor], kind: int, weight,
                     scale) -> tuple[torch.Tensor, float] | None:
        """The first case of the tensor-returning reduces, checked once for all three:
        one float32 tensor on an f32 wire and no pinned result armed, so copy-in, round
        and the reduce into a fresh result are one compiled call (a direct round's
        too); returns (result, accepted mass), or None for the general paths."""
        if isinstance(tensors, torch.Tensor):
            refuse_one_tensor(tensors)  # (one of one row has a len of 1: named, not reduced)
        try:  # (free in CPython 3.11 until something raises)
            if len(tensors) != 1 or (self._bf16 and kind == _MODEL) or self._armed is not None:
                return None
            plan = self._single_plan(tensors[0], kind, False, direct=True)
        except (TypeError, AttributeError):
            check_tensors(tensors)  # None, a generator, a list where a tensor goes: named
            raise
        if plan is None:
            return None
        scale = _as_scale(scale)
        if plan.fused:
            return self._single_result(tensors[0], plan, weight, scale)
        t = tensors[0]
        res = self._result_like(t, plan)
        return res, self._direct_one(t, plan, weight, scale, res)

    def all_reduce_(self, tensors: Sequence[torch.Tensor], *, weight: float = 1.0,
                    scale: float = 1.0, kind=RoundKind.MODEL, outer: bool = False,
                    report: Sequence[float] | None = None,
                    drift: np.ndarray | None = None) -> float:
        """In place: replace each tensor by the consensus (like ``dist.all_reduce``).

        Contributes ``tensors · scale`` with mass ``weight``. When a MODEL round's
        accepted mass is 0 the tensors are left untouched (keep local). Returns the
        accepted mass. Tensors must be float32 or bfloat16.

        ``report``: up to ``REPORT_VALUES`` (8) float32 numbers of this rank that ride in
        the round's header; every rank reads everyone's with :meth:`last_reports` right
        after the call (``engine/round_report.py``). One host only; every rank of the
        round must pass one.

        ``drift``: a float64 numpy array of shape ``(len(tensors), 3)``; row ``i`` gets
        ``(Σ old², Σ new², Σ (old - new)²)`` of tensor ``i`` added (old: its values
        before the call, new: after; a tensor left untouched adds its norm twice and
        0), e.g. a replica's drift ``||old - new|| / ||new||``. A small round takes the
        sums while it writes the consensus (no snapshot, no second pass); the others
        snapshot the tensors first.
        """
        if report is None and drift is None and kind is RoundKind.MODEL and not outer:
            plan = self._hot_plan(tensors)
            if plan is not None:
                # ``_all_reduce_in_place``'s one-call round with its frames inlined
                # (``_single_round``, ``_begin``): they cost a fifth of a 4 KiB call
                try:  # (free in CPython 3.11 until something raises)
                    # (as ``_hot_result`` takes them)
                    w = weight if type(weight) is float else _as_number(weight)
                    s = scale if type(scale) is float else _as_number(scale)
                    hot = (MASS_MIN <= w <= MASS_MAX or w == 0.0) and -_F32_MAX <= s <= _F32_MAX
                    addr = tensors[0].data_ptr()
                except (TypeError, ValueError, ArithmeticError, RuntimeError):
                    hot = False  # the general path names what is wrong (Decimal NaN's too)
                if hot:
                    rnd = self._round
                    self._round = rnd + 1
                    try:
                        mass = self._engine.inplace_round(rnd, w, addr, plan, s)
                    except BaseException as e:
                        self._fail(rnd, e)
                        raise
                    _written(tensors)
                    return mass
        if drift is not None and (drift is not self._drift_checked[0]
                                  or len(tensors) != self._drift_checked[1]):
            _check_drift(drift, len(tensors))  # once per array: a window reuses its own
            self._drift_checked = (drift, len(tensors))
        if report is None:
            mass = self._all_reduce_in_place(tensors, weight, scale, kind, outer, drift)
            _written(tensors)
            return mass
        rnd = self._round
        self._write_report(report)
        try:
            mass = self._all_reduce_in_place(tensors, weight, scale, kind, outer, drift)
        except BaseException:
            if self._round == rnd:  # refused before the round: the report went nowhere
                self._reported = -1
            raise
        _written(tensors)
        return mass

    def _all_reduce_in_place(self, tensors: Sequence[torch.Tensor], weight: float,
                             scale: float, kind, outer: bool,
                             drift: np.ndarray | None = None) -> float:
        kind = _kind(kind)
        dtype = DTYPE_BF16 if (self._bf16 and kind == _MODEL) else DTYPE_F32
        outer = outer and kind == _MODEL
        scale = _as_scale(scale)
        if self._armed is not None and kind == _MODEL:
            self._armed = None  # this MODEL round's reply is the tensors: nothing staged
        eng = self._engine
        if isinstance(tensors, torch.Tensor):
            refuse_one_tensor(tensors)  # (one of one row has a len of 1: named, not reduced)
        try:  # (free in CPython 3.11 until something raises)
            if len(tensors) == 1 and dtype == DTYPE_F32 and drift is None:
                plan = self._single_plan(tensors[0], kind, outer, direct=True)
                if plan is not None and not plan.fused:  # (a direct round: one call too)
                    return self._direct_one(tensors[0], plan, weight, scale, None)
                if plan is not None:
                    # copy-in, round and copy-out are a single compiled call
                    return self._single_round(tensors[0], plan, weight, scale)
        except (TypeError, AttributeError):
            check_tensors(tensors)  # None, a generator, a list where a tensor goes: named
            raise  # (tensors that pass: the round's own error)
        plan = self._fused_plan(tensors, kind, dtype, outer)
        if plan is not None:
            # copy-in, round and the write-back of the float32 tensors: one compiled call
            sums = NO_DRIFT if drift is None else drift
            mass = self._eager_call(weight, eng.tensors_round, plan, scale, sums)
            if kind == _MODEL and not mass > 0.0:
                if drift is not None:  # untouched: old == new
                    add_drift(drift_snapshot(tensors, plan.nelem, self._codec.results),
                              tensors, drift)
                return mass
            if plan.bf16_sources:  # the float32 tensors hold the consensus already
                decode_gathered(eng.eager_f32 if dtype == DTYPE_F32 else eng.eager_u16, dtype,
                                plan, tensors, drift, floats_done=True)
            return mass
        if drift is None:
            plan = self._direct_gathered(tensors, kind, dtype, outer)
            if plan is not None:  # every tensor's address gathered, none staged
                return self._direct_call(tensors, plan, weight, scale, None, gathered=True)
        plan = eng.plan(kind, dtype, tuple(check_tensors(tensors, in_place=True)))
        if drift is None:
            return self._all_reduce_planned(tensors, plan, weight, scale, kind, outer, dtype)
        old = drift_snapshot(tensors, plan.nelem, self._codec.results)
        mass = self._all_reduce_planned(tensors, plan, weight, scale, kind, outer, dtype)
        add_drift(old, tensors, drift)
        return mass

    def _all_reduce_planned(self, tensors: Sequence[torch.Tensor], plan: RoundPlan,
                            weight: float, scale: float, kind: int, outer: bool,
                            dtype: int) -> float:
        """``all_reduce_``'s rounds beyond one compiled call: direct, or the general
        round (bulk or eager) with the consensus copied back into ``tensors``."""
        eng = self._engine
        how = self._direct_mode(plan, outer)
        if how == A.FLAG_DIRECT:
            return self._direct_call(tensors, plan, weight, scale, None)

        def write(dst: np.ndarray, plan: RoundPlan) -> None:
            self._codec.encode(tensors, dst, plan, dtype, scale, eng.fault_hook, self._round)

        into = None
        if (len(tensors) == 1 and tensors[0].dtype is F32 and tensors[0].is_cpu
                and tensors[0].is_contiguous()):
            into = tensor_array(tensors[0].detach().view(-1), np.float32)
        cons, mass = self._run(plan, weight, write, outer=outer, into=into)
        if kind == _MODEL and mass <= 0.0:
            return mass
        if into is not None:
            self._copy_out_except_own(cons, dtype, tensors[0])
            return mass
        hook = eng.fault_hook
        for i, (t, off, n) in enumerate(zip(tensors, plan.offs, plan.numels)):
            if hook is not None and i == 1:
                hook("mid_copy_out", self._round - 1)
            decode_into_tensor(cons[off:off + n], dtype, t)
        return mass

    def all_reduce_per_rank_f64(self, values: Sequence[float]) -> np.ndarray:
        """Gather one float64 per rank: each rank fills its own slot (zeros elsewhere);
        every rank gets the summed vector (dead ranks read 0). Values travel as f32
        (exact for integers up to 2^24), as in flodl."""
        world = self.world_size
        plan, fused = self._per_rank
        if type(values) is np.ndarray and values.shape == (world,) and values.dtype is _F64:
            vec = values.copy()  # the common case; the copy is the result's memory
        else:
            try:
                vec = np.asarray(values, dtype=np.float64)
            except (TypeError, ValueError):
                vec = None
            if vec is not None and (vec is values or vec.base is not None):
                vec = vec.copy()  # (the input's own memory, or a view of it: the result's own)
            if vec is None or vec.ndim == 0:  # (None, a string, one number, a generator)
                raise TypeError(f"all_reduce_per_rank_f64 takes one number per rank ({world}), "
                                f"a list or a 1-d array, got {type(values).__name__} "
                                f"{values!r:.60}")
            vec = vec.reshape(-1)
            if vec.shape[0] != world:
                raise ValueError(
                    f"all_reduce_per_rank_f64 takes one slot per rank: {vec.shape[0]} "
                    f"values, world_size {world}. Pass {world} numbers with this rank's "
                    f"value at index {self.rank} and zeros elsewhere (every rank gets the "
                    f"sum: each rank's value in its slot)")
        if fused and self._fusable(_CONTROL, False):
            # into and out of ``vec``: one compiled call (``_eager_call`` inlined, as in
            # ``barrier``; its checks are ``_fusable``'s)
            rnd = self._round
            self._round = rnd + 1
            try:
                self._engine.per_rank_round(rnd, plan, vec)
            except BaseException as e:
                self._fail(rnd, e)
                raise
            return vec

        def write(dst: np.ndarray, plan: RoundPlan) -> None:
            np.copyto(dst[:world], vec, casting="same_kind")

        cons, _ = self._run(plan, 0.0, write)
        return cons[:world].astype(np.float64)

    def broadcast_from_root(self, tensors: Sequence[torch.Tensor], root: int = 0) -> list[torch.Tensor]:
        """Every rank receives ``root``'s tensors (byte-exact, f32), e.g. to align
        initial parameters. Non-root ranks pass tensors of the same shapes.

        On one host this is a real broadcast: the root copies its tensors into its eager
        slot (small frames) or bulk region once, every rank copies them out of there
        (no reduce, no result region). A root that died before publishing makes every
        other rank raise a RuntimeError naming it; ranks passing different roots raise
        ``SchemaMismatchError``. On a cluster it is a reduce to which only the root
        contributes (with mass 1); a root that died before its tensors arrived makes every
        rank raise a RuntimeError naming it.

        Args:
            tensors: float32/bfloat16 tensors (the root's are sent; the others only
                give the shapes).
            root: the global rank whose tensors every rank receives.
        """
        plan = self._hot_broadcast(tensors, root)
        if plan is not None:
            return [self._single_result(tensors[0], plan, 0.0, 1.0,
                                        root - self.rank + self.local_rank)[0]]
        is_root, local_root = self._broadcast_root(root)
        eng = self._engine
        if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__len__"):
            refuse_one_tensor(tensors)  # (None, a bare tensor, a generator: named)
        if len(tensors) == 1 and local_root is not None:
            t = tensors[0]
            plan = self._single_plan(t, _CONTROL, False, broadcast=True)
            if plan is not None and self._broadcast_direct(plan):
                res = self._result_like(t, plan)
                self._direct_broadcast_one(plan, t.data_ptr() if is_root else 0,
                                           res.data_ptr(), local_root)
                return [res]
            if plan is not None:
                # the root's copy-in, the round and the copy into a fresh result: one call
                return [self._single_result(tensors[0], plan, 0.0, 1.0, local_root)[0]]
        plan = self._fused_plan(tensors, _CONTROL, DTYPE_F32, False, broadcast=True)
        if plan is not None and not self._broadcast_direct(plan):  # (never in relay mode)
            res, out, addr = self._codec.fused_result(plan, None)
            self._fused_round(plan, 0.0, len(tensors) if is_root else 0, 1.0, out, addr, False,
                              elided=not is_root, broadcast=local_root)
            return res
        if local_root is not None:
            plan = self._direct_gathered(tensors, _CONTROL, DTYPE_F32, False, True, plan)
            if plan is not None:  # every tensor's address gathered, none staged
                flat = self._codec.flat_result(plan.nelem, None)
                self._direct_call(tensors if is_root else None, plan, 0.0, 1.0, flat,
                                  broadcast=local_root, gathered=is_root)
                return self._codec.views(flat, plan)
        plan = eng.plan(_CONTROL, DTYPE_F32, tuple(check_tensors(tensors, broadcast=True)))
        flat = self._codec.flat_result(plan.nelem, None)
        if local_root is not None and self._broadcast_direct(plan):
            self._direct_call(tensors if is_root else None, plan, 0.0, 1.0, flat,
                              broadcast=local_root)
            return self._codec.views(flat, plan)

        def write(dst: np.ndarray, plan: RoundPlan) -> None:
            self._codec.encode(tensors, dst, plan, DTYPE_F32, 1.0, eng.fault_hook,
                               self._round)

        out = tensor_array(flat, np.float32)
        # on a cluster, a reduce to which only the root contributes, with mass 1: a round
        # that accepted no mass lost its root (it died before its tensors arrived), and
        # its sum is zeros, not the root's tensors
        cons, mass = self._run(plan, 1.0 if is_root else 0.0, write if is_root else None,
                               elided=not is_root, out=out, broadcast=local_root)
        if local_root is None and not mass > 0.0:
            raise RuntimeError(
                f"broadcast_from_root: the root, rank {root}, died before its tensors "
                f"arrived; no rank received them. Broadcast from a live rank")
        if cons is not out:  # a cluster round: the consensus is in the result region
            np.copyto(out, cons[:plan.nelem])
        del out
        return self._codec.views(flat, plan)

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        """In place: every rank's ``tensors`` take ``root``'s values, bit for bit (like
        ``dist.broadcast``); the root's tensors keep theirs.

        The in-place form of :meth:`broadcast_from_root`, for tensors the call may
        overwrite: the root makes no copy for itself. Small tensors on one host are one
        compiled call per rank (the readers copy the root's eager slot straight into
        their tensors); float32 rounds that run as direct rounds (from 32 KiB, or 1 MiB
        where ranks outnumber cores; one host, ``max_failures=0``:
        ``Comm.direct_rounds_available``) have the readers copy the root's tensors
        straight into their own, and the root copy nothing (one tensor: one compiled call
        per rank too). Otherwise the round is :meth:`broadcast_from_root`'s, copied into
        the readers' tensors. Errors as :meth:`broadcast_from_root`'s. Float32 values
        arrive bit for bit; bfloat16 ones too, except that a NaN arrives as the canonical
        bfloat16 NaN (the round carries float32, and torch rounds it back).

        Args:
            tensors: float32/bfloat16 CPU tensors of the same shapes on every rank.
            root: the global rank whose values every rank takes.
        """
        plan = self._hot_broadcast(tensors, root)
        if plan is not None:  # (the root copies nothing back: its tensor holds it)
            t = tensors[0]
            self._single_round(t, plan, 0.0, 1.0, t.data_ptr(),
                               root - self.rank + self.local_rank)
            _written(tensors)
            return
        self._broadcast_in_place(tensors, root)
        _written(tensors)

    def _hot_broadcast(self, tensors: Sequence[torch.Tensor], root) -> RoundPlan | None:
        """The plan of a loop's repeated small broadcast of one float32 tensor on one host
        (a one-call eager round: the plan ``_single_plan`` cached for a CONTROL round),
        checked as ``_broadcast_root``, ``_single_plan`` and ``_broadcast_direct`` check
        it, in one frame instead of five; else None: the general path decides, and names
        a bad argument."""
        fast = self._fast
        if fast is None or fast[1] != _CONTROL or type(root) is not int:
            return None
        eng = self._engine
        try:  # (free in CPython 3.11 until something raises)
            t = tensors[0]
            plan = fast[2]
            if (len(tensors) == 1 and (type(tensors) is list or type(tensors) is tuple)
                    and 0 <= root < self.world_size and self._broken is None
                    and not eng.relay_mode and eng.fault_hook is None
                    and t.dtype is F32 and t.layout is _STRIDED and t.is_cpu
                    and t.is_contiguous() and t.shape == fast[0] and plan.eager_fits
                    and plan.nelem and plan.nbytes < eng.direct.broadcast_min_bytes):
                return plan
        except Exception:  # (an empty list, a sparse tensor, ...: the general path names it)
            pass  # (an mkldnn tensor passes the rest: its layout sends it there too)
        return None

    def _broadcast_in_place(self, tensors: Sequence[torch.Tensor], root: int) -> None:
        is_root, local_root = self._broadcast_root(root)
        eng = self._engine
        if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__len__"):
            refuse_one_tensor(tensors)
        if local_root is not None:
            if len(tensors) == 1:
                t = tensors[0]
                plan = self._single_plan(t, _CONTROL, False, broadcast=True)
                if plan is not None and self._broadcast_direct(plan):
                    addr = t.data_ptr()
                    self._direct_broadcast_one(plan, addr, addr, local_root)
                    return
                if plan is not None:  # (the root copies nothing back: its tensor holds it)
                    self._single_round(t, plan, 0.0, 1.0, t.data_ptr(), local_root)
                    return
            plan = self._fused_plan(tensors, _CONTROL, DTYPE_F32, False, broadcast=True)
            if plan is not None and not self._broadcast_direct(plan):
                self._fused_round(plan, 0.0, len(tensors) if is_root else 0, 1.0, None, 0,
                                  False, elided=not is_root, broadcast=local_root)
                if not is_root:
                    decode_gathered(eng.eager_f32, DTYPE_F32, plan, tensors)
                return
            plan = self._direct_gathered(tensors, _CONTROL, DTYPE_F32, False, True, plan)
            if plan is not None:  # every tensor's address gathered, none staged
                self._direct_call(tensors, plan, 0.0, 1.0, None, broadcast=local_root,
                                  gathered=True)
                return
            plan = eng.plan(_CONTROL, DTYPE_F32, tuple(
                check_tensors(tensors, in_place=not is_root, broadcast=True)))
            if self._broadcast_direct(plan):
                self._direct_call(tensors, plan, 0.0, 1.0, None, broadcast=local_root)
                return
            t = tensors[0]
            if len(tensors) == 1 and t.dtype is F32 and t.is_cpu and t.is_contiguous():
                # the general round: each reader copies the root's payload straight into
                # its tensor; the root copies its tensor in and nothing out
                def write(dst: np.ndarray, plan: RoundPlan) -> None:
                    self._codec.encode(tensors, dst, plan, DTYPE_F32, 1.0, eng.fault_hook,
                                       self._round)

                self._run(plan, 0.0, write if is_root else None, elided=not is_root,
                          out=None if is_root else tensor_array(t.detach().view(-1),
                                                                np.float32),
                          broadcast=local_root)
                return
        got = self.broadcast_from_root(tensors, root)
        if not is_root:
            with torch.no_grad():
                for t, r in zip(tensors, got):
                    t.copy_(r)

    def _broadcast_root(self, root: int) -> tuple[bool, int | None]:
        """(whether this rank is ``root``, the root's local rank on this host or None on
        a cluster, where a broadcast is a reduce); ValueError for a root that is not a
        rank of the cohort."""
        if (type(root) is not int and not _integral(root)) \
                or not 0 <= int(root) < self.world_size:
            raise ValueError(f"broadcast root {root!r} is not a rank of this cohort (an int "
                             f"from 0 to {self.world_size - 1}): pass the global rank whose "
                             f"tensors every rank should receive")
        root = int(root)
        local_root = (None if self._engine.relay_mode
                      else root - (self.rank - self.local_rank))
        return self.rank == root, local_root

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

    # -- shared tensors ------------------------------------------------------------
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

    def shared_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` placed in this rank's shared parameter block (the arena's
        ``p<r>`` segment), in order, each contiguous and of its tensor's shape.

        A direct round over exactly such tensors reduces them without copies: each slice
        reducer reads every rank's block and writes the consensus into every rank's
        block, in place, with plain loads and stores (``engine/direct.py``, MAPPED).
        ``LocalSGD(shared_params=...)`` moves a model's parameters there. The tensors
        stay valid for the arena's life. Once per rank of an arena (the block starts at
        its segment's first byte).

        Args:
            tensors: float32 CPU tensors.

        Raises:
            RuntimeError: this rank placed tensors already.
            ValueError: a tensor is not float32 on the CPU, or the rounds cross hosts.
        """
        me = A.rank_base(self._engine.rank)
        if self._engine.arena.ctl[me + A.R_PARAMS_BYTES] > 0:
            raise RuntimeError(
                "this rank's shared parameter block already holds the tensors of an earlier "
                "shared_tensors() call, for the Comm's life (an earlier LocalSGD's model, say: "
                "one placement per rank): average those (one LocalSGD per Comm, the models "
                "in one nn.ModuleList), or build this averaging without shared tensors")
        if self._engine.relay_mode:
            raise ValueError("shared tensors serve rounds inside one host, but this Comm's "
                             "rounds cross hosts through a relay")
        if isinstance(tensors, torch.Tensor) or tensors is None:
            refuse_one_tensor(tensors)  # (a bare tensor was placed as its rows)
        tensors = list(tensors)  # (a generator was read twice: nothing was placed)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {i} is a {type(t).__name__}; shared tensors are made "
                                f"from float32 CPU tensors (torch.from_numpy(a) for an array)")
            if t.dtype is not F32 or not t.is_cpu or t.layout is not torch.strided:
                layout = "" if t.layout is torch.strided else f", {t.layout}"
                raise ValueError(f"tensor {i} is {t.dtype} on {t.device}{layout}; shared "
                                 f"tensors are float32 CPU tensors, dense")
        # each tensor starts on a 64-byte boundary (16 floats)
        offs, total = [], 0
        for t in tensors:
            offs.append(total)
            total += -(-t.numel() // 16) * 16
        block = self._engine.arena.place_params(self._engine.rank, 4 * total)
        flat = torch.from_numpy(block[:4 * total].view(np.float32))
        out = []
        with torch.no_grad():
            for t, off in zip(tensors, offs):
                view = flat[off:off + t.numel()].view(t.shape)
                view.copy_(t)
                out.append(view)
        return out

    # -- zero-copy ---------------------------------------------------------------
    def zero_copy_inputs(self, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Tensors backed by this rank's shared memory for the next round, to fill in
        place (in the wire dtype: float32, or bfloat16 with ``set_bf16_wire(True)``).
        Fill them with wᵣ·Tᵣ, then call ``all_reduce_zero_copy(weight)`` as the very
        next collective. Valid until this rank's next collective call.

        A small frame lives in the eager slot of the next round's parity (the round then
        costs what the fused copy round costs); a larger one in this rank's bulk region,
        whose round has each rank reduce a slice. Small means it fits the slot and all
        the ranks' frames together stay under ``ZERO_COPY_EAGER_READ_BYTES``: in an eager
        round every rank reads all of them."""
        dtype = DTYPE_BF16 if self._bf16 else DTYPE_F32
        eng = self._engine
        rnd = self._round
        last = self._zc_plan  # a loop asks for the same shapes every round
        if not isinstance(shapes, (list, tuple)):  # (a generator is read once, here)
            shapes = _checked_shapes(shapes)
        if last is not None and last[0] == dtype and tuple(shapes) == last[1]:
            plan = last[2]
        else:
            key = _checked_shapes(shapes)
            plan = eng.plan(_MODEL, dtype, key)
            self._zc_plan = (dtype, key, plan)
        eager = (plan.eager_fits and plan.nbytes * eng.world < ZERO_COPY_EAGER_READ_BYTES
                 and not eng.relay_mode and eng.fault_hook is None)
        region = None if eager else eng.bulk_region(plan.total)
        where = (plan, rnd & 1) if eager else (plan, "bulk")
        cached = self._zc_inputs.get(where)
        if cached is None or cached[0] is not region:  # new schema, or the region grew
            if eager:
                payload = eng.eager_region(rnd)[plan.off:plan.total]
            else:
                payload = region[plan.off:plan.total]
            views = wire_views(payload.view(np.float32 if dtype == DTYPE_F32 else np.uint16),
                               dtype, plan)
            if len(self._zc_inputs) > 8:
                self._zc_inputs.clear()
            cached = self._zc_inputs[where] = (region, tuple(views))
        self._zero_copy = (plan, eager, rnd)
        return list(cached[1])

    def all_reduce_zero_copy(self, weight: float = 1.0, kind=RoundKind.MODEL
                             ) -> tuple[list[torch.Tensor], float]:
        """Reduce what was filled into ``zero_copy_inputs``; returns views of the
        consensus (wire dtype: in the shared result region, or for small frames in
        this rank's private reduce buffer) and the accepted mass. The views are valid
        until this rank's next collective call."""
        if self._zero_copy is None:
            raise RuntimeError("call zero_copy_inputs(shapes) and fill the tensors before "
                               "all_reduce_zero_copy()")
        plan, eager, rnd = self._zero_copy
        self._zero_copy = None
        if eager and rnd != self._round:
            raise RuntimeError(
                f"zero_copy_inputs was called for round {rnd} but this is round "
                f"{self._round}: another collective ran in between and reused the inputs' "
                f"memory; call all_reduce_zero_copy() right after filling the inputs")
        kind = _kind(kind)
        if kind != plan.kind:
            plan = self._engine.plan(kind, plan.dtype, tuple(plan.shapes))
        eng = self._engine
        if eager and self._fusable(kind, False):
            mass = self._eager_call(weight, eng.zero_copy_round, plan)
            cons = eng.eager_f32 if plan.dtype == DTYPE_F32 else eng.eager_u16
        else:
            cons, mass = self._run(plan, weight, None, zero_copy=True, eager_zero_copy=eager)
        cached = self._zc_outputs.get(plan)
        if cached is not None and cached[0] is cons.base:
            return list(cached[1]), mass
        out = wire_views(cons[:plan.nelem] if eager else cons, plan.dtype, plan)
        if len(self._zc_outputs) > 8:
            self._zc_outputs.clear()
        self._zc_outputs[plan] = (cons.base, tuple(out))
        return out, mass

    # -- the round ---------------------------------------------------------------
    def _begin(self, weight) -> float:
        """Round begin, shared by every path: refuse a broken Comm, validate the mass."""
        if self._broken is not None:
            raise RuntimeError(f"this Comm is unusable: {self._broken}")
        try:  # (free in CPython 3.11 until something raises)
            weight = _as_number(weight)
        except OverflowError:  # an int beyond a float's range
            raise mass_error(weight) from None
        except (TypeError, ValueError):
            raise TypeError(f"weight must be a number (this rank's mass in the round, e.g. "
                            f"its samples), got {type(weight).__name__} {weight!r:.60}"
                            ) from None
        if not MASS_MIN <= weight <= MASS_MAX and weight != 0.0:  # NaN fails both
            raise mass_error(weight)
        return weight

    def _fail(self, rnd: int, e: BaseException) -> None:
        """A round raised ``e`` after publishing (the caller re-raises). A schema
        mismatch leaves the Comm usable (every rank raised at the same point: still in
        step); anything else breaks it, naming the round."""
        if isinstance(e, FrameError):
            return
        self._broken = f"round {rnd} failed with {type(e).__name__}: {e}"
        if isinstance(e, CohortAborted) and self._engine.relay_mode:
            self._engine.raise_relay_error(rnd)  # the host relay's failure, if that is why

    def _single_plan(self, t: torch.Tensor, kind: int, outer: bool,
                     broadcast: bool = False, direct: bool = False) -> RoundPlan | None:
        """The plan of a one-tensor f32-wire round over ``t`` when it can run as one
        compiled call (a contiguous float32 CPU tensor whose frame fits the eager slot;
        a reduce's, one not sized for a direct round: ``RoundPlan.fused``), else None.
        With ``direct``, a reduce's plan that runs as a direct round too (not
        ``fused``: ``_direct_one``). The last such plan is cached: a training loop
        repeats it."""
        try:  # (free in CPython 3.11 until something raises)
            if not (t.dtype is F32 and t.layout is _STRIDED and t.is_cpu and t.is_contiguous()
                    and self._fusable(kind, outer)):
                return None  # (an mkldnn tensor, whose address is no data's, goes on to be named)
            shape = t.shape
        except RuntimeError:  # a sparse CSR or nested tensor has no strides or sizes: named
            check_tensors([t])
            raise
        fast = self._fast
        if fast is None or fast[0] != shape or fast[1] != kind:
            fast = self._fast = (shape, kind, self._engine.plan(kind, DTYPE_F32, (shape,)))
        plan = fast[2]
        # not for an empty tensor: its address is 0, which the call reads as "in place"
        if (plan.eager_fits if broadcast else plan.fused) and plan.nelem:
            return plan
        return plan if direct and self._direct_mode(plan, outer) == A.FLAG_DIRECT else None

    def _direct_one(self, t: torch.Tensor, plan: RoundPlan, weight, scale: float,
                    out: torch.Tensor | None) -> float:
        """A direct round of the contiguous float32 tensor ``t`` (``_single_plan`` with
        ``direct``), in place or into ``out``: its address gathered here, none of the
        general path's checks or plan lookups (``_direct_call``)."""
        plan.addr_words[0] = t.data_ptr()
        return self._direct_call((t,), plan, weight, scale, out, gathered=True)

    def _hot_plan(self, tensors: Sequence[torch.Tensor]) -> RoundPlan | None:
        """The plan of ``all_reduce_``'s hot case, a training loop's repeated call over
        one float32 tensor, weight and scale aside: the plan ``_single_plan`` cached for
        a MODEL round without outer step, when ``tensors`` is one tensor it fits and
        nothing else must run (a pinned result, a bf16 wire). Else None: the general
        path decides, and names a bad argument."""
        fast = self._fast
        eng = self._engine
        if (fast is None or fast[1] != _MODEL or self._armed is not None or self._bf16
                or self._broken is not None or eng.relay_mode or eng.fault_hook is not None
                or self._tap.armed is not None):
            return None
        try:  # (free in CPython 3.11 until something raises)
            # (a tensor of one row has a len of 1 too: the general path refuses it)
            if len(tensors) != 1 or type(tensors) is not list and type(tensors) is not tuple:
                return None
            t = tensors[0]
            plan = fast[2]
            if (t.dtype is F32 and t.is_cpu and t.is_contiguous() and t.shape == fast[0]
                    and plan.fused and plan.nelem):
                return plan
        except Exception:  # (a dict, a sparse CSR tensor, ...: the general path names it)
            pass
        return None

    def _single_round(self, t: torch.Tensor, plan: RoundPlan, weight, scale: float,
                      out: int = 0, broadcast: int | None = None) -> float:
        """Run a ``_single_plan`` round: in place (``out`` 0) or into the ``plan.nelem``
        f32 at address ``out``; ``broadcast``: the local root of a broadcast round into
        ``out``."""
        # ``_eager_call`` inlined: this is the 4 KiB path of six APIs, where going through
        # it measured 0.3-0.6 µs more per call (an in-place call is about 3 µs)
        if broadcast is None:
            flags = 0
            weight = self._begin(weight)
        else:  # (a broadcast's mass is 0; ``_single_plan`` refused a broken Comm)
            flags = A.FLAG_BROADCAST | (0 if broadcast == self.local_rank else A.FLAG_ELIDED)
        rnd = self._round
        self._round = rnd + 1
        try:
            return self._engine.inplace_round(rnd, weight, t.data_ptr(), plan, scale, out, flags,
                                              -1 if broadcast is None else broadcast)
        except BaseException as e:
            self._fail(rnd, e)
            raise

    def _single_result(self, t: torch.Tensor, plan: RoundPlan, weight, scale: float,
                       broadcast: int | None = None) -> tuple[torch.Tensor, float]:
        """A ``_single_round`` into a result the caller keeps (``_result_like``); returns
        (result, accepted mass)."""
        res = self._result_like(t, plan)
        mass = self._single_round(t, plan, weight, scale, res.data_ptr(), broadcast)
        return res, mass

    def _result_like(self, t: torch.Tensor, plan: RoundPlan) -> torch.Tensor:
        """A result shaped like ``t`` (a contiguous f32 tensor of ``plan``): fresh memory,
        from the codec's pool at pooled sizes."""
        if plan.nbytes < POOL_MIN_BYTES:
            return torch.empty_like(t)  # t: contiguous f32; cheaper than numpy + from_numpy
        res = torch.from_numpy(self._codec.results.take(plan.nelem, np.float32))
        return res.view(t.shape) if t.dim() != 1 else res

    def _direct_broadcast_one(self, plan: RoundPlan, src: int, dst: int, root: int) -> None:
        """A ``_single_plan`` broadcast from local rank ``root`` as a direct round
        (``DirectRounds.broadcast_one``): the root's tensor at ``src`` (0 elsewhere) into
        this rank's ``dst`` (the root's ``src`` again when in place)."""
        rnd = self._round
        self._round = rnd + 1
        try:
            self._engine.direct.broadcast_one(plan, rnd, root, src, dst)
        except BaseException as e:
            self._fail(rnd, e)
            raise

    def _eager_call(self, weight, call: Callable[..., float], *args) -> float:
        """An eager round's frame: validate the mass, take the round number, then
        ``call(round, mass, *args)`` (a fused call: it writes the slot's schema words
        itself; an engine method with its arguments costs less than a closure); a
        failure goes through ``_fail`` (naming the round) before it propagates."""
        weight = self._begin(weight)
        rnd = self._round
        self._round = rnd + 1
        try:
            return call(rnd, weight, *args)
        except BaseException as e:
            self._fail(rnd, e)
            raise

    def _copy_out_except_own(self, cons: np.ndarray, dtype: int, t: torch.Tensor) -> None:
        """Copy the consensus into the flat tensor ``t`` of a round run with ``into=``
        (``_run``): all of it, or every slice but the one this rank's reduce already
        wrote there (``RoundEngine.own_slice``)."""
        n = cons.shape[0]
        done = self._engine.own_slice or (0, 0)
        for a, b in ((0, done[0]), (done[1], n)):
            if b > a:
                decode_into_tensor(cons[a:b], dtype, flat_part(t, a, b))

    def _direct_mode(self, plan: RoundPlan, outer: bool, broadcast: bool = False) -> int:
        """FLAG_DIRECT when a round of ``plan`` runs as a direct round
        (``engine/direct.py``), else 0. Decided from what every rank agrees on, so the
        first eligible round of every rank settles the direct path first, together."""
        flags = ((A.FLAG_OUTER if outer and self._outer_installed else 0)
                 | (A.FLAG_TAP if plan.kind == _MODEL and self._tap.armed is not None else 0)
                 | (A.FLAG_BROADCAST if broadcast else 0))
        direct = self._engine.direct
        if direct.state == UNPROBED and direct.eligible(plan, flags):
            self.settle_direct_rounds()
        return direct.mode(plan, flags)

    def _broadcast_direct(self, plan: RoundPlan) -> bool:
        """Whether a one-host broadcast of ``plan`` runs as a direct round. Asked first on
        every path a broadcast may take (a fused eager call included), since the ranks'
        tensors may send them down different paths and the answer must be the same on
        all: it depends on the schema alone."""
        return (plan.nbytes >= self._engine.direct.broadcast_min_bytes
                and self._direct_mode(plan, False, True) == A.FLAG_DIRECT)

    def _direct_call(self, tensors: Sequence[torch.Tensor] | None, plan: RoundPlan, weight,
                     scale: float, out: torch.Tensor | None, broadcast: int | None = None,
                     gathered: bool = False) -> float:
        """A direct round over ``tensors`` (checked against ``plan``): in place when
        ``out`` is None (a MODEL round with no accepted mass leaves them untouched),
        else into ``out`` (a flat f32 result of ``plan.nelem``); ``broadcast``: the
        local root of a direct broadcast, into ``out`` (``tensors`` None on the other
        ranks) or, ``out`` None, into every rank's ``tensors`` (the root's stay as they
        are). A tensor that is not a contiguous float32 CPU tensor goes through a
        contiguous float32 copy. ``gathered``: the tensors' addresses are in
        ``plan.addrs`` already, every one a contiguous float32 CPU tensor's
        (``_direct_gathered``)."""
        return self._one_at_a_time(self._direct_round, tensors, plan, weight, scale, out,
                                   broadcast, gathered)

    def _direct_round(self, tensors: Sequence[torch.Tensor] | None, plan: RoundPlan, weight,
                      scale: float, out: torch.Tensor | None, broadcast: int | None,
                      gathered: bool = False) -> float:
        weight = self._begin(weight)
        nt = plan.ntensors
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        if gathered:  # (``TensorCodec.gather``: contiguous float32 CPU tensors, every one)
            srcs = plan.addrs[:nt].copy()
        else:
            srcs = np.zeros(nt, np.int64)
            # the round scales in float32, which a bfloat16 tensor's ``mul(scale)`` does
            # not (one bfloat16 rounding, as the shared path's copy-in): this rank's
            # tensors are then staged scaled, and its round scales by 1
            prescale = scale != 1.0 and any(t.dtype is not F32 for t in tensors or ())
            for i, t in enumerate(tensors or ()):
                if prescale:
                    t = _staged(t, staged, scale)
                elif not (t.dtype is F32 and t.is_cpu and t.is_contiguous()):
                    t = _staged(t, staged)
                srcs[i] = t.data_ptr()
            if prescale:
                scale = 1.0
        if out is None and nt > 1:
            # in place, each rank writes its slice of every tensor while the others still
            # read theirs: tensors that share memory (a tied weight listed twice,
            # overlapping views) would read what another slice already wrote: copies too
            for i in overlapping_spans(srcs, plan.addrs[nt:2 * nt]):
                srcs[i] = _staged(tensors[i], staged).data_ptr()
        if out is None:
            dsts = srcs
        else:
            base = out.data_ptr()
            dsts = base + 4 * np.asarray(plan.offs, np.int64)
        eng = self._engine
        rnd = self._round
        self._round = rnd + 1
        try:
            if broadcast is not None:
                mass = 0.0
                eng.direct.broadcast(plan, rnd, broadcast, srcs if tensors else None, dsts,
                                     hook=eng.fault_hook)
            else:
                mass = eng.direct.run(plan, rnd, weight, scale, srcs, dsts,
                                      keep_on_empty=out is None, hook=eng.fault_hook)
        except BaseException as e:
            self._fail(rnd, e)
            raise
        if out is None and staged and (plan.kind != _MODEL or mass > 0.0):
            # (narrowed as the shared path's write-back narrows: torch's copy_ gives a
            # NaN other bits)
            for t, copy in staged:
                decode_into_tensor(tensor_array(copy.view(-1), np.float32), DTYPE_F32, t)
        return mass

    def _fusable(self, kind: int, outer: bool) -> bool:
        """Whether a round of ``kind`` may run as one fused eager call on this rank."""
        eng = self._engine
        return not (self._broken is not None or eng.relay_mode or eng.fault_hook is not None
                    or (outer and self._outer_installed)
                    or (kind == _MODEL and self._tap.armed is not None))

    def _fused_plan(self, tensors: Sequence[torch.Tensor], kind: int, dtype: int,
                    outer: bool, broadcast: bool = False) -> RoundPlan | None:
        """The plan of a fused round over ``tensors`` with their addresses gathered, or
        None when the general round must run (nothing was published): a reduce's only
        when ``RoundPlan.fused``, a broadcast's when its frame fits the eager slot."""
        if type(tensors) is GatheredTensors:  # (a window's: gathered at its first round)
            return tensors.plan(self._engine, kind, dtype, broadcast) \
                if self._fusable(kind, outer) else None
        refuse_one_tensor(tensors)
        if not self._fusable(kind, outer):
            return None
        try:  # (a nested tensor has no sizes, or sizes that are no ints)
            plan = self._engine.plan(kind, dtype, tuple([t.shape for t in tensors]))
        except (AttributeError, TypeError, RuntimeError):
            return None  # the general path names what is wrong
        if not (plan.eager_fits if broadcast else plan.fused) \
                or not TensorCodec.gather(tensors, plan):
            return None
        return plan

    def _direct_gathered(self, tensors: Sequence[torch.Tensor], kind: int, dtype: int,
                         outer: bool, broadcast: bool = False,
                         plan: RoundPlan | None = None) -> RoundPlan | None:
        """The plan of a direct round (a ``broadcast``'s or a reduce's) over ``tensors``
        (on a float32 wire, ``dtype``) with their addresses gathered
        (``TensorCodec.gather``: every one a contiguous float32 CPU tensor, so none needs
        a staging copy, nor the general path's checks), or None: the general path runs
        (it stages what needs it, and names a tensor it cannot reduce). ``plan``: theirs,
        gathered already (``_fused_plan``'s)."""
        if dtype != DTYPE_F32:
            return None
        if plan is None:
            try:  # (a nested tensor has no sizes, or sizes that are no ints)
                plan = self._engine.plan(kind, DTYPE_F32, tuple([t.shape for t in tensors]))
            except (AttributeError, TypeError, RuntimeError):
                return None
            if self._direct_mode(plan, outer, broadcast) != A.FLAG_DIRECT \
                    or not TensorCodec.gather(tensors, plan):
                return None
        return None if plan.bf16_sources else plan

    def _fused_round(self, plan: RoundPlan, weight, count: int, scale: float,
                     out: np.ndarray | None, out_addr: int, upcast: bool, *,
                     elided: bool = False, broadcast: int | None = None) -> float:
        """One eager round as a single compiled call: copy-in of the first ``count``
        gathered tensors, publish, wait, validate, reduce into ``out`` or the
        ``plan.nelem`` f32 at ``out_addr`` (neither: the engine's ``eager_f32``;
        bf16-wire rounds reduce into ``eager_u16`` and widen into the f32 output when
        ``upcast``). ``broadcast``: the local root of a broadcast round (its slot is
        the only one read; checked to be the only contributor). Returns the accepted
        mass."""
        eng = self._engine
        flags = (A.FLAG_ELIDED if elided else 0) | (0 if broadcast is None else A.FLAG_BROADCAST)

        def call(rnd: int, w: float) -> float:
            mass = eng.eager_round(plan, rnd, flags, w, count=count, scale=scale,
                                   out_f32=out, out_addr=out_addr, upcast=upcast)
            if broadcast is not None:
                eng.check_broadcast(rnd, eng.last_accepted, eng.last_contributors(), broadcast)
            return mass

        return self._eager_call(weight, call)

    def _one_at_a_time(self, round_fn: Callable, *args, **kwargs):
        """Run ``round_fn`` (a general or direct round) as this Comm's one round in flight;
        RuntimeError before it starts when one is in flight already. A Comm is one
        rank's sequence of collectives: two threads driving it at once would put two
        rounds in its slots and mix their results silently. (The fused one-call rounds
        are not checked here, where a check costs a tenth of the call: their control
        block finds the rounds out of step.) Within the thread in flight, a round runs
        as part of the one in flight (the direct path's probe runs its barriers so)."""
        me = threading.get_ident()
        holder = self._in_round
        if holder == me:
            return round_fn(*args, **kwargs)
        if holder:
            raise RuntimeError(
                f"this Comm (rank {self.rank}) is in a collective already, called from "
                f"another thread: a Comm's collectives must come from one thread at a time, "
                f"in the same order on every rank; serialize them (a lock around the "
                f"calls), or give each thread its own process group")
        self._in_round = me
        try:
            return round_fn(*args, **kwargs)
        finally:
            self._in_round = 0

    def _run(self, plan: RoundPlan, weight: float, write: Callable | None, *,
             elided: bool = False, zero_copy: bool = False, outer: bool = False,
             into: np.ndarray | None = None, out: np.ndarray | None = None,
             eager_zero_copy: bool = False, broadcast: int | None = None
             ) -> tuple[np.ndarray, float]:
        """One collective round of the general path; returns (consensus in the wire
        dtype, accepted mass). ``write(dst, plan)`` fills the payload (``dst`` typed
        like the wire). The consensus array is only valid until this rank's next round,
        unless it is ``out`` (a wire-typed array of ``plan.nelem`` an eager round may
        reduce into). ``into``: a private flat f32 array of ``plan.nelem`` (the caller's
        destination) into which a bulk round's reduce writes this rank's own slice while
        it is still in cache (``RoundEngine.own_slice`` says which elements, or None).
        ``eager_zero_copy``: a zero-copy frame already in the eager slot.
        ``broadcast``: the local root of a one-host broadcast (every rank copies the
        root's payload into ``out``; no reduce; the root of an in-place broadcast passes
        no ``out``: its tensors hold the payload)."""
        return self._one_at_a_time(self._general_round, plan, weight, write, elided=elided,
                                   zero_copy=zero_copy, outer=outer, into=into, out=out,
                                   eager_zero_copy=eager_zero_copy, broadcast=broadcast)

    def _general_round(self, plan: RoundPlan, weight: float, write: Callable | None, *,
                       elided: bool, zero_copy: bool, outer: bool, into: np.ndarray | None,
                       out: np.ndarray | None, eager_zero_copy: bool, broadcast: int | None
                       ) -> tuple[np.ndarray, float]:
        """``_run``'s round, inside the one-round-in-flight guard."""
        weight = self._begin(weight)
        eng = self._engine
        rnd = self._round
        kind, dtype = plan.kind, plan.dtype
        tap = kind == _MODEL and self._tap.armed is not None
        # only a stateful outer optimizer steps (OuterAvg is the plain consensus); on a
        # cluster the flag travels to the controller, which refuses it if it has none
        outer = outer and self._outer_installed
        # the outer step runs in the slice reduce: outer rounds take the bulk path
        bulk = ((zero_copy and not eager_zero_copy) or eng.relay_mode or outer
                or not plan.eager_fits)
        region = eng.prepare(rnd, plan, bulk, payload=not (elided and broadcast is not None))
        hook = eng.fault_hook
        if hook is not None:
            hook("before_copy_in", rnd)
        if write is not None and not elided:
            if region is None:
                region = eng.eager_region(rnd)
            raw = region[plan.off:plan.off + plan.nbytes]
            write(raw.view(np.float32 if dtype == DTYPE_F32 else np.uint16), plan)
        flags = ((A.FLAG_BULK if bulk else 0) | (A.FLAG_ELIDED if elided else 0)
                 | (A.FLAG_ZERO_COPY if zero_copy else 0) | (A.FLAG_OUTER if outer else 0)
                 | (A.FLAG_TAP if tap else 0) | (0 if broadcast is None else A.FLAG_BROADCAST))
        self._round = rnd + 1
        eng.own_slice = None
        try:
            if not bulk:
                if out is None:
                    out_f32, out_u16 = eng.eager_f32, eng.eager_u16
                elif dtype == DTYPE_F32:
                    out_f32, out_u16 = out, eng.eager_u16
                else:
                    out_f32, out_u16 = eng.eager_f32, out
                mass = eng.eager_round(plan, rnd, flags, weight, out_f32=out_f32,
                                       out_u16=out_u16)
                if broadcast is not None:
                    eng.check_broadcast(rnd, eng.last_accepted, eng.last_contributors(),
                                        broadcast)
                cons = out if out is not None else (
                    (out_f32 if dtype == DTYPE_F32 else out_u16)[:plan.nelem])
            elif broadcast is not None:
                eng.publish(rnd, kind, flags, dtype, weight, len(plan.shapes), plan.nbytes,
                            plan.nelem, plan.shash, len(plan.words))
                if hook is not None:
                    hook("arrived", rnd)
                # the root copies its payload in before it arrives: spin for that long
                view = eng.await_arrivals(rnd, nbytes=plan.nbytes)
                eng.check_broadcast(rnd, view.accepted_mask, view.contrib_mask, broadcast)
                eng.broadcast_copy(view, broadcast, out)
                if self.local_rank == broadcast:
                    eng.await_readers(view)
                cons, mass = out, view.mass
            else:
                eng.publish(rnd, kind, flags, dtype, weight, len(plan.shapes), plan.nbytes,
                            plan.nelem, plan.shash, len(plan.words))
                if hook is not None:
                    hook("arrived", rnd)
                view = eng.await_arrivals(rnd, nbytes=plan.nbytes)
                eng.reduce_slice(view, self.local_rank,
                                 into if view.mass > 0.0 or kind != _MODEL else None)
                eng.await_slices(view)
                mass = eng.await_consensus(view) if eng.relay_mode else view.mass
                cons = eng.consensus_array(view)
                if eng.outer_applies(view):
                    eng.outer_round_done(view.nelem)
            if tap:
                self._tap.captured(rnd, dtype, plan.shapes, cons, mass, outer)
            return cons, mass
        except BaseException as e:
            self._fail(rnd, e)
            raise

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


def _write_payloads(payloads, dst: np.ndarray, plan: RoundPlan, np_dtype) -> None:
    """Copy a checked frame's payloads (byte counts match their shapes) into ``dst``."""
    if len(payloads) == 1:
        np.copyto(dst[:plan.nelem], np.frombuffer(payloads[0].data, np_dtype))
        return
    for p, off, n in zip(payloads, plan.offs, plan.numels):
        np.copyto(dst[off:off + n], np.frombuffer(p.data, np_dtype))


def _gather_payloads(payloads, plan: RoundPlan) -> list[np.ndarray]:
    """A float32 frame's payloads' addresses into ``plan.addrs``, for a direct round into
    a result (which only reads them); the arrays those addresses are in, for the caller
    to hold until the round is done. Read-only or unaligned data is copied (every rank
    must take the direct path alike, whatever its buffers)."""
    out = []
    addrs = plan.addr_words
    for i, p in enumerate(payloads):
        a = np.frombuffer(p.data, np.float32)
        if not (a.flags.writeable and a.flags.aligned):
            a = a.copy()
        addrs[i] = a.ctypes.data
        out.append(a)
    return out


def _payload_array(payloads) -> np.ndarray | None:
    """A one-payload float32 frame's data as an array a fused call can take, or None:
    several payloads, or data read-only or unaligned (each another compiled type; those
    frames are copied into the slot instead)."""
    if len(payloads) != 1 or payloads[0].data.readonly:
        return None
    src = np.frombuffer(payloads[0].data, np.float32)
    return src if src.flags.aligned else None


def _reply_payload(dtype: int, shape: tuple[int, ...], data: memoryview) -> TensorPayload:
    """A reply payload built from values already validated: the shape comes from the
    request (``check_frame`` checked it), the data is a flat byte view of fresh memory
    (``memoryview(array).cast("B")``, or a slice of one). Skips the constructor's
    re-validation (~1 µs per payload at 4 KiB)."""
    p = object.__new__(TensorPayload)
    p.dtype = dtype
    p.shape = shape
    p.data = data
    return p


def _reply_frame(payloads: list[TensorPayload], mass: float, kind: RoundKind) -> RoundFrame:
    """A reply frame of validated parts (``kind`` is the checked request's)."""
    f = object.__new__(RoundFrame)
    f.tensors = payloads
    f.weight = float(mass)
    f.kind = kind
    return f


def _getpid() -> int:
    import os

    return os.getpid()

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
  ``all_reduce(frame)`` are the caller's to keep: fresh memory no later round touches;
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
then all-gather, so no process reads all P inputs. See ``protocol.py``.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import numpy as np
import torch

from . import arena as A
from ..errors import CohortAborted, FrameError
from ..frame import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_frame,
    check_tensor_dtype,
    elem_size,
)
from ..kernels import codec as K
from ..kernels import rounds as RK
from ..kernels import signals
from ..kernels import tensorio as TIO
from .checkpoint_tap import post as tap_post
from .waiting import Waiter
from .hostmem import HostMemory, host_memory
from .protocol import RoundEngine, frame_layout, schema_hash, schema_words
from .staging import (  # noqa: F401 - the slot constants are part of this module's API too
    DECODE_SLOT_BUFFERS,
    DECODE_SLOT_PARAMS,
    DecodeStaging,
    StagingDecision,
    check_slot,
    decide_pinned_decode,
)
from .waiting import YIELD_BUDGET_S, oversubscribed, spin_iterations

logger = logging.getLogger("flodl_shm")

_SCRATCH = 4096


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
            self._engine.waiter.yield_budget = YIELD_BUDGET_S
        self._round = 0
        self._broken: str | None = None
        self._bf16 = False
        self._pinned = False
        self._armed: int | None = None
        self._staging = DecodeStaging()
        self._gate: StagingDecision | None = None
        # the RAM gate budgets against what was available at rank start, before the
        # run's own working set (docs/host_ram.md, "The checks")
        self._mem_at_start = memory
        eager_out = np.empty(arena.eager_bytes, np.uint8)
        self._eager_f32 = eager_out.view(np.float32)
        self._eager_u16 = eager_out.view(np.uint16)
        self._scratch = np.empty(_SCRATCH, np.float32)
        self._scratch16 = np.empty(_SCRATCH, np.uint16)
        self._plans: dict[tuple, _Plan] = {}
        self._slot_schema: dict = {}
        self._zero_copy: tuple | None = None
        self._zc_inputs: tuple | None = None
        self._outer_installed = False
        self._fast: tuple | None = None
        self._ckpt: dict | None = None
        self._ckpt_cycle = 0
        arena.ctl[A.rank_base(local_rank) + A.R_PID] = _getpid()

    # -- settings ----------------------------------------------------------------
    @property
    def bf16_wire(self) -> bool:
        return self._bf16

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
        return self._gate

    @property
    def pinned_decode(self) -> bool:
        return self._pinned

    def arm_pinned_decode(self, slot: int) -> None:
        """Decode the NEXT MODEL reply into ``slot``'s staging (one shot; no-op when
        pinned decode is off)."""
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

    def load_outer_momentum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Restore the outer momentum (``load_outer_momentum``'s tensors, in params
        order) before the first outer round after a resume."""
        flat = [t.detach().reshape(-1).to(torch.float32).numpy() for t in tensors]
        self._engine.outer_loaded = np.concatenate(flat) if flat else np.empty(0, np.float32)
        self._engine.outer_steps = 0

    def outer_momentum(self) -> np.ndarray | None:
        """A copy of the outer momentum after the last outer round (flat f32), or None."""
        eng = self._engine
        if eng.outer is None or eng.outer_steps == 0:
            return None
        return eng.outer_momentum().copy()

    def arm_checkpoint(self, path, schema, meta=None) -> None:
        """Capture the next MODEL rounds (the params frame, then the buffers frame: up to
        ``schema.tensor_count()`` tensors) as a consensus checkpoint at ``path``.

        Every rank must arm at the same point of its program. The frames go to the
        arena owner's forge (``engine/checkpoint_tap.py``), which writes ``path`` (and the outer
        momentum next to it) off the training path, then ``meta`` (a
        ``CheckpointMeta``) as the bundle's ``.meta.json`` commit marker. A round
        whose accepted mass is 0 cancels the cycle (nothing was realized).
        """
        import os

        self._ckpt_cycle += 1
        self._ckpt = {
            "cycle": self._ckpt_cycle, "part": 0, "path": os.fspath(path),
            "param_names": list(schema.param_names), "buffer_names": list(schema.buffer_names),
            "meta": None if meta is None else meta.to_dict(),
            "remaining": schema.tensor_count(),
        }
        if self._engine.relay_mode and self.rank == 0:
            # on a cluster the controller's forge taps the consensus; rank 0 tells it where
            # (through this host's relay) before the captured rounds start
            head = {k: v for k, v in self._ckpt.items() if k != "remaining"}
            head["arm_only"] = True
            tap_post(self.arena, self._engine.doorbell, head, np.empty(0, np.uint8), None,
                     wait_ack=self._wait_tap_ack)
            self._wait_tap_ack(int(self.arena.ctl[A.G_TAP_SEQ]))

    def _tap_round(self, rnd: int, dtype: int, shapes, cons: np.ndarray, mass: float,
                   outer: bool) -> None:
        ck = self._ckpt
        if mass <= 0.0:
            logger.info("checkpoint %s: round %d realized nothing (mass 0); cycle cancelled",
                        ck["path"], rnd)
            self._ckpt = None
            return
        lowest = (self._engine.last_accepted & -self._engine.last_accepted).bit_length() - 1
        if lowest == self.local_rank and not self._engine.relay_mode:
            momentum = None
            if outer and self._engine.outer is not None:
                momentum = self._engine.outer_momentum()
            head = {k: v for k, v in ck.items() if k != "remaining"}
            head.update(dtype=dtype, shapes=[list(s) for s in shapes], mass=mass, round=rnd,
                        momentum_shapes=[list(s) for s in shapes] if momentum is not None else None)
            tap_post(self.arena, self._engine.doorbell, head, cons, momentum,
                     wait_ack=self._wait_tap_ack)
        ck["part"] += 1
        ck["remaining"] -= len(shapes)
        if ck["remaining"] <= 0:
            self._ckpt = None

    def _wait_tap_ack(self, target: int) -> None:
        ctl = self.arena.ctl
        waiter = Waiter(self._engine.doorbell, self._engine.waiter.spin_iters, 300.0,
                        self._engine.waiter.liveness)
        waiter.wait(lambda it: signals.spin_word_ge(ctl, A.G_TAP_ACK, target, it),
                    what="waiting for the owner to take the previous checkpoint frame",
                    rnd=self._round - 1, missing_of=lambda: ("checkpoint owner",))

    def set_fault_hook(self, hook: Callable[[str, int], None] | None) -> None:
        """Tests only: call ``hook(phase, round)`` at the fault-injection points
        ("before_copy_in", "mid_copy_in", "arrived", "reduce", "mid_copy_out") so a
        test can kill this rank at a precise moment of a bulk round."""
        self._engine.fault_hook = hook

    def last_accepted_ranks(self) -> list[int]:
        """Global ranks of this host whose contribution the last round accepted.

        On one host that is the whole accepted set. On a cluster it covers this host's
        ranks only; remote ranks are known to the controller (its ``dead_ranks``)."""
        mask = self._engine.last_accepted
        first = self.rank - self.local_rank
        return [first + i for i in range(self.local_world_size) if (mask >> i) & 1]

    @property
    def round(self) -> int:
        """The number of the next collective round."""
        return self._round

    # -- collectives -------------------------------------------------------------
    def all_reduce(self, frame: RoundFrame) -> RoundFrame:
        """Frame-level reduce: the payloads carry wᵣ·Tᵣ and ``frame.weight`` wᵣ; the reply
        carries the consensus (same schema) with ``weight`` = accepted mass."""
        check_frame(frame)
        dtypes = {p.dtype for p in frame.tensors}
        if len(dtypes) > 1:
            raise FrameError("all tensors of one frame must share a wire dtype, got "
                             f"{sorted(dtypes)} (0 = f32, 1 = bf16)")
        dtype = dtypes.pop() if dtypes else DTYPE_F32
        shapes = [p.shape for p in frame.tensors]

        def write(dst: np.ndarray, offs: list[int], numels: list[int]) -> None:
            for p, off, n in zip(frame.tensors, offs, numels):
                np.copyto(dst[off:off + n], p.as_array())

        cons, mass = self._run(int(frame.kind), dtype, frame.weight, shapes, write)
        offs, numels, _ = frame_layout(shapes)
        out = []
        for s, off, n in zip(shapes, offs, numels):
            out.append(TensorPayload(dtype, s, cons[off:off + n].copy()))
        return RoundFrame(out, mass, frame.kind)

    def all_reduce_scaled(self, tensors: Sequence[torch.Tensor], scale: float, kind=RoundKind.MODEL,
                          weight: float = 1.0, *, outer: bool = False
                          ) -> tuple[list[torch.Tensor], float]:
        """Send ``tensors · scale`` (scale fused into the copy-in, bit-identical to
        ``tensor.mul(scale)``) with mass ``weight``; returns (consensus, accepted mass).

        ``outer=True`` marks the params round of a window: the installed outer
        optimizer (``set_outer``) steps the consensus into the new global before it is
        returned (every rank must pass the same flag)."""
        kind = RoundKind(int(kind))
        dtype = self._wire_dtype(kind)
        shapes = self._check_tensors(tensors)
        scale = float(scale)

        def write(dst: np.ndarray, offs: list[int], numels: list[int]) -> None:
            self._encode(tensors, dst, offs, numels, dtype, scale)

        armed = self._armed if kind == RoundKind.MODEL else None
        self._armed = None
        cons, mass = self._run(int(kind), dtype, weight, shapes, write,
                               outer=outer and kind == RoundKind.MODEL)
        return self._decode(cons, dtype, shapes, armed), mass

    def all_reduce_weighted(self, tensors: Sequence[torch.Tensor], kind=RoundKind.MODEL,
                            weight: float = 1.0, *, outer: bool = False
                            ) -> tuple[list[torch.Tensor], float]:
        """Tensors already scaled by the caller; returns (Σ/Σw, accepted mass Σw)."""
        return self.all_reduce_scaled(tensors, 1.0, kind, weight, outer=outer)

    def all_reduce_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Equal-weight mean over the accepted ranks."""
        return self.all_reduce_scaled(tensors, 1.0, RoundKind.MODEL, 1.0)[0]

    def all_reduce_(self, tensors: Sequence[torch.Tensor], *, weight: float = 1.0,
                    scale: float = 1.0, kind=RoundKind.MODEL, outer: bool = False) -> float:
        """In place: replace each tensor by the consensus (like ``dist.all_reduce``).

        Contributes ``tensors · scale`` with mass ``weight``. When a MODEL round's
        accepted mass is 0 the tensors are left untouched (keep local). Returns the
        accepted mass. Tensors must be float32 or bfloat16.
        """
        if len(tensors) == 1 and not outer:
            mass = self._inplace_fast(tensors[0], weight, scale, int(kind))
            if mass is not None:
                return mass
        kind = RoundKind(int(kind))
        dtype = self._wire_dtype(kind)
        shapes = self._check_tensors(tensors)

        def write(dst: np.ndarray, offs: list[int], numels: list[int]) -> None:
            self._encode(tensors, dst, offs, numels, dtype, float(scale))

        direct = None
        if (len(tensors) == 1 and tensors[0].dtype is _F32 and tensors[0].is_cpu
                and tensors[0].is_contiguous()):
            direct = tensors[0].detach().view(-1).numpy()
        cons, mass = self._run(int(kind), dtype, weight, shapes, write,
                               outer=outer and kind == RoundKind.MODEL, direct=direct)
        if kind == RoundKind.MODEL and mass <= 0.0:
            return mass
        done = self._engine.direct_slice if direct is not None else None
        if done is not None:
            # this rank's own slice already landed in the tensor during its reduce
            n = cons.shape[0]
            for a, b in ((0, done[0]), (done[1], n)):
                if b > a:
                    _decode_into_tensor(cons[a:b], dtype, _flat_part(tensors[0], a, b))
            return mass
        plan = self._plan(int(kind), dtype, shapes)
        hook = self._engine.fault_hook
        for i, (t, off, n) in enumerate(zip(tensors, plan.offs, plan.numels)):
            if hook is not None and i == 1:
                hook("mid_copy_out", self._round - 1)
            _decode_into_tensor(cons[off:off + n], dtype, t)
        return mass

    def all_reduce_per_rank_f64(self, values) -> np.ndarray:
        """Gather one float64 per rank: each rank fills its own slot (zeros elsewhere);
        every rank gets the summed vector (dead ranks read 0). Values travel as f32
        (exact for integers up to 2^24), as in flodl."""
        vec = np.asarray(values, dtype=np.float64).reshape(-1)
        if vec.shape[0] != self.world_size:
            raise ValueError(f"vector len ({vec.shape[0]}) must equal world_size "
                             f"({self.world_size})")
        as32 = vec.astype(np.float32)
        shapes = [(self.world_size,)]

        def write(dst: np.ndarray, offs: list[int], numels: list[int]) -> None:
            np.copyto(dst[:self.world_size], as32)

        cons, _ = self._run(int(RoundKind.CONTROL), DTYPE_F32, 0.0, shapes, write)
        return cons[:self.world_size].astype(np.float64)

    def broadcast_from_root(self, tensors: Sequence[torch.Tensor], root: int = 0) -> list[torch.Tensor]:
        """Every rank receives ``root``'s tensors (byte-exact, f32), e.g. to align
        initial parameters. Non-root ranks pass tensors of the same shapes."""
        if not 0 <= int(root) < self.world_size:
            raise ValueError(f"broadcast root {root} >= world_size {self.world_size}")
        shapes = self._check_tensors(tensors)
        is_root = self.rank == int(root)

        def write(dst: np.ndarray, offs: list[int], numels: list[int]) -> None:
            self._encode(tensors, dst, offs, numels, DTYPE_F32, 1.0)

        cons, _ = self._run(int(RoundKind.CONTROL), DTYPE_F32, 0.0, shapes,
                            write if is_root else None, elided=not is_root)
        return self._decode(cons, DTYPE_F32, shapes, None)

    def barrier(self) -> None:
        """Return once every live rank has entered the barrier."""
        self._run(int(RoundKind.CONTROL), DTYPE_F32, 0.0, [], None)

    # -- zero-copy ---------------------------------------------------------------
    def zero_copy_inputs(self, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Tensors backed by this rank's shared bulk region, to fill in place (in the
        wire dtype: float32, or bfloat16 with ``set_bf16_wire(True)``). Fill them with
        wᵣ·Tᵣ, then call ``all_reduce_zero_copy(weight)``. Valid until this rank's
        next collective call."""
        shapes = [tuple(int(d) for d in s) for s in shapes]
        dtype = self._wire_dtype(RoundKind.MODEL)
        offs, numels, nelem = frame_layout(shapes)
        nwords = len(schema_words(0, dtype, shapes))
        nbytes = nelem * elem_size(dtype)
        region = self._engine.bulk_region(nwords * 8 + nbytes)
        key = (tuple(shapes), dtype)
        cached = self._zc_inputs
        if cached is not None and cached[0] == key and cached[1] is region:
            self._zero_copy = (shapes, dtype)
            return list(cached[2])
        payload = region[nwords * 8:nwords * 8 + nbytes]
        out = []
        for s, off, n in zip(shapes, offs, numels):
            if dtype == DTYPE_F32:
                t = torch.from_numpy(payload.view(np.float32)[off:off + n])
            else:
                t = torch.from_numpy(payload.view(np.int16)[off:off + n]).view(torch.bfloat16)
            out.append(t.view(s))
        self._zero_copy = (shapes, dtype)
        self._zc_inputs = (key, region, tuple(out))
        return out

    def all_reduce_zero_copy(self, weight: float = 1.0, kind=RoundKind.MODEL
                             ) -> tuple[list[torch.Tensor], float]:
        """Reduce what was filled into ``zero_copy_inputs``; returns views of the
        consensus in shared memory (wire dtype) and the accepted mass. The views are
        valid until this rank's next collective call."""
        if self._zero_copy is None:
            raise RuntimeError("call zero_copy_inputs(shapes) and fill the tensors before "
                               "all_reduce_zero_copy()")
        shapes, dtype = self._zero_copy
        self._zero_copy = None
        cons, mass = self._run(int(RoundKind(int(kind))), dtype, weight, shapes, None,
                               zero_copy=True)
        offs, numels, _ = frame_layout(shapes)
        out = []
        for s, off, n in zip(shapes, offs, numels):
            if dtype == DTYPE_F32:
                t = torch.from_numpy(cons[off:off + n])
            else:
                t = torch.from_numpy(cons[off:off + n].view(np.int16)).view(torch.bfloat16)
            out.append(t.view(s))
        return out, mass

    # -- the round ---------------------------------------------------------------
    def _run(self, kind: int, dtype: int, weight: float, shapes: list[tuple[int, ...]],
             write: Callable | None, *, elided: bool = False, zero_copy: bool = False,
             outer: bool = False, direct: np.ndarray | None = None) -> tuple[np.ndarray, float]:
        """One collective round; returns (consensus in the wire dtype, accepted mass).
        The consensus array is only valid until this rank's next round."""
        if self._broken is not None:
            raise RuntimeError(f"this Comm is unusable: {self._broken}")
        weight = float(weight)
        if not 0.0 <= weight < math.inf:
            raise FrameError(f"weight {weight} is not a finite non-negative realized-work mass")
        eng = self._engine
        rnd = self._round
        plan = self._plan(kind, dtype, shapes)
        tap = kind == RoundKind.MODEL and self._ckpt is not None
        # only a stateful outer optimizer steps (OuterAvg is the plain consensus); on a
        # cluster the flag travels to the controller, which refuses it if it has none
        outer = outer and self._outer_installed
        # the outer step runs in the slice reduce: outer rounds take the bulk path
        bulk = zero_copy or eng.relay_mode or outer or not plan.eager_fits
        if bulk:
            region = eng.bulk_region(plan.total)
            slot_key = ("bulk", id(region))
        else:
            region = eng.eager_region(rnd)
            slot_key = rnd & 1
        if self._slot_schema.get(slot_key) is not plan:
            region[:plan.off].view(np.int64)[:] = plan.words
            self._slot_schema[slot_key] = plan
        hook = eng.fault_hook
        if hook is not None:
            hook("before_copy_in", rnd)
        if write is not None and not elided:
            raw = region[plan.off:plan.off + plan.nbytes]
            write(raw.view(np.float32 if dtype == DTYPE_F32 else np.uint16), plan.offs,
                  plan.numels)
        flags = ((A.FLAG_BULK if bulk else 0) | (A.FLAG_ELIDED if elided else 0)
                 | (A.FLAG_ZERO_COPY if zero_copy else 0) | (A.FLAG_OUTER if outer else 0)
                 | (A.FLAG_TAP if tap else 0))
        self._round = rnd + 1
        eng.direct_slice = None
        try:
            if not bulk:
                mass = eng.eager_round(rnd, kind, flags, dtype, weight, len(shapes), plan.nbytes,
                                       plan.nelem, plan.shash, len(plan.words), self._eager_f32,
                                       self._eager_u16)
                cons = (self._eager_f32 if dtype == DTYPE_F32 else self._eager_u16)[:plan.nelem]
            else:
                eng.publish(rnd, kind, flags, dtype, weight, len(shapes), plan.nbytes,
                            plan.nelem, plan.shash, len(plan.words))
                if hook is not None:
                    hook("arrived", rnd)
                view = eng.await_arrivals(rnd)
                eng.reduce_slice(view, self.local_rank,
                                 direct if view.mass > 0.0 or kind != RoundKind.MODEL else None)
                eng.await_slices(view)
                mass = eng.await_consensus(view) if eng.relay_mode else view.mass
                cons = eng.consensus_array(view)
                if eng.outer_applies(view):
                    eng.outer_steps += 1
            if tap:
                self._tap_round(rnd, dtype, shapes, cons, mass, outer)
            return cons, mass
        except FrameError:
            raise  # schema mismatch: every rank raised at the same point; still in step
        except BaseException as e:
            self._broken = f"round {rnd} failed with {type(e).__name__}: {e}"
            if isinstance(e, CohortAborted) and eng.relay_mode:
                eng.raise_relay_error(rnd)  # the host relay's failure, if that is why
            raise

    def _inplace_fast(self, t: torch.Tensor, weight, scale, kind: int) -> float | None:
        """One small contiguous f32 tensor averaged in place on an f32 wire: the whole
        round is one compiled call. ``None`` when the case does not apply (the general
        path then runs; nothing was published)."""
        eng = self._engine
        if (t.dtype is not _F32 or not t.is_cpu or (self._bf16 and kind == 0)
                or self._broken is not None or eng.relay_mode or self._ckpt is not None
                or eng.fault_hook is not None or not t.is_contiguous()):
            return None
        fast = self._fast
        shape = t.shape
        if fast is None or fast[0] != shape or fast[1] != kind:
            plan = self._plan(kind, DTYPE_F32, [tuple(shape)])
            fast = self._fast = (shape, kind, plan)
        plan = fast[2]
        if not plan.eager_fits:
            return None
        weight = float(weight)
        if not 0.0 <= weight < math.inf:
            raise FrameError(f"weight {weight} is not a finite non-negative realized-work mass")
        rnd = self._round
        if self._slot_schema.get(rnd & 1) is not plan:
            eng.eager_region(rnd)[:plan.off].view(np.int64)[:] = plan.words
            self._slot_schema[rnd & 1] = plan
        self._round = rnd + 1
        try:
            code = RK.eager_inplace_f32(t.data_ptr(), plan.nelem, float(scale), eng.ctl,
                                        eng.ctl_f64, eng.ctl32, eng._eager_all,
                                        self.arena.eager_bytes, eng.world, self.local_rank, rnd,
                                        kind, 0, weight, plan.shash, len(plan.words),
                                        eng.waiter.spin_iters, eng._info, eng._mass, eng._acc)
            if code == RK.OK:
                return eng.eager_done()
            view = eng.settle_eager(code, rnd)
            if kind == RoundKind.MODEL and not view.mass > 0.0:
                return view.mass
            cons = self._eager_f32[:plan.nelem]
            eng.reduce_eager(view, cons)
            _decode_into_tensor(cons, DTYPE_F32, t)
            return view.mass
        except FrameError:
            raise
        except BaseException as e:
            self._broken = f"round {rnd} failed with {type(e).__name__}: {e}"
            raise

    def _plan(self, kind: int, dtype: int, shapes: list[tuple[int, ...]]) -> "_Plan":
        key = (kind, dtype, tuple(shapes))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
                self._slot_schema.clear()
            plan = _Plan(kind, dtype, list(key[2]), self.arena.eager_bytes)
            self._plans[key] = plan
        return plan

    # -- helpers -------------------------------------------------------------------
    def _wire_dtype(self, kind: RoundKind) -> int:
        return DTYPE_BF16 if (self._bf16 and kind == RoundKind.MODEL) else DTYPE_F32

    @staticmethod
    def _check_tensors(tensors: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
        shapes = []
        for i, t in enumerate(tensors):
            try:
                dt = t.dtype
            except AttributeError:
                dt = None
            if dt is not _F32 and dt is not _BF16:
                check_tensor_dtype(t, i)  # raises with the dtype named
            shapes.append(tuple(t.shape))
        return shapes

    def _encode(self, tensors, dst: np.ndarray, offs, numels, dtype: int, scale: float) -> None:
        hook = self._engine.fault_hook
        for i, (t, off, n) in enumerate(zip(tensors, offs, numels)):
            if hook is not None and i == 1:
                hook("mid_copy_in", self._round)
            _encode_tensor(t, dst[off:off + n], dtype, scale, self._scratch, self._scratch16)

    def _decode(self, cons: np.ndarray, dtype: int, shapes, armed: int | None) -> list[torch.Tensor]:
        offs, numels, nelem = frame_layout(shapes)
        flat = None
        if armed is not None:
            if self._gate is None:
                if self._mem_at_start is None:
                    self._mem_at_start = host_memory()
                self._gate = decide_pinned_decode(nelem * 4, self.local_world_size,
                                                  self._mem_at_start)
            if self._gate.enabled:
                flat = self._staging.buffer(armed, nelem)
        if flat is None:
            flat = torch.from_numpy(np.empty(nelem, np.float32))
        dst = flat.numpy()
        if dtype == DTYPE_F32:
            np.copyto(dst, cons[:nelem])
        else:
            K.bf16_to_f32(cons[:nelem], dst)
        return [flat[off:off + n].view(s) for s, off, n in zip(shapes, offs, numels)]

    def close(self) -> None:
        """Release this rank's mappings (the arena's owner unlinks the segments)."""
        self._staging.clear()
        self.arena.close()

    def __repr__(self) -> str:
        return (f"Comm(rank={self.rank}/{self.world_size}, local={self.local_rank}/"
                f"{self.local_world_size}, round={self._round}, bf16_wire={self._bf16})")


class _Plan:
    """Everything about a round that depends only on (kind, dtype, shapes): cached."""

    __slots__ = ("words", "shash", "offs", "numels", "nelem", "nbytes", "off", "total",
                 "eager_fits")

    def __init__(self, kind: int, dtype: int, shapes: list[tuple[int, ...]],
                 eager_bytes: int) -> None:
        self.words = schema_words(kind, dtype, shapes)
        self.shash = schema_hash(self.words)
        self.offs, self.numels, self.nelem = frame_layout(shapes)
        self.nbytes = self.nelem * elem_size(dtype)
        self.off = len(self.words) * 8
        self.total = self.off + self.nbytes
        self.eager_fits = self.total <= eager_bytes


def _getpid() -> int:
    import os

    return os.getpid()


_F32 = torch.float32
_BF16 = torch.bfloat16
# Below this many bytes a tensor is copied by address in compiled code (no
# torch->numpy conversion, ~3 µs saved per tensor); above it through numpy, whose
# memcpy uses non-temporal stores for large buffers.
_BY_ADDRESS_MAX = 256 << 10


def _tensor_source(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """(flat numpy view of t's data, is_bf16) for a float32/bfloat16 tensor."""
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == _BF16:
        return t.reshape(-1).view(torch.int16).numpy().view(np.uint16), True
    return t.reshape(-1).numpy(), False


def _encode_tensor(t: torch.Tensor, dst: np.ndarray, dtype: int, scale: float,
                   scratch: np.ndarray, scratch16: np.ndarray) -> None:
    """Copy one tensor into its wire slot, converting and scaling on the way.

    The result equals encoding ``t.mul(scale)`` (one rounding stage): f32 data is
    multiplied in f32 then rounded once to bf16 if the wire is bf16; bf16 data is
    scaled with one bf16 rounding, then upcast exactly on an f32 wire.
    """
    n = dst.shape[0]
    is_bf16 = t.dtype is _BF16
    if t.is_cpu and n * (2 if is_bf16 else 4) <= _BY_ADDRESS_MAX and t.is_contiguous():
        addr = t.data_ptr()
        if not is_bf16:
            if dtype == DTYPE_F32:
                TIO.encode_f32_to_f32(addr, n, dst, scale)
            else:
                TIO.encode_f32_to_bf16(addr, n, dst, scale, scratch)
        elif dtype == DTYPE_BF16:
            TIO.encode_bf16_to_bf16(addr, n, dst, scale, scratch)
        else:
            TIO.encode_bf16_to_f32(addr, n, dst, scale, scratch, scratch16)
        return
    src, is_bf16 = _tensor_source(t)
    one = scale == 1.0
    if not is_bf16:
        if dtype == DTYPE_F32:
            if one:
                np.copyto(dst, src)
            else:
                K.f32_scaled_copy(src, dst, scale)
        elif one:
            K.f32_to_bf16(src, dst)
        else:
            K.f32_to_bf16_scaled(src, dst, scale, scratch)
    elif dtype == DTYPE_BF16:
        if one:
            np.copyto(dst, src)
        else:
            K.bf16_scaled_copy(src, dst, scale, scratch)
    else:
        TIO.encode_bf16_to_f32(src.ctypes.data, n, dst, scale, scratch, scratch16)


def _flat_part(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of a contiguous tensor, as a flat view."""
    return t.detach().view(-1)[a:b]


def _decode_into_tensor(src: np.ndarray, dtype: int, t: torch.Tensor) -> None:
    """Write a consensus slice into an existing float32/bfloat16 tensor, in place."""
    if t.dtype is _F32 and t.is_cpu and t.is_contiguous():
        n = src.shape[0]
        if n * 4 <= _BY_ADDRESS_MAX:
            if dtype == DTYPE_F32:
                TIO.decode_f32_into(src, t.data_ptr())
            else:
                TIO.decode_bf16_into(src, t.data_ptr())
            return
        dst = t.detach().view(-1).numpy()
        if dtype == DTYPE_F32:
            np.copyto(dst, src)
        else:
            K.bf16_to_f32(src, dst)
        return
    if dtype == DTYPE_F32:
        tmp = torch.from_numpy(src)
    else:
        tmp = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    with torch.no_grad():
        t.copy_(tmp.view(t.shape))

"""How a ``Comm`` call becomes a round: the paths, from the cheapest.

``RoundPaths`` is a part of :class:`flodl_shm.engine.comm.Comm`, which holds the state
these methods read (the engine, the round counter, the cached plans); the collectives
(``comm_reduces.py``, ``comm_broadcasts.py``, ``comm_zero_copy.py``) pick a path here.

One compiled call
=================
A call whose tensors are small contiguous float32 CPU tensors and whose frame fits the
eager slot runs as ONE compiled call (copy-in by address, publish, wait, validate,
reduce straight into the result memory): ``_single_plan`` / ``_single_round`` for one
tensor, ``_fused_plan`` / ``_fused_round`` for several (their addresses gathered by
``TensorCodec.gather``). The Python around it is a plan lookup by shapes
(``RoundEngine.plan``) and the address list.

Direct
======
On one host with ``max_failures=0``, float32 rounds from the direct threshold (256 KiB
unless the arena's owner said otherwise) are direct rounds (``direct.py``): each rank
reduces its slice straight out of the ranks' tensors, with no shared copies
(``_direct_mode`` decides, ``_direct_call`` runs one; ``_direct_gathered`` /
``_direct_one`` skip the staging of tensors that need none).

General
=======
Everything else (large frames on the shared path, non-contiguous tensors, checkpoint
taps, outer rounds, clusters) takes ``_run``: the eager slots for a contribution of at
most ``eager_bytes`` (schema words included; every rank reduces it itself, one
synchronisation point), else the bulk regions with reduce-scatter then all-gather, so
no process reads all P inputs (``protocol.py``). The torch <-> wire conversions live
in ``tensor_codec.py``.

Every path takes the round number with ``_begin``'s checks and hands a failure to
``_fail`` (a schema mismatch leaves the Comm usable; anything else breaks it); the
general and direct rounds run one at a time (``_one_at_a_time``).

Refused
=======
A public collective hands an error raised before any round (an argument this rank
refuses) to ``_refused``, which takes part in one refusal round first, so the peers'
round meets it now rather than this rank's next call.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import torch

from . import arena as A
from ..errors import CohortAborted, FrameError, SchemaMismatchError
from ..kernels.tensorio import overlapping_spans
from ..frame import (
    DTYPE_BF16,
    DTYPE_F32,
    MASS_MAX,
    MASS_MIN,
    RoundKind,
    mass_error,
    shown_number,
    tensor_array,
)
from .direct import UNPROBED
from .gathered import GatheredTensors
from .protocol import RoundPlan
from .tensor_codec import (
    F32,
    POOL_MIN_BYTES,
    TensorCodec,
    check_tensors,
    decode_into_tensor,
    flat_part,
    refuse_one_tensor,
)

_MODEL = int(RoundKind.MODEL)
_CONTROL = int(RoundKind.CONTROL)
_F32_MAX = float(np.finfo(np.float32).max)

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


def _staged(t: torch.Tensor, staged: list, scale: float = 1.0) -> torch.Tensor:
    """A contiguous float32 CPU copy of ``t`` (of ``t.mul(scale)``: a bfloat16 tensor
    scaled with one bfloat16 rounding, as the shared path's copy-in scales it) for a
    direct round, noted in ``staged`` (pairs written back after an in-place round)."""
    src = t.detach() if scale == 1.0 else t.detach().mul(scale)
    copy = src.to(device="cpu", dtype=torch.float32, copy=True,
                  memory_format=torch.contiguous_format)
    staged.append((t, copy))
    return copy


#: the attribute ``_fail`` and ``_refused`` set on an exception the ranks are done with
_SAID = "_flodl_shm_said"
#: a refusal round whose peers make no collective this long logs the rank's refused
#: call (its error would otherwise surface only when they do)
REFUSAL_NOTICE_S = 5.0


def said(e: BaseException) -> BaseException:
    """``e``, marked as an error every rank raises after the round (none of them then
    runs a refusal round: ``RoundPaths._refused``)."""
    setattr(e, _SAID, True)
    return e


def refusal_plan(engine):
    """The plan of a refusal round (``RoundPaths._refused``): a CONTROL round of no
    tensors on a bfloat16 wire, which no collective sends (a CONTROL round's wire is
    float32; a barrier is the float32 one), so it meets no call but another refusal.
    ``RoundEngine._describe`` names it."""
    return engine.plan(_CONTROL, DTYPE_BF16, ())


def _integral(value) -> bool:
    """An int, an int enum or a numpy integer; not a bool, a float or anything else
    (``int()`` of those would take a weight for a kind or 1.5 for rank 1)."""
    return type(value) is int or (isinstance(value, (int, np.integer))
                                  and not isinstance(value, bool))


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


class RoundPaths:
    """The round paths of a ``Comm`` (a part of it: see the module doc)."""

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
        step); anything else breaks it, naming the round. Either way the ranks are done
        with the round: no refusal round follows (``_refused``)."""
        said(e)
        if isinstance(e, FrameError):
            return
        self._broken = f"round {rnd} failed with {type(e).__name__}: {e}"
        if isinstance(e, CohortAborted) and self._engine.relay_mode:
            self._engine.raise_relay_error(rnd)  # the host relay's failure, if that is why

    def _refused(self, e: Exception) -> None:
        """A public collective of this rank raised ``e``; the caller re-raises it
        (unless this raises in its stead).

        Raised before any round (an argument this rank refuses: a dtype, a shape, a
        weight), ``e`` would leave the peers in their round, which would then pair with
        this rank's next call (its data read as this call's, when the schemas agree).
        So this rank first takes part in one round of a schema no collective sends
        (``refusal_plan``), the **refusal round**: where every rank refused, it
        completes and each raises its own error, in step; where a peer called a
        collective, it mismatches theirs, and every rank raises ``SchemaMismatchError``
        (this rank's chained from ``e``, its reason in the text). A wait that fails
        (a peer left, the timeout) is added to ``e`` as a note. Peers that make no
        collective for ``REFUSAL_NOTICE_S`` leave this rank waiting: it logs its error
        then (``Waiter.context``), and again each time the wait doubles.

        Nothing to do for an error a round already took (``_fail`` marked it), a broken
        Comm (it refuses every call), a world of one, a round in flight in another
        thread (``_one_at_a_time``'s refusal: that round is this rank's), or a fault
        hook's Comm (its injected faults stand for a crash)."""
        if (getattr(e, _SAID, False) or self._broken is not None or self.world_size == 1
                or self._in_round or self._engine.fault_hook is not None):
            return
        said(e)  # (once: a collective built on another re-raises it)
        waiter = self._engine.waiter
        if waiter.notice_s > 0:  # peers that call no collective for a while: say why
            waiter.context = (f"rank {self.rank} refused its call ({type(e).__name__}: "
                              f"{e}) and waits in a refusal round for its peers' next "
                              f"collective, so that every rank raises in step",
                              min(waiter.notice_s, REFUSAL_NOTICE_S))
        try:
            self._run(refusal_plan(self._engine), 0.0, None)
        except FrameError as mismatch:
            err = SchemaMismatchError(f"rank {self.rank} refused its call before the round "
                                      f"({type(e).__name__}: {e}), while a peer called a "
                                      f"collective; so every rank raises:\n{mismatch}")
            raise said(err) from e
        except Exception as failed:  # noqa: BLE001 - said after this rank's own reason
            e.add_note(f"(rank {self.rank} then waited in a refusal round, to keep its "
                       f"peers in step, and that failed: {failed})")
        finally:
            waiter.context = None

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

    def _hot_plan(self, tensors: Sequence[torch.Tensor], kind: int = _MODEL
                  ) -> RoundPlan | None:
        """The plan of ``all_reduce_``'s hot case, a training loop's repeated call over
        one float32 tensor, weight and scale aside: the plan ``_single_plan`` cached for
        a round of ``kind`` (MODEL, or CONTROL: the c10d backend's SUM) without outer
        step, when ``tensors`` is one tensor it fits and nothing else must run (a pinned
        result, a bf16 wire). Else None: the general path decides, and names a bad
        argument."""
        fast = self._fast
        eng = self._engine
        if (fast is None or fast[1] != kind or self._armed is not None or self._bf16
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

    def _direct_mode(self, plan: RoundPlan, outer: bool, broadcast: bool = False,
                     gather: bool = False) -> int:
        """FLAG_DIRECT when a round of ``plan`` runs as a direct round
        (``engine/direct.py``), else 0. Decided from what every rank agrees on, so the
        first eligible round of every rank settles the direct path first, together."""
        flags = ((A.FLAG_OUTER if outer and self._outer_installed else 0)
                 | (A.FLAG_TAP if plan.kind == _MODEL and self._tap.armed is not None else 0)
                 | (A.FLAG_BROADCAST if broadcast else 0) | (A.FLAG_GATHER if gather else 0))
        direct = self._engine.direct
        if direct.state == UNPROBED and direct.eligible(plan, flags):
            self.settle_direct_rounds()
        return direct.mode(plan, flags)

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
                if eng.outer.applies(view, eng.relay_mode):
                    eng.outer.round_done(view.nelem)
            if tap:
                self._tap.captured(rnd, dtype, plan.shapes, cons, mass, outer)
            return cons, mass
        except BaseException as e:
            self._fail(rnd, e)
            raise

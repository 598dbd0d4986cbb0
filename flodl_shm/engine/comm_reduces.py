"""The reduces of a ``Comm``: frames, tensor-returning and in-place reduces, and the
per-rank gather.

``ReduceCalls`` is a part of :class:`flodl_shm.engine.comm.Comm` (the semantics and
buffer lifetimes are in that module's doc); each call tries its hot case first (a
training loop's repeated call, checked in one frame), then the paths of
``comm_rounds.py``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import arena as A
from ..errors import FrameError
from ..frame import (
    DTYPE_BF16,
    DTYPE_F32,
    MASS_MAX,
    MASS_MIN,
    RoundFrame,
    RoundKind,
    TensorPayload,
    check_frame,
    tensor_array,
)
from .comm_rounds import (
    _CONTROL,
    _F32_MAX,
    _MODEL,
    _as_number,
    _as_scale,
    _kind,
    _written,
)
from .protocol import RoundPlan
from .tensor_codec import (
    F32,
    NO_DRIFT,
    POOL_MIN_BYTES,
    add_drift,
    check_tensors,
    decode_gathered,
    decode_into_tensor,
    drift_snapshot,
    refuse_one_tensor,
)

_MODEL_KIND, _CONTROL_KIND = RoundKind.MODEL, RoundKind.CONTROL  # (one global read each)

_F64 = np.dtype(np.float64)


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


class ReduceCalls:
    """The reduces of a ``Comm`` (a part of it: see the module doc)."""

    def all_reduce(self, frame: RoundFrame) -> RoundFrame:
        """Frame-level reduce: the payloads carry wᵣ·Tᵣ and ``frame.weight`` wᵣ; the reply
        carries the consensus (same schema) with ``weight`` = accepted mass."""
        try:
            reply = self._hot_frame(frame)
            if reply is not None:
                return reply
            check_frame(frame)
            payloads = frame.tensors
            dtype = payloads[0].dtype if payloads else DTYPE_F32
            if len(payloads) > 1:
                for p in payloads:
                    if p.dtype != dtype:
                        raise FrameError(
                            f"all tensors of one frame must share a wire dtype, got "
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
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

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
        ``tensor.mul(scale)`` for every value but a NaN) with mass ``weight``; returns
        (consensus, accepted mass). A NaN stays a NaN of its own sign and payload, quiet,
        as the bfloat16 codec keeps it, where torch's bfloat16 ``mul`` gives NaN bits of
        its own.

        ``outer=True`` marks the params round of a window: the installed outer
        optimizer (``set_outer``) steps the consensus into the new global before it is
        returned (every rank must pass the same flag)."""
        try:
            if kind is _MODEL_KIND and not outer:
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
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

    def all_reduce_weighted(self, tensors: Sequence[torch.Tensor],
                            kind: RoundKind | int = RoundKind.MODEL,
                            weight: float = 1.0, *, outer: bool = False
                            ) -> tuple[list[torch.Tensor], float]:
        """Tensors already scaled by the caller; returns (Σ/Σw, accepted mass Σw), as
        float32 tensors (for bfloat16 inputs too: the f32 consensus, not rounded again)."""
        try:
            if kind is _MODEL_KIND and not outer:
                got = self._hot_result(tensors, weight, 1.0)
                if got is not None:
                    return [got[0]], got[1]
            if not outer:
                got = self._single_fast(tensors, _kind(kind), weight, 1.0)
                if got is not None:
                    return [got[0]], got[1]
            return self.all_reduce_scaled(tensors, 1.0, kind, weight, outer=outer)
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

    def all_reduce_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Equal-weight mean over the accepted ranks, as float32 tensors (for bfloat16
        inputs too: ``.to(torch.bfloat16)`` gives what :meth:`all_reduce_` writes)."""
        try:
            got = self._hot_result(tensors, 1.0, 1.0)
            if got is not None:
                return [got[0]]
            got = self._single_fast(tensors, _MODEL, 1.0, 1.0)
            if got is not None:
                return [got[0]]
            return self.all_reduce_scaled(tensors, 1.0, RoundKind.MODEL, 1.0)[0]
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

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
        try:
            # (a RoundKind, not an int or float equal to one: ``_kind`` refuses those)
            if (report is None and drift is None and not outer
                    and (kind is _MODEL_KIND or kind is _CONTROL_KIND)):
                plan = self._hot_plan(tensors, kind)
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
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

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
        try:
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
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

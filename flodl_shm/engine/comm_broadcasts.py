"""The broadcasts of a ``Comm``: ``broadcast_from_root`` (a fresh result on every rank)
and ``broadcast_`` (in place).

``BroadcastCalls`` is a part of :class:`flodl_shm.engine.comm.Comm`. On one host a
broadcast is a real one: the root's tensors are read, never reduced (one compiled call
when small, a direct round when large, else the general round's copy out of the root's
payload); on a cluster it is a reduce to which only the root contributes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import arena as A
from ..frame import (
    DTYPE_F32,
    tensor_array,
)
from .comm_rounds import (
    _CONTROL,
    _STRIDED,
    _integral,
    said,
    _written,
)
from .protocol import RoundPlan
from .tensor_codec import (
    F32,
    check_tensors,
    decode_gathered,
    refuse_one_tensor,
)


class BroadcastCalls:
    """The broadcasts of a ``Comm`` (a part of it: see the module doc)."""

    def broadcast_from_root(self, tensors: Sequence[torch.Tensor], root: int = 0
                            ) -> list[torch.Tensor]:
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
        try:
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
                raise said(RuntimeError(  # (on every rank, after the round)
                    f"broadcast_from_root: the root, rank {root}, died before its tensors "
                    f"arrived; no rank received them. Broadcast from a live rank"))
            if cons is not out:  # a cluster round: the consensus is in the result region
                np.copyto(out, cons[:plan.nelem])
            del out
            return self._codec.views(flat, plan)
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

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
        try:
            plan = self._hot_broadcast(tensors, root)
            if plan is not None:  # (the root copies nothing back: its tensor holds it)
                t = tensors[0]
                self._single_round(t, plan, 0.0, 1.0, t.data_ptr(),
                                   root - self.rank + self.local_rank)
                _written(tensors)
                return
            self._broadcast_in_place(tensors, root)
            _written(tensors)
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

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

    def _broadcast_direct(self, plan: RoundPlan) -> bool:
        """Whether a one-host broadcast of ``plan`` runs as a direct round. Asked first on
        every path a broadcast may take (a fused eager call included), since the ranks'
        tensors may send them down different paths and the answer must be the same on
        all: it depends on the schema alone."""
        return (plan.nbytes >= self._engine.direct.broadcast_min_bytes
                and self._direct_mode(plan, False, True) == A.FLAG_DIRECT)

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

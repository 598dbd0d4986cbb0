"""``OuterInReduce``: the outer optimizer stepped inside the params round, on one host.

A round sent with ``outer=True`` (``Comm.all_reduce_``, a window's params round) steps
the installed outer optimizer (``Comm.set_outer``: an ``OuterOptimizer`` with momentum)
on the consensus before any rank reads it. No rank holds the whole optimizer state:
each slice reducer (``protocol.py``, REDUCED) steps the slice it reduced, and every rank
then copies the stepped consensus out as usual.

Ownership. The state lives in the arena's ``out`` segment, which the launcher creates
and unlinks (``arena.py``); each rank's ``OuterInReduce`` holds only views of it and
the seeds of the next step 0, in private memory. The segment holds, for a params frame
of ``n`` float32 elements, the previous global ``P[2][n]`` and the momentum ``M[2][n]``,
double-buffered by step parity: step ``k`` reads buffer ``k % 2`` and writes
``(k + 1) % 2``, so a survivor that reduces a dead rank's slice again recomputes it from
inputs nobody touched.

Step 0 (the first outer round of a run, or the first after a resume) starts from the
seeded previous global (``Comm.load_outer_state``) or else from the consensus itself (a
zero first step), and from the momentum restored from a checkpoint or else fresh
momentum. Every rank counts the steps alike (``round_done`` after each outer round,
whether or not it reduced a slice), so each knows ``k``. The arithmetic is
``OuterOptimizer.outer_step``'s, in float32.
"""
from __future__ import annotations

import logging

import numpy as np

from . import arena as A
from ..frame import DTYPE_F32, RoundKind
from ..kernels import codec as K

__all__ = ["OuterInReduce"]

logger = logging.getLogger("flodl_shm")


class OuterInReduce:
    """One rank's side of the in-reduce outer step (module doc).

    Args:
        arena: the host arena, whose ``out`` segment holds the state.
    """

    def __init__(self, arena: A.Arena) -> None:
        self._arena = arena
        self.optimizer = None             # an OuterOptimizer with momentum, or None
        self.steps = 0                    # realized outer rounds so far (k)
        self.nelem = 0                    # the params frame they stepped
        self.seeded_momentum: np.ndarray | None = None  # restored from a checkpoint
        self.seeded_prev: np.ndarray | None = None  # the prev global seeded for step 0
        self._scratch = np.empty(0, np.float32)

    def applies(self, view, relay_mode: bool) -> bool:
        """Whether round ``view`` steps the optimizer: a realized MODEL round sent with
        ``outer=True`` while a stateful optimizer is installed, on one host (across
        hosts the controller steps it)."""
        return (self.optimizer is not None and bool(view.flags & A.FLAG_OUTER)
                and view.kind == RoundKind.MODEL and view.mass > 0.0 and not relay_mode)

    def seed(self, prev: np.ndarray | None, momentum: np.ndarray | None) -> None:
        """Make the next outer round a step 0 from ``prev`` (None: the consensus) and
        ``momentum`` (None: fresh), both flat float32."""
        self.seeded_prev, self.seeded_momentum = prev, momentum
        self.steps = 0

    def step_index(self, n: int) -> int:
        """The step ``k`` an outer round over an ``n``-element params frame takes: the
        outer rounds realized so far, or 0 when the frame changed size (restart)."""
        return self.steps if n == self.nelem else 0

    def round_done(self, n: int) -> None:
        """Every rank, after a round the optimizer stepped (``applies``): count the step
        and drop the seeds (they served step 0)."""
        if n != self.nelem:
            if self.nelem:
                logger.warning("outer optimizer: the params frame changed size (%d -> %d "
                               "elements); restarting the outer state", self.nelem, n)
            self.nelem = n
            self.steps = 0
        self.steps += 1
        self.seeded_prev = self.seeded_momentum = None

    def momentum(self) -> np.ndarray | None:
        """A copy of the momentum the next outer round continues from (flat float32):
        the last step's, or the seeded one before the first; None if neither."""
        return self._vector(self.seeded_momentum, 1)

    def prev(self) -> np.ndarray | None:
        """A copy of the global the next outer round steps from (flat float32): the last
        step's result, or the seeded one before the first; None if neither."""
        return self._vector(self.seeded_prev, 0)

    def last_momentum(self) -> np.ndarray | None:
        """The momentum the last realized step wrote (flat float32, a view of the
        segment, valid until the next outer round), or None before any step (or with
        no optimizer installed): what a checkpoint of that round's consensus saves."""
        return self._written(1)

    def _written(self, which: int) -> np.ndarray | None:
        """The buffer the last realized step wrote, ``which`` 0 (the global) or 1 (the
        momentum), as a view; None before any step or with no optimizer installed."""
        if self.optimizer is None or self.steps == 0:
            return None
        return self._buffers(self.nelem)[which][self.steps % 2]

    def _vector(self, seeded: np.ndarray | None, which: int) -> np.ndarray | None:
        """A copy of ``_written(which)``, or of ``seeded`` before the first step."""
        if self.optimizer is None:
            return None
        if self.steps == 0:
            return None if seeded is None else seeded.copy()
        return self._written(which).copy()

    def _buffers(self, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The segment's ``(P[2], M[2])`` for an ``n``-element frame."""
        raw = self._arena.extra_view("out", 16 * n)[:16 * n].view(np.float32)
        return [raw[0:n], raw[n:2 * n]], [raw[2 * n:3 * n], raw[3 * n:4 * n]]

    def step_slice(self, view, out: np.ndarray, s: int, e: int) -> None:
        """Step elements ``s:e`` of round ``view``'s consensus in ``out`` (float32, or
        bfloat16 bits on the bf16 wire) in place, reading and writing the state's
        buffers of the step's parity.

        Raises:
            ValueError: a seed's length is not the params frame's (step 0).
        """
        if e <= s:
            return
        n = view.nelem
        prev_buf, mom_buf = self._buffers(n)
        k = self.step_index(n)
        rd, wr = k % 2, (k + 1) % 2
        m = e - s
        if self._scratch.shape[0] < 2 * m:
            self._scratch = np.empty(2 * m, np.float32)
        if view.dtype == DTYPE_F32:
            cons = out[s:e]
        else:
            cons = self._scratch[:m]
            K.bf16_to_f32(out[s:e], cons)
        new = self._scratch[m:2 * m]
        mom = mom_buf[wr][s:e]
        if k == 0:
            for what, seeded in (("prev global", self.seeded_prev),
                                 ("momentum", self.seeded_momentum)):
                if seeded is not None and seeded.shape[0] != n:
                    raise ValueError(
                        f"the outer {what} loaded with Comm.load_outer_state has "
                        f"{seeded.shape[0]} elements but the outer round's params frame has "
                        f"{n}: load the state saved for this model")
            prev = cons if self.seeded_prev is None else self.seeded_prev[s:e]
            fresh = self.seeded_momentum is None
            if not fresh:
                np.copyto(mom, self.seeded_momentum[s:e])
        else:
            prev = prev_buf[rd][s:e]
            fresh = False
            np.copyto(mom, mom_buf[rd][s:e])
        self.optimizer.step_flat(prev, cons, mom, fresh, new)
        np.copyto(prev_buf[wr][s:e], new)
        if view.dtype == DTYPE_F32:
            np.copyto(out[s:e], new)
        else:
            K.f32_to_bf16(new, out[s:e])

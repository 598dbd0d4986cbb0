"""The all-gather of a ``Comm``: ``all_gather_into_tensor``.

``AllGatherCalls`` is a part of :class:`flodl_shm.engine.comm.Comm`. Every rank's
part arrives bit for bit (nothing is summed): on one host in eager rounds of at most a
slot each, one compiled call a rank a round (``kernels/gather.py``); on a cluster, or
with a fault hook, each rank's part is broadcast in place in turn.
"""
from __future__ import annotations

import torch

from ..frame import DTYPE_F32
from ..kernels.codes import NOT_ROOT, OK
from ..kernels.gather import gather_calls
from .comm_rounds import _CONTROL, _STRIDED, _written
from .tensor_codec import F32


class AllGatherCalls:
    """The all-gather of a ``Comm`` (a part of it: see the module doc)."""

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's ``input`` into every rank's ``output``, rank r's at
        ``r * input.numel()`` (like ``dist.all_gather_into_tensor``), bit for bit: a
        float32 view of another dtype's bytes gathers that dtype's bits.

        On one host a part of up to the eager slot is one compiled call a rank, a larger
        one a call a slot's worth; on a cluster each rank's part is broadcast in place in
        turn. When the call returns no peer reads ``input`` any more.

        Args:
            output: a contiguous float32 CPU tensor of ``world_size * input.numel()``
                elements. It may hold ``input`` as this rank's part (FSDP's layout),
                but no other overlap.
            input: a contiguous float32 CPU tensor, of the same shape on every rank
                (another shape is a schema mismatch on every rank).
        Raises:
            ValueError: tensors that are not such, or that overlap otherwise.
        """
        n, src, dst = self._gather_args(output, input)
        eng = self._engine
        if n and not eng.relay_mode and eng.fault_hook is None:
            plan = eng.plan(_CONTROL, DTYPE_F32, (input.shape,))
            if plan.eager_fits:  # (one round: the loop's few lines cost 0.3 µs at 4 KiB)
                rnd = self._round
                self._round = rnd + 1
                try:
                    self._eager_gather(plan, rnd, src, dst, n)
                except BaseException as e:
                    self._fail(rnd, e)
                    raise
                _written((output,))
                return
            shape = tuple(input.shape)
            k = self._eager_gather_words(shape[:-1])
            for start in range(0, n, k):  # rounds of at most a slot each
                m = min(k, n - start)
                rnd = self._round
                self._round = rnd + 1
                try:
                    self._eager_gather(eng.plan(_CONTROL, DTYPE_F32, (shape[:-1] + (m,),)),
                                       rnd, src + 4 * start, dst + 4 * start, n)
                except BaseException as e:
                    self._fail(rnd, e)
                    raise
            _written((output,))
            return
        # a cluster (a broadcast is a reduce there), a fault hook: each rank's part
        # broadcast in place in turn
        parts = output.view((self.world_size,) + tuple(input.shape)).unbind(0)
        if src != dst + 4 * n * self.rank:
            with torch.no_grad():
                parts[self.rank].copy_(input)
        for r, part in enumerate(parts):
            self.broadcast_([part], r)

    def _eager_gather(self, plan, rnd: int, src: int, dst: int, stride: int) -> None:
        """An eager all-gather round (``kernels.gather.eager_gather_f32``) of
        ``plan.nelem`` float32 a rank from ``src``, rank r's into ``dst + 4 * stride * r``;
        its end the blocking way when the compiled call could not finish it."""
        eng = self._engine
        calls = gather_calls()
        code = calls.eager(eng.call_block, plan.call, src, dst, stride, rnd)
        if code == OK:
            return
        if code == NOT_ROOT:  # arrived, a part missing: raises
            eng.check_gather(rnd, eng.last_accepted, eng.last_contributors())
        view = eng.settle_eager(code, rnd)
        eng.check_gather(rnd, view.accepted_mask, view.contrib_mask)
        calls.copy_parts(eng.call_block, plan.off, plan.nelem, src, dst, stride, rnd,
                         view.contrib_mask)

    def _eager_gather_words(self, lead: tuple) -> int:
        """The most float32 of a part one eager round carries (a multiple of 16: its
        chunks stay 64-byte aligned), its schema words ``lead + (k,)`` included."""
        eng = self._engine
        words = eng.plan(_CONTROL, DTYPE_F32, (lead + (1,),)).off
        return max(16, (eng.arena.eager_bytes - words) // 4 // 16 * 16)

    def _gather_args(self, output: torch.Tensor, input: torch.Tensor) -> tuple[int, int, int]:
        """(the part's elements, the input's address, the output's), after checking the
        tensors (``all_gather_into_tensor``'s Raises)."""
        if self._broken is not None:
            raise RuntimeError(f"this Comm is unusable: {self._broken}")
        try:  # (free in CPython 3.11 until something raises)
            ok = (input.dtype is F32 and output.dtype is F32 and input.layout is _STRIDED
                  and output.layout is _STRIDED and input.is_cpu and output.is_cpu
                  and input.is_contiguous() and output.is_contiguous())
        except AttributeError:  # (not a tensor: named below)
            ok = False
        if not ok:
            _refuse_gather(output, input)
        n = input.numel()
        if output.numel() != self.world_size * n:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, "
                             f"a world of {self.world_size} inputs of {n} needs "
                             f"{self.world_size * n}; pass an output of that many")
        src, dst = input.data_ptr(), output.data_ptr()
        if src < dst + 4 * n * self.world_size and dst < src + 4 * n \
                and src != dst + 4 * n * self.rank and n:
            raise ValueError(f"all_gather_into_tensor: input overlaps output other than as "
                             f"this rank's part (elements {n * self.rank} to "
                             f"{n * (self.rank + 1)}); pass a separate input, or that part")
        return n, src, dst


def _refuse_gather(output, input) -> None:
    """Raise for the first of ``output``, ``input`` that is not a contiguous float32 CPU
    tensor, naming what it is."""
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_gather_into_tensor: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if not (t.dtype is F32 and t.layout is _STRIDED and t.is_cpu and t.is_contiguous()):
            raise ValueError(f"all_gather_into_tensor: {name} must be a contiguous float32 "
                             f"CPU tensor, got {t.dtype} on {t.device} (layout {t.layout}, "
                             f"contiguous: {t.is_contiguous()}); pass "
                             f"t.contiguous().view(torch.float32) of its bytes, or a copy")

"""The part collectives of a ``Comm``: ``all_gather_into_tensor`` (every rank's part to
every rank) and ``reduce_scatter_tensor`` (each rank its part of the sum).

``GatherScatterCalls`` is a part of :class:`flodl_shm.engine.comm.Comm`. On one host
both are eager rounds of their own kind, one compiled call a rank a round
(``kernels/parts.py``), in rounds of at most a slot each: an all-gather's parts arrive
bit for bit (nothing is summed); in a reduce-scatter each rank sums only its part. An
all-gather of parts of 64-256 KiB, where direct rounds run and ranks do not outnumber
cores, is a direct round instead: each rank reads its peers' inputs straight into its
output (``engine/direct.py``). On a
cluster, or with a fault hook, an all-gather broadcasts each rank's part in place in
turn, and a reduce-scatter all-reduces the input and keeps its part. A chunk's round
names the whole part in its schema (an empty tensor shaped like it), so ranks whose
sizes or shapes differ mismatch at the first round.
"""
from __future__ import annotations

import torch

from ..frame import DTYPE_F32, RoundKind
from ..kernels.codes import NOT_ROOT, OK
from ..kernels.parts import part_calls
from .comm_rounds import _CONTROL, _STRIDED, _written
from .tensor_codec import F32


class GatherScatterCalls:
    """The part collectives of a ``Comm`` (a part of it: see the module doc)."""

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's ``input`` into every rank's ``output``, rank r's at
        ``r * input.numel()`` (like ``dist.all_gather_into_tensor``), bit for bit: a
        float32 view of another dtype's bytes gathers that dtype's bits.

        On one host a part of up to the eager slot is one compiled call a rank, a larger
        one a call a slot's worth; a part of 64-256 KiB where direct rounds run, one
        call that reads the peers' inputs directly; on a cluster each rank's part is
        broadcast in place in turn. When the call returns no peer reads ``input`` any
        more.

        Args:
            output: a contiguous float32 CPU tensor of ``world_size * input.numel()``
                elements. It may hold ``input`` as this rank's part (FSDP's layout),
                but no other overlap.
            input: a contiguous float32 CPU tensor, of the same shape on every rank
                (another shape is a schema mismatch on every rank).
        Raises:
            TypeError: an argument that is not a tensor.
            ValueError: tensors that are not such, or that overlap otherwise.
        """
        try:
            n, src, dst = self._gather_args(output, input)
            eng = self._engine
            if n and not eng.relay_mode and eng.fault_hook is None:
                plan = eng.plan(_CONTROL, DTYPE_F32, (input.shape,))
                if self._direct_mode(plan, False, gather=True):
                    rnd = self._round
                    self._round = rnd + 1
                    try:
                        eng.direct.gather(plan, rnd, src, dst, n)
                    except BaseException as e:
                        self._fail(rnd, e)
                        raise
                    _written((output,))
                    return
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
                k = self._slot_words(_CONTROL, input.dim() + 1)
                for start in range(0, n, k):  # rounds of at most a slot each
                    m = min(k, n - start)
                    rnd = self._round
                    self._round = rnd + 1
                    try:  # (the schema: this chunk, and an empty tensor whose shape is the part's)
                        self._eager_gather(eng.plan(_CONTROL, DTYPE_F32, ((m,), (0,) + tuple(
                            input.shape))), rnd, src + 4 * start, dst + 4 * start, n)
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
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              kind: int = RoundKind.CONTROL) -> None:
        """This rank's part of the sum of every rank's ``input``: ``output`` = the
        ranks' ``input[r * m:(r + 1) * m]`` summed (``m = output.numel()``, ``r`` this
        rank), like ``dist.reduce_scatter_tensor``; with ``kind=RoundKind.MODEL`` their
        mean (the sum times ``1 / ranks``). The bits are those of ``all_reduce_`` of the
        inputs (float32 sums in rank order).

        On one host each rank sums only its part, one compiled call a rank a round: one
        round for an input that fits the eager slot, else rounds that each carry a
        chunk of every part. On a cluster the input is all-reduced, each rank keeping
        its part.

        Args:
            output: a contiguous float32 CPU tensor of ``m`` elements; it may lie
                anywhere in ``input`` (this rank's part of it, say).
            input: a contiguous float32 CPU tensor of ``world_size * m`` elements, of
                the same shape on every rank (another shape is a schema mismatch on
                every rank).
            kind: ``RoundKind.CONTROL`` sums, ``RoundKind.MODEL`` averages.
        Raises:
            TypeError: an argument that is not a tensor.
            ValueError: tensors or a kind that are not such.
        """
        try:
            m, src, dst = self._scatter_args(output, input, kind)
            eng = self._engine
            if not eng.relay_mode and eng.fault_hook is None:
                plan = eng.plan(kind, DTYPE_F32, (input.shape,))
                if plan.eager_fits:  # one round: the whole input is in the slot before the write
                    k, into = m, output
                else:  # chunk rounds: an output inside the input but off its parts would
                    # overwrite what later rounds read, so it goes through a stand-in
                    per = self._slot_words(kind, input.dim() + 1) // self.world_size
                    k = per // 16 * 16 or max(1, per)  # (16-aligned, unless the world is huge)
                    inside = dst < src + 4 * input.numel() and src < dst + 4 * m
                    into = torch.empty(m) if inside and (dst - src) % (4 * m) else output
                at = into.data_ptr()
                for start in range(0, m, k) if m else (0,):  # (chunks of every part a round)
                    n = min(k, m - start)
                    rnd = self._round
                    self._round = rnd + 1
                    try:  # (a chunk's schema: its parts, and an empty tensor shaped as the input)
                        self._eager_reduce_scatter(plan if n == m else eng.plan(
                            kind, DTYPE_F32, ((self.world_size * n,), (0,) + tuple(input.shape))),
                            src + 4 * start, m, at + 4 * start, rnd, kind)
                    except BaseException as e:
                        self._fail(rnd, e)
                        raise
                if into is not output:
                    with torch.no_grad():
                        output.copy_(into.view(output.shape))
                _written((output,))
                return
            (summed,), _ = self.all_reduce_scaled([input], 1.0, kind)
            with torch.no_grad():
                output.view(-1).copy_(summed.view(-1)[self.rank * m:(self.rank + 1) * m])
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

    def _eager_reduce_scatter(self, plan, src: int, stride: int, dst: int, rnd: int,
                              kind: int) -> None:
        """An eager reduce-scatter round (``kernels.parts.eager_reduce_scatter_f32``) of
        ``plan.nelem / world`` float32 of every part (rank r's at ``src + 4 * stride *
        r``) into ``dst``; its end the blocking way when the compiled call could not
        finish it."""
        eng = self._engine
        calls = part_calls()
        code = calls.reduce_scatter(eng.call_block, plan.call, src, stride, dst, rnd, 1.0)
        if code != OK:  # (peers asleep, a late rank, a mismatch: raises)
            view = eng.settle_eager(code, rnd)
            calls.reduce_part(eng.call_block, plan.off, plan.nelem // self.local_world_size,
                              dst, rnd, int(kind), view.contrib_mask, view.mass)

    def _eager_gather(self, plan, rnd: int, src: int, dst: int, stride: int) -> None:
        """An eager all-gather round (``kernels.parts.eager_gather_f32``) of
        ``plan.nelem`` float32 a rank from ``src``, rank r's into ``dst + 4 * stride * r``;
        its end the blocking way when the compiled call could not finish it."""
        eng = self._engine
        calls = part_calls()
        code = calls.eager(eng.call_block, plan.call, src, dst, stride, rnd)
        if code == OK:
            return
        if code == NOT_ROOT:  # arrived, a part missing: raises
            eng.check_gather(rnd, eng.last_accepted, eng.last_contributors())
        view = eng.settle_eager(code, rnd)
        eng.check_gather(rnd, view.accepted_mask, view.contrib_mask)
        calls.copy_parts(eng.call_block, plan.off, plan.nelem, src, dst, stride, rnd,
                         view.contrib_mask)

    def _slot_words(self, kind: int, ndim: int) -> int:
        """The most float32 one eager round of a chunk carries (a multiple of 16: its
        chunks stay 64-byte aligned), after the schema words of a chunk plan: a 1-D
        chunk and an empty tensor of ``ndim`` dimensions whose shape names the whole."""
        eng = self._engine
        words = eng.plan(kind, DTYPE_F32, ((1,), (0,) * ndim)).off
        return max(16, (eng.arena.eager_bytes - words) // 4 // 16 * 16)

    def _check_part_tensors(self, what: str, output: torch.Tensor,
                            input: torch.Tensor) -> None:
        """Refuse a broken Comm, and tensors that are not contiguous float32 CPU ones
        (one expression, as fast as it gets: the 4 KiB call costs about 2.5 µs)."""
        if self._broken is not None:
            raise RuntimeError(f"this Comm is unusable: {self._broken}")
        try:  # (free in CPython 3.11 until something raises)
            ok = (input.dtype is F32 and output.dtype is F32 and input.layout is _STRIDED
                  and output.layout is _STRIDED and input.is_cpu and output.is_cpu
                  and input.is_contiguous() and output.is_contiguous())
        except AttributeError:  # (not a tensor: named below)
            ok = False
        if not ok:
            _refuse_part_tensors(what, output, input)

    def _scatter_args(self, output: torch.Tensor, input: torch.Tensor, kind
                      ) -> tuple[int, int, int]:
        """(the part's elements, the input's address, the output's), after checking the
        arguments (``reduce_scatter_tensor``'s Raises)."""
        self._check_part_tensors("reduce_scatter_tensor", output, input)
        if kind not in (RoundKind.CONTROL, RoundKind.MODEL):
            raise ValueError(f"reduce_scatter_tensor: kind must be RoundKind.CONTROL (a sum) "
                             f"or RoundKind.MODEL (a mean), got {kind!r}")
        m = output.numel()
        if input.numel() != self.world_size * m:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, a "
                             f"world of {self.world_size} parts of the output's {m} needs "
                             f"{self.world_size * m}; pass an input of that many")
        return m, input.data_ptr(), output.data_ptr()

    def _gather_args(self, output: torch.Tensor, input: torch.Tensor) -> tuple[int, int, int]:
        """(the part's elements, the input's address, the output's), after checking the
        tensors (``all_gather_into_tensor``'s Raises)."""
        self._check_part_tensors("all_gather_into_tensor", output, input)
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


def _refuse_part_tensors(what: str, output, input) -> None:
    """Raise for the first of ``output``, ``input`` that is not a contiguous float32 CPU
    tensor, naming what it is."""
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.dtype is F32 and t.layout is _STRIDED and t.is_cpu and t.is_contiguous()):
            raise ValueError(f"{what}: {name} must be a contiguous float32 CPU tensor, got "
                             f"{t.dtype} on {t.device} (layout {t.layout}, contiguous: "
                             f"{t.is_contiguous()}); pass a float32 copy, t.float(), or "
                             f"a float32 view of a contiguous copy's bytes when they are a "
                             f"multiple of 4 (the all-gather carries any dtype's bits so)")

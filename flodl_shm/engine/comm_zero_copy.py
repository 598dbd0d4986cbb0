"""Tensors of a ``Comm`` that live in shared memory: the zero-copy inputs of the next
round and the rank's shared parameter block.

``ZeroCopyCalls`` is a part of :class:`flodl_shm.engine.comm.Comm`. Zero-copy inputs
and their consensus views stay valid until this rank's next collective call (the
lifetimes are in ``comm.py``'s module doc); shared tensors for the arena's life.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import arena as A
from ..frame import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundKind,
)
from .tensor_codec import (
    F32,
    refuse_one_tensor,
    wire_views,
)
from .comm_rounds import (
    _MODEL,
    _kind,
)

#: a zero-copy frame lives in the eager slot (every rank then reads every rank's frame)
#: while the ranks' frames together stay under this many bytes; else in the bulk region,
#: whose round reads each frame once, a slice per rank. Zero-copy rounds on 2 cores
#: (BENCHMARKS.md, "Forty-third session"), eager against bulk: 2 ranks 256 KiB 20-21 µs
#: against 29, 512 KiB 46-54 against 33-34, 1 MiB 110-134 against 52-54; 4 ranks 128 KiB
#: 64-68 against 72-74, 256 KiB 139-143 against 80-81, 1 MiB 604-607 against 209-224
ZERO_COPY_EAGER_READ_BYTES = 1 << 20


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


class ZeroCopyCalls:
    """The shared-memory tensors of a ``Comm`` (a part of it: see the module doc)."""

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
        try:
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
        except Exception as e:  # (one raised before any round: a refusal round tells the peers)
            self._refused(e)
            raise

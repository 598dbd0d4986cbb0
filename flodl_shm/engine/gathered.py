"""``GatheredTensors``: a fixed set of tensors whose fused rounds reuse their addresses.

A fused eager round (``Comm.all_reduce_`` of several small tensors, one compiled call)
reads and writes its tensors through the address table of its plan. A plain call finds
the plan by the tensors' shapes (the engine's cache) and refills the table from the
tensors (``TensorCodec.gather``: each one's dtype, layout and address): a third of a
call over a small model's four tensors. A training window reduces the same tensors at
every sync, and checks before each that none of them moved (``ReplicaReduce``'s held
check, ``training/sync_window.py``); it passes them as a ``GatheredTensors``, which
keeps a plan of its own per engine, round kind and wire dtype, its table gathered once.
Every other path of a collective reads it as the tuple of tensors it is.

Ownership: the plans are this object's, never the engine's shared ones (which every
plain call refills with its own tensors' addresses). Their addresses stay right while
no tensor's storage moves or is freed: the tuple keeps the tensors alive, and its
holder must build a new ``GatheredTensors`` once one may have moved (a ``p.data = ...``
on the tensor it views, a resize, ``share_memory()``), before the next round.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .protocol import RoundPlan
from .tensor_codec import TensorCodec


class GatheredTensors(tuple):
    """A tuple of tensors whose fused rounds reuse the addresses gathered at the first
    (module docstring: the holder vouches that their storage has not moved)."""

    def __new__(cls, tensors: Iterable[torch.Tensor]) -> "GatheredTensors":
        self = super().__new__(cls, tensors)
        self._plans = {}
        return self

    def plan(self, engine, kind: int, dtype: int, broadcast: bool = False) -> RoundPlan | None:
        """This set's plan of a ``kind`` round on ``dtype``'s wire in ``engine``, its
        address table filled; None when the round cannot be one fused call (too large
        for an eager slot, a tensor that is not a contiguous float32/bfloat16 CPU
        tensor, a reduce that may run direct, ``RoundPlan.fused``): the general path
        then runs, as for a plain list."""
        key = (engine, kind, dtype)
        plan = self._plans.get(key)
        if plan is None:
            try:  # (a nested tensor has no sizes, or sizes that are no ints)
                plan = engine.new_plan(kind, dtype, [t.shape for t in self])
            except (AttributeError, TypeError, RuntimeError):
                plan = False
            # (an eager-sized plan is gathered even when it may run direct: it turns fused
            # when the direct path turns out unavailable, ``RoundEngine.lose_direct_rounds``)
            if plan and not (plan.eager_fits and TensorCodec.gather(self, plan)):
                plan = False
            self._plans[key] = plan
        return plan if plan and (plan.eager_fits if broadcast else plan.fused) else None

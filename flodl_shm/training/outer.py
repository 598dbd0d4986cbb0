"""Outer optimizers: a step applied to the consensus between reduce and broadcast
(flodl 0.7.0 ``outer_optimizer.rs``; docs/runtime.md, "Outer optimizers").

Each window the cohort forms one work-weighted consensus of the parameters. An
outer optimizer turns it into the new *global* before the ranks adopt it. The
outer gradient is ``g = prev_global - consensus``: the drift the inner steps
produced, which equals the work-weighted mean of ``prev_global - theta_r``, so
the step needs no per-rank state and composes with the relay's per-host folds.
``prev_global`` is the previous window's global: under ``LocalSGD`` the first
window's is the replicas' common start (an exact resume restores it). The
Trainer's first window of a run or of a resume passes the consensus itself (a
cluster's controller cannot know the initial weights): ``g = 0`` and every
variant is a no-op.

* :class:`OuterAvg` (default): identity. Stateless; writes no ``.outer.fdl``.
* :class:`OuterNesterov` (DiLoCo): Nesterov momentum on ``g``; the workers
  reset their inner optimizer at every sync, which is what makes the *outer*
  momentum the canonical, checkpointable optimizer state.

Parameters only: buffers (BatchNorm statistics, ...) are not optimized and
never pass through an outer step.

Arithmetic: every element is computed in IEEE float32, one rounding per
operation, in the order ``kernels/outer_step.py`` documents (its bit-exact
contract): the flat kernel, the tensor-list ``outer_step`` and a literal torch
formulation agree bit for bit, and an element's result depends on that element
alone, so stepping a vector slice by slice (each rank stepping the slice it
reduces, as the single-host engine does) equals stepping it whole.
"""
from __future__ import annotations

import logging
import numbers
from typing import Optional, Sequence

import numpy as np

from ..frame import tensor_array
from ..kernels.outer_step import avg_step_flat, nesterov_step_flat

logger = logging.getLogger("flodl_shm")

__all__ = [
    "OuterAvg",
    "OuterNesterov",
    "OuterOptimizer",
    "avg_step_flat",
    "nesterov_step_flat",
]


# ---------------------------------------------------------------------------
# Tensor-list optimizers
# ---------------------------------------------------------------------------


def _as_f32_vector(t, what: str, i: int):
    """A contiguous float32 CPU tensor for parameter ``i`` (no copy when it already is)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(
            f"{what}[{i}] has dtype {t.dtype}; outer optimizers step float32 parameters "
            f"(decode bf16 frames to float32 first)"
        )
    return t.detach().to("cpu").contiguous()


class OuterOptimizer:
    """Interface of an outer optimizer (see the module docstring).

    Attributes:
        has_momentum: whether the engine must keep a momentum vector (one float32
            element per parameter element) for :meth:`step_flat`.
    """

    has_momentum: bool = False

    def outer_step(self, prev_global: Sequence, consensus: Sequence) -> list:
        """Transform ``consensus`` into the new global given ``prev_global``.

        Both are parallel lists of float32 tensors (one per model parameter, same
        shapes); the result has the same shapes. Momentum is updated internally.
        """
        raise NotImplementedError

    def step_flat(self, prev: np.ndarray, consensus: np.ndarray, momentum: Optional[np.ndarray],
                  fresh: bool, out: np.ndarray) -> None:
        """The same step over one flat float32 slice, in place (see the kernels)."""
        raise NotImplementedError

    def checkpoint_state(self) -> Optional[list]:
        """The checkpointable outer state (one tensor per parameter), or ``None``."""
        return None

    def load_checkpoint_state(self, tensors: Sequence) -> None:
        """Restore the state saved by :meth:`checkpoint_state` (resume)."""

    def reset_state(self) -> None:
        """Forget the outer state: the next step starts with fresh momentum."""

    def resets_inner(self) -> bool:
        """Whether workers must reset their inner optimizer at every sync."""
        return False


class OuterAvg(OuterOptimizer):
    """Identity: the new global *is* the consensus. Stateless, no checkpoint file,
    output byte-identical to the input (the very same tensor objects)."""

    has_momentum = False

    def outer_step(self, prev_global: Sequence, consensus: Sequence) -> list:
        if len(prev_global) != len(consensus):
            raise ValueError(
                f"prev_global has {len(prev_global)} tensors but consensus has {len(consensus)}; "
                "pass one tensor per model parameter in both (the consensus itself on the "
                "first window)"
            )
        return list(consensus)

    def step_flat(self, prev: np.ndarray, consensus: np.ndarray, momentum: Optional[np.ndarray],
                  fresh: bool, out: np.ndarray) -> None:
        avg_step_flat(prev, consensus, out)

    def __repr__(self) -> str:
        return "OuterAvg()"


class OuterNesterov(OuterOptimizer):
    """DiLoCo's outer optimizer: Nesterov momentum on the pseudo-gradient.

    ``g = prev - consensus``; ``v = g`` when the momentum is fresh, else
    ``v = mu*v + g``; ``new = prev - lr*(mu*v + g)`` - in the float32 order of
    the module docstring. The momentum is fresh before the first step and
    whenever the parameter count changes. Workers reset their inner optimizer
    at every sync (:meth:`resets_inner` is ``True``); the momentum is the
    canonical optimizer state and checkpoints to ``<stem>.outer.fdl``.

    Args:
        lr: outer learning rate (DiLoCo reference 0.7).
        momentum: outer momentum coefficient (reference 0.9).
    """

    has_momentum = True

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        for name, value in (("lr", lr), ("momentum", momentum)):
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"OuterNesterov {name} must be a number, got {value!r}; "
                                f"DiLoCo's reference is lr=0.7, momentum=0.9")
            if not np.isfinite(value):
                raise ValueError(
                    f"OuterNesterov {name} must be finite, got {value!r}; "
                    "DiLoCo's reference is lr=0.7, momentum=0.9"
                )
        if lr < 0:
            raise ValueError(f"OuterNesterov lr must be >= 0, got {lr!r} (a negative one steps "
                             f"away from the consensus); DiLoCo's reference is lr=0.7")
        if not 0 <= momentum < 1:
            raise ValueError(f"OuterNesterov momentum must be in [0, 1), got {momentum!r} (from "
                             f"1 up the velocity grows without bound); DiLoCo's reference "
                             f"is momentum=0.9")
        self.lr = float(lr)
        self.mu = float(momentum)
        self._velocity: Optional[list] = None

    def outer_step(self, prev_global: Sequence, consensus: Sequence) -> list:
        import torch

        n = len(consensus)
        if len(prev_global) != n:
            raise ValueError(
                f"prev_global has {len(prev_global)} tensors but consensus has {n}; "
                "pass one tensor per model parameter in both (the consensus itself on the "
                "first window)"
            )
        prev = [_as_f32_vector(t, "prev_global", i) for i, t in enumerate(prev_global)]
        cons = [_as_f32_vector(t, "consensus", i) for i, t in enumerate(consensus)]
        for i, (p, c) in enumerate(zip(prev, cons)):
            if p.shape != c.shape:
                raise ValueError(
                    f"parameter {i}: prev_global shape {tuple(p.shape)} != consensus shape "
                    f"{tuple(c.shape)}; both lists must follow the model's parameters() order"
                )
        fresh = self._velocity is None or len(self._velocity) != n
        if fresh:
            if self._velocity is not None:
                logger.warning(
                    "outer momentum holds %d tensors but the model has %d parameters: "
                    "restarting the momentum from zero", len(self._velocity), n,
                )
            velocity = [torch.empty_like(c) for c in cons]
        else:
            velocity = self._velocity
            for i, (v, c) in enumerate(zip(velocity, cons)):
                if v.shape != c.shape:
                    raise ValueError(
                        f"parameter {i}: outer momentum shape {tuple(v.shape)} != parameter "
                        f"shape {tuple(c.shape)}; the loaded .outer.fdl belongs to another "
                        f"model (delete it to restart the momentum)"
                    )
        new_global = []
        for p, c, v in zip(prev, cons, velocity):
            out = torch.empty_like(c)
            nesterov_step_flat(*(tensor_array(x.view(-1), np.float32) for x in (p, c, v)),
                               self.lr, self.mu, fresh, tensor_array(out.view(-1), np.float32))
            new_global.append(out)
        self._velocity = velocity
        return new_global

    def step_flat(self, prev: np.ndarray, consensus: np.ndarray, momentum: Optional[np.ndarray],
                  fresh: bool, out: np.ndarray) -> None:
        if momentum is None:
            raise ValueError(
                "OuterNesterov.step_flat needs a float32 momentum slice as long as prev "
                "(has_momentum is True: the engine allocates it in shared memory)"
            )
        nesterov_step_flat(prev, consensus, momentum, self.lr, self.mu, fresh, out)

    def checkpoint_state(self) -> Optional[list]:
        """Copies of the momentum, one float32 tensor per parameter, or ``None``
        before the first step (nothing to save yet)."""
        if self._velocity is None:
            return None
        return [v.clone() for v in self._velocity]

    def load_checkpoint_state(self, tensors: Sequence) -> None:
        """Adopt saved momentum (copied, as contiguous float32 CPU tensors); the next
        step continues accumulating from it instead of starting fresh."""
        self._velocity = [_as_f32_vector(t, "momentum", i).clone() for i, t in enumerate(tensors)]

    def reset_state(self) -> None:
        self._velocity = None

    def resets_inner(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"OuterNesterov(lr={self.lr!r}, momentum={self.mu!r})"

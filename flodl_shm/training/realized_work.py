"""Realized work: the mass algebra behind every consensus (flodl 0.7.0; docs/runtime.md, "Realized work").

A *mass* is the scalar weight that travels atomically with a contribution. The
algebra has exactly three moves:

1. **Pre-scale at the source.** A rank multiplies its tensors by its mass and
   ships the mass in the same frame.
2. **Sum through folds.** Tensors and masses are summed element-wise at any
   depth (rank -> host partial -> controller); folds are associative.
3. **Divide once at the root.** The root divides by the summed mass of exactly
   the accepted contributions.

The law: *the sum and its divisor come from the same accepted contributions.*
Work that was never accepted (a dead rank, a lost frame) enters neither, so a
death shrinks the divisor instead of dragging the consensus toward zero.

Parameters are weighted by :func:`gamma_mass` of the rank's optimizer steps
since the last sync; buffers (BatchNorm running statistics and the like) are
weighted by :func:`mover_mass`, so every rank that moved counts equally and an
idle rank is excluded by zero mass - never by leaving the collective: every
rank still joins every round.
"""
from __future__ import annotations

from typing import Sequence

import logging

from ..frame import MASS_MAX, MASS_MIN

#: The largest work mass a rank sends: far above any count of samples, and small enough
#: that wᵣ·Tᵣ and Σ over any cohort stay finite in float32 for parameters under 1e19
#: (``MASS_MAX``, float32's largest, bounds only the mass itself)
WORK_MASS_MAX = 2.0 ** 64
assert WORK_MASS_MAX < MASS_MAX

logger = logging.getLogger("flodl_shm")

__all__ = ["gamma_mass", "is_realized", "mover_mass", "sumcount_reduce"]


def gamma_mass(n: int, gamma: float) -> float:
    """The parameters mass of a rank that took ``n`` optimizer steps: ``n**gamma``.

    Contract:
      * ``n <= 0`` gives ``0.0`` for *any* ``gamma``. This is the idle guard: a
        raw power would give ``0**0 == 1`` (an idle rank voting at ``gamma=0``)
        and ``0**(gamma<0) == inf`` (the whole cohort turning into NaN).
      * ``gamma == 1.0`` gives ``float(n)`` exactly - the default and fast path.
      * otherwise ``float(n) ** gamma``. ``gamma = 0`` is an unweighted average
        over the ranks that moved; ``gamma = -1`` makes every step count equally
        across ranks regardless of how many each took.
      * a mass a round cannot carry (below ``MASS_MIN``, ``frame.py``), or above
        ``WORK_MASS_MAX`` (2^64: beyond it the float32 sum Σ(wᵣ·Tᵣ) overflows for
        ordinary values of T, e.g. ``6000 ** 10`` with weights of 100), raises
        ``ValueError`` naming ``n`` and ``gamma``, rather than turning the consensus
        into inf or NaN.

    Args:
        n: optimizer steps since the last sync (negative counts are treated as
            idle, not as an error, so a clock-skewed counter cannot poison the
            round).
        gamma: the work exponent.
    """
    if n <= 0:
        return 0.0
    if gamma == 1.0:
        mass = float(n)
    else:
        try:
            mass = float(n) ** gamma
        except OverflowError:  # beyond a double: past MASS_MAX too
            mass = float("inf")
    if not MASS_MIN <= mass <= WORK_MASS_MAX:  # NaN fails too
        raise ValueError(
            f"the work mass n**gamma = {n}**{gamma:g} = {mass:g} is outside {MASS_MIN:.4g} "
            f"to {WORK_MASS_MAX:.4g} (2^64), where the float32 sum of weight x parameters "
            f"stays finite: use a gamma nearer 1 (0 weighs every rank that moved equally, "
            f"-1 every step)")
    return mass


def mover_mass(n: int) -> float:
    """The buffers mass: ``1.0`` if the rank moved (``n > 0``), else ``0.0``.

    Buffers are not optimizer state, so they are not work-weighted: every rank
    that stepped contributes equally, and an idle rank contributes nothing.
    """
    return 1.0 if n > 0 else 0.0


def is_realized(mass: float) -> bool:
    """Whether a round with accepted mass ``mass`` realized any work (``mass > 0``).

    A round that realized nothing carries a meaningless zero sum: receivers keep
    their local state, the outer optimizer must not step, and the checkpoint
    forge skips it. NaN is not realized.
    """
    return mass > 0.0


# ---------------------------------------------------------------------------
# The rank-side consumer of the algebra above
# ---------------------------------------------------------------------------


def sumcount_reduce(comm, tensors: Sequence, weight: float, slot: int, *,
                    outer: bool = False, with_mass: bool = False):
    """Reduce ``tensors`` weighted by this rank's mass; keep them when nothing was realized.

    Pre-scales by ``weight`` (fused into the copy into shared memory), ships the mass
    in the same contribution, and returns the consensus Σ(wᵣ·Tᵣ)/Σwᵣ over exactly the
    accepted contributions - the divisor travels with the sum, so the two can never
    disagree. When the accepted mass is not positive (every rank idle, or all
    contributors dead) it returns the caller's ORIGINAL tensors: keep local state.

    Args:
        comm: the rank's ``Comm``.
        tensors: float32 / bfloat16 tensors (params, or the floating-point buffers).
        weight: this rank's mass (``gamma_mass`` for params, ``mover_mass`` for buffers).
        slot: the decode staging slot (``DECODE_SLOT_PARAMS`` / ``DECODE_SLOT_BUFFERS``);
            armed before the reduce, a no-op unless pinned decode is enabled.
        outer: this is the window's params frame: the installed outer optimizer steps
            the consensus into the new global (``Comm.set_outer``).
        with_mass: return ``(tensors, accepted_mass)`` instead of the tensors alone,
            so the caller can check the realized work against what it expected.
    """
    from ..frame import RoundKind

    comm.arm_pinned_decode(slot)
    consensus, mass = comm.all_reduce_scaled(tensors, weight, RoundKind.MODEL, weight,
                                             outer=outer)
    out = list(tensors) if not is_realized(mass) else consensus
    return (out, mass) if with_mass else out

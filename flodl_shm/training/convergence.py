"""Convergence guards: watch replica drift at each sync and advise ElChe (docs/runtime.md, "Convergence guards").

After every averaging the engine measures, per rank, the normalized distance
from the replica it held before the sync to the consensus it received,
``delta[r] = ||pre_r - post|| / ||post||``. A guard turns that trajectory into
a :class:`ConvergenceAction`, which maps onto ElChe's verdicts
(:meth:`flodl_shm.training.el_che.ElChe.apply_action`):

=====================  ===========================================================
action                 ElChe verdict
=====================  ===========================================================
``Stable()``           ``commit_proposed_anchor`` - a pending growth may land
``SuppressGrowth()``   ``veto_proposed_growth`` - drop it, latch growth off
``NudgeDown(factor)``  ``nudge_down(factor)`` - shrink the anchor by ``factor``
=====================  ===========================================================

Guards:

* :class:`TrendGuard` (the production default): three strictly rising maxima,
  the last above a threshold, suppress growth. It never nudges down: the trend
  signal alone is too noisy to drive an aggressive anchor cut.
* :class:`NoGuard`: always ``Stable`` - the unconditioned baseline.
* :class:`MsfGuard`: a rate detector on ``lambda = ln(D_t / D_{t-1}) / k_max``
  with soft (suppress) and hard (nudge) thresholds.

Only TrendGuard has state worth persisting; its ring is saved as
``ElCheState.trend_history`` and restored with :meth:`TrendGuard.with_history`,
so the 3-sample warm-up does not re-arm after a resume.
"""
from __future__ import annotations

import abc
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

logger = logging.getLogger("flodl_shm")

__all__ = [
    "ConvergenceAction",
    "ConvergenceGuard",
    "LambdaEstimator",
    "LambdaSample",
    "MsfGuard",
    "NoGuard",
    "NudgeDown",
    "Stable",
    "SuppressGrowth",
    "TrendGuard",
    "max_relative_delta",
]

#: Capacity of TrendGuard's divergence ring (and of a restored history).
TREND_RING_CAP = 5
#: Number of most recent entries that must be strictly rising to fire.
TREND_RISES = 3


# ---------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvergenceAction:
    """A guard's advice for the cadence. Concrete actions are the subclasses
    :class:`Stable`, :class:`SuppressGrowth` and :class:`NudgeDown`; compare by
    value (``action == Stable()``) or with ``match``."""


@dataclass(frozen=True)
class Stable(ConvergenceAction):
    """No divergence concern: a pending anchor growth may be committed."""


@dataclass(frozen=True)
class SuppressGrowth(ConvergenceAction):
    """Divergence is trending up: drop any pending growth and hold the anchor."""


@dataclass(frozen=True)
class NudgeDown(ConvergenceAction):
    """Sustained divergence: shrink the anchor multiplicatively.

    Attributes:
        factor: the shrink multiplier (0.5 halves the anchor). ElChe clamps it to
            ``[0.1, 1.0]`` and ignores a non-finite factor.
    """

    factor: float


def max_relative_delta(deltas: Iterable[float]) -> float:
    """The largest per-rank normalized delta, the guards' primary signal.

    ``0.0`` for an empty input; negative values and NaN never win (a rank whose
    delta could not be computed must not mask or fabricate drift).
    """
    worst = 0.0
    for d in deltas:
        d = float(d)
        if d > worst:
            worst = d
    return worst


# ---------------------------------------------------------------------------
# Guard interface
# ---------------------------------------------------------------------------


class ConvergenceGuard(abc.ABC):
    """A convergence-monitoring strategy, called once per averaging event.

    Guards are owned by one coordinator and are not thread-safe.
    """

    @abc.abstractmethod
    def check(self, deltas: Sequence[float], k_used: int = 0, k_max: int = 0) -> ConvergenceAction:
        """Observe one sync's per-rank deltas and return the advised action.

        Args:
            deltas: ``||pre_r - post|| / ||post||`` per rank.
            k_used: total batches across ranks since the previous sync
                (accounting only).
            k_max: the largest per-rank step count since the previous sync - the
                wall-clock length of the interval; MsfGuard's rate denominator.
        """

    def trend_history(self) -> Optional[list[float]]:
        """The resume-relevant history, or ``None`` when the guard has none."""
        return None

    def reset(self) -> None:
        """Forget all observations (run or mode boundaries). No-op by default."""


class NoGuard(ConvergenceGuard):
    """Always :class:`Stable`: the baseline that lets the overhead auto-tune
    drive the cadence with no convergence intervention."""

    def check(self, deltas: Sequence[float], k_used: int = 0, k_max: int = 0) -> ConvergenceAction:
        return Stable()

    def __repr__(self) -> str:
        return "NoGuard()"


class TrendGuard(ConvergenceGuard):
    """Suppress growth on three strictly rising divergence maxima above a threshold.

    Each :meth:`check` pushes ``max(deltas)`` into a ring of the last
    :data:`TREND_RING_CAP` (5) values. With fewer than 3 entries the answer is
    :class:`Stable`; when the last three are strictly increasing *and* the last
    exceeds ``threshold`` the answer is :class:`SuppressGrowth`; otherwise
    :class:`Stable`. It never returns :class:`NudgeDown`.

    Args:
        threshold: the divergence level a rising trend must exceed to count
            (default 0.01). Set it high (e.g. 1.0) to log-only during calibration;
            about twice the steady-state divergence is typical in production.
    """

    def __init__(self, threshold: float = 0.01) -> None:
        if not math.isfinite(threshold):
            raise ValueError(
                f"TrendGuard threshold must be finite, got {threshold!r}; "
                "pass a number such as the default 0.01 (or 1.0 to only log)"
            )
        self.threshold = float(threshold)
        self._history: deque[float] = deque(maxlen=TREND_RING_CAP)

    @classmethod
    def with_history(cls, history: Iterable[float], threshold: float = 0.01) -> "TrendGuard":
        """A guard whose ring is pre-filled with ``history`` (oldest first).

        Used on resume with ``ElCheState.trend_history``. A history longer than the
        ring keeps its most recent :data:`TREND_RING_CAP` values.
        """
        guard = cls(threshold)
        guard._history.extend(float(v) for v in history)
        return guard

    @property
    def history(self) -> tuple[float, ...]:
        """The ring's contents, oldest first (read-only view for monitoring)."""
        return tuple(self._history)

    def check(self, deltas: Sequence[float], k_used: int = 0, k_max: int = 0) -> ConvergenceAction:
        self._history.append(max_relative_delta(deltas))
        return self._check_trend()

    def _check_trend(self) -> ConvergenceAction:
        h = self._history
        if len(h) < TREND_RISES:
            return Stable()
        a, b, c = h[-3], h[-2], h[-1]
        if c > b > a and c > self.threshold:
            # DEBUG: it can hold for many windows in a row; ElChe says at INFO when it
            # holds its anchor's growth and when it re-arms it
            logger.debug(
                "weight-space divergence trending up (history %s, threshold %g): suppressing "
                "anchor growth", [round(v, 6) for v in h], self.threshold,
            )
            return SuppressGrowth()
        return Stable()

    def trend_history(self) -> Optional[list[float]]:
        """The ring as a list (oldest first), or ``None`` when empty - the value
        stored in ``ElCheState.trend_history``."""
        return list(self._history) if self._history else None

    def reset(self) -> None:
        self._history.clear()

    def __repr__(self) -> str:
        return f"TrendGuard(threshold={self.threshold!r}, history={list(self._history)!r})"


# ---------------------------------------------------------------------------
# MsfGuard
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LambdaSample:
    """One observation of the across-event divergence rate.

    Attributes:
        d_raw: this event's maximum normalized delta.
        lambda_raw: ``ln(D_t / D_{t-1}) / k_max``; ``None`` on the first event
            after a reset, or when either D is below the noise floor.
        lambda_ema: bias-corrected EMA of ``lambda_raw``; ``None`` until the first
            ``lambda_raw``.
        k_used: total batches across ranks (accounting only).
        k_max: the largest per-rank step count (the rate denominator).
    """

    d_raw: float
    lambda_raw: Optional[float]
    lambda_ema: Optional[float]
    k_used: int
    k_max: int


class LambdaEstimator:
    """EMA of the per-step divergence growth rate with Adam-style bias correction.

    ``lambda_raw = ln(D_t / D_{t-1}) / k_max``; the EMA is
    ``ema = alpha * ema + (1 - alpha) * lambda_raw`` reported as
    ``ema / (1 - alpha**t)``. A ``D`` at or below the noise floor (1e-8) breaks
    the chain: the next event has no predecessor.

    Args:
        alpha: EMA coefficient, clamped to ``(0, 1]``; a non-finite value falls
            back to the default 0.9.
        noise_floor: divergences at or below this are treated as no signal.
    """

    def __init__(self, alpha: float = 0.9, noise_floor: float = 1e-8) -> None:
        if not math.isfinite(alpha):
            alpha = 0.9
        self.alpha = min(max(float(alpha), 2.220446049250313e-16), 1.0)
        self.noise_floor = float(noise_floor)
        self.reset()

    def reset(self) -> None:
        self._prev_d: Optional[float] = None
        self._ema_raw = 0.0
        self._ema_t = 0

    def observe(self, d_raw: float, k_used: int, k_max: int) -> LambdaSample:
        """Fold one event's maximum delta into the estimate."""
        lam: Optional[float] = None
        prev = self._prev_d
        if prev is not None and prev > self.noise_floor and d_raw > self.noise_floor and k_max > 0:
            lam = math.log(d_raw / prev) / k_max
        if lam is not None:
            self._ema_raw = self.alpha * self._ema_raw + (1.0 - self.alpha) * lam
            self._ema_t += 1
        self._prev_d = d_raw if d_raw > self.noise_floor else None
        ema: Optional[float] = None
        if self._ema_t > 0:
            denom = 1.0 - self.alpha ** self._ema_t
            ema = self._ema_raw / denom if denom > 0.0 else self._ema_raw
        return LambdaSample(d_raw, lam, ema, k_used, k_max)


class MsfGuard(ConvergenceGuard):
    """Rate-based guard with a soft (suppress) and a hard (nudge) threshold.

    ``lambda_ema > suppress_threshold`` for ``suppress_sustain`` consecutive events
    gives :class:`SuppressGrowth`; ``lambda_ema > nudge_threshold`` for
    ``nudge_sustain`` consecutive events gives ``NudgeDown(nudge_factor)``. The
    two streaks are independent; the hard trigger wins when both fire on the same
    event, and a trigger resets only its own streak. ``nudge_threshold=inf``
    disables nudging. No resume state (the EMA re-warms).
    """

    def __init__(
        self,
        *,
        alpha: float = 0.9,
        suppress_threshold: float = 1e-3,
        suppress_sustain: int = 3,
        nudge_threshold: float = 1e-2,
        nudge_sustain: int = 3,
        nudge_factor: float = 0.5,
    ) -> None:
        self.estimator = LambdaEstimator(alpha)
        self.suppress_threshold = float(suppress_threshold)
        self.suppress_sustain = int(suppress_sustain)
        self.nudge_threshold = float(nudge_threshold)
        self.nudge_sustain = int(nudge_sustain)
        self.nudge_factor = float(nudge_factor)
        self._suppress_streak = 0
        self._nudge_streak = 0
        self.last_sample: Optional[LambdaSample] = None

    def check(self, deltas: Sequence[float], k_used: int = 0, k_max: int = 0) -> ConvergenceAction:
        sample = self.estimator.observe(max_relative_delta(deltas), k_used, k_max)
        self.last_sample = sample
        lema = sample.lambda_ema if sample.lambda_ema is not None else -math.inf
        self._suppress_streak = self._suppress_streak + 1 if lema > self.suppress_threshold else 0
        self._nudge_streak = self._nudge_streak + 1 if lema > self.nudge_threshold else 0
        if self._nudge_streak >= self.nudge_sustain and math.isfinite(self.nudge_threshold):
            self._nudge_streak = 0
            logger.info(
                "divergence rate lambda_ema=%.4e sustained above %.4e: nudging the anchor down by %g",
                lema, self.nudge_threshold, self.nudge_factor,
            )
            return NudgeDown(self.nudge_factor)
        if self._suppress_streak >= self.suppress_sustain:
            self._suppress_streak = 0
            logger.debug(  # ElChe says at INFO when it holds growth and when it re-arms it
                "divergence rate lambda_ema=%.4e sustained above %.4e: suppressing growth",
                lema, self.suppress_threshold,
            )
            return SuppressGrowth()
        return Stable()

    def reset(self) -> None:
        self.estimator.reset()
        self._suppress_streak = 0
        self._nudge_streak = 0
        self.last_sample = None


def resumed_guard(guard, trend_history: Optional[Sequence[float]]):
    """The convergence guard a resume goes on with: a ``TrendGuard`` refilled with the
    snapshot's ``trend_history`` (``ElCheState``), any other guard, or no history, as
    it is."""
    if trend_history and isinstance(guard, TrendGuard):
        return TrendGuard.with_history(trend_history, guard.threshold)
    return guard

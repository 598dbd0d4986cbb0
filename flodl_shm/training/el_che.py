"""ElChe: the heterogeneous-cadence balancer (flodl 0.7.0 ``el_che.rs``; docs/runtime.md, "ElChe").

"The column marches at the slowest one's pace." The slow rank (the *anchor
rank*) runs ``anchor`` batches per sync window; faster ranks run proportionally
more, so everyone reaches the reduce at about the same time and nobody idles at
the barrier. After every window the engine reports measured wall times; ElChe
refines the per-rank counts and proposes anchor growth when the per-window fixed
cost (reduce + fill) is too large a share of the window. Growth is only ever
*proposed*: the convergence guard's verdict commits or vetoes it
(:mod:`flodl_shm.training.convergence`).
"""
from __future__ import annotations

import enum
import logging
import math
import operator
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..checkpoint.meta import ELCHE_PHASES, ElCheState

if TYPE_CHECKING:
    from .convergence import ConvergenceAction

logger = logging.getLogger("flodl_shm")


class Phase(str, enum.Enum):
    """ElChe lifecycle phase; values are the JSON names used in checkpoint metadata.

    Phases only move forward: Probe -> Warmup (first calibration) -> Stable
    (5 calibrations) -> Mature (20 calibrations).
    """

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    def __str__(self) -> str:
        return self.value


# the sidecar stores the phase by these names (checkpoint.meta validates them)
assert tuple(p.value for p in Phase) == ELCHE_PHASES

def fit_counts(counts: Sequence[int], limit: int, *, strict: bool = True,
               remainder: str = "largest") -> list[int]:
    """Scale per-rank batch counts down to at most ``limit`` in total, proportionally.

    The runtime's one fitting rule: ElChe's epoch cap and the coordinator's
    dispatch near an epoch's end both use it. Counts that fit are returned
    unchanged. Otherwise each positive count becomes ``max(floor(c * limit /
    total), 1)``, and what is left of ``limit`` goes either to the largest count
    (``remainder="largest"``, flodl's window cap; on a tie the highest rank, as
    flodl's ``max_by_key``) or one batch each to the live ranks in rank order
    (``remainder="in_order"``, flodl's ``clamp_total``: an epoch's tail split as
    evenly as it divides). Zero counts (dead ranks) stay 0.

    Args:
        counts: per-rank batch counts (negative values count as 0).
        limit: the most batches the window may hold in total.
        strict: when the floors of 1 alone overshoot (more live ranks than
            ``limit``), drop the highest ranks to 0 until the total fits - the
            dispatcher cannot hand out batches that do not exist. With
            ``strict=False`` the floor wins: ElChe's counts are ratios that the
            dispatcher apportions later.
        remainder: ``"largest"`` or ``"in_order"`` (see above).
    """
    if remainder not in ("largest", "in_order"):
        raise ValueError(f"remainder must be 'largest' or 'in_order', got {remainder!r}")
    counts = [max(int(c), 0) for c in counts]
    total = sum(counts)
    if total <= limit:
        return counts
    limit = max(int(limit), 0)
    out = [max(math.floor(c * limit / total), 1) if c > 0 else 0 for c in counts]
    rem = limit - sum(out)
    live = [i for i, c in enumerate(out) if c > 0]
    if rem > 0 and remainder == "in_order" and live:
        for k in range(rem):
            out[live[k % len(live)]] += 1
    elif rem > 0:
        largest = max(reversed(range(len(out))), key=lambda i: out[i])
        out[largest] += rem
    if strict:
        for r in reversed(range(len(out))):
            excess = sum(out) - limit
            if excess <= 0:
                break
            out[r] -= min(out[r], excess)
    return out


# ---------------------------------------------------------------------------
# Constants (flodl 0.7.0 defaults)
# ---------------------------------------------------------------------------


#: Per-rank trust window: the mean of the last 5 ms/batch readings is the smoothed
#: signal; 5 consecutive missed reports clear a rank's window (death exception).
TRUST_WINDOW_CAP = 5
#: A rank is election-eligible when its smoothed ms is >= (1 - 0.15) x the slowest:
#: clearly fast ranks are excluded by evidence, not by oracle.
COHORT_BAND = 0.15
#: Within the cohort the current anchor is kept unless a challenger is slower by
#: more than 10%: near-identical ranks do not churn on noise.
DOMINANCE_MARGIN = 0.10
#: Upper clamp on slow_ms / ms: a degenerate sub-ms sample must not schedule 1e4x.
MAX_SPEED_RATIO = 64.0
#: Snapshots of batch_counts kept for ``recent_batch_share``.
BATCH_COUNTS_WINDOW_CAP = 10
#: Consecutive Stable verdicts that re-arm growth after a veto or nudge.
GROWTH_REARM_STABLE = 5
#: Cap on one growth step (multiplicative).
GROWTH_STEP_CAP = 2.0
#: Before Stable, a proposal must clear overhead_target x this margin; equal to the
#: step cap on purpose, so an early proposal is always cap-clamped (noise cannot
#: change the decision).
WARMUP_GROWTH_MARGIN = GROWTH_STEP_CAP
#: A rank's count only changes when the new target differs by more than 5%.
DEAD_ZONE = 0.05
#: Calibrations needed to enter Stable and Mature.
STABLE_AT = 5
MATURE_AT = 20

_PHASE_ORDER = {Phase.PROBE: 0, Phase.WARMUP: 1, Phase.STABLE: 2, Phase.MATURE: 3}


def check_anchor(sync_every, el_che: "ElChe") -> None:
    """With ElChe, ``sync_every`` is the slowest rank's batches in the first window, which
    is the anchor: an ElChe given as the cadence (or built by a factory) that starts at
    another anchor is refused, naming both, rather than one of them ignored."""
    anchor = el_che.anchor()
    if sync_every is not None and int(sync_every) != anchor:
        raise ValueError(
            f"sync_every={sync_every} is the slowest rank's batches in the first window with "
            f"ElChe, and the cadence's ElChe starts at anchor {anchor}: pass "
            f"sync_every={anchor}, or build the ElChe with anchor={sync_every}")


def _ord(phase: Phase) -> int:
    # Phase is a str enum: "stable" < "warmup" alphabetically, so never compare
    # phases with < / >= directly.
    return _PHASE_ORDER[phase]


def _round_half_away(x: float) -> int:
    """Round like Rust's ``f64::round`` (half away from zero), for x >= 0.

    Python's ``round`` is banker's rounding (2.5 -> 2); flodl's counts round
    2.5 -> 3, and the schedules must agree.
    """
    fl = math.floor(x)
    return int(fl + 1) if x - fl >= 0.5 else int(fl)


def _as_count(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


@dataclass
class WindowReport:
    """One reduce window's observations, for :meth:`ElChe.report_window`.

    Carries both timing scales so the scale choice lives next to the allocation
    model it protects:

    Attributes:
        wall_ms: per-rank compute-only wall (ms) this window.
        steps: per-rank step counts (the divisor matching ``wall_ms``).
        delivered_ms: per-rank marginal delivered wall (ms); 0 without a sample.
        delivered_batches: per-rank delivered batch counts; 0 without a sample.
        fill_ms: per-rank first-batch fill excess (ms), the growth signal.
        delivered_coherent: the caller attests the delivered scale is usable this
            window (every live mover has a delivered sample).
        sync_ms: duration of the sync that closed the window.
    """

    wall_ms: list[float]
    steps: list[int]
    delivered_ms: list[float]
    delivered_batches: list[int]
    fill_ms: list[float]
    delivered_coherent: bool
    sync_ms: float

    def select_feed(self) -> tuple[list[float], list[int]]:
        """The ``(ms, batches)`` pair ElChe schedules on.

        Allocation is relative, so the scale must be uniform within a window:
        unless the delivered scale is coherent, every rank feeds compute-only
        values. When coherent, ranks with a delivered sample feed it and the rest
        fall back to their compute pair.
        """
        if not self.delivered_coherent:
            return list(self.wall_ms), list(self.steps)
        ms: list[float] = []
        batches: list[int] = []
        for r in range(len(self.wall_ms)):
            if self.delivered_batches[r] > 0 and self.delivered_ms[r] > 0.0:
                ms.append(self.delivered_ms[r])
                batches.append(self.delivered_batches[r])
            else:
                ms.append(self.wall_ms[r])
                batches.append(self.steps[r])
        return ms, batches


class ElChe:
    """Heterogeneous-cadence balancer (flodl 0.7.0 ``el_che.rs``; docs/runtime.md, "ElChe").

    The slow *anchor rank* runs :meth:`anchor` batches per sync window and every
    other rank runs ``round(anchor * slow_ms / ms)`` (at least 1, ratio capped at
    64), so all ranks reach the reduce together. After each window call
    :meth:`report_timing`; feed the convergence guard's verdict back with
    :meth:`apply_action` (or the individual verdict methods).

    Lifecycle: ``Probe`` (no data) -> ``Warmup`` (first calibration; the anchor
    pin holds, growth only on a 2x margin) -> ``Stable`` (5 calibrations;
    election and growth at the real target) -> ``Mature`` (20). Phases only move
    forward.

    Args:
        world_size: number of ranks, at least 2.
        anchor: the initial batches per window of the slow rank, at least 1. It is
            also the default floor of the overhead auto-tune (``min_anchor``).

    Builders (``with_*``) return the ElChe itself, for chaining.
    """

    def __init__(self, world_size: int, anchor: int) -> None:
        world_size = _as_count(world_size, "world_size")
        anchor = _as_count(anchor, "anchor")
        if world_size < 2:
            raise ValueError(
                f"ElChe requires world_size >= 2, got {world_size}; a single rank has no cadence "
                "to balance (train without ElChe)"
            )
        if anchor < 1:
            raise ValueError(f"ElChe anchor must be >= 1 batch per window, got {anchor}")
        self._world_size = world_size
        self._anchor = anchor
        self._batch_counts: list[int] = [anchor] * world_size
        self._windows: list[deque[float]] = [deque(maxlen=TRUST_WINDOW_CAP) for _ in range(world_size)]
        self._zero_reports: list[int] = [0] * world_size
        self._counts_window: deque[tuple[int, ...]] = deque(maxlen=BATCH_COUNTS_WINDOW_CAP)
        self._calibrated = False
        self._overhead_target = 0.05
        self._min_anchor = anchor
        self._max_anchor = 1000
        self._max_total_batches: Optional[int] = None
        self._window_cap_binding = False
        self._max_batch_diff: Optional[int] = None
        self._phase = Phase.PROBE
        self._anchor_rank: Optional[int] = None
        self._calibration_count = 0
        self._slack_ms: list[float] = [0.0] * world_size
        self._proposed_anchor: Optional[int] = None  # a pending Grow(n)
        self._fill_ms: list[float] = [0.0] * world_size
        self._growth_enabled = True
        self._consecutive_stable = 0
        self._window_growth_applicable = True

    def __repr__(self) -> str:
        return (
            f"ElChe(world_size={self._world_size}, anchor={self._anchor}, "
            f"anchor_rank={self._anchor_rank}, phase={self._phase.value}, "
            f"batch_counts={self._batch_counts})"
        )

    def settings(self) -> tuple:
        """Its knobs and where its trajectory starts, as ``(name, value)`` pairs: what
        every rank's ElChe must share, since each rank computes the cohort's batch
        counts itself from the same reports."""
        return (("world_size", self._world_size), ("anchor", self._anchor),
                ("anchor_rank", self._anchor_rank), ("batch_counts", tuple(self._batch_counts)),
                ("overhead_target", self._overhead_target), ("min_anchor", self._min_anchor),
                ("max_anchor", self._max_anchor), ("max_batch_diff", self._max_batch_diff),
                ("max_total_batches", self._max_total_batches),
                ("window_growth_applicable", self._window_growth_applicable),
                ("phase", self._phase.value), ("calibrated", self._calibrated))

    # -- builders ----------------------------------------------------------------------

    def with_overhead_target(self, target: float) -> "ElChe":
        """Set the per-window fixed overhead (reduce + fill) the anchor grows to stay
        under, as a fraction of the anchor rank's window wall. Default 0.05; clamped
        to ``[0.01, 0.50]``. Lower means fewer, larger windows (more staleness,
        bounded by the convergence guard and the epoch cap)."""
        if not math.isfinite(target):
            raise ValueError(
                f"overhead target must be a finite fraction, got {target!r}; use a value in "
                "[0.01, 0.5] (default 0.05)"
            )
        self._overhead_target = min(max(float(target), 0.01), 0.50)
        return self

    def with_max_anchor(self, max_anchor: int) -> "ElChe":
        """Cap the anchor (the gradient-staleness limit). Default 1000; at least 1.
        Pulls ``min_anchor`` and the anchor down into range when they exceed it."""
        self._max_anchor = max(_as_count(max_anchor, "max_anchor"), 1)
        if self._min_anchor > self._max_anchor:
            self._min_anchor = self._max_anchor
            self._anchor = min(max(self._anchor, self._min_anchor), self._max_anchor)
        return self

    def with_min_anchor(self, min_anchor: int) -> "ElChe":
        """Floor of the overhead auto-tune (default: the initial anchor); at least 1,
        capped at ``max_anchor``; lifts the anchor to it. A convergence NudgeDown
        deliberately bypasses this floor."""
        self._min_anchor = min(max(_as_count(min_anchor, "min_anchor"), 1), self._max_anchor)
        if self._anchor < self._min_anchor:
            self._anchor = self._min_anchor
        return self

    def with_max_batch_diff(self, max_diff: int) -> "ElChe":
        """Limit how far one update may move a rank's count once calibrated
        (``0`` = lockstep: counts never change after the first calibration)."""
        max_diff = _as_count(max_diff, "max_batch_diff")
        if max_diff < 0:
            raise ValueError(f"max_batch_diff must be >= 0 (0 = lockstep), got {max_diff}")
        self._max_batch_diff = max_diff
        return self

    def with_speed_ratio(self, slow_rank: int, ratio: float) -> "ElChe":
        """Seed the schedule before any measurement: ``slow_rank`` gets ``anchor``,
        every other rank ``round(anchor * max(ratio, 1))`` (at least 1). Pins
        ``slow_rank`` as the anchor rank; measurements correct a wrong guess."""
        slow_rank = self._check_rank(slow_rank, "slow_rank")
        if not math.isfinite(ratio):
            raise ValueError(f"speed ratio must be finite, got {ratio!r}; e.g. 2.3 for a rank 2.3x faster")
        ratio = max(float(ratio), 1.0)
        for r in range(self._world_size):
            self._batch_counts[r] = (
                self._anchor if r == slow_rank else max(_round_half_away(self._anchor * ratio), 1)
            )
        self._anchor_rank = slow_rank
        return self

    def with_initial_anchor(self, slow_rank: int) -> "ElChe":
        """Pin the cold-start anchor rank without a speed ratio. The pin holds through
        Probe and Warmup; election may move it from Stable on."""
        self._anchor_rank = self._check_rank(slow_rank, "slow_rank")
        return self

    def with_window_growth_applicable(self, applicable: bool) -> "ElChe":
        """Whether anchor growth applies at all (False for Sync, which has no window
        to amortize). Config, not trajectory: restore leaves it untouched."""
        self._window_growth_applicable = bool(applicable)
        return self

    def set_max_total_batches(self, max_total: int) -> None:
        """Cap the window (``sum(batch_counts)``) at one epoch's batches; ``0`` removes
        the cap. While the cap binds, growth is not proposed."""
        max_total = _as_count(max_total, "max_total")
        if max_total < 0:
            raise ValueError(f"max_total must be >= 0 (0 = no cap), got {max_total}")
        self._max_total_batches = max_total or None

    def apply_callback_slack(self, slack_ms: Sequence[float]) -> None:
        """Stage per-rank callback wall time (ms) to absorb at the next recompute: the
        firing rank's count drops by ``ceil(slack / ms_per_batch)`` (at least 1 batch
        left), once. A length mismatch is logged and ignored, so an off-by-one caller
        cannot crash a running cohort."""
        if len(slack_ms) != self._world_size:
            logger.warning(
                "ElChe.apply_callback_slack ignored: %d values for world_size %d",
                len(slack_ms), self._world_size,
            )
            return
        self._slack_ms = [float(s) for s in slack_ms]

    def set_window_fill_ms(self, fill_ms: Sequence[float]) -> None:
        """Stage per-rank first-batch fill (ms) for the next growth proposal, once. A
        length mismatch is logged and ignored (growth falls back to the reduce term)."""
        if len(fill_ms) != self._world_size:
            logger.warning(
                "ElChe.set_window_fill_ms ignored: %d values for world_size %d",
                len(fill_ms), self._world_size,
            )
            return
        self._fill_ms = [float(f) for f in fill_ms]

    # -- the timing feed -------------------------------------------------------------

    def report_timing(self, wall_ms: Sequence[float], batches: Sequence[int], sync_ms: float) -> None:
        """Fold one window's measurements in and recompute the schedule.

        Args:
            wall_ms: per rank, the TOTAL wall (ms) of the batches it actually ran.
            batches: per rank, the batches it actually ran (the divisor: using the
                intended count would inflate a fast rank's ms/batch and invert the
                ratio).
            sync_ms: the reduce that closed the window (ms), the growth signal.

        A rank with no batches or a non-positive/non-finite wall contributes no
        sample; after 5 such reports in a row its trust window is cleared. A report
        from which no anchor can be derived changes nothing and does not count as a
        calibration.
        """
        if len(wall_ms) != self._world_size or len(batches) != self._world_size:
            raise ValueError(
                f"report_timing needs one value per rank: got {len(wall_ms)} wall_ms and "
                f"{len(batches)} batches for world_size {self._world_size}"
            )
        # 1. trust windows
        for r in range(self._world_size):
            wall = float(wall_ms[r])
            n = int(batches[r])
            if n > 0 and wall > 0.0 and math.isfinite(wall):
                self._windows[r].append(wall / n)
                self._zero_reports[r] = 0
            else:
                self._zero_reports[r] += 1
                if self._zero_reports[r] >= TRUST_WINDOW_CAP:
                    self._windows[r].clear()

        # 2. election: to make the first pick, and from Stable on. Probe and Warmup
        # hold the pin so cold-start skew cannot crown the wrong anchor.
        if self._anchor_rank is None or _ord(self._phase) >= _ord(Phase.STABLE):
            elected = self._elect_anchor()
            if elected is not None:
                if self._anchor_rank is not None and elected != self._anchor_rank:
                    logger.info("ElChe anchor rank %d -> %d", self._anchor_rank, elected)
                self._anchor_rank = elected

        # 3. the anchor's pace, with the dead-pin escape
        if self._anchor_rank is None:
            return
        slow_ms = self._smoothed(self._anchor_rank)
        if slow_ms <= 0.0:
            # A pinned anchor that never reports would freeze the balancer in Probe
            # forever (this return precedes the calibration count, and re-election
            # needs Stable). After a full trust window of misses, elect from data.
            if self._zero_reports[self._anchor_rank] >= TRUST_WINDOW_CAP:
                elected = self._elect_anchor()
                if elected is not None:
                    logger.warning(
                        "ElChe pinned anchor rank %d missed %d reports: re-electing rank %d",
                        self._anchor_rank, self._zero_reports[self._anchor_rank], elected,
                    )
                    self._anchor_rank = elected
                    slow_ms = self._smoothed(elected)
            if slow_ms <= 0.0:
                return

        # 4. growth proposal: from the 2nd calibration (never on the first report)
        self._proposed_anchor = None
        if _ord(self._phase) >= _ord(Phase.STABLE) or (
            self._phase is Phase.WARMUP and self._calibration_count >= 1
        ):
            self._proposed_anchor = self._propose_anchor(float(sync_ms))
        self._fill_ms = [0.0] * self._world_size  # one-shot signal

        # 5. schedule from the current (pre-proposal) anchor
        self._recompute_batch_counts(slow_ms)

        # 6. bookkeeping
        self._counts_window.append(tuple(self._batch_counts))
        self._calibrated = True
        self._calibration_count += 1
        logger.debug(
            "ElChe calibration %d: ms_per_batch=%s batch_counts=%s anchor_rank=%s anchor=%d",
            self._calibration_count, [round(m, 3) for m in self.ms_per_batch()],
            self._batch_counts, self._anchor_rank, self._anchor,
        )
        # 7. phases
        self._advance_phase()

    def report_window(self, report: WindowReport) -> None:
        """Stage the fill, pick the timing scale (:meth:`WindowReport.select_feed`)
        and call :meth:`report_timing` when the window carries any signal; an
        all-zero window reports nothing."""
        self.set_window_fill_ms(report.fill_ms)
        ms, batches = report.select_feed()
        if any(m > 0.0 for m in ms):
            self.report_timing(ms, batches, report.sync_ms)

    # -- verdicts ------------------------------------------------------------------------

    def commit_proposed_anchor(self) -> None:
        """Convergence is clean (``Stable``): apply a pending growth and count toward
        re-arming growth (5 consecutive Stable verdicts re-arm it)."""
        self._consecutive_stable += 1
        if self._consecutive_stable >= GROWTH_REARM_STABLE:
            if not self._growth_enabled:
                logger.info("ElChe anchor growth re-armed: %d stable windows in a row",
                            self._consecutive_stable)
            self._growth_enabled = True
        if self._proposed_anchor is not None:
            new = self._proposed_anchor
            self._proposed_anchor = None
            logger.info("ElChe anchor %d -> %d (growth committed)", self._anchor, new)
            self._anchor = new
            self._recompute_if_calibrated()

    def veto_proposed_growth(self) -> None:
        """Divergence is trending up (``SuppressGrowth``): drop a pending growth and
        latch growth off until 5 consecutive Stable verdicts re-arm it. Logged once when
        the latch closes (the guard may say so many windows in a row)."""
        if self._growth_enabled:
            logger.info("ElChe anchor growth held at anchor %d: the convergence guard reports "
                        "the replicas' divergence trending up (growth resumes once %d "
                        "windows in a row are stable)", self._anchor, GROWTH_REARM_STABLE)
        self._proposed_anchor = None
        self._consecutive_stable = 0
        self._growth_enabled = False

    def nudge_down(self, factor: float) -> None:
        """Sustained divergence (``NudgeDown``): drop a pending growth, latch growth
        off, then ``anchor = min(max(ceil(anchor * clamp(factor, 0.1, 1)), 1), anchor)``
        and recompute. Bypasses ``min_anchor`` (divergence outranks the overhead
        floor). A non-finite factor shrinks nothing (it still drops the proposal).

        The proposal is dropped first on purpose: it was computed from the
        pre-nudge anchor, and a later Stable commit would silently undo the nudge.
        """
        self._proposed_anchor = None
        self._consecutive_stable = 0
        self._growth_enabled = False
        if not math.isfinite(factor):
            logger.warning("ElChe.nudge_down ignored a non-finite factor %r", factor)
            return
        f = min(max(float(factor), 0.1), 1.0)
        new = min(max(math.ceil(self._anchor * f), 1), self._anchor)
        if new != self._anchor:
            logger.info("ElChe anchor %d -> %d (nudged down x%g)", self._anchor, new, f)
        self._anchor = new
        self._recompute_if_calibrated()

    def relax_anchor_up(self) -> None:
        """Drift the anchor up by one (async opt-in on Stable), up to ``max_anchor``;
        refused when the projected fastest count ``round((anchor+1) * max_ms/min_ms)``
        would lead the anchor by more than ``max_batch_diff``."""
        if self._anchor >= self._max_anchor:
            return
        if self._max_batch_diff is not None:
            sm = self.ms_per_batch()
            max_ms = max(sm)
            positive = [m for m in sm if m > 0.0]
            if max_ms > 0.0 and positive:
                new = self._anchor + 1
                fast = max(_round_half_away(new * max_ms / min(positive)), 1)
                if fast - new > self._max_batch_diff:
                    return
        self._anchor += 1
        self._recompute_if_calibrated()

    def apply_action(self, action: "ConvergenceAction", *, relax_up: bool = False) -> None:
        """Apply a convergence guard's action: ``Stable`` commits (and, with
        ``relax_up``, drifts the anchor up by one), ``SuppressGrowth`` vetoes,
        ``NudgeDown(f)`` nudges down."""
        from .convergence import NudgeDown, Stable, SuppressGrowth

        if isinstance(action, Stable):
            self.commit_proposed_anchor()
            if relax_up:
                self.relax_anchor_up()
        elif isinstance(action, SuppressGrowth):
            self.veto_proposed_growth()
        elif isinstance(action, NudgeDown):
            self.nudge_down(action.factor)
        else:
            raise TypeError(
                f"unknown convergence action {action!r}; expected Stable(), SuppressGrowth() "
                "or NudgeDown(factor) from flodl_shm.training.convergence"
            )

    # -- queries ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._world_size

    def batches(self, rank: int) -> int:
        """Batches ``rank`` runs this window."""
        return self._batch_counts[self._check_rank(rank, "rank")]

    def batch_counts(self) -> list[int]:
        """Per-rank batches this window (a copy)."""
        return list(self._batch_counts)

    def total_batches(self) -> int:
        return sum(self._batch_counts)

    def anchor(self) -> int:
        """Batches per window of the anchor (slow) rank."""
        return self._anchor

    def anchor_rank(self) -> Optional[int]:
        """The elected anchor rank, ``None`` before the first pick."""
        return self._anchor_rank

    def phase(self) -> Phase:
        return self._phase

    def calibration_count(self) -> int:
        return self._calibration_count

    def is_calibrated(self) -> bool:
        """Whether at least one report produced a schedule (or a restored state
        carried a reading)."""
        return self._calibrated

    def has_speed_hint(self) -> bool:
        """Whether the counts are non-uniform (e.g. after ``with_speed_ratio``)."""
        return len(set(self._batch_counts)) > 1

    def anchor_wall_ms(self) -> float:
        """Intended wall time of one window, ``anchor * slow_ms``; 0 when uncalibrated."""
        if not self._calibrated:
            return 0.0
        return self._anchor * self._slow_ms()

    def ms_per_batch(self) -> list[float]:
        """Per-rank smoothed ms/batch (trust-window means; 0.0 without data)."""
        return [self._smoothed(r) for r in range(self._world_size)]

    def smoothed_ms_per_batch(self, rank: int) -> Optional[float]:
        """Rank's smoothed ms/batch, or ``None`` when its trust window is empty
        (distinguishes "no reading" from a reading)."""
        w = self._windows[self._check_rank(rank, "rank")]
        return sum(w) / len(w) if w else None

    def recent_batch_share(self) -> list[float]:
        """Per-rank share of the last (up to 10) schedules, summing to 1. Falls back
        to the current counts before any report, then to equal shares."""
        if not self._counts_window:
            total = sum(self._batch_counts)
            if total == 0:
                return [1.0 / self._world_size] * self._world_size
            return [c / total for c in self._batch_counts]
        sums = [0.0] * self._world_size
        total = 0.0
        for snap in self._counts_window:
            for r, c in enumerate(snap):
                sums[r] += c
                total += c
        if total <= 0.0:
            return [1.0 / self._world_size] * self._world_size
        return [s / total for s in sums]

    @property
    def overhead_target(self) -> float:
        return self._overhead_target

    @property
    def min_anchor(self) -> int:
        return self._min_anchor

    @property
    def max_anchor(self) -> int:
        return self._max_anchor

    @property
    def max_batch_diff(self) -> Optional[int]:
        return self._max_batch_diff

    @property
    def max_total_batches(self) -> Optional[int]:
        return self._max_total_batches

    @property
    def window_cap_binding(self) -> bool:
        """Whether the last recompute had to scale the window down to the epoch cap."""
        return self._window_cap_binding

    @property
    def growth_enabled(self) -> bool:
        """The growth latch (off after a veto or nudge until 5 Stable verdicts)."""
        return self._growth_enabled

    @property
    def proposed_anchor(self) -> Optional[int]:
        """The pending growth target awaiting a verdict, or ``None``."""
        return self._proposed_anchor

    @property
    def pending_callback_slack_ms(self) -> list[float]:
        return list(self._slack_ms)

    @property
    def pending_window_fill_ms(self) -> list[float]:
        return list(self._fill_ms)

    # -- persistence -----------------------------------------------------------------------

    def to_state(self) -> "ElCheState":
        """Snapshot the trajectory for the checkpoint sidecar.

        Saved: anchor, anchor rank, per-rank smoothed ms/batch (window means, 0.0
        when empty), phase, calibration count. User knobs are NOT saved: on resume
        they come from the new run's configuration. ``trend_history`` is ``None``
        here; the engine fills it from the convergence guard.
        """
        return ElCheState(
            anchor=self._anchor,
            anchor_rank=self._anchor_rank,
            smoothed_ms_per_batch=self.ms_per_batch(),
            phase=self._phase.value,
            calibration_count=self._calibration_count,
            trend_history=None,
        )

    def restore_from_state(self, state: "ElCheState") -> None:
        """Adopt a snapshot's trajectory, keeping this instance's knobs.

        Restores anchor, anchor rank, phase and calibration count; reseeds each
        rank's trust window with ONE sample equal to the saved mean (empty when the
        mean is 0), so fresh reports take over within 5 windows; ``is_calibrated``
        becomes whether any saved mean is positive.

        Raises:
            ValueError: the snapshot's world size (its number of smoothed values)
                differs from this ElChe's - a config-coherence bug, never a soft
                case - or the snapshot is malformed (anchor < 1, anchor rank out of
                range).
        """
        saved = list(state.smoothed_ms_per_batch)
        if len(saved) != self._world_size:
            raise ValueError(
                f"ElChe.restore_from_state: snapshot world_size {len(saved)} != current "
                f"world_size {self._world_size}; resume must use the same world size as the "
                "saved run"
            )
        anchor = _as_count(state.anchor, "state.anchor")
        if anchor < 1:
            raise ValueError(f"ElChe.restore_from_state: snapshot anchor {anchor} must be >= 1")
        if state.anchor_rank is not None and not 0 <= state.anchor_rank < self._world_size:
            raise ValueError(
                f"ElChe.restore_from_state: snapshot anchor_rank {state.anchor_rank} is out of "
                f"range for world_size {self._world_size}"
            )
        self._anchor = anchor
        self._anchor_rank = state.anchor_rank
        self._phase = Phase(state.phase)
        self._calibration_count = int(state.calibration_count)
        for r, ms in enumerate(saved):
            self._windows[r].clear()
            if ms > 0.0:
                self._windows[r].append(float(ms))
        self._calibrated = any(ms > 0.0 for ms in saved)
        slow_ms = self._slow_ms()
        if slow_ms > 0.0:  # the saved cadence applies from the first window on
            self._recompute_batch_counts(slow_ms, jump=True)

    # -- internals ---------------------------------------------------------------------------

    def _check_rank(self, rank: int, name: str) -> int:
        rank = _as_count(rank, name)
        if not 0 <= rank < self._world_size:
            raise ValueError(f"{name} {rank} is out of range for world_size {self._world_size}")
        return rank

    def _smoothed(self, rank: int) -> float:
        w = self._windows[rank]
        return sum(w) / len(w) if w else 0.0

    def _slow_ms(self) -> float:
        return 0.0 if self._anchor_rank is None else self._smoothed(self._anchor_rank)

    def _elect_anchor(self) -> Optional[int]:
        """Cohort filter, then sticky-with-margin within the cohort.

        Cohort = ranks within 15% of the slowest. A single member wins. A current
        anchor in the cohort is kept unless the slowest other member exceeds it by
        more than 10%. Otherwise the lowest-index cohort member.
        """
        sm = self.ms_per_batch()
        max_ms = max(sm)
        if max_ms <= 0.0:
            return None
        threshold = max_ms * (1.0 - COHORT_BAND)
        cohort = [r for r in range(self._world_size) if sm[r] >= threshold]
        if len(cohort) == 1:
            return cohort[0]
        cur = self._anchor_rank
        if cur is not None and cur in cohort:
            challengers = [r for r in cohort if r != cur]
            # the slowest challenger; on an exact tie the highest index, as Rust's
            # Iterator::max_by returns the last maximal element
            other = max(reversed(challengers), key=lambda r: sm[r])
            if sm[other] > sm[cur] * (1.0 + DOMINANCE_MARGIN):
                return other
            return cur
        return cohort[0]

    def _propose_anchor(self, sync_ms: float) -> Optional[int]:
        """A grow-only proposal from the anchor rank's per-window fixed overhead.

        ``overhead = (reduce + fill) / (anchor * marginal + reduce + fill)``. It
        fires above ``overhead_target`` (x2 before Stable) and proposes
        ``clamp(ceil(anchor * min(overhead / target, 2)), min_anchor, max_anchor)``
        when that exceeds the current anchor.
        """
        if not self._window_growth_applicable or not self._growth_enabled:
            return None
        if self._window_cap_binding:
            logger.debug("ElChe growth suppressed: the window cap (one epoch) is binding")
            return None
        b = self._anchor_rank
        if b is None:
            return None
        marginal = self._smoothed(b)
        if marginal <= 0.0:
            return None
        fill = max(self._fill_ms[b], 0.0)
        reduce_ms = max(sync_ms, 0.0) if math.isfinite(sync_ms) else 0.0
        fixed = reduce_ms + fill
        denom = self._anchor * marginal + fixed
        if denom <= 0.0 or fixed <= 0.0:
            return None
        overhead = fixed / denom
        fire_at = (
            self._overhead_target
            if _ord(self._phase) >= _ord(Phase.STABLE)
            else self._overhead_target * WARMUP_GROWTH_MARGIN
        )
        if overhead <= fire_at:
            return None
        scale = min(overhead / self._overhead_target, GROWTH_STEP_CAP)
        new = min(max(math.ceil(self._anchor * scale), self._min_anchor), self._max_anchor)
        return new if new > self._anchor else None

    def _recompute_if_calibrated(self) -> None:
        slow_ms = self._slow_ms()
        if slow_ms > 0.0:
            self._recompute_batch_counts(slow_ms)

    def _recompute_batch_counts(self, slow_ms: float, jump: bool = False) -> None:
        """The anchor rank gets ``anchor``; rank r gets ``round(anchor * min(slow/ms_r,
        64))`` (>= 1), minus its staged callback slack. A count moves only when the
        target differs by more than 5% (or before calibration, or under slack, or on a
        ``jump``: a restored state), and once calibrated by at most ``max_batch_diff``
        per update (unless on a ``jump``). Then the window cap scales everything to fit
        one epoch (:func:`fit_counts`, the floor of 1 per rank winning over the cap)."""
        for r in range(self._world_size):
            ms = self._smoothed(r)
            if ms <= 0.0 or abs(ms - slow_ms) < 1e-6:
                target = self._anchor
            else:
                ratio = min(slow_ms / ms, MAX_SPEED_RATIO)
                target = max(_round_half_away(self._anchor * ratio), 1)
            slack = self._slack_ms[r]
            slack_batches = math.ceil(slack / ms) if slack > 0.0 and ms > 0.0 else 0
            target = max(target - slack_batches, 1)

            current = self._batch_counts[r]
            if (jump or abs(target - current) > current * DEAD_ZONE or not self._calibrated
                    or slack_batches > 0):
                d = self._max_batch_diff
                if d is not None and self._calibrated and not jump:
                    if target > current:
                        target = min(current + d, target)
                    else:
                        target = max(current - d, target, 1)
                self._batch_counts[r] = target

        self._window_cap_binding = False
        cap = self._max_total_batches
        if cap is not None:
            total = sum(self._batch_counts)
            if total > cap:
                # The per-rank floor of 1 wins over the cap when world_size > cap:
                # counts are ratios the dispatcher apportions, and a 0-step rank
                # simply ships a weight-0 frame.
                self._window_cap_binding = True
                self._batch_counts = fit_counts(self._batch_counts, cap, strict=False)
        self._slack_ms = [0.0] * self._world_size  # one-shot

    def _advance_phase(self) -> None:
        nxt = self._phase
        if self._phase is Phase.PROBE:
            nxt = Phase.WARMUP
        elif self._phase is Phase.WARMUP and self._calibration_count >= STABLE_AT:
            nxt = Phase.STABLE
        elif self._phase is Phase.STABLE and self._calibration_count >= MATURE_AT:
            nxt = Phase.MATURE
        if nxt is not self._phase:
            logger.info(
                "ElChe phase %s -> %s (calibration %d, anchor rank %s)",
                self._phase.value, nxt.value, self._calibration_count, self._anchor_rank,
            )
            self._phase = nxt

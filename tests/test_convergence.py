"""Convergence guards (spec §9.4): TrendGuard's three-rises rule, its resume ring,
NoGuard, and MsfGuard's rate thresholds."""
from __future__ import annotations

import math

import pytest

from flodl_shm.training.convergence import (
    LambdaEstimator,
    MsfGuard,
    NoGuard,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
    max_relative_delta,
)


def test_max_relative_delta_picks_the_worst_rank_and_ignores_nan():
    assert max_relative_delta([0.01, 0.05, 0.03]) == 0.05
    assert max_relative_delta([]) == 0.0
    assert max_relative_delta([float("nan"), 0.02]) == 0.02
    assert max_relative_delta([-1.0]) == 0.0


def test_actions_compare_by_value():
    assert Stable() == Stable()
    assert NudgeDown(0.5) == NudgeDown(0.5)
    assert NudgeDown(0.5) != NudgeDown(0.25)
    assert Stable() != SuppressGrowth()


def test_no_guard_is_always_stable_and_has_no_history():
    g = NoGuard()
    for _ in range(10):
        assert g.check([0.5, 0.9], 8, 4) == Stable()
    assert g.trend_history() is None


class TestTrendGuard:
    def test_default_threshold_is_0_01(self):
        g = TrendGuard()
        assert g.check([0.011]) == Stable()
        assert g.check([0.012]) == Stable()
        assert g.check([0.013]) == SuppressGrowth()

    def test_needs_three_entries(self):
        g = TrendGuard(0.01)
        assert g.check([0.02]) == Stable()
        assert g.check([0.03]) == Stable()
        assert g.check([0.04]) == SuppressGrowth()

    def test_uses_the_maximum_over_ranks(self):
        g = TrendGuard(0.01)
        g.check([0.001, 0.02])
        g.check([0.03, 0.0])
        assert g.check([0.0, 0.001, 0.04]) == SuppressGrowth()
        assert g.history == (0.02, 0.03, 0.04)

    def test_a_dip_breaks_the_trend(self):
        g = TrendGuard(0.01)
        g.check([0.05])
        g.check([0.04])
        assert g.check([0.06]) == Stable()

    def test_equal_values_are_not_strictly_rising(self):
        g = TrendGuard(0.01)
        g.check([0.02])
        g.check([0.03])
        assert g.check([0.03]) == Stable()

    def test_rising_below_threshold_is_stable(self):
        g = TrendGuard(0.10)
        g.check([0.01])
        g.check([0.02])
        assert g.check([0.03]) == Stable()
        # The last value alone must exceed the threshold (not merely reach it).
        g2 = TrendGuard(0.03)
        g2.check([0.01])
        g2.check([0.02])
        assert g2.check([0.03]) == Stable()

    def test_never_nudges_down(self):
        g = TrendGuard(0.0)
        for i in range(20):
            assert not isinstance(g.check([10.0 * (i + 1)]), NudgeDown)

    def test_ring_keeps_the_last_five(self):
        g = TrendGuard(0.01)
        for i in range(10):
            g.check([i * 0.01])
        assert len(g.history) == 5
        assert g.trend_history() == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09])

    def test_trend_history_is_none_when_empty_and_after_reset(self):
        g = TrendGuard()
        assert g.trend_history() is None
        g.check([0.5])
        assert g.trend_history() == [0.5]
        g.reset()
        assert g.trend_history() is None

    def test_snapshot_roundtrip(self):
        g = TrendGuard(0.01)
        for v in (0.01, 0.02, 0.03, 0.04, 0.05):
            g.check([v])
        snap = g.trend_history()
        assert snap == [0.01, 0.02, 0.03, 0.04, 0.05]
        restored = TrendGuard.with_history(snap)
        assert restored.history == g.history

    def test_restored_history_skips_the_warmup(self):
        # Cold: one observation can never fire. Warm: the saved rising ring plus one
        # new rising value fires immediately on the first post-resume sync.
        cold = TrendGuard(0.01)
        assert cold.check([0.05]) == Stable()
        warm = TrendGuard.with_history([0.02, 0.03, 0.04], threshold=0.01)
        assert warm.check([0.05]) == SuppressGrowth()

    def test_with_history_keeps_the_most_recent_five(self):
        g = TrendGuard.with_history([float(i) for i in range(10)])
        assert g.history == (5.0, 6.0, 7.0, 8.0, 9.0)

    def test_non_finite_threshold_is_refused(self):
        with pytest.raises(ValueError, match="threshold"):
            TrendGuard(float("nan"))


class TestMsf:
    def test_first_event_has_no_rate(self):
        e = LambdaEstimator()
        s = e.observe(0.05, 8, 4)
        assert s.lambda_raw is None and s.lambda_ema is None
        assert (s.d_raw, s.k_used, s.k_max) == (0.05, 8, 4)

    def test_rate_is_log_ratio_over_k_max(self):
        e = LambdaEstimator()
        e.observe(0.01, 8, 4)
        s = e.observe(0.02, 8, 4)
        assert s.lambda_raw == pytest.approx(math.log(2) / 4, abs=1e-12)
        e2 = LambdaEstimator()
        e2.observe(0.04, 12, 4)
        assert e2.observe(0.02, 12, 4).lambda_raw == pytest.approx(-math.log(2) / 4, abs=1e-12)

    def test_ema_is_bias_corrected(self):
        e = LambdaEstimator()
        e.observe(1.0, 1, 1)
        s = e.observe(math.e, 1, 1)
        assert s.lambda_raw == pytest.approx(1.0, abs=1e-12)
        assert s.lambda_ema == pytest.approx(1.0, abs=1e-12)

    def test_noise_floor_breaks_the_chain(self):
        e = LambdaEstimator()
        e.observe(0.01, 8, 4)
        assert e.observe(1e-12, 8, 4).lambda_raw is None
        assert e.observe(0.02, 8, 4).lambda_raw is None
        assert e.observe(0.04, 8, 4).lambda_raw == pytest.approx(math.log(2) / 4, abs=1e-12)

    def test_suppress_after_three_sustained_events(self):
        g = MsfGuard(nudge_threshold=float("inf"))
        d = 0.01
        actions = []
        for _ in range(5):
            actions.append(g.check([d], 8, 4))
            d *= 1.01  # lambda = ln(1.01)/4 ≈ 2.5e-3 > 1e-3
        # event 1 has no rate; events 2,3,4 are the sustained streak
        assert actions[:3] == [Stable(), Stable(), Stable()]
        assert actions[3] == SuppressGrowth()
        assert actions[4] == Stable()  # the streak restarted after firing

    def test_nudge_wins_over_suppress(self):
        g = MsfGuard()
        d = 0.01
        actions = []
        for _ in range(4):
            actions.append(g.check([d], 8, 4))
            d *= 2.0  # lambda = ln2/4 ≈ 0.17 > 1e-2
        assert actions[3] == NudgeDown(0.5)

    def test_msf_has_no_resume_history(self):
        assert MsfGuard().trend_history() is None

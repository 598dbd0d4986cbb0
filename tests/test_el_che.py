"""ElChe (spec §8): construction and knobs, report_timing's rules pinned with numbers,
verdicts, queries, and state persistence (ported from the seed-001 Rust tests)."""
from __future__ import annotations

import math

import pytest

from flodl_shm import ElChe, ElCheState, Phase
from flodl_shm.training.convergence import NudgeDown, Stable, SuppressGrowth
from flodl_shm.training.el_che import WindowReport, fit_counts


def report_ms(el: ElChe, ms, sync_ms: float = 0.0, batches: int = 10) -> None:
    """Report one window in which every rank ran ``batches`` batches at ``ms[r]`` each."""
    el.report_timing([m * batches for m in ms], [batches] * len(ms), sync_ms)


def calibrate(el: ElChe, ms, times: int, sync_ms: float = 0.0) -> None:
    for _ in range(times):
        report_ms(el, ms, sync_ms)


# --- construction and knobs ---------------------------------------------------------------


def test_construction_defaults():
    el = ElChe(3, 8)
    assert el.batch_counts() == [8, 8, 8]
    assert el.total_batches() == 24
    assert el.anchor() == 8
    assert el.phase() is Phase.PROBE
    assert el.anchor_rank() is None
    assert not el.is_calibrated()
    assert el.calibration_count() == 0
    assert el.anchor_wall_ms() == 0.0
    assert el.ms_per_batch() == [0.0, 0.0, 0.0]
    assert el.smoothed_ms_per_batch(0) is None
    assert el.overhead_target == 0.05
    assert (el.min_anchor, el.max_anchor) == (8, 1000)
    assert el.max_batch_diff is None and el.max_total_batches is None
    assert el.growth_enabled and el.proposed_anchor is None
    assert el.recent_batch_share() == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize("ws,anchor,match", [(1, 8, "world_size >= 2"), (0, 8, "world_size"),
                                              (2, 0, "anchor must be >= 1")])
def test_construction_is_validated(ws, anchor, match):
    with pytest.raises(ValueError, match=match):
        ElChe(ws, anchor)


def test_overhead_target_is_clamped_and_chains():
    el = ElChe(2, 4)
    assert el.with_overhead_target(0.9) is el
    assert el.overhead_target == 0.5
    assert ElChe(2, 4).with_overhead_target(0.001).overhead_target == 0.01
    assert ElChe(2, 4).with_overhead_target(0.2).overhead_target == 0.2
    with pytest.raises(ValueError, match="finite"):
        ElChe(2, 4).with_overhead_target(float("nan"))


def test_anchor_bounds_builders():
    el = ElChe(2, 10).with_max_anchor(5)
    assert (el.anchor(), el.min_anchor, el.max_anchor) == (5, 5, 5)
    assert ElChe(2, 10).with_max_anchor(0).max_anchor == 1
    el = ElChe(2, 10).with_min_anchor(20)
    assert (el.anchor(), el.min_anchor) == (20, 20)
    assert ElChe(2, 10).with_min_anchor(0).min_anchor == 1
    el = ElChe(2, 10).with_max_anchor(50).with_min_anchor(80)  # floor capped at max
    assert (el.anchor(), el.min_anchor) == (50, 50)


def test_speed_ratio_seeds_counts_and_pins_the_anchor():
    el = ElChe(3, 10).with_speed_ratio(1, 2.3)
    assert el.batch_counts() == [23, 10, 23]
    assert el.anchor_rank() == 1
    assert el.has_speed_hint()
    assert el.recent_batch_share() == pytest.approx([23 / 56, 10 / 56, 23 / 56])
    # ratio < 1 is treated as 1; rounding is half away from zero (2.5 -> 3, like Rust)
    assert ElChe(2, 10).with_speed_ratio(0, 0.5).batch_counts() == [10, 10]
    assert ElChe(2, 5).with_speed_ratio(0, 1.5).batch_counts() == [5, 8]  # 7.5 -> 8
    with pytest.raises(ValueError, match="slow_rank 2 is out of range for world_size 2"):
        ElChe(2, 10).with_speed_ratio(2, 2.0)


def test_report_timing_requires_one_value_per_rank():
    with pytest.raises(ValueError, match="world_size 3"):
        ElChe(3, 8).report_timing([1.0, 2.0], [8, 8], 0.0)


# --- schedule: speed ratio, dead zone, max_batch_diff, window cap ------------------------------


def test_faster_ranks_get_proportionally_more_batches():
    el = ElChe(3, 10)
    report_ms(el, [10.0, 5.0, 2.5])
    assert el.anchor_rank() == 0
    assert el.batch_counts() == [10, 20, 40]
    assert el.anchor_wall_ms() == pytest.approx(100.0)
    assert el.ms_per_batch() == pytest.approx([10.0, 5.0, 2.5])


def test_divisor_is_the_actual_batch_count():
    el = ElChe(2, 10)
    # rank 1 ran 30 batches in 150 ms (5 ms/batch), not its intended 10
    el.report_timing([100.0, 150.0], [10, 30], 0.0)
    assert el.ms_per_batch() == [10.0, 5.0]
    assert el.batch_counts() == [10, 20]


def test_speed_ratio_is_capped_at_64():
    el = ElChe(2, 2)
    report_ms(el, [100.0, 0.1])  # ratio 1000 -> 64
    assert el.batch_counts() == [2, 128]


def test_dead_zone_is_five_percent_of_the_current_count():
    def second_report(rank1_sample):
        el = ElChe(2, 100)
        report_ms(el, [10.0, 10.0])
        assert el.batch_counts() == [100, 100]
        report_ms(el, [10.0, rank1_sample])
        return el.batch_counts()[1]

    # window mean 9.5 -> target round(1000/9.5) = 105: |105-100| = 5, not > 5 -> held
    assert second_report(9.0) == 100
    # window mean 9.4 -> target 106: moves
    assert second_report(8.8) == 106


def test_max_batch_diff_limits_each_update_once_calibrated():
    el = ElChe(2, 10).with_max_batch_diff(3)
    report_ms(el, [10.0, 5.0])  # uncalibrated: the first schedule is not limited
    assert el.batch_counts() == [10, 20]
    report_ms(el, [10.0, 1.0])  # window [5, 1] mean 3 -> target 33, limited to 20+3
    assert el.batch_counts() == [10, 23]
    report_ms(el, [10.0, 1.0])  # window [5,1,1] mean 2.33 -> target 43, limited to 26
    assert el.batch_counts() == [10, 26]
    report_ms(el, [10.0, 100.0])  # window mean 26.75 -> target 4: down by at most 3
    assert el.batch_counts() == [10, 23]
    report_ms(el, [10.0, 100.0])  # mean 41.4 -> target 2; 5th calibration: Stable
    assert el.batch_counts() == [10, 20] and el.phase() is Phase.STABLE
    report_ms(el, [10.0, 100.0])
    # Stable: rank 1 (mean 60.4) is elected anchor; rank 0's target 60 and rank 1's
    # target 10 are both reached 3 batches at a time
    assert el.anchor_rank() == 1
    assert el.batch_counts() == [13, 17]


def test_max_batch_diff_zero_is_lockstep_after_the_first_schedule():
    el = ElChe(2, 10).with_max_batch_diff(0)
    report_ms(el, [10.0, 5.0])
    assert el.batch_counts() == [10, 20]
    calibrate(el, [10.0, 1.0], 6)
    assert el.batch_counts() == [10, 20]


def test_window_cap_scales_down_and_gives_the_remainder_to_the_largest():
    el = ElChe(3, 10)
    el.set_max_total_batches(50)
    assert el.max_total_batches == 50
    report_ms(el, [10.0, 5.0, 2.5])  # [10, 20, 40] = 70 > 50
    # floor(50/70 * [10,20,40]) = [7, 14, 28] = 49; remainder 1 -> rank 2
    assert el.batch_counts() == [7, 14, 29]
    assert el.total_batches() == 50
    assert el.window_cap_binding


def test_window_cap_floor_of_one_may_exceed_the_cap():
    el = ElChe(3, 10)
    el.set_max_total_batches(2)
    report_ms(el, [10.0, 5.0, 2.5])
    assert el.batch_counts() == [1, 1, 1]
    assert el.window_cap_binding


def test_window_cap_zero_means_none():
    el = ElChe(2, 10)
    el.set_max_total_batches(5)
    el.set_max_total_batches(0)
    assert el.max_total_batches is None
    report_ms(el, [10.0, 5.0])
    assert el.batch_counts() == [10, 20] and not el.window_cap_binding


def test_callback_slack_is_subtracted_once():
    el = ElChe(2, 10)
    report_ms(el, [10.0, 5.0])
    assert el.batch_counts() == [10, 20]
    el.apply_callback_slack([0.0, 12.0])
    assert el.pending_callback_slack_ms == [0.0, 12.0]
    report_ms(el, [10.0, 5.0])
    assert el.batch_counts() == [10, 17]  # 20 - ceil(12/5); bypasses the dead zone
    assert el.pending_callback_slack_ms == [0.0, 0.0]
    report_ms(el, [10.0, 5.0])
    assert el.batch_counts() == [10, 20]
    el.apply_callback_slack([1.0])  # wrong length: ignored
    assert el.pending_callback_slack_ms == [0.0, 0.0]


def test_fit_counts_is_the_one_rule_for_the_cap_and_the_dispatch():
    assert fit_counts([10, 20, 40], 100) == [10, 20, 40]       # fits: unchanged
    assert fit_counts([10, 20, 40], 35) == [5, 10, 20]
    assert fit_counts([10, 20, 40], 36) == [5, 10, 21]         # remainder to the largest
    assert fit_counts([20, 20], 5) == [2, 3]                   # tie: the highest rank
    assert fit_counts([0, 8, 8], 4) == [0, 2, 2]               # dead ranks stay 0
    # more live ranks than the limit: the dispatcher drops the highest ranks ...
    assert fit_counts([1, 1, 1], 2) == [1, 1, 0]
    assert fit_counts([5, 5], 0) == [0, 0]
    # ... while ElChe's ratios keep their floor of 1
    assert fit_counts([10, 20, 40], 2, strict=False) == [1, 1, 1]
    # the dispatcher's epoch tail: the remainder one batch each, in rank order
    assert fit_counts([8, 8, 8, 8], 10, remainder="in_order") == [3, 3, 2, 2]
    assert fit_counts([0, 8, 8, 8], 10, remainder="in_order") == [0, 4, 3, 3]
    assert fit_counts([8, 8, 8, 8], 10) == [2, 2, 2, 4]          # the window cap's rule
    with pytest.raises(ValueError, match="remainder must be"):
        fit_counts([1], 0, remainder="last")


# --- trust windows ---------------------------------------------------------------------------


def test_trust_window_is_the_mean_of_the_last_five():
    el = ElChe(2, 10)
    for ms in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        report_ms(el, [ms, 1.0])
    assert el.smoothed_ms_per_batch(0) == pytest.approx(5.0)  # mean of 3..7


def test_five_consecutive_misses_clear_a_rank_window():
    el = ElChe(3, 10)
    report_ms(el, [10.0, 5.0, 5.0])
    for i in range(4):
        el.report_timing([100.0, 50.0, 0.0], [10, 10, 10], 0.0)
        assert el.smoothed_ms_per_batch(2) == 5.0, i
    el.report_timing([100.0, 50.0, float("nan")], [10, 10, 10], 0.0)
    assert el.smoothed_ms_per_batch(2) is None
    assert el.ms_per_batch()[2] == 0.0
    # a rank without data is scheduled at the anchor count
    assert el.batch_counts() == [10, 20, 10]


# --- election -------------------------------------------------------------------------------


def test_first_election_picks_the_single_slowest():
    el = ElChe(3, 10)
    report_ms(el, [5.0, 10.0, 6.0])
    assert el.anchor_rank() == 1
    assert el.batch_counts() == [20, 10, 17]  # round(10*10/6) = 17


def test_cohort_band_is_15_percent_of_the_slowest():
    # 8.6 >= 0.85 * 10: rank 0 is in the slow cohort; the lowest cohort index wins
    el = ElChe(2, 10)
    report_ms(el, [8.6, 10.0])
    assert el.anchor_rank() == 0
    assert el.batch_counts() == [10, 9]  # the slower rank gets round(10*8.6/10)
    # 8.4 < 8.5: rank 0 is clearly faster and cannot anchor
    el = ElChe(2, 10)
    report_ms(el, [8.4, 10.0])
    assert el.anchor_rank() == 1
    assert el.batch_counts() == [12, 10]


def test_anchor_pin_holds_through_warmup():
    el = ElChe(2, 10)
    report_ms(el, [10.0, 10.0])
    assert el.anchor_rank() == 0  # lowest index of a tied cohort
    report_ms(el, [10.0, 100.0])  # rank 1 is now far slower, but Warmup holds the pin
    assert el.phase() is Phase.WARMUP and el.anchor_rank() == 0
    assert el.batch_counts() == [10, 2]  # round(10 * 10/55)


def test_dominance_margin_is_10_percent_from_stable_on():
    def sixth_report(rank1_sample):
        el = ElChe(2, 10)
        calibrate(el, [10.0, 10.0], 5)
        assert el.phase() is Phase.STABLE and el.anchor_rank() == 0
        report_ms(el, [10.0, rank1_sample])
        return el

    # window [10,10,10,10,14.5] -> mean 10.9 <= 11: the incumbent stays
    el = sixth_report(14.5)
    assert el.anchor_rank() == 0
    # window mean 11.2 > 11: the challenger takes the anchor
    el = sixth_report(16.0)
    assert el.anchor_rank() == 1
    assert el.batch_counts() == [11, 10]  # round(10 * 11.2/10)


def test_election_leaves_the_cohort_when_the_anchor_gets_fast():
    el = ElChe(2, 10)
    calibrate(el, [10.0, 9.0], 5)
    assert el.anchor_rank() == 0
    calibrate(el, [1.0, 9.0], 5)  # rank 0's window falls to 1 ms: out of the cohort
    assert el.anchor_rank() == 1


def test_dead_pinned_anchor_escape_after_five_misses():
    el = ElChe(2, 10).with_speed_ratio(1, 2.0)  # pins rank 1, which never reports
    for i in range(4):
        el.report_timing([50.0, 0.0], [10, 0], 0.0)
        assert not el.is_calibrated(), i
        assert el.calibration_count() == 0 and el.phase() is Phase.PROBE
        assert el.anchor_rank() == 1
    el.report_timing([50.0, 0.0], [10, 0], 0.0)
    assert el.anchor_rank() == 0
    assert el.is_calibrated() and el.calibration_count() == 1
    assert el.phase() is Phase.WARMUP
    assert el.batch_counts() == [10, 10]  # rank 1 has no data: anchor count


def test_all_idle_report_is_not_a_calibration():
    el = ElChe(2, 10)
    el.report_timing([0.0, 0.0], [0, 0], 5.0)
    assert el.anchor_rank() is None and not el.is_calibrated()
    assert el.phase() is Phase.PROBE and el.calibration_count() == 0


# --- phases ---------------------------------------------------------------------------------


def test_phase_thresholds_1_5_20():
    el = ElChe(2, 10)
    seen = []
    for _ in range(21):
        report_ms(el, [10.0, 5.0])
        seen.append(el.phase())
    assert seen[0] is Phase.WARMUP
    assert seen[3] is Phase.WARMUP  # 4 calibrations
    assert seen[4] is Phase.STABLE  # 5
    assert seen[18] is Phase.STABLE  # 19
    assert seen[19] is Phase.MATURE  # 20
    assert seen[20] is Phase.MATURE
    assert el.calibration_count() == 21


# --- growth proposals and verdicts -------------------------------------------------------------


def test_first_report_never_proposes_second_does():
    el = ElChe(2, 10)
    # anchor window = 10 x 10 ms = 100 ms; sync 100 ms -> overhead 0.5
    report_ms(el, [10.0, 10.0], sync_ms=100.0)
    assert el.proposed_anchor is None
    report_ms(el, [10.0, 10.0], sync_ms=100.0)
    # Warmup, 2nd calibration: 0.5 > 2 x 0.05; scale min(0.5/0.05, 2) = 2
    assert el.proposed_anchor == 20
    assert el.anchor() == 10  # only proposed
    el.commit_proposed_anchor()
    assert el.anchor() == 20 and el.proposed_anchor is None
    assert el.batch_counts() == [20, 20]


def test_warmup_needs_twice_the_target_stable_does_not():
    el = ElChe(2, 10)
    # overhead = 9 / (100 + 9) = 0.0826: above 0.05, below the warmup bar 0.10
    for _ in range(5):
        report_ms(el, [10.0, 10.0], sync_ms=9.0)
        if el.phase() is not Phase.STABLE:
            assert el.proposed_anchor is None
    assert el.phase() is Phase.STABLE
    # the 5th report ran its proposal in Warmup (phase advances after it)
    assert el.proposed_anchor is None
    report_ms(el, [10.0, 10.0], sync_ms=9.0)
    # 0.0826 > 0.05: scale 1.651, ceil(10 * 1.651) = 17
    assert el.proposed_anchor == math.ceil(10 * (9 / 109) / 0.05) == 17


def test_no_proposal_below_target_and_none_without_fixed_cost():
    el = ElChe(2, 10)
    calibrate(el, [10.0, 10.0], 5, sync_ms=5.0)  # 5/105 = 0.0476 <= 0.05
    report_ms(el, [10.0, 10.0], sync_ms=5.0)
    assert el.proposed_anchor is None
    report_ms(el, [10.0, 10.0], sync_ms=0.0)
    assert el.proposed_anchor is None


def test_proposals_only_grow_and_respect_max_anchor():
    el = ElChe(2, 10).with_max_anchor(10)
    calibrate(el, [10.0, 10.0], 2, sync_ms=100.0)
    assert el.proposed_anchor is None  # clamp(20, 10, 10) = 10 is not growth
    el = ElChe(2, 10).with_max_anchor(15)
    calibrate(el, [10.0, 10.0], 2, sync_ms=100.0)
    assert el.proposed_anchor == 15


def test_growth_step_is_capped_at_two():
    el = ElChe(2, 10)
    calibrate(el, [10.0, 10.0], 2, sync_ms=10_000.0)  # overhead ~0.99
    assert el.proposed_anchor == 20


def test_window_fill_drives_growth_once():
    el = ElChe(2, 10)
    report_ms(el, [10.0, 10.0])
    el.set_window_fill_ms([100.0, 0.0])  # the anchor rank's fill
    assert el.pending_window_fill_ms == [100.0, 0.0]
    report_ms(el, [10.0, 10.0])
    assert el.proposed_anchor == 20
    assert el.pending_window_fill_ms == [0.0, 0.0]
    report_ms(el, [10.0, 10.0])
    assert el.proposed_anchor is None


def test_no_growth_while_the_window_cap_binds():
    el = ElChe(2, 10)
    el.set_max_total_batches(15)
    calibrate(el, [10.0, 10.0], 2, sync_ms=100.0)
    assert el.window_cap_binding and el.proposed_anchor is None


def test_no_growth_when_not_applicable():
    el = ElChe(2, 10).with_window_growth_applicable(False)
    calibrate(el, [10.0, 10.0], 2, sync_ms=100.0)
    assert el.proposed_anchor is None


def test_veto_latches_growth_off_until_five_stable_verdicts():
    el = ElChe(2, 10)
    calibrate(el, [10.0, 10.0], 2, sync_ms=100.0)
    assert el.proposed_anchor == 20
    el.veto_proposed_growth()
    assert el.proposed_anchor is None and not el.growth_enabled and el.anchor() == 10
    for i in range(4):
        report_ms(el, [10.0, 10.0], sync_ms=100.0)
        assert el.proposed_anchor is None, i
        el.commit_proposed_anchor()
        assert not el.growth_enabled, i
    el.commit_proposed_anchor()  # 5th consecutive Stable
    assert el.growth_enabled
    report_ms(el, [10.0, 10.0], sync_ms=100.0)
    assert el.proposed_anchor == 20


def test_nudge_down_shrinks_bypasses_min_anchor_and_drops_the_proposal():
    el = ElChe(2, 20)
    calibrate(el, [10.0, 5.0], 2, sync_ms=1000.0)
    assert el.proposed_anchor == 40
    el.nudge_down(0.5)
    assert el.anchor() == 10 < el.min_anchor
    assert el.batch_counts() == [10, 20]
    assert el.proposed_anchor is None and not el.growth_enabled
    el.commit_proposed_anchor()  # a later Stable must not resurrect the old proposal
    assert el.anchor() == 10
    el.nudge_down(0.01)  # factor clamps to 0.1: ceil(10 * 0.1) = 1
    assert el.anchor() == 1
    el.nudge_down(float("nan"))
    assert el.anchor() == 1


def test_nudge_factor_above_one_never_grows():
    el = ElChe(2, 10)
    el.nudge_down(3.0)
    assert el.anchor() == 10
    el.nudge_down(0.55)
    assert el.anchor() == 6  # ceil(5.5)


def test_apply_action_maps_guard_actions_to_verdicts():
    el = ElChe(2, 10)
    calibrate(el, [10.0, 10.0], 2, sync_ms=100.0)
    el.apply_action(Stable())
    assert el.anchor() == 20
    report_ms(el, [10.0, 10.0], sync_ms=1000.0)
    assert el.proposed_anchor == 40
    el.apply_action(SuppressGrowth())
    assert el.proposed_anchor is None and not el.growth_enabled
    el.apply_action(NudgeDown(0.5))
    assert el.anchor() == 10
    with pytest.raises(TypeError, match="unknown convergence action"):
        el.apply_action("stable")


def test_relax_anchor_up_respects_max_batch_diff():
    el = ElChe(2, 10).with_max_batch_diff(12)
    report_ms(el, [10.0, 5.0])  # ratio 2: fast rank runs 2 x anchor
    el.relax_anchor_up()
    assert el.anchor() == 11  # projected fast 22 - 11 = 11 <= 12
    el.relax_anchor_up()
    assert el.anchor() == 12  # 24 - 12 = 12 <= 12
    el.relax_anchor_up()
    assert el.anchor() == 12  # 26 - 13 = 13 > 12: refused
    el.apply_action(Stable(), relax_up=True)
    assert el.anchor() == 12


def test_report_window_selects_a_coherent_scale():
    el = ElChe(2, 10)
    el.report_window(WindowReport(
        wall_ms=[100.0, 50.0], steps=[10, 10], delivered_ms=[200.0, 0.0],
        delivered_batches=[10, 0], fill_ms=[0.0, 0.0], delivered_coherent=False, sync_ms=0.0))
    assert el.ms_per_batch() == [10.0, 5.0]  # compute scale for every rank
    el.report_window(WindowReport(
        wall_ms=[100.0, 50.0], steps=[10, 10], delivered_ms=[300.0, 0.0],
        delivered_batches=[10, 0], fill_ms=[0.0, 0.0], delivered_coherent=True, sync_ms=0.0))
    assert el.ms_per_batch() == [20.0, 5.0]  # rank 0 fed (30 ms), rank 1 fell back (5)
    before = el.calibration_count()
    el.report_window(WindowReport([0.0, 0.0], [0, 0], [0.0, 0.0], [0, 0], [0.0, 0.0], False, 1.0))
    assert el.calibration_count() == before  # an all-zero window reports nothing


def test_recent_batch_share_averages_the_last_ten_schedules():
    el = ElChe(2, 10)
    report_ms(el, [10.0, 5.0])  # [10, 20]
    assert el.recent_batch_share() == pytest.approx([1 / 3, 2 / 3])
    report_ms(el, [10.0, 10.0 / 3])  # window mean 4.1667 -> round(24) = 24
    assert el.batch_counts() == [10, 24]
    assert el.recent_batch_share() == pytest.approx([20 / 64, 44 / 64])
    for _ in range(15):  # 5 to flush the trust window, then 10 uniform schedules
        report_ms(el, [10.0, 10.0])
    assert el.batch_counts() == [10, 10]
    assert el.recent_batch_share() == pytest.approx([0.5, 0.5])


# --- persistence (seed 001) -------------------------------------------------------------------


def test_elche_restore_from_state_roundtrip():
    """Capture a calibrated state, restore it onto a fresh ElChe with different user
    knobs: the trajectory fields match and the knobs are kept."""
    original = ElChe(3, 8).with_overhead_target(0.05)
    for _ in range(3):
        original.report_timing([5.0, 7.0, 6.0], [8, 8, 8], 0.5)
    snap = original.to_state()
    assert isinstance(snap, ElCheState)
    assert snap.anchor_rank is not None, "a calibrated run elects an anchor"
    assert any(v > 0.0 for v in snap.smoothed_ms_per_batch)
    assert snap.trend_history is None

    restored = ElChe(3, 8).with_overhead_target(0.20)
    restored.restore_from_state(snap)
    again = restored.to_state()
    assert again.anchor == snap.anchor
    assert again.anchor_rank == snap.anchor_rank
    assert again.phase == snap.phase
    assert again.calibration_count == snap.calibration_count
    assert again.smoothed_ms_per_batch == snap.smoothed_ms_per_batch
    assert restored.is_calibrated(), "restored from a positive-reading snapshot"
    assert restored.overhead_target == 0.20  # the knob was not overwritten


def test_elche_restore_from_state_rejects_world_size_mismatch():
    three = ElChe(3, 8)
    for _ in range(3):
        three.report_timing([5.0, 6.0, 7.0], [8, 8, 8], 0.5)
    snap = three.to_state()
    two = ElChe(2, 8)
    with pytest.raises(ValueError, match="world_size") as info:
        two.restore_from_state(snap)
    assert "snapshot world_size 3 != current world_size 2" in str(info.value)


def test_to_state_numbers():
    el = ElChe(3, 8)
    for _ in range(3):
        el.report_timing([5.0, 7.0, 6.0], [8, 8, 8], 0.5)
    s = el.to_state()
    assert (s.anchor, s.anchor_rank, s.phase, s.calibration_count) == (8, 1, Phase.WARMUP, 3)
    assert s.smoothed_ms_per_batch == pytest.approx([0.625, 0.875, 0.75])
    assert el.batch_counts() == [11, 8, 9]


def test_restore_reseeds_each_window_with_one_sample():
    el = ElChe(2, 10)
    el.restore_from_state(ElCheState(anchor=12, anchor_rank=1, smoothed_ms_per_batch=[4.0, 0.0],
                                     phase=Phase.STABLE, calibration_count=7))
    assert el.anchor() == 12 and el.anchor_rank() == 1 and el.phase() is Phase.STABLE
    assert el.smoothed_ms_per_batch(0) == 4.0 and el.smoothed_ms_per_batch(1) is None
    assert el.is_calibrated()
    report_ms(el, [8.0, 8.0])
    # one restored sample + one fresh one: mean (4 + 8) / 2
    assert el.ms_per_batch() == [6.0, 8.0]
    assert el.calibration_count() == 8


def test_a_restored_state_sets_the_cadence_of_the_first_window():
    """The first window after a resume used to run the fresh [anchor0] * world counts:
    restore_from_state restored the speeds but recomputed nothing until the next report."""
    el = ElChe(2, 4)
    el.restore_from_state(ElCheState(anchor=8, anchor_rank=1, smoothed_ms_per_batch=[3.0, 12.0],
                                     phase=Phase.STABLE, calibration_count=10))
    assert el.batch_counts() == [32, 8]  # rank 0 4x faster, at once (no max_batch_diff steps)
    saved = ElChe(3, 8)
    for _ in range(3):
        saved.report_timing([5.0, 7.0, 6.0], [8, 8, 8], 0.5)
    fresh = ElChe(3, 8)
    fresh.restore_from_state(saved.to_state())
    assert fresh.batch_counts() == saved.batch_counts() == [11, 8, 9]


def test_restore_of_an_uncalibrated_snapshot():
    el = ElChe(2, 10)
    el.restore_from_state(ElChe(2, 10).to_state())
    assert not el.is_calibrated() and el.phase() is Phase.PROBE and el.anchor_rank() is None


def test_restore_rejects_malformed_snapshots():
    el = ElChe(2, 10)
    with pytest.raises(ValueError, match="anchor_rank 5 is out of range"):
        el.restore_from_state(ElCheState(8, 5, [1.0, 1.0], Phase.STABLE, 5))
    with pytest.raises(ValueError, match="anchor 0 must be >= 1"):
        el.restore_from_state(ElCheState(0, None, [1.0, 1.0], Phase.STABLE, 5))

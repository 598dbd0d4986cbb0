"""The replicated coordinator, without processes: dispatch, settlement, checkpoint
decisions, ElChe cadence, and resume (the seed's ``resume_from_meta`` test).
"""
from __future__ import annotations

import pytest

from flodl_shm.checkpoint.meta import (CheckpointMeta, CoverageBlock, ElCheState, EpochCoverage,
                                       SaveReason)
from flodl_shm.training.convergence import NoGuard, TrendGuard
from flodl_shm.training.coordinator import Coordinator, CoordinatorConfig
from flodl_shm.training.el_che import fit_counts
from flodl_shm.training.el_che import Phase
from flodl_shm.training.sync_window import CohortAck, CohortCounts

pytestmark = pytest.mark.timeout(60)


def config(**kw) -> CoordinatorConfig:
    base = dict(world_size=2, dataset_len=100, batch_size=5, epochs=1, sync_every=2)
    base.update(kw)
    return CoordinatorConfig(**base)


def counts_for(plan, *, dead=(), stop=False, ms=None) -> CohortCounts:
    w = len(plan.batches)
    present = tuple(r not in dead for r in range(w))
    batches = tuple(0 if r in dead else plan.batches[r] for r in range(w))
    ms = ms or [1.0] * w
    compute = tuple(0.0 if r in dead else ms[r] * batches[r] for r in range(w))
    return CohortCounts(batches, compute, tuple(0.0 for _ in range(w)), present, stop)


def ack_for(world: int, div: float = 0.0, sync_ms: float = 0.0) -> CohortAck:
    return CohortAck(tuple(div for _ in range(world)), (sync_ms,) * world, (True,) * world)


def drive(coord: Coordinator, *, dead_at=None, windows=None):
    """Run the coordinator like the ranks do; returns [(window, rank, offsets...)] and
    the settlements."""
    trained, settlements = [], []
    dead = set()
    while windows is None or len(settlements) < windows:
        plan = coord.plan_window()
        if plan is None:
            break
        if dead_at is not None and plan.window == dead_at[1]:
            dead.add(dead_at[0])
        c = counts_for(plan, dead=dead)
        s = coord.settle(plan, c)
        coord.report(c, ack_for(len(plan.batches)), s.realized)
        for r in s.realized:
            for off, n in plan.chunks[r]:
                trained.append((plan.window, r, list(range(off, off + n))))
        settlements.append(s)
        if s.stop:
            break
    return trained, settlements


def offsets(trained, epoch_filter=None):
    return sorted(o for _, _, offs in trained for o in offs)


# --- the seed's resume_from_meta ---------------------------------------------------------

def test_resume_from_meta_applies_all_fields():
    """Port of coord_config_resume_from_meta_applies_all_fields."""
    elche_state = ElCheState(anchor=16, anchor_rank=2, smoothed_ms_per_batch=[4.0, 5.0, 6.0],
                             phase=Phase.MATURE, calibration_count=99,
                             trend_history=[0.01, 0.02, 0.03])
    coverage = CoverageBlock(seed=42, batch_size=32,
                             per_epoch=[EpochCoverage(7, 1024, [(320, 64), (640, 384)])])
    meta = (CheckpointMeta.new(7, 42_000, 201, 3, SaveReason.GRACEFUL_SHUTDOWN)
            .with_elche_state(elche_state).with_coverage(coverage))
    cfg = CoordinatorConfig(world_size=3, dataset_len=1024, batch_size=32, epochs=10,
                            cadence="elche", sync_every=8).resume_from_meta(meta)
    assert cfg.start_epoch == 7
    assert cfg.start_global_step == 42_000
    assert cfg.start_avg_count == 201
    assert cfg.start_elche_state == elche_state
    assert cfg.start_coverage == coverage
    assert cfg.start_elche_state is not elche_state, "a copy, not the caller's object"
    # and the coordinator built from it starts there
    coord = Coordinator(cfg)
    assert (coord.epoch, coord.global_step, coord.sync_round) == (7, 42_000, 201)
    assert coord.el_che.anchor() == 16 and coord.el_che.phase() is Phase.MATURE
    assert isinstance(coord.guard, TrendGuard) and coord.guard.history == (0.01, 0.02, 0.03)
    assert coord.pool.uncovered_ranges() == [(320, 64), (640, 384)]


# --- dispatch ------------------------------------------------------------------------------

@pytest.mark.parametrize("counts,limit,want", [
    ([4, 4], 10, [4, 4]),
    ([4, 4], 6, [3, 3]),
    ([4, 4], 5, [2, 3]),
    ([12, 4], 4, [3, 1]),
    ([1, 1, 1], 2, [1, 1, 0]),
    ([0, 8, 8], 4, [0, 2, 2]),
    ([5, 5], 0, [0, 0]),
])
def test_fit_counts(counts, limit, want):
    assert fit_counts(counts, limit) == want


def test_fixed_cadence_covers_each_epoch_exactly_once():
    coord = Coordinator(config(epochs=2))
    trained, settlements = drive(coord)
    assert len(settlements) == 5 * 2, "20 batches per epoch / (2 ranks x 2 batches)"
    per_epoch = {}
    for window, r, offs in trained:
        per_epoch.setdefault((window - 1) // 5, []).extend(offs)
    assert sorted(per_epoch[0]) == list(range(100)) == sorted(per_epoch[1])
    assert coord.finished and coord.epoch == 2 and coord.global_step == 40
    assert coord.sync_round == 10 and coord.plan_window() is None
    assert settlements[-1].stop and settlements[-1].save_reason is SaveReason.GRACEFUL_SHUTDOWN


def test_plan_hands_out_consecutive_chunks_in_rank_order():
    coord = Coordinator(config(world_size=3, sync_every=1))
    plan = coord.plan_window()
    assert plan.window == 1 and plan.epoch == 0 and plan.batches == (1, 1, 1)
    assert plan.chunks == (((0, 5),), ((5, 5),), ((10, 5),))


def test_epoch_tail_is_shared_not_overrun():
    # 20 batches; 2 ranks x 3 = 6 per window: 6, 6, 6, then 2 left -> (1, 1)
    coord = Coordinator(config(sync_every=3))
    _, settlements = drive(coord)
    assert coord.global_step == 20 and len(settlements) == 4


def test_a_dead_ranks_chunk_is_trained_once_by_the_survivors():
    coord = Coordinator(config(world_size=3, max_failures=1))
    trained, settlements = drive(coord, dead_at=(1, 2))
    assert offsets(trained) == list(range(100)), "every sample exactly once"
    dead_window = settlements[1]
    assert dead_window.newly_dead == (1,) and dead_window.forfeited[1] == 10
    assert 1 not in dead_window.realized and not dead_window.stop
    assert coord.alive == [0, 2] and coord.global_step == 20


def test_too_many_deaths_stop_with_max_failure_exceeded():
    coord = Coordinator(config(world_size=3, max_failures=0))
    _, settlements = drive(coord, dead_at=(2, 3))
    last = settlements[-1]
    assert len(settlements) == 3 and last.stop
    assert last.save_reason is SaveReason.MAX_FAILURE_EXCEEDED
    meta = coord.checkpoint_meta(last.save_reason)
    assert meta.world_size_at_save == 2 and meta.sync_round == 3
    assert meta.global_step == 2 * 6 + 4
    # window 3 dispatched 60-69, 70-79, 80-89: the dead rank's chunk joins the
    # never-dispatched 90-99 as uncovered
    assert meta.coverage.per_epoch[0].uncovered_ranges == [(80, 20)]


def test_checkpoint_cadence_and_stop_request():
    coord = Coordinator(config(checkpoint_every=2, epochs=3))
    reasons = []
    while True:
        plan = coord.plan_window()
        s = coord.settle(plan, counts_for(plan, stop=plan.window == 7))
        reasons.append(s.save_reason)
        if s.stop:
            break
    assert reasons == [None, SaveReason.CHECKPOINT, None, SaveReason.CHECKPOINT, None,
                       SaveReason.CHECKPOINT, SaveReason.GRACEFUL_SHUTDOWN]


def test_an_all_idle_checkpoint_window_defers_to_the_next_realized_one():
    coord = Coordinator(config(checkpoint_every=1, world_size=2, max_failures=2))
    plan = coord.plan_window()
    # everybody idle (e.g. a test-injected empty window): no reduce to capture
    idle = CohortCounts((0, 0), (0.0, 0.0), (0.0, 0.0), (True, True), False)
    s = coord.settle(plan, idle)
    assert s.save_reason is SaveReason.CHECKPOINT and s.realized == ()
    assert coord._force_checkpoint, "the save is owed to the next window with a reduce"
    assert coord.pool.uncovered_ranges() == [(0, 100)], "idle chunks go back to the pool"


def test_checkpoint_meta_carries_the_coverage_and_the_position():
    coord = Coordinator(config(epochs=2))
    drive(coord, windows=7)
    meta = coord.checkpoint_meta(SaveReason.CHECKPOINT)
    assert (meta.epoch, meta.global_step, meta.sync_round, meta.world_size_at_save) == \
        (1, 28, 7, 2)
    assert meta.elche_state is None, "fixed cadence has no ElChe state"
    cov = meta.coverage
    assert (cov.seed, cov.batch_size) == (42, 5)
    assert cov.per_epoch == [EpochCoverage(1, 100, [(40, 60)])]


def test_resumed_coordinator_dispatches_what_the_uninterrupted_one_would():
    """The basis of reproducible resume: same chunks, same ranks, same order."""
    full = Coordinator(config(epochs=2, world_size=3, sync_every=1, dataset_len=117))
    part = Coordinator(config(epochs=2, world_size=3, sync_every=1, dataset_len=117))
    drive(part, windows=9)
    resumed = Coordinator(part.config.resume_from_meta(part.checkpoint_meta(
        SaveReason.CHECKPOINT)))
    drive(full, windows=9)
    for _ in range(20):
        a, b = full.plan_window(), resumed.plan_window()
        assert a == b
        if a is None:
            break
        for coord, plan in ((full, a), (resumed, b)):
            coord.settle(plan, counts_for(plan))
    assert full.global_step == resumed.global_step and full.finished and resumed.finished


def test_resettle_credits_only_the_accepted_ranks_and_re_saves_next_window():
    coord = Coordinator(config(world_size=3, max_failures=1, checkpoint_every=3,
                               dataset_len=200))
    drive(coord, windows=2)
    plan = coord.plan_window()
    c = counts_for(plan)
    first = coord.settle(plan, c)
    assert first.realized == (0, 1, 2) and coord.global_step == 18
    assert first.save_reason is SaveReason.CHECKPOINT
    again = coord.resettle(plan, c, realized=[0, 2])
    assert again.realized == (0, 2) and again.forfeited[1] == 10
    assert coord.global_step == 16 and coord.sync_round == 3
    assert coord.pool.uncovered_ranges() == [(70, 10), (90, 110)]
    nxt = coord.plan_window()
    s = coord.settle(nxt, counts_for(nxt))
    assert s.save_reason is SaveReason.CHECKPOINT, "window 4 re-saves the corrected books"
    nxt = coord.plan_window()
    assert coord.settle(nxt, counts_for(nxt)).save_reason is None


def test_a_window_booked_again_logs_its_deaths_once(caplog):
    """A rank died between a window's count gather and its params round, which another
    rank's death had already made too many: the second booking (``resettle``) logged
    "rank(s) [2] left the cohort" and "lost, more than max_failures" a second time."""
    import logging

    coord = Coordinator(config(world_size=3, max_failures=0, dataset_len=200))
    drive(coord, windows=1)
    plan = coord.plan_window()
    c = counts_for(plan, dead=(2,))
    with caplog.at_level(logging.WARNING, logger="flodl_shm"):
        first = coord.settle(plan, c)
        again = coord.resettle(plan, c, realized=[0])
    assert first.newly_dead == again.newly_dead == (2,) and again.stop
    said = [r.getMessage() for r in caplog.records]
    assert sum("left the cohort" in m for m in said) == 1, said
    assert sum("more than max_failures" in m for m in said) == 1, said


def test_a_settlement_made_on_the_reduces_own_counts_keeps_no_undo_copy():
    """One host: the counts ride in the reduce, so there is nothing to book again; the
    books are not copied, and a resettle is refused rather than undoing the wrong thing."""
    coord = Coordinator(config(world_size=2, checkpoint_every=2, dataset_len=200))
    plan = coord.plan_window()
    settled = coord.settle(plan, counts_for(plan), undoable=False)
    assert settled.realized == (0, 1) and coord.sync_round == 1
    with pytest.raises(RuntimeError, match="undoable=True"):
        coord.resettle(plan, counts_for(plan), realized=[0])
    assert coord.sync_round == 1 and coord.global_step == sum(plan.batches)


# --- ElChe cadence ---------------------------------------------------------------------------

def test_elche_gives_the_faster_rank_proportionally_more_batches():
    coord = Coordinator(config(cadence="elche", sync_every=2, dataset_len=10_000, epochs=1),
                        guard=NoGuard())
    for _ in range(3):
        plan = coord.plan_window()
        c = counts_for(plan, ms=[1.0, 3.0])  # rank 1 is 3x slower
        s = coord.settle(plan, c)
        coord.report(c, ack_for(2), s.realized)
    plan = coord.plan_window()
    assert plan.batches == (6, 2), "anchor 2 on the slow rank, 3x that on the fast one"
    meta = coord.checkpoint_meta(SaveReason.CHECKPOINT)
    assert meta.elche_state.anchor_rank == 1
    assert meta.elche_state.smoothed_ms_per_batch == [1.0, 3.0]
    assert meta.elche_state.trend_history is None, "NoGuard keeps no history"


def test_elche_grows_the_anchor_when_the_sync_dominates():
    coord = Coordinator(config(cadence="elche", sync_every=2, dataset_len=10_000), guard=NoGuard())
    for _ in range(3):
        plan = coord.plan_window()
        c = counts_for(plan, ms=[1.0, 3.0])
        s = coord.settle(plan, c)
        coord.report(c, ack_for(2, sync_ms=3.0), s.realized)
    assert coord.el_che.anchor() > 2 and coord.plan_window().batches[0] > 6


def test_trend_guard_history_is_checkpointed_and_restored():
    coord = Coordinator(config(cadence="elche", dataset_len=10_000))
    for d in (0.01, 0.02, 0.03):
        plan = coord.plan_window()
        c = counts_for(plan, ms=[1.0, 2.0])
        s = coord.settle(plan, c)
        coord.report(c, ack_for(2, d), s.realized)
    meta = coord.checkpoint_meta(SaveReason.CHECKPOINT)
    assert meta.elche_state.trend_history == pytest.approx([0.01, 0.02, 0.03])
    back = Coordinator(coord.config.resume_from_meta(meta))
    assert back.guard.history == pytest.approx((0.01, 0.02, 0.03))
    assert back.el_che.to_state().smoothed_ms_per_batch == \
        meta.elche_state.smoothed_ms_per_batch


def test_a_window_without_an_ack_feeds_the_guard_nothing():
    """The ack travels one window late: at the first window of a run or a resume no rank
    has one, and its zeros must not read as "no drift" in the guard's history."""
    coord = Coordinator(config(cadence="elche", dataset_len=10_000))
    none_yet = CohortAck((0.0, 0.0), (0.0, 0.0), (False, False))
    for ack in (none_yet, ack_for(2, 0.02), ack_for(2, 0.03)):
        plan = coord.plan_window()
        c = counts_for(plan, ms=[1.0, 2.0])
        s = coord.settle(plan, c)
        coord.report(c, ack, s.realized)
    assert coord.guard.history == pytest.approx((0.02, 0.03))
    assert coord.el_che.to_state().calibration_count == 3, "the timings still count"


def test_elche_with_one_rank_falls_back_to_fixed_windows():
    coord = Coordinator(config(world_size=1, cadence="elche", sync_every=3))
    assert coord.el_che is None and coord.plan_window().batches == (3,)


def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="fewer than one batch"):
        config(dataset_len=3)
    with pytest.raises(ValueError, match="cadence"):
        config(cadence="fast")
    with pytest.raises(ValueError, match="sync_every"):
        config(sync_every=0)


def test_a_guard_holding_growth_is_logged_once_a_spell_not_every_window(caplog):
    """The trend guard advises every window; a rising divergence can hold for most of a
    run. ElChe says at INFO when it holds its growth and when stable windows re-arm it,
    once each; the guard's per-window verdict is DEBUG."""
    caplog.set_level("INFO", logger="flodl_shm")
    coord = Coordinator(config(cadence="elche", dataset_len=100_000, epochs=1))
    rising = [0.02 * (k + 1) for k in range(10)]
    for d in rising + [0.5] * 6:  # 10 windows trending up, then 6 stable ones
        plan = coord.plan_window()
        c = counts_for(plan, ms=[1.0, 2.0])
        s = coord.settle(plan, c)
        coord.report(c, ack_for(2, d), s.realized)
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert not [m for m in info if m.startswith("weight-space divergence")], info
    assert len([m for m in info if "ElChe anchor growth held" in m]) == 1, info
    assert len([m for m in info if "ElChe anchor growth re-armed" in m]) == 1, info
    assert coord.el_che.growth_enabled

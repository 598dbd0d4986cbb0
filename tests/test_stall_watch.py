"""The launcher's stall verdict and the meaning of a rank's exit, as pure values: no
process, no arena, no clock (the spawned cases are test_spawn_stall.py's)."""
import pytest

from flodl_shm.engine import arena as A
from flodl_shm.errors import RankFailed, RankStalled
from flodl_shm.launch.rank_exit import RankExit, failure_error, teardown_casualty
from flodl_shm.launch.stall_watch import Stall, StallWatch, stall_grace

T = 5.0  # the timeout of every watch here


def _poll(watch, arrived, done=None, entered=None, now=0.0):
    done = {r: -1 for r in arrived} if done is None else done
    entered = {r: 0.0 for r in arrived} if entered is None else entered
    return watch.look(arrived, done, entered, now)


def test_a_rank_behind_on_arrivals_is_named_a_timeout_after_the_wait_was_first_seen():
    watch = StallWatch(T)
    watch, stall = _poll(watch, {0: 3, 1: 2, 2: 3}, now=100.0)  # rank 1 not at round 3
    assert stall is None and watch.waiting == ("arrive", 3) and watch.since == 100.0
    watch, stall = _poll(watch, {0: 3, 1: 2, 2: 3}, now=104.9)
    assert stall is None
    watch, stall = _poll(watch, {0: 3, 1: 2, 2: 3}, now=105.0)
    assert stall == Stall(round=3, phase="arrive", culprits=(1,), waiters=(0, 2))


def test_the_clock_starts_again_for_another_round_and_stops_when_nobody_waits():
    watch, _ = _poll(StallWatch(T), {0: 3, 1: 2}, now=0.0)
    watch, stall = _poll(watch, {0: 4, 1: 3}, now=4.0)  # rank 1 came; now behind at round 4
    assert stall is None and watch.waiting == ("arrive", 4) and watch.since == 4.0
    watch, stall = _poll(watch, {0: 4, 1: 3}, now=8.0)
    assert stall is None  # 4 s of this wait, not 8
    watch, stall = _poll(watch, {0: 4, 1: 4}, now=8.5)
    assert stall is None and watch.waiting is None
    watch, stall = _poll(watch, {0: 5, 1: 4}, now=9.0)
    assert stall is None and watch.since == 9.0


def test_a_bulk_round_s_missing_slice_is_named_once_every_rank_arrived():
    arrived = {0: 7, 1: 7, 2: 7}
    done = {0: 7, 1: 6, 2: 7}  # ranks 0 and 2 reduced their slices of round 7
    watch, stall = _poll(StallWatch(T), arrived, done, now=0.0)
    assert stall is None and watch.waiting == ("reduce", 7)
    _, stall = _poll(watch, arrived, done, now=T)
    assert stall == Stall(7, "reduce", (1,), (0, 2))
    assert "did not reduce its slice of the round" in stall.why(4, T)
    # no slice published yet: the ranks are reducing, nobody waits on anybody
    watch, stall = _poll(StallWatch(T), arrived, {0: 6, 1: 6, 2: 6}, now=0.0)
    assert stall is None and watch.waiting is None


def test_a_rank_that_entered_its_function_after_the_wait_began_is_timed_from_then():
    entered = {0: 0.0, 1: 3.0}
    watch, _ = _poll(StallWatch(T), {0: 0, 1: -1}, entered=entered, now=1.0)
    _, stall = _poll(watch, {0: 0, 1: -1}, entered=entered, now=7.9)
    assert stall is None  # 4.9 s since it entered fn
    _, stall = _poll(watch, {0: 0, 1: -1}, entered=entered, now=8.0)
    assert stall is not None and stall.culprits == (1,)


def test_a_rank_still_starting_up_gets_half_the_grace_on_top():
    entered = {0: 0.0}  # rank 1 has not entered fn (importing torch on a busy host)
    start = T + stall_grace(T) / 2
    watch, _ = _poll(StallWatch(T), {0: 0, 1: -1}, entered=entered, now=0.0)
    _, stall = _poll(watch, {0: 0, 1: -1}, entered=entered, now=start - 0.01)
    assert stall is None
    _, stall = _poll(watch, {0: 0, 1: -1}, entered=entered, now=start)
    assert stall == Stall(0, "arrive", (1,), (0,))


def test_fewer_than_two_live_ranks_wait_on_nobody():
    watch, _ = _poll(StallWatch(T), {0: 3, 1: 2}, now=0.0)
    watch, stall = _poll(watch, {0: 3}, now=60.0)
    assert stall is None and watch.waiting is None


def test_a_stall_says_the_round_the_ranks_and_the_fix_in_global_ranks():
    why = Stall(12, "arrive", (1,), (0, 2)).why(first_rank=4, timeout=2.5)
    assert why == ("round 12 stalled: rank(s) [5] did not arrive at the round within the "
                   "2.5 s collective timeout while rank(s) [4, 6] waited for them; the "
                   "launcher killed the missing rank(s) (alive but silent: stuck outside the "
                   "collective, or wedged; if they were only slow, e.g. a long first batch, "
                   "pass a larger timeout)")


@pytest.mark.parametrize("msg, exitcode, kind, failed", [
    (("ok", 7), 0, "ok", False),
    (("ok", 7), 1, "died", True),  # its result sent, then it failed on the way out
    (("error", "ValueError", "tb"), 1, "error", True),
    (("error", "CohortAborted", "tb"), 1, "error", False),  # the stop's own error
    (None, -9, "died", True),
])
def test_a_rank_s_exit_is_ok_an_error_or_a_death(msg, exitcode, kind, failed):
    out = RankExit.of(msg, exitcode)
    assert (out.kind, out.failed) == (kind, failed)
    if kind == "died":
        assert out.signal == ("SIGKILL" if exitcode == -9 else None)


def test_once_the_cohort_stops_its_own_signals_and_errors_are_casualties_not_causes():
    killed = RankExit.of(None, -9)
    raised = RankExit.of(("error", "ValueError", "tb"), 1)
    assert not teardown_casualty(killed, 0, False)  # a SIGKILL out of the blue: a death
    assert teardown_casualty(killed, A.ABORT_FAILED, False)
    assert not teardown_casualty(raised, A.ABORT_FAILED, False)  # its own error: a cause
    assert teardown_casualty(raised, A.ABORT_INTERRUPT, True)  # anything after a Ctrl-C
    assert not teardown_casualty(raised, A.ABORT_INTERRUPT, False)
    assert teardown_casualty(RankExit.of(None, 143), A.ABORT_SHUTDOWN, False)  # its SIGTERM
    assert teardown_casualty(RankExit.of(("error", "_Terminated", "tb"), 1), A.ABORT_FAILED,
                             False)


def test_a_rank_that_gave_up_waiting_is_a_rank_stalled_with_spawn_s_deadline_explained():
    stall = {"round": 3, "missing": [1], "timeout": 12.0, "text": "round 3 stalled"}
    msg = ("error", "ReduceStall", "tb", stall)
    err = failure_error(0, RankExit.of(msg, 1), msg, timeout=2.0)
    assert isinstance(err, RankStalled) and (err.round, err.missing) == (3, (1,))
    assert str(err).startswith("rank 0 gave up waiting: round 3 stalled (spawn's timeout=2 s; "
                               "a rank's own deadline trails it by 10 s")
    # exit code 1 before fn: the traceback's whereabouts and the usual cause
    err = failure_error(2, RankExit.of(None, 1), None, started=False)
    assert type(err) is RankFailed and "put it under `if __name__ == \"__main__\":`" in str(err)

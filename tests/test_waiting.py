"""The bounded wait (engine/waiting.py) on a real doorbell word."""
from __future__ import annotations

import re

import numpy as np
import pytest

from flodl_shm.engine.waiting import Doorbell, Waiter
from flodl_shm.errors import PeerDied
from flodl_shm.kernels.codes import OK

pytestmark = pytest.mark.timeout(30)


def test_a_wait_that_completed_during_a_sleep_returns_even_if_a_peer_then_died():
    """The awaited rank arrived and then died while this one slept: the wait is
    complete, so it returns; liveness speaks only for a wait still missing someone
    (the survivor of a c10d group raised PeerDied for a finished round)."""
    ctl = np.zeros(64, np.int64)
    calls = {"check": 0}

    def check(iters):
        calls["check"] += 1
        return OK if calls["check"] > 2 else 0  # missing until after the sleep

    def liveness():
        raise PeerDied("rank 0 died")

    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=5.0, liveness=liveness)
    assert waiter.wait(check, what="waiting for ranks to arrive", rnd=1,
                       missing_of=lambda: (0,)) == OK
    assert waiter.sleeps == 1


def test_a_wait_still_missing_a_dead_peer_raises_through_liveness():
    ctl = np.zeros(64, np.int64)

    def liveness():
        raise PeerDied("rank 0 died", 0, 1234, host_ranks=(0, 1))

    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=5.0, liveness=liveness)
    with pytest.raises(PeerDied) as info:
        waiter.wait(lambda iters: 0, what="waiting for ranks to arrive", rnd=1,
                    missing_of=lambda: (0,))
    assert str(info.value) == "rank 0 died" and info.value.missing == ()


def test_a_peer_death_names_the_ranks_that_had_not_arrived_either():
    """Rank 0 (local 0) timed out waiting for rank 5 (local 2) and exited; the wait of
    rank 3 (local 1), whose deadline was a moment later, sees the death. Its error names
    rank 5 too: the cause, not only the rank that gave up on it."""
    ctl = np.zeros(64, np.int64)

    def liveness():
        raise PeerDied("rank 0 (pid 1234) died", 0, 1234, host_ranks=(0, 3, 5))

    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=5.0, liveness=liveness)
    with pytest.raises(PeerDied) as info:
        waiter.wait(lambda iters: 2, what="waiting for ranks to arrive", rnd=1,
                    missing_of=lambda: (2,))
    e = info.value
    assert (e.rank, e.pid, e.missing) == (0, 1234, (5,))
    assert str(e).startswith("rank 0 (pid 1234) died. Group rank(s) [5] of this host had "
                             "not arrived at this collective either"), str(e)


_PEER = r"""
import mmap, os, sys
import re

import numpy as np
from flodl_shm.kernels import rounds as RK
from flodl_shm.kernels import signals
core, path, words = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.sched_setaffinity(0, {core})
with open(path, "r+b") as f:
    mem = mmap.mmap(f.fileno(), 0)
ctl = np.frombuffer(mem, np.int64, words)
flag = np.frombuffer(mem, np.int64, 2, offset=8 * words)  # [ready, go]
RK.publish_round(ctl, ctl.view(np.float64), ctl.view(np.int32), 1, 0, 0, 0, 0, 1.0, 0, 0, 0,
                 7, 0)
signals.load(flag, 1)  # both calls compiled or loaded before saying ready
flag[0] = 1
while signals.load(flag, 1) == 0:
    pass  # runnable all along: it holds the shared core whenever it has it
RK.publish_round(ctl, ctl.view(np.float64), ctl.view(np.int32), 1, 1, 0, 0, 0, 1.0, 0, 0, 0,
                 7, 0)
"""


def test_a_fused_wait_hands_the_core_to_a_runnable_peer(tmp_path):
    """Ranks outnumber cores: the peer that has not arrived is runnable on this very
    core, and the compiled wait (``arrive`` with yields, as the fused calls run it)
    gives it the core with ``sched_yield`` and catches the round, without leaving the
    call. Both processes are pinned to one core, so only a yield lets the peer run
    within the wait."""
    import mmap
    import os
    import subprocess
    import sys
    import time

    from flodl_shm.engine.waiting import YIELDS_PER_CALL
    from flodl_shm.kernels import rounds as RK

    world = 2
    words = RK.GLOBAL_WORDS + world * RK.RANK_WORDS
    path = tmp_path / "ctl"
    path.write_bytes(bytes(8 * (words + 2)))
    core = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    with open(path, "r+b") as f:
        mem = mmap.mmap(f.fileno(), 0)
    ctl = np.frombuffer(mem, np.int64, words)
    flag = np.frombuffer(mem, np.int64, 2, offset=8 * words)
    f64, c32 = ctl.view(np.float64), ctl.view(np.int32)
    info = np.zeros(RK.I_WORDS, np.int64)
    mass = np.zeros(1, np.float64)
    RK.publish_round(ctl, f64, c32, 0, 0, 0, 0, 0, 1.0, 0, 0, 0, 7, 0)
    # loaded now: a first call loads the compiled code (milliseconds) and the peer
    # would run meanwhile
    assert RK.arrive(ctl, f64, world, 1, 0, 0, 0, info, mass) == 0
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(core), str(path), str(words)])
    try:
        deadline = time.monotonic() + 60
        while flag[0] == 0:
            assert peer.poll() is None, "the peer process failed to start"
            assert time.monotonic() < deadline, "the peer never got ready"
            time.sleep(0.01)
        os.sched_setaffinity(0, {core})
        RK.publish_round(ctl, f64, c32, 0, 1, 0, 0, 0, 1.0, 0, 0, 0, 7, 0)
        flag[1] = 1
        code = RK.arrive(ctl, f64, world, 1, 0, 0, YIELDS_PER_CALL, info, mass)
    finally:
        os.sched_setaffinity(0, saved)
        flag[1] = 1
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:  # never outlives the test
            peer.kill()
            peer.wait()
    assert code == OK, f"the wait returned {code} (1: the peer still missing after the yields)"
    assert mass[0] == 2.0


def _late_check(after_s):
    """A wait's check that reports rank 1 missing until ``after_s`` seconds have passed."""
    import time

    end = time.monotonic() + after_s

    def check(iters):
        return OK if time.monotonic() >= end else 1
    return check


def test_a_long_wait_says_what_it_waits_for_and_again_each_time_it_doubles(caplog):
    """Without a timeout a wait on a peer stuck outside the collectives would go on
    without a word: after ``notice_s`` it names the round, what it waits for, the
    missing rank (globally: this host's local rank 0 is global rank 4) and that nothing
    ends it, then again at twice that time; a wait shorter than ``notice_s`` says
    nothing."""
    ctl = np.zeros(64, np.int64)
    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=None, liveness=lambda: None)
    waiter.who, waiter.first_rank, waiter.notice_s = "rank 4", 4, 0.15
    with caplog.at_level("WARNING", logger="flodl_shm"):
        assert waiter.wait(_late_check(0.05), what="waiting for ranks to arrive", rnd=9,
                           missing_of=lambda: (1,)) == OK
        assert caplog.records == []
        assert waiter.wait(_late_check(0.5), what="waiting for ranks to arrive", rnd=10,
                           missing_of=lambda: (1,)) == OK
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # at 0.15 and 0.3 s, not at 0.6
    for line, (low, high) in zip(said, ((0.15, 0.3), (0.3, 0.6))):
        waited = re.match(r"rank 4 has waited ([\d.]+) s for", line)
        assert waited and low <= float(waited[1]) < high, line
        assert ("for ranks [5] in round 10 (waiting for ranks to arrive): alive, not there "
                "yet. No collective timeout is set") in line, line
        assert "spawn(timeout=...) bounds every wait" in line, line


def test_a_long_wait_with_a_timeout_says_when_it_gives_up(caplog):
    ctl = np.zeros(64, np.int64)
    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=5.0, liveness=lambda: None)
    waiter.who, waiter.notice_s = "rank 0", 0.1
    with caplog.at_level("WARNING", logger="flodl_shm"):
        waiter.wait(_late_check(0.15), what="waiting for reduce slices", rnd=3,
                    missing_of=lambda: (1,))
    line, = [r.getMessage() for r in caplog.records]
    assert "for ranks [1] in round 3 (waiting for reduce slices)" in line, line
    assert re.search(r"The round fails at the 5 s collective timeout, 4\.\d+ s from now$",
                     line), line


def test_a_long_wait_on_other_hosts_names_their_ranks_as_they_are(caplog):
    """A wait for the cluster's consensus names global ranks already, of hosts this one
    cannot see: they are not shifted by this host's first rank, nor said to be alive."""
    ctl = np.zeros(64, np.int64)
    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=None, liveness=lambda: None)
    waiter.who, waiter.first_rank, waiter.notice_s = "rank 2", 2, 0.1
    with caplog.at_level("WARNING", logger="flodl_shm"):
        waiter.wait(_late_check(0.15), what="waiting for the cluster consensus", rnd=4,
                    missing_of=lambda: (0, 1), global_missing=True)
    line, = [r.getMessage() for r in caplog.records]
    assert line.startswith("rank 2 has waited "), line
    assert ("for ranks [0, 1] in round 4 (waiting for the cluster consensus): on other "
            "hosts. No collective timeout is set") in line, line


def test_a_wait_of_a_known_cause_leads_with_it_and_no_notice_when_turned_off(caplog):
    """A refusal round's wait (``context``) says why it waits, after its own delay; a
    Waiter with ``notice_s`` 0 (the relay's, or ``FLODL_SHM_WAIT_NOTICE_S=0``) never
    warns. A missing peer that has a name, not a rank, is named."""
    ctl = np.zeros(64, np.int64)
    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=None, liveness=lambda: None)
    waiter.context = ("rank 2 refused its call (ValueError: bad root)", 0.1)
    with caplog.at_level("WARNING", logger="flodl_shm"):
        waiter.wait(_late_check(0.15), what="waiting for ranks to arrive", rnd=6,
                    missing_of=lambda: (0, 1))
        waiter.context, waiter.notice_s = None, 0.0
        waiter.wait(_late_check(0.15), what="waiting for ranks to arrive", rnd=7,
                    missing_of=lambda: (0,))
        waiter.notice_s = 0.1
        waiter.wait(_late_check(0.15), what="waiting for the owner", rnd=8,
                    missing_of=lambda: ("checkpoint owner",))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("rank 2 refused its call (ValueError: bad root): ranks [0, 1] "
                              "have made no collective for 0."), said[0]
    assert "(round 6)" in said[0] and "No collective timeout is set" in said[0], said[0]
    assert "for the checkpoint owner in round 8" in said[1], said[1]


@pytest.mark.parametrize("value, expected", [("", 60.0), ("0", 0.0), ("2.5", 2.5)])
def test_the_wait_notice_delay_comes_from_the_environment(monkeypatch, value, expected):
    from flodl_shm.engine.waiting import WAIT_NOTICE_S, wait_notice_s

    assert WAIT_NOTICE_S == 60.0
    monkeypatch.setenv("FLODL_SHM_WAIT_NOTICE_S", value)
    assert wait_notice_s() == expected


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_wait_notice_delay_is_refused_with_its_fix(monkeypatch, value):
    from flodl_shm.engine.waiting import wait_notice_s

    monkeypatch.setenv("FLODL_SHM_WAIT_NOTICE_S", value)
    with pytest.raises(ValueError) as info:
        wait_notice_s()
    assert str(info.value).startswith(f"FLODL_SHM_WAIT_NOTICE_S={value!r} is not a number of "
                                      f"seconds >= 0: set it to how long"), str(info.value)
    assert "(0 for never), or unset it for 60 s" in str(info.value)


@pytest.mark.parametrize("s, said", [(0.5031, "0.503"), (1.2, "1.2"), (60.01, "60"),
                                     (1798.7, "1799"), (3840.2, "3840")])
def test_a_notice_says_seconds_as_a_person_reads_them(s, said):
    """(A torchrun probe read "1.8e+03 s from now" of a 1800 s timeout.)"""
    from flodl_shm.engine.waiting import _seconds

    assert _seconds(s) == said

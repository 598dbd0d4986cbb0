"""The bounded wait (engine/waiting.py) on a real doorbell word."""
from __future__ import annotations

import numpy as np
import pytest

from flodl_shm.engine.waiting import Doorbell, Waiter
from flodl_shm.kernels.codes import OK

pytestmark = pytest.mark.timeout(30)


class PeerDied(RuntimeError):
    pass


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
        raise PeerDied("rank 0 died")

    waiter = Waiter(Doorbell(ctl), spin_iters=0, timeout=5.0, liveness=liveness)
    with pytest.raises(PeerDied, match="rank 0 died"):
        waiter.wait(lambda iters: 0, what="waiting for ranks to arrive", rnd=1,
                    missing_of=lambda: (0,))

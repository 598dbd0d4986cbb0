"""The handshake that gives each incarnation of a "flodl_shm" group a fresh key namespace
(flodl_shm/distributed/incarnation.py), on a store that holds an earlier incarnation's keys:
every rank lands in the same new namespace whichever order they start in, never in the old
one; a rank that never comes, and a second rank 0 on the same store, are named."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from flodl_shm.distributed.incarnation import incarnation_store

pytestmark = pytest.mark.timeout(60)


def _run_ranks(store, world: int, order: list[int], wait: float = 20,
               gap: float = 0.05) -> list[object]:
    """A thread per entry of ``order`` (a rank), started ``gap`` seconds apart; returns
    what each got, in that order: its store for the new incarnation, or the exception it
    raised."""
    got: list[object] = [None] * len(order)

    def rank_main(i: int, r: int) -> None:
        try:
            got[i] = incarnation_store(store, r, world, timedelta(seconds=wait),
                                       f"rank {r} of {world}")
        except Exception as e:  # noqa: BLE001 - the test reads it
            got[i] = e

    threads = []
    for i, r in enumerate(order):
        threads.append(threading.Thread(target=rank_main, args=(i, r)))
        threads[-1].start()
        time.sleep(gap)
    for t in threads:
        t.join()
    return got


def _earlier_incarnation(store, world: int) -> list[object]:
    """A full earlier incarnation that left a key in its namespace, then a failed one
    whose rank 1 asked for an offer and died."""
    old = _run_ranks(store, world, list(range(world)), gap=0)
    for r, keys in enumerate(old):
        keys.set(f"left/{r}", b"old")
    offer = dist.PrefixStore("incarnation/", store).get("offer").decode()
    dist.PrefixStore("incarnation/", store).set("ask/1", f"{offer}:a-dead-ranks-nonce")
    return old


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 0, 2]])
def test_every_rank_lands_in_one_fresh_namespace_whatever_the_start_order(order):
    store = dist.HashStore()
    old = _earlier_incarnation(store, 3)
    new = dict(zip(order, _run_ranks(store, 3, order)))
    assert all(not isinstance(k, Exception) for k in new.values()), new
    for r, keys in new.items():
        assert not any(keys.check([f"left/{q}"]) for q in range(3))  # not the old keys
        keys.set(f"here/{r}", str(r))
    for keys in new.values():  # one namespace: each rank reads every rank's key
        assert [keys.get(f"here/{q}").decode() for q in range(3)] == ["0", "1", "2"]
    assert not old[0].check(["here/0"])


def test_a_group_of_one_needs_nobody():
    store = dist.HashStore()
    first = incarnation_store(store, 0, 1, timedelta(seconds=1), "rank 0 of 1")
    first.set("x", b"1")
    again = incarnation_store(store, 0, 1, timedelta(seconds=1), "rank 0 of 1")
    assert not again.check(["x"])


def test_rank_0_names_the_ranks_that_never_came():
    got = _run_ranks(dist.HashStore(), 3, [0, 1], wait=1)
    assert not isinstance(got[1], Exception)  # admitted; it waits for rank 2 further on
    with pytest.raises(RuntimeError, match=r"rank 0 of 3: rank\(s\) \[2\] of 3 did not join "
                                           r"within 1 s .* same world size and store"):
        raise got[0]


def test_a_rank_that_rank_0_never_admits_says_so():
    store = dist.HashStore()
    _earlier_incarnation(store, 2)   # its offer is there; no rank 0 will answer
    [got] = _run_ranks(store, 2, [1], wait=1)
    with pytest.raises(RuntimeError, match=r"rank 1 of 2: rank 0 did not admit this rank "
                                           r"within 1 s .* give each job its own port"):
        raise got


def test_a_second_rank_0_on_the_store_is_named():
    """Two live jobs given one store: the rank 0 whose offer the other replaced says so
    (the other waits for its ranks until its timeout)."""
    store = dist.HashStore()
    first, second = _run_ranks(store, 2, [0, 0], wait=2, gap=0.2)
    with pytest.raises(RuntimeError, match=r"rank 0 of 2: another rank 0 set its own offer "
                                           r"in this group's store .* give each job its own "
                                           r"port"):
        raise first
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of 2 did not join"):
        raise second

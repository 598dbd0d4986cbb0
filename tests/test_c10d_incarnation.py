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
                                       f"rank {r} of {world}").keys
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
    marks = dist.PrefixStore("incarnation/", store)
    token = marks.get("offer").decode().split(":")[0]
    marks.set(f"ask/{token}/1", f"{token}:a-dead-ranks-nonce:{world}:1@gone")
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


def test_the_last_rank_done_deletes_the_groups_keys():
    """A store outlives its groups (torchrun's lives as long as the job): every key a
    formed incarnation set goes with its last rank's ``retire``, not before."""
    store = dist.HashStore()
    incs: list[object] = [None] * 3

    def rank_main(r: int) -> None:
        incs[r] = incarnation_store(store, r, 3, timedelta(seconds=20), f"rank {r} of 3")
        incs[r].keys.set(f"seen/{r}", b"1")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.num_keys() == 1 + 2 + 3  # the offer, two asks, the group's keys
    for r in (2, 0):
        incs[r].retire(3, [f"seen/{q}" for q in range(3)])
        assert incs[1].keys.get("seen/0") == b"1"  # a rank not done may still read
    incs[1].retire(3, [f"seen/{q}" for q in range(3)])
    marks = dist.PrefixStore("incarnation/", store)
    assert store.num_keys() == 1  # the offer, retired
    assert marks.get("offer").decode() == f"formed:{incs[0].token}"


def test_a_late_rank_retires_its_own_offer_only():
    """A probe re-created a group under one prefix with no collective in between: the
    last rank of the first incarnation, slow to retire, deleted the offer (and asks) of
    the next one, whose rank 0 had already moved on: 'another rank 0 set its own offer'."""
    store = dist.HashStore()
    first = _run_ranks(store, 2, [0, 1], gap=0)
    assert all(not isinstance(k, Exception) for k in first), first
    marks = dist.PrefixStore("incarnation/", store)
    old_token = marks.get("offer").decode().split(":")[0]
    marks.set("offer", "a-newer-token:2")  # the next incarnation's rank 0, already offering
    from flodl_shm.distributed.incarnation import Incarnation

    late = Incarnation(store, old_token, {}, "rank 1 of 2")
    late.keys.add("formed", 1)  # the other rank retired first
    late.retire(2, [])
    assert marks.get("offer").decode() == "a-newer-token:2"


def test_a_group_of_one_needs_nobody():
    store = dist.HashStore()
    first = incarnation_store(store, 0, 1, timedelta(seconds=1), "rank 0 of 1").keys
    first.set("x", b"1")
    again = incarnation_store(store, 0, 1, timedelta(seconds=1), "rank 0 of 1").keys
    assert not again.check(["x"])


def test_rank_0_names_the_ranks_that_never_came():
    got = _run_ranks(dist.HashStore(), 3, [0, 1], wait=1)
    assert not isinstance(got[1], Exception)  # admitted; it waits for rank 2 further on
    with pytest.raises(RuntimeError, match=r"rank 0 of 3: rank\(s\) \[2\] of 3 did not join "
                                           r"within 1 s .* same world_size and store"):
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


def test_ranks_given_different_world_sizes_are_told_so_on_both_sides():
    """Rank 0 of a world of 2 and a rank that thinks the world is 3: each waited on
    another key until its store's timeout, and neither said why."""
    store = dist.HashStore()
    got = [None, None]

    def rank(i: int, r: int, world: int) -> None:
        try:
            incarnation_store(store, r, world, timedelta(seconds=20), f"rank {r} of {world}")
        except RuntimeError as e:
            got[i] = e

    threads = [threading.Thread(target=rank, args=args) for args in ((0, 0, 2), (1, 1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    says = "rank 1 was started with world_size 3 and rank 0 with 2: every rank must call"
    assert str(got[0]).startswith("rank 0 of 2: " + says), got[0]
    assert str(got[1]).startswith("rank 1 of 3: rank 0 refused this rank: " + says), got[1]


def test_a_rank_that_fails_while_the_group_forms_tells_the_others_at_once():
    """Rank 0 missing rank 2 abandons the incarnation: rank 1, admitted, raised only at its
    store's timeout (30 s in a probe, not the group's 5), naming a key of rank 0's."""
    from flodl_shm.distributed.rendezvous import rendezvous

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    got: list = [None, None]
    took = [0.0, 0.0]

    def rank(r: int) -> None:
        t0 = time.monotonic()
        try:
            rendezvous(store, r, 3, timedelta(seconds=2))
        except RuntimeError as e:
            got[r] = e
        took[r] = time.monotonic() - t0

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "rank(s) [2] of 3 did not join within 2 s" in str(got[0]), got[0]
    assert str(got[1]).startswith("flodl_shm process group (rank 1 of 3): the group will not "
                                  "form: rank 0: rank(s) [2] of 3 did not join"), got[1]
    assert max(took) < 10


@pytest.mark.parametrize("then", ["replaced", "formed", "its own earlier group"])
def test_a_rank_whose_place_another_process_took_is_told_at_once(then, monkeypatch):
    """A probe started three processes as RANK 0, 1, 1: rank 0 admitted the later rank 1
    and the group formed; the other rank 1, whose ask had been replaced, waited for an
    admission until the store went away (the group's timeout: 30 minutes by default).
    Here the other rank 1's ask replaces this one's, or the group forms without it (its
    last rank retires the offer). An offer retired by a group this process joined (its
    previous incarnation, read before the next rank 0 offered) is no one's place: the
    rank waits for the next offer."""
    from flodl_shm.distributed import incarnation

    store = dist.HashStore()
    marks = dist.PrefixStore("incarnation/", store)
    marks.set("offer", "a-token:2")  # a rank 0 that has not admitted anyone yet
    got: list[object] = [None]

    def rank_1() -> None:
        try:
            got[0] = incarnation_store(store, 1, 2, timedelta(seconds=20), "rank 1 of 2")
        except RuntimeError as e:
            got[0] = e

    t = threading.Thread(target=rank_1)
    t.start()
    deadline = time.monotonic() + 10
    while not marks.check(["ask/a-token/1"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    token, nonce, world, _ = marks.get("ask/a-token/1").decode().split(":", 3)
    t0 = time.monotonic()
    if then == "replaced":
        marks.set("ask/a-token/1", f"{token}:another-nonce:{world}:4242@elsewhere")
        said = "another process (4242@elsewhere) asked to be rank 1 of this group too"
    elif then == "formed":
        marks.set("offer", "formed:a-token")
        said = "the group formed without this rank: rank 0 admitted another process as rank 1"
    else:
        # this process joined it (in another thread); a token of this test's own
        monkeypatch.setitem(incarnation._JOINED, "a-token", None)
        marks.set("offer", "formed:a-token")
        time.sleep(0.3)
        assert t.is_alive()  # waiting for the next offer
        marks.set("offer", "b-token:2")
        while not marks.check(["ask/b-token/1"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        asked = marks.get("ask/b-token/1").decode()
        marks.set(f"admit/{asked.split(':')[1]}", "b-token")
        t.join(30)
        assert got[0].token == "b-token", got[0]
        return
    t.join(30)
    assert time.monotonic() - t0 < 2.0
    assert str(got[0]).startswith(f"rank 1 of 2: {said}"), got[0]
    assert "start each process with its own RANK" in str(got[0])


def test_a_rank_that_arrives_after_a_group_formed_without_it_says_so_when_it_gives_up():
    """A second process started as rank 1 after the group had formed: the retired offer
    cannot tell it from a rank of torchrun's next attempt, early for its rank 0's offer,
    so it waits; its error then says what it saw (it blamed rank 0 alone)."""
    store = dist.HashStore()
    dist.PrefixStore("incarnation/", store).set("offer", "formed:a-token-nobody-joined")
    with pytest.raises(RuntimeError, match=r"rank 0 did not admit this rank within 1 s .*\. A "
                                           r"group formed on this store before this rank asked "
                                           r"to join one, without this process: if two "
                                           r"processes were started as rank 1, start each "
                                           r"process with its own RANK"):
        incarnation_store(store, 1, 2, timedelta(seconds=1), "rank 1 of 2")


def test_a_second_process_asking_for_an_admitted_rank_is_reported_at_confirmation():
    """Two jobs given one store: another job's rank 1 was admitted, then this job's rank
    1 asked for the same place. Both groups averaged silently with each other's ranks."""
    from flodl_shm.distributed.incarnation import _fields

    store = dist.HashStore()
    incs = [None, None]

    def rank(r: int) -> None:
        incs[r] = incarnation_store(store, r, 2, timedelta(seconds=20), f"rank {r} of 2")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for inc in incs:
        inc.confirm()  # nobody else asked: fine
    marks = dist.PrefixStore("incarnation/", store)
    key = f"ask/{incs[0].token}/1"
    mine = marks.get(key).decode()
    token, nonce, world, _ = mine.split(":", 3)
    marks.set(key, f"{token}:new-nonce:{world}:{_fields(mine)[3]}")  # the same process again
    incs[0].confirm()                                                 # is not a second one
    marks.set(key, f"{token}:another-nonce:{world}:4242@elsewhere")
    for inc in incs:
        with pytest.raises(RuntimeError, match=r"two processes asked to be rank 1 of this "
                                               r"group .* give each job its own port"):
            inc.confirm()
    with pytest.raises(RuntimeError, match="the group will not form: two processes asked"):
        incs[1].raise_if_abandoned()


def test_a_store_that_closes_while_the_group_forms_is_named_with_the_way_out():
    """A probe re-created a 2-process group on one tcp:// port in a loop: a rank that
    destroyed its group first reached the previous group's store as rank 0 closed it, and
    the handshake failed with torch's raw 'Failed to recv, got 0 bytes'."""
    import datetime
    import gc
    import socket

    import torch.distributed as dist

    from flodl_shm.distributed.incarnation import incarnation_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=5))
    client.set("previous group", "1")
    del server  # rank 0 destroyed the previous group: its store's server is gone
    gc.collect()
    with pytest.raises(RuntimeError, match=r"^rank 1: the group's store closed its connection "
                                           r"while the group formed .* keep one "
                                           r"dist.TCPStore per process and pass store="):
        incarnation_store(client, 1, 2, datetime.timedelta(seconds=3), "rank 1")


@pytest.mark.parametrize("rank, world", [(1, 1), (2, 2), (-1, 2)])
def test_a_rank_outside_the_group_is_refused_at_once(rank, world):
    """A probe: init_process_group("flodl_shm", rank=1, world_size=1) waited out the
    group's timeout (30 minutes by default) to be admitted by rank 0, then blamed rank 0;
    gloo refuses at once. The rank is checked before anything waits."""
    from flodl_shm.distributed.rendezvous import rendezvous

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"rank {rank} is not a rank of a group of {world}: "
                                         rf"ranks run from 0 to world_size - 1"):
        rendezvous(dist.HashStore(), rank, world, timedelta(seconds=30))
    assert time.monotonic() - t0 < 5


_RANK0_HOSTING_THE_STORE = """
import os, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from flodl_shm.distributed.rendezvous import rendezvous
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, True, timedelta(seconds=20),
                      wait_for_workers=False)
threading.Thread(target=rendezvous, args=(store, 0, 3, timedelta(seconds=30)),
                 daemon=True).start()  # admits rank 1; rank 2 never comes
print("listening", flush=True)
time.sleep(1.5)
os._exit(1)  # rank 0 ends (an error of its own): its store goes with it
"""


def test_a_rank_whose_store_went_with_rank_0_is_told_where_to_look():
    """A probe: rank 0 hosted the group's TCPStore (tcp://, or env:// outside torchrun)
    and ended on its own init error (a rank that did not come) before rank 1 read its
    verdict; rank 1, admitted and waiting for the others' keys, got a raw
    'DistNetworkError: Failed to recv' with a C++ stack (or advice about re-creating
    groups on one port). It is told the store's process ended and to read rank 0's
    error."""
    import socket
    import subprocess
    import sys

    from flodl_shm.distributed.rendezvous import rendezvous

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0_HOSTING_THE_STORE, str(port)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout.readline().strip() == "listening"
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=20))
        with pytest.raises(RuntimeError, match=r"rank 1 of 3\): the group's store closed its "
                                               r"connection while the group formed .*The "
                                               r"process that hosts it .* ended: most likely "
                                               r"it failed in init_process_group itself"):
            rendezvous(store, 1, 3, timedelta(seconds=20))
    finally:
        rank0.kill()
        rank0.wait()

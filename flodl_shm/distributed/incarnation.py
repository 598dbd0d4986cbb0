"""A fresh key namespace for each incarnation of a process group, agreed through a store
that may still hold an earlier incarnation's keys.

Why it is needed
----------------
A group's c10d store outlives the group in two ways:

* torchrun hands every attempt of a job the same store (its agent's ``TCPStore`` lives
  as long as the job), so after ``--max-restarts`` restarted the ranks the keys of the
  failed attempt are still there;
* a group destroyed and created again in the same processes (``destroy_process_group``
  then ``init_process_group``) gets the old group's key prefix from torch.

What the old keys name is gone (an arena handle whose segment names were removed,
``mapped/`` flags, the host leaders' gloo addresses) and must never be read. The ranks
cannot name their incarnation from what they are given: ``TORCHELASTIC_RESTART_COUNT``
counts restarts per node, and on several nodes it differs between them (the agent of a
node whose ranks did not fail restarts them without counting a restart). Nor can they
count arrivals in the store: a failed attempt may have died half-way through them.

So rank 0 draws a token nobody has used, and every other rank proves it read that token
by naming, next to it, a nonce of its own that nobody has used either. A key an earlier
incarnation left can name neither.

The handshake
-------------
Every key lives under ``incarnation/`` in the group's store.

Offer
    Rank 0 draws a fresh token (``uuid4``) and sets ``offer`` to it.
Ask
    Every other rank draws a fresh nonce and sets ``ask/<rank>`` to ``<offer>:<nonce>``
    for the offer it read. That offer may be an earlier incarnation's (read before this
    rank 0 set its own): the rank asks again whenever ``offer`` changes.
Admit
    Rank 0 admits rank r once ``ask/<r>`` names its token: it sets ``admit/<nonce>`` to
    the token. An ask left by an earlier incarnation cannot name a token drawn now.
Join
    Rank r joins once ``admit/<its nonce>`` exists. An admission left by an earlier
    incarnation cannot name a nonce drawn now.

Every rank then keys the group under ``<token>/``. The waits poll the store (a few
milliseconds apart at first) until the group's timeout; a rank that is not there by then
is named in the error.

Two live jobs on one store (two jobs on one host given one ``MASTER_ADDR:MASTER_PORT``)
would admit each other's ranks. Rank 0 watches ``offer`` while it admits: another rank 0
setting its own is reported as such.
"""
from __future__ import annotations

import time
import uuid
from datetime import timedelta

_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.02

SHARED_STORE_FIX = ("two jobs on this host with one MASTER_ADDR:MASTER_PORT share a store; "
                    "give each job its own port (MASTER_PORT, torchrun --master-port / "
                    "--rdzv-endpoint)")


def incarnation_store(store, rank: int, world: int, timeout: timedelta, what: str):
    """``store`` under this incarnation's fresh token, agreed by the handshake in the module
    docstring; every rank of the group calls it at once.

    Args:
        store: the group's c10d store.
        rank: this rank in the group; world: the group's size.
        timeout: how long to wait for the other ranks (the group's timeout).
        what: names this rank in errors, e.g. ``"flodl_shm process group (rank 1 of 2)"``.
    Raises:
        RuntimeError: a rank did not arrive within ``timeout``, or another job's rank 0
            uses the same store.
    """
    import torch.distributed as dist

    keys = dist.PrefixStore("incarnation/", store)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        token = _admit(keys, world, deadline, timeout, what)
    else:
        token = _join(keys, rank, deadline, timeout, what)
    return dist.PrefixStore(f"{token}/", store)


def _admit(keys, world: int, deadline: float, timeout: timedelta, what: str) -> str:
    """Offer and Admit (rank 0): returns the token once every other rank was admitted."""
    token = uuid.uuid4().hex
    keys.set("offer", token)
    waiting = set(range(1, world))
    for pause in _pauses(deadline):
        for r in sorted(waiting):
            if not keys.check([f"ask/{r}"]):
                continue
            offer, _, nonce = keys.get(f"ask/{r}").decode().partition(":")
            if offer == token:
                keys.set(f"admit/{nonce}", token)
                waiting.discard(r)
        if not waiting:
            return token
        if keys.get("offer").decode() != token:
            raise RuntimeError(
                f"{what}: another rank 0 set its own offer in this group's store while this "
                f"one was admitting ranks: {SHARED_STORE_FIX}")
        if pause is None:
            break
        time.sleep(pause)
    raise RuntimeError(
        f"{what}: rank(s) {sorted(waiting)} of {world} did not join within "
        f"{timeout.total_seconds():g} s (they did not start, crashed before "
        f"init_process_group, or were given another store); every rank of the group must "
        f"call init_process_group with the same world size and store")


def _join(keys, rank: int, deadline: float, timeout: timedelta, what: str) -> str:
    """Ask and Join (a rank other than 0): returns the token rank 0 admitted it with."""
    nonce = uuid.uuid4().hex
    asked = None
    for pause in _pauses(deadline):
        if keys.check([f"admit/{nonce}"]):
            return keys.get(f"admit/{nonce}").decode()
        if keys.check(["offer"]):
            offer = keys.get("offer").decode()
            if offer != asked:
                keys.set(f"ask/{rank}", f"{offer}:{nonce}")
                asked = offer
        if pause is None:
            break
        time.sleep(pause)
    raise RuntimeError(
        f"{what}: rank 0 did not admit this rank within {timeout.total_seconds():g} s "
        f"(it did not start, crashed before init_process_group, or was given another "
        f"store; or {SHARED_STORE_FIX})")


def _pauses(deadline: float):
    """The pause before each next poll, growing to ``_POLL_MAX_S``; ``None`` once the
    deadline has passed (the caller makes one last poll, then gives up)."""
    pause = _POLL_FIRST_S
    while time.monotonic() < deadline:
        yield pause
        pause = min(2 * pause, _POLL_MAX_S)
    yield None

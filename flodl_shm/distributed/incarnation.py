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
    Rank 0 draws a fresh token (``uuid4``) and sets ``offer`` to ``<token>:<world>``.
Ask
    Every other rank draws a fresh nonce and sets ``ask/<token>/<rank>`` to
    ``<token>:<nonce>:<world>:<pid>@<hostname>`` for the offer it read. That offer may
    be an earlier incarnation's (read before this rank 0 set its own): the rank asks
    again whenever ``offer`` changes.
Admit
    Rank 0 admits rank r once ``ask/<its token>/<r>`` is set: it sets ``admit/<nonce>`` to
    the token. An ask left by an earlier incarnation is under another token. An ask with
    another world size is refused (``admit/<nonce>`` = ``refused:<why>``), and rank 0
    raises too.
Join
    Rank r joins once ``admit/<its nonce>`` exists. An admission left by an earlier
    incarnation cannot name a nonce drawn now.

Every rank then keys the group under ``<token>/``. The waits poll the store (a few
milliseconds apart at first, ``poll_pauses``) until the group's timeout; a rank that is not
there by then is named in the error.

After the handshake
-------------------
A rank that fails while the group forms (rank 0 missing a rank, a leader that cannot
create its arena) sets ``<token>/abandoned`` to its reason (``Incarnation.abandon``); the
others' waits read it and raise it at once, instead of waiting out their timeouts.

Two processes asking for one rank (a launch script that started two as ``RANK=1``, or two
live jobs on one store: two jobs on one host given one ``MASTER_ADDR:MASTER_PORT``) ask
under the same ``ask/<token>/<rank>`` key. Rank 0 watches ``offer`` while it admits
(another rank 0 setting its own is reported as such), and once the group formed every rank
confirms that the asks it relied on still hold the nonces it admitted
(``Incarnation.confirm``); a rank waiting to be admitted whose ask another process
replaced says so at once; and one whose group formed without it (its offer retired, below,
though this process never joined it) says that. Nothing is averaged with a stranger.

Once formed
-----------
The keys are read only while the group forms, and a store may outlive many groups
(torchrun's lives as long as the job; a sweep creates and destroys a group per trial):
each rank deletes its own ``admit/<nonce>`` once it read it, and every rank, done with
the keys, counts itself in ``<token>/formed`` (``Incarnation.retire``); the last one
deletes the asks and the group's keys under the token, and retires the offer: it becomes
``formed:<token>`` through a compare-and-set, so a newer incarnation's offer, set
meanwhile by a rank 0 that already moved on (init and destroy do not wait for the other
ranks), is never touched. One key is left per group prefix (gloo leaves two); an
incarnation that failed keeps its keys. A rank that asked for an offer retired since by
a group its own process joined (its previous incarnation, read before the new rank 0
offered) waits for the new offer.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from datetime import timedelta
from typing import Iterable

logger = logging.getLogger("flodl_shm")

_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.02

SHARED_STORE_FIX = ("two jobs on this host with one MASTER_ADDR:MASTER_PORT share a store; "
                    "give each job its own port (MASTER_PORT, torchrun --master-port / "
                    "--rdzv-endpoint)")
_SAME_WORLD_FIX = "every rank must call init_process_group with the same world_size"
_FORMED = "formed:"  # a retired offer: "formed:<token>"
#: the tokens of the last groups this process joined (module doc, "Once formed")
_JOINED: "OrderedDict[str, None]" = OrderedDict()
_JOINED_KEPT = 64


class Incarnation:
    """One incarnation of a group, as this rank joined it: ``keys`` is the group's store
    under the incarnation's token.

    Args (from :func:`incarnation_store`): ``base`` the group's store, ``token`` the
    agreed token, ``asks`` the ``ask/<token>/<rank>`` values this rank relied on (rank 0:
    every admitted rank's; another rank: its own), ``what`` this rank in errors.
    """

    def __init__(self, base, token: str, asks: dict[int, str], what: str) -> None:
        import torch.distributed as dist

        self._marks = dist.PrefixStore("incarnation/", base)
        self.keys = dist.PrefixStore(f"{token}/", base)
        self.token = token
        self._asks = dict(asks)
        self.what = what

    def abandon(self, reason: str) -> None:
        """Tell the other ranks this group will not form (they raise ``reason``); the
        first rank's reason stands, the ranks that raise it repeat nothing."""
        try:
            if not self.keys.check(["abandoned"]):
                self.keys.set("abandoned", reason)
        except Exception:  # noqa: BLE001 - the store itself may be what failed
            pass

    def raise_if_abandoned(self) -> None:
        if self.keys.check(["abandoned"]):
            raise RuntimeError(f"{self.what}: the group will not form: "
                               f"{self.keys.get('abandoned').decode()}")

    def retire(self, world: int, keys: Iterable[str]) -> None:
        """This rank is done with the store: the last of the group's ``world`` ranks to
        say so deletes ``keys`` (the group's keys under the token), the ``formed`` count
        and the asks, and retires the offer (module doc, "Once formed"). Tidying only: a
        store that cannot delete, or is gone, costs a line at DEBUG."""
        try:
            if self.keys.add("formed", 1) < world:
                return
            # (only if it is still this incarnation's: a newer one's offer stays)
            self._marks.compare_set("offer", f"{self.token}:{world}", _FORMED + self.token)
            for key in (*keys, "formed"):
                self.keys.delete_key(key)
            for r in range(1, world):
                self._marks.delete_key(_ask_key(self.token, r))
        except Exception as e:  # noqa: BLE001 - the group formed; its keys are only litter
            logger.debug("%s: the group's store keys were not deleted: %s", self.what, e)

    def confirm(self) -> None:
        """Every ask this rank relied on still holds the nonce it was admitted with: no
        other process asked for one of those ranks since (another job on this store)."""
        for r, ask in self._asks.items():
            now = self._marks.get(_ask_key(self.token, r)).decode()
            if now != ask and _fields(now)[3] != _fields(ask)[3]:  # (not its next group)
                reason = (f"two processes asked to be rank {r} of this group (another job "
                          f"given this store joined it): {SHARED_STORE_FIX}")
                self.abandon(reason)
                raise RuntimeError(f"{self.what}: {reason}")


def incarnation_store(store, rank: int, world: int, timeout: timedelta,
                      what: str) -> Incarnation:
    """This incarnation of the group, agreed by the handshake in the module docstring;
    every rank of the group calls it at once.

    Args:
        store: the group's c10d store.
        rank: this rank in the group; world: the group's size.
        timeout: how long to wait for the other ranks (the group's timeout).
        what: names this rank in errors, e.g. ``"flodl_shm process group (rank 1 of 2)"``.
    Raises:
        RuntimeError: a rank did not arrive within ``timeout``, the ranks were given
            different world sizes, or another job's rank 0 uses the same store.
    """
    import torch.distributed as dist

    marks = dist.PrefixStore("incarnation/", store)
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        if rank == 0:
            token, asks = _admit(marks, store, world, deadline, timeout, what)
        else:
            token, asks = _join(marks, rank, world, deadline, timeout, what)
    except dist.DistNetworkError as e:
        raise store_closed(what, e) from e
    _JOINED[token] = None
    while len(_JOINED) > _JOINED_KEPT:
        _JOINED.popitem(last=False)
    return Incarnation(store, token, asks, what)


def _ask_key(token: str, rank: int) -> str:
    return f"ask/{token}/{rank}"


def store_closed(what: str, e: BaseException, more: str = "") -> RuntimeError:
    """The error of a rank whose group's store closed its connection while the group
    formed (a ``DistNetworkError``); ``more`` is added to its end."""
    return RuntimeError(
        f"{what}: the group's store closed its connection while the group formed "
        f"({str(e).splitlines()[0]}). The process that hosts it (rank 0's, under tcp:// or "
        f"env:// without torchrun, or a dist.TCPStore it created) ended: most likely it "
        f"failed in init_process_group itself (a rank that did not come, another "
        f"world_size): see rank 0's error. Re-creating a group on one init_method port "
        f"does it too (a rank that destroyed its group first can reach the previous "
        f"group's store as its rank 0 closes it): keep one dist.TCPStore per process and "
        f"pass store=..., or give each group its own port" + more)


def _admit(marks, store, world: int, deadline: float, timeout: timedelta,
           what: str) -> tuple[str, dict[int, str]]:
    """Offer and Admit (rank 0): the token and every admitted rank's ask, once every
    other rank was admitted."""
    token = uuid.uuid4().hex
    offer = f"{token}:{world}"
    marks.set("offer", offer)
    waiting = set(range(1, world))
    asks: dict[int, str] = {}

    def fail(reason: str) -> RuntimeError:
        Incarnation(store, token, {}, what).abandon(f"rank 0: {reason}")
        return RuntimeError(f"{what}: {reason}")

    for pause in poll_pauses(deadline):
        for r in sorted(waiting):
            if not marks.check([_ask_key(token, r)]):
                continue
            ask = marks.get(_ask_key(token, r)).decode()
            named, nonce, their_world, _ = _fields(ask)
            if named != token:
                continue
            if their_world != str(world):
                reason = (f"rank {r} was started with world_size {their_world} and rank 0 "
                          f"with {world}: {_SAME_WORLD_FIX}")
                marks.set(f"admit/{nonce}", f"refused:{reason}")
                raise fail(reason)
            marks.set(f"admit/{nonce}", token)
            asks[r] = ask
            waiting.discard(r)
        if not waiting:
            return token, asks
        if marks.get("offer").decode() != offer:
            raise fail(f"another rank 0 set its own offer in this group's store while this "
                       f"one was admitting ranks: {SHARED_STORE_FIX}")
        if pause is None:
            break
        time.sleep(pause)
    raise fail(f"rank(s) {sorted(waiting)} of {world} did not join within "
               f"{timeout.total_seconds():g} s (they did not start, crashed before "
               f"init_process_group, or were given another store); {_SAME_WORLD_FIX} and "
               f"store")


def _join(marks, rank: int, world: int, deadline: float, timeout: timedelta,
          what: str) -> tuple[str, dict[int, str]]:
    """Ask and Join (a rank other than 0): the token rank 0 admitted it with, and its ask."""
    import torch.distributed as dist

    nonce = uuid.uuid4().hex
    asker = f"{os.getpid()}@{socket.gethostname()}"
    asked = None
    ask = ""
    formed_before = ""  # what its errors add when a group formed before it asked
    try:
        for pause in poll_pauses(deadline):
            if marks.check([f"admit/{nonce}"]):
                token = marks.get(f"admit/{nonce}").decode()
                if token.startswith("refused:"):
                    raise RuntimeError(f"{what}: rank 0 refused this rank: "
                                       f"{token.removeprefix('refused:')}")
                marks.delete_key(f"admit/{nonce}")  # (only this rank reads it)
                return token, {rank: ask}
            offer = _peek(marks, "offer")
            if offer is not None and offer.startswith(_FORMED):
                _check_not_left_out(offer, asked, rank, what)
                if not formed_before and offer[len(_FORMED):] not in _JOINED:
                    # (a rank of torchrun's next attempt sees one too, before its rank 0
                    # offers)
                    formed_before = (f". A group formed on this store before this rank asked "
                                     f"to join one, without this process: if two processes "
                                     f"were started as rank {rank}, {_ONE_PROCESS_A_RANK}")
                offer = None  # (an earlier incarnation's, retired: wait for the next offer)
            if offer is not None and offer != asked:
                token = offer.partition(":")[0]
                ask = f"{token}:{nonce}:{world}:{asker}"
                marks.set(_ask_key(token, rank), ask)
                asked = offer
            elif asked is not None:
                _check_own_ask(marks, rank, ask, what)
            if pause is None:
                break
            time.sleep(pause)
    except dist.DistNetworkError as e:
        raise store_closed(what, e, formed_before) from e
    raise RuntimeError(
        f"{what}: rank 0 did not admit this rank within {timeout.total_seconds():g} s "
        f"(it did not start, crashed before init_process_group, was given another store, "
        f"or waits for a rank that did not start: with tcp:// or env:// init, rank 0 first "
        f"waits for all world_size ranks to connect; or {SHARED_STORE_FIX}){formed_before}")


def _check_own_ask(marks, rank: int, ask: str, what: str) -> None:
    """Raise when another process's ask replaced this rank's (module doc): two processes
    were started as this rank, and rank 0 admits one of them; the other would wait out its
    timeout."""
    token = _fields(ask)[0]
    now = _peek(marks, _ask_key(token, rank))
    other = "" if now is None else _fields(now)[3]
    if now is not None and now != ask and other != _fields(ask)[3]:
        raise RuntimeError(f"{what}: another process ({other}) asked to be rank {rank} of this "
                           f"group too: {_ONE_PROCESS_A_RANK}")


def _check_not_left_out(retired: str, asked: str | None, rank: int, what: str) -> None:
    """Raise when the offer this rank asked for was retired (``retired``, module doc "Once
    formed") by a group this process never joined: it formed without this rank, another
    process having been admitted as it."""
    token = retired[len(_FORMED):]
    if asked is not None and asked.partition(":")[0] == token and token not in _JOINED:
        raise RuntimeError(f"{what}: the group formed without this rank: rank 0 admitted "
                           f"another process as rank {rank}; {_ONE_PROCESS_A_RANK}")


_ONE_PROCESS_A_RANK = f"start each process with its own RANK (or {SHARED_STORE_FIX})"
_ABSENT = "\0flodl_shm: absent"


def _peek(store, key: str) -> str | None:
    """``key``'s value, or None when it is not set, without waiting for it as a store's
    ``get`` does (until the store's timeout). A compare-and-set that expects a value no key
    holds sets nothing and returns the key's value, or, for a missing key, the value it
    expected."""
    got = store.compare_set(key, _ABSENT, _ABSENT).decode()
    return None if got == _ABSENT else got


def _fields(ask: str) -> tuple[str, str, str, str]:
    """An ask's token, nonce, world size and asking process (``pid@hostname``); "" for
    a field it lacks."""
    token, nonce, world, asker = (ask.split(":", 3) + ["", "", ""])[:4]
    return token, nonce, world, asker


def poll_pauses(deadline: float):
    """The pause before each next poll, growing to ``_POLL_MAX_S``; ``None`` once the
    deadline has passed (the caller makes one last poll, then gives up)."""
    pause = _POLL_FIRST_S
    while time.monotonic() < deadline:
        yield pause
        pause = min(2 * pause, _POLL_MAX_S)
    yield None

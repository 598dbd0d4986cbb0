"""How the ranks of a ``"flodl_shm"`` process group find their host peers and share an arena.

Everything goes through the c10d store the group was created with (the per-group
prefix store, so several groups never mix keys):

1. every rank publishes ``host/<rank>`` = its host identity (``FLODL_SHM_HOST`` if
   set, else the hostname) and ``pid/<rank>``, then reads everyone's;
2. the ranks of one identity form a host, ordered by group rank; the lowest is the
   host's **leader**;
3. the leader unlinks the segments of dead owners (a leader killed between steps 3
   and 4, e.g. in torchrun's failed attempt, leaves its names), creates the host
   arena and publishes its handle (``arena/<host>``);
   the others attach and map every segment they will ever use, then say so
   (``mapped/<rank>``);
4. once every rank of the host mapped it, the leader **unlinks every segment name**.
   The memory lives on as long as one process maps it, and no name is left in
   ``/dev/shm`` whatever happens next: a clean ``destroy_process_group``, an
   exception, SIGKILL of any rank. (Segments only grow afterwards, through the
   descriptors already open.)

Every key lives under a token fresh to this incarnation of the group, agreed by all its
ranks (``incarnation.py``): the store may hold the keys of an earlier incarnation (torchrun's
failed attempt, or a group destroyed and created again under the same prefix), and what
they name is gone. Once the group formed, the last rank done with them deletes them
(``Incarnation.retire``).

A group spanning several hosts also gets a gloo process group among the host
leaders (``ProcessGroupGloo`` on the same store under ``leaders/``), through which
the leaders combine their hosts' partials.

Peer liveness: with no supervisor to fence a dead rank, a waiting rank checks after
every sleep slice that its host peers' processes still exist; a gone peer makes the
wait raise ``RuntimeError`` naming its rank and the host ranks that had not arrived
either (``PeerDied``, see ``PeerWatch``: a peer that timed out waiting for them and
exited is seen as a death); on a multi-host group the leader passes that to the other
hosts (``process_group.py``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from ..engine import arena as A
from ..engine.comm import Comm
from ..engine.segment import pid_alive, reap_dead_owner_segments
from ..errors import PeerDied
from .incarnation import (SHARED_STORE_FIX, Incarnation, incarnation_store, poll_pauses,
                          store_closed)

logger = logging.getLogger("flodl_shm")

HOST_ENV = "FLODL_SHM_HOST"


def host_identity() -> str:
    """This process's host identity: ``$FLODL_SHM_HOST`` if set, else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """Which group ranks share a host, seen from one rank.

    Attributes:
        rank: this rank in the group; world: the group size.
        hosts: the ranks of each host (sorted), hosts ordered by their lowest rank.
        host_index: index of this rank's host in ``hosts``.
    """

    rank: int
    world: int
    hosts: tuple[tuple[int, ...], ...]
    host_index: int

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.hosts[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.local_ranks[0] == self.rank

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(h[0] for h in self.hosts)

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1

    def host_of(self, rank: int) -> int:
        for i, h in enumerate(self.hosts):
            if rank in h:
                return i
        raise ValueError(f"rank {rank} is not in a group of {self.world}")


def topology_from_identities(rank: int, identities: list[str]) -> Topology:
    """Group ranks by identity; hosts ordered by their lowest rank."""
    by_host: dict[str, list[int]] = {}
    for r, ident in enumerate(identities):
        by_host.setdefault(ident, []).append(r)
    hosts = tuple(tuple(rs) for rs in sorted(by_host.values(), key=lambda rs: rs[0]))
    idx = next(i for i, h in enumerate(hosts) if rank in h)
    return Topology(rank, len(identities), hosts, idx)


class PeerWatch:
    """The liveness check a waiting rank runs after every sleep slice: raises
    ``PeerDied`` (a ``RuntimeError``) naming the first host peer whose process is gone."""

    def __init__(self, pids: dict[int, int], what: str, host_ranks: tuple[int, ...] = (),
                 left=None) -> None:
        self.pids = dict(pids)
        self.what = what
        self.host_ranks = tuple(host_ranks)  # group rank of each local rank, for the waits
        self.left = left  # group rank -> whether it left the group (Comm.leave)

    def __call__(self) -> None:
        for rank, pid in self.pids.items():
            if not pid_alive(pid):
                if self.left is not None and self.left(rank):
                    raise RuntimeError(
                        f"{self.what}: rank {rank} (pid {pid}) destroyed its process group "
                        f"and exited while this rank waits for it in a collective: every "
                        f"rank must make the same sequence of collective calls")
                raise PeerDied(
                    f"{self.what}: rank {rank} (pid {pid}) died; the collective cannot "
                    f"complete. Destroy the process group and restart the job (e.g. "
                    f"torchrun --max-restarts) from the last checkpoint", rank, pid,
                    host_ranks=self.host_ranks)


@dataclass
class HostLink:
    """What rendezvous hands to the process group: this rank's topology, its ``Comm``
    on the host arena, and (on a host leader of a multi-host group) the gloo group
    of the leaders."""

    topology: Topology
    comm: Comm
    leaders: object | None  # torch.distributed.ProcessGroupGloo

    def close(self, leaving: bool = True) -> None:
        """Leave (``leaving``: a host peer still waiting for this rank in a collective is
        told so, ``Comm.leave``, unless this rank's own collectives failed), then drop
        this rank's mappings (the names were unlinked at rendezvous)."""
        if leaving:
            self.comm.leave()
        self.comm.close()
        self.leaders = None


def rendezvous(store, rank: int, world: int, timeout: timedelta) -> HostLink:
    """Run the steps in the module doc; every rank of the group calls it at once.

    Args:
        store: the group's c10d store (prefixed per group by torch).
        rank: this rank in the group; world: the group's size.
        timeout: the group's timeout: bounds every store wait and every collective wait.
    """
    what = f"flodl_shm process group (rank {rank} of {world})"
    if not 0 <= rank < world:  # (it waited out the group's timeout to be admitted)
        raise ValueError(f"{what}: rank {rank} is not a rank of a group of {world}: ranks "
                         f"run from 0 to world_size - 1 ({world - 1}); start each process "
                         f"with its own rank below world_size")
    import torch.distributed as dist

    inc = incarnation_store(store, rank, world, timeout, what)
    with _sigterm_unwinds():
        try:
            link = _form(inc, rank, world, timeout)
        except dist.DistNetworkError as e:  # (no store left to tell the others through)
            raise store_closed(what, e) from e
        except BaseException as e:  # the first failure tells the others
            inc.abandon(f"rank {rank} failed while the group formed: {type(e).__name__}: "
                        f"{e}")
            raise
    inc.retire(world, _formed_keys(world, len(link.topology.hosts)))
    return link


class _Terminated(BaseException):
    """A SIGTERM while the group formed (``_sigterm_unwinds``)."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While the group forms, until no arena name is held, a SIGTERM (torchrun's agent
    stopping its workers, a scheduler) unwinds as an exception: the leader unlinks the
    arena's names it holds until every host peer mapped them (otherwise left in
    /dev/shm until a later leader or ``ram --reap`` removes them) and the others hear
    why; then the process ends by the SIGTERM, as it would have. Only in the main
    thread, and only where SIGTERM has its default action (a program's own handler runs
    as it is)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGTERM, _unwind)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # (ends the process here)
        raise
    finally:
        _sigterm_default()


def _unwind(signum, frame):
    raise _Terminated("stopped by SIGTERM while the group formed")


def _sigterm_default() -> None:
    """SIGTERM's default action back, where ``_sigterm_unwinds`` set it (once no name is
    held: a handler cannot run while the main thread blocks in C++, in the gloo group
    of host leaders that is built next, and would only delay the end)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _unwind):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _formed_keys(world: int, hosts: int) -> list[str]:
    """Every key ``_form`` sets for a group of ``world`` ranks on ``hosts`` hosts (steps
    1-4 of the module doc), for its last rank to delete."""
    return [*(f"{k}/{r}" for k in ("host", "pid", "mapped") for r in range(world)),
            *(f"arena/{h}" for h in range(hosts))]


def _form(inc: Incarnation, rank: int, world: int, timeout: timedelta) -> HostLink:
    """Steps 1-4 of the module doc, in this incarnation's keys."""
    store, what = inc.keys, inc.what
    # rank 0 may still be admitting the others for up to its own timeout: the ranks it
    # admitted first wait a little longer, so its verdict (abandoned: which rank did not
    # come) reaches them before their own deadline does
    grace = 0.0 if rank == 0 else min(5.0, 0.5 * timeout.total_seconds())
    deadline = time.monotonic() + timeout.total_seconds() + grace
    store.set(f"host/{rank}", host_identity())
    store.set(f"pid/{rank}", str(os.getpid()))
    _await_keys(inc, {r: f"host/{r}" for r in range(world)}, deadline, timeout,
                "publish a host identity")
    idents = [store.get(f"host/{r}").decode() for r in range(world)]
    topo = topology_from_identities(rank, idents)
    local = topo.local_ranks
    pids = {r: int(store.get(f"pid/{r}")) for r in local if r != rank}
    key = f"arena/{topo.host_index}"
    arena = None
    try:
        if topo.is_leader:
            reap_dead_owner_segments()  # e.g. a leader of torchrun's failed attempt
            # a dead peer fails the group's collectives: large rounds may go direct
            arena = A.Arena.create(len(local), first_rank=0, global_world=len(local),
                                   direct=True)
            store.set(key, pickle.dumps(arena.handle))
        else:
            _await_keys(inc, {local[0]: key}, deadline, timeout, "create the host's arena",
                        pids)
            handle = pickle.loads(store.get(key))
            try:
                arena = A.Arena.attach(handle)
            except FileNotFoundError as e:
                inc.raise_if_abandoned()  # its leader failed (and removed them) meanwhile
                raise RuntimeError(
                    f"{what}: the group's store names host arena {handle.name('ctl')} of "
                    f"leader pid {handle.owner_pid}, which is gone: its leader removed the "
                    f"names once its own ranks had mapped them, so another job's rank 0 "
                    f"admitted this rank: {SHARED_STORE_FIX}") from e
        # every segment mapped while the names exist (the outer state too, which an
        # outer optimizer in the reduce grows later through its open descriptor)
        arena.map_every_segment()
        store.set(f"mapped/{rank}", b"1")
        if topo.is_leader:
            _await_keys(inc, {r: f"mapped/{r}" for r in local}, deadline, timeout,
                        "map the host's arena", pids)
            arena.unlink()
        inc.confirm()
    except BaseException:
        if arena is not None:
            if arena.owner:
                arena.unlink()
            arena.close()
        raise
    _sigterm_default()  # (no name is held from here on)
    ctl = arena.ctl

    def left(r: int) -> bool:
        return int(ctl[A.rank_base(local.index(r)) + A.R_DEAD]) == A.DEAD_EXITED

    watch = PeerWatch(pids, what, local, left)
    comm = Comm(arena, topo.local_rank, global_rank=rank, world_size=len(local),
                timeout=timeout.total_seconds(), liveness=watch)
    leaders = None
    if topo.multi_host and topo.is_leader:
        import torch.distributed as dist

        leaders = dist.ProcessGroupGloo(dist.PrefixStore("leaders/", store),
                                        topo.leaders.index(rank), len(topo.hosts), timeout)
    logger.info("flodl_shm group: rank %d/%d on host %d of %d (%d local ranks)%s", rank, world,
                topo.host_index, len(topo.hosts), len(local),
                ", host leader" if topo.is_leader else "")
    return HostLink(topo, comm, leaders)


def _await_keys(inc: Incarnation, keys: dict[int, str], deadline: float, timeout: timedelta,
                doing: str, pids: dict[int, int] | None = None) -> None:
    """Wait, polling, until every rank in ``keys`` (rank -> its key) set its key: raise at
    once when a rank abandoned the group or a host peer in ``pids`` died, and at the
    group's deadline naming the ranks that did not ``doing``."""
    names = list(keys.values())
    for pause in poll_pauses(deadline):
        if inc.keys.check(names):
            return
        inc.raise_if_abandoned()
        for r, pid in (pids or {}).items():
            if r in keys and not pid_alive(pid) and not inc.keys.check([keys[r]]):
                raise PeerDied(f"{inc.what}: rank {r} (pid {pid}) died while the group "
                               f"formed (before it could {doing}); restart the job", r, pid)
        if pause is None:
            break
        time.sleep(pause)
    missing = [r for r, k in keys.items() if not inc.keys.check([k])]
    raise RuntimeError(f"{inc.what}: rank(s) {missing} did not {doing} within "
                       f"{timeout.total_seconds():g} s (alive but stopped during "
                       f"init_process_group, or on another store)")

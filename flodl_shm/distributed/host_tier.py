"""``HostTier``: how a collective of a ``"flodl_shm"`` group that spans hosts crosses them.

Inside a host a collective is a round of the engine in shared memory; between hosts
only the host leaders (each host's lowest group rank) talk, in a gloo group of their
own (``rendezvous.py``). Every collective of a multi-host group runs in three steps
(``HostTier.run``):

1. **The host round.** Every rank of the host runs the host's shared-memory round (a
   reduce into the host sum, or a byte round that hands the leader every local rank's
   bytes). A schema mismatch there raises on every rank of the host.
2. **The leaders agree, then combine.** The leaders all-reduce (MAX) four words,
   ``[failed, signature, -signature, dead]``: whether a host's round failed, the
   collective's signature (equal on every host exactly when its maximum equals minus
   the maximum of its negation), and ``rank << 32 | pid`` of a rank a leader saw die in
   step 1 (else -1). Only when every host completed the same collective do they combine
   their host partials through gloo.
3. **The fan-out.** Each leader publishes ``[status word | dead word | result]`` to its
   host in one byte round. Every rank raises if the status says another host failed,
   lost a rank, disagreed or the leaders' exchange failed; else it takes the result.

So a mismatch, a failure or a dead rank on one host makes every rank of every host
raise at once, instead of leaving the other hosts in a gloo call until the timeout or
until the dead rank's leader exits. A rank that is not a leader waits for its leader's
verdict longer than the leader may spend in gloo (``LEADER_VERDICT_S``), so the verdict,
which names the other hosts, arrives before its own deadline.

The tier tells its group what it learns through the callables it was built with: the
group's names for ranks in errors, that the group is unusable from now on (and why),
and, after a host round completed, the group's check that no rank of this host gave up
on it meanwhile.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..engine.byte_exchange import exchange_bytes
from ..errors import FrameError, PeerDied
from .rendezvous import HostLink

#: how long past their leader's gloo deadlines a multi-host group's other ranks wait for
#: its verdict (step 3)
LEADER_VERDICT_S = 5.0

# the fan-out's status word (step 3)
_OK, _HOST_FAILED, _MISMATCH, _LEADERS_FAILED, _RANK_DIED = range(5)


class HostTier:
    """The leaders' side of one group rank of a multi-host group (module doc).

    Args:
        link: the rank's ``HostLink`` (its ``leaders`` group on a host leader).
        size: the group's size.
        timeout_s: the group's timeout, which bounds each of the leaders' gloo calls.
        named: the group's name for group ranks in an error ("group rank(s) [1]").
        unusable: called with the reason before an error after which the group cannot
            go on (a rank died, the leaders' exchange failed).
        after_host_round: called once this rank's host round completed, before the
            leaders meet (the group's check that no rank of this host gave up on it).
    """

    def __init__(self, link: HostLink, size: int, timeout_s: float,
                 named: Callable[[Sequence[int]], str], unusable: Callable[[str], None],
                 after_host_round: Callable[[], None]) -> None:
        self._link = link
        self._topo = link.topology
        self._size = size
        self._timeout_s = timeout_s
        self._named = named
        self._unusable = unusable
        self._after_host_round = after_host_round

    def exchange(self, nbytes: int, fill: Callable[[np.ndarray], None] | None,
                 consume: Callable[[list[np.ndarray]], None], signature: int) -> None:
        """A byte round over the whole group: ``consume`` gets every group rank's
        ``nbytes`` bytes (uint8 views, group-rank order, valid during the call). The
        leaders gather their hosts' bytes, all-gather them and fan them out."""
        link, topo = self._link, self._topo
        per_host = max(len(h) for h in topo.hosts)
        local_n = len(topo.local_ranks)
        host_blob = np.zeros(per_host * nbytes, np.uint8) if topo.is_leader else None

        def collect(views: list[np.ndarray]) -> None:
            if host_blob is not None:
                for i in range(local_n):
                    host_blob[i * nbytes:(i + 1) * nbytes] = views[i]

        def combine() -> Callable[[np.ndarray], None]:
            out = torch.empty(len(topo.hosts) * per_host * nbytes, dtype=torch.uint8)
            link.leaders.allgather([list(out.chunk(len(topo.hosts)))],
                                   [torch.from_numpy(host_blob)]).wait()

            def write(dst: np.ndarray) -> None:
                dst[:] = out.numpy()

            return write

        def fan_out(blob: np.ndarray) -> None:
            per_rank = [None] * self._size
            for h, ranks in enumerate(topo.hosts):
                for i, r in enumerate(ranks):
                    start = (h * per_host + i) * nbytes
                    per_rank[r] = blob[start:start + nbytes]
            consume(per_rank)

        self.run(lambda: exchange_bytes(link.comm, nbytes, fill, collect, signature),
                 signature, combine, len(topo.hosts) * per_host * nbytes, fan_out)

    def run(self, host_round: Callable[[], None], signature: int,
            combine: Callable[[], Callable[[np.ndarray], None]], out_nbytes: int,
            take: Callable[[np.ndarray], None]) -> None:
        """One collective in the module doc's three steps: ``host_round()`` is step 1;
        ``combine()`` runs on the leaders in step 2 and returns the function that writes
        the ``out_nbytes`` result into the fan-out; every rank ``take``s the result in
        step 3."""
        link, topo = self._link, self._topo
        host_error = None
        try:
            host_round()
        except (FrameError, PeerDied) as e:
            if isinstance(e, PeerDied):
                self._unusable(f"{e}")
            if not topo.is_leader:
                raise  # the leader tells the other hosts, then raises too
            host_error = e
        if host_error is None:
            # a rank of this host gave up on this round before this (late) rank came: it
            # will not join what follows, where this rank would wait for it in vain
            self._after_host_round()
        status, write, leaders_error, dead = _OK, None, None, -1
        if topo.is_leader:
            lost = (host_error.rank << 32 | host_error.pid
                    if isinstance(host_error, PeerDied) else -1)
            flags = torch.tensor([int(host_error is not None), signature, -signature, lost],
                                 dtype=torch.int64)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            try:
                link.leaders.allreduce([flags], opts).wait()
                if host_error is None and not int(flags[0]) and int(flags[1]) == -int(flags[2]):
                    write = combine()
            except Exception as e:  # noqa: BLE001 - the leaders' group failed: tell the host
                leaders_error = e
            if host_error is not None:
                raise host_error
            dead = int(flags[3])
            if leaders_error is not None:
                status = _LEADERS_FAILED
            elif dead >= 0:
                status = _RANK_DIED
            elif int(flags[0]):
                status = _HOST_FAILED
            elif int(flags[1]) != -int(flags[2]):
                status = _MISMATCH

        def fill(dst: np.ndarray) -> None:
            dst[:16].view(np.int64)[:] = (status, dead)
            if write is not None:
                write(dst[16:16 + out_nbytes])

        def read(views: list[np.ndarray]) -> None:
            code, lost = (int(x) for x in views[0][:16].view(np.int64))
            if code != _OK:
                self._raise_verdict(code, lost, leaders_error)
            take(views[0][16:16 + out_nbytes])

        if topo.is_leader:  # it raises here too when the leaders failed
            exchange_bytes(link.comm, 16 + out_nbytes, fill, read, signature)
            return
        # the leader may spend its own timeout in each of the leaders' two gloo steps:
        # outwait them, so that its verdict (naming the other hosts) arrives first; a
        # leader that dies is seen at once (liveness), not at the deadline
        with link.comm.longer_waits(2 * self._timeout_s + LEADER_VERDICT_S):
            exchange_bytes(link.comm, 16 + out_nbytes, None, read, signature)

    def _raise_verdict(self, code: int, lost: int, leaders_error: Exception | None) -> None:
        """Raise what the leader's status word ``code`` says (step 3; ``lost``: the dead
        word; ``leaders_error``: gloo's own error, on the leader)."""
        topo = self._topo
        if code == _RANK_DIED:
            reason = (f"rank {lost >> 32} (pid {lost & 0xFFFFFFFF}) died on the host of "
                      f"leader rank {topo.leaders[topo.host_of(lost >> 32)]}")
            self._unusable(reason)
            raise RuntimeError(
                f"flodl_shm: {reason}; the collective cannot complete. Destroy the process "
                f"group and restart the job (e.g. torchrun --max-restarts) from the last "
                f"checkpoint")
        if code == _LEADERS_FAILED:
            others = [r for r in topo.leaders if r != topo.local_ranks[0]]
            reason = (
                f"the exchange between host leaders failed on this host's leader "
                f"({self._named([topo.local_ranks[0]])}): the leader(s) of the other hosts, "
                f"{self._named(others)}, did not complete this collective (they died, left, "
                f"timed out waiting for a rank of their own host (their output names it), or "
                f"are in another collective: every rank must make the same sequence of calls)")
            self._unusable(reason)
            raise RuntimeError(
                f"flodl_shm: {reason}; the group is unusable, destroy it and restart"
                + (f". gloo said: {leaders_error}" if leaders_error is not None else ""))
        why = ("a rank on another host failed this collective" if code == _HOST_FAILED else
               "the hosts called different collectives or shapes")
        raise FrameError(f"collective across {len(topo.hosts)} hosts: {why}; every rank must "
                         f"make the same sequence of collective calls")

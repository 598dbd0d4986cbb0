"""The exceptions flodl_shm raises, in one place.

Each says what was wrong, the value and the limit involved, and how to fix it.
"""
from __future__ import annotations


def plural(n: int, word: str) -> str:
    """``"1 rank"``, ``"2 ranks"``: a count and its noun, as a reader says them (the
    messages' counts)."""
    return f"{n} {word}" + ("" if n == 1 else "s")


class FrameError(ValueError):
    """A frame or its wire encoding is malformed, inconsistent or unauthenticated.

    The only error the frame and wire layers raise for bad input.
    """


class SchemaMismatchError(FrameError):
    """Ranks contributed frames of different schemas (tensor count, shapes, dtypes
    or kind) to the same collective round. Raised on every rank of the round."""


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, truncated, or incompatible with the model."""


class ReduceStall(TimeoutError):
    """A collective round did not complete within its deadline while the missing
    peers were still alive.

    Attributes:
        round: the round number that stalled.
        missing: the ranks that had not arrived (or finished their part): global ranks
            when ``global_ranks`` (a round across hosts, and ``spawn``'s own errors),
            else the host's local ranks (a wait inside one host's shared memory).
        timeout: the deadline in seconds.
        global_ranks: whether ``missing`` holds global ranks.
    """

    def __init__(self, message: str, *, round: int = -1, missing: tuple[int, ...] = (),
                 timeout: float | None = None, global_ranks: bool = False) -> None:
        super().__init__(message)
        self.round = round
        self.missing = tuple(missing)
        self.timeout = timeout
        self.global_ranks = bool(global_ranks)

    def __reduce__(self):
        return (_rebuild_reduce_stall, (str(self), self.round, self.missing, self.timeout,
                                        self.global_ranks))


def shifted_ranks(missing, first_rank: int) -> tuple:
    """A host's local ranks ``missing`` as global ranks (``first_rank``: the global rank
    of its local rank 0); an entry that names no rank (the checkpoint owner) stays."""
    return tuple(first_rank + m if isinstance(m, int) else m for m in missing)


def _rebuild_reduce_stall(message, round, missing, timeout, global_ranks=False):
    return ReduceStall(message, round=round, missing=missing, timeout=timeout,
                       global_ranks=global_ranks)


class CohortAborted(RuntimeError):
    """The cohort was torn down while this rank waited (a peer failed beyond
    ``max_failures``, the launcher was interrupted, or the launcher died)."""


class PeerDied(RuntimeError):
    """A host peer of a rank waiting in a c10d collective is gone: ``rank`` (group rank)
    and ``pid`` name it.

    ``missing``: the group ranks of this host that had not arrived at the collective
    either, when the wait knew them (``with_missing``). A peer that timed out waiting
    for them and then exited is seen here as a death; the ranks it waited for are the
    cause, so the message names them too.
    """

    def __init__(self, message: str, rank: int, pid: int, *,
                 host_ranks: tuple[int, ...] = (), missing: tuple[int, ...] | None = None
                 ) -> None:
        super().__init__(message)
        self.rank, self.pid = rank, pid
        self.host_ranks = tuple(host_ranks)  # group rank of each local rank of this host
        self.missing = missing

    def with_missing(self, local: tuple) -> "PeerDied":
        """This error, naming the host's local ranks ``local`` (as a wait lists the ranks
        it still waits for) that had not arrived, besides the dead one."""
        ranks = tuple(r for r in (self.host_ranks[m] for m in local
                                  if isinstance(m, int) and 0 <= m < len(self.host_ranks))
                      if r != self.rank)
        message = str(self) if not ranks else (
            f"{self}. Group rank(s) {list(ranks)} of this host had not arrived at this "
            f"collective either: if rank {self.rank} timed out waiting for them and exited, "
            f"they are the cause (alive but elsewhere: every rank must make the same "
            f"sequence of collective calls)")
        return PeerDied(message, self.rank, self.pid, host_ranks=self.host_ranks,
                        missing=ranks)

    def __reduce__(self):
        return (_rebuild_peer_died, (str(self), self.rank, self.pid, self.host_ranks,
                                     self.missing))


def _rebuild_peer_died(message, rank, pid, host_ranks, missing):
    return PeerDied(message, rank, pid, host_ranks=host_ranks, missing=missing)


class RankFailed(RuntimeError):
    """A rank of a ``spawn`` failed: it raised, or it was killed by a signal.

    Attributes:
        rank: the global rank that failed.
        exc_type: the exception's type name (``None`` when killed by a signal).
        traceback: the remote traceback text ("" when killed by a signal).
        signal: the signal name (e.g. ``"SIGKILL"``) or ``None``.
        exitcode: the process exit code when known.
        error: the first line of the exception's own message ("" when unknown).

    ``message`` replaces the whole message; ``head`` only what it says before
    ``(exc_type=..., signal=...)`` and the remote traceback.
    """

    def __init__(self, rank: int, exc_type: str | None = None, traceback: str = "",
                 signal: str | None = None, exitcode: int | None = None,
                 message: str | None = None, *, head: str | None = None) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.traceback = traceback
        self.signal = signal
        self.exitcode = exitcode
        #: the first line of the exception's own message ("" when killed or unknown)
        self.error, more = _error_lines(traceback, exc_type) if exc_type else ("", [])
        if message is None:
            if head is not None:  # the first line the launcher words itself
                message = head
            elif signal is not None:
                message = (f"rank {rank} was killed by signal {signal}"
                           f" (exit code {exitcode}); no Python traceback is available")
            elif exc_type is not None:
                # a message of several lines (one per rank, say) keeps them all
                message = f"rank {rank} raised {exc_type}" + (f": {self.error}"
                                                              if self.error else "")
                message += "".join("\n" + line for line in more)
            else:
                message = f"rank {rank} exited with code {exitcode} without a result"
            if exc_type is None and signal is None:
                message += " (exc_type=None, signal=None)"
            else:
                message += f" (exc_type={exc_type}, signal={signal})"
            if traceback:
                message += "\n\n--- remote traceback of rank %d ---\n%s" % (rank, traceback.rstrip())
        super().__init__(message)

    def __reduce__(self):
        return (RankFailed, (self.rank, self.exc_type, self.traceback, self.signal,
                             self.exitcode, str(self)))


def _error_lines(traceback: str, exc_type: str, limit: int = 300,
                 max_more: int = 16) -> tuple[str, list[str]]:
    """The error's own message in a traceback's text: its first line (what follows
    ``<exc_type>: `` on the last such line), cut at ``limit`` characters ("" if none),
    and the lines after it (at most ``max_more``; a cut says how many were left out)."""
    lines = traceback.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        head, sep, text = lines[i].partition(": ")
        if sep and (head == exc_type or head.endswith("." + exc_type)):
            text = text.strip()
            more = [line[:limit] for line in lines[i + 1:]]
            if len(more) > max_more:
                more = more[:max_more] + [f"... {len(more) - max_more} more lines in the "
                                          f"remote traceback below"]
            return (text if len(text) <= limit else text[:limit - 3] + "..."), more
    return "", []


class RankStalled(ReduceStall, RankFailed):
    """``spawn``'s error when ranks stalled a collective round past its ``timeout``.

    Both a ``ReduceStall`` (``round``, ``missing``: the global ranks that never
    arrived, ``timeout``) and a ``RankFailed`` (``rank``: the first of them,
    ``exc_type="ReduceStall"``, ``signal``: how the launcher stopped it), so either
    ``except`` clause catches it. The missing ranks are the culprits: the launcher
    killed them; the ranks that waited for them were healthy. The message ends with
    ``(exc_type=ReduceStall, signal=...)`` as every ``RankFailed``'s does; ``why`` is
    the message without it.
    """

    def __init__(self, message: str, *, round: int, missing: tuple[int, ...],
                 timeout: float | None, signal: str | None = "SIGKILL") -> None:
        said = f" (exc_type=ReduceStall, signal={signal})"  # as every RankFailed says them
        #: the message without that suffix: what a command line prints
        self.why = message.removesuffix(said)  # (a pickled copy carries it already)
        message = self.why + said
        ReduceStall.__init__(self, message, round=round, missing=missing, timeout=timeout,
                             global_ranks=True)
        self.rank = self.missing[0] if self.missing else -1
        self.exc_type = "ReduceStall"
        self.traceback = ""
        self.signal = signal
        self.exitcode = None
        self.error = ""  # (its message says what it waited for; no rank's line to parse)

    def __reduce__(self):
        return (_rebuild_rank_stalled, (str(self), self.round, self.missing, self.timeout,
                                        self.signal))


def _rebuild_rank_stalled(message, round, missing, timeout, signal):
    return RankStalled(message, round=round, missing=missing, timeout=timeout, signal=signal)


class ShmSpaceError(MemoryError):
    """``/dev/shm`` cannot hold what the arena needs. The message names both sizes
    and the fix (a bigger ``--shm-size`` for containers)."""


class HandshakeRejected(ConnectionError):
    """The controller refused this host (world size, rank set, duplicate host...)."""


class StartRefused(ValueError):
    """The cohort cannot start as asked, and every rank finds so at the same point (ranks
    resuming from different checkpoints, a controller holding another round's outer
    momentum). Not a rank death for ``max_failures`` to tolerate: ``spawn`` stops the
    cohort at the first, with the message, which names the fix."""


class TrainingAborted(RuntimeError):
    """More ranks died than ``max_failures`` allows. The survivors saved a
    ``max_failure_exceeded`` checkpoint first (``checkpoint``); continue with
    ``Trainer.resume(save_path)``. ``result`` is the partial ``TrainResult``.

    The message is ``summary`` (what died and why, what was saved) followed by
    ``resume_hint`` (the API call that continues; empty without a checkpoint), so a
    command-line tool can print the first with its own way to continue."""

    def __init__(self, summary: str, result, resume_hint: str = "") -> None:
        super().__init__(f"{summary}\n{resume_hint}" if resume_hint else summary)
        self.summary = summary
        self.resume_hint = resume_hint
        self.result = result
        self.checkpoint = result.checkpoint
        self.dead_ranks = result.dead_ranks

    def __reduce__(self):  # pickles (a job system, a process pool) with its result
        return (TrainingAborted, (self.summary, self.result, self.resume_hint))


class SeriesInUse(RuntimeError):
    """Another run holds the checkpoint series this run would write
    (``checkpoint/run_lock.py``): two runs on one save path would overwrite each
    other's bundles. ``lock`` is the series' lock file, ``holder`` who holds it (pid,
    host and start time), ``job`` the holder's job identity and ``member`` its member of
    that job (a host's first rank; each None when not given)."""

    def __init__(self, lock: str, holder: str, job: str | None = None,
                 member: int | None = None) -> None:
        super().__init__(
            f"the checkpoint series of {lock.removesuffix('.lock')} is in use by another run "
            f"({holder}; lock file {lock}): two runs writing one series would overwrite each "
            f"other's checkpoints. Wait for that run to end or stop it, or give this run "
            f"another save path")
        self.lock = lock
        self.holder = holder
        self.job = job  # the holder's job identity, when it gave one
        self.member = member

    def __reduce__(self):
        return (SeriesInUse, (self.lock, self.holder, self.job, self.member))


def check_int(name: str, value, minimum: int, *, optional: bool = False,
              prefix: str = "") -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (numpy's too, not a bool
    or a str) of at least ``minimum`` (or None, when ``optional``); ``prefix`` leads the
    message (``"spawn: "``)."""
    import numbers

    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{prefix}{name} must be an int >= {minimum}"
                         f"{' or None' if optional else ''}, got {value!r}")


def check_flag(name: str, value) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is True or False (numpy's too): a
    string from a config file such as ``"False"`` would otherwise count as true."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")

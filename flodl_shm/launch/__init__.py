"""The launcher: ``spawn`` runs a function on N rank processes of this host, supervised.

(This package is ``launch``, not ``spawn``: a submodule named like the function would
replace ``flodl_shm.spawn`` by the module once imported.) Its modules:

- ``supervisor``: ``spawn`` and ``SpawnContext``, the launcher's side (below);
- ``rank``: a rank process's side, from its bootstrap to its last message;
- ``rank_server``: the ``"forkserver"`` start method's rank server, and when the
  launcher is safe to fork it from;
- ``listener_folder``: the folder of the rank server's socket, and the reaping of those
  a killed launcher left;
- ``stop_signals``: Ctrl-C and the terminating signals while ``spawn`` runs (the ranks
  stop first, then the signal acts);
- ``failure_budget``: the failure policy below as a value: whether the deaths so far
  stop the cohort, and the reasons the log gives;
- ``stall_watch``: the stall verdict below as a value: which live rank leaves the others
  waiting in a round, and when the launcher names it;
- ``rank_exit``: what a rank's exit means (ok, an error, a death; a cause or a casualty
  of a stop under way) and the error ``spawn`` raises for it.

The calling process becomes the **supervisor**: it owns the host arena (creates and
unlinks every shared-memory segment), starts the ranks, watches them, fences the
dead, and — on a cluster — hosts the relay to the controller. A monitor thread does
the watching, so ``spawn`` may be called from any thread and with ``join=False``; rank
processes are started from that thread (``PR_SET_PDEATHSIG`` is per thread) and every
one is reaped before ``spawn`` returns or raises.

Failure policy:

- a rank that raises, or dies by a signal, counts as a failure;
- up to ``max_failures`` failures are tolerated: the dead rank is fenced in the
  arena (survivors finish the round, and later ones, over realized work), its
  result is ``None``, and a ``RankDeathRecord`` is written next to ``save_path``;
- one more, and the cohort is stopped (waiting ranks raise ``CohortAborted``, busy
  ones get SIGTERM then SIGKILL), every segment is unlinked and ``spawn`` raises
  ``RankFailed`` for the first failure (rank, exception type, remote traceback,
  signal name);
- with a ``timeout``, a rank that leaves the others waiting in a round for longer
  is the culprit, not the waiters: the supervisor (which watches every rank's
  arrival and slice words) kills it and counts it as one failure — fenced within
  ``max_failures``, else the cohort stops and ``spawn`` raises ``RankStalled`` (a
  ``ReduceStall`` and a ``RankFailed``) naming the round and the missing ranks.
  Ranks get a later backstop deadline of their own (``timeout`` + ``stall_grace``)
  so the supervisor's verdict comes first;
- Ctrl-C / SIGTERM of the launcher stop every rank and clean up the same way
  (handlers are installed only when ``spawn`` runs on the main thread, before the
  arena exists); ranks still starting up are stopped at once, and every exit
  after an interrupt is its casualty (``spawn`` raises ``KeyboardInterrupt``).
  Ranks start with SIGINT blocked and ignore it (the launcher decides), and follow
  the launcher's death from their first line of Python (PDEATHSIG is set by a
  bootstrap before any import, not after the user's imports).

Start methods (``spawn(..., start_method=...)``; docs/runtime.md, "Start-up"):

- ``"forkserver"`` (the default on Linux): one **rank server** per ``spawn`` loads
  torch, numpy, numba, this package and the kernels once, on its one thread, then
  forks every rank. Where it comes from:

  * **forked from the launcher** when that is safe: at ``spawn``'s entry the calling
    thread is the main thread and the process runs no other thread but OpenBLAS's
    pool (which OpenBLAS itself shuts down around a fork) - no user thread, no torch
    OpenMP (intra-op) or inter-op pool, no CUDA runtime - as in a script that has
    imported torch and this package and run no torch operation yet. The server then
    already holds what the launcher imported and only loads the kernels, and its
    ranks hold the launcher's main module as it was at ``spawn`` (nothing imported
    again). ``FLODL_SHM_FORK_SERVER=0`` turns this off;
  * else **a fresh interpreter** with the ranks' bootstrap, started from the
    supervisor thread, that imports torch itself (with ``OMP_NUM_THREADS`` set to the
    ranks' thread count first, so not even OpenBLAS starts a pool) and never runs a
    torch operation. Each rank still imports the launcher's main module as
    ``__mp_main__`` and unpickles ``fn`` as under "spawn".

  Either way the programs that work under "spawn" work unchanged, and the server is
  single-threaded when it forks. The chain of deaths holds: the server follows the
  thread that started it (PDEATHSIG: the launcher's main thread, or the supervisor
  thread), each rank follows the server from the instant it is forked; the server
  ignores SIGINT, as do the ranks; it is killed and reaped once every rank is.
- ``"spawn"``: every rank is a fresh interpreter that imports torch, numba and the
  kernels itself (the launcher compiles or loads them first, so ranks only read
  numba's cache): the slowest start, the fewest assumptions.
- ``"fork"``: ranks fork from the launcher's supervisor thread. Fastest, and unsafe
  once the launcher has run torch operations (its OpenMP pool does not survive a
  fork; GNU OpenMP may deadlock in the child) or started threads of its own.
"""
from __future__ import annotations

from .rank import RankContext, rank_logs_forwarded
from .stall_watch import STALL_POLL_S, stall_grace
from .supervisor import ABORT_GRACE_S, TERM_GRACE_S, SpawnContext, spawn

__all__ = ["ABORT_GRACE_S", "STALL_POLL_S", "TERM_GRACE_S", "RankContext", "SpawnContext",
           "rank_logs_forwarded", "spawn", "stall_grace"]

"""The launcher: ``spawn`` runs a function on N rank processes of this host, supervised.

(This module is ``launch``, not ``spawn``: a submodule named like the function would
replace ``flodl_shm.spawn`` by the module once imported.)

The calling process becomes the **supervisor**: it owns the host arena (creates and
unlinks every shared-memory segment), starts the ranks, watches them, fences the
dead, and — on a cluster — hosts the relay to the controller. A monitor thread does the watching, so ``spawn`` may be called from
any thread and with ``join=False``; rank processes are started from that thread
(``PR_SET_PDEATHSIG`` is per thread) and every one is reaped before ``spawn``
returns or raises.

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

import io
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing import process as mp_process
from multiprocessing import forkserver, popen_forkserver, popen_spawn_posix
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any, Callable, Sequence

from .engine import arena as A
from .errors import CohortAborted, RankFailed, RankStalled, ReduceStall
from .engine.checkpoint_tap import TapServer
from .engine.hostmem import host_memory
from .engine.segment import reap_dead_owner_segments, space_error
from .engine.waiting import Doorbell, available_cores

logger = logging.getLogger("flodl_shm")

ABORT_GRACE_S = 2.0   # voluntary exit after the abort flag, before SIGTERM
TERM_GRACE_S = 5.0    # after SIGTERM, before SIGKILL
STALL_POLL_S = 0.5    # the supervisor's longest look-away from the control block


def stall_grace(timeout: float) -> float:
    """Seconds a rank's own collective deadline trails the supervisor's stall verdict
    (``timeout``): time to notice, kill the culprit and fence it before any waiter
    gives up by itself. A rank still starting up (not yet in ``fn``: importing torch
    on a busy host) is given half of it on top of ``timeout`` before it is blamed."""
    return max(10.0, float(timeout))


@dataclass
class RankContext:
    """What ``fn`` receives as its first argument in each rank."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    comm: Any
    save_path: str | None = None

    def __repr__(self) -> str:
        return (f"RankContext(rank={self.rank}, local_rank={self.local_rank}, "
                f"world_size={self.world_size}, local_world_size={self.local_world_size})")


@dataclass
class _Outcome:
    kind: str                     # "ok" | "error" | "died"
    value: Any = None
    exc_type: str | None = None
    tb: str = ""
    exitcode: int | None = None
    signal: str | None = None
    when: float = 0.0


def _failure_error(global_rank: int, out: "_Outcome", msg: tuple | None) -> RankFailed:
    """The error ``spawn`` raises for rank ``global_rank``'s failure: a ``RankStalled``
    when the rank gave up waiting on ranks that never came (its own backstop deadline),
    else a ``RankFailed``."""
    stall = msg[3] if msg is not None and msg[0] == "error" and len(msg) > 3 else None
    if stall and stall["missing"] and all(isinstance(m, int) for m in stall["missing"]):
        return RankStalled(f"rank {global_rank} gave up waiting: {stall['text']}",
                           round=int(stall["round"]), missing=tuple(stall["missing"]),
                           timeout=stall["timeout"], signal=None)
    return RankFailed(global_rank, out.exc_type, out.tb, out.signal, out.exitcode)


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _main_file() -> str | None:
    """The launcher's main script, or None when ``__main__`` has no file a rank could
    import (``python -c``, ``python -`` reading stdin, an interactive session)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    if not os.path.isabs(path) and mp_process.ORIGINAL_DIR is not None:
        path = os.path.join(mp_process.ORIGINAL_DIR, path)
    return path if os.path.isfile(path) else None


def _check_picklable(fn: Callable, args: Sequence) -> bytes:
    if getattr(fn, "__module__", None) == "__main__" and _main_file() is None:
        raise TypeError(
            f"spawn: fn {getattr(fn, '__qualname__', fn)!r} is defined in a __main__ that "
            f"has no file (python -c, python - reading stdin, or an interactive session), "
            f"which the ranks cannot import; put it in a script file or a module"
        )
    try:
        return pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # pickle raises several types
        raise TypeError(
            f"spawn: fn and args must be picklable to reach the spawned ranks, but pickling "
            f"failed: {type(e).__name__}: {e}. Define fn at module top level (lambdas and "
            f"local functions cannot be pickled) and pass picklable arguments."
        ) from e


# --- the rank side -----------------------------------------------------------------


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _send(conn, msg: tuple) -> None:
    """Rank -> launcher message, pickled by value with the standard pickler.

    ``Connection.send`` uses multiprocessing's ForkingPickler, for which torch
    registers reductions that ship tensors as shared-memory handles; those die with
    the rank process, so a returned tensor would arrive dangling. Plain pickle copies
    the data.
    """
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


class _PipeLogHandler(logging.Handler):
    """Rank side: forward flodl_shm's records (INFO+, or the launcher's level when lower)
    to the launcher, which logs them under its own handlers as "rank N: ...".

    This is the ranks' one way to log: code running in a rank must not add handlers
    of its own to ``flodl_shm`` (each line would print twice); ``rank_logs_forwarded``
    tells it that this handler is there."""

    def __init__(self, conn, send_lock: threading.Lock, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.conn = conn
        self.send_lock = send_lock  # not ``lock``: that is logging.Handler's own RLock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            with self.send_lock:
                _send(self.conn, ("log", record.levelno, text))
        except Exception:  # a closed pipe at exit must never raise into the rank
            pass


class _Terminated(BaseException):
    """Raised in a rank by SIGTERM from the supervisor."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def rank_logs_forwarded() -> bool:
    """True in a ``spawn`` rank, whose ``flodl_shm`` records already reach the
    launcher's handlers: adding a handler there would print each line twice."""
    return any(isinstance(h, _PipeLogHandler) for h in logging.getLogger("flodl_shm").handlers)


def _forward_level() -> int:
    """The level ranks forward at: INFO, or lower when the launcher logs lower."""
    return min(logging.INFO, logging.getLogger("flodl_shm").getEffectiveLevel())


def _error_message(global_rank: int, first_rank: int, e: BaseException) -> tuple:
    """The ("error", ...) message of a rank whose function raised ``e``; a
    ``ReduceStall`` also carries its round, missing ranks (global) and timeout."""
    msg = ("error", type(e).__name__, traceback.format_exc())
    if isinstance(e, ReduceStall):
        missing = [first_rank + m if isinstance(m, int) else m for m in e.missing]
        msg += ({"round": e.round, "missing": missing, "timeout": e.timeout,
                 "text": str(e)},)
    return msg


def _torch_distributed_env() -> dict[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT`` for ranks that call ``dist.init_process_group`` with
    ``env://`` (e.g. backend ``"flodl_shm"``): a loopback port free now, which rank 0's
    store binds when a group is created."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _rank_main(handle: A.ArenaHandle, local_rank: int, global_rank: int, world_size: int,
               payload: bytes, conn, parent_pid: int, timeout: float | None,
               save_path: str | None, threads: int, pinned_decode: bool,
               log_level: int = logging.INFO, c10d_env: dict | None = None) -> None:
    """Entry point of a rank process (runs under multiprocessing's spawn)."""
    _set_pdeathsig()
    if os.getppid() != parent_pid:  # the launcher died before we could ask to follow it
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # ignored from now on
    os.environ.update({
        "RANK": str(global_rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(handle.world),
    })
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if forkserver.get_inherited_fds() is not None and "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # forked from the rank server: fresh entropy,
        # as a spawned rank's numpy has (Python's random reseeds itself at fork)
    for key, value in (c10d_env or {}).items():  # the caller's own MASTER_* win
        os.environ.setdefault(key, value)
    code = 0
    comm = None
    send_lock = threading.Lock()
    handler = _PipeLogHandler(conn, send_lock, log_level)
    lib_logger = logging.getLogger("flodl_shm")
    for inherited in list(lib_logger.handlers):  # a forked rank has the launcher's: its
        lib_logger.removeHandler(inherited)      # records reach them through the pipe
    lib_logger.addHandler(handler)
    lib_logger.propagate = False  # the launcher's handlers print it, not the rank's root
    if lib_logger.level == logging.NOTSET or lib_logger.level > log_level:
        lib_logger.setLevel(log_level)
    signal.signal(signal.SIGTERM, _on_sigterm)  # SIGTERM now ends fn cleanly (_Terminated)
    try:
        import torch

        torch.set_num_threads(threads)
        from .engine.arena import Arena
        from .engine.comm import Comm

        def liveness() -> None:
            if os.getppid() != parent_pid:
                raise CohortAborted(f"the launcher (pid {parent_pid}) died; rank {global_rank} "
                                    f"stops")

        from .engine.hostmem import host_memory

        memory = host_memory()  # before the run's own working set (the staging gate)
        arena = Arena.attach(handle)
        comm = Comm(arena, local_rank, global_rank=global_rank, world_size=world_size,
                    timeout=timeout, liveness=liveness, memory=memory)
        comm.set_pinned_decode(pinned_decode)
        fn, args = pickle.loads(payload)
        ctx = RankContext(global_rank, local_rank, world_size, handle.world, comm, save_path)
        with send_lock:
            _send(conn, ("running",))  # start-up is over: stall clocks apply in full, and
            # a stop grants fn a grace before SIGTERM
        result = fn(ctx, *args)
        lib_logger.removeHandler(handler)
        try:
            with send_lock:
                _send(conn, ("ok", result))
        except Exception as e:  # the result did not pickle
            _send(conn, ("error", type(e).__name__,
                       f"rank {global_rank} returned a value that cannot be sent back to the "
                       f"launcher: {type(e).__name__}: {e}\n" + traceback.format_exc()))
            code = 1
    except _Terminated:
        code = 143
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        code = 1
        lib_logger.removeHandler(handler)
        try:
            with send_lock:
                _send(conn, _error_message(global_rank, global_rank - local_rank, e))
        except Exception:
            pass
    finally:
        try:
            conn.close()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (no atexit surprises in ranks)


# --- starting a rank ------------------------------------------------------------------

# Runs first in a rank process, before multiprocessing imports the launcher's main module
# and this package (seconds on a busy host): follow the launcher's death (PDEATHSIG, or
# exit if it is already gone) and ignore SIGINT, which the forking thread blocked so
# that a Ctrl-C during the interpreter's own start-up cannot reach it either.
_BOOTSTRAP = ("import os, signal, ctypes; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0); "
              "os.getppid() == {ppid} or os._exit(1); ")


def _child_data(popen, process_obj) -> io.BytesIO:
    """What multiprocessing writes to a new child: its preparation data and the process
    object, pickled with ``popen`` as the spawning popen (fds it duplicates)."""
    fp = io.BytesIO()
    data = mp_spawn.get_preparation_data(process_obj._name)
    if "init_main_from_path" in data and _main_file() is None:
        # a main read from stdin: a rank would fail to import "<stdin>"; fn is not in it
        # (``_check_picklable``), so the rank needs no main module
        del data["init_main_from_path"]
    mp_context.set_spawning_popen(popen)
    try:
        mp_reduction.dump(data, fp)
        mp_reduction.dump(process_obj, fp)
    finally:
        mp_context.set_spawning_popen(None)
    return fp


class _RankPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn launch with ``_BOOTSTRAP`` ahead of its ``spawn_main``
    (same pipes, same preparation data; only the ``-c`` program gains a prefix)."""

    def _launch(self, process_obj):  # mirrors popen_spawn_posix.Popen._launch
        from multiprocessing import resource_tracker

        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        fp = _child_data(self, process_obj)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = mp_spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            i = cmd.index("-c") + 1
            cmd[i] = _BOOTSTRAP.format(ppid=os.getpid()) + cmd[i]
            self._fds.extend([child_r, child_w])
            # the child inherits this mask through exec: SIGINT stays pending until the
            # bootstrap ignores it (blocked here, at the last moment, because starting
            # the resource tracker above unblocks SIGINT in the calling thread)
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
            try:
                self.pid = mp_util.spawnv_passfds(mp_spawn.get_executable(), cmd, self._fds)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = mp_util.Finalize(
                self, mp_util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _RankProcess(mp_context.SpawnProcess):
    """A spawn-method process started through ``_RankPopen`` (Linux)."""

    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


def _process_class(start_method: str):
    """The Process class for ranks: on Linux (where ``-c`` command lines and prctl
    exist) the bootstrapped one for "spawn" and the rank server's for "forkserver";
    elsewhere the context's own, and spawned ranks for "forkserver" (a rank forked by
    multiprocessing's own server would fail its parent check)."""
    if sys.platform.startswith("linux") and not getattr(sys, "frozen", False):
        if start_method == "spawn":
            return _RankProcess
        if start_method == "forkserver":
            return _ServedRankProcess
    if start_method == "forkserver":
        return mp.get_context("spawn").Process
    return mp.get_context(start_method).Process


# --- the rank server ("forkserver"; why forking from it is safe: module docstring) -----


def _rank_server_main(listener_fd: int, alive_r: int, nprocs: int, threads: int) -> None:
    """The fresh rank server's program: on its one thread, import torch, numpy, numba
    and what a rank runs, load (or compile once) the kernels, run no torch operation;
    then serve forks (multiprocessing's forkserver loop). Started with SIGINT ignored
    and blocked, and PDEATHSIG set, by ``_BOOTSTRAP``."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # before torch/numpy load
    import numpy  # noqa: F401
    import torch  # noqa: F401

    _serve_ranks(listener_fd, alive_r, nprocs)


def _serve_ranks(listener_fd: int, alive_r: int, nprocs: int) -> None:
    """A rank server's common part: load the kernels and what every rank imports
    first, then serve forks until the launcher closes ``alive_r``; every child follows
    the server's death from the instant it is forked (an at-fork hook, before it
    imports the launcher's main module)."""
    _warm_kernels(nprocs)
    from .engine import comm as _comm  # noqa: F401 - what every rank imports first

    server_pid = os.getpid()

    def follow_server() -> None:  # in each child, right after the fork
        _set_pdeathsig()
        if os.getppid() != server_pid:
            os._exit(1)

    os.register_at_fork(after_in_child=follow_server)
    forkserver.main(listener_fd, alive_r, [], None, None)


_OPENBLAS_THREADS = ("openblas_get_num_threads", "openblas_get_num_threads64_",
                     "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads")


def _openblas_workers() -> int:
    """Worker threads of the OpenBLAS pools running in this process (numpy's starts one
    at import: its ``num_threads - 1`` workers; scipy's, which numba loads, another).
    OpenBLAS shuts its pool down before every fork (its own ``pthread_atfork``
    handler) and restarts it only when next needed, so these threads are safe to fork
    past, and a pool that is down has none: a library counts only while its
    ``blas_server_avail`` flag is set. 0 for a library it cannot ask."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            fields = [line.split() for line in f if "openblas" in line.lower()]
    except OSError:
        return 0
    paths = {parts[-1] for parts in fields if parts[-1].startswith("/")}
    workers = 0
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, no new init
        except OSError:
            continue
        try:
            if not ctypes.c_int.in_dll(lib, "blas_server_avail").value:
                continue  # the pool is down (after a fork, until its next use)
        except ValueError:
            pass  # a build that does not export the flag: count its configured pool
        for name in _OPENBLAS_THREADS:
            get = getattr(lib, name, None)
            if get is not None:
                workers += max(int(get()) - 1, 0)
                break
    return workers


def _fork_safe() -> bool:
    """Whether forking this process now is safe: the calling thread is the main thread
    and the only thread besides OpenBLAS's pool (``_openblas_workers``): no user thread,
    no torch OpenMP (intra-op) or inter-op pool, no CUDA runtime (their threads would
    count), as when a script has imported torch and this package but run no torch
    operation yet."""
    if not _only_python_thread():
        return False
    native = _native_threads(os.getpid())  # 0: unreadable, so not known to be safe
    return native == 1 or (native > 1 and native == 1 + _openblas_workers())


def _fork_safe_soon(checks: int = 5, pause_s: float = 0.004) -> bool:
    """``_fork_safe``, asked again a few times over a few milliseconds while this is
    the only Python thread: a thread an earlier ``spawn`` joined can still be in its
    native exit for a moment after ``join`` returns."""
    for _ in range(checks - 1):
        if _fork_safe():
            return True
        if not _only_python_thread():
            return False  # a Python thread does not go away by waiting
        time.sleep(pause_s)
    return _fork_safe()


def _only_python_thread() -> bool:
    """The caller is the main thread and Python runs no other thread."""
    return (threading.current_thread() is threading.main_thread()
            and threading.active_count() == 1)


def _native_threads(pid: int) -> int:
    """Native threads of process ``pid`` (Linux), 0 when it cannot be read."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


class _RankServer(forkserver.ForkServer):
    """One rank server per ``SpawnContext``, stopped once every rank is reaped: forked
    from the launcher when that is safe (``fork_from_launcher``), else a fresh
    interpreter started from the supervisor thread (``start``; its PDEATHSIG follows
    that thread)."""

    @classmethod
    def fork_from_launcher(cls, nprocs: int) -> "_RankServer | None":
        """A server forked from this process, or None when forking it is not safe
        (``_fork_safe``) or ``FLODL_SHM_FORK_SERVER=0``: the supervisor then starts a
        fresh one. Forked, the server already holds everything the launcher imported
        (torch, this package) and only loads the kernels: the second ``import torch`` of
        the start-up is gone (docs/runtime.md, "Start-up"). Its PDEATHSIG follows the
        main thread, which outlives every rank (the interpreter waits for its threads
        there)."""
        if os.environ.get("FLODL_SHM_FORK_SERVER", "1") == "0":
            logger.debug("rank server: a fresh interpreter (FLODL_SHM_FORK_SERVER=0)")
            return None
        if not _fork_safe_soon():
            logger.debug("rank server: a fresh interpreter (the launcher runs %d Python "
                         "threads, %d native threads besides its OpenBLAS workers)",
                         threading.active_count(),
                         _native_threads(os.getpid()) - _openblas_workers())
            return None
        server = cls()
        server._fork(nprocs)
        logger.debug("rank server: forked from the launcher (pid %d)", server._forkserver_pid)
        return server

    def _fork(self, nprocs: int) -> None:
        launcher = os.getpid()

        def fork_server(listener_fd: int, alive_r: int, alive_w: int) -> int:
            sys.stdout.flush()  # else the children inherit (and print again) our buffers
            sys.stderr.flush()
            # SIGINT/SIGTERM blocked across the fork: the child sets its own dispositions
            # (SIGINT ignored and kept blocked, as in a fresh server) before it unblocks
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
            try:
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        os.close(alive_w)
                        _set_pdeathsig()
                        if os.getppid() != launcher:
                            os._exit(1)
                        signal.signal(signal.SIGINT, signal.SIG_IGN)
                        signal.signal(signal.SIGTERM, signal.SIG_DFL)
                        signal.pthread_sigmask(signal.SIG_SETMASK,
                                               (set(old_mask) | {signal.SIGINT})
                                               - {signal.SIGTERM})
                        _serve_ranks(listener_fd, alive_r, nprocs)
                        code = 0
                    except SystemExit:  # the launcher closed alive_w: the normal end
                        code = 0
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        os._exit(code)  # never return into the launcher's program
                return pid
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

        self._open(fork_server)

    def start(self, nprocs: int, threads: int) -> None:
        def spawn_server(listener_fd: int, alive_r: int, alive_w: int) -> int:
            cmd = (_BOOTSTRAP.format(ppid=os.getpid())
                   + f"import sys; sys.path[:] = {sys.path!r}; "
                   + "from flodl_shm.launch import _rank_server_main; "
                   + f"_rank_server_main({listener_fd}, {alive_r}, {nprocs}, {threads})")
            exe = mp_spawn.get_executable()
            args = [exe] + mp_util._args_from_interpreter_flags() + ["-c", cmd]
            # blocked at the fork (the resource tracker unblocks it in this thread): the
            # server, and every rank it forks, starts with SIGINT blocked
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
            try:
                return mp_util.spawnv_passfds(exe, args, [listener_fd, alive_r])
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

        self._open(spawn_server)

    def _open(self, start_server: Callable[[int, int, int], int]) -> None:
        """Listen on a fresh socket and make the alive pipe, then start the server with
        ``start_server(listener_fd, alive_r, alive_w) -> pid``; keep the launcher's
        ends (the server's are closed here)."""
        import socket
        from multiprocessing import connection, resource_tracker

        resource_tracker.ensure_running()  # a process, not a thread: ranks share it
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                pid = start_server(listener.fileno(), alive_r, alive_w)
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w
        self._forkserver_pid = pid

    def ensure_running(self) -> None:  # called by connect_to_new_process
        if self._forkserver_pid is None:
            raise RuntimeError("the rank server is not running")
        pid, status = os.waitpid(self._forkserver_pid, os.WNOHANG)
        if pid:
            self._forkserver_pid = None
            raise _server_died(os.waitstatus_to_exitcode(status))

    def kill(self) -> None:
        """SIGKILL the server now (``stop`` reaps it); the ranks it forked follow it."""
        pid = self._forkserver_pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Kill and reap the server (every rank it forked is reaped already)."""
        self.kill()
        pid, self._forkserver_pid = self._forkserver_pid, None
        if self._forkserver_alive_fd is not None:
            os.close(self._forkserver_alive_fd)
            self._forkserver_alive_fd = None
        if pid is not None:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if self._forkserver_address:
            try:
                os.unlink(self._forkserver_address)
            except OSError:
                pass
            self._forkserver_address = None


class _ServedRankPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver launch, asking this run's ``_RankServer``."""

    def _launch(self, process_obj):  # mirrors popen_forkserver.Popen._launch
        buf = _child_data(self, process_obj)
        self.sentinel, w = process_obj._rank_server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = mp_util.Finalize(self, mp_util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        try:
            self.pid = forkserver.read_signed(self.sentinel)
        except EOFError:  # the server died before forking this rank
            raise _server_died(None) from None


def _server_died(exitcode: int | None) -> RuntimeError:
    return RuntimeError(
        f"spawn: the rank server exited (exit code {exitcode}) before forking every rank: "
        f"its preload of torch, numpy, numba and flodl_shm failed (its traceback is on "
        f"stderr); fix that import, or pass start_method='spawn'")


class _ServedRankProcess(mp_context.ForkServerProcess):
    """A rank forked by the run's ``_RankServer`` (set as ``_rank_server`` before
    ``start``; not pickled to the rank)."""

    _rank_server: _RankServer | None = None

    @staticmethod
    def _Popen(process_obj):
        return _ServedRankPopen(process_obj)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_rank_server", None)
        return state


# --- the supervisor side -----------------------------------------------------------


def _warm_kernels(nprocs: int) -> None:
    """Compile (or load) every kernel here, once, so ranks only read numba's cache."""
    from .kernels import cma, outer_step, permutation, rounds, signals, tensorio, warm_up

    warm_up(max_sources=max(4, nprocs))
    for module in (signals, rounds, tensorio, outer_step, permutation, cma):
        module.warm_up()


class SpawnContext:
    """A running ``spawn``: ``join()`` for the results, ``pids()``, ``terminate()``."""

    def __init__(self, fn, nprocs: int, args: Sequence, *, world_size: int, first_rank: int,
                 max_failures: int, timeout: float | None, save_path: str | None,
                 start_method: str, eager_bytes: int, relay_factory,
                 pinned_decode: bool = True, interrupts: "_InterruptGate | None" = None) -> None:
        self.nprocs = nprocs
        self.pinned_decode = pinned_decode
        self.world_size = world_size
        self.first_rank = first_rank
        self.max_failures = max_failures
        self.timeout = timeout
        # the ranks' own deadline: a backstop behind the supervisor's stall verdict
        self._rank_timeout = None if timeout is None else timeout + stall_grace(timeout)
        #: on a cluster, the round deadline this host announces to the controller: after
        #: the supervisor fences a local culprit (``timeout``), before the ranks give up
        self.cluster_round_timeout = (None if timeout is None
                                      else timeout + stall_grace(timeout) / 2)
        self.save_path = save_path
        self._payload = _check_picklable(fn, args)
        self._mp = mp.get_context(start_method)
        self._process_cls = _process_class(start_method)
        self._log_level = _forward_level()
        # single host: ranks may also call dist.init_process_group("flodl_shm") (env://)
        self._c10d_env = None if relay_factory is not None else _torch_distributed_env()
        self._running: dict[int, float] = {}  # local rank -> when it entered fn
        self._stalled: dict[int, str] = {}   # local culprits killed for a stall -> why
        self._stall_clock: tuple | None = None  # ((phase, round), first seen) of a wait
        self._outcomes: dict[int, _Outcome] = {}
        self._procs: list = []
        self._failure: RankFailed | None = None
        self._cohort_dead: set[int] = set()  # global ranks the controller declared dead
        self._interrupted = False
        self._started = threading.Event()
        self._done = threading.Event()
        self._start_error: BaseException | None = None
        self._lock = threading.Lock()
        # the rank server forks from here while this is still the only thread (before
        # the tap and supervisor threads start); else the supervisor starts a fresh one
        self._server: _RankServer | None = (_RankServer.fork_from_launcher(nprocs)
                                            if self._process_cls is _ServedRankProcess
                                            else None)
        try:
            self._setup(nprocs, eager_bytes, relay_factory, interrupts)
        except BaseException:
            if self._server is not None:
                self._server.stop()
            raise

    def _setup(self, nprocs: int, eager_bytes: int, relay_factory,
               interrupts: "_InterruptGate | None") -> None:
        """Create the arena and the tap, start the supervisor, wait for the ranks."""
        reap_dead_owner_segments()
        if self._process_cls is not _ServedRankProcess:
            _warm_kernels(nprocs)  # else the rank server loads them, in parallel with us
        with _signals_deferred():  # an interrupt now finds the arena owned by a context
            self.arena = A.Arena.create(nprocs, eager_bytes=eager_bytes,
                                        first_rank=self.first_rank,
                                        global_world=self.world_size,
                                        relay=relay_factory is not None,
                                        direct=self.max_failures == 0)
            try:
                self._doorbell = Doorbell(self.arena.ctl)
                self.tap = TapServer(self.arena)  # the consensus-checkpoint forge of this host
            except BaseException:
                self.arena.unlink()
                self.arena.close()
                raise
            self._relay = None
            self._relay_factory = relay_factory
            if interrupts is not None:
                interrupts.ctx = self
        self._monitor = threading.Thread(target=self._monitor_main, name="flodl-shm-supervisor",
                                         daemon=True)
        self._monitor.start()
        self._started.wait()
        if self._start_error is not None:
            self._monitor.join()
            raise self._start_error

    # -- public ------------------------------------------------------------------
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def relay_stats(self) -> dict[str, int] | None:
        """This host's relay counters so far (``None`` on a single host): ``rounds``
        relayed, frame payload bytes shipped up (``bytes_up``) and received down
        (``bytes_down``)."""
        relay = self._relay
        if relay is None:
            return None
        return {"rounds": relay.rounds, "bytes_up": relay.bytes_up,
                "bytes_down": relay.bytes_down}

    def join(self, timeout: float | None = None) -> list[Any] | None:
        """Wait for every rank; results by local rank (``None`` for dead ranks).

        Returns ``None`` if ``timeout`` expired first. Raises ``RankFailed`` when
        more than ``max_failures`` ranks failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.1):
            if deadline is not None and time.monotonic() >= deadline:
                return None
        self._monitor.join()
        relay_error = None if self._relay is None else self._relay.error
        if relay_error is not None:
            # the host's link to the cohort failed: that, not its consequences, is the news
            if isinstance(relay_error, ReduceStall):
                raise relay_error
            raise ConnectionError(f"this host's relay failed: {relay_error}") from relay_error
        if self._failure is not None:
            raise self._failure
        if self._interrupted:
            raise KeyboardInterrupt("flodl_shm.spawn: interrupted; every rank was stopped")
        return [self._outcomes[r].value if self._outcomes[r].kind == "ok" else None
                for r in range(self.nprocs)]

    def terminate(self, reason: int = A.ABORT_INTERRUPT) -> None:
        """Stop every rank (abort flag, then SIGTERM, then SIGKILL) and clean up.

        With ``ABORT_INTERRUPT`` (the default) and no failure before it, ``join``
        raises ``KeyboardInterrupt`` and no rank's exit counts as a failure. A no-op
        once every rank is reaped."""
        if self._done.is_set():
            return
        with self._lock:
            if reason == A.ABORT_INTERRUPT and self._failure is None:
                self._interrupted = True
        self._abort(reason)

    # -- monitor thread --------------------------------------------------------------
    def _monitor_main(self) -> None:
        conns = {}
        # Ranks inherit the starting thread's signal mask: SIGINT stays blocked in them
        # until they ignore it (a Ctrl-C is the launcher's to handle). "spawn" ranks
        # are also covered by _RankPopen; this covers the other start methods.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        try:
            try:
                threads = max(1, available_cores() // self.nprocs)
                parent_pid = os.getpid()
                if self._process_cls is _ServedRankProcess:
                    if self._server is None:
                        self._server = _RankServer()
                        self._server.start(self.nprocs, threads)
                    parent_pid = self._server._forkserver_pid  # the ranks' parent
                for r in range(self.nprocs):
                    if self.arena.ctl[A.G_ABORT]:
                        break  # interrupted while starting: start no more
                    parent_conn, child_conn = self._mp.Pipe(duplex=False)
                    p = self._process_cls(
                        target=_rank_main, name=f"flodl-shm-rank{self.first_rank + r}",
                        args=(self.arena.handle, r, self.first_rank + r, self.world_size,
                              self._payload, child_conn, parent_pid, self._rank_timeout,
                              self.save_path, threads, self.pinned_decode, self._log_level,
                              self._c10d_env),
                        daemon=False)
                    p._rank_server = self._server
                    try:
                        p.start()
                    except Exception:
                        parent_conn.close()
                        child_conn.close()
                        if self.arena.ctl[A.G_ABORT]:
                            break  # stopped while the rank server preloaded (_abort)
                        raise
                    child_conn.close()
                    self._procs.append(p)
                    conns[r] = parent_conn
                if self._server is not None and self._procs:
                    n = _native_threads(self._server._forkserver_pid)  # done forking now
                    if n > 1:
                        logger.warning(
                            "the rank server ran %d threads while forking ranks (expected 1: "
                            "a library it preloads started a pool; forking a threaded process "
                            "risks deadlocks in the ranks); pass start_method='spawn' if "
                            "ranks hang at start-up", n)
                if self._relay_factory is not None:
                    self._relay = self._relay_factory(self)
                    self.tap.forward = self._relay.forward
            except BaseException as e:
                self._start_error = e
                self._abort(A.ABORT_SHUTDOWN)
                return
            finally:
                self._started.set()
            self._watch(conns)
        finally:
            self._reap_all()
            for c in conns.values():
                c.close()
            if self._server is not None:
                self._server.stop()
            self._cleanup()
            self._done.set()

    def _watch(self, conns: dict) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        pending: dict[int, tuple] = {}
        live = set(range(len(self._procs)))
        poll = STALL_POLL_S if self.timeout is None else min(STALL_POLL_S,
                                                             max(0.01, self.timeout / 10))
        while live:
            ready = mpc.wait(list(conns.values()) + list(sentinels), timeout=poll)
            for obj in ready:
                r = sentinels.get(obj)
                if r is None:
                    r = next(k for k, c in conns.items() if c is obj)
                    try:
                        msg = _recv(obj)
                    except (EOFError, OSError):
                        conns.pop(r).close()
                        continue
                    if msg[0] == "log":
                        self._rank_log(r, msg)
                        continue
                    if msg[0] == "running":
                        self._running[r] = time.monotonic()
                        continue
                    pending[r] = msg
                    conns.pop(r).close()
                    continue
                # process r exited: drain what it may still have in the pipe
                c = conns.pop(r, None)
                if c is not None:
                    try:
                        while c.poll(0.5 if r not in pending else 0):
                            msg = _recv(c)
                            if msg[0] == "log":
                                self._rank_log(r, msg)
                            elif msg[0] != "running":
                                pending[r] = msg
                    except (EOFError, OSError):
                        pass
                    c.close()
                self._procs[r].join()
                sentinels.pop(obj)
                live.discard(r)
                self._record_exit(r, pending.get(r))
            if self._relay is not None and self._relay.failed() and live:
                self._abort(A.ABORT_SHUTDOWN)
            if self.timeout is not None and live:
                self._check_stall(live)

    def _check_stall(self, live: set[int]) -> None:
        """Find the rank(s) that leave others waiting in a round past ``timeout``.

        A live rank whose arrival word is behind another live rank's is missing from
        the round that rank waits in (a round cannot complete without a live rank);
        in a bulk round whose slices are being reduced, a live rank that has not
        published its slice while another has is missing likewise. The clock of a
        wait starts when the supervisor first sees it (within ``poll`` of the
        waiter's own start), so the culprit is named at ``timeout`` plus at most one
        poll; for a rank that entered ``fn`` after the wait began, from then on. A
        rank still starting up is named after ``timeout`` + ``stall_grace / 2``. The
        waiters' own deadline trails by ``stall_grace``."""
        ctl = self.arena.ctl
        if ctl[A.G_ABORT]:
            return
        alive = [r for r in live if not ctl[A.rank_base(r) + A.R_DEAD] and r not in self._stalled]
        if len(alive) < 2:
            self._stall_clock = None
            return
        arrived = {r: int(ctl[A.rank_base(r) + A.R_ARRIVED]) for r in alive}
        front = max(arrived.values())
        behind = [r for r in alive if arrived[r] < front]
        phase = "arrive"
        if not behind:
            done = {r: int(ctl[A.rank_base(r) + A.R_DONE]) for r in alive}
            if max(done.values()) == front:  # a bulk round's slices are being reduced
                behind = [r for r in alive if done[r] < front]
                phase = "reduce"
        if not behind:
            self._stall_clock = None
            return
        now = time.monotonic()
        key = (phase, front)
        if self._stall_clock is None or self._stall_clock[0] != key:
            self._stall_clock = (key, now)
            return
        since = self._stall_clock[1]
        starting = since + self.timeout + stall_grace(self.timeout) / 2
        culprits = [r for r in behind
                    if (r in self._running and now - max(since, self._running[r]) >= self.timeout)
                    or (r not in self._running and now >= starting)]
        if culprits:
            self._fence_stalled(front, phase, culprits, [r for r in alive if r not in behind])

    def _fence_stalled(self, rnd: int, phase: str, culprits: list[int],
                       waiters: list[int]) -> None:
        """Kill the ranks that stalled round ``rnd``; they count as failures."""
        missing = tuple(self.first_rank + r for r in culprits)
        waiting = [self.first_rank + r for r in waiters]
        what = "arrive at" if phase == "arrive" else "reduce its slice of"
        why = (f"round {rnd} stalled: rank(s) {list(missing)} did not {what} the round within "
               f"the {self.timeout:g} s collective timeout while rank(s) {waiting} waited for "
               f"them; the launcher killed the missing rank(s) (alive but silent: stuck outside "
               f"the collective, or wedged)")
        stall = RankStalled(why, round=rnd, missing=missing, timeout=self.timeout)
        used = len(self.dead_ranks())
        fatal = used + len(culprits) > self.max_failures
        with self._lock:
            for r in culprits:
                self._stalled[r] = why
            if fatal and self._failure is None:
                self._failure = stall
        if fatal:
            logger.error("%s; %d failure(s) exceed max_failures=%d: stopping the cohort", why,
                         used + len(culprits), self.max_failures)
        else:
            logger.warning("%s; fencing them and continuing on realized work with the "
                           "survivors (%d of max_failures=%d used)", why, used + len(culprits),
                           self.max_failures)
        for r in culprits:
            try:
                os.kill(self._procs[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if fatal:
            self._abort(A.ABORT_FAILED)

    def _rank_log(self, r: int, msg: tuple) -> None:
        _, level, text = msg
        logger.log(level, "rank %d: %s", self.first_rank + r, text)

    def _record_exit(self, r: int, msg: tuple | None) -> None:
        p = self._procs[r]
        now = time.monotonic()
        if msg is not None and msg[0] == "ok" and p.exitcode == 0:
            self._outcomes[r] = _Outcome("ok", msg[1], exitcode=0, when=now)
            self.arena.ctl[A.rank_base(r) + A.R_DEAD] = A.DEAD_EXITED
            self._doorbell.ring()
            return
        if msg is not None and msg[0] == "error":
            out = _Outcome("error", exc_type=msg[1], tb=msg[2], exitcode=p.exitcode, when=now)
        else:
            out = _Outcome("died", exitcode=p.exitcode, signal=_signal_name(p.exitcode), when=now)
        self._outcomes[r] = out
        reason = int(self.arena.ctl[A.G_ABORT])
        aborting = bool(reason)
        if reason == A.ABORT_INTERRUPT and self._interrupted:
            return  # stopped by the user's interrupt, whatever it was doing
        if aborting and out.exc_type in ("CohortAborted", "_Terminated"):
            return  # a casualty of the teardown, not a cause
        if aborting and out.kind == "died" and out.signal in ("SIGTERM", "SIGKILL"):
            return
        if aborting and out.exitcode == 143:
            return
        global_rank = self.first_rank + r
        failures = len(self.dead_ranks())
        stalled = self._stalled.get(r)
        if stalled is not None:  # killed by the stall check, which already said why
            err = RankFailed(global_rank, "ReduceStall", "", out.signal, out.exitcode,
                             message=stalled)
        else:
            err = _failure_error(global_rank, out, msg)
        if self.arena.relay_error() is not None:
            # the host's link to the controller is gone: no rank of it can continue, so
            # this is not a rank death to tolerate; one line, then stop
            with self._lock:
                first = self._failure is None
                if first:
                    self._failure = err
            if first:
                logger.error("rank %d failed (%s): this host's relay failed, stopping the "
                             "cohort", global_rank, out.exc_type or out.signal or out.exitcode)
            self._abort(A.ABORT_FAILED)
            return
        if failures > self.max_failures:
            with self._lock:
                if self._failure is None:
                    self._failure = err
            logger.error("rank %d failed (%s); stopping the cohort (max_failures=%d)",
                         global_rank, out.exc_type or out.signal or out.exitcode, self.max_failures)
            self._abort(A.ABORT_FAILED)
            return
        if stalled is None:
            logger.warning("rank %d failed (%s); continuing on realized work with the "
                           "survivors (%d of max_failures=%d used)", global_rank,
                           out.exc_type or out.signal or f"exit code {out.exitcode}", failures,
                           self.max_failures)
        if self._relay is not None:  # queued first: a relay that sees the death sends it
            self._relay.rank_died(global_rank)
        self.arena.ctl[A.rank_base(r) + A.R_DEAD] = A.DEAD_KILLED
        self._doorbell.ring()
        if self.save_path:
            self._write_death_record(global_rank, err)

    def dead_ranks(self) -> list[int]:
        """The global ranks dead so far, cohort-wide: this host's failed ranks and, on a
        cluster, every rank the controller declared dead (other hosts' deaths, every
        rank of a lost host). Their count is what ``max_failures`` bounds."""
        with self._lock:
            local = {self.first_rank + r for r, o in self._outcomes.items() if o.kind != "ok"
                     and o.exc_type not in ("CohortAborted", "_Terminated")}
            return sorted(local | self._cohort_dead)

    def cohort_deaths(self, ranks: list[int]) -> None:
        """On a cluster (the relay calls this): the controller declared ``ranks`` dead.
        Past ``max_failures`` cohort-wide, this host stops with ``RankFailed`` naming
        the dead ranks."""
        with self._lock:
            self._cohort_dead.update(int(r) for r in ranks)
        dead = self.dead_ranks()
        remote = [r for r in dead if not self.first_rank <= r < self.first_rank + self.nprocs]
        if len(dead) <= self.max_failures:
            logger.warning("ranks %s of other hosts are dead; continuing on realized work "
                           "(%d of max_failures=%d used)", remote, len(dead), self.max_failures)
            return
        err = RankFailed(remote[0] if remote else dead[0], message=(
            f"ranks {dead} of the cohort are dead (ranks {remote} on other hosts, declared by "
            f"the controller: a rank died there or the whole host was lost); {len(dead)} "
            f"failures exceed max_failures={self.max_failures}: stopping this host too"))
        with self._lock:
            if self._failure is None:
                self._failure = err
        logger.error("%s", err)
        self._abort(A.ABORT_FAILED)

    def _write_death_record(self, rank: int, err: RankFailed) -> None:
        try:
            from .checkpoint.meta import CheckpointBundle, RankDeathRecord

            rec = RankDeathRecord.new(rank, self.world_size, str(err))
            rec.write_to_file(CheckpointBundle.rank_death_path(self.save_path, rank))
        except Exception as e:  # forensic, best effort
            logger.warning("could not write the death record of rank %d: %s", rank, e)

    def _abort(self, reason: int) -> None:
        """Raise the abort flag, wake everyone, then escalate on stragglers."""
        if not self.arena.ctl[A.G_ABORT]:
            self.arena.ctl[A.G_ABORT] = reason
        self._doorbell.ring()
        server = self._server
        if server is not None and not self._started.is_set():
            server.kill()  # still preloading: the supervisor may be waiting on its fork
        if self._relay is not None:
            self._relay.shutdown()
        threading.Thread(target=self._escalate, name="flodl-shm-escalate", daemon=True).start()

    def _escalate(self) -> None:
        self._started.wait()  # every rank that will ever start is in self._procs
        for r, p in enumerate(self._procs):
            if r not in self._running and p.is_alive():
                p.terminate()  # still starting up (fn not entered): nothing to finish
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline and any(p.is_alive() for p in self._procs):
            time.sleep(0.02)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline and any(p.is_alive() for p in self._procs):
            time.sleep(0.02)
        for p in self._procs:
            if p.is_alive():
                p.kill()

    def _reap_all(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.join(ABORT_GRACE_S + TERM_GRACE_S + 1.0)
            if p.is_alive():
                p.kill()
                p.join()

    def _cleanup(self) -> None:
        try:
            self.tap.close()  # lets in-flight checkpoint writes finish
        except Exception as e:
            logger.warning("checkpoint tap shutdown: %s", e)
        if self._relay is not None:
            try:
                # every rank is gone: the relay notices, says host_done and ends by itself
                self._doorbell.ring()
                self._relay.join(5.0)
                self._relay.shutdown()
                self._relay.join(5.0)
            except Exception as e:
                logger.warning("relay shutdown: %s", e)
        self.arena.unlink()
        self.arena.close()


def spawn(fn: Callable, nprocs: int, args: Sequence = (), *, join: bool = True,
          controller: str | tuple | None = None, world_size: int | None = None,
          first_rank: int = 0, salt: bytes | None = None, max_failures: int = 0,
          timeout: float | None = None, save_path: str | os.PathLike | None = None,
          start_method: str = "forkserver", eager_bytes: int | None = None,
          shm_bytes_hint: int | None = None,
          pinned_decode: bool = True) -> list[Any] | SpawnContext:
    """Run ``fn(ctx, *args)`` on ``nprocs`` new rank processes of this host.

    Args:
        fn: a picklable (module-level) function taking a ``RankContext`` first.
        nprocs: local ranks to start (>= 1).
        args: extra positional arguments for ``fn`` (picklable).
        join: wait and return the results by rank; else return a ``SpawnContext``.
        controller: ``"host:port"`` of a cluster controller to join a multi-host
            cohort (this host carries global ranks ``first_rank .. first_rank+nprocs-1``
            of ``world_size``); ``salt`` is then the 16-byte session secret.
        max_failures: ranks allowed to die while the rest continue on realized work.
        timeout: bound on each collective wait, in seconds: a rank that leaves the
            others waiting longer (hung, or stuck outside the collectives) is killed by
            the supervisor and counts as one failure; past ``max_failures`` the run
            stops with ``RankStalled`` naming the round and the missing ranks.
        save_path: checkpoint stem; dead ranks' ``RankDeathRecord`` goes next to it.
        start_method: how ranks start: ``"forkserver"`` (default; on Linux ranks fork
            from a single-threaded rank server that holds torch, numpy, numba and the
            kernels: forked from the launcher when it runs no thread pool or thread of
            its own, else a fresh interpreter whose ranks then import the launcher's
            main module as under "spawn"; elsewhere they are spawned),
            ``"spawn"`` (each rank a fresh interpreter) or ``"fork"`` (from the
            launcher; unsafe once it ran torch operations). See docs/runtime.md,
            "Start-up".
        eager_bytes: contributions up to this size take the one-sync eager path.
        shm_bytes_hint: expected frame size in bytes; when given, /dev/shm is checked
            up front for the whole arena instead of at the first large round.
        pinned_decode: let ranks reuse (page-locked when CUDA is available) decode
            staging for armed replies; each rank's RAM gate still decides at its first
            armed decode and logs the decision at INFO.

    Returns:
        With ``join=True``, the return values by local rank (``None`` for a dead rank).

    Raises:
        RankStalled: past ``max_failures``, ranks that stalled a round for longer
            than ``timeout`` (a ``ReduceStall`` and a ``RankFailed``).
        RankFailed: more than ``max_failures`` ranks raised or were killed.
        KeyboardInterrupt: SIGINT/SIGTERM reached the launcher (main thread only);
            every rank was stopped and every segment unlinked first.
        TypeError: ``fn`` or ``args`` cannot be pickled.
        ValueError: bad counts or ranks.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be an int >= 1, got {nprocs!r}")
    if max_failures < 0:
        raise ValueError(f"spawn: max_failures must be >= 0, got {max_failures}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"spawn: timeout must be > 0 seconds or None, got {timeout}")
    world = nprocs if world_size is None else int(world_size)
    if controller is None and (world != nprocs or first_rank != 0):
        raise ValueError(f"spawn: world_size={world} / first_rank={first_rank} need a "
                         f"controller (a single host carries all {nprocs} ranks)")
    if not 0 <= first_rank or first_rank + nprocs > world:
        raise ValueError(f"spawn: ranks {first_rank}..{first_rank + nprocs - 1} do not fit "
                         f"world_size {world}")
    if shm_bytes_hint:
        reap_dead_owner_segments()  # leaked segments must not fail the check needlessly
        need = A.shm_need_bytes(nprocs, int(shm_bytes_hint), eager_bytes=eager_bytes,
                                relay=controller is not None)
        free = host_memory().shm_free
        if need > free:
            raise space_error(need, free, f"the host arena for {nprocs} ranks with "
                                          f"{shm_bytes_hint}-byte frames")
    relay_factory = None
    if controller is not None:
        from .cluster.relay import relay_factory as _relay_factory

        relay_factory = _relay_factory(controller, salt, world, first_rank, nprocs)
    def start(interrupts: _InterruptGate | None = None) -> SpawnContext:
        return SpawnContext(fn, nprocs, args, world_size=world, first_rank=first_rank,
                            max_failures=max_failures, timeout=timeout,
                            save_path=None if save_path is None else os.fspath(save_path),
                            start_method=start_method, eager_bytes=eager_bytes,
                            relay_factory=relay_factory, pinned_decode=pinned_decode,
                            interrupts=interrupts)

    if not join:
        return start()
    if threading.current_thread() is not threading.main_thread():
        return start().join()
    return _InterruptGate().run(start)


class _InterruptGate:
    """``spawn``'s SIGINT/SIGTERM handling on the main thread, from before the arena
    exists until every rank is reaped.

    Before a ``SpawnContext`` owns an arena the signal interrupts as usual (nothing
    to clean up); from then on it stops the cohort (``terminate``) and ``spawn``
    raises ``KeyboardInterrupt`` once every rank is gone. A SIGTERM is re-delivered
    at the end when its disposition was the default (the process then dies of it).
    """

    def __init__(self) -> None:
        self.ctx: SpawnContext | None = None
        self.received: list[int] = []

    def _handler(self, signum, frame) -> None:
        self.received.append(signum)
        if self.ctx is None:
            raise KeyboardInterrupt
        self.ctx.terminate(A.ABORT_INTERRUPT)

    def run(self, start: Callable[["_InterruptGate"], SpawnContext]) -> list[Any]:
        old_int = signal.signal(signal.SIGINT, self._handler)
        old_term = signal.signal(signal.SIGTERM, self._handler)
        try:
            return start(self).join()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
            if signal.SIGTERM in self.received and old_term in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signal.SIGTERM)  # re-deliver now that ranks are gone


class _signals_deferred:
    """Block SIGINT and SIGTERM for this thread inside the block (they are delivered,
    and their Python handlers run, right after it)."""

    def __enter__(self) -> None:
        self._old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old)

"""A rank process's side of ``spawn``: its bootstrap (the first line it runs follows the
launcher's death and ignores SIGINT), its entry point ``_rank_main`` (attach the arena,
build the ``Comm``, run ``fn``, report the outcome), the messages it sends the launcher
over its pipe, and the forwarding of its ``flodl_shm`` log records.
"""
from __future__ import annotations

import io
import logging
import multiprocessing
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
from multiprocessing import forkserver, popen_spawn_posix
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any, NoReturn

from ..engine import arena as A
from ..errors import CohortAborted, ReduceStall, shifted_ranks
from ..lifeline import follow, follow_starter_code
from . import rank_temp



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


def _children_follow_this_rank() -> None:
    """Make the processes this rank forks from its main thread (a DataLoader's
    workers) die with it, as the rank dies with the launcher: killed with their rank,
    they otherwise outlived ``spawn`` by seconds (until torch's worker watchdog saw
    the parent gone) and printed tracebacks about its vanished pipes. A fork is not
    inherited by the kernel's parent-death signal, so each child sets its own. Only
    children of the main thread: the signal follows the *thread* that forked, and a
    child of a short-lived worker thread would die with that thread.

    And make every fork end on SIGTERM by its default action, as in a plain script (the
    rank's handler is reset in the child), with SIGTERM blocked across the fork so that
    one sent before the reset is not lost."""
    main = threading.main_thread()
    # per forking thread (two may fork at once), read again in the child's copy: whether
    # it is the main thread, the forking process, and the thread's signal mask before
    # SIGTERM was blocked for the fork
    fork = threading.local()

    def before() -> None:
        fork.from_main = threading.current_thread() is main
        fork.parent = os.getpid()
        fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def in_parent() -> None:
        if not fork.from_main or signal.SIGTERM not in signal.sigpending():
            signal.pthread_sigmask(signal.SIG_SETMASK, fork.mask)
            return
        # a stop SIGTERM came during the fork: unblocked here, the rank's handler would
        # raise inside the fork's hook, whose exceptions Python prints and drops (the rank
        # then ran on until its SIGKILL). Taken here and sent again a moment later, it
        # raises in the rank's own code
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, fork.mask)
        finally:
            signal.signal(signal.SIGTERM, handler)
        threading.Thread(target=_send_sigterm_soon, name="flodl-shm-sigterm",
                         daemon=True).start()

    def in_child() -> None:
        try:
            if signal.getsignal(signal.SIGTERM) in _RANK_SIGTERM_HANDLERS:
                # a forked child (a Pool's or DataLoader's worker) ends on SIGTERM as any
                # process does: the rank's handler raised _Terminated inside it, and a
                # Pool's terminate() then hung on a worker holding its queue's lock
                try:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                except ValueError:  # (not the child's main thread: keep the rank's)
                    pass
        finally:
            # SIGTERM stayed blocked from before the fork to here: one sent to the child in
            # between (a Pool terminated while its worker still starts) is delivered now,
            # to the default action. Unblocked, the rank's handler would have caught it
            # in the child, and the reset above dropped it: the worker lived on, and the
            # Pool's terminate() waited for it for good
            signal.pthread_sigmask(signal.SIG_SETMASK, fork.mask)
        if fork.from_main:
            follow(fork.parent)

    os.register_at_fork(before=before, after_in_parent=in_parent, after_in_child=in_child)


def _send_sigterm_soon(delay_s: float = 0.05) -> None:
    """Send this process SIGTERM after ``delay_s`` (from a thread of its own)."""
    time.sleep(delay_s)
    os.kill(os.getpid(), signal.SIGTERM)


def _leave_forked_child(e: BaseException | None) -> NoReturn:
    """End a process forked inside the rank's function (``os.fork()`` in ``fn``) whose
    code returned or raised out of ``fn`` into ``_rank_main``: as such a child of a plain
    script ends (``sys.exit``'s code; an exception's traceback and 1), never reporting to
    the launcher as if it were the rank (its ``sys.exit(0)`` was the rank's failure)."""
    code = 0
    if isinstance(e, SystemExit):
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    elif isinstance(e, _Terminated):
        code = 143
    elif e is not None:
        traceback.print_exception(e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stopped_by_own_handler(e: BaseException, arena) -> bool:
    """Whether ``e`` is a clean ``sys.exit()`` while the cohort stops: the rank's own
    SIGTERM handler (its code's, replacing the rank's) ending it on the launcher's stop,
    which the launcher takes as it takes its own handler's end, not as a failure."""
    return (isinstance(e, SystemExit) and e.code in (0, None) and arena is not None
            and bool(arena.ctl[A.G_ABORT]))


def _is_resource_tracker(proc) -> bool:
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def _end_descendants(grace: float = 1.0) -> None:
    """Stop the processes the rank started and left running as it ends: a DataLoader's
    workers under a forkserver or spawn context (children of the context's server, not
    of the rank, so they do not die with it, and that server stays up for them: a probe
    found them alive half an hour later), an abandoned Pool. SIGTERM, then SIGKILL
    after ``grace`` seconds. multiprocessing's resource tracker is left alone: it exits
    by itself once its last user is gone, after cleaning up for them."""
    try:
        import psutil

        left = [p for p in psutil.Process().children(recursive=True)
                if not _is_resource_tracker(p)]
    except Exception:  # noqa: BLE001 - nothing to do without psutil's view
        return
    if not left:
        return
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(left, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
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
    to the launcher, which logs them under its own handlers as "rank N: ...", through
    the logger of the record's name, with the rank and its pid as the record's ``rank``
    and ``rank_pid`` attributes.

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
                _send(self.conn, ("log", record.levelno, text, record.name, record.process,
                                  getattr(record, "wait_notice", False)))
        except Exception:  # a closed pipe at exit must never raise into the rank
            pass


class _Terminated(BaseException):
    """Raised in a rank by SIGTERM from the supervisor."""


def _on_sigterm(signum, frame):
    # a second one (a process group's SIGTERM passed on twice, by `timeout` and by the
    # launcher) would raise again in the rank's way out, which printed its traceback.
    # Taken by a handler that does nothing, not ignored: an ignored SIGTERM would go
    # through exec to the processes a rank that swallowed its stop starts next
    signal.signal(signal.SIGTERM, _on_second_sigterm)
    raise _Terminated()


def _on_second_sigterm(signum, frame):
    """SIGTERM once the rank is stopping: nothing more to do (its SIGKILL follows)."""


def _on_sigterm_starting(signum, frame):
    """SIGTERM before the rank entered fn: nothing to finish, so it exits at once (an
    exception raised from here could land in a finalizer of an import, which prints it
    as 'Exception ignored' and goes on until the supervisor's SIGKILL)."""
    os._exit(143)


#: the rank's own SIGTERM handlers, which its forks do not keep
_RANK_SIGTERM_HANDLERS = (_on_sigterm_starting, _on_sigterm, _on_second_sigterm)


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
        missing = list(e.missing if e.global_ranks  # (a round across hosts)
                       else shifted_ranks(e.missing, first_rank))
        msg += ({"round": e.round, "missing": missing, "timeout": e.timeout,
                 "text": str(e)},)
    return msg


def _rank_main(handle: A.ArenaHandle, local_rank: int, global_rank: int, world_size: int,
               payload: bytes, conn, parent_pid: int, timeout: float | None,
               save_path: str | None, threads: int, pinned_decode: bool,
               log_level: int = logging.INFO, c10d_env: dict | None = None,
               mp_start_method: str | None = None) -> None:
    """Entry point of a rank process (runs under multiprocessing's spawn).

    ``mp_start_method``: the launcher's default multiprocessing start method, made the
    rank's (multiprocessing gives a child the method that started it, forkserver or
    spawn): a rank's own children (a DataLoader's workers) start as they would in the
    user's script or under torchrun (forked on Linux: a DataLoader's first batch in
    about 0.05 s, against 2 s per epoch through a fresh forkserver of the rank)."""
    follow(parent_pid)  # (the launcher, or the rank server)
    rank_pid = os.getpid()  # (a process forked in fn that leaves it has another)
    inherited_temp = rank_temp.name_after_the_rank()
    _children_follow_this_rank()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # ignored from now on
    os.environ.update({
        "RANK": str(global_rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(handle.world),
    })
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if mp_start_method is not None:
        multiprocessing.set_start_method(mp_start_method, force=True)
    if forkserver.get_inherited_fds() is not None and "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # forked from the rank server: fresh entropy,
        # as a spawned rank's numpy has (Python's random reseeds itself at fork)
    for key, value in (c10d_env or {}).items():  # the caller's own MASTER_* win
        os.environ.setdefault(key, value)
    code = 0
    comm = arena = None
    send_lock = threading.Lock()
    handler = _PipeLogHandler(conn, send_lock, log_level)
    lib_logger = logging.getLogger("flodl_shm")
    for inherited in list(lib_logger.handlers):  # a forked rank has the launcher's: its
        lib_logger.removeHandler(inherited)      # records reach them through the pipe
    lib_logger.addHandler(handler)
    lib_logger.propagate = False  # the launcher's handlers print it, not the rank's root
    if lib_logger.level == logging.NOTSET or lib_logger.level > log_level:
        lib_logger.setLevel(log_level)
    signal.signal(signal.SIGTERM, _on_sigterm_starting)
    try:
        import torch

        torch.set_num_threads(threads)
        from ..engine.arena import Arena
        from ..engine.comm import Comm

        def liveness() -> None:
            if os.getppid() != parent_pid:
                raise CohortAborted(f"the launcher (pid {parent_pid}) died; rank {global_rank} "
                                    f"stops")

        from ..engine.hostmem import host_memory

        memory = host_memory()  # before the run's own working set (the staging gate)
        arena = Arena.attach(handle)
        comm = Comm(arena, local_rank, global_rank=global_rank, world_size=world_size,
                    timeout=timeout, liveness=liveness, memory=memory)
        comm.set_pinned_decode(pinned_decode)
        fn, args = pickle.loads(payload)
        ctx = RankContext(global_rank, local_rank, world_size, handle.world, comm, save_path)
        signal.signal(signal.SIGTERM, _on_sigterm)  # SIGTERM now ends fn cleanly (_Terminated)
        arena.mark_entered(local_rank)  # read by a stop's escalation, whatever is unread
        with send_lock:
            _send(conn, ("running",))  # start-up is over: stall clocks apply in full, and
            # a stop grants fn a grace before SIGTERM
        result = fn(ctx, *args)
        if os.getpid() != rank_pid:
            _leave_forked_child(None)
        lib_logger.removeHandler(handler)
        try:
            with send_lock:
                _send(conn, ("ok", result))
        except Exception as e:  # the result did not pickle
            _send(conn, ("error", type(e).__name__,
                       f"rank {global_rank} returned a value that cannot be sent back to the "
                       f"launcher: {type(e).__name__}: {e}\n" + traceback.format_exc()))
            code = 1
    except _Terminated as e:
        if os.getpid() != rank_pid:
            _leave_forked_child(e)
        code = 143
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        if os.getpid() != rank_pid:
            _leave_forked_child(e)
        if _stopped_by_own_handler(e, arena):
            code = 143  # as _Terminated: a casualty of the stop, not a failure
        else:
            # the report goes out whole: the supervisor's SIGTERM (its stop, 2 s after an
            # abort) raised inside the traceback's formatting on a loaded machine, and the
            # rank died printing a traceback of its own; SIGKILL still follows a slow one
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            code = 1
            lib_logger.removeHandler(handler)
            try:
                with send_lock:
                    _send(conn, _error_message(global_rank, global_rank - local_rank, e))
            except BaseException:  # noqa: BLE001 - a closed pipe, a late _Terminated
                pass
    finally:
        # fn is over: a stop's SIGTERM now would only raise in the way out (printing a
        # traceback, exit code 1); the supervisor's SIGKILL still ends a slow one
        signal.signal(signal.SIGTERM, _on_second_sigterm)
        try:
            conn.close()
        except Exception:
            pass
    locks = sys.modules.get("flodl_shm.checkpoint.run_lock")
    if locks is not None:  # run locks the rank's function took (LocalSGD.save)
        locks.release_held()
    _end_descendants()
    rank_temp.remove_own(inherited_temp)  # (its users are gone with the descendants)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (no atexit surprises in ranks)


# --- starting a rank ------------------------------------------------------------------


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
    """multiprocessing's spawn launch with ``follow_starter_code`` ahead of its
    ``spawn_main`` (same pipes, same preparation data; only the ``-c`` program gains a
    prefix): the rank follows the launcher's death before multiprocessing imports the
    launcher's main module and this package (seconds on a busy host), and ignores SIGINT,
    which the forking thread blocked so that a Ctrl-C during the interpreter's own
    start-up cannot reach it either."""

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
            cmd[i] = follow_starter_code(os.getpid()) + cmd[i]
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

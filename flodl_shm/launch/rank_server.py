"""The rank server of the ``"forkserver"`` start method (the default on Linux): one per
``spawn``, holding torch, numba, this package and the kernels, forking every rank.

It is forked from the launcher when that is safe (``_fork_safe``: the main thread
calls ``spawn`` and the process runs no thread but OpenBLAS's pool), else started as a
fresh interpreter; the package docstring says why and what each costs.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing import connection as mp_connection
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Callable

from . import listener_folder
from ..lifeline import follow, follow_starter_code
from .rank import _child_data

logger = logging.getLogger("flodl_shm")


def _rank_server_main(listener_fd: int, alive_r: int, nprocs: int, threads: int) -> None:
    """The fresh rank server's program: on its one thread, import torch, numpy, numba
    and what a rank runs, load (or compile once) the kernels, run no torch operation;
    then serve forks (multiprocessing's forkserver loop). Started with SIGINT ignored
    and blocked, and PDEATHSIG set, by ``follow_starter_code``."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # before torch/numpy load
    import numpy  # noqa: F401
    import torch  # noqa: F401

    _serve_ranks(listener_fd, alive_r, nprocs)


def _serve_ranks(listener_fd: int, alive_r: int, nprocs: int) -> None:
    """A rank server's common part: load the kernels and what every rank imports
    first, then serve forks until the launcher closes ``alive_r``; every child follows
    the server's death from the instant it is forked (an at-fork hook, before it
    imports the launcher's main module). The ranks inherit the hook; in them it does
    nothing, so their own forks (a DataLoader's workers, a Pool) run as anywhere."""
    _warm_kernels(nprocs)
    from ..engine import comm as _comm  # noqa: F401 - what every rank imports first

    server_pid = os.getpid()
    in_server = True  # per process: False in a rank, which forks as it likes

    def follow_server() -> None:  # in each child, right after the fork
        nonlocal in_server
        if not in_server:
            return  # a rank's own fork (a DataLoader worker, a Pool): not a rank
        in_server = False
        follow(server_pid)

    os.register_at_fork(after_in_child=follow_server)
    forkserver.main(listener_fd, alive_r, [], None, None)


# --- is forking the launcher safe? -----------------------------------------------------


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

    _died: str | None = None  # see ``died``
    _listener_folder: str | None = None  # see ``_open``

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
        _KernelWarming.join_earlier()
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
                        follow(launcher)
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
            cmd = (follow_starter_code(os.getpid())
                   + f"import sys; sys.path[:] = {sys.path!r}; "
                   + "from flodl_shm.launch.rank_server import _rank_server_main; "
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
        ends (the server's are closed here).

        The socket's file lives in a folder of its own (``listener_folder``), which
        ``close_listener`` removes once every rank is started."""
        import socket
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # a process, not a thread: ranks share it
        folder = self._listener_folder = listener_folder.create()
        address = os.path.join(folder, listener_folder.SOCKET)
        try:
            with socket.socket(socket.AF_UNIX) as listener:
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
        except BaseException:
            self.close_listener()
            raise
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w
        self._forkserver_pid = pid

    def close_listener(self) -> None:
        """Remove the listening socket's file and its folder: the launcher calls this
        once it has started every rank (each start connects to that file). The server
        keeps its open socket, but nothing can connect to it any more."""
        self._forkserver_address = None
        folder = self._listener_folder
        if folder is not None:
            listener_folder.remove(folder)
            self._listener_folder = None

    def ensure_running(self) -> None:  # called by connect_to_new_process
        if self._forkserver_pid is None:
            raise RuntimeError("the rank server is not running")
        if self._forkserver_address is None:
            raise RuntimeError("the rank server starts no more ranks: its listener is closed "
                               "once every rank of the run is started")
        pid, status = os.waitpid(self._forkserver_pid, os.WNOHANG)
        if pid:
            self._forkserver_pid = None
            raise _server_died(os.waitstatus_to_exitcode(status))

    def died(self) -> str | None:
        """How the server ended, when it died on its own while serving (killed, OOM-killed,
        crashed), as a sentence naming it; None while it runs. Every rank it forked
        dies with it (PDEATHSIG), and the launcher then reads each one's exit code as 255:
        this is what to say instead."""
        if self._died is not None or self._forkserver_pid is None:
            return self._died
        try:
            pid, status = os.waitpid(self._forkserver_pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid:
            self._forkserver_pid = None  # reaped: nothing left for ``stop`` to wait for
            code = os.waitstatus_to_exitcode(status)
            try:
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
            except ValueError:
                how = f"was killed by signal {-code}"
            self._died = f"the rank server (pid {pid}), which forks this host's ranks, {how}"
        return self._died

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
        self.close_listener()


class _ServedRankPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver launch, asking this run's ``_RankServer``; its
    ``poll`` safe from several threads."""

    def _launch(self, process_obj):  # mirrors popen_forkserver.Popen._launch
        self._poll_lock = threading.Lock()
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

    def poll(self, flag=os.WNOHANG):
        """The exit code, read once. multiprocessing's forkserver ``poll`` reads it from
        the server's pipe unlocked: two threads that both find it ready read it once
        between them, and the other, finding the pipe at its end, sets 255 over it (the
        supervisor polls from its monitor and its escalation thread: a rank stopped
        with the cohort read as "failed too (exit code 255)"). Blocking waits happen
        outside the lock."""
        if self.returncode is None and flag != os.WNOHANG:
            mp_connection.wait([self.sentinel])
        with self._poll_lock:
            return super().poll(os.WNOHANG)


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


def _warm_kernels(nprocs: int) -> None:
    """Compile (or load) every kernel here, once, so ranks only read numba's cache (on a
    cold cache, half of them in a helper process: ``kernels.warming``)."""
    from ..kernels.warming import warm_all

    warm_all(max_sources=max(4, nprocs))


class _KernelWarming(threading.Thread):
    """Compiles (or loads) kernels on a helper thread: every kernel (``_warm_kernels``),
    or with ``nprocs=None`` only the doorbell's, which the launcher runs itself. A
    program's signal handler runs on the main thread; an exception it raises while numba
    compiles there (inside a callback of LLVM's, through ctypes) is printed as "Exception
    ignored" and lost, a Ctrl-C with it. Raised into the main thread's ``wait`` for this
    thread, or into its wait for numba's compiler lock, it propagates, and the thread
    compiles on: the next ``spawn`` waits for it (``join_earlier``) before it decides
    whether the launcher is safe to fork. (The waits are on an event, not ``join``: an
    exception raised into ``Thread.join`` of Python 3.11 marks a running thread stopped.)
    """

    #: the threads started so far that may still run (a wait an exception interrupted)
    _earlier: list["_KernelWarming"] = []

    def __init__(self, nprocs: int | None) -> None:
        super().__init__(daemon=True, name="flodl-shm-kernels")
        self.nprocs = nprocs
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.start()  # (listed once started: a thread that never started never finishes)
        earlier = _KernelWarming._earlier
        earlier[:] = [t for t in earlier if not t.finished.is_set()]
        earlier.append(self)

    @classmethod
    def join_earlier(cls) -> None:
        """Wait for what earlier spawns left compiling (it loads what this one needs)."""
        for t in cls._earlier:
            t.finished.wait()
            t.join()  # (a moment: its last step was setting ``finished``)
        cls._earlier.clear()

    def run(self) -> None:
        from ..kernels import signals

        began = time.monotonic()
        try:
            signals.warm_up() if self.nprocs is None else _warm_kernels(self.nprocs)
        except BaseException as e:  # the waiter raises it
            self.error = e
        finally:
            if time.monotonic() - began > 0.05:
                # it compiled or loaded: its cyclic garbage (LLVM objects whose finalizers
                # call into LLVM) is collected here, not on the main thread, where a
                # handler's exception in a finalizer is printed as "Exception ignored"
                gc.collect()
            self.finished.set()

    def wait(self) -> None:
        """Wait for it; raise what the compile raised."""
        self.finished.wait()
        if self.error is not None:
            raise self.error

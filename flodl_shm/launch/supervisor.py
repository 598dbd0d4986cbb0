"""``spawn`` and ``SpawnContext``: the launcher's side of a run. The calling process
becomes the supervisor: it owns the host arena, starts the ranks (through the rank
server, or as fresh interpreters, or forks), watches them, fences the dead, applies
the failure policy and, on a cluster, hosts the relay (the package docstring has the
policy and the start methods).
"""
from __future__ import annotations

import atexit
import errno
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import numbers
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from ..engine import arena as A
from ..errors import RankFailed, RankStalled, ReduceStall, check_flag, check_int
from ..engine.checkpoint_tap import TapServer
from ..engine.hostmem import host_memory
from ..engine.segment import fmt_bytes, reap_dead_owner_segments, space_error
from ..engine.hostcpu import available_cores
from ..engine.waiting import Doorbell, wait_notice_s
from . import rank_temp
from .failure_budget import FailureBudget
from .rank import _RankProcess, _forward_level, _main_file, _rank_main, _recv
from .rank_exit import RankExit, failure_error, host_failure, teardown_casualty
from .rank_server import _KernelWarming, _RankServer, _ServedRankProcess, _native_threads
from .stall_watch import STALL_POLL_S, Stall, StallWatch, stall_grace
from .stop_signals import InterruptGate, signals_deferred

logger = logging.getLogger("flodl_shm")


ABORT_GRACE_S = 2.0   # voluntary exit after the abort flag, before SIGTERM
TERM_GRACE_S = 5.0    # after SIGTERM, before SIGKILL


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


def _torch_distributed_env() -> dict[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT`` for ranks that call ``dist.init_process_group`` with
    ``env://`` (e.g. backend ``"flodl_shm"``): a loopback port free now, which rank 0's
    store binds when a group is created."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


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


class SpawnContext:
    """A running ``spawn``: ``join()`` for the results, ``pids()``, ``terminate()``."""

    def __init__(self, fn, nprocs: int, args: Sequence, *, world_size: int, first_rank: int,
                 max_failures: int, timeout: float | None, save_path: str | None,
                 start_method: str, eager_bytes: int, relay_factory,
                 pinned_decode: bool = True, interrupts: "InterruptGate | None" = None,
                 survivors_save: bool = False) -> None:
        self.nprocs = nprocs
        self._born = int(time.time())  # (death records older than this are an earlier run's)
        self.pinned_decode = pinned_decode
        self.world_size = world_size
        self.first_rank = first_rank
        self.max_failures = max_failures
        #: past ``max_failures`` the survivors save and stop on their own: the launcher
        #: stops the cohort only once no rank of this host is left
        self.survivors_save = survivors_save
        self._budget = FailureBudget(first_rank, nprocs, world_size, max_failures,
                                     survivors_save)
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
        # the ranks' own default (a DataLoader's workers): this launcher's, not the
        # method that started them; read without fixing the launcher's default
        self._child_start_method = (mp.get_start_method(allow_none=True)
                                    or mp.get_all_start_methods()[0])
        self._process_cls = _process_class(start_method)
        self._log_level = _forward_level()
        # single host: ranks may also call dist.init_process_group("flodl_shm") (env://)
        self._c10d_env = None if relay_factory is not None else _torch_distributed_env()
        self._running: dict[int, float] = {}  # local rank -> when it entered fn
        self._stalled: dict[int, str] = {}   # local culprits killed for a stall -> why
        self._stall_watch = StallWatch(timeout or 0.0)  # (polled only with a timeout)
        self._outcomes: dict[int, RankExit] = {}
        self._procs: list = []
        self._pids: list[int] = []
        self._failure: RankFailed | None = None
        self._failure_inferred = False  # _failure only says other hosts' ranks died
        self._first_death: RankFailed | None = None  # the first death the cohort survived
        self._cohort_dead: set[int] = set()  # global ranks the controller declared dead
        self._interrupted = False
        self._stopped_why: str | None = None  # what join's KeyboardInterrupt says (_stop)
        self._gated = False  # an InterruptGate guards this context's wait now
        self._monitor: threading.Thread | None = None  # the supervisor, once started
        self._started = threading.Event()
        self._done = threading.Event()
        self._start_error: BaseException | None = None
        # reentrant: a signal handler (terminate, via InterruptGate) runs on the main
        # thread, which may hold it at that moment (dead_ranks)
        self._lock = threading.RLock()
        # the _abort escalations, joined once every rank is reaped (then None)
        self._escalations: list[threading.Thread] | None = []
        # the rank server forks from here while this is still the only thread (before
        # the tap and supervisor threads start); else the supervisor starts a fresh one
        self._server: _RankServer | None = (_RankServer.fork_from_launcher(nprocs)
                                            if self._process_cls is _ServedRankProcess
                                            else None)
        try:
            self._setup(nprocs, eager_bytes, relay_factory, interrupts)
        except BaseException as e:
            if self._server is not None:
                self._server.stop()
            if isinstance(e, OSError) and e.errno == errno.EMFILE:
                raise _out_of_descriptors(nprocs) from None
            raise

    def _setup(self, nprocs: int, eager_bytes: int, relay_factory,
               interrupts: "InterruptGate | None") -> None:
        """Create the arena and the tap, start the supervisor, wait for the ranks."""
        reap_dead_owner_segments()
        if self._process_cls is _ServedRankProcess:
            # the rank server loads every kernel, in parallel with us; the doorbell's
            # are the launcher's own (joined before the run ends: a later spawn forks
            # its rank server only from a launcher running no other thread)
            self._warming = _KernelWarming(None)
        else:
            self._warming = _KernelWarming(nprocs)
            self._warming.wait()
        deferred = signals_deferred()
        try:
            with deferred:  # an interrupt now finds the arena owned by a running context
                self.arena = A.Arena.create(nprocs, eager_bytes=eager_bytes,
                                            first_rank=self.first_rank,
                                            global_world=self.world_size,
                                            relay=relay_factory is not None,
                                            # a death in a direct round ends the cohort:
                                            # only where no failure is to be survived
                                            direct=(self.nprocs == 1 if self.survivors_save
                                                    else self.max_failures == 0))
                self.tap = None
                try:
                    self._doorbell = Doorbell(self.arena.ctl)
                    self.tap = TapServer(self.arena)  # the consensus-checkpoint forge
                    self._relay = None
                    self._relay_factory = relay_factory
                    # started in here (it takes the launcher's own signal mask back), so
                    # a signal raising in the launcher finds the supervisor running
                    self._launcher_mask = deferred.old
                    monitor = threading.Thread(target=self._monitor_main, daemon=True,
                                               name="flodl-shm-supervisor")
                    monitor.start()
                except BaseException:
                    if self.tap is not None:
                        self.tap.close()
                    self.arena.unlink()
                    self.arena.close()
                    raise
                self._monitor = monitor
                if interrupts is not None:
                    interrupts.guard(self)
            self._started.wait()
        except BaseException:
            if self._monitor is not None:
                # raised into the start-up by a signal handler of the program's: the ranks
                # started so far are stopped, the arena unlinked, before it propagates
                self._stop_after_raise()
            raise
        if self._start_error is not None:
            self._monitor.join()
            raise self._start_error

    # -- public ------------------------------------------------------------------
    def pids(self) -> list[int]:
        return list(self._pids)

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
        more than ``max_failures`` ranks failed. On the main thread SIGINT and the
        terminating signals stop the ranks while it waits, as in ``spawn(join=True)``
        (``KeyboardInterrupt``, then the signal again where it would have ended the
        process). An exception raised into the wait (by a signal handler of the
        program's) stops and reaps the ranks before it propagates."""
        if self._gated or threading.current_thread() is not threading.main_thread():
            return self._join(timeout)

        def gated(gate: InterruptGate) -> list[Any] | None:
            results = gate.guard(self)._join(timeout)
            if results is None and gate.received:
                # a stop signal came while it waited: the stop is seen through (the ranks
                # reaped, the segments unlinked) before the signal is delivered again
                results = self._join(None)
            return results

        return InterruptGate().run(gated)

    def _join(self, timeout: float | None) -> list[Any] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        except BaseException:
            self._stop_after_raise()
            raise
        self._monitor.join()
        with _UNJOINED_LOCK:
            _UNJOINED.discard(self)  # joined: the exit has nothing left to wait for
        error = self._run_error()
        if error is not None:
            try:
                raise error
            finally:
                # the context keeps the error, whose traceback keeps this frame: without
                # this the pair (the rank processes' pipes, the arena's mappings) would
                # wait for the garbage collector, in a sweep of failing runs for long
                self = None
        return [self._outcomes[r].value if self._outcomes[r].kind == "ok" else None
                for r in range(self.nprocs)]

    def _stop_after_raise(self) -> None:
        """An exception was raised into a wait of the launcher's (start-up or ``join``)
        by a signal handler of the program's (an alarm, a test's timeout): stop and reap
        the ranks, and unlink the arena, before it propagates, as on any failure (they
        ran on, and the program's exit then waited for them for good). Another exception
        while this runs (a repeating alarm, a second Ctrl-C) kills them at once and is
        dropped: the first is what propagates, once they are gone."""
        deadline = time.monotonic() + ABORT_GRACE_S + TERM_GRACE_S + 30.0
        stopping = killing = False
        while True:
            try:
                if not stopping:
                    self._stop(A.ABORT_INTERRUPT, "its launcher raised while waiting for it",
                               said="stopped by an exception raised into its wait")
                    stopping = True  # (once it returned: the abort flag is up)
                if killing:
                    for p in list(self._procs):  # those started so far; the abort flag
                        if p.is_alive():         # stops the start of any more
                            p.kill()
                if self._done.wait(max(0.0, deadline - time.monotonic())):
                    # (its last step: a later spawn then finds only the main thread, and
                    # forks its rank server from there)
                    self._monitor.join(max(0.0, deadline - time.monotonic()))
                    break
                if time.monotonic() >= deadline:
                    break
            except BaseException:
                killing = True
        with _UNJOINED_LOCK:
            _UNJOINED.discard(self)  # stopped: the exit has nothing left to wait for

    def _run_error(self) -> BaseException | None:
        """What ``join`` raises for the finished run, or None when it succeeded."""
        relay_error = None if self._relay is None else self._relay.error
        if relay_error is not None:
            # the host's link to the cohort failed: that, not its consequences, is the news
            if isinstance(relay_error, ReduceStall):
                return relay_error
            error = ConnectionError(f"this host's relay failed: {relay_error}")
            error.__cause__, error.__suppress_context__ = relay_error, True  # raise ... from
            return error
        if self._failure is not None:
            return self._failure
        if self._interrupted:
            return KeyboardInterrupt(f"flodl_shm.spawn: {self._stopped_why or 'interrupted'}; "
                                     f"every rank was stopped")
        return None

    def terminate(self, reason: int = A.ABORT_INTERRUPT, why: str | None = None) -> None:
        """Stop every rank (abort flag, then SIGTERM, then SIGKILL) and clean up.

        With ``ABORT_INTERRUPT`` (the default) and no failure before it, ``join``
        raises ``KeyboardInterrupt`` and no rank's exit counts as a failure. A no-op
        once every rank is reaped. ``why`` (e.g. ``"its launcher was stopped by
        SIGTERM"``) goes to the controller, on a cluster, as why this host stops."""
        self._stop(reason, why)

    def _stop(self, reason: int, why: str | None, said: str | None = None) -> None:
        """``terminate``; ``said``: what ``join``'s ``KeyboardInterrupt`` then says in
        place of "interrupted", when this is the stop that interrupts the run."""
        if self._done.is_set():
            return
        with self._lock:
            first = reason == A.ABORT_INTERRUPT and self._failure is None \
                and not self._interrupted
            if first:
                self._interrupted = True
                self._stopped_why = said
        self._abort(reason, (-1, why) if first and why else None)

    # -- monitor thread --------------------------------------------------------------
    def _monitor_main(self) -> None:
        conns = {}
        # Ranks inherit the starting thread's signal mask: SIGINT stays blocked in them
        # until they ignore it (a Ctrl-C is the launcher's to handle). "spawn" ranks
        # are also covered by _RankPopen; this covers the other start methods.
        # SIGTERM unblocked, whatever the launcher's mask: a rank that inherited it
        # blocked sat out its stop's SIGTERM while starting (its SIGKILL came 7 s later)
        signal.pthread_sigmask(signal.SIG_SETMASK,
                               (self._launcher_mask - {signal.SIGTERM}) | {signal.SIGINT})
        try:
            try:
                threads = rank_threads(self.nprocs)
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
                              self._c10d_env, self._child_start_method),
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
                    self._pids.append(p.pid)
                    conns[r] = parent_conn
                if self._server is not None:
                    # every rank is started: a launcher killed from now on leaves no
                    # socket file behind (launch/listener_folder.py)
                    self._server.close_listener()
                    n = _native_threads(self._server._forkserver_pid) if self._procs else 0
                    if n > 1:  # (done forking now)
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
            # every rank is reaped, so each escalation ends at once; joined here, none
            # outlives join() holding this context and its rank processes
            with self._lock:
                escalations, self._escalations = self._escalations, None
            for t in escalations:
                t.join()
            rank_temp.remove_left_by(self._pids)  # (a killed rank's: it could not)
            for c in conns.values():
                c.close()
            if self._server is not None:
                self._server.stop()
            self._cleanup()
            self._warming.join()
            # a finished context holds nothing: no rank pipes, no arena mapping (a sweep
            # may keep many; they used to wait for the garbage collector)
            self._procs = []
            self.tap = self._doorbell = self.arena = None
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
        """The stall check's poll (``stall_watch.py``): the live, unfenced ranks' round
        words to the watch, its culprits fenced."""
        ctl = self.arena.ctl
        if ctl[A.G_ABORT]:
            return
        alive = [r for r in live if not ctl[A.rank_base(r) + A.R_DEAD] and r not in self._stalled]
        arrived = {r: int(ctl[A.rank_base(r) + A.R_ARRIVED]) for r in alive}
        done = {r: int(ctl[A.rank_base(r) + A.R_DONE]) for r in alive}  # (read after)
        self._stall_watch, stall = self._stall_watch.look(arrived, done, self._running,
                                                          time.monotonic())
        if stall is not None:
            self._fence_stalled(stall)

    def _fence_stalled(self, stall: Stall) -> None:
        """Kill the ranks that stalled a round; they count as failures."""
        culprits = stall.culprits
        missing = tuple(self.first_rank + r for r in culprits)
        why = stall.why(self.first_rank, self.timeout)
        err = RankStalled(why, round=stall.round, missing=missing, timeout=self.timeout)
        dead = self.dead_ranks()
        used = len(dead)
        fatal = self._budget.stops(dead, len(culprits))
        with self._lock:
            for r in culprits:
                self._stalled[r] = why
            if fatal and self._failure is None:
                self._failure = err
        if fatal:  # the whole story is the RankStalled that spawn raises: one line here
            logger.error("round %d stalled on rank(s) %s, killed by the launcher; %s: "
                         "stopping the cohort", stall.round, list(missing),
                         self._budget.why_stop(used + len(culprits)))
        else:
            logger.warning("%s; fencing them and %s", why,
                           self._budget.survivors_go_on(used + len(culprits)))
        for r in culprits:
            try:
                os.kill(self._procs[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if fatal:
            self._abort(A.ABORT_FAILED)

    def _rank_log(self, r: int, msg: tuple) -> None:
        _, level, text, name, pid, wait_notice = msg
        if wait_notice and self.arena is not None and self.arena.ctl[A.G_ABORT]:
            # a long wait's notice that reaches the launcher after it stopped the cohort:
            # the wait ends in the stop, and a peer that had just died was named "alive,
            # not there yet" after this launcher's own line said it failed
            return
        rank = self.first_rank + r
        # the record's own logger (``flodl_shm.*``): a JSON formatter keeps its name, and
        # the rank and its pid ride as attributes, not only in the text (which names the
        # rank first, unless the rank's own text does: a long wait's warning)
        fmt = "%s" if text.startswith(f"rank {rank} ") else f"rank {rank}: %s"
        logging.getLogger(name).log(level, fmt, text, extra={"rank": rank, "rank_pid": pid})

    def _record_exit(self, r: int, msg: tuple | None) -> None:
        p = self._procs[r]
        self._outcomes[r] = out = RankExit.of(msg, p.exitcode)
        if out.kind == "ok":
            self.arena.mark_exited(r)
            return
        if teardown_casualty(out, int(self.arena.ctl[A.G_ABORT]), self._interrupted):
            return
        global_rank = self.first_rank + r
        server_death = (self._server.died() if out.kind == "died" and out.exitcode == 255
                        and self._server is not None else None)
        if server_death is not None:
            self._died_with_server(global_rank, server_death)
            return
        dead = self.dead_ranks()
        failures = len(dead)
        stalled = self._stalled.get(r)
        if stalled is not None:  # killed by the stall check, which already said why
            err = RankFailed(global_rank, "ReduceStall", "", out.signal, out.exitcode,
                             message=stalled)
        else:
            err = failure_error(global_rank, out, msg, started=r in self._running,
                                 timeout=self.timeout)
        if out.exc_type == "StartRefused":
            # every rank refuses at the same point: no death to tolerate, the run stops.
            # The refusal names the cause, so it also replaces a failure this host only
            # inferred from other hosts' deaths (their ranks refused first)
            self._stop_on(err, logging.ERROR, "rank %d refused to start; stopping the cohort",
                          global_rank, overrides_inferred=True)
            return
        if self.arena.relay_error() is not None:
            # the host's link to the controller is gone: no rank of it can continue, so
            # this is not a rank death to tolerate; one line (the relay's error, which
            # ``wait`` raises, is the news), then stop
            self._stop_on(err, logging.DEBUG, "rank %d failed (%s): this host's relay failed, "
                          "stopping the cohort", global_rank,
                          out.exc_type or out.signal or out.exitcode)
            return
        if self._budget.stops(dead):
            with self._lock:
                first = self._failure is None
                # the others' refusal to start says "see their error": this is that error
                cause = not first and self._failure.exc_type == "StartRefused" and \
                    out.exc_type is not None and out.exc_type not in ("StartRefused", "PeerDied")
                if first or cause:
                    # a rank that raised PeerDied met a death already known: that is the news
                    self._failure = (self._first_death if out.exc_type == "PeerDied"
                                     and self._first_death is not None else err)
            what = out.exc_type or out.signal or f"exit code {out.exitcode}"
            if self.save_path:  # the run stops on it: its record, as for a death it survives
                self._write_death_record(global_rank, err)
            if first:
                logger.error("rank %d failed (%s); stopping the cohort (%s)", global_rank,
                             what, self._budget.why_stop(failures))
            elif cause:
                logger.error("rank %d failed (%s): the others refused to start for it",
                             global_rank, what)
            else:  # (the cohort is stopping already: not a second "stopping" line)
                logger.error("rank %d failed too (%s)", global_rank, what)
            self._abort(A.ABORT_FAILED, (global_rank, f"{host_failure(err)[1]}; "
                                         f"{self._budget.why_stop(failures)}") if first else None)
            return
        if stalled is None:
            logger.warning("rank %d failed (%s); %s", global_rank,
                           out.exc_type or out.signal or f"exit code {out.exitcode}",
                           self._budget.survivors_go_on(failures))
        if self._first_death is None:
            self._first_death = err
        if self._relay is not None:  # queued first: a relay that sees the death sends it
            self._relay.rank_died(global_rank)
        self.arena.ctl[A.rank_base(r) + A.R_DEAD] = A.DEAD_KILLED
        self._doorbell.ring()
        if self.save_path:
            self._write_death_record(global_rank, err)

    def _died_with_server(self, global_rank: int, how: str) -> None:
        """Rank ``global_rank`` died with the rank server (``_RankServer.died`` says how
        the server ended): every rank of this host dies with it, so the host stops at
        the first, with one line naming the server rather than one 'exit code 255' per
        rank."""
        err = RankFailed(global_rank, None, "", "SIGKILL", None, message=(
            f"{how}; rank {global_rank} and every other rank of this host died with it "
            f"(exc_type=None, signal=SIGKILL: the server's death signal to its ranks). An "
            f"OOM kill? See the kernel log (`dmesg`); resume from the last checkpoint"))
        if self.save_path:
            self._write_death_record(global_rank, err)
        self._stop_on(err, logging.ERROR, "%s: every rank of this host died with it; stopping",
                      how)

    def _stop_on(self, err: RankFailed, level: int, msg: str, *args,
                 overrides_inferred: bool = False) -> None:
        """Stop the cohort for ``err``, a failure no death budget covers: it becomes the
        run's failure unless one is recorded already (or, with ``overrides_inferred``,
        only inferred from other hosts' deaths), and ``msg`` is logged once, then."""
        with self._lock:
            first = self._failure is None or (overrides_inferred and self._failure_inferred)
            if first:
                self._failure, self._failure_inferred = err, False
        if first:
            logger.log(level, msg, *args)
        self._abort(A.ABORT_FAILED, host_failure(err) if first else None)

    def dead_ranks(self) -> list[int]:
        """The global ranks dead so far, cohort-wide: this host's failed ranks and, on a
        cluster, every rank the controller declared dead (other hosts' deaths, every
        rank of a lost host). Their count is what ``max_failures`` bounds."""
        with self._lock:
            local = {self.first_rank + r for r, o in self._outcomes.items() if o.failed}
            return sorted(local | self._cohort_dead)

    def cohort_deaths(self, ranks: list[int], why: str | None = None) -> None:
        """On a cluster (the relay calls this): the controller declared ``ranks`` dead;
        ``why``: how their host said it stopped (an operator's Ctrl-C), or None. With a
        ``save_path``, ``why`` becomes the ranks' death records on this host (where its
        run's end reads why they left), unless one this run wrote is there already.
        Past ``max_failures`` cohort-wide (with ``survivors_save``: only when none of
        this host's ranks is left), this host stops with ``RankFailed`` naming the dead
        ranks."""
        with self._lock:
            self._cohort_dead.update(int(r) for r in ranks)
        if why and self.save_path:
            self._record_remote(ranks, why)
        dead = self.dead_ranks()
        local = self._budget.local(dead)
        remote = [r for r in dead if r not in local]
        if not self._budget.stops(dead):
            if remote:  # (the controller also echoes this host's own deaths, said already)
                logger.warning("ranks %s of other hosts are dead; %s", remote,
                               self._budget.survivors_go_on(len(dead)))
            return
        why = self._budget.why_stop(len(dead))
        err = RankFailed(remote[0] if remote else dead[0], message=(
            f"ranks {dead} of the cohort are dead (ranks {remote} on other hosts, declared by "
            f"the controller: a rank died there or the whole host was lost); {why}: "
            f"stopping this host too"))
        with self._lock:
            first = self._failure is None
            if first:
                self._failure, self._failure_inferred = err, True
        logger.error("%s", err)
        # (-1: the cause is no rank of this host)
        self._abort(A.ABORT_FAILED, (-1, f"the controller declared ranks {remote} dead, "
                                     f"{why}") if first else None)

    def _write_death_record(self, rank: int, err: RankFailed | str,
                            keep: bool = False) -> None:
        """Rank ``rank``'s death record next to ``save_path``, saying ``err``; ``keep``:
        not over one this run wrote already (the rank's own host's, on a shared folder)."""
        try:
            from ..checkpoint.meta import RankDeathRecord
            from ..checkpoint.series import death_record_path

            path = death_record_path(self.save_path, rank)
            if keep and path.exists():
                try:
                    if RankDeathRecord.read_from_file(path).unix_time_secs >= self._born:
                        return
                except Exception:  # noqa: BLE001 - a torn record: replaced
                    pass
            rec = RankDeathRecord.new(rank, self.world_size, str(err))
            path.parent.mkdir(parents=True, exist_ok=True)  # a run that saved nothing yet
            rec.write_to_file(path)
        except Exception as e:  # forensic, best effort
            logger.warning("could not write the death record of rank %d: %s", rank, e)

    def _record_remote(self, ranks: list[int], why: str) -> None:
        """The death records of other hosts' ``ranks``, saying how their host stopped."""
        for r in map(int, ranks):
            if not self._budget.is_local(r):
                self._write_death_record(r, why, keep=True)

    def _abort(self, reason: int, failure: tuple[int, str] | None = None) -> None:
        """Raise the abort flag, wake everyone, then escalate on stragglers. ``failure``:
        ``(rank, reason)`` of the failure that stops this host, which the relay tells
        the controller (``Relay.shutdown``)."""
        arena, doorbell = self.arena, self._doorbell
        if arena is None:
            return  # the run ended and released them: nothing left to stop
        if self._relay is not None:  # first: the flag below ends its wait, and it leaves
            self._relay.shutdown(failure)  # (saying ``failure`` on its way out)
        if not arena.ctl[A.G_ABORT]:
            arena.ctl[A.G_ABORT] = reason
        doorbell.ring()
        server = self._server
        if server is not None and not self._started.is_set():
            server.kill()  # still preloading: the supervisor may be waiting on its fork
        escalation = threading.Thread(target=self._escalate, name="flodl-shm-escalate",
                                      daemon=True)
        with self._lock:  # started under it: the monitor joins only started threads
            if self._escalations is None:
                return  # every rank is reaped: nothing left to escalate on
            escalation.start()
            self._escalations.append(escalation)

    def _escalate(self) -> None:
        self._started.wait()  # every rank that will ever start is in self._procs
        arena = self.arena  # mapped until the monitor has joined this thread
        for r, p in enumerate(self._procs):
            # the rank's own word, not self._running: its 'running' message may still
            # sit unread in the pipe while this thread looks
            if not arena.entered(r) and p.is_alive():
                p.terminate()  # still starting up (fn not entered): nothing to finish
        self._after_grace(ABORT_GRACE_S, lambda p: p.terminate())  # SIGTERM
        self._after_grace(TERM_GRACE_S, lambda p: p.kill())  # SIGKILL

    def _after_grace(self, grace_s: float, action: Callable[[Any], None]) -> None:
        """Wait up to ``grace_s`` for every rank to exit, then ``action`` each still alive."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.is_alive() for p in self._procs):
            time.sleep(0.02)
        for p in self._procs:
            if p.is_alive():
                action(p)

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


def _out_of_descriptors(nprocs: int) -> OSError:
    """The error for EMFILE while a cohort starts (multiprocessing's own traceback said
    only ``Too many open files``): the limit and the fix."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = ("" if hard == resource.RLIM_INFINITY or hard >= 4096 else
               f"; the hard limit is {hard}: a higher one is the system's or the scheduler's "
               f"to grant")
    return OSError(errno.EMFILE, (
        f"spawn ran out of file descriptors starting {nprocs} ranks: this process may "
        f"hold {soft} (`ulimit -n`, RLIMIT_NOFILE), and the cohort takes a few for each "
        f"rank in the launcher (its shared memory, pipes, the rank server's connection); "
        f"raise it (`ulimit -n 4096` before starting the job{ceiling})"))


def rank_threads(nprocs: int) -> int:
    """torch threads for each of ``nprocs`` ranks of this host: ``OMP_NUM_THREADS`` when
    the launcher's environment sets it to a positive count (as torchrun honours it), else
    the CPUs this process can keep busy shared out (at least one each): its affinity,
    capped by a container's CPU quota (``engine/hostcpu.py``)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count >= 1:
            return count
    shared = max(1, available_cores() // nprocs)  # (reads the cgroup's files: once)
    if value:
        logger.warning("OMP_NUM_THREADS=%r is not a positive thread count; ranks run "
                       "%d thread(s) each (the CPUs this process may use / %d ranks). Set it to a "
                       "count such as 1, or unset it", value, shared, nprocs)
    return shared


def spawn(fn: Callable, nprocs: int, args: Sequence = (), *, join: bool = True,
          controller: str | tuple | None = None, world_size: int | None = None,
          first_rank: int = 0, salt: bytes | None = None, max_failures: int = 0,
          timeout: float | None = None, save_path: str | os.PathLike | None = None,
          start_method: str = "forkserver", eager_bytes: int | None = None,
          shm_bytes_hint: int | None = None,
          pinned_decode: bool = True, survivors_save: bool = False
          ) -> list[Any] | SpawnContext:
    """Run ``fn(ctx, *args)`` on ``nprocs`` new rank processes of this host.

    Args:
        fn: a picklable (module-level) function taking a ``RankContext`` first.
        nprocs: local ranks to start (>= 1). Each runs torch with ``OMP_NUM_THREADS``
            threads when the launcher's environment sets it, else the CPUs this process
            may use (its affinity, capped by a container's CPU quota) / ``nprocs``
            (``rank_threads``).
        args: extra positional arguments for ``fn`` (picklable).
        join: wait and return the results by rank; else return a ``SpawnContext``.
        controller: ``"host:port"`` of a cluster controller to join a multi-host
            cohort (this host carries global ranks ``first_rank .. first_rank+nprocs-1``
            of ``world_size``); ``salt`` is then the 16-byte session secret.
        max_failures: ranks allowed to die while the rest continue on realized work.
        survivors_save: past ``max_failures``, leave the survivors running instead of
            stopping the cohort: ``fn`` sees the deaths itself (the Trainer's ranks save
            a ``max_failure_exceeded`` checkpoint, then return), and ``spawn`` returns.
            The launcher still stops the cohort (``RankFailed``) once no rank of this
            host is left; other hosts' deaths alone never stop it.
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
        pinned_decode: let ranks reuse (page-locked in a rank that uses CUDA) decode
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
    if not callable(fn):
        raise TypeError(f"spawn: fn must be a function taking the RankContext first, got "
                        f"{type(fn).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"spawn: args must be a tuple (or list) of fn's extra arguments, got "
                        f"{type(args).__name__}: pass args=(value,) for one")
    check_int("nprocs", nprocs, 1, prefix="spawn: ")
    check_int("max_failures", max_failures, 0, prefix="spawn: ")
    check_int("eager_bytes", eager_bytes, 0, optional=True, prefix="spawn: ")
    check_flag("spawn: join", join)  # ("no" would have been true)
    if start_method is not None and start_method not in mp.get_all_start_methods():
        raise ValueError(f"spawn: start_method must be one of "
                         f"{', '.join(map(repr, mp.get_all_start_methods()))} (this platform's), "
                         f"got {start_method!r}; 'forkserver', the default, starts ranks fastest")
    if timeout is not None and not (isinstance(timeout, numbers.Real)
                                    and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"spawn: timeout must be a number of seconds > 0 or None, got "
                         f"{timeout!r}")
    wait_notice_s()  # (its environment variable, refused here once, not by every rank)
    world = nprocs if world_size is None else int(world_size)
    from ..cluster.control import MAX_WORLD_SIZE

    if world > MAX_WORLD_SIZE:
        raise ValueError(f"spawn: world_size={world} is more than a cohort holds "
                         f"({MAX_WORLD_SIZE:,} ranks)")
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
                                          f"{fmt_bytes(int(shm_bytes_hint))} frames")
    relay_factory = None
    if controller is not None:
        from ..cluster.relay import relay_factory as _relay_factory

        relay_factory = _relay_factory(controller, salt, world, first_rank, nprocs)
    def start(interrupts: InterruptGate | None = None) -> SpawnContext:
        return SpawnContext(fn, nprocs, args, world_size=world, first_rank=first_rank,
                            max_failures=max_failures, timeout=timeout,
                            save_path=None if save_path is None else os.fspath(save_path),
                            start_method=start_method, eager_bytes=eager_bytes,
                            relay_factory=relay_factory, pinned_decode=pinned_decode,
                            interrupts=interrupts, survivors_save=survivors_save)

    if not join:
        return _joined_at_exit(start())
    if threading.current_thread() is not threading.main_thread():
        return start().join()
    return InterruptGate().run(lambda gate: start(gate)._join(None))


#: ``spawn(join=False)`` contexts not joined yet (``_join_the_unjoined`` at exit)
_UNJOINED: "weakref.WeakSet[SpawnContext]" = weakref.WeakSet()
_UNJOINED_LOCK = threading.Lock()


def _joined_at_exit(ctx: "SpawnContext") -> "SpawnContext":
    """Have ``ctx`` joined when the interpreter exits, if its owner has not: its
    supervisor is a daemon thread, which the interpreter's exit stops before it can
    unlink the arena (multiprocessing's own exit hook waits for the ranks, then the
    segments stayed in /dev/shm)."""
    with _UNJOINED_LOCK:
        _UNJOINED.add(ctx)
    return ctx


def _join_the_unjoined() -> None:
    """At exit: wait for every ``spawn(join=False)`` run nobody joined, as the exit would
    anyway, so that its supervisor unlinks its segments; say so, and what failed."""
    with _UNJOINED_LOCK:
        waiting = list(_UNJOINED)
        _UNJOINED.clear()
    for ctx in waiting:
        if not ctx._done.is_set():
            logger.warning("the program ends with a spawn(join=False) of %d ranks not joined: "
                           "waiting for its ranks to finish (call join(), or terminate() to "
                           "stop them)", ctx.nprocs)
        try:
            ctx.join()
        except BaseException as e:  # nobody is left to raise it to
            logger.error("a spawn(join=False) nobody joined failed: %s", e)


# registered after multiprocessing's own exit hook (imported above), so it runs first
atexit.register(_join_the_unjoined)

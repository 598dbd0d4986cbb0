"""The cluster controller: one consensus from every host's partial.

Each host's relay (``relay.py``) ships one frame per round: the host partial
Σ(wᵣ·Tᵣ) over its accepted local contributions, with their mass Σwᵣ (never
divided). The controller, per round:

1. reads the live hosts' partials **in host order** (by first rank — a fixed f32
   summation order, so runs are reproducible), each into one reused staging
   buffer, verifies its tag, then adds it into one f32 accumulator: memory is two
   frames plus a constant whatever the number of hosts, and a frame that fails
   its tag is never mixed in (its host is dropped and its ranks declared dead);
2. divides once by the accepted mass (MODEL rounds; CONTROL rounds are sums),
   steps the outer optimizer on the window's params frame if one is configured,
   and encodes the consensus in the round's wire dtype;
3. hashes it once and sends it to every live host; a host whose link breaks is
   declared dead and the scatter continues (elastic);
4. taps the consensus into the checkpoint forge when a checkpoint is armed.

A round that does not complete within ``round_timeout`` (or the shortest
collective ``timeout`` a host announced, if shorter) while its hosts are alive
is a stall: every relay is told (their ranks raise ``ReduceStall`` naming the
round and the global ranks that never delivered) and the cohort ends. A host
whose ranks all finished ends the cohort cleanly once the others finish too.

Admission is bounded: at most ``MAX_PENDING_HANDSHAKES`` connections may be
mid-handshake (the oldest is dropped for a new one), each for at most the
handshake deadline, on at most ``MAX_HANDSHAKE_THREADS`` threads (a dropped
connection's thread ends it: the accept loop only shuts it down, so no thread ever
reads a descriptor number reused by another connection); running out of file
descriptors or threads backs off and keeps accepting instead of ending the accept
loop. What a flood repeats (refused and dropped connections) is logged the first
time, then at most every 10 s with a count. A host whose link closes
before the cohort is complete is forgotten: its ranks and name are free for a
relaunch. ``docs/failure-model.md`` ("Several hosts") describes every fault.

Also a command::

    python -m flodl_shm controller --bind 0.0.0.0:1337 --world-size 4 --secret-file secret.hex
"""
from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from .. import kernels as K
from ..checkpoint.meta import SaveReason
from .dead_ranks import DeadRanks
from ..errors import FrameError, ReduceStall
from ..frame import DTYPE_F32, RoundFrame, RoundKind, TensorPayload, elem_size
from .control import MAX_WORLD_SIZE, Ctrl, ctrl_message, outer_fields
from .link import (HandshakeRejected, Kind, Link, OutgoingFrame, handshake_deadline_s,
                   parse_addr, server_handshake)
from .wire import check_salt

logger = logging.getLogger("flodl_shm")

FLAG_OUTER = 8   # mirrors arena.FLAG_OUTER: the window's params frame
FLAG_TAP = 16    # mirrors arena.FLAG_TAP: captured for a checkpoint
DEFAULT_ROUND_TIMEOUT = 300.0
#: save reasons (as a checkpoint's metadata spells them) of one taken because the run
#: stops early
EARLY_STOP_REASONS = frozenset(r.value for r in (
    SaveReason.MAX_FAILURE_EXCEEDED, SaveReason.SINGLE_SURVIVOR, SaveReason.ALL_RANKS_LOST,
    SaveReason.REDUCE_STALL))
PARALLEL_SCATTER_BYTES = 1 << 20  # below this, thread start-up costs more than it saves
MAX_PENDING_HANDSHAKES = 64  # connections mid-handshake; the oldest goes for a new one
#: handshake threads alive at once: the pending ones and those ending a dropped connection
MAX_HANDSHAKE_THREADS = 2 * MAX_PENDING_HANDSHAKES
_FLOOD_REPORT_S = 10.0  # the most often a line a flood repeats is logged
_FLOOD_KEYS_KEPT = 256  # distinct lines a throttle tracks (the oldest goes)
ROUND_TIMES_KEPT = 10_000  # ControllerStats.round_s: the last rounds' seconds
_RSS_EVERY = 64  # rounds between two RSS samples (and after every round of 1 MiB or more)
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_CLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


@dataclass
class _Host:
    link: Link
    name: str
    ranks: list[int]
    timeout: float | None = None  # the ranks' collective timeout, as announced
    joined: float = field(default_factory=time.monotonic)
    told_unformed: bool = False  # told the cohort did not form within its deadline
    alive: bool = True
    done: bool = False
    stopped: str | None = None  # why it said it stops (``host_stopping``): "rank R: ..."
    sent: int = 0          # wire bytes received from this host (frames)

    @property
    def first(self) -> int:
        return self.ranks[0]


@dataclass
class ControllerStats:
    rounds: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    peak_rss: int = 0
    #: seconds of the last ``ROUND_TIMES_KEPT`` rounds (a controller serves for days)
    round_s: "deque[float]" = field(default_factory=lambda: deque(maxlen=ROUND_TIMES_KEPT))


class ClusterController:
    """A running controller. Build with ``ClusterController.start(...)``.

    Attributes:
        port: the bound TCP port (useful with port 0).
        dead_ranks: the cohort-wide ``DeadRanks`` ledger.
        forge: the ``CheckpointForge`` writing consensus checkpoints (built from the
            first checkpoint a rank arms, unless one was given).
        error: the exception that ended the reduce loop, or None.
        stats: rounds, bytes in/out, peak RSS, the last rounds' seconds.
        stopped_hosts: host name -> ``(rank, reason)``: why that host stopped, as it said
            before it left (``(0, "StartRefused: ...")``; rank -1 for no rank's failure:
            ``"its launcher was stopped by SIGTERM"``); a host that left without a word
            is not in it.
        last_armed: ``(path, save reason)`` of the last checkpoint a rank armed (the
            reason as its metadata spells it, ``"max_failure_exceeded"``), or None.
    """

    def __init__(self, sock: socket.socket, world_size: int, salt: bytes, *,
                 round_timeout: float | None, dead_ranks: DeadRanks, forge=None,
                 outer=None, outer_momentum=None, outer_round: int | None = None) -> None:
        self._sock = sock
        self.port = sock.getsockname()[1]
        self.world_size = world_size
        self.salt = salt
        self.round_timeout = round_timeout
        self.dead_ranks = dead_ranks
        self.forge = forge
        self.outer = outer if getattr(outer, "has_momentum", False) else None
        self.error: BaseException | None = None
        self.stats = ControllerStats()
        self.stopped_hosts: dict[str, tuple[int, str]] = {}
        self.last_armed: tuple[str, str | None] | None = None
        self._hosts: list[_Host] = []
        self._claimed: dict[int, str] = {}
        self._pending_names: set[str] = set()
        self._pending: OrderedDict[socket.socket, float] = OrderedDict()  # mid-handshake
        self._admitted: dict[socket.socket, dict] = {}  # hellos admitted, ack not yet sent
        self._admission_log = _Throttled(logging.ERROR, "connections dropped at admission")
        self._rejected_log = _Throttled(logging.ERROR, "hosts refused")  # (per host, reason)
        self._refused_log = _Throttled(logging.ERROR, "peers refused (another secret)")
        self._dropped_log = _Throttled(logging.WARNING, "failed handshakes dropped")
        self._dropped: set[socket.socket] = set()  # shut by us, their threads to end them
        self._handshake_slots = threading.BoundedSemaphore(MAX_HANDSHAKE_THREADS)
        self._me = None  # psutil's view of this process, for the peak RSS
        self._lock = threading.RLock()
        self._complete = threading.Event()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._acc = np.empty(0, np.float32)
        self._stage: dict[tuple[int, int], np.ndarray] = {}
        self._prev: np.ndarray | None = None
        self._mom: np.ndarray | None = None
        self._outer_loaded: np.ndarray | None = None
        self._outer_round: int | None = None  # the sync round _outer_loaded was saved at
        if outer_momentum is not None:  # before any host can be acknowledged
            self.load_outer_momentum(outer_momentum, sync_round=outer_round)
        self._accept_thread = threading.Thread(target=self._accept_loop,
                                               name="flodl-shm-controller-accept", daemon=True)
        self._reduce_thread = threading.Thread(target=self._reduce_main,
                                               name="flodl-shm-controller-reduce", daemon=True)
        self._accept_thread.start()
        self._reduce_thread.start()

    @classmethod
    def start(cls, addr, world_size: int, salt, *, round_timeout: float | None = DEFAULT_ROUND_TIMEOUT,
              dead_ranks: DeadRanks | None = None, forge=None, outer=None,
              outer_momentum=None, outer_round: int | None = None) -> "ClusterController":
        """Bind ``addr`` ("host:port" or (host, port); port 0 = any free port) and serve a
        cohort of ``world_size`` ranks authenticated by the 16-byte ``salt``.

        ``outer`` is the outer optimizer the ranks' params rounds step here; to resume,
        ``outer_momentum`` (tensors in params order) is the momentum of the checkpoint
        saved at sync round ``outer_round`` (``load_outer_momentum``)."""
        if not 0 < int(world_size) <= MAX_WORLD_SIZE:
            raise ValueError(f"ClusterController: world_size must be from 1 to "
                             f"{MAX_WORLD_SIZE:,} (the most ranks a cohort holds), got "
                             f"{world_size}")
        if round_timeout is not None and not round_timeout > 0:
            raise ValueError(f"ClusterController: round_timeout must be > 0 seconds or None "
                             f"(no deadline of its own), got {round_timeout}")
        salt = check_salt(salt)
        if dead_ranks is None:
            dead_ranks = DeadRanks(world_size)
        elif dead_ranks.world_size != world_size:
            raise ValueError(f"ClusterController: the DeadRanks ledger has world_size "
                             f"{dead_ranks.world_size}, the cohort {world_size}")
        host, port = parse_addr(addr)
        try:
            sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            if not (isinstance(e.errno, int) and e.errno < 0):  # (not a name lookup's)
                raise
            why = (e.strerror or str(e)).split(" (")[0]
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {why}; bind an "
                                   f"address of this machine (0.0.0.0:{port} for every "
                                   f"interface, 127.0.0.1:{port} for this host alone)") from None
        sock.settimeout(0.2)
        # debug: the command prints the one "listening" line a person reads
        logger.debug("controller listening on %s:%d for %d ranks", host, sock.getsockname()[1],
                     world_size)
        return cls(sock, int(world_size), salt, round_timeout=round_timeout,
                   dead_ranks=dead_ranks, forge=forge, outer=outer,
                   outer_momentum=outer_momentum, outer_round=outer_round)

    # -- public ----------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0, stopped: str | None = None) -> None:
        """Stop serving: let the reduce loop finish what it is reading (records already
        received, such as a host's ``host_done``, are still handled), then close every
        link and join the threads. ``stopped``: how an operator stopped it ("interrupted",
        "stopped by SIGTERM"), told to the hosts still running before their links close
        (with the rounds done and how to continue), so they stop with it rather than with
        a broken pipe."""
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self._reduce_thread.join(timeout)
        with self._lock:
            hosts = list(self._hosts)
            pending = list(self._pending)
            self._pending.clear()
            self._dropped.update(pending)  # (their threads end them without a word)
        for conn in pending:
            _shut(conn)
        reason = None if stopped is None else f"the controller was {self.stopped_line(stopped)}"
        for h in hosts:
            if reason is not None and h.alive and not h.done:
                try:
                    h.link.send_ctrl(ctrl_message(Ctrl.ERROR, message=reason))
                except OSError:  # (gone already: it has nothing left to be told)
                    pass
            h.link.close()
        self._accept_thread.join(timeout)
        self._reduce_thread.join(timeout)
        for log in (self._admission_log, self._rejected_log, self._refused_log,
                    self._dropped_log):
            log.flush()  # what a flood's last seconds did not say
        if self.forge is not None:
            self.forge.flush(60)

    def stopped_line(self, stopped: str, hosts: str = "") -> str:
        """What an operator's stop says (``stopped``: "interrupted", "stopped by
        SIGTERM"), to its hosts and in the ``controller`` command's last line (``hosts``:
        what became of them): the rounds done, and how to continue (``--resume`` once a
        checkpoint was taken; an outer optimizer's momentum lives here: the file to
        restart with)."""
        last = self.last_armed[0] if self.last_armed else None
        state = ""
        if self.outer is not None:
            from ..checkpoint.forge import outer_sidecar_path

            state = (f" with --outer nesterov --outer-state "
                     f"{outer_sidecar_path(last) if last else '<stem>.outer.fdl'} (of the "
                     f"round the hosts resume from)")
        return (f"{stopped} after {self.stats.rounds} rounds; {hosts}to continue, restart "
                f"the controller{state}, then every host" + (
                    " with --resume" if last is not None else
                    " (no checkpoint was taken yet: they start over)"))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the cohort to end; True if it did."""
        return self._done.wait(timeout)

    def hosts(self) -> list[tuple[str, list[int], bool]]:
        """The registered hosts in rank order: (name, global ranks, still running). A
        host that left before the cohort was complete is no longer listed."""
        with self._lock:
            return [(h.name, list(h.ranks), h.alive and not h.done) for h in self._hosts]

    def load_outer_momentum(self, tensors, *, sync_round: int | None = None) -> None:
        """Restore the outer momentum (in params order) before the first outer round.

        ``sync_round``: the sync round of the checkpoint it was saved with. Hosts that
        join afterwards learn it at the handshake, and a Trainer refuses to resume from
        any other round; without it nothing is checked. Call it before hosts join
        (``start(outer_momentum=...)`` does)."""
        from ..engine.tensor_codec import flat_f32  # torch: only where tensors come in

        with self._lock:
            self._outer_loaded = flat_f32(tensors)
            self._outer_round = None if sync_round is None else int(sync_round)

    @property
    def outer_round(self) -> int | None:
        """The sync round of the loaded outer momentum (None: fresh, or unknown)."""
        return self._outer_round

    def _ack_fields(self) -> dict:
        """The ``hello_ack`` fields (``control.py``): the outer optimizer stepped here and
        where its momentum starts."""
        with self._lock:
            if self.outer is None:
                return {"outer": {"kind": "none"}}
            fields = {"outer": outer_fields(self.outer)}  # (the relay checks Nesterov's)
            if self._outer_loaded is None or self._outer_round is not None:
                # (a momentum loaded without its round has no start to check)
                fields["outer_start_round"] = (-1 if self._outer_loaded is None
                                               else self._outer_round)
            return fields

    # -- accept ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        """Accept until shutdown. Out of descriptors (EMFILE/ENFILE): drop the oldest
        pending handshake and retry at once, or, with none to drop, back off (up to
        1 s); log it (at most every 10 s) and keep accepting."""
        backoff = 0.0
        while not self._stop.is_set():
            self._expire_pending()
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stop.is_set():
                    break
                dropped = e.errno in _FD_ERRNOS and self._drop_oldest_pending()
                self._note_drop(f"accept failed: {e}" + ("" if e.errno in _FD_ERRNOS else
                                                         "; retrying"),
                                "stop the flood or raise `ulimit -n`")
                if not dropped:
                    backoff = min(1.0, max(0.05, 2 * backoff))
                    time.sleep(backoff)
                continue
            backoff = 0.0
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._pending[conn] = time.monotonic()
                over = len(self._pending) > MAX_PENDING_HANDSHAKES
            if over and self._drop_oldest_pending():
                self._note_drop(f"more than {MAX_PENDING_HANDSHAKES} connections mid-handshake")
            self._start_handshake(conn, f"{addr[0]}:{addr[1]}")

    def _start_handshake(self, conn: socket.socket, peer: str) -> None:
        """Hand ``conn`` to a handshake thread of its own, once a slot is free (the
        threads of dropped connections end within moments); with none free after a
        second, or no thread to be had (a container's pids limit), close it here."""
        why = None
        t0 = time.monotonic()
        while not self._handshake_slots.acquire(timeout=0.2):
            self._expire_pending()
            if self._stop.is_set():
                why = "stopping"
                break
            if time.monotonic() - t0 > 1.0:
                why = f"{MAX_HANDSHAKE_THREADS} handshake threads still running"
                break
        if why is None:
            try:
                threading.Thread(target=self._handshake, args=(conn, peer),
                                 name="flodl-shm-controller-handshake", daemon=True).start()
                return
            except RuntimeError as e:  # "can't start new thread"
                self._handshake_slots.release()
                why = f"no thread for a handshake ({e})"
        with self._lock:
            counted = self._pending.pop(conn, None) is None  # dropped meanwhile: said so
            self._dropped.discard(conn)
        _shut(conn, close=True)
        if why != "stopping" and not counted:
            self._note_drop(why)

    def _note_drop(self, why: str, fix: str = "stop the flood") -> None:
        """Log admission trouble: the first time, then at most every 10 s, with counts."""
        self._admission_log.say(
            "controller: %s (%d handshakes pending; the oldest is dropped for a new one); "
            "still accepting - if real hosts wait, %s", why, len(self._pending), fix)

    def _drop_oldest_pending(self) -> bool:
        """Shut the oldest mid-handshake connection (its thread then ends it)."""
        with self._lock:
            if not self._pending:
                return False
            conn, _ = self._pending.popitem(last=False)
            self._dropped.add(conn)
        _shut(conn)
        return True

    def _expire_pending(self) -> None:
        """Shut connections mid-handshake for longer than the handshake deadline."""
        limit = time.monotonic() - (handshake_deadline_s() + 1.0)
        with self._lock:
            conns = [c for c, t0 in self._pending.items() if t0 < limit]
            for c in conns:
                del self._pending[c]
        for conn in conns:  # (its thread says why: no data for the deadline)
            _shut(conn)

    def _validate(self, hello: dict) -> str | None:
        try:
            ws = int(hello.get("world_size"))
            ranks = [int(r) for r in hello.get("ranks")]
            name = str(hello.get("host"))
            timeout = hello.get("timeout")
            if timeout is not None and not float(timeout) > 0:
                raise ValueError(timeout)
        except (TypeError, ValueError):
            return f"malformed hello {hello!r}"
        if ws != self.world_size:
            return (f"world_size {ws} != the controller's world_size {self.world_size} "
                    f"(every host must pass the same world_size)")
        if not ranks:
            return "the host announced no ranks"
        if sorted(set(ranks)) != sorted(ranks):
            return f"duplicate ranks in {ranks}"
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            return f"ranks {bad} are out of range for world_size {self.world_size}"
        with self._lock:
            if self._complete.is_set():
                return "the cohort is already complete"
            # the ranks first: a demo host's name holds its ranks ('vm:0-1'), so a second
            # host with the same --first-rank is an overlap, not merely a name taken
            taken = [r for r in ranks if r in self._claimed]
            if taken:
                return (f"ranks {taken} are already carried by host "
                        f"{self._claimed[taken[0]]!r} (overlapping rank sets): give each "
                        f"host its own ranks (--first-rank)")
            if any(h.name == name for h in self._hosts) or name in self._pending_names:
                return f"a host named {name!r} is already connected (duplicate host)"
        return None

    def _admit(self, hello: dict, link: Link) -> str | None:
        """Validate and claim a host's ranks in one step (racing hellos cannot both
        win). The host becomes visible to the reduce loop only after its ack is sent
        (``_handshake``), so no two threads ever write one link."""
        with self._lock:
            if self._pending.pop(link.sock, None) is None:
                return "the connection was dropped before its hello (admission overload)"
            reason = self._validate(hello)
            if reason is None:
                self._pending_names.add(str(hello["host"]))
                for r in hello["ranks"]:
                    self._claimed[int(r)] = str(hello["host"])
                self._admitted[link.sock] = hello
            return reason

    def _unclaim(self, conn: socket.socket) -> None:
        """Release what ``_admit`` claimed for a connection whose handshake then failed."""
        with self._lock:
            hello = self._admitted.pop(conn, None)
            if hello is not None:
                self._pending_names.discard(str(hello["host"]))
                for r in hello["ranks"]:
                    self._claimed.pop(int(r), None)

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        hello = None
        try:
            link, hello = server_handshake(conn, self.salt, peer, self._admit,
                                           self._ack_fields())
        except HandshakeRejected as e:  # (a host in a restart loop: its line, then counts)
            self._rejected_log.say("controller: %s", e, key=getattr(e, "key", None))
            return
        except Exception as e:  # silent, garbage, wrong secret: drop, keep serving
            with self._lock:
                ours = conn in self._dropped  # (counted when it was dropped)
            if not ours and "session secret" in str(e):
                self._refused_log.say("controller: refused %s: %s", peer, e)
            elif not ours:
                self._dropped_log.say("controller: dropped connection from %s: %s", peer, e)
            self._unclaim(conn)
            try:
                conn.close()
            except OSError:
                pass
            return
        finally:
            with self._lock:
                self._pending.pop(conn, None)
                self._dropped.discard(conn)
            self._handshake_slots.release()
        ranks = sorted(int(r) for r in hello["ranks"])
        timeout = hello.get("timeout")
        with self._lock:
            self._admitted.pop(conn, None)
            self._pending_names.discard(str(hello["host"]))
            self._hosts.append(_Host(link, str(hello["host"]), ranks,
                                     None if timeout is None else float(timeout)))
            self._hosts.sort(key=lambda h: h.first)
            # complete once every rank is claimed AND every claiming host is a member: a
            # host admitted (its ranks claimed) whose thread has not reached this line
            # yet would miss round 0 and send its round-k frame into round k+1
            if len(self._claimed) == self.world_size and not self._admitted:
                self._complete.set()
        logger.info("controller: host %r joined with ranks %s (%d/%d ranks)", hello["host"],
                    ranks, len(self._claimed), self.world_size)

    # -- reduce ----------------------------------------------------------------------
    def _forget_departed(self) -> None:
        """Before the cohort is complete: forget every host whose link closed (its
        ranks and name become free again, so a relaunch is admitted), except the ranks
        it reported dead before it left (a host whose every rank died exits): those
        stay claimed, and dead, so the cohort completes without them."""
        with self._lock:
            if self._complete.is_set() or not self._hosts:
                return
            poller = select.poll()
            for h in self._hosts:
                poller.register(h.link.sock, _CLOSED)
            try:
                gone = {fd for fd, ev in poller.poll(0) if ev & _CLOSED}
            except OSError:
                return
            for h in [h for h in self._hosts if h.link.sock.fileno() in gone]:
                dead = self._reported_dead(h)
                self._hosts.remove(h)
                free = [r for r in h.ranks if r not in dead]
                for r in free:
                    self._claimed.pop(r, None)
                for r in sorted(dead):
                    self.dead_ranks.declare_dead(r)  # announced once the cohort is complete
                h.link.close()
                if dead:
                    logger.warning("controller: ranks %s of host %r died before the cohort was "
                                   "complete; the cohort goes on without them", sorted(dead),
                                   h.name)
                if free:
                    # (one it told the cohort did not form stops on being told: no news)
                    how = ("stopped, as told" if h.told_unformed
                           else "left before the cohort was complete")
                    logger.warning("controller: host %r %s%s; its ranks %s are free for a "
                                   "relaunch (%d/%d ranks claimed)", h.name, how,
                                   "" if h.stopped is None else f" ({h.stopped})",
                                   free, len(self._claimed), self.world_size)

    def _stall_unformed(self) -> None:
        """Before the cohort is complete: a host that has waited past the deadline it
        announced (its ranks' collective timeout, plus half their launcher's grace) for
        ranks no host carries is told its round 0 stalled, naming those ranks, so its
        ranks stop with that reason rather than give up moments later with none. Its
        link then closes and ``_forget_departed`` frees its ranks for a relaunch.
        (``round_timeout`` bounds rounds among joined hosts: how long to wait for hosts
        still starting is each host's to say.)"""
        now = time.monotonic()
        with self._lock:
            missing = [r for r in range(self.world_size) if r not in self._claimed]
            if not missing or self._admitted:
                return  # every rank is claimed: the cohort is forming now
            for h in self._hosts:
                limit = h.timeout
                if limit is None or h.told_unformed or now - h.joined < limit:
                    continue
                h.told_unformed = True
                logger.error("controller: host %r waited %g s for ranks %s, which no host "
                             "carries; told it the cohort did not form", h.name, limit, missing)
                try:
                    h.link.send_ctrl(ctrl_message(
                        Ctrl.STALL, round=0, missing=missing, timeout=limit,
                        reason="never joined the cohort (their host was not started, is "
                               "still starting, or was refused: see the controller's log)"))
                except OSError:
                    pass  # its link closed: _forget_departed frees its ranks

    def _reported_dead(self, h: _Host) -> set[int]:
        """Of a host whose link closed: its ranks its last records declared dead
        (``RANK_DEAD``, which its supervisor sends before it leaves)."""
        dead: set[int] = set()
        while True:
            try:
                got = h.link.recv(None, timeout=1.0, idle=1.0)  # buffered, then the end
            except Exception:  # noqa: BLE001 - a torn or refused stream ends the reading
                return dead
            if got is None:
                return dead
            kind, _flags, body = got
            if kind == Kind.CTRL and body.get("type") == Ctrl.RANK_DEAD:
                dead.update(int(r) for r in body.get("ranks", []) if int(r) in h.ranks)
            elif kind == Kind.CTRL and body.get("type") == Ctrl.HOST_STOPPING:
                self._note_stopping(h, body)

    def _reduce_main(self) -> None:
        try:
            while not self._complete.wait(0.2):
                if self._stop.is_set():
                    return
                self._forget_departed()
                self._stall_unformed()
            n = len(self._hosts)
            logger.info("controller: cohort complete (%d host%s); reducing", n,
                        "" if n == 1 else "s")
            early = self.dead_ranks.dead()
            if early:  # ranks that died before every host had joined
                self._broadcast_ctrl(ctrl_message(Ctrl.DECLARE_DEAD, ranks=early))
            rnd = 0
            while not self._stop.is_set():
                live = [h for h in self._hosts if h.alive and not h.done]
                if not live:
                    break
                if not self._round(rnd, live):
                    break
                rnd += 1
        except BaseException as e:  # noqa: BLE001 - recorded and reported to the hosts
            self.error = e
            logger.error("controller: reduce loop failed: %s", e)
            self._broadcast_ctrl(ctrl_message(Ctrl.ERROR, message=f"{type(e).__name__}: {e}"))
        finally:
            self._done.set()

    def _note_stopping(self, h: _Host, msg: dict) -> None:
        """Record why host ``h`` stops (its ``host_stopping`` message)."""
        rank, reason = int(msg.get("rank", -1)), str(msg.get("reason") or "no reason given")
        h.stopped = reason if rank < 0 else f"rank {rank}: {reason}"  # (-1: no rank's)
        self.stopped_hosts[h.name] = (rank, reason)

    def _host_failed(self, h: _Host, why: str) -> None:
        if not h.alive:
            return
        h.alive = False
        newly = [r for r in h.ranks if self.dead_ranks.declare_dead(r)]
        if h.stopped is not None:  # it said why before its link closed
            logger.error("controller: host %r stopped (%s); its ranks %s are out of the "
                         "cohort", h.name, h.stopped, h.ranks)
        else:
            logger.error("controller: host %r failed (%s; that host's output says why); "
                         "ranks %s declared dead", h.name, why, h.ranks)
        h.link.close()
        if newly:
            said = (f"host {h.name!r} stopped: {h.stopped}" if h.stopped is not None else
                    f"host {h.name!r} was lost ({why}; that host's output says why)")
            self._broadcast_ctrl(ctrl_message(Ctrl.DECLARE_DEAD, ranks=newly, why=said))

    @property
    def stopped_early(self) -> bool:
        """Whether the ranks ended the run before its end (a Trainer's survivors past
        ``max_failures``, a stall): the last checkpoint they armed says so by its reason.
        Their hosts then report done, as after a finished run."""
        return self.last_armed is not None and self.last_armed[1] in EARLY_STOP_REASONS

    def _broadcast_ctrl(self, msg: dict) -> None:
        for h in self._hosts:
            if h.alive and not h.done:
                try:
                    h.link.send_ctrl(msg)
                except OSError as e:
                    self._host_failed(h, f"write failed: {e}")

    def _handle_ctrl(self, h: _Host, msg: dict) -> None:
        kind = msg["type"]
        if kind == Ctrl.RANK_DEAD:
            newly = [int(r) for r in msg.get("ranks", []) if self.dead_ranks.declare_dead(int(r))]
            if newly:
                logger.warning("controller: ranks %s died on host %r", newly, h.name)
                self._broadcast_ctrl(ctrl_message(
                    Ctrl.DECLARE_DEAD, ranks=newly,
                    why=f"died on host {h.name!r}, whose output says why"))
        elif kind == Ctrl.HOST_DONE:
            h.done = True
            logger.info("controller: host %r finished", h.name)
        elif kind == Ctrl.HOST_STOPPING:
            self._note_stopping(h, msg)  # said when its link closes, right after
        elif kind == Ctrl.ARM:
            self._arm(msg)
        else:
            logger.warning("controller: ignoring control message %r from %r", kind, h.name)

    def _arm(self, msg: dict) -> None:
        """A rank armed a checkpoint: the forge (rebuilt when the model's names change)
        captures the next tapped consensus frames."""
        from ..checkpoint.forge import arm_from_head
        from ..checkpoint.tap_head import TapHead

        head = TapHead.from_arm_fields(msg)
        self.forge = arm_from_head(self.forge, head)
        self.last_armed = (head.path, (head.meta or {}).get("save_reason"))

    def _sink(self, i: int, dtype: int, shape, nbytes: int) -> np.ndarray:
        key = (i, nbytes)
        buf = self._stage.get(key)
        if buf is None:
            # drop staging of other shapes at this index: one frame's worth at most
            for k in [k for k in self._stage if k[0] == i]:
                del self._stage[k]
            buf = np.empty(nbytes, np.uint8)
            self._stage[key] = buf
        return buf

    def _others_pending(self, h: _Host) -> bool:
        """Whether another live host has bytes waiting (it delivered its part)."""
        return bool(self._pending_hosts([x for x in self._hosts if x is not h]))

    def _pending_hosts(self, hosts: list[_Host]) -> set[int]:
        """ids of the live hosts among ``hosts`` with bytes waiting on their link."""
        live = [x for x in hosts if x.alive and not x.done]
        if not live:
            return set()
        poller = select.poll()
        for x in live:
            poller.register(x.link.sock, select.POLLIN)
        try:
            ready = {fd for fd, ev in poller.poll(0) if ev & select.POLLIN}
        except (OSError, ValueError):
            return set()
        return {id(x) for x in live if x.link.sock.fileno() in ready}

    def _recv_frame(self, h: _Host, rnd: int, clock: "_RoundClock"):
        """Read host h's next frame, handling control records first; None if h is gone.

        The round's deadline starts when some host has delivered (time between rounds
        is training, not a stall); a host still silent ``round_timeout`` later stalls it.
        A host that stops in the middle of a record for that long, or while the
        controller stops, has a broken link (``RecordStalled``: the host fails).
        """
        while True:
            try:
                got = h.link.recv(self._sink, timeout=0.2, idle=clock.timeout, abort=self._stop)
            except TimeoutError:
                if self._stop.is_set():
                    return None
                if clock.start is None and self._others_pending(h):
                    clock.start = time.monotonic()
                if clock.expired():
                    raise
                continue
            if got is None:
                if h.done:
                    return None
                self._host_failed(h, "connection closed")
                return None
            kind, flags, body = got
            if kind == Kind.CTRL:
                self._handle_ctrl(h, body)
                if h.done:
                    return None
                continue
            if kind != Kind.FRAME_UP:
                raise FrameError(f"host {h.name!r} sent a {kind.name} record upstream")
            return flags, body

    def _stall_deadline(self) -> float | None:
        """The round deadline: ``round_timeout`` or the shortest collective timeout a
        host announced (its ranks would give up first), whichever is smaller."""
        limits = [t for t in [self.round_timeout] + [h.timeout for h in self._hosts]
                  if t is not None]
        return min(limits) if limits else None

    def _round(self, rnd: int, live: list[_Host]) -> bool:
        t0 = time.monotonic()
        clock = _RoundClock(self._stall_deadline())
        schema = None
        mass = 0.0
        flags = 0
        offs: list[int] = []
        got_any = False
        for h in live:
            try:
                res = self._recv_frame(h, rnd, clock)
            except TimeoutError:
                later = live[live.index(h) + 1:]
                delivered = self._pending_hosts(later)
                silent = [h] + [x for x in later if id(x) not in delivered]
                waiting = [r for x in silent if x.alive and not x.done
                           for r in x.ranks if not self.dead_ranks.is_dead(r)]
                self._stall(rnd, waiting, clock.timeout)
                return False
            except (FrameError, OSError) as e:
                if self._stop.is_set():
                    return False
                self._host_failed(h, str(e))
                continue
            if res is None:
                if self._stop.is_set():  # stopped mid-round: no consensus of a part of
                    return False         # the hosts (the others never delivered theirs)
                continue
            if clock.start is None:
                clock.start = time.monotonic()
            fl, frame = res
            this = (frame.kind, tuple((p.dtype, p.shape) for p in frame.tensors))
            if fl & FLAG_OUTER and self.outer is None:
                raise FrameError(
                    f"round {rnd}: the ranks sent their params frame for an outer optimizer "
                    f"step, but this controller has none; start it with the ranks' optimizer "
                    f"(python -m flodl_shm controller --outer nesterov --outer-lr LR "
                    f"--outer-momentum MU, or ClusterController.start(..., outer=...))")
            if schema is None:
                schema, flags = this, fl
                offs = list(np.cumsum([0] + [int(np.prod(p.shape, dtype=np.int64))
                                             for p in frame.tensors]))
                nelem = offs[-1]
                if self._acc.shape[0] != nelem:
                    self._acc = np.empty(nelem, np.float32)
            elif this != schema:
                raise FrameError(
                    f"round {rnd}: host {h.name!r} sent a frame of schema {this} but the round's "
                    f"first frame had {schema} (ranks must make the same collective calls with "
                    f"the same shapes and bf16_wire setting"
                    + ("; a CONTROL frame of no tensors is a barrier, or a rank's refused call, "
                       "whose own error says why)" if () in (this[1], schema[1]) else ")"))
            self._add(frame, offs, first=not got_any)
            got_any = True
            mass += frame.weight
            h.sent += sum(p.nbytes for p in frame.tensors)
            self.stats.bytes_in += sum(p.nbytes for p in frame.tensors)
        if not got_any:
            return bool([h for h in self._hosts if h.alive and not h.done])
        kind, shapes = schema[0], [s for _, s in schema[1]]
        dtype = schema[1][0][0] if schema[1] else DTYPE_F32
        out = self._finish(kind, dtype, shapes, offs, mass, flags)
        # the consensus goes to the hosts of this round only (every live one delivered)
        self._scatter(OutgoingFrame(out, self.salt), [h for h in live if h.alive and not h.done])
        if self.forge is not None and flags & FLAG_TAP and kind == RoundKind.MODEL:
            self._tap(out, flags)
        self.stats.rounds += 1
        self.stats.round_s.append(time.monotonic() - t0)
        if self.stats.rounds % _RSS_EVERY == 0 or offs[-1] >= 1 << 18:  # (1 MiB of f32)
            self._note_rss()
        return True

    def _scatter(self, prepared: OutgoingFrame, targets: list[_Host]) -> None:
        """Send the consensus (split and hashed once) to the round's hosts; large
        frames go to the hosts concurrently, one thread per link (each link keeps a
        single writer). A host whose link breaks is declared dead and the others still
        get the frame."""
        out = prepared.frame
        errors: dict[int, BaseException] = {}

        def send(i: int, h: _Host) -> None:
            try:
                h.link.send_frame(Kind.FRAME_DOWN, prepared)
            except OSError as e:
                errors[i] = e

        if len(targets) > 1 and out.payload_nbytes() >= PARALLEL_SCATTER_BYTES:
            threads = [threading.Thread(target=send, args=(i, h), daemon=True)
                       for i, h in enumerate(targets[1:], 1)]
            for t in threads:
                t.start()
            send(0, targets[0])
            for t in threads:
                t.join()
        else:
            for i, h in enumerate(targets):
                send(i, h)
        for i, h in enumerate(targets):
            if i in errors:
                self._host_failed(h, f"scatter failed: {errors[i]}")
            else:
                self.stats.bytes_out += out.payload_nbytes()

    def _add(self, frame: RoundFrame, offs: list[int], first: bool) -> None:
        acc = self._acc
        for i, p in enumerate(frame.tensors):
            dst = acc[offs[i]:offs[i + 1]]
            src = p.as_array(i)
            if first:
                if p.dtype == DTYPE_F32:
                    np.copyto(dst, src)
                else:
                    K.bf16_to_f32(src, dst)
            elif p.dtype == DTYPE_F32:
                K.accumulate_f32(dst, src, 1.0)
            else:
                K.accumulate_bf16(dst, src, 1.0, _SCRATCH)

    def _finish(self, kind: int, dtype: int, shapes, offs, mass: float, flags: int) -> RoundFrame:
        """Divide once, step the outer optimizer, encode in the wire dtype."""
        acc = self._acc
        model = kind == RoundKind.MODEL
        inv = float(np.float32(1.0 / mass)) if model and mass > 0.0 else 1.0
        if dtype == DTYPE_F32:
            if inv != 1.0:
                K.finalize_f32(acc, acc, inv)
        else:
            out16 = self._stage.setdefault((-1, acc.shape[0]), np.empty(acc.shape[0], np.uint16))
            K.finalize_bf16(acc, out16, inv, _SCRATCH)
            K.bf16_to_f32(out16, acc)  # the consensus as the ranks will see it
        if model and mass > 0.0 and flags & FLAG_OUTER and self.outer is not None:
            self._outer_step(acc)
        if dtype == DTYPE_F32:
            body = acc
        else:
            body = self._stage[(-1, acc.shape[0])]
            K.f32_to_bf16(acc, body)
        esize = elem_size(dtype)
        raw = body.view(np.uint8)
        tensors = [TensorPayload(dtype, tuple(s), raw[offs[i] * esize:offs[i + 1] * esize])
                   for i, s in enumerate(shapes)]
        return RoundFrame(tensors, mass, RoundKind(kind))

    def _outer_step(self, cons: np.ndarray) -> None:
        n = cons.shape[0]
        fresh = False
        if self._prev is None or self._prev.shape[0] != n:
            loaded = self._outer_loaded
            if loaded is not None and loaded.shape[0] != n and self._mom is None:
                # another model's momentum: refused (the hosts hear it), never replaced by
                # fresh momentum behind a resume that asked for this one
                raise ValueError(
                    f"the loaded outer momentum holds {loaded.shape[0]} values and the "
                    f"model's parameters {n}: it belongs to another model. Restart the "
                    f"controller with the .outer.fdl saved with the checkpoint the hosts "
                    f"resume from (--outer-state)")
            self._prev = cons.copy()
            if loaded is not None and loaded.shape[0] == n:
                self._mom = loaded.copy()
            else:
                self._mom = np.zeros(n, np.float32)
                fresh = True
        self.outer.step_flat(self._prev, cons, self._mom, fresh, cons)
        np.copyto(self._prev, cons)

    def _tap(self, out: RoundFrame, flags: int) -> None:
        if flags & FLAG_OUTER and self._mom is not None:
            offs = np.cumsum([0] + [p.numel for p in out.tensors])
            self.forge.stash_outer_momentum([
                TensorPayload(DTYPE_F32, p.shape, self._mom[offs[i]:offs[i + 1]].copy())
                for i, p in enumerate(out.tensors)])
        self.forge.accumulate(RoundFrame(list(out.tensors), out.weight, out.kind), copy=True)

    def _stall(self, rnd: int, missing: list[int], timeout: float | None) -> None:
        logger.error("controller: round %d stalled after %s s; missing ranks %s", rnd,
                     timeout, missing)
        self._broadcast_ctrl(ctrl_message(Ctrl.STALL, round=rnd, missing=missing,
                                          timeout=timeout))
        self.error = ReduceStall(f"round {rnd} stalled at the controller after {timeout} s; "
                                 f"ranks that never delivered: {missing}", round=rnd,
                                 missing=tuple(missing), timeout=timeout, global_ranks=True)

    def _note_rss(self) -> None:
        try:
            if self._me is None:
                import psutil

                self._me = psutil.Process()
            self.stats.peak_rss = max(self.stats.peak_rss, self._me.memory_info().rss)
        except Exception:
            pass


_SCRATCH = np.empty(4096, np.float32)


def _shut(conn: socket.socket, close: bool = False) -> None:
    """Shut a connection down both ways: a thread blocked reading it sees EOF and
    closes it. ``close``: no thread has it, free its descriptor now. (Closing one that
    a thread reads would let that thread read whatever connection gets the number
    next.)"""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    if close:
        conn.close()


class _Throttled:
    """A log line that a flood can repeat (a port scanner, garbage peers): said the first
    time, then at most every ``_FLOOD_REPORT_S`` seconds, with how many were not said."""

    def __init__(self, level: int, what: str) -> None:
        self.level = level
        self.what = what
        self._seen: OrderedDict[object, list] = OrderedDict()  # key -> [last said, unsaid]
        self._lock = threading.Lock()

    def say(self, fmt: str, *args, key: object = None) -> None:
        """Log ``fmt % args`` unless a line of the same ``key`` was said less than
        ``_FLOOD_REPORT_S`` ago (then count it)."""
        with self._lock:
            now = time.monotonic()
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < _FLOOD_REPORT_S:
                seen[1] += 1
                return
            unsaid = 0 if seen is None else seen[1]
            self._seen[key] = [now, 0]
            self._seen.move_to_end(key)
            while len(self._seen) > _FLOOD_KEYS_KEPT:
                self._seen.popitem(last=False)
        more = f" ({unsaid} more like it since the last report)" if unsaid else ""
        logger.log(self.level, fmt + more, *args)

    def flush(self) -> None:
        """Say how many went unsaid since the last report, if any."""
        with self._lock:
            unsaid = sum(seen[1] for seen in self._seen.values())
            for seen in self._seen.values():
                seen[1] = 0
        if unsaid:
            logger.log(self.level, "controller: %d more %s since the last report", unsaid,
                       self.what)


class _RoundClock:
    """A round's stall deadline: ``timeout`` seconds after the first delivery."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.start: float | None = None

    def expired(self) -> bool:
        return (self.timeout is not None and self.start is not None
                and time.monotonic() - self.start > self.timeout)

"""The controller's door: who joins the cohort, and the cohort it forms.

``Admission`` owns the controller's listening socket. Its accept thread hands each
connection to a handshake thread of its own (``link.server_handshake``), which checks
the host's hello against the cohort (``_validate``: the same world size, ranks in range
and not carried by another host, a name not taken) and claims its ranks in the same
step (``_admit``: two racing hellos cannot both win). A host becomes a member
(``hosts``) only once its ack is sent, so the reduce loop and a handshake thread never
write one link. The cohort is ``complete`` once every rank is claimed and every
claiming host is a member.

Before that, the reduce loop calls ``forget_departed`` (a host whose link closed is
forgotten: its ranks and name are free for a relaunch, but the ranks it reported dead
stay claimed, and dead) and ``tell_unformed`` (a host that waited past the deadline it
announced for ranks no host carries is told its round 0 stalled, naming them).

Admission is bounded: at most ``MAX_PENDING_HANDSHAKES`` connections may be
mid-handshake (the oldest is dropped for a new one), each for at most the handshake
deadline, on at most ``MAX_HANDSHAKE_THREADS`` threads (a dropped connection's thread
ends it: the accept loop only shuts it down, so no thread ever reads a descriptor
number reused by another connection); running out of file descriptors or threads backs
off and keeps accepting instead of ending the accept loop. What a flood repeats
(refused and dropped connections) is logged the first time, then at most every 10 s
with a count (``Throttled``).

Every member and claim is read and written under the controller's lock, which the
controller hands in: its reduce loop reads ``hosts`` under it too.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from .control import Ctrl, ctrl_message
from .dead_ranks import DeadRanks
from .link import HandshakeRejected, Link, handshake_deadline_s, server_handshake

logger = logging.getLogger("flodl_shm")

MAX_PENDING_HANDSHAKES = 64  # connections mid-handshake; the oldest goes for a new one
#: handshake threads alive at once: the pending ones and those ending a dropped connection
MAX_HANDSHAKE_THREADS = 2 * MAX_PENDING_HANDSHAKES
_FLOOD_REPORT_S = 10.0  # the most often a line a flood repeats is logged
_FLOOD_KEYS_KEPT = 256  # distinct lines a throttle tracks (the oldest goes)
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_CLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


@dataclass
class Host:
    """A member of the cohort: its link, name and ranks (ascending), and what the
    controller learned of it since it joined."""

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


class Admission:
    """The door of a controller serving ``world_size`` ranks authenticated by ``salt``
    (module docstring).

    Args:
        sock: the bound listening socket (with a timeout, so the accept loop sees
            ``stop``); closed by ``close``.
        dead_ranks: the cohort's ledger: ranks a departed host reported dead stay dead.
        lock: the controller's lock, over every member and claim.
        stop: set when the controller stops serving.
        ack_fields: the fields of the ack a joining host is sent (the controller's
            outer state).
    """

    def __init__(self, sock: socket.socket, world_size: int, salt: bytes,
                 dead_ranks: DeadRanks, *, lock: threading.RLock, stop: threading.Event,
                 ack_fields: Callable[[], dict]) -> None:
        self._sock = sock
        self.world_size = world_size
        self.salt = salt
        self._dead_ranks = dead_ranks
        self._lock = lock
        self._stop = stop
        self._ack_fields = ack_fields
        #: the member hosts, by first rank
        self.hosts: list[Host] = []
        #: global rank -> the name of the host that claimed it
        self.claimed: dict[int, str] = {}
        #: set once every rank is claimed and every claiming host is a member
        self.complete = threading.Event()
        self._pending_names: set[str] = set()
        self._pending: OrderedDict[socket.socket, float] = OrderedDict()  # mid-handshake
        self._admitted: dict[socket.socket, dict] = {}  # hellos admitted, ack not yet sent
        self._admission_log = Throttled(logging.ERROR, "connections dropped at admission")
        self._rejected_log = Throttled(logging.ERROR, "hosts refused")  # (per host, reason)
        self._refused_log = Throttled(logging.ERROR, "peers refused (another secret)")
        self._dropped_log = Throttled(logging.WARNING, "failed handshakes dropped")
        self._dropped: set[socket.socket] = set()  # shut by us, their threads to end them
        self._handshake_slots = threading.BoundedSemaphore(MAX_HANDSHAKE_THREADS)
        self._accept_thread = threading.Thread(target=self._accept_loop,
                                               name="flodl-shm-controller-accept", daemon=True)

    def start(self) -> None:
        """Start accepting."""
        self._accept_thread.start()

    def close(self) -> None:
        """Stop accepting (``stop`` is set already): close the listening socket and
        shut the connections still mid-handshake (their threads end them)."""
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
            self._dropped.update(pending)  # (their threads end them without a word)
        for conn in pending:
            shut(conn)

    def join(self, timeout: float | None) -> None:
        """Wait for the accept thread to end (after ``close``), then say what the logs
        of a flood's last seconds did not."""
        self._accept_thread.join(timeout)
        for log in (self._admission_log, self._rejected_log, self._refused_log,
                    self._dropped_log):
            log.flush()

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
        shut(conn, close=True)
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
        shut(conn)
        return True

    def _expire_pending(self) -> None:
        """Shut connections mid-handshake for longer than the handshake deadline."""
        limit = time.monotonic() - (handshake_deadline_s() + 1.0)
        with self._lock:
            conns = [c for c, t0 in self._pending.items() if t0 < limit]
            for c in conns:
                del self._pending[c]
        for conn in conns:  # (its thread says why: no data for the deadline)
            shut(conn)

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
            if self.complete.is_set():
                return "the cohort is already complete"
            # the ranks first: a demo host's name holds its ranks ('vm:0-1'), so a second
            # host with the same --first-rank is an overlap, not merely a name taken
            taken = [r for r in ranks if r in self.claimed]
            if taken:
                return (f"ranks {taken} are already carried by host "
                        f"{self.claimed[taken[0]]!r} (overlapping rank sets): give each "
                        f"host its own ranks (--first-rank)")
            if any(h.name == name for h in self.hosts) or name in self._pending_names:
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
                    self.claimed[int(r)] = str(hello["host"])
                self._admitted[link.sock] = hello
            return reason

    def _unclaim(self, conn: socket.socket) -> None:
        """Release what ``_admit`` claimed for a connection whose handshake then failed."""
        with self._lock:
            hello = self._admitted.pop(conn, None)
            if hello is not None:
                self._pending_names.discard(str(hello["host"]))
                for r in hello["ranks"]:
                    self.claimed.pop(int(r), None)

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
            self.hosts.append(Host(link, str(hello["host"]), ranks,
                                     None if timeout is None else float(timeout)))
            self.hosts.sort(key=lambda h: h.first)
            # complete once every rank is claimed AND every claiming host is a member: a
            # host admitted (its ranks claimed) whose thread has not reached this line
            # yet would miss round 0 and send its round-k frame into round k+1
            if len(self.claimed) == self.world_size and not self._admitted:
                self.complete.set()
        logger.info("controller: host %r joined with ranks %s (%d/%d ranks)", hello["host"],
                    ranks, len(self.claimed), self.world_size)

    # -- before the cohort is complete ------------------------------------------
    def forget_departed(self, reported_dead: Callable[[Host], set[int]]) -> None:
        """Before the cohort is complete: forget every host whose link closed (its
        ranks and name become free again, so a relaunch is admitted), except the ranks
        it reported dead before it left (``reported_dead(host)``: a host whose every
        rank died exits): those stay claimed, and dead, so the cohort completes without
        them."""
        with self._lock:
            if self.complete.is_set() or not self.hosts:
                return
            poller = select.poll()
            for h in self.hosts:
                poller.register(h.link.sock, _CLOSED)
            try:
                gone = {fd for fd, ev in poller.poll(0) if ev & _CLOSED}
            except OSError:
                return
            for h in [h for h in self.hosts if h.link.sock.fileno() in gone]:
                dead = reported_dead(h)
                self.hosts.remove(h)
                free = [r for r in h.ranks if r not in dead]
                for r in free:
                    self.claimed.pop(r, None)
                for r in sorted(dead):
                    self._dead_ranks.declare_dead(r)  # announced once the cohort is complete
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
                                   free, len(self.claimed), self.world_size)

    def tell_unformed(self) -> None:
        """Before the cohort is complete: a host that has waited past the deadline it
        announced (its ranks' collective timeout, plus half their launcher's grace) for
        ranks no host carries is told its round 0 stalled, naming those ranks, so its
        ranks stop with that reason rather than give up moments later with none. Its
        link then closes and ``forget_departed`` frees its ranks for a relaunch.
        (``round_timeout`` bounds rounds among joined hosts: how long to wait for hosts
        still starting is each host's to say.)"""
        now = time.monotonic()
        with self._lock:
            missing = [r for r in range(self.world_size) if r not in self.claimed]
            if not missing or self._admitted:
                return  # every rank is claimed: the cohort is forming now
            for h in self.hosts:
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


def shut(conn: socket.socket, close: bool = False) -> None:
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


class Throttled:
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

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

Who joins the cohort, and how a flood of connections is bounded: ``admission.py``.
A host whose link closes before the cohort is complete is forgotten: its ranks and name
are free for a relaunch. ``docs/failure-model.md`` ("Several hosts") describes every
fault.

Also a command::

    python -m flodl_shm controller --bind 0.0.0.0:1337 --world-size 4 --secret-file secret.hex
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .. import kernels as K
from ..checkpoint.meta import SaveReason
from .admission import Admission, Host
from .dead_ranks import DeadRanks
from ..errors import FrameError, ReduceStall
from ..frame import (DTYPE_F32, RoundFrame, RoundKind, TensorPayload, describe_schema,
                     elem_size)
from .control import MAX_REASON_CHARS, MAX_WORLD_SIZE, Ctrl, ctrl_message, outer_fields
from .link import Kind, OutgoingFrame, parse_addr
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
#: the longest the controller waits for a host it drops to take the reason (``dropped``)
DROPPED_WORD_S = 1.0
PARALLEL_SCATTER_BYTES = 1 << 20  # below this, thread start-up costs more than it saves
ROUND_TIMES_KEPT = 10_000  # ControllerStats.round_s: the last rounds' seconds
_RSS_EVERY = 64  # rounds between two RSS samples (and after every round of 1 MiB or more)


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
        self._me = None  # psutil's view of this process, for the peak RSS
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._admission = Admission(sock, world_size, salt, dead_ranks, lock=self._lock,
                                    stop=self._stop, ack_fields=self._ack_fields)
        self._done = threading.Event()
        self._acc = np.empty(0, np.float32)
        self._stage: dict[tuple[int, int], np.ndarray] = {}
        self._prev: np.ndarray | None = None
        self._mom: np.ndarray | None = None
        self._outer_loaded: np.ndarray | None = None
        self._outer_round: int | None = None  # the sync round _outer_loaded was saved at
        if outer_momentum is not None:  # before any host can be acknowledged
            self.load_outer_momentum(outer_momentum, sync_round=outer_round)
        self._reduce_thread = threading.Thread(target=self._reduce_main,
                                               name="flodl-shm-controller-reduce", daemon=True)
        self._admission.start()
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
        self._admission.close()
        self._reduce_thread.join(timeout)
        with self._lock:
            hosts = list(self._admission.hosts)
        reason = None if stopped is None else f"the controller was {self.stopped_line(stopped)}"
        for h in hosts:
            if reason is not None and h.alive and not h.done:
                try:
                    h.link.send_ctrl(ctrl_message(Ctrl.ERROR, message=reason))
                except OSError:  # (gone already: it has nothing left to be told)
                    pass
            h.link.close()
        self._admission.join(timeout)
        self._reduce_thread.join(timeout)
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
            return [(h.name, list(h.ranks), h.alive and not h.done) for h in self._admission.hosts]

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

    # -- reduce ----------------------------------------------------------------------
    def _reported_dead(self, h: Host) -> set[int]:
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
            while not self._admission.complete.wait(0.2):
                if self._stop.is_set():
                    return
                self._admission.forget_departed(self._reported_dead)
                self._admission.tell_unformed()
            n = len(self._admission.hosts)
            logger.info("controller: cohort complete (%d host%s); reducing", n,
                        "" if n == 1 else "s")
            early = self.dead_ranks.dead()
            if early:  # ranks that died before every host had joined
                self._broadcast_ctrl(ctrl_message(Ctrl.DECLARE_DEAD, ranks=early))
            rnd = 0
            while not self._stop.is_set():
                live = [h for h in self._admission.hosts if h.alive and not h.done]
                if not live:
                    break
                if not self._round(rnd, live):
                    break
                rnd += 1
        except BaseException as e:  # noqa: BLE001 - recorded and reported to the hosts
            self.error = e
            logger.error("controller: the cohort ended: %s", e)
            self._broadcast_ctrl(ctrl_message(Ctrl.ERROR, message=f"{type(e).__name__}: {e}"))
        finally:
            self._done.set()

    def _note_stopping(self, h: Host, msg: dict) -> None:
        """Record why host ``h`` stops (its ``host_stopping`` message)."""
        rank, reason = int(msg.get("rank", -1)), str(msg.get("reason") or "no reason given")
        h.stopped = reason if rank < 0 else f"rank {rank}: {reason}"  # (-1: no rank's)
        self.stopped_hosts[h.name] = (rank, reason)

    def _host_failed(self, h: Host, why: str, told: bool = False) -> None:
        """Host ``h`` is out of the cohort: ``why`` its link failed (the host's own output
        says more), or, ``told``, why this controller drops it (a record of it failed a
        check: the host is told so, ``Ctrl.DROPPED``, as its link closes)."""
        if not h.alive:
            return
        h.alive = False
        newly = [r for r in h.ranks if self.dead_ranks.declare_dead(r)]
        where = "told it" if told else "that host's output says why"
        if told:
            # (best effort, and not waited for long: its link may be gone or full too)
            h.link.send_idle = min(h.link.send_idle or DROPPED_WORD_S, DROPPED_WORD_S)
            try:
                h.link.send_ctrl(ctrl_message(Ctrl.DROPPED, reason=why[:MAX_REASON_CHARS]))
            except OSError:
                pass
        if h.stopped is not None:  # it said why before its link closed
            logger.error("controller: host %r stopped (%s); its ranks %s are out of the "
                         "cohort", h.name, h.stopped, h.ranks)
        else:
            logger.error("controller: host %r failed (%s; %s); ranks %s declared dead",
                         h.name, why, where, h.ranks)
        h.link.close()
        if newly:
            said = (f"host {h.name!r} stopped: {h.stopped}" if h.stopped is not None else
                    f"host {h.name!r} was lost ({why}; {where})")
            self._broadcast_ctrl(ctrl_message(Ctrl.DECLARE_DEAD, ranks=newly, why=said))

    @property
    def stopped_early(self) -> bool:
        """Whether the ranks ended the run before its end (a Trainer's survivors past
        ``max_failures``, a stall): the last checkpoint they armed says so by its reason.
        Their hosts then report done, as after a finished run."""
        return self.last_armed is not None and self.last_armed[1] in EARLY_STOP_REASONS

    def _broadcast_ctrl(self, msg: dict) -> None:
        for h in self._admission.hosts:
            if h.alive and not h.done:
                try:
                    h.link.send_ctrl(msg)
                except OSError as e:
                    self._host_failed(h, f"sending it a control message failed: {e}")

    def _handle_ctrl(self, h: Host, msg: dict) -> None:
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

    def _others_pending(self, h: Host) -> bool:
        """Whether another live host has bytes waiting (it delivered its part)."""
        return bool(self._pending_hosts([x for x in self._admission.hosts if x is not h]))

    def _pending_hosts(self, hosts: list[Host]) -> set[int]:
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

    def _recv_frame(self, h: Host, rnd: int, clock: "_RoundClock"):
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
        limits = [t for t in [self.round_timeout] + [h.timeout for h in self._admission.hosts]
                  if t is not None]
        return min(limits) if limits else None

    def _round(self, rnd: int, live: list[Host]) -> bool:
        t0 = time.monotonic()
        clock = _RoundClock(self._stall_deadline())
        for h in live:  # a host that takes nothing of a send for as long fails, as a
            h.link.send_idle = clock.timeout  # silent one does (``Link.send_idle``)
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
                self._host_failed(h, str(e), told=isinstance(e, FrameError))
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
                schema, flags, first = this, fl, h
                offs = list(np.cumsum([0] + [int(np.prod(p.shape, dtype=np.int64))
                                             for p in frame.tensors]))
                nelem = offs[-1]
                if self._acc.shape[0] != nelem:
                    self._acc = np.empty(nelem, np.float32)
            elif this != schema:
                barrier = () in (this[1], schema[1])
                raise FrameError(
                    f"round {rnd}: the hosts' ranks made different collective calls (every "
                    f"rank must make the same calls, with the same shapes and bf16_wire setting"
                    + ("; a CONTROL round without tensors is a barrier, or a rank's refused "
                       "call, whose own error says why" if barrier else "")
                    + f"):\n  host {first.name!r}: {describe_schema(schema[0].name, schema[1])}"
                    f"\n  host {h.name!r}: {describe_schema(this[0].name, this[1])}")
            self._add(frame, offs, first=not got_any)
            got_any = True
            mass += frame.weight
            h.sent += sum(p.nbytes for p in frame.tensors)
            self.stats.bytes_in += sum(p.nbytes for p in frame.tensors)
        if not got_any:
            return bool([h for h in self._admission.hosts if h.alive and not h.done])
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

    def _scatter(self, prepared: OutgoingFrame, targets: list[Host]) -> None:
        """Send the consensus (split and hashed once) to the round's hosts; large
        frames go to the hosts concurrently, one thread per link (each link keeps a
        single writer). A host whose link breaks is declared dead and the others still
        get the frame."""
        out = prepared.frame
        errors: dict[int, BaseException] = {}

        def send(i: int, h: Host) -> None:
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
                self._host_failed(h, f"sending it the consensus failed: {errors[i]}")
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


class _RoundClock:
    """A round's stall deadline: ``timeout`` seconds after the first delivery."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.start: float | None = None

    def expired(self) -> bool:
        return (self.timeout is not None and self.start is not None
                and time.monotonic() - self.start > self.timeout)

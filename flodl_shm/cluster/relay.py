"""The relay: one per host, inside ``spawn``'s supervisor, bridging arena and controller.

On a cluster every collective round takes the bulk path. The local ranks fold
their contributions into the shared result region as an f32 host partial
Σ(wᵣ·Tᵣ) over the accepted local contributions — each rank reducing its slice,
never dividing (``protocol.py``, relay mode). The relay then, per round:

1. waits (as an observer) for the arrivals and for every slice of the partial;
2. ships it upstream as ONE frame for the whole host — f32, or bf16 on a bf16
   wire (accumulation stays f32 everywhere) — with the host's accepted mass;
3. reads the cohort consensus straight into the result region (payload bytes land
   where the ranks read them; nothing is used before the frame's tag verifies)
   and publishes it (``G_CONSENSUS = round``), waking the ranks.

While it waits for its local ranks the relay still reads the controller's
control messages, so a stall verdict reaches a host whose ranks hang.

Local deaths are forwarded to the controller (``rank_dead``); deaths the
controller declares anywhere in the cohort (``declare_dead``, including every rank
of a lost host) go to ``on_dead``, with how their host said it stopped when it did —
the launcher counts them against ``max_failures``. When every local rank has finished
the relay says ``host_done``. A stall, a lost or misbehaving
controller, or a frame that fails its tag ends the host: the relay records the
error in the arena (ranks raise ``ReduceStall`` or ``ConnectionError`` naming it)
and raises the abort flag.
"""
from __future__ import annotations

import logging
import queue
import select
import socket
import threading

import numpy as np

from ..engine import arena as A
from ..errors import CohortAborted, FrameError, ReduceStall
from ..frame import DTYPE_F32, RoundFrame, RoundKind, TensorPayload, elem_size
from ..kernels import codec as K
from .control import MAX_REASON_CHARS, Ctrl, ctrl_message
from .link import Kind, RecordCut, client_handshake, connect, parse_addr
from ..engine.protocol import RoundEngine, decode_schema_words
from .wire import check_salt

#: Seconds between the relay's attempts to reach the controller (it may start later).
CONNECT_RETRY_S = 0.5
#: Seconds a stopping host's relay gets to tell the controller why before its link closes.
FINAL_WORD_S = 1.0

logger = logging.getLogger("flodl_shm")


class Relay:
    """The host's link to the controller (a thread). Built by ``relay_factory``."""

    def __init__(self, arena: A.Arena, addr: tuple[str, int], salt: bytes, world_size: int,
                 first_rank: int, nprocs: int, host: str | None = None, *,
                 timeout: float | None = None, on_dead=None) -> None:
        self.arena = arena
        self.timeout = timeout   # this host's round deadline, announced to the controller
        self.on_dead = on_dead   # on_dead(ranks, why): global ranks the controller declares
                                 # dead, and how their host said it stopped (or None)
        self.addr = addr
        self.salt = salt
        self.world_size = world_size
        self.first_rank = first_rank
        self.nprocs = nprocs
        self.host = host or f"{socket.gethostname()}:{first_rank}-{first_rank + nprocs - 1}"
        self.error: BaseException | None = None
        self.rounds = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._closer: threading.Thread | None = None
        self._final_word = False  # a host_stopping message waits in the queue
        self._closed_here = False  # ``shutdown`` closed the link (what a read then raises
        #                            is that close, not news from the controller)
        self._upstream: queue.Queue[dict] = queue.Queue()
        self._link = None
        self._enc16 = np.empty(0, np.uint16)
        self._thread = threading.Thread(target=self._main, name="flodl-shm-relay", daemon=True)
        self._thread.start()

    # -- supervisor-facing -----------------------------------------------------------
    def failed(self) -> bool:
        return self.error is not None

    def rank_died(self, global_rank: int) -> None:
        self._upstream.put(ctrl_message(Ctrl.RANK_DEAD, ranks=[int(global_rank)]))

    def forward(self, msg: dict) -> None:
        """Queue a control message for the controller (e.g. a checkpoint ``arm``)."""
        self._upstream.put(msg)

    def shutdown(self, failure: tuple[int, str] | None = None) -> None:
        """Stop relaying and close the link to the controller.

        Args:
            failure: ``(rank, reason)`` when a failure ends this host (the first stop
                only; before the arena's abort flag, which ends the relay's wait): the
                relay tells the controller as it leaves (``host_stopping``), so its log
                names the cause instead of a lost host. The link then closes once the
                relay thread has sent it, or after ``FINAL_WORD_S`` (a thread blocked
                on the controller cannot send).
        """
        with self._closing:
            if failure is not None and not self._stop.is_set():
                rank, reason = failure
                self._upstream.put(ctrl_message(Ctrl.HOST_STOPPING, rank=int(rank),
                                                reason=str(reason)[:MAX_REASON_CHARS]))
                self._final_word = True
            self._stop.set()
            link = self._link
            if link is None or self._closer is not None:
                return  # not connected, or a closer already waits to close it
            if self._final_word and threading.current_thread() is not self._thread:
                self._closer = threading.Thread(target=self._close_after_word, args=(link,),
                                                name="flodl-shm-relay-close", daemon=True)
                self._closer.start()
                return
        if self._final_word:  # (called from the relay thread itself: say it now)
            self._say_last()
        self._closed_here = True
        link.close()

    def _close_after_word(self, link) -> None:
        self._thread.join(FINAL_WORD_S)  # it flushes its queue on the way out
        self._closed_here = True
        link.close()

    def _say_last(self) -> None:
        """Flush the queued control messages on the way out, best effort (the link may
        be gone)."""
        if self._link is None:
            return
        try:
            self._flush_upstream()
        except (OSError, FrameError):
            pass

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- the thread --------------------------------------------------------------------
    def _liveness(self) -> None:
        """Called while the relay waits for its local ranks: stop on shutdown, and read
        what the controller sent meanwhile (a stall verdict, an error, deaths, or its
        end), so a host whose ranks hang still learns the cohort's fate."""
        if self._stop.is_set():
            raise CohortAborted("the relay is shutting down")
        link = self._link
        while link is not None:
            try:
                ready, _, _ = select.select([link.sock], [], [], 0)
            except (OSError, ValueError):
                return
            if not ready:
                return
            got = link.recv(timeout=1.0)
            if got is None:
                raise ConnectionError(f"the controller at {self.addr[0]}:{self.addr[1]} closed "
                                      f"the connection while this host's ranks were busy")
            kind, _, body = got
            if kind != Kind.CTRL:
                raise FrameError(f"unexpected {kind.name} record from the controller before "
                                 f"this host delivered its round")
            self._control(body)

    def _take_ack(self, msg: dict) -> None:
        """The controller admitted this host: publish the outer optimizer it steps and
        where its momentum starts (``G_CONTROLLER_OUTER*``) before any round is relayed,
        so a rank that reads them after its first cross-host round sees them."""
        start = msg.get("outer_start_round")
        if start is not None:
            start = int(start)
            self.arena.ctl[A.G_CONTROLLER_OUTER] = 1 if start < 0 else 2 + start
        outer = msg.get("outer")
        if isinstance(outer, dict) and outer.get("kind") == "nesterov":
            self.arena.ctl_f64[A.G_CONTROLLER_OUTER_LR] = float(outer["lr"])
            self.arena.ctl_f64[A.G_CONTROLLER_OUTER_MU] = float(outer["momentum"])
            self.arena.ctl[A.G_CONTROLLER_OUTER_KIND] = 2
        elif isinstance(outer, dict) and outer.get("kind") == "none":
            self.arena.ctl[A.G_CONTROLLER_OUTER_KIND] = 1

    def _waiting(self, error: OSError, seconds: float) -> None:
        logger.warning("relay %s: the controller at %s:%s is not reachable yet (%s); trying "
                       "again for up to %.3g s. Start the controller, or check the controller "
                       "address this host was given", self.host, self.addr[0], self.addr[1],
                       error.strerror or error, seconds)

    def _main(self) -> None:
        peer = f"{self.addr[0]}:{self.addr[1]}"
        try:
            # give up connecting while the ranks still wait in their first round, so they
            # learn "connection refused" rather than time out on a silent relay
            budget_s = 30.0 if self.timeout is None else max(1.0, 0.5 * float(self.timeout))
            sock = connect(self.addr, attempts=max(1, int(budget_s / CONNECT_RETRY_S)),
                           delay=CONNECT_RETRY_S, on_wait=self._waiting, stop=self._stop)
            ranks = list(range(self.first_rank, self.first_rank + self.nprocs))
            self._link = client_handshake(sock, self.salt, {
                "host": self.host, "ranks": ranks, "world_size": self.world_size,
                "timeout": self.timeout, "protocol": "flodl_shm-relay"}, peer,
                on_ack=self._take_ack)
            logger.info("relay %s: joined the controller at %s with ranks %s", self.host, peer,
                        ranks)
            self._rounds()
        except BaseException as e:  # noqa: BLE001 - recorded; ranks learn it from the arena
            if self._stop.is_set() and (self._closed_here
                                        or not isinstance(e, (FrameError, TimeoutError))):
                # the host stops for its own reason, which ``spawn`` raises; a read this
                # stop's close ended (even one inside a record a frozen controller began)
                # is not the news
                self._say_last()  # why this host stops, if it was told (``shutdown``)
                return
            def lost(how: str) -> ConnectionError:
                return ConnectionError(f"lost the connection to the controller at {peer} "
                                       f"{how}; it stopped or its host is unreachable")

            if isinstance(e, RecordCut):  # (nothing after it is readable: no last word)
                e = lost(f"in the middle of a record (after {e.got} of its {e.length} bytes)")
            elif isinstance(e, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
                # a send or receive that found the socket gone: what the controller said
                # before it closed (a stall verdict: this host was the one it waited for),
                # else name who went away
                e = last_word(self._link) or lost(f"({type(e).__name__}: {e})")
            self.error = e
            # spawn raises it once every rank stopped (``ConnectionError: this host's relay
            # failed: ...``): logged here it would print the same news twice
            logger.debug("relay %s: %s: %s", self.host, type(e).__name__, e)
            self._fail(e)
        finally:
            if self._link is not None:
                self._link.close()

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, ReduceStall):
            self.arena.set_relay_error(A.RELAY_STALL, str(e), e.round, e.missing, e.timeout)
        else:
            self.arena.set_relay_error(A.RELAY_FAILED, f"{type(e).__name__}: {e}")

    def _local_gone(self) -> bool:
        c = self.arena.ctl
        return all(c[A.rank_base(r) + A.R_DEAD] for r in range(self.arena.world))

    def _flush_upstream(self) -> None:
        while True:
            try:
                msg = self._upstream.get_nowait()
            except queue.Empty:
                return
            self._link.send_ctrl(msg)

    def _rounds(self) -> None:
        eng = RoundEngine(self.arena, -1, timeout=None, spin_iters=64, liveness=self._liveness)
        link = self._link
        rnd = 0
        while not self._stop.is_set():
            self._flush_upstream()
            if self._local_gone():
                break
            try:
                view = eng.await_arrivals(rnd, "relay: waiting for the local ranks")
            except CohortAborted:
                # this host's cohort is stopping (a rank failed past max_failures, an
                # interrupt): the launcher reports why, and the relay passes it on
                # (``shutdown``'s failure) as it leaves. (Caught before RuntimeError, its
                # base: reported as the relay's own failure, it hid the rank's error
                # behind "the cohort is shutting down".)
                self._say_last()
                return
            except RuntimeError:
                if self._local_gone():
                    break
                raise
            eng.await_slices(view)
            self._flush_upstream()  # deaths and checkpoint arms go before the frame
            up = self._partial_frame(eng, view)
            link.send_frame(Kind.FRAME_UP, up, flags=view.flags & (A.FLAG_OUTER | A.FLAG_TAP))
            self.bytes_up += up.payload_nbytes()
            down = self._receive_consensus(eng, view)
            self.bytes_down += down.payload_nbytes()
            self.arena.ctl_f64[A.G_CONSENSUS_MASS] = down.weight
            eng.doorbell.publish(A.G_CONSENSUS, rnd)
            self.rounds += 1
            rnd += 1
        self._flush_upstream()
        c = self.arena.ctl
        # done once every local rank returned or died and was fenced (a tolerated death,
        # already sent upstream by _flush_upstream): the controller must not take the
        # closing link for a lost host and declare the ranks that finished dead
        if all(c[A.rank_base(r) + A.R_DEAD] in (A.DEAD_EXITED, A.DEAD_KILLED)
               for r in range(self.arena.world)):
            link.send_ctrl(ctrl_message(Ctrl.HOST_DONE))
            logger.info("relay %s: every local rank finished after %d rounds", self.host, rnd)

    def _shapes(self, view) -> list[tuple[int, ...]]:
        r = view.accepted[0]
        region = self.arena.data_view(r, view.nwords * 8)
        _, _, shapes = decode_schema_words(region[:view.nwords * 8].view(np.int64))
        return shapes

    def _partial_frame(self, eng: RoundEngine, view) -> RoundFrame:
        partial = eng.result_array(view)  # f32 host sums
        shapes = self._shapes(view)
        if view.dtype == DTYPE_F32:
            body = partial
        else:  # bf16 on this hop; the controller accumulates in f32
            if self._enc16.shape[0] < view.nelem:
                self._enc16 = np.empty(view.nelem, np.uint16)
            body = self._enc16[:view.nelem]
            K.f32_to_bf16(partial, body)
        raw = body.view(np.uint8)
        esize = elem_size(view.dtype)
        tensors, off = [], 0
        for s in shapes:
            nb = int(np.prod(s, dtype=np.int64)) * esize
            tensors.append(TensorPayload(view.dtype, s, raw[off:off + nb]))
            off += nb
        return RoundFrame(tensors, view.mass, RoundKind(view.kind))

    def _receive_consensus(self, eng: RoundEngine, view) -> RoundFrame:
        cons = eng.consensus_array(view).view(np.uint8)
        offset = [0]

        def sink(i, dtype, shape, nbytes):
            if dtype != view.dtype:
                raise FrameError(f"consensus tensor[{i}] has wire dtype {dtype}, the round "
                                 f"{view.dtype}")
            start = offset[0]
            if start + nbytes > cons.shape[0]:
                raise FrameError(f"consensus of round {view.rnd} is larger than the round's "
                                 f"{cons.shape[0]} bytes")
            offset[0] = start + nbytes
            return cons[start:start + nbytes]

        while True:
            got = self._link.recv(sink)
            if got is None:
                raise ConnectionError(f"the controller at {self.addr[0]}:{self.addr[1]} closed "
                                      f"the connection during round {view.rnd}")
            kind, _, body = got
            if kind == Kind.FRAME_DOWN:
                if offset[0] != cons.shape[0] or len(body.tensors) != view.ntensors:
                    raise FrameError(f"consensus of round {view.rnd} does not match the round's "
                                     f"schema ({offset[0]} of {cons.shape[0]} bytes)")
                return body
            if kind != Kind.CTRL:
                raise FrameError(f"unexpected {kind.name} record from the controller")
            self._control(body)

    def _control(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == Ctrl.DECLARE_DEAD:
            ranks = [int(r) for r in msg.get("ranks", [])]
            why = msg.get("why")  # (a host that stopped said how)
            why = why if isinstance(why, str) else None
            logger.warning("relay %s: the controller declared ranks %s dead%s", self.host, ranks,
                           f" ({why})" if why else "")
            if self.on_dead is not None:
                self.on_dead(ranks, why)
        elif kind in _VERDICTS:
            raise _verdict(msg)
        else:
            logger.warning("relay %s: ignoring control message %r", self.host, kind)


#: the controller's messages that end this host's run (``_verdict``)
_VERDICTS = (Ctrl.STALL, Ctrl.ERROR, Ctrl.DROPPED)


def _verdict(msg: dict) -> BaseException:
    """The error a controller's stall verdict (``Ctrl.STALL``), error message
    (``Ctrl.ERROR``) or drop of this host (``Ctrl.DROPPED``) ends this host's run with."""
    if msg["type"] == Ctrl.DROPPED:
        return ConnectionError(f"the controller dropped this host: {msg.get('reason')}")
    if msg["type"] == Ctrl.STALL:
        why = msg.get("reason") or "had not delivered"
        return ReduceStall(
            f"round {msg['round']} stalled at the controller after {msg.get('timeout')} s; "
            f"ranks {msg['missing']} {why}", round=int(msg["round"]),
            missing=tuple(int(r) for r in msg["missing"]), timeout=msg.get("timeout"),
            global_ranks=True)
    return ConnectionError(f"the controller ended the cohort: {msg.get('message')}")


def last_word(link) -> BaseException | None:
    """The stall verdict or error a controller sent on ``link`` before it closed it,
    still unread (``_verdict``), or None. A host stopped for a while (SIGSTOP, a frozen
    VM) found the link gone when it next sent, and said "lost the connection" although
    the round had stalled on it; what the peer sent stays readable after that failed
    send."""
    if link is None:
        return None
    try:
        while True:
            got = link.recv(timeout=0.5)
            if got is None or got[0] != Kind.CTRL:
                return None
            if got[2]["type"] in _VERDICTS:
                return _verdict(got[2])
    except (OSError, ValueError):  # nothing readable left
        pass
    return None


def relay_factory(controller, salt, world_size: int, first_rank: int, nprocs: int):
    """What ``spawn(controller=...)`` calls: validates up front, builds the relay later."""
    if salt is None:
        raise ValueError("spawn(controller=...) needs salt=: the 16-byte session secret every "
                         "host shares (flodl_shm.cluster.secret.read_secret_file / new_salt)")
    salt = check_salt(salt)
    addr = parse_addr(controller)

    def make(ctx) -> Relay:
        return Relay(ctx.arena, addr, salt, world_size, first_rank, nprocs,
                     timeout=ctx.cluster_round_timeout, on_dead=ctx.cohort_deaths)

    return make

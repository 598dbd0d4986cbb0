"""The checkpoint tap: consensus frames go from the ranks to the owner's forge.

On a single host the consensus is formed by the ranks themselves, so the
checkpoint forge runs in the arena's owner (``spawn``'s supervisor, or a
``FakeCohort``) and the ranks *post* the frames of a checkpoint cycle to it
through the arena's ``tap`` segment — a one-slot mailbox:

1. all ranks arm the same cycle (``Comm.arm_checkpoint``) at the same point of
   their program; the next MODEL rounds, up to the schema's tensor count (the
   params frame, then the buffers frame), are flagged ``FLAG_TAP``;
2. after each such round, the lowest accepted rank waits until the owner has
   consumed the previous message (``G_TAP_ACK``), writes the message — its head (a
   ``checkpoint.tap_head.TapHead`` as JSON: cycle, path, names, metadata, shapes,
   mass) then the consensus payload (and,
   on the params frame of an outer optimizer with state, its momentum) — and
   bumps ``G_TAP_SEQ``, waking the owner on that futex word;
3. the owner's ``TapServer`` thread copies the frame into its ``CheckpointForge``
   (``accumulate(copy=True)``: the mailbox is reused) and acknowledges; the forge
   writes ``<stem>.fdl`` (and ``.outer.fdl``) on its own writer thread and then
   the ``.meta.json`` commit marker.

Ranks never wait for disk: only for the owner's copy of the previous message.

The rank side is a ``TapClient`` (one per ``Comm``): the armed cycle, the frames it
posts after captured rounds, and the consensus a rank posts on its own
(``Comm.post_checkpoint``). The owner side is a ``TapServer``.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from . import arena as A
from ..checkpoint.forge import arm_from_head
from ..checkpoint.tap_head import TapHead
from ..frame import DTYPE_BF16, DTYPE_F32, RoundFrame, RoundKind, TensorPayload, elem_size
from ..kernels import signals
from .waiting import Doorbell, Waiter, futex_wait, futex_wake

logger = logging.getLogger("flodl_shm")

_HEAD = 64         # int64 words: json_len, payload_off, payload_len, mom_off, mom_len
_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def post(arena: A.Arena, doorbell: Doorbell, head: TapHead, payload: np.ndarray,
         momentum: np.ndarray | None, *, wait_ack=None) -> None:
    """Rank side: post one message (``wait_ack()`` blocks until the mailbox is free)."""
    ctl = arena.ctl
    if wait_ack is not None:
        wait_ack(int(ctl[A.G_TAP_SEQ]))
    text = head.to_json()
    pay = payload.view(np.uint8)
    mom = None if momentum is None else momentum.view(np.uint8)
    p_off = _align(_HEAD + len(text))
    m_off = _align(p_off + pay.nbytes)
    total = m_off + (0 if mom is None else mom.nbytes)
    box = arena.extra_view("tap", total)
    words = box[:_HEAD].view(np.int64)
    box[_HEAD:_HEAD + len(text)] = np.frombuffer(text, np.uint8)
    box[p_off:p_off + pay.nbytes] = pay
    if mom is not None:
        box[m_off:m_off + mom.nbytes] = mom
    words[:5] = (len(text), p_off, pay.nbytes, m_off, 0 if mom is None else mom.nbytes)
    seq = int(signals.fetch_add_word(arena.ctl32, 2 * A.G_TAP_SEQ, 1)) + 1
    futex_wake(arena.ctl.ctypes.data + A.G_TAP_SEQ * 8)
    logger.debug("tap: posted message %d (%s part %s, %d bytes)", seq, head.path, head.part,
                 total)


class TapClient:
    """A rank's side of the tap: the checkpoint cycle it armed and the messages it posts.

    ``armed`` is the head of the next frame to capture (None: nothing armed). While it
    is set, the rank's MODEL rounds are flagged ``FLAG_TAP`` and take the general round
    path, which hands each one's consensus to :meth:`captured`.

    Args:
        arena: the host arena (its ``tap`` mailbox and words).
        engine: the rank's ``RoundEngine`` (doorbell, waiter, the last round's accepted
            ranks, the outer momentum, relay mode).
        rank: the rank's global rank; local_rank: its index on this host.
    """

    #: seconds a rank waits for the owner to take the previous message
    ACK_TIMEOUT_S = 300.0

    def __init__(self, arena: A.Arena, engine, *, rank: int, local_rank: int) -> None:
        self.arena = arena
        self._engine = engine
        self._rank = rank
        self._local_rank = local_rank
        self.armed: TapHead | None = None
        self._remaining = 0  # tensors of the armed cycle still to capture
        self._cycle = 0

    def _head(self, path, schema, meta) -> TapHead:
        """The first head of a new cycle for ``path``."""
        self._cycle += 1
        return TapHead(cycle=self._cycle, part=0, path=os.fspath(path),
                       param_names=schema.param_names, buffer_names=schema.buffer_names,
                       tied=schema.tied, non_persistent=schema.non_persistent,
                       meta=None if meta is None else meta.to_dict())

    def arm(self, path, schema, meta, last_round: int, tells_controller: bool) -> None:
        """Capture the next MODEL rounds (up to ``schema.tensor_count()`` tensors) as the
        checkpoint at ``path`` (``Comm.arm_checkpoint``). On a cluster, the one rank that
        ``tells_controller`` first tells the controller's forge where, through this host's
        relay."""
        head = self._head(path, schema, meta)
        self.armed = head
        self._remaining = head.tensor_count
        if self._engine.relay_mode and tells_controller:
            post(self.arena, self._engine.doorbell, replace(head, arm_only=True),
                 np.empty(0, np.uint8), None,
                 wait_ack=lambda target: self._wait_ack(target, last_round))
            self._wait_ack(int(self.arena.ctl[A.G_TAP_SEQ]), last_round)

    def post_consensus(self, path, schema, tensors: Sequence[torch.Tensor], *, mass: float,
                       meta, momentum: np.ndarray | None, bf16: bool,
                       last_round: int) -> None:
        """Post a consensus this rank holds as a checkpoint (``Comm.post_checkpoint``,
        which documents the arguments); ``last_round``: the round that formed it."""
        want = schema.tensor_count()
        if len(tensors) != want:
            raise ValueError(f"the schema has {want} tensors (params then averaged "
                             f"buffers), got {len(tensors)}")
        if not mass > 0.0:
            raise ValueError(f"mass {mass} realized nothing: there is no consensus to save")
        wire = torch.bfloat16 if bf16 else torch.float32
        flat = torch.cat([t.detach().reshape(-1).to(wire) for t in tensors])
        payload = flat.view(torch.int16).numpy().view(np.uint16) if bf16 else flat.numpy()
        shapes = tuple(tuple(t.shape) for t in tensors)
        nparams = len(schema.param_names)
        head = self._head(path, schema, meta).for_frame(
            dtype=DTYPE_BF16 if bf16 else DTYPE_F32, shapes=shapes, mass=mass,
            round=last_round, momentum_shapes=None if momentum is None else shapes[:nparams])
        post(self.arena, self._engine.doorbell, head, payload,
             None if momentum is None else np.ascontiguousarray(momentum, np.float32),
             wait_ack=lambda target: self._wait_ack(target, last_round))

    def captured(self, rnd: int, dtype: int, shapes, cons: np.ndarray, mass: float,
                 outer: bool) -> None:
        """Round ``rnd`` of the armed cycle formed ``cons``: the lowest accepted rank of
        a single host posts it (with the outer momentum after an outer params round);
        a round that realized nothing cancels the cycle."""
        head = self.armed
        eng = self._engine
        if mass <= 0.0:
            logger.info("checkpoint %s: round %d realized nothing (mass 0); cycle cancelled",
                        head.path, rnd)
            self.armed = None
            return
        lowest = (eng.last_accepted & -eng.last_accepted).bit_length() - 1
        if lowest == self._local_rank and not eng.relay_mode:
            momentum = eng.outer.last_momentum() if outer else None
            frame = head.for_frame(dtype=dtype, shapes=shapes, mass=mass, round=rnd,
                                   momentum_shapes=shapes if momentum is not None else None)
            post(self.arena, eng.doorbell, frame, cons, momentum,
                 wait_ack=lambda target: self._wait_ack(target, rnd))
        self._remaining -= len(shapes)
        self.armed = head.next_part() if self._remaining > 0 else None

    def _wait_ack(self, target: int, rnd: int) -> None:
        """Wait until the owner took message ``target`` (the mailbox is free)."""
        ctl = self.arena.ctl
        eng = self._engine
        waiter = Waiter(eng.doorbell, eng.waiter.spin_iters, self.ACK_TIMEOUT_S,
                        eng.waiter.liveness)
        waiter.who, waiter.notice_s = eng.waiter.who, eng.waiter.notice_s
        waiter.wait(lambda it: signals.spin_word_ge(ctl, A.G_TAP_ACK, target, it),
                    what="waiting for the owner to take the previous checkpoint frame",
                    rnd=rnd, missing_of=lambda: ("checkpoint owner",))


class TapServer:
    """Owner side: a thread that feeds posted frames into a ``CheckpointForge``."""

    def __init__(self, arena: A.Arena) -> None:
        self.arena = arena
        self.doorbell = Doorbell(arena.ctl)
        self._forge = None
        self._cycle = None
        self._stop = threading.Event()
        self.errors: list[str] = []
        #: on a cluster: where checkpoint arms go (the relay, toward the controller's forge)
        self.forward = None
        self._thread = threading.Thread(target=self._run, name="flodl-shm-tap", daemon=True)
        self._thread.start()

    @property
    def forge(self):
        return self._forge

    def _run(self) -> None:
        ctl32 = self.arena.ctl32
        addr = self.arena.ctl.ctypes.data + A.G_TAP_SEQ * 8
        seen = int(ctl32[2 * A.G_TAP_SEQ])
        while not self._stop.is_set():
            cur = int(signals.load(ctl32, 2 * A.G_TAP_SEQ))
            if cur == seen:
                futex_wait(addr, cur, 0.2)
                continue
            seen = cur
            try:
                self._consume()
            except Exception as e:  # a bad message must never kill the owner
                logger.error("checkpoint tap: message %d dropped: %s", cur, e)
                self.errors.append(str(e))
            self.doorbell.publish(A.G_TAP_ACK, cur)

    def _consume(self) -> None:
        box = self.arena.extra_view("tap", _HEAD, grow=False)
        jlen, p_off, p_len, m_off, m_len = (int(x) for x in box[:_HEAD].view(np.int64)[:5])
        box = self.arena.extra_view("tap", max(p_off + p_len, m_off + m_len), grow=False)
        head = TapHead.from_json(bytes(box[_HEAD:_HEAD + jlen]))
        if head.arm_only:
            if self.forward is None:
                raise RuntimeError("a cluster checkpoint arm reached a host without a relay")
            self.forward({"type": "arm", **head.arm_fields()})
            return
        if self._forge is None or head.part == 0 or self._cycle != head.cycle:
            self._forge = arm_from_head(self._forge, head)
            self._cycle = head.cycle
        forge = self._forge
        esize = elem_size(head.dtype)
        tensors = []
        off = p_off
        for shape in head.shapes:
            nb = int(np.prod(shape, dtype=np.int64)) * esize
            tensors.append(TensorPayload(head.dtype, shape, box[off:off + nb]))
            off += nb
        if m_len:
            moms = []
            off = m_off
            for shape in head.momentum_shapes or ():
                nb = int(np.prod(shape, dtype=np.int64)) * 4
                moms.append(TensorPayload(DTYPE_F32, shape, bytearray(box[off:off + nb])))
                off += nb
            forge.stash_outer_momentum(moms)
        forge.accumulate(RoundFrame(tensors, head.mass, RoundKind.MODEL), copy=True)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every posted message is consumed and its checkpoint written."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        ctl = self.arena.ctl
        while int(ctl[A.G_TAP_ACK]) < int(signals.load(self.arena.ctl32, 2 * A.G_TAP_SEQ)):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        if self._forge is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._forge.flush(left)

    def close(self, timeout: float = 60.0) -> None:
        """Consume what was posted (a checkpoint posted just before the end is kept),
        stop the thread, and wait for the forge's writes."""
        self.flush(timeout)
        self._stop.set()
        futex_wake(self.arena.ctl.ctypes.data + A.G_TAP_SEQ * 8)
        self._thread.join(5.0)
        if self._forge is not None:
            self._forge.flush(timeout)

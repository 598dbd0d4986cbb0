"""Raw-byte rounds: every rank publishes bytes, every rank reads everyone's, nothing is reduced.

The reduce rounds of ``Comm`` sum float32/bfloat16 frames. Collectives that must be
byte-exact for any dtype (broadcast, all_gather, scatter, all-to-all) or that reduce
with an operator the kernels do not have (MAX, PRODUCT, integer sums, float64) need
the contributions themselves. A byte round gives every rank read-only views of every
rank's bytes for the length of a callback; callers that reduce do it in rank order,
so every rank computes the same bits.

A byte round is one round of the host protocol (``protocol.py``) on the bulk path,
sharing the round counter of the ``Comm`` it runs on, so byte rounds and reduce
rounds interleave freely:

::

    COPY-IN   rank r writes its bytes after the schema words in its bulk region d<r>
    ARRIVED   r publishes its header and arrived[r] = N; waits for every rank
              (validation compares headers: every rank must send the same byte
              count and signature; a byte round never matches a reduce round: its
              schema carries a marker tensor no reduce sends)
    READ      ``consume`` reads the regions of every rank (views, no copy)
    DONE      r publishes done[r] = N and waits for every done[.] >= N

Why the bulk region may be rewritten in round N+1: its owner leaves round N only
after every rank published done[.] >= N, i.e. after every reader's ``consume``
returned. The result region and the eager slots are not touched.

A rank missing from the round (dead, in a spawn cohort that fences it) makes the
round fail with ``RuntimeError`` naming it: byte collectives have no meaning without
every contribution.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from . import arena as A
from ..errors import FrameError
from ..frame import DTYPE_F32, RoundKind
from .protocol import schema_hash

# Second "tensor" of a byte round's schema: zero elements, a dimension no reduce
# round sends, so a byte round and a reduce round never validate as the same round.
_BYTE_MARKER_DIM = 0x42595445  # "BYTE"


def _byte_schema(nbytes: int, signature: int) -> np.ndarray:
    n4 = -(-int(nbytes) // 4)
    return np.asarray([3, DTYPE_F32, int(RoundKind.CONTROL), 1, n4, 2, 0, _BYTE_MARKER_DIM,
                       1, int(signature) & ((1 << 62) - 1)], dtype=np.int64)


def exchange_bytes(comm, nbytes: int, fill: Callable[[np.ndarray], None] | None,
                   consume: Callable[[Sequence[np.ndarray]], None], signature: int = 0) -> None:
    """Run one byte round on ``comm``'s host arena.

    Args:
        comm: this rank's ``Comm``; the round takes its next round number.
        nbytes: bytes this rank publishes; every rank of the host must pass the same.
        fill: ``fill(dst)`` writes this rank's bytes into ``dst`` (a uint8 array of
            ``nbytes`` in shared memory); ``None`` publishes nothing (e.g. a
            broadcast's receivers) and peers must not read this rank's bytes.
        consume: ``consume(views)`` gets one uint8 array (to read, never write) of ``nbytes`` per
            local rank, in local-rank order; the views are valid only during the call.
        signature: what the bytes mean (e.g. a hash of the collective, dtypes and shapes);
            part of the round's schema, so ranks that disagree raise instead of reading
            each other's bytes as something else.

    Raises:
        FrameError: ranks passed different ``nbytes`` or ``signature`` (raised on every
            rank).
        Exception: what ``consume`` raised (``KeyboardInterrupt`` aside), re-raised after
            the round completed, so this rank stays in step with the others.
        RuntimeError: a rank is dead or the round was left out of step.
        ReduceStall / CohortAborted: the waits' deadline or the cohort's abort.
    """
    if comm._broken is not None:
        raise RuntimeError(f"this Comm is unusable: {comm._broken}")
    eng = comm._engine
    arena = comm.arena
    me = comm.local_rank
    nbytes = int(nbytes)
    words = _byte_schema(nbytes, signature)
    off = words.shape[0] * 8
    rnd = comm._round
    region = eng.bulk_region(off + nbytes)
    region[:off].view(np.int64)[:] = words
    if fill is not None:
        fill(region[off:off + nbytes])
    comm._round = rnd + 1
    try:
        eng.publish(rnd, int(RoundKind.CONTROL), A.FLAG_BULK, DTYPE_F32, 0.0, 3, nbytes,
                    int(words[4]), schema_hash(words), words.shape[0])
        view = eng.await_arrivals(rnd, what="waiting for ranks to publish their bytes")
        full = (1 << arena.world) - 1
        if view.accepted_mask != full:
            gone = [r for r in range(arena.world) if not (view.accepted_mask >> r) & 1]
            raise RuntimeError(f"byte round {rnd}: local rank(s) {gone} are dead; a byte "
                               f"collective needs every rank's contribution")
        views = []
        for r in range(arena.world):
            v = arena.data_view(r, off + nbytes)[off:off + nbytes]
            views.append(v)
        refused = None
        try:
            consume(views)
        except Exception as e:  # noqa: BLE001 - the caller refused what it read (an
            refused = e         # output that does not fit...): the round itself completed
        finally:
            del views
            eng.doorbell.publish(A.rank_base(me) + A.R_DONE, rnd)
        eng.await_slices(view)
    except FrameError:
        raise  # a schema mismatch is raised on every rank at the same point: in step
    except BaseException as e:
        comm._broken = f"byte round {rnd} failed with {type(e).__name__}: {e}"
        raise
    if refused is not None:
        raise refused  # after the round: this rank stays in step with the others

"""The host arena: every shared-memory segment one host's ranks use, and their layout.

Who creates, who attaches, who unlinks:

- the **owner** (``spawn``'s supervisor, or a ``FakeCohort``) creates every segment
  with ``Arena.create`` and alone unlinks them (``Arena.unlink``), on every exit path;
- **ranks** attach with ``Arena.attach(handle)`` (the handle pickles to names) and
  only ever grow segments, never unlink them.

Segments (names ``fshm_<owner pid>_<session>_<what>``):

``ctl``
    The control block (below) followed by the eager slots: per rank, two
    (double-buffered by round parity) slots of ``eager_bytes`` each, holding the
    whole contribution of small rounds.
``d<r>``
    Rank ``r``'s bulk input region (one per rank; grown by that rank on demand).
``p<r>``
    Rank ``r``'s shared parameter block (one per rank; grown by that rank once it
    places tensors there, ``Comm.shared_tensors``): tensors that live in shared
    memory, so the slice reducers of a direct round read and write them in place
    (``engine/direct.py``). Peers map it lazily.
``res``
    The bulk result region: the consensus of a large round (and, on a cluster,
    the host partial the relay ships). Grown by whichever rank needs it first.
``out``
    The outer optimizer's state (single host): previous global and momentum, f32,
    double-buffered by outer-step parity so a slice taken over from a dead rank is
    recomputed from untouched inputs. Grown by the slice reducers.
``tap``
    The checkpoint mailbox: a rank posts a consensus frame (and momentum) there
    for the owner's checkpoint forge (``engine/checkpoint_tap.py``).

Control block: an int64 word array. Words are grouped so that words written by
different processes never share a 64-byte cache line:

- global words (``G_*``) at the start;
- one block of ``RANK_WORDS`` per rank (``R_*`` offsets), with the arrival word,
  the slice-done word and the slice-claim word each on their own cache line, and
  two round headers (``H_*``), one per round parity.

Each rank block's round header for parity ``N % 2`` describes that rank's
contribution to round ``N`` (kind, flags, dtype, weight, schema). See
``protocol.py`` for the state machine that drives these words.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .segment import Segment, new_session_id, segment_name, shm_free_bytes, space_error

from ..kernels.control_block import *  # noqa: F401,F403 - the control block word map, re-exported

DEFAULT_EAGER_BYTES = (1 << 20) + (4 << 10)  # 1 MiB frames plus their schema words


def default_eager_bytes(world: int) -> int:
    """The small-round threshold: 1 MiB frames (DeepSpeed's choice) up to 8 local
    ranks, shrinking beyond so the eager slots (2 per rank) stay within ~16 MiB."""
    per = min(1 << 20, max(64 << 10, (16 << 20) // (2 * max(1, world))))
    return per + (4 << 10)
MAX_LOCAL_RANKS = 63  # accepted/contributor sets travel as 64-bit masks
_PAGE = 4096
_RESULT_GRANULE = 1 << 20


def rank_base(r: int) -> int:
    return GLOBAL_WORDS + r * RANK_WORDS


def header_base(r: int, rnd: int) -> int:
    return rank_base(r) + R_HDR + (rnd & 1) * HDR_WORDS


def control_words(world: int) -> int:
    return GLOBAL_WORDS + world * RANK_WORDS


def control_bytes(world: int, eager_bytes: int) -> int:
    ctl = control_words(world) * 8 + ERROR_AREA_BYTES
    ctl = -(-ctl // _PAGE) * _PAGE
    return ctl + 2 * world * eager_bytes


def result_target(nbytes: int) -> int:
    """Deterministic growth target: every rank computes the same size for a round."""
    return max(_RESULT_GRANULE, -(-int(nbytes) // _RESULT_GRANULE) * _RESULT_GRANULE)


def shm_need_bytes(local_ranks: int, frame_bytes: int, *, eager_bytes: int | None = None,
                   relay: bool = False, wire_bf16: bool = False) -> int:
    """/dev/shm bytes an arena of ``local_ranks`` needs for frames of ``frame_bytes``.

    ``frame_bytes`` is the wire size of one contribution (f32: 4 B/element, bf16:
    2 B/element). Each rank holds one bulk input; the result region holds one
    frame, or on a cluster one f32 partial (plus the bf16 consensus on a bf16 wire).
    """
    p = max(1, int(local_ranks))
    if eager_bytes is None:
        eager_bytes = default_eager_bytes(p)
    frame = int(frame_bytes)
    if relay:
        elems = frame // (2 if wire_bf16 else 4)
        result = elems * 4 + (elems * 2 if wire_bf16 else 0)
    else:
        result = frame
    schema = 64 << 10  # generous allowance for the schema words in front of a payload
    # a bulk region grows as the result region does, by whole granules (grow_data); the
    # "out" and "tap" segments and each rank's parameter block hold a page at rest
    return (control_bytes(p, eager_bytes) + p * result_target(frame + schema)
            + result_target(result) + (p + 2) * _PAGE)


@dataclass(frozen=True)
class ArenaHandle:
    """Everything a rank needs to attach: segment names and geometry (picklable)."""

    owner_pid: int
    session: str
    world: int
    eager_bytes: int

    def name(self, what: str) -> str:
        return segment_name(self.owner_pid, self.session, what)


class Arena:
    """The mapped segments of one host arena plus typed views of the control block."""

    def __init__(self, handle: ArenaHandle, ctl: Segment, result: Segment,
                 data: list[Segment | None], owner: bool) -> None:
        self.handle = handle
        self.world = handle.world
        self.eager_bytes = handle.eager_bytes
        self.owner = owner
        self._ctl_seg = ctl
        self._result_seg = result
        self._data = data
        nwords = control_words(self.world)
        self.ctl = np.frombuffer(ctl.buf, dtype=np.int64, count=nwords)
        self.ctl_f64 = self.ctl.view(np.float64)
        self.ctl32 = self.ctl.view(np.int32)
        self._error_area = np.frombuffer(ctl.buf, dtype=np.uint8, offset=nwords * 8,
                                         count=ERROR_AREA_BYTES)
        start = -(-(nwords * 8 + ERROR_AREA_BYTES) // _PAGE) * _PAGE
        self._eager = np.frombuffer(ctl.buf, dtype=np.uint8, offset=start,
                                    count=2 * self.world * self.eager_bytes)
        self._result_view: np.ndarray | None = None
        self._data_views: list[np.ndarray | None] = [None] * self.world
        self._extra: dict[str, Segment] = {}
        self._extra_views: dict[str, np.ndarray] = {}
        self._params: list[Segment | None] = [None] * self.world
        self._params_views: list[np.ndarray | None] = [None] * self.world

    # -- life cycle -------------------------------------------------------------
    @classmethod
    def create(cls, world: int, *, eager_bytes: int | None = None,
               owner_pid: int | None = None, session: str | None = None,
               first_rank: int = 0, global_world: int | None = None,
               relay: bool = False, direct: bool = False) -> "Arena":
        """Create every segment of a new arena (the caller becomes its owner).

        ``direct``: a dead rank stops this cohort (nobody continues on realized work),
        so large rounds may move data between the ranks' private memory
        (``engine/direct.py``); ``FLODL_SHM_DIRECT=0`` in this process's environment
        turns it off.
        """
        import os

        if not 1 <= world <= MAX_LOCAL_RANKS:
            raise ValueError(f"an arena holds 1 to {MAX_LOCAL_RANKS} local ranks, got {world}; "
                             f"run more ranks as several hosts (relays) of one cohort")
        if eager_bytes is None:
            eager_bytes = default_eager_bytes(world)
        eager_bytes = max(_PAGE, -(-int(eager_bytes) // 64) * 64)
        # the thresholds first: a bad environment value is refused before any segment
        direct_min, broadcast_min = direct_min_bytes(), direct_broadcast_min_bytes(world)
        need = control_bytes(world, eager_bytes) + (2 * world + 1) * _PAGE
        free = shm_free_bytes()
        if need > free:
            raise space_error(need, free, f"the host arena for {world} ranks")
        handle = ArenaHandle(owner_pid or os.getpid(), session or new_session_id(), world,
                             eager_bytes)
        made: list[Segment] = []
        try:
            # locked while this owner lives: reapers leave the session alone
            ctl = Segment.create(handle.name("ctl"), control_bytes(world, eager_bytes),
                                 lock=True)
            made.append(ctl)
            result = Segment.create(handle.name("res"), _PAGE)
            made.append(result)
            for what in ("out", "tap"):
                made.append(Segment.create(handle.name(what), _PAGE))
                made[-1].close()
            data = []
            for r in range(world):
                seg = Segment.create(handle.name(f"d{r}"), _PAGE)
                made.append(seg)
                data.append(seg)
            for r in range(world):
                made.append(Segment.create(handle.name(f"p{r}"), _PAGE))
                made[-1].close()
        except BaseException:
            for seg in made:
                seg.close()
                seg.unlink()
            raise
        arena = cls(handle, ctl, result, data, owner=True)
        c = arena.ctl
        c[:] = 0
        for r in range(world):
            c[rank_base(r) + R_ARRIVED] = -1
            c[rank_base(r) + R_DONE] = -1
            c[rank_base(r) + R_CLAIM] = -1
            c[rank_base(r) + R_DATA_CAP] = _PAGE
            for p in (0, 1):
                c[header_base(r, p) + H_ROUND] = -1
        c[G_WORLD] = world
        c[G_EAGER] = eager_bytes
        c[G_CONSENSUS] = -1
        c[G_RESULT_CAP] = _PAGE
        c[G_RELAY] = 1 if relay else 0
        c[G_DIRECT] = 1 if direct and not relay and direct_allowed_by_env() else 0
        c[G_DIRECT_BROADCAST_MIN] = broadcast_min
        c[G_DIRECT_MIN] = direct_min
        c[G_FIRST_RANK] = first_rank
        c[G_GLOBAL_WORLD] = global_world if global_world is not None else world
        c[G_VERSION] = VERSION
        c[G_MAGIC] = MAGIC  # last: an attacher seeing the magic sees a complete block
        return arena

    @classmethod
    def attach(cls, handle: ArenaHandle) -> "Arena":
        """Map an existing arena (ranks, relays). Bulk segments map lazily."""
        ctl = Segment.attach(handle.name("ctl"))
        result = Segment.attach(handle.name("res"))
        arena = cls(handle, ctl, result, [None] * handle.world, owner=False)
        if int(arena.ctl[G_MAGIC]) != MAGIC or int(arena.ctl[G_VERSION]) != VERSION:
            raise RuntimeError(
                f"shared-memory segment {ctl.name} is not a flodl_shm arena of version "
                f"{VERSION} (magic 0x{int(arena.ctl[G_MAGIC]) & (2**64 - 1):x})"
            )
        return arena

    def close(self) -> None:
        """Drop this process's mappings (views still held keep their pages)."""
        self._result_view = None
        self._data_views = [None] * self.world
        self._extra_views = {}
        self._params_views = [None] * self.world
        for seg in [self._ctl_seg, self._result_seg, *self._data, *self._extra.values(),
                    *self._params]:
            if seg is not None:
                seg.close()

    def unlink(self) -> None:
        """Owner only: remove every segment name of this arena from /dev/shm."""
        from .segment import unlink_name

        for what in ("ctl", "res", "out", "tap"):
            unlink_name(self.handle.name(what))
        for r in range(self.world):
            unlink_name(self.handle.name(f"d{r}"))
            unlink_name(self.handle.name(f"p{r}"))

    # -- eager slots -------------------------------------------------------------
    def eager_area(self) -> np.ndarray:
        """Every eager slot, as one byte array (rank r, parity p at (2r + p) * eager_bytes)."""
        return self._eager

    def eager_slot(self, rank: int, rnd: int) -> np.ndarray:
        """Rank ``rank``'s eager slot for round ``rnd`` (bytes; parity-indexed)."""
        start = (2 * rank + (rnd & 1)) * self.eager_bytes
        return self._eager[start:start + self.eager_bytes]

    # -- bulk data regions ---------------------------------------------------------
    def _rank_segment(self, attached: list, what: str, rank: int) -> Segment:
        """Rank ``rank``'s segment ``<what><rank>`` (``d`` bulk input, ``p`` parameter
        block), attached by name on first use and kept in ``attached``."""
        seg = attached[rank]
        if seg is None:
            seg = attached[rank] = Segment.attach(self.handle.name(f"{what}{rank}"))
        return seg

    def _data_segment(self, rank: int) -> Segment:
        return self._rank_segment(self._data, "d", rank)

    def grow_data(self, rank: int, nbytes: int) -> None:
        """Grow rank ``rank``'s own bulk region to hold ``nbytes`` (call from that rank)."""
        seg = self._data_segment(rank)
        target = result_target(nbytes)
        if seg.reserve(target) or self._data_views[rank] is None:
            self._data_views[rank] = np.frombuffer(seg.buf, dtype=np.uint8)
        self.ctl[rank_base(rank) + R_DATA_CAP] = seg.nbytes

    def data_view(self, rank: int, nbytes: int) -> np.ndarray:
        """A byte view of rank ``rank``'s bulk region covering at least ``nbytes``."""
        return _covering(self._data_views, rank, nbytes, self._data_segment,
                         "bulk region", "its round header promises")

    # -- shared parameter blocks -----------------------------------------------------
    def _params_segment(self, rank: int) -> Segment:
        return self._rank_segment(self._params, "p", rank)

    def place_params(self, rank: int, nbytes: int) -> np.ndarray:
        """Rank ``rank``'s own shared parameter block, grown to hold ``nbytes`` (call from
        that rank, once: the block starts at the segment's first byte): a byte view
        whose address and ``nbytes`` are published in the rank's ``R_PARAMS_BASE`` /
        ``R_PARAMS_BYTES``."""
        seg = self._params_segment(rank)
        seg.reserve(-(-max(int(nbytes), 1) // _PAGE) * _PAGE)
        view = np.frombuffer(seg.buf, dtype=np.uint8)
        self._params_views[rank] = view
        base = rank_base(rank)
        self.ctl[base + R_PARAMS_BASE] = view.ctypes.data
        self.ctl[base + R_PARAMS_BYTES] = int(nbytes)
        return view

    def params_view(self, rank: int, nbytes: int) -> np.ndarray:
        """This process's byte view of rank ``rank``'s shared parameter block, covering at
        least ``nbytes`` (mapped on first use, re-mapped if the rank grew it)."""
        return _covering(self._params_views, rank, nbytes, self._params_segment,
                         "shared parameter block", "its control words promise")

    # -- result region -------------------------------------------------------------
    def result_view(self, nbytes: int) -> np.ndarray:
        """A byte view of the result region of at least ``nbytes``, growing it if needed.

        Every rank asks for the same ``nbytes`` in a round, so concurrent growth agrees
        on the target (``result_target``) and the file only ever grows.
        """
        view = self._result_view
        if view is None or view.shape[0] < nbytes:
            seg = self._result_seg
            target = result_target(nbytes)
            if seg.nbytes < target:
                seg.refresh()
            if seg.nbytes < target:
                seg.reserve(target)
                self.ctl[G_RESULT_CAP] = max(int(self.ctl[G_RESULT_CAP]), seg.nbytes)
            view = np.frombuffer(seg.buf, dtype=np.uint8)
            self._result_view = view
        return view

    def map_every_segment(self) -> None:
        """Map every segment of the arena now, while the names exist: each rank's bulk
        region and parameter block, the outer state (``out``) and the checkpoint mailbox
        (``tap``). An owner that unlinks the names once every rank did this (the c10d
        backend) leaves nothing in /dev/shm, and every segment can still grow later
        through its open descriptor."""
        for r in range(self.world):
            self.data_view(r, 0)
            self.params_view(r, 0)
        for what in ("out", "tap"):
            self._growable(what)

    # -- outer state and checkpoint mailbox -----------------------------------------------
    def _growable(self, what: str) -> Segment:
        seg = self._extra.get(what)
        if seg is None:
            seg = Segment.attach(self.handle.name(what))
            self._extra[what] = seg
        return seg

    def extra_view(self, what: str, nbytes: int, *, grow: bool = True) -> np.ndarray:
        """A byte view of the ``out`` or ``tap`` segment covering ``nbytes`` (grown with a
        deterministic target when ``grow``; otherwise re-mapped if a peer grew it)."""
        seg = self._growable(what)
        view = self._extra_views.get(what)
        if view is None or view.shape[0] < nbytes:
            if seg.nbytes < nbytes:
                seg.refresh()
            if seg.nbytes < nbytes:
                if not grow:
                    raise RuntimeError(f"segment {seg.name} holds {seg.nbytes} bytes, "
                                       f"{nbytes} expected")
                seg.reserve(result_target(nbytes))
            view = np.frombuffer(seg.buf, dtype=np.uint8)
            self._extra_views[what] = view
        return view

    # -- relay errors ------------------------------------------------------------------
    def set_relay_error(self, code: int, text: str, rnd: int = -1,
                        missing: list[int] | tuple[int, ...] = (),
                        timeout: float | None = None) -> None:
        """Relay side: record why the host cannot continue, abort, wake everyone."""
        import json

        from .waiting import Doorbell

        blob = json.dumps({"text": text, "round": rnd, "missing": list(missing),
                           "timeout": timeout}).encode()
        if len(blob) > ERROR_AREA_BYTES - 8:
            blob = json.dumps({"text": text[:ERROR_AREA_BYTES // 2], "round": rnd,
                               "missing": list(missing)[:16]}).encode()[:ERROR_AREA_BYTES - 8]
        area = self._error_area
        area[8:8 + len(blob)] = np.frombuffer(blob, np.uint8)
        area[:8].view(np.int64)[0] = len(blob)
        self.ctl[G_RELAY_ERROR] = code
        if not self.ctl[G_ABORT]:
            self.ctl[G_ABORT] = ABORT_SHUTDOWN
        Doorbell(self.ctl).ring()

    def relay_error(self) -> tuple[int, dict] | None:
        """(code, {"text", "round", "missing"}) if the relay failed, else None."""
        import json

        code = int(self.ctl[G_RELAY_ERROR])
        if not code:
            return None
        n = int(self._error_area[:8].view(np.int64)[0])
        try:
            info = json.loads(bytes(self._error_area[8:8 + n]))
        except ValueError:
            info = {"text": "relay failed (no details)", "round": -1, "missing": []}
        return code, info

    # -- helpers -------------------------------------------------------------------
    def is_dead(self, rank: int) -> bool:
        return bool(self.ctl[rank_base(rank) + R_DEAD])

    def mark_entered(self, rank: int) -> None:
        """Local rank ``rank`` finished its start-up and enters its function: a stop
        grants it a grace to finish (:meth:`entered`) rather than SIGTERM at once."""
        self.ctl[rank_base(rank) + R_ENTERED] = 1

    def entered(self, rank: int) -> bool:
        return bool(self.ctl[rank_base(rank) + R_ENTERED])

    def mark_exited(self, rank: int) -> None:
        """Local rank ``rank`` makes no further calls (it returned, or left its group):
        a peer waiting for it in a round raises naming it (the kernels' ``EXITED``)
        instead of waiting; the doorbell wakes the sleepers to see it."""
        from .waiting import Doorbell

        self.ctl[rank_base(rank) + R_DEAD] = DEAD_EXITED
        Doorbell(self.ctl).ring()

    def mark_gave_up(self, rank: int) -> None:
        """Local rank ``rank`` gave up on a round (its wait passed its deadline): a peer
        whose round completes after that must not take the result the others refused
        (:meth:`gave_up`). The first rank to give up is kept."""
        if not self.ctl[G_GAVE_UP]:
            self.ctl[G_GAVE_UP] = rank + 1

    def gave_up(self) -> int | None:
        """The local rank that first gave up on a round of this arena, or None."""
        who = int(self.ctl[G_GAVE_UP])
        return who - 1 if who else None

    def __repr__(self) -> str:
        return (f"Arena(session={self.handle.session}, world={self.world}, "
                f"eager={self.eager_bytes} B, owner={self.owner})")


def _covering(views: list, rank: int, nbytes: int, segment, what: str,
              promise: str) -> np.ndarray:
    """``views[rank]`` if it covers ``nbytes``, else a byte view of ``segment(rank)``
    re-mapped at its current size (a peer grew it), cached in ``views``."""
    view = views[rank]
    if view is None or view.shape[0] < nbytes:
        seg = segment(rank)
        if seg.nbytes < nbytes:
            seg.refresh()
        if seg.nbytes < nbytes:
            raise RuntimeError(f"rank {rank}'s {what} holds {seg.nbytes} bytes but {promise} "
                               f"{nbytes}: the arena is inconsistent")
        view = np.frombuffer(seg.buf, dtype=np.uint8)
        views[rank] = view
    return view


def direct_allowed_by_env() -> bool:
    """False when ``FLODL_SHM_DIRECT`` is 0/false/no/off (read by an arena's owner at
    creation: it decides for the whole arena)."""
    import os

    return os.environ.get("FLODL_SHM_DIRECT", "1").strip().lower() not in ("0", "false", "no",
                                                                         "off")


#: payload bytes from which an eligible reduce is a direct round (``engine/direct.py``),
#: in the eager slots' sizes too. Tensors on 4 KiB pages, ``all_reduce_`` (BENCHMARKS.md,
#: "Forty-third session"): 2 MiB on 2 ranks 261-307 µs direct against 531-538 through the
#: shared regions, on 4 ranks sharing 2 cores 922-929 against 1,446; 1 MiB on 2 ranks
#: 139-146 against 221-241 through the eager slots, on 4 ranks 542-568 against 1,084-1,131;
#: 512 KiB on 4 ranks 329-352 against 507-530. Since every direct reduce is one compiled
#: call (BENCHMARKS.md, "Forty-fourth session" and "Forty-fifth session"), 256 KiB on 2
#: ranks: one tensor 29-30 µs against the eager slots' 45, 4 tensors 32-34 against 55-57,
#: 16 tensors 42-44 against 60-64, 4 tensors in the shared blocks 23-24; at 128 KiB one
#: tensor on 4 ranks sharing 2 cores lost (127-133 µs against 109-115 into a result).
#: (Before the direct kernels were compiled whole, 2-3 MiB on 4 KiB pages broke even.)
DIRECT_MIN_BYTES = 256 << 10
#: payload bytes from which a broadcast is a direct round when each rank has a core: a
#: reader then reads the root's tensor once, where the eager slot costs the root a copy in
#: and the reader one out of lines another core just wrote. 2 ranks (BENCHMARKS.md,
#: "Forty-first session"): ``broadcast_`` of 32 KiB 7.0-7.1 µs direct against 8.8-8.9
#: eager, 64 KiB 6.4-9.1 against 11.2-11.4, 256 KiB 9.4-9.8 against 17.5-19.3; at 16 KiB
#: eager is ahead, 5.5-5.8 against 6.5-6.7
DIRECT_BROADCAST_MIN_BYTES = 32 << 10
#: the same where ranks outnumber cores: the direct round's second wait (for every slice)
#: then costs a scheduling turn. 4 ranks on 2 cores: 256 KiB 58-90 µs direct against 49-50
#: eager, 1 MiB 202-210 against 266-546
DIRECT_BROADCAST_MIN_BYTES_OVERSUBSCRIBED = 1 << 20


def _bytes_from_env(var: str) -> int | None:
    """A whole number of bytes from environment variable ``var`` (None when unset)."""
    import os

    env = os.environ.get(var, "").strip()
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        raise ValueError(f"{var}={env!r} is not a whole number of bytes: set it to e.g. "
                         f"65536, or unset it") from None
    if not 0 <= value < 1 << 62:
        raise ValueError(f"{var}={env!r} is out of range: set it to a number of bytes "
                         f"from 0 to 2^62 - 1, e.g. 65536, or unset it")
    return value


def direct_min_bytes() -> int:
    """The reduce threshold an arena's owner writes at creation:
    ``FLODL_SHM_DIRECT_MIN_BYTES`` when set, else ``DIRECT_MIN_BYTES`` (every rank reads
    the owner's word, so ranks whose environments differ still agree on every round)."""
    env = _bytes_from_env("FLODL_SHM_DIRECT_MIN_BYTES")
    return DIRECT_MIN_BYTES if env is None else env


def direct_broadcast_min_bytes(world: int) -> int:
    """The broadcast threshold an arena's owner writes at creation for ``world`` local
    ranks: ``FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES`` when set, else by whether the ranks
    outnumber the owner's cores (every rank reads the owner's word: they all agree)."""
    from .hostcpu import available_cores

    env = _bytes_from_env("FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES")
    if env is not None:
        return env
    if world > available_cores():
        return DIRECT_BROADCAST_MIN_BYTES_OVERSUBSCRIBED
    return DIRECT_BROADCAST_MIN_BYTES


def slice_bounds(nelem: int, parts: int, index: int, align: int = 16) -> tuple[int, int]:
    """Element range of slice ``index`` of ``parts`` over ``nelem`` elements.

    Slices are multiples of ``align`` elements (64 bytes of f32) so two ranks never
    write the same cache line of the result; the last slice takes the remainder.
    """
    per = int(math.ceil(nelem / parts / align)) * align if nelem else 0
    start = min(nelem, index * per)
    stop = nelem if index == parts - 1 else min(nelem, start + per)
    return start, stop

"""Fake ranks for tests: a real host arena in this process, ranks run as threads.

``FakeCohort`` builds the same shared-memory arena ``spawn`` builds and hands out
the same ``Comm`` objects, so tests exercise the real collective path (segments,
control block, futex waits, kernels) minus the process launcher. The compiled
kernels release the GIL, so thread-ranks really run concurrently::

    with FakeCohort(3) as cohort:
        results = cohort.run(lambda comm: comm.all_reduce_tensors([torch.ones(4)]))

Validation is local, before touching shared memory: ``FakeCohort(0)`` and
``cohort.comm(5)`` on a world of 3 raise ``ValueError``.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from .engine import arena as A
from .engine.comm import Comm
from .errors import CohortAborted
from .engine.checkpoint_tap import TapServer
from .engine.segment import reap_dead_owner_segments
from .engine.waiting import Doorbell


def _release(tap: TapServer, arena: "A.Arena", comms: dict[int, Comm]) -> None:
    """Close a cohort's tap and Comms (a Comm kept past the cohort raises instead of
    reducing alone), then unlink and unmap its arena."""
    tap.close()
    for c in comms.values():
        c.close()
    comms.clear()
    arena.unlink()
    arena.close()


class FakeCohort:
    """A host arena plus ``world_size`` thread-ranks (a context manager).

    Args:
        world_size: number of ranks (>= 1).
        timeout: per-collective deadline passed to every Comm (seconds).
        eager_bytes: size of each eager slot (small-round threshold).
        spin_iters: override the spin budget (iterations) of every Comm.
        direct: let large rounds run as direct rounds (``engine/direct.py``), as under
            ``spawn(max_failures=0)``; then no rank may be declared dead mid-run.
    """

    def __init__(self, world_size: int, *, timeout: float | None = 60.0,
                 eager_bytes: int | None = None, spin_iters: int | None = None,
                 direct: bool = False) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self.eager_bytes = eager_bytes
        self.spin_iters = spin_iters
        self.direct = direct
        self.arena: A.Arena | None = None
        self.tap: TapServer | None = None
        self._comms: dict[int, Comm] = {}
        self._finalizer: weakref.finalize | None = None

    def __enter__(self) -> "FakeCohort":
        reap_dead_owner_segments()  # a crashed test run's, as spawn does
        self.arena = A.Arena.create(self.world_size, eager_bytes=self.eager_bytes,
                                    direct=self.direct)
        self.tap = TapServer(self.arena)
        # a cohort never closed (dropped, or a test that failed before its close) gives
        # its segments back when collected, or at the interpreter's exit at the latest
        self._finalizer = weakref.finalize(self, _release, self.tap, self.arena, self._comms)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def flush_checkpoints(self, timeout: float = 60.0) -> bool:
        """Wait until every consensus checkpoint posted so far is on disk."""
        return self.tap.flush(timeout) if self.tap is not None else True

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # (once: a finalizer runs at most once)
            self._finalizer = None
        self.tap = None
        self.arena = None

    def comm(self, rank_id: int) -> Comm:
        """The Comm of rank ``rank_id`` (one per rank, created on first use)."""
        if not isinstance(rank_id, int) or rank_id < 0 or rank_id >= self.world_size:
            raise ValueError(f"rank_id {rank_id} must be < world_size {self.world_size}")
        if self.arena is None:
            raise RuntimeError("use FakeCohort as a context manager (with FakeCohort(n) as c:)")
        c = self._comms.get(rank_id)
        if c is None:
            c = Comm(self.arena, rank_id, timeout=self.timeout, spin_iters=self.spin_iters)
            self._comms[rank_id] = c
        return c

    def declare_dead(self, rank_id: int) -> None:
        """Fence a rank as the supervisor would after its process died. Only for a
        rank whose thread makes no further calls (never started, or finished)."""
        self.comm(rank_id)  # validates
        self.arena.ctl[A.rank_base(rank_id) + A.R_DEAD] = 1
        Doorbell(self.arena.ctl).ring()

    def abort(self) -> None:
        """Make every waiting rank raise CohortAborted."""
        if self.arena is not None:
            self.arena.ctl[A.G_ABORT] = A.ABORT_FAILED
            Doorbell(self.arena.ctl).ring()

    def run(self, fn: Callable[[Comm], Any], ranks: list[int] | None = None,
            join_timeout: float = 120.0) -> list[Any]:
        """Run ``fn(comm)`` on one thread per rank; results by rank.

        If a rank raises, the cohort is aborted (the others stop waiting) and the
        first exception is re-raised here. ``ranks`` runs only those ranks (others
        must be declared dead or run elsewhere); their results are ``None``.
        """
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        comms = {r: self.comm(r) for r in ranks}
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}

        def body(r: int) -> None:
            try:
                results[r] = fn(comms[r])
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors[r] = e
                if not isinstance(e, CohortAborted):
                    self.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True)
                   for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_timeout)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.abort()
            for t in threads:
                t.join(5.0)
            raise TimeoutError(f"FakeCohort.run: {stuck} did not finish within {join_timeout} s")
        if errors:
            first = min((r for r, e in errors.items() if not isinstance(e, CohortAborted)),
                        default=min(errors))
            raise errors[first]
        return results

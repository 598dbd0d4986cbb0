"""How a rank waits: spin briefly, then block on a futex, always bounded.

Waking a sleeping process costs ~35 µs on these VMs, so a round that completes in
a few µs must be caught by spinning; but a spinning waiter burns the core that a
late rank needs when ranks outnumber cores (4 ranks on 2 cores made spin-then-
``sched_yield`` rounds take over a millisecond, BENCHMARKS.md). So:

1. **spin** in compiled code (``kernels/signals.py``) for a time budget: ~200 µs
   (``SPIN_BUDGET_S``; ``FLODL_SHM_SPIN_US``) when every rank has a core, none when
   oversubscribed; then, **when ranks outnumber
   cores, yield** (``sched_yield``) for up to ~60 µs: the late rank is usually
   *runnable* on this core, not asleep, and a yield hands it the core at once,
   where sleeping would cost every waiter a ~35 µs wake-up per round. The fused
   eager calls make their first ``YIELDS_PER_CALL`` yields in compiled code
   (``kernels/rounds.py``, ``arrive``) before they return to this waiter;
2. **block** on the arena's doorbell futex. Every publication bumps the doorbell
   (a seq_cst RMW, i.e. a full fence) and wakes sleepers only if the sleeper count
   is non-zero. A waiter reads the doorbell *before* re-checking its condition and
   sleeps with ``FUTEX_WAIT(doorbell, seen)``: a publication after the read
   changes the doorbell, so the kernel refuses to sleep — no lost wake-up. The
   waiter counts itself a sleeper (seq_cst) before sleeping, so a publisher that
   bumps the doorbell afterwards sees it and wakes it;
3. every sleep is a slice of at most ``LIVENESS_SLICE`` seconds, after which the
   waiter checks liveness (the launcher is alive, the cohort is not aborting) and
   the round's deadline, failing with a ``ReduceStall`` naming the round and the
   missing ranks;
4. a wait still going after ``WAIT_NOTICE_S`` (60 s; ``FLODL_SHM_WAIT_NOTICE_S``, 0 for
   never) logs a warning naming the round, what it waits for and the ranks missing,
   and again each time its length doubles (one rank of a host says it for those
   waiting with it): without a collective timeout (``spawn``'s default) a rank stuck
   outside the collectives would otherwise leave its peers waiting without a word.
   A wait with a ``context`` (a refusal round: the rank's error is known, its peers
   have not called yet) says so after a few seconds.

``FUTEX_WAIT``/``FUTEX_WAKE`` are plain syscalls through ctypes on the mapped
address (non-private futexes work across processes on shared mappings). Where the
syscall is unavailable the waiter falls back to short sleeps.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import time
from typing import Callable

import numpy as np

from ..errors import CohortAborted, PeerDied, ReduceStall, shifted_ranks
from ..kernels import signals
from ..kernels.codes import ABORT, is_finished
from .hostcpu import available_cores

LIVENESS_SLICE = 0.05
# Longer than a futex wake-up (~50-100 µs on a VM): with a shorter budget one late peer
# makes the waiter sleep, its late wake-up makes the *other* rank late next round, and
# the pair settles in a sleep/wake ping-pong (seen under torch.distributed: 100 µs per
# 4 KiB round instead of 11 µs; a 200 µs budget breaks the cycle).
SPIN_BUDGET_S = 200e-6
# oversubscribed: no spin, a yield at once. The rank a wait misses is then most often
# runnable on this very core, where a spin only delays it (4 ranks on 2 cores: a 2 µs
# spin made a 4 KiB all_reduce_ 37-60 µs against 25-28 without, BENCHMARKS.md)
SPIN_BUDGET_OVERSUBSCRIBED_S = 0.0
YIELD_BUDGET_S = 60e-6  # oversubscribed only: hand the core to a runnable peer first
#: oversubscribed only: ``sched_yield`` calls a fused round's compiled wait makes before it
#: returns to the Python waiter (~0.5 µs each when nobody else is runnable, so about
#: ``YIELD_BUDGET_S``): leaving the call first made a barrier on 4 ranks and 2 cores cost
#: 26-45 µs instead of 14-28 (BENCHMARKS.md, ninth session)
YIELDS_PER_CALL = 64
MAX_WORK_SPIN_S = 5e-3  # the longest spin a large round's expected work may ask for
#: bytes per second a rank's step of a bulk round moves (copy or slice reduce), at worst:
#: how long a peer may take before a waiter stops spinning for it (``Waiter.wait``)
WORK_BYTES_PER_S = 2e9

#: a wait this long logs a warning (``Waiter``), then again at every doubling of its
#: length; ``FLODL_SHM_WAIT_NOTICE_S`` sets it, 0 turns the warnings off
WAIT_NOTICE_S = 60.0

logger = logging.getLogger("flodl_shm")

#: the ``extra`` of a long wait's notice: its record's ``wait_notice`` attribute is True
WAIT_NOTICE = {"wait_notice": True}

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
    _syscall = None

HAVE_FUTEX = _syscall is not None and _SYS_FUTEX is not None


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected``, at most ``timeout`` s."""
    if not HAVE_FUTEX:
        time.sleep(min(timeout, 50e-6))
        return
    sec = int(timeout)
    ts = _Timespec(sec, int((timeout - sec) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
             ctypes.c_int(expected), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(addr: int, count: int = _INT_MAX) -> None:
    if HAVE_FUTEX:
        _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                 ctypes.c_int(count), None, None, ctypes.c_int(0))


_relax_ns: float | None = None


def relax_ns() -> float:
    """Measured cost of one spin iteration (calibrated once per process)."""
    global _relax_ns
    if _relax_ns is None:
        signals.spin_calibrate(1000)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter_ns()
            signals.spin_calibrate(20000)
            best = min(best, (time.perf_counter_ns() - t0) / 20000)
        _relax_ns = max(best, 1.0)
    return _relax_ns


def oversubscribed(local_ranks: int) -> bool:
    """More ranks on this host than cores this process may run on."""
    return local_ranks > available_cores()


def spin_iterations(local_ranks: int, budget_s: float | None = None) -> int:
    """Spin iterations for this host: a long budget when each rank has a core."""
    if budget_s is None:
        env = os.environ.get("FLODL_SHM_SPIN_US")
        if env:
            budget_s = float(env) * 1e-6
        elif local_ranks > available_cores():
            budget_s = SPIN_BUDGET_OVERSUBSCRIBED_S
        else:
            budget_s = SPIN_BUDGET_S
    return max(0, int(budget_s * 1e9 / relax_ns()))


def wait_notice_s() -> float:
    """How long a wait lasts before it logs a warning: ``FLODL_SHM_WAIT_NOTICE_S``
    seconds when set (0: never), else ``WAIT_NOTICE_S``."""
    env = os.environ.get("FLODL_SHM_WAIT_NOTICE_S")
    if not env:
        return WAIT_NOTICE_S
    try:
        value = float(env)
    except ValueError:
        value = math.nan
    if not value >= 0.0:  # NaN too
        raise ValueError(f"FLODL_SHM_WAIT_NOTICE_S={env!r} is not a number of seconds >= 0: "
                         f"set it to how long a collective's wait lasts before it logs a "
                         f"warning (0 for never), or unset it for {WAIT_NOTICE_S:g} s")
    return value


class Doorbell:
    """Blocking half of the wait: the arena's futex word and its sleeper count."""

    def __init__(self, ctl: np.ndarray) -> None:
        self.ctl = ctl
        self.ctl32 = ctl.view(np.int32)
        self.addr = ctl.ctypes.data + signals.G_DOORBELL * 8

    def ring(self) -> None:
        """Announce a publication (callers that stored words without ``publish``)."""
        if signals.ring(self.ctl, self.ctl32) > 0:
            futex_wake(self.addr)

    def publish(self, idx: int, value: int) -> None:
        """Release-store ``ctl[idx] = value`` and wake sleepers if there are any."""
        if signals.publish(self.ctl, self.ctl32, idx, value) > 0:
            futex_wake(self.addr)

    def seen(self) -> int:
        return int(signals.doorbell(self.ctl32))

    def sleep(self, seen: int, timeout: float) -> None:
        signals.add_sleeper(self.ctl, 1)
        try:
            futex_wait(self.addr, seen, timeout)
        finally:
            signals.add_sleeper(self.ctl, -1)


class Waiter:
    """Runs one bounded wait: spin, then sleep in liveness-checked slices.

    Args:
        doorbell: the arena's doorbell.
        spin_iters: compiled spin iterations before blocking.
        timeout: per-wait deadline in seconds (``None``: no deadline, liveness only).
        liveness: called after every sleep slice that did not end the wait; raises if
            this rank must stop (launcher gone, cohort aborting, a peer dead).
    """

    def __init__(self, doorbell: Doorbell, spin_iters: int, timeout: float | None,
                 liveness: Callable[[], None]) -> None:
        self.doorbell = doorbell
        self.yield_budget = 0.0  # set by the owner when ranks outnumber cores
        self.max_spin = max(0, int(spin_iters))
        self.min_spin = min(self.max_spin, 16)
        self._spin = np.full(1, self.max_spin, np.int64)  # see ``share_spin``
        # the whole spin budget in seconds: a wait that ended within it after a missed
        # spin would have been caught by spinning longer
        self.max_spin_s = self.max_spin * relax_ns() * 1e-9 if self.max_spin else 0.0
        self.timeout = timeout
        self.liveness = liveness
        #: waits whose first spin missed (they went on to yield or sleep), and futex
        #: sleeps taken: monotone counters a benchmark reads to tell the spin regime
        #: (a few µs per round) from the sleep/wake one (tens of µs and more)
        self.missed = 0
        self.sleeps = 0
        #: who waits, as the warnings of a long wait name it, and the global rank of
        #: this host's local rank 0 (a wait's missing local ranks are named globally)
        self.who = "this rank"
        self.first_rank = 0
        #: a long wait's first warning, after this many seconds (0: none)
        self.notice_s = wait_notice_s()
        #: ``(text, seconds)`` while the owner runs a wait of a known cause (a refusal
        #: round): its warning leads with ``text``, and comes after ``seconds``
        self.context: tuple[str, float] | None = None
        #: ``speaks(missing, remote)``: whether this rank logs a long wait for
        #: ``missing`` (on other hosts when ``remote``), so that a host's waiting ranks
        #: say it once between them (``RoundEngine``: its lowest live waiting rank)
        self.speaks: Callable[[tuple, bool], bool] = lambda missing, remote: True

    def _yield_phase(self, check: Callable[[int], int], work_s: float) -> int:
        end = time.perf_counter() + max(self.yield_budget, min(work_s, MAX_WORK_SPIN_S))
        r = check(0)
        while r >= 0 and time.perf_counter() < end:
            os.sched_yield()
            r = check(8)
        return r

    @property
    def spin_iters(self) -> int:
        """The current spin budget in iterations (adapted by ``note_spin``)."""
        return int(self._spin[0])

    @spin_iters.setter
    def spin_iters(self, iters: int) -> None:
        self._spin[0] = iters

    def share_spin(self, cell: np.ndarray) -> None:
        """Keep the spin budget in ``cell`` (one int64 word), e.g. a word of the engine's
        call block, where the fused calls read it and double it themselves after a
        caught round (``kernels/rounds.py``, ``C_SPIN``): same rule as ``note_spin``."""
        cell[0] = self._spin[0]
        self._spin = cell

    def note_spin(self, succeeded: bool) -> None:
        """Adapt the spin budget (like glibc's adaptive mutex): halve it after a wait
        the full budget would not have caught — the peer was probably descheduled, and
        spinning only kept it off the core — and double it back after a wait it did
        (or would have) caught. A wait that missed a *reduced* spin but ended within
        the full budget counts as caught: otherwise a few late peers collapse the spin
        for good and every later round pays a futex sleep and wake-up (~50-100 µs)."""
        if succeeded:
            self.spin_iters = min(self.max_spin, max(self.min_spin, self.spin_iters * 2))
        else:
            self.spin_iters = max(self.min_spin, self.spin_iters // 2)

    def wait(self, check: Callable[[int], int], *, what: str, rnd: int,
             missing_of: Callable[[], tuple[int, ...]],
             on_missing: Callable[[int], bool] | None = None, work_s: float = 0.0,
             global_missing: bool = False) -> int:
        """Wait until ``check(iters)`` returns ``OK`` (done) or a terminal code.

        ``check`` is a compiled spin returning a status of ``kernels/codes.py``: ``OK``
        done, ``ABORT`` the cohort aborts (raised here as ``CohortAborted``), >= 0 the
        first item still missing, ``MISMATCH`` and below terminal. ``on_missing(m)``
        may act on the missing item (e.g. take over a dead rank's slice) and return
        True when it made progress. ``work_s``: how long the awaited ranks' step takes
        (a bulk round's copy or slice): the spin (when every rank has a core) or the
        yields (when ranks outnumber cores) last at least that long, since a peer that
        far behind is still working, not gone, and sleeping would add a wake-up to
        every large round. ``global_missing``: ``missing_of`` names global ranks (a
        wait on other hosts), not this host's local ones. Returns ``OK`` or the
        terminal code.
        """
        iters = self.spin_iters
        if work_s > 0.0 and not self.yield_budget and self.max_spin:
            iters = max(iters, int(min(work_s, MAX_WORK_SPIN_S) * 1e9 / relax_ns()))
        r = check(iters)
        if is_finished(r):
            self.note_spin(True)
            return r
        started = time.perf_counter()
        self.missed += 1
        r = self._wait_slow(check, r, what=what, rnd=rnd, missing_of=missing_of,
                            on_missing=on_missing, work_s=work_s,
                            global_missing=global_missing)
        self.note_spin(time.perf_counter() - started <= self.max_spin_s)
        return r

    def _wait_slow(self, check: Callable[[int], int], r: int, *, what: str, rnd: int,
                   missing_of: Callable[[], tuple[int, ...]],
                   on_missing: Callable[[int], bool] | None, work_s: float,
                   global_missing: bool = False) -> int:
        """The part of ``wait`` after the spin missed: yield (for as long as the awaited
        work takes, when it is longer than the yield budget), then sleep in slices."""
        if self.yield_budget and r >= 0:
            r = self._yield_phase(check, work_s)
            if is_finished(r):
                return r
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        first = self.notice_s if self.context is None else self.context[1]
        notice = started + first if first > 0 else math.inf
        while True:
            if r == ABORT:
                self.liveness()
                raise CohortAborted(f"the cohort is shutting down (while {what}, round {rnd})")
            if r >= 0 and on_missing is not None and on_missing(r):
                r = check(0)
                continue
            seen = self.doorbell.seen()
            r = check(0)
            if is_finished(r):
                return r
            if r == ABORT:
                continue
            slice_s = LIVENESS_SLICE
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = missing_of()
                    raise ReduceStall(
                        f"round {rnd} stalled: {what} exceeded the {self.timeout:g} s collective "
                        f"timeout; ranks that had not arrived: {list(missing)} (alive but "
                        f"silent - a scheduler wedge or a rank stuck outside the collective)",
                        round=rnd, missing=missing, timeout=self.timeout)
                slice_s = min(slice_s, left)
            self.sleeps += 1
            self.doorbell.sleep(seen, slice_s)
            # the wait's own condition first: a peer that finished this step and then
            # died (or a launcher that went away after it) must not fail a wait that
            # is complete; liveness answers for the peers still missing
            r = check(self.spin_iters // 8)
            if is_finished(r):
                return r
            try:
                self.liveness()
            except PeerDied as e:  # name who else had not arrived: maybe why it left
                raise e.with_missing(missing_of()) from None
            now = time.monotonic()
            if now >= notice:
                missing = missing_of()
                if self.context is not None or self.speaks(missing, global_missing):
                    if not global_missing:
                        missing = shifted_ranks(missing, self.first_rank)
                    self._notice(now - started, what, rnd, missing, deadline, now,
                                 "on other hosts" if global_missing
                                 else "alive, not there yet")
                notice = started + 2 * (notice - started)  # again when the wait doubled

    def _notice(self, waited: float, what: str, rnd: int, missing: tuple[int, ...],
                deadline: float | None, now: float, where: str) -> None:
        """Warn that this wait has lasted ``waited`` seconds: what it waits for, who is
        missing (``where``: what is known of them), and when (if ever) it gives up."""
        if deadline is None:
            ends = ("No collective timeout is set, so the wait goes on: it ends when they "
                    "call (a peer in evaluation or writing a checkpoint does in time), "
                    "never if one is stuck or deadlocked outside the collectives "
                    "(spawn(timeout=...) bounds every wait)")
        else:
            ends = (f"The round fails at the {self.timeout:g} s collective timeout, "
                    f"{_seconds(deadline - now)} s from now")
        if not missing:
            late = "its peers"
        elif all(isinstance(m, int) for m in missing):
            late = f"ranks {list(missing)}"
        else:  # named, not numbered (the checkpoint tap's owner)
            late = "the " + ", ".join(map(str, missing))
        # (``wait_notice``: a spawned rank's launcher drops the notices that reach it
        # after it stopped the cohort, as a peer's failure does, ``launch/supervisor.py``)
        if self.context is not None:
            logger.warning("%s: %s have made no collective for %s s (round %d). %s",
                           self.context[0], late, _seconds(waited), rnd, ends,
                           extra=WAIT_NOTICE)
        else:
            logger.warning("%s has waited %s s for %s in round %d (%s): %s. %s",
                           self.who, _seconds(waited), late, rnd, what, where, ends,
                           extra=WAIT_NOTICE)


def _seconds(s: float) -> str:
    """Seconds as a notice says them: 0.503, 60, 1740."""
    return f"{max(s, 0.0):.0f}" if s >= 100 else f"{max(s, 0.0):.3g}"

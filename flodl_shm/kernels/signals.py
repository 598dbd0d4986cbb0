"""Compiled spin checks and publications on the arena's control block.

These are the only code that touches synchronisation words in a loop; they use
the atomics in ``atomics.py`` so the compiler neither caches a peer's word in a
register nor moves a payload store after the flag that publishes it.

Return convention of the ``spin_*`` checks (``codes.py``): ``OK`` the condition holds,
``ABORT`` the cohort is aborting, ``>= 0`` the condition does not hold yet (the value
names the first rank or slice still missing). ``iters`` bounds the spin: 0 checks once.

Word offsets come from ``flodl_shm/kernels/control_block.py``, the one definition of the control block.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .control_block import G_ABORT, G_DOORBELL, G_SLEEPERS, GLOBAL_WORDS, R_DONE, RANK_WORDS
from .codes import ABORT, OK
from .atomics import compare_exchange, cpu_relax, fetch_add, load_acquire, store_release



@njit(cache=True, nogil=True)
def ring(ctl, ctl32):
    """Bump the doorbell (a full fence); returns how many waiters sleep on it."""
    fetch_add(ctl32, 2 * G_DOORBELL, 1)
    return load_acquire(ctl, G_SLEEPERS)


@njit(cache=True, nogil=True)
def publish(ctl, ctl32, idx, value):
    """Release-store ``ctl[idx] = value``, then ring; returns the sleeper count."""
    store_release(ctl, idx, value)
    fetch_add(ctl32, 2 * G_DOORBELL, 1)
    return load_acquire(ctl, G_SLEEPERS)


@njit(cache=True, nogil=True)
def load(ctl, idx):
    return load_acquire(ctl, idx)


@njit(cache=True, nogil=True)
def doorbell(ctl32):
    return load_acquire(ctl32, 2 * G_DOORBELL)


@njit(cache=True, nogil=True)
def add_sleeper(ctl, delta):
    return fetch_add(ctl, G_SLEEPERS, delta)


@njit(cache=True, nogil=True)
def fetch_add_word(arr, idx, delta):
    """seq_cst ``old = arr[idx]; arr[idx] += delta; return old`` on any int array."""
    return fetch_add(arr, idx, delta)


@njit(cache=True, nogil=True)
def cas(ctl, idx, expected, new):
    """Compare-and-swap ``ctl[idx]`` from ``expected`` to ``new``; returns the old value
    (the swap happened iff it equals ``expected``)."""
    return compare_exchange(ctl, idx, expected, new)


@njit(cache=True, nogil=True)
def spin_slices(ctl, world, rnd, first, iters):
    """Every slice's done word reached ``rnd``; scans from slice ``first``."""
    it = 0
    while True:
        if load_acquire(ctl, G_ABORT) != 0:
            return ABORT
        missing = OK
        for k in range(world):
            j = (first + k) % world
            if load_acquire(ctl, GLOBAL_WORDS + j * RANK_WORDS + R_DONE) < rnd:
                missing = j
                break
        if missing == OK:
            return OK
        if it >= iters:
            return missing
        it += 1
        cpu_relax()


@njit(cache=True, nogil=True)
def spin_word_ge(ctl, idx, target, iters):
    """``ctl[idx] >= target``; returns 0 (not yet) rather than a rank."""
    it = 0
    while True:
        if load_acquire(ctl, G_ABORT) != 0:
            return ABORT
        if load_acquire(ctl, idx) >= target:
            return OK
        if it >= iters:
            return 0
        it += 1
        cpu_relax()


@njit(cache=True, nogil=True)
def spin_calibrate(n):
    """Run ``n`` relax iterations (used once to size spin budgets in time)."""
    acc = 0
    for i in range(n):
        cpu_relax()
        acc += i
    return acc


def warm_up() -> None:
    ctl = np.zeros(GLOBAL_WORDS + 2 * RANK_WORDS, np.int64)
    c32 = ctl.view(np.int32)
    ring(ctl, c32)
    publish(ctl, c32, GLOBAL_WORDS + R_DONE, 1)
    load(ctl, 0)
    load(c32, 0)
    fetch_add_word(c32, 0, 0)
    cas(ctl, 0, 0, 0)
    doorbell(c32)
    add_sleeper(ctl, 1)
    add_sleeper(ctl, -1)
    spin_slices(ctl, 2, 1, 0, 0)
    spin_word_ge(ctl, 0, 0, 0)
    spin_calibrate(10)

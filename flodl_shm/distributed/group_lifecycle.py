"""A ``"flodl_shm"`` group's life in this process: its creation and its end.

- **Created** by ``create_process_group``, the creator ``Backend.register_backend``
  calls (``flodl_shm/distributed/__init__.py``) for ``dist.init_process_group`` and
  ``dist.new_group``. It builds the group (``process_group.py``), records it as live,
  and says, once, what a newcomer's set-up gets wrong at this moment: device backends
  that torch will never build beside a Python backend, and torch threads that
  outnumber the host's cores.
- **Ended** by ``dist.destroy_process_group`` (the group's ``shutdown``) or, for a group
  a program left, by ``_shut_down_at_exit`` while the interpreter still runs: a group
  left to the interpreter's teardown aborted the process now and then.
"""
from __future__ import annotations

import atexit
import logging
import weakref
from datetime import timedelta

import torch

from ..engine.hostcpu import available_cores
from .process_group import ProcessGroupFlodlShm

logger = logging.getLogger("flodl_shm")

#: the groups of this process not shut down yet (``_shut_down_at_exit``)
_live_groups: "weakref.WeakSet[ProcessGroupFlodlShm]" = weakref.WeakSet()


@atexit.register
def _shut_down_at_exit() -> None:
    """Shut down the groups a program left without ``dist.destroy_process_group()``,
    while the interpreter still runs: a multi-host group's gloo group of host leaders,
    left to the interpreter's teardown, aborted the process now and then ('terminate
    called without an active exception', exit status -6). A program ending on an
    uncaught exception (the interpreter printed it: ``sys.last_value``) does not leave
    as one that finished: a peer waiting for it names it dead, where it was told the
    rank "returned from its function" and to check the order of its collective calls."""
    import sys

    failed = (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)) is not None
    for group in list(_live_groups):
        try:
            group.shutdown(failed=failed)
        except Exception as e:  # noqa: BLE001 - exiting anyway: say it, shut the others
            logger.warning("flodl_shm: shutting down a process group at exit failed: %s", e)


def create_process_group(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupFlodlShm:
    """The creator ``Backend.register_backend`` calls for ``"flodl_shm"``."""
    pg = ProcessGroupFlodlShm(store, rank, size, timeout)
    _live_groups.add(pg)
    left_out = _device_backends_left_out()
    if left_out and rank == 0:
        logger.warning(
            "%s: torch gives a Python backend such as flodl_shm the whole process group, so "
            "no %s backend is built (collectives of %s tensors on this group raise). Give "
            "them a group of their own, e.g. dist.new_group(backend=%r)",
            ",".join(["cpu:flodl_shm", *left_out]),
            " or ".join(e.split(":", 1)[1] for e in left_out),
            " or ".join(e.split(":", 1)[0] for e in left_out),
            left_out[0].split(":", 1)[1])
    _warn_if_threads_outnumber_cores(pg)
    return pg


_warned_of_threads = False


def _warn_if_threads_outnumber_cores(pg: ProcessGroupFlodlShm) -> None:
    """At the first group of a process (``init_process_group``'s), on the first rank of
    its host: where the host's ranks run more torch threads together than it has cores
    (``torch.multiprocessing.spawn`` or a launcher of one's own, with torch's default of
    a thread a core; torchrun and ``flodl_shm.spawn`` set one thread or the ranks'
    share), say how to run one a rank.
    Each rank's OpenMP team then waits for cores its peers hold: two ranks of two threads
    on two cores ran a 256x512 by 512x512 matmul in 15.6 ms instead of 1.4 between
    all-reduces (7.2 on gloo)."""
    global _warned_of_threads
    if _warned_of_threads:
        return
    # (this process's first group, init_process_group's: its ranks are all of the host's;
    # a subgroup's first rank would warn again, naming fewer)
    _warned_of_threads = True
    ranks = len(pg.topology.local_ranks)
    threads, cores = torch.get_num_threads(), available_cores()
    share = max(1, cores // ranks)  # (ranks alone may outnumber the cores: one each then)
    if threads <= share or pg.rank() != min(pg.topology.local_ranks):
        return
    logger.warning(
        "flodl_shm: the %d ranks on this host each run torch with %d threads, %d in all on %d "
        "cores, so each rank's torch threads wait for cores its peers hold (its matmuls and "
        "collectives slow down many times over). Run %d thread(s) a rank: OMP_NUM_THREADS=%d "
        "in the launcher's environment (torchrun sets 1), or torch.set_num_threads(%d) in "
        "each rank before init_process_group", ranks, threads, threads * ranks, cores,
        share, share, share)


def _device_backends_left_out() -> list[str]:
    """``device:backend`` entries of the backend string being built besides flodl_shm's
    (``"cpu:flodl_shm,cuda:nccl"``): torch's group builder stops at a backend that is a
    ``ProcessGroup`` (every Python backend is), so they are never built. Read from the
    builder's frame (``_new_process_group_helper``'s ``backend_config``); [] when it
    cannot be found."""
    import sys

    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return []
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            return [f"{device}:{backend}"
                    for device, backend in config.get_device_backend_map().items()
                    if backend != "flodl_shm"]
    return []

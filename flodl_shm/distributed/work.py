"""The ``Work`` objects the ``"flodl_shm"`` process group's collectives return.

A collective either ran to completion in the caller's thread (``DoneWork``: ``wait()``
returns at once, the outputs are written) or was queued on the group's worker thread
(``QueuedWork``, ``overlap.py``: ``wait()`` blocks until it ran and raises what it
raised). Both are what torch's callers expect of a ``dist.Work``: DDP's reducer waits on
``get_future()``, ``dist.all_reduce(..., async_op=True)`` on ``wait()``.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class DoneWork(dist.Work):
    """The ``Work`` of a collective that completed in the call: ``wait()`` returns at
    once and ``get_future()`` holds its outputs (``done_work``), made only when asked
    for (DDP's comm hooks ask; a plain ``dist.all_reduce`` never does). A third of the
    cost of wrapping a completed future, which at 4 KiB was half a round."""

    # (no ``__init__`` of its own: ``done_work`` sets the result; a Python ``__init__``
    # calling torch's cost a 4 KiB dist.all_reduce 0.35 us of its 8)
    _result = None
    _future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        return None

    def result(self):
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._result)
        return self._future


def done_work(result) -> dist.Work:
    """The completed ``Work`` of a collective whose outputs are ``result``."""
    work = DoneWork()
    work._result = result
    return work


#: the ``Work`` of every completed barrier, made once: it holds no tensors, as gloo's
#: (a ``torch.zeros(0)`` and a ``Work`` a call cost 2.3 us of a 5.2 us barrier)
BARRIER_DONE = done_work([])


class QueuedWork(dist.Work):
    """The ``Work`` of a collective queued on the group's worker (``overlap.py``):
    ``wait()`` blocks until it ran and raises what it raised. (torch's
    ``_create_work_from_future`` returns a Work whose ``wait()`` swallows the future's
    exception: a queued collective's errors were lost.)"""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective ran (raising what it raised), or, with a
        ``timeout`` (torch's 0 means none), raise ``RuntimeError`` once that passed,
        as gloo's ``wait(timeout)`` does; the collective stays queued either way."""
        limit = None if timeout is None else timeout.total_seconds()
        if limit is not None and limit > 0 and not self._future.done():
            ran = threading.Event()
            self._future.add_done_callback(lambda _: ran.set())
            if not ran.wait(limit):
                raise RuntimeError(
                    f"flodl_shm: Work.wait timed out after {limit:g} s: the collective has "
                    f"not completed (a peer has not joined it yet); it stays queued on the "
                    f"group, which fails it at the group's own timeout")
        self._future.wait()  # raises the collective's error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self):
        try:
            self._future.value()
        except Exception as e:
            return e
        return None

    def synchronize(self) -> None:
        return None

    def result(self):
        return self._future.value()

    def get_future(self) -> torch.futures.Future:
        # a chained future: torch's DDP reducer waits on it in C++, where a future
        # failed from Python (set_exception) crashed the process with SIGSEGV; the
        # chain's callback re-raises under the GIL and fails the future it returns with
        # a plain C++ error naming the collective's ("Got the following error when
        # running the callback: PeerDied: ...")
        return self._future.then(_its_value)


def _its_value(future: torch.futures.Future):
    return future.value()

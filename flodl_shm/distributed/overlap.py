"""Overlapping a process group's collectives with the backward pass: one worker thread.

DDP launches a bucket's all-reduce from inside ``loss.backward()`` and waits for all of
them at its end; gloo runs them on a worker thread meanwhile, so communication hides
behind the rest of the backward pass. ``CollectiveWorker`` gives the ``"flodl_shm"``
group the same: collectives issued during a backward pass are queued and run in
order on one thread (the engine's kernels and waits release the GIL), the caller gets
a ``Work`` whose future completes when its collective did.

Order is what keeps ranks in step, so:

- one FIFO queue, one thread: queued collectives run in submission order;
- a collective issued while the queue is not empty is queued too, even outside a
  backward pass (it must not overtake those before it);
- a collective issued *on* the worker thread (a future's callback, e.g. PowerSGD's
  second all-reduce) runs at once, inline: the callbacks of queued item k run before
  item k+1 on every rank;
- ``lock`` is held by whoever drives the engine (the worker, or a caller running a
  collective inline), so two threads never drive the same ``Comm``.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch


class CollectiveWorker:
    """The FIFO thread that runs one process group's queued collectives.

    Args:
        name: the thread's name.
        lock: the group's engine lock (re-entrant), held while an item runs and while
            its future's callbacks run.
    """

    def __init__(self, name: str, lock: threading.RLock) -> None:
        self.lock = lock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def on_worker_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def pending(self) -> int:
        """Items queued or running (their callbacks included)."""
        return self._pending

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``fn``; its return value (a tensor or list of tensors) completes the
        returned future, an exception fails it."""
        fut = torch.futures.Future()
        with self._count_lock:
            self._pending += 1
        self._queue.put((fn, fut))
        return fut

    def _main(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            with self.lock:
                try:
                    result = fn()
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    fut.set_exception(e)
                else:
                    fut.set_result(result)  # callbacks run here, still under the lock
                finally:
                    with self._count_lock:
                        self._pending -= 1

    def stop(self, timeout: float) -> bool:
        """Let the queued items finish, then end the thread; False if it did not end
        within ``timeout`` seconds (it is a daemon: it dies with the process)."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

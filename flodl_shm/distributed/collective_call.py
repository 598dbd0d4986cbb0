"""How every public collective of the ``"flodl_shm"`` process group is called.

``@collective`` wraps each of ``ProcessGroupFlodlShm``'s collectives: the errors its
rounds raise become the ``RuntimeError`` c10d users expect, a call asked to run in the
background is queued on the group's worker thread, its torch work runs on the rank's
share of the cores, and a torch.compile'd caller reaches it as eager code. It reads the
group's state and asks the group for its error texts through these members:

- ``_worker``, ``_start_worker()``, ``_engine_lock``, ``_overlap``: the overlap
  (``overlap.py``);
- ``_link``, ``_unusable``: a destroyed or unusable group raises at once;
- ``_threads``: the most torch threads a collective's own work may use;
- ``_calling``: set to the running collective's name, for its errors;
- ``_refusal_round``, ``_mismatch``, ``_stalled``, ``_check_nobody_gave_up``: the
  texts of a refused call, a mismatch and a timeout, and the check after a completed
  call that no peer gave up on it.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..errors import FrameError, ReduceStall
from .reduce_ops import RefusedCall
from .work import QueuedWork

_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass


def collective(method):
    """Every public collective goes through here.

    - Errors: collectives raise ``RuntimeError`` as c10d users expect; the engine's
      ``FrameError`` (ranks called different collectives or shapes, raised on every
      rank at the same round, so the group stays usable) becomes one, chained, that
      lists what each rank called (``call_mismatch.py``: one more round).
    - Overlap (``overlap.py``): issued with ``async_op=True``, during a backward pass,
      or while earlier ones are still queued, the collective is queued on the group's
      worker thread and the returned ``Work`` completes later; otherwise it runs now,
      in the caller's thread.
      A collective built on another one must be decorated as a whole (the inner call
      then runs inline): one that called a decorated collective and returned its own
      completed ``Work`` would return before a queued round ran, its outputs unwritten
      and its errors lost.
    - A collective this rank refuses before any round (``RefusedCall``: a tensor, dtype,
      layout or op it cannot reduce) still takes part in one round, the **refusal
      round**: where every rank refused, it completes and each raises its own error;
      where other ranks called a collective, it mismatches theirs, and every rank
      raises, told what each rank called (before it, the refusing rank returned at once
      and the others' next collective paired with its next one).
    - A wait past the group's timeout raises ``RuntimeError`` (as gloo's does) naming the
      group ranks that had not arrived (the engine counts ranks per host).
    - Threads: the collective's own torch work (copies, sums) runs on at most this rank's
      share of the host's cores (``_threads``), torch's count restored after. Where the
      ranks' torch threads outnumber the cores (``mp.spawn`` with torch's default: two
      ranks of two threads on two cores), a torch copy inside a round woke an OpenMP team
      whose threads waited for cores the peers spun on: a 256 KiB ``all_gather_into_tensor``
      took 8 ms instead of 0.09.
    """
    name = method.__name__

    def run(self, args, kwargs):
        # (one frame for the thread share, the call and its errors: each Python frame
        # here cost a 4 KiB dist.all_reduce 0.3 us of its 8)
        threads = torch.get_num_threads()
        if threads > self._threads:
            torch.set_num_threads(self._threads)
        else:
            threads = 0
        self._calling = name
        try:
            work = method(self, *args, **kwargs)
            self._check_nobody_gave_up(name)
            return work
        except RefusedCall as e:
            # before any round: a rank whose peers did not refuse would leave them a call
            # behind, so every rank that refuses takes part in one round that says so (one:
            # a collective built on another one sees the inner one's refusal, said already)
            if e.said:
                raise
            e.said = True
            why = self._refusal_round(name, args, kwargs)
            if why is None:
                raise  # every rank refused: in step
            raise RuntimeError(f"{e}\n{why}") from e
        except FrameError as e:  # every rank raised it at the same round
            raise RuntimeError(self._mismatch(name, args, kwargs, e)) from e
        except ReduceStall as e:
            raise RuntimeError(f"flodl_shm {self._stalled(name, e)}; the group is unusable, "
                               f"destroy it") from e
        finally:
            if threads:
                torch.set_num_threads(threads)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if _compiler_callback is not None and _compiler_callback() is not None:
            # a torch.compile'd caller (DDP's forward rebuilding its buckets, syncing its
            # buffers) reached the collective through torch's C++: its frame evaluation
            # would trace this Python, where the group is an opaque object to it
            return uncompiled(wrapper, self, *args, **kwargs)
        worker = self._worker
        if worker is not None and worker.on_worker_thread():
            return run(self, args, kwargs)  # nested, or a queued item's callback
        if self._link is None or self._unusable is not None:
            return run(self, args, kwargs)  # destroyed or unusable: it raises now
        if self._overlap:
            # asked to run in the background: the options (every collective's last
            # argument) say ``asyncOp`` (``dist.all_reduce(..., async_op=True)``, a
            # functional collective, torch's own calls with default options); a call
            # that waits at once (``async_op=False``) says no
            opts = kwargs.get("opts", args[-1] if args else None)
            queue = _graph_task_id() != -1 or getattr(opts, "asyncOp", False) is True
        else:
            queue = False
        if queue or (worker is not None and worker.pending()):
            worker = self._start_worker()
            fut = worker.submit(lambda: run(self, args, kwargs).get_future().value())
            return QueuedWork(fut)
        with self._engine_lock:
            return run(self, args, kwargs)

    return wrapper


#: the frame-evaluation callback torch.compile has set in this thread (None: no compiled
#: code runs here); torch's C function, which needs no import of ``torch._dynamo``
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _compiler_callback
except ImportError:  # a torch built without it
    _compiler_callback = None


def uncompiled(collective: Callable, *args, **kwargs):
    """``collective(*args, **kwargs)`` with torch.compile's frame evaluation off for it and
    all it calls: a collective runs as the eager code it is (as gloo's C++ does)."""
    global _untraced
    if _untraced is None:
        import torch._dynamo  # loaded: a compiled caller is running

        _untraced = torch._dynamo.disable(lambda fn, *a, **k: fn(*a, **k), recursive=True)
    return _untraced(collective, *args, **kwargs)


_untraced: Callable | None = None


def leave_to_eager(*functions: Callable) -> None:
    """Tell torch.compile's frame evaluation to run these functions' frames as they are,
    without tracing them (``torch._dynamo.eval_frame.skip_code``, through torch's C
    module: importing ``torch._dynamo`` costs a second): a collective's entry, reached by
    a compiled caller, would otherwise be traced up to its check, with a warning that
    the check cannot be traced. Without that C API, that is all that happens."""
    try:
        from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                                 set_code_exec_strategy)

        for fn in functions:
            set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP,
                                                                    _FrameAction.DEFAULT))
    except (ImportError, AttributeError, TypeError):
        pass

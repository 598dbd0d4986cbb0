"""``ProcessGroupFlodlShm``: the ``torch.distributed`` process group of backend ``"flodl_shm"``.

Created by ``dist.init_process_group("flodl_shm", ...)`` / ``dist.new_group(backend=
"flodl_shm")`` through ``group_lifecycle.create_process_group``, the creator registered
in ``flodl_shm/distributed/__init__.py``; rendezvous (host peers, one arena per host) is
``rendezvous.py``.

Two transports carry every collective (docs/c10d.md has the op/dtype table):

- **reduce rounds** of the engine (``Comm.all_reduce_``) for float32 and bfloat16
  SUM/AVG all-reduces: each element is summed in f32 in rank order, so every rank
  gets the same bits. Across hosts: the host sum in shared memory, then the host
  leaders' gloo all-reduce of those partials, then the result fans out through
  shared memory;
- **byte rounds** (``engine/byte_exchange.py``) for everything else: every rank sees
  every rank's bytes and reduces or copies locally, in rank order (bit-identical on
  every rank, any dtype, any op of ``reduce_ops.py``). Across hosts the leaders
  gather their hosts' bytes, all-gather them through gloo and fan them out
  (``byte_layout.py``: where the tensors sit in a round's bytes).

Across hosts, each collective's host round, the leaders' agreement that every host ran
the same one, and the fan-out of the result are ``host_tier.py``'s.

Every collective is called through ``collective_call.py`` (errors, overlap, threads);
arguments a rank cannot take still join the round and raise after it
(``tensor_arguments.py``), so the ranks stay in step.

A collective the caller waits for (``async_op=False``) runs to completion in the
calling thread; the returned ``Work`` (``work.py``) is already completed (``wait()``
returns True at once, ``get_future()`` holds the output tensors) and a failure raises
from the call itself. One issued with ``async_op=True`` (or during a backward pass, or
behind queued ones) is queued on the group's worker thread (``overlap.py``), as gloo
runs it in the background: its ``Work`` completes when it ran, and ``wait()`` raises
what it raised.
"""
from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..engine.byte_exchange import exchange_bytes
from ..engine.hostcpu import available_cores
from ..errors import FrameError, ReduceStall
from ..frame import RoundKind, tensor_array
from .byte_layout import (ALIGN, aligned, apart_or_own, copy_into, nbytes_of, packed_offsets,
                          put_status, round_signature, tensor_at, write_tensors)
from .call_mismatch import describe_call, explain_mismatch
from .collective_call import collective, leave_to_eager, uncompiled
from .host_tier import HostTier
from .overlap import CollectiveWorker
from .reduce_ops import (SUPPORTED_DTYPES, average_, check_dtype, check_layout, check_op,
                         float_view, op_label, op_name, op_type, real_views, reduce_in_order)
from .rendezvous import HostLink, rendezvous
from .sparse_sum import is_sparse_call, sparse_all_reduce
from .tensor_arguments import (checked_inputs, dense_outputs, misfit, nothing_to_refuse,
                               raise_problem, writable)
from .work import BARRIER_DONE, done_work

logger = logging.getLogger("flodl_shm")

BACKEND_NAME = "flodl_shm"
_F32 = torch.float32
_STRIDED = torch.strided
_SUM = dist.ReduceOp.RedOpType.SUM
_AVG = dist.ReduceOp.RedOpType.AVG
_CONTROL = RoundKind.CONTROL
_MODEL = RoundKind.MODEL
#: a dtype's code in the shapes of the engine rounds that carry it as float32
#: (``_allgather_words``, ``_reduce_scatter_summed``): ranks that pass different
#: dtypes send different shapes, a schema mismatch, as a byte round's signature makes it
_DTYPE_CODES = {dt: k for k, dt in enumerate(
    SUPPORTED_DTYPES + (torch.complex64, torch.complex128))}
#: the signature of the refusal round (``ProcessGroupFlodlShm._refusal_round``)
_REFUSAL_SIGNATURE = round_signature("flodl_shm refusal round")


class ProcessGroupFlodlShm(dist.ProcessGroup):
    """The ``"flodl_shm"`` process group (CPU tensors).

    Args:
        store: the group's c10d store; rank, size: this rank and the group size;
        timeout: bounds every wait of every collective (and the rendezvous).
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._link: HostLink | None = rendezvous(store, rank, size, timeout)
        self._topo = self._link.topology
        self._engine_lock = threading.RLock()
        self._worker: CollectiveWorker | None = None
        # the first failure that left the group unusable across hosts (a dead rank, the
        # leaders' exchange failed): every later call raises naming it
        self._unusable: str | None = None
        self._calling = "collective"  # the name of the collective running (its errors')
        # the most torch threads a collective's own work may use (``collective``): this
        # rank's share of the host's cores
        self._threads = max(1, available_cores() // len(self._topo.local_ranks))
        # FLODL_SHM_C10D_OVERLAP=0 runs every collective in the caller's thread
        self._overlap = os.environ.get("FLODL_SHM_C10D_OVERLAP", "1") != "0"
        # how collectives cross hosts (a group on one host has none: ``self._tier is None``
        # is how the ops ask whether the group spans hosts)
        self._tier = HostTier(
            self._link, size, timeout.total_seconds(), self._named, self._mark_unusable,
            lambda: self._check_nobody_gave_up(self._calling)) \
            if self._topo.multi_host else None

    def _start_worker(self) -> CollectiveWorker:
        if self._worker is None:
            self._worker = CollectiveWorker(f"flodl-shm-c10d-rank{self._rank}",
                                            self._engine_lock)
        return self._worker

    # -- identity ------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # A Python process group registers no C++ backend per device, so torch's own answer
    # to "which devices does this group serve" is none, and torch code that asks it
    # (dcp.async_save, set_model_state_dict(broadcast_from_rank0=True), FSDP's sharded
    # state dicts, _get_pg_default_device) failed, on some ranks only. The group serves
    # CPU tensors, as its own backend.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device) -> "ProcessGroupFlodlShm":
        if torch.device(device).type != "cpu":
            raise RuntimeError(
                f"the flodl_shm group serves CPU tensors only: it has no backend for device "
                f"{device} (use dist.new_group(backend='nccl') for CUDA tensors)")
        return self

    # A Python process group has no C++ backend to hold its name: keep it here
    # (destroy_process_group and new_group read it back).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    @property
    def comm(self):
        """This rank's engine ``Comm`` on the host arena (local ranks only)."""
        return self._live().comm

    @property
    def topology(self):
        """Which group ranks share this rank's host (``rendezvous.Topology``)."""
        return self._topo

    def __repr__(self) -> str:
        return (f"ProcessGroupFlodlShm(rank={self._rank}, size={self._size}, "
                f"hosts={len(self._topo.hosts)})")

    def _global(self, ranks: Sequence[int]) -> list[int] | None:
        """The global ranks of group ranks ``ranks``, or None where they are the same (the
        world, or a group torch no longer maps)."""
        try:
            world = dist.get_process_group_ranks(self)
            glob = [world[r] for r in ranks]
        except Exception:  # noqa: BLE001 - not (or no longer) in torch's group map
            return None
        return None if glob == list(ranks) else glob

    def _named(self, ranks: Sequence[int]) -> str:
        """Group ranks as an error names them: "group rank(s) [1]", and in a subgroup
        whose ranks are not the world's, "group rank(s) [1] (global [2])"."""
        glob = self._global(ranks)
        return f"group rank(s) {list(ranks)}" + ("" if glob is None else f" (global {glob})")

    def _me(self) -> str:
        """This rank as an error names it: "group rank 1 of 3" (", global rank 2" in a
        subgroup whose ranks are not the world's)."""
        glob = self._global([self._rank])
        return (f"group rank {self._rank} of {self._size}"
                + ("" if glob is None else f", global rank {glob[0]}"))

    def _refusal_round(self, name: str, args, kwargs) -> str | None:
        """This rank refused collective ``name`` before any round: one byte round of a
        signature of its own (``collective``). None when every rank refused (the round
        completed); otherwise the text that lists what each rank called, as the other
        ranks raise it too (their collective met this round: a mismatch on every rank)."""
        try:
            self._exchange(0, None, lambda views: None, _REFUSAL_SIGNATURE)
        except FrameError as e:
            return self._mismatch(name, args, kwargs, e)
        except ReduceStall as e:
            return f"and then: {self._stalled(name, e)}; the group is unusable, destroy it"
        except Exception as e:  # noqa: BLE001 - a peer left or died meanwhile: said after
            return f"and then: {e}"  # this rank's own reason, which stays first
        return None

    def _mismatch(self, name: str, args, kwargs, e: FrameError) -> str:
        """The error text of collective ``name``, whose round raised ``e`` on every rank
        (the ranks called different collectives): what each rank called, from one more
        round (``call_mismatch.py``), else the round's own text."""
        try:
            return explain_mismatch(self._exchange, name, describe_call(name, args, kwargs), e)
        except Exception:  # noqa: BLE001 - the collective's own error says enough
            return f"flodl_shm {name}: {e}"

    def _stalled(self, name: str, e: ReduceStall) -> str:
        """Collective ``name`` timed out: the group is unusable from now on (every later
        call raises at once, naming this; the engine's own refusal would number the ranks
        by their place on this host). Returns the cause."""
        self._gave_up()
        self._unusable = self._stall_cause(name, e)
        return self._unusable

    def _stall_cause(self, what: str, e: ReduceStall) -> str:
        """What timed out, naming the group ranks that had not arrived (the engine's
        ``missing`` are places on this host)."""
        local = self._topo.local_ranks
        missing = [local[m] if isinstance(m, int) and 0 <= m < len(local) else m
                   for m in e.missing]
        return (f"{what} ({self._me()}) timed out after "
                f"{self._timeout.total_seconds():g} s: {self._named(missing)} of this host "
                f"had not arrived (alive but not in this collective: stuck or slow outside "
                f"it, e.g. in data loading or a hang, or making another sequence of "
                f"collective calls than this rank)")

    def _gave_up(self) -> None:
        """This rank's wait passed the group's timeout: say so in the host arena, so a
        late peer whose round completes afterwards raises as this rank does."""
        link = self._link
        if link is not None:
            link.comm.arena.mark_gave_up(link.comm.local_rank)

    def _check_nobody_gave_up(self, what: str) -> None:
        """After a collective completed here: if a rank of this host gave up on a round
        (its timeout passed while this rank was late), this rank's result is one the
        others refused; raise as they did, instead of going on alone."""
        link = self._link
        who = None if link is None else link.comm.arena.gave_up()
        if who is None or who == link.comm.local_rank:
            return
        rank = self._topo.local_ranks[who]
        self._unusable = (f"{self._named([rank])} gave up on a collective after the group's "
                          f"{self._timeout.total_seconds():g} s timeout, before this rank "
                          f"({self._me()}) arrived")
        raise RuntimeError(
            f"flodl_shm {what} ({self._me()}): {self._unusable}, so the "
            f"ranks disagree on its outcome (every rank must make the same sequence of "
            f"collective calls, each within the timeout); the group is unusable, destroy it")

    def _live(self) -> HostLink:
        if self._link is None:
            raise RuntimeError("this flodl_shm process group was shut down "
                               "(destroy_process_group); create a new one")
        if self._unusable is not None:
            raise RuntimeError(f"this flodl_shm process group is unusable: {self._unusable}")
        return self._link

    def shutdown(self, failed: bool = False) -> None:
        """Finish queued collectives, then release this rank's shared-memory mappings
        (nothing is left in /dev/shm either way). ``failed``: the program is ending on
        an error, so its peers name this rank as dead, not as one that left early."""
        worker, self._worker = self._worker, None
        if worker is not None and not worker.stop(self._timeout.total_seconds()):
            logger.warning("flodl_shm group rank %d: queued collectives still running after "
                           "%s; its mappings are kept until the process exits", self._rank,
                           self._timeout)
            self._link = None
            return
        link, self._link = self._link, None
        if link is not None:
            # a clean leave only from a usable group: a rank whose collective failed (a
            # timeout, say) exits as a failure, and its peers name the ranks they waited for
            link.close(leaving=self._unusable is None and not failed)

    def abort(self) -> None:
        self.shutdown()

    # -- transports ------------------------------------------------------------------------
    def _exchange(self, nbytes: int, fill: Callable[[np.ndarray], None] | None,
                  consume: Callable[[list[np.ndarray]], None], signature: int) -> None:
        """A byte round over the whole group: ``consume`` gets every group rank's bytes
        (uint8 views, group-rank order, valid during the call)."""
        link = self._live()
        if self._tier is None:
            exchange_bytes(link.comm, nbytes, fill, consume, signature)
        else:
            self._tier.exchange(nbytes, fill, consume, signature)

    def _mark_unusable(self, reason: str) -> None:
        """From now on every call raises at once, naming ``reason`` (``_unusable``)."""
        self._unusable = reason

    def _exchange_tensors(self, tensors: Sequence[torch.Tensor] | None, offs: Sequence[int],
                          total: int, consume: Callable[[list[np.ndarray]], None],
                          signature: int) -> None:
        fill = None if tensors is None else (lambda dst: write_tensors(dst, tensors, offs))
        self._exchange(total, fill, consume, signature)

    def _sum_f32(self, tensors: list[torch.Tensor], avg: bool) -> None:
        """SUM/AVG of float32/bfloat16 tensors through the engine's reduce rounds."""
        link = self._live()
        topo = self._topo
        if self._tier is None:
            if avg:
                link.comm.all_reduce_(tensors, kind=RoundKind.MODEL)
            else:
                link.comm.all_reduce_(tensors, kind=RoundKind.CONTROL)
            return
        offs, total = packed_offsets(tensors)
        signature = round_signature("sum_f32", avg, tensors)

        one = len(tensors) == 1 and tensors[0].dtype == _F32 and tensors[0].is_contiguous()

        def combine() -> Callable[[np.ndarray], None]:
            # the leader's tensors hold the host sum: reduce them across hosts in place
            # (one float32 tensor: no copy at all), then the fan-out reads them
            flat = (tensors[0].detach().view(-1) if one else
                    torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors]))
            link.leaders.allreduce([flat], dist.AllreduceOptions()).wait()
            if avg:
                average_(flat, self._size, torch.float32)
            if not one:
                with torch.no_grad():
                    for t, p in zip(tensors, flat.split([t.numel() for t in tensors])):
                        t.copy_(p.view(t.shape))
            return lambda dst: write_tensors(dst, tensors, offs)

        def take(blob: np.ndarray) -> None:
            if topo.is_leader:
                return  # combine() left the result in this rank's tensors
            for t, o in zip(tensors, offs):
                copy_into(t, tensor_at(blob, o, t))

        self._tier.run(lambda: link.comm.all_reduce_(tensors, kind=RoundKind.CONTROL),
                       signature, combine, total, take)

    def _reduce_generic(self, tensors: list[torch.Tensor], op) -> None:
        offs, total = packed_offsets(tensors)

        def consume(views: list[np.ndarray]) -> None:
            for t, o in zip(tensors, offs):
                reduce_in_order([tensor_at(v, o, t) for v in views], op, t)

        self._exchange_tensors(tensors, offs, total, consume,
                               round_signature("allreduce", op_label(op), tensors))

    def _allreduce_list(self, tensors: list[torch.Tensor], op, what: str) -> None:
        for t in tensors:
            check_dtype(t, what)
            check_op(op, t.dtype, what)
        tensors, refuse = writable(tensors, what)
        self._allreduce_writable(tensors, op)
        refuse()

    def _allreduce_writable(self, tensors: list[torch.Tensor], op) -> None:
        name = op_name(op_type(op))
        # the transport follows from what every rank shares (op, dtypes), never from a
        # rank's own memory layout: ranks on different transports could not meet
        fast = [t for t in tensors if t.dtype in (torch.float32, torch.bfloat16)]
        if name in ("SUM", "AVG") and len(fast) == len(tensors) and tensors and (
                self._tier is None or all(t.dtype is torch.float32 for t in tensors)):
            self._sum_f32(tensors, name == "AVG")
        elif tensors:
            self._reduce_generic(tensors, op)

    def _hot_link(self, t: torch.Tensor, out: torch.Tensor | None = None) -> HostLink | None:
        """The link, when a call is the ops' hot case (DDP buckets, model averaging, a
        loop's small broadcasts, FSDP's gathers and reduce-scatters): ``t`` (and
        ``out``, when given) a contiguous float32 CPU tensor, the group usable, on one
        host; the op then hands them straight to the engine, in the round its general
        path would run. Else None (a sparse, mkldnn or nested tensor goes on to the
        checks that name it on every rank alike)."""
        link = self._link
        if (link is None or self._tier is not None or self._unusable is not None
                or not _plain_f32(t) or out is not None and not _plain_f32(out)):
            return None
        return link

    # -- collectives ------------------------------------------------------------------------
    @collective
    def allreduce(self, tensors, opts=None) -> dist.Work:
        link = self._hot_link(tensors[0]) if len(tensors) == 1 else None
        if link is not None:
            op = _SUM if opts is None else opts.reduceOp
            if op == _SUM:
                link.comm.all_reduce_(tensors, kind=_CONTROL)
                return done_work(tensors)
            if op == _AVG:
                link.comm.all_reduce_(tensors, kind=_MODEL)
                return done_work(tensors)
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        if is_sparse_call(tensors):  # (DDP's gradients of nn.Embedding(sparse=True))
            sparse_all_reduce(self._exchange, list(tensors), op, self._size)
        else:
            self._allreduce_list(list(tensors), op, "allreduce")
        return done_work(list(tensors))

    @collective
    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        self._allreduce_list(list(tensors), op, "allreduce_coalesced")
        return done_work(list(tensors))

    @collective
    def reduce(self, tensors, opts) -> dist.Work:
        root = int(opts.rootRank)
        work = real_views([t if self._rank == root else t.clone() for t in tensors],
                          opts.reduceOp, "reduce")
        self._allreduce_list(work, opts.reduceOp, "reduce")
        return done_work(list(tensors))

    @collective
    def broadcast(self, tensors, opts) -> dist.Work:
        link = self._hot_link(tensors[0]) if len(tensors) == 1 else None
        if link is not None:  # (the engine's in-place broadcast, as ``_broadcast``'s)
            link.comm.broadcast_(tensors, int(opts.rootRank))
            return done_work(tensors)
        given = list(tensors)
        # complex tensors as their float views (the same bytes): torch's dist.broadcast
        # passes those, but DDP's start-up broadcast (_broadcast_coalesced) does not
        tensors = checked_inputs([float_view(t) for t in given], "broadcast")
        root = int(opts.rootRank)
        work, refuse = ((tensors, nothing_to_refuse) if self._rank == root  # read only
                        else writable(tensors, "broadcast"))
        self._broadcast(work, root)
        refuse()
        return done_work(given)

    def _broadcast(self, tensors: list[torch.Tensor], root: int) -> None:
        link = self._link
        if (link is not None and tensors and self._tier is None
                and self._unusable is None and all(t.dtype is _F32 for t in tensors)):
            # the engine's in-place broadcast: one compiled call when small, the root's
            # tensors read straight into the others' when large (engine/comm_broadcasts.py);
            # float32 only: its bfloat16 path widens and rounds, which canonicalizes NaN
            # payloads
            link.comm.broadcast_(tensors, root)
            return
        offs, total = packed_offsets(tensors)

        def consume(views: list[np.ndarray]) -> None:
            if self._rank != root:
                for t, o in zip(tensors, offs):
                    copy_into(t, tensor_at(views[root], o, t))

        self._exchange_tensors(tensors if self._rank == root else None, offs, total, consume,
                               round_signature("broadcast", root, tensors))

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        return self.allgather_coalesced(output_tensors, input_tensors, opts)

    @collective
    def allgather_coalesced(self, output_lists, input_tensors, opts=None) -> dist.Work:
        """``output_lists[i][r]`` receives rank r's ``input_tensors[i]``."""
        inputs = checked_inputs(input_tensors, "allgather")
        problem = self._per_rank_lists("allgather", "output", output_lists, [
            (o, t) for outs, t in zip(output_lists, inputs) for o in outs])
        self._allgather(output_lists, inputs, problem)
        return done_work([t for outs in output_lists for t in outs])

    def _refuse_root_list(self, views: list[np.ndarray], root: int, what: str, fit: str,
                          t: torch.Tensor) -> None:
        """Raise, on every rank, when the root's status word (``put_status``) says its
        ``<what>_list`` did not fit ``fit`` (one tensor like ``t`` per rank)."""
        if int(views[root][:8].view(np.int64)[0]):
            raise RuntimeError(f"flodl_shm {what}: the root, rank {root}, passed a {what}_list "
                               f"that does not fit {fit} ({self._size} tensors of "
                               f"{t.numel()} {t.dtype} elements)")

    def _per_rank_lists(self, what: str, noun: str, lists, pairs) -> str | None:
        """The first argument error of a collective over per-rank ``lists`` of tensors: a
        list that is not one ``noun`` tensor per rank, or an (output, input) of ``pairs``
        that cannot take the other (``misfit``); None when they fit."""
        short = next((lst for lst in lists if len(lst) != self._size), None)
        if short is not None:
            return (f"flodl_shm {what}: {len(short)} {noun} tensors for a group of "
                    f"{self._size}; pass one per rank")
        return next((p for p in (misfit(o, i, what) for o, i in pairs) if p), None)

    def _allgather(self, output_lists, inputs, problem: str | None) -> None:
        """The byte round of an all-gather; ``problem``: the caller's argument error, raised
        by every rank that has one once the round completed (the group stays usable)."""
        offs, total = packed_offsets(inputs)

        def consume(views: list[np.ndarray]) -> None:
            raise_problem(problem)
            for outs, t, o in zip(output_lists, inputs, offs):
                for r, out in enumerate(outs):
                    copy_into(out, tensor_at(views[r], o, t))

        self._exchange_tensors(inputs, offs, total, consume, round_signature("allgather", inputs))

    def all_gather_single(self, output, input, opts=None) -> dist.Work:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    @collective
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        link = self._hot_link(inputs[0], outputs[0]) if len(inputs) == len(outputs) == 1 \
            else None
        if link is not None and inputs[0].numel() \
                and outputs[0].numel() == self._size * inputs[0].numel():
            # (``_allgather_words``' float32 round, as the general path runs it)
            t = inputs[0]
            self._allgather_words(link.comm, outputs[0], t if t.dim() == 1 else t.view(-1),
                                  4 * t.numel())
            return done_work(list(outputs))
        what = "all_gather_into_tensor"
        for t in (*outputs, *inputs):  # (a layout before any reshape)
            check_layout(t, what)
        inputs = checked_inputs([i.reshape(-1) for i in inputs], what)
        problem = next((self._gather_misfit(o, i) for o, i in zip(outputs, inputs)
                        if o.dtype != i.dtype or o.numel() != self._size * i.numel()), None)
        if len(inputs) == 1 and self._tier is None:
            # one tensor on one host (FSDP's parameter all-gather): decided by what every
            # rank shares, a rank's misfit output included (it gathers into scratch, then
            # raises), so the ranks run the same rounds
            out = outputs[0]
            dense = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
            self._allgather_one(dense, inputs[0], problem)
            if dense is not out:
                with torch.no_grad():
                    out.copy_(dense)
            return done_work(list(outputs))
        dense, copy_back = dense_outputs(outputs)
        lists = ([[i] * self._size for i in inputs] if problem else  # not written
                 [list(o.view(-1).chunk(self._size)) if o.numel() else [o] * self._size
                  for o in dense])
        self._allgather(lists, inputs, problem)
        copy_back()
        return done_work(list(outputs))

    def _gather_misfit(self, out: torch.Tensor, t: torch.Tensor) -> str:
        return (f"flodl_shm all_gather_into_tensor: an output of {out.numel()} {out.dtype} "
                f"elements for a group of {self._size} inputs of {t.numel()} {t.dtype}; "
                f"pass an output of {self._size * t.numel()} {t.dtype} elements")

    def _allgather_one(self, out: torch.Tensor, t: torch.Tensor, problem: str | None) -> None:
        """``_allgather`` of one input ``t`` into the contiguous ``out`` (rank r's bytes
        at ``r * nbytes(t)``): the engine's all-gather of the parts read as float32 (bit
        for bit; one compiled call a rank a round of at most the eager slot), where the
        byte round copied every part twice through shared memory at 1.5-2x the time
        (world 2 and 4 on 2 cores, 4 KiB-4 MiB); a part that is no whole
        number of 4-byte words (or none) takes the general path's byte round (the same
        schema), its bytes copied into the output by numpy. ``problem``: this rank's
        output does not fit (``out`` is not written), raised once the rounds are done."""
        n = nbytes_of(t)
        if problem is not None:
            out = torch.empty(self._size * n, dtype=torch.uint8)
        if n and n % 4 == 0:  # (the same on every rank)
            self._allgather_words(self._live().comm, out, t, n)
            raise_problem(problem)
            return
        dst = tensor_array(out.view(-1), np.uint8) if n else None

        def consume(views: list[np.ndarray]) -> None:
            raise_problem(problem)
            if n:
                for r, v in enumerate(views):
                    dst[r * n:(r + 1) * n] = v[:n]

        self._exchange_tensors([t], [0], aligned(n), consume, round_signature("allgather", [t]))

    def _allgather_words(self, comm, out: torch.Tensor, t: torch.Tensor, n: int) -> None:
        """``_allgather_one`` of ``n`` bytes a rank, a whole number of 4-byte words: the
        engine's all-gather of them read as float32 (``Comm.all_gather_into_tensor``),
        shaped ``(1,) * code + (n // 4,)`` by the dtype's code (``_DTYPE_CODES``). An
        input or output not at a 4-byte address goes through an aligned copy, and an
        input that overlaps the output other than as this rank's part (which the engine
        refuses: it writes the output while peers read the input) through a copy too,
        as gloo copies every input before it writes."""
        if t.dtype is _F32 and out.dtype is _F32 and t.is_contiguous():  # (FSDP's float32)
            comm.all_gather_into_tensor(out, t if apart_or_own(
                t, out, n, self._rank) else t.clone())
            return
        flat = out.view(-1).view(torch.uint8)
        staged = flat.data_ptr() % 4 != 0  # (a view at an odd offset: float32 needs 4)
        dst = torch.empty(flat.numel(), dtype=torch.uint8) if staged else flat
        mine = t.detach()
        if mine.dim() and mine.stride(-1) != 1 or not mine.is_contiguous():
            # (one element at stride 2 is contiguous, yet no byte view takes it)
            mine = mine.clone(memory_format=torch.contiguous_format)
        mine = mine.view(-1).view(torch.uint8)
        if mine.data_ptr() % 4 or not apart_or_own(mine, dst, n, self._rank):
            mine = mine.clone()
        shape = (1,) * _DTYPE_CODES.get(t.dtype, len(_DTYPE_CODES)) + (n // 4,)
        comm.all_gather_into_tensor(dst.view(torch.float32), mine.view(torch.float32).view(shape))
        if staged:
            with torch.no_grad():
                flat.copy_(dst)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    @collective
    def reduce_scatter(self, output_tensors, input_lists, opts) -> dist.Work:
        """``output_tensors[i]`` = reduce over ranks of their ``input_lists[i][rank]``."""
        outs = real_views(output_tensors, opts.reduceOp, "reduce_scatter")
        input_lists = [real_views(lst, opts.reduceOp, "reduce_scatter") for lst in input_lists]
        flat_in = [t for lst in input_lists for t in lst]
        for t in flat_in + outs:
            check_dtype(t, "reduce_scatter")
            check_op(opts.reduceOp, t.dtype, "reduce_scatter")
        offs, total = packed_offsets(flat_in)
        me = self._rank
        problem = self._per_rank_lists("reduce_scatter", "input", input_lists, [
            (out, t) for out, lst in zip(outs, input_lists) for t in lst])

        def consume(views: list[np.ndarray]) -> None:
            raise_problem(problem)
            for i, out in enumerate(outs):
                k = i * self._size + me
                t, o = flat_in[k], offs[k]
                reduce_in_order([tensor_at(v, o, t) for v in views], opts.reduceOp, out)

        self._exchange_tensors(flat_in, offs, total, consume, round_signature(
            "reduce_scatter", op_label(opts.reduceOp), flat_in))
        return done_work(outs)

    def reduce_scatter_single(self, output, input, opts) -> dist.Work:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    @collective  # whole: queued, its output copy must follow the round (see collective)
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts) -> dist.Work:
        link = self._hot_link(inputs[0], outputs[0]) if len(inputs) == len(outputs) == 1 \
            else None
        if link is not None and outputs[0].numel() * self._size == inputs[0].numel():
            op = opts.reduceOp  # (a PREMUL_SUM is neither: the general path takes it)
            if op == _SUM or op == _AVG:
                # (``_reduce_scatter_summed``'s float32 round, as the general path runs it)
                t = inputs[0]
                link.comm.reduce_scatter_tensor(outputs[0], t if t.dim() == 1 else t.view(-1),
                                                _CONTROL if op == _SUM else _MODEL)
                return done_work(list(outputs))
        what = "reduce_scatter_tensor"
        for t in (*outputs, *inputs):  # (a layout before any reshape)
            check_layout(t, what)
        given, outputs = outputs, real_views(outputs, opts.reduceOp, what)
        inputs = real_views(inputs, opts.reduceOp, what)
        for i in inputs:
            if i.numel() % self._size:
                raise RuntimeError(f"flodl_shm reduce_scatter_tensor: input of {i.numel()} "
                                   f"elements does not split into {self._size} equal parts")
        kind = op_type(opts.reduceOp)  # (compared as it is: its name costs 1.2 µs more)
        if (len(inputs) == 1 and (kind == _SUM or kind == _AVG) and self._tier is None
                and inputs[0].dtype in (torch.float32, torch.bfloat16)):
            # what every rank shares decides (op, dtype, one host), never a rank's layout:
            # the engine's reduce-scatter or all-reduce of the input
            self._reduce_scatter_summed(outputs[0], inputs[0], kind == _AVG)
            return done_work(list(given))
        lists = [list(i.reshape(-1).chunk(self._size)) for i in inputs]
        dense, copy_back = dense_outputs(outputs)
        self.reduce_scatter([o.view(-1) for o in dense], lists, opts)
        copy_back()
        return done_work(list(given))

    def _reduce_scatter_summed(self, out: torch.Tensor, t: torch.Tensor, avg: bool) -> None:
        """A float32/bfloat16 SUM (or AVG) reduce-scatter on one host, summed as
        ``allreduce`` sums (in float32, in rank order), where the byte round's reduce in
        torch ops cost 120 µs at 4 KiB. float32 goes through the engine's reduce-scatter
        (``Comm.reduce_scatter_tensor``: each rank sums only its part, in rounds of at
        most the eager slot); bfloat16 through the engine's all-reduce of ``t``, this
        rank's part copied into ``out`` (rounded once, through a contiguous stand-in, as
        the list form writes: torch's strided bfloat16 copy gives a NaN other bits). The
        bfloat16 input travels shaped by its dtype's code (``_DTYPE_CODES``; float32's
        round is its own kind): a rank that passes bfloat16 among float32 ones
        mismatches, where the engine would widen it and sum silently."""
        check_dtype(out, "reduce_scatter_tensor")
        flat = t.detach().reshape(-1)
        problem = (misfit(out, flat[:flat.numel() // self._size], "reduce_scatter_tensor")
                   if out.dtype != t.dtype or out.numel() * self._size != t.numel() else None)
        if t.dtype is _F32:  # each rank sums only its part
            part = out if problem is None and out.is_contiguous() else torch.empty(
                t.numel() // self._size)
            self._live().comm.reduce_scatter_tensor(part, flat.contiguous(),
                                                    _MODEL if avg else _CONTROL)
            raise_problem(problem)  # (after the round: the group stays in step)
            if part is not out:
                with torch.no_grad():
                    out.copy_(part.view(out.shape))
            return
        shape = (1,) * _DTYPE_CODES[t.dtype] + (t.numel(),)
        (summed,), _ = self._live().comm.all_reduce_scaled(
            [flat.view(shape)], 1.0, _MODEL if avg else _CONTROL)
        raise_problem(problem)  # (after the round: the group stays in step)
        m = out.numel()
        dense = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        with torch.no_grad():
            dense.view(-1).copy_(summed.view(-1)[self._rank * m:(self._rank + 1) * m])
            if dense is not out:
                out.copy_(dense)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts) -> dist.Work:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    @collective
    def gather(self, output_lists, input_tensors, opts) -> dist.Work:
        root = int(opts.rootRank)
        # complex tensors travel as their float views, as torch hands them to the other
        # byte copies (scatter, all_gather, broadcast) but not to gather
        inputs = checked_inputs([float_view(t) for t in input_tensors], "gather")
        offs, total = packed_offsets(inputs)
        problem = None
        if self._rank == root:
            outs = [float_view(o) for o in (output_lists[0] if output_lists else [])]
            problem = self._per_rank_lists("gather", "gather_list", [outs],
                                           [(o, inputs[0]) for o in outs])
        head = ALIGN  # every rank's bytes start with a status word (put_status)

        def fill(dst: np.ndarray) -> None:
            put_status(dst, problem)
            write_tensors(dst[head:], inputs, offs)

        def consume(views: list[np.ndarray]) -> None:
            raise_problem(problem)
            self._refuse_root_list(views, root, "gather", "the inputs", inputs[0])
            if self._rank == root:
                for r, out in enumerate(outs):
                    copy_into(out, tensor_at(views[r], head + offs[0], inputs[0]))

        self._exchange(head + total, fill, consume, round_signature("gather", root, inputs))
        return done_work([t for lst in output_lists for t in lst] or inputs)

    @collective
    def scatter(self, output_tensors, input_lists, opts) -> dist.Work:
        root = int(opts.rootRank)
        outs = checked_inputs(output_tensors, "scatter")
        chunks = [outs[0]] * self._size  # every rank knows the chunk shape: its output's
        offs, total = packed_offsets(chunks)
        me = self._rank
        problem = None
        if me == root:
            mine = list(input_lists[0]) if input_lists else []
            problem = self._per_rank_lists("scatter", "scatter_list", [mine],
                                           [(outs[0], t) for t in mine])
        head = ALIGN  # the root's bytes start with a status word (put_status)

        def fill(dst: np.ndarray) -> None:
            put_status(dst, problem)
            if problem is None:
                write_tensors(dst[head:], mine, offs)

        def consume(views: list[np.ndarray]) -> None:
            raise_problem(problem)
            self._refuse_root_list(views, root, "scatter", "the outputs", outs[0])
            copy_into(outs[0], tensor_at(views[root], head + offs[me], outs[0]))

        self._exchange(head + total, fill if me == root else None, consume,
                       round_signature("scatter", root, outs))
        return done_work(outs)

    @collective
    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        """Rank s's ``input_tensors[r]`` lands in rank r's ``output_tensors[s]``."""
        outs, ins = list(output_tensors), list(input_tensors)
        for t in outs + ins:
            check_dtype(t, "alltoall")
        n, me = self._size, self._rank
        if len(ins) != n or len(outs) != n:
            problem = (f"flodl_shm alltoall: {len(ins)} input and {len(outs)} output tensors "
                       f"for a group of {n}; pass one of each per rank")
            ins, outs = (ins + [ins[0] if ins else torch.empty(0)] * n)[:n], outs[:n]
        else:
            problem = None
        # phase 1: every rank's exact chunk sizes, sent and expected, so that every rank
        # checks every pair and knows where its chunks sit
        sizes = np.asarray([nbytes_of(t) for t in ins] + [nbytes_of(t) for t in outs]
                           + [0] * (n - len(outs)) + [int(problem is not None)], np.int64)
        sent = np.zeros((n, n), np.int64)
        expected = np.zeros((n, n), np.int64)
        bad = []

        def read_sizes(views: list[np.ndarray]) -> None:
            for s, v in enumerate(views):
                row = v.view(np.int64)
                sent[s], expected[s] = row[:n], row[n:2 * n]
                if row[2 * n]:
                    bad.append(s)

        self._exchange(sizes.nbytes, lambda dst: np.copyto(dst, sizes.view(np.uint8)),
                       read_sizes, round_signature("alltoall sizes"))
        raise_problem(problem)
        if bad:
            raise RuntimeError(f"flodl_shm alltoall: rank(s) {bad} passed input/output lists "
                               f"not of one tensor per rank")
        wrong = [(s, r) for s in range(n) for r in range(n) if sent[s, r] != expected[r, s]]
        if wrong:  # every rank sees the same tables: every rank raises, in step
            s, r = wrong[0]
            raise RuntimeError(f"flodl_shm alltoall: rank {s} sends {sent[s, r]} bytes to rank "
                               f"{r}, whose output {s} holds {expected[r, s]}"
                               + (f" ({len(wrong) - 1} more pairs differ)" if len(wrong) > 1
                                  else "") + "; the split sizes must agree")
        table = (sent + ALIGN - 1) // ALIGN * ALIGN
        total = int(table.sum(axis=1).max()) if n else 0
        offs = [int(x) for x in np.concatenate([[0], np.cumsum(table[me])[:-1]])]

        def consume(views: list[np.ndarray]) -> None:
            for s, out in enumerate(outs):
                copy_into(out, tensor_at(views[s], int(table[s, :me].sum()), out))

        self._exchange_tensors(ins, offs, total, consume,
                               round_signature("alltoall", [str(t.dtype) for t in ins + outs]))
        return done_work(outs)

    @collective  # whole, as reduce_scatter_tensor_coalesced
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None) -> dist.Work:
        def split(t: torch.Tensor, sizes) -> list[torch.Tensor]:
            if not sizes:
                if t.shape[0] % self._size:
                    raise RuntimeError(f"flodl_shm all_to_all_single: dim 0 of size "
                                       f"{t.shape[0]} does not split into {self._size} parts; "
                                       f"pass split sizes")
                return list(t.chunk(self._size)) if t.shape[0] else [t] * self._size
            return list(t.split(list(sizes)))

        for t in (output, input):  # (a layout before any split)
            check_layout(t, "all_to_all_single")
        self.alltoall(split(output, output_split_sizes), split(input, input_split_sizes), opts)
        return done_work([output])

    alltoall_base = all_to_all_single

    @collective
    def barrier(self, opts=None) -> dist.Work:
        link = self._live()
        if self._tier is None:
            link.comm.barrier()
        else:
            self._tier.run(link.comm.barrier, round_signature("barrier"),
                           lambda: lambda dst: None, 0, lambda blob: None)
        return BARRIER_DONE

    # -- not offered ----------------------------------------------------------------------
    def _unsupported(self, what: str):
        raise RuntimeError(
            f"flodl_shm: {what} is not supported (point-to-point needs a matching partner "
            f"round the host protocol does not have); supported: allreduce, "
            f"allreduce_coalesced, reduce, broadcast, allgather, all_gather_into_tensor, "
            f"reduce_scatter, reduce_scatter_tensor, gather, scatter, alltoall, "
            f"all_to_all_single, barrier. Use a gloo group for send/recv: "
            f"dist.new_group(backend='gloo')")

    def send(self, tensors, dst, tag=0):
        self._unsupported("send")

    def recv(self, tensors, src, tag=0):
        self._unsupported("recv")

    def recv_anysource(self, tensors, tag=0):
        self._unsupported("recv_anysource")


leave_to_eager(ProcessGroupFlodlShm.allreduce, uncompiled)  # (every collective's entry)


def _plain_f32(t: torch.Tensor) -> bool:
    """Whether ``t`` is a contiguous float32 CPU tensor (not sparse, mkldnn or nested)."""
    return (t.dtype is _F32 and t.layout is _STRIDED and not t.is_nested and t.is_cpu
            and t.is_contiguous())

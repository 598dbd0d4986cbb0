"""Rank programs for the c10d backend tests, run as real processes.

``run_group`` (the test side) forks the ranks; each joins a ``tcp://127.0.0.1:PORT``
group (``run_rank``) and writes its scenario's result (a dict, with ``torch.save``).
The deadline bounds them: every rank that outlives it is killed.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from typing import Callable
from pathlib import Path

import torch

from forked import drop_inherited_sockets, leave, wait_children

#: rank r's values in the half-precision AVG check (three ranks)
HALF_AVG_VALUES = [[-2368.0, 1576.0, 62.0], [0.0032196044921875, -0.00057220458984375, -1856.0],
                   [-47360.0, 5888.0, 0.00014972686767578125]]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
#: whether this torch lets a Python backend read a PREMUL_SUM's factor (2.13 does, 2.11
#: does not: the backend refuses the op there, on every rank, the group usable after)
PREMUL_READABLE = hasattr(torch.distributed.ReduceOp, "factor")


def premul_or_refusal(t: torch.Tensor, call: Callable[[], object]) -> torch.Tensor | str:
    """``t`` after ``call`` (a PREMUL_SUM collective into it), or the refusal's message
    where this torch gives the backend no factor (``PREMUL_READABLE``)."""
    try:
        call()
    except RuntimeError as e:
        if PREMUL_READABLE:
            raise
        return str(e)
    return t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_input(rank: int, dtype: torch.dtype, n: int = 37, salt: int = 0) -> torch.Tensor:
    """A deterministic, rank-dependent tensor of ``dtype`` (small values: no overflow)."""
    g = torch.Generator().manual_seed(1000 * rank + salt + 7)
    if dtype is torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    lo = 0 if dtype is torch.uint8 else -3
    return torch.randint(lo, 4, (n,), generator=g).to(dtype)


def run_group(scenario: str, world: int, tmp: Path, *, backend: str = "flodl_shm",
              hosts: list[str] | None = None, timeout: float = 90.0,
              extra_env: dict | None = None, rank_env: list[dict] | None = None
              ) -> list[dict | None]:
    """Run ``scenario`` on ``world`` rank processes; results by rank (None: no result).

    The ranks are forked from the test process (``forked.py``: torch and the kernels
    already loaded), each with its own environment and its output in a log.
    ``hosts[r]`` sets rank r's FLODL_SHM_HOST, ``rank_env[r]`` more of rank r's variables
    (over ``extra_env``). Ranks still running at the deadline are killed (then a
    TimeoutError names them)."""
    port = free_port()
    pids = []
    for r in range(world):
        env = {"OMP_NUM_THREADS": "1", "FLODL_SHM_HOST": None if hosts is None else hosts[r],
               **(extra_env or {}), **(rank_env[r] if rank_env else {})}
        out = tmp / f"{scenario}_{backend}_{r}.pt"
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the test
            _forked_rank(scenario, r, world, port, str(out), backend, env)
        pids.append(pid)
    codes, stuck = wait_children(pids, time.monotonic() + timeout)
    logs = [_log(tmp / f"{scenario}_{backend}_{r}.pt.log") for r in range(world)]
    if stuck:
        raise TimeoutError(f"ranks {[pids.index(p) for p in stuck]} of {scenario} did not "
                           f"finish in {timeout} s:\n" + "\n".join(logs))
    results = []
    for r in range(world):
        f = tmp / f"{scenario}_{backend}_{r}.pt"
        results.append(torch.load(f, weights_only=False) if f.exists() else None)
        if results[-1] is not None:
            results[-1]["log"] = logs[r]
            results[-1]["returncode"] = codes[pids[r]]
            results[-1]["all_pids"] = pids
    if all(x is None for x in results):
        raise RuntimeError(f"no rank of {scenario} wrote a result:\n" + "\n".join(logs))
    return results


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _forked_rank(scenario: str, rank: int, world: int, port: int, out: str, backend: str,
                 env: dict) -> None:
    """A forked rank: its environment (None removes a variable) and its log, then
    ``run_rank``; leaves with 0, or 1 after printing what it raised."""
    code = 1
    try:
        drop_inherited_sockets()
        log = os.open(out + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # a fresh process's streams and logging, not pytest's captures of the parent's
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        logging.root.handlers.clear()
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        run_rank(scenario, rank, world, port, out, backend)
        code = 0
    except BaseException:  # noqa: BLE001 - printed to the rank's log
        traceback.print_exc()
    finally:
        leave(code)


# --- scenarios (run inside the rank processes) ---------------------------------------


def _errors_of(calls: dict, then=None) -> dict:
    """Each call's RuntimeError message (None when it did not raise); with ``then``,
    also ``what + " then"``: what ``then()`` returns after it (a collective that shows
    the group still works)."""
    errors = {}
    for what, call in calls.items():
        try:
            call()
            errors[what] = None
        except RuntimeError as e:
            errors[what] = str(e)
        if then is not None:
            errors[what + " then"] = then()
    return errors


def sc_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    res: dict = {"pid": os.getpid()}
    ops = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT,
           "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG}
    for dt in DTYPES:
        for name, op in ops.items():
            if name == "AVG" and dt is torch.bool:
                continue
            t = rank_input(rank, dt)
            dist.all_reduce(t, op=op)
            res[("all_reduce", str(dt), name)] = t
    big = rank_input(rank, torch.float32, n=(3 << 20) // 4 + 5, salt=1)  # bulk path
    dist.all_reduce(big)
    res["all_reduce_big"] = big
    bigavg = rank_input(rank, torch.float32, n=(3 << 20) // 4 + 5, salt=1)
    dist.all_reduce(bigavg, op=dist.ReduceOp.AVG)
    res["all_reduce_big_avg"] = bigavg
    bigb = rank_input(rank, torch.float32, n=(3 << 20) // 4 + 5, salt=2)
    dist.broadcast(bigb, src=0)  # the bulk path of an in-place broadcast
    res["broadcast_big"] = bigb
    prem = rank_input(rank, torch.float64)
    res["premul"] = premul_or_refusal(
        prem, lambda: dist.all_reduce(prem, op=dist._make_nccl_premul_sum(0.5)))
    for dt in (torch.float64, torch.int32, torch.bool, torch.bfloat16, torch.float32):
        t = rank_input(rank, dt) if rank == 1 % world else torch.zeros(37, dtype=dt)
        dist.broadcast(t, src=1 % world)
        res[("broadcast", str(dt))] = t
        outs = [torch.empty(37, dtype=dt) for _ in range(world)]
        dist.all_gather(outs, rank_input(rank, dt))
        res[("all_gather", str(dt))] = outs
    # (the *_single calls: torch 2.13's names, which the old ones warn to use; torch 2.11
    # has only the old)
    for gather, scatter in (("all_gather_into_tensor", "reduce_scatter_tensor"),
                            ("all_gather_single", "reduce_scatter_single")
                            )[:None if hasattr(dist, "all_gather_single") else 1]:
        res[gather] = torch.empty(world * 5, dtype=torch.int16)
        getattr(dist, gather)(res[gather], torch.full((5,), rank, dtype=torch.int16))
        res[scatter] = torch.empty(4, dtype=torch.float64)
        getattr(dist, scatter)(res[scatter], rank_input(rank, torch.float64, n=4 * world))
    o = torch.empty(4, dtype=torch.int64)
    dist.reduce_scatter(o, list(rank_input(rank, torch.int64, n=4 * world).chunk(world)),
                        op=dist.ReduceOp.MAX)
    res["reduce_scatter_max"] = o
    ts = [rank_input(rank, torch.float32, n=5, salt=3), rank_input(rank, torch.float32, n=9,
                                                                    salt=4)]
    dist.all_reduce_coalesced(ts)
    res["all_reduce_coalesced"] = ts
    g = [torch.empty(3, dtype=torch.int32) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((3,), rank + 10, dtype=torch.int32), g, dst=0)
    res["gather"] = g
    # complex: torch hands gather its tensors as they are (scatter and all_gather their
    # float views); it was refused, naming complex64 as unsupported
    g = [torch.empty(2, dtype=torch.complex64) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([rank + 0.5j, -rank * 1j], dtype=torch.complex64), g, dst=0)
    res["gather_complex"] = g
    o = torch.empty(3, dtype=torch.float16)
    sl = [torch.full((3,), 100 + r, dtype=torch.float16) for r in range(world)]
    dist.scatter(o, sl if rank == world - 1 else None, src=world - 1)
    res["scatter"] = o
    outs = [torch.empty(r + 1, dtype=torch.int64) for r in range(world)]  # uneven chunks
    ins = [torch.full((rank + 1,), 10 * rank + r, dtype=torch.int64) for r in range(world)]
    dist.all_to_all(outs, ins)
    res["all_to_all"] = outs
    o = torch.empty(2 * world)
    dist.all_to_all_single(o, torch.arange(2 * world, dtype=torch.float32) + 100 * rank)
    res["all_to_all_single"] = o
    r = torch.full((4,), float(rank))
    dist.reduce(r, dst=0)
    res["reduce"] = r
    w = dist.all_reduce(torch.ones(3), async_op=True)
    res["async"] = (w.wait(), w.is_completed(), w.get_future().value()[0].clone())
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    res["all_gather_object"] = objs
    dist.barrier()
    w = dist.barrier(async_op=True)  # (its result holds no tensor, as gloo's)
    res["barrier"] = (w.wait(), w.get_future().value())
    errors = _errors_of({
        "band": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                        op=dist.ReduceOp.BAND),
        "avg_bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool),
                                            op=dist.ReduceOp.AVG),
        "premul_int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                              op=dist._make_nccl_premul_sum(0.5)),
        "uint16": lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)),
        "send": lambda: dist.send(torch.ones(1), dst=(rank + 1) % world),
        "mismatch": lambda: dist.all_reduce(torch.ones(3 + rank)),  # every rank raises
        "mismatch_bytes": lambda: dist.all_reduce(torch.ones(3 + rank, dtype=torch.int64)),
        "mismatch_dtype": lambda: dist.all_reduce(  # rank 0's reduce round meets byte rounds
            torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64)),
        "mismatch_op": lambda: dist.all_reduce(
            torch.ones(3), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX),
        # (each rank applies its factor to every contribution: the ranks would differ)
        "mismatch_factor": lambda: dist.all_reduce(
            torch.ones(3), op=dist._make_nccl_premul_sum(float(rank + 1))),
        "mismatch_factor_rs": lambda: dist.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * world), op=dist._make_nccl_premul_sum(0.5 + rank)),
    })
    res["errors"] = errors

    def layout(name: str) -> torch.Tensor:
        import warnings

        with warnings.catch_warnings():  # (torch's beta/prototype notes)
            warnings.simplefilter("ignore")
            return {"csr": lambda: torch.ones(4, 4).to_sparse_csr(),
                    "mkldnn": lambda: torch.ones(16).to_mkldnn(),
                    "nested": lambda: torch.nested.nested_tensor([torch.ones(2)] * 2),
                    "jagged": lambda: torch.nested.nested_tensor(
                        [torch.ones(2), torch.ones(3)], layout=torch.jagged)}[name]()

    def summed() -> list[float]:
        t = torch.ones(4)
        dist.all_reduce(t)
        return t.tolist()

    # every rank refuses them alike, before any round: the root's refusal came from the
    # engine, the others' from torch, one round apart (a sparse CSR broadcast desynced)
    # (a root's scatter_list or gather_list: its status word has every rank refuse it;
    # a root that failed copying it alone left the others a call behind)
    res["layouts"] = _errors_of({
        f"{op} {name}": (lambda op, name: lambda: {
            "broadcast": lambda t: dist.broadcast(t, src=0),
            "all_reduce": lambda t: dist.all_reduce(t),
            "max": lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX),
            "scatter_list": lambda t: dist.scatter(torch.empty(16), [t] * world if rank == 0
                                                   else None, src=0),
            "gather_list": lambda t: dist.gather(torch.ones(16), [t] * world if rank == 0
                                                 else None, dst=0),
            "all_gather_into_tensor": lambda t: dist.all_gather_into_tensor(
                torch.empty(16 * world), t),
            "reduce_scatter_tensor": lambda t: dist.reduce_scatter_tensor(torch.empty(16), t),
            "all_to_all_single": lambda t: dist.all_to_all_single(torch.empty(16), t)}[op](
                layout(name)))(op, name)
        for op in ("broadcast", "all_reduce", "max", "scatter_list", "gather_list",
                   "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
        for name in ("csr", "mkldnn", "nested", "jagged")}, then=summed)
    dist.barrier()  # the errors above left every rank in step
    group = dist.distributed_c10d._get_default_group()  # the backend object itself
    res["direct_state"] = group.comm._engine.direct.state
    return res


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _sgd_steps(model: torch.nn.Module, rank: int, steps: int, after_step=None) -> None:
    """``steps`` SGD steps of ``_mlp``'s regression on data fixed by ``rank``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(50 + rank)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)),
                                     torch.randn(8, 4, generator=g)).backward()
        opt.step()
        if after_step is not None:
            after_step()


def sparse_input(rank: int, salt: int = 0, dtype: torch.dtype = torch.float32,
                 size: tuple = (9,), nnz: int | None = None) -> torch.Tensor:
    """A deterministic, rank-dependent sparse COO tensor of ``size`` (its first
    dimension sparse, the others dense): ``3 + 2 * rank`` entries by default, not
    coalesced (repeated indices likely)."""
    g = torch.Generator().manual_seed(100 * rank + salt + 3)
    nnz = 3 + 2 * rank if nnz is None else nnz
    idx = torch.randint(0, size[0], (1, nnz), generator=g)
    vals = (torch.randn(nnz, *size[1:], generator=g) * 3).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, size, check_invariants=True)


def _sparse_reduces(rank: int, res: dict) -> None:
    """``sc_sparse``'s reduces and DDP training, their results into ``res``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.distributed_c10d._get_default_group()
    cases = {"f32": sparse_input(rank), "f64": sparse_input(rank, 1, torch.float64),
             "bf16": sparse_input(rank, 2, torch.bfloat16),
             "int64": sparse_input(rank, 3, torch.int64),
             "dense_dims": sparse_input(rank, 4, size=(7, 3, 2)),
             "empty_on_rank_1": sparse_input(rank, 5, nnz=0 if rank == 1 else None),
             "all_empty": sparse_input(rank, 6, nnz=0),
             "two_sparse_dims": torch.sparse_coo_tensor(
                 torch.tensor([[rank, 2, 4], [1, rank + 1, 0]]), torch.ones(3) * (rank + 1),
                 (5, 6), check_invariants=True)}
    for name, t in cases.items():
        dist.all_reduce(t)
        res[name] = t
    pair = [sparse_input(rank, 7), sparse_input(rank, 8)]
    group.allreduce(pair).wait()  # (gloo adds a list first)
    res["pair"] = pair
    t = sparse_input(rank, 9)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    res["async"] = (t, work.result()[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(5)  # (the sums may run on fewer: the count must come back)
    dist.all_reduce(sparse_input(rank, 11))
    res["threads_after"] = torch.get_num_threads()
    torch.set_num_threads(threads)

    torch.manual_seed(rank + 1)  # different inits: DDP's broadcast aligns them
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(12, 2))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(50 + rank)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randint(0, 20, (8, 3), generator=g)
        torch.nn.functional.mse_loss(ddp(x), torch.randn(8, 2, generator=g)).backward()
        opt.step()
    res["ddp"] = [p.detach().clone() for p in model.parameters()]


def sc_sparse(rank: int, world: int) -> dict:
    """All-reduces of sparse COO tensors (SUM; uneven and empty entries, dense
    dimensions, two sparse dimensions, several dtypes, a list summed first, async), DDP
    of a model with sparse embedding gradients, and on flodl_shm what every rank raises
    for sparse calls that do not agree."""
    import torch.distributed as dist

    res: dict = {"pid": os.getpid()}
    # torch 2.11 warns that sparse invariant checks are off even for a tensor built with
    # check_invariants=True (2.13 does not): that warning, once a process, is spent here,
    # where it says nothing of the collectives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), (1,),
                                check_invariants=True)
    # what the reduces and DDP warn of (torch warns once per process: these are its first
    # sparse tensors built without saying whether to check their invariants)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sparse_reduces(rank, res)
    res["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # (CSR's beta note, below)
    group = dist.distributed_c10d._get_default_group()
    if dist.get_backend() != "flodl_shm":
        return res  # (gloo's errors are its own; some of these calls would wedge it)

    def summed() -> list[float]:
        d = torch.ones(4)
        dist.all_reduce(d)
        return d.tolist()

    kept = sparse_input(rank, 10)
    res["errors"] = _errors_of({
        "avg": lambda: dist.all_reduce(kept, op=dist.ReduceOp.AVG),
        "op_mismatch": lambda: dist.all_reduce(
            sparse_input(rank), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX),
        "size_mismatch": lambda: dist.all_reduce(sparse_input(rank, size=(9 + rank,))),
        "dtype_mismatch": lambda: dist.all_reduce(
            sparse_input(rank, dtype=torch.float32 if rank == 0 else torch.float64)),
        "float16": lambda: dist.all_reduce(sparse_input(rank, dtype=torch.float16)),
        "mixed_on_rank_1": lambda: group.allreduce(
            [sparse_input(rank)] + ([torch.ones(9)] if rank == 1 else [])).wait(),
        "dense_on_rank_1": lambda: dist.all_reduce(
            torch.ones(9) if rank == 1 else sparse_input(rank)),
        "dense_dims_differ": lambda: dist.all_reduce(
            sparse_input(rank, size=(9,) if rank == 0 else (9, 2))),
        "leaf_requires_grad": lambda: dist.all_reduce(sparse_input(rank).requires_grad_()),
        # refused by one rank before any round, while the others reduce
        "csr_on_rank_0": lambda: dist.all_reduce(
            torch.eye(4).to_sparse_csr() if rank == 0 else torch.ones(4, 4)),
        "uint16_on_rank_2": lambda: dist.all_reduce(
            torch.ones(3, dtype=torch.uint16 if rank == 2 else torch.float32)),
        # every rank refuses, rank 0 in reduce_scatter_tensor's own check, the others in
        # the reduce_scatter it calls: one refusal round each (two made rank 0 a round late)
        "refused_at_two_levels": lambda: dist.reduce_scatter_tensor(
            *((torch.ones(1, 2), torch.ones(3, 2).to_sparse_csr()) if rank == 0 else
              (torch.ones(1, 2, dtype=torch.uint16), torch.ones(3, 2, dtype=torch.uint16)))),
    }, then=summed)
    res["kept"] = (kept, sparse_input(rank, 10))
    return res


def sc_layouts(rank: int, world: int) -> dict:
    """Tensors of every memory layout, chosen per rank, and half-precision sums through
    every transport. World 3: ranks contribute 1, 2^-8, 2^-8 (bfloat16) and 1, 2^-11,
    2^-11 (float16), whose per-step sum rounds to 1 and whose float32 sum rounded once
    does not."""
    import torch.distributed as dist

    res: dict = {"pid": os.getpid()}
    one = torch.tensor([10 * rank + 1, -1], dtype=torch.int64)[::2]  # 1 element, stride 2
    dist.all_reduce(one)  # a byte round
    res["one_strided_sum"] = one.clone()
    outs = [torch.empty(1) for _ in range(world)]
    dist.all_gather(outs, torch.tensor([float(rank), -1.0])[::2])
    res["one_strided_gather"] = outs
    # only rank 1 sends a one-element strided chunk: a rank-local layout
    ins = [torch.full((2,), float(rank)) for _ in range(world)]
    if rank == 1:
        ins[0] = torch.tensor([7.0, -1.0, 7.0])[::2]
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, ins)
    res["all_to_all"] = outs
    out = torch.zeros(4, world * 3).t()  # a transposed output
    dist.all_gather_into_tensor(out, torch.arange(12.).view(3, 4) + 100 * rank)
    res["gather_into_transposed"] = out.clone()
    # the float32 hot case: ranks whose tensors are contiguous hand them straight to the
    # engine (rank 2's input 2-D), rank 0's transposed output takes the general path;
    # both must run the same round
    out = torch.zeros(4, world * 3).t() if rank == 0 else torch.zeros(world * 3, 4)
    src = torch.arange(12.) + 100 * rank
    dist.all_gather_into_tensor(out, src.view(3, 4) if rank == 2 else src)
    res["gather_into_mixed"] = out.clone()
    out = torch.zeros(3, 2, dtype=torch.int64).t()
    dist.reduce_scatter_tensor(out, (torch.arange(world * 6) + rank).view(world * 2, 3))
    res["reduce_scatter_into_transposed"] = out.clone()
    # float32 SUM/AVG reduce_scatter_tensor takes the engine's all-reduce, the list form a
    # byte round reduced in torch ops: the same bits (summed in float32 in rank order),
    # whatever the values (summation order matters at these magnitudes) and layouts
    g = torch.Generator().manual_seed(rank)
    vals = torch.randn(world * 6, generator=g) * torch.tensor([1e-30, 1.0, 3e38] * 2 * world)
    vals[rank] = -0.0
    vals[world + rank] = float("inf") if rank == 0 else -0.0
    vals[2 * world] = float("nan") if rank == 1 else vals[2 * world]
    for name, op in (("SUM", dist.ReduceOp.SUM), ("AVG", dist.ReduceOp.AVG)):
        src = vals.view(world, 6).t().contiguous().t() if rank == 2 else vals.view(world, 6)
        fast = torch.zeros(3, 2).t() if rank == 0 else torch.zeros(2, 3)  # (rank 0: strided)
        dist.reduce_scatter_tensor(fast, src, op=op)
        listed = torch.zeros(6)
        dist.reduce_scatter(listed, [p.clone() for p in vals.chunk(world)], op=op)
        res[("reduce_scatter_transports", name)] = (fast.reshape(-1).clone(), listed)
    t = torch.zeros(12)[::2]  # every rank strided; reduce clones on the non-roots
    t.copy_(torch.arange(6.) + rank)
    dist.reduce(t, dst=0)
    res["reduce_strided"] = t.clone()
    base = torch.arange(12.).view(3, 4) + rank
    t = base.t().contiguous().t() if rank == 0 else base.clone()  # rank 0: transposed memory
    dist.all_reduce(t)
    res["all_reduce_mixed_layouts"] = t.clone()
    for dt, small in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
        val = 1.0 if rank == 0 else small
        got = {}
        t = torch.full((4,), val, dtype=dt)
        dist.all_reduce(t)
        got["all_reduce"] = t[0].item()
        t = torch.zeros(8, dtype=dt)[::2]
        t.fill_(val)
        dist.all_reduce(t)
        got["all_reduce_strided"] = t[0].item()
        o = torch.zeros(2, dtype=dt)
        dist.reduce_scatter_tensor(o, torch.full((2 * world,), val, dtype=dt))
        got["reduce_scatter_tensor"] = o[0].item()
        o = torch.zeros(2, dtype=dt)
        dist.reduce_scatter(o, [torch.full((2,), val, dtype=dt) for _ in range(world)])
        got["reduce_scatter"] = o[0].item()
        res[("half_sums", str(dt))] = got
        # AVG: the float32 sum times float32(1/n), rounded once, on every transport
        # (in bfloat16 the first value's product is a tie, so the sum divided by n
        # rounds the other way); -0.0 summed stays -0.0
        vals = HALF_AVG_VALUES[rank % len(HALF_AVG_VALUES)]
        got = {}
        for how in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter"):
            o = torch.tensor(vals, dtype=dt)
            if how == "all_reduce":
                dist.all_reduce(o, op=dist.ReduceOp.AVG)
            elif how == "reduce_scatter_tensor":
                o = torch.zeros(len(vals), dtype=dt)
                dist.reduce_scatter_tensor(o, torch.tensor(vals * world, dtype=dt),
                                           op=dist.ReduceOp.AVG)
            else:
                o = torch.zeros(len(vals), dtype=dt)
                dist.reduce_scatter(o, [torch.tensor(vals, dtype=dt)] * world,
                                    op=dist.ReduceOp.AVG)
            got[how] = o.tolist()
        for name, op in (("SUM", dist.ReduceOp.SUM),
                         ("PREMUL_SUM", dist._make_nccl_premul_sum(0.5))):
            z = torch.full((2,), -0.0, dtype=dt)
            o = premul_or_refusal(z, lambda: dist.all_reduce(z, op=op))
            got[("negative_zero", name)] = o if isinstance(o, str) else [
                math.copysign(1.0, v) for v in o.tolist()]
        res[("half_avg", str(dt))] = got
    # the caller's tensors stay resizable after a byte-exchange collective (viewing
    # them through Tensor.numpy() marked their storage not resizable for good)
    resized = []
    for make in (lambda t: dist.all_reduce(t), lambda t: dist.broadcast(t, src=0),
                 lambda t: dist.all_gather([torch.empty_like(t) for _ in range(world)], t)):
        t = torch.ones(3, dtype=torch.float64)
        make(t)
        try:
            t.resize_(5)
            resized.append(None)
        except RuntimeError as e:
            resized.append(str(e))
    res["resized"] = resized
    # the same bits whatever the layout: ties of -0.0 and 0.0, a NaN's sign
    zeros = torch.tensor([-0.0, 0.0, -0.0, 0.0] if rank % 2 else [0.0, -0.0, -0.0, 0.0])
    for name, op in (("MIN", dist.ReduceOp.MIN), ("MAX", dist.ReduceOp.MAX)):
        t = torch.zeros(8)[::2] if rank == 1 else torch.zeros(4)
        t.copy_(zeros)
        dist.all_reduce(t, op=op)
        res[("signed_zeros", name)] = t.clone().view(torch.int32).tolist()
    t = torch.zeros(4, dtype=torch.bfloat16)[::2] if rank == 1 else \
        torch.zeros(2, dtype=torch.bfloat16)
    t.copy_(torch.tensor([float("inf") if rank == 0 else float("-inf"), 1.0]))
    dist.all_reduce(t)
    res["nan_bits"] = t.clone().view(torch.int16).tolist()
    t = torch.zeros(0, 3)  # an empty float32 broadcast: nothing to move, on every rank
    dist.broadcast(t, src=1)
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
    dist.reduce(c, dst=0)
    res["complex_reduce"] = c.clone()
    o = torch.zeros(1, dtype=torch.complex64)
    dist.reduce_scatter_tensor(o, torch.arange(world).to(torch.complex64) * (1 + 1j))
    res["complex_reduce_scatter"] = o.clone()
    # misuse: every rank raises a RuntimeError naming it, and the group stays usable
    def ones_summed() -> list:
        t = torch.ones(2)
        dist.all_reduce(t)
        return t.tolist()

    errors = _errors_of({
        "all_gather_count": lambda: dist.all_gather([torch.empty(2)] * (world + 1),
                                                    torch.ones(2)),
        "gather_into_size": lambda: dist.all_gather_into_tensor(torch.empty(7), torch.ones(3)),
        "reduce_scatter_size": lambda: dist.reduce_scatter_tensor(torch.empty(3),
                                                                  torch.ones(4 * world)),
        "alltoall_splits": lambda: dist.all_to_all_single(
            torch.empty(world + (2 if rank == 0 else 0)), torch.ones(world),
            output_split_sizes=[3 if (rank == 0 and s == 1) else 1 for s in range(world)]
            if rank == 0 else None),
        "scatter_list": lambda: dist.scatter(
            torch.empty(4), [torch.ones(3)] * world if rank == 0 else None, src=0),
        "gather_list": lambda: dist.gather(
            torch.ones(3), [torch.empty(3)] * (world - 1) if rank == 0 else None, dst=0),
        "complex_max": lambda: dist.reduce(torch.ones(2, dtype=torch.complex64), dst=0,
                                           op=dist.ReduceOp.MAX),
    }, then=ones_summed)  # still in step, still usable
    res["errors"] = errors
    # an expand()ed tensor where a result is written, on one rank only: that rank raises
    # after the round; the others get their results, and the group stays in step
    def expanded_on(r: int, values: list) -> torch.Tensor:
        if rank == r:
            return torch.tensor([float(rank)]).expand(len(values))
        return torch.tensor(values)

    got: dict = {}

    def keep(what: str, t: torch.Tensor) -> None:
        got[what] = t.tolist()

    res["expanded"] = _errors_of({
        "broadcast": lambda: (lambda t: (dist.broadcast(t, src=0), keep("broadcast", t)))(
            expanded_on(1, [10.0 + rank, 20.0])),
        "reduce": lambda: (lambda t: (dist.reduce(t, dst=2), keep("reduce", t)))(
            expanded_on(2, [1.0, 2.0])),
        "all_reduce": lambda: (lambda t: (dist.all_reduce(t), keep("all_reduce", t)))(
            expanded_on(0, [1.0, 2.0])),
        "all_reduce_bf16": lambda: (lambda t: (dist.all_reduce(t), keep("all_reduce_bf16", t)))(
            expanded_on(1, [1.0, 2.0]).to(torch.bfloat16) if rank != 1
            else torch.tensor([1.0], dtype=torch.bfloat16).expand(2)),
    }, then=ones_summed)
    res["expanded_results"] = got
    return res


def sc_ddp(rank: int, world: int) -> dict:
    """DDP with a different init per rank (the init broadcast aligns them), small
    buckets, no_sync steps, then the fp16 and PowerSGD hooks; final params."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict = {"pid": os.getpid(), "cuda": torch.cuda.is_available()}
    # (torch's PowerSGD hook calls torch.cuda.synchronize with the gradients' device
    # wherever CUDA is available, which raises for CPU gradients, gloo's too)
    for variant in ("plain", "fp16", "powersgd")[:2 if out["cuda"] else None]:
        model = _mlp(seed=rank + 1)
        # small buckets (several allreduces per step), except under PowerSGD, whose
        # per-bucket state trips gloo itself when buckets are rebuilt after step 1
        ddp = DDP(model, bucket_cap_mb=25 if variant == "powersgd" else 0.01)
        if variant == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif variant == "powersgd":
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=2, use_error_feedback=True)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(50 + rank)
        for step in range(6):
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            if step == 2 and variant == "plain":
                with ddp.no_sync():
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                continue
            if not (variant == "plain" and step == 3):  # step 3 adds to no_sync's grads
                opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[variant] = [p.detach().clone() for p in model.parameters()]
    # DDP's bucket all-reduces ran on the group's worker thread, overlapping backward
    out["overlapped"] = getattr(dist.group.WORLD, "_worker", None) is not None
    # a collective queued from inside a backward pass: its Work completes later, in order
    x = torch.ones(3, requires_grad=True)
    works = []
    x.register_hook(lambda g: works.append(dist.all_reduce(g * (rank + 1), async_op=True)))
    (x * 2).sum().backward()
    after = torch.full((2,), float(rank))
    dist.all_reduce(after)  # queued behind the hook's collective, not overtaking it
    works[0].wait()
    out["hook_allreduce"] = works[0].get_future().value()[0].tolist()
    out["after"] = after.tolist()
    # collectives built on others, called without async_op inside a backward pass: done
    # on return (they returned before their queued round ran, outputs unwritten, errors
    # lost: FSDP2's gradients were garbage), and their argument errors raised
    seen: dict = {}

    def in_backward(g):
        rs = torch.full((4,), -1.0)
        dist.reduce_scatter_tensor(rs, torch.arange(4.0 * world) + rank)
        seen["reduce_scatter_tensor"] = rs.tolist()
        a2a = torch.full((2 * world,), -1.0)
        dist.all_to_all_single(a2a, torch.arange(2.0 * world) + 10 * rank)
        seen["all_to_all_single"] = a2a.tolist()
        try:
            dist.reduce_scatter_tensor(torch.empty(3), torch.ones(4 * world))
        except RuntimeError as e:
            seen["bad_output"] = str(e)
        return g

    y = torch.ones(3, requires_grad=True)
    y.register_hook(in_backward)
    (y * 2).sum().backward()
    out["in_backward"] = seen
    return out


def sc_ddp_compiled(rank: int, world: int) -> dict:
    """``torch.compile(DDP(model))``: the compiled forward reaches the backend through
    torch's C++ (the BatchNorm buffers' broadcast every step, the bucket rebuild at the
    second); final params and buffers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank + 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 4))
    ddp = DDP(model)
    step = torch.compile(ddp, backend="eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(50 + rank)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(4):
            opt.zero_grad()
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            torch.nn.functional.mse_loss(step(x), y).backward()
            opt.step()
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "warnings": [str(w.message) for w in said]}


def sc_ddp_complex(rank: int, world: int) -> dict:
    """DDP on a model with a complex parameter, a different init per rank: DDP's start-up
    broadcast (``_broadcast_coalesced``) hands the backend the complex tensor itself."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp(seed=rank + 1)
    model.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    ddp = DDP(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(50 + rank)
    for _ in range(3):
        opt.zero_grad()
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y) + 0.1 * model.phase.abs().square().sum()
        loss.backward()
        opt.step()
    return {"start": start, "params": [p.detach().clone() for p in model.parameters()]}


def sc_ddp_big(rank: int, world: int) -> dict:
    """DDP whose gradient buckets (~2.4 MiB) take the engine's large-round path, during
    the backward pass on the group's worker thread; final params and the path taken."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank + 1)  # different inits: DDP's broadcast aligns them
    model = torch.nn.Sequential(torch.nn.Linear(1024, 600), torch.nn.ReLU(),
                                torch.nn.Linear(600, 4))
    ddp = DDP(model, bucket_cap_mb=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(50 + rank)
    for _ in range(4):
        x = torch.randn(8, 1024, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    group = dist.distributed_c10d._get_default_group()
    return {"pid": os.getpid(), "params": [p.detach().clone() for p in model.parameters()],
            "direct_state": group.comm._engine.direct.state if hasattr(group, "comm")
            else None}


def sc_averager(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    model = _mlp(seed=rank + 1)
    avg = PeriodicModelAverager(period=2, warmup_steps=0)
    # averages at the 1st, 3rd and 5th call (period 2, from step 0)
    _sgd_steps(model, rank, 5, lambda: avg.average_parameters(model.parameters()))
    dist.barrier()
    return {"pid": os.getpid(), "params": [p.detach().clone() for p in model.parameters()]}


def sc_fsdp2(rank: int, world: int) -> dict:
    """FSDP2 (fully_shard on a CPU mesh): its gradient reduce-scatters run during the
    backward pass; the full parameters after 5 SGD steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(seed=1)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    _sgd_steps(model, rank, 5)
    params = [v.full_tensor().clone() for v in model.state_dict().values()]
    dist.barrier()
    return {"pid": os.getpid(), "params": params}


def sc_device_checkpoints(rank: int, world: int) -> dict:
    """The torch code that asks the group which device it serves: dcp.async_save (then
    dcp.load), set_model_state_dict(broadcast_from_rank0=True) and a torch.save file
    read through BroadcastingTorchSaveReader, in the C10D_DIR folder."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import (BroadcastingTorchSaveReader,
                                                           DynamicMetaLoadPlanner)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    warnings.simplefilter("ignore")  # torch's notes on private and prototype APIs
    folder = os.environ["C10D_DIR"]
    dcp.async_save({"w": torch.full((4,), 1.0 + rank)}, checkpoint_id=f"{folder}/a").result()
    saved = {"w": torch.zeros(4)}
    dcp.load(saved, checkpoint_id=f"{folder}/a")
    src = _mlp(seed=3)
    model = _mlp(seed=4 + rank)
    set_model_state_dict(model, src.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True,
                                                  broadcast_from_rank0=True))
    if rank == 0:
        torch.save(src.state_dict(), f"{folder}/m.pt")
    dist.barrier()
    read = _mlp(seed=5).state_dict()
    dcp.load(read, storage_reader=BroadcastingTorchSaveReader(),
             planner=DynamicMetaLoadPlanner(), checkpoint_id=f"{folder}/m.pt")
    return {"pid": os.getpid(), "saved": saved["w"], "broadcast": list(model.state_dict().values()),
            "read": list(read.values()), "source": list(src.state_dict().values()),
            "devices": dist.distributed_c10d._device_capability()}


def sc_direct_threshold(rank: int, world: int) -> dict:
    """A 2 MiB reduce (over the eager slots) and a 256 KiB broadcast, whatever each
    rank's environment says of the direct rounds' thresholds: every rank reads the arena
    owner's words."""
    import torch.distributed as dist

    t = torch.full((1 << 19,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.full((1 << 16,), float(rank + 1))
    dist.broadcast(b, src=world - 1)
    comm = dist.distributed_c10d._get_default_group().comm
    return {"reduced": t.unique().tolist(), "broadcast": b.unique().tolist(),
            "min_bytes": comm.direct_min_bytes,
            "broadcast_min_bytes": comm.direct_broadcast_min_bytes,
            "direct_state": comm._engine.direct.state}


def sc_big_gathers(rank: int, world: int) -> dict:
    """all_gather_into_tensor of raw random bits in several dtypes, each rank's part
    broadcast in place as float32: 1 MiB a rank (direct broadcasts, on an oversubscribed
    host too), into outputs of every layout (one at an offset no float32 view takes,
    one transposed), 12 bytes a rank (one compiled call a broadcast) and 3 bytes a rank
    (no whole float32: the byte round); a 1 MiB float32 reduce_scatter_tensor next to
    the list form's byte round. Whether every rank got what it should."""
    import torch.distributed as dist

    per = 1 << 20

    def bits(r: int, dt) -> torch.Tensor:  # rank r's input: random bytes, read as dt
        g = torch.Generator().manual_seed(1000 + r)
        raw = torch.randint(-2 ** 31, 2 ** 31 - 1, (per // 4,), dtype=torch.int32, generator=g)
        return raw.view(dt)

    out = {}
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        mine = bits(rank, dt)
        want = torch.cat([bits(r, dt) for r in range(world)])
        got = torch.empty(want.numel(), dtype=dt)
        dist.all_gather_into_tensor(got, mine)
        out[str(dt)] = got.view(torch.uint8).equal(want.view(torch.uint8))
    for nbytes in (12, 3):  # (a small part; one of no whole float32)
        mine = bits(rank, torch.uint8)[:nbytes]
        got = torch.empty(world * nbytes, dtype=torch.uint8)
        dist.all_gather_into_tensor(got, mine)
        out[f"{nbytes} bytes"] = got.equal(torch.cat([bits(r, torch.uint8)[:nbytes]
                                                      for r in range(world)]))
    mine = bits(rank, torch.bfloat16)
    shifted = torch.empty(world * mine.numel() + 1, dtype=torch.bfloat16)[1:]  # 2 bytes in
    dist.all_gather_into_tensor(shifted, mine)
    want = torch.cat([bits(r, torch.bfloat16) for r in range(world)])
    out["offset output"] = shifted.view(torch.uint8).equal(want.view(torch.uint8))
    mine = bits(rank, torch.float32)[::2]  # a strided input, into a transposed output
    got = torch.empty(mine.numel(), world).t()
    dist.all_gather_into_tensor(got, mine)
    want = torch.cat([bits(r, torch.float32)[::2] for r in range(world)]).view(world, -1)
    out["transposed output"] = got.contiguous().view(torch.int32).equal(want.view(torch.int32))
    g = torch.Generator().manual_seed(rank)
    vals = torch.randn(world * (per // 4), generator=g)
    fast = torch.empty(per // 4)
    dist.reduce_scatter_tensor(fast, vals)
    listed = torch.empty(per // 4)
    dist.reduce_scatter(listed, [p.clone() for p in vals.chunk(world)])
    out["reduce_scatter"] = fast.view(torch.int32).equal(listed.view(torch.int32))
    # rank 0's output does not fit: it raises its own error, the others gather, in step
    got = torch.empty(7 if rank == 0 else world * (per // 4))
    try:
        dist.all_gather_into_tensor(got, bits(rank, torch.float32))
        want = torch.cat([bits(r, torch.float32) for r in range(world)])
        out["misfit on rank 0"] = rank != 0 and got.view(torch.int32).equal(want.view(torch.int32))
    except RuntimeError as e:
        out["misfit on rank 0"] = rank == 0 and "an output of 7 torch.float32" in str(e)
    t = torch.ones(2)
    dist.all_reduce(t)
    out["then in step"] = t.tolist() == [float(world)] * 2
    # a bfloat16 NaN sum into a strided output: the bits of a contiguous one
    vals = torch.full((world * 4,), 1.5, dtype=torch.bfloat16)
    vals[::4] = float("nan") if rank == 0 else 2.0
    got = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)[::2]]
    for o in got:
        dist.reduce_scatter_tensor(o, vals)
    out["strided bfloat16 NaN"] = got[0].view(torch.int16).equal(
        got[1].contiguous().view(torch.int16))
    # rank 1 passes another dtype of the same bytes (all-gather) or of the engine's path
    # (reduce-scatter): every rank raises, naming the calls, as the byte rounds made them
    for what, call in (
            ("gather int32 among float32", lambda dt: dist.all_gather_into_tensor(
                torch.zeros(world * 4, dtype=dt), torch.ones(4, dtype=dt))),
            ("reduce_scatter bfloat16 among float32", lambda dt: dist.reduce_scatter_tensor(
                torch.zeros(4, dtype=dt), torch.ones(world * 4, dtype=dt)))):
        dt = (torch.int32 if "int32" in what else torch.bfloat16) if rank == 1 else torch.float32
        try:
            call(dt)
            out[what] = False
        except RuntimeError as e:
            out[what] = "made different calls" in str(e)
    t = torch.ones(2)
    dist.all_reduce(t)
    out["then in step again"] = t.tolist() == [float(world)] * 2
    # an input inside the output, off this rank's part (gloo copies inputs first: so do we)
    buf = torch.arange(world * 4, dtype=torch.float32) + 100 * rank
    dist.all_gather_into_tensor(buf, buf[1:5])
    out["input overlapping the output"] = buf.tolist() == [
        float(i + 100 * r) for r in range(world) for i in range(1, 5)]
    # one element at stride 2 (contiguous, yet no byte view takes it), of an 8-byte dtype
    got = torch.zeros(world, dtype=torch.int64)
    dist.all_gather_into_tensor(got, (torch.arange(2, dtype=torch.int64) + 7 * rank)[::2])
    out["one strided int64"] = got.tolist() == [7 * r for r in range(world)]
    return out


def sc_one_sum(rank: int, world: int) -> dict:
    """One all_reduce of two ones, then subgroups' (whose inits must not warn again)."""
    import torch.distributed as dist

    t = torch.ones(2)
    dist.all_reduce(t)
    dist.all_reduce(t, group=dist.new_group(list(range(world))))
    last = dist.new_group([world - 1])  # (its one rank is its host's first: no warning)
    if rank == world - 1:
        dist.all_reduce(torch.ones(1), group=last)
    dist.barrier()  # (rank 0 hosts the store: it stays until the last rank's group formed)
    return {"t": t.tolist()}


def _native_threads() -> set[int]:
    """This process's threads that Python did not start (torch's OpenMP team, say)."""
    import threading

    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def sc_torch_threads(rank: int, world: int) -> dict:
    """Collectives whose rounds hold torch work on 1 MiB tensors (copies, sums in torch
    ops), called with torch set to more threads than the host has cores: whether any of
    them started torch's OpenMP team (new native threads), and torch's count after. The
    rank has run torch with one thread so far, so no team exists yet."""
    import torch.distributed as dist
    from flodl_shm.engine.hostcpu import available_cores

    n = 1 << 18
    got, mine = torch.empty(world * n), torch.full((n,), float(rank))
    part, whole, parts = torch.empty(n), torch.ones(world * n), [torch.ones(n)] * world
    wide = torch.full((n,), float(rank + 1), dtype=torch.float64)
    half, outs = torch.ones(n, dtype=torch.bfloat16), [torch.empty(n) for _ in range(world)]
    before = _native_threads()
    threads = available_cores() + 2
    torch.set_num_threads(threads)  # (from here on, collectives only)
    try:
        dist.all_gather_into_tensor(got, mine)
        dist.reduce_scatter_tensor(part, whole)
        dist.reduce_scatter(part, parts)
        dist.all_reduce(wide, op=dist.ReduceOp.MAX)
        dist.broadcast(half, src=0)
        dist.all_gather(outs, mine)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(1)
    gathered = got.view(world, n)[:, 0].tolist() == [float(r) for r in range(world)]
    return {"gathered": gathered, "summed": part.unique().tolist(),
            "max": wide.unique().tolist(), "threads after": after, "asked": threads,
            "new native threads": sorted(_native_threads() - before)}


def sc_ddp_peer_dies(rank: int, world: int) -> dict:
    """The last rank SIGKILLs itself before a DDP backward: the others' gradient
    all-reduce (queued on the group's worker) fails, and ``backward`` must raise."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(seed=1))
    for _ in range(2):  # past the second forward, which rebuilds DDP's buckets
        model(torch.randn(4, 16)).sum().backward()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out = model(torch.randn(4, 16)).sum()
    try:
        out.backward()
        err = None
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        err = f"{type(e).__name__}: {e}"
    return {"pid": os.getpid(), "error": err}


def _timed_all_reduce() -> tuple[str | None, float]:
    """One all_reduce of 8 ones: what it raised (None: nothing) and how long it took."""
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
        err = None
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        err = f"{type(e).__name__}: {e}"
    return err, time.monotonic() - t0


def sc_peer_dies(rank: int, world: int) -> dict:
    """The last rank SIGKILLs itself between two collectives; the others must raise."""
    import torch.distributed as dist

    t = torch.ones(8)
    dist.all_reduce(t)
    victim = int(os.environ.get("C10D_VICTIM", world - 1))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    err, seconds = _timed_all_reduce()
    again, again_seconds = None, 0.0
    if err is not None:   # the group is unusable now: a further call raises at once
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(8))
        except Exception as e:  # noqa: BLE001
            again = f"{type(e).__name__}: {e}"
        again_seconds = time.monotonic() - t0
        # a survivor that stays up after its error (C10D_LINGER seconds)
        time.sleep(float(os.environ.get("C10D_LINGER", "0")))
    return {"pid": os.getpid(), "error": err, "seconds": seconds, "again": again,
            "again_seconds": again_seconds}


def sc_peer_leaves(rank: int, world: int) -> dict:
    """The last rank makes one collective fewer: it returns, so ``run_rank`` destroys its
    group and it exits 0, while the others are in (or, after C10D_LATE seconds, enter)
    a collective it never joins: they must raise naming it as gone, not as dead."""
    import torch.distributed as dist

    dist.all_reduce(torch.ones(8))
    if rank == world - 1:
        return {"pid": os.getpid(), "error": None}
    time.sleep(float(os.environ.get("C10D_LATE", "0")))
    err, seconds = _timed_all_reduce()
    return {"pid": os.getpid(), "error": err, "seconds": seconds}


def sc_destroy_recreate(rank: int, world: int) -> dict:
    """destroy_process_group, then a second group on the same store address."""
    import torch.distributed as dist

    t = torch.ones(4) * rank
    dist.all_reduce(t)
    pg = dist.new_group(backend="flodl_shm")
    u = torch.ones(2)
    dist.all_reduce(u, group=pg)
    dist.destroy_process_group(pg)
    try:
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
        after = None
    except RuntimeError as e:
        after = str(e)
    return {"pid": os.getpid(), "t": t, "u": u, "after_destroy": after}

def sc_stall(rank: int, world: int) -> dict:
    """The last rank skips a collective (alive, sleeping): the others time out naming it.
    A rank that timed out stays up C10D_LINGER seconds, as a process that raised takes a
    while to exit (else a peer whose deadline is later sees it die first)."""
    import torch.distributed as dist

    err = None
    if rank != world - 1:
        if rank == 1:  # C10D_LATE: rank 1 enters that much later than rank 0
            time.sleep(float(os.environ.get("C10D_LATE", "0")))
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            err = f"{type(e).__name__}: {e}"
            time.sleep(float(os.environ.get("C10D_LINGER", "0")))
    else:
        time.sleep(float(os.environ["C10D_TIMEOUT"]) + 4)
    return {"pid": os.getpid(), "error": err}


def sc_stall_subgroup(rank: int, world: int) -> dict:
    """Subgroup [1, 2] of a world of 3, a 2 s timeout: global rank 2 skips its
    all_reduce, global rank 1 times out naming it."""
    import torch.distributed as dist
    from datetime import timedelta

    group = dist.new_group([1, 2], timeout=timedelta(seconds=2))
    err = None
    if rank == 1:
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            err = f"{type(e).__name__}: {e}"
    elif rank == 2:
        time.sleep(5)
    dist.barrier()  # the world's group still works
    return {"pid": os.getpid(), "error": err}


def sc_async_order(rank: int, world: int) -> dict:
    """Two groups of the same ranks; each rank starts one group's all_reduce with
    ``async_op=True``, then runs the other's synchronously, in opposite orders (rank 0:
    g1 async, g2; rank 1: g2 async, g1), then waits. gloo runs the async one in the
    background, so both complete; one that ran it in the caller's thread waited there
    for a peer that was in the other group's call until the timeout."""
    import torch.distributed as dist

    g1, g2 = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    a, b = torch.ones(4), torch.full((4,), 2.0)
    first, then = ((g1, a), (g2, b)) if rank == 0 else ((g2, b), (g1, a))
    t0 = time.monotonic()
    err = None
    try:
        work = dist.all_reduce(first[1], group=first[0], async_op=True)
        dist.all_reduce(then[1], group=then[0])
        work.wait()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - t0, "a": a.tolist(), "b": b.tolist()}


def sc_wait_timeout(rank: int, world: int) -> dict:
    """Rank 0's async all_reduce waits with a 1 s timeout while rank 1 joins 3 s late:
    the wait raises after 1 s, the collective stays queued, and a second wait gets its
    result once rank 1 joined."""
    import torch.distributed as dist
    from datetime import timedelta

    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(3.0)
        dist.all_reduce(t)
        return {"t": t.tolist()}
    work = dist.all_reduce(t, async_op=True)
    t0 = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=1))
        first = None
    except RuntimeError as e:
        first = str(e)
    first_s = time.monotonic() - t0
    work.wait()
    return {"first": first, "first_s": first_s, "t": t.tolist()}


def sc_late(rank: int, world: int) -> dict:
    """The last rank enters the collective after the others' timeout; they linger
    (C10D_LINGER s, alive) while it arrives, then each says what its call did, how long
    it took, and what a second call does (``again``, ``again_s``)."""
    import torch.distributed as dist

    def call(t):
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
            err = None
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            err = f"{type(e).__name__}: {e}"
        return err, time.monotonic() - t0

    if rank == world - 1:
        time.sleep(float(os.environ["C10D_TIMEOUT"]) + 1.5)
    t = torch.ones(4)
    err, seconds = call(t)
    again, again_s = call(torch.ones(4))
    if rank != world - 1:
        time.sleep(float(os.environ.get("C10D_LINGER", "0")))
    return {"pid": os.getpid(), "error": err, "seconds": seconds, "t": t.tolist(),
            "again": again, "again_s": again_s}


#: the dtypes ``sc_fuzz`` draws, and each one's tolerance against gloo (sums may round in
#: another order; integers, MAX and MIN must match exactly)
FUZZ_DTYPES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2,
               torch.float16: 2e-3, torch.int32: 0, torch.int64: 0, torch.int8: 0,
               torch.uint8: 0}
FUZZ_OPS = ("all_reduce", "all_reduce", "all_reduce", "broadcast", "all_gather",
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "gather",
            "scatter", "barrier")


def fuzz_program(seed: int, world: int, steps: int) -> list[dict]:
    """``sc_fuzz``'s calls: the same on every rank (drawn from ``seed``)."""
    import random

    R = torch.distributed.ReduceOp
    rng = random.Random(seed)
    program = []
    for _ in range(steps):
        op = rng.choice(FUZZ_OPS)
        dtype = rng.choice(list(FUZZ_DTYPES))
        if op in ("all_gather_into_tensor", "reduce_scatter_tensor") and rng.random() < 0.6:
            dtype = torch.float32  # FSDP's dtype, the ops' hot case: drawn more often
        n = rng.choice((1, 3, 64, 1000, 8192, 70_000 if dtype is torch.float32 else 5000))
        if op == "reduce_scatter_tensor":  # gloo's reduce-scatter sums only
            reduce_ops = [R.SUM]
        else:
            reduce_ops = [R.SUM, R.MAX, R.MIN] + ([R.PRODUCT] if n <= 64 else [])
        if dtype.is_floating_point:
            reduce_ops.append(R.AVG)
        program.append({
            "op": op, "dtype": dtype, "n": n, "reduce": rng.choice(reduce_ops),
            # a layout the hot cases must not take: a transposed or strided view
            "layout": rng.choice(("flat", "flat", "flat", "2d", "transposed", "strided")),
            "root": rng.randrange(world), "async": rng.random() < 0.3,
            "salt": rng.randrange(1 << 20),
        })
    return program


def _fuzz_layout(rank: int, st: dict, n: int | None = None, rows: int = 1,
                 contiguous: bool = False) -> torch.Tensor:
    """Rank ``rank``'s input of step ``st`` in its drawn layout (same values whatever the
    layout): ``n`` elements, or ``rows`` times ``st["n"]``; ``contiguous``: of the
    layout's shape, contiguous (gloo's: torch 2.13's gloo reads a strided or transposed
    tensor as if it were contiguous, silently wrong)."""
    if contiguous:
        return _fuzz_layout(rank, st, n, rows).contiguous()
    n = st["n"] * rows if n is None else n
    flat = rank_input(rank, st["dtype"], n, salt=st["salt"])
    if st["dtype"].is_floating_point:
        flat = (flat.float() / 3).to(st["dtype"])  # |x| ~ 1: products stay in range
    layout = st["layout"]
    if layout == "2d" and n % 2 == 0:
        return flat.view(2, n // 2)
    if layout == "transposed" and n % 2 == 0:
        return flat.view(n // 2, 2).t().contiguous().t()  # same values, column-major
    if layout == "strided":
        wide = torch.zeros(2 * n, dtype=flat.dtype)
        wide[::2] = flat
        return wide[::2]
    return flat.clone()


def _fuzz_call(st: dict, group, rank: int, world: int, reference: bool
               ) -> Callable[[], list[torch.Tensor]]:
    """Issue step ``st`` on ``group``; returns a call that waits for it (an async call's
    work) and gives its results (tensors this rank holds after it). With ``reference``
    (``group`` is gloo, which has no AVG), an AVG is a SUM divided by the world, and
    every tensor is contiguous (``_fuzz_layout``)."""
    import functools

    import torch.distributed as dist

    R = dist.ReduceOp
    op, n = st["op"], st["n"]
    a = st["async"]
    reduce = st["reduce"]
    avg = reduce == R.AVG and reference
    if avg:
        reduce = R.SUM
    make = functools.partial(_fuzz_layout, contiguous=reference)

    def later(work, results: Callable[[], list[torch.Tensor]]):
        def wait() -> list[torch.Tensor]:
            if work is not None:
                work.wait()
            return results()
        return wait

    if op == "all_reduce":
        t = make(rank, st)
        if avg:
            t = t.double() if t.dtype is torch.float64 else t.float()
        return later(dist.all_reduce(t, op=reduce, group=group, async_op=a),
                     lambda: [(t / world).to(st["dtype"]) if avg else t])
    if op == "broadcast":
        t = make(rank, st)
        return later(dist.broadcast(t, src=st["root"], group=group, async_op=a), lambda: [t])
    if op == "all_gather":
        t = make(rank, st)
        outs = [torch.full_like(t, 7) for _ in range(world)]  # (in t's layout)
        return later(dist.all_gather(outs, t, group=group, async_op=a), lambda: outs)
    if op == "all_gather_into_tensor":
        out = torch.zeros(world * n, dtype=st["dtype"])
        return later(dist.all_gather_into_tensor(out, make(rank, st).reshape(-1).contiguous(),
                                                 group=group, async_op=a), lambda: [out])
    if op == "reduce_scatter_tensor":
        src = make(rank, st, rows=world).reshape(-1).contiguous()
        if avg:
            src = src.double() if src.dtype is torch.float64 else src.float()
        out = torch.zeros(n, dtype=src.dtype)
        return later(dist.reduce_scatter_tensor(out, src, op=reduce, group=group, async_op=a),
                     lambda: [(out / world).to(st["dtype"]) if avg else out])
    if op == "all_to_all_single":
        out = torch.zeros(world * n, dtype=st["dtype"])
        src = make(rank, st, rows=world).reshape(-1).contiguous()
        return later(dist.all_to_all_single(out, src, group=group, async_op=a), lambda: [out])
    if op == "gather":
        root = st["root"]
        outs = ([torch.zeros(n, dtype=st["dtype"]) for _ in range(world)] if rank == root
                else None)
        return later(dist.gather(make(rank, st).reshape(-1).contiguous(), outs, dst=root,
                                 group=group, async_op=a), lambda: outs or [])
    if op == "scatter":
        root = st["root"]
        out = torch.zeros(n, dtype=st["dtype"])
        ins = ([make(r, st).reshape(-1).contiguous() for r in range(world)]
               if rank == root else None)
        return later(dist.scatter(out, ins, src=root, group=group, async_op=a), lambda: [out])
    return later(dist.barrier(group=group, async_op=a), lambda: [])


def sc_fuzz(rank: int, world: int) -> dict:
    """A random program of torch.distributed calls (``fuzz_program``), each run on the
    flodl_shm group and on a gloo group of the same ranks: the results compared (exact
    for integers, MAX and MIN, within the dtype's tolerance for float sums), and a
    digest of flodl_shm's results per step, to compare across ranks."""
    import torch.distributed as dist

    seed = int(os.environ.get("C10D_FUZZ_SEED", "1"))
    steps = int(os.environ.get("C10D_FUZZ_STEPS", "120"))
    gloo = dist.new_group(backend="gloo")
    program = fuzz_program(seed, world, steps)
    mismatches, digests = [], [""] * steps
    # an async call's work is waited for up to four calls later (as DDP's buckets are),
    # while later calls are issued; gloo's at once
    pending: list[tuple[int, Callable, list[torch.Tensor]]] = []
    for k, st in enumerate(program):
        ours = _fuzz_call(st, None, rank, world, reference=False)
        ref = _fuzz_call(st, gloo, rank, world, reference=True)()
        pending.append((k, ours, ref))
        if not st["async"] or len(pending) > 4 or k == steps - 1:
            for j, wait, ref in pending:
                _fuzz_check(j, program[j], wait(), ref, mismatches, digests)
            pending = []
    return {"mismatches": mismatches, "digests": digests}


def _fuzz_check(k: int, st: dict, ours: list[torch.Tensor], ref: list[torch.Tensor],
                mismatches: list[str], digests: list[str]) -> None:
    """Compare step ``k``'s results with gloo's (into ``mismatches``); its digest."""
    import hashlib

    import torch.distributed as dist

    R = dist.ReduceOp
    tol = FUZZ_DTYPES[st["dtype"]]
    exact = tol == 0 or st["op"] not in ("all_reduce", "reduce_scatter_tensor") \
        or st["reduce"] in (R.MAX, R.MIN)
    for i, (a, b) in enumerate(zip(ours, ref)):
        what = (f"step {k} {st['op']} {st['dtype']} n={st['n']} {st['layout']} "
                f"{st['reduce']} async={st['async']} root={st['root']} result {i}")
        if a.shape != b.shape or a.dtype != b.dtype:
            mismatches.append(f"{what}: {a.dtype}{list(a.shape)} vs gloo's "
                              f"{b.dtype}{list(b.shape)}")
        elif exact and not torch.equal(a, b):
            bad = (a != b).nonzero()[:3].flatten().tolist()
            mismatches.append(f"{what}: differs from gloo at {bad}")
        elif not exact and not torch.allclose(a.double(), b.double(), rtol=tol,
                                              atol=tol * max(1.0, float(b.double().abs()
                                                                        .max()))):
            err = float((a.double() - b.double()).abs().max())
            mismatches.append(f"{what}: max error {err:.3g} against gloo (tol {tol})")
    if len(ours) != len(ref):
        mismatches.append(f"step {k} {st['op']}: {len(ours)} results, gloo {len(ref)}")
    # (a fresh 1-D copy: a (2, 1) tensor of strides (1, 2) counts as contiguous)
    digests[k] = hashlib.sha1(b"".join(
        torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8)
        .numpy().tobytes() for t in ours)).hexdigest()


def run_rank(scenario: str, rank: int, world: int, port: int, out: str,
             backend: str = "flodl_shm") -> None:
    """Join a ``tcp://127.0.0.1:port`` group as ``rank`` and write the scenario's result
    (a dict, with ``torch.save``) to ``out``."""
    Path(out + ".pid").write_text(str(os.getpid()))
    torch.set_num_threads(int(os.environ.get("C10D_THREADS", "1")))
    import flodl_shm  # noqa: F401 - registers the backend
    import torch.distributed as dist
    from datetime import timedelta

    timeout = float(os.environ.get("C10D_TIMEOUT", "60"))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    result = globals()[f"sc_{scenario}"](rank, world)
    tmp = out + ".tmp"
    torch.save(result, tmp)
    os.replace(tmp, out)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_rank(ctx) -> dict:
    """Under ``flodl_shm.spawn``: the same script line as under torchrun works."""
    import torch.distributed as dist

    import flodl_shm  # noqa: F401 - registers the backend

    dist.init_process_group("flodl_shm")
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.tolist(),
           "engine_rank": ctx.rank, "pid": os.getpid()}
    dist.destroy_process_group()
    return out

"""Random sequences of every public collective, checked against numpy.

Each case draws one program from a seed: a few hundred calls mixing every ``Comm``
collective (in place, tensor-returning, frame, zero-copy, broadcasts, all-gather,
reduce-scatter, per-rank values, barrier, reports and drift sums), sizes on both sides
of the eager slot and of direct rounds, several tensors or one, float32 and bfloat16
tensors, the bf16 wire on and off, weights of zero included. Every rank (a thread of a
``FakeCohort``) runs the same program on its own inputs, which each rank can compute for
every rank, so each checks its own results against a numpy reference; afterwards the
ranks' results must be the same bits. What this guards: the caches and fast paths a
call takes (plans, hot cases, gathered addresses, the zero-copy views, the pinned
result pool) staying right whatever call came before.
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from typing import Callable, Sequence

import numpy as np
import pytest
import torch

from flodl_shm import RoundFrame, RoundKind, TensorPayload
from flodl_shm.testing import FakeCohort

WORLD = 3
STEPS = 160
SIZES = (1, 5, 64, 1000, 3000, 12_000, 70_000)  # 70,000 float32: past direct rounds' 256 KiB
WEIGHTS = (0.5, 1.0, 2.0, 3.0)
OPS = ("inplace", "inplace_control", "inplace_report", "tensors", "weighted", "scaled",
       "frame", "zero_copy", "broadcast_from_root", "broadcast_", "all_gather",
       "reduce_scatter", "per_rank", "barrier")


#: the calls that go on over the survivors once a rank died (an all-gather or a
#: reduce-scatter needs every rank's part: it raises instead)
SURVIVABLE = tuple(op for op in OPS if op not in ("all_gather", "reduce_scatter"))


#: the calls that cross hosts (round reports cover one host's ranks: refused there)
ACROSS_HOSTS = tuple(op for op in OPS if op != "inplace_report")


def _program(seed: int, victim: int | None = None, death: int | None = None,
             ops: Sequence[str] = OPS) -> list[dict]:
    """The calls every rank makes, in order, with each rank's weight, drawn from
    ``ops``; with ``victim`` dying before its call ``death``, from then on only
    ``SURVIVABLE`` calls, and broadcasts from other roots."""
    rng = random.Random(seed)
    steps = []
    for k in range(STEPS):
        after = victim is not None and k >= death
        op = rng.choice([o for o in ops if o in SURVIVABLE] if after else ops)
        count = rng.choice((1, 1, 1, 2, 4)) if op in ("inplace", "inplace_report", "tensors",
                                                       "weighted", "scaled", "frame",
                                                       "zero_copy", "broadcast_",
                                                       "broadcast_from_root") else 1
        sizes = [rng.choice(SIZES) for _ in range(count)]
        weights = [rng.choice(WEIGHTS) for _ in range(WORLD)]
        if op == "inplace" and rng.random() < 0.1:
            weights = [0.0] * WORLD  # a round that realizes nothing keeps the tensors
        elif op == "inplace" and rng.random() < 0.1:
            weights[rng.randrange(WORLD)] = 0.0
        steps.append({
            "op": op, "sizes": sizes, "weights": weights,
            "bf16_wire": op in ("inplace", "tensors", "scaled", "zero_copy")
            and rng.random() < 0.25,
            "bf16_tensor": op in ("inplace", "tensors") and rng.random() < 0.2,
            "root": (rng.choice([r for r in range(WORLD) if r != victim]) if after
                     else rng.randrange(WORLD)),
            "drift": op == "inplace_report" and rng.random() < 0.5,
        })
    return steps


def _data(seed: int, step: int, rank: int, i: int, n: int) -> np.ndarray:
    """Rank ``rank``'s ``i``-th input of ``step``: any rank can compute any rank's."""
    return np.random.default_rng((seed, step, rank, i)).standard_normal(n).astype(np.float32)


def _bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 and back (torch's rounding, nearest even)."""
    return torch.from_numpy(a).to(torch.bfloat16).float().numpy()


def _close(got: np.ndarray, want: np.ndarray, loose: bool, where: str) -> None:
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    tol = 2e-2 * scale if loose else 1e-5 * scale
    err = float(np.abs(got.astype(np.float64) - want).max(initial=0.0))
    assert err <= tol, f"{where}: max error {err:.3g} > {tol:.3g}"


def _accepted(comm) -> Sequence[int]:
    """The ranks the last round accepted: on one host, the engine's word; across hosts
    (where a Comm knows its own host's only) every rank, as these programs kill none."""
    return range(WORLD) if comm.spans_hosts else comm.last_accepted()


def _run_program(comm, rank: int, seed: int, program: list[dict],
                 before_call: Callable[[int], None] | None = None) -> list[str]:
    """Run ``program`` on this rank, checking each result against the ranks the round
    accepted; returns a digest a step. ``before_call(k)`` runs before call ``k`` (a
    rank that kills itself there)."""
    digests = []
    for k, st in enumerate(program):
        if before_call is not None:
            before_call(k)
        op, sizes, w = st["op"], st["sizes"], st["weights"]
        where = f"seed {seed} step {k} {op} sizes {sizes} rank {rank}"
        comm.set_bf16_wire(st["bf16_wire"])
        loose = st["bf16_wire"] or st["bf16_tensor"]
        mine = [_data(seed, k, rank, i, n) for i, n in enumerate(sizes)]
        every = [[_data(seed, k, r, i, n) for i, n in enumerate(sizes)] for r in range(WORLD)]

        def mean() -> list[np.ndarray]:
            # Σ wᵣ·xᵣ / Σ wᵣ over the accepted ranks in float64, from the inputs as they
            # travel (a bfloat16 tensor's values; the products rounded on the bf16 wire)
            ranks = _accepted(comm)
            total = sum(w[r] for r in ranks)
            out = []
            for i in range(len(sizes)):
                acc = np.zeros(sizes[i])
                for r in ranks:
                    x = every[r][i]
                    x = (_bf16(x) if st["bf16_tensor"] else x) * np.float32(w[r])
                    if st["bf16_wire"]:
                        x = _bf16(x.astype(np.float32))
                    acc += x
                out.append(acc / total)
            return out

        got: list[np.ndarray]
        if op in ("inplace", "inplace_report"):
            dtype = torch.bfloat16 if st["bf16_tensor"] else torch.float32
            ts = [torch.from_numpy(x.copy()).to(dtype) for x in mine]
            before = [t.float().numpy().copy() for t in ts]
            drift = np.zeros((len(ts), 3)) if st["drift"] else None
            report = (float(rank), float(k), w[rank]) if op == "inplace_report" else None
            mass = comm.all_reduce_(ts, weight=w[rank], scale=w[rank], report=report,
                                    drift=drift)
            realized = sum(w[r] for r in _accepted(comm))
            assert mass == pytest.approx(realized), where
            got = [t.float().numpy() for t in ts]
            want = before if realized == 0.0 else mean()
            if st["bf16_tensor"] and realized > 0:
                want = [_bf16(x.astype(np.float32)) for x in want]
            for g, x in zip(got, want):
                _close(g, x, loose, where)
            if report is not None:
                rows = comm.last_report_rows()
                live = _accepted(comm)  # (a rank not accepted reads as zeros)
                assert [row[:3] for row in rows] == [(float(r), float(k), w[r]) if r in live
                                                      else (0.0, 0.0, 0.0)
                                                      for r in range(WORLD)], where
            if drift is not None:
                for i, (b, g) in enumerate(zip(before, got)):
                    want_d = (np.sum(b.astype(np.float64) ** 2), np.sum(g.astype(np.float64) ** 2),
                              np.sum((b.astype(np.float64) - g) ** 2))
                    np.testing.assert_allclose(drift[i], want_d, rtol=1e-4, atol=1e-6,
                                               err_msg=where)
        elif op == "inplace_control":  # a plain sum (c10d's SUM)
            t = torch.from_numpy(mine[0].copy())
            comm.all_reduce_([t], kind=RoundKind.CONTROL)
            got = [t.numpy()]
            _close(got[0], sum(every[r][0].astype(np.float64) for r in _accepted(comm)),
                   False, where)
        elif op in ("tensors", "weighted", "scaled"):
            dtype = torch.bfloat16 if st["bf16_tensor"] else torch.float32
            if op == "tensors":
                w = [1.0] * WORLD
                res = comm.all_reduce_tensors([torch.from_numpy(x).to(dtype) for x in mine])
            elif op == "weighted":
                res, mass = comm.all_reduce_weighted(
                    [torch.from_numpy(x * np.float32(w[rank])) for x in mine], weight=w[rank])
                assert mass == pytest.approx(sum(w[r] for r in _accepted(comm))), where
            else:
                res, mass = comm.all_reduce_scaled([torch.from_numpy(x) for x in mine],
                                                   w[rank], weight=w[rank])
                assert mass == pytest.approx(sum(w[r] for r in _accepted(comm))), where
            got = [t.numpy().copy() for t in res]
            for g, x in zip(got, mean()):
                _close(g, x, loose, where)
        elif op == "frame":
            payloads = [TensorPayload(0, (n,), x * np.float32(w[rank]))
                        for n, x in zip(sizes, mine)]
            reply = comm.all_reduce(RoundFrame(payloads, w[rank], RoundKind.MODEL))
            assert reply.weight == pytest.approx(sum(w[r] for r in _accepted(comm))), where
            got = [np.frombuffer(p.data, np.float32).copy() for p in reply.tensors]
            for g, x in zip(got, mean()):
                _close(g, x, loose, where)
        elif op == "zero_copy":
            bufs = comm.zero_copy_inputs([(n,) for n in sizes])
            for b, x in zip(bufs, mine):
                b.copy_(torch.from_numpy(x * np.float32(w[rank])))
            views, mass = comm.all_reduce_zero_copy(w[rank])
            assert mass == pytest.approx(sum(w[r] for r in _accepted(comm))), where
            got = [v.float().numpy().copy() for v in views]
            for g, x in zip(got, mean()):
                _close(g, x, loose, where)
        elif op == "broadcast_from_root":
            got = [t.numpy().copy() for t in
                   comm.broadcast_from_root([torch.from_numpy(x) for x in mine], st["root"])]
            for g, x in zip(got, every[st["root"]]):
                np.testing.assert_array_equal(g, x, err_msg=where)
        elif op == "broadcast_":
            ts = [torch.from_numpy(x.copy()) for x in mine]
            comm.broadcast_(ts, st["root"])
            got = [t.numpy() for t in ts]
            for g, x in zip(got, every[st["root"]]):
                np.testing.assert_array_equal(g, x, err_msg=where)
        elif op == "all_gather":
            n = sizes[0]
            out = torch.full((WORLD * n,), float("nan"))
            comm.all_gather_into_tensor(out, torch.from_numpy(mine[0]))
            got = [out.numpy()]
            np.testing.assert_array_equal(got[0], np.concatenate([e[0] for e in every]),
                                          err_msg=where)
        elif op == "reduce_scatter":
            m = sizes[0]
            src = [_data(seed, k, r, 1, WORLD * m) for r in range(WORLD)]
            out = torch.full((m,), float("nan"))
            comm.reduce_scatter_tensor(out, torch.from_numpy(src[rank]))
            got = [out.numpy()]
            want = sum(s.astype(np.float64) for s in src)[rank * m:(rank + 1) * m]
            _close(got[0], want, False, where)
        elif op == "per_rank":
            values = [0.0] * WORLD
            values[rank] = float(k * 10 + rank)
            got = [np.asarray(comm.all_reduce_per_rank_f64(values))]
            live = _accepted(comm)  # (a rank not accepted reads 0)
            assert got[0].tolist() == [float(k * 10 + r) if r in live else 0.0
                                       for r in range(WORLD)], where
        else:
            comm.barrier()
            got = []
        digests.append(hashlib.sha1(b"".join(np.ascontiguousarray(g).tobytes()
                                             for g in got)).hexdigest())
    comm.set_bf16_wire(False)
    return digests


def _same_bits(seed: int, program: list[dict], digests: list[list[str]],
               ranks: Sequence[int] = range(WORLD)) -> None:
    """Every rank of ``ranks`` (``digests``' ranks) got the same bits (a result that
    differs between ranks would fork them), but where each keeps its own by design: its
    part of a reduce-scatter, its tensors after a round that realized nothing."""
    for k, st in enumerate(program):
        if st["op"] == "reduce_scatter" or not any(st["weights"][r] for r in ranks):
            continue
        assert len({d[k] for d in digests}) == 1, (f"seed {seed} step {k} {st['op']}: "
                                                   f"ranks got different bits")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed, eager_bytes, direct", [
    (1, None, False),   # the default eager slot
    (2, 8192, False),   # a small slot: most sizes go bulk
    (3, 8192, True),    # and the largest ones direct
])
def test_a_random_program_of_every_collective_is_right_on_every_rank(seed, eager_bytes,
                                                                     direct):
    program = _program(seed)
    with FakeCohort(WORLD, eager_bytes=eager_bytes, direct=direct, timeout=60.0) as cohort:
        digests = cohort.run(lambda comm: _run_program(comm, comm.rank, seed, program))
    _same_bits(seed, program, digests)


def _rank_program(ctx, seed: int) -> list[str]:
    return _run_program(ctx.comm, ctx.rank, seed, _program(seed))


@pytest.mark.timeout(120)
def test_the_same_on_rank_processes_whose_large_rounds_read_each_other_s_tensors():
    """Processes of ``spawn`` (``max_failures=0``: large rounds run direct, each rank
    reading the others' private tensors through cross-memory attach)."""
    from flodl_shm import spawn

    seed = 4
    program = _program(seed)
    _same_bits(seed, program, spawn(_rank_program, WORLD, (seed,), timeout=60))


def _rank_program_dying(ctx, seed: int, victim: int, death: int, delay: float | None
                        ) -> list[str]:
    """``delay`` None: the victim kills itself before call ``death``; else a thread of
    its kills it ``delay`` seconds after that call started, wherever it is then."""
    def before_call(k: int) -> None:
        if k != death:
            return
        if delay is None:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=lambda: (time.sleep(delay), os.kill(os.getpid(),
                                                                    signal.SIGKILL)),
                         daemon=True).start()

    return _run_program(ctx.comm, ctx.rank, seed, _program(seed, victim, death),
                        before_call if ctx.rank == victim else None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed, mid_round", [(5, False), (6, False), (7, True), (8, True)])
def test_the_survivors_of_a_rank_killed_mid_program_go_on_right(seed, mid_round):
    """A rank is SIGKILLed (``spawn(max_failures=1)``) before a random call, or a random
    0-2 ms after it began, wherever the rank is then (in that call's round, or a later
    one's; where it lands is not measured): the survivors' rounds go on over the ranks
    each accepted (reports and per-rank values read zeros for the dead), whatever call
    comes next, every result still checked against numpy, and the same bits on both
    survivors."""
    from flodl_shm import spawn

    rng = random.Random(seed)
    victim, death = rng.randrange(WORLD), rng.randrange(10, STEPS - 40)
    delay = rng.uniform(0.0, 0.002) if mid_round else None
    digests = spawn(_rank_program_dying, WORLD, (seed, victim, death, delay), max_failures=1,
                    timeout=60, eager_bytes=8192)
    assert digests[victim] is None
    survivors = [r for r in range(WORLD) if r != victim]
    _same_bits(seed, _program(seed, victim, death), [digests[r] for r in survivors],
               survivors)


def _rank_program_across_hosts(ctx, seed: int) -> list[str]:
    return _run_program(ctx.comm, ctx.rank, seed, _program(seed, ops=ACROSS_HOSTS))


@pytest.mark.timeout(180)
def test_the_same_across_two_hosts_through_their_relays_and_the_controller():
    """Two hosts on loopback (two ranks and one), each host's rounds completed through
    its relay and the controller: the same program but round reports, the same checks."""
    from cluster_util import run_hosts

    seed = 9
    out, errors, ctl = run_hosts(_rank_program_across_hosts, [2, 1], args=(seed,),
                                 timeout=120)
    assert not errors, errors
    assert ctl.error is None
    _same_bits(seed, _program(seed, ops=ACROSS_HOSTS), [d for host in out for d in host])

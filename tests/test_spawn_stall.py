"""A rank that hangs: the supervisor blames and fences the missing rank, never the ranks
that waited for it, and ``spawn`` always returns or raises (``RankStalled``, which is a
``ReduceStall`` and a ``RankFailed``).

Every test checks on exit that no shared-memory segment of this process and no rank
process outlived it.
"""
from __future__ import annotations

import logging
import signal
import time

import pytest
import torch

import flodl_shm
from flodl_shm import RankFailed, RankStalled, ReduceStall, spawn

from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(240)
HANG_S = 600.0   # "forever": far beyond any test's bound
TIMEOUT = 1.0    # the collective timeout of these runs
BIG = 1 << 19    # f32 elements of a bulk round (2 MiB: past the eager size)


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    assert_no_leaks()


# --- rank functions (module level: they are pickled to the ranks) ---------------------------

def hang_before_round(ctx, victim, rnd, rounds):
    """Every rank all-reduces ``rounds`` small frames; ``victim`` hangs before ``rnd``."""
    out = []
    for i in range(rounds):
        if ctx.rank == victim and i == rnd:
            time.sleep(HANG_S)
        (t,) = ctx.comm.all_reduce_tensors([torch.full((4,), float(ctx.rank + 1))])
        out.append(float(t[0]))
    return out


def hang_in_reduce(ctx, victim, target_round):
    """Bulk rounds; ``victim`` hangs halfway through reducing its slice of round
    ``target_round`` (after arriving: the others wait for its slice, not its arrival)."""
    if ctx.rank == victim:
        def hook(where, rnd):
            if where == "reduce" and rnd == target_round:
                time.sleep(HANG_S)

        ctx.comm.set_fault_hook(hook)
    results = []
    for i in range(3):
        a = torch.full((BIG,), float(ctx.rank + 1) * (i + 1))
        mass = ctx.comm.all_reduce_([a])
        results.append((float(a[0]), float(a[-1]), mass))
    return results


def run_to_end(fn, nprocs, args, **kw):
    """``spawn(..., join=False)`` joined with a bound: the results, or a failed test (the
    cohort stopped either way)."""
    ctx = spawn(fn, nprocs, args, join=False, **kw)
    try:
        out = ctx.join(timeout=120)
        assert out is not None, "spawn did not return: the hung rank was never dealt with"
    finally:
        ctx.terminate()
        ctx.join()
    return out


# --- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_failures", [1, 2])
def test_hung_rank_is_fenced_not_the_ranks_waiting_for_it(tmp_path, max_failures):
    """Rank 2 hangs before round 2: it is the one killed and fenced; ranks 0 and 1 finish
    every round over the survivors and agree. With max_failures=2 (room to wrongly fence
    both waiters) ``spawn`` used to wait for the hung rank forever."""
    stem = tmp_path / "ckpt"
    out = run_to_end(hang_before_round, 3, (2, 2, 4), max_failures=max_failures,
                     timeout=TIMEOUT, save_path=stem)
    assert out[2] is None
    # rounds 0-1: (1+2+3)/3; rounds 2-3: (1+2)/2 over the survivors
    assert out[0] == out[1] == [2.0, 2.0, 1.5, 1.5]
    record = flodl_shm.RankDeathRecord.read_from_file(
        flodl_shm.CheckpointBundle.rank_death_path(stem, 2))
    assert record.rank == 2 and "round 2 stalled" in record.error


def test_hung_rank_beyond_max_failures_raises_reduce_stall_naming_it(caplog):
    """Without a failure budget the run stops with a ``ReduceStall`` (``except
    ReduceStall`` catches it) naming the round and the rank that never arrived. The
    launcher's log says it in one line; the explanation is the exception's (it was said
    twice)."""
    with caplog.at_level(logging.ERROR, logger="flodl_shm"):
        with pytest.raises(ReduceStall) as info:
            spawn(hang_before_round, 3, (2, 2, 4), timeout=TIMEOUT)
    err = info.value
    [line] = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert line.startswith("round 2 stalled on rank(s) [2], killed by the launcher; ")
    assert line.endswith(": stopping the cohort") and "waited for" not in line
    assert isinstance(err, RankStalled) and isinstance(err, RankFailed)
    assert err.round == 2 and err.missing == (2,) and err.timeout == TIMEOUT
    assert err.rank == 2 and err.signal == "SIGKILL"
    assert "round 2" in str(err) and "[2]" in str(err) and "[0, 1] waited" in str(err)
    assert str(err).endswith("(exc_type=ReduceStall, signal=SIGKILL)")  # as RankFailed's


def test_rank_hung_mid_reduce_is_fenced_and_its_slice_taken_over():
    """Rank 2 hangs inside its slice of bulk round 1 (it had arrived): it is the culprit;
    the survivors take its slice over and round 1 still includes its contribution."""
    out = run_to_end(hang_in_reduce, 3, (2, 1), max_failures=1, timeout=TIMEOUT)
    assert out[2] is None and out[0] == out[1]
    # round 0: all three; round 1: all three (rank 2 arrived); round 2: survivors only
    assert out[0] == [(2.0, 2.0, 3.0), (4.0, 4.0, 3.0), (4.5, 4.5, 2.0)]


def test_stall_error_survives_pickling():
    import pickle

    err = RankStalled("round 3 stalled", round=3, missing=(1, 2), timeout=2.0)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, RankStalled)
    assert (back.round, back.missing, back.timeout, back.rank, back.signal) == \
        (3, (1, 2), 2.0, 1, signal.Signals.SIGKILL.name)
    assert str(back) == str(err) == "round 3 stalled (exc_type=ReduceStall, signal=SIGKILL)"
    assert back.why == "round 3 stalled"

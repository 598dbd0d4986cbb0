"""Every error that carries more than a message pickles back whole: a process pool or a
job system (and the launchers' own pipes) hands it to another process."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from flodl_shm.errors import (PeerDied, RankFailed, RankStalled, ReduceStall, SeriesInUse,
                              TrainingAborted)
from flodl_shm.training.trainer import TrainResult


def _errors():
    result = TrainResult({}, [], None, Path("runs/demo/ckpt-r00000003.fdl"), (1,))
    return [
        ReduceStall("round 7 stalled", round=7, missing=(1, 2), timeout=3.0),
        ReduceStall("round 7 stalled across hosts", round=7, missing=(0,), timeout=3.0,
                    global_ranks=True),
        RankFailed(1, "ValueError", "Traceback ...\nValueError: bad"),
        RankFailed(2, None, "", "SIGKILL", -9),
        RankStalled("ranks [1] stalled", round=4, missing=(1,), timeout=2.0),
        TrainingAborted("1 rank died ([1])", result, "Continue with trainer.resume('r')."),
        PeerDied("rank 0 (pid 7) died", 0, 7, host_ranks=(0, 1, 2)).with_missing((2,)),
        SeriesInUse("runs/demo/ckpt.lock", "pid 7 on host a since 2026-12-02 21:00:00",
                    "cafe"),
    ]


@pytest.mark.parametrize("err", _errors(), ids=lambda e: type(e).__name__)
def test_an_error_pickles_back_with_its_message_and_attributes(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    for name in ("round", "missing", "timeout", "rank", "exc_type", "traceback", "signal",
                 "exitcode", "summary", "resume_hint", "checkpoint", "dead_ranks", "pid",
                 "host_ranks", "lock", "holder", "job", "error", "global_ranks"):
        assert getattr(back, name, None) == getattr(err, name, None), name


def test_a_rank_s_message_of_several_lines_keeps_them_all():
    """A probe read 'rank 1 raised SchemaMismatchError: round 6: ... setting):' and
    nothing after the colon: the per-rank lines that say what differed were left to the
    remote traceback at the end."""
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
          "flodl_shm.errors.SchemaMismatchError: round 6: ranks differ:\n"
          "  rank 0: 2 tensors\n  rank 1: 1 tensor\n")
    err = RankFailed(1, "SchemaMismatchError", tb)
    assert err.error == "round 6: ranks differ:"
    head = str(err).split("\n\n--- remote traceback")[0]
    assert head == ("rank 1 raised SchemaMismatchError: round 6: ranks differ:\n"
                    "  rank 0: 2 tensors\n  rank 1: 1 tensor"
                    " (exc_type=SchemaMismatchError, signal=None)")
    many = RankFailed(0, "ValueError", "ValueError: head\n" + "\n".join(
        f"line {i}" for i in range(40)))
    lines = str(many).split("\n\n--- remote traceback")[0].splitlines()
    assert lines[-2] == "line 15" and lines[-1].startswith("... 24 more lines in the remote")


def test_a_stall_has_every_attribute_of_a_rank_failure():
    """The demo read ``RankFailed.error`` of a ``RankStalled`` (a cluster round that
    stalled) and printed an AttributeError traceback under the stall's own message."""
    from flodl_shm.cli.demo import _reason

    err = RankStalled("rank 0 gave up waiting: round 0 stalled", round=0, missing=(1,),
                      timeout=15.0)
    plain = RankFailed(1, "ValueError", "Traceback ...\nValueError: bad")
    assert {k for k in vars(plain) if not k.startswith("_")} <= set(vars(err))
    assert _reason(err) == "RankStalled: rank 0 gave up waiting: round 0 stalled"

"""Kill and resume, on real rank processes: every sample of every epoch is realized
exactly once across the runs (counting the interrupted run only up to the checkpoint
it is resumed from), and a run killed and resumed ends at the same weights as an
uninterrupted one.

Samples are recorded by a hook at each window's end, which a rank reaches only
after its work entered the consensus: a rank killed mid-window records nothing for
that window, exactly as its work is not realized.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flodl_shm.checkpoint.meta import CheckpointBundle, CheckpointMeta, SaveReason
from flodl_shm.checkpoint.series import (committed_checkpoints, latest_checkpoint,
                                         round_model_path)
from flodl_shm.engine.segment import list_segments
from flodl_shm.training.trainer import TrainingAborted

from trainer_util import (no_leaks,  # noqa: F401 - autouse fixture
                          KillAt, RecordSamples, assert_each_epoch_once, make_trainer,
                          read_samples, sgd_momentum, step_lr)

pytestmark = pytest.mark.timeout(150)
HERE = os.path.dirname(os.path.abspath(__file__))

# 256 samples, batch 8: 32 batches per epoch; 2 ranks x 2 batches: 8 windows per epoch


def records_up_to(records, last_window):
    return [r for r in records if r[0] <= last_window]


def test_a_rank_killed_mid_epoch_is_covered_by_the_survivors(tmp_path, caplog):
    """max_failures=1: rank 1 dies in the middle of window 3; its unrealized chunk goes
    back to the pool and rank 0 trains it later in the epoch."""
    caplog.set_level("WARNING", logger="flodl_shm")
    rec = tmp_path / "rec"
    rec.mkdir()
    trainer = make_trainer(epochs=1, max_failures=1, save_path=tmp_path / "ck",
                           checkpoint_every=4, keep_checkpoints=5,
                           hooks=[RecordSamples(rec), KillAt(rank=1, window=3, batch=1)])
    result = trainer.run(2)
    assert result.dead_ranks == (1,)
    assert "rank 1 failed (SIGKILL); continuing on realized work with the survivors (1 of " \
        "max_failures=1 used)" in caplog.text
    records = read_samples(rec)
    assert {w for w, _, r, _ in records if r == 1} == {1, 2}, "rank 1 realized windows 1-2"
    assert_each_epoch_once(records, epochs=1, batch_size=8)
    hist = result.history
    assert hist[2].cohort_batches == (2, 0) and hist[2].live_ranks == (0,)
    assert result.meta.global_step == 32 and result.meta.world_size_at_save == 1
    assert result.reason is SaveReason.GRACEFUL_SHUTDOWN
    # windows are 32 samples: window 3 dispatched 64-79 (rank 0) and 80-95 (rank 1, lost);
    # window 4 trained 96-111 on rank 0 alone. Its checkpoint lists the lost chunk as
    # uncovered next to the never-dispatched rest.
    meta4 = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(
        round_model_path(tmp_path / "ck", 4)))
    assert meta4.world_size_at_save == 1 and meta4.global_step == 4 + 4 + 2 + 2
    assert meta4.coverage.per_epoch[0].uncovered_ranges == [(80, 16), (112, 144)]


def test_too_many_deaths_save_then_resume_covers_the_rest_once(tmp_path, caplog):
    """max_failures=0: rank 1 dies in window 3; the survivor saves a
    max_failure_exceeded checkpoint at that very window and the run raises; resuming
    on two ranks trains exactly the samples not yet realized. The launcher's line
    names the Trainer's budget, not the one it keeps the survivor running with."""
    caplog.set_level("WARNING", logger="flodl_shm")
    rec = tmp_path / "rec"
    rec.mkdir()
    stem = tmp_path / "ck"
    first = make_trainer(epochs=2, save_path=stem, checkpoint_every=5,
                         hooks=[RecordSamples(rec), KillAt(rank=1, window=3, batch=1)])
    with pytest.raises(TrainingAborted) as info:
        first.run(2)
    err = info.value
    assert err.dead_ranks == (1,) and err.checkpoint.name == "ck-r00000003.fdl"
    assert "max_failures=0" in str(err) and "SIGKILL" in str(err)
    assert "\nrank 1 was killed by signal SIGKILL" in str(err)  # (it read "rank 1: rank 1 ...")
    assert str(err).endswith(f"\nContinue with trainer.resume({str(stem)!r}) (on the 1 rank "
                             f"alive at the save), or trainer.resume({str(stem)!r}, nprocs=2) "
                             f"on 2 again.")
    assert "trainer.resume" not in err.summary and err.resume_hint in str(err)
    assert "rank 1 failed (SIGKILL); 1 failure, more than max_failures=0: the survivors " \
        "save a checkpoint of the realized work, if any, and stop" in caplog.text
    assert "max_failures=1" not in caplog.text and "continuing" not in caplog.text
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(err.checkpoint))
    assert meta.save_reason is SaveReason.MAX_FAILURE_EXCEEDED
    assert (meta.epoch, meta.global_step, meta.sync_round, meta.world_size_at_save) == \
        (0, 4 + 4 + 2, 3, 1)
    run1 = read_samples(rec)
    for p in rec.iterdir():
        p.unlink()
    second = make_trainer(epochs=2, save_path=stem, checkpoint_every=5,
                          hooks=[RecordSamples(rec)])
    caplog.set_level("INFO", logger="flodl_shm")
    result = second.resume(nprocs=2)
    assert f"resuming from {err.checkpoint} on 2 ranks: epoch 0" in caplog.text
    # (rank 1 was dead at the save: it starts fresh beside rank 0, and says so; an operator
    # probe's cluster host did so silently)
    fresh = [r for r in caplog.records if "rank 1's inner optimizer" in r.getMessage()]
    assert [r.levelname for r in fresh] == ["WARNING"], caplog.text
    assert ("the bundle was saved by 1 live rank and holds none of rank 1's state: a partial "
            "copy, or a rank dead at the save") in fresh[0].getMessage()
    assert result.history[0].window == 4 and result.history[0].global_step == 14
    assert result.meta.global_step == 64 and result.reason is SaveReason.GRACEFUL_SHUTDOWN
    assert_each_epoch_once(records_up_to(run1, 3) + read_samples(rec), epochs=2,
                           batch_size=8)


def _run_driver(spec: dict) -> tuple[int, int, str]:
    """Run ``trainer_util.drive(spec)`` in a launcher subprocess: (pid, returncode, stderr)."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import trainer_util; "
            f"trainer_util.drive({json.dumps(json.dumps(spec))})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    return proc.pid, proc.returncode, err


def test_whole_run_killed_then_resumed_matches_the_uninterrupted_run(tmp_path):
    """The launcher is SIGKILLed in window 11 (its ranks die with it); resuming from the
    window-9 checkpoint replays windows 10-16 exactly: same samples on the same ranks,
    same seeds, and each rank's inner optimizer state (SGD momentum), LR schedule (a
    StepLR stepped per batch) and integer buffers (BatchNorm's num_batches_tracked)
    from its .rank<N>.optim, so the final state is bit-identical to an uninterrupted
    run's."""
    for d in ("rec_full", "rec1", "rec2"):
        (tmp_path / d).mkdir()
    _, code, err = _run_driver({"records": str(tmp_path / "rec_full"), "momentum": True,
                                "scheduler": True,
                                "save_path": str(tmp_path / "full"), "every": 3, "nprocs": 2,
                                "out": str(tmp_path / "full.pt")})
    assert code == 0, err[-3000:]
    stem = tmp_path / "killed"
    pid, code, err = _run_driver({
        "records": str(tmp_path / "rec1"), "save_path": str(stem), "every": 3, "nprocs": 2,
        "out": str(tmp_path / "never.pt"), "momentum": True, "scheduler": True,
        "kill": {"rank": 0, "window": 11, "batch": 0, "target": "launcher",
                 "wait_for": str(CheckpointBundle.meta_path(round_model_path(stem, 9)))}})
    assert code == -9, err[-3000:]
    assert not (tmp_path / "never.pt").exists()
    assert [s for s in list_segments() if s.owner_pid == pid], \
        "the killed launcher could not unlink its segments (the next spawn reaps them)"
    assert [r for r, _ in committed_checkpoints(stem)][-1] == 9

    assert {p.name for p in tmp_path.glob("killed-r00000009.rank*.optim")} == \
        {"killed-r00000009.rank0.optim", "killed-r00000009.rank1.optim"}
    trainer = make_trainer(sgd_momentum, scheduler_fn=step_lr, save_path=stem,
                           checkpoint_every=3, hooks=[RecordSamples(tmp_path / "rec2")])
    result = trainer.resume()
    assert result.history[0].window == 10 and result.meta.sync_round == 16
    # coverage: run 1 up to its checkpoint, then run 2
    assert_each_epoch_once(records_up_to(read_samples(tmp_path / "rec1"), 9)
                           + read_samples(tmp_path / "rec2"), epochs=2, batch_size=8)
    # the resumed run trained what the uninterrupted one did in windows 10-16
    full_tail = sorted((w, r, tuple(ids)) for w, _, r, ids in read_samples(tmp_path / "rec_full")
                       if w >= 10)
    resumed = sorted((w, r, tuple(ids)) for w, _, r, ids in read_samples(tmp_path / "rec2"))
    assert full_tail == resumed
    want = torch.load(tmp_path / "full.pt")
    got = result.state_dict
    assert sorted(got) == sorted(want) and any(not v.is_floating_point() for v in want.values())
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after resume"
    assert not [s for s in list_segments() if s.owner_pid == pid], \
        "resume's spawn reaped the dead launcher's segments"


def test_resuming_from_an_older_bundle_refuses_the_newer_ones_unless_overwrite(tmp_path):
    """A run resumed from an older bundle of its own series would keep the newer ones
    (an abandoned branch) outranking its own checkpoints: a crash before it passed
    their rounds would resume the old branch. Refused, naming the newest, unless
    overwrite=True, which deletes them."""
    stem = tmp_path / "ck"
    make_trainer(epochs=2, save_path=stem, checkpoint_every=3, keep_checkpoints=8).run(2)
    rounds = [r for r, _ in committed_checkpoints(stem)]
    assert rounds[:2] == [3, 6] and rounds[-1] > 6
    old = round_model_path(stem, 3)
    second = make_trainer(epochs=2, save_path=stem, checkpoint_every=3, keep_checkpoints=8)
    newest = round_model_path(stem, rounds[-1]).name
    with pytest.raises(FileExistsError, match=rf"newest: {re.escape(newest)}.*overwrite=True"):
        second.resume(old, nprocs=2)
    assert [r for r, _ in committed_checkpoints(stem)] == rounds  # nothing touched
    result = second.resume(old, nprocs=2, overwrite=True)
    assert result.history[0].window == 4
    after = [r for r, _ in committed_checkpoints(stem)]
    assert after[0] == 3 and after[-1] == rounds[-1]  # the branch's own, up to the end
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(result.checkpoint))
    assert meta.sync_round == rounds[-1] and result.checkpoint == latest_checkpoint(stem)


def test_a_checkpoint_cut_short_leaves_no_rank_state_in_its_rounds_next_commit(tmp_path):
    """A 2-rank checkpoint of round 6 cut short leaves both ranks' .optim; a 1-rank resume
    of round 3 commits round 6 again with its own rank 0 file. Rank 1's file of the
    cut-short save used to stay in that bundle, for a later 2-rank resume to restore as
    rank 1's optimizer state; a resume clears the failed writes beyond its bundle at
    its start."""
    stem = tmp_path / "ck"
    make_trainer(epochs=1, save_path=stem, checkpoint_every=3, keep_checkpoints=8).run(2)
    assert [r for r, _ in committed_checkpoints(stem)] == [3, 6, 8]
    for f in tmp_path.glob("ck-r0000000[68].*"):  # killed while saving round 6: its
        if not f.name.startswith("ck-r00000006.rank"):  # ranks' states only, no round 8
            f.unlink()
    make_trainer(epochs=1, save_path=stem, checkpoint_every=3, keep_checkpoints=8).resume(
        stem, nprocs=1)
    assert (tmp_path / "ck-r00000006.meta.json").exists()
    assert not (tmp_path / "ck-r00000006.rank1.optim").exists()


def test_a_resume_by_a_trainer_without_save_path_warns_it_saves_nothing(tmp_path, caplog):
    """Trainer(save_path=None).resume(stem) trains on with no checkpoint: a crash loses
    the whole resumed run, which used to happen without a word."""
    caplog.set_level("WARNING", logger="flodl_shm")
    stem = tmp_path / "ck"
    make_trainer(epochs=1, save_path=stem).run(1)
    result = make_trainer(epochs=2).resume(stem, nprocs=1)
    assert result.checkpoint is None and len(result.history) > 0
    assert (f"this Trainer has no save_path: the resumed run writes no checkpoint, so a crash "
            f"loses all of it; build the Trainer with save_path={str(stem)!r}") in caplog.text


def test_a_last_checkpoint_that_failed_to_write_is_not_reported_as_written(tmp_path, caplog,
                                                                             monkeypatch):
    """The final bundle's write fails (a full disk): the run used to return
    result.checkpoint naming a bundle with no .meta.json (the demo then printed it as
    'its last checkpoint'); it names the newest committed bundle and says why."""
    import flodl_shm.checkpoint.forge as forge

    real = forge.write_consensus_fdl

    def full_disk_at_the_end(schema, payloads, path):
        if str(path).endswith("-r00000008.fdl"):
            raise OSError(28, "No space left on device")
        return real(schema, payloads, path)

    monkeypatch.setattr(forge, "write_consensus_fdl", full_disk_at_the_end)
    caplog.set_level("ERROR", logger="flodl_shm")
    stem = tmp_path / "ck"
    result = make_trainer(epochs=1, save_path=stem, checkpoint_every=3).run(2)
    assert result.checkpoint == round_model_path(stem, 6), result.checkpoint
    assert (f"the run's last checkpoint {round_model_path(stem, 8)} was not written (its write "
            f"failed: see the errors above); the newest on disk is "
            f"{round_model_path(stem, 6)}") in caplog.text
    # the failed bundle's files (names, the ranks' states) went with the run's end: on a
    # full disk they held the space a recovery needs
    assert not list(tmp_path.glob("ck-r00000008.*")), list(tmp_path.glob("ck-r00000008.*"))
    monkeypatch.undo()
    (tmp_path / "ck-r00000009.rank1.optim").write_bytes(b"left by a crash")
    again = make_trainer(epochs=1, save_path=stem, checkpoint_every=3).resume(nprocs=2)
    assert again.checkpoint == round_model_path(stem, 8) and again.history[0].window == 7
    assert not list(tmp_path.glob("ck-r00000009.*"))


def test_the_reporting_rank_dying_after_the_last_window_leaves_a_survivor_to_report(tmp_path):
    """Rank 0, the one that reports, fails after the last window's books (a full disk
    writing its state, here a hook): within max_failures=1 rank 1 reports the run. The
    survivor took rank 0 for alive and for the reporter, and the run ended 'no rank
    returned the final model (every rank failed)'."""
    from trainer_util import DieAtWindowEnd

    result = make_trainer(epochs=1, save_path=tmp_path / "ck", checkpoint_every=3,
                          max_failures=1, hooks=[DieAtWindowEnd(0, 8)]).run(2)
    assert result.history[-1].window == 8 and result.state_dict is not None
    assert result.dead_ranks == (0,)


def test_resuming_a_finished_run_says_so_and_returns_its_checkpoint(tmp_path, caplog):
    """A resume of a run that trained all its epochs trains nothing: it says so (and how
    to continue), and its result names the bundle it resumed from."""
    caplog.set_level("INFO", logger="flodl_shm")
    stem = tmp_path / "ck"
    first = make_trainer(epochs=1, save_path=stem).run(2)
    again = make_trainer(epochs=1, save_path=stem).resume()
    assert again.history == [] and again.checkpoint == first.checkpoint
    assert again.meta.global_step == first.meta.global_step
    assert f"{first.checkpoint} finished 1 epoch, and this Trainer has epochs=1: nothing " \
        "left to train (pass a larger epochs to continue)" in caplog.text
    for k, v in again.state_dict.items():
        assert torch.equal(v, first.state_dict[k]) or not v.is_floating_point(), k


def test_a_bundle_missing_a_rank_s_state_or_holding_another_s_is_said_or_refused(tmp_path,
                                                                                  caplog):
    """A probe deleted one rank's .optim from a committed bundle of a cohort of the same
    size (a partial copy): the resume was not exact and said so only at INFO, which the
    demo does not show. A .optim copied over another rank's gave that rank the other's
    optimizer state and RNG, silently; one of another save than its .meta.json commits
    was taken too. The first is a warning, the other two are refused."""
    stem = tmp_path / "ck"
    make_trainer(sgd_momentum, epochs=1, save_path=stem, checkpoint_every=3,
                 keep_checkpoints=8).run(2)
    newest = latest_checkpoint(stem)
    rank0 = CheckpointBundle.rank_state_path(newest, 0)
    rank1 = CheckpointBundle.rank_state_path(newest, 1)
    saved1 = rank1.read_bytes()

    rank1.write_bytes(rank0.read_bytes())   # a copy of rank 0's file
    with pytest.raises(Exception, match=rf"{re.escape(str(rank1))} holds rank 0's state, not "
                                        rf"rank 1's: the bundle's rank files were copied"):
        make_trainer(sgd_momentum, epochs=2, save_path=stem, checkpoint_every=3).resume(
            stem, nprocs=2)
    older = round_model_path(stem, 3)       # another save's file, renamed into this bundle
    rank1.write_bytes(CheckpointBundle.rank_state_path(older, 1).read_bytes())
    with pytest.raises(Exception, match=r"holds sync round 3 but .*marks round 8 complete"):
        make_trainer(sgd_momentum, epochs=2, save_path=stem, checkpoint_every=3).resume(
            stem, nprocs=2)
    rank1.write_bytes(saved1)  # (else rank 1's refusal may come first, naming its own file)

    buffer = torch.load(rank0, weights_only=False)["optimizer"]["state"][0]["momentum_buffer"]
    saved0 = rank0.read_bytes()
    raw = bytearray(saved0)                 # damaged on disk (a probe: loaded silently)
    at = bytes(raw).find(buffer.numpy().tobytes())
    raw[at:at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    rank0.write_bytes(bytes(raw))
    with pytest.raises(Exception, match=rf"{re.escape(str(rank0))} is damaged: its values do "
                                        rf"not match the checksum written with them"):
        make_trainer(sgd_momentum, epochs=2, save_path=stem, checkpoint_every=3).resume(
            stem, nprocs=2)
    rank0.write_bytes(saved0)
    caplog.set_level("INFO", logger="flodl_shm")
    rank1.unlink()                          # lost in a partial copy
    make_trainer(sgd_momentum, epochs=2, save_path=stem, checkpoint_every=3,
                 keep_checkpoints=8).resume(newest, nprocs=2)
    said = [r for r in caplog.records if "rank 1's inner optimizer" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], caplog.text
    assert "saved by 2 live ranks and holds none of rank 1's state" in said[0].getMessage()
    assert "rank 0's inner optimizer" not in caplog.text


def test_a_cohort_of_another_size_starts_its_inner_state_fresh_in_one_line(tmp_path, caplog):
    """Growing the cohort is not damage; it was said once per rank, at mixed levels (a
    WARNING from each rank the saving cohort had, an INFO from each new one). One line
    says it for every rank, and the resume line names the save's reason in words."""
    stem = tmp_path / "ck"
    make_trainer(sgd_momentum, epochs=1, save_path=stem, checkpoint_every=3).run(1)
    caplog.set_level("INFO", logger="flodl_shm")
    make_trainer(sgd_momentum, epochs=2, save_path=stem, checkpoint_every=3).resume(
        stem, nprocs=3)
    said = [r for r in caplog.records if "inner optimizer" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], caplog.text
    assert ("was written by a cohort of 1 rank, this one has 3: every rank's inner optimizer, "
            "LR schedule and integer buffers start fresh") in said[0].getMessage()
    assert "(the run's last)" in caplog.text and "graceful_shutdown" not in caplog.text

"""The checkpoint series (one bundle per checkpointed window) and the Trainer's
argument checks - files and objects only, no processes."""
from __future__ import annotations

import functools
import os
import re

import pytest
import torch

from flodl_shm.checkpoint.meta import CheckpointBundle, CheckpointMeta, SaveReason
from flodl_shm.checkpoint.run_lock import run_lock_path
from flodl_shm.checkpoint.series import (committed_checkpoints, death_record_path, delete_series,
                                         latest_checkpoint, not_continued, prune_series,
                                         resolve_checkpoint, round_model_path)
from flodl_shm.training.rank_run import window_seed
from flodl_shm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(30)


def bundle(stem, rnd, *, meta=True, outer=False, tmp=False, ranks=0):
    model = round_model_path(stem, rnd)
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"model")
    if outer:
        model.with_name(model.name.replace(".fdl", ".outer.fdl")).write_bytes(b"m")
    for r in range(ranks):  # each rank's own state (the Trainer's and LocalSGD's)
        model.with_name(model.name.replace(".fdl", f".rank{r}.optim")).write_bytes(b"s")
    if meta:
        CheckpointMeta.new(0, rnd, rnd, 2, SaveReason.CHECKPOINT).write_to_file(
            model.with_name(model.name.replace(".fdl", ".meta.json")))
    if tmp:
        model.with_name(model.name + ".tmp").write_bytes(b"torn")
    return model


def test_round_paths_share_a_stem_whatever_the_extension(tmp_path):
    assert round_model_path(tmp_path / "ck", 12).name == "ck-r00000012.fdl"
    assert round_model_path(tmp_path / "ck.fdl", 12) == round_model_path(tmp_path / "ck", 12)
    dotted = tmp_path / "run.v2" / "ck"
    assert round_model_path(dotted, 3) == dotted.parent / "ck-r00000003.fdl"
    assert round_model_path(tmp_path / "ck", 123_456_789).name == "ck-r123456789.fdl"


def test_save_paths_that_differ_after_a_dot_are_two_series(tmp_path):
    """Only a model extension is dropped from a save path: a sweep's ``runs/lr0.1`` and
    ``runs/lr0.01`` used to be one series ``runs/lr0-r*`` (the second run refused as
    'an earlier run's', or deleting the first's bundles with overwrite=True), sharing
    one run lock and one set of death records."""
    a, b = tmp_path / "lr0.1", tmp_path / "lr0.01"
    assert round_model_path(a, 4).name == "lr0.1-r00000004.fdl"
    assert round_model_path(b, 4).name == "lr0.01-r00000004.fdl"
    assert run_lock_path(a) != run_lock_path(b)
    assert death_record_path(a, 1).name == "lr0.1.rank1.death.json"
    assert death_record_path(tmp_path / "ck.fdl", 1).name == "ck.rank1.death.json"
    bundle(a, 4)
    assert latest_checkpoint(b) is None and not_continued(b) == (0, [])
    assert latest_checkpoint(a) == round_model_path(a, 4)
    assert delete_series(b) == 0 and latest_checkpoint(a) is not None


def test_latest_is_the_highest_committed_round(tmp_path):
    stem = tmp_path / "ck"
    assert latest_checkpoint(stem) is None
    bundle(stem, 3)
    bundle(stem, 6, outer=True)
    bundle(stem, 9, meta=False)                  # its write never finished
    bundle(tmp_path / "other", 12)               # another series
    assert [r for r, _ in committed_checkpoints(stem)] == [3, 6]
    assert latest_checkpoint(stem) == round_model_path(stem, 6)
    assert resolve_checkpoint(stem) == round_model_path(stem, 6)
    assert resolve_checkpoint(tmp_path / "ck.fdl") == round_model_path(stem, 6)
    assert resolve_checkpoint(round_model_path(stem, 3)) == round_model_path(stem, 3)
    meta3 = tmp_path / "ck-r00000003.meta.json"
    assert resolve_checkpoint(meta3) == round_model_path(stem, 3)
    with pytest.raises(FileNotFoundError, match="never committed"):
        resolve_checkpoint(round_model_path(stem, 9))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "nothing")
    # a round's bundle that is not there is named, with the series' newest (every caller:
    # Trainer.resume, LocalSGD.load)
    with pytest.raises(FileNotFoundError, match=rf"ck-r00000012\.fdl does not exist; the newest "
                                                rf"complete checkpoint of that series is "
                                                rf"{re.escape(str(round_model_path(stem, 6)))}$"):
        resolve_checkpoint(round_model_path(stem, 12))
    # given the folder (or a wrong stem), the error names the series it holds
    for wrong in (tmp_path, tmp_path / "nothing"):
        with pytest.raises(FileNotFoundError, match=rf"not its folder.*holds the series "
                                                    rf"'{tmp_path / 'ck'}', '{tmp_path / 'other'}'"):
            resolve_checkpoint(wrong)


def test_prune_keeps_the_newest_and_drops_failed_writes(tmp_path):
    stem = tmp_path / "ck"
    for rnd in (2, 4, 6):
        bundle(stem, rnd, outer=True, ranks=2 if rnd != 4 else 0)
    bundle(stem, 5, meta=False, tmp=True)       # failed write, older than the newest
    (tmp_path / "ck-r00000003.rank1.optim").write_bytes(b"s")  # a rank's file, nothing else
    bundle(stem, 8, meta=False, ranks=1)        # maybe still being written: untouched
    assert prune_series(stem, keep=2) == [2, 3, 5]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["ck-r00000004.fdl", "ck-r00000004.meta.json", "ck-r00000004.outer.fdl",
                    "ck-r00000006.fdl", "ck-r00000006.meta.json", "ck-r00000006.outer.fdl",
                    "ck-r00000006.rank0.optim", "ck-r00000006.rank1.optim",
                    "ck-r00000008.fdl", "ck-r00000008.rank0.optim"]
    assert prune_series(stem, keep=0) == [4], "at least the newest is always kept"
    (tmp_path / "ck.rank1.death.json").write_text("{}")
    assert delete_series(stem) == 2
    assert list(tmp_path.iterdir()) == []


def make_model():
    return torch.nn.Linear(2, 2)


class GateModel(torch.nn.Module):
    """make_model's shapes (a [2, 2] weight and a [2] bias) under other names."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.zeros(2, 2))
        self.shift = torch.nn.Parameter(torch.zeros(2))


def test_prune_reads_its_folder_once(tmp_path, monkeypatch):
    """A soak probe: a save into a folder of 20,000 files took 112 ms, against 4 ms in an
    empty one: a prune listed the folder again for each file of each bundle it removed
    (to find their writers' stale temps). It reads the listing once."""
    import flodl_shm.checkpoint.series as series

    stem = tmp_path / "ck"
    for rnd in (2, 4, 6, 8):
        bundle(stem, rnd, outer=True, ranks=2)
    bundle(stem, 5, meta=False, tmp=True)
    listed = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(path) or real(path))
    assert series.prune_series(stem, keep=1) == [2, 4, 5, 6]
    assert listed == [tmp_path]
    assert [r for r, _ in committed_checkpoints(stem)] == [8]


def test_trainer_arguments_are_checked_up_front(tmp_path):
    args = (make_model, functools.partial(torch.optim.SGD, lr=0.1),
            (torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)), torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match="needs a save_path"):
        Trainer(*args, checkpoint_every=5)
    with pytest.raises(ValueError, match="cadence"):
        Trainer(*args, cadence="fastest")
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(*args, batch_size=0)
    with pytest.raises(ValueError, match="max_failures"):
        Trainer(*args, max_failures=-1)
    with pytest.raises(ValueError, match="ends with a separator"):
        Trainer(*args, save_path=f"{tmp_path}/runs/")
    with pytest.raises(ValueError, match="needs a save_path"):
        Trainer(*args).resume()
    bundle(tmp_path / "ck", 4)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        Trainer(*args, save_path=tmp_path / "ck").run(2)


def test_window_seeds_are_distinct_and_stable():
    seeds = {window_seed(42, r, w) for r in range(4) for w in range(1, 50)}
    assert len(seeds) == 4 * 49
    assert window_seed(42, 1, 7) == window_seed(42, 1, 7)
    assert all(0 <= s < 2 ** 63 for s in seeds)


def test_what_a_run_does_not_continue(tmp_path, monkeypatch):
    """A fresh run continues nothing; a run resumed from round 3 of the series continues
    it after round 3, however either path is spelled; a bundle of another series
    continues nothing of this one."""
    stem = tmp_path / "ck"
    for rnd in (3, 6, 9):
        bundle(stem, rnd)
    bundle(tmp_path / "other", 12)
    models = [round_model_path(stem, r) for r in (3, 6, 9)]
    assert not_continued(stem) == (0, models)
    assert not_continued(stem, models[0]) == (3, models[1:])
    assert not_continued(stem, models[2]) == (9, [])
    monkeypatch.chdir(tmp_path)  # a relative save path, an absolute bundle path
    assert not_continued("ck", models[0])[0] == 3
    assert not_continued(stem, round_model_path(tmp_path / "other", 12)) == (0, models)


def test_integer_arguments_are_checked_for_their_type_too(tmp_path):
    """An int argument given as a str (or a float, or a bool) is named with its value and
    its limit, not left to fail on arithmetic (``batch_size % accumulate``)."""
    args = (make_model, functools.partial(torch.optim.SGD, lr=0.1),
            (torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)), torch.nn.functional.mse_loss)
    for name, bad, limit in (("batch_size", "32", ">= 1"), ("epochs", 1.5, ">= 0"),
                             ("sync_every", True, ">= 1"), ("accumulate", "2", ">= 1"),
                             ("keep_checkpoints", 2.0, ">= 1"), ("max_failures", "1", ">= 0"),
                             ("seed", "42", ">= 0"), ("log_every", 0, ">= 1 or None")):
        with pytest.raises(ValueError, match=rf"^{name} must be an int {limit}, got "
                                             rf"{re.escape(repr(bad))}$"):
            Trainer(*args, **{name: bad})
    for i, bad, said in ((0, None, "model_fn must be a picklable () -> model callable, got "
                                   "NoneType"),
                         (0, torch.nn.Linear(2, 2), "model_fn must build the model in each "
                                                    "rank, got a Linear instance"),
                         (1, "sgd", "optimizer_fn must be a picklable parameters -> optimizer "
                                    "callable, got str"),
                         (3, 5, "loss_fn must be a picklable (output, target) -> loss "
                                "callable, got int")):
        wrong = list(args)
        wrong[i] = bad  # these failed in the ranks (StartRefused, or RankFailed mid-run)
        with pytest.raises(TypeError, match=f"^{re.escape(said)}"):
            Trainer(*wrong)
    with pytest.raises(TypeError, match=r"^outer must be None, OuterAvg\(\) or "
                                        r"OuterNesterov\(\.\.\.\), got str$"):
        Trainer(*args, outer="nesterov")
    with pytest.raises(ValueError, match=r"^seed must be below 2\*\*63 .* got "
                                         r"2361183241434822606848$"):
        Trainer(*args, seed=1 << 71)  # torch's 'Overflow when unpacking long long', in a rank
    with pytest.raises(ValueError, match=r"^checkpoint_every must be an int >= 1 or None, "
                                         r"got '5'$"):
        Trainer(*args, checkpoint_every="5", save_path=tmp_path / "ck")
    for name, bad in (("timeout", "60"), ("gamma", "1"), ("clip_grad_norm", "1.0")):
        with pytest.raises(ValueError, match=rf"^{name} must be a .*number.*got '"):
            Trainer(*args, **{name: bad})
    with pytest.raises(ValueError, match=r"^nprocs must be an int >= 1, got '2'$"):
        Trainer(*args, batch_size=4).run("2")
    import numpy as np

    assert Trainer(*args, batch_size=np.int64(4)).batch_size == 4  # numpy ints are ints


def test_resume_names_the_path_that_does_not_exist(tmp_path):
    """A bundle path that is not there is named as such (with the series' newest bundle
    when there is one), and a missing folder is named, instead of a series pattern
    made from the file name."""
    args = (make_model, functools.partial(torch.optim.SGD, lr=0.1),
            (torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)), torch.nn.functional.mse_loss)
    trainer = Trainer(*args, batch_size=4, save_path=tmp_path / "mine" / "ck")
    missing = tmp_path / "does_not_exist" / "ck-r00000010.fdl"
    with pytest.raises(FileNotFoundError, match=rf"^cannot resume from {re.escape(str(missing))}: "
                                                rf"the folder {re.escape(str(missing.parent))} "
                                                r"does not exist"):
        trainer.resume(missing)
    with pytest.raises(FileNotFoundError, match="folder .*does_not_exist does not exist"):
        trainer.resume(tmp_path / "does_not_exist" / "ck")
    newest = bundle(tmp_path / "ck", 4)
    gone = round_model_path(tmp_path / "ck", 10)
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(gone))} does not exist; the "
                                                rf"newest complete checkpoint of that series "
                                                rf"is {re.escape(str(newest))}"):
        trainer.resume(gone)
    with pytest.raises(FileNotFoundError, match=r"ck-r00000010\.meta\.json does not exist"):
        trainer.resume(gone.with_name("ck-r00000010.meta.json"))


def real_bundle(stem, rnd, model, *, batch_size, samples, epoch=0):
    """A complete bundle of ``model`` as a Trainer writes it (positional .fdl, names,
    metadata with the coverage of an epoch of ``samples`` in batches of ``batch_size``)
    - files only, no run."""
    from flodl_shm.checkpoint.fdl import save_tensors
    from flodl_shm.checkpoint.meta import (CheckpointBundle, CoverageBlock, EpochCoverage,
                                           ModelSchema, names_sidecar_path)

    path = round_model_path(stem, rnd)
    path.parent.mkdir(parents=True, exist_ok=True)
    ModelSchema.from_module(model).write_to_file(names_sidecar_path(path))
    save_tensors(path, [(f"p{i}", p.detach()) for i, p in enumerate(model.parameters())])
    cover = CoverageBlock(42, batch_size, [EpochCoverage(epoch, samples, [(batch_size,
                                                                           samples - batch_size)])])
    CheckpointMeta.new(epoch, 1, rnd, 2, SaveReason.CHECKPOINT).with_coverage(cover) \
        .write_to_file(CheckpointBundle.meta_path(path))
    return path


def elche_for_three(world_size):
    from flodl_shm import ElChe

    return ElChe(3, anchor=2)


def elche_anchored_at_three(world_size):
    from flodl_shm import ElChe

    return ElChe(world_size, anchor=3)


def test_what_the_launcher_knows_is_refused_before_any_rank_starts(tmp_path):
    """The dataset against batch_size, a dataset of the wrong kind, a cadence factory
    that ignores its world size, and on a resume a checkpoint of another model, batch
    size or epoch size: each raised by run/resume itself, naming the value and the fix,
    with no rank started and nothing deleted (overwrite=True included)."""
    from flodl_shm.errors import CheckpointError

    from engine_util import live_children

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    data = (torch.zeros(8, 2), torch.zeros(8, dtype=torch.long))

    def trainer(**kw):
        args = dict(model_fn=make_model, optimizer_fn=sgd, dataset=data,
                    loss_fn=torch.nn.functional.mse_loss, batch_size=4, log_every=None,
                    save_path=tmp_path / "ck")
        args.update(kw)
        return Trainer(**args)

    with pytest.raises(ValueError, match=r"^the dataset has 8 samples, fewer than one batch of "
                                         r"batch_size=16; pass a batch_size of at most 8$"):
        trainer(batch_size=16).run(2)
    with pytest.raises(TypeError, match=r"^dataset sample 0 is of type int: with a loss_fn, "
                                        r"each sample must be an \(input\.\.\., target\) "
                                        r"tuple"):
        trainer(dataset=[1, 2, 3] * 4).run(2)
    with pytest.raises(TypeError, match=r"^dataset element 1 is of type list: a dataset of "
                                        r"tensors needs every element to be a tensor"):
        trainer(dataset=(torch.zeros(8, 2), [0] * 8)).run(2)
    with pytest.raises(ValueError, match=r"^the cadence factory built an ElChe for world_size 3, "
                                         r"but the run has 2 ranks"):
        trainer(cadence=elche_for_three).run(2)
    with pytest.raises(ValueError, match=r"^sync_every=8 is the slowest rank's batches in the "
                                         r"first window with ElChe, and the cadence's ElChe "
                                         r"starts at anchor 3: pass sync_every=3, or build the "
                                         r"ElChe with anchor=8$"):  # (8 was ignored, silently)
        trainer(cadence=elche_anchored_at_three).run(2)
    assert not (tmp_path / "ck").parent.joinpath("ck.lock").exists()

    ckpt = real_bundle(tmp_path / "ck", 4, make_model(), batch_size=4, samples=8)
    newer = real_bundle(tmp_path / "ck", 6, make_model(), batch_size=4, samples=8)
    before = sorted(p.name for p in tmp_path.iterdir())
    other = functools.partial(torch.nn.Linear, 3, 2)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt))} is not a checkpoint of "
                                              r"the model model_fn builds: parameter 'weight' is "
                                              r"\[2, 2\] in the checkpoint and \[2, 3\] in the "
                                              r"model\. Resume it with the model_fn that trained"):
        trainer(model_fn=other).resume(ckpt, overwrite=True)
    # the same shapes under other names: another model (it used to resume and train)
    with pytest.raises(CheckpointError, match=r"parameter p0 \[2, 2\] is 'weight' in the "
                                              r"checkpoint and 'gate' in the model; parameter p1 "
                                              r"\[2\] is 'bias'.*renamed modules, delete the "
                                              r"bundle's ck-r00000004\.names\.json"):
        trainer(model_fn=GateModel).resume(ckpt, overwrite=True)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(ckpt))} was trained with batch_size 4 "
                                         r"and this Trainer has batch_size=2: resume with "
                                         r"batch_size=4"):
        trainer(batch_size=2).resume(ckpt, overwrite=True)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(ckpt))} was trained with seed 42 and "
                                         r"this Trainer has seed=7: resume with seed=42"):
        trainer(seed=7).resume(ckpt, overwrite=True)
    more = (torch.zeros(12, 2), torch.zeros(12, dtype=torch.long))
    with pytest.raises(ValueError, match=r"trained on epochs of 8 samples, and this Trainer's "
                                         r"are 12 \(12 samples in batches of 4\): resume with "
                                         r"the dataset it was trained on"):
        trainer(dataset=more).resume(ckpt, overwrite=True)
    from flodl_shm import ElChe

    elche = CheckpointBundle.meta_path(ckpt)
    CheckpointMeta.read_from_file(elche).with_elche_state(ElChe(3, 2).to_state()) \
        .write_to_file(elche)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(ckpt))} holds an ElChe cadence state "
                                         r"for 3 ranks and this run has 2: resume an ElChe run "
                                         r"on 3 ranks, or with cadence='fixed'"):
        trainer(cadence="elche").resume(ckpt, nprocs=2, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused resume deleted"
    assert newer.exists() and live_children() == [], "a rank was started"


def _rows(n):
    """A dataset of ``n`` samples (a picklable factory's product)."""
    return (torch.randn(n, 2, generator=torch.Generator().manual_seed(n)),
            torch.randn(n, 2, generator=torch.Generator().manual_seed(n + 1)))


def test_a_dataset_of_another_length_in_the_same_whole_batches_is_refused_mid_epoch(tmp_path):
    """A probe resumed a mid-epoch bundle of a 520-sample run with 527 samples: the same
    epoch of 512 in batches of 16, so it passed, and the epoch's shuffle of 527 put other
    samples in the uncovered batches (89 trained twice). The coverage keeps the
    dataset's length: refused before any rank starts, or by the ranks for a factory. At
    an epoch's end the next epoch is untouched and starts on the new dataset."""
    from flodl_shm.errors import StartRefused

    def trainer(dataset):
        return Trainer(model_fn=make_model, dataset=dataset, batch_size=4, epochs=2,
                       optimizer_fn=functools.partial(torch.optim.SGD, lr=0.1),
                       loss_fn=torch.nn.functional.mse_loss, sync_every=1,
                       checkpoint_every=1, keep_checkpoints=8, log_every=None,
                       save_path=tmp_path / "ck")

    trainer(_rows(17)).run(1)  # epochs of 16: four windows, a bundle each
    mid = round_model_path(tmp_path / "ck", 2)
    assert CheckpointMeta.read_from_file(CheckpointBundle.meta_path(mid)).coverage.dataset_len \
        == 17
    with pytest.raises(ValueError, match=rf"^{re.escape(str(mid))} was trained on a dataset of "
                                         r"17 samples, and this Trainer's has 18 \(its epoch in "
                                         r"progress is a shuffle of that many samples"):
        trainer(_rows(18)).resume(mid, overwrite=True)
    with pytest.raises(StartRefused, match=r"the checkpoint's epoch 0 is a shuffle of a dataset "
                                           r"of 17 samples and this run's dataset has 18"):
        trainer(functools.partial(_rows, 18)).resume(mid, overwrite=True)
    assert trainer(functools.partial(_rows, 17)).resume(mid, overwrite=True).meta.epoch == 2
    # at an epoch's end none of the next epoch is trained: it starts afresh on the new data
    # (a regression probe's resume there with 520 samples for 512 was refused)
    boundary = round_model_path(tmp_path / "ck", 4)
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(boundary))
    assert meta.epoch == 1 and [(e.epoch, e.uncovered_ranges) for e in meta.coverage.per_epoch] \
        == [(1, [(0, 16)])]
    for more, batches in ((_rows(18), 4), (functools.partial(_rows, 21), 5)):  # 21: 5 of 4
        result = trainer(more).resume(boundary, overwrite=True)
        assert result.meta.epoch == 2
        assert sum(w.cohort_batches[0] for w in result.history) == batches


def test_a_damaged_newest_bundle_names_the_one_before(tmp_path):
    """A probe truncated the newest bundle's .meta.json, then its .fdl: resume() said
    what was wrong with the file and nothing of the way on (a damaged .optim's error
    did); it names the bundle before it, or that there is none."""
    from flodl_shm.errors import CheckpointError

    stem = tmp_path / "ck"
    r4 = real_bundle(stem, 4, make_model(), batch_size=4, samples=8)
    r6 = real_bundle(stem, 6, make_model(), batch_size=4, samples=8)
    trainer = Trainer(model_fn=make_model, dataset=(torch.zeros(8, 2), torch.zeros(8, 2)),
                      optimizer_fn=functools.partial(torch.optim.SGD, lr=0.1),
                      loss_fn=torch.nn.functional.mse_loss, batch_size=4, log_every=None,
                      save_path=stem)
    meta6 = CheckpointBundle.meta_path(r6)
    good = meta6.read_text()
    meta6.write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=rf"parse JSON from .*; resume\('{re.escape(str(r4))}"
                                              rf"'\) continues from the checkpoint before it"):
        trainer.resume(stem)
    meta6.write_text(good)
    os.truncate(r6, os.path.getsize(r6) - 3)
    with pytest.raises(CheckpointError, match=r"payload truncated.*; resume\('.*r00000004\.fdl'\) "
                                              r"continues from the checkpoint before it"):
        trainer.resume(r6)
    os.truncate(r4, os.path.getsize(r4) - 3)
    with pytest.raises(CheckpointError, match=r"payload truncated.*; no earlier checkpoint of "
                                              r"its series is left: restore its files from a"):
        trainer.resume(r4)

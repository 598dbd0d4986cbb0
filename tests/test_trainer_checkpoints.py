"""The checkpoint series (one bundle per checkpointed window) and the Trainer's
argument checks - files and objects only, no processes."""
from __future__ import annotations

import functools

import pytest
import torch

from flodl_shm.checkpoint.meta import CheckpointMeta, SaveReason
from flodl_shm.checkpoint.series import (committed_checkpoints, delete_series, latest_checkpoint,
                                         not_continued, prune_series, resolve_checkpoint,
                                         round_model_path)
from flodl_shm.training.trainer import Trainer, window_seed

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

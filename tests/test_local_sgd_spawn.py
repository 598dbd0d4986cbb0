"""LocalSGD on real rank processes (flodl_shm.spawn): comm=ctx.comm, a dead rank within
max_failures, and full-state save/load whose resume is bit-identical."""
from __future__ import annotations

import logging
import os
import time

import pytest
import torch

import flodl_shm
from flodl_shm import CheckpointBundle, CheckpointMeta, LocalSGD
from flodl_shm.checkpoint.convert import consensus_state_dict
from flodl_shm.checkpoint.series import latest_checkpoint
from flodl_shm.training.local_sgd import rank_state_path

from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(240)


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))


def _batch(rank: int, step: int, n: int = 8):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _params(model) -> list:
    return [t.detach().clone() for t in model.state_dict().values()]


# --- a dead rank ---------------------------------------------------------------------


def _dies_before_first_sync(ctx, die_rank: int):
    model = make_model()
    sgd = LocalSGD(model, sync_every=2, comm=ctx.comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        if ctx.rank == die_rank and step == 1:
            os._exit(3)
        if step == 0:
            x, y = _batch(ctx.rank, step, n=4 + ctx.rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        else:                            # what enters the sync
            local = [p.detach().clone() for p in model.parameters()]
        synced = sgd.step(samples=4 + ctx.rank)
    after = [p.detach().clone() for p in model.parameters()]
    return synced, local, after, sgd.last_sync.mass, sgd.last_sync.accepted


def test_a_dead_rank_is_tolerated_and_its_work_leaves_the_consensus():
    out = flodl_shm.spawn(_dies_before_first_sync, 3, args=(2,), max_failures=1, timeout=60)
    assert out[2] is None
    (s0, l0, a0, m0, acc0), (s1, l1, a1, m1, acc1) = out[0], out[1]
    assert s0 and s1
    w0, w1 = 2 * 4.0, 2 * 5.0
    assert m0 == m1 == w0 + w1
    assert acc0 == acc1 == (0, 1)
    for x0, x1, b0, b1 in zip(l0, l1, a0, a1):
        assert torch.equal(b0, b1)
        torch.testing.assert_close(b0, (x0 * w0 + x1 * w1) / (w0 + w1), rtol=1e-6, atol=1e-7)
    assert_no_leaks()


# --- full-state checkpoints ----------------------------------------------------------


def _train(ctx, stop: int, save_at: int | None, stem: str | None, load: bool, outer: str):
    """Train ranks' own loop to ``stop`` total steps (from the checkpoint when ``load``);
    save a bundle after step ``save_at``."""
    torch.manual_seed(100 + ctx.rank)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    kwargs = dict(sync_every=2, comm=ctx.comm, optimizer=opt, scheduler=sched)
    if outer == "nesterov":
        sgd = flodl_shm.DiLoCo(model, **kwargs)
    elif outer == "torch":
        kwargs["outer"] = torch.optim.SGD(model.parameters(), lr=0.8, momentum=0.5,
                                          nesterov=True)
        sgd = LocalSGD(model, **kwargs)
    else:
        sgd = LocalSGD(model, **kwargs)
    if load:
        sgd.load(stem)
    model.train()
    while sgd.total_steps < stop:
        x, y = _batch(ctx.rank, sgd.total_steps)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        sgd.step(samples=len(x))
        if save_at is not None and sgd.total_steps == save_at:
            sgd.save(stem)
    return _params(model), sgd.sync_round, sched.get_last_lr()


@pytest.mark.parametrize("saved_on,resumed_on", [(1, 2), (2, 1)])
def test_a_resume_on_another_number_of_ranks_starts_every_rank_alike(tmp_path, caplog,
                                                                     saved_on, resumed_on):
    """A probe: resumed on 2 ranks from a 1-rank bundle, rank 0 restored its own
    optimizer and scheduler (lr 0.00196 of a cosine schedule) while rank 1 started fresh
    (lr 0.003): the cohort trained at two learning rates, and only rank 1 said a word;
    from a 2-rank bundle on 1 rank, rank 0 restored its state without one. Every rank
    now loads the consensus and starts its optimizer and scheduler fresh; one line says
    why."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_train, saved_on, args=(6, 6, stem, False, "none"))
    ref = make_model()
    flodl_shm.load_consensus_checkpoint(ref, latest_checkpoint(stem))
    want = [v for v in ref.state_dict().values() if v.is_floating_point()]
    caplog.set_level("WARNING", logger="flodl_shm")
    resumed = flodl_shm.spawn(_train, resumed_on, args=(6, None, stem, True, "none"))
    for params, sync_round, lr in resumed:
        assert (sync_round, lr) == (3, [0.05])  # the scheduler fresh: StepLR's first lr
        floats = [p for p in params if p.is_floating_point()]
        assert len(floats) == len(want) and all(map(torch.equal, floats, want))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and (
        f"it was saved by {saved_on} rank{'s' if saved_on > 1 else ''} and this run has "
        f"{resumed_on}; every rank loads the consensus only") in said[0], said
    assert_no_leaks()


@pytest.mark.parametrize("outer", ["nesterov", "torch"])
def test_resume_from_a_full_state_bundle_is_bit_identical(tmp_path, outer):
    stem = os.fspath(tmp_path / "ckpt")
    straight = flodl_shm.spawn(_train, 2, args=(12, None, None, False, outer))
    saved = flodl_shm.spawn(_train, 2, args=(6, 6, stem, False, outer))
    resumed = flodl_shm.spawn(_train, 2, args=(12, None, stem, True, outer))
    for (p_a, round_a, lr_a), (p_b, round_b, lr_b) in zip(straight, resumed):
        assert (round_a, lr_a) == (round_b, lr_b)
        for a, b in zip(p_a, p_b):
            assert torch.equal(a, b)
    # the bundle of sync round 3: consensus model, per-rank states, metadata written last
    bundle = latest_checkpoint(stem)
    assert bundle == tmp_path / "ckpt-r00000003.fdl"
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(bundle))
    assert (meta.global_step, meta.sync_round, meta.world_size_at_save) == (6, 3, 2)
    assert rank_state_path(bundle, 0).exists() and rank_state_path(bundle, 1).exists()
    assert CheckpointBundle.outer_path(bundle).exists() == (outer == "nesterov")
    # the model's names travel with it: the converted consensus loads strictly
    fresh = make_model()
    fresh.load_state_dict(consensus_state_dict(bundle))
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), saved[0][0])
               if a.is_floating_point())
    assert_no_leaks()


def _save_every_sync(ctx, stem: str, stop: int, load: bool, keep: int):
    """Sync every 2 steps and save after each sync (``keep`` bundles), resuming from
    ``stem`` first when ``load``; returns where it started and ended."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sgd = LocalSGD(model, sync_every=2, comm=ctx.comm, optimizer=opt)
    if load:
        sgd.load(stem)
    start = (sgd.sync_round, sgd.total_steps)
    while sgd.total_steps < stop:
        x, y = _batch(ctx.rank, sgd.total_steps)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if sgd.step(samples=len(x)):
            sgd.save(stem, keep=keep)
    return start, (sgd.sync_round, sgd.total_steps)


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_bundle(tmp_path):
    """Each save is a bundle of its own: a save cut short (rank 0's state written, the
    commit marker never) leaves the previous one whole, and the ranks resume from it in
    step. (Overwriting one stem in place left rank 0 at round 3 and rank 1 at round 2:
    the resumed ranks then waited for each other at different collectives.)"""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_save_every_sync, 2, args=(stem, 8, False, 3))
    names = sorted(p.name for p in tmp_path.glob("ckpt-r*.meta.json"))
    assert names == [f"ckpt-r0000000{r}.meta.json" for r in (2, 3, 4)]  # keep=3
    # the save of round 4 as a crash leaves it: rank 0's state written, nothing else
    for f in tmp_path.glob("ckpt-r00000004.*"):
        if not f.name.endswith(".rank0.optim"):
            f.unlink()
    out = flodl_shm.spawn(_save_every_sync, 2, args=(stem, 12, True, 2))
    assert [start for start, _ in out] == [(3, 6), (3, 6)]  # round 3, on both ranks
    assert [end for _, end in out] == [(6, 12), (6, 12)]
    # the resumed run saved rounds 4 (over the cut one), 5 and 6, keeping the newest 2
    assert sorted(p.name for p in tmp_path.glob("ckpt-r*")) == sorted(
        f"ckpt-r0000000{r}.{ext}" for r in (5, 6)
        for ext in ("fdl", "meta.json", "names.json", "rank0.optim", "rank1.optim"))
    assert_no_leaks()


def test_a_later_save_of_a_cut_short_round_drops_the_ranks_files_it_left(tmp_path):
    """A 2-rank save of round 4 cut short leaves both ranks' state files; a 1-rank run
    resuming round 3 then commits round 4 again, with its own rank 0 file only. Rank 1's
    stale file (the earlier run's replica and optimizer) used to stay in that committed
    bundle, and a later 2-rank load gave rank 1 those weights: the replicas started
    apart, with no warning. The save removes it before its commit."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_save_every_sync, 2, args=(stem, 8, False, 3))
    for f in tmp_path.glob("ckpt-r00000004.*"):  # cut short: the ranks' states only
        if not f.name.endswith((".rank0.optim", ".rank1.optim")):
            f.unlink()
    assert flodl_shm.spawn(_save_every_sync, 1, args=(stem, 8, True, 3)) == [((3, 6), (4, 8))]
    assert sorted(p.name for p in tmp_path.glob("ckpt-r00000004.*")) == [
        f"ckpt-r00000004.{ext}" for ext in ("fdl", "meta.json", "names.json", "rank0.optim")]
    loaded = flodl_shm.spawn(_load_consensus_only, 2, args=(stem,))
    assert [(m, r) for _, m, r, _ in loaded] == [(4, 4), (4, 4)]
    for a, b in zip(loaded[0][0], loaded[1][0]):  # (rank 1 has no state: its counts start over)
        assert not a.is_floating_point() or torch.equal(a, b), "the ranks resumed apart"
    assert_no_leaks()


def _save_once(ctx, stem: str, load_from, overwrite: bool):
    """Two steps, one sync, one save into ``stem`` (after loading ``load_from``, when
    given): the saved bundle's name, or the refusal's type and message."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sgd = LocalSGD(model, sync_every=2, comm=ctx.comm, optimizer=opt)
    if load_from is not None:
        sgd.load(load_from)
    for _ in range(2):
        x, y = _batch(ctx.rank, sgd.total_steps)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sgd.step(samples=len(x))
    try:
        return sgd.save(stem, overwrite=overwrite).name
    except FileExistsError as e:
        return f"FileExistsError: {e}"


def test_saves_beside_another_runs_bundles_are_refused_unless_overwrite(tmp_path):
    """A fresh run saving into a stem that holds an earlier run's bundles (rounds 3 and
    4) would have its saves pruned at once against those newer rounds; a run resumed
    from round 3 would lose its saves to round 4 the same way. Both are refused on
    every rank before anything is written; overwrite=True deletes what the run does
    not continue."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_save_every_sync, 2, args=(stem, 8, False, 2))
    before = {p.name: p.read_bytes() for p in tmp_path.glob("ckpt-r*")}
    assert {n for n in before if n.endswith(".meta.json")} == {
        "ckpt-r00000003.meta.json", "ckpt-r00000004.meta.json"}
    r3 = os.fspath(tmp_path / "ckpt-r00000003.fdl")
    for load_from in (None, r3):
        out = flodl_shm.spawn(_save_once, 2, args=(stem, load_from, False))
        for message in out:
            assert message.startswith("FileExistsError: ") and "ckpt-r00000004.fdl" in message
            assert "overwrite=True" in message
        assert {p.name: p.read_bytes() for p in tmp_path.glob("ckpt-r*")} == before
    # resumed from round 3, overwriting: round 4 goes, the run saves its own round 4
    assert flodl_shm.spawn(_save_once, 2, args=(stem, r3, True)) == ["ckpt-r00000004.fdl"] * 2
    assert (tmp_path / "ckpt-r00000004.rank0.optim").read_bytes() != \
        before["ckpt-r00000004.rank0.optim"]
    # a fresh run, overwriting: every earlier bundle goes
    assert flodl_shm.spawn(_save_once, 2, args=(stem, None, True)) == ["ckpt-r00000001.fdl"] * 2
    assert sorted(p.name for p in tmp_path.glob("ckpt-r*.meta.json")) == [
        "ckpt-r00000001.meta.json"]
    assert_no_leaks()


def _save_and_hold(ctx, stem: str, flags: str, seed: int):
    """Sync, then save into ``stem``. With ``seed`` 0 (the first job): mark the save done
    and stay up until the second job is through; else return the SeriesInUse message."""
    torch.manual_seed(seed + ctx.rank)
    model = make_model()
    sgd = LocalSGD(model, sync_every=1, comm=ctx.comm)
    with torch.no_grad():
        model[0].weight.add_(float(seed + ctx.rank))
    sgd.step(samples=1)
    try:
        sgd.save(stem)
    except flodl_shm.SeriesInUse as e:
        return str(e)
    if seed == 0:
        if ctx.rank == 0:
            open(os.path.join(flags, "saved"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(flags, "other_done")):
            assert time.monotonic() < deadline, "the second job never finished"
            time.sleep(0.02)
    return "saved"


def test_a_second_job_saving_into_a_series_in_use_is_refused_before_writing(tmp_path):
    """Two own-loop jobs given one stem would write each other's rounds: the second is
    refused, on every rank, before any of them writes a file."""
    stem = os.fspath(tmp_path / "ckpt")
    first = flodl_shm.spawn(_save_and_hold, 2, args=(stem, os.fspath(tmp_path), 0),
                            join=False)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "saved").exists():
            assert time.monotonic() < deadline, "the first job never saved"
            time.sleep(0.02)
        files = {p.name: p.read_bytes() for p in tmp_path.glob("ckpt-r*")}
        assert "ckpt-r00000001.rank1.optim" in files
        second = flodl_shm.spawn(_save_and_hold, 2, args=(stem, os.fspath(tmp_path), 10))
    finally:
        (tmp_path / "other_done").touch()
        assert first.join(60) == ["saved", "saved"]
    for message in second:
        assert "is in use by another run (pid" in message and "ckpt.lock" in message
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ckpt-r*")} == files
    assert not (tmp_path / "ckpt.lock").exists()  # the first job's lead released it
    assert_no_leaks()


def _load_consensus_only(ctx, stem: str):
    model = make_model()
    sgd = LocalSGD(model, sync_every=2, comm=ctx.comm)
    meta = sgd.load(stem)
    return _params(model), meta.sync_round, sgd.sync_round, sgd.total_steps


@pytest.mark.parametrize("rank_files", ["missing", "a Trainer's"])
def test_a_bundle_without_rank_states_loads_the_consensus(tmp_path, rank_files, caplog):
    """Without LocalSGD rank states (none, or a Trainer's, whose rank files hold its own
    format) the consensus is loaded and the rest starts fresh; the warning names the
    integer buffers, which keep each model's own values; one line says so, not one a
    rank."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_train, 2, args=(4, 4, stem, False, "none"))
    bundle = latest_checkpoint(stem)
    ref = make_model()
    report = flodl_shm.load_consensus_checkpoint(ref, bundle)
    assert not report.missing and not report.unexpected
    for r in range(2):
        if rank_files == "missing":
            rank_state_path(bundle, r).unlink()
        else:
            torch.save({"format": "flodl_shm.Trainer/1", "optimizer": {}},
                       rank_state_path(bundle, r))
    with caplog.at_level(logging.WARNING, logger="flodl_shm"):
        out = flodl_shm.spawn(_load_consensus_only, 2, args=(stem,))
    why = ("it holds no state file for ranks [0, 1]" if rank_files == "missing"
           else "the state files of ranks [0, 1] are not LocalSGD's (a Trainer's bundle?)")
    assert caplog.text.count(f"{why}; every rank loads the consensus only (the inner optimizer "
                             f"and the scheduler start fresh; integer buffers "
                             f"(3.num_batches_tracked) keep each model's own values)") == 1, \
        caplog.text
    expected = {k: v for k, v in ref.state_dict().items() if v.is_floating_point()}
    for params, meta_round, round_, steps in out:
        assert (meta_round, round_, steps) == (2, 2, 4)
        floats = [p for p in params if p.is_floating_point()]
        for got, want in zip(floats, expected.values()):
            assert torch.equal(got, want)
    assert_no_leaks()


def _load_each(ctx, stem: str, mode: str):
    """Each rank loads what ``mode`` gives it; returns the type and text of what it
    raised (None: no error)."""
    model = make_model()
    sgd = LocalSGD(model, sync_every=1, comm=ctx.comm)
    bundles = sorted(p for p in os.listdir(os.path.dirname(stem)) if p.endswith(".fdl"))
    try:
        if mode == "different rounds":
            sgd.load(os.path.join(os.path.dirname(stem), bundles[ctx.rank]))
        elif mode == "one rank cannot load":
            sgd.load(stem if ctx.rank == 0 else stem + "-missing")
        elif mode == "only rank 0 loads":
            if ctx.rank == 0:
                sgd.load(stem)
            sgd.sync()
        elif mode == "only rank 0 saves":
            if ctx.rank == 0:
                sgd.save(stem + "-again")
            sgd.sync()
        else:
            sgd.load(stem)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_ranks_that_load_different_bundles_or_fail_to_load_all_raise(tmp_path):
    """On one host load() used to run no collective: a rank that loaded another bundle,
    could not load, or skipped load() (`if rank == 0: sgd.load(...)`) trained on with its
    own counters and weights, averaged silently with the others, or left them waiting
    for the timeout."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_save_twice, 2, args=(stem,))
    assert flodl_shm.spawn(_load_each, 2, args=(stem, "same")) == [None, None]
    out = flodl_shm.spawn(_load_each, 2, args=(stem, "different rounds"))
    for kind, text in out:
        assert kind == "StartRefused"
        assert ("the ranks start from different checkpoints (from sync round 1: ranks [0]; "
                "from sync round 2: ranks [1]); call load() with the same bundle on every "
                "rank") in text
    (kind0, text0), (kind1, text1) = flodl_shm.spawn(_load_each, 2,
                                                     args=(stem, "one rank cannot load"))
    assert kind0 == "StartRefused" and "could not load (see their error): ranks [1]" in text0
    assert kind1 == "FileNotFoundError" and "ckpt-missing" in text1
    (kind0, text0), (kind1, text1) = flodl_shm.spawn(_load_each, 2,
                                                     args=(stem, "only rank 0 loads"))
    assert kind0 == kind1 == "SchemaMismatchError"
    assert "load() is a collective" in text0 and "CONTROL round" in text0
    (kind0, text0), (kind1, text1) = flodl_shm.spawn(_load_each, 2,
                                                     args=(stem, "only rank 0 saves"))
    assert kind0 == kind1 == "SchemaMismatchError"  # save() said nothing of the cause
    assert ("save() is a collective: a rank whose collective differs did not call it (call "
            "save() on every rank at the same point, not under `if rank == 0`)") in text0
    assert_no_leaks()


def test_a_rank_state_copied_over_another_rank_s_is_refused(tmp_path):
    """A probe copied rank 0's .rank0.optim over rank 1's: load() gave rank 1 rank 0's
    RNG, momentum and counters silently, and both ranks then drew the same data."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_save_twice, 2, args=(stem,))
    bundle = latest_checkpoint(stem)
    rank_state_path(bundle, 1).write_bytes(rank_state_path(bundle, 0).read_bytes())
    (kind0, text0), (kind1, text1) = flodl_shm.spawn(_load_each, 2, args=(stem, "same"))
    assert kind1 == "ValueError" and text1.startswith(
        f"{rank_state_path(bundle, 1)} holds rank 0's state, not rank 1's: the bundle's rank "
        f"files were copied or renamed")
    assert kind0 == "StartRefused" and "could not load (see their error): ranks [1]" in text0
    assert_no_leaks()


def _load(ctx, stem: str):
    LocalSGD(make_model(), sync_every=1, comm=ctx.comm).load(stem)


def test_the_launcher_names_the_rank_that_could_not_load_not_one_that_refused(tmp_path):
    """A probe truncated rank 0's state file: spawn raised rank 1's StartRefused, whose
    message says to see rank 0's error, and said of rank 0 only "failed too
    (CheckpointError)": the cause, naming the file, was printed nowhere."""
    stem = os.fspath(tmp_path / "ckpt")
    flodl_shm.spawn(_save_twice, 2, args=(stem,))
    path = rank_state_path(latest_checkpoint(stem), 0)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    with pytest.raises(flodl_shm.RankFailed) as info:
        flodl_shm.spawn(_load, 2, args=(stem,))
    assert (info.value.rank, info.value.exc_type) == (0, "CheckpointError"), str(info.value)
    assert f"{path} cannot be read" in str(info.value)
    assert_no_leaks()


def _save_twice(ctx, stem: str):
    model = make_model()
    sgd = LocalSGD(model, sync_every=1, comm=ctx.comm)
    for _ in range(2):
        sgd.step(samples=4)
        sgd.save(stem, keep=2)


# --- several hosts -------------------------------------------------------------------


def _cluster_window(ctx, root: str, shared_folder: bool = False):
    model = make_model()
    sgd = flodl_shm.DiLoCo(model, sync_every=2, comm=ctx.comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    torch.manual_seed(ctx.rank)
    x, y = _batch(ctx.rank, 0, n=4 + ctx.rank)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sgd.step(samples=4 + ctx.rank)
    local = [p.detach().clone() for p in model.parameters()]
    assert sgd.step(samples=4 + ctx.rank)
    host = ctx.rank - ctx.local_rank                 # each host saves to its own disk
    sgd.save(os.path.join(root, "shared" if shared_folder else f"host{host}", "ckpt"))
    return local, [p.detach().clone() for p in model.parameters()], sgd.last_sync.mass


def test_local_sgd_across_two_hosts_and_each_host_gets_its_bundle(tmp_path):
    from cluster_util import run_hosts

    out, errors, _ = run_hosts(_cluster_window, [2, 1], args=(os.fspath(tmp_path),))
    assert not errors, errors
    ranks = [r for host in out for r in host]
    w = [2.0 * (4 + r) for r in range(3)]
    ref = flodl_shm.OuterNesterov(lr=0.7, momentum=0.9)
    init = [p.detach() for p in make_model().parameters()]
    cons = [sum(ranks[r][0][i] * w[r] for r in range(3)) / sum(w) for i in range(len(init))]
    expected = ref.outer_step(init, cons)
    for local, after, mass in ranks:
        assert mass == sum(w)
        for a, b, e in zip(after, ranks[0][1], expected):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    for host, own in ((0, (0, 1)), (2, (2,))):
        bundle = tmp_path / f"host{host}" / "ckpt-r00000001.fdl"
        for path in (bundle, CheckpointBundle.outer_path(bundle),
                     CheckpointBundle.meta_path(bundle)):
            assert path.exists(), path
        assert sorted(p.name for p in bundle.parent.glob("*.optim")) == \
            [f"ckpt-r00000001.rank{r}.optim" for r in own]
    assert_no_leaks(10)


def test_hosts_saving_into_one_shared_folder_share_the_series(tmp_path):
    """A cluster whose hosts save into one shared file system (NFS): the run lock of
    the series is the job's on every host, so no host is refused (another job would
    be), and the bundle holds every rank's state."""
    from cluster_util import run_hosts

    out, errors, _ = run_hosts(_cluster_window, [2, 1], args=(os.fspath(tmp_path), True))
    assert not errors, errors
    bundle = tmp_path / "shared" / "ckpt-r00000001.fdl"
    assert CheckpointBundle.meta_path(bundle).exists()
    assert sorted(p.name for p in bundle.parent.glob("*.optim")) == \
        [f"ckpt-r00000001.rank{r}.optim" for r in range(3)]
    assert_no_leaks(10)


def _cluster_save_then_load(ctx, root: str, which: dict):
    """Two synced windows, each saved to this host's own disk (``ckpt0``, ``ckpt1``),
    then a fresh LocalSGD per rank loads this host's ``ckpt<which[host]>``: its sync
    round, or the ValueError's message."""
    model = make_model()
    sgd = flodl_shm.LocalSGD(model, sync_every=1, comm=ctx.comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    host = ctx.rank - ctx.local_rank
    for k in range(2):
        x, y = _batch(ctx.rank, k)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert sgd.step(samples=len(x))
        sgd.save(os.path.join(root, f"host{host}", f"ckpt{k}"))
    fresh = flodl_shm.LocalSGD(make_model(), sync_every=1, comm=ctx.comm)
    try:
        return fresh.load(os.path.join(root, f"host{host}", f"ckpt{which[host]}")).sync_round
    except ValueError as e:
        return str(e)


def test_hosts_loading_different_bundles_are_refused(tmp_path):
    """On several hosts each host loads its own copy of a bundle: the same one loads
    everywhere; an older copy on one host makes every rank's load raise, naming who
    loaded which round, instead of averaging replicas whose counters disagree."""
    from cluster_util import run_hosts

    out, errors, _ = run_hosts(_cluster_save_then_load, [2, 1],
                               args=(os.fspath(tmp_path / "same"), {0: 1, 2: 1}))
    assert not errors, errors
    assert [r for host in out for r in host] == [2, 2, 2]
    out, errors, _ = run_hosts(_cluster_save_then_load, [2, 1],
                               args=(os.fspath(tmp_path / "mixed"), {0: 0, 2: 1}))
    assert not errors, errors
    for got in (r for host in out for r in host):
        assert "start from different checkpoints" in got, got
        assert "from sync round 1: ranks [0, 1]; from sync round 2: ranks [2]" in got, got
    assert_no_leaks(10)


# --- state_dict round trip with ElChe ------------------------------------------------


def _elche_round_trip(ctx):
    import time

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd = flodl_shm.DiLoCo(model, sync_every=2, comm=ctx.comm, cadence="elche", optimizer=opt)
    syncs = 0
    while syncs < 5:
        if ctx.rank == 1:
            time.sleep(0.003)                          # the slow rank
        x, y = _batch(ctx.rank, syncs)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        syncs += sgd.step(samples=len(x))
    state = sgd.state_dict()
    fresh_model = make_model()
    fresh = flodl_shm.DiLoCo(fresh_model, sync_every=2, comm=ctx.comm, cadence="elche",
                             optimizer=torch.optim.SGD(fresh_model.parameters(), lr=0.1,
                                                       momentum=0.9))
    fresh.load_state_dict(state)
    same_model = all(torch.equal(state["model"][k], v)
                     for k, v in fresh_model.state_dict().items())
    # both LocalSGDs share ctx.comm, whose reduce holds the outer state: compare the
    # saved state with what the fresh one holds after loading it
    saved_prev, saved_momentum = state["prev_global"], state["outer"]["momentum"]
    got_prev, got_momentum = fresh.outer_state()
    same_momentum = (saved_momentum is not None and
                     all(torch.equal(a, b) for a, b in zip(saved_momentum, got_momentum)) and
                     all(torch.equal(a, b) for a, b in zip(saved_prev, got_prev)))
    same_inner = all(torch.equal(fresh.optimizer.state[p]["momentum_buffer"],
                                 opt.state[q]["momentum_buffer"])
                     for p, q in zip(fresh_model.parameters(), model.parameters())
                     if q in opt.state)
    return (same_model, same_momentum, same_inner, fresh.el_che.batch_counts() ==
            sgd.el_che.batch_counts(), fresh.sync_round, fresh.steps_until_sync ==
            sgd.steps_until_sync)


def test_state_dict_round_trip_restores_elche_outer_and_inner_state():
    out = flodl_shm.spawn(_elche_round_trip, 2)
    assert out == [(True, True, True, True, 5, True)] * 2
    assert_no_leaks()


def _plain_local_sgd(ctx):
    flodl_shm.LocalSGD(make_model(), sync_every=2, comm=ctx.comm)
    return "built"


def test_local_sgd_across_hosts_refuses_a_controller_that_steps_an_outer_optimizer():
    """LocalSGD across hosts steps its outer optimizer on every rank; a controller run
    with --outer nesterov was silently ignored (plain averaging, no message)."""
    from cluster_util import run_hosts

    out, errors, _ = run_hosts(_plain_local_sgd, [1, 1],
                               controller_kwargs={"outer": flodl_shm.OuterNesterov(0.7, 0.9)})
    assert len(errors) == 2, (out, errors)
    for err in errors.values() if isinstance(errors, dict) else errors:
        assert "the controller steps OuterNesterov(lr=0.7, momentum=0.9), but LocalSGD across " \
               "hosts steps its outer optimizer on every rank (outer=None)" in str(err), err
        assert "Restart the controller without --outer nesterov" in str(err)
    assert_no_leaks(10)


def _elche_save_then_load_without_rank1_state(ctx, stem: str):
    """Train an ElChe cadence with a slow rank 1 and save; then (the launcher deletes rank
    1's state file between the runs) load into fresh LocalSGDs: every rank's ElChe."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if os.path.exists(stem + ".phase2"):
        sgd = LocalSGD(model, sync_every=2, comm=ctx.comm, cadence="elche", optimizer=opt)
        sgd.load(stem)
        return sgd.el_che.settings(), sgd.steps_until_sync, sgd.el_che.batch_counts()
    sgd = LocalSGD(model, sync_every=2, comm=ctx.comm, cadence="elche", optimizer=opt)
    while sgd.sync_round < 8:
        if ctx.rank == 1:
            time.sleep(0.004)  # the slow rank: ElChe calibrates and gives rank 0 more steps
        x, y = _batch(ctx.rank, sgd.total_steps)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sgd.step(samples=len(x))
    sgd.save(stem)
    return sgd.el_che.settings(), sgd.steps_until_sync, sgd.el_che.batch_counts()


def test_a_load_where_one_rank_has_no_state_of_its_own_keeps_the_ranks_elche_equal(
        tmp_path, caplog):
    """A probe: rank 2's .optim was missing, so it loaded the consensus only and started
    ElChe fresh while the others restored theirs; the ranks then planned different windows
    (rank 0 expected 13 steps of rank 2, which trained 4). Every rank now loads the
    consensus only and restarts ElChe from the bundle's snapshot, and rank 0 says so once."""
    stem = str(tmp_path / "ck")
    saved = flodl_shm.spawn(_elche_save_then_load_without_rank1_state, 2, (stem,))
    assert saved[0][0] == saved[1][0] and saved[0][2][0] > saved[0][2][1], saved
    bundle = latest_checkpoint(stem)
    rank_state_path(bundle, 1).unlink()
    open(stem + ".phase2", "w").close()
    caplog.set_level("WARNING", logger="flodl_shm")
    loaded = flodl_shm.spawn(_elche_save_then_load_without_rank1_state, 2, (stem,))
    assert loaded[0][0] == loaded[1][0], loaded  # the same ElChe on both ranks
    # the saved cadence goes on (recomputed from the snapshot's smoothed speeds)
    assert loaded[0][2][1] == saved[0][2][1], (loaded, saved)
    assert abs(loaded[0][2][0] - saved[0][2][0]) <= 0.1 * saved[0][2][0], (loaded, saved)
    assert [steps for _, steps, _ in loaded] == loaded[0][2]
    assert caplog.text.count("it holds no state file for ranks [1]; every rank loads the "
                             "consensus only (the inner optimizer and the scheduler start "
                             "fresh, ElChe restarts from the bundle's ElChe snapshot") == 1, \
        caplog.text
    assert caplog.text.count("WARNING") == 1, caplog.text
    assert_no_leaks()


def _elche_windows(ctx):
    model = make_model()
    sgd = LocalSGD(model, sync_every=2, comm=ctx.comm, cadence="elche")
    while sgd.sync_round < 6:
        if ctx.rank == 1:
            time.sleep(0.004)
        sgd.step(samples=1)
    return sgd.sync_round


def test_elche_decisions_are_logged_once_not_once_per_rank(caplog):
    """A probe read each of ElChe's decisions ('ElChe phase probe -> warmup', ...) once
    per rank from LocalSGD (under torchrun without a rank prefix: N identical lines); the
    Trainer logged them once. The lowest live rank logs them now."""
    caplog.set_level("INFO", logger="flodl_shm")
    assert flodl_shm.spawn(_elche_windows, 2) == [6, 6]
    phases = [r.getMessage() for r in caplog.records if "ElChe phase" in r.getMessage()]
    assert phases and len(phases) == len(set(phases)), phases
    assert all(m.startswith("rank 0: ") for m in phases), phases

"""The Trainer on real rank processes: a run end to end, hooks and metrics, the final
checkpoint, ElChe's cadence on a heterogeneous cohort, and the DiLoCo outer optimizer.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from flodl_shm import load_consensus_checkpoint
from flodl_shm.checkpoint.forge import load_outer_momentum, outer_sidecar_path
from flodl_shm.checkpoint.meta import CheckpointBundle, CheckpointMeta, SaveReason
from flodl_shm.checkpoint.series import (committed_checkpoints, latest_checkpoint,
                                         round_model_path)
from flodl_shm.training.hooks import Hook, SimulatedSlowdown
from flodl_shm.training.outer import OuterNesterov
from flodl_shm.training.trainer import Trainer

from trainer_util import (no_leaks,  # noqa: F401 - autouse fixture
                          KillAt, RecordSamples, StopAt, assert_each_epoch_once, float_state,
                          make_data, make_model, make_trainer, read_samples, sgd, loss_fn)

pytestmark = pytest.mark.timeout(120)


def test_run_trains_every_sample_once_per_epoch_and_saves(tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    stem = tmp_path / "ck" / "run"
    trainer = make_trainer(save_path=stem, checkpoint_every=3, keep_checkpoints=2,
                           hooks=[RecordSamples(rec)])
    result = trainer.run(2)
    # 256 samples / 8 = 32 batches per epoch, 2 ranks x 2 batches per window: 8 windows
    assert [s.window for s in result.history] == list(range(1, 17))
    assert [s.epoch for s in result.history] == [0] * 8 + [1] * 8
    assert all(s.cohort_batches == (2, 2) and not s.skipped for s in result.history)
    assert [s.global_step for s in result.history] == list(range(4, 68, 4))
    assert [s.save_reason for s in result.history if s.checkpoint] == \
        ["checkpoint"] * 5 + ["graceful_shutdown"]
    last = result.history[-1]
    assert last.next_batches == () and last.live_ranks == (0, 1)
    assert all(math.isfinite(s.cohort_loss) and s.samples_per_s > 0 and s.bytes_sent > 0
               for s in result.history)
    assert result.history[-1].cohort_loss < result.history[0].cohort_loss, "it learns"
    # the window's time outside training: its averaging part holds the reduce
    assert all(0 < s.sync_ms <= s.averaging_ms <= s.window_ms - s.compute_ms
               for s in result.history)
    assert_each_epoch_once(read_samples(rec), epochs=2, batch_size=8)
    # where it ended, and the checkpoint that says so
    meta = result.meta
    assert (meta.epoch, meta.global_step, meta.sync_round, meta.world_size_at_save) == \
        (2, 64, 16, 2)
    assert result.reason is SaveReason.GRACEFUL_SHUTDOWN and result.dead_ranks == ()
    assert result.checkpoint == latest_checkpoint(stem)
    assert result.checkpoint.name == "run-r00000016.fdl"
    assert [r for r, _ in committed_checkpoints(stem)] == [15, 16], "pruned to keep=2"
    saved = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(result.checkpoint))
    assert saved.save_reason is SaveReason.GRACEFUL_SHUTDOWN
    assert (saved.epoch, saved.global_step, saved.sync_round) == (2, 64, 16)
    assert saved.coverage.per_epoch == [] and saved.coverage.batch_size == 8
    model = make_model()
    report = load_consensus_checkpoint(model, result.checkpoint)
    assert not report.missing and not report.unexpected
    for k, v in float_state(model.state_dict()).items():
        assert torch.equal(v, result.state_dict[k]), f"{k}: checkpoint != final model"
    # a second run() must not silently mix with these checkpoints
    with pytest.raises(FileExistsError, match="resume"):
        trainer.run(2)


def test_stop_request_ends_every_rank_after_the_same_window(tmp_path):
    trainer = make_trainer(epochs=5, hooks=[StopAt(rank=1, window=3)])
    result = trainer.run(2)
    assert [s.window for s in result.history] == [1, 2, 3]
    assert result.reason is SaveReason.GRACEFUL_SHUTDOWN and result.checkpoint is None
    assert result.meta.coverage.per_epoch[0].uncovered_ranges == [(96, 160)]


class _StopAtWindowEnd(Hook):
    def on_window_end(self, state, stats) -> None:
        if stats.window == 3:
            state.request_stop()


def test_a_stop_requested_after_a_window_s_sync_ends_the_next_window():
    """(docs/trainer.md, Hooks: a request from on_window_end travels with the next
    window's sync; a probe read "every rank stops after that same window" as this one)."""
    result = make_trainer(epochs=5, hooks=[_StopAtWindowEnd()]).run(2)
    assert [s.window for s in result.history] == [1, 2, 3, 4]
    assert result.reason is SaveReason.GRACEFUL_SHUTDOWN


def test_elche_gives_the_fast_rank_more_batches_and_resumes_its_state(tmp_path):
    """Rank 1 sleeps 4x as long per batch as rank 0: ElChe measures it and schedules
    rank 0 about 4x the batches, so neither waits long at the gather. Stopped at window
    8 and resumed, the cadence continues from the saved state (and guard history)."""
    stem = tmp_path / "elche"

    def trainer(hooks=()):
        return Trainer(make_model, sgd, make_data(2048), loss_fn, batch_size=8, epochs=1,
                       sync_every=2, cadence="elche", log_every=None, timeout=120.0,
                       save_path=stem, hooks=[SimulatedSlowdown(rank=1, factor=4.0,
                                                                batch_ms=3.0), *hooks])

    first = trainer([StopAt(rank=0, window=8)]).run(2)
    assert [s.window for s in first.history] == list(range(1, 9))
    assert first.history[0].cohort_batches == (2, 2), "the first window is uncalibrated"
    for s in first.history[-3:]:
        fast, slow = s.cohort_batches
        assert 2.5 <= fast / slow <= 8, s.cohort_batches
    saved = first.meta.elche_state
    assert saved.anchor_rank == 1 and saved.calibration_count == 8
    assert saved.phase == "stable"
    assert len(saved.trend_history) == 5, "TrendGuard's ring is checkpointed"
    assert saved.smoothed_ms_per_batch[1] > 2.5 * saved.smoothed_ms_per_batch[0]

    # the checkpoint was armed before window 8's timing report: it holds 7 calibrations
    on_disk = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(first.checkpoint))
    assert on_disk.elche_state.calibration_count == 7
    assert on_disk.elche_state.anchor_rank == 1

    second = trainer().resume()
    assert second.history[0].window == 9
    state = second.meta.elche_state
    assert state.anchor_rank == 1
    assert state.calibration_count == 7 + len(second.history), "calibration continues"
    for s in second.history[1:-1]:
        fast, slow = s.cohort_batches
        assert 2.5 <= fast / slow <= 8, s.cohort_batches
    assert second.meta.global_step == 256


def test_diloco_outer_nesterov_saves_its_momentum(tmp_path):
    stem = tmp_path / "diloco"
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    trainer = Trainer(make_model, adam, make_data(), loss_fn, batch_size=8, epochs=1,
                      sync_every=2, outer=OuterNesterov(lr=0.7, momentum=0.9),
                      bf16_wire=True, save_path=stem, checkpoint_every=4, log_every=None,
                      timeout=120.0)
    result = trainer.run(2)
    ckpt = result.checkpoint
    assert ckpt.name == "diloco-r00000008.fdl"
    outer = outer_sidecar_path(ckpt)
    assert outer.exists(), "the outer momentum is checkpointed next to the model"
    mom = load_outer_momentum(make_model(), outer)
    assert len(mom) == len(list(make_model().parameters()))
    assert all(torch.isfinite(m).all() for m in mom) and any(float(m.abs().sum()) > 0
                                                             for m in mom)
    # bf16 wire: the adopted consensus is bf16-representable
    w = result.state_dict["0.weight"]
    assert torch.equal(w, w.to(torch.bfloat16).float())
    assert math.isfinite(result.history[-1].cohort_loss)


class _WithRotary(torch.nn.Module):
    """make_model's layers and a float buffer registered with persistent=False (a rotary
    embedding's inv_freq): averaged and checkpointed, absent from state_dict()."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 4), persistent=False)

    def forward(self, x):
        return self.net(x)


def test_a_trainer_checkpoint_converts_to_a_state_dict_that_loads_strictly(tmp_path):
    """A probe: a Trainer's bundle of a model with a non-persistent buffer named it in
    its .names.json without marking it non-persistent (the rank's tap lost the mark on
    the way to the forge), so its conversion failed a strict load_state_dict
    ('Unexpected key(s) in state_dict: "inv_freq"'); LocalSGD's bundles had it."""
    from flodl_shm.checkpoint.convert import consensus_state_dict
    from flodl_shm.checkpoint.meta import ModelSchema, names_sidecar_path

    result = Trainer(_WithRotary, sgd, make_data(), loss_fn, batch_size=8, epochs=1,
                     sync_every=4, save_path=tmp_path / "ck", log_every=None,
                     timeout=120.0).run(2)
    schema = ModelSchema.read_from_file(names_sidecar_path(result.checkpoint))
    assert schema.non_persistent == ["inv_freq"]
    state = consensus_state_dict(result.checkpoint)
    assert "inv_freq" not in state
    _WithRotary().load_state_dict(state)  # strict


def test_a_missing_outer_momentum_is_said_once(tmp_path, caplog):
    """A probe's resume without the .outer.fdl printed its warning once per rank."""
    stem = tmp_path / "diloco"
    trainer = Trainer(make_model, sgd, make_data(), loss_fn, batch_size=8, epochs=1,
                      sync_every=2, outer=OuterNesterov(lr=0.7, momentum=0.9), save_path=stem,
                      checkpoint_every=4, log_every=None, timeout=120.0)
    outer_sidecar_path(trainer.run(2).checkpoint).unlink()
    caplog.set_level("WARNING", logger="flodl_shm")
    Trainer(make_model, sgd, make_data(), loss_fn, batch_size=8, epochs=2, sync_every=2,
            outer=OuterNesterov(lr=0.7, momentum=0.9), save_path=stem, log_every=None,
            timeout=120.0).resume(stem, nprocs=3)
    said = [r for r in caplog.records if "the outer momentum restarts" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_the_log_line_of_a_checkpointed_window_says_why_in_words(tmp_path, caplog):
    """The line of a checkpointed window ended in the metadata's reason names, read by
    probes as jargon: `checkpoint .../ck-r00000010.fdl (checkpoint)` and `(graceful_shutdown)`."""
    caplog.set_level("INFO", logger="flodl_shm")
    stem = tmp_path / "ck"
    Trainer(make_model, sgd, make_data(), loss_fn, batch_size=8, epochs=1, sync_every=2,
            save_path=stem, checkpoint_every=3, log_every=100, timeout=120.0).run(2)
    lines = [r.getMessage() for r in caplog.records if ", checkpoint " in r.getMessage()]
    # 256 samples / 8 = 32 batches, 2 x 2 per window: 8 windows, checkpoints at 3, 6, 8
    assert [line.split(", checkpoint ", 1)[1] for line in lines] == [
        f"{stem}-r{w:08d}.fdl ({why})" for w, why in (
            (3, "every checkpoint_every windows"), (6, "every checkpoint_every windows"),
            (8, "the run's last"))], caplog.text


def _two_hosts(tmp_path, call, outer=False, shared_folder=False, controller_outer="same",
               controllers=None, **controller):
    """A 2-rank cohort as 2 hosts of 1 rank on loopback: ``call(trainer, i, **cluster)``
    on host i, whose Trainer saves under ``tmp_path/host<i>`` (its own disk; with
    ``shared_folder`` both save under ``tmp_path/shared``, as on NFS); (results by
    host, exceptions by host). ``outer``: DiLoCo (an outer Nesterov the controller
    steps); ``controller_outer``: the controller's own outer optimizer when it differs
    from the hosts'; ``controller``: more arguments of ``ClusterController.start``."""
    from flodl_shm import ClusterController

    from cluster_util import SALT, run_host_processes

    def nesterov():
        return OuterNesterov(lr=0.7, momentum=0.9) if outer else None

    ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=60.0,
                                  outer=nesterov() if controller_outer == "same"
                                  else controller_outer, **controller)
    if controllers is not None:  # the caller inspects it afterwards
        controllers.append(ctl)

    def host(i):
        folder = tmp_path / ("shared" if shared_folder else f"host{i}")
        trainer = make_trainer(save_path=folder / "run", checkpoint_every=4,
                               keep_checkpoints=4, outer=nesterov())
        return call(trainer, i, controller=f"127.0.0.1:{ctl.port}", world_size=2,
                    first_rank=i, salt=SALT)

    results, errors = run_host_processes(ctl, host, 2, join_timeout=100.0)
    return dict(enumerate(results)), errors


def test_one_host_joined_to_a_controller_trains_like_one_host(tmp_path):
    """A controller whose world is this one host's ranks (a cluster of one, e.g. the
    README's walk-through before the second host is added) trains as on one host. It
    used to fail every rank at the first window: the window took itself for one host
    (ranks == world) and sent a round report, which a round through a relay refuses."""
    from flodl_shm import ClusterController

    from cluster_util import SALT, run_host_processes

    ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=60.0)
    alone = make_trainer(epochs=1).run(2)

    def host(_):
        return make_trainer(epochs=1).run(2, controller=f"127.0.0.1:{ctl.port}",
                                          world_size=2, salt=SALT)

    (result,), errors = run_host_processes(ctl, host, 1, join_timeout=100.0)
    assert not errors, errors
    assert [s.window for s in result.history] == [s.window for s in alone.history]
    assert result.dead_ranks == () and len(result.history) > 0


def test_a_cluster_whose_controller_steps_another_outer_optimizer_is_refused(tmp_path):
    """On a cluster the controller steps the Trainer's outer optimizer with its own
    settings (``--outer-lr`` / ``--outer-momentum``). A controller with another lr, with
    none while the Trainer asks for DiLoCo, or with one the Trainer's rounds never ask
    for, would silently train another outer trajectory than the one the Trainer was
    built with: every rank refuses at its start, naming both and the controller flags
    that fix it."""
    def run(t, i, **c):
        return t.run(1, **c)

    cases = {
        "other lr": (True, OuterNesterov(lr=0.5, momentum=0.9),
                     ["OuterNesterov(lr=0.7, momentum=0.9)", "OuterNesterov(lr=0.5, momentum=0.9)",
                      "--outer-lr 0.7 --outer-momentum 0.9"]),
        "none at the controller": (True, None, ["the controller steps none",
                                                "--outer nesterov --outer-lr 0.7"]),
        "none in the Trainer": (False, OuterNesterov(lr=0.7, momentum=0.9),
                                ["rounds have no outer optimizer",
                                 "without --outer nesterov"]),
    }
    for name, (outer, at_controller, expected) in cases.items():
        _, errors = _two_hosts(tmp_path / name.replace(" ", "_"), run, outer=outer,
                               controller_outer=at_controller)
        assert set(errors) == {0, 1}, (name, errors)
        for text in _error_texts(errors):
            assert all(part in text for part in expected), (name, text)


def test_a_host_past_max_failures_after_another_hosts_death_saves_before_it_stops(tmp_path):
    """Two hosts of one rank, max_failures=0: host 1's rank dies in window 3. Host 0's
    launcher keeps its rank running through the controller's death declaration (it
    used to stop it unsaved, counting the remote death against its nprocs - 1 = 0
    spare ranks): the rank sees the death in the window's counts, saves a
    max_failure_exceeded bundle on host 0's disk, and the run raises TrainingAborted
    there; host 1 raises RankFailed."""
    from flodl_shm.errors import RankFailed, TrainingAborted

    def call(trainer, i, **cluster):
        if i == 1:
            trainer.hooks = [*trainer.hooks, KillAt(rank=1, window=3, batch=0)]
        return trainer.run(1, **cluster)

    controllers = []
    _, errors = _two_hosts(tmp_path, call, controllers=controllers)
    assert isinstance(errors.get(1), RankFailed) and errors[1].rank == 1, errors
    err = errors.get(0)
    assert isinstance(err, TrainingAborted), errors
    assert err.dead_ranks == (1,) and err.checkpoint is not None
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(err.checkpoint))
    assert meta.save_reason is SaveReason.MAX_FAILURE_EXCEEDED and meta.sync_round >= 2
    assert err.checkpoint.parent == tmp_path / "host0"
    # host 0 reports done once its rank returned: the controller knows the run stopped
    # early from the reason of the checkpoint it was armed with (its command said
    # "cohort finished" and exited 0)
    (ctl,) = controllers
    assert ctl.stopped_early and ctl.last_armed == (str(err.checkpoint), "max_failure_exceeded")


def test_a_host_past_rank_0_counts_its_dead_by_global_rank(tmp_path):
    """Host 1 carries global ranks 1-2 and loses rank 2 within max_failures=1. Its run
    counted spawn's local index (1) as the dead rank next to the coordinator's global 2:
    dead_ranks (1, 2), or a RankFailed naming live rank 1. (The relay's part of such a
    run: tests/test_cluster_faults.py.)"""
    from flodl_shm import ClusterController

    from cluster_util import SALT, run_host_processes

    ctl = ClusterController.start("127.0.0.1:0", 3, SALT, round_timeout=60.0)

    def host(i):
        trainer = make_trainer(save_path=tmp_path / f"host{i}" / "run", max_failures=1,
                               hooks=[KillAt(rank=2, window=3, batch=0)] if i else [])
        return trainer.run(1 + i, controller=f"127.0.0.1:{ctl.port}", world_size=3,
                           first_rank=i, salt=SALT)

    results, errors = run_host_processes(ctl, host, 2, join_timeout=120.0)
    assert not errors, errors
    for result in results:
        assert result.dead_ranks == (2,), result.dead_ranks
        assert result.meta.global_step == results[0].meta.global_step


def test_hosts_built_with_different_settings_are_refused_before_training(tmp_path):
    """Another seed on one host trained some samples twice and others never (1,540 of
    2,048 distinct in a probe), another batch size or epoch count stopped a host early
    and had it taken for dead: silently, or as a false death."""
    from flodl_shm.errors import StartRefused

    def call(trainer, i, **cluster):
        if i == 1:
            trainer.seed, trainer.epochs = 7, 3
        return trainer.run(1, **cluster)

    controllers = []
    _, errors = _two_hosts(tmp_path, call, controllers=controllers)
    assert set(errors) == {0, 1}, errors
    said = ("ValueError: the ranks differ in seed (42 on ranks [0]; 7 on ranks [1]); epochs "
            "(2 on ranks [0]; 3 on ranks [1]): build the same Trainer, with the same dataset, "
            "on every host")
    for i, e in errors.items():
        # every host names every host's values (each named only its own)
        assert isinstance(e, StartRefused) and str(e).endswith(said), e
    assert not list(tmp_path.glob("host*/run-r*")), "nothing was trained or saved"
    # the same refusal on both hosts: one reason at the controller
    (ctl,) = controllers
    refusal = f"StartRefused: could not start training: {said}"
    reasons = {why for _, why in ctl.stopped_hosts.values()}
    # (a host may hear of the other's refusal from the controller before its own)
    assert refusal in reasons and all(why == refusal or why.startswith(
        "the controller declared ranks ") for why in reasons), ctl.stopped_hosts


def test_the_controller_keeps_checkpointing_after_rank_0_died(tmp_path):
    """Only global rank 0 armed the controller's forge: once it was dead, the controller
    wrote no more bundles (with DiLoCo, the only copies of the outer momentum), and the
    run could resume only from before the death. The lowest live rank arms it now."""
    from flodl_shm import ClusterController

    from cluster_util import SALT, run_host_processes

    ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=60.0)

    def host(i):
        trainer = make_trainer(save_path=tmp_path / f"host{i}" / "run", max_failures=1,
                               checkpoint_every=4, keep_checkpoints=10,
                               hooks=[KillAt(rank=0, window=6, batch=0)] if i == 0 else [])
        return trainer.run(1, controller=f"127.0.0.1:{ctl.port}", world_size=2,
                           first_rank=i, salt=SALT)

    original = ctl.forge
    results, errors = run_host_processes(ctl, host, 2, join_timeout=120.0)
    assert set(errors) == {0} and results[1].dead_ranks == (0,), (results, errors)
    assert results[1].meta.sync_round > 8
    forge = ctl.forge or original
    # the controller's last copy is the host's last bundle, past the death at window 6
    assert forge is not None and forge.writes_completed >= 3, forge
    last = results[1].checkpoint
    assert CheckpointMeta.read_from_file(CheckpointBundle.meta_path(last)).sync_round > 8


def test_a_host_interrupted_by_its_operator_is_named_in_the_others_abort(tmp_path):
    """Host 1's operator pressed Ctrl-C. Host 0 stopped with "1 rank died ([1])", and
    its log's warning was the only place that said how host 1 had left; its abort now
    names the rank lost and how its host stopped."""
    import signal

    from flodl_shm import ClusterController
    from flodl_shm.errors import TrainingAborted

    from cluster_util import SALT, run_host_processes

    ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=60.0)

    def host(i):
        trainer = make_trainer(save_path=tmp_path / f"host{i}" / "run", checkpoint_every=2,
                               epochs=20, hooks=[KillAt(rank=1, window=5, target="launcher",
                                                        signum=signal.SIGINT)])
        return trainer.run(1, controller=f"127.0.0.1:{ctl.port}", world_size=2,
                           first_rank=i, salt=SALT)

    _, errors = run_host_processes(ctl, host, 2, join_timeout=120.0)
    assert set(errors) == {0, 1}, errors
    assert isinstance(errors[1], KeyboardInterrupt), repr(errors[1])
    said = str(errors[0])
    assert isinstance(errors[0], TrainingAborted), repr(errors[0])
    assert said.startswith("1 rank lost ([1]), more than max_failures=0."), said
    assert "\nrank 1: host " in said and ("stopped: its launcher was interrupted (Ctrl-C)"
                                          in said), said


def test_an_abort_names_only_the_death_records_of_its_own_run(tmp_path):
    """A resumed series holds the death records of the run before: a host's abort named
    the earlier run's Ctrl-C for ranks its host lost in this one."""
    import dataclasses
    import time

    from flodl_shm.checkpoint.meta import RankDeathRecord
    from flodl_shm.checkpoint.series import death_record_path
    from flodl_shm.training.trainer import TrainResult

    trainer = make_trainer(save_path=tmp_path / "run")
    earlier = RankDeathRecord.new(2, 4, "host 'b' stopped: its launcher was interrupted (Ctrl-C)")
    dataclasses.replace(earlier, unix_time_secs=earlier.unix_time_secs - 3600).write_to_file(
        death_record_path(trainer.save_path, 2))
    lost = "host 'b' was lost (connection closed; that host's output says why)"
    for r in (1, 3):
        RankDeathRecord.new(r, 4, lost).write_to_file(death_record_path(trainer.save_path, r))
    said = trainer._abort_message(TrainResult({}, [], None, None, (1, 2, 3)), time.time() - 60)
    assert said == ("3 ranks lost ([1, 2, 3]), more than max_failures=0.\n"
                    "ranks [1, 3]: host 'b' was lost (connection closed; that host's output says "
                    "why)"), said


def test_hosts_saving_into_one_shared_folder_share_its_run_lock(tmp_path):
    """Hosts of one cluster whose save paths are one shared folder (NFS): both hold the
    job's run lock (a digest of the session salt), so neither is refused; every rank's
    state lands in the shared bundles."""
    out, errors = _two_hosts(tmp_path, lambda t, i, **c: t.run(1, **c), shared_folder=True)
    assert not errors, errors
    last = out[0].checkpoint
    assert last is not None and last.parent == tmp_path / "shared"
    assert CheckpointBundle.rank_state_path(last, 0).exists()
    assert CheckpointBundle.rank_state_path(last, 1).exists()


def test_each_host_keeps_its_own_checkpoints_and_resumes_from_them(tmp_path):
    """On a cluster every host writes its own copy of each bundle (the consensus model,
    the metadata, its ranks' .optim), so it resumes from its own disk. From the same
    round, the resumed cohort ends exactly where the uninterrupted one did; from
    different rounds (a host holding an older copy), every rank refuses at once, naming
    who starts from which round, instead of training with books that disagree."""
    full, errors = _two_hosts(tmp_path / "full", lambda t, i, **c: t.run(1, **c))
    assert not errors, errors
    rounds = [r for r, _ in committed_checkpoints(tmp_path / "full" / "host1" / "run")]
    assert rounds == [4, 8, 12, 16], "host 1 (not the controller's) has every bundle"
    assert full[1].checkpoint == latest_checkpoint(tmp_path / "full" / "host1" / "run")
    for rnd in rounds:
        here, there = (round_model_path(tmp_path / "full" / f"host{i}" / "run", rnd)
                       for i in (0, 1))
        # host 0's folder also takes the controller's copy (rank 0 named that path)
        assert here.read_bytes() == there.read_bytes(), f"round {rnd}: the models differ"
        metas = [CheckpointMeta.read_from_file(CheckpointBundle.meta_path(p))
                 for p in (here, there)]
        assert metas[0] == metas[1] and metas[1].sync_round == rnd
        assert [p.name for p in sorted(there.parent.glob(f"{there.stem}.rank*.optim"))] == \
            [f"{there.stem}.rank1.optim"], "each host holds its own ranks' files"
    for host in full.values():
        assert host.meta.sync_round == 16

    def resume_from(rnd):
        return lambda t, i, **c: t.resume(
            round_model_path(tmp_path / "full" / f"host{i}" / "run", rnd[i]), 1, **c)

    results, errors = _two_hosts(tmp_path / "again", resume_from([8, 8]))
    assert not errors, errors
    for i, host in results.items():
        assert (host.meta.sync_round, host.meta.global_step) == \
            (full[i].meta.sync_round, full[i].meta.global_step)
        assert [s.window for s in host.history] == list(range(9, 17))
        for k, v in host.state_dict.items():
            assert torch.equal(v, full[i].state_dict[k]), f"{k}: the resume is not exact"
    results, errors = _two_hosts(tmp_path / "mixed", resume_from([8, 16]))
    assert set(errors) == {0, 1}, (results, errors)
    for e in errors.values():
        text = f"{e} {getattr(e, 'traceback', '')}"
        assert "start from different checkpoints" in text, text
        assert "from sync round 8: ranks [0]" in text, text
        assert "from sync round 16: ranks [1]" in text, text


def _error_texts(errors) -> list[str]:
    return [f"{e} {getattr(e, 'traceback', '')}" for e in errors.values()]


def test_a_diloco_cluster_resumes_only_with_the_controllers_momentum_of_that_round(tmp_path):
    """On a cluster the controller steps the outer optimizer and keeps its momentum
    (``.outer.fdl``, written with its copy of each bundle). Resuming hosts must find the
    controller holding the momentum of the round they continue: a controller holding
    another round's, fresh momentum, or one when the hosts start from scratch would
    silently step a different outer trajectory. Every rank refuses at its start,
    naming both rounds and the file to load; with the right one the run continues."""
    full, errors = _two_hosts(tmp_path / "full", lambda t, i, **c: t.run(1, **c), outer=True)
    assert not errors, errors
    # the controller's copies are in host 0's folder: rank 0 named that path
    saved = {rnd: load_outer_momentum(make_model(), outer_sidecar_path(
        round_model_path(tmp_path / "full" / "host0" / "run", rnd))) for rnd in (8, 12)}
    assert list((tmp_path / "full" / "host1").rglob("*.outer.fdl")) == [], \
        "a host steps no outer optimizer: only the controller saves its momentum"

    def resume_8(t, i, **c):
        return t.resume(round_model_path(tmp_path / "full" / f"host{i}" / "run", 8), 1, **c)

    _, errors = _two_hosts(tmp_path / "other", resume_8, outer=True,
                           outer_momentum=saved[12], outer_round=12)
    assert set(errors) == {0, 1}, errors
    for text in _error_texts(errors):
        assert "resume from sync round 8" in text and "sync round 12" in text, text
        assert "run-r00000008.outer.fdl" in text, text
    _, errors = _two_hosts(tmp_path / "fresh", resume_8, outer=True)
    assert set(errors) == {0, 1}, errors
    assert all("fresh outer momentum" in text for text in _error_texts(errors))
    _, errors = _two_hosts(tmp_path / "scratch", lambda t, i, **c: t.run(1, **c), outer=True,
                           outer_momentum=saved[8], outer_round=8)
    assert set(errors) == {0, 1}, errors
    assert all("start from scratch" in text and "without --outer-state" in text
               for text in _error_texts(errors))
    results, errors = _two_hosts(tmp_path / "right", resume_8, outer=True,
                                 outer_momentum=saved[8], outer_round=8)
    assert not errors, errors
    for i, host in results.items():
        assert [s.window for s in host.history] == list(range(9, 17))
        assert host.meta.sync_round == full[i].meta.sync_round == 16


def test_a_resume_refused_by_its_ranks_deletes_no_bundle(tmp_path):
    """A resume a rank refuses (an optimizer of another kind than the saved one) trains
    nothing; the end-of-run pruning still cut the series to ``keep_checkpoints``,
    deleting a committed bundle the user could have resumed from."""
    from flodl_shm.errors import StartRefused

    stem = tmp_path / "ck"
    make_trainer(epochs=1, save_path=stem, checkpoint_every=1, keep_checkpoints=4).run(2)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert len([n for n in before if n.endswith(".meta.json")]) == 4

    adam = functools.partial(torch.optim.Adam, lr=0.01)
    with pytest.raises(StartRefused, match="Adam"):
        make_trainer(adam, epochs=2, save_path=stem, keep_checkpoints=2).resume()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_rank_that_cannot_start_stops_the_run_and_leaves_no_death_record(tmp_path, caplog):
    """What only a rank can find (here: a dataset factory's data shorter than one batch)
    stops the run at once whatever max_failures allows, as StartRefused with the rank's
    error: nothing was trained, so nothing is saved, no death record is written and the
    launcher does not announce a survivors' checkpoint. A fresh run on the same save
    path then removes the death records an earlier run left, next to its own bundles."""
    from flodl_shm.checkpoint.meta import RankDeathRecord
    from flodl_shm.errors import RankFailed, StartRefused

    caplog.set_level("WARNING", logger="flodl_shm")
    stem = tmp_path / "ck"
    tiny = Trainer(make_model, sgd, functools.partial(make_data, 4), loss_fn, batch_size=8,
                   sync_every=2, max_failures=1, save_path=stem, log_every=None, timeout=60.0)
    with pytest.raises(StartRefused, match=r"^rank \d could not start training: ValueError: the "
                                           r"dataset has 4 samples, fewer than one batch of 8") \
            as info:
        tiny.run(2)
    assert isinstance(info.value.__cause__, RankFailed), "the rank's traceback is the cause"
    assert "refused to start; stopping the cohort" in caplog.text
    assert "survivors" not in caplog.text and "continuing" not in caplog.text, caplog.text
    assert list(tmp_path.glob("*.death.json")) == [], "a rank that never trained has no record"

    stale = CheckpointBundle.rank_death_path(stem, 1)  # an earlier run's rank 1 died
    stale.parent.mkdir(parents=True, exist_ok=True)
    RankDeathRecord.new(1, 2, "rank 1 was killed by signal SIGKILL").write_to_file(stale)
    result = make_trainer(epochs=1, save_path=stem).run(2)
    assert result.checkpoint is not None and result.checkpoint.exists()
    assert not stale.exists(), "an earlier run's death record outlived a fresh run"


class _OnlyABuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return x[:, :3] * self.scale


def _half_model():
    return make_model().half()


@pytest.mark.parametrize("model_fn, said", [
    (_half_model, r"TypeError: parameter '0.weight' has dtype torch.float16; "
                                  r"the Trainer averages float32 or bfloat16"),
    (_OnlyABuffer, r"ValueError: model_fn built a model \(_OnlyABuffer\) without parameters: "
                   r"the optimizer would have nothing to train"),
])
def test_a_model_the_trainer_cannot_train_is_named_in_the_trainers_words(model_fn, said):
    """A probe's float16 model was refused in LocalSGD's words (which the Trainer's user
    never built), and a model without parameters with torch's "optimizer got an empty
    parameter list"."""
    from flodl_shm.errors import StartRefused

    trainer = Trainer(model_fn, sgd, make_data(64), loss_fn, batch_size=8, sync_every=2,
                      log_every=None, timeout=60.0)
    with pytest.raises(StartRefused, match=r"^rank \d could not start training: " + said):
        trainer.run(2)


def _linear_rank0_dies_building_it():
    import multiprocessing
    import os
    import signal

    if multiprocessing.current_process().name == "flodl-shm-rank0":
        os.kill(os.getpid(), signal.SIGKILL)  # before it broadcasts its weights
    return torch.nn.Linear(4, 2)


def _linear_data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g)


def test_a_rank_killed_before_the_start_broadcast_is_the_run_s_failure(tmp_path):
    """A probe killed rank 0 during start-up: the run said 'rank 1 refused to start'
    (StartRefused: the dead broadcast root was a plain RuntimeError in rank 1's setup).
    The survivor's error is a PeerDied now, and the run's failure is rank 0's death."""
    from flodl_shm.errors import RankFailed, StartRefused

    trainer = Trainer(_linear_rank0_dies_building_it, functools.partial(torch.optim.SGD, lr=0.1),
                      _linear_data, torch.nn.functional.mse_loss, batch_size=8, epochs=1,
                      sync_every=2, log_every=None, save_path=tmp_path / "ck")
    with pytest.raises(RankFailed) as info:
        trainer.run(2)
    assert not isinstance(info.value, StartRefused)
    assert info.value.rank == 0 and info.value.signal == "SIGKILL", info.value

"""Trainer loop features: step_fn, clip_grad_norm, accumulate, scheduler_fn (real rank
processes)."""
from __future__ import annotations

import functools
import re

import pytest
import torch

import flodl_shm

from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(300)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def make_data(n=512):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 10, generator=g)
    return x, (x @ torch.randn(10, 3, generator=g)).argmax(dim=1)


def ce_step(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _run(**kwargs) -> dict:
    loss_fn = kwargs.pop("loss_fn", torch.nn.functional.cross_entropy)
    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                make_data, loss_fn, batch_size=16, epochs=1, sync_every=4,
                                log_every=None, **kwargs)
    return trainer.run(nprocs=2).state_dict


@pytest.fixture(scope="module")
def plain():
    return _run()


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_step_fn_replaces_the_loss_and_gives_the_same_run(plain):
    assert _equal(_run(loss_fn=None, step_fn=ce_step), plain)


def test_clip_grad_norm_clips_only_above_the_limit(plain):
    assert _equal(_run(clip_grad_norm=1e6), plain)
    clipped = _run(clip_grad_norm=1e-3)
    assert not _equal(clipped, plain)
    # a step moves the weights by at most lr * 1e-3 in norm: 32 steps per rank, averaged
    moved = torch.sqrt(sum(((clipped[k] - v) ** 2).sum() for k, v in _init().items()))
    assert moved <= 0.1 * 1e-3 * 32 * (1 + 1e-4)
    assert_no_leaks()


def _init() -> dict:
    torch.manual_seed(42)      # the Trainer's default seed: the model every rank starts from
    return make_model().state_dict()


def test_accumulate_splits_each_batch_into_micro_batches(plain):
    acc = _run(accumulate=4)
    for k in plain:
        torch.testing.assert_close(acc[k], plain[k], rtol=1e-4, atol=1e-5)


def test_scheduler_fn_steps_after_every_optimizer_step(plain, tmp_path):
    """A StepLR halving the rate every 3 of a rank's batches: after window w (4 batches
    a window) the rate is 0.1 * 0.5 ** (4w // 3) on every rank; a schedule that keeps the
    rate gives exactly the plain run."""
    from trainer_util import RecordLR

    keep = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=1.0)
    assert _equal(_run(scheduler_fn=keep), plain)
    halve = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    assert not _equal(_run(scheduler_fn=halve, hooks=[RecordLR(tmp_path)]), plain)
    for rank in range(2):
        lines = (tmp_path / f"lr{rank}.txt").read_text().split("\n")[:-1]
        assert len(lines) == 4  # 512 samples, 16 a batch, 2 ranks x 4 batches a window
        for line in lines:
            window, lr = line.split()
            assert float(lr) == pytest.approx(0.1 * 0.5 ** (4 * int(window) // 3))


def make_model_with_frozen_dropout():
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 3))
    model[1].eval()  # frozen by the user: no dropout in training
    return model


@pytest.mark.parametrize("evaluate", [False, True], ids=["frozen submodule", "eval hook"])
def test_training_mode_is_restored_but_a_frozen_submodule_stays(evaluate, tmp_path):
    """A hook that leaves the model in eval mode gets it back in training mode at the
    next window (every submodule with it); without such a hook, a submodule the user
    froze in eval mode stays frozen."""
    from trainer_util import RecordModes

    trainer = flodl_shm.Trainer(make_model_with_frozen_dropout,
                                functools.partial(torch.optim.SGD, lr=0.1), make_data,
                                torch.nn.functional.cross_entropy, batch_size=16, epochs=1,
                                sync_every=4, log_every=None,
                                hooks=[RecordModes(tmp_path, evaluate)])
    trainer.run(nprocs=2)
    for rank in range(2):
        lines = (tmp_path / f"mode{rank}.txt").read_text().split("\n")[:-1]
        assert len(lines) == 16
        first, later = lines[:4], lines[4:]
        assert first == ["True False"] * 4  # as model_fn left it
        assert later == (["True True"] * 12 if evaluate else ["True False"] * 12)


def test_loop_feature_arguments_are_checked():
    with pytest.raises(ValueError, match="loss_fn .* or a step_fn"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, None)
    with pytest.raises(ValueError, match="a loss_fn or a step_fn, not both.*pass None as the "
                                         "loss_fn"):  # (the loss_fn was ignored silently)
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data,
                          torch.nn.functional.cross_entropy, step_fn=ce_step)
    with pytest.raises(ValueError, match="accumulate must be an int >= 1 dividing batch_size 16"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, ce_step, batch_size=16,
                          accumulate=3)
    with pytest.raises(ValueError, match="clip_grad_norm must be a finite number > 0"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, ce_step, clip_grad_norm=0.0)
    with pytest.raises(TypeError, match="scheduler_fn must be an optimizer -> LR scheduler"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, ce_step, scheduler_fn=0.5)
    # a probe passed the class: the ranks failed with "Boolean value of Tensor ... ambiguous"
    with pytest.raises(TypeError, match=r"loss_fn is the class CrossEntropyLoss: pass an "
                                        r"instance, CrossEntropyLoss\(\)"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, torch.nn.CrossEntropyLoss)


@pytest.mark.parametrize("dataset, said", [
    (make_data()[0], "dataset sample 0 is of type Tensor"),
    ((make_data()[0],), "dataset sample 0 has 1 field"),
    ([(make_data()[0][0],)], "dataset sample 0 has 1 field"),
])
def test_a_dataset_without_targets_for_a_loss_fn_is_refused_before_the_ranks_start(dataset,
                                                                                    said):
    """A probe gave one tensor, or (x,), with a loss_fn: the ranks started and failed
    7 s later inside the model's forward (`takes 2 positional arguments but 32 were
    given`)."""
    trainer = flodl_shm.Trainer(make_model, torch.optim.SGD, dataset,
                                torch.nn.functional.cross_entropy, batch_size=16)
    with pytest.raises(TypeError, match=re.escape(said) + ": with a loss_fn, each sample "
                                        "must be an \\(input..., target\\) tuple"):
        trainer.run(nprocs=2)
    assert_no_leaks()


def test_a_dataloader_or_a_stream_as_dataset_is_named_with_the_ways_on():
    """A probe passed its DataLoader, then an IterableDataset: both got the generic
    'must be a map-style dataset' line."""
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(())

    loader = DataLoader(TensorDataset(*make_data()), batch_size=16)
    for dataset, said in ((loader, "dataset is a DataLoader: .*pass the loader's dataset "
                                   r"\(loader.dataset\) and batch_size=..., or keep your "
                                   "loop and its DataLoader with flodl_shm.LocalSGD"),
                          (Stream(), r"dataset is an IterableDataset \(Stream\): .*LocalSGD")):
        trainer = flodl_shm.Trainer(make_model, torch.optim.SGD, dataset,
                                    torch.nn.functional.cross_entropy, batch_size=16)
        with pytest.raises(TypeError, match=said):
            trainer.run(nprocs=2)
    assert_no_leaks()


def test_micro_batches_keep_the_batch_s_structure_and_name_what_cannot_be_cut():
    """accumulate cut each element of a batch with `.chunk`: a dict batch failed with
    "'str' object has no attribute 'chunk'" (a probe)."""
    from flodl_shm.training.data import micro_batches

    x, y = torch.arange(8.0).reshape(4, 2), torch.arange(4)
    parts = micro_batches({"x": x, "y": [y, {"z": y * 2}]}, 2)
    assert len(parts) == 2
    assert torch.equal(parts[1]["x"], x[2:]) and torch.equal(parts[1]["y"][0], y[2:])
    assert torch.equal(parts[0]["y"][1]["z"], y[:2] * 2) and isinstance(parts[0]["y"], list)
    assert [tuple(t.tolist() for t in p) for p in micro_batches((x[:, 0], y), 4)] == \
        [([0.0], [0]), ([2.0], [1]), ([4.0], [2]), ([6.0], [3])]
    with pytest.raises(TypeError, match=r"accumulate=2 cuts each batch's tensors into 2 "
                                        r"micro-batches, but batch\['text'\]\[0\] is a str"):
        micro_batches({"x": x, "text": ["a", "b", "c", "d"]}, 2)


def test_an_argument_that_cannot_reach_the_ranks_is_named():
    """Everything given to the Trainer travels to the ranks by pickling: a lambda, or a
    dataset that cannot be pickled, is named with its fix before any rank starts."""
    def args(**kw):
        return dict(dict(model_fn=make_model, optimizer_fn=functools.partial(
            torch.optim.SGD, lr=0.1), dataset=make_data, loss_fn=ce_step), **kw)

    class Local(torch.utils.data.Dataset):  # a class local to a function cannot be pickled
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.zeros(4), 0

    class LocalHook:  # a duck-typed hook (any of the methods will do), local: unpicklable
        def on_window_end(self, state, stats):
            pass

    cases = [
        (args(model_fn=lambda: make_model()), "Trainer: model_fn cannot be pickled .* define "
                                              "it at module top level"),
        (args(scheduler_fn=lambda opt: None), "Trainer: scheduler_fn cannot be pickled"),
        (args(dataset=Local()), "Trainer: dataset cannot be pickled .* pass a "
                                "picklable dataset, or a module-level function"),
        # not a dataset at all: said as such, before the pickling
        (args(dataset=(x for x in ())), "dataset must be a map-style dataset .* got generator"),
        (dict(args(), hooks=[flodl_shm.LoggingHook(every=1), LocalHook()]),
         r"Trainer: hooks\[1\] cannot be pickled"),
        # not a hook at all: said as such, at construction
        (dict(args(), hooks=[flodl_shm.LoggingHook(every=1), lambda: None]),
         r"hooks\[1\] \(a function\) has none of the hook methods on_train_start, "
         r"on_batch_end, on_window_end, on_train_end: subclass flodl_shm.training.hooks.Hook"),
    ]
    for kwargs, message in cases:
        with pytest.raises(TypeError, match=message):
            flodl_shm.Trainer(batch_size=16, epochs=1, log_every=None, **kwargs).run(nprocs=2)
    assert_no_leaks()


@pytest.mark.parametrize("make, said", [
    (lambda: flodl_shm.LoggingHook(every=0), r"LoggingHook every must be an int >= 1, got 0"),
    (lambda: flodl_shm.LoggingHook(every="10"), r"LoggingHook every must be an int >= 1, got '10'"),
    (lambda: flodl_shm.LoggingHook(level="INFO"), r"LoggingHook level must be an int >= 0"),
    (lambda: flodl_shm.SimulatedSlowdown(rank="1"), r"SimulatedSlowdown rank must be an int"),
    (lambda: flodl_shm.SimulatedSlowdown(rank=1, factor=0.5),
     r"SimulatedSlowdown factor must be a finite number >= 1, got 0\.5"),
    (lambda: flodl_shm.SimulatedSlowdown(rank=1, factor="4"), r"factor must be a finite number"),
    (lambda: flodl_shm.SimulatedSlowdown(rank=1, batch_ms=-3.0),
     r"SimulatedSlowdown batch_ms must be a finite number >= 0, got -3\.0"),
], ids=["every-0", "every-text", "level-text", "rank-text", "factor-below-1", "factor-text",
        "batch_ms-negative"])
def test_the_library_s_hooks_refuse_bad_settings_when_made(make, said):
    """A probe's hooks: every=0 or "10" and a factor of "4" raised at the first window or
    batch, mid-run; a rank of "1" slowed nothing and a factor of 0.5 was taken as 1,
    silently. Each is refused when the hook is made, naming the setting."""
    with pytest.raises(ValueError, match=said):
        make()


class WindowCounter:
    """A duck-typed hook: only on_window_end, no Hook base (the docs: 'an object with any
    of these methods')."""

    def __init__(self, path) -> None:
        self.path = path

    def on_window_end(self, state, stats) -> None:
        with open(f"{self.path}.rank{state.rank}", "a") as fh:
            fh.write(f"{stats.window}\n")


class Samples(torch.utils.data.Dataset):
    """A map-style dataset whose class is the dataset factory (zero arguments)."""

    def __init__(self) -> None:
        self.x, self.y = make_data(64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_duck_typed_hook_and_a_dataset_class_as_factory(tmp_path):
    """A hook with only some of the methods crashed every rank (AttributeError:
    on_train_start); a Dataset class given as the factory was taken for a dataset
    ('object of type type has no len()')."""
    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                Samples, torch.nn.functional.cross_entropy, batch_size=8,
                                epochs=1, sync_every=2, log_every=None,
                                hooks=[WindowCounter(tmp_path / "windows")])
    result = trainer.run(nprocs=2)
    windows = [s.window for s in result.history]
    assert windows == list(range(1, len(windows) + 1)) and len(windows) == 2
    for r in range(2):
        assert (tmp_path / f"windows.rank{r}").read_text().split() == [str(w) for w in windows]
    assert_no_leaks()


class FailsAtStart(flodl_shm.Hook):
    def on_train_start(self, state) -> None:
        if state.rank == 1:
            raise RuntimeError("the hook's own set-up failed")


def test_a_hook_failing_at_train_start_refuses_the_start(tmp_path):
    """on_train_start is the last step of a rank's set-up: its failure was counted as a
    rank death (a death record, a survivors' checkpoint with max_failures=1)."""
    from flodl_shm.errors import StartRefused

    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                make_data, torch.nn.functional.cross_entropy, batch_size=16,
                                epochs=1, sync_every=4, log_every=None, max_failures=1,
                                save_path=tmp_path / "ck", hooks=[FailsAtStart()])
    with pytest.raises(StartRefused, match=r"^rank 1 could not start training: RuntimeError: "
                                           r"the hook's own set-up failed"):
        trainer.run(nprocs=2)
    assert list(tmp_path.glob("*.death.json")) == [] and list(tmp_path.glob("ck-r*")) == []
    assert_no_leaks()


def small_trainer(**kw):
    """A Trainer of the module's model and data, one epoch, with ``kw`` on top."""
    args = dict(model_fn=make_model, optimizer_fn=functools.partial(torch.optim.SGD, lr=0.1),
                dataset=make_data, loss_fn=torch.nn.functional.cross_entropy,
                batch_size=16, epochs=1, log_every=None)
    return flodl_shm.Trainer(**dict(args, **kw))


def make_wide_on_rank_one():
    import os

    rank = int(os.environ.get("RANK", "0"))  # spawn sets it for each rank
    width = 32 if rank == 0 else 16
    return torch.nn.Sequential(torch.nn.Linear(10, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 3))


def make_plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=2)


def test_set_up_misuse_is_named_in_the_trainer_s_terms():
    """From a user probe: a ReduceLROnPlateau crashed mid-run (its step() needs a metric);
    an empty dataset was told to use 'a batch_size of at most 0'; a model_fn building
    other shapes on another rank was told to 'build LocalSGD' the same way."""
    from flodl_shm.errors import StartRefused

    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=2)
    # the launcher tells it from the factory, before any rank starts; the ranks, from a
    # function that builds one
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau, which steps on a metric.*"
                                        r"build it in on_train_start"):
        small_trainer(scheduler_fn=plateau).run(nprocs=2)
    with pytest.raises(StartRefused, match=r"ReduceLROnPlateau, which steps on a metric.*"
                                           r"build it in on_train_start"):
        small_trainer(scheduler_fn=make_plateau).run(nprocs=2)
    empty = (torch.zeros(0, 10), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="^the dataset is empty: pass one with samples$"):
        small_trainer(dataset=empty).run(nprocs=2)
    # (a probe's epochs=0 started two ranks for 4 s and returned the untrained model)
    with pytest.raises(ValueError, match=r"^epochs=0: a fresh run would start its ranks and "
                                         r"train nothing; build the Trainer with epochs >= 1$"):
        small_trainer(epochs=0).run(nprocs=2)
    with pytest.raises(StartRefused, match=r"the ranks' models differ: on rank \d, tensor 0 is "
                                           r"parameter '0.weight'.*: make model_fn build the "
                                           r"same model on every rank"):
        small_trainer(model_fn=make_wide_on_rank_one).run(nprocs=2)
    assert_no_leaks()


def step_float(model, batch):
    return float(ce_step(model, batch))


def step_per_sample(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def step_detached(model, batch):
    return ce_step(model, batch).detach()


class LossTensor(torch.Tensor):
    """A tensor subclass, as libraries' outputs are (MONAI's MetaTensor)."""


def step_subclass(model, batch):
    return ce_step(model, batch).as_subclass(LossTensor)


def not_a_scheduler(optimizer):
    return 5


def rows_only():
    return make_data()[0]


def fewer_rows_on_rank_one():
    import os

    return make_data(512 if os.environ.get("RANK", "0") == "0" else 480)


@pytest.mark.parametrize("step_fn, said", [
    (step_float, r"step_fn\(model, batch\) returned float 1\.\d+"),
    (step_per_sample, r"step_fn\(model, batch\) returned a tensor of shape \[16\] \(a loss "
                      r"per sample\? reduce it\)"),
    (step_detached, r"step_fn\(model, batch\) returned a tensor that does not require grad"),
], ids=["float", "per-sample", "detached"])
def test_a_step_fn_that_returns_no_loss_is_named(step_fn, said):
    """A probe's step_fn returned a float, per-sample losses, a detached tensor: the
    ranks failed with `'float' object has no attribute 'backward'` or torch's autograd
    message, from the library's own line."""
    from flodl_shm.errors import RankFailed

    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                make_data, None, step_fn=step_fn, batch_size=16, epochs=1,
                                log_every=None)
    with pytest.raises(RankFailed, match=r"raised TypeError: " + said + r".*: it must return "
                                         r"the batch's loss, a one-value tensor that requires "
                                         r"grad"):
        trainer.run(nprocs=2)
    assert_no_leaks()


def test_a_loss_of_a_tensor_subclass_trains():
    """A regression probe: the loss check refused a tensor subclass's loss (an exact type
    test), which trained before it."""
    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                make_data, None, step_fn=step_subclass, batch_size=16,
                                epochs=1, log_every=None)
    assert trainer.run(nprocs=1).meta.global_step == 32  # every batch of the epoch


def test_what_a_factory_builds_is_checked_by_the_ranks():
    """A probe's dataset factory returned one tensor (the launcher refuses that dataset
    given whole), another rank's a shorter dataset (the ranks trained until a round's
    schemas differed, or, with the same batch count, on two shuffles: samples twice),
    and a scheduler_fn an int (found at the first window's step)."""
    from flodl_shm.errors import StartRefused

    with pytest.raises(StartRefused, match=r"dataset sample 0 is of type Tensor: with a "
                                           r"loss_fn, each sample must be an \(input\.\.\., "
                                           r"target\) tuple"):
        small_trainer(dataset=rows_only).run(nprocs=2)
    with pytest.raises(StartRefused, match=r"the ranks differ in the dataset's length \(512 on "
                                           r"ranks \[0\]; 480 on ranks \[1\]\): make the dataset "
                                           r"factory build the same dataset on every rank"):
        small_trainer(dataset=fewer_rows_on_rank_one).run(nprocs=2)
    with pytest.raises(StartRefused, match=r"scheduler_fn must return an LR scheduler \(one "
                                           r"with step\(\)\), got int 5"):
        small_trainer(scheduler_fn=not_a_scheduler).run(nprocs=2)
    assert_no_leaks()


class FailsAtEnd(flodl_shm.Hook):
    def on_train_end(self, state, summary) -> None:
        if state.rank == 1:
            raise RuntimeError("the hook's own wrap-up failed")


def test_a_rank_failing_after_the_last_window_is_raised_with_a_save_path_too(tmp_path):
    """Without a save_path, a hook failing in on_train_end made run raise RankFailed; with
    one, run returned as if nothing happened (dead_ranks (1,), max_failures=0)."""
    from flodl_shm.errors import RankFailed

    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                make_data, torch.nn.functional.cross_entropy, batch_size=16,
                                epochs=1, sync_every=4, log_every=None,
                                save_path=tmp_path / "ck", hooks=[FailsAtEnd()])
    with pytest.raises(RankFailed, match=r"^rank 1 failed after the run's last window, past "
                                         r"max_failures=0; the run finished \(its last "
                                         r"checkpoint: .*ck-r\d+\.fdl\)\.\n.*wrap-up failed"
                       ) as info:
        trainer.run(nprocs=2)
    assert info.value.rank == 1
    assert_no_leaks()


def test_keep_history_keeps_the_last_windows_only(plain, caplog):
    """Every window's WindowStats stayed on every rank (about 1 KB each, a GB per rank
    over a million windows) and was pickled back at the end; keep_history bounds it,
    and by default (a soak probe's 7-minute run of 616,731 windows grew each rank by
    85 MB a minute, and the launcher by 1.3 GB at the end). The launcher says what it
    kept."""
    from flodl_shm.training.trainer import DEFAULT_KEEP_HISTORY

    assert flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, ce_step).keep_history \
        == DEFAULT_KEEP_HISTORY == 10_000
    caplog.set_level("INFO", logger="flodl_shm")

    def run(keep):
        trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                    make_data, torch.nn.functional.cross_entropy,
                                    batch_size=16, epochs=1, sync_every=4, log_every=None,
                                    keep_history=keep)
        return trainer.run(nprocs=2)

    full, last2, none = run(None), run(2), run(0)
    assert [s.window for s in full.history] == [1, 2, 3, 4]
    assert [(s.window, s.global_step) for s in last2.history] == \
        [(s.window, s.global_step) for s in full.history[-2:]]
    assert none.history == []
    assert _equal(last2.state_dict, plain) and _equal(none.state_dict, plain)
    kept = [r.getMessage() for r in caplog.records if "result.history holds" in r.getMessage()]
    assert kept == ["result.history holds the last 2 of this run's 4 windows (keep_history=2; "
                    "keep_history=None keeps every one)"], kept
    with pytest.raises(ValueError, match="keep_history must be an int >= 0"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, make_data, ce_step, keep_history=-1)


class _DivergeAt:
    """A step_fn whose loss turns NaN from window ``at`` on (a picklable callable)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, model, batch):
        loss = ce_step(model, batch)
        self.seen = getattr(self, "seen", 0) + 1
        return loss * float("nan") if self.seen > 4 * (self.at - 1) else loss


def test_a_diverged_run_reads_nan_and_keeps_its_last_finite_checkpoint(tmp_path, caplog):
    """A probe's loss turned NaN: every window logged `loss 0.0000` (the count column
    made a non-finite loss 0), and the run wrote its NaN consensus as checkpoints, the
    last as `graceful_shutdown`, pruning the finite ones it had. The loss now reads nan,
    and a non-finite consensus is not checkpointed (said once)."""
    caplog.set_level("INFO", logger="flodl_shm")
    stem = tmp_path / "ck"
    trainer = flodl_shm.Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1),
                                make_data, None, step_fn=_DivergeAt(3), batch_size=16,
                                epochs=1, sync_every=4, log_every=1, save_path=stem,
                                checkpoint_every=1, keep_checkpoints=2)
    result = trainer.run(nprocs=2)
    losses = [w.cohort_loss for w in result.history]
    assert all(x == x for x in losses[:2]) and all(x != x for x in losses[2:]), losses
    assert "step 16: loss 0." in caplog.text and "step 24: loss nan," in caplog.text
    assert [r for r, _ in flodl_shm.checkpoint.series.committed_checkpoints(stem)] == [1, 2]
    said = [r.getMessage() for r in caplog.records if "holds NaN or inf" in r.getMessage()]
    assert len(said) == 1 and "window 3: the consensus holds NaN or inf (training " \
        f"diverged): it is not checkpointed, so {stem}-r00000002.fdl stays the newest " \
        "checkpoint" in said[0], said
    assert "clip the gradients (clip_grad_norm=...)" in said[0]  # (not said once it is set)
    assert str(result.checkpoint).endswith("ck-r00000002.fdl"), result.checkpoint
    assert_no_leaks()

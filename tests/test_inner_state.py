"""Restoring the inner optimizer and scheduler (training/inner_state.py): a resume used to
apply the checkpoint's learning rate, momentum and schedule over the ones the run was built
with, silently; an optimizer of another kind failed at its first step (KeyError)."""
from __future__ import annotations

import logging

import numpy as np

import pytest
import torch

from flodl_shm.training.inner_state import read_rank_state, restore_inner


def _saved(make_opt, make_sched=None, steps: int = 3):
    model = torch.nn.Linear(3, 2)
    opt = make_opt(model.parameters())
    sched = None if make_sched is None else make_sched(opt)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        if sched is not None:
            sched.step()
    return opt.state_dict(), None if sched is None else sched.state_dict()


def _fresh(make_opt, make_sched=None):
    opt = make_opt(torch.nn.Linear(3, 2).parameters())
    return opt, None if make_sched is None else make_sched(opt)


def sgd(lr=0.1, momentum=0.9):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def cosine(t_max):
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)


def test_the_settings_a_restore_replaces_are_named(caplog):
    caplog.set_level(logging.WARNING, logger="flodl_shm")
    opt_state, _ = _saved(sgd(lr=0.1, momentum=0.9))
    opt, _ = _fresh(sgd(lr=0.001, momentum=0.0))
    restore_inner(opt, None, opt_state, None, "ck.rank0.optim", "set them after load()")
    assert opt.param_groups[0]["lr"] == 0.1  # torch's semantics: the saved run continues
    assert ("ck.rank0.optim restores the saved inner settings over the ones built now: "
            "lr 0.1 (built now: 0.001), momentum 0.9 (built now: 0.0). The resume continues "
            "the saved run exactly; to train with new settings, set them after load()"
            ) in caplog.text


def test_a_schedule_compares_its_settings_not_where_it_was(caplog):
    caplog.set_level(logging.WARNING, logger="flodl_shm")
    opt_state, sched_state = _saved(sgd(), cosine(20))
    opt, sched = _fresh(sgd(), cosine(60))
    restore_inner(opt, sched, opt_state, sched_state, "ck", "...")
    assert sched.T_max == 20
    assert "settings over the ones built now: scheduler T_max 20 (built now: 60)." in caplog.text
    assert "lr " not in caplog.text  # the scheduled lr moved; its initial_lr did not
    caplog.clear()
    opt, sched = _fresh(sgd(), cosine(20))
    restore_inner(opt, sched, opt_state, sched_state, "ck", "...")
    opt, _ = _fresh(sgd(lr=0.5))
    restore_inner(opt, None, opt_state, None, "ck", "...", say=False)
    assert caplog.text == ""  # the same settings, or another rank says it


def one_cycle(max_momentum=0.95):
    return lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=10, max_momentum=max_momentum)


@pytest.mark.parametrize("make_opt", [sgd(), lambda p: torch.optim.AdamW(p, lr=0.01)],
                         ids=["sgd-momentum", "adamw-betas"])
def test_a_cycling_schedule_moves_momentum_without_a_word(caplog, make_opt):
    """A probe's every resume of a OneCycleLR run warned `restores the saved inner settings
    ...: betas (0.876..., 0.999) (built now: (0.95, 0.999))`: the schedule moves momentum
    (betas[0]) as it moves lr. Its settings are max_momentum and base_momentum, and
    betas[1], which are still compared."""
    caplog.set_level(logging.WARNING, logger="flodl_shm")
    opt_state, sched_state = _saved(make_opt, one_cycle())
    opt, sched = _fresh(make_opt, one_cycle())
    restore_inner(opt, sched, opt_state, sched_state, "ck", "...")
    assert caplog.text == ""
    opt, sched = _fresh(make_opt, one_cycle(max_momentum=0.99))
    restore_inner(opt, sched, opt_state, sched_state, "ck", "...")
    assert "max_momentum 0.95 (built now: 0.99)" in caplog.text
    assert "momentum 0." not in caplog.text.replace("max_momentum", "")
    if "betas" in opt_state["param_groups"][0]:
        caplog.clear()
        opt, sched = _fresh(lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.9, 0.99)),
                            one_cycle())
        restore_inner(opt, sched, opt_state, sched_state, "ck", "...")
        assert "betas (" in caplog.text and "0.999) (built now: (0.95, 0.99))" in caplog.text


def test_an_optimizer_of_another_kind_is_refused_before_loading():
    opt_state, _ = _saved(sgd())
    adam = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.01)
    with pytest.raises(ValueError, match=r"^ck holds the state of another kind of optimizer "
                                         r"than the Adam built now \(its parameter group 0 has "
                                         r"dampening, momentum, nesterov where the Adam has "
                                         r"amsgrad, betas, .*\): resume with the optimizer"):
        restore_inner(adam, None, opt_state, None, "ck", "...")
    assert adam.param_groups[0]["lr"] == 0.01 and not adam.state  # nothing loaded
    two = torch.nn.Linear(3, 2)
    grouped = torch.optim.SGD([{"params": [two.weight]}, {"params": [two.bias]}], lr=0.1)
    with pytest.raises(ValueError, match="1 parameter groups; the SGD built now has 2"):
        restore_inner(grouped, None, opt_state, None, "ck", "...")


def test_a_damaged_rank_state_file_is_named_with_the_ways_on(tmp_path):
    """torch.load of a truncated file says 'PytorchStreamReader failed reading zip
    archive', naming neither the file nor what to do."""
    from flodl_shm.errors import CheckpointError

    path = tmp_path / "ck-r00000004.rank0.optim"
    torch.save({"format": "x", "optimizer": {"state": {}}}, path)
    assert read_rank_state(path)["format"] == "x"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=rf"^{path} cannot be read \(.*\): the file is "
                                              r"damaged or truncated\. Resume from the bundle "
                                              r"before this one, or delete this file"):
        read_rank_state(path)


def test_a_nan_setting_restored_over_a_nan_one_is_no_change(caplog):
    """A probe's resume named a NaN parameter-group setting as replaced by the same NaN
    (NaN != NaN): the log line listed a change that was none."""
    caplog.set_level(logging.WARNING, logger="flodl_shm")
    opt_state, _ = _saved(sgd())
    opt_state["param_groups"][0]["floor"] = float("nan")
    opt_state["param_groups"][0]["window"] = (float("nan"), 0.5)
    opt, _ = _fresh(sgd())
    opt.param_groups[0]["floor"] = float("nan")
    opt.param_groups[0]["window"] = (float("nan"), 0.5)
    restore_inner(opt, None, opt_state, None, "ck", "...")
    assert caplog.text == ""
    opt, _ = _fresh(sgd())
    opt.param_groups[0]["floor"] = 1.0
    opt.param_groups[0]["window"] = (float("nan"), 0.25)
    restore_inner(opt, None, opt_state, None, "ck", "...")
    assert "floor nan (built now: 1.0), window (nan, 0.5) (built now: (nan, 0.25))" in caplog.text


def test_settings_compare_by_value_whatever_holds_them():
    """A regression probe: a NaN in a tensor, a numpy float32 or a dict (a scheduler's
    nested state), and equal tensors of several elements, were each named as replaced."""
    from flodl_shm.training.inner_state import _differs

    nan = float("nan")
    same = [(torch.tensor(nan), torch.tensor(nan)), (np.float32(nan), np.float32(nan)),
            ({"a": nan, "b": [1, (nan, 2.0)]}, {"a": nan, "b": [1, (nan, 2.0)]}),
            ([{"a": nan}], ({"a": nan},)), (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])),
            (torch.tensor([1, 2]), torch.tensor([1, 2])), (1, 1.0), (0.0, -0.0),
            (torch.tensor(nan), nan), (0.5, torch.tensor(0.5)), (np.ones(3), np.ones(3)),
            (np.array([nan]), np.array([nan])), (np.array(["a"]), np.array(["a"])),
            (10 ** 400, 10 ** 400)]
    for a, b in same:
        assert not _differs(a, b), (a, b)
    differ = [(torch.tensor(nan), torch.tensor(1.0)), (np.float32(0.5), 0.25),
              ({"a": 1.0}, {"a": 2.0}), ({"a": 1.0}, {"b": 1.0}), (torch.tensor([1.0, 2.0]),
              torch.tensor([1.0, 2.5])), (torch.tensor([1.0]), torch.tensor([1.0, 1.0])),
              (torch.tensor([1.0]), torch.tensor([1], dtype=torch.int64)), (nan, None),
              (0.9, 0.9000001), ((0.9, 0.999), (0.9, 0.99)), (torch.tensor(nan), 1.0),
              (np.ones(3), np.zeros(3)), (10 ** 400, 1), (np.array(["a"]), np.array(["b"]))]
    for a, b in differ:
        assert _differs(a, b), (a, b)


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2)],
    ids=["plateau", "warm-restarts"])
def test_a_schedule_s_progress_is_not_named_as_a_setting(caplog, make):
    """A regression probe: restoring a ReduceLROnPlateau built with the same settings
    logged 'scheduler best 0.5 (built now: inf)' (and CosineAnnealingWarmRestarts its
    T_cur and T_i): where the schedule was, not a setting."""
    caplog.set_level(logging.WARNING, logger="flodl_shm")
    model = torch.nn.Linear(3, 2)
    opt = sgd()(model.parameters())
    sched = make(opt)
    for i in range(7):
        opt.step()
        # (a plateau: the schedule lowers lr, which the probe saw named as a setting)
        sched.step(1.0 + i) if isinstance(
            sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()
    assert opt.param_groups[0]["lr"] < 0.1
    opt2, sched2 = _fresh(sgd(), make)
    restore_inner(opt2, sched2, opt.state_dict(), sched.state_dict(), "ck", "...")
    assert caplog.text == ""

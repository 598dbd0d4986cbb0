"""A rank's state file of a checkpoint bundle (``<stem>.rank<N>.optim``): reading it, checking
that it is this rank's share of this save and undamaged, and restoring the rank's inner
optimizer and LR scheduler from it, saying what the checkpoint overrides.

Integrity: each file carries a CRC-32 of its saved values (:func:`seal_rank_state`), and
LocalSGD's the id of the save it belongs to (the same on every rank of one save); a load
checks both (:func:`check_rank_checksum`, ``LocalSGD.load``), so a file damaged on disk or
copied in from another save is refused, naming it, instead of starting its rank from other
values than the others'.

Inner state:

torch's ``Optimizer.load_state_dict`` and ``LRScheduler.load_state_dict`` restore the
saved hyper-parameters (``lr``, ``momentum``, ``T_max``, ...) over the ones the
optimizer and the scheduler were just built with: that is what makes a resume continue
the saved run exactly. A user who resumes with a new learning rate or schedule would
otherwise see it ignored silently, so :func:`restore_inner` logs each setting the
checkpoint replaces, with the way to apply new ones (set them after the restore). An
optimizer of another kind than the one that saved the state (its parameter groups carry
other settings: SGD's ``momentum`` against Adam's ``betas``) is refused before anything
is loaded, naming both; torch would load it and fail at the first step.
"""
from __future__ import annotations

import logging
import numbers
from typing import Any, Optional

logger = logging.getLogger("flodl_shm")

__all__ = ["check_optimizer_state", "check_rank_checksum", "check_rank_file", "read_rank_state",
           "restore_inner", "seal_rank_state", "state_checksum"]

def read_rank_state(path, *, lazy: bool = False) -> Any:
    """A rank's state file of a checkpoint bundle (``<stem>.rank<N>.optim``), read with
    ``torch.load``; a file that cannot be read raises ``CheckpointError`` naming it and
    the ways on, where torch's own error names neither (``PytorchStreamReader failed
    reading zip archive``). ``lazy``: the tensors stay mapped from the file, read only
    where they are touched (to learn another rank's small fields without reading its
    optimizer state)."""
    import torch

    from ..errors import CheckpointError

    try:
        return torch.load(path, weights_only=False, mmap=lazy)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a damaged file
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{path} cannot be read ({type(e).__name__}: {first}): the file is damaged or "
            f"truncated. {_WAYS_ON}") from e


#: what a damaged rank state file leaves its user
_WAYS_ON = ("Resume from the bundle before this one, or delete this file to load the consensus "
            "with the inner optimizer, schedule and counters fresh (this rank's under the "
            "Trainer, every rank's under LocalSGD)")


def state_checksum(obj: Any) -> int:
    """A CRC-32 of every dense tensor and NumPy array in ``obj`` with its dtype and shape,
    and of every plain number and string (dicts, lists and tuples walked, their keys taken
    in; other objects, such as an ElChe, skipped): what a rank state file's bytes must
    still hold when it is read back (a damaged file otherwise loads silently, a NaN in it
    spreading to every rank at the next sync)."""
    import zlib

    import numpy as np
    import torch

    crc = 0

    def walk(x: Any, key: str) -> None:
        nonlocal crc
        if isinstance(x, torch.Tensor):
            if x.layout is torch.strided and not x.is_nested and x.device.type == "cpu":
                crc = zlib.crc32(f"{key}:{x.dtype}{tuple(x.shape)}".encode(), crc)
                crc = zlib.crc32(x.detach().contiguous().reshape(-1).view(torch.uint8)
                                 .numpy(), crc)
        elif isinstance(x, np.ndarray):  # (NumPy's RNG state)
            crc = zlib.crc32(f"{key}:{x.dtype}{x.shape}".encode(), crc)
            crc = zlib.crc32(np.ascontiguousarray(x).tobytes(), crc)
        elif x is None or isinstance(x, (bool, int, float, str)):  # (counters, Python's RNG)
            crc = zlib.crc32(f"{key}={x!r}".encode(), crc)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}/{i}")

    walk(obj, "")
    return crc


def seal_rank_state(state: dict, save_id: Optional[int] = None) -> dict:
    """``state`` with the checksum of its values (:func:`state_checksum`, which the load
    checks: a file damaged on disk is refused instead of loaded) and, for LocalSGD, the
    save it belongs to (``save_id``, the same on every rank of one save: a rank file
    copied in from another save of the same sync round is refused too). The checksum
    covers the save id: a damaged id would otherwise read as a file of another save."""
    sealed = {k: v for k, v in state.items() if k != "checksum"}
    if save_id is not None:
        sealed["save_id"] = int(save_id)
    sealed["checksum"] = state_checksum(sealed)
    return sealed


def check_rank_checksum(path, state: dict) -> None:
    """Raise ``CheckpointError`` naming ``path`` when its values no longer match the
    checksum written with them (a file of an older version, without one, passes)."""
    from ..errors import CheckpointError

    saved = state.get("checksum")
    if saved is None:
        return
    rest = {k: v for k, v in state.items() if k != "checksum"}
    if state_checksum(rest) == saved:
        return
    # a file of the versions whose checksum left the save id out
    older = {k: v for k, v in rest.items() if k != "save_id"}
    if len(older) < len(rest) and state_checksum(older) == saved:
        return
    raise CheckpointError(f"{path} is damaged: its values do not match the checksum "
                          f"written with them. {_WAYS_ON}")


def check_rank_file(path, meta_path, saved_rank, rank: int, saved_round,
                    meta_round: int) -> None:
    """Refuse a rank's state file that is not this rank's share of this bundle: one
    written by another rank (a copy or rename: this rank would take that rank's RNG and
    draw its data) or by another save than the one its ``.meta.json`` commits."""
    if saved_rank != rank:
        raise ValueError(
            f"{path} holds rank {saved_rank}'s state, not rank {rank}'s: the bundle's rank "
            f"files were copied or renamed. Put each rank's own file back, or delete this one "
            f"to load the consensus with the inner state fresh (this rank's under the "
            f"Trainer, every rank's under LocalSGD)")
    if saved_round != meta_round:
        raise ValueError(
            f"{path} holds sync round {saved_round} but {meta_path} marks round {meta_round} "
            f"complete: the files come from different saves; load a bundle that was written "
            f"whole (its stem: the newest complete one)")


#: scheduler state entries that record progress, not settings (ReduceLROnPlateau's best
#: and counters, CosineAnnealingWarmRestarts' place in its cycle)
_PROGRESS = frozenset({"last_epoch", "base_lrs", "best", "num_bad_epochs",
                       "cooldown_counter", "T_cur", "T_i"})


def restore_inner(optimizer, scheduler, optimizer_state: Optional[dict],
                  scheduler_state: Optional[dict], where: str, override: str,
                  say: bool = True) -> None:
    """Load ``optimizer_state`` / ``scheduler_state`` (each skipped when None or when its
    object is None) and log the settings they replace.

    Args:
        optimizer: the optimizer built now; ``scheduler``: the LR scheduler (or None).
        where: the checkpoint, for messages (e.g. its ``.rank0.optim`` path).
        override: how to apply new settings after the restore, for the log line.
        say: log the replaced settings (one rank of a cohort whose ranks agree says it).

    Raises:
        ValueError: the saved optimizer state is of another kind or shape (parameter
            groups, their settings) than ``optimizer``, naming both.
    """
    changed = []
    if optimizer is not None and optimizer_state is not None:
        changed += check_optimizer_state(optimizer, optimizer_state, where,
                                         scheduled=scheduler is not None)
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None and scheduler_state is not None:
        fresh = scheduler.state_dict()
        changed += [f"scheduler {k} {v!r} (built now: {fresh[k]!r})"
                    for k, v in scheduler_state.items()
                    if k in fresh and not k.startswith("_") and k not in _PROGRESS
                    and _differs(v, fresh[k])]
        scheduler.load_state_dict(scheduler_state)
    if changed and say:
        logger.warning("%s restores the saved inner settings over the ones built now: %s. "
                       "The resume continues the saved run exactly; to train with new "
                       "settings, %s", where, ", ".join(changed), override)


def check_optimizer_state(optimizer, state: dict, where: str,
                          scheduled: bool = False) -> list[str]:
    """The settings of the saved optimizer ``state`` that differ from ``optimizer``'s
    (described for the log); raises ``ValueError`` for a state of another optimizer
    kind or group layout (call it before changing anything, to refuse a load whole).
    ``scheduled``: an LR scheduler moves ``lr`` (where it was is no setting; one that
    keeps no ``initial_lr``, ReduceLROnPlateau, leaves nothing to compare it with)."""
    saved, fresh = state.get("param_groups", []), optimizer.param_groups
    kind = type(optimizer).__name__
    if len(saved) != len(fresh):
        raise ValueError(f"{where} holds an optimizer state of {len(saved)} parameter groups; "
                         f"the {kind} built now has {len(fresh)}: resume with the optimizer "
                         f"that saved it")
    out = []
    for i, (s, f) in enumerate(zip(saved, fresh)):
        # under a scheduler, lr is where the schedule was; initial_lr is the setting
        initial = "initial_lr" in s and "initial_lr" in f
        skip = {"params", "param_names", "lr" if initial or scheduled else "initial_lr"}
        keys_s, keys_f = set(s) - skip, set(f) - skip
        if keys_s - keys_f and keys_f - keys_s:  # (one-sided: a torch version's new default)
            raise ValueError(
                f"{where} holds the state of another kind of optimizer than the {kind} built "
                f"now (its parameter group {i} has {', '.join(sorted(keys_s - keys_f))} where "
                f"the {kind} has {', '.join(sorted(keys_f - keys_s))}): resume with the "
                f"optimizer that saved it")
        if len(s.get("params", ())) != len(f["params"]):
            raise ValueError(f"{where} holds an optimizer state whose parameter group {i} has "
                             f"{len(s['params'])} tensors; the {kind} built now has "
                             f"{len(f['params'])}: resume with the optimizer that saved it")
        group = f" (group {i})" if len(fresh) > 1 else ""
        # a cycling schedule (OneCycleLR, CyclicLR with cycle_momentum) moves momentum, or
        # betas[0], between its base_momentum and max_momentum, which are the settings
        cycled = "max_momentum" in s and "max_momentum" in f
        out += [f"{k}{group} {s[k]!r} (built now: {f[k]!r})" for k in sorted(keys_f & keys_s)
                if not (cycled and k == "momentum")
                and (_differs(s[k][1:], f[k][1:]) if cycled and k == "betas"
                     else _differs(s[k], f[k]))]
    return out


def _differs(a: Any, b: Any) -> bool:
    """Whether a saved setting ``a`` differs from the one built now, ``b``: numbers by
    value (a NaN is the same as a NaN), sequences, dicts and tensors element by element
    (a tuple such as ``betas``, a scheduler's nested states, a tensor ``lr``)."""
    import numpy as np
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        # a one-value tensor against a number (or anything else): by its value
        a, b = [x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x
                for x in (a, b)]
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        try:
            a, b = torch.from_numpy(a), torch.from_numpy(b)
        except TypeError:  # (strings, objects)
            return not np.array_equal(a, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return True
        same = a == b
        if a.is_floating_point() or a.is_complex():
            same |= a.isnan() & b.isnan()
        return not bool(same.all())
    if isinstance(a, numbers.Number) and isinstance(b, numbers.Number):
        return a != b and not (a != a and b != b)  # (NaN: the one value unequal to itself)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    try:
        return bool(a != b)
    except Exception:  # e.g. an object without a meaning for ==: worth naming
        return True

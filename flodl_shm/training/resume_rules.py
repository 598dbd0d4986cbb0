"""What a resume cannot change, known before any rank starts: the settings a
checkpoint binds (``resume_conflicts``: its shuffle seed, batch size, epoch size and
an ElChe state's world size) and the model it fits (``model_mismatch``). The Trainer
words a conflict in its arguments, the demo in its flags.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..checkpoint.meta import CheckpointMeta
from .coverage import untouched


@dataclass(frozen=True)
class ResumeConflict:
    """A setting of the resuming run that cannot continue a checkpoint: the checkpoint's
    value (``saved``) and the run's (``given``). ``setting`` is ``"seed"``,
    ``"batch_size"``, ``"world_size"`` (an ElChe cadence state is per rank),
    ``"dataset"`` (its epoch size, in samples) or ``"dataset_len"`` (its sample count,
    whose shuffle the epoch in progress is, where the epoch sizes agree); ``why`` says,
    in parentheses, what binds the saved value (for the dataset: how the run's epoch
    size comes about)."""

    setting: str
    saved: Any
    given: Any
    why: str


def resume_conflicts(meta: CheckpointMeta, *, seed: int, batch_size: int, epochs: int,
                     dataset_len: Optional[int], world: int, elche: bool
                     ) -> list[ResumeConflict]:
    """What keeps a run with these settings from continuing the checkpoint ``meta``
    describes (empty: nothing), known before any rank starts: the shuffle seed and the
    batch size its record of the samples still to train refers to, the epoch size and
    the dataset's length (of an epoch in progress), and the world size of an ElChe
    cadence state. A finished checkpoint (``meta.epoch >= epochs``: nothing left to
    train) binds no seed, batch size or dataset.

    Args:
        meta: the checkpoint's metadata.
        seed, batch_size, epochs: the resuming run's.
        dataset_len: its dataset's length (None: unknown, a factory).
        world: its number of ranks.
        elche: whether it runs the ElChe cadence.
    """
    out = []
    cov = meta.coverage
    if cov is not None and meta.epoch < epochs:  # what the ranks' coordinator reads
        if cov.seed != seed:
            out.append(ResumeConflict(
                "seed", cov.seed, seed, "(its record of the samples still to train refers "
                "to that seed's shuffle; another would train some samples twice and skip "
                "others)"))
        if cov.batch_size != batch_size:
            out.append(ResumeConflict(
                "batch_size", cov.batch_size, batch_size, f"(its record of the samples "
                f"still to train counts whole batches of {cov.batch_size})"))
        per_epoch = (None if dataset_len is None
                     else (dataset_len // batch_size) * batch_size)
        for ec in cov.per_epoch:
            if ec.epoch != meta.epoch or untouched(ec):
                continue  # (an epoch none of whose samples were trained starts afresh)
            if per_epoch not in (None, ec.total_samples):
                out.append(ResumeConflict(
                    "dataset", ec.total_samples, per_epoch, f"({dataset_len} samples in "
                    f"batches of {batch_size})"))
            elif None not in (cov.dataset_len, dataset_len) and cov.dataset_len != dataset_len:
                out.append(ResumeConflict(
                    "dataset_len", cov.dataset_len, dataset_len, "(its epoch in progress is "
                    "a shuffle of that many samples: another count puts other samples in "
                    "the same batches, training some twice and skipping others)"))
    if meta.elche_state is not None and elche:
        saved_world = len(meta.elche_state.smoothed_ms_per_batch)
        if saved_world != world:
            out.append(ResumeConflict(
                "world_size", saved_world, world, "(its ElChe cadence state is per rank)"))
    return out


def model_mismatch(model_path: "str | os.PathLike[str]", model_fn: Callable) -> Optional[str]:
    """Why the consensus checkpoint ``model_path`` cannot load into the model ``model_fn``
    builds (a parameter or averaged buffer missing, extra, of another shape, or, with
    the bundle's names, of another name; the message calls them "the checkpoint" and
    "the model"), or None when it fits.

    Reads the ``.fdl``'s headers only, and the bundle's ``.names.json`` to name the
    tensors; ``model_fn`` is called once here, on torch's meta device (no memory, no
    draw from torch's RNG, no torch thread pool started in the launcher). A model that
    cannot be built there is left to the ranks' own load to check (None)."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = model_fn()
    except Exception:  # model_fn needs real tensors: the ranks' load checks it
        return None
    if not isinstance(model, torch.nn.Module):
        return None  # the ranks raise the TypeError naming it
    return checkpoint_mismatch(model_path, model)


def checkpoint_mismatch(model_path: "str | os.PathLike[str]", model) -> Optional[str]:
    """:func:`model_mismatch` for a model already built (its tensors' shapes and names
    only are read: a model on the meta device will do)."""
    from ..checkpoint.fdl import FdlReader
    from ..checkpoint.forge import consensus_targets
    from ..checkpoint.meta import ModelSchema, names_sidecar_path
    from ..errors import CheckpointError

    mine = {t.key: (t.label, tuple(t.tensor.shape)) for t in consensus_targets(model)}
    with FdlReader(model_path) as reader:
        saved = {e.name: tuple(e.shape) for e in reader.entries(False)}
    try:
        names = ModelSchema.read_from_file(names_sidecar_path(model_path)).positional_names()
    except (CheckpointError, OSError):
        names = {}  # no names (an older bundle): the positions name them

    def kind(key: str) -> str:
        return "buffer" if key.startswith("b") else "parameter"

    problems, renamed = [], []
    for key, (label, shape) in mine.items():
        theirs = names.get(key, label)
        if key not in saved:
            problems.append(f"the model's {kind(key)} {label!r} {list(shape)} is not in the "
                            f"checkpoint")
        elif saved[key] != shape and theirs == label:
            problems.append(f"{kind(key)} {label!r} is {list(saved[key])} in the checkpoint "
                            f"and {list(shape)} in the model")
        elif saved[key] != shape:
            problems.append(f"{kind(key)} {key} is {theirs!r} {list(saved[key])} in the "
                            f"checkpoint and {label!r} {list(shape)} in the model")
        elif theirs != label:
            renamed.append(f"{kind(key)} {key} {list(shape)} is {theirs!r} in the checkpoint "
                           f"and {label!r} in the model")
    problems += [f"the checkpoint's {kind(key)} {names.get(key, key)!r} {list(shape)} has no "
                 f"place in the model" for key, shape in saved.items() if key not in mine]
    if not problems and renamed:  # same shapes, other names: another model, or renamed
        more = f" (and {len(renamed) - 2} more)" if len(renamed) > 2 else ""
        return ("; ".join(renamed[:2]) + more + f" (if it is the same model with renamed "
                f"modules, delete the bundle's {names_sidecar_path(model_path).name} to load "
                f"it by position)")
    if not problems:
        return None
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    counts = (f"{len(saved)} tensors in the checkpoint, {len(mine)} in the model; "
              if len(saved) != len(mine) else "")
    return counts + "; ".join(problems[:2]) + more

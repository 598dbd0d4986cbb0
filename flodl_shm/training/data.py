"""Map-style datasets for the trainer: fetch a batch by sample ids.

The trainer never iterates a DataLoader: each rank knows the exact dataset indices
of every batch it trains (offsets into the epoch's permutation, dispatched by the
coordinator), so it fetches them directly. Accepted datasets:

- a tuple or list of tensors with a common first dimension, or a
  ``torch.utils.data.TensorDataset``: a batch is each tensor indexed by the ids (one
  gather per tensor, no per-sample Python);
- any map-style dataset (``__len__`` + ``__getitem__``): the items are fetched one by
  one and collated with ``torch.utils.data.default_collate``;
- a zero-argument factory returning one of the above, called once in each rank (so a
  large dataset is built where it is used instead of pickled to every rank).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["check_samples_fit_loss_fn", "fetch_batch", "first_sample", "is_dataset_factory",
           "micro_batches", "resolve_dataset"]


class _Tensors:
    """Tensors sharing their first dimension, indexed together."""

    def __init__(self, tensors) -> None:
        tensors = tuple(tensors)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("a tensor dataset must be a non-empty tuple of tensors")
        n = tensors[0].shape[0] if tensors[0].dim() else 0
        for i, t in enumerate(tensors):
            if t.dim() == 0 or t.shape[0] != n:
                raise ValueError(f"dataset tensor {i} has shape {tuple(t.shape)}; every tensor "
                                 f"needs the same first dimension ({n} samples)")
        self.tensors = tensors

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def fetch(self, ids: torch.Tensor):
        return tuple(t[ids] for t in self.tensors)


def is_dataset_factory(dataset: Any) -> bool:
    """Whether ``dataset`` is a zero-argument callable that builds the dataset (a
    function, a ``functools.partial``, a Dataset class) rather than a dataset."""
    return callable(dataset) and (isinstance(dataset, type)
                                  or not hasattr(dataset, "__getitem__"))


def resolve_dataset(dataset: Any):
    """The dataset the rank trains on (see the module doc); raises ``TypeError`` for
    anything else."""
    if is_dataset_factory(dataset):
        dataset = dataset()
    if isinstance(dataset, (tuple, list)) and dataset:
        kinds = [isinstance(t, torch.Tensor) for t in dataset]
        if all(kinds):
            return _Tensors(dataset)
        if any(kinds):
            bad = kinds.index(False)
            raise TypeError(f"dataset element {bad} is of type {type(dataset[bad]).__name__}: "
                            f"a dataset of tensors needs every element to be a tensor "
                            f"(inputs..., target), each with one row per sample")
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return _Tensors(dataset.tensors)
    own_loop = ("or keep your loop and its DataLoader with flodl_shm.LocalSGD "
                "(docs/local_sgd.md)")
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise TypeError(f"dataset is a DataLoader: the Trainer fetches each batch by its "
                        f"sample ids itself (it dispatches them to the ranks); pass the "
                        f"loader's dataset (loader.dataset) and batch_size=..., {own_loop}")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(f"dataset is an IterableDataset ({type(dataset).__name__}): the "
                        f"Trainer dispatches samples by index, which a stream has not; pass "
                        f"a map-style dataset (__len__ and __getitem__), {own_loop}")
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return dataset
    raise TypeError(
        f"dataset must be a map-style dataset (__len__ and __getitem__), a tuple of tensors, "
        f"or a zero-argument factory returning one; got {type(dataset).__name__}")


def first_sample(dataset) -> Any:
    """Sample 0 of a resolved dataset (``resolve_dataset``), as the batches will hold
    its fields: for tensors indexed together, the tuple of those tensors (one field
    each); else ``dataset[0]``."""
    if isinstance(dataset, _Tensors):
        return dataset.tensors
    return dataset[0]


def check_samples_fit_loss_fn(dataset) -> None:
    """Raise ``TypeError`` unless sample 0 of a resolved dataset is an ``(input...,
    target)`` tuple, which ``loss_fn(model(*inputs), target)`` unpacks (a single tensor
    would unpack along its rows, silently)."""
    if not len(dataset):
        return
    item = first_sample(dataset)
    if not isinstance(item, (tuple, list)) or len(item) < 2:
        what = (f"is of type {type(item).__name__}" if not isinstance(item, (tuple, list))
                else f"has {len(item)} field")
        raise TypeError(f"dataset sample 0 {what}: with a loss_fn, each sample must be "
                        f"an (input..., target) tuple; pass a tuple of tensors "
                        f"(inputs..., targets), a list of such items, or a step_fn "
                        f"(model, batch) -> loss")


def fetch_batch(dataset, ids: np.ndarray):
    """The batch of samples ``ids`` (dataset indices, int64), in that order."""
    if isinstance(dataset, _Tensors):
        return dataset.fetch(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))
    from torch.utils.data import default_collate

    return default_collate([dataset[int(i)] for i in ids])


def micro_batches(batch, k: int) -> list:
    """``batch`` cut into ``k`` micro-batches along the first dimension of each of its
    tensors, keeping its structure (tuples, lists and dicts of tensors, nested): the
    ``accumulate`` split. Anything else in the batch (a string, a number) cannot be
    cut: ``TypeError`` naming it and the way on."""
    def split(x, where: str) -> list:
        if isinstance(x, torch.Tensor):
            return list(x.chunk(k))
        if isinstance(x, dict):
            parts = [split(v, f"{where}[{key!r}]") for key, v in x.items()]
            return [dict(zip(x.keys(), vals)) for vals in zip(*parts)]
        if isinstance(x, (tuple, list)):
            parts = [split(v, f"{where}[{i}]") for i, v in enumerate(x)]
            return [type(x)(vals) for vals in zip(*parts)]
        raise TypeError(f"accumulate={k} cuts each batch's tensors into {k} micro-batches, "
                        f"but {where} is a {type(x).__name__}: keep the batch to tensors "
                        f"(tuples, lists and dicts of them), or train with accumulate=1")
    return split(batch, "batch")

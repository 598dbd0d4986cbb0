"""The ``torch.distributed`` backend ``"flodl_shm"`` (docs/c10d.md).

``import flodl_shm`` registers it: at once when torch is already imported, otherwise
the moment torch finishes importing (an import hook), so ``import flodl_shm`` stays
free of torch. After that, ``dist.init_process_group("flodl_shm", ...)`` works with
``env://`` (torchrun), ``tcp://``, a store, or ``flodl_shm.spawn``'s environment.

This module imports nothing heavy; the process group itself lives in
``process_group.py`` and loads when the first group is created (``group_lifecycle.py``).
"""
from __future__ import annotations

import importlib.machinery
import sys

BACKEND_NAME = "flodl_shm"

_registered = False


def _create(store, rank, size, timeout):
    from .group_lifecycle import create_process_group

    return create_process_group(store, rank, size, timeout)


def register() -> None:
    """Register the ``"flodl_shm"`` backend with ``torch.distributed`` (CPU tensors).
    Idempotent; imports torch."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():  # pragma: no cover - torch built without distributed
        return
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
    _registered = True


class _RegisterAfterTorch:
    """Finds nothing itself: wraps the loader of ``torch`` so that ``register()`` runs
    right after torch finished importing, then removes itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            try:
                register()
            except Exception:  # never break `import torch` over our backend
                import logging

                logging.getLogger("flodl_shm").exception(
                    "could not register the flodl_shm torch.distributed backend")

        spec.loader.exec_module = exec_module
        return spec


def register_when_torch_loads() -> None:
    """Register now if torch is imported, else as soon as it is (no torch import here)."""
    if "torch.distributed" in sys.modules:
        register()
    elif "torch" not in sys.modules and not any(
            isinstance(f, _RegisterAfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTorch())

"""Consensus checkpoints: ``.fdl`` files, the forge, the metadata sidecar.

- ``flodl_shm.checkpoint.fdl``: flodl's ``.fdl`` byte layout (read, write from raw
  payload bytes, load by name into a torch module) and ``LoadReport``;
- ``flodl_shm.checkpoint.forge``: ``CheckpointForge`` (accumulates the consensus
  frames of one cycle and writes them off the reduce thread),
  ``load_consensus_checkpoint``, ``load_outer_momentum``;
- ``flodl_shm.checkpoint.meta``: ``ModelSchema``, ``CheckpointMeta`` (the
  ``.meta.json`` sidecar), ``SaveReason``, ``ElCheState``, ``CoverageBlock``,
  ``EpochCoverage``, ``RankDeathRecord``, ``CheckpointBundle``;
- ``flodl_shm.checkpoint.convert``: ``.fdl`` <-> torch state_dict <-> safetensors;
- ``flodl_shm.cli.fdl``: ``python -m flodl_shm fdl ...``.

Names are imported lazily so that importing the metadata types does not pull in
torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CheckpointForge": "forge",
    "load_consensus_checkpoint": "forge",
    "load_outer_momentum": "forge",
    "outer_sidecar_path": "forge",
    "LoadReport": "fdl",
    "FdlEntry": "fdl",
    "RawEntry": "fdl",
    "read_fdl": "fdl",
    "write_fdl_raw": "fdl",
    "load_checkpoint_file": "fdl",
    "ModelSchema": "meta",
    "CheckpointMeta": "meta",
    "SaveReason": "meta",
    "ElCheState": "meta",
    "CoverageBlock": "meta",
    "EpochCoverage": "meta",
    "RankDeathRecord": "meta",
    "CheckpointBundle": "meta",
    "CHECKPOINT_META_SCHEMA_VERSION": "meta",
    "RANK_DEATH_RECORD_SCHEMA_VERSION": "meta",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl_shm.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__

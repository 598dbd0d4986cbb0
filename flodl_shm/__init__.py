"""flodl_shm: CPU-averaged data-parallel PyTorch training over shared memory.

Ranks on one host exchange model frames through shared-memory rings and reduce
them to a weighted consensus Σ(wᵣ·Tᵣ)/Σwᵣ with numba kernels; a relay per host
bridges to a controller over authenticated TCP for multi-host cohorts. See
README.md for the quick start and DESIGN notes.

The public API is re-exported here lazily: ``import flodl_shm`` is cheap and
pulls in torch or numba only when a name that needs them is first used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # errors
    "FrameError": "flodl_shm.errors",
    "SchemaMismatchError": "flodl_shm.errors",
    "CheckpointError": "flodl_shm.errors",
    "RankFailed": "flodl_shm.errors",
    "ReduceStall": "flodl_shm.errors",
    "RankStalled": "flodl_shm.errors",
    "CohortAborted": "flodl_shm.errors",
    "ShmSpaceError": "flodl_shm.errors",
    "HandshakeRejected": "flodl_shm.errors",
    "TrainingAborted": "flodl_shm.errors",
    "StartRefused": "flodl_shm.errors",
    "SeriesInUse": "flodl_shm.errors",
    # frames
    "DTYPE_F32": "flodl_shm.frame",
    "DTYPE_BF16": "flodl_shm.frame",
    "RoundKind": "flodl_shm.frame",
    "TensorPayload": "flodl_shm.frame",
    "RoundFrame": "flodl_shm.frame",
    "tensors_to_round_frame": "flodl_shm.frame",
    "round_frame_to_tensors": "flodl_shm.frame",
    # launch and collectives
    "spawn": "flodl_shm.launch",
    "RankContext": "flodl_shm.launch",
    "Comm": "flodl_shm.engine.comm",
    "ClusterController": "flodl_shm.cluster.controller",
    # realized work and dead ranks
    "gamma_mass": "flodl_shm.training.realized_work",
    "mover_mass": "flodl_shm.training.realized_work",
    "sumcount_reduce": "flodl_shm.training.realized_work",
    "DeadRanks": "flodl_shm.cluster.dead_ranks",
    # staging and RAM
    "pinned_decode_affordable": "flodl_shm.engine.staging",
    "DECODE_SLOT_PARAMS": "flodl_shm.engine.staging",
    "DECODE_SLOT_BUFFERS": "flodl_shm.engine.staging",
    # checkpoints
    "CheckpointForge": "flodl_shm.checkpoint.forge",
    "load_consensus_checkpoint": "flodl_shm.checkpoint.forge",
    "load_outer_momentum": "flodl_shm.checkpoint.forge",
    "LoadReport": "flodl_shm.checkpoint.fdl",
    "ModelSchema": "flodl_shm.checkpoint.meta",
    "CheckpointMeta": "flodl_shm.checkpoint.meta",
    "SaveReason": "flodl_shm.checkpoint.meta",
    "ElCheState": "flodl_shm.checkpoint.meta",
    "CoverageBlock": "flodl_shm.checkpoint.meta",
    "EpochCoverage": "flodl_shm.checkpoint.meta",
    "RankDeathRecord": "flodl_shm.checkpoint.meta",
    "CheckpointBundle": "flodl_shm.checkpoint.meta",
    "CHECKPOINT_META_SCHEMA_VERSION": "flodl_shm.checkpoint.meta",
    "RANK_DEATH_RECORD_SCHEMA_VERSION": "flodl_shm.checkpoint.meta",
    # training runtime
    "ElChe": "flodl_shm.training.el_che",
    "Phase": "flodl_shm.training.el_che",
    "TrendGuard": "flodl_shm.training.convergence",
    "OuterAvg": "flodl_shm.training.outer",
    "OuterNesterov": "flodl_shm.training.outer",
    "ChunkPool": "flodl_shm.training.coverage",
    # trainer API
    "LocalSGD": "flodl_shm.training.local_sgd",
    "DiLoCo": "flodl_shm.training.local_sgd",
    "Trainer": "flodl_shm.training.trainer",
    "TrainResult": "flodl_shm.training.trainer",
    "Hook": "flodl_shm.training.hooks",
    "LoggingHook": "flodl_shm.training.hooks",
    "SimulatedSlowdown": "flodl_shm.training.hooks",
    "WindowStats": "flodl_shm.training.hooks",
    "BatchInfo": "flodl_shm.training.hooks",
    "RankState": "flodl_shm.training.hooks",
    "RankSummary": "flodl_shm.training.hooks",
    "Coordinator": "flodl_shm.training.coordinator",
    "CoordinatorConfig": "flodl_shm.training.coordinator",
    "latest_checkpoint": "flodl_shm.checkpoint.series",
    "NoGuard": "flodl_shm.training.convergence",
    "SpawnContext": "flodl_shm.launch",
    # multi-host secrets
    "new_salt": "flodl_shm.cluster.secret",
    "read_secret_file": "flodl_shm.cluster.secret",
    "write_secret_file": "flodl_shm.cluster.secret",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # submodules load on first attribute access too (flodl_shm.testing, ...secret)
        try:
            value = importlib.import_module(f"flodl_shm.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"flodl_shm.{name}":
                raise
            raise AttributeError(f"module 'flodl_shm' has no attribute {name!r}") from None
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


# torch.distributed backend "flodl_shm": registered when torch loads (no torch import here)
from .distributed import register_when_torch_loads as _register_c10d  # noqa: E402

_register_c10d()

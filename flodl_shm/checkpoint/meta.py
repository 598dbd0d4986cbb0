"""Checkpoint metadata: the model schema, the ``.meta.json`` sidecar, death records
and the bundle's path helpers (flodl 0.7.0 ``checkpoint_meta.rs``; docs/checkpoints.md, "Metadata types").

A checkpoint *bundle* is a set of files sharing one stem::

    <stem>.fdl               consensus model (params p{i}, averaged buffers b{j})
    <stem>.outer.fdl         outer-optimizer momentum (only for stateful outer optimizers)
    <stem>.optim             optimizer state (written by the training runtime)
    <stem>.meta.json         CheckpointMeta: where the run was (the bundle's commit marker)
    <stem>.names.json        ModelSchema: the qualified names behind p{i} / b{j}
    <stem>.config.json       architecture sidecar, when the model has one
    <stem>.rank<N>.death.json  RankDeathRecord of a rank that died on its own

Every helper here applies Rust's ``PathBuf::set_extension`` to the stem: one
existing extension is dropped first, so ``ckpt.fdl`` and ``ckpt`` name the same
bundle.

The JSON layout is flodl's (serde field names, snake_case enum names, ``null``
for absent optionals, 2-space pretty printing), so Rust flodl and flodl_shm read
each other's sidecars.

``CHECKPOINT_META_SCHEMA_VERSION`` history:

- 1: epoch, global_step, sync_round, world_size_at_save, save_reason
- 2: optional ``elche_state`` (v1 files parse with it ``None``)
- 3: ``elche_state.trend_history`` (v2 files parse with it ``None``)
- 4: optional ``coverage`` (v3 files parse with it ``None``)

A file whose version is newer than this one is refused loudly rather than
half-understood.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import CheckpointError
from ._atomic import atomic_write_bytes

if TYPE_CHECKING:  # (read by processes that do not import torch)
    import torch

#: Version stamped into every ``.meta.json`` this build writes; newer files are refused.
CHECKPOINT_META_SCHEMA_VERSION = 4
#: Version stamped into every ``.rank<N>.death.json``.
RANK_DEATH_RECORD_SCHEMA_VERSION = 1
#: Version stamped into every ``.names.json`` (a ``ModelSchema``).
MODEL_NAMES_SCHEMA_VERSION = 1

_U64_MAX = (1 << 64) - 1


# --- path helpers ---------------------------------------------------------------


def checkpoint_path(path: "str | os.PathLike[str]") -> Path:
    """``path`` as a ``Path``; ``TypeError`` naming it for bytes (which ``pathlib``
    refuses without saying which path)."""
    raw = os.fspath(path)
    if isinstance(raw, bytes):
        raise TypeError(f"checkpoint path {raw!r} is bytes: pass a str or a pathlib.Path "
                        f"(os.fsdecode() turns bytes into a str)")
    return Path(raw)


def set_extension(path: "str | os.PathLike[str]", ext: str) -> Path:
    """Rust ``PathBuf::set_extension``: drop one existing extension, append ``.ext``.

    ``a/ckpt`` -> ``a/ckpt.ext``; ``a/ckpt.fdl`` -> ``a/ckpt.ext``;
    ``a/ckpt.tar.gz`` -> ``a/ckpt.tar.ext``; a leading dot is not an extension
    (``.ckpt`` -> ``.ckpt.ext``); ``ext == ""`` only drops the extension.

    Raises ``ValueError`` when the path has no file name (``""``, ``"."``, ``"/"``) or
    ends with a separator (``"runs/job/"`` names a directory: the files would land
    beside it as ``runs/job.fdl``).
    """
    p = checkpoint_path(path)
    raw = os.fspath(path)
    name = p.name
    if not name or name in (".", ".."):
        raise ValueError(
            f"checkpoint stem {raw!r} has no file name; pass a stem such as "
            f"'runs/job/ckpt' (the bundle files are named after it)"
        )
    if isinstance(raw, str) and raw.endswith(("/", os.sep)):
        raise ValueError(
            f"checkpoint stem {raw!r} ends with a separator, as a directory does, but the "
            f"bundle files are named after the stem ({name}.fdl beside that directory); "
            f"pass a stem inside it, such as {raw + 'ckpt'!r}"
        )
    dot = name.rfind(".")
    stem = name[:dot] if dot > 0 else name
    return p.with_name(f"{stem}.{ext}" if ext else stem)


class CheckpointBundle:
    """Paths of the files of one checkpoint bundle, derived from a stem.

    Every method accepts ``str`` or ``os.PathLike`` and returns a ``pathlib.Path``;
    one existing extension on the stem is dropped first (``set_extension``), so
    ``"ckpt.fdl"`` and ``"ckpt"`` give the same bundle.
    """

    @staticmethod
    def model_path(stem: "str | os.PathLike[str]") -> Path:
        """Consensus model: ``<stem>.fdl``."""
        return set_extension(stem, "fdl")

    @staticmethod
    def optim_path(stem: "str | os.PathLike[str]") -> Path:
        """Optimizer state: ``<stem>.optim``."""
        return set_extension(stem, "optim")

    @staticmethod
    def meta_path(stem: "str | os.PathLike[str]") -> Path:
        """Metadata sidecar: ``<stem>.meta.json`` (same as ``CheckpointMeta.sidecar_path``)."""
        return CheckpointMeta.sidecar_path(stem)

    @staticmethod
    def config_sidecar_path(stem: "str | os.PathLike[str]") -> Path:
        """Architecture sidecar: ``<stem>.config.json``."""
        return set_extension(stem, "config.json")

    @staticmethod
    def names_path(stem: "str | os.PathLike[str]") -> Path:
        """Parameter and buffer names: ``<stem>.names.json`` (see :func:`names_sidecar_path`
        for the sidecar of a model file)."""
        return set_extension(stem, "names.json")

    @staticmethod
    def outer_path(stem: "str | os.PathLike[str]") -> Path:
        """Outer-optimizer momentum: ``<stem>.outer.fdl`` (see ``forge.outer_sidecar_path``
        for the ``.fdl.gz`` form)."""
        return set_extension(stem, "outer.fdl")

    @staticmethod
    def rank_death_path(stem: "str | os.PathLike[str]", rank: int) -> Path:
        """Per-rank death record: ``<stem>.rank<N>.death.json``.

        Per rank, unlike the shared ``.meta.json``: several ranks may die
        independently and none may clobber another's record.
        """
        return _rank_file(stem, rank, "death.json")

    @staticmethod
    def rank_state_path(stem: "str | os.PathLike[str]", rank: int) -> Path:
        """A rank's own resume state in a bundle (its inner optimizer, LR scheduler...):
        ``<stem>.rank<N>.optim``."""
        return _rank_file(stem, rank, "optim")


def _rank_file(stem: "str | os.PathLike[str]", rank: int, what: str) -> Path:
    """``<stem>.rank<N>.<what>`` (one extension of ``stem`` dropped first)."""
    rank = _check_uint(rank, "rank")
    base = set_extension(stem, "")
    return base.with_name(f"{base.name}.rank{rank}.{what}")


def names_sidecar_path(model_path: "str | os.PathLike[str]") -> Path:
    """The ``.names.json`` of the bundle a model file belongs to.

    ``x.fdl``, ``x.fdl.gz``, ``x.outer.fdl`` and ``x.outer.fdl.gz`` all map to
    ``x.names.json``: the outer-momentum sidecar's ``p{i}`` are the same
    parameters as the model's. Any other name gets its extension replaced.
    """
    p = Path(os.fspath(model_path))
    name = p.name
    for suffix in (".fdl.gz", ".fdl"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            if name.endswith(".outer") and len(name) > len(".outer"):
                name = name[: -len(".outer")]
            return p.with_name(name + ".names.json")
    return set_extension(p, "names.json")


#: the name endings of a bundle's files (``<stem>`` + one of these), longest first
_BUNDLE_FILE = re.compile(r"(\.rank\d+\.(?:optim|death\.json)|\.outer\.fdl\.gz|\.outer\.fdl"
                          r"|\.fdl\.gz|\.fdl|\.optim|\.meta\.json|\.names\.json"
                          r"|\.config\.json)$")


def bundle_meta_of(path: "str | os.PathLike[str]") -> Optional[Path]:
    """The ``.meta.json`` of the checkpoint bundle whose file ``path`` names (any of
    the files listed at the top of this module, written or not yet), when that
    ``.meta.json`` exists; None otherwise. A tool that writes files uses it to keep
    off a committed bundle: a resume reads every one of its files."""
    p = Path(os.fspath(path))
    m = _BUNDLE_FILE.search(p.name)
    if m is None or m.start() == 0:
        return None
    meta = p.with_name(p.name[: m.start()] + ".meta.json")
    return meta if meta.exists() else None


# --- JSON field validation ------------------------------------------------------


def _check_uint(value: Any, name: str, limit: int = _U64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(
            f"{name} must be a non-negative integer, got {value!r} ({type(value).__name__})"
        )
    if value < 0 or value > limit:
        raise CheckpointError(f"{name} = {value} is out of range 0 ..= {limit}")
    return int(value)


def _check_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    f = float(value)
    if not math.isfinite(f):
        raise CheckpointError(f"{name} = {value!r} is not finite (JSON cannot carry NaN or inf)")
    return f


def _check_list(value: Any, name: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(f"{name} must be a list, got {value!r} ({type(value).__name__})")
    return list(value)


def _require(obj: dict, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise CheckpointError(f"{where} is missing required field {key!r}")
    return obj[key]


def _check_version(obj: dict, where: str, supported: int, source: str) -> int:
    """The record's ``schema_version``; refused (message: "newer than") above ``supported``."""
    version = _check_uint(_require(obj, "schema_version", where), "schema_version", 0xFFFFFFFF)
    if version > supported:
        raise CheckpointError(
            f"{where}: schema version {version} in {source} is newer than the version "
            f"{supported} this build supports; upgrade flodl_shm to read it"
        )
    return version


# --- model schema ---------------------------------------------------------------


def averaged_buffers(module) -> list:
    """The ``(qualified_name, tensor)`` buffers of ``module`` that the cohort averages.

    Exactly the floating-point entries of ``module.named_buffers()``, in that
    order. The others (integer ``num_batches_tracked``, bool masks, complex
    ``freqs_cis``) stay local to each rank: they are neither averaged nor in a
    consensus checkpoint. This is
    the single definition shared by ``ModelSchema.from_module``, the forge's
    ``b{j}`` keys and ``load_consensus_checkpoint``.
    """
    return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]


def consensus_param_key(i: int) -> str:
    """Positional ``.fdl`` key of the i-th parameter (``module.parameters()`` order)."""
    return f"p{i}"


def consensus_buffer_key(j: int) -> str:
    """Positional ``.fdl`` key of the j-th averaged buffer (:func:`averaged_buffers` order)."""
    return f"b{j}"


@dataclass
class ModelSchema:
    """Static, ordered names of the tensors a consensus carries.

    ``param_names`` follow ``module.named_parameters()`` (== ``parameters()``)
    order; ``buffer_names`` the floating-point ``named_buffers()`` in order (see
    :func:`averaged_buffers`). The consensus frames carry params first, then
    these buffers; a checkpoint writer pairs them positionally: the i-th
    parameter is key ``p{i}``, the j-th averaged buffer ``b{j}``.

    ``tied`` maps each further name of a shared tensor to the name it is carried
    under: a model whose output head reuses its embedding lists the head's weight
    once in ``param_names`` (as ``parameters()`` does), while its ``state_dict()``
    has both keys. The converters emit the tied names too, so the result loads with
    a strict ``load_state_dict``.

    ``non_persistent`` lists the carried buffers registered with
    ``persistent=False`` (a rotary embedding's ``inv_freq``): averaged and checkpointed
    like the others, but left out of what the converters emit, as ``state_dict()``
    leaves them out.
    """

    param_names: list[str] = field(default_factory=list)
    buffer_names: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    non_persistent: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.param_names = [str(n) for n in self.param_names]
        self.buffer_names = [str(n) for n in self.buffer_names]
        self.tied = {str(a): str(n) for a, n in dict(self.tied).items()}
        self.non_persistent = [str(n) for n in self.non_persistent]
        stray = [n for n in self.non_persistent if n not in self.buffer_names]
        if stray:
            raise CheckpointError(f"ModelSchema.non_persistent names {stray}, which are not "
                                  f"among its buffers {self.buffer_names}")
        carried = set(self.param_names) | set(self.buffer_names)
        if len(carried) != len(self.param_names) + len(self.buffer_names):
            seen: set[str] = set()
            twice = sorted({n for n in (*self.param_names, *self.buffer_names)
                            if n in seen or seen.add(n)})
            raise CheckpointError(
                f"ModelSchema names {twice} more than once among its params and buffers: "
                f"a converted state_dict would keep one tensor per name and drop the others")
        for alias, name in self.tied.items():
            if name not in carried or alias in carried:
                raise CheckpointError(
                    f"ModelSchema.tied[{alias!r}] = {name!r}: a tied name must map a name "
                    f"the schema does not carry to one it carries (params and buffers: "
                    f"{sorted(carried)})")

    @classmethod
    def from_module(cls, module: "torch.nn.Module") -> "ModelSchema":
        """Capture the schema of a torch ``nn.Module`` (names only; no weights read)."""
        if not callable(getattr(module, "named_parameters", None)):
            raise TypeError(f"ModelSchema.from_module takes a torch.nn.Module, got "
                            f"{type(module).__name__} {module!r:.60}")
        tied: dict[str, str] = {}
        params = module.named_parameters(remove_duplicate=False)
        floats = ((n, b) for n, b in module.named_buffers(remove_duplicate=False)
                  if b.is_floating_point())  # integer buffers are not carried
        for named in (params, floats):
            first: dict[int, str] = {}
            for n, t in named:
                if id(t) in first:
                    tied[n] = first[id(t)]
                else:
                    first[id(t)] = n
        buffer_names = [n for n, _ in averaged_buffers(module)]
        hidden = {f"{prefix}.{b}" if prefix else b for prefix, m in module.named_modules()
                  for b in getattr(m, "_non_persistent_buffers_set", ())}
        return cls(
            param_names=[n for n, _ in module.named_parameters()],
            buffer_names=buffer_names,
            tied=tied,
            non_persistent=[n for n in buffer_names if n in hidden],
        )

    def tensor_count(self) -> int:
        """Params + averaged buffers: the tensor count a complete consensus carries."""
        return len(self.param_names) + len(self.buffer_names)

    def positional_names(self) -> dict[str, str]:
        """``{"p0": param_names[0], ..., "b0": buffer_names[0], ...}``: the qualified name
        behind each positional key of a consensus checkpoint."""
        names = {consensus_param_key(i): n for i, n in enumerate(self.param_names)}
        names.update({consensus_buffer_key(j): n for j, n in enumerate(self.buffer_names)})
        return names

    def as_state_dict(self, named: dict) -> dict:
        """``named`` (qualified names to tensors) as the model's ``state_dict()`` has
        them: each tied name whose tensor is in it added, as the same tensor object
        (``torch.save`` stores it once), and the non-persistent buffers left out."""
        out = {n: t for n, t in named.items() if n not in self.non_persistent}
        for alias, name in self.tied.items():
            if name in out:
                out[alias] = out[name]
        return out

    def write_to_file(self, path: "str | os.PathLike[str]") -> None:
        """Commit the names as pretty JSON (``schema_version``, ``param_names``,
        ``buffer_names``, and ``tied`` when the model shares tensors) to ``path``
        atomically: a bundle's ``.names.json``."""
        p = Path(os.fspath(path))
        obj = {"schema_version": MODEL_NAMES_SCHEMA_VERSION, **self.to_dict()}
        atomic_write_bytes(p, _dump_json(obj, "ModelSchema", p))

    @classmethod
    def read_from_file(cls, path: "str | os.PathLike[str]") -> "ModelSchema":
        """Read a ``.names.json``; ``CheckpointError`` when unreadable, malformed, or newer
        than ``MODEL_NAMES_SCHEMA_VERSION``."""
        def parse(obj: dict, source: str) -> "ModelSchema":
            _check_version(obj, "ModelSchema", MODEL_NAMES_SCHEMA_VERSION, source)
            return cls.from_dict(obj)

        return _read_json_file(path, "ModelSchema", parse)

    def to_dict(self) -> dict:
        d = {"param_names": list(self.param_names), "buffer_names": list(self.buffer_names)}
        if self.tied:  # absent for the common untied model: its files stay as they were
            d["tied"] = dict(self.tied)
        if self.non_persistent:  # likewise
            d["non_persistent"] = list(self.non_persistent)
        return d

    @classmethod
    def from_dict(cls, obj: dict) -> "ModelSchema":
        where = "ModelSchema"
        names = {}
        for key in ("param_names", "buffer_names"):
            items = _check_list(_require(obj, key, where), f"{where}.{key}")
            for i, n in enumerate(items):
                if not isinstance(n, str):
                    raise CheckpointError(f"{where}.{key}[{i}] must be a string, got {n!r}")
            names[key] = items
        tied = obj.get("tied", {})
        if not isinstance(tied, dict) or not all(isinstance(a, str) and isinstance(n, str)
                                                 for a, n in tied.items()):
            raise CheckpointError(f"{where}.tied must map names to names, got {tied!r}")
        hidden = obj.get("non_persistent", [])
        if not isinstance(hidden, list) or not all(isinstance(n, str) for n in hidden):
            raise CheckpointError(f"{where}.non_persistent must be a list of names, got "
                                  f"{hidden!r}")
        return cls(**names, tied=tied, non_persistent=hidden)


# --- save reason ----------------------------------------------------------------


class SaveReason(str, enum.Enum):
    """Why a checkpoint was written. Values are the snake_case JSON names.

    ``to_u8`` / ``from_u8`` give the stable wire byte codes (0-5, in declaration
    order); existing codes never change and new reasons take the next byte.
    """

    GRACEFUL_SHUTDOWN = "graceful_shutdown"
    MAX_FAILURE_EXCEEDED = "max_failure_exceeded"
    SINGLE_SURVIVOR = "single_survivor"
    ALL_RANKS_LOST = "all_ranks_lost"
    REDUCE_STALL = "reduce_stall"
    CHECKPOINT = "checkpoint"

    def __str__(self) -> str:
        return self.value

    @property
    def words(self) -> str:
        """Why, in the words a log line says (``"the run's last"``, not its JSON name)."""
        return _SAVE_REASON_WORDS[self]

    def to_u8(self) -> int:
        """The stable wire byte (0 = graceful_shutdown ... 5 = checkpoint)."""
        return _SAVE_REASON_CODES[self]

    @classmethod
    def from_u8(cls, byte: int) -> Optional["SaveReason"]:
        """Decode a wire byte; ``None`` for a byte this build doesn't know (a newer
        peer's reason), so the caller can log it and fall back instead of crashing."""
        return _SAVE_REASON_BY_CODE.get(byte)


_SAVE_REASON_WORDS = {
    SaveReason.CHECKPOINT: "every checkpoint_every windows",
    SaveReason.GRACEFUL_SHUTDOWN: "the run's last",
    SaveReason.MAX_FAILURE_EXCEEDED: "ranks failed past max_failures",
    SaveReason.SINGLE_SURVIVOR: "one rank left",
    SaveReason.ALL_RANKS_LOST: "all ranks lost",
    SaveReason.REDUCE_STALL: "a round stalled",
}
_SAVE_REASON_CODES = {r: i for i, r in enumerate(SaveReason)}
_SAVE_REASON_BY_CODE = {i: r for r, i in _SAVE_REASON_CODES.items()}


def _parse_save_reason(value: Any, where: str) -> SaveReason:
    try:
        return SaveReason(value)
    except ValueError:
        known = ", ".join(r.value for r in SaveReason)
        raise CheckpointError(f"{where} = {value!r} is not a known save reason ({known})") from None


# --- ElChe state and coverage ---------------------------------------------------

#: ElChe's lifecycle phases in order, as stored in the sidecar (JSON names).
ELCHE_PHASES = ("probe", "warmup", "stable", "mature")


def _check_phase(phase, where: str) -> str:
    """The phase as its JSON name; a name outside :data:`ELCHE_PHASES` is refused."""
    name = str(getattr(phase, "value", phase))
    if name not in ELCHE_PHASES:
        raise CheckpointError(
            f"{where}.phase = {phase!r} is not a known phase ({', '.join(ELCHE_PHASES)})")
    return name


@dataclass
class ElCheState:
    """ElChe's trajectory at save time, for cadence resume without recalibration.

    Attributes:
        anchor: batches per cycle of the slow anchor rank.
        anchor_rank: the elected anchor rank, ``None`` before the first calibration.
        smoothed_ms_per_batch: per-rank mean ms/batch over the trust window
            (length = world size at save; 0.0 for ranks without a reading).
        phase: lifecycle phase, one of :data:`ELCHE_PHASES` (the values of the
            training layer's ``Phase`` enum, which converts to and from it).
        calibration_count: successful ``report_timing`` calls so far.
        trend_history: the convergence guard's divergence ring (schema v3), or
            ``None`` when the guard keeps no state.
    """

    anchor: int
    anchor_rank: Optional[int]
    smoothed_ms_per_batch: list[float]
    phase: str
    calibration_count: int
    trend_history: Optional[list[float]] = None

    def to_dict(self) -> dict:
        return {
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms_per_batch": [float(v) for v in self.smoothed_ms_per_batch],
            "phase": _check_phase(self.phase, "elche_state"),
            "calibration_count": self.calibration_count,
            "trend_history": (None if self.trend_history is None
                              else [float(v) for v in self.trend_history]),
        }

    @classmethod
    def from_dict(cls, obj: dict) -> "ElCheState":
        where = "elche_state"
        anchor_rank = _require(obj, "anchor_rank", where)
        phase = _require(obj, "phase", where)
        phase = _check_phase(phase, where)
        trend = obj.get("trend_history")
        return cls(
            anchor=_check_uint(_require(obj, "anchor", where), f"{where}.anchor"),
            anchor_rank=(None if anchor_rank is None
                         else _check_uint(anchor_rank, f"{where}.anchor_rank")),
            smoothed_ms_per_batch=[
                _check_float(v, f"{where}.smoothed_ms_per_batch[{i}]")
                for i, v in enumerate(_check_list(_require(obj, "smoothed_ms_per_batch", where),
                                                  f"{where}.smoothed_ms_per_batch"))
            ],
            phase=phase,
            calibration_count=_check_uint(_require(obj, "calibration_count", where),
                                          f"{where}.calibration_count"),
            trend_history=(None if trend is None else [
                _check_float(v, f"{where}.trend_history[{i}]")
                for i, v in enumerate(_check_list(trend, f"{where}.trend_history"))
            ]),
        )


@dataclass
class EpochCoverage:
    """Uncovered data of one in-progress epoch pool at a checkpoint reduce.

    Attributes:
        epoch: the epoch index.
        total_samples: the batch-aligned pool size (``ChunkPool.total_samples``).
        uncovered_ranges: ``(offset, size)`` ranges into the epoch's permutation
            not yet trained into the consensus, coalesced and sorted by offset.
            Resume re-dispatches exactly these.
    """

    epoch: int
    total_samples: int
    uncovered_ranges: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.uncovered_ranges = [(int(o), int(s)) for o, s in self.uncovered_ranges]

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "total_samples": self.total_samples,
            "uncovered_ranges": [[o, s] for o, s in self.uncovered_ranges],
        }

    @classmethod
    def from_dict(cls, obj: dict, where: str = "coverage.per_epoch[]") -> "EpochCoverage":
        ranges = []
        for i, r in enumerate(_check_list(_require(obj, "uncovered_ranges", where),
                                          f"{where}.uncovered_ranges")):
            r = _check_list(r, f"{where}.uncovered_ranges[{i}]")
            if len(r) != 2:
                raise CheckpointError(
                    f"{where}.uncovered_ranges[{i}] must be an [offset, size] pair, got {r!r}"
                )
            ranges.append((_check_uint(r[0], f"{where}.uncovered_ranges[{i}][0]"),
                           _check_uint(r[1], f"{where}.uncovered_ranges[{i}][1]")))
        return cls(
            epoch=_check_uint(_require(obj, "epoch", where), f"{where}.epoch"),
            total_samples=_check_uint(_require(obj, "total_samples", where),
                                      f"{where}.total_samples"),
            uncovered_ranges=ranges,
        )


@dataclass
class CoverageBlock:
    """Data coverage of every in-progress epoch pool at a checkpoint reduce.

    Attributes:
        seed: the run's shuffle base seed; epoch ``e``'s permutation is derived
            from ``seed + e``, so only uncovered ranges need recording.
        batch_size: the batch size at save (a resume sanity check).
        per_epoch: one ``EpochCoverage`` per live epoch pool.
        dataset_len: the dataset's sample count at save, whose shuffle each epoch's
            permutation is (a resume check: a count that rounds to the same batches
            shuffles otherwise); ``None`` where unknown (files of flodl and of earlier
            releases, which lack the field). Written only when known.
    """

    seed: int
    batch_size: int
    per_epoch: list[EpochCoverage] = field(default_factory=list)
    dataset_len: Optional[int] = None

    def to_dict(self) -> dict:
        out = {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "per_epoch": [e.to_dict() for e in self.per_epoch],
        }
        if self.dataset_len is not None:
            out["dataset_len"] = self.dataset_len
        return out

    @classmethod
    def from_dict(cls, obj: dict) -> "CoverageBlock":
        where = "coverage"
        return cls(
            seed=_check_uint(_require(obj, "seed", where), f"{where}.seed"),
            batch_size=_check_uint(_require(obj, "batch_size", where), f"{where}.batch_size"),
            per_epoch=[
                EpochCoverage.from_dict(e, f"{where}.per_epoch[{i}]")
                for i, e in enumerate(_check_list(_require(obj, "per_epoch", where),
                                                  f"{where}.per_epoch"))
            ],
            dataset_len=(None if obj.get("dataset_len") is None
                         else _check_uint(obj["dataset_len"], f"{where}.dataset_len")),
        )


# --- the sidecar ----------------------------------------------------------------


def _dump_json(obj: dict, what: str, path: Path) -> bytes:
    try:
        return json.dumps(obj, indent=2, allow_nan=False).encode("utf-8")
    except ValueError as e:
        raise CheckpointError(f"{what}: cannot serialize JSON for {path}: {e}") from None


def _load_json(path: "str | os.PathLike[str]", what: str) -> dict:
    p = Path(os.fspath(path))
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"{what}: read {p}: {e}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what}: {p} is not UTF-8 JSON: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what}: parse JSON from {p}: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what}: {p} holds a JSON {type(obj).__name__}, not an object")
    return obj


def _read_json_file(path: "str | os.PathLike[str]", what: str,
                    parse: Callable[[dict, str], Any]) -> Any:
    """``parse(obj, source)`` of the JSON object in ``path``; a field it refuses is
    named with the file (``CheckpointMeta: runs/x/ckpt-r00000012.meta.json:
    global_step must be ...``), so the reader knows which file to restore or move."""
    source = os.fspath(path)
    obj = _load_json(path, what)
    try:
        return parse(obj, source)
    except CheckpointError as e:
        if source in str(e):
            raise
        raise CheckpointError(f"{what}: {source}: {e}") from None


@dataclass
class CheckpointMeta:
    """The ``<stem>.meta.json`` sidecar: where the run stood when the bundle was saved.

    Written last, atomically: its presence marks the bundle complete. Build with
    :meth:`new` (stamps the current schema version); attach optional state with
    :meth:`with_elche_state` / :meth:`with_coverage`, which return new objects.

    Attributes:
        schema_version: version of the file's layout (4 for files this build writes).
        epoch: 0-based epoch at save.
        global_step: batches trained into the model so far (drives LR schedules on resume).
        sync_round: completed averaging cycles.
        world_size_at_save: live ranks at save (may be below the launch size).
        save_reason: why the bundle was written.
        elche_state: cadence trajectory (``None`` for sync runs and v1 files).
        coverage: data coverage (``None`` outside a reduce-atomic save and for v1-v3 files).
    """

    schema_version: int
    epoch: int
    global_step: int
    sync_round: int
    world_size_at_save: int
    save_reason: SaveReason
    elche_state: Optional[ElCheState] = None
    coverage: Optional[CoverageBlock] = None

    @classmethod
    def new(cls, epoch: int, global_step: int, sync_round: int, world_size_at_save: int,
            save_reason: SaveReason) -> "CheckpointMeta":
        """A record stamped with ``CHECKPOINT_META_SCHEMA_VERSION``, no optional state;
        ``CheckpointError`` for a field its own reader would refuse (a negative or
        non-integer count, an unknown reason), naming it."""
        meta = cls(CHECKPOINT_META_SCHEMA_VERSION, epoch, global_step, sync_round,
                   world_size_at_save, _parse_save_reason(save_reason, "save_reason"))
        cls.from_dict(meta.to_dict())  # never a record whose file would not load
        return meta

    def with_elche_state(self, state: ElCheState) -> "CheckpointMeta":
        """A copy carrying ``state``."""
        return dataclasses.replace(self, elche_state=state)

    def with_coverage(self, coverage: CoverageBlock) -> "CheckpointMeta":
        """A copy carrying ``coverage`` (set only for saves taken atomically at a reduce)."""
        return dataclasses.replace(self, coverage=coverage)

    @staticmethod
    def sidecar_path(stem: "str | os.PathLike[str]") -> Path:
        """``<stem>.meta.json``, one existing extension dropped (``ckpt.fdl`` -> ``ckpt.meta.json``)."""
        return set_extension(stem, "meta.json")

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "sync_round": self.sync_round,
            "world_size_at_save": self.world_size_at_save,
            "save_reason": SaveReason(self.save_reason).value,
            "elche_state": None if self.elche_state is None else self.elche_state.to_dict(),
            "coverage": None if self.coverage is None else self.coverage.to_dict(),
        }

    def to_json(self) -> str:
        """Pretty JSON (2-space indent), the layout ``write_to_file`` commits."""
        return _dump_json(self.to_dict(), "CheckpointMeta", Path("<memory>")).decode("utf-8")

    @classmethod
    def from_dict(cls, obj: dict, source: str = "<dict>") -> "CheckpointMeta":
        """Parse a decoded sidecar. Missing optional fields (older versions) default to
        ``None``; a ``schema_version`` newer than this build's is refused."""
        where = "CheckpointMeta"
        version = _check_version(obj, where, CHECKPOINT_META_SCHEMA_VERSION, source)
        elche = obj.get("elche_state")
        coverage = obj.get("coverage")
        return cls(
            schema_version=version,
            epoch=_check_uint(_require(obj, "epoch", where), "epoch"),
            global_step=_check_uint(_require(obj, "global_step", where), "global_step"),
            sync_round=_check_uint(_require(obj, "sync_round", where), "sync_round"),
            world_size_at_save=_check_uint(_require(obj, "world_size_at_save", where),
                                           "world_size_at_save"),
            save_reason=_parse_save_reason(_require(obj, "save_reason", where), "save_reason"),
            elche_state=None if elche is None else ElCheState.from_dict(elche),
            coverage=None if coverage is None else CoverageBlock.from_dict(coverage),
        )

    def write_to_file(self, path: "str | os.PathLike[str]") -> None:
        """Commit the pretty JSON to ``path`` atomically (temp + fsync + rename):
        the sidecar is the bundle's commit marker and must never appear torn."""
        p = Path(os.fspath(path))
        atomic_write_bytes(p, _dump_json(self.to_dict(), "CheckpointMeta", p))

    @classmethod
    def read_from_file(cls, path: "str | os.PathLike[str]") -> "CheckpointMeta":
        """Read a sidecar; ``CheckpointError`` when unreadable, malformed, or newer
        than ``CHECKPOINT_META_SCHEMA_VERSION`` (message contains "newer than")."""
        return _read_json_file(path, "CheckpointMeta", cls.from_dict)


@dataclass
class RankDeathRecord:
    """Forensic record a rank writes when it dies on its own error.

    Tells "a rank crashed" apart from "the cohort was asked to save and exit"
    (which writes a ``CheckpointMeta``). Written to
    ``CheckpointBundle.rank_death_path(stem, rank)``.

    Attributes:
        schema_version: ``RANK_DEATH_RECORD_SCHEMA_VERSION``.
        rank: the global rank that died.
        world_size: cohort size at launch.
        error: the rendered error.
        unix_time_secs: seconds since the epoch at death (0 if the clock failed).
    """

    schema_version: int
    rank: int
    world_size: int
    error: str
    unix_time_secs: int

    @classmethod
    def new(cls, rank: int, world_size: int, error: str) -> "RankDeathRecord":
        """A record stamped with the current version and wall-clock time;
        ``CheckpointError`` for a rank or a world size its own reader would refuse."""
        try:
            now = max(0, int(time.time()))
        except (OSError, OverflowError, ValueError):
            now = 0
        record = cls(RANK_DEATH_RECORD_SCHEMA_VERSION, rank, world_size, str(error), now)
        cls.from_dict(record.to_dict())  # never a record whose file would not load
        return record

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "rank": self.rank,
            "world_size": self.world_size,
            "error": self.error,
            "unix_time_secs": self.unix_time_secs,
        }

    @classmethod
    def from_dict(cls, obj: dict, source: str = "<dict>") -> "RankDeathRecord":
        where = "RankDeathRecord"
        version = _check_version(obj, where, RANK_DEATH_RECORD_SCHEMA_VERSION, source)
        error = _require(obj, "error", where)
        if not isinstance(error, str):
            raise CheckpointError(f"{where}.error must be a string, got {error!r}")
        return cls(
            schema_version=version,
            rank=_check_uint(_require(obj, "rank", where), "rank"),
            world_size=_check_uint(_require(obj, "world_size", where), "world_size"),
            error=error,
            unix_time_secs=_check_uint(_require(obj, "unix_time_secs", where), "unix_time_secs"),
        )

    def write_to_file(self, path: "str | os.PathLike[str]") -> None:
        """Commit the pretty JSON to ``path`` atomically."""
        p = Path(os.fspath(path))
        atomic_write_bytes(p, _dump_json(self.to_dict(), "RankDeathRecord", p))

    @classmethod
    def read_from_file(cls, path: "str | os.PathLike[str]") -> "RankDeathRecord":
        """Read a death record; ``CheckpointError`` when unreadable or malformed."""
        return _read_json_file(path, "RankDeathRecord", cls.from_dict)


__all__ = [
    "CHECKPOINT_META_SCHEMA_VERSION",
    "MODEL_NAMES_SCHEMA_VERSION",
    "RANK_DEATH_RECORD_SCHEMA_VERSION",
    "CheckpointBundle",
    "CheckpointMeta",
    "CoverageBlock",
    "ElCheState",
    "EpochCoverage",
    "ModelSchema",
    "RankDeathRecord",
    "SaveReason",
    "averaged_buffers",
    "consensus_buffer_key",
    "consensus_param_key",
    "names_sidecar_path",
    "set_extension",
]

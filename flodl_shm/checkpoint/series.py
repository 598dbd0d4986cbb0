"""The checkpoint series of one training run: one bundle per checkpointed window.

A bundle is several files (``.fdl``, ``.outer.fdl``, ``.meta.json``), each committed
atomically, the ``.meta.json`` last (the bundle's commit marker). Overwriting one
stem in place would not be atomic *as a bundle*: a crash between the model's
rename and the metadata's would pair the new model with the old coverage and
step. So every checkpointed window gets its own stem::

    <save_path>-r00000012.fdl            consensus after window 12
    <save_path>-r00000012.outer.fdl      outer momentum (stateful outer optimizers)
    <save_path>-r00000012.names.json     the model's parameter and buffer names (first)
    <save_path>-r00000012.meta.json      CheckpointMeta (written last)

(``<save_path>`` less a ``.fdl`` extension, so ``runs/ckpt`` and ``runs/ckpt.fdl``
name the same series; any other dot is part of the name). The last good checkpoint is
the highest round whose ``.meta.json`` and ``.fdl`` both exist; older bundles are pruned
to ``keep``.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional

from ._atomic import LONGEST_TEMP_SUFFIX, TMP_SUFFIX, path_limit, remove_stale_temps
from .forge import outer_sidecar_path
from .meta import CheckpointBundle, checkpoint_path, names_sidecar_path, set_extension

logger = logging.getLogger("flodl_shm")

__all__ = ["bundle_files", "check_series_stem", "committed_checkpoints", "death_record_path",
           "delete_rounds", "delete_series", "latest_checkpoint", "not_continued",
           "prune_series", "remove_other_rank_states", "resolve_checkpoint",
           "round_model_path", "series_base", "series_of"]

_ROUND_DIGITS = 8


#: what ``series_base`` drops from a save path: a bundle's own model extensions only
_MODEL_SUFFIXES = (".fdl.gz", ".fdl")


def series_base(save_path: "str | os.PathLike[str]") -> Path:
    """The prefix of every bundle stem of the series at ``save_path``: ``save_path``
    itself, less a model extension (``runs/ckpt.fdl`` names the series of ``runs/ckpt``).
    Any other dot is part of the name: ``runs/lr0.1`` and ``runs/lr0.01`` are two
    series. ``ValueError`` for a path without a file name or ending with a separator
    (``set_extension``'s rules)."""
    set_extension(save_path, "")  # the stem's checks
    p = Path(os.fspath(save_path))
    for suffix in _MODEL_SUFFIXES:
        if p.name.endswith(suffix) and len(p.name) > len(suffix):
            return p.with_name(p.name[:-len(suffix)])
    return p


def refuse_folder_stem(save_path: "str | os.PathLike[str]") -> None:
    """``ValueError`` when ``save_path`` is an existing folder: a series' files are named
    after its stem, so they would land beside the folder (``runs/exp-r00000002.fdl``),
    not in it."""
    p = Path(os.fspath(save_path))
    if p.is_dir():
        raise ValueError(f"{p} is a folder: a series' files are named after its stem and "
                         f"would land beside it ({p}-r00000001.fdl); pass a stem inside "
                         f"it, e.g. {p / 'ckpt'}")


#: the longest name a series' files take, as a format of the series base's name: a rank's
#: optimizer state while ``atomic_write`` writes it (round of 8 digits, rank of up to 5)
_LONGEST_NAME = "{}-r99999999.rank99999.optim" + LONGEST_TEMP_SUFFIX


def names_a_home(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` starts with ``~`` or ``~user`` as a shell would expand it (Python
    does not: ``open`` and ``mkdir`` take it as a folder named so)."""
    first = os.fspath(path).split(os.sep, 1)[0]
    return first.startswith("~") and os.path.expanduser(first) != first


def check_series_stem(save_path: "str | os.PathLike[str]") -> None:
    """``ValueError``, before anything is written, when the series at ``save_path``
    could not be written where meant: a folder (``refuse_folder_stem``), a stem that
    starts with ``~`` (not expanded: a folder named ``~``), or a stem whose files' names
    would pass the file system's limits (its longest, a rank's optimizer state as it is
    written, adds 47 bytes to the stem's name). A run would otherwise train until its
    first checkpoint and fail there."""
    base = series_base(save_path)
    if names_a_home(save_path):  # (Python does not expand it: a folder named ~ would appear)
        raise ValueError(
            f"checkpoint stem {os.fspath(save_path)!r} starts with ~, which is not expanded "
            f"here (a folder named ~ would be made in the current one): pass "
            f"os.path.expanduser({os.fspath(save_path)!r}) for your home folder, or "
            f"{os.path.join('.', os.fspath(save_path))!r} for a folder named ~")
    longest = base.with_name(_LONGEST_NAME.format(base.name))
    name_max = path_limit(base.parent, "PC_NAME_MAX", 255)
    extra = len(os.fsencode(longest.name)) - len(os.fsencode(base.name))
    if len(os.fsencode(longest.name)) > name_max:
        raise ValueError(
            f"checkpoint stem {os.fspath(save_path)!r}: its name {base.name[:40]!r}... is "
            f"{len(os.fsencode(base.name))} bytes, and a checkpoint's files add up to "
            f"{extra} to it (a rank's optimizer state as it is written: "
            f"{_LONGEST_NAME.format('<name>')}), over this file system's limit of "
            f"{name_max} bytes on a file name. Shorten the name to at most "
            f"{name_max - extra} bytes")
    path_max = path_limit(base.parent, "PC_PATH_MAX", 4096)
    if len(os.fsencode(longest)) >= path_max:  # (PATH_MAX counts the terminating NUL)
        raise ValueError(
            f"checkpoint stem {os.fspath(save_path)[:60]!r}... is {len(os.fsencode(base))} "
            f"bytes long, and a checkpoint's files add up to {extra} to it (a rank's "
            f"optimizer state as it is written), over this system's limit of {path_max - 1} "
            f"bytes on a path. Save in a folder with a shorter path, or give a relative one")
    refuse_folder_stem(save_path)


def death_record_path(save_path: "str | os.PathLike[str]", rank: int) -> Path:
    """The death record of ``rank`` in the series at ``save_path``:
    ``<series base>.rank<N>.death.json`` (``CheckpointBundle.rank_death_path``'s name,
    on the series' base)."""
    base = series_base(save_path)
    return CheckpointBundle.rank_death_path(base.with_name(base.name + ".fdl"), rank)


def round_model_path(save_path: "str | os.PathLike[str]", sync_round: int) -> Path:
    """The consensus model path of the checkpoint taken at window ``sync_round``."""
    base = series_base(save_path)
    return base.with_name(f"{base.name}-r{int(sync_round):0{_ROUND_DIGITS}d}.fdl")


def series_of(model_path: "str | os.PathLike[str]") -> Optional[tuple[Path, int]]:
    """``(series base, sync round)`` of a bundle of a series (``runs/ckpt-r00000012.fdl``
    -> ``(runs/ckpt, 12)``), or None for a bundle that belongs to no series."""
    p = Path(os.fspath(model_path))
    m = re.fullmatch(r"(.+)-r(\d{%d,})\.fdl" % _ROUND_DIGITS, p.name)
    return None if m is None else (p.with_name(m.group(1)), int(m.group(2)))


def bundle_files(model_path: "str | os.PathLike[str]") -> list[Path]:
    """The files of the bundle whose model is ``model_path``, commit marker first."""
    p = Path(os.fspath(model_path))
    return [CheckpointBundle.meta_path(p), outer_sidecar_path(p), p, names_sidecar_path(p)]


def _listing(folder: Path) -> list[str]:
    """The names in ``folder`` ([] when it does not exist): read once by a caller that
    looks for several files in it (a folder of 20,000 files takes ms to list)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _rounds(save_path, listing: Optional[list[str]] = None) -> dict[int, Path]:
    """round -> model path of every bundle with any file (or leftover temp) on disk;
    ``listing``: the names in the series' folder, when the caller read them already."""
    base = series_base(save_path)
    pattern = re.compile(re.escape(base.name)
                         + r"-r(\d{%d,})\.(?:fdl|outer\.fdl|meta\.json|names\.json|rank\d+\.optim)"
                           r"(?:(?:\.\d+\.[0-9a-f]+)?%s)?$" % (_ROUND_DIGITS, re.escape(TMP_SUFFIX)))
    folder = base.parent
    out: dict[int, Path] = {}
    names = _listing(folder) if listing is None else listing
    prefix = base.name + "-r"
    for name in names:
        m = name.startswith(prefix) and pattern.match(name)
        if m:
            rnd = int(m.group(1))
            out[rnd] = folder / f"{base.name}-r{m.group(1)}.fdl"
    return out


def committed_checkpoints(save_path: "str | os.PathLike[str]") -> list[tuple[int, Path]]:
    """``(sync_round, model_path)`` of every complete bundle of the series, oldest first
    (complete: the model and its ``.meta.json`` commit marker both exist)."""
    return _committed(_rounds(save_path))


def _committed(rounds: dict[int, Path]) -> list[tuple[int, Path]]:
    """``committed_checkpoints`` of the bundles ``_rounds`` found."""
    return [(rnd, model) for rnd, model in sorted(rounds.items())
            if model.exists() and CheckpointBundle.meta_path(model).exists()]


def latest_checkpoint(save_path: "str | os.PathLike[str]") -> Optional[Path]:
    """The model path of the series' last good checkpoint, or None."""
    done = committed_checkpoints(save_path)
    return done[-1][1] if done else None


def resolve_checkpoint(path: "str | os.PathLike[str]") -> Path:
    """The model path of a bundle named by its ``.fdl`` or ``.meta.json``, or of the last
    good checkpoint of the series ``path`` names.

    Raises:
        FileNotFoundError: no complete checkpoint is there; a bundle file or a folder
            that does not exist is named as such.
    """
    p = checkpoint_path(path)
    if not p.is_dir() and not p.parent.is_dir():
        raise FileNotFoundError(f"cannot resume from {p}: the folder {p.parent} does not "
                                f"exist; pass the save_path of the run (a stem such as "
                                f"runs/exp/ckpt) or one of its bundles' .fdl")
    series = (series_of(p.with_name(p.name[:-len(".meta.json")] + ".fdl")
                        if p.name.endswith(".meta.json") else p)
              if p.name.endswith((".fdl", ".fdl.gz", ".meta.json")) else None)
    if series is not None and not p.exists():  # one round's bundle, named but not there
        newest = latest_checkpoint(series[0])
        hint = ("" if newest is None else
                f"; the newest complete checkpoint of that series is {newest}")
        raise FileNotFoundError(f"{p} does not exist{hint}")
    if p.name.endswith(".meta.json") and p.is_file():
        p = p.with_name(p.name[: -len(".meta.json")] + ".fdl")
    if p.name.endswith(".fdl") and p.is_file():
        if not CheckpointBundle.meta_path(p).exists():
            raise FileNotFoundError(
                f"{p} has no {CheckpointBundle.meta_path(p).name}: the bundle was never "
                f"committed (its write did not finish); resume from an earlier checkpoint")
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        folder = p if p.is_dir() else p.parent
        found = _series_in(folder)
        hint = (f"; {folder} holds the series {', '.join(repr(f) for f in found)}"
                if found else "")
        raise FileNotFoundError(
            f"no complete checkpoint under {series_base(p)}-r*.fdl (each needs its .fdl and "
            f".meta.json); pass the save_path the run was started with (a stem such as "
            f"runs/exp/ckpt, not its folder), or a bundle's .fdl{hint}")
    return latest


def _series_in(folder: Path) -> list[str]:
    """The stems (``folder/<name>``) of the series with a complete bundle in ``folder``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    pattern = re.compile(r"(.+)-r\d{%d,}\.meta\.json$" % _ROUND_DIGITS)
    stems = sorted({m.group(1) for m in map(pattern.match, names) if m})
    return [os.fspath(folder / s) for s in stems if latest_checkpoint(folder / s) is not None]


def _rank_files(model: Path, *, temps: bool = False,
                listing: Optional[list[str]] = None) -> list[Path]:
    """The bundle's ``<stem>.rank<N>.optim`` files (each rank's own state); ``temps``:
    also the files whose writer's temp alone is on disk (a rank killed mid-save);
    ``listing``: the names in the bundle's folder, when the caller read them already."""
    stem = set_extension(model, "").name  # CheckpointBundle.rank_state_path's rule
    tail = r"(?:\.\d+\.[0-9a-f]+%s)?" % re.escape(TMP_SUFFIX) if temps else ""
    pattern = re.compile("(" + re.escape(stem) + r"\.rank\d+\.optim)" + tail + "$")
    names = [n for n in (_listing(model.parent) if listing is None else listing)
             if n.startswith(stem)]
    finals = {m.group(1) for m in map(pattern.match, names) if m}
    return [model.parent / n for n in sorted(finals)]


def remove_other_rank_states(model_path: "str | os.PathLike[str]", ranks) -> list[Path]:
    """Delete the ``.rank<N>.optim`` files of the bundle at ``model_path`` whose rank is
    not in ``ranks`` (the ranks that wrote theirs in this save); returns them. Before the
    bundle's commit: a save cut short by a crash leaves its ranks' files behind, and a
    later save of that round by fewer ranks would commit them with the new bundle, for a
    later resume to load as its own. Not another writer's live temp file."""
    keep = {int(r) for r in ranks}
    gone = []
    for f in _rank_files(Path(os.fspath(model_path))):
        rank = int(f.name[:-len(".optim")].rpartition(".rank")[2])
        if rank in keep:
            continue
        try:
            f.unlink()
            gone.append(f)
        except FileNotFoundError:
            pass
    if gone:
        logger.info("removed %s: left by an earlier save of this round that did not "
                    "finish", ", ".join(f.name for f in gone))
    return gone


def _remove(model: Path, listing: Optional[list[str]] = None) -> None:
    """Delete the bundle's files (its ranks' states included) and its writers' stale
    temps (a live writer's temp stays), those of a rank state never committed too.
    ``listing``: the names in the bundle's folder, when the caller read them already
    (one listing serves every file: listing it again per file made a save into a
    folder of 20,000 files take over 100 ms)."""
    names = _listing(model.parent) if listing is None else listing
    for f in bundle_files(model) + _rank_files(model, temps=True, listing=names):
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not delete old checkpoint file %s: %s", f, e)
        remove_stale_temps(f, names)


def prune_series(save_path: "str | os.PathLike[str]", keep: int, *,
                 settled: bool = False) -> list[int]:
    """Keep the newest ``keep`` complete bundles (at least 1); delete older complete
    ones and incomplete ones older than the newest complete one (failed writes: the
    forge writes in order). ``settled``: no write into the series is in flight (the
    run's end on one host), so every incomplete bundle is a failed write, the newer
    ones too (a full disk leaves them holding the space a recovery needs). Returns the
    rounds deleted."""
    keep = max(int(keep), 1)
    base = series_base(save_path)
    # every file of the series' bundles (and their writers' temps) starts so
    names = [n for n in _listing(base.parent) if n.startswith(base.name + "-r")]
    paths = _rounds(save_path, names)
    done = _committed(paths)
    if not done and not settled:
        return []
    newest = done[-1][0] if done else -1
    doomed = [rnd for rnd, _ in done[:-keep]]
    complete = {rnd for rnd, _ in done}
    doomed += [rnd for rnd in paths if (settled or rnd < newest) and rnd not in complete]
    for rnd in sorted(set(doomed)):
        _remove(paths[rnd], names)
    return sorted(set(doomed))


def not_continued(save_path: "str | os.PathLike[str]",
                  resumed_from: "str | os.PathLike[str] | None" = None
                  ) -> tuple[int, list[Path]]:
    """What a run that starts from the bundle ``resumed_from`` (None: a fresh run) does
    not continue in the series of ``save_path``: ``(round, bundles)``, the round it
    continues after (the bundle's, when it belongs to this very series; else 0) and the
    complete bundles above it, which would outrank the run's own checkpoints."""
    own = None if resumed_from is None else series_of(resumed_from)
    same = own is not None and (os.path.realpath(own[0])
                                == os.path.realpath(series_base(save_path)))
    after = own[1] if same else 0
    return after, [model for rnd, model in committed_checkpoints(save_path) if rnd > after]


def delete_rounds(save_path: "str | os.PathLike[str]", after: int) -> list[int]:
    """Delete the series' bundles (complete or not) of rounds above ``after``; returns
    their rounds."""
    doomed = sorted((rnd, model) for rnd, model in _rounds(save_path).items() if rnd > after)
    for _, model in doomed:
        _remove(model)
    return [rnd for rnd, _ in doomed]


def delete_series(save_path: "str | os.PathLike[str]") -> int:
    """Delete every bundle of the series (and its rank death records); returns the
    number of bundles removed."""
    rounds = _rounds(save_path)
    for model in rounds.values():
        _remove(model)
    base = series_base(save_path)
    try:
        names = os.listdir(base.parent)
    except FileNotFoundError:
        names = []
    for name in names:
        if re.fullmatch(re.escape(base.name) + r"\.rank\d+\.death\.json", name):
            (base.parent / name).unlink(missing_ok=True)
    return len(rounds)

"""Where numba keeps its compiled-kernel cache.

Every kernel is declared with ``cache=True`` so a second process (every rank of a
``spawn``) or a second run loads machine code instead of recompiling for seconds.
That only works when the cache directory is writable. numba's default is the
``__pycache__`` folder next to the source; an installed package may live in a
read-only site-packages, so we pick the first writable candidate:

1. ``$NUMBA_CACHE_DIR`` when the user set it (when it is not writable, numba would
   write into the package's own folder, bypassing the digest folder below, or fail to
   define a kernel at all: the next candidate is taken instead, with a warning; when it
   names a digest folder itself, a parent's export or an older version's, its parent);
2. ``$FLODL_SHM_NUMBA_CACHE`` (ours, explicit);
3. ``<package>/kernels/__pycache__`` when writable (in-tree, like numba's default);
4. ``$XDG_CACHE_HOME/flodl_shm/numba`` (or ``~/.cache/flodl_shm/numba``);
5. a per-user folder under the system temp dir.

With none writable, numba cannot define a cached kernel (``cannot cache function ...:
no locator available``); the import then fails with ``NoKernelCache``, naming the
folders tried and the fix.

The base is exported through ``FLODL_SHM_NUMBA_CACHE`` so spawned ranks agree with
the parent without re-deciding, and the cache lives in a subfolder named by a
digest of the package's compiled sources (see ``sources_digest``). Concurrent writers
are safe: numba writes a unique temporary file and renames it over the index, and
``spawn`` warms the kernels in the parent before any rank starts, so ranks normally
only read.

Every version (every source change, in a checkout) compiles into a digest folder of its
own, a few MB, so a process marks the folder it chooses as used (its mtime) and removes
the digest folders beside it that no process chose for ``STALE_DIGEST_AGE_S``
(``prune_stale_digests``): a version not run for that long compiles once more when it
runs again.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

_chosen: Path | None = None

#: A digest folder that no process chose for this long (7 days) is removed by the next
#: process that chooses another one beside it.
STALE_DIGEST_AGE_S = 7 * 24 * 3600

_DIGEST_FOLDER = re.compile(r"flodl_shm-[0-9a-f]{12}")
_BEING_REMOVED = re.compile(r"flodl_shm-[0-9a-f]{12}\.stale-\d+")


class NoKernelCache(RuntimeError):
    """No folder for the compiled-kernel cache is writable (see the module doc)."""


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".flodl_shm_write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def _candidates() -> list[Path]:
    out: list[Path] = []
    ours = os.environ.get("FLODL_SHM_NUMBA_CACHE")
    if ours:
        out.append(Path(ours))
    out.append(Path(__file__).resolve().parent / "__pycache__")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    out.append(base / "flodl_shm" / "numba")
    try:
        user = str(os.getuid())
    except AttributeError:  # pragma: no cover - non-POSIX
        user = "user"
    try:
        out.append(Path(tempfile.gettempdir()) / f"flodl_shm_numba_{user}")
    except FileNotFoundError:  # no usable temp dir at all (TMPDIR, /tmp... not writable)
        pass
    return out


def sources_digest() -> str:
    """A digest of every compiled source of the package (and the numba version).

    numba invalidates a cached kernel only when *its own* file changes, yet our
    kernels inline helpers from other files (``codec.bf16_bits_rne`` into the
    reduce, the round kernels, the tensor copies). Keying the cache folder by this
    digest makes any source change - or a numba upgrade - start a fresh cache,
    so a stale kernel can never run.
    """
    import hashlib

    import numba

    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha1(numba.__version__.encode())
    kernels = pkg / "kernels"
    for path in sorted(pkg.rglob("*.py")):
        try:
            text = path.read_bytes()
        except OSError:
            continue
        # every kernels/ file (the control-block word map's constants are compiled
        # in), and any other module that compiles code of its own
        if (path.parent == kernels or b"njit" in text
                or b"intrinsic" in text):
            h.update(str(path.relative_to(pkg)).encode())
            h.update(text)
    return h.hexdigest()[:12]


def configure_numba_cache() -> Path:
    """Pick (once per process) a writable numba cache directory and install it.

    Must run before any ``@njit(cache=True)`` decorator of ours executes; the
    kernels package calls it on import. Returns the directory in use: a
    ``flodl_shm-<sources digest>`` folder under the first writable base.
    """
    global _chosen
    if _chosen is not None:
        return _chosen
    preset = os.environ.get("NUMBA_CACHE_DIR")
    digest_dir = f"flodl_shm-{sources_digest()}"
    replaced = False
    if preset and Path(preset).name.startswith("flodl_shm-") and _writable(Path(preset)):
        # our own folder, as a parent that replaced the variable exports it (or an older
        # version's: this one's goes beside it, not inside)
        base = Path(preset).parent
    elif preset and _writable(Path(preset)):
        base = Path(preset)
    else:
        tried = [Path(preset)] if preset else []
        for cand in _candidates():
            tried.append(cand)
            if _writable(cand):
                base = cand
                break
        else:
            raise NoKernelCache(
                f"flodl_shm compiles its kernels once and caches them, and none of the "
                f"folders for that cache is writable here ({', '.join(map(str, tried))}): "
                f"set NUMBA_CACHE_DIR to a writable folder")
        if preset:
            logging.getLogger("flodl_shm").warning(
                "NUMBA_CACHE_DIR=%s is not writable: flodl_shm caches its compiled kernels "
                "in %s instead (set NUMBA_CACHE_DIR to a writable folder)", preset, base)
            replaced = True
        os.environ["FLODL_SHM_NUMBA_CACHE"] = str(base)  # spawned ranks agree
    chosen = base / digest_dir
    if not _writable(chosen):
        chosen = base
    if replaced:
        # the folder itself: numba re-reads its NUMBA_ variables whenever they change (at
        # its next compile, when it was imported before us), and spawned ranks take it
        # as is, without a warning of their own
        os.environ["NUMBA_CACHE_DIR"] = str(chosen)
    import numba  # imported here so the env var is set before numba reads its config

    # numba re-reads its NUMBA_ variables at a compile when they changed since it last
    # read them (a script that set NUMBA_CACHE_DIR after importing numba): read them now,
    # so that no later compile puts the cache back past the digest folder
    numba.config.reload_config()
    numba.config.CACHE_DIR = str(chosen)
    _chosen = chosen
    if chosen != base:
        prune_stale_digests(chosen)
    return _chosen


def prune_stale_digests(chosen: Path, max_age_s: float = STALE_DIGEST_AGE_S) -> list[str]:
    """Mark the digest folder ``chosen`` used now, and remove the digest folders beside
    it (``flodl_shm-<12 hex digits>``) whose last use is older than ``max_age_s``;
    nothing else in the base is touched. Returns the names removed.

    A folder is renamed (``<name>.stale-<pid>``) before it is removed: a process that
    chooses it at that moment then compiles into a fresh folder of that name instead of
    reading one half removed. A renamed folder that a pruner left (it was killed
    mid-way) is removed by the next one. Best effort: whatever the file system refuses
    stays."""
    try:
        os.utime(chosen)
        entries = list(os.scandir(chosen.parent))
    except OSError:
        return []
    now = time.time()
    removed = []
    for entry in entries:
        name = entry.name
        if _BEING_REMOVED.fullmatch(name):
            shutil.rmtree(entry.path, ignore_errors=True)
            continue
        if name == chosen.name or not _DIGEST_FOLDER.fullmatch(name):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) \
                    or now - entry.stat(follow_symlinks=False).st_mtime < max_age_s:
                continue
            doomed = f"{entry.path}.stale-{os.getpid()}"
            os.rename(entry.path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(name)
    return removed


def cache_dir() -> Path:
    """The numba cache directory this process uses."""
    return configure_numba_cache()


#: The file whose presence in a cache folder says it holds every kernel (written once a
#: process compiled or loaded them all: ``warming.warm_all``, a ``spawn``'s warm-up).
COMPLETE_MARKER = "complete"


def cache_complete() -> bool:
    """Whether this process's cache folder holds every kernel, so a ``spawn`` loads
    them in about a second instead of compiling them (about 50 s of one core here)."""
    return (cache_dir() / COMPLETE_MARKER).exists()


def mark_cache_complete() -> None:
    """Say that this process's cache folder now holds every kernel (best effort: a
    folder that refuses the file only keeps ``cache_complete`` False)."""
    try:
        (cache_dir() / COMPLETE_MARKER).touch()
    except OSError:
        pass

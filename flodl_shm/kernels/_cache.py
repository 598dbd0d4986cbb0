"""Where numba keeps its compiled-kernel cache.

Every kernel is declared with ``cache=True`` so a second process (every rank of a
``spawn``) or a second run loads machine code instead of recompiling for seconds.
That only works when the cache directory is writable. numba's default is the
``__pycache__`` folder next to the source; an installed package may live in a
read-only site-packages, so we pick the first writable candidate:

1. ``$NUMBA_CACHE_DIR`` when the user set it (respected as is);
2. ``$FLODL_SHM_NUMBA_CACHE`` (ours, explicit);
3. ``<package>/kernels/__pycache__`` when writable (in-tree, like numba's default);
4. ``$XDG_CACHE_HOME/flodl_shm/numba`` (or ``~/.cache/flodl_shm/numba``);
5. a per-user folder under the system temp dir.

The choice is exported through ``NUMBA_CACHE_DIR`` so spawned ranks agree with the
parent without re-deciding. Concurrent writers are safe: numba writes a unique
temporary file and renames it over the index, and ``spawn`` warms the kernels in
the parent before any rank starts, so ranks normally only read.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

_chosen: Path | None = None


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
    out.append(Path(tempfile.gettempdir()) / f"flodl_shm_numba_{user}")
    return out


def configure_numba_cache() -> Path:
    """Pick (once per process) a writable numba cache directory and install it.

    Must run before any ``@njit(cache=True)`` decorator of ours executes; the
    kernels package calls it on import. Returns the directory in use.
    """
    global _chosen
    if _chosen is not None:
        return _chosen
    preset = os.environ.get("NUMBA_CACHE_DIR")
    if preset:
        _chosen = Path(preset)
        _writable(_chosen)
    else:
        for cand in _candidates():
            if _writable(cand):
                _chosen = cand
                break
        else:  # nothing writable: numba will JIT every process; still correct
            _chosen = Path(tempfile.gettempdir())
        os.environ["NUMBA_CACHE_DIR"] = str(_chosen)
    import numba  # imported here so the env var is set before numba reads its config

    numba.config.CACHE_DIR = str(_chosen)
    return _chosen


def cache_dir() -> Path:
    """The numba cache directory this process uses."""
    return configure_numba_cache()

"""The session secret: 16 random bytes shared by every host of a cohort.

It keys every authentication tag (frames, records, the handshake proofs) and never
crosses the wire. On disk it is 32 lowercase hex digits (whitespace ignored), in a
file readable by the job's user only.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .wire import SESSION_SALT_BYTES, check_salt

logger = logging.getLogger("flodl_shm")


def new_salt() -> bytes:
    """16 bytes from the OS CSPRNG."""
    return os.urandom(SESSION_SALT_BYTES)


def parse_secret(text: str) -> bytes:
    """32 hex digits (surrounding whitespace ignored) -> 16 bytes; ValueError otherwise."""
    t = text.strip()
    if len(t) != 2 * SESSION_SALT_BYTES:
        raise ValueError(f"a session secret is {2 * SESSION_SALT_BYTES} hex digits, got "
                         f"{len(t)} characters")
    try:
        return bytes.fromhex(t)
    except ValueError:
        raise ValueError("a session secret must be hex digits only (0-9, a-f)") from None


def read_secret_file(path: str | os.PathLike) -> bytes:
    """Read a secret file; the error names the file and the fix."""
    p = Path(path)
    try:
        text = p.read_text()
    except IsADirectoryError:
        raise ValueError(f"the session secret file {p} is a folder; give the file in it, or "
                         f"create one with `python -m flodl_shm controller --new-secret "
                         f"{p / 'secret.hex'}`") from None
    except FileNotFoundError:
        raise ValueError(f"the session secret file {p} does not exist; create one with "
                         f"`python -m flodl_shm controller --new-secret {p}` and copy it to "
                         f"every host") from None
    except OSError as e:
        raise ValueError(f"cannot read the session secret file {p}: {e}") from None
    except UnicodeDecodeError:
        text = None
    if text is not None:
        text = text.removeprefix("\ufeff")  # (the byte-order mark some editors write first)
    # (NUL and other control bytes decode as text: binary all the same)
    if text is None or any((c < " " or c == "\x7f") and not c.isspace() for c in text):
        raise ValueError(f"{p} is not a session secret file (it holds binary data): a secret "
                         f"is {2 * SESSION_SALT_BYTES} hex digits; create one with `python -m "
                         f"flodl_shm controller --new-secret FILE`")
    try:
        salt = parse_secret(text)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    _warn_if_weak(p, salt)
    return salt


_WARNED: set = set()  # (file, what): each said once per process (a command reads it thrice)


def _first(p: Path, what: str) -> bool:
    """Whether ``what`` of file ``p`` is said for the first time in this process."""
    key = (os.path.realpath(p), what)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


def _warn_if_weak(p: Path, salt: bytes) -> None:
    """A warning for a secret others can read (docs/README: mode 0600) or that is no
    secret at all (every byte the same, e.g. a placeholder of zeros)."""
    try:
        mode = p.stat().st_mode & 0o777
    except OSError:
        mode = 0
    if mode & 0o077 and _first(p, "mode"):
        logger.warning("the session secret file %s can be read by other users (mode %o): "
                       "anyone who reads it can join the cohort; chmod 600 %s", p, mode, p)
    if len(set(salt)) == 1 and _first(p, "weak"):
        logger.warning("the session secret in %s is one byte repeated (%s...): no secret; "
                       "create one with `python -m flodl_shm controller --new-secret FILE`",
                       p, salt.hex()[:8])


def write_secret_file(path: str | os.PathLike, salt: bytes | None = None) -> bytes:
    """Write ``salt`` (a fresh one by default) as hex, mode 0600; returns it. A salt that
    is not 16 bytes is refused before the file is touched (it would have replaced a good
    secret with one nobody can read)."""
    salt = new_salt() if salt is None else check_salt(salt)
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(salt.hex() + "\n")
    return salt

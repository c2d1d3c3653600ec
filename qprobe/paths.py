"""Where qprobe keeps its cache and journals, and how it touches files there.

The cache holds what qprobe later trusts: symbol tables, kernels it boots,
the journal of bytes it must put back into a guest.  Someone who could
write there could make qprobe overwrite the user's files through a planted
symlink or feed it data of their choosing, so the cache must be the user's
alone: created 0700, refused when it belongs to someone else or others may
write to it, and files in it are opened without following symlinks.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from qprobe.errors import QprobeError

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeCache(QprobeError):
    """The cache directory cannot be used safely (or at all)."""


def cache_root() -> Path:
    """``$QPROBE_CACHE`` or ``~/.cache/qprobe`` (not created)."""
    env = os.environ.get("QPROBE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qprobe"


def check_private(path: Path) -> None:
    """Refuse a directory that is not this user's alone (owned by someone else, or group/world-writable)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise UnsafeCache(f"cannot use the cache directory {path}: {exc.strerror}; set QPROBE_CACHE") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(f"the cache directory {path} is not a directory; set QPROBE_CACHE to a directory")
    if st.st_uid != os.getuid():
        raise UnsafeCache(f"the cache directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                          "use a directory of your own (QPROBE_CACHE)")  # fmt: skip
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCache(f"the cache directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                          f"chmod 700 {path}, or set QPROBE_CACHE to a private directory")  # fmt: skip


def _private_mkdir(path: Path) -> None:
    try:
        # mkdir(parents=True) applies the mode to the leaf only; the parents are the user's business.
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UnsafeCache(f"cannot create the cache directory {path}: {exc.strerror}; set QPROBE_CACHE") from None


def cache_dir(*parts: str) -> Path:
    """``$QPROBE_CACHE`` or ``~/.cache/qprobe`` (or a directory in it), created with mode 0700.

    Raises ``UnsafeCache`` for a cache others could plant files in.
    """
    base = cache_root()
    _private_mkdir(base)
    check_private(base)
    path = base.joinpath(*parts)
    if parts:
        _private_mkdir(path)
        for sub in (base.joinpath(*parts[: i + 1]) for i in range(len(parts))):
            if sub.is_symlink():
                raise UnsafeCache(f"{sub} is a symbolic link; qprobe does not follow links in its cache")
        check_private(path)
    return path


def check_owned(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse a cache entry that is a symbolic link or belongs to another user (``st``: its lstat, if known).

    The cache directory is the user's alone, so such an entry was planted by someone who could write there
    (root, or the cache's owner before it): what it holds is not to be trusted.
    """
    if st is None:
        st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCache(f"{path} is a symbolic link; qprobe does not follow links in its cache")
    if st.st_uid != os.getuid():
        raise UnsafeCache(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): qprobe does not "
                          "trust it; delete it")  # fmt: skip


def open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symlink at ``path`` with a one-line error."""
    try:
        return os.open(path, flags | NOFOLLOW, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafeCache(f"{path} is a symbolic link; qprobe does not follow links in its cache") from None
        raise UnsafeCache(f"cannot open {path}: {exc.strerror}") from None


def read_private(path: Path) -> bytes | None:
    """The contents of a cache file (None if it does not exist), never through a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafeCache(f"{path} is a symbolic link; qprobe does not follow links in its cache") from None
        raise UnsafeCache(f"cannot read {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            check_owned(path, os.fstat(f.fileno()))
            return f.read()
    except OSError as exc:
        raise UnsafeCache(f"cannot read {path}: {exc.strerror}") from None


def write_private(path: Path, data: bytes) -> None:
    """Replace a cache file atomically (a fresh 0600 file renamed over it), never writing through a symlink."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a killed process that had our pid (a link is removed, not followed)
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # rename replaces a symlink at path, never its target
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

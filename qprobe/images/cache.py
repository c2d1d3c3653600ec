"""The on-disk cache: where fetched kernels and built guest files live.

Everything qprobe downloads or builds goes below one directory,
``$QPROBE_CACHE`` or ``~/.cache/qprobe``, created with mode 0700 (it may hold
a kernel a user built). Two rules keep it trustworthy:

* every result is written under a temporary name and renamed into place, so
  an interrupted build never leaves a half-written file that a later run
  would take as good;
* builds of one result take an exclusive lock file, so two processes (say,
  parallel test workers) never build the same thing twice at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from qprobe import paths

__all__ = [
    "atomic_dir",
    "atomic_file",
    "cache_dir",
    "hash_inputs",
    "locked",
    "prune",
    "subdir",
]

TMP_PREFIX = ".tmp-"


def cache_dir() -> Path:
    """The cache root, created (mode 0700) if missing; refused if others could write to it."""
    return paths.cache_dir()


def subdir(*parts: str) -> Path:
    """A directory inside the cache, created with mode 0700."""
    return paths.cache_dir(*parts)


@contextlib.contextmanager
def locked(directory: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock named ``name`` in ``directory`` for the block."""
    fd = paths.open_nofollow(directory / f".lock-{name}", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(dest: Path, mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; rename it to ``dest`` on success.

    On an exception the temporary file is removed and ``dest`` is untouched.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{dest.name}.", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``dest``; rename it to ``dest`` on success.

    An existing ``dest`` (an incomplete leftover the caller decided to
    replace) is removed first.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}.", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_leftovers(directory: Path, name: str = "") -> None:
    """Remove temporary files and directories an interrupted run left behind.

    Only those for results whose name starts with ``name``; call it while
    holding the lock that guards building them, or a running build's
    temporary files would go.
    """
    for leftover in directory.glob(f"{TMP_PREFIX}{name}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def hash_inputs(items: Iterable[tuple[str, bytes]]) -> str:
    """A short hex digest of named byte strings (names are part of the hash)."""
    h = hashlib.sha256()
    for name, data in items:
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def prune(directory: Path, pattern: str, keep: int, protect: Iterable[Path] = (), min_age: float = 3600) -> None:
    """Delete all but the ``keep`` most recently used entries matching ``pattern``.

    Entries used (``touch``) within ``min_age`` seconds stay, so a file
    another process just got from the cache is not deleted before it starts
    QEMU with it. Deleting a file a running QEMU has open is harmless.
    """
    protected = {p.resolve() for p in protect}
    now = time.time()
    entries = []
    for p in directory.glob(pattern):
        if p.name.startswith(TMP_PREFIX):
            continue
        with contextlib.suppress(OSError):
            entries.append((p.stat().st_mtime, p))
    entries.sort(key=lambda item: item[0], reverse=True)
    for mtime, old in entries[keep:]:
        if old.resolve() in protected or now - mtime < min_age:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def touch(path: Path) -> None:
    """Mark a cached entry as just used (``prune`` keeps recent ones)."""
    with contextlib.suppress(OSError):
        os.utime(path)

"""apt for one Debian architecture: the host's own, or a private state in the cache for another.

A kernel (or busybox) for an architecture the host's dpkg does not list
comes through the host's apt sources without touching its configuration:
``APT::Architecture`` and ``APT::Architectures`` name the one architecture,
the package lists and the download cache live in ``<cache>/apt-<arch>/``, and
the dpkg status is /dev/null (nothing is installed there). ``apt-cache`` and
``apt-get download`` then answer for that architecture as for the host's own.

The private lists are fetched (``apt-get update``, under the cache's lock)
when they are missing or a day old, and again when a package is not found in
them. apt stamps each list file with the archive's own date, so their age is
kept in a file of our own, ``updated``.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache

__all__ = ["AptState", "apt_state", "flavour_architecture", "host_architecture", "refresh", "run"]

LISTS_MAX_AGE = 24 * 3600
_STAMP = "updated"


@functools.cache
def host_architecture() -> str:
    """The host's Debian architecture (``dpkg --print-architecture``: "amd64", "arm64")."""
    proc = run("dpkg", "--print-architecture")
    arch = proc.stdout.strip()
    if proc.returncode != 0 or not arch:
        raise ImageError("dpkg --print-architecture failed: Debian images need a Debian host with apt")
    return arch


def flavour_architecture(flavour: str) -> str:
    """The Debian architecture a kernel flavour is built for: its last part ("cloud-arm64" gives "arm64")."""
    return flavour.rpartition("-")[2]


@dataclass(frozen=True)
class AptState:
    """The apt of one architecture: the host's (``root`` None) or a private one under ``root``."""

    arch: str  # Debian's name: "amd64", "arm64"
    root: Path | None = None

    def options(self) -> list[str]:
        """The ``-o`` options that point apt at this state (none for the host's own)."""
        if self.root is None:
            return []
        return [
            "-o", f"APT::Architecture={self.arch}",
            # The list form's "::=" replaces the host's list of architectures instead of adding to it.
            "-o", f"APT::Architectures::={self.arch}",
            "-o", f"Dir::State::Lists={self.root / 'lists'}",
            "-o", f"Dir::Cache={self.root / 'cache'}",
            "-o", "Dir::State::status=/dev/null",
        ]  # fmt: skip

    def argv(self, tool: str, *args: str) -> list[str]:
        """``tool`` (apt-cache, apt-get) with this state's options, then ``args``."""
        return [tool, *self.options(), *args]

    def stale(self, now: float | None = None) -> bool:
        """Whether a private state's lists are missing or older than a day (the host's are the host's affair)."""
        if self.root is None:
            return False
        try:
            age = (time.time() if now is None else now) - (self.root / _STAMP).stat().st_mtime
        except OSError:
            return True
        return not 0 <= age < LISTS_MAX_AGE


def apt_state(arch: str) -> AptState:
    """The apt that answers for Debian architecture ``arch``: the host's, or a private one in the cache."""
    if arch == host_architecture():
        return AptState(arch)
    return AptState(arch, cache.subdir(f"apt-{arch}"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run an apt or dpkg tool; missing, it is an ImageError that says what Debian images need."""
    if shutil.which(args[0]) is None:
        raise ImageError(f"{args[0]} not found: Debian images need a Debian host with apt; or define a user image")
    return subprocess.run(list(args), capture_output=True, encoding="utf-8", errors="replace", check=False)


def refresh(state: AptState, *, force: bool = False) -> bool:
    """Fetch a private state's package lists if stale (or ``force``); whether it did (never the host's own)."""
    if state.root is None:
        return False
    with cache.locked(state.root, "update"):
        if not force and not state.stale():
            return False
        for sub in ("lists/partial", "cache/archives/partial"):
            (state.root / sub).mkdir(parents=True, exist_ok=True)
        proc = run(*state.argv("apt-get", "-q", "update"))
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("E:")]
            detail = errors[-1] if errors else f"exit status {proc.returncode}"
            raise ImageError(f"apt-get update for architecture {state.arch} failed: {detail}")
        (state.root / _STAMP).touch()
    return True

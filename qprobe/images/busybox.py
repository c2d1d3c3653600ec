"""The guest's static busybox for its architecture, and the applets it provides.

A guest of the host's architecture gets the host's static busybox
(busybox-static, or ``$QPROBE_BUSYBOX``). Another gets Debian's
busybox-static of its architecture, downloaded with apt (through a private
state when the host's dpkg does not list that architecture:
qprobe.images.apt), whose ``bin/busybox`` is kept in
``<cache>/busybox/<debian arch>/busybox``. Once there it is reused, as a
fetched kernel is; delete it to take a newer one.

A busybox of the host's architecture lists its applets itself
(``--list-full``). One of another architecture cannot run here, so its
applet names are read from its own ``applet_names`` table (busybox's
generated applet_tables.h: the names in order, each NUL-terminated, the
table ending in an empty name), and each applet goes where the host's
busybox installs it (Debian configures busybox-static alike on every
architecture), or to /bin when the host's has no such applet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache
from qprobe.images.apt import apt_state, refresh
from qprobe.images.debian import download, extract, show
from qprobe.images.progress import Reporter
from qprobe.images.toolchain import Toolchain

__all__ = ["applets", "busybox_for", "host_busybox"]

_PACKAGE = "busybox-static"
# The start of applet_names: "[" and "[[" (test's two names) sort before every other applet.
_TABLE_START = b"\0[\0[[\0"


def host_busybox() -> Path:
    """The host's static busybox: ``$QPROBE_BUSYBOX``, else /bin/busybox or the one on PATH."""
    env = os.environ.get("QPROBE_BUSYBOX")
    candidates = [Path(env)] if env else [Path("/bin/busybox"), Path(shutil.which("busybox") or "/nonexistent")]
    for path in candidates:
        if path.is_file():
            return path
    raise ImageError("busybox not found: install busybox-static (or set QPROBE_BUSYBOX to a static busybox)")


def busybox_for(chain: Toolchain, reporter: Reporter) -> Path:
    """The static busybox for a guest built by ``chain``: the host's, or Debian's of its architecture (fetched)."""
    if chain.native:
        return host_busybox()
    directory = cache.subdir("busybox", chain.debian_arch)
    dest = directory / "busybox"
    if dest.is_file():
        return dest
    with cache.locked(directory, "fetch"):
        if dest.is_file():
            return dest
        state = apt_state(chain.debian_arch)
        fetched = refresh(state)
        info = show(state, _PACKAGE)
        if info is None and state.root is not None and not fetched:
            refresh(state, force=True)
            info = show(state, _PACKAGE)
        if info is None or "Version" not in info:
            raise ImageError(f"apt knows no {_PACKAGE} package of architecture {chain.debian_arch}: "
                             "Debian's main archive must be in apt's sources")  # fmt: skip
        reporter.note(f"fetching {_PACKAGE} {info['Version']} ({chain.debian_arch}) for the guest")
        debs = cache.subdir("debs")
        with cache.locked(debs, "download"):
            deb = download(state, _PACKAGE, info["Version"], int(info.get("Size", "0")), debs, reporter)
        with cache.atomic_file(dest, 0o755) as tmp:
            extract(deb, {"bin/busybox": tmp}, reporter)
        deb.unlink(missing_ok=True)
    return dest


def _listed(busybox: Path) -> list[str]:
    """``busybox --list-full``: applet paths ("bin/sh", "sbin/poweroff", "linuxrc") of a busybox that runs here."""
    proc = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, encoding="utf-8", errors="replace", check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ImageError(f"{busybox} --list-full failed: is it a busybox binary?")
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def applet_names(data: bytes, what: Path) -> list[str]:
    """The applet names in a busybox binary's ``applet_names`` table."""
    start = data.find(_TABLE_START)
    if start < 0:
        raise ImageError(f"{what} has no busybox applet table: is it a busybox binary?")
    end = data.index(b"\0\0", start + 1)
    return [name.decode("ascii", "replace") for name in data[start + 1 : end].split(b"\0")]


def applets(busybox: Path, chain: Toolchain) -> list[str]:
    """Applet paths ("bin/sh", "sbin/poweroff", ...) a guest's busybox provides, but those of the root directory.

    The root's (linuxrc, an init for initrds) would stand beside qprobe's own /init.
    """
    if chain.native:
        paths = _listed(busybox)
    else:
        try:
            where = {Path(path).name: path for path in _listed(host_busybox())}
        except ImageError:
            where = {}
        paths = [where.get(name, f"bin/{name}") for name in applet_names(busybox.read_bytes(), busybox)]
    return [path for path in paths if "/" in path]

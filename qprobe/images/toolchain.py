"""The compiler and C library that build the guest's programs for its architecture.

A guest of the host's own architecture gets the host's ``gcc`` and libc (its
libraries found by the host's loader, ``guest._loader_list``). Another gets
Debian's cross toolchain for it: ``<triplet>-gcc`` (gcc-aarch64-linux-gnu),
whose C library (libc6-dev-arm64-cross, libc6-arm64-cross) lives under
``/usr/<triplet>/lib``. The host's loader cannot run a foreign program, so
the libraries a cross-built program loads are found by its DT_NEEDED entries
in that directory (``cross_libraries``) and put where the guest's loader
looks without an ld.so.cache: ``/lib/<triplet>``, the first directory of
glibc's multiarch default search path; the loader itself goes to the path
the program names (PT_INTERP).
"""

from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images.elf import interpreter, needed

__all__ = ["GUEST_ARCHES", "Toolchain", "cross_libraries", "host_arch", "toolchain"]

# Each guest architecture (as uname -m names it) with its Debian architecture and GNU triplet.
GUEST_ARCHES = {
    "x86_64": ("amd64", "x86_64-linux-gnu"),
    "aarch64": ("arm64", "aarch64-linux-gnu"),
}


def host_arch() -> str:
    """The host's architecture, as uname -m names it."""
    return platform.machine()


@dataclass(frozen=True)
class Toolchain:
    """How to build C programs for one guest architecture."""

    arch: str  # "x86_64", "aarch64"
    debian_arch: str  # "amd64", "arm64"
    triplet: str  # "aarch64-linux-gnu"
    native: bool  # the host's own architecture: its gcc and libc

    @property
    def gcc(self) -> str:
        """The compiler's command: ``gcc``, or the cross compiler ``<triplet>-gcc``."""
        return "gcc" if self.native else f"{self.triplet}-gcc"

    @property
    def packages(self) -> str:
        """The Debian packages that install this compiler and its C library."""
        if self.native:
            return "gcc and libc6-dev"
        return f"gcc-{self.triplet} and libc6-dev-{self.debian_arch}-cross"

    @property
    def libdir(self) -> Path:
        """Where a cross toolchain's C library (the guest's shared libraries) is on the host."""
        return Path("/usr") / self.triplet / "lib"

    @property
    def guest_libdir(self) -> str:
        """Where the guest's loader finds a library without an ld.so.cache (glibc's multiarch default)."""
        return f"/lib/{self.triplet}"

    def which_gcc(self) -> str:
        """The compiler's path; missing, an ImageError naming the packages to install."""
        gcc = shutil.which(self.gcc)
        if gcc is None:
            raise ImageError(f"{self.gcc} not found: install {self.packages} to build the guest programs")
        return gcc


def toolchain(arch: str) -> Toolchain:
    """The toolchain for a guest of architecture ``arch`` ("x86_64", "aarch64")."""
    if arch not in GUEST_ARCHES:
        raise ImageError(f"qprobe builds no guest programs for architecture {arch!r} "
                         f"(known: {', '.join(GUEST_ARCHES)})")  # fmt: skip
    debian_arch, triplet = GUEST_ARCHES[arch]
    return Toolchain(arch=arch, debian_arch=debian_arch, triplet=triplet, native=arch == host_arch())


def cross_libraries(program: Path, chain: Toolchain, beside: Path) -> list[tuple[str, Path]]:
    """(guest path, host file) of the loader and each library a cross-built ``program`` loads.

    Followed through DT_NEEDED from the program, in ``beside`` (the program's
    own libraries, installed by the caller and left out here) and then in the
    toolchain's library directory.
    """
    interp = interpreter(program, "uprog")
    if interp is None:
        raise ImageError(f"uprog {program} has no interpreter: {chain.gcc} linked it statically")
    loader = chain.libdir / Path(interp).name
    if not loader.is_file():
        raise ImageError(f"uprog's loader {Path(interp).name} is not in {chain.libdir}: install {chain.packages}")
    found: list[tuple[str, Path]] = [(interp, loader)]
    todo, seen = [program], {Path(interp).name}
    while todo:
        for name in needed(todo.pop()):
            if name in seen:
                continue
            seen.add(name)
            if (beside / name).is_file():
                todo.append(beside / name)
                continue
            lib = chain.libdir / name
            if not lib.is_file():
                raise ImageError(f"uprog needs {name}, which is not in {chain.libdir}: install {chain.packages}")
            found.append((f"{chain.guest_libdir}/{name}", lib))
            todo.append(lib)
    return found

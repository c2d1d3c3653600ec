"""A writer for "newc" cpio archives, the format the kernel unpacks as initramfs.

Written here rather than shelling out to ``cpio`` because the guest's
initramfs must hold ``/dev/console`` (a character device the kernel opens
before it runs ``/init``) and files owned by root, neither of which a
non-root user can create on the host to let ``cpio -o`` copy them. The format
is simple: per entry a 110-byte ASCII header ("070701" and 13 eight-digit hex
fields), the NUL-terminated name padded to 4 bytes, the data padded to 4
bytes, and a last entry named ``TRAILER!!!``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from qprobe.errors import ImageError

__all__ = ["CpioWriter", "extra_files_cpio", "guest_path"]

_MAGIC = b"070701"
_TRAILER = "TRAILER!!!"


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


class CpioWriter:
    """Builds a newc archive in memory, entry by entry.

    Directories are created implicitly for every parent of an added path
    (once each), because the kernel does not create missing parents when it
    unpacks: a file whose directory is absent is silently dropped. Every
    entry is owned by root and has a fixed mtime, so the same input gives the
    same bytes (which keeps cache keys stable).
    """

    def __init__(self, mtime: int = 0) -> None:
        self._parts: list[bytes] = []
        self._ino = 720000  # arbitrary start; only uniqueness matters
        self._dirs: set[str] = {""}
        self._names: set[str] = set()
        self._mtime = mtime
        self._finished = False

    def _entry(self, name: str, mode: int, data: bytes = b"", nlink: int = 1, rdev: tuple[int, int] = (0, 0)) -> None:
        if self._finished:
            raise ImageError("internal error: cpio archive already finished")
        encoded = name.encode()
        self._ino += 1
        fields = (
            self._ino if name != _TRAILER else 0,
            mode,
            0,  # uid
            0,  # gid
            nlink,
            self._mtime if name != _TRAILER else 0,
            len(data),
            0,  # devmajor
            0,  # devminor
            rdev[0],
            rdev[1],
            len(encoded) + 1,
            0,  # check
        )
        header = _MAGIC + b"".join(b"%08X" % f for f in fields)
        self._parts.append(header + encoded + b"\0" + _pad4(len(header) + len(encoded) + 1))
        if data:
            self._parts.append(data + _pad4(len(data)))

    @staticmethod
    def _name(path: str | PurePosixPath) -> str:
        """Archive name of a guest path: relative, normalised, no ``..``."""
        p = PurePosixPath(path)
        parts = [x for x in p.parts if x not in ("/", ".")]
        if ".." in parts:
            raise ImageError(f"guest path {path} must not contain '..'")
        return "/".join(parts)

    def _parents(self, name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d in self._names and d not in self._dirs:
                raise ImageError(f"guest path /{d} is a file but is also used as a directory")
            if d not in self._dirs:
                self._dirs.add(d)
                self._names.add(d)
                self._entry(d, stat.S_IFDIR | 0o755, nlink=2)

    def _claim(self, name: str) -> None:
        if not name:
            raise ImageError("guest path / cannot be an archive entry")
        if name in self._names:
            raise ImageError(f"guest path /{name} is given twice")
        self._parents(name)
        self._names.add(name)

    def add_dir(self, path: str | PurePosixPath, mode: int = 0o755) -> None:
        """Add a directory (its parents too, with mode 0755)."""
        name = self._name(path)
        if name in self._dirs:
            return
        self._claim(name)
        self._dirs.add(name)
        self._entry(name, stat.S_IFDIR | (mode & 0o7777), nlink=2)

    def add_file(self, path: str | PurePosixPath, data: bytes, mode: int = 0o644) -> None:
        """Add a regular file with the given contents and permission bits."""
        name = self._name(path)
        self._claim(name)
        self._entry(name, stat.S_IFREG | (mode & 0o7777), data)

    def add_symlink(self, path: str | PurePosixPath, target: str) -> None:
        """Add a symbolic link pointing at ``target``."""
        name = self._name(path)
        self._claim(name)
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def add_chardev(self, path: str | PurePosixPath, major: int, minor: int, mode: int = 0o600) -> None:
        """Add a character device node (no root needed: it is only a header)."""
        name = self._name(path)
        self._claim(name)
        self._entry(name, stat.S_IFCHR | (mode & 0o7777), rdev=(major, minor))

    def add_tree(self, root: Path, prefix: str = "/") -> None:
        """Add everything below host directory ``root`` at guest path ``prefix``.

        Modes are kept, owners become root; sockets, fifos and devices on the
        host are refused, as the guest tree never needs them.
        """
        base = PurePosixPath(prefix)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = Path(dirpath).relative_to(root)
            for entry in sorted(dirnames) + sorted(filenames):
                host = Path(dirpath) / entry
                guest = base / PurePosixPath(rel.as_posix()) / entry
                st = host.lstat()
                if stat.S_ISDIR(st.st_mode):
                    self.add_dir(guest, stat.S_IMODE(st.st_mode))
                elif stat.S_ISLNK(st.st_mode):
                    self.add_symlink(guest, os.readlink(host))
                elif stat.S_ISREG(st.st_mode):
                    self.add_file(guest, host.read_bytes(), stat.S_IMODE(st.st_mode))
                else:
                    raise ImageError(f"{host} is not a file, directory or symlink; cannot archive it")

    def finish(self) -> bytes:
        """Append the trailer and return the archive."""
        if not self._finished:
            self._entry(_TRAILER, 0)
            self._finished = True
        return b"".join(self._parts)


def guest_path(path: str | PurePosixPath) -> PurePosixPath:
    """Check and normalise a guest path given by a caller: absolute, no ``..``."""
    text = str(path)
    if not text.startswith("/"):
        raise ImageError(f"guest path {text!r} must be absolute (start with /)")
    p = PurePosixPath(text)
    if ".." in p.parts:
        raise ImageError(f"guest path {text!r} must not contain '..'")
    if p == PurePosixPath("/"):
        raise ImageError("guest path '/' names no file")
    return p


def extra_files_cpio(files: Mapping[str, str | Path]) -> bytes:
    """A newc archive holding host files at the given guest paths.

    ``files`` maps a guest path (absolute) to a host file. The result is
    meant to be appended to an initrd: the kernel unpacks concatenated
    archives in order, so these files land on top of the base initramfs.
    Executable host files get mode 0755, others 0644; missing parent
    directories are added with mode 0755. Note that the guest's ``/init``
    mounts tmpfs over ``/tmp`` and ``/run``, hiding anything put there.
    """
    writer = CpioWriter()
    for guest, host in sorted(files.items()):
        gpath = guest_path(guest)
        hpath = Path(host).expanduser()
        if not hpath.exists():
            raise ImageError(f"host file {hpath} (for guest path {gpath}) does not exist")
        if not hpath.is_file():
            raise ImageError(f"host path {hpath} (for guest path {gpath}) is not a regular file")
        try:
            data = hpath.read_bytes()
            executable = bool(hpath.stat().st_mode & 0o111)
        except OSError as exc:
            raise ImageError(f"cannot read host file {hpath}: {exc.strerror}") from exc
        writer.add_file(gpath, data, 0o755 if executable else 0o644)
    return writer.finish()

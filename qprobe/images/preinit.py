"""qprobe's pre-init: its shell brought to a root filesystem whose own init does not start it.

A root filesystem that is not qprobe's (a buildroot ``rootfs.ext2`` or
``rootfs.cpio``, any distribution's) runs its own init, which knows nothing
of qprobe's shell.  qprobe boots it with a small initramfs archive of its
own, ``/qprobe/{preinit,init,busybox}`` (scripts/guest/preinit, the shell
part of scripts/guest/init, the host's static busybox), and
``rdinit=/qprobe/preinit``: the script starts qprobe's shell on qprobe's
serial port, then execs the image's own init with the kernel's arguments,
as PID 1 (see the script for how it finds that init and mounts a disk
root).  The archive is the only initramfs of a disk image, and is appended
to an initramfs image's own archive (the kernel unpacks both, in order);
the image's files are read, never written: the disk stays a QEMU snapshot.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache
from qprobe.images.cpio import CpioWriter
from qprobe.images.elf import interpreter
from qprobe.images.guest import guest_sources
from qprobe.images.image import Image, parse_config
from qprobe.vmm.bootfail import PREINIT

__all__ = ["PREINIT", "preinit_archive", "preinit_cmdline", "with_preinit"]

_KEEP = 8


def _script() -> Path:
    return guest_sources().init.with_name("preinit")


def preinit_archive(arch: str | None = None) -> Path:
    """The pre-init's newc archive for a guest of ``arch`` (the host's by default), cached by its three files."""
    files = guest_sources(arch)
    if interpreter(files.busybox, "busybox") is not None:
        raise ImageError(f"busybox {files.busybox} is dynamically linked; install busybox-static")
    parts = {"preinit": _script(), "init": files.init, "busybox": files.busybox}
    try:
        data = {name: path.read_bytes() for name, path in parts.items()}
    except OSError as exc:
        raise ImageError(f"cannot read the pre-init's file {exc.filename}: {exc.strerror}") from exc
    dest = cache.subdir("preinit") / f"preinit-{cache.hash_inputs(sorted(data.items()))[:16]}.cpio"
    if dest.is_file():
        cache.touch(dest)
        return dest
    writer = CpioWriter()
    for name, content in data.items():
        writer.add_file(f"/qprobe/{name}", content, 0o755)
    with cache.atomic_file(dest) as tmp:
        tmp.write_bytes(writer.finish())
    cache.prune(dest.parent, "preinit-*.cpio", keep=_KEEP, protect=[dest])
    return dest


def _appended(initrd: Path, archive: Path) -> Path:
    """``initrd`` with ``archive`` after it (cached): padded to 4 bytes, where the kernel looks for the next."""
    st = initrd.stat()
    key = f"{initrd.resolve()}:{st.st_size}:{st.st_mtime_ns}:{archive.name}".encode()
    dest = cache.subdir("preinit") / f"initrd-{hashlib.sha256(key).hexdigest()[:16]}.img"
    if dest.is_file():
        cache.touch(dest)
        return dest
    with cache.atomic_file(dest) as tmp, initrd.open("rb") as src, tmp.open("wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
        out.write(b"\0" * (-out.tell() % 4))
        out.write(archive.read_bytes())
    cache.prune(dest.parent, "initrd-*.img", keep=_KEEP, protect=[dest])
    return dest


def preinit_cmdline(image: Image) -> str:
    """The kernel arguments that run the pre-init: rdinit=, and whether the kernel would mount devtmpfs.

    With a disk root the kernel mounts devtmpfs on its /dev when built with CONFIG_DEVTMPFS_MOUNT; the
    pre-init, which mounts that root in its place, does the same (a kernel without a config: it does).
    """
    automount = image.config is None or parse_config(image.config).get("CONFIG_DEVTMPFS_MOUNT") == "y"
    return f"rdinit={PREINIT} qprobe.devtmpfs={int(automount)}"


def with_preinit(image: Image) -> Image:
    """The image as qprobe boots it: through the pre-init unless its root filesystem is qprobe's own."""
    if image.own_init:
        return image
    if image.config is not None and parse_config(image.config).get("CONFIG_BLK_DEV_INITRD") != "y":
        raise ImageError(f"the kernel of image {image.name!r} has no CONFIG_BLK_DEV_INITRD: qprobe brings its "
                         "shell to a root filesystem of the image's own in an initramfs archive")  # fmt: skip
    archive = preinit_archive(image.arch)
    initrd = archive if image.initrd is None else _appended(image.initrd, archive)
    return replace(image, initrd=initrd, cmdline=f"{image.cmdline} {preinit_cmdline(image)}".strip())

"""What a bootable kernel image is, and the checks that catch wrong files early.

An ``Image`` is the set of files one boot needs (bzImage or arm64 Image, initrd or disk)
plus those the host needs to understand the running kernel (vmlinux for
symbols and code, System.map, the config). The validators check magic
numbers so that a user who points qprobe at the wrong file hears it at once,
naming the file, instead of seeing QEMU hang or gdb read garbage later.
"""

from __future__ import annotations

import functools
import gzip
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import ImageError

__all__ = [
    "DISK_INTERFACES",
    "ELF_MACHINES",
    "Image",
    "ImageInfo",
    "check_config",
    "check_disk",
    "check_initrd",
    "check_kernel",
    "check_vmlinux",
    "disk_interface_of",
    "kernel_kind",
    "kernel_release",
    "parse_config",
    "preempt_model",
    "vmlinux_arch",
]

DISK_INTERFACES = ("nvme", "virtio")

# The guest architectures qprobe boots, by their vmlinux's ELF e_machine, named as ``uname -m`` names them.
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}  # EM_X86_64, EM_AARCH64
# arm64's Image header (Documentation/arch/arm64/booting.rst): "ARM\x64" at offset 0x38.
_ARM64_MAGIC_AT = 0x38
_ARM64_MAGIC = b"ARM\x64"
_EXT_MAGIC = 0xEF53
# Compressed initrd formats the kernel can unpack (besides plain cpio).
_COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x1f\x9e": "gzip",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bzip2",
    b"\x02\x21\x4c\x18": "lz4",
    b"\x5d\x00\x00": "lzma",
    b"\x89LZO": "lzo",
}
_CPIO = (b"070701", b"070702", b"070707")


@dataclass(frozen=True)
class ImageInfo:
    """One line of ``list_images()``: what an image is, without fetching it."""

    name: str
    description: str
    source: str  # "debian:<flavour>", "build:<source package>" or "files:<manifest path>"
    state: str  # "ready", "not fetched" or "partial"
    rootfs: str  # "initramfs" or "disk"
    kernel_version: str | None = None  # known once fetched


@dataclass(frozen=True)
class Image:
    """Everything needed to boot one kernel and to probe it from the host.

    ``cmdline`` holds only the arguments this image needs (``root=`` for a
    disk image); the launcher adds ``console=ttyS0`` and its own options.
    One of ``initrd`` and ``disk`` is set, or both once qprobe's pre-init
    archive is added to a disk image (``qprobe.images.preinit``).
    ``own_init``: the root filesystem is qprobe's, whose /init starts the
    shell; any other is booted through qprobe's pre-init.
    """

    name: str
    kernel: Path
    vmlinux: Path
    initrd: Path | None
    disk: Path | None
    system_map: Path | None
    config: Path | None
    cmdline: str
    disk_interface: str
    preempt: str
    kernel_version: str
    own_init: bool = True
    # The guest's architecture as uname -m names it ("x86_64", "aarch64"): get_image and image_from_files
    # set it from the vmlinux (vmlinux_arch); the default is for images made by hand, as before arm64.
    arch: str = "x86_64"

    def config_option(self, name: str) -> str | None:
        """Value of a kernel config option ("y", "m", a number, a string), or None.

        ``name`` may be given with or without the ``CONFIG_`` prefix. Options
        that are "not set", or absent, give None; so does an image without a
        config file. String values come without their quotes.
        """
        if self.config is None:
            return None
        key = name if name.startswith("CONFIG_") else f"CONFIG_{name}"
        return parse_config(self.config).get(key)

    def qemu_boot_args(self, initrd: Path | None = None) -> list[str]:
        """QEMU arguments that load this image (not ``-append``: see ``cmdline``).

        ``initrd`` replaces the image's own (e.g. one from
        ``initrd_with_files``). The disk is attached with ``snapshot=on`` so
        the guest's writes never reach the cached file.
        """
        args = ["-kernel", str(self.kernel)]
        rd = initrd if initrd is not None else self.initrd
        if rd is not None:
            args += ["-initrd", str(rd)]
        if self.disk is not None:
            if self.disk_interface == "virtio":
                args += ["-drive", f"file={self.disk},if=virtio,format=raw,snapshot=on"]
            else:
                args += [
                    "-drive",
                    f"file={self.disk},if=none,id=qprobe-disk,format=raw,snapshot=on",
                    "-device",
                    "nvme,drive=qprobe-disk,serial=qprobe0",
                ]
        return args


def _head(path: Path, size: int, what: str) -> bytes:
    """The first ``size`` bytes of a file the user named, or an ImageError."""
    if not path.exists():
        raise ImageError(f"{what} file {path} does not exist")
    if not path.is_file():
        raise ImageError(f"{what} {path} is not a regular file")
    try:
        with path.open("rb") as f:
            return f.read(size)
    except OSError as exc:
        raise ImageError(f"cannot read {what} file {path}: {exc.strerror}") from exc


def _gunzip_head(head: bytes, size: int) -> bytes:
    """The first ``size`` bytes of what a gzip stream beginning with ``head`` holds (less if it is short)."""
    try:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, size)
    except zlib.error:
        return b""


def kernel_kind(head: bytes) -> str | None:
    """ "bzImage" or "arm64 Image" by the boot header's magic, None if neither."""
    if head[0x202:0x206] == b"HdrS":
        return "bzImage"
    if head[_ARM64_MAGIC_AT : _ARM64_MAGIC_AT + 4] == _ARM64_MAGIC:
        return "arm64 Image"
    return None


def check_kernel(path: Path) -> None:
    """A kernel QEMU's -kernel boots: a bzImage ("HdrS" at 0x202) or an arm64 Image ("ARM\\x64" at 0x38).

    An arm64 Image may be gzip'd (Image.gz), which QEMU unpacks; its header is read through the gzip stream.
    """
    head = _head(path, 64 << 10, "kernel")
    if kernel_kind(head) is not None:
        return
    if head[:2] == b"\x1f\x8b" and kernel_kind(_gunzip_head(head, 0x40)) == "arm64 Image":
        return
    hint = " (that is an ELF file: use the bzImage or Image, not vmlinux)" if head[:4] == b"\x7fELF" else ""
    raise ImageError(f"kernel {path} is not a bzImage ('HdrS' magic at offset 0x202) "
                     f"nor an arm64 Image ('ARM\\x64' at 0x38){hint}")  # fmt: skip


def _bzimage_release(path: Path) -> str | None:
    """The release string stored in a bzImage header (its kernel_version field), if any."""
    try:
        with path.open("rb") as f:
            head = f.read(0x210)
            if len(head) < 0x210 or head[0x202:0x206] != b"HdrS":
                return None
            (offset,) = struct.unpack_from("<H", head, 0x20E)
            if offset == 0:
                return None
            f.seek(offset + 0x200)
            text = f.read(256).split(b"\0", 1)[0].decode("ascii", "replace")
    except OSError:
        return None
    return text.split()[0] if text.split() else None


# init/version.c's linux_banner: "Linux version <release> (<user>@<host>) ...".
_BANNER = re.compile(rb"Linux version (\S+) \(")
_BANNER_MAX = 256 << 20


def _banner_release(path: Path) -> str | None:
    """The release in the linux_banner of an uncompressed kernel (an arm64 Image), if any."""
    try:
        if path.stat().st_size > _BANNER_MAX:
            return None
        with path.open("rb") as f:
            head = f.read(_ARM64_MAGIC_AT + 4)
            if kernel_kind(head) != "arm64 Image":
                return None
            m = _BANNER.search(head + f.read())
    except OSError:
        return None
    return m.group(1).decode("ascii", "replace") if m else None


def kernel_release(path: Path) -> str | None:
    """The release (``uname -r``) a kernel file states, if any.

    A bzImage carries it in its boot header; an arm64 Image has no such field, so it is read from the
    linux_banner in its (uncompressed) body. A gzip'd Image gives None.
    """
    return _bzimage_release(path) or _banner_release(path)


def _elf_machine(path: Path) -> int:
    head = _head(path, 0x206, "vmlinux")
    if head[:4] != b"\x7fELF":
        hint = " (that is a bzImage: give the uncompressed vmlinux)" if head[0x202:0x206] == b"HdrS" else ""
        raise ImageError(f"vmlinux {path} is not an ELF file{hint}")
    if len(head) < 20 or head[4] != 2 or head[5] != 1:
        raise ImageError(f"vmlinux {path} is not a 64-bit little-endian ELF file")
    (machine,) = struct.unpack_from("<H", head, 18)
    return int(machine)


def vmlinux_arch(path: Path) -> str:
    """The guest architecture of a vmlinux by its ELF e_machine: "x86_64" or "aarch64" (as uname -m names it)."""
    machine = _elf_machine(path)
    if machine not in ELF_MACHINES:
        known = " or ".join(ELF_MACHINES.values())
        raise ImageError(f"vmlinux {path} is an ELF file for machine {machine}, not {known}")
    return ELF_MACHINES[machine]


def check_vmlinux(path: Path) -> None:
    """vmlinux must be a 64-bit little-endian ELF of an architecture qprobe boots (what gdb and lief read)."""
    vmlinux_arch(path)


def check_initrd(path: Path) -> None:
    """An initrd is a cpio archive, plain or compressed as the kernel can unpack."""
    head = _head(path, 6, "initrd")
    if head.startswith(_CPIO) or head[:2] == b"\xc7\x71":
        return
    if any(head.startswith(magic) for magic in _COMPRESSED):
        return
    raise ImageError(f"initrd {path} is neither a cpio archive nor a gzip (or xz/zstd/...) compressed one")


def check_disk(path: Path) -> None:
    """A disk must be a raw ext2/3/4 filesystem: superblock magic 0xEF53 at 1080."""
    head = _head(path, 1082, "disk")
    if len(head) < 1082 or struct.unpack_from("<H", head, 1080)[0] != _EXT_MAGIC:
        raise ImageError(f"disk {path} is not a raw ext2/ext3/ext4 image (no superblock magic at byte 1080)")


def check_config(path: Path) -> None:
    """A config is a kernel .config (maybe gzip'd, as /proc/config.gz)."""
    parse_config(path)


def _read_config_text(path: Path) -> str:
    raw = _head(path, 64 << 20, "config")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ImageError(f"config {path} is a broken gzip file") from exc
    return raw.decode("utf-8", "replace")


_LINE = re.compile(r"^(CONFIG_[A-Za-z0-9_]+)=(.*)$")


@functools.lru_cache(maxsize=16)
def _parse_config_cached(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    del mtime_ns, size  # part of the cache key only
    text = _read_config_text(Path(path))
    options: dict[str, str] = {}
    seen_comment = False
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            value = m.group(2)
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
            options[m.group(1)] = value
        elif line.startswith("# CONFIG_"):
            seen_comment = True
    if not options and not seen_comment:
        raise ImageError(f"config {path} is not a kernel .config file (no CONFIG_ lines)")
    return options


def parse_config(path: Path) -> dict[str, str]:
    """Options set in a kernel config file, ``{"CONFIG_X": "y", ...}`` (cached)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ImageError(f"config file {path} does not exist") from exc
    return _parse_config_cached(str(path), st.st_mtime_ns, st.st_size)


def disk_interface_of(config: Path | None) -> str:
    """How to attach a root disk the kernel can find: the driver its config builds in.

    NVMe first (what qprobe attached before it looked, and Debian's kernels build in), then virtio-blk
    (buildroot's qemu boards).  Without a config, NVMe.
    """
    if config is None:
        return "nvme"
    options = parse_config(config)
    if options.get("CONFIG_BLK_DEV_NVME") == "y":
        return "nvme"
    if options.get("CONFIG_VIRTIO_BLK") == "y" and options.get("CONFIG_VIRTIO_PCI") == "y":
        return "virtio"
    raise ImageError(f"the kernel config {config} builds in no driver for a root disk qprobe can attach: it needs "
                     f"CONFIG_VIRTIO_BLK=y with CONFIG_VIRTIO_PCI=y, or CONFIG_BLK_DEV_NVME=y "
                     f"(or set disk_interface)")  # fmt: skip


_PREEMPT_ARG = re.compile(r"(?:^|\s)preempt=(none|voluntary|full)(?:\s|$)")


def preempt_model(config: Path | None, cmdline: str = "") -> str:
    """The preemption model: "none", "voluntary", "full", "rt" or "unknown".

    Read from the config (PREEMPT_RT, PREEMPT, PREEMPT_VOLUNTARY,
    PREEMPT_NONE). With PREEMPT_DYNAMIC a ``preempt=`` boot argument in the
    image's own cmdline overrides the built-in default, as in the kernel.
    """
    if config is None:
        return "unknown"
    options = parse_config(config)
    if options.get("CONFIG_PREEMPT_RT") == "y":
        return "rt"
    if options.get("CONFIG_PREEMPT_DYNAMIC") == "y":
        m = _PREEMPT_ARG.search(cmdline)
        if m:
            return m.group(1)
    if options.get("CONFIG_PREEMPT") == "y":
        return "full"
    if options.get("CONFIG_PREEMPT_VOLUNTARY") == "y":
        return "voluntary"
    return "none"

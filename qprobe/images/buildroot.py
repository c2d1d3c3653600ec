"""A buildroot ``output/`` directory as an image: where buildroot leaves each file, and what its start-qemu.sh says.

buildroot puts the kernel image and the root filesystem in ``output/images/``
(``bzImage``, ``rootfs.ext2``/``rootfs.ext4`` or ``rootfs.cpio[.gz]``) and
keeps the kernel's build tree, with ``vmlinux``, ``.config`` and
``System.map``, in ``output/build/linux-VERSION/`` (``images/vmlinux`` only
with BR2_LINUX_KERNEL_VMLINUX).  Its qemu boards' post-image script writes
``images/start-qemu.sh`` from the board's readme (board/qemu/start-qemu.sh.in):
one ``exec qemu-system-ARCH ... -append "..."`` line whose paths are relative to
``images/`` (older buildroot: prefixed with ``${IMAGE_DIR}/``).  The machine,
how the root disk is attached and the kernel command line are read from it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images.image import DISK_INTERFACES
from qprobe.images.manifest import ImageSpec

__all__ = ["Layout", "StartQemu", "find_layout", "missing", "parse_start_qemu", "resolve"]

_DISKS = ("rootfs.ext2", "rootfs.ext4")
_INITRDS = ("rootfs.cpio.gz", "rootfs.cpio")
_KERNELS = ("bzImage", "Image")
_SCRIPT_DIRS = re.compile(r"\$\{?(IMAGE_DIR|BINARIES_DIR)\}?/*")
# QEMU devices that attach a -drive as a virtio or NVMe disk (-device NAME,drive=ID).
_DEVICES = {"virtio-blk-pci": "virtio", "virtio-blk": "virtio", "virtio-blk-device": "virtio", "nvme": "nvme"}


@dataclass(frozen=True)
class StartQemu:
    """What start-qemu.sh's QEMU command line says about the boot (None: it does not say)."""

    binary: str
    machine: str | None = None
    kernel: Path | None = None
    initrd: Path | None = None
    disk: Path | None = None
    disk_interface: str | None = None  # "virtio", "nvme", or the -drive's if= qprobe does not attach ("ide"...)
    cmdline: str | None = None


@dataclass(frozen=True)
class Layout:
    """The files of one buildroot output directory, and what its start-qemu.sh adds."""

    output: Path
    files: dict[str, Path] = field(default_factory=dict)  # kernel, vmlinux, config, system_map, disk|initrd
    start: StartQemu | None = None


def _qemu_words(text: str) -> list[str] | None:
    """The words of the script's ``qemu-system-*`` command (continuation lines joined), or None."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        if "qemu-system-" not in line or line.lstrip().startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # an unbalanced quote: not the command line
        for i, word in enumerate(words):
            if Path(word).name.startswith("qemu-system-"):
                return words[i:]
    return None


def _options(value: str) -> tuple[str, dict[str, str]]:
    """QEMU's ``first,key=value,...``: the first part (when it has no '=') and the keys."""
    parts = value.split(",")
    head = "" if "=" in parts[0] else parts.pop(0)
    return head, {k: v if eq else "on" for k, eq, v in (p.partition("=") for p in parts if p)}


def parse_start_qemu(text: str, images: Path) -> StartQemu:
    """start-qemu.sh's QEMU command line: paths resolved against ``images`` (the script cd's there)."""
    words = _qemu_words(text)
    if words is None:
        raise ImageError(f"{images / 'start-qemu.sh'} has no qemu-system-* command line")

    def path(value: str) -> Path:
        value = _SCRIPT_DIRS.sub("", value)
        return Path(value) if Path(value).is_absolute() else images / value

    found: dict[str, object] = {"binary": Path(words[0]).name}
    drives: dict[str, tuple[Path, str]] = {}  # by id= (or by position), with their if=
    devices: list[tuple[str, str]] = []  # (device, drive id)
    pairs = zip(words[1:], [*words[2:], ""], strict=True)
    for opt, value in pairs:
        if opt in ("-M", "-machine"):
            head, keys = _options(value)
            found["machine"] = head or keys.get("type") or found.get("machine")
        elif opt == "-kernel":
            found["kernel"] = path(value)
        elif opt == "-initrd":
            found["initrd"] = path(value)
        elif opt == "-append":
            found["cmdline"] = value
        elif opt == "-hda":
            drives[f"#{len(drives)}"] = (path(value), "ide")
        elif opt == "-drive":
            _, keys = _options(value)
            if "file" in keys:
                drives[keys.get("id", f"#{len(drives)}")] = (path(keys["file"]), keys.get("if", "ide"))
        elif opt == "-device":
            head, keys = _options(value)
            if "drive" in keys:
                devices.append((head, keys["drive"]))
    for drive_id, (file, interface) in drives.items():
        if file.name.startswith("rootfs."):
            attached = [_DEVICES.get(dev, dev) for dev, ref in devices if ref == drive_id]
            found["disk"] = file
            found["disk_interface"] = attached[0] if interface == "none" and attached else interface
            break
    return StartQemu(**found)  # type: ignore[arg-type]


def _first(directory: Path, names: tuple[str, ...]) -> Path | None:
    return next((directory / n for n in names if (directory / n).is_file()), None)


def _linux_build(output: Path) -> Path | None:
    """The one ``build/linux-*`` directory that holds a vmlinux (None: there is none)."""
    build = output / "build"
    candidates = sorted(d for d in build.glob("linux-*") if d.is_dir()) if build.is_dir() else []
    with_vmlinux = [d for d in candidates if (d / "vmlinux").is_file()]
    if len(with_vmlinux) > 1:
        raise ImageError(f"buildroot output {output}: several kernel builds have a vmlinux "
                         f"({', '.join(d.name for d in with_vmlinux)}): name one with vmlinux = ")  # fmt: skip
    return with_vmlinux[0] if with_vmlinux else None


def find_layout(output: Path) -> Layout:
    """The files buildroot left in ``output`` (its ``output/`` directory), as image keys.

    The root filesystem is the one start-qemu.sh attaches, else a disk image (rootfs.ext2, rootfs.ext4),
    else an initramfs (rootfs.cpio.gz, rootfs.cpio).  What is missing is left out: the caller says which
    keys an image still needs.
    """
    images = output / "images"
    if not images.is_dir():
        what = "does not exist" if not output.exists() else "has no images/ directory"
        raise ImageError(f"buildroot output {output} {what}: give buildroot's output/ directory (the one that "
                         f"holds images/ and build/)")  # fmt: skip
    script = images / "start-qemu.sh"
    try:
        start = parse_start_qemu(script.read_text(errors="replace"), images) if script.is_file() else None
    except OSError as exc:
        raise ImageError(f"cannot read {script}: {exc.strerror}") from None
    files: dict[str, Path] = {}
    kernel = start.kernel if start is not None and start.kernel is not None else _first(images, _KERNELS)
    if kernel is not None:
        files["kernel"] = kernel
    if start is not None and start.disk is not None:
        files["disk"] = start.disk
    elif start is not None and start.initrd is not None:
        files["initrd"] = start.initrd
    elif (disk := _first(images, _DISKS)) is not None:
        files["disk"] = disk
    elif (initrd := _first(images, _INITRDS)) is not None:
        files["initrd"] = initrd
    linux = _linux_build(output)
    if linux is not None:
        files["vmlinux"] = linux / "vmlinux"
        for key, name in (("config", ".config"), ("system_map", "System.map")):
            if (linux / name).is_file():
                files[key] = linux / name
    elif (images / "vmlinux").is_file():  # BR2_LINUX_KERNEL_VMLINUX installs it there too
        files["vmlinux"] = images / "vmlinux"
    return Layout(output, files, start)


def missing(layout: Layout, given: set[str]) -> str | None:
    """What an image needs that neither the layout nor the entry's own keys give, said in one line."""
    if "kernel" not in layout.files and "kernel" not in given:
        return f"no kernel image in {layout.output / 'images'} (bzImage): give kernel ="
    if "vmlinux" not in layout.files and "vmlinux" not in given:
        build = layout.output / "build"
        names = sorted(d.name for d in build.glob("linux-*")) if build.is_dir() else []
        seen = f" (found {', '.join(names)}, none with a vmlinux)" if names else ""
        return f"no vmlinux in {build}/linux-*/{seen}: build the kernel, or give vmlinux ="
    return None


def resolve(spec: ImageSpec) -> ImageSpec:
    """A ``buildroot = ...`` entry as the files it names: its own keys first, then the output directory's."""
    if spec.buildroot is None:
        return spec
    layout = find_layout(spec.buildroot)
    where = f"{spec.origin or '<manifest>'}: image '{spec.name}'"
    problem = missing(layout, set(spec.files))
    if problem is not None:
        raise ImageError(f"{where}: {problem}")
    files = dict(layout.files)
    if "initrd" in spec.files or "disk" in spec.files:  # the entry's root filesystem replaces the tree's
        files.pop("initrd", None)
        files.pop("disk", None)
    files.update(spec.files)
    start = layout.start
    interface = spec.disk_interface
    if interface is None and start is not None and "disk" in files and files.get("disk") == start.disk:
        interface = start.disk_interface
        if interface not in DISK_INTERFACES:
            raise ImageError(f"{where}: {layout.output / 'images' / 'start-qemu.sh'} attaches the root disk as "
                             f"{interface!r}; qprobe attaches it as 'virtio' or 'nvme': set disk_interface to the "
                             f"one the kernel has a driver for")  # fmt: skip
    if start is not None and start.binary != "qemu-system-x86_64":
        raise ImageError(f"{where}: {layout.output / 'images' / 'start-qemu.sh'} runs {start.binary}: qprobe "
                         f"boots x86-64 kernels (qemu-system-x86_64)")  # fmt: skip
    if start is not None and start.machine is not None and not start.machine.startswith(("pc", "q35")):
        # The kernel then finds its PCI disk (virtio or NVMe) on qprobe's pc machine just as on q35.
        raise ImageError(f"{where}: {layout.output / 'images' / 'start-qemu.sh'} boots QEMU's {start.machine!r} "
                         f"machine; qprobe boots the pc machine (pc or q35 kernels boot there)")  # fmt: skip
    cmdline = spec.cmdline
    if cmdline is None and start is not None and start.cmdline is not None:
        # qprobe's console is the first serial port, which it names itself; the board's (tty1, ttyS0) would
        # move /dev/console away from it.
        cmdline = " ".join(arg for arg in start.cmdline.split() if not arg.startswith("console="))
    return replace(spec, files=files, disk_interface=interface, cmdline=cmdline, buildroot=None)

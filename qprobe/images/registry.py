"""Turning image names into bootable ``Image`` objects.

``list_images`` only looks (manifests and cache, no apt, no builds);
``get_image`` makes an image ready: it fetches a Debian kernel if none is
cached, builds the guest root filesystem if its inputs changed, and checks
every file. ``initrd_with_files``/``with_files`` add host files to a guest
for one run without rebuilding the cached image.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path, PurePosixPath

from qprobe.errors import ImageError
from qprobe.images import brstyle, build, buildroot, cache, debian, guest
from qprobe.images.cpio import extra_files_cpio, guest_path
from qprobe.images.image import (
    DISK_INTERFACES,
    Image,
    ImageInfo,
    check_config,
    check_disk,
    check_initrd,
    check_kernel,
    disk_interface_of,
    kernel_release,
    preempt_model,
    vmlinux_arch,
)
from qprobe.images.manifest import DEFAULT_IMAGE, ImageSpec, load_specs
from qprobe.images.progress import Reporter
from qprobe.images.progress import wanted as progress_wanted
from qprobe.images.toolchain import toolchain

__all__ = [
    "disk_with_files",
    "get_image",
    "image_from_files",
    "initrd_with_files",
    "list_images",
    "with_files",
]

# Kept in the cache per kind; older ones are deleted.
_KEEP_EXTRA = 16


def _root_device(interface: str) -> str:
    return "/dev/vda" if interface == "virtio" else "/dev/nvme0n1"


def _disk_cmdline(spec_cmdline: str | None, interface: str, own_disk: bool) -> str:
    """Kernel arguments a disk image needs: root= (unless given), rw, our /init."""
    if own_disk:
        default = f"root={_root_device(interface)} rootfstype=ext2 rootwait rw init=/init"
    else:
        default = f"root={_root_device(interface)} rootwait rw"
    if spec_cmdline is None:
        return default
    if any(arg.startswith("root=") for arg in spec_cmdline.split()):
        return spec_cmdline
    return f"{default} {spec_cmdline}".strip()


def _state_of_files(spec: ImageSpec) -> str:
    present = [p.exists() for p in spec.files.values()]
    if all(present):
        return "ready"
    return "partial" if any(present) else "not fetched"


def list_images() -> list[ImageInfo]:
    """Every known image (built-in, then the user's) and whether it is ready.

    Nothing is fetched or built and apt is not asked: the state comes from
    the cache and the file system. "ready" means the kernel files are there
    (the guest root filesystem is built in seconds when needed).
    """
    infos = []
    for spec in load_specs().values():
        if spec.source == "debian":
            assert spec.flavour is not None
            state, release = debian.kernel_state(spec.flavour, spec.abi, spec.series)
            source = f"debian:{spec.flavour}" + (f" (abi {spec.abi})" if spec.abi else "")
            source += f" (series {spec.series})" if spec.series and not spec.abi else ""
        elif spec.source == "build":
            state, release = build.build_state(spec)
            source = f"build:{spec.package}"
        else:
            source = f"files:{spec.origin}"
            try:
                spec = buildroot.resolve(spec)
            except ImageError:  # an output directory not (yet) built: said in full by get_image
                assert spec.buildroot is not None
                state, release = ("partial" if spec.buildroot.exists() else "not fetched"), None
            else:
                state = _state_of_files(spec)
                kernel = spec.files["kernel"]
                release = kernel_release(kernel) if kernel.is_file() else None
        infos.append(
            ImageInfo(
                name=spec.name,
                description=spec.description,
                source=source,
                state=state,
                rootfs=spec.form,
                kernel_version=release,
            )
        )
    return infos


def _rootfs(rootfs: str, reporter: Reporter, arch: str) -> tuple[Path | None, Path | None]:
    """(initrd, disk) for a root filesystem qprobe builds for a guest of ``arch``: its own, or a buildroot-style one."""
    if rootfs in brstyle.FORMS and not toolchain(arch).native:
        raise ImageError(f"the buildroot-style root filesystem {rootfs!r} is built from the host's busybox and "
                         f"programs: it has no {arch} form")  # fmt: skip
    if rootfs == "buildroot-ext2":
        return None, brstyle.build_rootfs(rootfs, reporter)
    if rootfs == "buildroot-cpio":
        return brstyle.build_rootfs(rootfs, reporter), None
    files = guest.guest_sources(arch, reporter)
    if rootfs == "disk":
        return None, guest.build_disk(reporter, files)
    return guest.build_initramfs(reporter, files), None


def get_image(name: str = DEFAULT_IMAGE, *, fetch: bool = True, progress: bool = True) -> Image:
    """The image called ``name``, made ready to boot.

    With ``fetch=False`` nothing is downloaded (an image whose kernel is not
    cached is an ImageError); the guest root filesystem is still built
    locally when its inputs changed, since that needs no network. A cached
    Debian kernel is reused even if apt has a newer one.
    """
    specs = load_specs()
    spec = specs.get(name)
    if spec is None:
        raise ImageError(f"unknown image {name!r}; known images: {', '.join(specs) or 'none'}")
    reporter = Reporter(progress and progress_wanted())
    if spec.source == "files":
        return _image_from_spec(spec, reporter)

    if spec.source == "build":
        files = build.built_kernel(spec)
    else:
        assert spec.flavour is not None
        files = debian.cached_kernel(spec.flavour, spec.abi, spec.series)
    if files is None:
        if not fetch:
            where = cache.cache_dir()
            raise ImageError(f"the kernel of image {name!r} is not in the cache ({where}); get it with fetch=True")
        if spec.source == "build":
            files = build.build_kernel(spec, reporter)
        else:
            assert spec.flavour is not None
            files = debian.fetch_kernel(spec.flavour, spec.abi, reporter, spec.series)
    arch = vmlinux_arch(files.vmlinux)
    initrd, disk = _rootfs(spec.rootfs, reporter, arch)
    interface = spec.disk_interface or "nvme"
    own = spec.rootfs not in brstyle.FORMS
    cmdline = _disk_cmdline(spec.cmdline, interface, own_disk=own) if disk is not None else spec.cmdline or ""
    return Image(
        name=name,
        kernel=files.vmlinuz,
        vmlinux=files.vmlinux,
        initrd=initrd,
        disk=disk,
        system_map=files.system_map,
        config=files.config,
        cmdline=cmdline,
        disk_interface=interface,
        preempt=preempt_model(files.config, cmdline),
        kernel_version=files.release,
        arch=arch,
        own_init=own,
    )


def _image_from_spec(spec: ImageSpec, reporter: Reporter) -> Image:
    spec = buildroot.resolve(spec)
    f = spec.files
    check_kernel(f["kernel"])
    arch = vmlinux_arch(f["vmlinux"])
    if "config" in f:
        check_config(f["config"])
    if "system_map" in f and not f["system_map"].is_file():
        raise ImageError(f"system_map file {f['system_map']} does not exist")
    if "initrd" in f:
        check_initrd(f["initrd"])
        initrd, disk = f["initrd"], None
    elif "disk" in f:
        check_disk(f["disk"])
        initrd, disk = None, f["disk"]
    else:
        initrd, disk = _rootfs(spec.rootfs, reporter, arch)
    own = spec.rootfs not in brstyle.FORMS and "initrd" not in f and "disk" not in f
    config = f.get("config")
    interface = spec.disk_interface or (disk_interface_of(config) if disk is not None else "nvme")
    cmdline = _disk_cmdline(spec.cmdline, interface, own_disk=own) if disk is not None else spec.cmdline or ""
    return Image(
        name=spec.name,
        kernel=f["kernel"].resolve(),
        vmlinux=f["vmlinux"].resolve(),
        initrd=initrd.resolve() if initrd else None,
        disk=disk.resolve() if disk else None,
        system_map=f["system_map"].resolve() if "system_map" in f else None,
        config=config.resolve() if config else None,
        cmdline=cmdline,
        disk_interface=interface,
        preempt=preempt_model(config, cmdline),
        kernel_version=kernel_release(f["kernel"]) or "unknown",
        arch=arch,
        own_init=own,
    )


def image_from_files(
    name: str,
    *,
    kernel: str | Path,
    vmlinux: str | Path,
    initrd: str | Path | None = None,
    disk: str | Path | None = None,
    system_map: str | Path | None = None,
    config: str | Path | None = None,
    cmdline: str | None = None,
    disk_interface: str | None = None,
    rootfs: str = "initramfs",
    progress: bool = True,
) -> Image:
    """An image from files on the host (a kernel you built, buildroot's output/images/).

    Checked like a user manifest entry. Without ``initrd`` or ``disk`` the
    kernel boots qprobe's own busybox root (``rootfs`` "initramfs" or
    "disk"). With ``disk`` and no ``root=`` in ``cmdline``, ``root=`` names
    the disk as the kernel will call it (/dev/nvme0n1, or /dev/vda for
    ``disk_interface="virtio"``); without ``disk_interface`` the disk is
    attached as the kernel's ``config`` builds in a driver for (NVMe without one).
    """
    if initrd is not None and disk is not None:
        raise ImageError("give either initrd or disk, not both")
    if disk_interface is not None and disk_interface not in DISK_INTERFACES:
        raise ImageError(f"disk_interface must be 'nvme' or 'virtio', not {disk_interface!r}")
    if rootfs not in ("initramfs", "disk"):
        raise ImageError(f"rootfs must be 'initramfs' or 'disk', not {rootfs!r}")
    given = {
        "kernel": kernel,
        "vmlinux": vmlinux,
        "initrd": initrd,
        "disk": disk,
        "system_map": system_map,
        "config": config,
    }
    files = {key: Path(value).expanduser() for key, value in given.items() if value is not None}
    spec = ImageSpec(
        name=name,
        source="files",
        files=files,
        cmdline=cmdline,
        rootfs=rootfs,
        disk_interface=disk_interface,
    )
    return _image_from_spec(spec, Reporter(progress))


def _files_key(files: Mapping[str, str | Path]) -> tuple[dict[PurePosixPath, Path], str]:
    """Checked (guest path -> host file) and a hash of the contents and modes."""
    checked: dict[PurePosixPath, Path] = {}
    items: list[tuple[str, bytes]] = []
    for g, h in sorted(files.items()):
        gpath = guest_path(g)
        hpath = Path(h).expanduser()
        if not hpath.is_file():
            raise ImageError(f"host file {hpath} (for guest path {gpath}) does not exist or is not a file")
        checked[gpath] = hpath
        mode = "x" if hpath.stat().st_mode & 0o111 else "-"
        items.append((f"{gpath}:{mode}", hpath.read_bytes()))
    return checked, cache.hash_inputs(items)


def _base_key(path: Path) -> bytes:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()


def _extra_file(base: Path, kind: str, files: Mapping[str, str | Path]) -> tuple[dict[PurePosixPath, Path], Path]:
    """The checked files, and the cache file that holds ``base`` with them added (``KIND-DIGEST.img``)."""
    checked, key = _files_key(files)
    digest = hashlib.sha256(_base_key(base) + key.encode()).hexdigest()[:16]
    return checked, cache.subdir("extra") / f"{kind}-{digest}.img"


def initrd_with_files(image: Image, files: Mapping[str, str | Path]) -> Path:
    """The image's initrd with host files added at guest paths (cached file).

    The extra newc archive is appended after padding the initrd to 4 bytes
    (the kernel looks for an uncompressed archive's header only at 4-byte
    aligned offsets); the kernel unpacks both, later files win.
    """
    if image.initrd is None:
        raise ImageError(f"image {image.name!r} boots from a disk: use with_files() or disk_with_files()")
    checked, dest = _extra_file(image.initrd, "initrd", files)
    if dest.is_file():
        cache.touch(dest)
        return dest
    extra = extra_files_cpio({str(g): h for g, h in checked.items()})
    with cache.atomic_file(dest) as tmp, image.initrd.open("rb") as src, tmp.open("wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
        out.write(b"\0" * (-out.tell() % 4))
        out.write(extra)
    cache.prune(dest.parent, "initrd-*.img", keep=_KEEP_EXTRA, protect=[dest])
    return dest


def _e2fs(tool: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run an e2fsprogs tool (they live in /sbin, often not in a user's PATH)."""
    path = shutil.which(tool) or shutil.which(tool, path="/sbin:/usr/sbin")
    if path is None:
        raise ImageError(f"{tool} not found: install e2fsprogs")
    return subprocess.run(
        [path, *args], input=stdin, capture_output=True, encoding="utf-8", errors="replace", check=False
    )


def _make_room(disk: Path, need: int) -> None:
    """Grow an ext2/3/4 image file (offline, no root) until ``need`` more bytes fit."""
    fields = {}
    for line in _e2fs("dumpe2fs", "-h", str(disk)).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    try:
        free = int(fields["Free blocks"]) * int(fields["Block size"])
    except (KeyError, ValueError) as exc:
        raise ImageError(f"dumpe2fs cannot read {disk}: is it an ext2/3/4 image?") from exc
    margin = 1 << 20
    if free >= need + margin:
        return
    # resize2fs insists on a freshly checked filesystem; -p fixes only what is safe.
    check = _e2fs("e2fsck", "-f", "-p", str(disk))
    if check.returncode not in (0, 1):
        raise ImageError(f"e2fsck found errors in a copy of the disk image: {check.stdout.strip()[-200:]}")
    new_size = disk.stat().st_size + need + 8 * margin
    os.truncate(disk, new_size)
    grow = _e2fs("resize2fs", str(disk), f"{new_size // 1024}K")
    if grow.returncode != 0:
        raise ImageError(f"resize2fs could not grow a copy of the disk image: {grow.stderr.strip()}")


def disk_with_files(image: Image, files: Mapping[str, str | Path]) -> Path:
    """A copy of the image's disk with host files written in (cached file).

    Uses ``debugfs -w`` (e2fsprogs), which edits an ext2/3/4 image without
    root or mounting. Parent directories are created as needed.
    """
    if image.disk is None:
        raise ImageError(f"image {image.name!r} has no disk: use initrd_with_files()")
    checked, dest = _extra_file(image.disk, "disk", files)
    if dest.is_file():
        cache.touch(dest)
        return dest
    script: list[str] = []
    made: set[PurePosixPath] = set()
    for gpath, hpath in checked.items():
        for parent in reversed(gpath.parents[:-1]):
            if parent not in made:
                made.add(parent)
                script.append(f'mkdir "{parent}"')  # fails harmlessly if it exists
        mode = 0o100755 if hpath.stat().st_mode & 0o111 else 0o100644
        if any(c in str(gpath) + str(hpath) for c in '"\n'):
            raise ImageError(f"cannot put {hpath} at {gpath}: quotes and newlines are not supported in names")
        script += [
            f'rm "{gpath}"',
            f'write "{hpath}" "{gpath}"',
            f'sif "{gpath}" mode 0{mode:o}',
            f'sif "{gpath}" uid 0',
            f'sif "{gpath}" gid 0',
        ]
    need = sum(h.stat().st_size for h in checked.values()) + 4096 * (len(checked) + len(made))
    with cache.atomic_file(dest) as tmp:
        subprocess.run(["cp", "--sparse=always", str(image.disk), str(tmp)], check=True)
        _make_room(tmp, need)
        proc = _e2fs("debugfs", "-w", "-f", "-", str(tmp), stdin="\n".join(script) + "\n")
        failed = [line for line in proc.stderr.splitlines() if line.startswith(("write:", "sif:"))]
        if proc.returncode != 0 or failed:
            detail = failed[0] if failed else proc.stderr.strip()
            raise ImageError(f"debugfs could not write files into a copy of {image.disk}: {detail}")
    cache.prune(dest.parent, "disk-*.img", keep=_KEEP_EXTRA, protect=[dest])
    return dest


def with_files(image: Image, files: Mapping[str, str | Path]) -> Image:
    """The same image with host files added to its root filesystem, whichever form it has."""
    if not files:
        return image
    if image.disk is not None:
        return replace(image, disk=disk_with_files(image, files))
    return replace(image, initrd=initrd_with_files(image, files))

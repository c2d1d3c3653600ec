"""qprobe's pre-init as qprobe adds it to an image whose root filesystem is not its own, and the
buildroot-style root filesystem qprobe's tests boot through it."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from images_fakes import fake_bzimage, fake_config, fake_disk, fake_initrd, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import brstyle, get_image, image_from_files
from qprobe.images.preinit import preinit_archive, with_preinit
from qprobe.vmm import bootfail

PREINIT = Path(__file__).resolve().parents[3] / "scripts" / "guest" / "preinit"
needs_cpio = pytest.mark.skipif(shutil.which("cpio") is None, reason="cpio not installed")


def _unpack(data: bytes, into: Path) -> None:
    """Every archive of a (concatenated) initramfs unpacked by GNU cpio, as the kernel unpacks them in turn."""
    into.mkdir()
    rest = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    while rest.strip(b"\0"):
        rest = rest.lstrip(b"\0")
        proc = subprocess.run(["cpio", "-id", "--quiet", "--no-absolute-filenames"], input=rest, cwd=into,
                              capture_output=True, check=True)  # fmt: skip
        del proc
        # GNU cpio stops at the trailer: find the next archive's magic after it.
        end = rest.find(b"TRAILER!!!")
        nxt = rest.find(b"070701", end)
        rest = rest[nxt:] if nxt >= 0 else b""


def _image(tmp_path: Path, *config: str, **root: Path) -> object:
    return image_from_files(
        "br", kernel=fake_bzimage(tmp_path / "bzImage"), vmlinux=fake_vmlinux(tmp_path / "vmlinux"),
        config=fake_config(tmp_path / "config", *config), progress=False, **root,  # type: ignore[arg-type]
    )  # fmt: skip


def test_an_image_of_qprobes_own_root_is_booted_as_it_is(tmp_path: Path) -> None:
    img = image_from_files("own", kernel=fake_bzimage(tmp_path / "bzImage"), vmlinux=fake_vmlinux(tmp_path / "v"),
                           progress=False)  # fmt: skip
    assert img.own_init and with_preinit(img) is img


@needs_cpio
def test_a_disk_image_gets_the_pre_init_as_its_only_initramfs_and_its_disk_unchanged(tmp_path: Path) -> None:
    disk = fake_disk(tmp_path / "rootfs.ext2")
    img = _image(tmp_path, "CONFIG_BLK_DEV_INITRD=y", "CONFIG_DEVTMPFS_MOUNT=y", "CONFIG_BLK_DEV_NVME=y", disk=disk)
    assert not img.own_init  # type: ignore[attr-defined]
    booted = with_preinit(img)  # type: ignore[arg-type]
    assert booted.disk == disk.resolve() and booted.initrd == preinit_archive()
    assert booted.cmdline.endswith(f" rdinit={bootfail.PREINIT} qprobe.devtmpfs=1"), booted.cmdline
    assert "init=/init" not in booted.cmdline.split()  # the image's own init runs
    _unpack(booted.initrd.read_bytes(), tmp_path / "root")
    unpacked = sorted(str(p.relative_to(tmp_path / "root")) for p in (tmp_path / "root").rglob("*"))
    assert unpacked == ["qprobe", "qprobe/busybox", "qprobe/init", "qprobe/preinit"]
    assert (tmp_path / "root" / bootfail.PREINIT.lstrip("/")).read_bytes() == PREINIT.read_bytes()
    assert all(os.access(tmp_path / "root" / "qprobe" / f, os.X_OK) for f in ("busybox", "init", "preinit"))


@needs_cpio
def test_an_initramfs_image_keeps_its_archive_and_gets_the_pre_init_after_it(tmp_path: Path) -> None:
    rootfs = fake_initrd(tmp_path / "rootfs.cpio", compressed=False)
    (tmp_path / "odd.cpio").write_bytes(rootfs.read_bytes() + b"\0\0")  # not a multiple of 4 bytes long
    img = _image(tmp_path, "CONFIG_BLK_DEV_INITRD=y", initrd=tmp_path / "odd.cpio")
    booted = with_preinit(img)  # type: ignore[arg-type]
    data = booted.initrd.read_bytes()  # type: ignore[union-attr]
    archive = preinit_archive().read_bytes()
    assert data == rootfs.read_bytes() + b"\0\0" + b"\0\0" + archive  # padded to 4 bytes, where the kernel looks
    assert booted.cmdline.endswith(" qprobe.devtmpfs=0"), booted.cmdline  # no CONFIG_DEVTMPFS_MOUNT
    _unpack(data, tmp_path / "root")
    assert (tmp_path / "root" / "init").is_file() and (tmp_path / "root" / "qprobe" / "preinit").is_file()


def test_a_kernel_without_initramfs_support_is_refused_before_it_boots(tmp_path: Path) -> None:
    img = _image(
        tmp_path,
        "# CONFIG_BLK_DEV_INITRD is not set",
        "CONFIG_BLK_DEV_NVME=y",
        disk=fake_disk(tmp_path / "rootfs.ext2"),
    )
    with pytest.raises(ImageError, match=r"^the kernel of image 'br' has no CONFIG_BLK_DEV_INITRD: qprobe brings"):
        with_preinit(img)  # type: ignore[arg-type]


def test_the_script_prints_what_qprobe_reads_on_the_console() -> None:
    text = PREINIT.read_text()
    assert bootfail.PREINIT_STARTED.removeprefix("qprobe-preinit: ") in text
    assert bootfail.PREINIT_OWN in text and f"rdinit={bootfail.PREINIT})" in text
    assert "Waiting for root device" in text and "VFS: Cannot open root device" in text
    subprocess.run(["sh", "-n", str(PREINIT)], check=True)


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("mke2fs", path="/sbin:/usr/sbin:" + os.environ["PATH"])
                    is None, reason="gcc and mke2fs build the guest")  # fmt: skip
def test_the_buildroot_style_root_is_buildroots_layout_with_nothing_of_qprobes(tmp_path: Path) -> None:
    cpio = brstyle.build_rootfs("buildroot-cpio", brstyle.Reporter(enabled=False))
    tree = cpio.parent / "tree"
    inittab = (tree / "etc" / "inittab").read_text()
    assert "console::respawn:/sbin/getty -L  console 0 vt100" in inittab and "::sysinit:/etc/init.d/rcS" in inittab
    assert sorted(p.name for p in (tree / "etc" / "init.d").iterdir()) == ["S01syslogd", "S02klogd", "S40network",
                                                                          "rcK", "rcS"]  # fmt: skip
    assert (tree / "etc" / "shadow").read_text().startswith("root::")
    assert os.readlink(tree / "sbin" / "init") == "../bin/busybox" and (tree / "usr" / "bin" / "workload").is_file()
    assert not (tree / "init").exists() and "QPROBE-READY" not in (brstyle.skeleton_dir() / "init-cpio").read_text()
    assert not [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink() and b"QPROBE-READY" in p.read_bytes()]
    ext2 = brstyle.build_rootfs("buildroot-ext2", brstyle.Reporter(enabled=False))
    assert ext2.parent == cpio.parent and ext2.read_bytes()[1080:1082] == b"\x53\xef"
    with pytest.raises(ImageError, match="unknown buildroot-style root filesystem 'buildroot-squashfs'"):
        brstyle.build_rootfs("buildroot-squashfs", brstyle.Reporter(enabled=False))


def test_the_buildroot_style_images_are_not_qprobes_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built = {"buildroot-ext2": fake_disk(tmp_path / "rootfs.ext2"), "buildroot-cpio": fake_initrd(tmp_path / "c")}
    monkeypatch.setattr(brstyle, "build_rootfs", lambda form, reporter: built[form])
    manifest = tmp_path / "images.toml"
    kernel, vmlinux = fake_bzimage(tmp_path / "bzImage"), fake_vmlinux(tmp_path / "vmlinux")
    manifest.write_text("".join(f'[images.my-{n}]\nkernel = "{kernel}"\nvmlinux = "{vmlinux}"\nrootfs = "{n}"\n'
                                'cmdline = "root=/dev/vda rootwait"\n' for n in built))  # fmt: skip
    monkeypatch.setenv("QPROBE_IMAGES", str(manifest))
    disk, cpio = get_image("my-buildroot-ext2", progress=False), get_image("my-buildroot-cpio", progress=False)
    assert not disk.own_init and disk.disk == built["buildroot-ext2"].resolve() and disk.initrd is None
    assert disk.cmdline == "root=/dev/vda rootwait"  # no init=/init: the image's own init runs
    assert not cpio.own_init and cpio.initrd == built["buildroot-cpio"].resolve() and cpio.disk is None

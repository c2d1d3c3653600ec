"""User images from files: the checks that name the wrong file, and the results."""

from __future__ import annotations

import gzip
import shutil
import subprocess
from pathlib import Path

import pytest
from images_fakes import RELEASE, fake_bzimage, fake_config, fake_disk, fake_initrd, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import get_image, image_from_files, initrd_with_files, with_files
from qprobe.images.image import check_disk, check_initrd, check_kernel, check_vmlinux


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {
        "kernel": fake_bzimage(tmp_path / "bzImage"),
        "vmlinux": fake_vmlinux(tmp_path / "vmlinux"),
        "initrd": fake_initrd(tmp_path / "rootfs.cpio.gz"),
        "disk": fake_disk(tmp_path / "rootfs.ext2"),
        "config": fake_config(tmp_path / "config", "CONFIG_PREEMPT=y", "CONFIG_KPROBES=y"),
    }


def test_checks_accept_good_files(files: dict[str, Path], tmp_path: Path) -> None:
    check_kernel(files["kernel"])
    check_vmlinux(files["vmlinux"])
    check_initrd(files["initrd"])
    check_initrd(fake_initrd(tmp_path / "plain.cpio", compressed=False))
    check_disk(files["disk"])


def test_bad_bzimage(tmp_path: Path, files: dict[str, Path]) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\0" * 0x300)
    with pytest.raises(ImageError, match=r"not a bzImage.*HdrS.*0x202") as exc:
        check_kernel(bad)
    assert str(bad) in str(exc.value)
    with pytest.raises(ImageError, match="use the bzImage or Image, not vmlinux"):
        check_kernel(files["vmlinux"])
    short = tmp_path / "short"
    short.write_bytes(b"MZ")
    with pytest.raises(ImageError, match="not a bzImage"):
        check_kernel(short)


def test_bad_vmlinux(tmp_path: Path, files: dict[str, Path]) -> None:
    with pytest.raises(ImageError, match=r"not an ELF file \(that is a bzImage"):
        check_vmlinux(files["kernel"])
    with pytest.raises(ImageError, match=r"not an ELF file$"):
        check_vmlinux(files["config"])
    with pytest.raises(ImageError, match="machine 40, not x86_64 or aarch64"):
        check_vmlinux(fake_vmlinux(tmp_path / "arm32", machine=40))
    with pytest.raises(ImageError, match="64-bit"):
        check_vmlinux(fake_vmlinux(tmp_path / "i386", machine=3, elf_class=1))


def test_bad_initrd_and_disk(tmp_path: Path, files: dict[str, Path]) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("just text\n")
    with pytest.raises(ImageError, match="neither a cpio archive nor a gzip"):
        check_initrd(text)
    with pytest.raises(ImageError, match="not a raw ext2/ext3/ext4"):
        check_disk(files["initrd"])
    with pytest.raises(ImageError, match="not a raw ext2/ext3/ext4"):
        check_disk(text)


def test_missing_file_is_named(tmp_path: Path, files: dict[str, Path]) -> None:
    missing = tmp_path / "nope" / "vmlinux"
    with pytest.raises(ImageError, match=r"vmlinux file .*nope/vmlinux does not exist"):
        image_from_files("x", kernel=files["kernel"], vmlinux=missing, initrd=files["initrd"])
    with pytest.raises(ImageError, match=r"initrd file .*absent\.img does not exist"):
        image_from_files("x", kernel=files["kernel"], vmlinux=files["vmlinux"], initrd=tmp_path / "absent.img")


def test_image_from_files_initrd(files: dict[str, Path]) -> None:
    image = image_from_files(
        "mine",
        kernel=files["kernel"],
        vmlinux=files["vmlinux"],
        initrd=files["initrd"],
        config=files["config"],
    )
    assert image.initrd == files["initrd"].resolve()
    assert image.disk is None
    assert image.cmdline == ""
    assert image.preempt == "full"
    assert image.kernel_version == RELEASE
    assert image.config_option("KPROBES") == "y"
    assert image.qemu_boot_args() == ["-kernel", str(files["kernel"]), "-initrd", str(files["initrd"])]


def test_image_from_files_disk_cmdline(files: dict[str, Path]) -> None:
    nvme = image_from_files("d", kernel=files["kernel"], vmlinux=files["vmlinux"], disk=files["disk"])
    assert nvme.cmdline == "root=/dev/nvme0n1 rootwait rw"
    assert nvme.preempt == "unknown"
    args = nvme.qemu_boot_args()
    assert "-initrd" not in args
    assert "nvme,drive=qprobe-disk,serial=qprobe0" in args
    assert any("snapshot=on" in a for a in args)
    virtio = image_from_files(
        "v",
        kernel=files["kernel"],
        vmlinux=files["vmlinux"],
        disk=files["disk"],
        disk_interface="virtio",
        cmdline="quiet",
    )
    assert virtio.cmdline == "root=/dev/vda rootwait rw quiet"
    assert any(a.startswith(f"file={files['disk']},if=virtio") for a in virtio.qemu_boot_args())
    own_root = image_from_files(
        "o", kernel=files["kernel"], vmlinux=files["vmlinux"], disk=files["disk"], cmdline="root=/dev/sda1 ro"
    )
    assert own_root.cmdline == "root=/dev/sda1 ro"
    with pytest.raises(ImageError, match="either initrd or disk"):
        image_from_files(
            "b", kernel=files["kernel"], vmlinux=files["vmlinux"], initrd=files["initrd"], disk=files["disk"]
        )


def test_get_image_user_manifest(tmp_path: Path, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = tmp_path / "images.toml"
    manifest.write_text(
        '[images.mine]\nkernel = "bzImage"\nvmlinux = "vmlinux"\ninitrd = "rootfs.cpio.gz"\n'
        'config = "config"\ncmdline = "preempt=none"\n'
        '[images.broken]\nkernel = "vmlinux"\nvmlinux = "vmlinux"\ninitrd = "rootfs.cpio.gz"\n'
    )
    monkeypatch.setenv("QPROBE_IMAGES", str(manifest))
    image = get_image("mine", fetch=False, progress=False)
    assert image.kernel == files["kernel"].resolve()
    assert image.cmdline == "preempt=none"
    with pytest.raises(ImageError, match="not a bzImage"):
        get_image("broken", progress=False)
    with pytest.raises(ImageError, match=r"unknown image 'nosuch'; known images: debian-cloud, .*mine"):
        get_image("nosuch")


def test_debian_image_not_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImageError, match="not in the cache"):
        get_image("debian-cloud", fetch=False, progress=False)


def test_initrd_with_files(tmp_path: Path, files: dict[str, Path]) -> None:
    image = image_from_files("mine", kernel=files["kernel"], vmlinux=files["vmlinux"], initrd=files["initrd"])
    extra = tmp_path / "probe-helper"
    extra.write_text("#!/bin/sh\n")
    extra.chmod(0o755)
    out = initrd_with_files(image, {"/opt/probe-helper": extra})
    data = out.read_bytes()
    base = files["initrd"].read_bytes()
    assert data.startswith(base)
    start = len(base) + (-len(base) % 4)
    assert data[len(base) : start] == b"\0" * (start - len(base))
    assert data[start : start + 6] == b"070701"  # the kernel wants it 4-byte aligned
    assert gzip.decompress(base)  # the base part is untouched
    if shutil.which("cpio"):
        listing = subprocess.run(["cpio", "-it", "--quiet"], input=data[start:], capture_output=True, check=True)
        assert listing.stdout.decode().split() == ["opt", "opt/probe-helper"]
    assert initrd_with_files(image, {"/opt/probe-helper": extra}) == out  # cached
    extra.write_text("#!/bin/sh\necho changed\n")
    assert initrd_with_files(image, {"/opt/probe-helper": extra}) != out
    assert with_files(image, {}) is image
    assert with_files(image, {"/opt/probe-helper": extra}).initrd == initrd_with_files(
        image, {"/opt/probe-helper": extra}
    )
    with pytest.raises(ImageError, match="must be absolute"):
        initrd_with_files(image, {"opt/x": extra})
    with pytest.raises(ImageError, match="does not exist"):
        initrd_with_files(image, {"/opt/x": tmp_path / "gone"})
    disk_image = image_from_files("d", kernel=files["kernel"], vmlinux=files["vmlinux"], disk=files["disk"])
    with pytest.raises(ImageError, match="boots from a disk"):
        initrd_with_files(disk_image, {"/opt/x": extra})

"""arm64 kernels without a VM: the Image checks, its release, the guest architecture from vmlinux."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
from images_fakes import fake_arm64_image, fake_initrd, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import image_from_files
from qprobe.images.image import check_kernel, check_vmlinux, kernel_release, vmlinux_arch


def test_check_kernel_takes_an_arm64_image_raw_or_gzipped(tmp_path: Path) -> None:
    check_kernel(fake_arm64_image(tmp_path / "Image"))
    check_kernel(fake_arm64_image(tmp_path / "Image.gz", compress=True))
    other = tmp_path / "other.gz"
    other.write_bytes(gzip.compress(b"\0" * 0x1000))
    for bad in (other, fake_vmlinux(tmp_path / "vmlinux", machine=183)):
        with pytest.raises(ImageError, match=r"not a bzImage .* nor an arm64 Image \('ARM\\x64' at 0x38\)"):
            check_kernel(bad)


def test_kernel_release_of_an_arm64_image_is_its_banner(tmp_path: Path) -> None:
    assert kernel_release(fake_arm64_image(tmp_path / "Image")) == "6.1.0-57-cloud-arm64"
    assert kernel_release(fake_arm64_image(tmp_path / "Image.gz", compress=True)) is None
    assert kernel_release(fake_vmlinux(tmp_path / "vmlinux")) is None


def test_vmlinux_arch_by_elf_machine(tmp_path: Path) -> None:
    assert vmlinux_arch(fake_vmlinux(tmp_path / "x86", machine=62)) == "x86_64"
    assert vmlinux_arch(fake_vmlinux(tmp_path / "arm64", machine=183)) == "aarch64"
    check_vmlinux(tmp_path / "arm64")
    with pytest.raises(ImageError, match="machine 243, not x86_64 or aarch64"):
        vmlinux_arch(fake_vmlinux(tmp_path / "riscv", machine=243))


def test_an_arm64_image_from_files_says_its_arch_and_release(tmp_path: Path) -> None:
    image = image_from_files(
        "arm",
        kernel=fake_arm64_image(tmp_path / "Image"),
        vmlinux=fake_vmlinux(tmp_path / "vmlinux", machine=183),
        initrd=fake_initrd(tmp_path / "rootfs.cpio.gz"),
        progress=False,
    )
    assert (image.arch, image.kernel_version) == ("aarch64", "6.1.0-57-cloud-arm64")
    assert os.fspath(image.kernel).endswith("Image")

"""The guest root filesystem for another architecture (no VM, no network): cross toolchain, busybox, libraries."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from images_fakes import fake_arm64_image, fake_config, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import busybox, cache, get_image, guest, registry, toolchain
from qprobe.images.elf import interpreter, needed
from qprobe.images.progress import Reporter

can_cross_build = pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-gcc") and os.path.exists("/usr/aarch64-linux-gnu/lib/libc.so.6")),
    reason="needs gcc-aarch64-linux-gnu and libc6-dev-arm64-cross",
)


def _e_machine(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[18:20], "little")


def test_toolchain_for_the_host_and_for_a_foreign_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "host_arch", lambda: "x86_64")
    native, cross = toolchain.toolchain("x86_64"), toolchain.toolchain("aarch64")
    assert (native.native, native.gcc, native.debian_arch) == (True, "gcc", "amd64")
    assert (cross.native, cross.gcc, cross.debian_arch) == (False, "aarch64-linux-gnu-gcc", "arm64")
    assert cross.libdir == Path("/usr/aarch64-linux-gnu/lib") and cross.guest_libdir == "/lib/aarch64-linux-gnu"
    assert cross.packages == "gcc-aarch64-linux-gnu and libc6-dev-arm64-cross"
    # On an arm64 host the roles turn round.
    monkeypatch.setattr(toolchain, "host_arch", lambda: "aarch64")
    assert toolchain.toolchain("aarch64").gcc == "gcc" and toolchain.toolchain("x86_64").gcc == "x86_64-linux-gnu-gcc"
    with pytest.raises(ImageError, match=r"no guest programs for architecture 'riscv64' \(known: x86_64, aarch64\)"):
        toolchain.toolchain("riscv64")


def test_a_missing_cross_compiler_names_its_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(toolchain, "host_arch", lambda: "x86_64")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ImageError, match=r"^aarch64-linux-gnu-gcc not found: install gcc-aarch64-linux-gnu and "):
        toolchain.toolchain("aarch64").which_gcc()


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_needed_and_interpreter_read_the_dynamic_section(tmp_path: Path) -> None:
    (tmp_path / "foo.c").write_text("int foo(void) { return 1; }\n")
    (tmp_path / "main.c").write_text("int foo(void);\nint main(void) { return foo(); }\n")
    lib = tmp_path / "libqptneeded.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, tmp_path / "foo.c"], check=True)
    prog = tmp_path / "prog"
    subprocess.run(["gcc", "-o", prog, tmp_path / "main.c", f"-L{tmp_path}", "-lqptneeded"], check=True)
    assert needed(prog) == ["libqptneeded.so", "libc.so.6"]
    assert interpreter(prog) is not None and interpreter(lib) is None
    static = tmp_path / "static"
    subprocess.run(["gcc", "-static", "-o", static, tmp_path / "foo.c", "-nostartfiles", "-e", "foo"], check=True)
    assert needed(static) == [] and interpreter(static) is None
    with pytest.raises(ImageError, match="not a 64-bit little-endian ELF"):
        needed(tmp_path / "foo.c")


def test_applets_of_a_foreign_busybox_from_its_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = tmp_path / "busybox"
    binary.write_bytes(b"\x7fELF junk\0[\0[[\0ash\0linuxrc\0poweroff\0zcat\0\0more data\0")
    monkeypatch.setattr(busybox, "host_busybox", lambda: Path("/host/busybox"))
    host = ["usr/bin/[", "usr/bin/[[", "bin/ash", "linuxrc", "sbin/poweroff"]
    monkeypatch.setattr(busybox, "_listed", lambda path: host)
    chain = toolchain.Toolchain("aarch64", "arm64", "aarch64-linux-gnu", native=False)
    assert busybox.applets(binary, chain) == ["usr/bin/[", "usr/bin/[[", "bin/ash", "sbin/poweroff", "bin/zcat"]
    binary.write_bytes(b"\x7fELF no table")
    with pytest.raises(ImageError, match="no busybox applet table"):
        busybox.applets(binary, chain)


@can_cross_build
def test_aarch64_tree_is_cross_built_and_kept_apart(
    monkeypatch: pytest.MonkeyPatch, _isolated_images: Path, tmp_path: Path
) -> None:
    monkeypatch.setattr(toolchain, "host_arch", lambda: "x86_64")
    # Stands in for Debian's arm64 busybox-static (fetched with apt): a busybox binary in the cache's place.
    fetched = cache.subdir("busybox", "arm64") / "busybox"
    shutil.copyfile(busybox.host_busybox(), fetched)
    files = guest.guest_sources("aarch64")
    assert files.busybox == fetched and files.arch == "aarch64"
    tree = guest.guest_tree(Reporter(False), files)
    for name in ("bin/workload", "bin/uprog", "bin/uprog-static", "usr/lib/libqpt.so"):
        assert _e_machine(tree / name) == 183, name  # EM_AARCH64
    assert interpreter(tree / "bin/uprog") == "/lib/ld-linux-aarch64.so.1"
    assert _e_machine(tree / "lib/ld-linux-aarch64.so.1") == 183
    assert (tree / "lib/aarch64-linux-gnu/libc.so.6").is_file()
    assert os.readlink(tree / "bin/sh") == "/bin/busybox" and (tree / "sbin/poweroff").is_symlink()
    # The architecture is part of the key: an x86_64 guest of the same sources is another tree.
    host = guest.GuestFiles(files.workload_c, files.init, files.busybox, files.uprog_c, files.libqpt_c, "x86_64")
    assert host.sources_key() != files.sources_key()
    assert guest.guest_tree(Reporter(False), files) == tree  # cached


def test_buildroot_style_roots_are_refused_for_a_foreign_guest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "host_arch", lambda: "x86_64")
    with pytest.raises(ImageError, match=r"'buildroot-ext2' is built from the host's busybox .* no aarch64 form"):
        registry._rootfs("buildroot-ext2", Reporter(False), "aarch64")


@can_cross_build
def test_a_cached_arm64_debian_kernel_gets_an_aarch64_root(
    monkeypatch: pytest.MonkeyPatch, _isolated_images: Path, tmp_path: Path
) -> None:
    monkeypatch.setattr(toolchain, "host_arch", lambda: "x86_64")
    release = "6.1.0-57-cloud-arm64"
    kernel = cache.subdir("kernels", release)
    fake_arm64_image(kernel / f"vmlinuz-{release}", release)
    fake_vmlinux(kernel / f"vmlinux-{release}", machine=183)
    fake_config(kernel / f"config-{release}", "CONFIG_PREEMPT_VOLUNTARY=y")
    (kernel / f"System.map-{release}").write_text("0000000000000000 T _text\n")
    (kernel / "source.json").write_text('{"version": "6.1.192-3"}')
    shutil.copyfile(busybox.host_busybox(), cache.subdir("busybox", "arm64") / "busybox")
    image = get_image("debian-cloud-arm64", fetch=False, progress=False)
    assert (image.arch, image.kernel_version, image.preempt) == ("aarch64", release, "voluntary")
    assert image.initrd is not None
    (workload,) = (_isolated_images / "guest").glob("*/tree/bin/workload")
    assert image.initrd.parent == workload.parents[2] and _e_machine(workload) == 183

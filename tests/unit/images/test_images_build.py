"""Building the guest (no VM), choosing a Debian kernel (apt faked), the cache."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from images_fakes import fake_bzimage, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import cache, debian, guest, image_from_files, with_files
from qprobe.images.apt import AptState
from qprobe.images.progress import Reporter

can_build = pytest.mark.skipif(
    not (shutil.which("gcc") and os.path.exists("/bin/busybox") and shutil.which("cpio")),
    reason="needs gcc, /bin/busybox and cpio",
)
has_mke2fs = pytest.mark.skipif(
    not (shutil.which("mke2fs") or os.path.exists("/sbin/mke2fs")), reason="needs e2fsprogs"
)


@can_build
def test_initramfs_tree(_isolated_images: Path) -> None:
    quiet = Reporter(False)
    path = guest.build_initramfs(quiet)
    listing = subprocess.run(
        f"gzip -dc {path} | cpio -itv --quiet", shell=True, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    entries = {line.split()[8] if "->" in line else line.split()[-1]: line for line in listing}
    assert entries["init"].startswith("-rwxr-xr-x")
    assert entries["bin/busybox"].startswith("-rwxr-xr-x")
    assert entries["bin/workload"].startswith("-rwxr-xr-x")
    assert entries["bin/uprog"].startswith("-rwxr-xr-x") and entries["bin/uprog-static"].startswith("-rwxr-xr-x")
    assert entries["usr/lib/libqpt.so"].startswith("-rwxr-xr-x")
    assert any(name.endswith("/libc.so.6") for name in entries)
    assert entries["dev/console"].startswith("crw-------")
    assert entries["tmp"].startswith("drwxrwxrwt")
    assert entries["bin/sh"].startswith("lrwxrwxrwx") and entries["bin/sh"].endswith("-> /bin/busybox")
    assert "sbin/poweroff" in entries and "usr/bin/setsid" in entries and "bin/cttyhack" in entries
    assert "etc/passwd" in entries and "root" in entries
    assert all(" root " in line or " 0 " in line for line in listing)  # owned by root
    # Cached: a second call builds nothing.
    mtime = path.stat().st_mtime_ns
    assert guest.build_initramfs(quiet) == path and path.stat().st_mtime_ns == mtime


@can_build
def test_workload_runs_on_host(_isolated_images: Path) -> None:
    guest.build_initramfs(Reporter(False))
    (workload,) = (_isolated_images / "guest").glob("*/workload")
    out = subprocess.run([workload, "getppid", "5"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("workload mode=getppid n=5 pid=") and "errors=0" in out
    out = subprocess.run([workload, "open-fail", "3", "/nonexistent"], capture_output=True, text=True).stdout
    assert "errors=3 errnos=ENOENT:3" in out
    assert subprocess.run([workload, "bogus"], capture_output=True).returncode == 2


@can_build
def test_inputs_change_rebuilds(_isolated_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "guest-src"
    shutil.copytree(Path(guest.__file__).resolve().parents[2] / "scripts" / "guest", src)
    monkeypatch.setenv("QPROBE_GUEST_SRC", str(src))
    first = guest.build_initramfs(Reporter(False))
    with (src / "init").open("a") as f:
        f.write("# changed\n")
    second = guest.build_initramfs(Reporter(False))
    assert first != second and first.parent.parent == second.parent.parent


@can_build
@has_mke2fs
def test_disk_image_and_disk_with_files(_isolated_images: Path, tmp_path: Path) -> None:
    disk = guest.build_disk(Reporter(False))
    with disk.open("rb") as f:
        f.seek(1080)
        assert f.read(2) == b"\x53\xef"
    image = image_from_files(
        "d",
        kernel=fake_bzimage(tmp_path / "bzImage"),
        vmlinux=fake_vmlinux(tmp_path / "vmlinux"),
        rootfs="disk",
        progress=False,
    )
    assert image.disk == disk
    assert image.cmdline == "root=/dev/nvme0n1 rootfstype=ext2 rootwait rw init=/init"
    helper = tmp_path / "helper"
    helper.write_text("#!/bin/sh\necho hi\n")
    helper.chmod(0o755)
    extended = with_files(image, {"/opt/qp/helper": helper})
    assert extended.disk != disk and extended.kernel == image.kernel
    debugfs = shutil.which("debugfs") or "/sbin/debugfs"
    stat = subprocess.run([debugfs, "-R", "stat /opt/qp/helper", str(extended.disk)], capture_output=True, text=True)
    assert "Mode:  0755" in stat.stdout
    assert re.search(rf"Size: {helper.stat().st_size}\b", stat.stdout)
    cat = subprocess.run([debugfs, "-R", "cat /init", str(extended.disk)], capture_output=True, text=True)
    assert "QPROBE-READY" in cat.stdout  # the original tree is still there


def _fake_apt(outputs: dict[tuple[str, ...], str]):
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out = outputs.get(args, "")
        return subprocess.CompletedProcess(list(args), 0 if out else 100, out, "" if out else "E: No packages found")

    return run


def _show(package: str, version: str, size: int = 1000) -> str:
    return f"Package: {package}\nVersion: {version}\nSize: {size}\n\n"


def test_resolve_follows_metapackage(monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = {
        ("apt-cache", "depends", "linux-image-cloud-amd64"): (
            "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-56-cloud-amd64\n"
        ),
        ("apt-cache", "search", "--names-only", "^linux-image-[0-9.]+(-[0-9]+|\\+deb[0-9]+)-cloud-amd64-dbg$"): (
            "linux-image-6.1.0-50-cloud-amd64-dbg - Debug symbols\n"
            "linux-image-6.1.0-56-cloud-amd64-dbg - Debug symbols\n"
        ),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.1.0-56-cloud-amd64-dbg"): _show(
            "linux-image-6.1.0-56-cloud-amd64-dbg", "6.1.192-2", 283
        ),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.1.0-56-cloud-amd64-unsigned"): _show(
            "linux-image-6.1.0-56-cloud-amd64-unsigned", "6.1.192-2", 26
        ),
    }
    monkeypatch.setattr(debian, "_apt", _fake_apt(outputs))
    kernel = debian.resolve("cloud-amd64")
    assert kernel.release == "6.1.0-56-cloud-amd64"
    assert kernel.image_package == "linux-image-6.1.0-56-cloud-amd64-unsigned"
    assert kernel.dbg_package == "linux-image-6.1.0-56-cloud-amd64-dbg"
    assert (kernel.version, kernel.image_size, kernel.dbg_size) == ("6.1.192-2", 26, 283)


def test_resolve_falls_back_to_highest_listed_and_signed(monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = {
        ("apt-cache", "search", "--names-only", "^linux-image-[0-9.]+(-[0-9]+|\\+deb[0-9]+)-rt-amd64-dbg$"): (
            "linux-image-6.1.0-9-rt-amd64-dbg - x\nlinux-image-6.1.0-10-rt-amd64-dbg - x\n"
        ),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.1.0-10-rt-amd64-dbg"): _show("d", "6.1.1-1"),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.1.0-10-rt-amd64"): _show("s", "6.1.1-1"),
    }
    monkeypatch.setattr(debian, "_apt", _fake_apt(outputs))
    kernel = debian.resolve("rt-amd64")
    assert kernel.release == "6.1.0-10-rt-amd64"  # 10 > 9 numerically
    assert kernel.image_package == "linux-image-6.1.0-10-rt-amd64"


def test_resolve_series_takes_its_metapackage_and_debian_naming(monkeypatch: pytest.MonkeyPatch) -> None:
    # bookworm's 6.12 backport: linux-image-6.12-<flavour> and ABIs named "6.12.117+deb12".
    search = "^linux-image-[0-9.]+(-[0-9]+|\\+deb[0-9]+)-cloud-amd64-dbg$"
    outputs = {
        ("apt-cache", "depends", "linux-image-6.12-cloud-amd64"): (
            "linux-image-6.12-cloud-amd64\n  Depends: linux-image-6.12.117+deb12-cloud-amd64\n"
        ),
        ("apt-cache", "depends", "linux-image-cloud-amd64"): (
            "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-56-cloud-amd64\n"
        ),
        ("apt-cache", "search", "--names-only", search): (
            "linux-image-6.1.0-56-cloud-amd64-dbg - x\n"
            "linux-image-6.12.111+deb12-cloud-amd64-dbg - x\n"
            "linux-image-6.12.117+deb12-cloud-amd64-dbg - x\n"
        ),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.12.117+deb12-cloud-amd64-dbg"): _show(
            "d", "6.12.117-1~deb12u1"
        ),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.12.117+deb12-cloud-amd64-unsigned"): _show(
            "u", "6.12.117-1~deb12u1"
        ),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.1.0-56-cloud-amd64-dbg"): _show("d", "6.1.192-2"),
        ("apt-cache", "show", "--no-all-versions", "linux-image-6.1.0-56-cloud-amd64-unsigned"): _show(
            "u", "6.1.192-2"
        ),
    }
    monkeypatch.setattr(debian, "_apt", _fake_apt(outputs))
    assert debian.resolve("cloud-amd64", series="6.12").release == "6.12.117+deb12-cloud-amd64"
    # Series 6.1 has no linux-image-6.1-<flavour>: the plain metapackage, and never a 6.12 ABI.
    assert debian.resolve("cloud-amd64", series="6.1").release == "6.1.0-56-cloud-amd64"
    assert debian._candidate_abis(AptState("amd64"), "cloud-amd64", "6.1") == ["6.1.0-56"]
    assert debian.resolve("cloud-amd64", abi="6.12.117+deb12").image_package.endswith("-unsigned")


def test_cached_kernel_keeps_series_apart(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QPROBE_CACHE", str(tmp_path / "cache"))
    for release in ("6.1.0-56-cloud-amd64", "6.12.117+deb12-cloud-amd64"):
        d = cache.subdir("kernels", release)
        for name in ("vmlinuz", "config", "vmlinux", "System.map"):
            (d / f"{name}-{release}").write_text("x")
        (d / "source.json").write_text('{"version": "v"}')
    assert debian.cached_kernel("cloud-amd64", series="6.1").release == "6.1.0-56-cloud-amd64"
    assert debian.cached_kernel("cloud-amd64", series="6.12").release == "6.12.117+deb12-cloud-amd64"
    assert debian.cached_kernel("cloud-amd64", abi="6.1.0-56").release == "6.1.0-56-cloud-amd64"
    assert debian.kernel_state("rt-amd64", series="6.12") == ("not fetched", None)


def test_resolve_nothing_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(debian, "_apt", _fake_apt({}))
    with pytest.raises(ImageError, match="apt-get update"):
        debian.resolve("cloud-amd64")


def test_atomic_file_leaves_nothing_on_failure(tmp_path: Path) -> None:
    dest = tmp_path / "result.bin"
    with pytest.raises(RuntimeError), cache.atomic_file(dest) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert not dest.exists() and list(tmp_path.iterdir()) == []
    with cache.atomic_file(dest) as tmp:
        tmp.write_bytes(b"whole")
    assert dest.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [dest]


def test_atomic_dir_and_leftovers(tmp_path: Path) -> None:
    dest = tmp_path / "kernel"
    with pytest.raises(KeyboardInterrupt), cache.atomic_dir(dest) as tmp:
        (tmp / "vmlinux").write_bytes(b"partial")
        raise KeyboardInterrupt
    assert not dest.exists()
    (tmp_path / f"{cache.TMP_PREFIX}junk").mkdir()
    cache.remove_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_mode(_isolated_images: Path) -> None:
    root = cache.cache_dir()
    assert root == _isolated_images
    assert root.stat().st_mode & 0o777 == 0o700
    assert cache.subdir("kernels").stat().st_mode & 0o777 == 0o700
    assert cache.hash_inputs([("a", b"1")]) != cache.hash_inputs([("a", b"2")])
    assert cache.hash_inputs([("a", b"1")]) != cache.hash_inputs([("b", b"1")])


def test_progress_bars_follow_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """``qprobe --quiet`` sets logging to errors only: no progress bars then."""
    import logging

    from qprobe.images.progress import wanted

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)
    assert wanted()
    monkeypatch.setattr(root, "level", logging.ERROR)
    assert not wanted()

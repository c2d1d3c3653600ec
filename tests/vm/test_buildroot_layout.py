"""A buildroot output/ directory named by one key (``buildroot = "output"``): its files found where buildroot
leaves them, start-qemu.sh read, and the image booted and traced from the command line.

The layout is scripts/buildroot-layout.py's: the test image's kernel, its vmlinux, .config and System.map in
build/linux-RELEASE/, and qprobe's own ext2 root filesystem (its init, hence init=/init in start-qemu.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from qprobe.images import get_image

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
# The built-in image with a disk; its kernel is the test image's (debian-cloud's, fetched already).
DISK_IMAGE = "debian-cloud-disk"


def _layout(out: Path, *extra: str) -> dict[str, str]:
    """The environment that defines the image ``buildroot`` from a layout in ``out``."""
    script = ROOT / "scripts" / "buildroot-layout.py"
    made = subprocess.run([sys.executable, str(script), *extra, str(out), DISK_IMAGE], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (out / "images.toml").read_text().splitlines()[-1] == 'buildroot = "output"'
    return {**os.environ, "QPROBE_IMAGES": str(out / "images.toml")}


def _qprobe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)  # fmt: skip


def test_a_buildroot_output_is_found_booted_and_traced(tmp_path: Path) -> None:
    env = _layout(tmp_path)
    linux = tmp_path / "output" / "build" / f"linux-{get_image(DISK_IMAGE, fetch=False).kernel_version}"
    funcs = _qprobe(env, "funcs", "--image", "buildroot", "vfs_rea*")
    assert funcs.returncode == 0, funcs.stderr
    names = funcs.stdout.split()
    # The vmlinux of build/linux-*/ (System.map beside it says the same functions are there).
    rows = [line.split() for line in (linux / "System.map").read_text().splitlines()]
    in_map = {name for _addr, kind, name in rows if kind in "Tt" and fnmatch(name, "vfs_rea*")}
    assert "vfs_read" in names and set(names) <= in_map, (names, in_map)
    out = _qprobe(env, "trace", "--image", "buildroot", "--json", "--run", "cat /proc/mounts; workload read 3 100",
                  "p:rd ksys_read fd=%di:s32 count=%dx:u64 comm=$comm:string")  # fmt: skip
    assert out.returncode == 0, out.stderr
    # The root is the ext2 disk start-qemu.sh attaches (NVMe here: this kernel builds in no virtio-blk).
    assert "/dev/root / ext2 " in out.stderr and "mode=read n=3" in out.stderr, out.stderr
    hits = [json.loads(line) for line in out.stdout.splitlines()][:-1]
    reads = [h["args"] for h in hits if h["args"]["comm"] == "workload"]
    assert reads == [{"fd": 3, "count": 100, "comm": "workload"}] * 3, hits


def test_a_vmlinux_without_dwarf_says_what_needs_it_before_boot(tmp_path: Path) -> None:
    """A kernel built without CONFIG_DEBUG_INFO: funcs works from the symbols; perf definitions and --run say,
    in one line and without booting, that they need the debug info."""
    env = _layout(tmp_path, "--strip-debug")
    funcs = _qprobe(env, "funcs", "--image", "buildroot", "vfs_read")
    assert funcs.returncode == 0 and funcs.stdout.split()[:1] == ["vfs_read"], funcs.stderr
    for args in (["perf vfs_read count"], ["--run", "cat /proc/version", "p:h vfs_read"]):
        out = _qprobe(env, "trace", "--image", "buildroot", *args)
        err = out.stderr.splitlines()
        assert out.returncode == 2 and len(err) == 1, out.stderr
        assert "needs the kernel's debug info, and vmlinux has none" in err[0], err
        assert "CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=y" in err[0] and "booting" not in out.stderr

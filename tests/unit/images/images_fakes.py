"""Tiny stand-ins for kernel image files, with just the magic numbers checked."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

from qprobe.images.cpio import CpioWriter

RELEASE = "6.6.0-qptest"


def fake_bzimage(path: Path, release: str = RELEASE) -> Path:
    """A file with the boot protocol header: "HdrS" at 0x202, a version string."""
    data = bytearray(0x600)
    data[0x202:0x206] = b"HdrS"
    text_at = 0x400
    struct.pack_into("<H", data, 0x20E, text_at - 0x200)
    version = f"{release} (test@example) #1 SMP PREEMPT_DYNAMIC".encode()
    data[text_at : text_at + len(version)] = version
    path.write_bytes(bytes(data))
    return path


def fake_arm64_image(path: Path, release: str = "6.1.0-57-cloud-arm64", compress: bool = False) -> Path:
    """An arm64 Image: its header's magic "ARM\\x64" at 0x38, and a linux_banner in its body."""
    data = bytearray(0x1000)
    data[0x38:0x3C] = b"ARM\x64"
    banner = f"Linux version {release} (debian-kernel@lists.debian.org) (gcc 12) #1 SMP Debian\n\0".encode()
    data[0x800 : 0x800 + len(banner)] = banner
    path.write_bytes(gzip.compress(bytes(data), mtime=0) if compress else bytes(data))
    return path


def fake_vmlinux(path: Path, machine: int = 62, elf_class: int = 2) -> Path:
    """An ELF header: 64-bit little-endian, x86-64 unless told otherwise."""
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[4] = elf_class
    header[5] = 1
    header[6] = 1
    struct.pack_into("<HH", header, 16, 2, machine)
    path.write_bytes(bytes(header))
    return path


def fake_initrd(path: Path, compressed: bool = True) -> Path:
    """A real (tiny) initramfs: /init only."""
    writer = CpioWriter()
    writer.add_file("/init", b"#!/bin/sh\n", 0o755)
    data = writer.finish()
    path.write_bytes(gzip.compress(data, mtime=0) if compressed else data)
    return path


def fake_disk(path: Path) -> Path:
    """Just an ext2 superblock magic at byte 1080."""
    data = bytearray(4096)
    struct.pack_into("<H", data, 1080, 0xEF53)
    path.write_bytes(bytes(data))
    return path


def fake_config(path: Path, *lines: str) -> Path:
    """A kernel .config with the given option lines."""
    body = "#\n# Automatically generated file; DO NOT EDIT.\n#\n" + "\n".join(lines) + "\n"
    path.write_text(body)
    return path

"""detect_slide: find the banner and the build-id notes of vmlinux in (fake) guest memory."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from qprobe.errors import SymbolError, VmlinuxMismatch
from qprobe.kernel.kaslr import ALIGN, WINDOW, detect_slide
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.vmlinux import Section
from qprobe.vmm.memory import MemoryFault

TEXT = 0xFFFF_FFFF_8100_0000
RODATA = 0xFFFF_FFFF_8200_0000
NOTES = 0xFFFF_FFFF_81E0_0000
END = 0xFFFF_FFFF_8300_0000  # a 32 MiB image
BANNER = (b"Linux version 6.1.0-13-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14) 12.2.0, "
          b"GNU ld (GNU Binutils for Debian) 2.40) #1 SMP PREEMPT_DYNAMIC Debian 6.1.55-1 (2023-09-29)\n")  # fmt: skip
BUILD_ID = bytes.fromhex("5a6b7c8d9e0f11223344556677889900aabbccdd")


def gnu_note(desc: bytes) -> bytes:
    return struct.pack("<III", 4, len(desc), 3) + b"GNU\0" + desc


NOTE_BYTES = struct.pack("<III", 4, 4, 1) + b"Xen\0" + b"\x01\0\0\0" + gnu_note(BUILD_ID)


def make_symbols(tmp_path: Path, banner: bytes = BANNER, notes: bytes = NOTE_BYTES) -> Symbols:
    """A vmlinux whose .rodata holds linux_banner and whose .notes hold the build-id."""
    rodata = bytearray(0x400)
    rodata[0x100 : 0x100 + len(banner) + 1] = banner + b"\0"
    path = tmp_path / "vmlinux-6.1.0-13-amd64"
    path.write_bytes(bytes(0x1000) + bytes(rodata) + notes)
    rows = [
        ("_text", TEXT, 0, "other"),
        ("_end", END, 0, "other"),
        ("linux_banner", RODATA + 0x100, len(banner) + 1, "object"),
        ("__start_notes", NOTES, 0, "other"),
        ("__stop_notes", NOTES + len(notes), 0, "other"),
    ]
    sections = [
        Section(".text", TEXT, 0xE0_0000, 0x10_0000, True),
        Section(".rodata", RODATA, len(rodata), 0x1000, False),
        Section(".notes", NOTES, len(notes), 0x1000 + len(rodata), False),
    ]
    return Symbols(path, BUILD_ID.hex(), rows, sections)


class FakeGuestMemory:
    """Kernel virtual memory made of a few mapped ranges; everything else faults."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, bytes]] = []
        self.reads = 0

    def map(self, addr: int, data: bytes) -> None:
        self.ranges.append((addr, data))

    def read(self, vaddr: int, size: int, pgd: int | None = None) -> bytes:
        self.reads += 1
        for start, data in self.ranges:
            if start <= vaddr and vaddr + size <= start + len(data):
                return data[vaddr - start : vaddr - start + size]
        raise MemoryFault(vaddr)


def running_kernel(slide: int, banner: bytes = BANNER, notes: bytes = NOTE_BYTES) -> FakeGuestMemory:
    mem = FakeGuestMemory()
    mem.map(RODATA + 0x100 + slide, banner + b"\0" + bytes(200))
    mem.map(NOTES + slide, notes)
    return mem


@pytest.mark.parametrize(
    "slide",
    [0, ALIGN, 0x1E0_0000, 0x2E0_0000, 0x3C00_0000, WINDOW - (END - TEXT) - ALIGN],
    ids=["none", "2M", "30M", "46M", "960M", "largest"],
)
def test_finds_the_slide(tmp_path: Path, slide: int) -> None:
    syms = make_symbols(tmp_path)
    assert detect_slide(syms, running_kernel(slide)) == slide  # type: ignore[arg-type]
    assert syms.slide == slide
    assert syms.address("linux_banner") == RODATA + 0x100 + slide


def test_a_previous_slide_is_not_trusted(tmp_path: Path) -> None:
    syms = make_symbols(tmp_path)
    syms.slide = 0x400_0000
    assert detect_slide(syms, running_kernel(0x200_0000)) == 0x200_0000  # type: ignore[arg-type]


def test_same_banner_other_build_is_skipped(tmp_path: Path) -> None:
    # A rebuild with the same version string: the banner matches at a lower
    # slide, but only the right build's notes prove it is this vmlinux.
    syms = make_symbols(tmp_path)
    mem = running_kernel(0x1000_0000)
    other = NOTE_BYTES[: -len(BUILD_ID)] + bytes(len(BUILD_ID))
    mem.map(RODATA + 0x100 + 0x400_0000, BANNER + b"\0")
    mem.map(NOTES + 0x400_0000, other)
    assert detect_slide(syms, mem) == 0x1000_0000  # type: ignore[arg-type]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "\r" not in text, text
    return text


def test_other_kernel_is_a_mismatch(tmp_path: Path) -> None:
    syms = make_symbols(tmp_path)
    other = BANNER.replace(b"6.1.0-13", b"6.1.0-18")
    console = "[    0.000000] Linux version 6.1.0-18-amd64 (debian-kernel@lists.debian.org) (gcc-12)\r\n[    0.0] x"
    with pytest.raises(VmlinuxMismatch) as info:
        detect_slide(syms, running_kernel(0x200_0000, banner=other), console)  # type: ignore[arg-type]
    text = one_line(info.value)
    assert text.startswith("vmlinux-6.1.0-13-amd64 is not the running kernel")
    assert "Linux version 6.1.0-13-amd64" in text and BUILD_ID.hex()[:12] in text
    assert "(the guest booted 'Linux version 6.1.0-18-amd64" in text
    assert isinstance(info.value, SymbolError)
    assert syms.slide == 0


def test_same_banner_wrong_build_id_is_a_mismatch(tmp_path: Path) -> None:
    syms = make_symbols(tmp_path)
    wrong = NOTE_BYTES[: -len(BUILD_ID)] + bytes(len(BUILD_ID))
    with pytest.raises(VmlinuxMismatch) as info:
        detect_slide(syms, running_kernel(0x200_0000, notes=wrong))  # type: ignore[arg-type]
    assert "guest booted" not in one_line(info.value)


def test_nothing_mapped_is_a_mismatch_not_a_fault(tmp_path: Path) -> None:
    syms = make_symbols(tmp_path)
    mem = FakeGuestMemory()
    with pytest.raises(VmlinuxMismatch):
        detect_slide(syms, mem)  # type: ignore[arg-type]
    # Every 2 MiB step of the 1 GiB window was tried, and nothing beyond it.
    assert mem.reads == len(range(0, WINDOW - (END - TEXT), ALIGN))


def test_slide_outside_the_window_is_not_found(tmp_path: Path) -> None:
    syms = make_symbols(tmp_path)
    with pytest.raises(VmlinuxMismatch):
        detect_slide(syms, running_kernel(WINDOW))  # type: ignore[arg-type]


def test_unaligned_copy_is_not_found(tmp_path: Path) -> None:
    syms = make_symbols(tmp_path)
    with pytest.raises(VmlinuxMismatch):
        detect_slide(syms, running_kernel(0x20_1000))  # type: ignore[arg-type]


def test_banner_is_compared_up_to_its_nul(tmp_path: Path) -> None:
    # Only the first 160 bytes of the file are read; a longer banner still matches on them.
    syms = make_symbols(tmp_path)
    assert len(BANNER) > 160
    assert detect_slide(syms, running_kernel(0x600_0000)) == 0x600_0000  # type: ignore[arg-type]
    short = b"Linux version 6.1.0-test #1\n"
    (tmp_path / "short").mkdir()
    syms2 = make_symbols(tmp_path / "short", banner=short)
    assert detect_slide(syms2, running_kernel(0x800_0000, banner=short)) == 0x800_0000  # type: ignore[arg-type]

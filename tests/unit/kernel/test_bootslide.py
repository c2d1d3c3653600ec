"""The slide of a kernel that has not run yet: its first virtual instruction, the candidates, the one hit."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qprobe.arch.x86_64.bootentry import boot_virtual_entry
from qprobe.errors import ImageError, SymbolError
from qprobe.kernel.bootslide import BootSlide
from qprobe.kernel.kaslr import KERNEL_IMAGE_BASE, WINDOW, candidate_slides, image_alignment
from qprobe.vmm.gdbremote import BREAK_HW

STARTUP = 0xFFFF_FFFF_8100_0000
LABEL = 0xFFFF_FFFF_8100_00D3


def code_at(blocks: dict[int, bytes]) -> tuple[Any, Any]:
    """``read(addr, n)`` over code blocks (zeros elsewhere) and ``address(name)`` for startup_64."""

    def read(addr: int, n: int) -> bytes:
        out = bytearray(n)
        for base, data in blocks.items():
            for i in range(max(addr, base), min(addr + n, base + len(data))):
                out[i - addr] = data[i - base]
        return bytes(out)

    return read, {"startup_64": STARTUP}.__getitem__


def test_6_1_s_jump_through_a_register_loaded_with_the_label() -> None:
    # startup_64: ...; jmp into secondary_startup_64, which does mov $1f, %rax; jmp *%rax; 1:
    second = STARTUP + 0x83
    rel = second - (STARTUP + 0x10 + 5)
    mov = b"\x48\xc7\xc0" + struct.pack("<i", LABEL - (1 << 64))  # sign-extended imm32
    read, address = code_at({STARTUP: b"\x90" * 0x10 + b"\xe9" + struct.pack("<i", rel),
                             second: b"\x48\x89\xc7" + mov + b"\xff\xe0"})  # fmt: skip
    assert boot_virtual_entry(read, address) == LABEL


def test_6_9_s_jump_through_a_pointer() -> None:
    ptr = STARTUP + 0x1000
    read, address = code_at({STARTUP: b"\x90\x90" + b"\xff\x25" + struct.pack("<i", ptr - (STARTUP + 8)),
                             ptr: struct.pack("<Q", LABEL)})  # fmt: skip
    assert boot_virtual_entry(read, address) == LABEL


def test_a_register_overwritten_after_its_constant_is_not_trusted() -> None:
    mov = b"\x48\xc7\xc0" + struct.pack("<i", LABEL - (1 << 64))
    read, address = code_at({STARTUP: mov + b"\x48\x01\xc8" + b"\xff\xe0"})  # add %rcx, %rax between
    with pytest.raises(SymbolError, match="first virtual instruction"):
        boot_virtual_entry(read, address)


def header(magic: bytes = b"HdrS", version: int = 0x20F, align: int = 0x200000) -> bytes:
    head = bytearray(0x300)
    head[0x202:0x206] = magic
    struct.pack_into("<H", head, 0x206, version)
    struct.pack_into("<I", head, 0x230, align)
    return bytes(head)


def test_the_kaslr_alignment_is_the_bzimage_header_s(tmp_path: Path) -> None:
    image = tmp_path / "bzImage"
    image.write_bytes(header(align=0x1000000))
    assert image_alignment(image) == 0x1000000
    for bad in (header(magic=b"ELF\0"), header(version=0x204), header(align=0x300000), b"short"):
        image.write_bytes(bad)
        with pytest.raises(ImageError):
            image_alignment(image)


def test_candidates_keep_the_whole_image_in_the_window() -> None:
    end = 0xFFFF_FFFF_8300_0000  # 32 MiB past the window's first 16 MiB
    symbols = SimpleNamespace(slide=0, address={"_end": end}.__getitem__)
    slides = candidate_slides(symbols, 0x200000)  # type: ignore[arg-type]
    assert slides[0] == 0 and slides.step == 0x200000
    assert end + slides[-1] <= KERNEL_IMAGE_BASE + WINDOW < end + slides[-1] + 0x200000


class FakeMachine:
    pc = "rip"

    def __init__(self) -> None:
        self.stop_handlers: dict[int, Any] = {}
        self.gdb = SimpleNamespace(breakpoints=set(), insert_breakpoint=self._insert, remove_breakpoint=self._remove)

    def _insert(self, addr: int, kind: int) -> None:
        assert kind == BREAK_HW
        self.gdb.breakpoints.add(addr)

    def _remove(self, addr: int, kind: int) -> None:
        self.gdb.breakpoints.remove(addr)


def boot_slide(cmdline: str = "console=ttyS0") -> tuple[BootSlide, FakeMachine]:
    machine = FakeMachine()
    symbols = SimpleNamespace(slide=0, file_bytes=None,
                              address={"_end": 0xFFFF_FFFF_8300_0000, "startup_64": STARTUP}.__getitem__)  # fmt: skip
    arch = SimpleNamespace(arch_boot_entry=lambda read, address: LABEL)
    return BootSlide(machine, symbols, arch, 0x200000, cmdline), machine  # type: ignore[arg-type]


def test_the_hit_gives_the_slide_and_takes_every_candidate_out() -> None:
    slide, machine = boot_slide()
    found: list[tuple[str, int]] = []
    slide.arm(lambda tid, regs, at: found.append((tid, at)))
    assert len(machine.gdb.breakpoints) == len(slide.slides) > 400
    assert machine.gdb.breakpoints == set(machine.stop_handlers)
    at = LABEL + 0x2E00000
    machine.stop_handlers[at]("p1.1", {"rip": at})
    assert found == [("p1.1", 0x2E00000)]
    assert machine.gdb.breakpoints == set() and machine.stop_handlers == {}


def test_nokaslr_needs_one_breakpoint() -> None:
    slide, machine = boot_slide("console=ttyS0 nokaslr panic=-1")
    slide.arm(lambda tid, regs, at: None)
    assert machine.gdb.breakpoints == {LABEL}
    assert len(boot_slide("nokaslrx")[0].slides) > 1  # a word of the command line, not a part of one

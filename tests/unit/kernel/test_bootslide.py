"""The slide of a kernel that has not run yet: its first virtual instruction, the candidates, the one hit."""

from __future__ import annotations

import logging
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qprobe.arch.x86_64.bootentry import boot_virtual_entry
from qprobe.errors import ImageError, MemoryFault, SymbolError, TargetError
from qprobe.kernel.bootslide import BootSlide
from qprobe.kernel.kaslr import (
    KERNEL_IMAGE_BASE,
    WINDOW,
    Decompressed,
    candidate_slides,
    image_alignment,
    output_candidates,
)
from qprobe.vmm.gdbremote import BREAK_HW

STARTUP = 0xFFFF_FFFF_8100_0000
LABEL = 0xFFFF_FFFF_8100_00D3
BANNER = b"Linux version 6.12.0-test (builder) #1 SMP PREEMPT_DYNAMIC"
BANNER_AT = 0xA0_0000  # from _text


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


def test_an_arm64_image_has_no_kaslr_alignment_said_in_one_line(tmp_path: Path) -> None:
    image = tmp_path / "vmlinuz-6.1.0-57-cloud-arm64"
    head = bytearray(0x300)
    head[0x38:0x3C] = b"ARM\x64"  # the Image header's magic (Documentation/arch/arm64/booting.rst)
    image.write_bytes(bytes(head))
    with pytest.raises(ImageError, match=r"^vmlinuz-6.1.0-57-cloud-arm64 is an arm64 Image: it has no KASLR alignment"):
        image_alignment(image)


def test_candidates_keep_the_whole_image_in_the_window() -> None:
    end = 0xFFFF_FFFF_8300_0000  # 32 MiB past the window's first 16 MiB
    symbols = SimpleNamespace(slide=0, address={"_end": end}.__getitem__)
    slides = candidate_slides(symbols, 0x200000)  # type: ignore[arg-type]
    assert slides[0] == 0 and slides.step == 0x200000
    assert end + slides[-1] <= KERNEL_IMAGE_BASE + WINDOW < end + slides[-1] + 0x200000


class FakeMachine:
    """The stop loop's side of a BootSlide: breakpoints, handlers, and requests run at once (the VM "stopped")."""

    pc = "rip"

    def __init__(self) -> None:
        self.stop_handlers: dict[int, Any] = {}
        self.vcpus = ["p1.1", "p1.2"]
        self.pcs = {"p1.1": 0x10_0000, "p1.2": 0xFFF0}  # the decompressor's, a secondary's reset vector
        self.alive = True
        self.gdb = SimpleNamespace(breakpoints=set(), insert_breakpoint=self._insert, remove_breakpoint=self._remove,
                                   read_registers=lambda tid: {"rip": self.pcs[tid]})  # fmt: skip
        self.before_call: Any = None  # what the guest does between the watch's look and the stop

    def call(self, fn: Any) -> Any:
        if self.before_call is not None:
            self.before_call()
        return fn()

    def _insert(self, addr: int, kind: int) -> None:
        assert kind == BREAK_HW
        self.gdb.breakpoints.add(addr)

    def _remove(self, addr: int, kind: int) -> None:
        self.gdb.breakpoints.remove(addr)


def never_fails(exc: BaseException) -> None:
    raise AssertionError(f"on_failed({exc})")


def boot_slide(
    cmdline: str = "console=ttyS0", ram: Any = None, path: Path | None = None
) -> tuple[BootSlide, FakeMachine]:
    machine = FakeMachine()
    symbols = SimpleNamespace(slide=0, file_bytes=lambda addr, n: (BANNER + b"\0" + bytes(n))[:n], path=path,
                              address={"_end": 0xFFFF_FFFF_8300_0000, "startup_64": STARTUP, "_text": STARTUP,
                                       "linux_banner": STARTUP + BANNER_AT}.__getitem__)  # fmt: skip
    arch = SimpleNamespace(boot=SimpleNamespace(arch_boot_entry=lambda read, address: LABEL))
    return BootSlide(machine, symbols, arch, 0x200000, cmdline, ram), machine  # type: ignore[arg-type]


def test_the_hit_gives_the_slide_and_takes_every_candidate_out() -> None:
    slide, machine = boot_slide()
    found: list[tuple[str, int]] = []
    slide.arm(lambda tid, regs, at: found.append((tid, at)), never_fails)
    assert len(machine.gdb.breakpoints) == len(slide.slides) > 400
    assert machine.gdb.breakpoints == set(machine.stop_handlers)
    at = LABEL + 0x2E00000
    machine.stop_handlers[at]("p1.1", {"rip": at})
    assert found == [("p1.1", 0x2E00000)]
    assert machine.gdb.breakpoints == set() and machine.stop_handlers == {}


def test_nokaslr_needs_one_breakpoint() -> None:
    slide, machine = boot_slide("console=ttyS0 nokaslr panic=-1")
    slide.arm(lambda tid, regs, at: None, never_fails)
    assert machine.gdb.breakpoints == {LABEL}
    assert len(boot_slide("nokaslrx")[0].slides) > 1  # a word of the command line, not a part of one


def vmlinux_head(entry: int = 0x100_0B53, shoff: int = 0x4000_0000, shnum: int = 0x2B) -> bytes:
    """An x86_64 vmlinux's first page: its ELF header and program headers (text, data, percpu)."""
    phdrs = [(1, 5, 0x20_0000, 0xFFFF_FFFF_8100_0000, 0x100_0000, 0x1C0_0000, 0x1C0_0000, 0x20_0000),
             (1, 6, 0x1E0_0000, 0xFFFF_FFFF_82C0_0000, 0x2C0_0000, 0x60_0000, 0x60_0000, 0x20_0000),
             (1, 6, 0x260_0000, 0, 0x32D_D000, 0x3_9000, 0x3_9000, 0x20_0000)]  # fmt: skip
    head = bytearray(4096)
    struct.pack_into("<16sHHIQQQIHHHHHH", head, 0, b"\x7fELF\x02\x01\x01" + bytes(9), 2, 0x3E, 1, entry, 0x40,
                     shoff, 0, 0x40, 56, len(phdrs), 0x40, shnum, shnum - 1)  # fmt: skip
    for i, p in enumerate(phdrs):
        struct.pack_into("<IIQQQQQQ", head, 0x40 + 56 * i, *p)
    return bytes(head)


class FakeRam:
    """Shared guest RAM: 64 MiB at 0, so that candidates above it fault."""

    def __init__(self, size: int = 64 << 20) -> None:
        self.data = bytearray(size)
        self.low = self.size = size

    def read_phys(self, paddr: int, size: int) -> bytes:
        if paddr + size > self.size:
            raise MemoryFault(paddr, "outside guest RAM")
        return bytes(self.data[paddr : paddr + size])

    def put(self, paddr: int, data: bytes) -> None:
        self.data[paddr : paddr + len(data)] = data


def test_the_decompressed_header_is_vmlinux_s_but_for_its_section_table() -> None:
    d = Decompressed(vmlinux_head())
    assert d.entry == 0xB53  # e_entry - LOAD_PHYSICAL_ADDR (the text segment's p_paddr), as parse_elf returns
    ram = FakeRam()
    ram.put(0x200_0000, vmlinux_head(shoff=0x123_4560, shnum=5))  # objcopy -S: fewer sections, elsewhere
    assert d.header_at(ram.read_phys, 0x200_0000)
    assert not d.header_at(ram.read_phys, 0x220_0000) and not d.header_at(ram.read_phys, 63 << 20)
    ram.put(0x200_0000, vmlinux_head(entry=0x100_0000))  # another build
    assert not d.header_at(ram.read_phys, 0x200_0000)
    assert Decompressed(vmlinux_head(entry=0x100_0000)).entry == 0  # 6.1: startup_64 at _text


def test_a_vmlinux_without_what_the_watch_needs_is_refused() -> None:
    head = bytearray(vmlinux_head())
    for bad in (b"\x7fELF\x01" + bytes(100), bytes(head[:0x50]), vmlinux_head(entry=0x80_0000)):
        with pytest.raises(ImageError):
            Decompressed(bad)
    struct.pack_into("<I", head, 0x40, 4)  # no PT_LOAD left
    struct.pack_into("<I", head, 0x40 + 56, 4)
    struct.pack_into("<I", head, 0x40 + 112, 4)
    with pytest.raises(ImageError, match="PT_LOAD"):
        Decompressed(bytes(head))


def test_output_candidates_cover_ram_below_and_above_the_hole() -> None:
    assert output_candidates(8 << 20, 8 << 20, 0x200000) == [0, 0x20_0000, 0x40_0000, 0x60_0000]
    assert output_candidates(4 << 20, 8 << 20, 0x200000, high_base=1 << 32) == [
        0,
        0x20_0000,
        1 << 32,
        (1 << 32) + 0x20_0000,
    ]


def watched(tmp_path: Path) -> tuple[BootSlide, FakeMachine, FakeRam, list[Any]]:
    vmlinux = tmp_path / "vmlinux"
    vmlinux.write_bytes(vmlinux_head())
    ram = FakeRam()
    slide, machine = boot_slide(ram=ram, path=vmlinux)
    found: list[Any] = []
    slide.arm(lambda tid, regs, at: found.append((tid, at)), lambda exc: found.append(exc))
    return slide, machine, ram, found


def wait_for(what: Any) -> None:
    deadline = time.monotonic() + 5
    while not what():
        assert time.monotonic() < deadline, "the watch did not see it"
        time.sleep(0.005)


def test_the_watch_puts_one_breakpoint_on_the_physical_entry_then_the_candidates(tmp_path: Path) -> None:
    slide, machine, ram, found = watched(tmp_path)
    assert machine.gdb.breakpoints == set()  # the decompressor runs with none
    time.sleep(0.01)
    output = 0x180_0000
    ram.put(output, vmlinux_head(shoff=0x100))
    wait_for(lambda: machine.gdb.breakpoints)
    assert machine.gdb.breakpoints == {output + 0xB53} and slide.output == output and slide.method == "entry"
    machine.stop_handlers[output + 0xB53]("p1.1", {"rip": output + 0xB53})
    assert len(machine.gdb.breakpoints) == len(slide.slides) > 400
    at = LABEL + 0x2E00000
    machine.stop_handlers[at]("p1.1", {"rip": at})
    assert found == [("p1.1", 0x2E00000)] and machine.gdb.breakpoints == set()


def test_a_kernel_seen_only_in_place_gets_every_candidate_at_once(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, "qprobe")
    slide, machine, ram, found = watched(tmp_path)
    ram.put(0x180_0000 + BANNER_AT, BANNER)  # the header missed: the text already over it
    wait_for(lambda: len(machine.gdb.breakpoints) == len(slide.slides))
    assert slide.method == "late"
    assert "FALLBACK" in caplog.text and found == []


def test_a_header_moved_over_by_the_stop_is_late(tmp_path: Path) -> None:
    slide, machine, ram, found = watched(tmp_path)
    machine.before_call = lambda: ram.put(0x180_0000, bytes(64))  # parse_elf moves the text over it meanwhile
    ram.put(0x180_0000, vmlinux_head())
    # The watch inserts the candidates' breakpoints one by one: wait for the last, not the first.
    wait_for(lambda: len(machine.gdb.breakpoints) == len(slide.slides))
    assert slide.method == "late" and found == []


def test_a_kernel_already_at_its_virtual_addresses_fails_the_boot(tmp_path: Path) -> None:
    _slide, machine, ram, found = watched(tmp_path)
    machine.pcs["p1.1"] = 0xFFFF_FFFF_9000_0000
    ram.put(0x180_0000 + BANNER_AT, BANNER)
    wait_for(lambda: found)
    assert isinstance(found[0], TargetError) and "missed" in str(found[0])
    assert machine.gdb.breakpoints == set()


def test_a_vmlinux_the_watch_cannot_read_gets_every_candidate_at_once(tmp_path: Path) -> None:
    vmlinux = tmp_path / "vmlinux"
    vmlinux.write_bytes(b"not an ELF file")
    slide, machine = boot_slide(ram=FakeRam(), path=vmlinux)
    slide.arm(lambda tid, regs, at: None, never_fails)
    assert len(machine.gdb.breakpoints) == len(slide.slides) and slide.method == "candidates"


def test_a_boot_that_times_out_says_what_it_waited_for(tmp_path: Path) -> None:
    slide, machine, ram, _found = watched(tmp_path)
    assert "decompressed vmlinux at any of 32 physical addresses" in slide.waiting_for()
    ram.put(0x180_0000, vmlinux_head())
    wait_for(lambda: machine.gdb.breakpoints)
    assert slide.waiting_for() == "the kernel's physical entry at 0x1800000"
    machine.stop_handlers[0x180_0B53]("p1.1", {"rip": 0x180_0B53})
    assert "candidate slides' first virtual instruction" in slide.waiting_for()

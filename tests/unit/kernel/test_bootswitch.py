"""SwitchSlide: vCPU 0 stepped into the image, stopped on the branch to virtual addresses, the slide from there."""

from __future__ import annotations

from typing import Any

import pytest

from qprobe.errors import TargetError
from qprobe.kernel.bootswitch import MAX_LOADER_STEPS, SwitchSlide

TEXT = 0xFFFF_8000_8000_0000  # _text's link address
SWITCH = TEXT + 0x187_75D0  # the branch's
ENTRY = TEXT + 0x188_0000  # __primary_switched's
LOADED = 0x4020_0000  # where the loader put the image
STUB = 0x4000_0000
SLIDE = 0x3A_1234_0000
HEAD = bytes(range(64))


class Gdb:
    """vCPU 0 runs a loader stub of ``stub_len`` instructions, then the image; one step from the switch
    takes the branch."""

    def __init__(self, stub_len: int) -> None:
        self.pc = STUB
        self.stub_len = stub_len
        self.breakpoints: set[int] = set()
        self.steps = 0

    def read_registers(self, tid: str) -> dict[str, int]:
        return {"pc": self.pc}

    def step(self, tid: str) -> None:
        self.steps += 1
        if self.pc == LOADED + SWITCH - TEXT:
            self.pc = ENTRY + SLIDE
        elif self.pc < STUB + 4 * (self.stub_len - 1):
            self.pc += 4
        else:
            self.pc = LOADED

    def insert_breakpoint(self, addr: int, kind: int) -> None:
        self.breakpoints.add(addr)

    def remove_breakpoint(self, addr: int, kind: int) -> None:
        self.breakpoints.discard(addr)


class Machine:
    def __init__(self, gdb: Gdb) -> None:
        self.gdb, self.pc, self.vcpus = gdb, "pc", ["1"]
        self.stop_handlers: dict[int, Any] = {}


class Symbols:
    slide = 0

    def address(self, name: str) -> int:
        return {"_text": TEXT}[name]

    def file_bytes(self, addr: int, size: int) -> bytes:
        assert addr == TEXT
        return HEAD[:size]


class Boot:
    def arch_boot_entry(self, read: object, address: object) -> int:
        return ENTRY


class Arch:
    boot = Boot()


def read_phys(addr: int, size: int) -> bytes:
    return HEAD[:size] if addr == LOADED else b"\xff" * size


def slide_of(stub_len: int) -> tuple[SwitchSlide, Gdb, list[Any], list[BaseException]]:
    gdb = Gdb(stub_len)
    machine = Machine(gdb)
    search = SwitchSlide(machine, Symbols(), Arch(), SWITCH, read_phys)  # type: ignore[arg-type]
    found: list[Any] = []
    failed: list[BaseException] = []
    search.arm(lambda tid, regs, slide: found.append((tid, regs, slide)), failed.append)
    return search, gdb, found, failed


def test_the_slide_is_the_branch_target_less_the_entry() -> None:
    search, gdb, found, failed = slide_of(6)
    assert not failed and search.loaded_at == LOADED
    at = LOADED + SWITCH - TEXT
    assert gdb.breakpoints == {at} and gdb.steps == 6
    assert "physical" in search.waiting_for()
    gdb.pc = at  # the VM ran to the breakpoint
    search.machine.stop_handlers[at]("1", {"pc": at})
    assert found == [("1", {"pc": ENTRY + SLIDE}, SLIDE)]
    assert gdb.breakpoints == set() and search.machine.stop_handlers == {}


def test_a_loader_that_does_not_enter_the_image_soon_is_refused_in_one_line() -> None:
    _search, gdb, found, failed = slide_of(MAX_LOADER_STEPS + 10)
    assert not found and gdb.breakpoints == set()
    assert len(failed) == 1 and isinstance(failed[0], TargetError)
    assert "did not enter the kernel image within" in str(failed[0]) and "\n" not in str(failed[0])


def test_a_branch_that_stays_in_the_lower_half_fails_the_boot() -> None:
    search, gdb, found, failed = slide_of(3)
    at = LOADED + SWITCH - TEXT
    gdb.pc = at

    def step(tid: str) -> None:
        gdb.pc = LOADED + 0x1000

    gdb.step = step  # type: ignore[method-assign]
    search.machine.stop_handlers[at]("1", {"pc": at})
    assert not found and len(failed) == 1
    with pytest.raises(TargetError, match="went to 0x40201000"):
        raise failed[0]

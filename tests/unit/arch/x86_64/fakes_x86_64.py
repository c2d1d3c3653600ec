"""Fake vCPU registers and guest memory for the x86_64 emulation tests."""

from __future__ import annotations

from dataclasses import dataclass

from qprobe.arch.x86_64.paging import kernel_pgd

REG_NAMES = ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", *(f"r{n}" for n in range(8, 16)), "ip", "flags")


@dataclass
class FakeRegs:
    ax: int = 0
    bx: int = 0
    cx: int = 0
    dx: int = 0
    si: int = 0
    di: int = 0
    bp: int = 0
    sp: int = 0
    r8: int = 0
    r9: int = 0
    r10: int = 0
    r11: int = 0
    r12: int = 0
    r13: int = 0
    r14: int = 0
    r15: int = 0
    ip: int = 0
    flags: int = 0x2
    cs: int = 0x33  # a 64-bit user task's (the kernel's emulation does not read it)


class FakeMem:
    """Sparse byte-addressed memory; reading an unwritten byte is an error."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def pgd_of(self, cr3: int) -> int:
        return kernel_pgd(cr3)

    def write(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.bytes[addr + i] = b

    def read(self, addr: int, size: int) -> bytes:
        return bytes(self.bytes[addr + i] for i in range(size))

    def u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    def put_u64(self, addr: int, val: int) -> None:
        self.write(addr, val.to_bytes(8, "little"))

"""Fakes the core's unit tests share: guest memory as one flat address space, and pt_regs over it."""

from __future__ import annotations

from collections.abc import Mapping

from qprobe.arch.x86_64.arch import X86_64
from qprobe.core.regs import PtRegs
from qprobe.vmm.memory import MemoryFault

ARCH = X86_64()


class FlatMem:
    """Guest memory as one flat address space (virtual = physical), zero where nothing was written."""

    pgd = 0

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        self.unmapped: set[int] = set()  # page addresses whose reads fault (guard pages)

    def pgd_of(self, cr3: int) -> int:
        return self.pgd

    def fill(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.bytes[addr + i] = b

    def read(self, addr: int, size: int, pgd: int | None = None) -> bytes:
        for page in range(addr & ~0xFFF, addr + size, 0x1000):
            if page in self.unmapped:
                raise MemoryFault(max(page, addr))
        return bytes(self.bytes.get(addr + i, 0) for i in range(size))

    def read_u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    def virt_to_phys(self, addr: int, pgd: int | None = None) -> int:
        return addr


def flat_regs(values: Mapping[str, int], tid: str, mem: FlatMem) -> PtRegs:
    """A hit's pt_regs as RegsMaker.make_regs builds them, reading ``mem``."""
    return PtRegs(dict(values), tid, 0, mem, layout=ARCH.registers)  # type: ignore[arg-type]

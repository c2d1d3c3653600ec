"""A hit's task's memory as the architecture's emulators and fix-ups use it (qprobe.arch.Memory)."""

from __future__ import annotations

from qprobe.core.regs import PtRegs
from qprobe.vmm.machine import Machine


class TaskMemory:
    """Memory for the emulator: reads through the task's tables, writes through the stub."""

    def __init__(self, machine: Machine, pt: PtRegs) -> None:
        self.machine = machine
        self.pt = pt

    def read(self, addr: int, size: int) -> bytes:
        return self.pt.read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        phys = self.machine.mem.virt_to_phys(addr, self.pt._pgd)
        if (phys & 0xFFF) + len(data) > 0x1000:
            head = 0x1000 - (phys & 0xFFF)
            self.write(addr, data[:head])
            self.write(addr + head, data[head:])
            return
        self.machine.write_phys(phys, data)


__all__ = ["TaskMemory"]

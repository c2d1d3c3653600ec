"""A hit's task's memory as the architecture's emulators and fix-ups use it (qprobe.arch.Memory, UserMemory)."""

from __future__ import annotations

from collections.abc import Callable

from qprobe.core.regs import PtRegs
from qprobe.errors import MemoryFault
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


class UserMemory:
    """A stopped task's user memory as its own accesses see it: each page is checked as the CPU would check it
    in user mode, and an access the task would fault on (or one that needs a bit set in its page-table entry)
    raises MemoryFault, so the instruction is stepped and the kernel handles the fault as it would.

    The VM is stopped: a write through the physical page is the task's store (text pages are never written:
    only a writable, dirty page is)."""

    def __init__(self, machine: Machine, root: int, allows: Callable[[int, str], bool]) -> None:
        """``root``: the task's page-table root (physical); ``allows(entry, access)``: the architecture's check
        of a leaf entry (qprobe.arch.Uprobes.user_page_allows)."""
        self.machine = machine
        self.root = root
        self.allows = allows
        self.limit = machine.mem.user_end()

    def _pieces(self, addr: int, size: int, access: str) -> list[tuple[int, int]]:
        """(physical address, length) of each page's part of the access, every page checked first."""
        if addr + size > self.limit:
            raise MemoryFault(addr)
        mem = self.machine.mem
        out: list[tuple[int, int]] = []
        done = 0
        while done < size:
            va = addr + done
            phys, page, entry = mem.leaf(va, self.root)
            if not self.allows(entry, access):
                raise MemoryFault(va)
            n = min(size - done, page - va % page)
            out.append((phys, n))
            done += n
        return out

    def read(self, addr: int, size: int) -> bytes:
        return b"".join(self.machine.mem.read_phys(pa, n) for pa, n in self._pieces(addr, size, "read"))

    def fetch(self, addr: int, size: int) -> bytes:
        return b"".join(self.machine.mem.read_phys(pa, n) for pa, n in self._pieces(addr, size, "fetch"))

    def write(self, addr: int, data: bytes) -> None:
        done = 0
        for pa, n in self._pieces(addr, len(data), "write"):
            self.machine.write_phys(pa, data[done : done + n])
            done += n


__all__ = ["TaskMemory", "UserMemory"]

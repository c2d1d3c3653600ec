"""The scratch area: guest RAM the kernel was told not to use, mapped as kernel text.

QEMU boots the kernel with ``memmap=2M$PHYS`` so the kernel (and KASLR)
never touches that RAM.  qprobe maps it with one 2 MiB PMD entry into the
page table that maps the kernel image (PML4[511] -> PUD[510], shared by every
process's page tables), in a slot the image does not use, so that code there
is within +/-2 GiB of kernel text (rel32 jumps and RIP-relative operands
reach it) and every vCPU can execute it.  The entry is journaled like any
other patch and removed on exit.
"""

from __future__ import annotations

import re

from qprobe.errors import ScratchFull, TargetError
from qprobe.target.journal import Patch
from qprobe.target.machine import Machine
from qprobe.target.memory import MemoryFault, walk

SIZE = 2 << 20
KERNEL_IMAGE_BASE = 0xFFFF_FFFF_8000_0000
_PMD_FLAGS = 0x1E3  # present, writable, accessed, dirty, 2 MiB page, global; NX clear
_ADDR = 0x000F_FFFF_FFFF_F000


def memmap_reservation(cmdline: str) -> int | None:
    """The physical base of a ``memmap=2M$ADDR`` reservation on the kernel command line."""
    m = re.search(r"memmap=(?:2M|2048K|0x200000)\$(0x[0-9a-fA-F]+|\d+)([KMG]?)", cmdline)
    if not m:
        return None
    # The kernel's memparse() suffixes.
    return int(m.group(1), 0) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


class ScratchArea:
    """Maps the reserved RAM and hands out slots in it (first fit, 16-byte granules)."""

    GRANULE = 16

    def __init__(self, machine: Machine, phys: int, image_end: int | None = None) -> None:
        if phys & (SIZE - 1):
            raise TargetError(f"scratch area {phys:#x} is not 2 MiB aligned")
        self.machine = machine
        self.phys = phys
        # Without KASLR the module area starts 512 MiB into this PUD: take the first
        # free slot just above the kernel image rather than the last one.
        self.image_end = image_end
        self.base = 0
        self._pmd: Patch | None = None
        self._free: list[tuple[int, int]] = []  # (offset, size), sorted
        self._used: dict[int, int] = {}

    def map(self) -> int:
        """Install the PMD entry (stop-loop thread); returns the virtual base."""
        mem = self.machine.mem
        path = walk(mem.read_u64_phys, mem.pgd, KERNEL_IMAGE_BASE, mem.levels)
        pud_level = mem.levels - 3  # PML5? PML4, PUD, PMD, PTE
        if len(path) <= pud_level + 1 or path[pud_level][1] & 0x80:
            raise TargetError("the kernel image is not mapped through a PMD table")
        pmd_table = path[pud_level][1] & _ADDR
        order = range(511, -1, -1)
        if self.image_end is not None:
            order = range(((self.image_end - KERNEL_IMAGE_BASE) >> 21) + 1, 512)
        for index in order:
            entry = int.from_bytes(mem.phys.read_phys(pmd_table + index * 8, 8), "little")
            if entry == 0:
                break
        else:
            raise TargetError("no free 2 MiB slot in the kernel image's page table for the scratch area")
        self.base = KERNEL_IMAGE_BASE + index * SIZE
        new = (self.phys | _PMD_FLAGS).to_bytes(8, "little")
        p = Patch(pmd_table + index * 8, self.base, bytes(8), new, "pmd")
        self.machine.journal.record(p)
        self.machine.write_phys(p.phys, new)
        self._pmd = p
        self._free = [(0, SIZE)]
        try:
            self.machine.mem.virt_to_phys(self.base)
        except MemoryFault:
            raise TargetError("the scratch area mapping did not take effect") from None
        return self.base

    def unmap(self) -> None:
        if self._pmd is not None:
            self.machine.unpatch(self._pmd)
            self._pmd = None

    @property
    def mapped(self) -> bool:
        return self._pmd is not None

    @property
    def used(self) -> int:
        """Bytes handed out and not freed."""
        return sum(self._used.values())

    def contains(self, addr: int) -> bool:
        return self.mapped and self.base <= addr < self.base + SIZE

    def alloc(self, size: int, align: int = GRANULE) -> int:
        if size <= 0:
            raise ValueError(f"internal: scratch allocation of {size} bytes")
        size = -(-size // self.GRANULE) * self.GRANULE
        for i, (off, n) in enumerate(self._free):
            start = -(-off // align) * align
            if start + size <= off + n:
                pieces = [(o, m) for o, m in ((off, start - off), (start + size, off + n - start - size)) if m]
                self._free[i : i + 1] = pieces
                self._used[start] = size
                return self.base + start
        raise ScratchFull(f"the {SIZE >> 20} MiB scratch area is full ({len(self._used)} slots in use)")

    def free(self, addr: int) -> None:
        off = addr - self.base
        size = self._used.pop(off)
        self._free.append((off, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    def phys_of(self, addr: int) -> int:
        """The guest-physical address of ``addr`` in the area (one 2 MiB mapping: a fixed offset)."""
        return self.phys + addr - self.base

    def write(self, addr: int, data: bytes) -> None:
        """Write code into the area through the stub (so stale translations are dropped)."""
        if not (self.contains(addr) and addr + len(data) <= self.base + SIZE):
            raise TargetError(f"internal: {addr:#x} is outside the scratch area")
        self.machine.write_phys(self.phys_of(addr), data)

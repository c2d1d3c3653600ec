"""Guest memory: physical readers and our own x86_64 page-table walk.

Reads go through the shared RAM file when we have it (no VM stop, no stub
round trip) and through the stub's physical mode otherwise.  Code bytes are
always *written* through the stub: a write there invalidates QEMU's
translated code for the page, a write into the file would not.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from qprobe.errors import TargetError

PAGE = 4096
_P, _PS = 0x1, 0x80
_ADDR = 0x000F_FFFF_FFFF_F000
_SHIFTS = (48, 39, 30, 21, 12)
LOW_RAM_LIMIT = 3 << 30  # the pc machine puts RAM above this at 4 GiB


class MemoryFault(TargetError):
    """A guest virtual address is not mapped."""

    def __init__(self, addr: int, why: str = "not mapped") -> None:
        self.addr = addr
        super().__init__(f"guest address {addr:#x} is {why}")


class PhysReader(Protocol):
    def read_phys(self, paddr: int, size: int) -> bytes: ...


class SharedRam:
    """Guest RAM mapped from QEMU's ``memory-backend-file`` (read-only here)."""

    def __init__(self, path: Path, size: int, writable: bool = False) -> None:
        # Writable only for data the guest polls (the optimized probes' mailboxes):
        # code must be written through the stub so translated blocks are dropped.
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.writable = writable
        self.size = size
        # QEMU's pc machine moves RAM above 3 GiB to 4 GiB only from 3.5 GiB of RAM (pc_piix.c).
        self.low = LOW_RAM_LIMIT if size >= 0xE000_0000 else size

    def _offset(self, paddr: int, size: int) -> int:
        if paddr + size <= self.low:
            return paddr
        if paddr >= 1 << 32 and paddr - (1 << 32) + self.low + size <= self.size:
            return paddr - (1 << 32) + self.low
        raise MemoryFault(paddr, "outside guest RAM")

    def read_phys(self, paddr: int, size: int) -> bytes:
        off = self._offset(paddr, size)
        return self._map[off : off + size]

    def read_u64_phys(self, paddr: int) -> int:
        off = self._offset(paddr, 8)
        return int.from_bytes(self._map[off : off + 8], "little")

    def write_phys(self, paddr: int, data: bytes) -> None:
        off = self._offset(paddr, len(data))
        self._map[off : off + len(data)] = data

    def write_u64_phys(self, paddr: int, value: int) -> None:
        """One aligned 8-byte store, for a word a vCPU polls.

        A slice assignment is a memcpy of run-time size, and glibc copies 8
        bytes as two overlapping stores: a vCPU polling the word can see the
        first, move on, write the word itself, and then see the second, stale
        one land.  struct's native "Q" stores with a fixed-size memcpy, one
        instruction, straight into the mapping.
        """
        if paddr & 7:
            raise ValueError(f"unaligned polled word at {paddr:#x}")
        struct.pack_into("Q", self._map, self._offset(paddr, 8), value)

    def close(self) -> None:
        self._map.close()


def paging_levels(cr4: int) -> int:
    """4, or 5 when CR4.LA57 is set (QEMU's ``-cpu max`` offers LA57 and Debian enables it)."""
    return 5 if cr4 & (1 << 12) else 4


def kernel_pgd(cr3: int, pti: bool = True) -> int:
    """The kernel half's PGD from any CR3: PCID bits cleared and, on a kernel with PTI, the user-PGD bit.

    With page-table isolation compiled in, every PGD is an 8 KiB pair whose second page is the
    user copy (bit 12 of CR3 set while in user mode); without it a PGD is any single page and
    bit 12 is part of its address.
    """
    return cr3 & _ADDR & ~(0x1000 if pti else 0)


def walk(read_u64: Callable[[int], int], pgd: int, vaddr: int, levels: int = 4) -> list[tuple[int, int]]:
    """The page-table path of ``vaddr``: (table physical address, entry) per level, top first.

    Stops at the leaf or at the first non-present entry (which is included).
    """
    path = []
    table = pgd
    for shift in _SHIFTS[5 - levels :]:
        entry = read_u64(table + ((vaddr >> shift) & 0x1FF) * 8)
        path.append((table, entry))
        if not entry & _P or shift == 12 or (shift in (30, 21) and entry & _PS):
            break
        table = entry & _ADDR
    return path


def translate(read_u64: Callable[[int], int], pgd: int, vaddr: int, levels: int = 4) -> tuple[int, int, int]:
    """Walk 4- or 5-level page tables: (physical address, page size, leaf entry)."""
    path = walk(read_u64, pgd, vaddr, levels)
    entry = path[-1][1]
    if not entry & _P:
        raise MemoryFault(vaddr)
    size = 1 << _SHIFTS[5 - levels + len(path) - 1]
    base = entry & _ADDR & ~(size - 1)
    return base | (vaddr & (size - 1)), size, entry


class GuestMemory:
    """Kernel virtual memory through a page-table walk over a physical reader."""

    def __init__(self, phys: PhysReader, pgd: int, levels: int = 4) -> None:
        self.phys = phys
        self.pgd = pgd
        self.levels = levels  # 5 when the guest runs with LA57
        self.pti = True  # PGDs are PTI's 8 KiB pairs (kernel_pgd); set once the kernel is known
        self.read_u64_phys: Callable[[int], int] = getattr(phys, "read_u64_phys", None) or (
            lambda pa: int.from_bytes(phys.read_phys(pa, 8), "little")
        )

    def pgd_of(self, cr3: int) -> int:
        """The kernel half's PGD of a vCPU whose CR3 is ``cr3``."""
        return kernel_pgd(cr3, self.pti)

    def virt_to_phys(self, vaddr: int, pgd: int | None = None) -> int:
        return translate(self.read_u64_phys, self.pgd if pgd is None else pgd, vaddr, self.levels)[0]

    def read(self, vaddr: int, size: int, pgd: int | None = None) -> bytes:
        out = bytearray()
        while len(out) < size:
            va = vaddr + len(out)
            pa, page, _ = translate(self.read_u64_phys, self.pgd if pgd is None else pgd, va, self.levels)
            n = min(size - len(out), page - (va & (page - 1)))
            out += self.phys.read_phys(pa, n)
        return bytes(out)

    def read_u64(self, vaddr: int) -> int:
        return struct.unpack("<Q", self.read(vaddr, 8))[0]

    def read_cstring(self, vaddr: int, limit: int = 4096) -> bytes:
        out = bytearray()
        while len(out) < limit:
            n = min(limit - len(out), PAGE - ((vaddr + len(out)) & (PAGE - 1)))
            chunk = self.read(vaddr + len(out), n)
            nul = chunk.find(b"\0")
            if nul >= 0:
                return bytes(out + chunk[:nul])
            out += chunk
        return bytes(out)

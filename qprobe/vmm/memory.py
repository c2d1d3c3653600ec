"""Guest memory: physical readers and our own walk of the guest's page tables (the architecture's).

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

from qprobe.arch import PageTables
from qprobe.errors import MemoryFault

PAGE = 4096
LOW_RAM_LIMIT = 3 << 30  # the pc machine puts RAM above this at 4 GiB


class PhysReader(Protocol):
    def read_phys(self, paddr: int, size: int) -> bytes: ...


class SharedRam:
    """Guest RAM mapped from QEMU's ``memory-backend-file`` (read-only here)."""

    def __init__(self, path: Path, size: int, writable: bool = False, base: int = 0) -> None:
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
        # The physical address of the file's first byte: the board's RAM base (qprobe.vmm.boards; 1 GiB on
        # arm64's virt).  QEMU's pc machine, whose RAM starts at 0, moves RAM above 3 GiB to 4 GiB only from
        # 3.5 GiB of RAM (pc_piix.c).
        self.base = base
        self.low = LOW_RAM_LIMIT if size >= 0xE000_0000 and not base else size

    def _offset(self, paddr: int, size: int) -> int:
        off = paddr - self.base
        if off >= 0 and off + size <= self.low:
            return off
        if off >= 1 << 32 and off - (1 << 32) + self.low + size <= self.size:
            return off - (1 << 32) + self.low
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


class GuestMemory:
    """Kernel virtual memory through a page-table walk over a physical reader.

    ``pgd`` is the root of the kernel's page tables (physical), ``paging`` the
    architecture's walk of them.  A reader given a task's root (``pgd_of`` of
    its ``RegisterLayout.task_page_table``) walks each address from the root
    ``paging.root_for`` picks: on arm64 the task's for its user half (TTBR0)
    and ``pgd`` for the kernel's (TTBR1), on x86 the task's for both.
    """

    def __init__(self, phys: PhysReader, pgd: int, paging: PageTables) -> None:
        self.phys = phys
        self.pgd = pgd
        self.paging = paging
        self.read_u64_phys: Callable[[int], int] = getattr(phys, "read_u64_phys", None) or (
            lambda pa: int.from_bytes(phys.read_phys(pa, 8), "little")
        )

    @property
    def levels(self) -> int:
        """The depth of the guest's page tables (drgn's VMCOREINFO says whether it is 5)."""
        return self.paging.levels

    def pgd_of(self, root: int) -> int:
        """The physical table a page-table register holding ``root`` points at (x86's kernel PGD of any CR3)."""
        return self.paging.root(root)

    def virt_to_phys(self, vaddr: int, pgd: int | None = None) -> int:
        return self.paging.translate(self.read_u64_phys, self.paging.root_for(vaddr, self.pgd, pgd), vaddr)[0]

    def leaf(self, vaddr: int, pgd: int) -> tuple[int, int, int]:
        """(physical address, page size, leaf page-table entry) of ``vaddr`` through ``pgd``'s tables."""
        return self.paging.translate(self.read_u64_phys, self.paging.root_for(vaddr, self.pgd, pgd), vaddr)

    def read_phys(self, paddr: int, size: int) -> bytes:
        return self.phys.read_phys(paddr, size)

    def user_end(self) -> int:
        """Where user addresses end (TASK_SIZE_MAX)."""
        return self.paging.task_size_max()

    def read(self, vaddr: int, size: int, pgd: int | None = None) -> bytes:
        out = bytearray()
        while len(out) < size:
            va = vaddr + len(out)
            pa, page, _ = self.paging.translate(self.read_u64_phys, self.paging.root_for(va, self.pgd, pgd), va)
            n = min(size - len(out), page - (va & (page - 1)))
            out += self.phys.read_phys(pa, n)
        return bytes(out)

    def read_u64(self, vaddr: int) -> int:
        return int.from_bytes(self.read(vaddr, 8), "little")

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

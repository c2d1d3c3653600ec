"""The scratch area: guest RAM the kernel was told not to use, mapped as kernel text.

QEMU boots the kernel with the RAM kept from it (``memmap=SIZE$PHYS`` on x86,
``mem=`` below it on arm64: ``qprobe.vmm.boards``) so the kernel (and KASLR)
never touches it.  qprobe maps it with large-page entries (2 MiB: an
x86 PMD entry) into the page table that maps the kernel image (the
architecture's ``PageTables.large_page_table``; on x86_64 shared by every
process's page tables), in slots the image does not use, so that code there
is within branch reach of kernel text and every vCPU can execute it.  The
entries are journaled like any other patch and removed on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from qprobe.errors import MemoryFault, ScratchFull, TargetError
from qprobe.vmm.journal import Patch
from qprobe.vmm.machine import Machine

SIZE = 2 << 20


class ScratchArea:
    """Maps the reserved RAM and hands out slots in it (first fit, 16-byte granules).

    The first 2 MiB are mapped by ``map``; when they are full, ``alloc`` maps
    the next 2 MiB of the reservation into the next PMD slot (slots for the
    whole reservation are chosen together, so the area stays one contiguous
    range, virtually and physically).
    """

    GRANULE = 16

    def __init__(self, machine: Machine, phys: int, image_end: int | None = None, size: int = SIZE,
                 image_start: int | None = None) -> None:  # fmt: skip
        if phys & (SIZE - 1) or size <= 0 or size % SIZE:
            raise TargetError(f"scratch area {phys:#x}+{size:#x} is not 2 MiB aligned in whole 2 MiB pages")
        self.machine = machine
        self.phys = phys
        self.size = size  # reserved; mapped as needed, 2 MiB at a time
        # Where the image lies picks the slots: the kernel maps some of its table's free slots
        # later (modules, vmalloc), the architecture's ``PageTables.scratch_slots`` says which last.
        self.image_end = image_end
        self.image_start = image_start
        self.base = 0
        self._pmd_table = 0
        self._slots: list[int] = []  # PMD indexes chosen for the area, in address order
        self._pmds: list[Patch] = []  # the ones installed
        self._free: list[tuple[int, int]] = []  # (offset, size), sorted
        self._used: dict[int, int] = {}
        # Inside ``combined``: writes held back, each run of adjacent ones sent as one (address, bytes).
        self._runs: list[tuple[int, bytearray]] | None = None

    def map(self) -> int:
        """Install the PMD entry (stop-loop thread); returns the virtual base."""
        mem = self.machine.mem
        paging = mem.paging
        if paging.large_page != SIZE:
            raise TargetError(
                f"the scratch area is mapped in 2 MiB pages; this guest's large page is {paging.large_page}"
            )
        pmd_table = paging.large_page_table(mem.read_u64_phys, mem.pgd)
        base = paging.image_base
        order: Sequence[int] = range(511, -1, -1)
        if self.image_end is not None:
            first = (self.image_start - base) // SIZE if self.image_start is not None else 0
            order = paging.scratch_slots(range(first, (self.image_end - base) // SIZE + 1))
        want = self.size // SIZE

        def free_run(index: int) -> int:
            n = 0
            while n < want and index + n < 512:
                if int.from_bytes(mem.phys.read_phys(pmd_table + (index + n) * 8, 8), "little"):
                    break
                n += 1
            return n

        best = (0, 0)
        for index in order:
            run = free_run(index)
            if run > best[0]:
                best = (run, index)
            if run == want:
                break
        if not best[0]:
            raise TargetError("no free 2 MiB slot in the kernel image's page table for the scratch area")
        run, index = best
        self._pmd_table = pmd_table
        self._slots = list(range(index, index + run))
        self.base = base + index * SIZE
        self._free = []
        self._grow()
        try:
            self.machine.mem.virt_to_phys(self.base)
        except MemoryFault:
            raise TargetError("the scratch area mapping did not take effect") from None
        return self.base

    def _grow(self) -> bool:
        """Map the next 2 MiB of the reservation (stop-loop thread); False when all of it is mapped."""
        n = len(self._pmds)
        if n >= len(self._slots):
            return False
        virt = self.base + n * SIZE
        new = self.machine.mem.paging.large_page_entry(self.phys + n * SIZE).to_bytes(8, "little")
        p = Patch(self._pmd_table + self._slots[n] * 8, virt, bytes(8), new, "pmd")
        self.machine.journal.record(p)
        self.machine.write_phys(p.phys, new)
        self._pmds.append(p)
        self._release(n * SIZE, SIZE)
        return True

    def ensure_mapped(self) -> None:
        """``map`` if the area is not mapped yet (stop-loop thread)."""
        if not self._pmds:
            self.map()

    @property
    def mapped_size(self) -> int:
        return len(self._pmds) * SIZE

    def unmap(self) -> None:
        for p in reversed(self._pmds):
            self.machine.unpatch(p)
        self._pmds = []

    @property
    def mapped(self) -> bool:
        return bool(self._pmds)

    @property
    def used(self) -> int:
        """Bytes handed out and not freed."""
        return sum(self._used.values())

    def contains(self, addr: int) -> bool:
        return self.mapped and self.base <= addr < self.base + self.mapped_size

    def alloc(self, size: int, align: int = GRANULE) -> int:
        if size <= 0:
            raise ValueError(f"internal: scratch allocation of {size} bytes")
        size = -(-size // self.GRANULE) * self.GRANULE
        while True:
            for i, (off, n) in enumerate(self._free):
                start = -(-off // align) * align
                if start + size <= off + n:
                    pieces = [(o, m) for o, m in ((off, start - off), (start + size, off + n - start - size)) if m]
                    self._free[i : i + 1] = pieces
                    self._used[start] = size
                    return self.base + start
            if not self._grow():
                raise ScratchFull(f"the {self.mapped_size >> 20} MiB scratch area is full "
                                  f"({len(self._used)} slots in use)")  # fmt: skip

    def free(self, addr: int) -> None:
        off = addr - self.base
        self._release(off, self._used.pop(off))

    def _release(self, off: int, size: int) -> None:
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
        """The guest-physical address of ``addr`` in the area (contiguous both ways: a fixed offset)."""
        return self.phys + addr - self.base

    def write(self, addr: int, data: bytes) -> None:
        """Write code into the area through the stub (so stale translations are dropped)."""
        if not (self.contains(addr) and addr + len(data) <= self.base + self.mapped_size):
            raise TargetError(f"internal: {addr:#x} is outside the scratch area")
        if self._runs is None:
            self.machine.write_phys(self.phys_of(addr), data)
            return
        size = self._used.get(addr - self.base, 0)
        if len(data) < size:
            # The rest of the allocation goes along as it is, so that the next one's write joins this run:
            # as the guest has it, with the writes still held back here laid over it (this run goes out
            # after them, and must not put back what they replace).
            start = addr + len(data)
            rest = bytearray(self.machine.mem.read(start, size - len(data)))
            for run_addr, run in self._runs:
                lo, hi = max(run_addr, start), min(run_addr + len(run), addr + size)
                if lo < hi:
                    rest[lo - start : hi - start] = run[lo - run_addr : hi - run_addr]
            data = data + bytes(rest)
        if self._runs and self._runs[-1][0] + len(self._runs[-1][1]) == addr:
            self._runs[-1][1].extend(data)
        else:
            self._runs.append((addr, bytearray(data)))

    @contextlib.contextmanager
    def combined(self) -> Iterator[None]:
        """Writes made inside (stop loop, one VM stop) go out at its end, adjacent ones as one.

        A batch of a thousand probes writes a slot or a detour each, one after
        the other in the area: a gdbstub round trip apiece was a tenth of a
        second per thousand.  Order is kept: a run only grows at its end.  A
        write at an allocation's start carries the rest of the allocation's
        bytes as they are (nobody else's), so that allocations made one after
        the other make one run.
        """
        if self._runs is not None:
            yield
            return
        self._runs = []
        try:
            yield
        finally:
            runs, self._runs = self._runs, None
            for addr, data in runs:
                self.machine.write_phys(self.phys_of(addr), bytes(data))

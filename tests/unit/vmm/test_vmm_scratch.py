"""The scratch area: the memmap= parser, mapping one PMD on fake page tables, the first-fit allocator."""

from __future__ import annotations

import random

import pytest
from vmm_fakes import ACCESSED, DIRTY, GLOBAL, NX, PS, RW, US, P, PageTables, PhysRam

from qprobe.arch.x86_64.paging import KERNEL_IMAGE_BASE, X86PageTables, translate
from qprobe.errors import ScratchFull, TargetError
from qprobe.vmm.boards import board_for
from qprobe.vmm.journal import Patch
from qprobe.vmm.memory import GuestMemory, MemoryFault
from qprobe.vmm.scratch import SIZE, ScratchArea

M2 = 2 << 20
SCRATCH_PHYS = 0x1E00_0000

# -- memmap= ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "found"),
    [
        ("BOOT_IMAGE=/vmlinuz root=/dev/vda console=ttyS0 memmap=2M$0x1e000000 quiet", (0x1E00_0000, M2)),
        ("memmap=2M$0x1e000000", (0x1E00_0000, M2)),
        ("memmap=2M$0x1E000000 nokaslr", (0x1E00_0000, M2)),
        ("memmap=2048K$0x3dc00000", (0x3DC0_0000, M2)),
        ("memmap=0x200000$0x3dc00000", (0x3DC0_0000, M2)),
        ("memmap=2M$503316480", (503316480, M2)),
        ("memmap=8M$0x1e000000", (0x1E00_0000, 4 * M2)),  # qprobe's own: grown 2 MiB at a time
        ("memmap=4M$0x1e000000 memmap=2M$0x20000000", (0x2000_0000, M2)),  # the last one
        ("memmap=2M$0x1e000000 memmap=1M$0x20000000", (0x1E00_0000, M2)),  # not whole 2 MiB pages
        ("root=/dev/vda console=ttyS0", None),
        ("", None),
        ("memmap=3M$0x1e000000", None),
        ("memmap=2M#0x1e000000", None),  # '#' is ACPI data, not a reservation
        ("memmap=2M!0x1e000000", None),  # '!' is persistent memory
        ("memmap=2M@0x1e000000", None),  # '@' is usable RAM
    ],
)
def test_the_pc_boards_reservation_is_memmap(cmdline: str, found: tuple[int, int] | None) -> None:
    assert board_for("x86_64").reserved(cmdline) == found


@pytest.mark.parametrize(("cmdline", "phys"), [("memmap=2M$480M", 480 << 20), ("memmap=2M$1G", 1 << 30)])
def test_a_memmap_reservation_with_a_suffixed_address(cmdline: str, phys: int) -> None:
    # The kernel parses the address with memparse(), which takes K/M/G;
    # "480M" is read as 480 (and then rejected as unaligned, far from the cause).
    assert board_for("x86_64").reserved(cmdline) == (phys, M2)


# -- a machine on fake page tables ------------------------------------------------------------


class FakeJournal:
    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log
        self.patches: dict[int, Patch] = {}

    def record(self, p: Patch) -> None:
        self.log.append(("record", p))
        self.patches[p.phys] = p

    def forget(self, phys: int) -> None:
        self.log.append(("forget", phys))
        self.patches.pop(phys, None)


class FakeMachine:
    """What ScratchArea uses of Machine: mem, journal, write_phys, unpatch."""

    def __init__(self, levels: int = 4, image_pmds: range = range(8, 24), effective: bool = True) -> None:
        self.ram = PhysRam()
        self.pt = PageTables(self.ram, levels)
        # The kernel image in 2 MiB pages from KERNEL_IMAGE_BASE + 16 MiB, as head_64.S maps it.
        for i in image_pmds:
            self.pt.map(KERNEL_IMAGE_BASE + i * M2, 0x0100_0000 + (i - 8) * M2, M2, P | RW | GLOBAL)
        if not image_pmds:
            self.pt.slot(KERNEL_IMAGE_BASE, 21)  # the PMD table exists but is empty
        self.mem = GuestMemory(self.ram, self.pt.root, X86PageTables(levels))
        self.log: list[tuple[str, object]] = []
        self.journal = FakeJournal(self.log)
        self.effective = effective

    def pmd_table(self) -> int:
        return self.pt.slot(KERNEL_IMAGE_BASE, 21)

    def write_phys(self, phys: int, data: bytes) -> None:
        self.log.append(("write", (phys, data)))
        if self.effective:
            self.ram.write(phys, data)

    def unpatch(self, p: Patch) -> None:
        self.write_phys(p.phys, p.old)
        self.journal.forget(p.phys)


def mapped(levels: int = 4) -> tuple[FakeMachine, ScratchArea]:
    m = FakeMachine(levels)
    area = ScratchArea(m, SCRATCH_PHYS)  # type: ignore[arg-type]
    area.map()
    return m, area


@pytest.mark.parametrize("levels", [4, 5])
def test_map_installs_one_pmd_in_the_highest_free_slot(levels: int) -> None:
    m = FakeMachine(levels)
    area = ScratchArea(m, SCRATCH_PHYS)  # type: ignore[arg-type]
    assert not area.mapped and not area.contains(KERNEL_IMAGE_BASE + 511 * M2)
    base = area.map()
    assert base == area.base == KERNEL_IMAGE_BASE + 511 * M2 == 0xFFFF_FFFF_BFE0_0000
    slot = m.pmd_table() + 511 * 8
    entry = int.from_bytes(m.ram.read_phys(slot, 8), "little")
    assert entry & ~0xFFF == SCRATCH_PHYS
    assert entry & (P | RW | PS | GLOBAL | ACCESSED | DIRTY) == P | RW | PS | GLOBAL | ACCESSED | DIRTY
    assert not entry & (US | NX)  # kernel-only and executable
    new = entry.to_bytes(8, "little")
    patch = Patch(slot, base, bytes(8), new, "pmd")
    # Journaled before it is written.
    assert m.log == [("record", patch), ("write", (slot, new))]
    pa, size, _ = translate(m.mem.read_u64_phys, m.mem.pgd, base + 0x12345, levels)
    assert (pa, size) == (SCRATCH_PHYS + 0x12345, M2)
    assert area.mapped and area.contains(base) and area.contains(base + SIZE - 1)
    assert not area.contains(base - 1) and not area.contains(base + SIZE)


def test_a_full_area_maps_the_next_2_mib_of_its_reservation() -> None:
    m = FakeMachine()
    area = ScratchArea(m, SCRATCH_PHYS, size=3 * M2)  # type: ignore[arg-type]
    base = area.map()
    # Slots for the whole reservation are chosen at once, in address order, below the top.
    assert base == KERNEL_IMAGE_BASE + 509 * M2 and area.mapped_size == M2
    first = area.alloc(M2 - 4096)
    assert first == base and not area.contains(base + M2)
    grown = area.alloc(8192)  # does not fit in the first 2 MiB: the next one is mapped
    assert area.mapped_size == 2 * M2 and area.contains(grown) and grown + 8192 <= base + 2 * M2
    entry = int.from_bytes(m.ram.read_phys(m.pmd_table() + 510 * 8, 8), "little")
    assert entry & ~0xFFF == SCRATCH_PHYS + M2
    pa, _, _ = translate(m.mem.read_u64_phys, m.mem.pgd, grown, 4)
    assert pa == area.phys_of(grown) == SCRATCH_PHYS + (grown - base)
    area.alloc(M2)
    with pytest.raises(ScratchFull, match="the 6 MiB scratch area is full"):
        area.alloc(M2)
    assert area.mapped_size == 3 * M2
    area.unmap()
    assert all(m.ram.read_phys(m.pmd_table() + i * 8, 8) == bytes(8) for i in (509, 510, 511))


def test_the_areas_slots_are_one_free_run() -> None:
    m = FakeMachine()
    m.ram.write_u64(m.pmd_table() + 510 * 8, 0x2)  # taken: 511 alone is too short for 4
    area = ScratchArea(m, SCRATCH_PHYS, size=4 * M2)  # type: ignore[arg-type]
    assert area.map() == KERNEL_IMAGE_BASE + 506 * M2
    for _ in range(4):
        area.alloc(M2)
    with pytest.raises(ScratchFull):
        area.alloc(16)
    assert m.ram.read_phys(m.pmd_table() + 510 * 8, 8) == (2).to_bytes(8, "little")


def test_map_skips_used_slots() -> None:
    m = FakeMachine()
    m.pt.map(KERNEL_IMAGE_BASE + 511 * M2, 0x7000_0000, M2)
    m.ram.write_u64(m.pmd_table() + 510 * 8, 0x2)  # not present but not free either
    area = ScratchArea(m, SCRATCH_PHYS)  # type: ignore[arg-type]
    assert area.map() == KERNEL_IMAGE_BASE + 509 * M2


def test_unmap_restores_the_entry() -> None:
    m, area = mapped()
    slot = m.pmd_table() + 511 * 8
    area.unmap()
    assert not area.mapped
    assert m.ram.read_phys(slot, 8) == bytes(8)
    assert m.log[-1] == ("forget", slot) and not m.journal.patches
    with pytest.raises(MemoryFault):
        m.mem.virt_to_phys(area.base)
    area.unmap()  # twice is harmless
    assert m.log[-1] == ("forget", slot)


def test_unaligned_area_is_refused() -> None:
    with pytest.raises(TargetError, match="not 2 MiB aligned"):
        ScratchArea(FakeMachine(), SCRATCH_PHYS + 0x1000)  # type: ignore[arg-type]


def test_image_mapped_by_a_1g_page_is_refused() -> None:
    m = FakeMachine(image_pmds=range(0))
    m.pt.set_entry(KERNEL_IMAGE_BASE, 30, 0x4000_0000 | P | RW | PS)  # PUD[510] is a 1 GiB page
    with pytest.raises(TargetError, match="not mapped through a PMD table"):
        ScratchArea(m, SCRATCH_PHYS).map()  # type: ignore[arg-type]


def test_image_not_mapped_is_refused() -> None:
    m = FakeMachine(image_pmds=range(0))
    m.pt.set_entry(KERNEL_IMAGE_BASE, 30, 0)
    with pytest.raises(TargetError, match="not mapped through a PMD table"):
        ScratchArea(m, SCRATCH_PHYS).map()  # type: ignore[arg-type]


def test_full_pmd_table_is_refused() -> None:
    m = FakeMachine(image_pmds=range(512))
    with pytest.raises(TargetError, match="no free 2 MiB slot"):
        ScratchArea(m, SCRATCH_PHYS).map()  # type: ignore[arg-type]
    assert not m.log


def test_mapping_that_does_not_take_effect() -> None:
    m = FakeMachine(effective=False)
    with pytest.raises(TargetError, match="did not take effect"):
        ScratchArea(m, SCRATCH_PHYS).map()  # type: ignore[arg-type]


def test_write_goes_to_the_physical_area() -> None:
    m, area = mapped()
    area.write(area.base + 0x40, b"\x90\x90")
    assert m.log[-1] == ("write", (SCRATCH_PHYS + 0x40, b"\x90\x90"))
    area.write(area.base + SIZE - 4, b"\xcc" * 4)
    assert m.mem.read(area.base + SIZE - 4, 4) == b"\xcc" * 4
    for addr, n in [(area.base + SIZE - 4, 5), (area.base - 1, 1), (area.base + SIZE, 1)]:
        with pytest.raises(TargetError, match="outside the scratch area"):
            area.write(addr, bytes(n))


def test_write_before_map_is_refused() -> None:
    area = ScratchArea(FakeMachine(), SCRATCH_PHYS)  # type: ignore[arg-type]
    with pytest.raises(TargetError, match="outside the scratch area"):
        area.write(KERNEL_IMAGE_BASE + 511 * M2, b"\xcc")


# -- the allocator --------------------------------------------------------------------------


def test_alloc_rounds_to_granules_first_fit() -> None:
    _, area = mapped()
    b = area.base
    assert area.alloc(1) == b
    assert area.alloc(17) == b + 16
    assert area.alloc(16) == b + 48
    assert area.alloc(64) == b + 64
    area.free(b + 16)  # a 32-byte hole
    assert area.alloc(40) == b + 128  # 48 bytes: does not fit the hole
    assert area.alloc(8) == b + 16  # first fit: the hole
    assert area.alloc(16) == b + 32  # the rest of the hole
    assert area.alloc(16) == b + 176


def test_alloc_alignment_leaves_a_usable_hole() -> None:
    _, area = mapped()
    b = area.base
    assert area.alloc(16) == b
    assert area.alloc(16, align=64) == b + 64
    assert area.alloc(32) == b + 16  # the hole the alignment left
    assert area.alloc(16) == b + 48
    assert area.alloc(100, align=4096) == b + 4096
    assert area.alloc(16, align=4096) == b + 8192
    area.free(b + 4096)
    area.free(b + 64)
    assert area.alloc(4096 - 80) == b + 64  # everything from 64 up to 8192 merged back
    with pytest.raises(ScratchFull):
        area.alloc(16, align=SIZE)  # only offset 0 is SIZE-aligned, and it is taken


def test_free_merges_both_neighbours() -> None:
    _, area = mapped()
    a, b, c = area.alloc(32), area.alloc(32), area.alloc(32)
    area.free(a)
    area.free(c)
    area.free(b)
    assert area.alloc(96) == a
    area.free(a)
    assert area.alloc(SIZE) == area.base  # everything merged back into one region


def test_full_raises_scratch_full() -> None:
    _, area = mapped()
    assert area.alloc(SIZE - 32) == area.base
    assert area.alloc(32) == area.base + SIZE - 32  # an exact fit
    with pytest.raises(ScratchFull, match=r"the 2 MiB scratch area is full \(2 slots in use\)") as info:
        area.alloc(1)
    assert "\n" not in str(info.value)
    area.free(area.base + SIZE - 32)
    assert area.alloc(17) == area.base + SIZE - 32
    with pytest.raises(ScratchFull):
        area.alloc(SIZE + 1)


def test_free_of_an_unknown_slot_is_an_error() -> None:
    _, area = mapped()
    a = area.alloc(16)
    area.free(a)
    with pytest.raises(KeyError):
        area.free(a)


@pytest.mark.parametrize("size", [0, -16])
def test_an_empty_or_negative_alloc_is_refused_and_changes_nothing(size: int) -> None:
    # A 0-byte slot would share its address with the next allocation: refused outright.
    _, area = mapped()
    first = area.alloc(16)
    with pytest.raises(ValueError, match=f"scratch allocation of {size} bytes"):
        area.alloc(size)
    assert area.alloc(16) == first + 16  # the free list is as it was
    area.free(first)
    assert area.alloc(16) == first


def first_fit(live: dict[int, int], size: int, align: int) -> int | None:
    """The lowest aligned offset in a free gap that fits, gaps taken in address order."""
    pos = 0
    for off in [*sorted(live), SIZE]:
        start = -(-pos // align) * align
        if start + size <= off:
            return start
        if off < SIZE:
            pos = off + live[off]
    return None


@pytest.mark.parametrize("seed", range(8))
def test_allocator_against_a_model(seed: int) -> None:
    rnd = random.Random(seed)
    _, area = mapped()
    live: dict[int, int] = {}  # offset -> rounded size
    for _ in range(600):
        if live and rnd.random() < 0.45:
            off = rnd.choice(sorted(live))
            area.free(area.base + off)
            del live[off]
            continue
        size = rnd.choice([1, 15, 16, 17, 48, 200, 4096, 65536, 300_000])
        align = rnd.choice([16, 16, 16, 64, 4096])
        rounded = -(-size // 16) * 16
        expect = first_fit(live, rounded, align)
        if expect is None:
            with pytest.raises(ScratchFull):
                area.alloc(size, align)
            continue
        addr = area.alloc(size, align)
        assert addr == area.base + expect and addr % align == 0
        live[expect] = rounded
    for off in list(live):
        area.free(area.base + off)
    assert area.alloc(SIZE) == area.base


def test_combined_writes_go_out_at_the_end_adjacent_ones_as_one_in_order() -> None:
    m, area = mapped()
    a, b, c = (area.alloc(16) for _ in range(3))
    assert b == a + 16 and c == b + 16
    phys = SCRATCH_PHYS + a - area.base
    m.ram.write(phys, bytes(range(0x40, 0x70)))  # what the three allocations hold now
    m.log.clear()
    with area.combined():
        area.write(a, b"\x01" * 10)  # the allocation's other 6 bytes go along, as they are
        area.write(b, b"\x02" * 16)
        area.write(a + 2, b"\x03" * 4)  # not an allocation's start, nor adjacent: a run of its own, after
        with area.combined():  # nested: the outer one sends
            area.write(a + 6, b"\x04" * 4)
        assert m.log == []
    first = b"\x01" * 10 + bytes(range(0x4A, 0x50)) + b"\x02" * 16
    assert m.log == [("write", (phys, first)), ("write", (phys + 2, b"\x03" * 4 + b"\x04" * 4))]
    assert m.ram.read_phys(phys, 48) == b"\x01" * 2 + b"\x03" * 4 + b"\x04" * 4 + first[10:] + bytes(range(0x60, 0x70))
    area.write(c, b"\x05")  # outside: at once, as it is
    assert m.log[-1] == ("write", (phys + 32, b"\x05"))


def test_a_combined_write_does_not_put_back_what_a_held_write_replaces() -> None:
    """The rest of an allocation that a write at its start carries is the guest's bytes under the held writes."""
    m, area = mapped()
    a = area.alloc(16)
    phys = SCRATCH_PHYS + a - area.base
    m.ram.write(phys, bytes(range(0x40, 0x50)))
    with area.combined():
        area.write(a + 8, b"\x07" * 4)  # e.g. a pool's header, written before the allocation's start
        area.write(a, b"\x01" * 4)  # carries bytes 4..16 along: they must hold the 0x07s
    assert m.ram.read_phys(phys, 16) == b"\x01" * 4 + bytes(range(0x44, 0x48)) + b"\x07" * 4 + bytes(range(0x4C, 0x50))


def test_an_image_at_the_end_of_its_table_takes_the_slots_below_it_farthest_first() -> None:
    # x86_64's order (PageTables.scratch_slots) when no slot above the image is free, or the image runs past.
    m = FakeMachine(image_pmds=range(500, 512))
    start, end = KERNEL_IMAGE_BASE + 500 * M2, KERNEL_IMAGE_BASE + 512 * M2 - 0x1000
    area = ScratchArea(m, SCRATCH_PHYS, end, image_start=start)  # type: ignore[arg-type]
    assert area.map() == KERNEL_IMAGE_BASE  # slot 0
    # Past the table's end: the same.
    m = FakeMachine(image_pmds=range(500, 512))
    area = ScratchArea(m, SCRATCH_PHYS, end + 8 * M2, image_start=start)  # type: ignore[arg-type]
    assert area.map() == KERNEL_IMAGE_BASE


def test_the_slots_above_the_image_come_first() -> None:
    m = FakeMachine()  # the image in slots 8..23
    area = ScratchArea(m, SCRATCH_PHYS, KERNEL_IMAGE_BASE + 24 * M2 - 1, image_start=KERNEL_IMAGE_BASE + 8 * M2)  # type: ignore[arg-type]
    assert area.map() == KERNEL_IMAGE_BASE + 24 * M2

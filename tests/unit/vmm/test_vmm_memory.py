"""Page-table walks over fake physical memory (4- and 5-level, 4K/2M/1G pages) and the shared RAM file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from vmm_fakes import (
    GLOBAL,
    NX,
    PAGE,
    PAT_LARGE,
    PKEY,
    PS,
    RW,
    US,
    P,
    PageTables,
    PhysRam,
    PhysRamU64,
)

from qprobe.arch.x86_64.paging import X86PageTables, kernel_pgd, paging_levels, translate, walk
from qprobe.errors import TargetError
from qprobe.vmm.memory import LOW_RAM_LIMIT, GuestMemory, MemoryFault, SharedRam

M2, G1 = 2 << 20, 1 << 30
KTEXT = 0xFFFF_FFFF_8100_0000
DIRECT4 = 0xFFFF_8880_0000_0000  # the 4-level direct map
DIRECT5 = 0xFF11_0000_0000_0000  # the 5-level direct map
USER = 0x0000_7FFD_0000_0000


def build(levels: int, ram: PhysRam | None = None) -> tuple[PhysRam, PageTables]:
    """The same layout under 4- or 5-level paging.

    KTEXT        4K -> 0x0200_0000 (NX clear, global)
    KTEXT+0x1000 4K -> 0x0300_5000 (not contiguous with the page before)
    KTEXT+0x2000 not mapped (PTE clear), in a PTE table that exists
    KTEXT+0x3000 PTE present bit clear but the rest of the entry set
    0x...811ff000 4K -> 0x0500_0000, just below a 2M page
    0x...81200000 2M -> 0x0400_0000 (PAT and NX set in the entry)
    0x...81400000 PMD entry clear
    direct map   1G -> 0x4000_0000 (protection key set)
    direct+1G    PUD entry clear
    USER         top-level entry clear
    """
    ram = ram if ram is not None else PhysRam()
    pt = PageTables(ram, levels)
    pt.map(KTEXT, 0x0200_0000, flags=P | RW | GLOBAL)
    pt.map(KTEXT + 0x1000, 0x0300_5000, flags=P | RW | NX)
    pt.set_entry(KTEXT + 0x3000, 12, 0x0600_0000 | RW)  # everything but present
    pt.map(0xFFFF_FFFF_811F_F000, 0x0500_0000)
    pt.map(0xFFFF_FFFF_8120_0000, 0x0400_0000, M2, flags=P | RW | PAT_LARGE | NX)
    direct = DIRECT5 if levels == 5 else DIRECT4
    pt.map(direct, 0x4000_0000, G1, flags=P | RW | PKEY | NX)
    # Data at the far ends of the pages, so a wrong offset shows.
    ram.write(0x0200_0000, b"text-page-0")
    ram.write(0x0200_0FF8, b"ABCDEFGH")
    ram.write(0x0300_5000, b"IJKLMNOP")
    ram.write(0x0500_0FFC, b"4k->")
    ram.write(0x0400_0000, b"2m<-")
    ram.write(0x0400_0000 + 0x1F_FFF0, b"end of the 2M pg")
    ram.write(0x4000_0000 + 0x1234_5678, b"direct map")
    ram.write(0x4000_0000 + G1 - 8, b"lastbyte")
    return ram, pt


@pytest.fixture(params=[4, 5], ids=["4-level", "5-level"])
def paging(request: pytest.FixtureRequest) -> tuple[int, PhysRam, PageTables, int]:
    levels = request.param
    ram, pt = build(levels)
    return levels, ram, pt, DIRECT5 if levels == 5 else DIRECT4


def u64(ram: PhysRam) -> Callable[[int], int]:
    return lambda pa: int.from_bytes(ram.read_phys(pa, 8), "little")


# -- translate --------------------------------------------------------------------------

TRANSLATIONS = [
    # (vaddr or offset from the direct map, physical, page size)
    (KTEXT, 0x0200_0000, PAGE),
    (KTEXT + 0xFFF, 0x0200_0FFF, PAGE),
    (KTEXT + 0x1000, 0x0300_5000, PAGE),
    (KTEXT + 0x1ABC, 0x0300_5ABC, PAGE),
    (0xFFFF_FFFF_811F_FFFF, 0x0500_0FFF, PAGE),
    (0xFFFF_FFFF_8120_0000, 0x0400_0000, M2),
    (0xFFFF_FFFF_8120_1234, 0x0400_1234, M2),  # the PAT bit (12) is not an address bit here
    (0xFFFF_FFFF_813F_FFFF, 0x041F_FFFF, M2),
    ("direct", 0x4000_0000, G1),
    ("direct+0x12345678", 0x5234_5678, G1),
    ("direct+0x3fffffff", 0x7FFF_FFFF, G1),
]


def resolve(v: int | str, direct: int) -> int:
    if isinstance(v, int):
        return v
    return direct + (int(v.split("+")[1], 16) if "+" in v else 0)


@pytest.mark.parametrize(("vaddr", "paddr", "size"), TRANSLATIONS)
def test_translate(paging: tuple[int, PhysRam, PageTables, int], vaddr: int | str, paddr: int, size: int) -> None:
    levels, ram, pt, direct = paging
    va = resolve(vaddr, direct)
    pa, page, entry = translate(u64(ram), pt.root, va, levels)
    assert (pa, page) == (paddr, size)
    assert entry & P
    assert bool(entry & PS) == (size != PAGE)


@pytest.mark.parametrize(
    ("vaddr", "depth4", "depth5"),
    [
        (KTEXT + 0x2000, 4, 5),  # PTE clear
        (KTEXT + 0x3000, 4, 5),  # PTE with only the present bit clear
        (0xFFFF_FFFF_8140_0000, 3, 4),  # PMD entry clear
        ("direct+0x40000000", 2, 3),  # PUD entry clear
        (USER, 1, 1),  # top-level entry clear
    ],
)
def test_not_present_raises_memory_fault(paging: tuple[int, PhysRam, PageTables, int], vaddr: int | str,
                                         depth4: int, depth5: int) -> None:  # fmt: skip
    levels, ram, pt, direct = paging
    va = resolve(vaddr, direct)
    with pytest.raises(MemoryFault) as info:
        translate(u64(ram), pt.root, va, levels)
    assert info.value.addr == va
    assert str(info.value) == f"guest address {va:#x} is not mapped"
    assert isinstance(info.value, TargetError)
    path = walk(u64(ram), pt.root, va, levels)
    assert len(path) == (depth5 if levels == 5 else depth4)
    assert not path[-1][1] & P


@pytest.mark.parametrize(("vaddr", "leaf_depth"), [(KTEXT, 4), (0xFFFF_FFFF_8120_0000, 3), ("direct", 2)])
def test_walk_stops_at_the_leaf(paging: tuple[int, PhysRam, PageTables, int], vaddr: int | str,
                                leaf_depth: int) -> None:  # fmt: skip
    levels, ram, pt, direct = paging
    va = resolve(vaddr, direct)
    path = walk(u64(ram), pt.root, va, levels)
    assert len(path) == leaf_depth + levels - 4
    assert path[0][0] == pt.root
    # Each table is the one the entry above points at, and each entry is the one for va.
    shifts = [48, 39, 30, 21, 12][5 - levels :]
    for i, (table, entry) in enumerate(path):
        assert entry == u64(ram)(table + ((va >> shifts[i]) & 0x1FF) * 8)
        if i:
            assert table == path[i - 1][1] & 0x000F_FFFF_FFFF_F000


def test_levels_select_the_top_index() -> None:
    # The 5-level direct map is reached through PML5[0x111]; read as 4-level
    # tables, the same root is indexed by bits 39..47 and finds nothing.
    ram, pt = build(5)
    assert translate(u64(ram), pt.root, DIRECT5, 5)[0] == 0x4000_0000
    with pytest.raises(MemoryFault):
        translate(u64(ram), pt.root, DIRECT5, 4)
    ram4, pt4 = build(4)
    with pytest.raises(MemoryFault):
        translate(u64(ram4), pt4.root, DIRECT4 | (0x111 << 48), 5)


def test_high_entry_bits_are_not_address_bits() -> None:
    ram = PhysRam()
    pt = PageTables(ram)
    pt.map(KTEXT, 0x0007_FFFF_FFFF_F000, flags=P | NX | PKEY | US | (0x7F << 52))  # bits 52..58 ignored/avail
    pa, _, _ = translate(u64(ram), pt.root, KTEXT + 0x10)
    assert pa == 0x0007_FFFF_FFFF_F010


# -- GuestMemory --------------------------------------------------------------------------


def test_read_across_4k_pages(paging: tuple[int, PhysRam, PageTables, int]) -> None:
    levels, ram, pt, _ = paging
    mem = GuestMemory(ram, pt.root, X86PageTables(levels))
    assert mem.read(KTEXT + 0xFF8, 16) == b"ABCDEFGHIJKLMNOP"
    assert mem.read_u64(KTEXT + 0xFFC) == int.from_bytes(b"EFGHIJKL", "little")


def test_read_from_a_4k_page_into_a_2m_page(paging: tuple[int, PhysRam, PageTables, int]) -> None:
    levels, ram, pt, _ = paging
    mem = GuestMemory(ram, pt.root, X86PageTables(levels))
    assert mem.read(0xFFFF_FFFF_811F_FFFC, 8) == b"4k->2m<-"
    assert mem.read(0xFFFF_FFFF_813F_FFF0, 16) == b"end of the 2M pg"


def test_read_within_a_1g_page(paging: tuple[int, PhysRam, PageTables, int]) -> None:
    levels, ram, pt, direct = paging
    mem = GuestMemory(ram, pt.root, X86PageTables(levels))
    assert mem.read(direct + 0x1234_5678, 10) == b"direct map"
    assert mem.read(direct + G1 - 8, 8) == b"lastbyte"
    assert mem.virt_to_phys(direct + 0x1234_5678) == 0x5234_5678


def test_read_into_an_unmapped_page_faults_at_that_page(paging: tuple[int, PhysRam, PageTables, int]) -> None:
    levels, ram, pt, direct = paging
    mem = GuestMemory(ram, pt.root, X86PageTables(levels))
    with pytest.raises(MemoryFault) as info:
        mem.read(KTEXT + 0x1FF0, 0x20)
    assert info.value.addr == KTEXT + 0x2000
    with pytest.raises(MemoryFault) as info:
        mem.read(direct + G1 - 4, 8)  # off the end of the 1G page
    assert info.value.addr == direct + G1


def test_read_cstring(paging: tuple[int, PhysRam, PageTables, int]) -> None:
    levels, ram, pt, _ = paging
    mem = GuestMemory(ram, pt.root, X86PageTables(levels))
    assert mem.read_cstring(KTEXT) == b"text-page-0"
    # A string that runs over a page boundary is read from both pages.
    ram.write(0x0200_0FFA, b"abcdef")
    ram.write(0x0300_5000, b"ghi\0")
    assert mem.read_cstring(KTEXT + 0xFFA) == b"abcdefghi"
    assert mem.read_cstring(KTEXT + 0xFFA, limit=4) == b"abcd"
    # A string that ends before an unmapped page does not touch it.
    ram.write(0x0300_5FFC, b"end\0")
    assert mem.read_cstring(KTEXT + 0x1FFC) == b"end"
    ram.write(0x0300_5FFE, b"xy")
    with pytest.raises(MemoryFault):
        mem.read_cstring(KTEXT + 0x1FFE)  # two bytes left in the page, no NUL


def test_explicit_pgd() -> None:
    ram, pt = build(4)
    other = PageTables(ram, 4, table_base=0x0080_0000)
    other.map(KTEXT, 0x0300_5000)
    mem = GuestMemory(ram, pt.root, X86PageTables())
    assert mem.read(KTEXT, 8) == b"text-pag"
    assert mem.read(KTEXT, 8, pgd=other.root) == b"IJKLMNOP"
    assert mem.virt_to_phys(KTEXT, other.root) == 0x0300_5000


def test_fast_u64_reader_is_used_for_the_walk() -> None:
    ram = PhysRamU64()
    _, pt = build(4, ram)
    mem = GuestMemory(ram, pt.root, X86PageTables())
    ram.reads.clear()
    assert mem.read(KTEXT, 4) == b"text"
    assert ram.u64_reads == 4  # one entry per level
    # Without read_u64_phys, entries are read as 8-byte physical reads.
    plain = PhysRam()
    _, pt2 = build(4, plain)
    plain.reads.clear()
    assert GuestMemory(plain, pt2.root, X86PageTables()).read(KTEXT, 4) == b"text"
    assert [size for _, size in plain.reads] == [8, 8, 8, 8, 4]


# -- CR3 and CR4 -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cr3", "pgd"),
    [
        (0x0123_4000, 0x0123_4000),
        (0x0123_4005, 0x0123_4000),  # PCID 5
        (0x0123_5000, 0x0123_4000),  # PTI: the user half's PGD is the next page
        (0x0123_5FFF, 0x0123_4000),
        (0x8000_0000_0123_5801, 0x0123_4000),  # CR3 bit 63: no-flush
        (0x000F_FFFF_FFFF_E000, 0x000F_FFFF_FFFF_E000),  # the highest 52-bit address
    ],
)
def test_kernel_pgd(cr3: int, pgd: int) -> None:
    assert kernel_pgd(cr3) == pgd


def test_kernel_pgd_without_pti() -> None:
    # Without page-table isolation a PGD is any page: bit 12 is an address bit, not the user copy.
    assert kernel_pgd(0x0123_5005, pti=False) == 0x0123_5000
    assert kernel_pgd(0x8000_0000_0123_5801, pti=False) == 0x0123_5000


@pytest.mark.parametrize(("cr4", "levels"), [(0, 4), (0x3406F0, 4), (0x1000, 5), (0x3416F0, 5)])
def test_paging_levels(cr4: int, levels: int) -> None:
    assert paging_levels(cr4) == levels


def test_user_cr3_reaches_the_kernel_half() -> None:
    # Under PTI the task runs on the user PGD (kernel PGD + 4K); the kernel half is in the other one.
    ram = PhysRam()
    pt = PageTables(ram, table_base=0x0040_0000)  # root 0x400000: 8K aligned, as the kernel allocates it
    user_pgd = pt.new_table()  # the next page: nothing of the kernel in it
    assert user_pgd == pt.root + PAGE
    pt.map(KTEXT, 0x0200_0000)
    ram.write(0x0200_0000, b"kernel")
    with pytest.raises(MemoryFault):
        GuestMemory(ram, user_pgd, X86PageTables()).read(KTEXT, 6)
    mem = GuestMemory(ram, kernel_pgd(pt.root | PAGE | 0x801), X86PageTables())
    assert mem.read(KTEXT, 6) == b"kernel"


# -- SharedRam -----------------------------------------------------------------------------


def sparse(path: Path, size: int, marks: dict[int, bytes]) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in marks.items():
            f.seek(off)
            f.write(data)
    return path


def test_shared_ram_small(tmp_path: Path) -> None:
    size = 16 * PAGE
    path = sparse(tmp_path / "ram", size, {0: b"first", 0x1FF8: b"\x01\x02\x03\x04\x05\x06\x07\x08",
                                           size - 4: b"last"})  # fmt: skip
    ram = SharedRam(path, size)
    try:
        assert ram.low == size
        assert ram.read_phys(0, 5) == b"first"
        assert ram.read_phys(size - 4, 4) == b"last"
        assert ram.read_u64_phys(0x1FF8) == 0x0807060504030201
        for paddr, n in [(size, 1), (size - 2, 4), (1 << 32, 8), (LOW_RAM_LIMIT, 1)]:
            with pytest.raises(MemoryFault, match="outside guest RAM"):
                ram.read_phys(paddr, n)
        with pytest.raises(MemoryFault):
            ram.read_u64_phys(size - 4)
    finally:
        ram.close()


def test_shared_ram_of_a_board_whose_ram_starts_at_1_gib(tmp_path: Path) -> None:
    # arm64's virt machine: the file's first byte is physical 0x40000000; below it and past it is no RAM.
    size, base = 16 * PAGE, 0x4000_0000
    ram = SharedRam(sparse(tmp_path / "ram", size, {0: b"first", size - 4: b"last"}), size, base=base)
    try:
        assert ram.read_phys(base, 5) == b"first" and ram.read_phys(base + size - 4, 4) == b"last"
        for paddr, n in [(0, 5), (base - 2, 4), (base + size, 1), ((1 << 32) + base, 8)]:
            with pytest.raises(MemoryFault, match="outside guest RAM"):
                ram.read_phys(paddr, n)
    finally:
        ram.close()


def test_shared_ram_sees_later_writes(tmp_path: Path) -> None:
    path = sparse(tmp_path / "ram", PAGE, {})
    ram = SharedRam(path, PAGE)
    try:
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"live")
        assert ram.read_phys(100, 4) == b"live"
    finally:
        ram.close()


GIB = 1 << 30


@pytest.mark.parametrize("size", [4 * GIB, 3 * GIB + GIB // 2], ids=["4G", "3.5G"])
def test_shared_ram_split_above_4g(tmp_path: Path, size: int) -> None:
    # QEMU's pc machine with >= 3.5 GiB: [0, 3G) at 0, the rest at 4 GiB.
    high = size - 3 * GIB
    marks = {0x1000: b"low", 3 * GIB - 8: b"lowlast!", 3 * GIB: b"high0", size - 8: b"hiendXYZ"}
    ram = SharedRam(sparse(tmp_path / "ram", size, marks), size)
    try:
        assert ram.low == 3 * GIB
        assert ram.read_phys(0x1000, 3) == b"low"
        assert ram.read_phys(3 * GIB - 8, 8) == b"lowlast!"
        assert ram.read_phys(1 << 32, 5) == b"high0"
        assert ram.read_phys((1 << 32) + high - 8, 8) == b"hiendXYZ"
        assert ram.read_u64_phys(1 << 32) == int.from_bytes(b"high0\0\0\0", "little")
        for paddr, n in [(3 * GIB, 1), (3 * GIB - 4, 8), ((1 << 32) - 1, 2), ((1 << 32) + high - 4, 8),
                         ((1 << 32) + high, 1)]:  # fmt: skip
            with pytest.raises(MemoryFault):
                ram.read_phys(paddr, n)
    finally:
        ram.close()


def test_shared_ram_below_three_and_a_half_gib_is_not_split(tmp_path: Path) -> None:
    # hw/i386/pc_piix.c: lowmem = 3.5G unless ram_size >= 3.5G (then 3G with
    # gigabyte_align), and RAM below lowmem is not split.  -m 3328M puts all
    # of it below 4 GiB, so physical 3G+4K is file offset 3G+4K.
    size = 3 * GIB + GIB // 4
    ram = SharedRam(sparse(tmp_path / "ram", size, {3 * GIB + 0x1000: b"above3G"}), size)
    try:
        assert ram.read_phys(3 * GIB + 0x1000, 7) == b"above3G"
    finally:
        ram.close()


def test_writable_shared_ram(tmp_path: Path) -> None:
    size = 4 * GIB
    path = sparse(tmp_path / "ram", size, {})
    ram = SharedRam(path, size, writable=True)
    try:
        ram.write_phys(0x2000, b"mailbox")
        ram.write_phys(1 << 32, b"high")
        assert ram.read_phys(0x2000, 7) == b"mailbox"
        with open(path, "rb") as f:
            f.seek(3 * GIB)
            assert f.read(4) == b"high"  # 4 GiB physical is file offset 3 GiB
        with pytest.raises(MemoryFault):
            ram.write_phys(3 * GIB, b"hole")
    finally:
        ram.close()


def test_read_only_shared_ram_refuses_writes(tmp_path: Path) -> None:
    ram = SharedRam(sparse(tmp_path / "ram", PAGE, {}), PAGE)
    try:
        assert not ram.writable
        with pytest.raises(TypeError):
            ram.write_phys(0, b"x")
    finally:
        ram.close()


def test_guest_memory_over_shared_ram(tmp_path: Path) -> None:
    # The page tables and the data live in the RAM file; GuestMemory walks them through it.
    fake = PhysRam()
    _, pt = build(4, fake)
    size = 0x4000_0000 + GIB  # covers the 1G direct-map page at 0x4000_0000 too
    marks = {pfn * PAGE: bytes(frame) for pfn, frame in fake.frames.items()}
    ram = SharedRam(sparse(tmp_path / "ram", size, marks), size)
    try:
        mem = GuestMemory(ram, pt.root, X86PageTables())
        assert mem.read(KTEXT + 0xFF8, 16) == b"ABCDEFGHIJKLMNOP"
        assert mem.read(DIRECT4 + 0x1234_5678, 10) == b"direct map"
    finally:
        ram.close()


def test_shared_ram_polled_word_is_one_aligned_store(tmp_path: Path) -> None:
    path = sparse(tmp_path / "ram", PAGE, {})
    ram = SharedRam(path, PAGE, writable=True)
    try:
        ram.write_u64_phys(0x40, 0x1122334455667788)
        assert ram.read_u64_phys(0x40) == 0x1122334455667788
        assert path.read_bytes()[0x40:0x48] == bytes.fromhex("8877665544332211")  # little-endian, in the file
        with pytest.raises(ValueError, match="unaligned"):
            ram.write_u64_phys(0x44, 1)
        with pytest.raises(MemoryFault):
            ram.write_u64_phys(PAGE, 1)
    finally:
        ram.close()

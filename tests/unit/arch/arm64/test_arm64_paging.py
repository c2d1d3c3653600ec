"""arm64's page-table walk over descriptors built in a fake RAM: granules, VA sizes, blocks, 52-bit layouts."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from qprobe.arch.arm64.paging import (
    MT_NORMAL,
    PMD_SECT_AF,
    PMD_SECT_PXN,
    PMD_SECT_RDONLY,
    PMD_SECT_UXN,
    Arm64PageTables,
    page_tables,
)
from qprobe.errors import MemoryFault, TargetError

sys.path.insert(0, str(Path(__file__).parent))
from pagetables_arm64 import (
    ATTRS,
    BLOCK,
    G1,
    IMAGE,
    K4,
    M2,
    PAGE,
    TABLE,
    TG1_4K,
    TG1_16K,
    TG1_64K,
    Ram,
    Tables,
    image_tables,
    kva,
    tcr,
)

ENIA, WXN = 1 << 31, 1 << 19


def four_level() -> tuple[Ram, Tables, Arm64PageTables]:
    """4K pages, 48-bit kernel addresses: 4 levels, with a page, a 2 MiB block and a 1 GiB block."""
    pt = Arm64PageTables(tcr(48))
    ram = Ram()
    t = Tables(pt, ram)
    t.map(kva(48, 0x1234_5000), 0x4123_4000)
    t.map(kva(48, 0x1240_0000), 0x4060_0000, level=2)
    t.map(kva(48, 0x4_0000_0000), 0x8000_0000, level=1)
    return ram, t, pt


def test_4k_granule_48_bits_is_four_levels_of_4k_2m_1g() -> None:
    ram, t, pt = four_level()
    assert (pt.levels, pt.large_page, pt.va_bits) == (4, M2, 48)
    assert pt.translate(ram.read_u64, t.root, kva(48, 0x1234_5ABC)) == (
        0x4123_4ABC, K4, 0x4123_4000 | PAGE | ATTRS)  # fmt: skip
    assert pt.translate(ram.read_u64, t.root, kva(48, 0x1241_2345))[:2] == (0x4061_2345, M2)
    assert pt.translate(ram.read_u64, t.root, kva(48, 0x4_3FFF_FFF8))[:2] == (0x8000_0000 + G1 - 8, G1)


@pytest.mark.parametrize(
    "offset",
    [0x1234_6000, 0x1260_0000, 0x5_0000_0000, 0x7F_0000_0000_00],
    ids=["page-in-a-table", "pmd-clear", "pud-clear", "pgd-clear"],
)
def test_unmapped_raises_memory_fault(offset: int) -> None:
    ram, t, pt = four_level()
    with pytest.raises(MemoryFault):
        pt.translate(ram.read_u64, t.root, kva(48, offset))


def test_a_user_address_is_not_walked_through_ttbr1() -> None:
    """TTBR1's tables map kva(48, x) at the indices of user address x: only the task's root may walk it."""
    ram, t, pt = four_level()
    assert pt.translate(ram.read_u64, t.root, 0x1234_5000)[0] == 0x4123_4000  # the kernel's page: wrong
    assert pt.root_for(kva(48, 0x1234_5000), t.root, 0x4800_0000) == t.root
    assert pt.root_for(0x1234_5000, t.root, 0x4800_0000) == 0x4800_0000
    with pytest.raises(MemoryFault, match="TTBR0_EL1"):
        pt.root_for(0x1234_5000, t.root, None)


def test_39_bits_is_three_levels_and_the_top_index_is_the_va_s_top_bits() -> None:
    pt = Arm64PageTables(tcr(39))
    ram = Ram()
    t = Tables(pt, ram)
    va = kva(39, 0x40_0000_0000 + 0x12_3456_7000)  # top index 256 + 0x48: bits 38:30
    t.map(va, 0x4555_5000)
    assert (pt.levels, pt.task_size_max()) == (3, 1 << 39)
    assert ram.words[t.root + (256 + 0x48) * 8] & TABLE == TABLE
    assert pt.translate(ram.read_u64, t.root, va + 0x10) == (0x4555_5010, K4, 0x4555_5000 | PAGE | ATTRS)


def test_a_block_where_linux_maps_none_is_no_mapping() -> None:
    """A level-0 block (4K granule, no LPA2) and a last-level descriptor with bit 1 clear map nothing."""
    ram, t, pt = four_level()
    ram.words[t.slot(kva(48, 0x80_0000_0000), 0)] = 0x4000_0000 | BLOCK | ATTRS
    t.map(kva(48, 0x1234_7000), 0x4123_7000)
    ram.words[t.slot(kva(48, 0x1234_7000), 3)] = 0x4123_7000 | BLOCK | ATTRS
    for offset in (0x80_0000_0000, 0x1234_7000):
        with pytest.raises(MemoryFault):
            pt.translate(ram.read_u64, t.root, kva(48, offset))


@pytest.mark.parametrize(
    ("va_bits", "tg1", "levels", "large_page"),
    [(48, TG1_4K, 4, M2), (39, TG1_4K, 3, M2), (47, TG1_16K, 3, 32 << 20), (48, TG1_16K, 4, 32 << 20),
     (48, TG1_64K, 3, 512 << 20), (42, TG1_64K, 2, 512 << 20), (52, TG1_64K, 3, 512 << 20)],
)  # fmt: skip
def test_levels_follow_the_granule_and_va_size(va_bits: int, tg1: int, levels: int, large_page: int) -> None:
    pt = Arm64PageTables(tcr(va_bits, tg1))
    assert (pt.levels, pt.large_page) == (levels, large_page)


def test_a_reserved_granule_is_refused() -> None:
    with pytest.raises(TargetError, match="granule"):
        Arm64PageTables(tcr(48, tg1=0))


@pytest.mark.parametrize(
    ("ttbr1", "root"),
    [(0x0000_0000_4123_4000, 0x4123_4000), (0x0042_0000_4123_4001, 0x4123_4000),
     (0xFFFF_0000_4123_4000, 0x4123_4000)],
    ids=["plain", "asid-and-cnp", "all-asid-bits"],
)  # fmt: skip
def test_root_drops_the_asid_and_cnp(ttbr1: int, root: int) -> None:
    assert Arm64PageTables(tcr(48)).root(ttbr1) == root


def test_root_with_52_bit_output_addresses_takes_baddr_51_48_from_bits_5_2() -> None:
    """phys_to_ttbr(): TTBR_BADDR_MASK_52 keeps bits 47:2, with the address's 51:48 shifted into 5:2."""
    pt = Arm64PageTables(tcr(52, TG1_64K, extra=0b110 << 32))
    assert pt.pa52
    assert pt.root(0x0007_0000_4123_0000 | 0x9 << 2 | 1) == 0x9_0000_4123_0000


def test_64k_pages_with_52_bit_addresses_read_pa_51_48_from_descriptor_bits_15_12() -> None:
    pt = Arm64PageTables(tcr(52, TG1_64K, extra=0b110 << 32))
    ram = Ram()
    root = ram.alloc(1 << 16)
    l2, l3 = ram.alloc(1 << 16), ram.alloc(1 << 16)
    va = kva(52, 0x0123_4567_0000)
    ram.words[root + (va >> 42 & 0x3FF) * 8] = l2 | TABLE
    ram.words[l2 + (va >> 29 & 0x1FFF) * 8] = l3 | TABLE
    ram.words[l3 + (va >> 16 & 0x1FFF) * 8] = 0x0000_7654_3210_0000 | 0xA << 12 | PAGE | ATTRS
    assert pt.translate(ram.read_u64, root, va + 0x1234)[:2] == (0xA_7654_3210_1234, 1 << 16)


def test_lpa2_4k_52_bits_is_five_levels_with_pa_51_50_in_bits_9_8() -> None:
    """6.12's LPA2 (TCR_EL1.DS): a level -1 table of 16 entries, and no shareability bits in descriptors."""
    pt = Arm64PageTables(tcr(52, extra=1 << 59))
    assert (pt.levels, pt.pa52) == (5, True)
    ram = Ram()
    tables = [ram.alloc(K4) for _ in range(5)]
    va = kva(52, 0x9_8765_4321_0000)
    for level, (table, below) in enumerate(itertools.pairwise(tables), start=-1):
        shift = 12 + 9 * (3 - level)
        ram.words[table + (va >> shift & (0xF if level == -1 else 0x1FF)) * 8] = below | TABLE
    leaf = 0x0003_0000_4444_4000 | 0b10 << 8 | PAGE | PMD_SECT_AF | PMD_SECT_UXN  # PA bits 51:48 = 0b1011
    ram.words[tables[4] + (va >> 12 & 0x1FF) * 8] = leaf
    assert pt.translate(ram.read_u64, tables[0], va + 0x10)[:2] == (0xB_0000_4444_4010, K4)
    block = pt.large_page_entry(0xB_0000_4460_0000)
    assert block & (3 << 8) == 0b10 << 8 and block & (3 << 48) == 3 << 48  # address bits, no SH


# -- the scratch area's mapping: the kernel image's PMD table and a PROT_SECT_NORMAL_EXEC block ------------
def test_the_image_base_is_where_the_image_s_pmd_table_starts() -> None:
    ram, t, pt = image_tables()
    assert pt.image_base == kva(48, 0x8_0000_0000)  # the 1 GiB that table maps
    assert pt.large_page_table(ram.read_u64, t.root) == t.slot(IMAGE, 2) - (IMAGE >> 21 & 0x1FF) * 8


@pytest.mark.parametrize(
    ("image", "first", "last"),
    [
        (range(64, 84), [*range(63, -1, -1), 511], 84),  # 6.1 without KASLR: KIMAGE_VADDR is 128 MiB in
        (range(0, 21), [511, 510], 21),  # 6.12 without KASLR: the image starts its table (MODULES_VSIZE 2 GiB)
        (range(500, 515), [499, 498], 0),  # KASLR may end the image past its table: only slots below it
    ],
)
def test_the_scratch_slots_are_below_the_image_then_the_table_s_top(image: range, first: list[int],
                                                                    last: int) -> None:  # fmt: skip
    # Never just above the image: without KASLR that is where vmalloc's next allocation goes.
    order = Arm64PageTables(tcr(48)).scratch_slots(image)
    assert order[: len(first)] == first and order[-1] == last
    assert not set(order) & set(image) and len(order) == len(set(order)) == 512 - len(set(image) & set(range(512)))


def test_large_page_entry_round_trips_through_translate() -> None:
    ram, t, pt = image_tables()
    pmd = pt.large_page_table(ram.read_u64, t.root)
    entry = pt.large_page_entry(0x4800_0000)
    ram.words[pmd + 300 * 8] = entry
    va = pt.image_base + 300 * M2 + 0x1_2345
    assert pt.translate(ram.read_u64, t.root, va) == (0x4801_2345, M2, entry)


def test_large_page_entry_is_prot_sect_normal_exec() -> None:
    """Valid block, AttrIndx MT_NORMAL, inner shareable, accessed; RW at EL1 (AP[2] clear), executable at
    EL1 (PXN clear) and never at EL0 (UXN), global (nG clear)."""
    entry = Arm64PageTables(tcr(48)).large_page_entry(0x4800_0000)
    assert entry == 0x4800_0000 | 1 | MT_NORMAL << 2 | 3 << 8 | 1 << 10 | 1 << 54
    assert not entry & (PMD_SECT_PXN | PMD_SECT_RDONLY | 1 << 11 | 1 << 6)


def test_large_page_entry_refuses_a_misaligned_block_and_wxn() -> None:
    with pytest.raises(TargetError, match="aligned"):
        Arm64PageTables(tcr(48)).large_page_entry(0x4810_0000)
    with pytest.raises(TargetError, match="WXN"):
        Arm64PageTables(tcr(48), WXN).large_page_entry(0x4800_0000)


def test_large_page_table_needs_the_image_mapped_through_a_pmd_table() -> None:
    pt = Arm64PageTables(tcr(48), image=IMAGE)
    ram = Ram()
    t = Tables(pt, ram)
    t.map(IMAGE & -G1, 0x4000_0000, level=1)
    with pytest.raises(TargetError, match="PMD table"):
        pt.large_page_table(ram.read_u64, t.root)


def test_before_vbar_points_into_the_kernel_the_image_is_not_known() -> None:
    pt = page_tables({"TCR_EL1": tcr(48), "SCTLR": 0, "VBAR": 0})
    assert pt.image is None
    with pytest.raises(TargetError, match="VBAR_EL1"):
        pt.large_page_table(Ram().read_u64, 0x4010_0000)


@pytest.mark.parametrize(("sctlr", "mask"), [(ENIA, 0xFFFF_0000_0000_0000), (0, 0)], ids=["pauth", "no-pauth"])
def test_pac_mask_is_ptrauth_kernel_pac_mask_with_address_auth(sctlr: int, mask: int) -> None:
    assert page_tables({"TCR_EL1": tcr(48), "SCTLR": sctlr}).pac_mask == mask


def test_task_size_max_is_task_size_64() -> None:
    assert Arm64PageTables(tcr(48)).task_size_max() == 1 << 48
    assert Arm64PageTables(tcr(48)).kernel_root_symbol == "swapper_pg_dir"

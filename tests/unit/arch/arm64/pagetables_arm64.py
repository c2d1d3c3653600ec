"""Fake physical RAM and arm64 page tables built in it, the way the kernel's create_pgd_mapping writes them."""

from __future__ import annotations

from qprobe.arch.arm64.paging import (
    PMD_SECT_AF,
    PMD_SECT_PXN,
    PMD_SECT_RDONLY,
    PMD_SECT_S,
    PMD_SECT_UXN,
    Arm64PageTables,
    Half,
    page_tables,
)

K4, M2, G1 = 1 << 12, 2 << 20, 1 << 30
TG1_16K, TG1_4K, TG1_64K = 1 << 30, 2 << 30, 3 << 30
PAGE, BLOCK, TABLE = 3, 1, 3  # descriptor type bits: a last-level page, a block, a table
ATTRS = PMD_SECT_AF | PMD_SECT_S | PMD_SECT_UXN | PMD_SECT_PXN  # kernel data, as PROT_NORMAL maps it


def tcr(va_bits: int, tg1: int = TG1_4K, extra: int = 0) -> int:
    """TCR_EL1 as the kernel sets it: T0SZ and T1SZ both 64 - va_bits."""
    return (64 - va_bits) << 16 | (64 - va_bits) | tg1 | extra


def kva(va_bits: int, offset: int) -> int:
    """The kernel-half address ``offset`` bytes above the half's start."""
    return (1 << 64) - (1 << va_bits) + offset


class Ram:
    """Physical memory as 8-byte words (absent words read as zero), with a table allocator."""

    def __init__(self) -> None:
        self.words: dict[int, int] = {}
        self.free = 0x4010_0000  # tables go here, above the guest RAM base of QEMU's virt machine

    def read_u64(self, pa: int) -> int:
        assert not pa & 7, f"unaligned descriptor read at {pa:#x}"
        return self.words.get(pa, 0)

    def alloc(self, size: int) -> int:
        self.free = -(-self.free // size) * size
        table, self.free = self.free, self.free + size
        return table


class Tables:
    """Descriptors built the way the kernel's create_pgd_mapping writes them (48-bit output addresses), for
    the kernel half (TTBR1) or, with ``half=pt.user``, a task's (TTBR0)."""

    def __init__(self, pt: Arm64PageTables, ram: Ram, half: Half | None = None) -> None:
        self.pt, self.ram = pt, ram
        self.half = half or pt.kernel
        self.granule = 1 << pt.page_shift
        self.root = ram.alloc(self.granule)

    def slot(self, va: int, level: int) -> int:
        """The physical address of ``va``'s descriptor at ``level``, making the tables above it."""
        table, top = self.root, 4 - self.half.levels
        for lv in range(top, level + 1):
            shift = self.pt.page_shift + (self.pt.page_shift - 3) * (3 - lv)
            bits = self.half.va_bits - shift if lv == top else self.pt.page_shift - 3
            slot = table + (va >> shift & (1 << bits) - 1) * 8
            if lv == level:
                return slot
            entry = self.ram.words.get(slot, 0)
            if not entry:
                entry = self.ram.alloc(self.granule) | TABLE
                self.ram.words[slot] = entry
            table = entry & 0x0000_FFFF_FFFF_F000
        raise AssertionError("unreachable")

    def map(self, va: int, pa: int, level: int = 3, attrs: int = ATTRS) -> None:
        self.ram.words[self.slot(va, level)] = pa | (PAGE if level == 3 else BLOCK) | attrs


IMAGE = kva(48, 0x8_1000_0000 + 0x20_0800)  # vectors in a KASLR-placed image


def image_tables(sctlr: int = 0) -> tuple[Ram, Tables, Arm64PageTables]:
    pt = page_tables({"TCR_EL1": tcr(48), "SCTLR": sctlr, "VBAR": IMAGE})
    ram = Ram()
    t = Tables(pt, ram)
    t.map(IMAGE & -M2, 0x4020_0000, level=2, attrs=PMD_SECT_AF | PMD_SECT_S | PMD_SECT_UXN | PMD_SECT_RDONLY)
    return ram, t, pt

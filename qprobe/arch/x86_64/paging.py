"""x86_64's page tables as the host walks them: 4 or 5 levels, 2 MiB and 1 GiB leaves, PTI's PGD pairs.

The host reads kernel virtual memory through its own walk over guest-physical
RAM (no VM stop), and maps the scratch area with one 2 MiB PMD entry into the
table that maps the kernel image (PML4[511] -> PUD[510], shared by every
process's page tables), so that code there is within +/-2 GiB of kernel text
(rel32 jumps and RIP-relative operands reach it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from qprobe.errors import MemoryFault, TargetError

PAGE_SIZE = 4096
_P, _PS = 0x1, 0x80
_ADDR = 0x000F_FFFF_FFFF_F000
_SHIFTS = (48, 39, 30, 21, 12)
CR4_LA57 = 1 << 12
# __START_KERNEL_map: the kernel image's virtual base (arch/x86/include/asm/page_64_types.h).
KERNEL_IMAGE_BASE = 0xFFFF_FFFF_8000_0000
PMD_SIZE = 2 << 20
_PMD_FLAGS = 0x1E3  # present, writable, accessed, dirty, 2 MiB page, global; NX clear


def paging_levels(cr4: int) -> int:
    """4, or 5 when CR4.LA57 is set (QEMU's ``-cpu max`` offers LA57 and Debian enables it)."""
    return 5 if cr4 & CR4_LA57 else 4


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


class X86PageTables:
    """The :class:`qprobe.arch.PageTables` of one x86_64 guest (its paging depth read from CR4)."""

    root_register = "cr3"
    # swapper_pg_dir is init_top_pgt on x86_64 (#define in arch/x86/include/asm/pgtable_64.h).
    kernel_root_symbol = "init_top_pgt"
    # x86_64_start_kernel has copied the image's mapping into init_top_pgt (setup_arch switches CR3 to it
    # later, but the early tables boot builds go away meanwhile).
    kernel_root_from = "start_kernel"
    image_base = KERNEL_IMAGE_BASE
    large_page = PMD_SIZE

    def __init__(self, levels: int = 4) -> None:
        self.levels = levels
        self.pti = True  # PGDs are PTI's 8 KiB pairs until the kernel is known (see learn)

    def learn(self, has_symbol: Callable[[str], bool]) -> None:
        """Whether the kernel has page-table isolation compiled in, so its PGDs are 8 KiB pairs.

        arch/x86/mm/pti.c (``pti_init``) is built only with CONFIG_MITIGATION_PAGE_TABLE_ISOLATION
        (CONFIG_PAGE_TABLE_ISOLATION before Linux 6.9); with it ``PGD_ALLOCATION_ORDER`` is 1
        (arch/x86/include/asm/pgalloc.h) even when PTI is off at run time, and CR3 bit 12 selects
        the user copy. A small config without it (minimal-6.12) allocates single-page PGDs, and a
        CR3 with bit 12 set is then just a PGD at an odd page.
        """
        self.pti = has_symbol("pti_init")

    def root(self, value: int) -> int:
        return kernel_pgd(value, self.pti)

    def root_for(self, vaddr: int, kernel: int, task: int | None) -> int:
        """A task's CR3 maps the kernel half as well as its own: its root walks every address."""
        return kernel if task is None else task

    def translate(self, read_u64: Callable[[int], int], root: int, vaddr: int) -> tuple[int, int, int]:
        return translate(read_u64, root, vaddr, self.levels)

    def large_page_table(self, read_u64: Callable[[int], int], root: int) -> int:
        """The physical address of the PMD table that maps the kernel image."""
        path = walk(read_u64, root, KERNEL_IMAGE_BASE, self.levels)
        pud_level = self.levels - 3  # PML5? PML4, PUD, PMD, PTE
        if len(path) <= pud_level + 1 or path[pud_level][1] & _PS:
            raise TargetError("the kernel image is not mapped through a PMD table")
        return path[pud_level][1] & _ADDR

    def large_page_entry(self, phys: int) -> int:
        """A kernel-text PMD entry for the 2 MiB at ``phys``: present, writable, executable, global."""
        return phys | _PMD_FLAGS

    def scratch_slots(self, image: range) -> Sequence[int]:
        """Above the image first, then below it, farthest first.

        The image's table maps [__START_KERNEL_map, +1 GiB). Without KASLR the image may use only
        its first KERNEL_IMAGE_SIZE (512 MiB) and the module area (MODULES_VADDR, allocated lowest
        first) begins there, so the slots just above the image are free for good. With
        CONFIG_RANDOMIZE_BASE, KERNEL_IMAGE_SIZE is 1 GiB (arch/x86/include/asm/page_64_types.h)
        and the modules start past this table: no slot of it is ever the kernel's but the image's.
        """
        return [*range(max(image.stop, 0), 512), *range(min(image.start, 512))]

    def task_size_max(self) -> int:
        """``TASK_SIZE_MAX``: ``(1 << __VIRTUAL_MASK_SHIFT) - PAGE_SIZE``.

        The shift is 47 with 4-level paging and 56 with 5-level (LA57); since Linux
        4.17 ("x86/mm: Make __VIRTUAL_MASK_SHIFT dynamic") one
        kernel picks it at boot, so it is a fact of the running guest, not of the build.
        """
        return (1 << (56 if self.levels == 5 else 47)) - PAGE_SIZE


def page_tables(regs: Mapping[str, int]) -> X86PageTables:
    """The page tables of the guest whose vCPU has ``regs`` (CR4 gives their depth)."""
    return X86PageTables(paging_levels(regs["cr4"]))


__all__ = ["KERNEL_IMAGE_BASE", "X86PageTables", "kernel_pgd", "page_tables", "paging_levels", "translate", "walk"]

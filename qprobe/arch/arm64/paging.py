"""arm64's page tables as the host walks them: the kernel half (TTBR1_EL1) and a task's (TTBR0_EL1), shaped by TCR_EL1.

Nothing about the shape is fixed by the architecture: TCR_EL1 says the
kernel half's virtual address size (T1SZ: VA_BITS, or the smaller size a
52-bit kernel falls back to) and its granule (TG1: 4K, 16K or 64K pages), so
the number of levels and the block sizes follow from it, as they do for the
MMU and for arch/arm64/include/asm/pgtable-hwdef.h's ARM64_HW_PGTABLE_LEVELS.
The user half is shaped the same way by T0SZ and TG0, and an address's bit
55 says which half (and so which root) translates it, as for the MMU.

The user half's root is TTBR0_EL1's, in kernel mode too: cpu_do_switch_mm
(arch/arm64/mm/context.c, 6.1 and 6.12) writes the next mm's table there
(with CnP; the ASID goes to TTBR1, as TCR_EL1.A1 is set: ``root`` drops
both), and with UNMAP_KERNEL_AT_EL0 (KPTI) the entry trampoline switches
only TTBR1 and its user ASID bit (tramp_map_kernel, entry.S).  A kernel
thread (init_mm) has reserved_pg_dir there, which maps nothing.  With
CONFIG_ARM64_SW_TTBR0_PAN, kernel code outside uaccess would run with
reserved_pg_dir in TTBR0 and the task's table saved in its
``thread_info.ttbr0``; the host does not read that (a kernel-mode read of
user memory there faults): the kernel does it only when
system_uses_ttbr0_pan(), that is without hardware PAN (asm/cpufeature.h),
which ``-cpu max`` has, and Debian's 6.1 cloud-arm64 config has
CONFIG_ARM64_PAN=y and SW_TTBR0_PAN unset.  A user-mode stop (every uprobe)
always has the task's table in TTBR0: kernel_exit restores it.

A descriptor is valid when bit 0 is set; above the last level, bit 1 tells a
table from a block.  Linux maps blocks only where its PUD or PMD may be a
section (pud_sect_supported(): PUD blocks with 4K pages only), so a block is
taken at level 1 (4K granule) or level 2 (any granule), and any other is no
mapping.

The scratch area (``qprobe.vmm.scratch``) is mapped as level-2 blocks (2 MiB
with 4K pages: ``large_page``) into the table that maps the running kernel
image, found through VBAR_EL1 (which holds ``vectors``, in the image's text):
KASLR places arm64's image anywhere in the vmalloc area, so its address is
read from the CPU, not from a link address.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from qprobe.arch.arm64.ptregs import SCTLR_EL1, TCR_EL1, VBAR_EL1
from qprobe.arch.arm64.traps import PC
from qprobe.errors import MemoryFault, TargetError

# TCR_EL1 fields (arch/arm64/include/asm/pgtable-hwdef.h; TCR_DS is 6.12's, for LPA2).
TCR_T0SZ_OFFSET = 0
TCR_T1SZ_OFFSET = 16
TCR_TxSZ_WIDTH = 6
TCR_TG0_SHIFT = 14
TCR_TG1_SHIFT = 30
TCR_TBI0 = 1 << 37  # the top byte of a user address is ignored (a tag): set by __cpu_setup (proc.S)
TCR_IPS_SHIFT = 32
TCR_DS = 1 << 59
# TG1's encodings -> PAGE_SHIFT (TCR_TG1_16K, TCR_TG1_4K, TCR_TG1_64K); 0 is reserved.
_TG1_PAGE_SHIFT = {1: 14, 2: 12, 3: 16}
# TG0's encodings -> PAGE_SHIFT (TCR_TG0_4K, TCR_TG0_64K, TCR_TG0_16K); 3 is reserved.
_TG0_PAGE_SHIFT = {0: 12, 1: 16, 2: 14}
_IPS_52 = 0b110  # TCR.IPS for a 52-bit physical address space (FEAT_LPA)

# Descriptor bits (pgtable-hwdef.h).
PMD_TYPE_SECT = 1 << 0  # valid, bit 1 clear: a block
PMD_TYPE_TABLE = 3 << 0
PTE_VALID = 1 << 0
PTE_TABLE_BIT = 1 << 1  # above the last level: a table; at the last level: a page
PMD_SECT_RDONLY = 1 << 7  # AP[2]
PMD_SECT_S = 3 << 8  # inner shareable
PMD_SECT_AF = 1 << 10
PMD_SECT_PXN = 1 << 53
PMD_SECT_UXN = 1 << 54
MT_NORMAL = 0  # the MAIR_EL1 index of Normal write-back memory (asm/memory.h, 6.1 and 6.12)
_ADDR_48 = 0x0000_FFFF_FFFF_F000  # output address bits [47:12]
TTBR_ASID_MASK = 0xFFFF << 48
TTBR_CNP_BIT = 1 << 0
SCTLR_ELx_WXN = 1 << 19  # every writable page is execute-never
SCTLR_ELx_ENIA = 1 << 31  # instruction address authentication with the A key
KERNEL_ROOT_SYMBOL = "swapper_pg_dir"
# setup_arch's paging_init maps the kernel into swapper_pg_dir and switches TTBR1_EL1 to it, freeing
# init_pg_dir; bootmem_init is the next function it calls (arch/arm64/kernel/setup.c, 6.1 and 6.12).
KERNEL_ROOT_FROM = "bootmem_init"
_BIT55 = 1 << 55  # the bit that selects the half: set, TTBR1's; clear, TTBR0's


@dataclass(frozen=True)
class Half:
    """One half's shape: its granule (``page_shift``) and its virtual address size (``va_bits``)."""

    page_shift: int
    va_bits: int

    @property
    def stride(self) -> int:
        """Index bits a table resolves: 8-byte descriptors in one page."""
        return self.page_shift - 3

    @property
    def levels(self) -> int:
        """ARM64_HW_PGTABLE_LEVELS(va_bits): ((va_bits) - 4) / (PAGE_SHIFT - 3), the same as this ceiling."""
        return -(-(self.va_bits - self.page_shift) // self.stride)

    @property
    def first_block_level(self) -> int:
        """Linux's PUD sections are 4K-granule only (pud_sect_supported()): blocks at level 1 or 2, else 2."""
        return 1 if self.page_shift == 12 else 2

    def shift(self, level: int) -> int:
        """The address bit a level's index starts at: PAGE_SHIFT at level 3, one stride more each level up."""
        return self.page_shift + self.stride * (3 - level)


def _user_half(tcr: int, kernel: Half) -> Half | None:
    """TTBR0's half from T0SZ and TG0, or None where they give no shape to walk.

    Linux gives both halves one granule (TCR_TG_FLAGS, proc.S): the descriptors' output addresses are
    read as the kernel half's granule lays them out, so a user half with another granule is not walked.
    """
    page_shift = _TG0_PAGE_SHIFT.get(tcr >> TCR_TG0_SHIFT & 3)
    va_bits = 64 - (tcr >> TCR_T0SZ_OFFSET & (1 << TCR_TxSZ_WIDTH) - 1)
    if page_shift != kernel.page_shift or not kernel.page_shift < va_bits <= 52:
        return None
    return Half(page_shift, va_bits)


class Arm64PageTables:
    """The :class:`qprobe.arch.PageTables` of one arm64 guest, from its TCR_EL1 and SCTLR_EL1.

    ``image``: an address in the running kernel image (VBAR_EL1's ``vectors``), or
    None before the kernel has set one (early boot): the scratch area's table is then
    not known.  From SCTLR_EL1: WXN, under which no writable mapping executes, and
    EnIA, which the kernel sets at every entry when it uses address authentication
    (ptrauth_enable() and kernel_entry, only if system_supports_address_auth()).
    """

    kernel_root_symbol = KERNEL_ROOT_SYMBOL
    kernel_root_from = KERNEL_ROOT_FROM

    def __init__(self, tcr: int, sctlr: int = 0, image: int | None = None) -> None:
        tg1 = tcr >> TCR_TG1_SHIFT & 3
        if tg1 not in _TG1_PAGE_SHIFT:
            raise TargetError(f"TCR_EL1 {tcr:#x} gives the kernel half no granule (TG1 is {tg1})")
        self.tcr = tcr
        self.page_shift = _TG1_PAGE_SHIFT[tg1]
        self.stride = self.page_shift - 3  # index bits a table resolves: 8-byte descriptors in one page
        # vabits_actual: 6.12's asm/memory.h reads it from T1SZ, as the MMU does (6.1 keeps it in a variable).
        self.va_bits = 64 - (tcr >> TCR_T1SZ_OFFSET & (1 << TCR_TxSZ_WIDTH) - 1)
        if not self.page_shift < self.va_bits <= 52:
            raise TargetError(f"TCR_EL1 {tcr:#x} gives the kernel half {self.va_bits}-bit addresses")
        self.kernel = Half(self.page_shift, self.va_bits)
        self.levels = self.kernel.levels
        self.user = _user_half(tcr, self.kernel)
        self.tbi0 = bool(tcr & TCR_TBI0)
        self.lpa2 = bool(tcr & TCR_DS)  # 4K/16K pages with 52-bit output addresses (FEAT_LPA2)
        self.pa52 = self.lpa2 or (self.page_shift == 16 and tcr >> TCR_IPS_SHIFT & 7 == _IPS_52)
        self.large_page = 1 << (self.page_shift + self.stride)  # a level-2 block: a PMD section
        self.wxn = bool(sctlr & SCTLR_ELx_WXN)
        # ptrauth_kernel_pac_mask(), GENMASK_ULL(63, vabits_actual): the bits a PAC takes in a kernel pointer.
        self.pac_mask = -(1 << self.va_bits) & (1 << 64) - 1 if sctlr & SCTLR_ELx_ENIA else 0
        self.image = image if image is not None and self.is_kernel_address(image) else None
        # The address the large-page table's first entry maps (scratch.py counts its slots from there).
        span = self.large_page << self.stride
        self.image_base = self.image & -span if self.image is not None else 0

    def learn(self, has_symbol: Callable[[str], bool]) -> None:
        """Nothing of the walk depends on the kernel's build: TCR_EL1 says it all."""

    def is_kernel_address(self, vaddr: int) -> bool:
        """Whether ``vaddr`` is in TTBR1's half: bits 63 down to va_bits all set."""
        return vaddr >> self.va_bits == (1 << (64 - self.va_bits)) - 1

    def is_user_address(self, vaddr: int) -> bool:
        """Whether ``vaddr`` is in TTBR0's half: bits 63 (55 under TBI0: the top byte is a tag) down to T0SZ's
        size all clear."""
        if self.user is None:
            return False
        return not (vaddr & (1 << 56) - 1 if self.tbi0 else vaddr) >> self.user.va_bits

    def root_for(self, vaddr: int, kernel: int, task: int | None) -> int:
        """TTBR1's root (``kernel``) for an address with bit 55 set, the task's TTBR0 root otherwise."""
        if vaddr & _BIT55:
            return kernel
        if task is None:
            raise MemoryFault(vaddr, "a user address, and no task's TTBR0_EL1 to translate it")
        return task

    def root(self, value: int) -> int:
        """The physical table TTBR1_EL1 points at: its BADDR, without the ASID (bits 63:48) or CnP (bit 0).

        With 52-bit output addresses, BADDR's bits 51:48 are the register's bits 5:2 (phys_to_ttbr()).
        """
        if self.pa52:
            return value & 0x0000_FFFF_FFFF_FFC0 | (value >> 2 & 0xF) << 48
        return value & ~(TTBR_ASID_MASK | TTBR_CNP_BIT)

    def _output_address(self, entry: int) -> int:
        """A descriptor's output address (next table, block or page), before the block's own alignment."""
        addr = entry & _ADDR_48 & -(1 << self.page_shift)
        if self.lpa2:  # bits 49:48 in place, 51:50 in descriptor bits 9:8
            addr |= entry & (3 << 48) | (entry >> 8 & 3) << 50
        elif self.pa52:  # 64K pages (FEAT_LPA): bits 51:48 in descriptor bits 15:12
            addr |= (entry >> 12 & 0xF) << 48
        return addr

    def half(self, vaddr: int) -> Half:
        """The shape of the half ``vaddr`` is in (MemoryFault: in neither)."""
        if self.is_kernel_address(vaddr):
            return self.kernel
        if self.user is not None and self.is_user_address(vaddr):
            return self.user
        raise MemoryFault(vaddr, "in neither half of the address space")

    def walk(self, read_u64: Callable[[int], int], root: int, vaddr: int) -> list[tuple[int, int]]:
        """The path of ``vaddr`` from ``root`` (its half's: see root_for): (table physical address,
        descriptor) per level, top first.

        Stops at the leaf (a page or a block) or at the first descriptor that maps nothing (included).
        """
        half = self.half(vaddr)
        path: list[tuple[int, int]] = []
        table = root
        top = 4 - half.levels  # level 0 with 4 levels, 1 with 3, -1 with 52-bit LPA2's 5
        for level in range(top, 4):
            shift = half.shift(level)
            bits = half.va_bits - shift if level == top else half.stride
            entry = read_u64(table + (vaddr >> shift & (1 << bits) - 1) * 8)
            path.append((table, entry))
            if not entry & PTE_VALID or level == 3 or not entry & PTE_TABLE_BIT:
                break
            table = self._output_address(entry)
        return path

    def translate(self, read_u64: Callable[[int], int], root: int, vaddr: int) -> tuple[int, int, int]:
        """Walk ``vaddr``'s half from ``root``: (physical address, page or block size, leaf descriptor);
        MemoryFault if unmapped."""
        half = self.half(vaddr)
        path = self.walk(read_u64, root, vaddr)
        entry, level = path[-1][1], 4 - half.levels + len(path) - 1
        if not entry & PTE_VALID or (level == 3) != bool(entry & PTE_TABLE_BIT) or level < half.first_block_level:
            raise MemoryFault(vaddr)
        size = 1 << half.shift(level)
        return self._output_address(entry) & -size | vaddr & size - 1, size, entry

    def large_page_table(self, read_u64: Callable[[int], int], root: int) -> int:
        """The physical address of the level-2 table (PMD) that maps the running kernel image."""
        if self.image is None:
            raise TargetError("VBAR_EL1 does not point into the kernel yet: where its image runs is not known")
        path = self.walk(read_u64, root, self.image)
        pmd = 2 - (4 - self.levels)  # the level-2 table's place in the path
        if len(path) <= pmd:  # the walk stopped above it: no table, or a block, on the way
            raise TargetError("the kernel image is not mapped through a PMD table")
        return path[pmd][0]

    def large_page_entry(self, phys: int) -> int:
        """A level-2 block of kernel memory at ``phys``: PROT_SECT_NORMAL_EXEC (asm/pgtable-prot.h, 6.1 and 6.12).

        Valid, accessed, Normal memory, inner shareable (no SH bits under LPA2, where they hold
        output address bits: PMD_MAYBE_SHARED), writable and executable at EL1 (AP[2] and PXN
        clear: the guest runs the stubs there and writes their rings), never executable at EL0
        (UXN), global.
        """
        if phys & self.large_page - 1:
            raise TargetError(f"{phys:#x} is not aligned to the {self.large_page:#x}-byte block it would map")
        if self.wxn:
            raise TargetError("SCTLR_EL1.WXN is set: a writable block of code would never execute")
        addr = phys & _ADDR_48
        if self.lpa2:
            addr |= phys & (3 << 48) | (phys >> 50 & 3) << 8
        elif self.pa52:
            addr |= (phys >> 48 & 0xF) << 12
        shared = 0 if self.lpa2 else PMD_SECT_S
        return addr | PMD_TYPE_SECT | PMD_SECT_AF | shared | MT_NORMAL << 2 | PMD_SECT_UXN

    def scratch_slots(self, image: range) -> Sequence[int]:
        """Below the image first, nearest first; then the table's top, downward.

        vmalloc's area starts where the image does (VMALLOC_START is MODULES_END, KIMAGE_VADDR
        since Linux 4.6) and vmalloc hands out the lowest free range (find_vmap_lowest_match):
        without KASLR every vmalloc allocation (each fork's VMAP stack) lands just above the image,
        and a block there would be walked as their table. Modules are allocated lowest first in
        a 128 MiB window that ends with the image (at _etext in 6.1, arch/arm64/kernel/kaslr.c; at
        _end since 6.5, module_init_limits), so the slot just below the image is the last they
        take. With KASLR the image sits far above VMALLOC_START and either side is free.
        """
        return [*range(min(image.start, 512) - 1, -1, -1), *range(511, max(image.stop, 0) - 1, -1)]

    def task_size_max(self) -> int:
        """TASK_SIZE_64, ``1 << vabits_actual`` (asm/processor.h), where user addresses end: TTBR0's half's size.

        From T0SZ, which cpu_uninstall_idmap sets to TCR_T0SZ(vabits_actual) for every task (the
        identity map widens it only while it is installed, in early boot and around suspend); from
        T1SZ, the same size, where TCR_EL1 gives TTBR0 no shape.
        """
        return 1 << (self.user.va_bits if self.user is not None else self.va_bits)


class MmuOff:
    """The :class:`qprobe.arch.PageTables` of a vCPU whose MMU is off (at reset, in the boot stub or the
    kernel's first instructions): no virtual address is mapped, so nothing walks them.  Boot-time probes
    read physical memory until they stop the boot CPU with its MMU on (qprobe.kernel.bootswitch)."""

    kernel_root_symbol = KERNEL_ROOT_SYMBOL
    kernel_root_from = KERNEL_ROOT_FROM
    levels = 0
    image_base = 0
    large_page = 0

    def learn(self, has_symbol: Callable[[str], bool]) -> None:
        """Nothing to learn: there are no tables."""

    def root(self, value: int) -> int:
        return value

    def root_for(self, vaddr: int, kernel: int, task: int | None) -> int:
        return kernel

    def translate(self, read_u64: Callable[[int], int], root: int, vaddr: int) -> tuple[int, int, int]:
        raise MemoryFault(vaddr, "the vCPU's MMU is off: no virtual address is mapped yet")

    def large_page_table(self, read_u64: Callable[[int], int], root: int) -> int:
        raise TargetError("the vCPU's MMU is off: the kernel image is not mapped yet")

    def large_page_entry(self, phys: int) -> int:
        raise TargetError("the vCPU's MMU is off: the kernel image is not mapped yet")

    def scratch_slots(self, image: range) -> Sequence[int]:
        raise TargetError("the vCPU's MMU is off: the kernel image is not mapped yet")

    def task_size_max(self) -> int:
        raise TargetError("the vCPU's MMU is off: there is no user address space yet")


def page_tables(regs: Mapping[str, int]) -> Arm64PageTables:
    """The page tables of the guest whose vCPU has ``regs`` (TCR_EL1, VBAR_EL1 and SCTLR_EL1 of a stop).

    Where the image runs is VBAR_EL1's ``vectors``; before ``__primary_switched`` has set it, the pc of a
    vCPU stopped in the kernel's text (the boot CPU's first virtual instruction, for boot-time probes)."""
    image = regs.get(VBAR_EL1)
    if not image or image >> 63 == 0:
        image = regs.get(PC)
    return Arm64PageTables(regs[TCR_EL1], regs.get(SCTLR_EL1, 0), image)


__all__ = [
    "KERNEL_ROOT_FROM",
    "KERNEL_ROOT_SYMBOL",
    "MT_NORMAL",
    "PMD_SECT_AF",
    "PMD_SECT_PXN",
    "PMD_SECT_RDONLY",
    "PMD_SECT_S",
    "PMD_SECT_UXN",
    "PMD_TYPE_SECT",
    "PMD_TYPE_TABLE",
    "PTE_TABLE_BIT",
    "PTE_VALID",
    "TCR_DS",
    "Arm64PageTables",
    "MmuOff",
    "SCTLR_ELx_ENIA",
    "SCTLR_ELx_WXN",
    "page_tables",
]

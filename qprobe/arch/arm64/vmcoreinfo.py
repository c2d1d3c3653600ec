"""arm64's VMCOREINFO lines, as the kernel writes them, for a kernel that exports none.

The generic lines (OSRELEASE, PAGESIZE, KERNELOFFSET, ...) are
``qprobe.kernel.program``'s; these are what arm64 adds: swapper_pg_dir's
address (VMCOREINFO_SYMBOL_ARRAY in kernel/crash_core.c, 6.1;
kernel/vmcore_info.c, 6.12) and arch_crash_save_vmcoreinfo()'s numbers
(arch/arm64/kernel/crash_core.c, 6.1; vmcore_info.c, 6.12), each in the
kernel's own format so that a line compares equal to the guest's.  drgn
reads VA_BITS, TCR_EL1_T1SZ, kimage_voffset (to walk swapper_pg_dir by its
physical address) and KERNELPACMASK (to strip return addresses a PAC signed).
The numbers that only describe the build's layout (MODULES_VADDR,
VMALLOC_START..., which moved between 6.1 and 6.12) are left out: nothing
reads them.
"""

from __future__ import annotations

from collections.abc import Callable

from qprobe.arch.arm64.paging import KERNEL_ROOT_SYMBOL, Arm64PageTables

_U64 = (1 << 64) - 1


def arch_crash_save_vmcoreinfo(
    address: Callable[[str], int],
    virt_to_phys: Callable[[int], int],
    read_u64: Callable[[int], int],
    paging: Arm64PageTables,
) -> list[str]:
    """The lines, from the symbols (``address``), the page walk, kernel memory (``read_u64``) and the
    registers' view of the address space (``paging``: TCR_EL1 and SCTLR_EL1 at a kernel-mode stop).

    - ``VA_BITS`` is CONFIG_ARM64_VA_BITS, a build option no symbol records; written as the size
      TCR_EL1 gives, which is the same but for a 52-bit build on a CPU without 52-bit addresses
      (QEMU's ``max`` has them).
    - ``kimage_voffset`` is what __pa_symbol() subtracts from an image address: _stext's virtual
      address less its physical one, as head.S computes the kernel's variable.  Not from that variable,
      which boot-time probes read before __primary_switched stores it; not through _text, whose header
      page swapper_pg_dir does not map (paging_init's map_kernel maps the image from _stext on).
    - ``PHYS_OFFSET`` is ``memstart_addr`` (asm/memory.h), a variable set at boot.
    - ``KERNELPACMASK`` is ptrauth_kernel_pac_mask() with address authentication in use, else 0.
    """
    stext = address("_stext")
    return [
        f"SYMBOL(swapper_pg_dir)={address(KERNEL_ROOT_SYMBOL):x}",
        f"NUMBER(VA_BITS)={paging.va_bits}",
        f"NUMBER(kimage_voffset)={stext - virt_to_phys(stext) & _U64:#x}",
        f"NUMBER(PHYS_OFFSET)={read_u64(address('memstart_addr')) & _U64:#x}",
        f"NUMBER(TCR_EL1_T1SZ)={64 - paging.va_bits:#x}",
        f"NUMBER(KERNELPACMASK)={paging.pac_mask:#x}",
    ]


__all__ = ["arch_crash_save_vmcoreinfo"]

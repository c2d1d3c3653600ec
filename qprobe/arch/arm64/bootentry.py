"""Where arm64's boot first runs at the kernel's virtual addresses, and how far a stopped vCPU has come.

The boot loader enters the Image at ``primary_entry`` with the MMU off, at
physical addresses.  ``__primary_switch`` turns the MMU on with the identity
map, maps (and, with KASLR, relocates) the kernel, then leaves the identity
map with ``ldr x8, =__primary_switched; br x8`` (arch/arm64/kernel/head.S,
6.1 and 6.12 alike; 6.12 maps the kernel from ``__pi_early_map_kernel``
first): the literal is relocated by the slide, so ``__primary_switched`` at
its link address plus the slide is the first instruction run at a virtual
address.  Secondary CPUs leave theirs the same way for ``__secondary_switched``.

QEMU's ``virt`` machine (hw/arm/boot.c, 7.2) starts vCPU 0 of a ``-kernel``
boot at ``info->loader_start``, the start of RAM, where its boot stub loads
the DTB's address into x0 and branches to the Image; with firmware instead,
at the reset vector RVBAR, 0 (the flash).  Either way with SCTLR_EL1.M clear:
the MMU comes on in the kernel's ``__enable_mmu``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import BootStage
from qprobe.arch.arm64.traps import PC

# QEMU 7.2's gdbstub names SCTLR_EL1 by its ARMCPRegInfo, "SCTLR" (one definition for the AArch32 and
# AArch64 views, ARM_CP_STATE_BOTH in target/arm/helper.c).
SCTLR_EL1 = "SCTLR"
SCTLR_ELx_M = 1 << 0  # arch/arm64/include/asm/sysreg.h: stage 1 translation (the MMU) on

# hw/arm/virt.c's memory map puts RAM at 1 GiB (VIRT_MEM), where a -kernel boot's stub starts; the
# flash at 0 holds a firmware's reset vector (RVBAR_EL1, QEMU's rvbar property, 0 by default).
VIRT_RAM_BASE = 0x4000_0000
RESET_PCS = frozenset({0, VIRT_RAM_BASE})

# The first function run at a virtual address (head.S's ``ldr x8, =__primary_switched; br x8``).
BOOT_VIRTUAL_ENTRY = "__primary_switched"


def arch_boot_entry(read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
    """The link address of ``__primary_switched``; SymbolError (``address``'s) if vmlinux has none.

    vmlinux's bytes cannot say more: arm64 links with ``--no-apply-dynamic-relocs``, so the literal
    ``__primary_switch`` branches through is 0 in the file until the kernel relocates itself.
    """
    return address(BOOT_VIRTUAL_ENTRY)


def boot_stage(regs: Mapping[str, int]) -> BootStage:
    """SCTLR_EL1.M set: the kernel runs (its idmap included); clear at RESET_PCS: the vCPU has run nothing;
    clear elsewhere: the boot stub, firmware, or the kernel before ``__enable_mmu``.  A stub that shows
    no SCTLR cannot tell: the kernel is taken to run, as an attach expects."""
    if regs.get(SCTLR_EL1, SCTLR_ELx_M) & SCTLR_ELx_M:
        return BootStage.KERNEL
    return BootStage.RESET if regs[PC] in RESET_PCS else BootStage.EARLY


__all__ = ["BOOT_VIRTUAL_ENTRY", "RESET_PCS", "SCTLR_EL1", "arch_boot_entry", "boot_stage"]

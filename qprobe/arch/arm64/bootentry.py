"""Where arm64's boot first runs at the kernel's virtual addresses, and how far a stopped vCPU has come.

The boot loader enters the Image at ``primary_entry`` with the MMU off, at
physical addresses.  ``__primary_switch`` turns the MMU on with the identity
map, maps (and, with KASLR, relocates) the kernel, then leaves the identity
map with ``ldr x8, =__primary_switched; br x8`` (arch/arm64/kernel/head.S,
6.1 and 6.12 alike; 6.12 maps the kernel from ``__pi_early_map_kernel``
first): the literal is relocated by the slide, so ``__primary_switched`` at
its link address plus the slide is the first instruction run at a virtual
address.  Secondary CPUs leave theirs the same way for ``__secondary_switched``.

Where a vCPU comes out of reset is the board's (``qprobe.vmm.boards``): this
module tells only whether the MMU is on.  The kernel relocates itself, so the
host cannot guess the slide beforehand as it does with x86's decompressor: it
stops the boot CPU on that ``br x8`` (``arch_boot_switch``), still at the
identity map's physical address, and steps it once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import BootStage
from qprobe.errors import TargetError

# QEMU 7.2's gdbstub names SCTLR_EL1 by its ARMCPRegInfo, "SCTLR" (one definition for the AArch32 and
# AArch64 views, ARM_CP_STATE_BOTH in target/arm/helper.c).
SCTLR_EL1 = "SCTLR"
SCTLR_ELx_M = 1 << 0  # arch/arm64/include/asm/sysreg.h: stage 1 translation (the MMU) on

# The first function run at a virtual address (head.S's ``ldr x8, =__primary_switched; br x8``).
BOOT_VIRTUAL_ENTRY = "__primary_switched"
BOOT_SWITCH = "__primary_switch"
BR_X8 = 0xD61F0100  # br x8: BR's encoding 0xd61f0000 with Rn = 8
# How far into __primary_switch the branch may be: 28 instructions on 6.1 (with KASLR), 13 on 6.12.
SWITCH_SEARCH = 64 * 4


def arch_boot_entry(read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
    """The link address of ``__primary_switched``; SymbolError (``address``'s) if vmlinux has none.

    vmlinux's bytes cannot say more: arm64 links with ``--no-apply-dynamic-relocs``, so the literal
    ``__primary_switch`` branches through is 0 in the file until the kernel relocates itself.
    """
    return address(BOOT_VIRTUAL_ENTRY)


def arch_boot_switch(read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
    """The link address of ``__primary_switch``'s ``br x8`` to ``__primary_switched``; SymbolError
    (``address``'s) if vmlinux has no such function, TargetError if the branch is not in it."""
    start = address(BOOT_SWITCH)
    code = read(start, SWITCH_SEARCH)
    for offset in range(0, len(code) - 3, 4):
        if int.from_bytes(code[offset : offset + 4], "little") == BR_X8:
            return start + offset
    raise TargetError(f"no 'br x8' in the first {SWITCH_SEARCH // 4} instructions of {BOOT_SWITCH}: "
                      "this kernel enters its virtual addresses in a way qprobe does not know")  # fmt: skip


def boot_stage(regs: Mapping[str, int]) -> BootStage:
    """SCTLR_EL1.M set: the kernel runs (its idmap included); clear: the boot stub, firmware, or the kernel
    before ``__enable_mmu`` (the board knows its reset pcs, which are RESET).  A stub that shows no SCTLR
    cannot tell: the kernel is taken to run, as an attach expects."""
    if regs.get(SCTLR_EL1, SCTLR_ELx_M) & SCTLR_ELx_M:
        return BootStage.KERNEL
    return BootStage.EARLY


class Arm64Boot:
    """The :class:`qprobe.arch.Boot` facet of arm64: this module's functions."""

    boot_stage = staticmethod(boot_stage)
    arch_boot_entry = staticmethod(arch_boot_entry)
    arch_boot_switch = staticmethod(arch_boot_switch)


__all__ = [
    "BOOT_SWITCH",
    "BOOT_VIRTUAL_ENTRY",
    "BR_X8",
    "SCTLR_EL1",
    "Arm64Boot",
    "arch_boot_entry",
    "arch_boot_switch",
    "boot_stage",
]

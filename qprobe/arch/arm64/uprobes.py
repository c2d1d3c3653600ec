"""arm64's :class:`qprobe.arch.Uprobes`: what arch/arm64/kernel/probes/uprobes.c answers that qprobe needs.

qprobe steps a probed user instruction in place under a gdbstub breakpoint
(nothing written into the guest, no out-of-line slot), so of the kernel's
hooks it needs only which instructions the kernel would refuse, whether a
step ended on a fault, and where a function's return goes.  The instructions
the kernel simulates for its uprobes as for its kprobes (arm_probe_decode_insn's
INSN_GOOD_NO_SLOT: branches, adr/adrp, literal loads; arch_uprobe_skip_sstep)
are performed on the host instead of stepped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import Registers, UserMemory
from qprobe.arch.arm64 import decode, returns
from qprobe.arch.arm64.insn import AARCH64_INSN_SIZE
from qprobe.arch.arm64.kprobes import simulate_at
from qprobe.arch.arm64.ptregs import PSR_MODE32_BIT

# The decoder as the newest kernel qprobe follows decodes (decode.NEWEST, 6.12): Debian's 6.1 is a stable
# 6.1.1xx with "Remove broken LDR (literal) uprobe support" backported (6.1.113), so it refuses LDR
# (literal) as 6.12 does.  The one other difference, MOPS (refused from 6.12.2), is moot on 6.1, which has
# no FEAT_MOPS support at all.  The Uprobes seam is given no kernel version.
UPROBE_DECODE_VERSION = decode.NEWEST

DBG_SPSR_SS = 1 << 21  # PSTATE.SS: a debugger single-steps the task and wants its step exception after it
# Stage-1 descriptor bits (the ARM ARM's VMSAv8-64 descriptors; asm/pgtable-hwdef.h names them).
_PTE_VALID, _PTE_USER, _PTE_RDONLY, _PTE_AF = 1 << 0, 1 << 6, 1 << 7, 1 << 10  # AP[1], AP[2]
_PTE_UXN = 1 << 54


class Arm64Uprobes:
    """Which user instructions may be probed, a step that faulted, and a function's return at its entry."""

    # UPROBE_SWBP_INSN_SIZE (asm/uprobes.h): uprobe_register() refuses an offset not aligned to it (EINVAL).
    uprobe_swbp_insn_size = AARCH64_INSN_SIZE

    def arch_uprobe_analyze_insn(self, code: bytes) -> str | None:
        """The uprobe BRK is refused (ENOTSUPP), and what arm_probe_decode_insn rejects (EINVAL).

        The instruction's bytes past the file's end read as zero, as the page cache holds them.
        """
        return decode.arch_uprobe_analyze_insn(code, UPROBE_DECODE_VERSION)

    def arch_uprobe_xol_was_trapped(self, code: bytes, after: Mapping[str, int]) -> bool:
        return returns.arch_uprobe_xol_was_trapped(code, after)

    def arch_uretprobe_frame(self, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]:
        """The return address is in x30 (``bl`` put it there, before any ``paciasp`` signs it); ``ret`` leaves sp."""
        return returns.arch_uretprobe_frame(regs, read)

    def arch_uprobe_emulate(self, regs: Registers, mem: UserMemory) -> bool:
        """What the decoder simulates (the kernel's arch_uprobe_skip_sstep: simulate_* of simulate-insn.c), on
        the word at pc fetched as the task would; False: it is stepped."""
        if regs.pstate & (DBG_SPSR_SS | PSR_MODE32_BIT):  # stepping, or an AArch32 task: stepped
            return False
        return simulate_at(mem.fetch, regs, mem, UPROBE_DECODE_VERSION)

    def user_page_allows(self, entry: int, access: str) -> bool:
        """EL0 reads need AP[1] and writes AP[2] clear too (writable and, whether or not the hardware manages the
        dirty state, dirty); fetches need UXN clear; every access the access flag set."""
        if entry & (_PTE_VALID | _PTE_AF) != _PTE_VALID | _PTE_AF:
            return False
        if access == "fetch":
            return not entry & _PTE_UXN
        return bool(entry & _PTE_USER) and (access == "read" or not entry & _PTE_RDONLY)


__all__ = ["UPROBE_DECODE_VERSION", "Arm64Uprobes"]

"""arm64's :class:`qprobe.arch.Uprobes`: what arch/arm64/kernel/probes/uprobes.c answers that qprobe needs.

qprobe steps a probed user instruction in place under a gdbstub breakpoint
(nothing written into the guest, no out-of-line slot), so of the kernel's
hooks it needs only which instructions the kernel would refuse, whether a
step ended on a fault, and where a function's return goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch.arm64 import decode, returns
from qprobe.arch.arm64.insn import AARCH64_INSN_SIZE

# The decoder as the newest kernel qprobe follows decodes (decode.NEWEST, 6.12): Debian's 6.1 is a stable
# 6.1.1xx with "Remove broken LDR (literal) uprobe support" backported (6.1.113), so it refuses LDR
# (literal) as 6.12 does.  The one other difference, MOPS (refused from 6.12.2), is moot on 6.1, which has
# no FEAT_MOPS support at all.  The Uprobes seam is given no kernel version.
UPROBE_DECODE_VERSION = decode.NEWEST


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


__all__ = ["UPROBE_DECODE_VERSION", "Arm64Uprobes"]

"""x86's :class:`qprobe.arch.Uprobes`: the answers of arch/x86/kernel/uprobes.c qprobe's user-space probes need."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from iced_x86 import Code, Decoder

# Instructions that enter the kernel on purpose: a step that ends there is no fault to restart.
_SYSTEM_CALLS = frozenset({Code.SYSCALL, Code.SYSENTER, Code.INT_IMM8, Code.INT3, Code.INTO, Code.INT1})


class X86Uprobes:
    """Which user instructions may be probed, a step that faulted, and a function's return at its entry."""

    uprobe_swbp_insn_size = 1  # UPROBE_SWBP_INSN_SIZE (asm/uprobes.h): the int3's one byte

    def arch_uprobe_analyze_insn(self, code: bytes) -> str | None:
        """The kernel refuses an int3 as the probed instruction (``is_trap_insn``, -ENOTSUPP): it would be
        its own trap.  It also refuses what its decoder cannot read; an instruction qprobe steps in place
        needs no table of what can run out of line."""
        insn = Decoder(64, code[:16]).decode()
        if insn.code == Code.INVALID:
            return "an instruction the decoder cannot read (EINVAL)"
        if insn.code == Code.INT3:
            return "an int3 is there already (ENOTSUPP)"
        return None

    def arch_uprobe_xol_was_trapped(self, code: bytes, after: Mapping[str, int]) -> bool:
        if after["cs"] & 3:  # still in user mode: the instruction completed
            return False
        return Decoder(64, code[:16]).decode().code not in _SYSTEM_CALLS

    def arch_uretprobe_frame(self, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]:
        """At a function's first instruction ``call`` has pushed the return address at rsp; ``ret`` pops it."""
        sp = regs["rsp"]
        return int.from_bytes(read(sp, 8), "little"), sp + 8


__all__ = ["X86Uprobes"]

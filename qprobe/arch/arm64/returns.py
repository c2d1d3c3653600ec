"""arm64's return address at a function's entry: the link register, for kretprobes and uretprobes.

``bl`` leaves the return address in x30 and moves no stack pointer; ``ret``
branches to x30 and leaves sp as the function found it (AAPCS64: sp is
callee-saved).  So at a function's first instruction the return address is a
register, not a stack slot, and the frame a return comes back with is the
entry's sp (``ret_pops`` 0).  The kernel's arch_prepare_kretprobe
(arch/arm64/kernel/probes/kprobes.c) and arch_uretprobe_hijack_return_addr
(uprobes.c, ``procedure_link_pointer``) replace x30 the same way.  x30 is
still the plain return address there: pointer authentication signs it with
the function's ``paciasp``, which a replaced one then goes through as well.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import Registers, ReturnHijack
from qprobe.arch.arm64.traps import CPSR, pstate_user_mode

# pt_regs' name of the link register (regs[30]; kprobe_events' %x30, also %lr), and the gdbstub's
# names (QEMU 7.2's aarch64-core.xml) of it and of the stack pointer.
LR = "x30"
GDB_LR, GDB_SP = "x30", "sp"
RET_POPS = 0  # ``ret`` moves no stack pointer: at the trampoline, sp is the entry's

# arch/arm64/include/asm/insn.h: __AARCH64_INSN_FUNCS(svc, 0xFFE0001F, 0xD4000001) and (brk, 0xFFE0001F,
# 0xD4200000)
_SVC_MASK, _SVC_VALUE = 0xFFE0001F, 0xD4000001
_BRK_MASK, _BRK_VALUE = 0xFFE0001F, 0xD4200000


def aarch64_insn_is_svc(code: bytes) -> bool:
    """Whether the instruction at ``code`` is an ``svc #imm``: a system call."""
    return len(code) >= 4 and int.from_bytes(code[:4], "little") & _SVC_MASK == _SVC_VALUE


def aarch64_insn_is_brk(code: bytes) -> bool:
    """Whether the instruction at ``code`` is a ``brk #imm``: a breakpoint of the kernel's own (its uprobes'
    ``brk #0x005``), whose handler goes on past it."""
    return len(code) >= 4 and int.from_bytes(code[:4], "little") & _BRK_MASK == _BRK_VALUE


def arch_prepare_kretprobe(regs: Registers, read_u64: Callable[[int], int]) -> ReturnHijack:
    """At a function's first instruction the return address is in x30, which the core sets in the trapped
    context (nothing on the stack to read: ``read_u64`` goes unused)."""
    return ReturnHijack(getattr(regs, LR), register=LR)


def arch_uretprobe_frame(regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]:
    """A user function's return address (x30) and the stack pointer after its ``ret`` (sp, unchanged)."""
    return regs[GDB_LR], regs[GDB_SP]


def arch_uprobe_xol_was_trapped(code: bytes, after: Mapping[str, int]) -> bool:
    """Whether the stepped user instruction ``code`` ended in the kernel on a fault it runs again after.

    The step ended at EL1 (PSTATE.M no longer EL0t) and the instruction was no ``svc``, which enters
    the kernel on purpose and returns past itself, nor a ``brk``: the guest's own uprobe on the same
    instruction, whose handler runs the instruction it displaced and returns past it.  The kernel asks the
    same of the task's ``thread.fault_code``, which only a fault sets (arch/arm64/kernel/probes/uprobes.c).
    """
    entered = aarch64_insn_is_svc(code) or aarch64_insn_is_brk(code)
    return not pstate_user_mode(after[CPSR]) and not entered


__all__ = [
    "LR",
    "RET_POPS",
    "aarch64_insn_is_svc",
    "arch_prepare_kretprobe",
    "arch_uprobe_xol_was_trapped",
    "arch_uretprobe_frame",
]

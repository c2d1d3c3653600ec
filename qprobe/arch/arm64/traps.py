"""arm64's trap entry: the synchronous-exception vector every kernel-mode BRK enters, and what a stop there is.

arm64 has no breakpoint-only entry.  Every synchronous exception taken at EL1
with SP_EL1 selected (the kernel's EL1h) enters ``vectors`` at VBAR_EL1 +
0x200, whose ``kernel_ventry 1, h, 64, sync`` moves sp down by
``PT_REGS_SIZE`` and branches to ``el1h_64_sync`` (arch/arm64/kernel/entry.S,
6.1 and 6.12 alike).  With CONFIG_VMAP_STACK the vector checks sp for an
overflow in between: ``add sp, sp, x0; sub x0, sp, x0; tbnz x0, #THREAD_SHIFT,
0f; sub x0, sp, x0; sub sp, sp, x0`` puts x0 and sp back as they were (an
overflow branches to ``__bad_stack`` instead and never reaches the entry), and
none of those instructions sets the flags.  So when ``el1h_64_sync``'s first
instruction runs, every general register is the trapped context's, sp is the
trapped sp minus ``PT_REGS_SIZE``, and ``kernel_entry`` has saved nothing yet;
ELR_EL1 holds the trapped pc (a BRK's own address: the exception's preferred
return address), SPSR_EL1 its PSTATE, ESR_EL1 the syndrome, and PSTATE itself
is EL1h with DAIF masked.

A BRK, a data or instruction abort, an undefined instruction and a BTI or
PAC failure all stop there: ``kprobe_break_hook`` makes the kernel's choice
of handler from ESR_EL1 (``call_break_hook`` on 6.1, ``call_el1_break_hook``
since the debug-exception rework Debian's 6.12.118 has) as far as kprobes'
two BRK immediates go.  A BRK at EL0 enters ``el0t_64_sync`` at VBAR_EL1 +
0x400 and never stops here.

The kernel runs at EL1 (QEMU's ``virt`` machine without ``virtualization=on``):
at EL2 (VHE) its vectors would be VBAR_EL2's and the syndrome ESR_EL2's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import BreakHook, Trap, TrapHook
from qprobe.errors import TargetError

# The gdbstub's names (QEMU 7.2, target/arm/gdbstub64.c and the "org.qemu.gdb.arm.sys.regs" feature
# target/arm/gdbstub.c builds from each AArch64 system register's ARMCPRegInfo name).  The system
# registers are read-only there (arm_gdb_set_sysreg writes nothing): a resume writes pc, sp and cpsr.
PC, SP, CPSR = "pc", "sp", "cpsr"
ESR_EL1, ELR_EL1, SPSR_EL1 = "ESR_EL1", "ELR_EL1", "SPSR_EL1"

# arch/arm64/include/asm/esr.h
ESR_ELx_EC_SHIFT = 26
ESR_ELx_EC_MASK = 0x3F << ESR_ELx_EC_SHIFT
ESR_ELx_EC_BRK64 = 0x3C
ESR_ELx_BRK64_ISS_COMMENT_MASK = 0xFFFF  # esr_brk_comment(): a BRK's immediate
# arch/arm64/include/asm/brk-imm.h: the immediates kprobes' two break hooks are registered for.
KPROBES_BRK_IMM = 0x004
KPROBES_BRK_SS_IMM = 0x006
# arch/arm64/include/uapi/asm/ptrace.h: PSTATE's mode field; user_mode() is M[3:0] == EL0t, which an
# AArch32 user mode (PSR_MODE32_BIT set, M[3:0] 0) also is.
PSR_MODE_MASK = 0x0000000F
PSR_MODE_EL0t = 0x00000000

# The EL1h synchronous vector's target (entry.S's ``entry_handler 1, h, 64, sync``, a local symbol).
TRAP_ENTRIES = ("el1h_64_sync",)
# What a BRK from EL1 runs through to kprobes' break hook, 6.1's route then the one of the
# debug-exception rework (Debian's 6.12.118: el1_brk64 -> do_el1_brk64 -> call_el1_break_hook, which
# calls the handlers by immediate, no longer through registered hooks).  A kernel has one of the two.
TRAP_PATH = (
    "el1h_64_sync", "el1h_64_sync_handler",
    "el1_dbg", "do_debug_exception", "brk_handler", "call_break_hook", "kprobe_breakpoint_handler",
    "el1_brk64", "do_el1_brk64", "call_el1_break_hook", "kprobe_brk_handler",
)  # fmt: skip

# kernel_entry's ``add x21, sp, #PT_REGS_SIZE`` (the aborted sp, for el == 1): ADD (immediate), 64-bit,
# Rn = sp, Rd = x21; imm12 at bits 21:10, shifted by 12 if bit 22 is set.
_ADD_X21_SP_MASK, _ADD_X21_SP = 0xFF8003FF, 0x910003F5
# kernel_entry stores x0..x29 with 15 ``stp`` first: the ``add`` is the 16th instruction.
ENTRY_SCAN = 32 * 4


def pstate_user_mode(pstate: int) -> bool:
    """user_mode(): whether a PSTATE (a pt_regs ``pstate``, SPSR_ELx, the gdbstub's cpsr) is EL0's."""
    return pstate & PSR_MODE_MASK == PSR_MODE_EL0t


def entry_pt_regs_size(code: bytes) -> int | None:
    """PT_REGS_SIZE as the entry's own code has it: the immediate of kernel_entry's ``add x21, sp, #PT_REGS_SIZE``.

    ``code`` is ``el1h_64_sync``'s first bytes.  sizeof(struct pt_regs) is 336 on 6.1 and 6.12 and
    changes with the kernel (6.13's ``struct frame_record_meta stackframe``), so it is read from the
    kernel, not assumed.  None if the instruction is not there.
    """
    for off in range(0, len(code) - 3, 4):
        insn = int.from_bytes(code[off : off + 4], "little")
        if insn & _ADD_X21_SP_MASK == _ADD_X21_SP:
            return ((insn >> 10) & 0xFFF) << (12 if insn >> 22 & 1 else 0)
    return None


class Arm64Traps:
    """The EL1h synchronous vector, shared by every exception from EL1, and the trapped context a stop there has.

    One per ``Arch`` object (per target): it keeps PT_REGS_SIZE as the entry's code gave it, by the
    entry's address, so that code is read once.
    """

    trap_entries: tuple[str, ...] = TRAP_ENTRIES
    trap_path: tuple[str, ...] = TRAP_PATH

    def __init__(self) -> None:
        self._pt_regs_size: dict[int, int] = {}

    def kprobe_break_hook(self, regs: Mapping[str, int]) -> BreakHook | None:
        """The kernel's choice among its break hooks for the exception ESR_EL1 describes, as far as kprobes go.

        A BRK (EC 0x3C) from EL1 with kprobes' immediate: ``KPROBE`` for KPROBES_BRK_IMM
        (kprobe_breakpoint_handler; kprobe_brk_handler after the rework), ``KPROBE_SS`` for
        KPROBES_BRK_SS_IMM (the BRK after a trap-stepped copy).  Anything else is another handler's: a
        BRK of BUG()/WARN() (0x800), KASAN (0x9xx), UBSAN (0x55xx), kgdb (0x400, 0x401), the kernel's
        kretprobe trampoline (0x007), or no BRK at all (a data abort, an undefined instruction).  A BRK
        from EL0 goes to the user hooks (call_break_hook's ``user_mode(regs)`` list), never kprobes'.
        """
        esr = regs[ESR_EL1]
        if (esr & ESR_ELx_EC_MASK) >> ESR_ELx_EC_SHIFT != ESR_ELx_EC_BRK64 or pstate_user_mode(regs[SPSR_EL1]):
            return None
        comment = esr & ESR_ELx_BRK64_ISS_COMMENT_MASK
        if comment == KPROBES_BRK_IMM:
            return BreakHook.KPROBE
        if comment == KPROBES_BRK_SS_IMM:
            return BreakHook.KPROBE_SS
        return None

    def pt_regs_size(self, entry: int, read: Callable[[int, int], bytes]) -> int:
        """PT_REGS_SIZE of the kernel whose trap entry is at ``entry`` (see :func:`entry_pt_regs_size`)."""
        size = self._pt_regs_size.get(entry)
        if size is None:
            size = entry_pt_regs_size(read(entry, ENTRY_SCAN))
            if size is None:
                raise TargetError(f"the trap entry at {entry:#x} has no 'add x21, sp, #PT_REGS_SIZE' in its first "
                                  f"{ENTRY_SCAN // 4} instructions: its exception frame is not where qprobe "
                                  "knows")  # fmt: skip
            self._pt_regs_size[entry] = size
        return size

    def decode_trap(self, hook: TrapHook, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> Trap:
        """The trapped context of a vCPU stopped on ``el1h_64_sync``'s first instruction.

        pc is ELR_EL1, PSTATE SPSR_EL1, sp the vector's sp plus PT_REGS_SIZE; the general registers are
        the vCPU's own.  The vCPU itself is in the exception (EL1h, DAIF masked, sp lowered), so the
        resume must put all three back: ``restore``.
        """
        if hook is not TrapHook.ENTRY:
            raise ValueError("arm64 hears of a trap only on its entry: it has no trap_watch")
        pc, pstate = regs[ELR_EL1], regs[SPSR_EL1]
        sp = regs[SP] + self.pt_regs_size(regs[PC], read)
        restore = {PC: pc, SP: sp, CPSR: pstate}
        return Trap(pc, sp, pstate, {**regs, **restore}, restore, user=pstate_user_mode(pstate))


__all__ = [
    "CPSR",
    "ELR_EL1",
    "ESR_EL1",
    "KPROBES_BRK_IMM",
    "KPROBES_BRK_SS_IMM",
    "PC",
    "SP",
    "SPSR_EL1",
    "TRAP_ENTRIES",
    "TRAP_PATH",
    "Arm64Traps",
    "entry_pt_regs_size",
    "pstate_user_mode",
]

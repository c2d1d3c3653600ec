"""``struct pt_regs`` on arm64, defined once; every register table of the arm64 port is derived from it.

The layout is arch/arm64/include/asm/ptrace.h's, the same in Linux 6.1 and
6.12 (336 bytes, PT_REGS_SIZE in arch/arm64/kernel/asm-offsets.c): the
ptrace ABI's ``struct user_pt_regs`` (``regs[31]``, ``sp``, ``pc``,
``pstate``: what the exception entry saves from x0-x30, SP_EL0 or the
interrupted SP, ELR_EL1 and SPSR_EL1), then fields only memory holds:
``orig_x0``, ``syscallno`` (an s32, then the u32 ``unused2``),
``sdei_ttbr1``, ``pmr_save`` (renamed ``pmr`` after 6.12), ``stackframe[2]``
(the frame record that links the unwinder across the exception),
``lockdep_hardirqs`` and ``exit_rcu``.

Each register has its pt_regs name (what kprobe_events' ``%REG`` takes:
arch/arm64/kernel/ptrace.c's regoffset_table names ``x0``..``x30``, ``sp``,
``pc`` and ``pstate``, plus ``lr`` for x30) and the QEMU gdbstub's name
(gdb-xml/aarch64-core.xml: ``x0``..``x30``, ``sp``, ``pc``, ``cpsr``; the
``g`` packet carries those 34).  The system registers the arm64 ``Arch``
reads from a stop are in QEMU's ``org.qemu.gdb.arm.sys.regs`` feature
(target/arm/gdbstub.c, arm_gen_dynamic_sysreg_xml), named by their
ARMCPRegInfo in target/arm/helper.c: only AArch64-state registers without
ARM_CP_NO_RAW or ARM_CP_NO_GDB are listed there on an AArch64 CPU, read with
``p`` (read_raw_cp_reg) and never written (arm_gdb_set_sysreg writes nothing).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from qprobe.arch import RegisterLayout

# pt_regs names of struct user_pt_regs, in memory order: the registers (and, with "lr", kprobe_events' %REG names).
PT_NAMES: tuple[str, ...] = (*(f"x{n}" for n in range(31)), "sp", "pc", "pstate")
# pt_regs name -> gdbstub name (QEMU 7.2's aarch64-core.xml calls PSTATE "cpsr", 32 bits wide).
GDB_NAME: dict[str, str] = {**{name: name for name in PT_NAMES[:-1]}, "pstate": "cpsr"}
PT_NAME: dict[str, str] = {g: pt for pt, g in GDB_NAME.items()}
PT_GPRS: tuple[str, ...] = PT_NAMES[:31]  # x0-x30, by either name

# Offsets of the fields past user_pt_regs: asm-offsets.c's S_SYSCALLNO, S_SDEI_TTBR1, S_PMR_SAVE and
# S_STACKFRAME (6.1 and 6.12); the others have no S_ name there and are named here after their fields.
USER_PT_REGS_SIZE = 8 * len(PT_NAMES)  # 272
S_ORIG_X0 = USER_PT_REGS_SIZE
S_SYSCALLNO = S_ORIG_X0 + 8  # s32, then the u32 unused2 (little-endian: syscallno first)
S_SDEI_TTBR1 = S_SYSCALLNO + 8
S_PMR_SAVE = S_SDEI_TTBR1 + 8
S_STACKFRAME = S_PMR_SAVE + 8  # u64 stackframe[2]: the frame record {x29, pc} of the exception
S_LOCKDEP_HARDIRQS = S_STACKFRAME + 16
S_EXIT_RCU = S_LOCKDEP_HARDIRQS + 8
PT_REGS_SIZE = S_EXIT_RCU + 8  # 336: "pt_regs has to be a multiple of 16 bytes" (ptrace.h's static_assert)
NO_SYSCALL = -1  # syscallno of a context that is in no system call (ptrace.h)

# PSTATE (SPSR_ELx) bits, arch/arm64/include/uapi/asm/ptrace.h.
PSR_MODE_EL0t = 0x0
PSR_MODE_EL1h = 0x5
PSR_MODE_MASK = 0xF
PSR_MODE32_BIT = 0x10
PSR_F_BIT = 1 << 6
PSR_I_BIT = 1 << 7  # IRQs masked: interrupts are enabled while it is clear (ptrace.h's interrupts_enabled)
PSR_A_BIT = 1 << 8
PSR_D_BIT = 1 << 9
PSR_DAIF_MASK = PSR_D_BIT | PSR_A_BIT | PSR_I_BIT | PSR_F_BIT

# The AAPCS64 integer argument registers (pt_regs names): regs_get_kernel_argument's NR_REG_ARGUMENTS = 8.
ARG_REGS = tuple(f"x{n}" for n in range(8))

_USER_PT_REGS = struct.Struct(f"<{len(PT_NAMES)}Q")
_TAIL = struct.Struct("<QiIQQ2QQQ")  # orig_x0 .. exit_rcu, as ptrace.h declares them
assert _USER_PT_REGS.size + _TAIL.size == PT_REGS_SIZE


def parse_pt_regs(raw: bytes, offset: int = 0) -> dict[str, int]:
    """A struct pt_regs read from guest memory: the registers by gdbstub name, then ``orig_x0`` and
    ``syscallno`` (signed) by their pt_regs names, as no gdbstub register holds them."""
    values = dict(zip(GDB_NAME.values(), _USER_PT_REGS.unpack_from(raw, offset), strict=True))
    orig_x0, syscallno, *_ = _TAIL.unpack_from(raw, offset + USER_PT_REGS_SIZE)
    values["orig_x0"], values["syscallno"] = orig_x0, syscallno
    return values


def pack_pt_regs(values: Mapping[str, int], syscallno: int = NO_SYSCALL) -> bytes:
    """A whole struct pt_regs (PT_REGS_SIZE bytes) from registers by gdbstub name (absent ones are zero).

    ``orig_x0`` may be given by that name; ``syscallno`` defaults to NO_SYSCALL (what
    kernel_entry stores for an entry from EL0 until el0_svc sets the number; an entry
    from EL1 leaves the field as the stack held it: entry.S, 6.1 and 6.12).  The
    fields past them are zero.
    """
    regs = _USER_PT_REGS.pack(*(values.get(g, 0) & (1 << 64) - 1 for g in GDB_NAME.values()))
    return regs + _TAIL.pack(values.get("orig_x0", 0) & (1 << 64) - 1, syscallno, 0, 0, 0, 0, 0, 0, 0)


def user_mode(pstate: int) -> bool:
    """ptrace.h's user_mode(): the exception was taken from EL0 (AArch64's EL0t or an AArch32 EL0 mode)."""
    return pstate & PSR_MODE_MASK == PSR_MODE_EL0t


def interrupts_enabled(pstate: int) -> bool:
    """ptrace.h's interrupts_enabled() without pseudo-NMI priority masking: PSTATE.I clear."""
    return not pstate & PSR_I_BIT


# The system registers (QEMU 7.2 names, target/arm/helper.c), all readable with ``p``.  QEMU names
# SCTLR_EL1 and VBAR_EL1 "SCTLR" and "VBAR": each is one ARM_CP_STATE_BOTH definition whose AArch32
# view shares the name, and only the AArch64 view is listed for an AArch64 CPU.  The "_EL12" aliases
# exist only with EL2 and VHE (define_arm_vh_e2h_redirects_aliases), which ``-M virt`` without
# virtualization=on lacks: the kernel runs at EL1 and keeps its state in the EL1 registers.
TTBR1_EL1 = "TTBR1_EL1"  # the kernel half's page-table root (swapper_pg_dir's physical address, ASID, CnP)
# The user half's: the running task's mm->pgd (cpu_do_switch_mm), in kernel mode too (paging's docstring).
TTBR0_EL1 = "TTBR0_EL1"
TPIDR_EL1 = "TPIDR_EL1"  # this CPU's __per_cpu_offset (set_my_cpu_offset; TPIDR_EL2 only under VHE)
# ``current`` in kernel mode (asm/current.h reads sp_el0); QEMU's copy is stale while EL0 runs on it,
# and at such a stop the user's stack pointer is ``sp`` anyway.
SP_EL0 = "SP_EL0"
ESR_EL1 = "ESR_EL1"  # the syndrome of the exception the vector was entered for (kprobe_break_hook)
ELR_EL1 = "ELR_EL1"  # where it returns (the trapped pc)
SPSR_EL1 = "SPSR_EL1"  # the trapped PSTATE
TCR_EL1 = "TCR_EL1"  # translation control: VA sizes and granules (paging.page_tables)
SCTLR_EL1 = "SCTLR"  # system control: WXN (paging) and the MMU bit (boot_stage)
VBAR_EL1 = "VBAR"  # ``vectors``, in the running image (paging: where the image is after KASLR)
# Every stop reads each of these with its own ``p`` (the ``g`` packet has none of them): the list is kept
# to what the readers use.
SYSTEM = (ESR_EL1, ELR_EL1, SPSR_EL1, TCR_EL1, SCTLR_EL1, VBAR_EL1)

# What the shell prints for a vCPU, in the target description's order: the x registers as ints, sp a
# data pointer, pc a code pointer, cpsr by flag; then the system registers above, in hex.
DISPLAY: tuple[tuple[str, str], ...] = (
    *((g, "int") for g in PT_GPRS), ("sp", "data"), ("pc", "code"), ("cpsr", "flags"),
    *((g, "hex") for g in (TTBR1_EL1, TTBR0_EL1, TPIDR_EL1, SP_EL0, *SYSTEM)),
)  # fmt: skip
# gdb's aarch64 cpsr_flags (gdb/features/aarch64-core.xml), its one-bit fields as masks; QEMU 7.2's
# description gives cpsr no flags type, so gdb itself would print it as a number.
FLAG_BITS = tuple((1 << bit, name) for bit, name in (
    (0, "SP"), (6, "F"), (7, "I"), (8, "A"), (9, "D"), (12, "SSBS"), (20, "IL"), (21, "SS"), (22, "PAN"),
    (23, "UAO"), (24, "DIT"), (25, "TCO"), (28, "V"), (29, "C"), (30, "Z"), (31, "N")))  # fmt: skip
# Registers a ``G`` may rewrite: QEMU 7.2 stores x0-x30, sp and pc as given (aarch64_cpu_gdb_write_register),
# and cpsr through pstate_write, which neither switches the banked stack pointer nor rebuilds the cached
# translation flags when its mode, SP or SS bits change.  A ``G``'s prefix ends at the highest register
# written, so cpsr is in one only when it is written anyway (as a ``P`` would, by the same pstate_write);
# with it, a resume's pc, sp and cpsr are one packet, which a client killed part way cannot split.
PLAIN = frozenset((*PT_GPRS, "sp", "pc", "cpsr"))

REGISTERS = RegisterLayout(
    GDB_NAME,
    ARG_REGS,
    {},  # every pt_regs register is a gdbstub register: nothing to default
    general=PT_GPRS,
    irq_flag=PSR_I_BIT,
    irq_masked_when_set=True,  # PSTATE.I masks IRQs: interrupts are enabled while it is clear (interrupts_enabled)
    page_table=TTBR1_EL1,
    user_page_table=TTBR0_EL1,
    percpu_base=TPIDR_EL1,
    current=SP_EL0,
    # At a user-mode stop SP_EL0 is the user's stack pointer; __entry_task (arch/arm64/kernel/process.c,
    # 6.1 and 6.12) is what kernel_entry loads into it.
    current_percpu="__entry_task",
    # pt_regs' syscallno is no %REG of arm64's kprobe_events (regoffset_table ends at pstate), and an
    # exception from EL1 does not set it (kernel_entry stores NO_SYSCALL for EL0 entries only): a kprobe
    # handler has no system-call number to show.
    syscall_nr=None,
    system=SYSTEM,
    retval="x0",
    stack_args=0,  # a call leaves sp at the first stacked argument: the return address is in x30
    pt_regs=PT_NAMES,
    # regoffset_table (arch/arm64/kernel/ptrace.c, 6.1 and 6.12) names x30 "lr" as well.
    reg_aliases={"lr": "x30"},
    # drgn's aarch64 registers (libdrgn/arch_aarch64_defs.py) that are gdbstub registers too: x0-x30 and sp
    # (drgn's "pstate" is QEMU's "cpsr", and drgn's frame gives pc itself).
    unwound=(*PT_GPRS, "sp"),
    display=DISPLAY,
    flag_bits=FLAG_BITS,
    plain=PLAIN,
    ip="pc",
    sp="sp",
    flags="pstate",
)

__all__ = [
    "ARG_REGS",
    "DISPLAY",
    "ELR_EL1",
    "ESR_EL1",
    "FLAG_BITS",
    "GDB_NAME",
    "NO_SYSCALL",
    "PLAIN",
    "PSR_A_BIT",
    "PSR_DAIF_MASK",
    "PSR_D_BIT",
    "PSR_F_BIT",
    "PSR_I_BIT",
    "PSR_MODE32_BIT",
    "PSR_MODE_MASK",
    "PT_GPRS",
    "PT_NAME",
    "PT_NAMES",
    "PT_REGS_SIZE",
    "REGISTERS",
    "SCTLR_EL1",
    "SPSR_EL1",
    "SP_EL0",
    "SYSTEM",
    "S_EXIT_RCU",
    "S_LOCKDEP_HARDIRQS",
    "S_ORIG_X0",
    "S_PMR_SAVE",
    "S_SDEI_TTBR1",
    "S_STACKFRAME",
    "S_SYSCALLNO",
    "TCR_EL1",
    "TPIDR_EL1",
    "TTBR0_EL1",
    "TTBR1_EL1",
    "USER_PT_REGS_SIZE",
    "VBAR_EL1",
    "PSR_MODE_EL0t",
    "PSR_MODE_EL1h",
    "interrupts_enabled",
    "pack_pt_regs",
    "parse_pt_regs",
    "user_mode",
]

"""arm64's struct pt_regs and the RegisterLayout built from it, against ptrace.h and QEMU 7.2's gdbstub."""

from __future__ import annotations

import pytest

from qprobe.arch.arm64.ptregs import (
    NO_SYSCALL,
    PSR_I_BIT,
    PT_REGS_SIZE,
    REGISTERS,
    S_EXIT_RCU,
    S_LOCKDEP_HARDIRQS,
    S_ORIG_X0,
    S_PMR_SAVE,
    S_SDEI_TTBR1,
    S_STACKFRAME,
    S_SYSCALLNO,
    interrupts_enabled,
    pack_pt_regs,
    parse_pt_regs,
    user_mode,
)

# gdb-xml/aarch64-core.xml's feature, in register-number order: what the ``g`` packet carries.
CORE_XML = (*(f"x{n}" for n in range(31)), "sp", "pc", "cpsr")
# The system registers QEMU 7.2 describes in org.qemu.gdb.arm.sys.regs that the layout names.
SYSREGS = {
    "TTBR1_EL1",
    "TTBR0_EL1",
    "TPIDR_EL1",
    "SP_EL0",
    "ESR_EL1",
    "ELR_EL1",
    "SPSR_EL1",
    "TCR_EL1",
    "SCTLR",
    "VBAR",
}
# drgn 0.0.3x's aarch64 registers (libdrgn/arch_aarch64_defs.py).
DRGN = {*(f"x{n}" for n in range(31)), "sp", "pstate"}


def test_the_layout_is_ptrace_h_s() -> None:
    """asm-offsets.c's S_* offsets (and those of the fields it names none for) and PT_REGS_SIZE."""
    assert (S_ORIG_X0, S_SYSCALLNO, S_SDEI_TTBR1, S_PMR_SAVE, S_STACKFRAME, S_LOCKDEP_HARDIRQS, S_EXIT_RCU) == (
        272, 280, 288, 296, 304, 320, 328)  # fmt: skip
    assert PT_REGS_SIZE == 336 and PT_REGS_SIZE % 16 == 0


def test_pt_regs_are_kprobe_events_names_in_memory_order() -> None:
    """regoffset_table (arch/arm64/kernel/ptrace.c): x0..x30, sp, pc, pstate at 8-byte steps from 0."""
    assert REGISTERS.pt_regs == (*(f"x{n}" for n in range(31)), "sp", "pc", "pstate")


def test_every_pt_regs_register_has_its_core_gdb_name() -> None:
    assert tuple(REGISTERS.gdb_name[name] for name in REGISTERS.pt_regs) == CORE_XML
    assert REGISTERS.pc == "pc" and REGISTERS.pt_name["cpsr"] == "pstate"


def test_memory_only_fields_are_neither_registers_nor_kprobe_events_names() -> None:
    assert REGISTERS.syscall_nr is None
    assert {"orig_x0", "syscallno"}.isdisjoint({*REGISTERS.gdb_name, *REGISTERS.pt_regs})


def test_stop_registers_are_the_core_ones_and_the_named_system_registers() -> None:
    assert REGISTERS.stop_registers == {*CORE_XML, *SYSREGS}
    assert (REGISTERS.page_table, REGISTERS.percpu_base, REGISTERS.current) == ("TTBR1_EL1", "TPIDR_EL1", "SP_EL0")
    assert REGISTERS.current_percpu == "__entry_task"


def test_a_task_s_memory_is_read_through_ttbr0() -> None:
    """The user half's root is TTBR0_EL1's; the kernel half's stays TTBR1_EL1's."""
    assert (REGISTERS.user_page_table, REGISTERS.task_page_table) == ("TTBR0_EL1", "TTBR0_EL1")


def test_every_named_register_is_in_the_layout() -> None:
    layout = REGISTERS
    names = set(layout.gdb_name)
    assert {*layout.arg_regs, *layout.general, layout.retval, layout.ip, layout.sp, layout.flags} <= names
    assert layout.arg_regs == tuple(f"x{n}" for n in range(8)) and layout.retval == "x0"
    assert layout.stack_args == 0 and not layout.defaults
    assert set(layout.unwound) <= DRGN & set(layout.pt_name)
    assert {name for name, _ in layout.display} <= layout.stop_registers
    # A resume writes pc, sp and cpsr: one G, which a client killed part way cannot split.
    assert {"pc", "sp", "cpsr"} <= layout.plain <= layout.stop_registers


def test_flags_name_nzcv_and_daif() -> None:
    names = dict(REGISTERS.flag_bits)
    assert [names[1 << bit] for bit in (31, 30, 29, 28, 9, 8, 7, 6)] == ["N", "Z", "C", "V", "D", "A", "I", "F"]
    assert REGISTERS.irq_flag == PSR_I_BIT == 0x80


@pytest.mark.parametrize(
    ("pstate", "user", "irqs_on"),
    [(0x0000_0000, True, True), (0x6000_0005, False, True), (0x0000_03C5, False, False),
     (0x0000_0010, True, True), (0x0000_0084, False, False)],
    ids=["el0t", "el1h-zc", "el1h-daif-masked", "aarch32-usr", "el1t-i"],
)  # fmt: skip
def test_user_mode_and_interrupts_enabled(pstate: int, user: bool, irqs_on: bool) -> None:
    assert (user_mode(pstate), interrupts_enabled(pstate)) == (user, irqs_on)
    assert REGISTERS.irqs_disabled_flags(pstate) is not irqs_on  # what the trace's irqs-off column shows


def test_pack_and_parse_round_trip() -> None:
    regs = {g: 0xFFFF_0000_0000_0000 + i for i, g in enumerate(CORE_XML)}
    raw = pack_pt_regs({**regs, "orig_x0": 7})
    assert len(raw) == PT_REGS_SIZE
    assert raw[S_SYSCALLNO : S_SYSCALLNO + 4] == b"\xff\xff\xff\xff"  # NO_SYSCALL, an s32
    assert raw[S_SDEI_TTBR1:] == bytes(PT_REGS_SIZE - S_SDEI_TTBR1)
    assert parse_pt_regs(raw) == {**regs, "orig_x0": 7, "syscallno": NO_SYSCALL}


def test_parse_reads_at_an_offset_and_the_system_call_number_signed() -> None:
    raw = b"\xaa" * 8 + pack_pt_regs({"pc": 0xFFFF_8000_0801_0000}, syscallno=64)
    parsed = parse_pt_regs(raw, 8)
    assert parsed["pc"] == 0xFFFF_8000_0801_0000 and parsed["syscallno"] == 64 and parsed["x0"] == 0

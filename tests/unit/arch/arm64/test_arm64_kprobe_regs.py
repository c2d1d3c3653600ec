"""kprobe_events' %REG on arm64: the names arch/arm64/kernel/ptrace.c's regoffset_table gives
regs_query_register_offset() (x0..x30, "lr" for x30 again, sp, pc, pstate; the same in 6.1 and 6.12),
and the kernel's refusal of any other name, at the '%' as x86's refusal is."""

from __future__ import annotations

import pytest

from qprobe.arch.arm64.ptregs import REGISTERS
from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import FetchArgError
from qprobe.fetch import ProbeEvent, Reg, parse_event
from qprobe.fetch import messages as M
from qprobe.fetch.dialect import Dialect, dialect_of

ARM64 = dialect_of(None, None, registers=REGISTERS.regoffset_table)
X86 = dialect_of(None, None, registers=X86_64.registers.regoffset_table)
# The table's names (ptrace.c, 6.1 and 6.12; regs_query_register_offset() finds one by strcmp()).
REGOFFSET_TABLE = (*(f"x{n}" for n in range(31)), "lr", "sp", "pc", "pstate")


def parse(text: str, dialect: Dialect) -> ProbeEvent:
    ev = parse_event(text, symbol_exists=lambda name: True, dialect=dialect)
    assert isinstance(ev, ProbeEvent)
    return ev


def refusal(text: str, dialect: Dialect) -> tuple[str, int]:
    with pytest.raises(FetchArgError) as info:
        parse_event(text, symbol_exists=lambda name: True, dialect=dialect)
    return info.value.reason, info.value.column


def test_the_layout_s_table_is_the_kernel_s() -> None:
    table = REGISTERS.regoffset_table
    assert set(table) == set(REGOFFSET_TABLE)
    assert table["lr"] == "x30" and all(table[name] == name for name in REGOFFSET_TABLE if name != "lr")
    assert ARM64.registers == frozenset(REGOFFSET_TABLE) and ARM64.reg_aliases == frozenset({("lr", "x30")})


def test_x0_sp_and_pc_are_registers() -> None:
    ev = parse("p vfs_read a=%x0 b=%sp c=%pc d=%pstate e=%x30:x64", ARM64)
    assert [a.expr for a in ev.args] == [Reg("x0"), Reg("sp"), Reg("pc"), Reg("pstate"), Reg("x30")]


def test_lr_reads_x30() -> None:
    """The kernel keeps the offset of regs[30] for %lr: the argument is x30's slot, its text the user's."""
    (arg,) = parse("p vfs_read ret=%lr:x64", ARM64).args
    assert arg.expr == Reg("x30") and arg.definition == "ret=%lr:x64"


@pytest.mark.parametrize("name", ["di", "ax", "ip", "x31", "xzr", "fp", "LR", "X0", "orig_x0", "syscallno", "cpsr"])
def test_other_names_are_refused_with_the_kernel_s_error_at_the_percent(name: str) -> None:
    """BAD_REG_NAME at the '%', as x86's refusal of arm64's name: regoffset_table has no x86 name, no frame
    pointer alias, no field past pstate and no gdbstub name, and strcmp() is case-sensitive."""
    assert refusal(f"p vfs_read %{name}", ARM64) == (M.BAD_REG_NAME, 11)
    assert refusal(f"p vfs_read a=%x0 b=+8(%{name})", ARM64) == (M.BAD_REG_NAME, 22)
    assert refusal("p vfs_read %x0", X86) == (M.BAD_REG_NAME, 11)


def test_x86_has_no_alias_and_no_lr() -> None:
    assert X86.reg_aliases == frozenset() and X86.registers == frozenset(X86_64.registers.pt_regs)
    assert refusal("p vfs_read %lr", X86) == (M.BAD_REG_NAME, 11)

"""The user forms' registers are the kernel architecture's: bpftrace's argN and perf's hint, on x86_64 and on
another architecture's RegisterLayout, whose language refuses x86's names."""

from __future__ import annotations

import pytest

from qprobe.arch import RegisterLayout
from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import FetchArgError
from qprobe.fetch import messages as M
from qprobe.fetch import parse_definition, parse_uprobe_event
from qprobe.fetch.dialect import Dialect
from qprobe.kernel.usyntax import UprobeSyntaxError, symbolic_user_form, unresolved_syntax, user_form_definition

# arm64's pt_regs as its regs_query_register_offset() names them; AAPCS64 passes eight integer arguments in
# x0..x7 and the rest on the stack from sp up (the return address is in x30, not on the stack).
ARM64_PT_REGS = (*(f"x{n}" for n in range(31)), "sp", "pc", "pstate")
ARM64 = RegisterLayout(
    gdb_name={**{f"x{n}": f"x{n}" for n in range(31)}, "sp": "sp", "ip": "pc", "flags": "cpsr"},
    arg_regs=tuple(f"x{n}" for n in range(8)),
    defaults={},
    general=tuple(f"x{n}" for n in range(31)),
    irq_flag=0x80,
    page_table="TTBR1_EL1",
    percpu_base="TPIDR_EL1",
    retval="x0",
    stack_args=0,
    current_percpu="__entry_task",
    pt_regs=ARM64_PT_REGS,
)


def resolve(path: str, spec: str) -> int:
    return 0x1A50


@pytest.mark.parametrize(
    ("registers", "variables", "args"),
    [
        (X86_64.registers, "arg0 arg5 arg6 arg7", "arg0=%di:u64 arg5=%r9:u64 arg6=+8(%sp):u64 arg7=+16(%sp):u64"),
        (ARM64, "arg0 arg7 arg8 arg9", "arg0=%x0:u64 arg7=%x7:u64 arg8=+0(%sp):u64 arg9=+8(%sp):u64"),
    ],
)  # fmt: skip
def test_bpftrace_arguments_are_the_architecture_s_registers_then_its_stack(
    registers: RegisterLayout, variables: str, args: str
) -> None:
    assert user_form_definition(f"uprobe:/bin/uprog:qpt_target {variables}", resolve, registers) == (
        f"p:uprobes/qpt_target /bin/uprog:0x1a50 {args}"
    )


def test_perf_s_hint_names_the_architecture_s_registers() -> None:
    with pytest.raises(UprobeSyntaxError) as info:
        user_form_definition("perf -x /bin/uprog qpt_target a", resolve, X86_64.registers)
    assert str(info.value) == (
        "a: C variables need the program's DWARF; fetch registers (%di, %si...) or memory (+0(%di):string) instead"
    )
    with pytest.raises(UprobeSyntaxError, match=r"\(%x0, %x1\.\.\.\) or memory \(\+0\(%x0\):string\)"):
        user_form_definition("perf -x /bin/uprog qpt_target a", resolve, ARM64)


def test_another_architecture_s_language_takes_its_forms_and_refuses_x86_s_names() -> None:
    arm64 = Dialect(registers=frozenset(ARM64_PT_REGS))
    line = symbolic_user_form("uprobe:/bin/uprog:qpt_target arg0 arg8", ARM64)
    assert line == "p:uprobes/qpt_target /bin/uprog:qpt_target arg0=%x0:u64 arg8=+0(%sp):u64"
    assert parse_uprobe_event(unresolved_syntax(parse_definition(line)), arm64)
    x86_line = user_form_definition("uprobe:/bin/uprog:qpt_target arg0", resolve, X86_64.registers)
    with pytest.raises(FetchArgError) as info:
        parse_uprobe_event(x86_line, arm64)
    assert info.value.reason == M.BAD_REG_NAME

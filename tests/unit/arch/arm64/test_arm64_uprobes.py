"""arm64's Uprobes facet: the kernel's refusals, a step that faulted, a function's return at its entry."""

from __future__ import annotations

import pytest

from qprobe.arch.arm64.arch import Arm64
from qprobe.arch.arm64.uprobes import Arm64Uprobes
from qprobe.errors import MemoryFault

# Encodings from aarch64-linux-gnu-as.
LDR_LITERAL, LDRSW_LITERAL = 0x58000040, 0x98000041  # ldr x0, .+8; ldrsw x1, .+8
ADD, SVC, BRK_UPROBES = 0x91000400, 0xD4000001, 0xD42000A0  # add x0, x0, #1; svc #0; brk #0x5
EL0T, EL1H = 0x6000_0000, 0x6000_03C5  # a user PSTATE, and the vector's after a fault (DAIF masked)
UP = Arm64Uprobes()


def word(insn: int) -> bytes:
    return insn.to_bytes(4, "little")


def test_the_arm64_arch_has_the_facet() -> None:
    assert isinstance(Arm64().uprobes, Arm64Uprobes)
    assert UP.uprobe_swbp_insn_size == 4


def test_the_uprobe_brk_is_refused_as_the_kernel_s_is_trap_insn_does() -> None:
    assert UP.arch_uprobe_analyze_insn(word(BRK_UPROBES)) == (
        "the uprobe breakpoint instruction is there already (ENOTSUPP)")  # fmt: skip


@pytest.mark.parametrize("insn", [LDR_LITERAL, LDRSW_LITERAL], ids=["ldr", "ldrsw"])
def test_literal_loads_are_refused_as_6_1_113_and_6_12_refuse_them(insn: int) -> None:
    why = UP.arch_uprobe_analyze_insn(word(insn))
    assert why is not None and why.endswith("(EINVAL)")


def test_an_ordinary_instruction_is_taken() -> None:
    assert UP.arch_uprobe_analyze_insn(word(ADD) + word(SVC)) is None


@pytest.mark.parametrize(
    ("insn", "pstate", "trapped"),
    [(ADD, EL0T, False), (ADD, EL1H, True), (SVC, EL1H, False)],
    ids=["completed", "faulted", "system-call"],
)
def test_a_step_that_ended_in_the_kernel_on_a_fault_was_trapped(insn: int, pstate: int, trapped: bool) -> None:
    assert UP.arch_uprobe_xol_was_trapped(word(insn), {"pc": 0x40_1004, "cpsr": pstate}) is trapped


def test_the_return_address_is_x30_and_ret_leaves_sp() -> None:
    def unread(addr: int, size: int) -> bytes:
        raise MemoryFault(addr, "the stack is not read")

    regs = {"x30": 0x40_1234, "sp": 0x7FFF_FFF0_0000, "pc": 0x40_1000}
    assert UP.arch_uretprobe_frame(regs, unread) == (0x40_1234, 0x7FFF_FFF0_0000)

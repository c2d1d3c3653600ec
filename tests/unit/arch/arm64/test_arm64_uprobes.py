"""arm64's Uprobes facet: the kernel's refusals, a step that faulted, a function's return at its entry, and the
instructions performed on the host (simulate-insn.c's) with the user pages' permissions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qprobe.arch.arm64.arch import Arm64
from qprobe.arch.arm64.uprobes import Arm64Uprobes
from qprobe.errors import MemoryFault

sys.path.insert(0, str(Path(__file__).parent))
from fakes_arm64 import FakeRegs

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


class UserMem:
    """A task's memory: words by address, with a fetch."""

    def __init__(self, words: dict[int, int]) -> None:
        self.words = words

    def read(self, addr: int, size: int) -> bytes:
        if addr not in self.words:
            raise MemoryFault(addr)
        return self.words[addr].to_bytes(8, "little")[:size]

    fetch = read

    def write(self, addr: int, data: bytes) -> None:
        raise AssertionError("arm64's simulated instructions write no memory")


PC = 0x0000_AAAA_0000_1000
B_FWD, BL_FWD = 0x14000004, 0x94000004  # b .+16; bl .+16 (imm26 = 4 words)
LDR_X0 = 0x58000040  # ldr x0, .+8
DBG_SS = 1 << 21  # PSTATE.SS


def test_branches_the_kernel_simulates_are_performed_on_the_host() -> None:
    regs = FakeRegs(pc=PC, pstate=EL0T)
    assert UP.arch_uprobe_emulate(regs, UserMem({PC: B_FWD})) and regs.pc == PC + 16  # type: ignore[arg-type]
    regs = FakeRegs(pc=PC, pstate=EL0T)
    assert UP.arch_uprobe_emulate(regs, UserMem({PC: BL_FWD}))  # type: ignore[arg-type]
    assert regs.pc == PC + 16 and regs.x30 == PC + 4  # bl links the next instruction's address


def test_a_literal_load_reads_the_task_s_memory_and_a_fault_leaves_it_to_the_step() -> None:
    regs = FakeRegs(pc=PC, pstate=EL0T)
    assert UP.arch_uprobe_emulate(regs, UserMem({PC: LDR_X0, PC + 8: 0x1234}))  # type: ignore[arg-type]
    assert regs.x0 == 0x1234 and regs.pc == PC + 4
    regs = FakeRegs(pc=PC, pstate=EL0T)
    assert not UP.arch_uprobe_emulate(regs, UserMem({PC: LDR_X0}))  # type: ignore[arg-type]


def test_what_runs_out_of_line_or_under_a_debugger_s_step_is_stepped() -> None:
    regs = FakeRegs(pc=PC, pstate=EL0T)
    assert not UP.arch_uprobe_emulate(regs, UserMem({PC: ADD})) and regs.dirty() == {}  # type: ignore[arg-type]
    regs = FakeRegs(pc=PC, pstate=EL0T | DBG_SS)
    assert not UP.arch_uprobe_emulate(regs, UserMem({PC: B_FWD})) and regs.dirty() == {}  # type: ignore[arg-type]
    regs = FakeRegs(pc=PC, pstate=0x10)  # AArch32 user mode: the word is an A32 or T32 instruction
    assert not UP.arch_uprobe_emulate(regs, UserMem({PC: B_FWD})) and regs.dirty() == {}  # type: ignore[arg-type]


# Stage-1 leaf descriptors: valid 1<<0, AP[1] (EL0) 1<<6, AP[2] (read-only) 1<<7, AF 1<<10, UXN 1<<54.
@pytest.mark.parametrize(
    ("entry", "read", "write", "fetch"),
    [
        (0x443, True, True, True),  # EL0 read-write, accessed
        (0x4C3, True, False, True),  # read-only (copy-on-write, or clean without hardware dirty management)
        (0x403, False, False, True),  # no EL0 data access: execute-only
        (0x443 | 1 << 54, True, True, False),  # UXN
        (0x043, False, False, False),  # the access flag clear: the access would fault to set it
        (0x442, False, False, False),  # invalid
    ],
)
def test_user_page_allows_what_el0_may_do_without_a_fault(entry: int, read: bool, write: bool, fetch: bool) -> None:
    assert tuple(UP.user_page_allows(entry, a) for a in ("read", "write", "fetch")) == (read, write, fetch)

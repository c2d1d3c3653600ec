"""arm64's trap entry: which stops on el1h_64_sync are kprobes' BRKs, and the trapped context of one.

The ESR_EL1 values are the architecture's (EC in bits 31:26, IL in bit 25, a
BRK's immediate in ISS bits 15:0); the entry code is kernel_entry's prologue
as arch/arm64/kernel/entry.S assembles it (encodings from GNU as).
"""

from __future__ import annotations

import pytest

from qprobe.arch import BreakHook, TrapHook
from qprobe.arch.arm64.traps import TRAP_ENTRIES, TRAP_PATH, Arm64Traps, entry_pt_regs_size
from qprobe.errors import TargetError

EL1H_DAIF = 0x3C5  # PSTATE as the exception sets it: EL1h, D, A, I and F masked
EL1H = 0x5  # SPSR of a context at EL1h with interrupts on
EL0T = 0x0
ESR_IL = 1 << 25


def esr(ec: int, iss: int = 0) -> int:
    return ec << 26 | ESR_IL | iss


BRK64 = 0x3C
# el1h_64_sync's first instructions: kernel_entry 1 saves x0..x29 with 15 stp, then
# ``add x21, sp, #PT_REGS_SIZE`` (336 on 6.1 and 6.12), ``mrs x22, elr_el1``, ``mrs x23, spsr_el1``.
STP_X0_X29 = bytes.fromhex(
    "e00700a9e20f01a9e41702a9e61f03a9e82704a9ea2f05a9ec3706a9ee3f07a9f04708a9f24f09a9f4570aa9f65f0ba9f8670ca9fa6f0da9fc770ea9"
)
ADD_X21_SP_336 = bytes.fromhex("f5430591")
MRS_ELR_SPSR = bytes.fromhex("364038d5174038d5")
ENTRY_CODE = STP_X0_X29 + ADD_X21_SP_336 + MRS_ELR_SPSR
ENTRY = 0xFFFF800008011800


@pytest.mark.parametrize(
    ("value", "spsr", "hook"),
    [
        (esr(BRK64, 0x004), EL1H, BreakHook.KPROBE),  # brk #4: KPROBES_BRK_IMM
        (esr(BRK64, 0x006), EL1H, BreakHook.KPROBE_SS),  # brk #6: KPROBES_BRK_SS_IMM, after a trap-stepped copy
        (esr(BRK64, 0x004), 0x3C5, BreakHook.KPROBE),  # taken with interrupts masked: still EL1h
        (esr(BRK64, 0x800), EL1H, None),  # BUG() and WARN()
        (esr(BRK64, 0x900), EL1H, None),  # KASAN (software tags) reports 0x9xx
        (esr(BRK64, 0x93F), EL1H, None),
        (esr(BRK64, 0x5501), EL1H, None),  # UBSAN_BRK_IMM | check
        (esr(BRK64, 0x400), EL1H, None),  # kgdb's dynamic breakpoint
        (esr(BRK64, 0x007), EL1H, None),  # the kernel's own kretprobe trampoline (KRETPROBES_BRK_IMM)
        (esr(BRK64, 0x005), EL1H, None),  # UPROBES_BRK_IMM: a user hook's
        (esr(BRK64, 0x8004), EL1H, None),  # kprobes' immediate must be the whole comment
        (esr(BRK64, 0x004), EL0T, None),  # a BRK from EL0 goes to the user hooks (and enters el0t_64_sync)
        (esr(0x25, 0x45), EL1H, None),  # a data abort at EL1 (a copy_from_user's fault, say)
        (esr(0x21, 0x0F), EL1H, None),  # an instruction abort at EL1
        (esr(0x00), EL1H, None),  # an undefined instruction (EC Unknown)
        (esr(0x0D, 0x1), EL1H, None),  # a BTI failure
        (esr(0x1C), EL1H, None),  # a PAC failure (FPAC)
        (0x3C << 26 | 0x004, EL1H, BreakHook.KPROBE),  # IL is no part of the choice
    ],
)
def test_kprobe_break_hook_is_the_kernels_choice_from_esr(value: int, spsr: int, hook: BreakHook | None) -> None:
    assert Arm64Traps().kprobe_break_hook({"ESR_EL1": value, "SPSR_EL1": spsr}) is hook


def test_entry_pt_regs_size_is_read_from_kernel_entrys_add() -> None:
    assert entry_pt_regs_size(ENTRY_CODE) == 336
    assert entry_pt_regs_size(STP_X0_X29 + bytes.fromhex("f5074091")) == 0x1000  # add x21, sp, #1, lsl #12
    assert entry_pt_regs_size(STP_X0_X29 + bytes.fromhex("f5430591")[:3]) is None  # cut short
    assert entry_pt_regs_size(STP_X0_X29 + bytes.fromhex("f6430591")) is None  # add x22, sp, #336
    assert entry_pt_regs_size(STP_X0_X29 + bytes.fromhex("f5420591")) is None  # add x21, x23, #336


def _stop(**over: int) -> dict[str, int]:
    """A vCPU on el1h_64_sync's first instruction, taken from a BRK at 0x...9abc with sp 0x...3f80."""
    regs = {f"x{i}": 0x1000 + i for i in range(31)}
    regs.update(sp=0xFFFF80000A003F80 - 336, pc=ENTRY, cpsr=EL1H_DAIF, ESR_EL1=esr(BRK64, 4),
                ELR_EL1=0xFFFF800008129ABC, SPSR_EL1=0x60000005)  # fmt: skip
    regs.update(over)
    return regs


class _Code:
    """The entry's text; counts the reads."""

    def __init__(self, code: bytes) -> None:
        self.code, self.reads = code, 0

    def read(self, addr: int, size: int) -> bytes:
        assert addr == ENTRY
        self.reads += 1
        return self.code[:size].ljust(size, b"\0")


def test_decode_trap_gives_the_trapped_context_and_what_to_restore() -> None:
    code = _Code(ENTRY_CODE)
    regs = _stop()
    trap = Arm64Traps().decode_trap(TrapHook.ENTRY, regs, code.read)
    assert (trap.addr, trap.sp, trap.flags, trap.user) == (0xFFFF800008129ABC, 0xFFFF80000A003F80, 0x60000005, False)
    # The vCPU is in the exception (EL1h, DAIF masked, sp lowered): pc, sp and PSTATE go back with the resume.
    assert trap.restore == {"pc": 0xFFFF800008129ABC, "sp": 0xFFFF80000A003F80, "cpsr": 0x60000005}
    # The general registers are the vCPU's: the vector changed none of them.
    assert trap.regs == {**regs, **trap.restore}
    assert all(trap.regs[f"x{i}"] == 0x1000 + i for i in range(31))


def test_decode_trap_reads_the_entry_once_per_entry() -> None:
    code, traps = _Code(ENTRY_CODE), Arm64Traps()
    for sp in (0x1000, 0x2000):
        assert traps.decode_trap(TrapHook.ENTRY, _stop(sp=sp), code.read).sp == sp + 336
    assert code.reads == 1


def test_decode_trap_refuses_an_entry_that_saves_the_frame_otherwise() -> None:
    with pytest.raises(TargetError, match="PT_REGS_SIZE"):
        Arm64Traps().decode_trap(TrapHook.ENTRY, _stop(), _Code(STP_X0_X29).read)


def test_decode_trap_has_no_watch_hook() -> None:
    with pytest.raises(ValueError, match="trap_watch"):
        Arm64Traps().decode_trap(TrapHook.WATCH, _stop(), _Code(ENTRY_CODE).read)


def test_trap_entry_and_path() -> None:
    assert TRAP_ENTRIES == ("el1h_64_sync",)
    # Both kernels' routes start at the entry and its C handler and end in kprobes' break handler.
    assert TRAP_PATH[:2] == ("el1h_64_sync", "el1h_64_sync_handler")
    assert {"kprobe_breakpoint_handler", "kprobe_brk_handler"} <= set(TRAP_PATH)
    assert TRAP_PATH.index("call_break_hook") < TRAP_PATH.index("kprobe_breakpoint_handler")
    assert (
        TRAP_PATH.index("do_el1_brk64") < TRAP_PATH.index("call_el1_break_hook") < TRAP_PATH.index("kprobe_brk_handler")
    )

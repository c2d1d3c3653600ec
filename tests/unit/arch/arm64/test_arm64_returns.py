"""arm64's return address at a function's entry: x30, for kretprobes and uretprobes; and a stepped user insn."""

from __future__ import annotations

import pytest

from qprobe.arch.arm64.returns import (
    LR,
    RET_POPS,
    aarch64_insn_is_svc,
    arch_prepare_kretprobe,
    arch_uprobe_xol_was_trapped,
    arch_uretprobe_frame,
)


class _Regs:
    """A trapped context's pt_regs as the core hands them over: attributes, and the changed ones."""

    def __init__(self, **values: int) -> None:
        self.__dict__["values"] = values
        self.__dict__["changed"] = {}

    def __getattr__(self, name: str) -> int:
        return int(self.values[name])

    def __setattr__(self, name: str, value: int) -> None:
        self.values[name] = value
        self.changed[name] = value

    def dirty(self) -> dict[str, int]:
        return dict(self.changed)


def _no_memory(addr: int) -> int:
    raise AssertionError("the return address is in a register: nothing on the stack is read")


def test_kretprobe_hijacks_the_link_register() -> None:
    regs = _Regs(x30=0xFFFF800008123458, sp=0xFFFF80000A003F80, x29=0xFFFF80000A003FA0)
    hijack = arch_prepare_kretprobe(regs, _no_memory)
    assert (hijack.ret_addr, hijack.register, hijack.slot) == (0xFFFF800008123458, "x30", None)
    # The core writes the trampoline into that pt_regs field, which goes back with the resume.
    setattr(regs, hijack.register, 0xFFFF800009000000)
    assert regs.dirty() == {LR: 0xFFFF800009000000}
    assert RET_POPS == 0  # ``ret`` leaves sp as the entry had it: the trampoline's frame is its sp


def test_uretprobe_frame_is_x30_and_sp_unchanged() -> None:
    def no_read(addr: int, size: int) -> bytes:
        raise AssertionError("nothing on the user stack is read")

    assert arch_uretprobe_frame({"x30": 0xAAAA_0000_1234, "sp": 0xFFFF_FFF0_E000, "pc": 0xAAAA_0000_2000},
                                no_read) == (0xAAAA_0000_1234, 0xFFFF_FFF0_E000)  # fmt: skip


SVC_0 = bytes.fromhex("010000d4")
SVC_1234 = bytes.fromhex("814602d4")
HVC_0 = bytes.fromhex("020000d4")  # undefined at EL0: a fault
LDR_X0_X1 = bytes.fromhex("200040f9")  # ldr x0, [x1]
EL0T, EL1H_DAIF = 0x8000_0000, 0x3C5  # N set at EL0; the vector's PSTATE


@pytest.mark.parametrize(
    ("code", "cpsr", "trapped"),
    [
        (LDR_X0_X1, EL0T, False),  # completed in user mode
        (LDR_X0_X1, EL1H_DAIF, True),  # a page fault: at el0t_64_sync, the load runs again
        (SVC_0, EL1H_DAIF, False),  # a system call enters on purpose and returns past itself
        (SVC_1234, EL1H_DAIF, False),
        (HVC_0, EL1H_DAIF, True),
        (SVC_0, EL0T, False),
        # The guest's own uprobe (brk #0x005, UPROBES_BRK_IMM) on the same instruction: its handler goes past.
        ((0xD42000A0).to_bytes(4, "little"), EL1H_DAIF, False),
    ],
)
def test_xol_was_trapped_means_a_fault_at_el1(code: bytes, cpsr: int, trapped: bool) -> None:
    assert arch_uprobe_xol_was_trapped(code, {"cpsr": cpsr, "pc": 0xFFFF800008011C00}) is trapped


def test_svc_is_told_by_its_encoding() -> None:
    assert aarch64_insn_is_svc(SVC_0) and aarch64_insn_is_svc(SVC_1234)
    assert not aarch64_insn_is_svc(HVC_0) and not aarch64_insn_is_svc(bytes.fromhex("800020d4"))  # brk #4
    assert not aarch64_insn_is_svc(SVC_0[:3])

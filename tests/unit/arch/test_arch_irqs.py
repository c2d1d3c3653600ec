"""RegisterLayout.irqs_disabled_flags reads the flags register's interrupt bit in the architecture's sense:
x86's IF is set while interrupts are enabled, arm64's PSTATE.I while IRQs are masked."""

from __future__ import annotations

import pytest

from qprobe.arch import RegisterLayout
from qprobe.arch.arm64.ptregs import REGISTERS as ARM64
from qprobe.arch.x86_64.arch import X86_64

X86 = X86_64.registers


@pytest.mark.parametrize(
    ("layout", "flags", "disabled"),
    [
        (X86, 0x246, False),  # IF set: a kernel running with interrupts on
        (X86, 0x046, True),  # IF clear: under local_irq_disable()
        (X86, 0x002, True),  # only the always-one bit
        (ARM64, 0x6000_0005, False),  # EL1h, Z and C, DAIF clear
        (ARM64, 0x0000_03C5, True),  # EL1h with D, A, I and F masked (an exception's entry)
        (ARM64, 0x0000_0085, True),  # only I masked
        (ARM64, 0x0000_0345, False),  # D, A and F masked but not I: IRQs are taken
    ],
    ids=["x86-if", "x86-cli", "x86-reserved", "arm64-daif-clear", "arm64-daif-masked", "arm64-i", "arm64-daf"],
)  # fmt: skip
def test_irqs_disabled_flags_is_the_architecture_s_sense(layout: RegisterLayout, flags: int, disabled: bool) -> None:
    assert layout.irqs_disabled_flags(flags) is disabled


def test_the_sense_is_each_architecture_s() -> None:
    assert (X86.irq_flag, X86.irq_masked_when_set) == (0x200, False)
    assert (ARM64.irq_flag, ARM64.irq_masked_when_set) == (0x80, True)

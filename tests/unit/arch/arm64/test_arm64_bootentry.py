"""How far a stopped arm64 vCPU has come, and the boot CPU's first instruction at virtual addresses."""

from __future__ import annotations

import pytest

from qprobe.arch import BootStage
from qprobe.arch.arm64.arch import Arm64
from qprobe.arch.arm64.bootentry import arch_boot_entry, boot_stage
from qprobe.errors import SymbolError, TargetError

# SCTLR_EL1 as QEMU's reset leaves it (M, C and I clear) and as the kernel runs (M set).
SCTLR_RESET, SCTLR_KERNEL = 0x30D00800, 0x3450D91D
EL1H_DAIF = 0x3C5


@pytest.mark.parametrize(
    ("regs", "stage"),
    [
        ({"SCTLR": SCTLR_RESET, "pc": 0x4000_0000, "cpsr": EL1H_DAIF}, BootStage.RESET),  # -kernel's stub, not run
        ({"SCTLR": SCTLR_RESET, "pc": 0x0, "cpsr": EL1H_DAIF}, BootStage.RESET),  # a firmware's reset vector
        ({"SCTLR": SCTLR_RESET, "pc": 0x4000_0010, "cpsr": EL1H_DAIF}, BootStage.EARLY),  # the stub, part way
        ({"SCTLR": SCTLR_RESET, "pc": 0x4020_0040, "cpsr": EL1H_DAIF}, BootStage.EARLY),  # primary_entry, MMU off
        ({"SCTLR": SCTLR_KERNEL, "pc": 0x4020_1000, "cpsr": EL1H_DAIF}, BootStage.KERNEL),  # the idmap, MMU on
        ({"SCTLR": SCTLR_KERNEL, "pc": 0xFFFF_8000_0801_2000, "cpsr": 0x5}, BootStage.KERNEL),
        ({"pc": 0x4000_0000, "cpsr": EL1H_DAIF}, BootStage.KERNEL),  # no SCTLR shown: cannot tell
    ],
)
def test_boot_stage(regs: dict[str, int], stage: BootStage) -> None:
    assert boot_stage(regs) is stage


def test_boot_entry_is_primary_switched() -> None:
    symbols = {"__primary_switch": 0xFFFF_8000_0A1B_0000, "__primary_switched": 0xFFFF_8000_0A1A_0800}

    def address(name: str) -> int:
        if name not in symbols:
            raise SymbolError(f"unknown symbol {name}")
        return symbols[name]

    def read(addr: int, size: int) -> bytes:
        return b"\0" * size

    assert arch_boot_entry(read, address) == 0xFFFF_8000_0A1A_0800
    del symbols["__primary_switched"]
    with pytest.raises(SymbolError):
        arch_boot_entry(read, address)


def test_page_tables_of_a_vcpu_with_its_mmu_off_are_refused_in_one_line() -> None:
    reset = {"pc": 0x4000_0000, "cpsr": 0x3C5, "SCTLR": 0x0C50_0838, "TCR_EL1": 0}  # QEMU virt's -kernel stub
    with pytest.raises(TargetError, match=r"MMU off .* boot-time probes on arm64 are not supported yet$"):
        Arm64().page_tables(reset)

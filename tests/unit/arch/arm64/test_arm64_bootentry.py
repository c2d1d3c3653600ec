"""How far a stopped arm64 vCPU has come, and the boot CPU's first instruction at virtual addresses."""

from __future__ import annotations

import pytest

from qprobe.arch import BootStage
from qprobe.arch.arm64.arch import Arm64
from qprobe.arch.arm64.bootentry import BR_X8, arch_boot_entry, arch_boot_switch, boot_stage
from qprobe.errors import MemoryFault, SymbolError, TargetError

# SCTLR_EL1 as QEMU's reset leaves it (M, C and I clear) and as the kernel runs (M set).
SCTLR_RESET, SCTLR_KERNEL = 0x30D00800, 0x3450D91D
EL1H_DAIF = 0x3C5


@pytest.mark.parametrize(
    ("regs", "stage"),
    [
        # Where QEMU's virt starts vCPU 0 is the board's to say (qprobe.vmm.boards): the MMU is off.
        ({"SCTLR": SCTLR_RESET, "pc": 0x4000_0000, "cpsr": EL1H_DAIF}, BootStage.EARLY),  # -kernel's stub, not run
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


def test_a_vcpu_with_its_mmu_off_maps_no_virtual_address() -> None:
    reset = {"pc": 0x4000_0000, "cpsr": 0x3C5, "SCTLR": 0x0C50_0838, "TCR_EL1": 0}  # QEMU virt's -kernel stub
    paging = Arm64().page_tables(reset)
    with pytest.raises(MemoryFault, match="MMU is off"):
        paging.translate(lambda pa: 0, 0, 0xFFFF_8000_0800_0000)
    with pytest.raises(TargetError, match="MMU is off"):
        paging.large_page_table(lambda pa: 0, 0)


# __primary_switch's end on Debian's 6.12 (objdump of its vmlinux): ldr x8, =__primary_switched; adrp x0,
# _text; br x8.
SWITCH_612 = bytes.fromhex("fd031faa e00314aa e10315aa 24410094 c8000058 403cffb0 00011fd6".replace(" ", ""))


def test_boot_switch_is_the_br_x8_in_primary_switch() -> None:
    start = 0xFFFF_8000_8187_75B8

    def read(addr: int, size: int) -> bytes:
        code = SWITCH_612 + b"\0" * 1024
        return code[addr - start : addr - start + size]

    assert int.from_bytes(SWITCH_612[-4:], "little") == BR_X8
    assert arch_boot_switch(read, {"__primary_switch": start}.__getitem__) == start + 24
    with pytest.raises(TargetError, match="no 'br x8'"):
        arch_boot_switch(lambda addr, size: b"\0" * size, {"__primary_switch": start}.__getitem__)

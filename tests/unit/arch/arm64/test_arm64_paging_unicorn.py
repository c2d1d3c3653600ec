"""The scratch area's block against a real MMU model: unicorn's AArch64 CPU walks the tables at EL1.

The CPU turns its MMU on with TTBR0 and TTBR1 both at the tables the
walk tests build, branches into the block ``large_page_entry`` made in the
kernel image's PMD table, and there stores to and loads from it: the
kernel-text block the scratch area needs (executable and writable at EL1).
The same block with PXN set must not run, and read-only must not take the store.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

unicorn = pytest.importorskip(
    "unicorn", reason="unicorn is not installed (pip install unicorn); it only cross-checks the arch layer"
)
from unicorn import arm64_const as A  # noqa: E402

from qprobe.arch.arm64.paging import PMD_SECT_PXN, PMD_SECT_RDONLY, Arm64PageTables  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from pagetables_arm64 import ATTRS, M2, image_tables, kva, tcr  # noqa: E402

# aarch64-linux-gnu-as: msr tcr_el1, x3; msr mair_el1, x4; msr ttbr1_el1, x5; msr ttbr0_el1, x5; isb;
# mrs x7, sctlr_el1; orr x7, x7, #1; msr sctlr_el1, x7; isb; br x8
ENABLE_MMU = struct.pack("<10I", 0xD5182043, 0xD518A204, 0xD5182025, 0xD5182005, 0xD5033FDF,
                         0xD5381007, 0xB24000E7, 0xD5181007, 0xD5033FDF, 0xD61F0100)  # fmt: skip
BODY = struct.pack("<3I", 0xF9000001, 0xF9400002, 0xD503201F)  # str x1, [x0]; ldr x2, [x0]; nop
RAM, CODE, SCRATCH_PHYS, SLOT = 0x4000_0000, 0x4000_0000, 0x4200_0000, 300
TCR_IPS_36 = 1 << 32
VALUE = 0x1122_3344_5566_7788
SCR_EL3 = (1, 1, 3, 6, 0)  # CP_REG (crn, crm, op0, op1, op2)
HCR_EL2 = (1, 1, 3, 4, 0)


def run(entry: Callable[[Arm64PageTables], int]) -> tuple[bool, int, bytes]:
    """Map the block ``entry(pt)`` gives at the scratch slot, run BODY in it: (ran to the end, x2, the word)."""
    ram, t, pt = image_tables()
    # The code that turns the MMU on runs where it sits: an identity block through TTBR0 (same indexes).
    t.map(kva(48, CODE), CODE, level=2, attrs=ATTRS & ~PMD_SECT_PXN)
    ram.words[pt.large_page_table(ram.read_u64, t.root) + SLOT * 8] = entry(pt)
    va = pt.image_base + SLOT * M2
    uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
    uc.ctl_set_tlb_mode(unicorn.UC_TLB_CPU)  # the guest's own page-table walk, not unicorn's flat map
    uc.mem_map(RAM, 64 << 20)
    # EL1 must be AArch64 (SCR_EL3.RW, HCR_EL2.RW) and non-secure, as a Linux guest's is.
    uc.reg_write(A.UC_ARM64_REG_CP_REG, (*SCR_EL3, 1 << 10 | 1))
    uc.reg_write(A.UC_ARM64_REG_CP_REG, (*HCR_EL2, 1 << 31))
    for pa, word in ram.words.items():
        uc.mem_write(pa, word.to_bytes(8, "little"))
    uc.mem_write(CODE, ENABLE_MMU)
    uc.mem_write(SCRATCH_PHYS, BODY)
    regs = {A.UC_ARM64_REG_X3: tcr(48) | TCR_IPS_36, A.UC_ARM64_REG_X4: 0xFF, A.UC_ARM64_REG_X5: t.root,
            A.UC_ARM64_REG_X8: va, A.UC_ARM64_REG_X0: va + 0x100, A.UC_ARM64_REG_X1: VALUE}  # fmt: skip
    for reg, value in regs.items():
        uc.reg_write(reg, value)
    try:
        uc.emu_start(CODE, va + len(BODY))
    except unicorn.UcError:
        return False, uc.reg_read(A.UC_ARM64_REG_X2), bytes(uc.mem_read(SCRATCH_PHYS + 0x100, 8))
    return True, uc.reg_read(A.UC_ARM64_REG_X2), bytes(uc.mem_read(SCRATCH_PHYS + 0x100, 8))


def test_the_scratch_block_runs_and_takes_stores_at_el1() -> None:
    assert run(lambda pt: pt.large_page_entry(SCRATCH_PHYS)) == (True, VALUE, VALUE.to_bytes(8, "little"))


def test_the_same_block_with_pxn_does_not_run() -> None:
    ran, x2, word = run(lambda pt: pt.large_page_entry(SCRATCH_PHYS) | PMD_SECT_PXN)
    assert (ran, x2, word) == (False, 0, bytes(8))


def test_the_same_block_read_only_refuses_the_store() -> None:
    ran, _, word = run(lambda pt: pt.large_page_entry(SCRATCH_PHYS) | PMD_SECT_RDONLY)
    assert (ran, word) == (False, bytes(8))

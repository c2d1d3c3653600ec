"""The EL1h synchronous vector run on a real arm64 CPU model (unicorn), up to el1h_64_sync's first instruction.

kernel_ventry's CONFIG_VMAP_STACK check borrows x0 and sp and puts them back;
decode_trap relies on every general register being the trapped context's
there, and on sp being the trapped one minus PT_REGS_SIZE.  Skipped when
unicorn (an optional test dependency) is absent.
"""

from __future__ import annotations

import pytest

unicorn = pytest.importorskip(
    "unicorn", reason="unicorn is not installed (pip install unicorn); it only cross-checks the arch layer"
)
from unicorn import arm64_const as A  # noqa: E402

from qprobe.arch import TrapHook  # noqa: E402
from qprobe.arch.arm64.traps import Arm64Traps  # noqa: E402

TEXT = 0x10000
# entry.S's ``kernel_ventry 1, h, 64, sync`` with CONFIG_VMAP_STACK (THREAD_SHIFT 14), then
# el1h_64_sync's kernel_entry up to the ``add x21, sp, #PT_REGS_SIZE`` (GNU as):
#   sub sp, sp, #336; add sp, sp, x0; sub x0, sp, x0; tbnz x0, #14, 0f; sub x0, sp, x0; sub sp, sp, x0;
#   b el1h_64_sync; 0: brk #0x800
#   el1h_64_sync: stp x0, x1, [sp] ... stp x28, x29, [sp, #224]; add x21, sp, #336
VECTOR = bytes.fromhex("ff4305d1ff63208be06320cb80007037e06320cbff6320cb02000014000021d4")
EL1H_64_SYNC = TEXT + len(VECTOR)
ENTRY_CODE = bytes.fromhex(
    "e00700a9e20f01a9e41702a9e61f03a9e82704a9ea2f05a9ec3706a9ee3f07a9f04708a9f24f09a9f4570aa9f65f0ba9f8670ca9fa6f0da9fc770ea9"
    "f5430591"
)
# A task stack is THREAD_SIZE (16 KiB) aligned to twice that, so bit 14 of any sp on it is clear.
STACK_BASE, STACK_SIZE = 0x80000, 0x4000


@pytest.mark.parametrize("sp", [STACK_BASE + STACK_SIZE, STACK_BASE + 0x1230, STACK_BASE + 0x200])
def test_vector_leaves_the_registers_and_decode_trap_finds_the_trapped_sp(sp: int) -> None:
    uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
    uc.mem_map(TEXT, 0x1000)
    uc.mem_map(STACK_BASE - 0x1000, STACK_SIZE + 0x2000)
    uc.mem_write(TEXT, VECTOR + ENTRY_CODE)
    before = {f"x{i}": 0x0101_0101_0000_0000 * (i + 1) + i for i in range(29)}
    before.update(x29=sp + 0x40, x30=0xFFFF800008123450)
    for name, value in before.items():
        uc.reg_write(getattr(A, f"UC_ARM64_REG_{name.upper()}"), value)
    uc.reg_write(A.UC_ARM64_REG_SP, sp)
    uc.emu_start(TEXT, EL1H_64_SYNC)  # the vector, up to the entry's first instruction

    regs = {name: uc.reg_read(getattr(A, f"UC_ARM64_REG_{name.upper()}")) for name in before}
    assert regs == before  # x0 borrowed and given back; nothing else touched
    regs.update(sp=uc.reg_read(A.UC_ARM64_REG_SP), pc=uc.reg_read(A.UC_ARM64_REG_PC), cpsr=0x3C5,
                ESR_EL1=0xF2000004, ELR_EL1=0xFFFF800008129ABC, SPSR_EL1=0x5)  # fmt: skip
    assert regs["pc"] == EL1H_64_SYNC
    trap = Arm64Traps().decode_trap(TrapHook.ENTRY, regs, lambda addr, size: bytes(uc.mem_read(addr, size)))
    assert trap.sp == sp
    assert trap.restore == {"pc": 0xFFFF800008129ABC, "sp": sp, "cpsr": 0x5}

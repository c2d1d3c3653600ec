"""Cross-check arm64 simulation and the slot's copies against a real A64 CPU model (unicorn).

Each simulated instruction runs once at its own address under unicorn and
once through simulate-insn.c's port from the same registers: x0-x30, sp,
pc and NZCV must come out equal.  A copy that runs out of line runs in its
slot up to the BRK after it, and the trap-step resume must leave the
registers as running the original in place does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

unicorn = pytest.importorskip(
    "unicorn", reason="unicorn is not installed (pip install unicorn); it only cross-checks the arch layer"
)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import arm64_const as A  # noqa: E402

from qprobe.arch.arm64.decode import ProbeInsn, arm_kprobe_decode_insn  # noqa: E402
from qprobe.arch.arm64.insn import BRK64_OPCODE_KPROBES_SS, DAIF_MASK  # noqa: E402
from qprobe.arch.arm64.kprobes import Arm64TrapStep, arch_setup_resume, prepare_kprobe, slot_code  # noqa: E402
from qprobe.arch.arm64.simulate import simulate  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from fakes_arm64 import FakeRegs  # noqa: E402

PAGE = 0x1000
ADDR = 0xFFFF800008A01234  # a kernel text address, 4-byte aligned
SLOT = 0xFFFF800010000040
NZCV_SHIFT = 28
UC_X = [getattr(A, f"UC_ARM64_REG_X{n}") for n in range(31)]


class Machine:
    """A unicorn A64 CPU with pages mapped (and filled with a pattern) on demand."""

    def __init__(self) -> None:
        self.uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
        self.uc.ctl_set_cpu_model(A.UC_CPU_ARM64_MAX)  # LSE atomics (ldadd) and the rest of -cpu max
        self.pages: set[int] = set()
        self.brk: list[int] = []
        # With count=1 unicorn still fetches at a branch's target; loads and stores go anywhere.
        self.uc.hook_add(unicorn.UC_HOOK_MEM_UNMAPPED, self._on_demand)
        self.uc.hook_add(unicorn.UC_HOOK_INTR, self._on_brk)

    def _on_demand(self, uc: object, access: int, addr: int, size: int, value: int, data: object) -> bool:
        for page in range(addr & ~(PAGE - 1), addr + size, PAGE):
            self.map(page)
        return True

    def _on_brk(self, uc: object, intno: int, data: object) -> None:
        self.brk.append(self.uc.reg_read(A.UC_ARM64_REG_PC))
        self.uc.emu_stop()

    def map(self, page: int) -> None:
        if page not in self.pages:
            self.uc.mem_map(page, PAGE)
            self.uc.mem_write(page, bytes((page >> 12) + i & 0xFF for i in range(PAGE)))
            self.pages.add(page)

    def read(self, addr: int, size: int) -> bytes:
        for page in range(addr & ~(PAGE - 1), addr + size, PAGE):
            self.map(page)
        return bytes(self.uc.mem_read(addr, size))

    def load(self, addr: int, code: bytes) -> None:
        self.read(addr, len(code))
        self.uc.mem_write(addr, code)

    def set(self, regs: FakeRegs) -> None:
        for n, reg in enumerate(UC_X):
            self.uc.reg_write(reg, getattr(regs, f"x{n}"))
        self.uc.reg_write(A.UC_ARM64_REG_SP, regs.sp)
        self.uc.reg_write(A.UC_ARM64_REG_NZCV, regs.pstate & 0xF << NZCV_SHIFT)

    def state(self) -> dict[str, int]:
        out = {f"x{n}": self.uc.reg_read(reg) for n, reg in enumerate(UC_X)}
        out["sp"] = self.uc.reg_read(A.UC_ARM64_REG_SP)
        out["pc"] = self.uc.reg_read(A.UC_ARM64_REG_PC)
        out["nzcv"] = self.uc.reg_read(A.UC_ARM64_REG_NZCV) >> NZCV_SHIFT
        return out


def state(regs: FakeRegs) -> dict[str, int]:
    out = {f"x{n}": getattr(regs, f"x{n}") for n in range(31)}
    return {**out, "sp": regs.sp, "pc": regs.pc, "nzcv": regs.pstate >> NZCV_SHIFT & 0xF}


u64s = st.integers(0, (1 << 64) - 1)
small = st.sampled_from([0, 1, 0x80000000, 0xFFFFFFFF, 0x1_0000_0000, 1 << 63, (1 << 64) - 1])
values = st.one_of(u64s, small)
reg_files = st.lists(values, min_size=31, max_size=31)
nzcvs = st.integers(0, 15)
rn = st.integers(0, 31)
imm14, imm19 = st.integers(0, (1 << 14) - 1), st.integers(0, (1 << 19) - 1)

b_cond = st.builds(lambda imm, c: 0x54000000 | imm << 5 | c, st.integers(0, (1 << 19) - 1), st.integers(0, 15))
cbz = st.builds(lambda sf, op, imm, rt: sf << 31 | 0x34000000 | op << 24 | imm << 5 | rt,
                st.integers(0, 1), st.integers(0, 1), st.integers(0, (1 << 19) - 1), rn)  # fmt: skip
tbz = st.builds(lambda b5, op, b40, imm, rt: b5 << 31 | 0x36000000 | op << 24 | b40 << 19 | imm << 5 | rt,
                st.integers(0, 1), st.integers(0, 1), st.integers(0, 31), imm14, rn)  # fmt: skip
adr = st.builds(lambda op, lo, hi, rd: op << 31 | lo << 29 | 0x10000000 | hi << 5 | rd,
                st.integers(0, 1), st.integers(0, 3), st.integers(0, (1 << 19) - 1), rn)  # fmt: skip
b_bl = st.builds(lambda op, imm: op << 31 | 0x14000000 | imm, st.integers(0, 1), st.integers(0, (1 << 26) - 1))
br = st.builds(lambda opc, n: 0xD61F0000 | opc << 21 | n << 5, st.sampled_from([0, 1, 2]), rn)
ldr_lit = st.builds(lambda opc, imm, rt: opc << 30 | 0x18000000 | imm << 5 | rt,
                    st.integers(0, 1), st.integers(0, (1 << 19) - 1), rn)  # fmt: skip
ldrsw_lit = st.builds(lambda imm, rt: 0x98000000 | imm << 5 | rt, st.integers(0, (1 << 19) - 1), rn)
SIMULATED = {"b_cond": b_cond, "cbz_cbnz": cbz, "tbz_tbnz": tbz, "adr_adrp": adr, "b_bl": b_bl,
             "br_blr_ret": br, "ldr_literal": ldr_lit, "ldrsw_literal": ldrsw_lit}  # fmt: skip


@pytest.mark.parametrize("version", [(6, 1), (6, 12)])
@pytest.mark.parametrize("kind", sorted(SIMULATED))
@settings(max_examples=40, deadline=None)
@given(data=st.data(), gprs=reg_files, nzcv=nzcvs, sp=u64s)
def test_simulation_matches_the_cpu(kind: str, version: tuple[int, int], data: st.DataObject, gprs: list[int],
                                    nzcv: int, sp: int) -> None:  # fmt: skip
    word = data.draw(SIMULATED[kind])
    decoded = arm_kprobe_decode_insn(word, b"", version)
    assert decoded.kind is ProbeInsn.INSN_GOOD_NO_SLOT and decoded.handler == f"simulate_{kind}"
    regs = FakeRegs(**{f"x{n}": v for n, v in enumerate(gprs)}, sp=sp, pc=ADDR,
                    pstate=nzcv << NZCV_SHIFT | 0x3C5)  # fmt: skip
    cpu = Machine()
    cpu.load(ADDR, word.to_bytes(4, "little"))
    cpu.set(regs)
    cpu.uc.emu_start(ADDR, 0, count=1)
    simulate(decoded.handler, word, ADDR, regs, cpu.read, version)
    assert state(regs) == cpu.state()
    assert regs.pstate & 0x3FF == 0x3C5  # the simulation leaves DAIF and the mode alone


# Instructions that run out of line: add x0, x1, x2; ldr x0, [x1, #8]; stp x29, x30, [sp, #-16]!;
# mov x29, sp; ldadd x0, x1, [x2]; str wzr, [x1, #12]; ubfx x1, x2, #4, #4; cmp x1, x2.
STEPPED = [0x8B020020, 0xF9400420, 0xA9BF7BFD, 0x910003FD, 0xF8200041, 0xB9000C3F, 0xD3441C41, 0xEB02003F]


@pytest.mark.parametrize("word", STEPPED, ids=lambda w: f"{w:08x}")
@pytest.mark.parametrize("daif", [0, 0x80, 0x3C0])
def test_trap_stepped_copy_matches_the_original(word: int, daif: int) -> None:
    """The copy runs in its slot to the BRK after it; the resume leaves what the original left in place."""
    prep = prepare_kprobe(word.to_bytes(4, "little"), ADDR, SLOT)
    gprs = {f"x{n}": 0xFFFF800011000000 + 0x100 * n for n in range(31)}
    original = Machine()
    original.load(ADDR, word.to_bytes(4, "little"))
    regs = FakeRegs(**gprs, sp=0xFFFF800012000800, pc=ADDR, pstate=0x60000005 | daif)
    original.set(regs)
    original.uc.emu_start(ADDR, 0, count=1)

    resume = arch_setup_resume(prep, regs, _NoMemory(), may_trap_step=True)
    assert resume.flags is not None and resume.flags & DAIF_MASK == DAIF_MASK
    slotted = Machine()
    slotted.load(SLOT, slot_code(prep))
    slotted.set(regs)
    slotted.uc.emu_start(resume.ip, 0, count=8)
    assert slotted.brk, "the copy never reached its BRK"
    trap = slotted.brk[0]
    assert int.from_bytes(slotted.read(trap, 4), "little") == BRK64_OPCODE_KPROBES_SS
    step = Arm64TrapStep()
    assert step.is_trap_step_start(prep, resume.ip) and step.is_trap_step_end(prep, trap)
    ran = slotted.state()
    after = FakeRegs(**{k: v for k, v in ran.items() if k.startswith("x")}, sp=ran["sp"], pc=trap,
                     pstate=ran["nzcv"] << NZCV_SHIFT | resume.flags & 0x3FF)  # fmt: skip
    step.arch_resume_trap_step(prep, after)
    assert after.pstate & DAIF_MASK == daif
    want = original.state()
    assert state(after) == want
    for addr in (0xFFFF800011000000, 0xFFFF800012000000):  # the memory either one wrote
        assert slotted.read(addr, 0x2000) == original.read(addr, 0x2000)


class _NoMemory:
    def read(self, addr: int, size: int) -> bytes:
        raise AssertionError("a copy that runs out of line reads no memory on the host")

    def write(self, addr: int, data: bytes) -> None:
        raise AssertionError("a copy that runs out of line writes no memory on the host")

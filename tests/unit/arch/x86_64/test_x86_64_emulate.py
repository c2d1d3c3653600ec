"""Host emulation of branches, calls, returns and loops (kprobe_emulate_*)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.emulate import emulate, jcc_taken
from qprobe.arch.x86_64.insn import PreparedInsn, prepare_kprobe

sys.path.insert(0, str(Path(__file__).parent))
from fakes_x86_64 import FakeMem, FakeRegs

ADDR = 0xFFFFFFFF81000100
SLOT = 0xFFFFFFFFA0000000
STACK = 0xFFFFC90000008000
M64 = (1 << 64) - 1
CF, PF, ZF, SF, OF = 1 << 0, 1 << 2, 1 << 6, 1 << 7, 1 << 11


def prep(hexcode: str) -> PreparedInsn:
    return prepare_kprobe(bytes.fromhex(hexcode) + b"\x90" * 16, ADDR, SLOT)


def run(hexcode: str, regs: FakeRegs | None = None, mem: FakeMem | None = None) -> tuple[FakeRegs, FakeMem]:
    regs = regs or FakeRegs(sp=STACK)
    mem = mem or FakeMem()
    regs.ip = ADDR
    emulate(prep(hexcode), regs, mem)
    return regs, mem


# Condition of each jcc (low opcode nibble), written from the Intel SDM's table.
CONDITIONS = {
    0x0: ("o", lambda c, p, z, s, o: o),
    0x1: ("no", lambda c, p, z, s, o: not o),
    0x2: ("b", lambda c, p, z, s, o: c),
    0x3: ("ae", lambda c, p, z, s, o: not c),
    0x4: ("e", lambda c, p, z, s, o: z),
    0x5: ("ne", lambda c, p, z, s, o: not z),
    0x6: ("be", lambda c, p, z, s, o: c or z),
    0x7: ("a", lambda c, p, z, s, o: not c and not z),
    0x8: ("s", lambda c, p, z, s, o: s),
    0x9: ("ns", lambda c, p, z, s, o: not s),
    0xA: ("p", lambda c, p, z, s, o: p),
    0xB: ("np", lambda c, p, z, s, o: not p),
    0xC: ("l", lambda c, p, z, s, o: s != o),
    0xD: ("ge", lambda c, p, z, s, o: s == o),
    0xE: ("le", lambda c, p, z, s, o: z or s != o),
    0xF: ("g", lambda c, p, z, s, o: not z and s == o),
}
FLAG_COMBOS = list(itertools.product([False, True], repeat=5))


def flags_of(c: bool, p: bool, z: bool, s: bool, o: bool) -> int:
    bits = (CF if c else 0) | (PF if p else 0) | (ZF if z else 0) | (SF if s else 0) | (OF if o else 0)
    return 0x202 | bits


@pytest.mark.parametrize("cc", range(16), ids=[CONDITIONS[i][0] for i in range(16)])
@pytest.mark.parametrize("form", ["short", "near"])
def test_every_jcc_against_every_flag_combination(cc: int, form: str) -> None:
    hexcode = f"{0x70 + cc:02x}10" if form == "short" else f"0f{0x80 + cc:02x}00100000"
    p = prep(hexcode)
    assert p.emulate == "jcc"
    length = 2 if form == "short" else 6
    target = ADDR + length + (0x10 if form == "short" else 0x1000)
    name, cond = CONDITIONS[cc]
    assert p.insn.mnemonic == f"j{name}"
    for combo in FLAG_COMBOS:
        regs = FakeRegs(sp=STACK, ip=ADDR, flags=flags_of(*combo))
        emulate(p, regs, FakeMem())
        expected = target if cond(*combo) else ADDR + length
        assert regs.ip == expected, (name, combo)
        assert regs.sp == STACK
        assert jcc_taken(cc, flags_of(*combo)) == cond(*combo)


def test_jcc_backwards_target() -> None:
    regs, _ = run("74f0", FakeRegs(sp=STACK, flags=ZF))  # je .-0xe
    assert regs.ip == ADDR + 2 - 0x10


def test_call_pushes_return_address() -> None:
    regs, mem = run("e8fb0f0000")
    assert regs.ip == ADDR + 5 + 0xFFB
    assert regs.sp == STACK - 8
    assert mem.u64(STACK - 8) == ADDR + 5


def test_jmp_rel8_and_rel32() -> None:
    assert run("ebfe")[0].ip == ADDR
    assert run("e900000080")[0].ip == (ADDR + 5 - 0x80000000) & M64


def test_ret_pops() -> None:
    mem = FakeMem()
    mem.put_u64(STACK, 0xFFFFFFFF81ABCDEF)
    regs, _ = run("c3", FakeRegs(sp=STACK), mem)
    assert regs.ip == 0xFFFFFFFF81ABCDEF
    assert regs.sp == STACK + 8


def test_ret_imm16_releases_arguments() -> None:
    mem = FakeMem()
    mem.put_u64(STACK, 0xFFFFFFFF81ABCDEF)
    regs, _ = run("c21800", FakeRegs(sp=STACK), mem)
    assert regs.ip == 0xFFFFFFFF81ABCDEF
    assert regs.sp == STACK + 8 + 0x18


@pytest.mark.parametrize(
    ("hexcode", "reg", "value"),
    [("ffd0", "ax", 0xFFFFFFFF81111111), ("41ffd3", "r11", 0xFFFFFFFF82222222), ("ffd5", "bp", 0x1234)],
)
def test_call_register(hexcode: str, reg: str, value: int) -> None:
    regs = FakeRegs(sp=STACK)
    setattr(regs, reg, value)
    regs, mem = run(hexcode, regs)
    assert regs.ip == value
    assert mem.u64(STACK - 8) == ADDR + len(bytes.fromhex(hexcode))


def test_call_rsp_uses_the_old_rsp() -> None:
    regs, _ = run("ffd4", FakeRegs(sp=STACK))
    assert regs.ip == STACK
    assert regs.sp == STACK - 8


def test_call_through_rip_relative_memory_reads_the_target() -> None:
    mem = FakeMem()
    pointer = ADDR + 6 + 0x1000
    mem.put_u64(pointer, 0xFFFFFFFF81C0FFEE)
    regs, mem = run("ff1500100000", FakeRegs(sp=STACK), mem)
    assert regs.ip == 0xFFFFFFFF81C0FFEE
    assert mem.u64(STACK - 8) == ADDR + 6


def test_call_through_base_index_memory() -> None:
    mem = FakeMem()
    regs = FakeRegs(sp=STACK, r8=0xFFFF888000001000, cx=3)
    mem.put_u64(0xFFFF888000001000 + 3 * 8 - 8, 0xFFFFFFFF81D00D00)
    regs, mem = run("41ff54c8f8", regs, mem)  # call [r8+rcx*8-8]
    assert regs.ip == 0xFFFFFFFF81D00D00
    assert mem.u64(STACK - 8) == ADDR + 5


def test_call_through_stack_memory_uses_old_rsp() -> None:
    mem = FakeMem()
    mem.put_u64(STACK + 8, 0xFFFFFFFF81E00E00)
    regs, _ = run("ff542408", FakeRegs(sp=STACK), mem)  # call [rsp+8]
    assert regs.ip == 0xFFFFFFFF81E00E00


def test_jmp_register() -> None:
    regs, _ = run("3effe0", FakeRegs(sp=STACK, ax=0xFFFFFFFF81F00000))  # notrack jmp rax
    assert regs.ip == 0xFFFFFFFF81F00000
    assert regs.sp == STACK


@pytest.mark.parametrize(
    ("rcx", "taken", "after"),
    [(1, False, 0), (2, True, 1), (0, True, M64), (0x1_0000_0001, True, 0x1_0000_0000)],
)
def test_loop_decrements_rcx_then_tests(rcx: int, taken: bool, after: int) -> None:
    regs, _ = run("e2f0", FakeRegs(sp=STACK, cx=rcx))
    assert regs.cx == after
    assert regs.ip == (ADDR + 2 - 0x10 if taken else ADDR + 2)


@pytest.mark.parametrize(("zf", "taken"), [(False, False), (True, True)])
def test_loope(zf: bool, taken: bool) -> None:
    regs, _ = run("e1f0", FakeRegs(sp=STACK, cx=5, flags=ZF if zf else 0))
    assert regs.cx == 4
    assert regs.ip == (ADDR + 2 - 0x10 if taken else ADDR + 2)


@pytest.mark.parametrize(("zf", "taken"), [(False, True), (True, False)])
def test_loopne(zf: bool, taken: bool) -> None:
    regs, _ = run("e0f0", FakeRegs(sp=STACK, cx=5, flags=ZF if zf else 0))
    assert regs.cx == 4
    assert regs.ip == (ADDR + 2 - 0x10 if taken else ADDR + 2)


def test_loope_with_count_reaching_zero_falls_through() -> None:
    regs, _ = run("e1f0", FakeRegs(sp=STACK, cx=1, flags=ZF))
    assert regs.cx == 0
    assert regs.ip == ADDR + 2


@pytest.mark.parametrize(("rcx", "taken"), [(0, True), (1, False), (0x1_0000_0000, False)])
def test_jrcxz(rcx: int, taken: bool) -> None:
    regs, _ = run("e310", FakeRegs(sp=STACK, cx=rcx))
    assert regs.cx == rcx
    assert regs.ip == (ADDR + 2 + 0x10 if taken else ADDR + 2)


@pytest.mark.parametrize(("rcx", "taken"), [(0, True), (0x1_0000_0000, True), (0x1_0000_0001, False)])
def test_jecxz_uses_ecx(rcx: int, taken: bool) -> None:
    regs, _ = run("67e310", FakeRegs(sp=STACK, cx=rcx))
    assert regs.ip == (ADDR + 3 + 0x10 if taken else ADDR + 3)


def test_addr32_loop_uses_ecx_and_zero_extends() -> None:
    regs, _ = run("67e2f0", FakeRegs(sp=STACK, cx=0xFFFF_FFFF_0000_0001))
    assert regs.cx == 0  # ecx 1 -> 0: not taken, upper half cleared
    assert regs.ip == ADDR + 3
    regs, _ = run("67e2f0", FakeRegs(sp=STACK, cx=0x5_0000_0000))
    assert regs.cx == 0xFFFF_FFFF  # ecx 0 wraps, taken
    assert regs.ip == ADDR + 3 - 0x10


def test_emulate_single_stepped_instruction_is_an_error() -> None:
    with pytest.raises(ValueError):
        emulate(prep("4889e5"), FakeRegs(), FakeMem())


def in_place(hexcode: str, regs: FakeRegs) -> bool:
    """The stub breakpoint's emulation of the instruction at ``regs.ip``, whose bytes the memory holds."""
    mem = FakeMem()
    mem.write(regs.ip, bytes.fromhex(hexcode) + b"\xcc" * 16)
    return X86_64().arch_emulate_in_place(regs, mem)  # type: ignore[arg-type]


@pytest.mark.parametrize(("hexcode", "ip", "sp"), [
    ("0f1f440000", ADDR + 5, STACK),  # the __fentry__ site: a 5-byte nop
    ("6690", ADDR + 2, STACK),
    ("e8fb0f0000", ADDR + 0x1000, STACK - 8),  # call: the return address pushed
    ("eb10", ADDR + 0x12, STACK),
])  # fmt: skip
def test_in_place_a_nop_or_a_branch_is_performed_by_the_host(hexcode: str, ip: int, sp: int) -> None:
    regs = FakeRegs(sp=STACK, ip=ADDR)
    assert in_place(hexcode, regs) and (regs.ip, regs.sp) == (ip, sp)


@pytest.mark.parametrize("hexcode", ["f30f1efa", "55", "4889e5", "fa", "ff2500010000"],
                         ids=["endbr64", "push", "mov", "cli", "jmp-mem"])  # fmt: skip
def test_in_place_any_other_instruction_is_left_to_a_step(hexcode: str) -> None:
    regs = FakeRegs(sp=STACK, ip=ADDR)
    assert not in_place(hexcode, regs) and regs == FakeRegs(sp=STACK, ip=ADDR)

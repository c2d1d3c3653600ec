"""can_boost, synthesized jumps and jump-optimization checks (opt.c)."""

from __future__ import annotations

import pytest

from qprobe.arch.x86_64.boost import can_boost, synthesize_relcall, synthesize_reljump, twobyte_is_boostable
from qprobe.arch.x86_64.decode import decode_one
from qprobe.arch.x86_64.opt import can_optimize, insn_is_indirect_jump, insn_jump_into_range
from qprobe.errors import DisplacementOverflow

ADDR = 0xFFFFFFFF81000000


@pytest.mark.parametrize(
    ("hexcode", "boostable"),
    [
        ("4889e5", True),  # mov
        ("55", True),  # push
        ("c3", True),  # ret: Linux boosts it
        ("ffe0", True),  # jmp rax: the only boostable grp5
        ("ff2500000000", True),  # jmp [rip]
        ("ffd0", False),  # call rax
        ("ff1500000000", False),  # call [rip]
        ("fec0", False),  # grp4
        ("f7d8", False),  # grp3 (neg)
        ("d1e0", False),  # grp2 (shl)
        ("c1e003", False),  # grp2 (shl imm)
        ("7400", False),  # jcc
        ("e800000000", False),  # call
        ("e900000000", False),  # jmp
        ("eb00", False),  # jmp short
        ("e2fe", False),  # loop
        ("cc", False),  # int3
        ("cd80", False),  # int
        ("f4", False),  # hlt
        ("f3a4", True),  # rep movsb: Linux only refuses 2e/67 prefixes
        ("2e4889e5", False),  # CS override
        ("674889e5", False),  # address-size override
        ("0fb6c0", True),  # movzx: bitmap b6
        ("0f1f00", True),  # nopl: bitmap 1f
        ("0f0b", False),  # ud2: bitmap 0b
        ("0f8400000000", False),  # jcc near: bitmap 8x
        ("0f05", False),  # syscall
        ("f30f1efa", False),  # endbr64: bitmap 1e
        ("0f31", True),  # rdtsc
        ("660f3a0fc108", False),  # 3-byte opcode
        ("c5fd6fc1", True),  # VEX: one opcode byte (6f), as in Linux
        ("fa", True),  # cli
        ("9d", True),  # popf
    ],
)
def test_can_boost(hexcode: str, boostable: bool) -> None:
    insn = decode_one(bytes.fromhex(hexcode), ADDR)
    assert can_boost(insn) is boostable


def test_rep_prefix_is_not_checked_for_one_byte_opcodes() -> None:
    # Linux only refuses 0x2e and 0x67 among prefixes; rep movsb's opcode is a4.
    insn = decode_one(bytes.fromhex("f3a4"), ADDR)
    assert insn.raw[insn.opcode_offset] == 0xA4


def test_can_boost_refuses_exception_table_entries() -> None:
    insn = decode_one(bytes.fromhex("488b06"), ADDR)
    assert can_boost(insn, set())
    assert not can_boost(insn, {ADDR})
    assert not can_boost(insn, lambda a: a == ADDR)


def test_twobyte_bitmap_spot_checks() -> None:
    assert len(twobyte_is_boostable) == 256
    assert sum(twobyte_is_boostable) == 126  # counted by hand from Linux's table
    assert twobyte_is_boostable[0xA2] is False  # cpuid
    assert twobyte_is_boostable[0xAF] is True  # imul


def test_synthesize_reljump_and_relcall() -> None:
    src, dst = ADDR, ADDR + 0x1234
    jmp = synthesize_reljump(src, dst)
    assert jmp[0] == 0xE9 and len(jmp) == 5
    assert decode_one(jmp, src).branch_target == dst
    call = synthesize_relcall(src, ADDR - 0x100)
    assert call[0] == 0xE8
    assert decode_one(call, src).branch_target == ADDR - 0x100
    # wrap-around across the top of the address space works like the CPU
    top = 0xFFFFFFFFFFFFFF00
    assert decode_one(synthesize_reljump(top, 0x100), top).branch_target == 0x100
    assert decode_one(synthesize_reljump(ADDR, 0x1000), ADDR).branch_target == 0x1000


@pytest.mark.parametrize("dst", [ADDR + 5 + (1 << 31), ADDR + 5 - (1 << 31) - 1, 0x1_0000_0000])
def test_synthesize_reljump_overflow(dst: int) -> None:
    with pytest.raises(DisplacementOverflow):
        synthesize_reljump(ADDR, dst)


def test_synthesize_reljump_limits() -> None:
    assert synthesize_reljump(ADDR, ADDR + 5 + (1 << 31) - 1)[1:] == b"\xff\xff\xff\x7f"
    assert synthesize_reljump(ADDR, ADDR + 5 - (1 << 31))[1:] == b"\x00\x00\x00\x80"


# --- can_optimize ---------------------------------------------------------

FUNC = bytes.fromhex(
    "55"  # +0x00 push rbp
    "4889e5"  # +0x01 mov rbp,rsp
    "4883ec10"  # +0x04 sub rsp,0x10
    "488b0500100000"  # +0x08 mov rax,[rip+0x1000]
    "4885c0"  # +0x0f test rax,rax
    "7404"  # +0x12 je +0x18
    "4883c001"  # +0x14 add rax,1
    "c9"  # +0x18 leave
    "c3"  # +0x19 ret
    "cccccccccc"  # +0x1a padding
)


def test_can_optimize_ok_reports_displaced_size() -> None:
    ok, reason, size = can_optimize(FUNC, ADDR, ADDR)
    assert (ok, reason, size) == (True, "", 8)  # push(1) + mov(3) + sub(4)
    assert can_optimize(FUNC, ADDR, ADDR + 8) == (True, "", 7)
    assert can_optimize(FUNC, ADDR, ADDR + 8, buffer_addr=ADDR + 0x10000).ok


def test_can_optimize_refuses_a_cold_part() -> None:
    res = can_optimize(FUNC, ADDR, ADDR, name="__x64_sys_gethostname.cold")
    assert not res.ok and "cold part" in res.reason
    assert can_optimize(FUNC, ADDR, ADDR, name="__x64_sys_gethostname").ok


def test_can_optimize_rip_relative_out_of_reach_of_buffer() -> None:
    res = can_optimize(FUNC, ADDR, ADDR + 8, buffer_addr=ADDR + (1 << 40))
    assert not res.ok and "relocated" in res.reason


def test_can_optimize_refuses_jump_into_replaced_bytes() -> None:
    # je at +0x12 targets +0x18; a probe at +0x14 would replace +0x15..+0x18.
    res = can_optimize(FUNC, ADDR, ADDR + 0x14, name="f")
    assert not res.ok
    assert "jumps into" in res.reason and "f+0x12" in res.reason


JUMPY = bytes.fromhex(
    "7408"  # +0x00 je +0x0a
    "4889e5"  # +0x02 mov rbp,rsp
    "4883ec10"  # +0x05 sub rsp,0x10
    "90"  # +0x09 nop
    "4889c7"  # +0x0a mov rdi,rax
    "4883c708"  # +0x0d add rdi,8
    "c3"  # +0x11 ret
)


def test_can_optimize_allows_a_jump_to_the_probe_itself() -> None:
    assert can_optimize(JUMPY, ADDR, ADDR + 0xA) == (True, "", 7)


def test_can_optimize_refuses_a_jump_right_after_the_five_bytes_as_linux_does() -> None:
    # Linux's range check is start <= target <= start + len, i.e. addr+1..addr+5.
    res = can_optimize(JUMPY, ADDR, ADDR + 0x5)
    assert not res.ok and "jumps into" in res.reason


def test_can_optimize_refuses_a_region_with_jcc() -> None:
    res = can_optimize(FUNC, ADDR, ADDR + 0xF)  # test(3) + je(2): je is not boostable
    assert not res.ok and "not boostable" in res.reason


def test_can_optimize_refuses_indirect_jumps_anywhere() -> None:
    code = FUNC[:0x18] + bytes.fromhex("ffe0") + FUNC[0x18:]
    res = can_optimize(code, ADDR, ADDR)
    assert not res.ok and "indirect jump" in res.reason


def test_can_optimize_refuses_jumps_into_the_retpoline_thunk() -> None:
    thunk = (ADDR + 0x100000, ADDR + 0x100100)
    code = bytes.fromhex("4889e54883ec10") + synthesize_reljump(ADDR + 7, thunk[0] + 0x20) + b"\xc3"
    assert can_optimize(code, ADDR, ADDR).ok
    res = can_optimize(code, ADDR, ADDR, indirect_thunk=thunk)
    assert not res.ok and "indirect jump" in res.reason


def test_can_optimize_refuses_functions_with_exception_table_entries() -> None:
    assert not can_optimize(FUNC, ADDR, ADDR, {ADDR + 0x14}).ok
    assert not can_optimize(FUNC, ADDR, ADDR, lambda a: a == ADDR + 0x14).ok
    assert can_optimize(FUNC, ADDR, ADDR, {ADDR + 0x1000}).ok


def test_can_optimize_int3_in_body_vs_padding() -> None:
    body = FUNC[:0x14] + b"\xcc" + FUNC[0x15:]
    res = can_optimize(body, ADDR, ADDR)
    assert not res.ok and "int3" in res.reason


def test_can_optimize_recovers_our_own_probe() -> None:
    armed = b"\xcc" + FUNC[1:]
    assert not can_optimize(armed, ADDR, ADDR).ok
    assert can_optimize(armed, ADDR, ADDR, patched={ADDR: 0x55}).ok


def test_can_optimize_refuses_another_probe_inside_the_region() -> None:
    armed = FUNC[:4] + b"\xcc" + FUNC[5:]
    res = can_optimize(armed, ADDR, ADDR, patched={ADDR + 4: 0x48})
    assert not res.ok and "another probe" in res.reason


def test_can_optimize_needs_a_boundary() -> None:
    res = can_optimize(FUNC, ADDR, ADDR + 2, name="f")
    assert res == (False, "f+0x2 is not an instruction boundary", 0)


def test_can_optimize_needs_five_bytes() -> None:
    res = can_optimize(FUNC[:0x1A], ADDR, ADDR + 0x18)
    assert not res.ok and "needs 5" in res.reason
    assert not can_optimize(FUNC, ADDR, ADDR + 0x100).ok


def test_insn_jump_into_range_bounds_and_calls() -> None:
    jmp = decode_one(synthesize_reljump(ADDR, ADDR + 0x10), ADDR)
    assert insn_jump_into_range(jmp, ADDR + 0x10, 0)
    assert insn_jump_into_range(jmp, ADDR + 0xC, 4)
    assert not insn_jump_into_range(jmp, ADDR + 0x11, 4)
    call = decode_one(synthesize_relcall(ADDR, ADDR + 0x10), ADDR)
    assert not insn_jump_into_range(call, ADDR + 0x10, 4)


@pytest.mark.parametrize(
    ("hexcode", "indirect"),
    [
        ("ffe0", True),
        ("ff2500000000", True),
        ("ff2c2500000000", True),
        ("ffd0", False),
        ("e900000000", False),
    ],
)
def test_insn_is_indirect_jump(hexcode: str, indirect: bool) -> None:
    assert insn_is_indirect_jump(decode_one(bytes.fromhex(hexcode), ADDR)) is indirect

"""Decoding and instruction-boundary checks (Linux's can_probe)."""

from __future__ import annotations

import pytest

from qprobe.arch.x86_64.decode import check_boundary, decode_all, decode_one, recover_bytes, skip_prefixes
from qprobe.errors import CannotProbe, NotInstructionBoundary

START = 0xFFFFFFFF81234000

# A small function as gcc emits it with IBT and SLS hardening.
FUNC = bytes.fromhex(
    "f30f1efa"  # +0x00 endbr64
    "55"  # +0x04 push rbp
    "4889e5"  # +0x05 mov rbp,rsp
    "488b0510000000"  # +0x08 mov rax,[rip+0x10]
    "e800000000"  # +0x0f call
    "5d"  # +0x14 pop rbp
    "c3"  # +0x15 ret
    "cc"  # +0x16 int3 (SLS)
    "90"  # +0x17 nop
)
BOUNDARIES = [0x0, 0x4, 0x5, 0x8, 0xF, 0x14, 0x15, 0x16, 0x17]


def test_decode_one_fields() -> None:
    insn = decode_one(bytes.fromhex("488b0578563412") + b"\x90" * 9, 0xFFFFFFFF81000000)
    assert insn.length == 7
    assert insn.raw == bytes.fromhex("488b0578563412")
    assert insn.text == "mov rax,[rip+0x12345678]"
    assert insn.mnemonic == "mov"
    assert insn.is_rip_relative
    assert insn.memory_target == 0xFFFFFFFF81000007 + 0x12345678
    assert insn.flow == "next"
    assert insn.next_addr == 0xFFFFFFFF81000007
    assert (insn.disp_offset, insn.disp_size) == (3, 4)


@pytest.mark.parametrize(
    ("hexcode", "flow", "text"),
    [
        ("e8fb0f0000", "call", "call 0x2000"),
        ("ffd0", "indirect_call", "call rax"),
        ("c3", "return", "ret"),
        ("7400", "conditional_branch", "je short 0x1002"),
        ("cc", "interrupt", "int3"),
        ("0f0b", "exception", "ud2"),
    ],
)
def test_decode_one_flow(hexcode: str, flow: str, text: str) -> None:
    insn = decode_one(bytes.fromhex(hexcode), 0x1000)
    assert insn.flow == flow
    assert insn.text == text


@pytest.mark.parametrize("hexcode", ["06", "ce", "0fff", "488b"])
def test_decode_one_invalid_or_truncated(hexcode: str) -> None:
    with pytest.raises(CannotProbe):
        decode_one(bytes.fromhex(hexcode), 0x1000)


def test_decode_all_sweeps_whole_function() -> None:
    insns = decode_all(FUNC, START)
    assert [i.addr - START for i in insns] == BOUNDARIES
    assert insns[-1].next_addr == START + len(FUNC)


@pytest.mark.parametrize("off", BOUNDARIES)
def test_check_boundary_accepts_boundaries(off: int) -> None:
    insn = check_boundary(FUNC, START, START + off)
    assert insn.addr == START + off


@pytest.mark.parametrize(
    ("off", "prev", "nxt"),
    [(1, 0, 4), (3, 0, 4), (6, 5, 8), (7, 5, 8), (9, 8, 0xF), (0xE, 8, 0xF), (0x10, 0xF, 0x14)],
)
def test_check_boundary_rejects_inside(off: int, prev: int, nxt: int) -> None:
    with pytest.raises(NotInstructionBoundary) as exc:
        check_boundary(FUNC, START, START + off, name="f")
    assert str(exc.value) == (f"f+{off:#x} is not an instruction boundary (nearest: +{prev:#x} and +{nxt:#x})")


def test_check_boundary_message_like_vfs_read() -> None:
    code = bytes.fromhex("e800000000") + bytes.fromhex("4889e5c3")
    with pytest.raises(
        NotInstructionBoundary,
        match=r"^vfs_read\+0x3 is not an instruction boundary "
        r"\(nearest: \+0x0 and \+0x5\)$",
    ):
        check_boundary(code, START, START + 3, name="vfs_read")


def test_check_boundary_without_name_uses_address() -> None:
    with pytest.raises(NotInstructionBoundary, match=f"^{START + 1:#x} is not"):
        check_boundary(FUNC, START, START + 1)


@pytest.mark.parametrize("off", [-1, len(FUNC), len(FUNC) + 10])
def test_check_boundary_outside_function(off: int) -> None:
    with pytest.raises(NotInstructionBoundary, match="outside"):
        check_boundary(FUNC, START, START + off)


def test_check_boundary_recovers_our_int3() -> None:
    # qprobe armed a probe at +0x0 of "mov eax,0x02030405; ret" (b8 -> cc).
    # Decoded raw, the int3 is followed by "add eax,imm32", which swallows
    # the ret; ``patched`` puts the original byte back first.
    code = bytes.fromhex("b805040302c390909090")
    armed = b"\xcc" + code[1:]
    with pytest.raises(NotInstructionBoundary):
        check_boundary(armed, START, START + 5)
    assert check_boundary(armed, START, START + 5, patched={START: 0xB8}).text == "ret"
    assert check_boundary(armed, START, START, patched={START: 0xB8}).raw == code[:5]
    assert check_boundary(armed, START, START).text == "int3"


def test_patched_outside_range_is_ignored() -> None:
    insn = check_boundary(FUNC, START, START + 4, patched={START - 1: 0x90, START + 0x1000: 0x90})
    assert insn.text == "push rbp"


def test_check_boundary_invalid_before_addr() -> None:
    code = bytes.fromhex("900690")
    with pytest.raises(CannotProbe, match="invalid"):
        check_boundary(code, START, START + 2)


@pytest.mark.parametrize(
    ("hexcode", "offset"),
    [("c3", 0), ("66c3", 1), ("f3480f1efa", 2), ("2e3e0f1f00", 2), ("4c8b00", 1), ("c5fd6f00", 0)],
)
def test_skip_prefixes(hexcode: str, offset: int) -> None:
    assert skip_prefixes(bytes.fromhex(hexcode)) == offset


def test_recover_bytes_reads_the_same_from_a_few_patches_or_from_many() -> None:
    start = 0xFFFF_FFFF_8100_0000
    code = bytes([0xCC, 0x89, 0xE5, 0xCC])
    mine = {start: 0x55, start + 3: 0xC3}
    far = {start + 0x1000 + i: 0x90 for i in range(10)}  # other functions' int3s: more than the function's bytes
    assert recover_bytes(code, start, mine) == bytes([0x55, 0x89, 0xE5, 0xC3])
    assert recover_bytes(code, start, {**mine, **far}) == bytes([0x55, 0x89, 0xE5, 0xC3])
    assert recover_bytes(code, start, far) == code

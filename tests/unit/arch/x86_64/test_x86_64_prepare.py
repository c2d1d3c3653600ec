"""prepare_kprobe: what runs in the slot, what is emulated, what is refused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from qprobe.arch.x86_64.arch import X86_64, X86TrapStep
from qprobe.arch.x86_64.decode import decode_one
from qprobe.arch.x86_64.insn import (
    TRAP_COPY,
    PreparedInsn,
    StepOutsideSlot,
    arch_adjust_kprobe_addr,
    prepare_kprobe,
    resume_singlestep,
    resume_trap_step,
)
from qprobe.errors import CannotProbe, DisplacementOverflow, ProbeBusy

ADDR = 0xFFFFFFFF81234560
SLOT = ADDR + 0x30000000
PAD = b"\x90" * 16


def prep(hexcode: str, addr: int = ADDR, slot: int = SLOT, **kw: object) -> PreparedInsn:
    return prepare_kprobe(bytes.fromhex(hexcode) + PAD, addr, slot, **kw)  # type: ignore[arg-type]


@dataclass
class IP:
    ip: int


def test_rip_relative_mov_is_relocated_to_the_slot() -> None:
    p = prep("488b0578563412")
    target = ADDR + 7 + 0x12345678
    assert p.emulate is None
    assert len(p.copy) == 7
    assert p.copy[:3] == bytes.fromhex("488b05")
    moved = decode_one(p.copy, SLOT)
    assert moved.memory_target == target
    assert moved.text == "mov rax,[rip-0x1dcba988]"  # 0x12345678 - 0x30000000
    assert int.from_bytes(p.copy[3:], "little", signed=True) == target - (SLOT + 7)


def test_rip_relative_relocation_downwards() -> None:
    slot = ADDR - 0x7000_0000
    p = prep("488d3d00000080", slot=slot)  # lea rdi,[rip-0x80000000]
    assert decode_one(p.copy, slot).memory_target == p.insn.memory_target


def test_rip_relative_with_immediate_keeps_the_immediate() -> None:
    p = prep("48c705f0ffffff2a000000")  # mov qword [rip-0x10],0x2a
    moved = decode_one(p.copy, SLOT)
    assert moved.memory_target == ADDR + 11 - 0x10
    assert moved.instr.immediate32 == 0x2A


@pytest.mark.parametrize(
    ("addr", "slot"),
    [
        (ADDR, ADDR - 0x9000_0000),
        (ADDR, ADDR - (1 << 40)),
        (0xFFFFFFFFC0000000, 0xFFFFFFFFC0000000 - 0x8000_0000 - 0x100),  # just out of reach
        (0xFFFF888000000000, 0xFFFF888000000000 + 0x9000_0000),
    ],
)
def test_rip_relative_displacement_overflow(addr: int, slot: int) -> None:
    with pytest.raises(DisplacementOverflow, match="2 GiB"):
        prep("488b0500000000", addr=addr, slot=slot)


def test_rip_relative_displacement_at_the_limit() -> None:
    # new disp = target - (slot + 7) = -2**31 exactly: still fits
    addr = 0xFFFF888000000000
    target = addr + 7
    p = prep("488b0500000000", addr=addr, slot=target + (1 << 31) - 7)
    assert p.copy[3:] == b"\x00\x00\x00\x80"
    assert decode_one(p.copy, p.slot_addr).memory_target == target
    with pytest.raises(DisplacementOverflow):
        prep("488b0500000000", addr=addr, slot=target + (1 << 31) - 6)


def test_slot_address_must_be_64_bit() -> None:
    with pytest.raises(ValueError):
        prep("90", slot=1 << 64)


def test_non_rip_relative_copy_is_verbatim_and_any_distance_works() -> None:
    p = prep("4889e5", slot=0x1000)
    assert p.copy == bytes.fromhex("4889e5")
    assert p.emulate is None


@pytest.mark.parametrize(
    ("hexcode", "kind"),
    [
        ("e800100000", "call"),
        ("e9fbffffff", "jmp"),
        ("ebfe", "jmp"),
        ("7402", "jcc"),
        ("0f8400010000", "jcc"),
        ("e2fe", "loop"),
        ("e1fe", "loop"),
        ("e0fe", "loop"),
        ("e3fe", "loop"),
        ("67e3fe", "loop"),
        ("c3", "ret"),
        ("c21000", "ret"),
        ("ffd0", "call_indirect"),
        ("41ffd3", "call_indirect"),
        ("ff1500100000", "call_indirect"),
        ("ff5408f8", "call_indirect"),
        ("ffe0", "jmp_indirect"),
        ("3effe0", "jmp_indirect"),
    ],
)
def test_emulated_instructions_have_no_copy(hexcode: str, kind: str) -> None:
    p = prep(hexcode)
    assert p.emulate == kind
    assert p.copy == b""
    assert not p.boostable


def test_memory_indirect_jmp_is_single_stepped_with_fixup() -> None:
    p = prep("ff2500100000")  # jmp [rip+0x1000]
    assert p.emulate is None
    assert decode_one(p.copy, SLOT).memory_target == ADDR + 6 + 0x1000
    assert not p.resume_fixes_ip
    regs = IP(0xFFFFFFFF81999999)  # the jump's target, already absolute
    resume_singlestep(p, regs)
    assert regs.ip == 0xFFFFFFFF81999999


@pytest.mark.parametrize("hexcode", ["9c", "9d", "fa", "fb", "4889e5", "f3a4", "0f31"])
def test_ordinary_and_if_modifying_instructions_are_copied(hexcode: str) -> None:
    p = prep(hexcode)
    assert p.emulate is None
    assert p.copy == bytes.fromhex(hexcode)
    # cli/sti/pushfq/popfq are emulated where they are not boosted; the others run to an int3 after them.
    assert p.if_modifier == (hexcode in ("9c", "9d", "fa", "fb"))
    assert p.trap_copies == (() if p.if_modifier else (p.copy + b"\xcc",) * 2)
    assert p.step_reason is None


@pytest.mark.parametrize(
    ("hexcode", "table", "reason"),
    [
        ("8b07", {ADDR}, "exception-table entry"),  # mov eax,[rdi]: a user access with a fixup
        ("ff2500100000", None, "jumps through memory"),  # jmp [rip+0x1000]: no int3 after it runs
        ("669c", None, "16-bit flags"),  # pushfw
    ],
)
def test_what_the_host_still_single_steps_and_why(hexcode: str, table: set[int] | None, reason: str) -> None:
    p = prep(hexcode, exception_table=table)
    assert p.step_reason is not None and reason in p.step_reason
    assert p.trap_copies == () and not p.if_modifier


def test_the_slot_holds_the_boosted_copy_and_the_two_int3_terminated_copies() -> None:
    p = prep("488b0500100000")  # mov rax,[rip+0x1000]: relocated separately for each place
    code = p.slot_code()
    assert len(code) == X86_64.slot_size == 64
    assert code[:12] == p.boosted_copy() and set(code[12:32]) == {0xCC}
    for off in TRAP_COPY:
        copy = decode_one(code[off : off + 7], SLOT + off)
        assert copy.memory_target == ADDR + 7 + 0x1000 and copy.length == 7
        assert code[off + 7] == 0xCC and set(code[off + 8 : off + 16]) == {0xCC}


def test_a_step_only_instruction_leaves_the_trap_copies_as_int3s() -> None:
    code = prep("8b07", exception_table={ADDR}).slot_code()
    assert code[:2] == bytes.fromhex("8b07") and set(code[2:]) == {0xCC}


@dataclass
class IPFlags:
    ip: int
    sp: int = 0
    flags: int = 0x46


@pytest.mark.parametrize(("off", "flags"), [(TRAP_COPY[0], 0x46), (TRAP_COPY[1], 0x246)])
def test_the_second_trap_maps_ip_back_and_gives_if_back_to_the_context_that_had_it(off: int, flags: int) -> None:
    p = prep("4889e5")  # mov rbp,rsp
    regs = IPFlags(SLOT + off + 3)  # the int3 after the copy
    resume_trap_step(p, regs)
    assert (regs.ip, regs.flags) == (ADDR + 3, flags)
    arch = X86TrapStep()
    assert arch.is_trap_step_end(p, SLOT + off + 3) and arch.is_trap_step_start(p, SLOT + off)
    assert not arch.is_trap_step_end(p, SLOT + off) and not arch.is_trap_step_end(p, SLOT + 3)


def test_a_second_trap_anywhere_else_is_reported() -> None:
    with pytest.raises(StepOutsideSlot):
        resume_trap_step(prep("4889e5"), IPFlags(SLOT + TRAP_COPY[0] + 1))


@pytest.mark.parametrize(
    ("ip_off", "flags", "expected"),
    [(0, 0x46, (ADDR, 0x46)), (3, 0x46, (ADDR + 3, 0x46)), (TRAP_COPY[0] + 3, 0x46, (ADDR + 3, 0x46)),
     (TRAP_COPY[1], 0x46, (ADDR, 0x246)), (TRAP_COPY[1] + 3, 0x46, (ADDR + 3, 0x246)), (64, 0x46, None)],
)  # fmt: skip
def test_recovery_maps_any_place_in_a_slot_back_to_the_text(ip_off: int, flags: int,
                                                            expected: tuple[int, int] | None) -> None:  # fmt: skip
    assert X86_64().arch_slot_resume(SLOT, ADDR, SLOT + ip_off, flags) == expected


def test_int3_already_there_is_busy() -> None:
    with pytest.raises(ProbeBusy, match="another int3 is already at vfs_read\\+0x4"):
        prep("cc", where="vfs_read+0x4")


def test_our_own_int3_is_recovered() -> None:
    p = prep("cc8b0500000000", patched={ADDR: 0x48})
    assert p.insn.text.startswith("mov rax,[rip")
    assert p.opcode == 0x48


@pytest.mark.parametrize(
    ("hexcode", "reason"),
    [
        ("0f0b", "BUG/WARN"),
        ("0fb9c0", "BUG/WARN"),
        ("0fffc0", "BUG/WARN"),
        ("cd80", "software interrupt"),
        ("f1", "software interrupt"),
        ("ce", "invalid"),
        ("cf", "interrupt return"),
        ("48cf", "interrupt return"),
        ("cb", "far"),
        ("ca0800", "far"),
        ("ff1c2500000000", "far"),
        ("ff2c2500000000", "far"),
        ("0f05", "privilege"),
        ("0f07", "privilege"),
        ("0f34", "privilege"),
        ("0f35", "privilege"),
        ("8ed0", "masks interrupts"),
        ("8e1500000000", "masks interrupts"),
        ("17", "invalid"),
        ("f4", "waits for an interrupt"),
        ("0f01c9", "waits for an interrupt"),
        ("0f01c1", "VM/enclave"),
        ("0f01c4", "VM/enclave"),
        ("0f0b78656e0fa2", "xen emulate prefix"),
        ("0f0b6b766d0fa2", "kvm emulate prefix"),
        ("c7f800000000", "transaction"),
        ("6548ff1500000000", "fs:/gs:"),
        ("67ffd0", "32-bit address size"),
        ("67ff10", "32-bit address size"),
        ("06", "invalid"),
    ],
)
def test_refused_instructions(hexcode: str, reason: str) -> None:
    with pytest.raises(CannotProbe, match=reason) as exc:
        prep(hexcode, where="f+0x10")
    msg = str(exc.value)
    assert msg.startswith("cannot probe f+0x10: ")
    assert "\n" not in msg


def test_truncated_code_is_refused() -> None:
    with pytest.raises(CannotProbe, match="truncated"):
        prepare_kprobe(bytes.fromhex("488b05"), ADDR, SLOT)


def test_boostable_copy_jumps_back() -> None:
    p = prep("4889e5")
    assert p.boostable
    boosted = p.boosted_copy()
    assert boosted[:3] == p.copy
    jmp = decode_one(boosted[3:], SLOT + 3)
    assert jmp.text == f"jmp {ADDR + 3:#x}"


def test_not_boostable_when_in_exception_table_or_jump_too_far() -> None:
    assert not prep("488b06", exception_table={ADDR}).boostable
    assert prep("488b06", exception_table={ADDR}).in_exception_table
    assert not prep("488b06", exception_table=lambda a: a == ADDR).boostable
    assert not prep("488b06", slot=ADDR - (1 << 33)).boostable
    with pytest.raises(CannotProbe, match="not boostable"):
        prep("0f0d08").boosted_copy()  # prefetch: 0f 0d is not in the bitmap


def test_resume_singlestep_maps_slot_to_original() -> None:
    p = prep("488b0578563412")
    regs = IP(SLOT + 7)
    resume_singlestep(p, regs)
    assert regs.ip == ADDR + 7


def test_rep_string_step_that_stays_on_the_copy() -> None:
    p = prep("f3a4")
    regs = IP(SLOT)
    resume_singlestep(p, regs)
    assert regs.ip == ADDR


def test_resume_singlestep_outside_slot_is_reported() -> None:
    p = prep("488b06")
    with pytest.raises(StepOutsideSlot):
        resume_singlestep(p, IP(0xFFFFFFFF81E00000))


def test_resume_singlestep_of_emulated_is_an_error() -> None:
    with pytest.raises(ValueError):
        resume_singlestep(prep("c3"), IP(SLOT))


@pytest.mark.parametrize(
    ("head", "offset", "expected"),
    [
        ("f30f1efa55", 0, (4, True)),
        ("f30f1efa55", 4, (4, True)),
        ("f30f1efa55", 5, (5, False)),
        ("660f1f0055", 0, (4, True)),
        ("5548", 0, (0, True)),
        ("5548", 1, (1, False)),
    ],
)
def test_arch_adjust_kprobe_addr(head: str, offset: int, expected: tuple[int, bool]) -> None:
    addr, on_entry = arch_adjust_kprobe_addr(bytes.fromhex(head), ADDR, offset)
    assert (addr - ADDR, on_entry) == expected


@dataclass
class IPSP:
    ip: int
    sp: int


class Stack:
    def __init__(self, sp: int, word: int) -> None:
        self.mem = {sp: word.to_bytes(8, "little")}

    def read(self, addr: int, size: int) -> bytes:
        return self.mem[addr][:size]

    def write(self, addr: int, data: bytes) -> None:
        self.mem[addr] = data


def test_stepped_pushf_has_tf_cleared_in_the_pushed_word() -> None:
    p = prep("9c")
    sp = 0xFFFFC90000007FF8
    stack = Stack(sp, 0x346)  # TF | IF | ZF | PF | reserved bit 1
    regs = IPSP(SLOT + 1, sp)
    resume_singlestep(p, regs, stack)
    assert regs.ip == ADDR + 1
    assert int.from_bytes(stack.read(sp, 8), "little") == 0x246
    # without mem (or under TCG, where TF was never set) nothing is touched
    untouched = Stack(sp, 0x246)
    resume_singlestep(p, IPSP(SLOT + 1, sp), untouched)
    assert int.from_bytes(untouched.read(sp, 8), "little") == 0x246


def test_displacement_overflow_message_names_the_probe() -> None:
    with pytest.raises(DisplacementOverflow) as exc:
        prep("488b0500000000", slot=ADDR - (1 << 40), where="vfs_read+0x8")
    assert str(exc.value).startswith("cannot probe vfs_read+0x8: 'mov rax,[rip]' refers to ")

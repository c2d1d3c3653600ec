"""Finding where the watchpoint hook hears of a trap: poke_int3_handler's first read of bp_desc.refs."""

from __future__ import annotations

import struct

from iced_x86 import BlockEncoder, Code, Decoder, Instruction, Register

from qprobe.arch.x86_64.detour import _mem
from qprobe.arch.x86_64.int3hook import watch_site
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, PT_REGS_SIZE, parse_pt_regs

BASE, REFS = 0xFFFFFFFF81005E40, 0xFFFFFFFF828BC52C


def assemble(insns: list[Instruction]) -> bytes:
    enc = BlockEncoder(64)
    enc.add_many(insns)
    return bytes(enc.encode(BASE))


def poke_int3_handler(clobber_rdi: bool = False) -> bytes:
    """The shape of Linux 6.1's: user-mode test, rdx = regs, read refs, bail out if 0, take a reference."""
    c = Instruction
    out = c.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX)
    out.ip = 1
    insns = [
        c.create_mem_i32(Code.TEST_RM8_IMM8, _mem("rdi", 0x88), 3),
        c.create_branch(Code.JNE_REL32_64, 1),
        c.create_reg_reg(Code.MOV_R64_RM64, Register.RDX, Register.RDI),
    ]
    if clobber_rdi:
        insns.append(c.create_reg_u32(Code.MOV_R32_IMM32, Register.EDI, 0))
    insns += [
        c.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, _mem(disp=REFS)),
        c.create_reg_reg(Code.TEST_RM32_R32, Register.EAX, Register.EAX),
        c.create_branch(Code.JE_REL32_64, 1),
        c.create_reg_mem(Code.LEA_R32_M, Register.ECX, _mem("rax", 1)),
    ]
    cmpxchg = c.create_mem_reg(Code.CMPXCHG_RM32_R32, _mem(disp=REFS), Register.ECX)
    cmpxchg.has_lock_prefix = True
    insns += [cmpxchg, c.create_reg(Code.POP_R64, Register.RBX), out, c.create(Code.RETNQ)]
    return assemble(insns)


def test_the_places_after_the_read_up_to_the_first_write() -> None:
    code = poke_int3_handler()
    insns = list(Decoder(64, code, ip=BASE))
    read = next(i for i in insns if i.memory_displacement == REFS)
    test, je, lea, cmpxchg = insns[insns.index(read) + 1 : insns.index(read) + 5]
    safe = watch_site(code, BASE, REFS)
    # Right after the read, after the test, at the branch's target, and up to (not past) the cmpxchg.
    assert safe == {test.ip, je.ip, je.near_branch_target, lea.ip, cmpxchg.ip}
    assert cmpxchg.next_ip not in safe


def test_no_site_when_rdi_is_overwritten_before_the_read_or_there_is_no_read() -> None:
    code = poke_int3_handler(clobber_rdi=True)
    assert watch_site(code, BASE, REFS) is None
    code = poke_int3_handler()
    assert watch_site(code, BASE, REFS + 8) is None


def test_pt_regs_fields_in_memory_order() -> None:
    values = list(range(100, 100 + len(PT_REGS_ORDER)))
    pt = parse_pt_regs(struct.pack(f"<{len(values)}Q", *values))
    assert PT_REGS_SIZE == 168
    assert (pt["r15"], pt["rdi"], pt["orig_ax"], pt["rip"], pt["cs"], pt["eflags"], pt["rsp"], pt["ss"]) == (
        100, 114, 115, 116, 117, 118, 119, 120)  # fmt: skip

"""Property: relocating a rip-relative instruction keeps its memory target.

Instructions come from iced's Encoder (mov/add/cmp/lea/test/push/movzx and
an AVX load, with and without immediates and REX registers), placed at a
random kernel-text address and moved to a random slot within reach.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from iced_x86 import Code, Encoder, Instruction, MemoryOperand, Register

from qprobe.arch.x86_64.decode import decode_one, format_insn
from qprobe.arch.x86_64.insn import prepare_kprobe
from qprobe.errors import DisplacementOverflow

GPR64 = [getattr(Register, n) for n in ("RAX", "RCX", "RDX", "RBX", "RBP", "RSI", "RDI", "R8", "R12", "R15")]
GPR32 = [getattr(Register, n) for n in ("EAX", "ECX", "EDI", "R9D", "R14D")]
YMM = [Register.YMM0, Register.YMM7, Register.YMM9, Register.YMM15]

# (Code, operand shape, register pool)
FORMS = [
    (Code.MOV_R64_RM64, "reg_mem", GPR64),
    (Code.ADD_R64_RM64, "reg_mem", GPR64),
    (Code.CMP_R64_RM64, "reg_mem", GPR64),
    (Code.LEA_R64_M, "reg_mem", GPR64),
    (Code.MOVZX_R32_RM8, "reg_mem", GPR32),
    (Code.MOV_RM64_R64, "mem_reg", GPR64),
    (Code.CMP_RM64_R64, "mem_reg", GPR64),
    (Code.MOV_RM32_IMM32, "mem_imm", None),
    (Code.CMP_RM32_IMM8, "mem_imm8", None),
    (Code.TEST_RM32_IMM32, "mem_imm", None),
    (Code.ADD_RM64_IMM32, "mem_imm", None),
    (Code.INC_RM64, "mem", None),
    (Code.PUSH_RM64, "mem", None),
    (Code.VEX_VMOVDQU_YMM_YMMM256, "reg_mem", YMM),
]
MASK = (1 << 64) - 1


def signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def encode(form: int, reg_index: int, imm: int, addr: int, target: int) -> bytes:
    code, shape, regs = FORMS[form]
    mem = MemoryOperand(Register.RIP, displ=signed(target), displ_size=8)
    if shape == "reg_mem":
        instr = Instruction.create_reg_mem(code, regs[reg_index % len(regs)], mem)
    elif shape == "mem_reg":
        instr = Instruction.create_mem_reg(code, mem, regs[reg_index % len(regs)])
    elif shape == "mem_imm":
        instr = Instruction.create_mem_i32(code, mem, imm)
    elif shape == "mem_imm8":
        instr = Instruction.create_mem_i32(code, mem, imm % 256 - 128)
    else:
        instr = Instruction.create_mem(code, mem)
    encoder = Encoder(64)
    encoder.encode(instr, addr)
    return encoder.take_buffer()


kernel_text = st.integers(0xFFFFFFFF80000000, 0xFFFFFFFFBFFFFFFF)
reach = st.integers(-(1 << 31) + 64, (1 << 31) - 64)


@settings(max_examples=400, deadline=None, database=None)
@given(
    form=st.integers(0, len(FORMS) - 1),
    reg_index=st.integers(0, 15),
    imm=st.integers(-(1 << 31), (1 << 31) - 1),
    addr=kernel_text,
    target_rel=reach,
    slot_rel=st.integers(-(1 << 32), 1 << 32),
)
def test_relocation_keeps_memory_target(
    form: int, reg_index: int, imm: int, addr: int, target_rel: int, slot_rel: int
) -> None:
    target = (addr + target_rel) & MASK
    slot = addr + slot_rel
    assume(0x1000 <= slot < (1 << 64) - 0x1000)
    raw = encode(form, reg_index, imm, addr, target)
    original = decode_one(raw, addr)
    assert original.memory_target == target
    newdisp = target - (slot + len(raw))
    if not -(1 << 31) <= signed(newdisp) < (1 << 31):
        with pytest.raises(DisplacementOverflow):
            prepare_kprobe(raw + b"\x90" * 16, addr, slot)
        return
    prep = prepare_kprobe(raw + b"\x90" * 16, addr, slot)
    assert prep.emulate is None
    moved = decode_one(prep.copy, slot)
    assert moved.memory_target == target
    assert moved.length == original.length
    assert moved.code == original.code
    # With rip-relative operands shown as absolute addresses, nothing differs.
    assert format_insn(moved.instr, absolute=True) == format_insn(original.instr, absolute=True)
    # Only the displacement bytes changed.
    off = original.disp_offset
    assert prep.copy[:off] == raw[:off]
    assert prep.copy[off + 4 :] == raw[off + 4 :]


@settings(max_examples=100, deadline=None, database=None)
@given(addr=kernel_text, slot_rel=reach, target_rel=reach)
def test_resume_singlestep_maps_next_ip(addr: int, slot_rel: int, target_rel: int) -> None:
    from qprobe.arch.x86_64.insn import resume_singlestep

    target = (addr + target_rel) & MASK
    slot = addr + slot_rel
    assume(0x1000 <= slot < (1 << 64) - 0x1000)
    raw = encode(0, 0, 0, addr, target)
    newdisp = signed(target - (slot + len(raw)))
    assume(-(1 << 31) <= newdisp < (1 << 31))
    prep = prepare_kprobe(raw + b"\x90" * 16, addr, slot)

    class R:
        ip = slot + len(prep.copy)

    regs = R()
    resume_singlestep(prep, regs)
    assert regs.ip == addr + len(raw)

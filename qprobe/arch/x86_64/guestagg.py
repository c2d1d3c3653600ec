"""Keyed counts in the guest: a detour that adds one to ``table[key]`` in its CPU's hash table.

For the shell's ``count EVENT by ARG`` and ``hist EVENT by ARG`` when ARG is
an integer taken from a register: the detour computes the key (the argument
as its type reads it, or for a histogram its log2 bucket, bpftrace's
``hist()`` index) and counts it in a per-CPU open-addressing table in guest
RAM, waking nobody and writing no ring; the host sums the CPUs' tables when
it reads them.  Interrupts are off while a CPU updates its own table, so
its slots need no atomics.  A table with no free slot within ``MAX_PROBE``
of the key's hash counts the hit in ``lost`` instead (never silently).

Layout of one CPU's table: ``TABLE_ENTRIES`` slots of (key u64, count u64);
a slot is taken once its count is non-zero (the key is stored first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iced_x86 import Code, Instruction, Register

from qprobe.arch.inguest import KeySpec
from qprobe.arch.x86_64.detour import _mem, _r, encode_detour, locked_inc, restore_regs, save_regs, simm32

if TYPE_CHECKING:
    from iced_x86._iced_x86_py import Register as RegisterKind

TABLE_SHIFT = 9
TABLE_ENTRIES = 1 << TABLE_SHIFT
SLOT_SIZE = 16
TABLE_SIZE = TABLE_ENTRIES * SLOT_SIZE  # per CPU
MAX_PROBE = 32  # slots tried before a hit counts as lost
GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of key * 2^64/phi


def key_value(spec: KeySpec, raw: int) -> int:
    """What the detour computes from the register's 64-bit value (the host's model of it, for tests)."""
    v = raw & ((1 << spec.bits) - 1)
    if spec.signed and v >> (spec.bits - 1):
        v -= 1 << spec.bits
    if not spec.hist:
        return v & ((1 << 64) - 1)
    return 0 if v < 0 else 1 if v == 0 else v.bit_length() + 1


def slot_index(key: int) -> int:
    return ((key * GOLDEN) & ((1 << 64) - 1)) >> (64 - TABLE_SHIFT)


_LOAD = {  # (bits, signed) -> how rax gets the value from a 64-bit register
    (64, False): Code.MOV_R64_RM64, (64, True): Code.MOV_R64_RM64,
    (32, False): Code.MOV_R32_RM32, (32, True): Code.MOVSXD_R64_RM32,
    (16, False): Code.MOVZX_R32_RM16, (16, True): Code.MOVSX_R64_RM16,
    (8, False): Code.MOVZX_R32_RM8, (8, True): Code.MOVSX_R64_RM8,
}  # fmt: skip


def _sub_register(reg: str, bits: int) -> RegisterKind:
    """rdi -> edi/di/dil, r8 -> r8d/r8w/r8l (iced's name for r8b), rax -> eax/ax/al."""
    name = "r" + reg if not reg.startswith("r") else reg
    if bits == 64:
        return _r(name)
    if name[1:].isdigit():
        return _r(name + {32: "d", 16: "w", 8: "l"}[bits])
    base = name[1:]  # ax, bx, cx, dx, si, di, bp
    if bits == 32:
        return _r("e" + base)
    if bits == 16:
        return _r(base)
    return _r({"ax": "al", "bx": "bl", "cx": "cl", "dx": "dl", "si": "sil", "di": "dil", "bp": "bpl"}[base])


def build_keyed_detour(
    address: int, spec: KeySpec, tables: int, cpu_number: int, hits: int, lost: int, relocated: bytes, resume: int
) -> tuple[bytes, int]:
    """The detour at ``address`` and the offset its relocated instructions start at.

    ``tables`` is CPU 0's table (CPU n's is ``TABLE_SIZE * n`` further);
    ``hits`` and ``lost`` are the probe's u64 counters.
    """
    loop, empty, found, out, negative, zero, bucket = 1, 2, 3, 4, 5, 6, 7
    c = Instruction
    rax, rcx, rdx = Register.RAX, Register.RCX, Register.RDX

    def labelled(insn: Instruction, label: int) -> Instruction:
        insn.ip = label
        return insn

    dest = rax if spec.bits == 64 or spec.signed else Register.EAX
    saved = ("rax", "rbx", "rcx", "rdx")
    code = [
        *save_regs(*saved),
        locked_inc(hits),
        # Nothing was changed yet: the key's register still holds the value at the probe.
        c.create_reg_reg(_LOAD[(spec.bits, spec.signed)], dest, _sub_register(spec.reg, spec.bits)),
    ]
    after_key = c.create_reg_mem(Code.MOV_R32_RM32, Register.EDX, _mem(disp=cpu_number, seg="gs"))
    if spec.hist:
        code += [c.create_reg_reg(Code.TEST_RM64_R64, rax, rax)]
        if spec.signed:
            code += [c.create_branch(Code.JS_REL32_64, negative)]
        code += [
            c.create_branch(Code.JE_REL32_64, zero),
            c.create_reg_reg(Code.BSR_R64_RM64, rax, rax),
            c.create_reg_i32(Code.ADD_RM64_IMM8, rax, 2),
            c.create_branch(Code.JMP_REL32_64, bucket),
            labelled(c.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX), negative),
            c.create_branch(Code.JMP_REL32_64, bucket),
            labelled(c.create_reg_u32(Code.MOV_R32_IMM32, Register.EAX, 1), zero),
        ]
        after_key.ip = bucket
    # rdx: this CPU's table; rcx: the byte offset of the key's first slot, then of the next ones
    code += [
        after_key,
        c.create_reg_i32(Code.SHL_RM64_IMM8, rdx, TABLE_SHIFT + 4),
        c.create_reg_i32(Code.ADD_RM64_IMM32, rdx, simm32(tables)),
        c.create_reg_u64(Code.MOV_R64_IMM64, rcx, GOLDEN),
        c.create_reg_reg(Code.IMUL_R64_RM64, rcx, rax),
        c.create_reg_i32(Code.SHR_RM64_IMM8, rcx, 64 - TABLE_SHIFT),
        c.create_reg_i32(Code.SHL_RM64_IMM8, rcx, 4),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.EBX, MAX_PROBE),
        labelled(c.create_mem_i32(Code.CMP_RM64_IMM8, _mem("rdx", 8, "rcx"), 0), loop),
        c.create_branch(Code.JE_REL32_64, empty),
        c.create_reg_mem(Code.CMP_R64_RM64, rax, _mem("rdx", 0, "rcx")),
        c.create_branch(Code.JE_REL32_64, found),
        c.create_reg_i32(Code.ADD_RM32_IMM8, Register.ECX, SLOT_SIZE),
        c.create_reg_i32(Code.AND_RM32_IMM32, Register.ECX, TABLE_SIZE - 1),
        c.create_reg(Code.DEC_RM32, Register.EBX),
        c.create_branch(Code.JNE_REL32_64, loop),
        locked_inc(lost),
        c.create_branch(Code.JMP_REL32_64, out),
        labelled(c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdx", 0, "rcx"), rax), empty),
        labelled(c.create_mem(Code.INC_RM64, _mem("rdx", 8, "rcx")), found),
    ]
    code += restore_regs(*saved, label=out)
    return encode_detour(code, address, relocated, resume)

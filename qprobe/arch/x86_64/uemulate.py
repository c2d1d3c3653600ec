"""Host emulation of the user instructions a probed function typically begins with (and a call returns to).

A uprobe hit stopped on a gdbstub breakpoint would otherwise single-step the instruction in place: a
second VM stop, and QEMU 7.2 flushes all its translated code at every breakpoint or step stop.  The
kernel itself emulates some probed user instructions instead of stepping them out of line
(arch/x86/kernel/uprobes.c, Linux 6.1 to 6.12: ``branch_setup_xol_ops`` for jmp, call, jcc and the nop
0x90, ``push_setup_xol_ops`` for ``push reg``); qprobe performs those and, since the host has the whole
register file, the plain integer moves and arithmetic of function prologues and call sites: ``endbr``
and the nops (no user IBT on Linux 6.1/6.12: ``endbr`` is a nop in user mode), ``push``/``pop``,
``mov`` between registers, immediates and memory, ``lea``, and ``add``/``sub``/``cmp``/``test``/
``and``/``or``/``xor`` with their flags.

The host writes the task's memory first and its registers after, in one packet: a qprobe killed between
the two leaves the instruction to run again, which stores the same bytes (a push, a mov) to the same place.
An add, sub, and, or or xor into memory would add twice, so those are stepped.

Anything else, a 16-bit or high-byte operand, an fs:/gs: or 32-bit address, the trap flag set (a
debugger single-stepping the task wants its #DB after the instruction), or a memory access the task
could not make without a fault (``mem`` raises MemoryFault: not present, not user, a store to a page not
writable and dirty), is left to the single-step.  ``regs`` may be changed by an emulation that gives up:
give a copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iced_x86 import Code, FlowControl, Instruction, Mnemonic, OpKind, Register, RegisterInfo

from qprobe.arch.x86_64.decode import Insn, skip_prefixes
from qprobe.arch.x86_64.emulate import Memory, Regs, emulate, int3_emulate_pop, int3_emulate_push
from qprobe.arch.x86_64.insn import PreparedInsn, prepare_emulation
from qprobe.arch.x86_64.ptregs import (
    GDB_NAME,
    PT_GPRS,
    PT_NAMES,
    X86_EFLAGS_CF,
    X86_EFLAGS_OF,
    X86_EFLAGS_PF,
    X86_EFLAGS_SF,
    X86_EFLAGS_ZF,
)
from qprobe.errors import CannotProbe

if TYPE_CHECKING:
    # iced_x86.Register is a module of constants at run time; its members' type is this enum.
    from iced_x86._iced_x86_py import Register as RegisterKind

__all__ = ["uprobe_emulate"]

X86_EFLAGS_AF = 1 << 4
X86_EFLAGS_TF = 1 << 8
_ARITH_FLAGS = X86_EFLAGS_CF | X86_EFLAGS_PF | X86_EFLAGS_AF | X86_EFLAGS_ZF | X86_EFLAGS_SF | X86_EFLAGS_OF
_MASK64 = (1 << 64) - 1

# The kernel's user branch emulations (branch_emulate_op) and the host's other ones for branches: not the
# IF modifiers, which a user task cannot run (cli/sti fault) or runs with its own IF semantics (popf).
_BRANCHES = frozenset({"call", "jmp", "jcc", "loop", "ret", "call_indirect", "jmp_indirect"})

# Code -> (operation, operand bytes).  Operand 0 is the destination (or the first compared), operand 1
# the source; the binary operations set the arithmetic flags.
_OPS: dict[int, tuple[str, int]] = {
    Code.PUSH_R64: ("push", 8),
    Code.PUSHQ_IMM8: ("push", 8),
    Code.PUSHQ_IMM32: ("push", 8),
    Code.POP_R64: ("pop", 8),
    Code.LEA_R64_M: ("lea", 8),
    Code.LEA_R32_M: ("lea", 4),
    Code.MOV_R32_IMM32: ("mov", 4),
    Code.MOV_R64_IMM64: ("mov", 8),
    Code.MOV_RM32_IMM32: ("mov", 4),
    Code.MOV_RM64_IMM32: ("mov", 8),
    Code.MOV_RM8_IMM8: ("mov", 1),
}
for _size, _w in ((1, "8"), (4, "32"), (8, "64")):
    for _op in ("MOV", "ADD", "SUB", "CMP", "AND", "OR", "XOR"):
        for _form in (f"RM{_w}_R{_w}", f"R{_w}_RM{_w}"):
            _OPS[getattr(Code, f"{_op}_{_form}")] = (_op.lower(), _size)
    _OPS[getattr(Code, f"TEST_RM{_w}_R{_w}")] = ("test", _size)
    _imms = ("IMM8",) if _size == 1 else ("IMM8", "IMM32")
    for _op in ("ADD", "SUB", "CMP", "AND", "OR", "XOR"):
        for _imm in _imms:
            _OPS[getattr(Code, f"{_op}_RM{_w}_{_imm}")] = (_op.lower(), _size)
    _OPS[getattr(Code, f"TEST_RM{_w}_IMM{'8' if _size == 1 else '32'}")] = ("test", _size)
    _acc = {1: "AL_IMM8", 4: "EAX_IMM32", 8: "RAX_IMM32"}[_size]  # the accumulator's short forms
    for _op in ("ADD", "SUB", "CMP", "AND", "OR", "XOR", "TEST"):
        _OPS[getattr(Code, f"{_op}_{_acc}")] = (_op.lower(), _size)

#: iced register (any width) -> pt_regs field of its full register.
_FULL: dict[int, str] = {getattr(Register, GDB_NAME[pt].upper()): pt for pt in (*PT_NAMES[: len(PT_GPRS)], "sp")}
_HIGH_BYTES = frozenset({Register.AH, Register.CH, Register.DH, Register.BH})
_IMMEDIATES = frozenset({OpKind.IMMEDIATE8, OpKind.IMMEDIATE32, OpKind.IMMEDIATE64, OpKind.IMMEDIATE8TO32,
                         OpKind.IMMEDIATE8TO64, OpKind.IMMEDIATE32TO64})  # fmt: skip


class _Refused(Exception):
    """A form left to the single-step."""


def _reg_field(reg: RegisterKind) -> str:
    if reg in _HIGH_BYTES:
        raise _Refused
    field = _FULL.get(RegisterInfo(reg).full_register)
    if field is None:
        raise _Refused
    return field


def _address(instr: Instruction, regs: Regs) -> int:
    """The effective address of the memory operand (64-bit addressing, a segment with base 0)."""
    if instr.memory_segment in (Register.FS, Register.GS):
        raise _Refused  # their bases are MSRs the pt_regs do not hold
    ea = instr.memory_displacement  # rip-relative: already absolute, the instruction decoded at its address
    for reg, scale in ((instr.memory_base, 1), (instr.memory_index, instr.memory_index_scale)):
        if reg in (Register.NONE, Register.RIP):
            continue
        if RegisterInfo(reg).size != 8:
            raise _Refused  # a 0x67 prefix: a 32-bit address
        ea += getattr(regs, _reg_field(reg)) * scale
    return ea & _MASK64


def _read(instr: Instruction, n: int, size: int, regs: Regs, mem: Memory) -> int:
    kind = instr.op_kind(n)
    if kind == OpKind.REGISTER:
        value: int = getattr(regs, _reg_field(instr.op_register(n)))
        return value & ((1 << 8 * size) - 1)
    if kind == OpKind.MEMORY:
        return int.from_bytes(mem.read(_address(instr, regs), size), "little")
    if kind in _IMMEDIATES:
        return instr.immediate(n) & ((1 << 8 * size) - 1)  # the sign-extended forms come sign-extended
    raise _Refused


def _write(instr: Instruction, n: int, size: int, value: int, regs: Regs, mem: Memory) -> None:
    value &= (1 << 8 * size) - 1
    if instr.op_kind(n) == OpKind.MEMORY:
        mem.write(_address(instr, regs), value.to_bytes(size, "little"))
        return
    field = _reg_field(instr.op_register(n))
    if size == 1:  # a byte register keeps the other 56 bits
        value |= getattr(regs, field) & ~0xFF & _MASK64
    setattr(regs, field, value)  # a 32-bit destination zero-extends into the 64-bit register


def _flags(op: str, a: int, b: int, res: int, size: int) -> int:
    """CF PF AF ZF SF OF after ``res = a op b`` on ``size``-byte operands (the logical ones clear CF, OF and AF,
    as QEMU's CC_OP_LOGIC does: AF is undefined after them)."""
    bits = 8 * size
    sign = 1 << (bits - 1)
    mask = (1 << bits) - 1
    out = 0
    if op in ("add", "sub", "cmp"):
        sub = op != "add"
        if (a < b) if sub else (a + b > mask):
            out |= X86_EFLAGS_CF
        if (a ^ b ^ res) & 0x10:
            out |= X86_EFLAGS_AF
        overflow = ((a ^ b) & (a ^ res)) if sub else (~(a ^ b) & (a ^ res))
        if overflow & sign:
            out |= X86_EFLAGS_OF
    res &= mask
    if res == 0:
        out |= X86_EFLAGS_ZF
    if res & sign:
        out |= X86_EFLAGS_SF
    if bin(res & 0xFF).count("1") % 2 == 0:
        out |= X86_EFLAGS_PF
    return out


_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "cmp": lambda a, b: a - b,
    "and": lambda a, b: a & b,
    "test": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
}


def _perform(instr: Instruction, op: str, size: int, regs: Regs, mem: Memory) -> None:
    if op == "push":  # the value before the stack pointer moves: push rsp pushes the old rsp
        int3_emulate_push(regs, mem, _read(instr, 0, 8, regs, mem) if instr.op0_kind == OpKind.REGISTER
                          else instr.immediate(0))  # fmt: skip
    elif op == "pop":  # rsp moves before the register is written: pop rsp loads the popped value
        value = int3_emulate_pop(regs, mem)
        _write(instr, 0, 8, value, regs, mem)
    elif op == "lea":
        _write(instr, 0, size, _address(instr, regs), regs, mem)
    elif op == "mov":
        _write(instr, 0, size, _read(instr, 1, size, regs, mem), regs, mem)
    else:
        if op not in ("cmp", "test") and instr.op0_kind == OpKind.MEMORY:
            raise _Refused  # a read-modify-write of memory: run twice after a kill, it would not be idempotent
        a, b = _read(instr, 0, size, regs, mem), _read(instr, 1, size, regs, mem)
        res = _BINARY[op](a, b)
        if op not in ("cmp", "test"):
            _write(instr, 0, size, res, regs, mem)
        regs.flags = (regs.flags & ~_ARITH_FLAGS) | _flags(op, a, b, res, size)


def uprobe_emulate(insn: Insn, regs: Regs, mem: Memory) -> bool:
    """Perform the user instruction ``insn`` (at ``regs.ip``) on ``regs`` and ``mem``, if it is one emulated here.

    False: it is to be single-stepped (``regs`` and ``mem`` may have been written part way)."""
    instr = insn.instr
    if regs.flags & X86_EFLAGS_TF or instr.has_lock_prefix:
        return False
    if 0x66 in insn.raw[: skip_prefixes(insn.raw)] and instr.flow_control != FlowControl.NEXT:
        # branch_setup_xol_ops refuses these: Intel ignores the prefix in 64-bit mode, AMD truncates the ip.
        return False
    next_ip = (insn.addr + insn.length) & _MASK64
    if instr.mnemonic in (Mnemonic.NOP, Mnemonic.ENDBR64, Mnemonic.ENDBR32):
        regs.ip = next_ip
        return True
    known = _OPS.get(insn.code)
    if known is not None:
        try:
            _perform(instr, *known, regs, mem)
        except _Refused:
            return False
        regs.ip = next_ip
        return True
    try:
        kind = prepare_emulation(insn)
    except CannotProbe:
        return False
    if kind not in _BRANCHES:
        return False
    emulate(PreparedInsn(insn.addr, insn, b"", 0, kind, False), regs, mem)
    return True

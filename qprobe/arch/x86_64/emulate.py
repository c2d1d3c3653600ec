"""Host-side emulation of the instructions that cannot run in the slot.

A relative branch, call or return executed at the slot address would go to
(or push) the wrong place, so, like Linux 6.1's ``kprobe_emulate_*``
functions, the host computes the effect on the registers and the stack and
the guest never executes the instruction at all.

``regs`` is any object with integer attributes ``ax bx cx dx si di bp sp
r8..r15 ip flags`` (ip is the probed address on entry, the next ip on exit).
``mem`` has ``read(addr, n) -> bytes`` and ``write(addr, data)``, used for
the stack and for ``call [mem]``.
"""

from __future__ import annotations

from typing import Protocol

from iced_x86 import Code, OpKind, Register

from qprobe.arch.x86_64.decode import Insn
from qprobe.arch.x86_64.ptregs import (
    GDB_NAME,
    PT_GPRS,
    PT_NAMES,
    X86_EFLAGS_CF,
    X86_EFLAGS_IF,
    X86_EFLAGS_OF,
    X86_EFLAGS_PF,
    X86_EFLAGS_SF,
    X86_EFLAGS_ZF,
)

__all__ = [
    "LOOP_KINDS",
    "Emulated",
    "Memory",
    "Regs",
    "emulate",
    "jcc_taken",
    "kprobe_emulate_ifmodifiers",
]


class Emulated(Protocol):
    """What an emulator reads of a prepared probe (qprobe.arch.x86_64.insn.PreparedInsn)."""

    addr: int
    insn: Insn
    emulate: str | None


_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


class Regs(Protocol):
    """The general registers, ip and flags of the stopped vCPU."""

    ax: int
    bx: int
    cx: int
    dx: int
    si: int
    di: int
    bp: int
    sp: int
    r8: int
    r9: int
    r10: int
    r11: int
    r12: int
    r13: int
    r14: int
    r15: int
    ip: int
    flags: int


class Memory(Protocol):
    """Guest virtual memory as the stopped vCPU sees it."""

    def read(self, addr: int, size: int) -> bytes: ...

    def write(self, addr: int, data: bytes) -> None: ...


#: iced register -> pt_regs field (Linux's addrmode_regoffs): the general registers and sp, named in ptregs.
_REG_ATTR: dict[int, str] = {getattr(Register, GDB_NAME[pt].upper()): pt for pt in (*PT_NAMES[: len(PT_GPRS)], "sp")}


#: Code -> (Linux's ainsn.loop.type: 0 loopne, 1 loope, 2 loop, 3 jcxz; address size).
LOOP_KINDS: dict[int, tuple[int, int]] = {Code.JRCXZ_REL8_64: (3, 64), Code.JECXZ_REL8_64: (3, 32)}
for _type, _name in enumerate(("LOOPNE", "LOOPE", "LOOP")):
    LOOP_KINDS[getattr(Code, f"{_name}_REL8_64_RCX")] = (_type, 64)
    LOOP_KINDS[getattr(Code, f"{_name}_REL8_64_ECX")] = (_type, 32)


def int3_emulate_jmp(regs: Regs, ip: int) -> None:
    regs.ip = ip & _MASK64


def int3_emulate_push(regs: Regs, mem: Memory, val: int) -> None:
    regs.sp = (regs.sp - 8) & _MASK64
    mem.write(regs.sp, (val & _MASK64).to_bytes(8, "little"))


def int3_emulate_pop(regs: Regs, mem: Memory) -> int:
    val = int.from_bytes(mem.read(regs.sp, 8), "little")
    regs.sp = (regs.sp + 8) & _MASK64
    return val


def int3_emulate_call(regs: Regs, mem: Memory, func: int, ret_addr: int) -> None:
    int3_emulate_push(regs, mem, ret_addr)
    int3_emulate_jmp(regs, func)


def jcc_taken(cc: int, flags: int) -> bool:
    """Whether jcc with condition ``cc`` (the opcode's low nibble) jumps under ``flags``.

    Linux 6.1's jcc_mask logic: even ``cc`` tests a flag combination, odd
    ``cc`` is its negation; 0xc-0xf compare SF with OF (and ZF for le/g).
    Linux 6.1.0 had ``&&`` where ``||`` belongs for jle/jg (fixed in a
    later 6.1.y stable release); this follows the architecture.
    """
    sf = bool(flags & X86_EFLAGS_SF)
    of = bool(flags & X86_EFLAGS_OF)
    base = cc >> 1
    if base == 0:
        match = bool(flags & X86_EFLAGS_OF)  # o
    elif base == 1:
        match = bool(flags & X86_EFLAGS_CF)  # b
    elif base == 2:
        match = bool(flags & X86_EFLAGS_ZF)  # e
    elif base == 3:
        match = bool(flags & (X86_EFLAGS_CF | X86_EFLAGS_ZF))  # be
    elif base == 4:
        match = sf  # s
    elif base == 5:
        match = bool(flags & X86_EFLAGS_PF)  # p
    elif base == 6:
        match = sf != of  # l
    else:
        match = sf != of or bool(flags & X86_EFLAGS_ZF)  # le
    return match != bool(cc & 1)


def _next_ip(prep: Emulated) -> int:
    return (prep.addr + prep.insn.length) & _MASK64


def _target(prep: Emulated) -> int:
    target = prep.insn.branch_target
    assert target is not None, prep.insn.text
    return target


def kprobe_emulate_call(prep: Emulated, regs: Regs, mem: Memory) -> None:
    int3_emulate_call(regs, mem, _target(prep), _next_ip(prep))


def kprobe_emulate_jmp(prep: Emulated, regs: Regs, mem: Memory) -> None:
    int3_emulate_jmp(regs, _target(prep))


def kprobe_emulate_jcc(prep: Emulated, regs: Regs, mem: Memory) -> None:
    cc = prep.insn.instr.condition_code - 1  # iced numbers o..g from 1; x86 from 0
    int3_emulate_jmp(regs, _target(prep) if jcc_taken(cc, regs.flags) else _next_ip(prep))


def kprobe_emulate_loop(prep: Emulated, regs: Regs, mem: Memory) -> None:
    """LOOPNE/LOOPE/LOOP/J*CXZ with a 64-bit (rcx) or, with 0x67, 32-bit (ecx) counter.

    Architecturally LOOP tests the count after decrementing it; Linux's
    ``(cx--) != 0`` tests the value before, which nothing in the kernel
    exercises. A 32-bit counter write zero-extends into rcx, as any 32-bit
    register write does in 64-bit mode (QEMU and Bochs agree).
    """
    kind, asize = LOOP_KINDS[prep.insn.code]
    mask = _MASK64 if asize == 64 else _MASK32
    count = regs.cx & mask
    if kind != 3:  # LOOP*
        count = (count - 1) & mask
        regs.cx = count
        match = count != 0
        if kind == 0:  # LOOPNE
            match = match and not regs.flags & X86_EFLAGS_ZF
        elif kind == 1:  # LOOPE
            match = match and bool(regs.flags & X86_EFLAGS_ZF)
    else:  # JCXZ
        match = count == 0
    int3_emulate_jmp(regs, _target(prep) if match else _next_ip(prep))


def kprobe_emulate_ret(prep: Emulated, regs: Regs, mem: Memory) -> None:
    """Near return; ``ret imm16`` also releases imm16 bytes (Linux 6.1 forgets this)."""
    ip = int3_emulate_pop(regs, mem)
    if prep.insn.code == Code.RETNQ_IMM16:
        regs.sp = (regs.sp + prep.insn.instr.immediate16) & _MASK64
    int3_emulate_jmp(regs, ip)


def kprobe_emulate_ifmodifiers(prep: Emulated, regs: Regs, mem: Memory) -> None:
    """cli, sti, pushfq, popfq (Linux 6.1's kprobe_emulate_ifmodifiers), in place of the int3 single-step.

    The int3 single-step runs the copy with interrupts off, so these would
    see or leave the wrong IF there.
    """
    code = prep.insn.code
    if code == Code.CLI:
        regs.flags &= ~X86_EFLAGS_IF
    elif code == Code.STI:
        regs.flags |= X86_EFLAGS_IF
    elif code == Code.PUSHFQ:
        int3_emulate_push(regs, mem, regs.flags)
    elif code == Code.POPFQ:
        regs.flags = int3_emulate_pop(regs, mem)
    else:
        raise ValueError(f"{prep.insn.text!r} does not modify IF")
    regs.ip = _next_ip(prep)


def _indirect_target(prep: Emulated, regs: Regs, mem: Memory) -> int:
    """Value of the FF /2 or FF /4 operand, read before anything is pushed."""
    instr = prep.insn.instr
    if instr.op0_kind == OpKind.REGISTER:
        value: int = getattr(regs, _REG_ATTR[instr.op0_register])
        return value
    # For [rip+disp] iced already made the displacement absolute (decoded at prep.addr).
    ea = instr.memory_displacement
    if instr.memory_base not in (Register.NONE, Register.RIP):
        ea += getattr(regs, _REG_ATTR[instr.memory_base])
    if instr.memory_index != Register.NONE:
        ea += getattr(regs, _REG_ATTR[instr.memory_index]) * instr.memory_index_scale
    return int.from_bytes(mem.read(ea & _MASK64, 8), "little")


def kprobe_emulate_call_indirect(prep: Emulated, regs: Regs, mem: Memory) -> None:
    """``call reg``/``call [mem]``; the target is read first, so ``call rsp`` works too."""
    int3_emulate_call(regs, mem, _indirect_target(prep, regs, mem), _next_ip(prep))


def kprobe_emulate_jmp_indirect(prep: Emulated, regs: Regs, mem: Memory) -> None:
    int3_emulate_jmp(regs, _indirect_target(prep, regs, mem))


_EMULATORS = {
    "call": kprobe_emulate_call,
    "jmp": kprobe_emulate_jmp,
    "jcc": kprobe_emulate_jcc,
    "loop": kprobe_emulate_loop,
    "ret": kprobe_emulate_ret,
    "call_indirect": kprobe_emulate_call_indirect,
    "jmp_indirect": kprobe_emulate_jmp_indirect,
    "ifmodifier": kprobe_emulate_ifmodifiers,
}


def emulate(prep: Emulated, regs: Regs, mem: Memory, kind: str | None = None) -> None:
    """Perform ``prep``'s instruction on ``regs``/``mem`` (its ``emulate_op``, or the emulator ``kind``)."""
    kind = kind or prep.emulate
    if kind is None:
        raise ValueError(f"{prep.insn.text!r} is single-stepped, not emulated")
    _EMULATORS[kind](prep, regs, mem)

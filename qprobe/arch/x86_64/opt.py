"""Can a probe be jump-optimized? Linux's arch/x86/kernel/kprobes/opt.c checks.

An optimized probe replaces the int3 and the following bytes with a 5-byte
``jmp`` to a detour buffer that runs the handler and then the displaced
instructions. That is only safe if nothing ever jumps into the middle of
those 5 bytes and every displaced instruction can run elsewhere; proving
the first needs the whole function decoded, as ``can_optimize()`` does.

Left to the caller, as they need kernel state this layer does not have:
entry-text and blacklist checks, and ftrace/alternatives/jump-label/
static-call reservations of the replaced range.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from iced_x86 import Code, EncodingKind, FlowControl

from qprobe.arch.x86_64.boost import (
    INT3_INSN_OPCODE,
    INT3_INSN_SIZE,
    JMP32_INSN_SIZE,
    ExceptionTable,
    can_boost,
    opcode_bytes,
    search_exception_tables,
)
from qprobe.arch.x86_64.decode import Insn, decode_all, recover_bytes
from qprobe.arch.x86_64.emulate import LOOP_KINDS
from qprobe.arch.x86_64.insn import cannot_copy_reason, copy_instruction, insn_has_emulate_prefix
from qprobe.errors import CannotProbe

__all__ = [
    "DISP32_SIZE",
    "RELATIVEJUMP_SIZE",
    "OptCheck",
    "can_optimize",
    "insn_is_indirect_jump",
    "insn_jump_into_range",
]

RELATIVEJUMP_SIZE = JMP32_INSN_SIZE
DISP32_SIZE = 4
# Instructions that go on to the next one or call (and come back there).
_PLAIN_FLOW = frozenset((FlowControl.NEXT, FlowControl.CALL))


class OptCheck(NamedTuple):
    """Result of :func:`can_optimize`: ``size`` is the number of bytes the jump displaces."""

    ok: bool
    reason: str
    size: int = 0


def __insn_is_indirect_jump(insn: Insn) -> bool:
    """FF /4, FF /5 (near and far indirect jmp) or EA (segment jump)."""
    nbytes, opcode, after = opcode_bytes(insn)
    if nbytes != 1:
        return False
    if opcode[0] == 0xFF and after < len(insn.raw):
        return ((insn.raw[after] >> 3) & 7) & 6 == 4
    return opcode[0] == 0xEA


def insn_jump_into_range(insn: Insn, start: int, length: int) -> bool:
    """True if a relative jmp/jcc/loop/jcxz lands in [start, start + length] (calls don't count)."""
    code = insn.code
    if not (code in (Code.JMP_REL8_64, Code.JMP_REL32_64) or insn.instr.is_jcc_short_or_near or code in LOOP_KINDS):
        return False
    target = insn.branch_target
    return target is not None and start <= target <= start + length


def insn_is_indirect_jump(insn: Insn, indirect_thunk: tuple[int, int] | None = None) -> bool:
    """An indirect jump, or (CONFIG_RETPOLINE) a jump into the indirect-thunk range [start, end)."""
    if __insn_is_indirect_jump(insn):
        return True
    if indirect_thunk is not None:
        start, end = indirect_thunk
        return insn_jump_into_range(insn, start, end - start)
    return False


def _where(addr: int, func_start: int, name: str | None) -> str:
    return f"{name}+{addr - func_start:#x}" if name else f"+{addr - func_start:#x}"


def can_optimize(
    func_code: bytes,
    func_start: int,
    addr: int,
    exception_table: ExceptionTable | None = None,
    *,
    indirect_thunk: tuple[int, int] | None = None,
    patched: Mapping[int, int] | None = None,
    buffer_addr: int | None = None,
    name: str | None = None,
) -> OptCheck:
    """Linux 6.1 ``can_optimize()`` plus ``copy_optimized_instructions()``.

    ``func_code`` is the whole function from ``func_start``; ``addr`` the
    probe (already a checked boundary). ``exception_table`` holds addresses
    with fixup entries; ``indirect_thunk`` the retpoline thunk range;
    ``patched`` the int3s qprobe placed (addr -> original byte);
    ``buffer_addr`` the detour slot where displaced instructions will run,
    if known, to check rip-relative reach. Returns (ok, reason, size).
    """
    where = _where(addr, func_start, name)
    if name is not None and ".cold" in name:
        # GCC's split-off cold part: its parent jumps into it anywhere, unseen from here.
        return OptCheck(False, f"{name} is the cold part of a function, entered by jumps from its parent")
    size = len(func_code)
    offset = addr - func_start
    if not 0 <= offset < size:
        return OptCheck(False, f"{addr:#x} is outside the function")
    if size - offset < RELATIVEJUMP_SIZE:
        return OptCheck(False, f"only {size - offset} byte(s) left after {where}; a jump needs 5")
    code = recover_bytes(func_code, func_start, patched)
    try:
        insns = decode_all(code, func_start)
    except CannotProbe as exc:
        return OptCheck(False, f"the function cannot be decoded: {exc}")
    if all(insn.addr != addr for insn in insns):
        return OptCheck(False, f"{where} is not an instruction boundary")
    after_exit = False
    for insn in insns:
        if search_exception_tables(exception_table, insn.addr):
            # Fixup code may jump back into this function.
            return OptCheck(False, f"{_where(insn.addr, func_start, name)} has an exception-table entry")
        if insn.instr.flow_control in _PLAIN_FLOW and insn.instr.encoding == EncodingKind.LEGACY:
            # Most of a function: neither an int3, an exit nor a jump, and (legacy-encoded) no opcode
            # byte the indirect-jump check below reads as one; skipping them keeps a batch of
            # a thousand checks from taking seconds.
            after_exit = False
            continue
        here = _where(insn.addr, func_start, name)
        if insn.code == Code.INT3:
            # Padding after the last ret is fine, and so is the speculation
            # barrier the kernel puts after every ret/jmp (CONFIG_RETHUNK/SLS:
            # the 6.1.y fix "Fix optprobe optimization check with CONFIG_RETHUNK");
            # any other int3 may be another debugger's breakpoint hiding the real instruction.
            if after_exit or all(b == INT3_INSN_OPCODE for b in code[insn.addr - func_start :]):
                continue
            return OptCheck(False, f"int3 at {here} inside the function body")
        after_exit = insn.mnemonic in ("ret", "jmp")
        if insn_is_indirect_jump(insn, indirect_thunk):
            return OptCheck(False, f"'{insn.text}' at {here} is an indirect jump")
        if insn_jump_into_range(insn, addr + INT3_INSN_SIZE, DISP32_SIZE):
            return OptCheck(False, f"'{insn.text}' at {here} jumps into the bytes the jump would replace")
    return copy_optimized_instructions(code, insns, func_start, addr, exception_table, patched, buffer_addr, name)


def copy_optimized_instructions(
    code: bytes,
    insns: list[Insn],
    func_start: int,
    addr: int,
    exception_table: ExceptionTable | None,
    patched: Mapping[int, int] | None,
    buffer_addr: int | None,
    name: str | None,
) -> OptCheck:
    """Every instruction displaced by the 5-byte jump must copy and be boostable."""
    length = 0
    region = [i for i in insns if i.addr >= addr]
    for insn in region:
        if length >= RELATIVEJUMP_SIZE:
            break
        here = _where(insn.addr, func_start, name)
        if insn.addr != addr and patched and insn.addr in patched:
            return OptCheck(False, f"another probe at {here} is inside the bytes the jump would replace")
        reason = "is int3" if insn.code == Code.INT3 else cannot_copy_reason(insn)
        if insn_has_emulate_prefix(code[insn.addr - func_start :]):
            reason = "has an emulate prefix"
        if reason is None and buffer_addr is not None:
            try:
                copy_instruction(insn, buffer_addr + length)
            except CannotProbe as exc:
                reason = f"cannot be relocated ({exc})"
        if reason is None and not can_boost(insn, exception_table):
            reason = "cannot run in the detour buffer (not boostable)"
        if reason:
            return OptCheck(False, f"'{insn.text}' at {here} {reason}")
        length += insn.length
    if length < RELATIVEJUMP_SIZE:
        return OptCheck(False, f"the function ends {length} byte(s) after {_where(addr, func_start, name)}")
    return OptCheck(True, "", length)

"""What Linux's ``arch_prepare_kprobe()`` does, done on the host.

For a probed instruction this decides whether it can run out of line at all,
whether it must be emulated (anything whose effect depends on where it runs:
relative branches, calls, returns), and otherwise produces the bytes to
single-step in the scratch slot, with a rip-relative displacement rewritten
so the copy still reaches the same absolute address.

Function names follow arch/x86/kernel/kprobes/core.c (Linux 6.1) so the two
can be read side by side. Differences from the kernel are deliberate and
commented where they are made.

The copy runs as the kernel's has since Linux 5.14 ("x86/kprobes: Use int3
instead of debug trap for single-step"): followed by an int3 in the slot,
with interrupts off, so the second trap finishes the hit
(:func:`resume_trap_step`, the kernel's resume_singlestep()), and the
instructions that change IF are emulated (:data:`IF_MODIFIERS`).  Unlike
the kernel, a copy that may fault into an exception-table fixup is
single-stepped through QEMU's gdbstub instead: the kernel's
kprobe_fault_handler() moves such a fault back to the probed address, which
qprobe can only do when it sees the fault, at the end of a step
(:func:`trap_step_reason`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from iced_x86 import Code, FlowControl, OpKind, Register

from qprobe.arch.x86_64.boost import (
    CALL_INSN_OPCODE,
    INT3_INSN_OPCODE,
    JMP32_INSN_OPCODE,
    JMP32_INSN_SIZE,
    MAX_INSN_SIZE,
    ExceptionTable,
    can_boost,
    opcode_bytes,
    rel32,
    search_exception_tables,
    signed64,
    synthesize_relcall,
    synthesize_reljump,
)
from qprobe.arch.x86_64.decode import Insn, decode_one, recover_bytes, skip_prefixes
from qprobe.arch.x86_64.emulate import LOOP_KINDS, Memory, emulate
from qprobe.arch.x86_64.ptregs import X86_EFLAGS_IF, X86_EFLAGS_TF
from qprobe.errors import CannotProbe, DisplacementOverflow, ProbeBusy, ProbeError

__all__ = [
    "CALL_INSN_OPCODE",
    "IF_MODIFIERS",
    "INT3_INSN_OPCODE",
    "JMP32_INSN_OPCODE",
    "JMP32_INSN_SIZE",
    "MAX_INSN_SIZE",
    "SLOT_SIZE",
    "TRAP_COPY",
    "ExceptionTable",
    "PreparedInsn",
    "StepOutsideSlot",
    "StepRegs",
    "arch_adjust_kprobe_addr",
    "can_boost",
    "cannot_copy_reason",
    "copy_instruction",
    "emulate",
    "insn_has_emulate_prefix",
    "insn_masking_exception",
    "is_endbr",
    "prepare_emulation",
    "prepare_kprobe",
    "resume_singlestep",
    "resume_trap_step",
    "search_exception_tables",
    "synthesize_relcall",
    "synthesize_reljump",
    "trap_step_reason",
]

_MASK64 = (1 << 64) - 1

# A slot: the copy (and the boosted jump back) at 0; at TRAP_COPY[0] and TRAP_COPY[1] the copy
# relocated there followed by an int3, run with interrupts off, for a context that had them off
# and on (which of the two the second trap comes from says what to give back to IF).
SLOT_SIZE = 64
TRAP_COPY = (32, 48)
assert SLOT_SIZE - TRAP_COPY[1] == TRAP_COPY[1] - TRAP_COPY[0] >= MAX_INSN_SIZE  # a copy and its int3 fit
assert TRAP_COPY[0] >= MAX_INSN_SIZE + JMP32_INSN_SIZE  # so do the boosted copy and its jump

# Linux 6.1's prepare_emulation(): "IF modifiers must be emulated since it will enable interrupt
# while int3 single stepping" (kprobe_emulate_ifmodifiers).  The 64-bit forms only: the kernel
# pushes and pops 8 bytes whatever the operand size.
IF_MODIFIERS = frozenset({Code.CLI, Code.STI, Code.PUSHFQ, Code.POPFQ})


class StepOutsideSlot(ProbeError):
    """A single-step of the slot copy ended outside the slot (it faulted or jumped)."""


_EMULATE_PREFIXES = {b"\x0f\x0bxen": "xen", b"\x0f\x0bkvm": "kvm"}

_REFUSED: dict[int, str] = {}


def _refuse(reason: str, *names: str) -> None:
    for name in names:
        _REFUSED[getattr(Code, name)] = reason


_refuse("raises a software interrupt", "INT_IMM8", "INTO", "INT1")
_refuse("is an interrupt return; in-kernel iret is not supported (as in Linux)", "IRETW", "IRETD", "IRETQ")
_refuse(
    "is a far transfer; segment changes are not supported (as in Linux)",
    *("CALL_M1616", "CALL_M1632", "CALL_M1664", "JMP_M1616", "JMP_M1632", "JMP_M1664"),
    *("CALL_PTR1616", "CALL_PTR1632", "JMP_PTR1616", "JMP_PTR1632"),
    *("RETFW", "RETFD", "RETFQ", "RETFW_IMM16", "RETFD_IMM16", "RETFQ_IMM16"),
)
_refuse(
    "switches privilege level",
    *("SYSCALL", "SYSRETD", "SYSRETQ", "SYSENTER", "SYSEXITD", "SYSEXITQ"),
)
_refuse(
    "is a BUG/WARN site (the kernel's bug table is keyed by its address)",
    *("UD2", "UD0", "UD0_R16_RM16", "UD0_R32_RM32", "UD0_R64_RM64"),
    *("UD1_R16_RM16", "UD1_R32_RM32", "UD1_R64_RM64"),
)
# Not in Linux's list: with the gdbstub's single-step masking interrupts, a
# step of an instruction that waits for one would never complete.
_refuse(
    "waits for an interrupt, which the host's single-step keeps masked",
    *("HLT", "MWAIT", "MWAITX", "UMWAIT_R32", "UMWAIT_R64", "TPAUSE_R32", "TPAUSE_R64"),
)
_refuse("starts a transaction whose abort address is relative", "XBEGIN_REL16", "XBEGIN_REL32")


def insn_has_emulate_prefix(code: bytes) -> str | None:
    """``ud2; .ascii "xen"/"kvm"`` before an instruction asks the hypervisor to emulate it."""
    return _EMULATE_PREFIXES.get(bytes(code[:5]))


def insn_masking_exception(insn: Insn) -> bool:
    """``mov ss``/``pop ss`` block interrupts and debug traps for one instruction."""
    if insn.code in (Code.POPW_SS, Code.POPD_SS):
        return True
    return (
        insn.code in (Code.MOV_SREG_RM16, Code.MOV_SREG_R32M16, Code.MOV_SREG_R64M16)
        and insn.instr.op0_register == Register.SS
    )


def cannot_copy_reason(insn: Insn) -> str | None:
    """Why the instruction cannot run out of line at all (emulated or not), or None.

    Linux's __copy_instruction() refusals (mov/pop ss; the emulate prefix
    spans two instructions, see :func:`insn_has_emulate_prefix`) and
    prepare_emulation()'s -EOPNOTSUPP cases, plus qprobe's own additions.
    """
    if insn_masking_exception(insn):
        return "masks interrupts and debug exceptions for the next instruction"
    if insn.code in _REFUSED:
        return _REFUSED[insn.code]
    nbytes, opcode, after = opcode_bytes(insn)
    if nbytes == 2 and opcode[1] == 0x01 and after < len(insn.raw):
        modrm = insn.raw[after]
        if modrm >> 6 == 3 and (modrm >> 3) & 7 == 0:
            return "is a VM/enclave extension (not supported, as in Linux)"
    return None


def prepare_emulation(insn: Insn, where: str | None = None) -> str | None:
    """Name of the host emulation for ``insn``, or None to single-step it.

    Linux 6.1's prepare_emulation(), minus the IF modifiers (cli/sti/pushf/
    popf): like the kernel, qprobe boosts those when it may and emulates them
    only in place of the int3 single-step (``PreparedInsn.if_modifier``); a
    reentered hit steps them with the gdbstub, whose flags are genuine.
    (Under KVM that step does set the real TF; resume_singlestep() clears it
    from a pushf, given the memory, as the dispatcher gives it.)
    Raises CannotProbe for forms that are neither.
    """
    instr = insn.instr
    code = insn.code
    if code == Code.CALL_REL32_64:
        return "call"
    if code in (Code.JMP_REL8_64, Code.JMP_REL32_64):
        return "jmp"
    if instr.is_jcc_short_or_near:
        return "jcc"
    if code in LOOP_KINDS:
        return "loop"
    if code in (Code.RETNQ, Code.RETNQ_IMM16):
        return "ret"
    if code in (Code.CALL_RM64, Code.JMP_RM64):
        call = code == Code.CALL_RM64
        if 0x67 in insn.raw[: skip_prefixes(insn.raw)]:
            raise CannotProbe(_msg(insn, "uses a 32-bit address size (not supported, as in Linux)", where))
        if instr.op0_kind == OpKind.REGISTER:
            return "call_indirect" if call else "jmp_indirect"
        if not call:
            return None  # jmp [mem]: single-stepped with the rip-relative fixup
        # A stepped call would push the slot's return address: emulate it,
        # reading the target through the memory callback.
        if instr.memory_segment in (Register.FS, Register.GS):
            why = "calls through fs:/gs: memory, whose base the host cannot see"
            raise CannotProbe(_msg(insn, why, where))
        if instr.memory_base == Register.EIP:
            raise CannotProbe(_msg(insn, "uses eip-relative addressing", where))
        return "call_indirect"
    if instr.flow_control != FlowControl.NEXT:
        raise CannotProbe(_msg(insn, "transfers control in a way qprobe does not emulate", where))
    return None


def _msg(insn: Insn, reason: str, where: str | None = None) -> str:
    return f"cannot probe {where or hex(insn.addr)}: '{insn.text}' {reason}"


def copy_instruction(insn: Insn, slot_addr: int, where: str | None = None) -> bytes:
    """Linux's ``__copy_instruction()``: the bytes to single-step at ``slot_addr``.

    A rip-relative displacement is rewritten in place (same length, same
    prefixes) so the copy references the same absolute address; the result
    is checked by decoding it back. Raises DisplacementOverflow when the
    slot is more than ±2 GiB from the target.
    """
    if not insn.is_rip_relative:
        return insn.raw
    if insn.instr.memory_base == Register.EIP or insn.disp_size != 4:
        raise CannotProbe(_msg(insn, "uses eip-relative addressing", where))
    target = insn.instr.ip_rel_memory_address
    try:
        newdisp = rel32(slot_addr + insn.length, target, "rip-relative reference")
    except DisplacementOverflow:
        raise DisplacementOverflow(
            f"cannot probe {where or hex(insn.addr)}: '{insn.text}' refers to {target:#x}, "
            f"{signed64(target - slot_addr - insn.length):+#x} from the slot at {slot_addr:#x}; "
            "a rip-relative displacement only reaches ±2 GiB"
        ) from None
    off = insn.disp_offset
    copy = insn.raw[:off] + newdisp.to_bytes(4, "little", signed=True) + insn.raw[off + 4 :]
    check = decode_one(copy, slot_addr)
    if check.memory_target != target or check.code != insn.code or check.length != insn.length:
        raise CannotProbe(_msg(insn, f"could not be relocated to {slot_addr:#x}", where))
    return copy


@dataclass
class PreparedInsn:
    """A probed instruction ready to be executed out of line or emulated.

    ``copy`` is written at ``slot_addr`` (single-stepped by the host, or
    boosted: run freely followed by a jump back, see :meth:`boosted_copy`);
    it is empty when ``emulate`` names the host emulation instead.
    ``trap_copies`` are the copy relocated to the slot's two ``TRAP_COPY``
    places, each followed by an int3 (empty when ``step_reason`` says why
    the host must single-step it instead).  ``if_modifier``: a cli, sti,
    pushf or popf, emulated (``"ifmodifier"``) where it is not boosted.
    """

    addr: int
    insn: Insn
    copy: bytes
    slot_addr: int
    emulate: str | None
    boostable: bool
    in_exception_table: bool = False
    step_reason: str | None = None
    trap_copies: tuple[bytes, ...] = ()
    if_modifier: bool = False

    @property
    def length(self) -> int:
        return self.insn.length

    @property
    def opcode(self) -> int:
        """The original first byte, which int3 replaces (Linux's ``kp->opcode``)."""
        return self.insn.raw[0]

    @property
    def resume_fixes_ip(self) -> bool:
        """False when the stepped copy leaves ip at an absolute target (``jmp [mem]``)."""
        return self.emulate is None and self.insn.flow_control != FlowControl.INDIRECT_BRANCH

    def boosted_copy(self) -> bytes:
        """The copy followed by ``jmp`` back to the next original instruction."""
        if not self.boostable:
            raise CannotProbe(_msg(self.insn, "is not boostable"))
        return self.copy + synthesize_reljump(self.slot_addr + len(self.copy), self.addr + self.insn.length)

    def slot_code(self) -> bytes:
        """The whole slot: the copy (boosted if it may be) at 0, the int3-terminated copies at ``TRAP_COPY``."""
        code = bytearray([INT3_INSN_OPCODE]) * SLOT_SIZE
        first = self.boosted_copy() if self.boostable else self.copy
        code[: len(first)] = first
        for off, trap_copy in zip(TRAP_COPY, self.trap_copies, strict=False):
            code[off : off + len(trap_copy)] = trap_copy
        return bytes(code)


def trap_step_reason(insn: Insn, in_exception_table: bool) -> str | None:
    """Why the copy of ``insn`` cannot run to an int3 after it (so the host single-steps it), or None.

    A fault in a copy that runs freely is taken with ip in the slot, where
    the kernel's exception table has no fixup: the kernel's own
    kprobe_fault_handler() moves ip back to the probed address first, and
    qprobe sees the fault only when it steps the copy itself.  Every kernel
    access to user memory is such an instruction (``_ASM_EXTABLE_UA``).
    """
    if in_exception_table:
        return "it has an exception-table entry (a fault must be fixed up at the probed address)"
    if insn.flow_control == FlowControl.INDIRECT_BRANCH:
        return "it jumps through memory, so no int3 after it would run"
    if insn.code in (Code.PUSHFW, Code.POPFW):
        return "it pushes or pops 16-bit flags, which the kernel's IF emulation does not cover"
    return None


def prepare_kprobe(
    code: bytes,
    addr: int,
    slot_addr: int,
    *,
    patched: Mapping[int, int] | None = None,
    exception_table: ExceptionTable | None = None,
    where: str | None = None,
) -> PreparedInsn:
    """Linux's ``arch_prepare_kprobe()`` + ``arch_copy_kprobe()`` for the instruction at ``addr``.

    ``code`` holds the guest bytes from ``addr`` (at least the instruction;
    16 bytes is always enough). An int3 qprobe itself placed must be undone
    through ``patched`` (addr -> original byte); any other int3 is somebody
    else's and raises ProbeBusy. ``where`` (e.g. ``"vfs_read+0x4"``) only
    improves messages. Boundary checking is :func:`check_boundary`'s job.
    """
    for what, value in (("address", addr), ("slot address", slot_addr)):
        if not 0 <= value <= _MASK64:
            raise ValueError(f"{what} {value:#x} is not a 64-bit address")
    code = recover_bytes(code, addr, patched)
    where = where or f"{addr:#x}"
    prefix = insn_has_emulate_prefix(code)
    if prefix:
        raise CannotProbe(f"cannot probe {where}: the {prefix} emulate prefix is there (forced emulation)")
    if code[:1] == bytes([INT3_INSN_OPCODE]):
        raise ProbeBusy(f"another int3 is already at {where} (a debugger or the kernel's own kprobe?)")
    try:
        insn = decode_one(code, addr)
    except CannotProbe as exc:
        raise CannotProbe(f"cannot probe {where}: {exc}") from None
    if insn.code == Code.INT3:
        raise ProbeBusy(f"another int3 is already at {where} (a debugger or the kernel's own kprobe?)")
    reason = cannot_copy_reason(insn)
    if reason:
        raise CannotProbe(_msg(insn, reason, where))
    kind = prepare_emulation(insn, where)
    in_table = search_exception_tables(exception_table, addr)
    if kind is not None:
        return PreparedInsn(addr, insn, b"", slot_addr, kind, False, in_table)
    copy = copy_instruction(insn, slot_addr, where)
    boostable = can_boost(insn, exception_table) and MAX_INSN_SIZE - insn.length >= JMP32_INSN_SIZE
    if boostable:
        try:
            synthesize_reljump(slot_addr + insn.length, addr + insn.length)
        except DisplacementOverflow:
            boostable = False
    if_modifier = insn.code in IF_MODIFIERS
    step_reason = trap_step_reason(insn, in_table)
    trap_copies: tuple[bytes, ...] = ()
    if step_reason is None and not if_modifier:
        try:
            trap_copies = tuple(copy_instruction(insn, slot_addr + off, where) + bytes([INT3_INSN_OPCODE])
                                for off in TRAP_COPY)  # fmt: skip
        except DisplacementOverflow:
            step_reason = "its rip-relative operand is out of reach of the slot's int3-terminated copies"
    return PreparedInsn(addr, insn, copy, slot_addr, None, boostable, in_table, step_reason, trap_copies, if_modifier)


class StepRegs(Protocol):
    """What resume_singlestep() touches: ip, and sp when fixing up a pushf; resume_trap_step() ip and flags."""

    ip: int
    sp: int
    flags: int


def resume_singlestep(prep: PreparedInsn, regs: StepRegs, mem: Memory | None = None) -> None:
    """Linux's ``resume_singlestep()``: map ip from the slot back to the original text.

    After the copy was stepped, ``regs.ip`` is just past it in the slot; it
    becomes the same offset past ``prep.addr``. A stepped ``jmp [mem]`` has
    already put its absolute target in ip and is left alone. An ip anywhere
    else means the step faulted (the kernel then rewinds to the probe address
    in kprobe_fault_handler); that is reported as StepOutsideSlot.

    With ``mem``, a stepped ``pushf`` gets TF cleared in the word it pushed,
    as Linux's pre-5.14 resume_execution() did: TCG's gdbstub step leaves TF
    alone, but KVM's guest-debug step sets the real TF, which pushf records.
    """
    if prep.emulate is not None:
        raise ValueError(f"{prep.insn.text!r} is emulated, not single-stepped")
    if not prep.resume_fixes_ip:
        return
    ip = regs.ip
    if not prep.slot_addr <= ip <= prep.slot_addr + len(prep.copy):
        raise StepOutsideSlot(f"single-step of '{prep.insn.text}' in the slot at {prep.slot_addr:#x} ended at {ip:#x}")
    if mem is not None and prep.insn.code in (Code.PUSHFQ, Code.PUSHFW) and ip != prep.slot_addr:
        size = 8 if prep.insn.code == Code.PUSHFQ else 2
        pushed = int.from_bytes(mem.read(regs.sp, size), "little")
        if pushed & X86_EFLAGS_TF:
            mem.write(regs.sp, (pushed & ~X86_EFLAGS_TF).to_bytes(size, "little"))
    regs.ip = (prep.addr + (ip - prep.slot_addr)) & _MASK64


def trap_copy_start(prep: PreparedInsn, ip: int) -> int | None:
    """The start of the int3-terminated copy that ``ip`` lies in (from its start to its int3), or None."""
    if not prep.trap_copies:
        return None
    for off in TRAP_COPY:
        start = prep.slot_addr + off
        if start <= ip <= start + prep.insn.length:
            return start
    return None


def resume_trap_step(prep: PreparedInsn, regs: StepRegs) -> None:
    """Linux's resume_singlestep() at the second trap: ip back in the text, IF as it was.

    ``regs.ip`` is the int3's address after the copy (the trap's address):
    it becomes the same offset past the probed instruction.  The copy ran with
    interrupts off; the copy at ``TRAP_COPY[1]`` is the one run for a context
    that had them on.
    """
    start = trap_copy_start(prep, regs.ip)
    if start is None or regs.ip != start + prep.insn.length:
        raise StepOutsideSlot(f"'{prep.insn.text}' trapped back at {regs.ip:#x}, not after its copy in the slot")
    regs.ip = (prep.addr + prep.insn.length) & _MASK64
    if start == prep.slot_addr + TRAP_COPY[1]:
        regs.flags |= X86_EFLAGS_IF


_ENDBR64 = bytes.fromhex("f30f1efa")
_ENDBR32 = bytes.fromhex("f30f1efb")
_ENDBR_POISON = bytes.fromhex("660f1f00")  # nopw (%rax), written over unused ENDBRs


def is_endbr(code: bytes) -> bool:
    """Linux's ``is_endbr()``: ENDBR64/ENDBR32 or the boot-time poison that replaces it."""
    return code[:4] in (_ENDBR64, _ENDBR32, _ENDBR_POISON)


def arch_adjust_kprobe_addr(func_code: bytes, func_start: int, offset: int) -> tuple[int, bool]:
    """Linux's ``arch_adjust_kprobe_addr()``: skip an ENDBR at the function entry.

    Returns (probe address, on_func_entry). A probe on ``func+0`` of an IBT
    function goes after the 4-byte ENDBR, which must stay in place.
    """
    if is_endbr(func_code):
        on_entry = offset in (0, 4)
        return func_start + (4 if on_entry else offset), on_entry
    return func_start + offset, offset == 0

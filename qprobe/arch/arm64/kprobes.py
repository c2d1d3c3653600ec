"""arch/arm64/kernel/probes/kprobes.c on the host: prepare a probe, its slot, and the resume after a hit.

arm64 never boosts: a copy in the slot is followed by ``brk
#KPROBES_BRK_SS_IMM`` (arch_prepare_ss_slot(), 6.1 and 6.12 alike), which
brings the vCPU back once the copy ran, with all of DAIF masked while it
runs (kprobes_save_local_irqflag()).  The kernel keeps the DAIF bits it
masked in its per-CPU kprobe_ctlblk; the host keeps them in where the copy
runs instead, as x86's port keeps IF: a slot holds one copy (instruction and
BRK) for each of the 16 DAIF values, the one run being the one at
``8 * DAIF``, so that the second trap and a vCPU found in a slot by
recovery both say which DAIF to give back (a host step runs the same copy
with DAIF as it was).  The copies are identical: only instructions that do
not read the pc run out of line.

A hit on an instruction the decoder simulates is finished on the host
(:func:`emulate`, simulate-insn.c), as arch_simulate_insn() finishes it in
the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from qprobe.arch import ExceptionTable, Memory, Prepared, Registers, Resume, ResumeKind
from qprobe.arch.arm64.decode import NEWEST, KernelVersion, ProbeInsn, arm_kprobe_decode_insn, atomic_reason
from qprobe.arch.arm64.insn import (
    AARCH64_INSN_SIZE,
    BRK64_OPCODE_KPROBES,
    BRK64_OPCODE_KPROBES_SS,
    DAIF_MASK,
    DAIF_SHIFT,
    le32,
    recover_bytes,
    u64,
)
from qprobe.arch.arm64.simulate import simulate
from qprobe.arch.shared import search_exception_tables
from qprobe.errors import CannotProbe, InvalidProbe, MemoryFault, NotInstructionBoundary, ProbeBusy, ProbeError

COPY_SIZE = 2 * AARCH64_INSN_SIZE  # the instruction and the BRK after it
DAIF_STATES = (DAIF_MASK >> DAIF_SHIFT) + 1  # 16: D, A, I and F each masked or not
SLOT_SIZE = COPY_SIZE * DAIF_STATES
# The register a synchronous exception's return address is in (the gdbstub's and RegisterLayout's name).
ELR, SPSR = "ELR_EL1", "SPSR_EL1"


class StepOutsideSlot(ProbeError):
    """A single-step or trap-step of the slot's copy ended somewhere else than just after it."""


@dataclass
class Arm64Insn:
    """arm64's :class:`qprobe.arch.Prepared` (``struct arch_specific_insn``).

    Not frozen, though nothing changes it: the protocol's attributes are plain (settable) ones.

    ``copy`` is the instruction that runs out of line (empty when
    ``emulate`` names the simulate-insn.c handler that runs it on the host
    instead); ``opcode`` is the probed instruction word (``kp->opcode``).
    """

    addr: int
    slot_addr: int
    copy: bytes
    emulate: str | None
    opcode: int
    version: KernelVersion = NEWEST
    boostable: bool = False  # arm64's kprobes never boost
    step_reason: str | None = None  # every copy may run to its BRK (arm64 refuses instructions with a fixup)

    @property
    def length(self) -> int:
        return AARCH64_INSN_SIZE

    def boosted_copy(self) -> bytes:
        raise CannotProbe(f"the probe at {self.addr:#x} is not boostable: arm64's kprobes never boost")


def _insn(prep: Prepared) -> Arm64Insn:
    """The core hands back what prepare_kprobe returned."""
    assert isinstance(prep, Arm64Insn)
    return prep


def check_boundary(code: bytes, func_start: int, addr: int, patched: Mapping[int, int] | None = None,
                   name: str | None = None) -> None:  # fmt: skip
    """Every aligned word is an instruction; and a probe may not split an atomic sequence.

    ``code`` holds the function's bytes from ``func_start``.  The kernel's
    arch_prepare_kprobe() refuses a misaligned address (EINVAL), and
    arm_kprobe_decode_insn() an address within an LDXR ... STXR sequence
    (is_probed_address_atomic(), which needs the bytes before the address:
    only this check has them).
    """
    where = f"{name}+{addr - func_start:#x}" if name else f"{addr:#x}"
    if addr % AARCH64_INSN_SIZE:
        # arch_prepare_kprobe's EINVAL, which trace_kprobe logs as a failed registration, not as x86's
        # instruction boundary (EILSEQ).
        raise InvalidProbe(f"{where} is not 4-byte aligned (EINVAL): arm64 instructions are")
    if not func_start <= addr < func_start + len(code):
        raise NotInstructionBoundary(f"{where} is outside the function's {len(code)} bytes at {func_start:#x}")
    preceding = recover_bytes(code[: addr - func_start], func_start, patched)
    why = atomic_reason(preceding)
    if why is not None:
        raise CannotProbe(f"cannot probe {where}: the instruction {why} (EINVAL)")


def prepare_kprobe(code: bytes, addr: int, slot_addr: int, *, where: str | None = None, preceding: bytes = b"",
                   version: KernelVersion = NEWEST, exception_table: ExceptionTable | None = None,
                   patched: Mapping[int, int] | None = None) -> Arm64Insn:  # fmt: skip
    """``arch_prepare_kprobe()`` for the instruction at ``addr`` (``code``: the guest's bytes from there).

    ``preceding``: the function's bytes before ``addr`` for the atomic-sequence
    scan (see :func:`check_boundary`, which the core runs first).  A BRK
    qprobe placed is undone through ``patched`` (byte address -> original byte);
    a kprobe BRK of anyone else's raises ProbeBusy.  ``version`` is the guest
    kernel's (decode.py says what differs).
    """
    where = where or f"{addr:#x}"
    if addr % AARCH64_INSN_SIZE:
        raise InvalidProbe(f"cannot probe {where}: not 4-byte aligned (EINVAL)")
    code = recover_bytes(code, addr, patched)
    if len(code) < AARCH64_INSN_SIZE:
        raise CannotProbe(f"cannot probe {where}: only {len(code)} byte(s) of its instruction were read")
    opcode = le32(code)
    if opcode == BRK64_OPCODE_KPROBES:
        raise ProbeBusy(f"another kprobe's brk is already at {where} (the kernel's own kprobe?)")
    if search_exception_tables(exception_table, addr):
        raise CannotProbe(f"cannot probe {where}: it has an exception-table entry, which arm64's kprobes refuse "
                          "(EINVAL)")  # fmt: skip
    decoded = arm_kprobe_decode_insn(opcode, preceding, version)
    if decoded.kind is ProbeInsn.INSN_REJECTED:
        raise CannotProbe(f"cannot probe {where}: the instruction {opcode:#010x} {decoded.reason} (EINVAL)")
    if decoded.kind is ProbeInsn.INSN_GOOD_NO_SLOT:
        return Arm64Insn(addr, slot_addr, b"", decoded.handler, opcode, version)
    return Arm64Insn(addr, slot_addr, code[:AARCH64_INSN_SIZE], None, opcode, version)


def slot_code(prep: Prepared) -> bytes:
    """The slot: for each DAIF value, the copy and ``brk #KPROBES_BRK_SS_IMM`` (arch_prepare_ss_slot())."""
    insn = _insn(prep)
    if not insn.copy:
        raise ValueError(f"the probe at {insn.addr:#x} is simulated: it has no slot")
    return (insn.copy + BRK64_OPCODE_KPROBES_SS.to_bytes(4, "little")) * DAIF_STATES


def copy_addr(prep: Prepared, pstate: int) -> int:
    """Where the copy run for a context with ``pstate`` starts: the one that stands for its DAIF."""
    return prep.slot_addr + COPY_SIZE * ((pstate & DAIF_MASK) >> DAIF_SHIFT)


def copy_index(slot: int, ip: int) -> tuple[int, int] | None:
    """(DAIF the copy at ``ip`` stands for, offset of ``ip`` in that copy), or None outside the slot."""
    off = ip - slot
    if not 0 <= off < SLOT_SIZE:
        return None
    return (off // COPY_SIZE) << DAIF_SHIFT, off % COPY_SIZE


def emulate(prep: Prepared, regs: Registers, mem: Memory) -> None:
    """``arch_simulate_insn()``: the simulated instruction's effect on ``regs``, the pc included."""
    insn = _insn(prep)
    if insn.emulate is None:
        raise ValueError(f"the probe at {insn.addr:#x} runs out of line; it is not simulated")
    simulate(insn.emulate, insn.opcode, insn.addr, regs, mem.read, insn.version)


def emulate_in_place(regs: Registers, mem: Memory) -> bool:
    """A stub breakpoint's instruction, simulated on the host if kprobes simulate it (branches, adr, literal
    loads), on the word at pc now; False: it is to be stepped."""
    return simulate_at(mem.read, regs, mem)


def simulate_at(fetch: Callable[[int, int], bytes], regs: Registers, mem: Memory,
                version: KernelVersion = NEWEST) -> bool:  # fmt: skip
    """The word ``fetch`` gives at pc, simulated on the host if the decoder of ``version`` simulates it;
    False (nothing changed): it is to be stepped."""
    try:
        prep = prepare_kprobe(fetch(regs.pc, AARCH64_INSN_SIZE), regs.pc, 0, version=version)
        if prep.emulate is None:
            return False
        emulate(prep, regs, mem)
    except (ProbeError, MemoryFault):  # not an instruction to simulate, or its memory faulted
        return False
    return True


def arch_setup_resume(prep: Prepared, regs: Registers, mem: Memory, may_trap_step: bool) -> Resume:
    """setup_singlestep(): simulate on the host, or run the copy that stands for the context's DAIF.

    Run to its BRK (TRAP_STEP), it runs with all of DAIF masked, as
    kprobes_save_local_irqflag() has it; stepped by the host (STEP), the
    pstate stays as it is.
    """
    insn = _insn(prep)
    if insn.emulate is not None:
        emulate(insn, regs, mem)
        return Resume(ResumeKind.CONTINUE, regs.pc, regs.sp, regs.pstate, regs.dirty())
    start = copy_addr(insn, regs.pstate)
    if may_trap_step and insn.step_reason is None:
        return Resume(ResumeKind.TRAP_STEP, start, regs.sp, regs.pstate | DAIF_MASK, regs.dirty())
    return Resume(ResumeKind.STEP, start, regs.sp, regs.pstate, regs.dirty())


def step_left_slot(prep: Prepared, ip: int) -> bool:
    """Whether a step of a copy ended anywhere but on the BRK after a copy (it faulted)."""
    at = copy_index(prep.slot_addr, ip)
    return at is None or at[1] != AARCH64_INSN_SIZE


def resume_singlestep(prep: Prepared, regs: Registers) -> None:
    """After the host stepped the copy: the pc goes on after the probed instruction (``api.restore``)."""
    if step_left_slot(prep, regs.pc):
        raise StepOutsideSlot(f"the step of the copy of {prep.addr:#x} in its slot at {prep.slot_addr:#x} "
                              f"ended at {regs.pc:#x}")  # fmt: skip
    regs.pc = u64(prep.addr + AARCH64_INSN_SIZE)


def resume_trap_step(prep: Prepared, regs: Registers) -> None:
    """At the BRK after a copy (post_kprobe_handler()): the pc after the probed instruction, DAIF given back
    (kprobes_restore_local_irqflag()) as the copy that ran says it was."""
    at = copy_index(prep.slot_addr, regs.pc)
    if at is None or at[1] != AARCH64_INSN_SIZE:
        raise StepOutsideSlot(f"the copy of {prep.addr:#x} trapped back at {regs.pc:#x}, not at a BRK after it")
    regs.pc = u64(prep.addr + AARCH64_INSN_SIZE)
    regs.pstate = regs.pstate & ~DAIF_MASK | at[0]


def arch_slot_resume(slot: int, addr: int, ip: int, flags: int) -> tuple[int, int] | None:
    """(pc, pstate) in the text for a vCPU found at ``ip`` in the slot of the probe at ``addr`` (recovery).

    On a copy, it has not run: back to the probed instruction; on the BRK
    after it, it has: on after it.  DAIF is the one the copy stands for.
    """
    at = copy_index(slot, ip)
    if at is None:
        return None
    daif, off = at
    return addr + off, flags & ~DAIF_MASK | daif


def arch_fault_fixup(prep: Prepared, regs: Registers) -> bool:
    """kprobe_fault_handler() for KPROBE_HIT_SS: the exception must return to the probed address, not the slot.

    ``regs`` are the exception's: its return address ELR_EL1, the PSTATE it was taken with SPSR_EL1.  The
    kernel sets ELR_EL1; QEMU 7.2's stub writes no system register, so instead ``regs`` go back to the
    context the copy ran in, at the probed instruction with the DAIF the copy stands for, for the core to
    take the exception again there (False).  An exception taken elsewhere needs nothing (True).
    """
    at = copy_index(prep.slot_addr, getattr(regs, ELR))
    if at is None:
        return True
    daif, off = at
    regs.pc = u64(prep.addr + off)
    regs.pstate = getattr(regs, SPSR) & ~DAIF_MASK | daif
    return False


class Arm64TrapStep:
    """The ``trap_step`` facet: the copy runs to the ``brk #KPROBES_BRK_SS_IMM`` after it."""

    def is_trap_step_start(self, prep: Prepared, ip: int) -> bool:
        """Whether ``ip`` is the start of one of the slot's copies (the vCPU has not run it yet)."""
        at = copy_index(prep.slot_addr, ip)
        return at is not None and at[1] == 0

    def is_trap_step_end(self, prep: Prepared, addr: int) -> bool:
        """Whether ``addr`` is the BRK after one of the slot's copies (kprobe_breakpoint_ss_handler's test)."""
        at = copy_index(prep.slot_addr, addr)
        return at is not None and at[1] == AARCH64_INSN_SIZE

    def arch_resume_trap_step(self, prep: Prepared, regs: Registers) -> None:
        resume_trap_step(prep, regs)

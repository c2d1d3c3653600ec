"""arm64's arch_prepare_kprobe, its slot, and the resume after a hit (kprobes.c on the host)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qprobe.arch import ResumeKind
from qprobe.arch.arm64.arch import Arm64
from qprobe.arch.arm64.insn import BRK64_OPCODE_KPROBES, BRK64_OPCODE_KPROBES_SS, DAIF_MASK
from qprobe.arch.arm64.kprobes import (
    SLOT_SIZE,
    Arm64TrapStep,
    StepOutsideSlot,
    arch_fault_fixup,
    arch_setup_resume,
    arch_slot_resume,
    check_boundary,
    prepare_kprobe,
    resume_singlestep,
    slot_code,
    step_left_slot,
)
from qprobe.arch.arm64.ptregs import REGISTERS
from qprobe.core.regs import PtRegs
from qprobe.errors import CannotProbe, InvalidProbe, NotInstructionBoundary, ProbeBusy

sys.path.insert(0, str(Path(__file__).parent))
from fakes_arm64 import FakeMem, FakeRegs

ADDR = 0xFFFF800008A01234
SLOT = 0xFFFF800010000040
ADD = (0x8B020020).to_bytes(4, "little")  # add x0, x1, x2
LDXR = (0xC85F7C20).to_bytes(4, "little")  # ldxr x0, [x1]
STXR = (0xC8027C20).to_bytes(4, "little")  # stxr w2, x0, [x1]
BEQ = (0x54000200).to_bytes(4, "little")  # b.eq .+0x40
LDR_W = (0x18FFFC0D).to_bytes(4, "little")  # ldr w13, .-0x80
BRK_SS = BRK64_OPCODE_KPROBES_SS.to_bytes(4, "little")
NZCV = 0x60000000  # Z and C set
EL1H = 0x5


def test_the_kernel_brk_encodings() -> None:
    assert BRK64_OPCODE_KPROBES == 0xD4200080  # brk #0x4
    assert BRK64_OPCODE_KPROBES_SS == 0xD42000C0  # brk #0x6


def test_a_steppable_instruction_gets_a_copy_and_a_slot_of_16() -> None:
    prep = prepare_kprobe(ADD + b"\0" * 12, ADDR, SLOT, where="f+0x34")
    assert (prep.copy, prep.emulate, prep.boostable, prep.step_reason, prep.length) == (ADD, None, False, None, 4)
    code = slot_code(prep)
    assert len(code) == SLOT_SIZE == 128
    assert code == (ADD + BRK_SS) * 16
    with pytest.raises(CannotProbe, match="never boost"):
        prep.boosted_copy()


def test_a_simulated_instruction_has_no_slot() -> None:
    prep = prepare_kprobe(BEQ, ADDR, SLOT)
    assert (prep.copy, prep.emulate, prep.opcode) == (b"", "simulate_b_cond", 0x54000200)
    with pytest.raises(ValueError, match="simulated"):
        slot_code(prep)


def test_refusals() -> None:
    with pytest.raises(CannotProbe, match=r"cannot probe f\+0x34: the instruction 0xd4000001 generates an exception"):
        prepare_kprobe((0xD4000001).to_bytes(4, "little"), ADDR, SLOT, where="f+0x34")
    with pytest.raises(ProbeBusy):
        prepare_kprobe(BRK64_OPCODE_KPROBES.to_bytes(4, "little"), ADDR, SLOT)
    with pytest.raises(InvalidProbe, match="not 4-byte aligned"):
        prepare_kprobe(ADD, ADDR + 2, SLOT)
    with pytest.raises(CannotProbe, match="exception-table entry"):
        prepare_kprobe(ADD, ADDR, SLOT, exception_table={ADDR})
    with pytest.raises(CannotProbe, match="atomic sequence"):
        prepare_kprobe(ADD, ADDR, SLOT, preceding=LDXR)
    with pytest.raises(CannotProbe, match="only 2 byte"):
        prepare_kprobe(ADD[:2], ADDR, SLOT)


def test_qprobe_s_own_brk_is_looked_through() -> None:
    patched = {ADDR + i: b for i, b in enumerate(ADD)}
    prep = prepare_kprobe(BRK64_OPCODE_KPROBES.to_bytes(4, "little"), ADDR, SLOT, patched=patched)
    assert prep.copy == ADD


def test_check_boundary() -> None:
    start = ADDR - 8
    check_boundary(STXR + ADD + ADD, start, ADDR, {}, "f")
    with pytest.raises(InvalidProbe, match=r"f\+0x9 is not 4-byte aligned"):
        check_boundary(ADD * 4, start, ADDR + 1, {}, "f")
    with pytest.raises(NotInstructionBoundary, match="outside"):
        check_boundary(ADD * 2, start, ADDR, {}, "f")
    with pytest.raises(CannotProbe, match=r"f\+0x8: .*atomic sequence"):
        check_boundary(LDXR + ADD + ADD, start, ADDR, {}, "f")
    # An LDXR under one of qprobe's own BRKs still opens a sequence.
    brk = BRK64_OPCODE_KPROBES.to_bytes(4, "little")
    with pytest.raises(CannotProbe, match="atomic sequence"):
        check_boundary(brk + ADD + ADD, start, ADDR, {start + i: b for i, b in enumerate(LDXR)}, "f")


@pytest.mark.parametrize("daif", [0, 0x80, 0xC0, 0x3C0])
def test_the_copy_run_stands_for_the_context_s_daif(daif: int) -> None:
    prep = prepare_kprobe(ADD, ADDR, SLOT)
    regs = FakeRegs(pc=ADDR, sp=0xFFFF800012000000, pstate=NZCV | daif | EL1H)
    start = SLOT + 8 * (daif >> 6)
    trap = arch_setup_resume(prep, regs, FakeMem(), may_trap_step=True)
    assert (trap.kind, trap.ip, trap.flags) == (ResumeKind.TRAP_STEP, start, NZCV | DAIF_MASK | EL1H)
    step = arch_setup_resume(prep, regs, FakeMem(), may_trap_step=False)
    assert (step.kind, step.ip, step.flags) == (ResumeKind.STEP, start, regs.pstate)

    ts = Arm64TrapStep()
    assert ts.is_trap_step_start(prep, start) and not ts.is_trap_step_start(prep, start + 4)
    assert ts.is_trap_step_end(prep, start + 4) and not ts.is_trap_step_end(prep, start)
    assert not ts.is_trap_step_end(prep, SLOT + SLOT_SIZE + 4)
    # The copy changed the flags (N); the BRK's resume keeps them and gives DAIF back.
    after = FakeRegs(pc=start + 4, pstate=0x80000000 | DAIF_MASK | EL1H)
    ts.arch_resume_trap_step(prep, after)
    assert (after.pc, after.pstate) == (ADDR + 4, 0x80000000 | daif | EL1H)

    stepped = FakeRegs(pc=start + 4, pstate=regs.pstate)
    assert not step_left_slot(prep, stepped.pc)
    resume_singlestep(prep, stepped)
    assert (stepped.pc, stepped.pstate) == (ADDR + 4, regs.pstate)

    assert arch_slot_resume(SLOT, ADDR, start, NZCV | DAIF_MASK) == (ADDR, NZCV | daif)
    assert arch_slot_resume(SLOT, ADDR, start + 4, NZCV | DAIF_MASK) == (ADDR + 4, NZCV | daif)


def test_a_step_that_left_the_slot() -> None:
    prep = prepare_kprobe(ADD, ADDR, SLOT)
    vector = 0xFFFF800008010200  # el1h_64_sync's vector
    assert step_left_slot(prep, vector)
    assert step_left_slot(prep, SLOT)  # the copy did not run
    with pytest.raises(StepOutsideSlot):
        resume_singlestep(prep, FakeRegs(pc=vector))
    with pytest.raises(StepOutsideSlot):
        Arm64TrapStep().arch_resume_trap_step(prep, FakeRegs(pc=SLOT + 8))
    assert arch_slot_resume(SLOT, ADDR, SLOT + SLOT_SIZE, 0) is None
    assert arch_slot_resume(SLOT, ADDR, SLOT - 4, 0) is None


def test_the_fault_fixup_reads_the_exception_from_the_pt_regs_of_a_stop_and_writes_no_system_register() -> None:
    # What the core hands it: pt_regs made from the stop on the vector, ELR_EL1 and SPSR_EL1 among the stop's
    # system registers, no pt_regs fields (reading them as fields stopped the stop loop).
    prep = prepare_kprobe(ADD, ADDR, SLOT)
    stop = {"pc": 0xFFFF800008010200, "sp": 0xFFFF800012000000, "cpsr": DAIF_MASK | EL1H, "ELR_EL1": SLOT + 8 * 2,
            "SPSR_EL1": NZCV | DAIF_MASK | EL1H, "ESR_EL1": 0x96000006}  # fmt: skip
    regs = PtRegs(stop, "p1.1", 0, SimpleNamespace(pgd=0), layout=REGISTERS)  # type: ignore[arg-type]
    assert arch_fault_fixup(prep, regs) is False
    assert regs.dirty() == {"pc": ADDR, "cpsr": NZCV | 2 << 6 | EL1H}
    assert "ELR_EL1" not in regs.as_dict() and regs.ELR_EL1 == SLOT + 8 * 2
    with pytest.raises(AttributeError, match="ELR_EL1"):
        regs.ELR_EL1 = ADDR


def test_a_fault_in_the_copy_is_taken_again_at_the_probe_in_the_copy_s_context() -> None:
    # ELR_EL1 is not writable through QEMU 7.2's stub: the registers go back to the probed instruction, the
    # flags as the exception saved them, DAIF the one the copy stands for (the third copy: I), for the core
    # to run the original instruction there.
    prep = prepare_kprobe(ADD, ADDR, SLOT)
    regs = FakeRegs(pc=0xFFFF800008010200, ELR_EL1=SLOT + 8 * 2, SPSR_EL1=NZCV | DAIF_MASK | EL1H,
                    pstate=DAIF_MASK | EL1H)  # fmt: skip
    assert arch_fault_fixup(prep, regs) is False
    assert regs.dirty() == {"pc": ADDR, "pstate": NZCV | 2 << 6 | EL1H}
    elsewhere = FakeRegs(ELR_EL1=0xFFFF800009000000)
    assert arch_fault_fixup(prep, elsewhere) is True
    assert elsewhere.dirty() == {}


def test_a_simulated_hit_continues_where_the_instruction_goes() -> None:
    taken = arch_setup_resume(prepare_kprobe(BEQ, ADDR, SLOT), FakeRegs(pc=ADDR, pstate=NZCV), FakeMem(), True)
    assert (taken.kind, taken.ip, taken.changed) == (ResumeKind.CONTINUE, ADDR + 0x40, {"pc": ADDR + 0x40})
    mem = FakeMem()
    mem.write(ADDR - 0x80, bytes(range(1, 9)))
    for version in ((6, 1), (6, 12)):
        regs = FakeRegs(pc=ADDR, x13=(1 << 64) - 1)
        arch_setup_resume(prepare_kprobe(LDR_W, ADDR, SLOT, version=version), regs, mem, True)
        assert (regs.x13, regs.pc) == (0x04030201, ADDR + 4)


def test_a_w_literal_load_reads_8_bytes_before_the_fix() -> None:
    """6.1 loaded 64 bits for a W register (only 4 readable here): the read the kernel would have done."""
    mem = FakeMem()
    mem.write(ADDR - 0x80, bytes(range(1, 5)))
    regs = FakeRegs(pc=ADDR)
    arch_setup_resume(prepare_kprobe(LDR_W, ADDR, SLOT, version=(6, 12)), regs, mem, True)
    assert regs.x13 == 0x04030201
    with pytest.raises(KeyError):
        arch_setup_resume(prepare_kprobe(LDR_W, ADDR, SLOT, version=(6, 1)), FakeRegs(pc=ADDR), mem, True)


def test_in_place_a_simulated_instruction_is_performed_by_the_host_and_any_other_left_to_a_step() -> None:
    """A stub breakpoint's hit: what kprobes simulate needs no step, an instruction with a slot does."""
    mem = FakeMem()
    mem.write(ADDR, BEQ + ADD)
    regs = FakeRegs(pc=ADDR, pstate=NZCV)
    assert Arm64().arch_emulate_in_place(regs, mem) and regs.pc == ADDR + 0x40  # type: ignore[arg-type]
    regs = FakeRegs(pc=ADDR + 4, x1=1, x2=2)
    assert not Arm64().arch_emulate_in_place(regs, mem) and regs.dirty() == {}  # type: ignore[arg-type]

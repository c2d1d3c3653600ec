"""The toy's one exception vector, as arm64's el1h_64_sync: a fault, an undefined instruction and a BRK of the
kernel's own stop on the entry the dispatcher hooks, and go on to the toy kernel's handler as no trap of ours."""

from __future__ import annotations

import pytest
from fakearch import (
    BRK,
    BRK_OP,
    BRK_SS,
    BUG_BRK_IMM,
    EC_BRK64,
    EC_DABT_CUR,
    EC_SHIFT,
    EC_UNKNOWN,
    ENTRY,
    IRQ,
    KPROBES_BRK_IMM,
    KPROBES_BRK_SS_IMM,
    Rig,
    Toy,
    insn,
)

from qprobe.arch import BreakHook
from qprobe.core.kprobe import Kprobe
from qprobe.core.point import KprobeStatus

A = "p1.1"
UNMAPPED = 0xFFFF_9000_0000_0000  # a stack pointer whose reads fault


@pytest.fixture
def rig() -> Rig:
    return Rig()


def passed_on(rig: Rig, at: int) -> bool:
    """Whether vCPU A went on into the toy kernel's handler (the vector's first instruction run) from an
    exception at ``at``, with no trap of ours dispatched and no hit or miss counted."""
    regs, d = rig.t.regs(A), rig.km.dispatcher
    probes = [kp for point in rig.km.points.values() for kp in point.probes]
    return ((regs["pc"], regs["elr"]) == (ENTRY + 4, at) and d.ntraps == 0 and d.ctlblk[A].status is KprobeStatus.IDLE
            and not any(kp.nhit or kp.nmissed for kp in probes))  # fmt: skip


@pytest.mark.parametrize(
    ("esr", "hook"),
    [(EC_BRK64 << EC_SHIFT | KPROBES_BRK_IMM, BreakHook.KPROBE),
     (EC_BRK64 << EC_SHIFT | KPROBES_BRK_SS_IMM, BreakHook.KPROBE_SS),
     (EC_BRK64 << EC_SHIFT | BUG_BRK_IMM, None),
     (EC_DABT_CUR << EC_SHIFT | KPROBES_BRK_IMM, None),  # a data abort's ISS is no BRK immediate
     (EC_UNKNOWN << EC_SHIFT, None)],
)  # fmt: skip
def test_the_syndrome_says_which_kprobes_handler_a_stop_on_the_vector_is_for(esr: int, hook: BreakHook | None) -> None:
    assert Toy().traps.kprobe_break_hook({"esr": esr}) is hook


@pytest.mark.parametrize(
    ("code", "sp", "syndrome"),
    [(insn(BRK_OP, BUG_BRK_IMM), 0, EC_BRK64 << EC_SHIFT | BUG_BRK_IMM),  # BUG()
     (insn(0x03), UNMAPPED, EC_DABT_CUR << EC_SHIFT),  # LDR from memory that is not mapped
     (bytes(4), 0, EC_UNKNOWN << EC_SHIFT)],  # an undefined instruction
    ids=["bug-brk", "data-abort", "undefined"],
)  # fmt: skip
def test_another_exception_on_the_vector_goes_on_to_the_kernels_handler(rig: Rig, code: bytes, sp: int,
                                                                         syndrome: int) -> None:  # fmt: skip
    rig.km.register_kprobes([Kprobe("toy_fn", offset=8), Kprobe("toy_other")])  # probes armed: the hook is in
    at = rig.t.function("toy_excepting", code, insn(0x01))
    rig.run(A, at, **({"sp": sp} if sp else {}))
    assert rig.t.regs(A)["esr"] == syndrome
    assert passed_on(rig, at) and rig.km.dispatcher.passed_through == 1
    assert rig.t.cpu.steps == [(A, ENTRY)]  # stepped off the hook's breakpoint into the kernel's handler


def test_a_copy_that_faulted_goes_on_from_the_vector_to_the_kernels_fault_handler(rig: Rig) -> None:
    # The LDR's copy faults when the host steps it: the fault enters the vector with the slot's address in
    # elr, which kprobe_fault_handler's fix-up turns into the probe's.  The vCPU then sits on the vector,
    # on the dispatcher's breakpoint, with a probe armed at elr: the stop there is no second hit.
    kp = Kprobe("toy_load")
    rig.km.register_kprobe(kp)
    rig.run(A, rig.load, sp=UNMAPPED)
    regs = rig.t.regs(A)
    assert (regs["pc"], regs["elr"], regs["esr"]) == (ENTRY, rig.load, EC_DABT_CUR << EC_SHIFT)
    assert (kp.nhit, kp.nfaults) == (1, 1)
    assert rig.km.dispatcher.arriving(regs) is None  # no trap on its way (what the optimizer's checks see)
    rig.km.dispatcher.on_entry_stop(A, dict(regs))  # the stop loop hears of the vCPU on the vector
    assert (regs["pc"], regs["elr"]) == (ENTRY + 4, rig.load)  # the kernel handles the fault at the probe
    assert (kp.nhit, kp.nmissed, kp.nfaults, rig.km.dispatcher.ntraps) == (1, 0, 1, 1)
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE


@pytest.mark.parametrize("trap_step", [False, True], ids=["stepped", "trap-stepped"])
def test_where_the_return_address_cannot_be_written_the_guest_takes_the_fault_again_at_the_probe(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, trap_step: bool
) -> None:
    # arm64 through QEMU 7.2's stub: the fix-up cannot set ELR_EL1, so the vCPU goes back to the probed
    # instruction's context and runs the original instruction there once; it faults again, at the probe.
    monkeypatch.setattr(Toy, "elr_writable", False)
    kp = Kprobe("toy_load")
    rig.km.register_kprobe(kp)
    point = rig.km.points[rig.load]
    if trap_step:  # run to the BRK after the copy: the fault is heard on the entry, the hit still open
        point.prep.step_reason = None  # type: ignore[misc]
    rig.run(A, rig.load, sp=UNMAPPED)
    if trap_step:
        assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.HIT_SS and kp.nfaults == 0
        rig.step(A)  # the copy faults: the stop on the entry
    regs = rig.t.regs(A)
    assert (regs["pc"], regs["elr"], regs["esr"]) == (ENTRY, rig.load, EC_DABT_CUR << EC_SHIFT)
    assert regs["spsr"] & IRQ  # taken in the context the probed instruction ran in, interrupts on
    assert rig.t.cpu.steps[-1] == (A, rig.load) and rig.at(rig.load) == BRK  # in place, the probe armed again
    assert (kp.nhit, kp.nmissed, kp.nfaults) == (1, 0, 1)
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE and not rig.km.dispatcher.in_slot(point)
    rig.km.dispatcher.on_entry_stop(A, dict(regs))  # back on the entry: the kernel's fault, no second hit
    assert (regs["pc"], kp.nhit, rig.km.dispatcher.passed_through) == (ENTRY + 4, 1, 1)


@pytest.mark.parametrize("brk", [insn(BRK_OP, BUG_BRK_IMM), BRK_SS], ids=["bug", "guest-kprobes-ss"])
def test_a_brk_not_ours_where_a_probe_once_was_goes_on_to_the_kernels_handler(rig: Rig, brk: bytes) -> None:
    # Text a probe was in, freed and reused (a module's): a BRK there now is the kernel's own (BUG's, or the
    # guest's own kprobes' single-step one), not an int3 of ours removed after the vCPU ran it.
    kp = Kprobe("toy_fn", offset=4)
    rig.km.register_kprobes([kp, Kprobe("toy_other")])
    rig.km.unregister_kprobe(kp)
    rig.t.mem.write(rig.fn + 4, brk)
    rig.run(A, rig.fn + 4)
    assert passed_on(rig, rig.fn + 4) and rig.km.dispatcher.passed_through == 1

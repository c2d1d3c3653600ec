"""The kprobe table and the trap path (qprobe.core.kprobes, qprobe.core.dispatch) on the toy architecture.

Registration, aggregation, arming and the counters, as kernel/kprobes.c
defines them, checked on a made-up ISA whose vCPUs really execute the
probed instructions (tests/unit/core/fakearch.py): a hit is a BRK the toy
vCPU executes, and the dispatcher is handed that stop as the stop loop would.
"""

from __future__ import annotations

import inspect

import pytest
from fakearch import (
    ADDI,
    BRK,
    BRK_SS,
    BTI,
    ENTRY,
    IRQ,
    JMPL,
    NOP,
    STACK,
    STACK_SIZE,
    STEP_COPY,
    Rig,
    Toy,
    ToyTarget,
    insn,
)

from qprobe.arch import Arch
from qprobe.core.kprobe import KPROBE_FLAG_GONE, Kprobe
from qprobe.core.kprobes import KprobeManager
from qprobe.core.listing import list_probes
from qprobe.core.point import KprobeStatus
from qprobe.core.regsmaker import RegsMaker
from qprobe.core.table import ProbeTable
from qprobe.errors import Blacklisted, InvalidProbe, NotKernelText, ProbeError, SymbolError, TargetError

A, B = "p1.1", "p1.2"  # the two vCPUs


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_toy_implements_every_member_of_arch() -> None:
    names = set(Arch.__annotations__) | {n for n, v in vars(Arch).items() if inspect.isfunction(v)}
    missing = sorted(n for n in names if not n.startswith("_") and not hasattr(Toy(), n))
    assert missing == []


# -- registration ------------------------------------------------------------------------------


def test_register_writes_the_breakpoint_and_unregister_puts_the_text_back(rig: Rig) -> None:
    kp = Kprobe("toy_fn", offset=8)
    rig.km.register_kprobe(kp)
    addr = rig.fn + 8
    assert (kp.registered, kp.resolved, kp.at) == (True, addr, addr)
    assert rig.at(addr) == BRK
    assert rig.km.text.patched() == {addr + i: b for i, b in enumerate(insn(ADDI, 5))}
    [patch] = rig.t.machine.journal.patches.values()
    assert (patch.virt, patch.old, patch.new) == (addr, insn(ADDI, 5), BRK)
    assert rig.t.cpu.breakpoints == [(ENTRY, 0, 1)]  # the trap hook
    slot = rig.km.points[addr].prep.slot_addr
    # The out-of-line copies: boosted (a jump back after it), and trap-stepped (a breakpoint after it).
    assert (
        rig.t.mem.read(slot, 24)
        == insn(ADDI, 5) + insn(JMPL) + (addr + 4).to_bytes(8, "little") + insn(ADDI, 5) + BRK_SS
    )
    assert list_probes(rig.km) == f"{addr:016x}  k  toy_fn+0x8\n"

    rig.km.unregister_kprobe(kp)
    assert rig.text_unchanged()
    assert (kp.registered, rig.km.points, rig.t.machine.journal.patches) == (False, {}, {})
    assert rig.t.scratch.used == 0  # the slot went back
    assert rig.t.cpu.breakpoints == []  # and the hook, with the last probe
    assert dict(rig.km.text.patched()) == {}


def test_a_function_entry_probe_goes_past_its_landing_pad(rig: Rig) -> None:
    kp = Kprobe("toy_fn")
    rig.km.register_kprobe(kp)
    assert kp.resolved == rig.fn + 4
    assert rig.at(rig.fn) == insn(BTI)


def test_several_probes_at_one_address_share_one_breakpoint_and_one_slot(rig: Rig) -> None:
    kps = [Kprobe("toy_fn", offset=4), Kprobe(addr=rig.fn + 4), Kprobe("toy_fn", offset=4)]
    for kp in kps:
        rig.km.register_kprobe(kp)
    assert list(rig.km.points) == [rig.fn + 4]
    assert rig.km.points[rig.fn + 4].probes == kps
    assert len(rig.t.machine.journal.patches) == 1
    assert len(rig.t.scratch.allocs) == 1
    rig.km.unregister_kprobe(kps[0])
    rig.km.unregister_kprobe(kps[2])
    assert rig.at(rig.fn + 4) == BRK  # one left: still armed
    rig.km.unregister_kprobe(kps[1])
    assert rig.text_unchanged()
    assert rig.t.scratch.used == 0


def test_registering_twice_and_unregistering_an_unregistered_probe_are_einval(rig: Rig) -> None:
    kp = Kprobe("toy_fn", offset=4)
    with pytest.raises(InvalidProbe, match="not registered"):
        rig.km.unregister_kprobe(kp)
    rig.km.register_kprobe(kp)
    with pytest.raises(InvalidProbe, match="already registered"):
        rig.km.register_kprobe(kp)
    assert len(rig.km.points[kp.resolved].probes) == 1


def test_a_killed_probe_puts_the_text_back_and_stays_listed_gone_until_unregistered_or_registered(rig: Rig) -> None:
    kp, other = Kprobe("toy_fn", offset=4), Kprobe("toy_fn", offset=8)
    addr = rig.fn + 4
    original = rig.at(addr)
    rig.km.register_kprobes([kp, other])
    kp.nhit = 3
    rig.km.kill_kprobe(kp)  # kill_kprobe: the text under it is about to be freed
    assert rig.at(addr) == original and addr not in rig.km.text.patched()
    assert (kp.gone, kp.registered, kp.nhit) == (True, False, 3)
    assert list_probes(rig.km) == f"{other.resolved:016x}  k  toy_fn+0x8\n{addr:016x}  k  toy_fn+0x4    [GONE]\n"
    rig.km.unregister_kprobe(kp)  # no EINVAL: the kernel's unregister_kprobe takes a gone one out of its table
    assert list_probes(rig.km) == f"{other.resolved:016x}  k  toy_fn+0x8\n"
    with pytest.raises(InvalidProbe, match="not registered"):
        rig.km.unregister_kprobe(kp)

    rig.km.kill_kprobe(other)
    other.flags &= ~KPROBE_FLAG_GONE
    rig.km.register_kprobe(other)  # the text is back (a module loaded again): armed, listed once
    assert list_probes(rig.km) == f"{other.resolved:016x}  k  toy_fn+0x8\n"
    rig.km.unregister_kprobe(other)
    assert rig.text_unchanged()


def test_a_killed_probe_registered_again_stays_listed_gone_if_that_fails(rig: Rig) -> None:
    kp = Kprobe("toy_fn", offset=4)
    rig.km.register_kprobe(kp)
    rig.km.kill_kprobe(kp)
    gone = list_probes(rig.km)
    with pytest.raises(InvalidProbe), rig.km.reviving(kp):
        assert not kp.gone and list_probes(rig.km) == ""  # off the list while it is registered again
        raise InvalidProbe("refused")
    assert kp.gone and list_probes(rig.km) == gone
    with rig.km.reviving(kp):
        rig.km.register_kprobe(kp)
    assert not kp.gone and list_probes(rig.km) == f"{kp.resolved:016x}  k  toy_fn+0x4\n"
    rig.km.unregister_kprobe(kp)
    assert rig.text_unchanged()


@pytest.mark.parametrize(
    ("probe", "error", "words"),
    [
        (lambda r: Kprobe("no_such_fn"), SymbolError, "unknown symbol 'no_such_fn'"),
        (lambda r: Kprobe(addr=ENTRY + 4), Blacklisted, "blacklisted (.entry.text)"),
        (lambda r: Kprobe(addr=0xFFFF_9000_0000_0000), NotKernelText, "not in kernel text"),
        (lambda r: Kprobe("toy_fn", offset=6), InvalidProbe, "instruction boundary"),
        (lambda r: Kprobe("toy_bad"), InvalidProbe, "cannot probe instruction 00000000"),
    ],
)
def test_a_refused_probe_writes_nothing_and_keeps_no_slot(rig: Rig, probe, error, words) -> None:  # type: ignore[no-untyped-def]
    kp = probe(rig)
    with pytest.raises(error) as info:
        rig.km.register_kprobe(kp)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert rig.text_unchanged()
    assert (kp.registered, rig.km.points, rig.t.scratch.used) == (False, {}, 0)
    assert rig.t.machine.journal.patches == {}


def test_register_kprobes_is_all_or_nothing(rig: Rig) -> None:
    good = [Kprobe("toy_fn", offset=4), Kprobe("toy_other")]
    with pytest.raises(InvalidProbe, match="cannot probe"):
        rig.km.register_kprobes([*good, Kprobe("toy_bad")])
    assert rig.text_unchanged()
    assert [kp.registered for kp in good] == [False, False]
    assert (rig.km.points, rig.t.scratch.used) == ({}, 0)
    rig.km.register_kprobes(good)
    assert sorted(rig.km.points) == [rig.fn + 4, rig.other]
    assert rig.t.machine.journal.batches == 2


# -- enable and disable --------------------------------------------------------------------------


def test_disabling_every_probe_of_a_point_disarms_it_and_enabling_one_arms_it(rig: Rig) -> None:
    one, two = Kprobe("toy_fn", offset=4), Kprobe("toy_fn", offset=4, disabled=True)
    rig.km.register_kprobe(one)
    rig.km.register_kprobe(two)
    addr = rig.fn + 4
    assert rig.at(addr) == BRK
    rig.km.disable_kprobe(one)
    assert rig.at(addr) == insn(NOP)
    assert rig.km.points[addr].probes == [one, two]  # still registered
    assert list_probes(rig.km).count("[DISABLED]") == 2
    rig.km.enable_kprobe(two)
    assert rig.at(addr) == BRK
    rig.run(A, addr)
    assert (one.nhit, two.nhit) == (0, 1)  # a disabled probe's handler does not run at its point's hit


def test_kprobes_enabled_off_disarms_everything_and_keeps_each_probes_state(rig: Rig) -> None:
    on, off = Kprobe("toy_fn", offset=4), Kprobe("toy_other", disabled=True)
    rig.km.register_kprobes([on, off])
    rig.km.set_enabled(False)
    assert rig.text_unchanged()
    assert list_probes(rig.km).count("[DISABLED]") == 2
    rig.km.set_enabled(True)
    assert (rig.at(rig.fn + 4), rig.at(rig.other)) == (BRK, insn(ADDI, 7))
    assert (on.disabled, off.disabled) == (False, True)


# -- hits ----------------------------------------------------------------------------------------


def test_an_emulated_hit_runs_every_pre_handler_once_with_the_regs_before_the_instruction(rig: Rig) -> None:
    seen: list[tuple[int, int, int]] = []
    kps = [Kprobe("toy_fn", offset=4, pre_handler=lambda kp, regs: seen.append((regs.ip, regs.sp, regs.r0)))
           for _ in range(2)]  # fmt: skip
    for kp in kps:
        rig.km.register_kprobe(kp)
    sp = STACK + 0x800
    rig.run(A, rig.fn + 4, sp=sp, r0=3)
    assert seen == [(rig.fn + 4, sp, 3)] * 2
    assert [kp.nhit for kp in kps] == [1, 1]
    assert rig.t.regs(A)["pc"] == rig.fn + 8  # the NOP was emulated: the vCPU goes on after it
    assert rig.t.cpu.steps == []
    assert rig.km.dispatcher.ntraps == 1


def test_a_trap_stepped_hit_runs_the_copy_out_of_line_then_the_post_handler(rig: Rig) -> None:
    post: list[tuple[int, int, int]] = []
    kp = Kprobe("toy_fn", offset=8, post_handler=lambda kp, regs: post.append((regs.ip, regs.r0, regs.flags)))
    rig.km.register_kprobe(kp)
    addr = rig.fn + 8
    rig.run(A, addr, r0=10)
    point = rig.km.points[addr]
    regs = rig.t.regs(A)
    assert regs["pc"] == point.prep.slot_addr + STEP_COPY and not regs["psr"] & IRQ  # the copy, interrupts off
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.HIT_SS
    assert rig.km.dispatcher.trap_step_returns() == {A: addr + 4}
    rig.step(A)  # the copy: r0 += 5
    assert post == []
    rig.step(A)  # the BRK after it: the second trap
    assert post == [(addr + 4, 15, IRQ)]
    assert (regs["pc"], regs["r0"], regs["psr"] & IRQ) == (addr + 4, 15, IRQ)
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE
    assert (kp.nhit, point.trap_stepped, point.boosted) == (1, 1, 0)


def test_a_boostable_hit_without_post_handler_is_boosted(rig: Rig) -> None:
    kp = Kprobe("toy_other")
    rig.km.register_kprobe(kp)
    rig.run(A, rig.other)
    point = rig.km.points[rig.other]
    assert rig.t.regs(A)["pc"] == point.prep.slot_addr
    assert point.boosted == 1
    rig.step(A)
    rig.step(A)  # the copy and its jump back
    assert (rig.t.regs(A)["pc"], rig.t.regs(A)["r0"]) == (rig.other + 4, 7)
    assert set(rig.km.slots.resume_targets) == {rig.other + 4}  # where the copy jumps back to
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE


def test_a_host_single_stepped_hit_resumes_after_the_original_instruction(rig: Rig) -> None:
    post: list[tuple[int, int]] = []
    kp = Kprobe("toy_fn", offset=12, post_handler=lambda kp, regs: post.append((regs.ip, regs.r1)))
    rig.km.register_kprobe(kp)
    sp = STACK + STACK_SIZE - 0x40
    rig.t.mem.write(sp, (0x1234).to_bytes(8, "little"))
    rig.run(A, rig.fn + 12, sp=sp)
    slot = rig.km.points[rig.fn + 12].prep.slot_addr + STEP_COPY
    assert rig.t.cpu.steps == [(A, slot)]
    assert post == [(rig.fn + 16, 0x1234)]
    assert (rig.t.regs(A)["pc"], rig.t.regs(A)["r1"]) == (rig.fn + 16, 0x1234)


def test_without_the_trap_step_facet_the_host_single_steps_the_copy(rig: Rig) -> None:
    rig.km.arch.trap_step = None  # an architecture that has no trap-step
    post: list[tuple[int, int]] = []
    kp = Kprobe("toy_fn", offset=8, post_handler=lambda kp, regs: post.append((regs.ip, regs.r0)))
    rig.km.register_kprobe(kp)
    addr = rig.fn + 8
    rig.run(A, addr, r0=10)
    point = rig.km.points[addr]
    assert rig.t.cpu.steps == [(A, point.prep.slot_addr + STEP_COPY)]  # stepped at once, through the gdbstub
    assert post == [(addr + 4, 15)]
    assert (rig.t.regs(A)["pc"], rig.t.regs(A)["psr"] & IRQ) == (addr + 4, IRQ)
    assert (kp.nhit, point.trap_stepped) == (1, 0)
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE


class _Ram:
    """Shared RAM the optimizer may write (it is given, but never used, in these tests)."""

    writable = True


def _with_shared_ram(t: ToyTarget, arch: Toy) -> KprobeManager:
    """A KprobeManager given shared RAM and a doorbell, as on qprobe's own QEMU."""
    regs = RegsMaker(t.machine, t.kernel, arch)  # type: ignore[arg-type]
    table = ProbeTable()
    return KprobeManager(t.machine, t.kernel, t.scratch, arch, table, regs, ram=_Ram(), doorbell="sock")  # type: ignore[arg-type]


def test_without_jump_optimization_every_probe_stays_a_breakpoint_and_says_why() -> None:
    t, arch = ToyTarget(), Toy()
    t.function("toy_fn", insn(NOP), insn(NOP))
    km = _with_shared_ram(t, arch)
    assert km.optimizer.available  # the toy has the guest-RAM layouts: its kretprobes may return through the mailbox
    kp = Kprobe("toy_fn")
    km.register_kprobe(kp, optimize=False)
    point = km.points[kp.resolved]
    assert km.optimizer.why_not(point) == "toy has no jump optimization"
    assert t.mem.read(point.addr, 4) == BRK


def test_without_guest_ram_layouts_the_optimizer_is_unavailable_and_builds_nothing() -> None:
    t, arch = ToyTarget(), Toy()
    arch.guest_ram = None  # type: ignore[assignment]
    km = _with_shared_ram(t, arch)
    opt = km.optimizer
    assert not opt.available and (opt.doorbell, opt.records, opt.returns, opt.counts) == (None, None, None, None)


def test_a_pre_handler_that_moves_ip_and_returns_nonzero_skips_the_instruction(rig: Rig) -> None:
    def skip(kp: Kprobe, regs) -> int:  # type: ignore[no-untyped-def]
        regs.ip = rig.fn + 16
        regs.r2 = 99
        return 1

    rig.km.register_kprobe(Kprobe("toy_fn", offset=8, pre_handler=skip))
    rig.run(A, rig.fn + 8, r0=1)
    regs = rig.t.regs(A)
    assert (regs["pc"], regs["r0"], regs["r2"]) == (rig.fn + 16, 1, 99)  # ADDI never ran
    assert rig.t.cpu.steps == []


def test_a_hit_while_the_vcpu_handles_a_probe_is_missed_and_its_instruction_still_runs(rig: Rig) -> None:
    outer = Kprobe("toy_fn", offset=8, post_handler=lambda kp, regs: None)
    calls: list[str] = []
    inner = Kprobe("toy_load", pre_handler=lambda kp, regs: calls.append(regs.tid),
                   post_handler=lambda kp, regs: calls.append("post"))  # fmt: skip
    rig.km.register_kprobes([outer, inner])
    sp = STACK + 0x800
    rig.t.mem.write(sp, (0xABC).to_bytes(8, "little"))
    rig.run(A, rig.fn + 8, r0=0, sp=sp)  # A is now trap-stepping outer's copy
    resume = rig.t.regs(A)["pc"]
    # Say an interrupt on A runs toy_load before the copy: its hit is a re-entry.
    rig.run(A, rig.load, r1=0)
    assert (inner.nhit, inner.nmissed, calls) == (0, 1, [])
    # Its own copy, stepped by the host: not run to a breakpoint, which the outer hit's trap-step would take as its own.
    assert rig.t.cpu.steps == [(A, rig.km.points[rig.load].prep.slot_addr + STEP_COPY)]
    assert (rig.t.regs(A)["pc"], rig.t.regs(A)["r1"]) == (rig.load + 4, 0xABC)  # and it ran
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.HIT_SS  # the outer hit still owns A
    # The other vCPU is not re-entered: its hit counts.
    rig.run(B, rig.load, sp=sp)
    assert (inner.nhit, inner.nmissed, calls) == (1, 1, [B, "post"])
    # Back from the interrupt, A finishes the outer hit.
    rig.t.regs(A)["pc"] = resume
    rig.step(A)
    rig.step(A)
    assert (rig.t.regs(A)["pc"], rig.t.regs(A)["r0"]) == (rig.fn + 12, 5)
    assert (outer.nhit, outer.nmissed) == (1, 0)
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE


def test_a_stepped_copy_that_faults_is_seen_by_the_guest_at_the_probe_address(rig: Rig) -> None:
    # kprobe_fault_handler: the exception's return address goes from the slot back to the probe, here (as
    # on arm64) in a register, so the kernel's fixups and oops reports see the real text.
    faults: list[str] = []
    kp = Kprobe("toy_load", fault_handler=lambda kp, regs, exc: faults.append(str(exc)))
    rig.km.register_kprobe(kp)
    rig.run(A, rig.load, sp=0xFFFF_9000_0000_0000)  # the LDR reads [sp], which is not mapped
    regs = rig.t.regs(A)
    assert rig.t.cpu.steps == [(A, rig.km.points[rig.load].prep.slot_addr + STEP_COPY)]
    assert (regs["pc"], regs["elr"]) == (ENTRY, rig.load)
    assert (kp.nhit, kp.nfaults, len(faults)) == (1, 1, 1) and "faulted" in faults[0]


def test_a_failing_pre_handler_is_counted_and_the_hit_goes_on(rig: Rig) -> None:
    faults: list[str] = []

    def boom(kp: Kprobe, regs) -> None:  # type: ignore[no-untyped-def]
        raise ValueError("bad handler")

    kp = Kprobe("toy_fn", offset=4, pre_handler=boom,
                fault_handler=lambda kp, regs, exc: faults.append(str(exc)))  # fmt: skip
    rig.km.register_kprobe(kp)
    rig.run(A, rig.fn + 4)
    rig.run(B, rig.fn + 4)
    assert (kp.nhit, kp.nfaults, faults) == (2, 2, ["bad handler"] * 2)
    assert kp.errors == ["pre_handler of toy_fn+0x4 raised ValueError: bad handler"] * 2
    assert rig.km.handlers.errors.count == 2
    assert rig.t.regs(A)["pc"] == rig.t.regs(B)["pc"] == rig.fn + 8


def test_a_trap_on_a_breakpoint_removed_meanwhile_reruns_the_original_instruction(rig: Rig) -> None:
    kp = Kprobe("toy_fn", offset=8, pre_handler=lambda kp, regs: pytest.fail("handler of a removed probe"))
    other = Kprobe("toy_other")  # keeps the hook installed
    rig.km.register_kprobes([kp, other])
    rig.t.regs(A).update(pc=rig.fn + 8, psr=IRQ, r0=0)
    rig.t.cpu.execute(A)  # A executes the BRK...
    rig.km.unregister_kprobe(kp)  # ...and the probe goes before the stop is dispatched
    rig.km.dispatcher.on_entry_stop(A, dict(rig.t.regs(A)))
    assert rig.t.regs(A)["pc"] == rig.fn + 8  # backed up: the ADDI runs as if never probed
    rig.step(A)
    assert rig.t.regs(A)["r0"] == 5
    assert kp.nhit == 0


def test_somebody_elses_breakpoint_passes_through(rig: Rig) -> None:
    rig.km.register_kprobe(Kprobe("toy_fn", offset=4))
    rig.t.mem.write(rig.fn + 16, BRK)  # the guest's own
    rig.run(A, rig.fn + 16)
    assert rig.km.dispatcher.passed_through == 1
    assert rig.km.dispatcher.ntraps == 0
    assert rig.t.cpu.steps == [(A, ENTRY)]  # stepped off the hook's breakpoint into the guest's handler


def test_a_full_scratch_area_refuses_the_probe_in_one_line_and_writes_nothing(rig: Rig) -> None:
    rig.t.scratch.map()
    rig.t.scratch.alloc(rig.t.scratch.mapped_size)
    kp = Kprobe("toy_fn", offset=4)
    with pytest.raises(ProbeError, match="scratch area is full"):
        rig.km.register_kprobe(kp)
    assert rig.text_unchanged()
    assert (kp.registered, rig.km.points, rig.t.machine.journal.patches) == (False, {}, {})


def test_remove_all_unregisters_everything_and_unmaps_the_scratch_area(rig: Rig) -> None:
    kps = [Kprobe("toy_fn", offset=4), Kprobe("toy_fn", offset=8), Kprobe("toy_other")]
    rig.km.register_kprobes(kps)
    rig.run(A, rig.other)  # boosted: its slot is quarantined, not freed, until the area goes
    rig.t.regs(A)["pc"] = rig.other + 4  # the copy ran and jumped back
    rig.km.remove_all(grace=0)
    assert rig.text_unchanged()
    assert [kp.registered for kp in kps] == [False] * 3
    assert (rig.t.scratch.mapped, rig.t.cpu.breakpoints, rig.km.slots.resume_targets) == (False, [], {})


def test_unregistering_while_a_vcpu_is_inside_the_copy_lets_it_finish_and_keeps_the_slot(rig: Rig) -> None:
    post: list[int] = []
    kp = Kprobe("toy_fn", offset=8, post_handler=lambda kp, regs: post.append(regs.ip))
    keep = Kprobe("toy_other")  # keeps the hook installed
    rig.km.register_kprobes([kp, keep])
    rig.run(A, rig.fn + 8, r0=0)  # A trap-steps the copy
    slot = rig.km.points[rig.fn + 8].prep.slot_addr
    rig.km.unregister_kprobe(kp)
    assert slot in rig.t.scratch.allocs  # not freed: A still runs there
    again = Kprobe("toy_fn", offset=4)
    rig.km.register_kprobe(again)
    assert rig.km.points[rig.fn + 4].prep.slot_addr != slot  # so not reused
    rig.step(A)
    rig.step(A)  # the copy's breakpoint: the hit is finished, its probe gone
    assert (rig.t.regs(A)["pc"], rig.t.regs(A)["r0"]) == (rig.fn + 12, 5)
    assert post == []  # unregistered since the first trap: no post_handler (the kernel's kprobe_post_process)
    assert rig.km.dispatcher.ctlblk[A].status is KprobeStatus.IDLE


def test_a_probe_given_twice_to_register_kprobes_is_einval_and_nothing_is_registered(rig: Rig) -> None:
    kp, other = Kprobe("toy_fn", offset=4), Kprobe("toy_other")
    with pytest.raises(InvalidProbe, match="already registered"):
        rig.km.register_kprobes([other, kp, kp])
    assert (kp.registered, other.registered, rig.km.points) == (False, False, {})
    assert rig.text_unchanged()


def test_a_probe_given_twice_to_unregister_kprobes_is_unregistered_once(rig: Rig) -> None:
    kp, other = Kprobe("toy_fn", offset=4), Kprobe("toy_other")
    rig.km.register_kprobes([kp, other])
    rig.km.unregister_kprobes([kp, other, kp])
    assert (kp.registered, other.registered, rig.km.points) == (False, False, {})
    assert rig.text_unchanged()


def test_optimization_off_keeps_every_probe_on_its_breakpoint_and_says_why() -> None:
    t, arch = ToyTarget(), Toy()
    t.function("toy_fn", insn(NOP), insn(NOP))
    km = _with_shared_ram(t, arch)
    kp = Kprobe("toy_fn")
    km.register_kprobe(kp, optimize=False)
    km.set_optimization(False)
    point = km.points[kp.resolved]
    assert not km.optimizer.enabled and km.optimizer.why_not(point) == "optimization is off"
    assert point.armed and t.mem.read(point.addr, 4) == BRK
    km.set_optimization(True)
    assert km.optimizer.enabled and km.optimizer.why_not(point) == "toy has no jump optimization"


def test_optimization_asked_of_an_architecture_without_guest_ram_layouts_says_so_in_one_line() -> None:
    t, arch = ToyTarget(), Toy()
    arch.guest_ram = None  # arm64's case: no detours, rings or mailbox
    t.function("toy_fn", insn(NOP), insn(NOP))
    km = _with_shared_ram(t, arch)
    with pytest.raises(TargetError, match=r"^toy has no jump optimization nor detours in guest RAM: every hit stops "
                       r"the VM$"):  # fmt: skip
        km.set_optimization(True)
    assert not km.optimizer.enabled


def test_optimization_cannot_be_turned_on_without_shared_ram_and_a_doorbell(rig: Rig) -> None:
    assert not rig.km.optimizer.available
    with pytest.raises(TargetError, match="doorbell device and shared RAM"):
        rig.km.set_optimization(True)
    assert not rig.km.optimizer.enabled

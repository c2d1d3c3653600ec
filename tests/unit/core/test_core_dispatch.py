"""The trap path (qprobe.core.dispatch) against the scripted QEMU 7.2 gdbstub of tests/unit/vmm.

A vCPU is put on the #BP entry with a hardware exception frame on its stack,
as the guest's int3 leaves it; the dispatcher is handed the stop and every
register it writes back (``P`` packets) and every step (``vCont;s``) is
read from the stub.  The instructions are decoded and prepared by the real
x86_64 arch; only the probe table and guest memory are small fakes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
from core_fakes import ARCH, FlatMem, flat_regs
from vmm_fakes import QemuStub, g_offsets

from qprobe.arch import BreakHook
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER
from qprobe.core.dispatch import Dispatcher
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe
from qprobe.core.point import KprobeStatus, ProbePoint
from qprobe.core.regs import PtRegs
from qprobe.core.slots import Trampoline
from qprobe.vmm.gdbremote import GdbRemote

ENTRY = 0xFFFF_FFFF_81C0_0BA0  # asm_exc_int3
PROBE = 0xFFFF_FFFF_8120_0000
SLOT = 0xFFFF_FFFF_A000_0000
STACK = 0xFFFF_C900_0000_3F00  # the kernel stack: the hardware frame at rsp
CONTEXT_SP = 0xFFFF_C900_0000_3FA0  # the trapped context's rsp
FLAGS = 0x246 | 0x100 | 0x10000  # IF ZF PF, and TF RF (the step must clear both)


class FakeSymbols:
    def __contains__(self, name: str) -> bool:
        return name == "asm_exc_int3"

    def address(self, name: str) -> int:
        assert name == "asm_exc_int3"
        return ENTRY


@dataclass
class FakeKernel:
    symbols: FakeSymbols = field(default_factory=FakeSymbols)


class FakeMachine:
    def __init__(self, gdb: GdbRemote, mem: FlatMem) -> None:
        self.gdb, self.mem = gdb, mem
        self.vcpus = gdb.threads()
        self.stop_handlers: dict[int, object] = {}
        self.watch_handlers: dict[int, object] = {}
        self.after_stop = None

    def write_phys(self, phys: int, data: bytes) -> None:
        self.mem.fill(phys, data)


class Table:
    """The probe table as the dispatcher reads it (qprobe.core.table.ProbeTable), its InsnSlots and RegsSource."""

    def __init__(self, machine: FakeMachine, boost: bool) -> None:
        self.machine = machine
        self.points: dict[int, ProbePoint] = {}
        self.touched: set[int] = set()
        self.trampolines: dict[int, Trampoline] = {}
        self.resume_targets: dict[int, float] = {}
        self.boost = boost

    def make_regs(self, values: Mapping[str, int], tid: str) -> PtRegs:
        return flat_regs(values, tid, self.machine.mem)

    def probe(self, code: bytes, *probes: Kprobe, fixup: bool = False) -> ProbePoint:
        """A point at PROBE on ``code`` (``fixup``: with an exception-table entry)."""
        table = {PROBE} if fixup else None
        prep = ARCH.arch_prepare_kprobe(code.ljust(16, b"\x90"), PROBE, SLOT, "f+0x10", table)
        point = ProbePoint(PROBE, "f+0x10", prep, list(probes), int3=object())  # type: ignore[arg-type]
        for kp in probes:
            kp.registered = True
        self.points[PROBE] = point
        self.touched.add(PROBE)
        return point


@dataclass
class Rig:
    stub: QemuStub
    gdb: GdbRemote
    mem: FlatMem
    table: Table
    dispatcher: Dispatcher
    handlers: Handlers

    def reg(self, name: str, cpu: int = 0) -> int:
        off = g_offsets()[name]
        size = 4 if name == "eflags" else 8
        return int.from_bytes(self.stub.vcpus[cpu].regs[off : off + size], "little")

    def trap(self, addr: int = PROBE, cs: int = 0x10, rax: int = 7, flags: int = FLAGS,
             sp: int = CONTEXT_SP) -> dict[str, int]:  # fmt: skip
        """vCPU 0 stopped on the #BP entry after the int3 at ``addr``; its registers as the stop shows them."""
        self.mem.fill(STACK, struct.pack("<5Q", addr + 1, cs, flags, sp, 0x18))
        for name, value in (("rip", ENTRY), ("rsp", STACK), ("rax", rax), ("eflags", 0x86)):
            self.stub.vcpus[0].set(name, value)
        self.stub.requests.clear()
        return self.gdb.read_registers(self.dispatcher.machine.vcpus[0])

    def writes(self) -> list[bytes]:
        """Every register write the stub received (``P`` one register, ``G`` several)."""
        return self.stub.sent(b"P") + self.stub.sent(b"G")


@pytest.fixture(params=[False, True], ids=["trap-step", "boost"])
def rig(request: pytest.FixtureRequest, stub_gdb: tuple[QemuStub, GdbRemote]) -> Rig:
    stub, gdb = stub_gdb
    mem = FlatMem()
    machine = FakeMachine(gdb, mem)
    table = Table(machine, boost=request.param)
    handlers = Handlers()
    dispatcher = Dispatcher(machine, FakeKernel(), ARCH, table, table, handlers, table)  # type: ignore[arg-type]
    dispatcher.boost = table.boost
    return Rig(stub, gdb, mem, table, dispatcher, handlers)


def test_a_hit_runs_the_pre_handler_on_the_state_before_the_int3(rig: Rig) -> None:
    seen: list[tuple[int, int, int, int]] = []
    kp = Kprobe(addr=PROBE, pre_handler=lambda kp, regs: seen.append((regs.ip, regs.sp, regs.flags, regs.ax)))
    point = rig.table.probe(b"\x55", kp)  # push rbp: boostable
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert seen == [(PROBE, CONTEXT_SP, FLAGS, 7)]
    assert kp.nhit == 1 and rig.dispatcher.ntraps == 1
    if rig.table.boost:
        # One write of the resume: into the slot, the jump back is the copy's own.
        assert rig.reg("rip") == SLOT and rig.reg("rsp") == CONTEXT_SP and rig.reg("eflags") == FLAGS
        assert point.boosted == 1 and not rig.stub.sent(b"vCont;s")
        assert PROBE + 1 in rig.table.resume_targets
        assert rig.dispatcher.ctlblk[rig.dispatcher.machine.vcpus[0]].status is KprobeStatus.IDLE
    else:
        # Into the int3-terminated copy for a context with interrupts on, with IF, TF and RF clear: no step.
        assert rig.reg("rip") == SLOT + 48 and rig.reg("rsp") == CONTEXT_SP
        assert rig.reg("eflags") == FLAGS & ~(0x100 | 0x10000 | 0x200)
        assert point.boosted == 0 and point.trap_stepped == 1 and not rig.stub.sent(b"vCont;s")
        assert rig.dispatcher.ctlblk[rig.dispatcher.machine.vcpus[0]].status is KprobeStatus.HIT_SS


IF, TF, RF = 0x200, 0x100, 0x10000


def test_a_post_handler_sees_the_state_the_copy_left_at_the_second_trap(rig: Rig) -> None:
    after: list[tuple[int, int, int, int]] = []
    kp = Kprobe(addr=PROBE, post_handler=lambda kp, regs: after.append((regs.ip, regs.sp, regs.flags, regs.ax)))
    rig.table.probe(b"\x55", kp)  # push rbp
    tid = rig.dispatcher.machine.vcpus[0]
    rig.dispatcher.on_entry_stop(tid, rig.trap())
    assert rig.reg("rip") == SLOT + 48 and not after and not rig.stub.sent(b"vCont;s")
    assert rig.dispatcher.trap_step_returns() == {tid: PROBE + 1}  # what the optimizer waits for
    # The copy ran (sp moved, rax as it left it, IF still off) and its int3 trapped.
    rig.dispatcher.on_entry_stop(tid, rig.trap(SLOT + 48 + 1, rax=9, flags=0x46, sp=CONTEXT_SP - 8))
    assert after == [(PROBE + 1, CONTEXT_SP - 8, 0x46 | IF, 9)]
    assert rig.reg("rip") == PROBE + 1 and rig.reg("rsp") == CONTEXT_SP - 8 and rig.reg("eflags") == 0x46 | IF
    assert rig.dispatcher.ctlblk[tid].status is KprobeStatus.IDLE and rig.dispatcher.trap_step_returns() == {}
    assert kp.nhit == 1 and rig.dispatcher.ntraps == 2 and rig.dispatcher.passed_through == 0


def test_a_context_with_interrupts_off_keeps_them_off(rig: Rig) -> None:
    rig.table.probe(b"\x55", Kprobe(addr=PROBE, post_handler=lambda kp, regs: None))
    tid = rig.dispatcher.machine.vcpus[0]
    rig.dispatcher.on_entry_stop(tid, rig.trap(flags=0x46))
    assert rig.reg("rip") == SLOT + 32 and rig.reg("eflags") == 0x46
    rig.dispatcher.on_entry_stop(tid, rig.trap(SLOT + 32 + 1, flags=0x46))
    assert rig.reg("rip") == PROBE + 1 and rig.reg("eflags") == 0x46


def test_a_copy_with_an_exception_table_entry_is_stepped_by_the_host(rig: Rig) -> None:
    after: list[int] = []
    kp = Kprobe(addr=PROBE, post_handler=lambda kp, regs: after.append(regs.ip))
    point = rig.table.probe(b"\x55", kp, fixup=True)
    assert point.prep.step_reason is not None and "exception-table" in point.prep.step_reason
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    # Stepped in the slot with TF and RF clear (the fake's step moves rip by one), then back in the text.
    assert len(rig.stub.sent(b"vCont;s")) == 1 and after == [PROBE + 1]
    assert rig.reg("rip") == PROBE + 1 and rig.reg("rsp") == CONTEXT_SP and rig.reg("eflags") == FLAGS & ~(TF | RF)
    assert rig.dispatcher.ctlblk[rig.dispatcher.machine.vcpus[0]].status is KprobeStatus.IDLE


@pytest.mark.parametrize(("code", "flags", "sp", "pushed"),
                         [(b"\x9c", FLAGS, CONTEXT_SP - 8, FLAGS), (b"\xfa", FLAGS & ~IF, CONTEXT_SP, None),
                          (b"\xfb", FLAGS | IF, CONTEXT_SP, None)],
                         ids=["pushfq", "cli", "sti"])  # fmt: skip
def test_an_if_modifier_is_emulated_where_it_is_not_boosted(rig: Rig, code: bytes, flags: int, sp: int,
                                                              pushed: int | None) -> None:  # fmt: skip
    after: list[tuple[int, int, int]] = []
    kp = Kprobe(addr=PROBE, post_handler=lambda kp, regs: after.append((regs.ip, regs.sp, regs.flags)))
    rig.table.probe(code, kp)
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert after == [(PROBE + 1, sp, flags)] and not rig.stub.sent(b"vCont;s")
    assert rig.reg("rip") == PROBE + 1 and rig.reg("rsp") == sp and rig.reg("eflags") == flags
    if pushed is not None:
        assert rig.mem.read_u64(sp) == pushed


def test_a_hit_inside_a_trap_step_is_missed_and_stepped_and_the_outer_one_still_finishes(rig: Rig) -> None:
    posts: list[int] = []
    kp = Kprobe(addr=PROBE, post_handler=lambda kp, regs: posts.append(regs.ip))
    rig.table.probe(b"\x55", kp)
    tid = rig.dispatcher.machine.vcpus[0]
    rig.dispatcher.on_entry_stop(tid, rig.trap())
    # An NMI inside the copy hits the same probe: counted missed, its instruction boosted or stepped by
    # the host (not trap-stepped: the slot's state is the outer hit's), no handler.
    rig.dispatcher.on_entry_stop(tid, rig.trap(sp=CONTEXT_SP - 0x800))
    assert kp.nmissed == 1 and kp.nhit == 1 and posts == []
    assert len(rig.stub.sent(b"vCont;s")) == (0 if rig.table.boost else 1)
    assert rig.dispatcher.ctlblk[tid].status is KprobeStatus.HIT_SS
    rig.dispatcher.on_entry_stop(tid, rig.trap(SLOT + 48 + 1))
    assert posts == [PROBE + 1] and rig.dispatcher.ctlblk[tid].status is KprobeStatus.IDLE


def test_drain_finishes_a_trap_step_the_vcpu_has_not_run_yet(rig: Rig) -> None:
    posts: list[int] = []
    kp = Kprobe(addr=PROBE, post_handler=lambda kp, regs: posts.append(regs.ip))
    rig.table.probe(b"\x55", kp)
    tid = rig.dispatcher.machine.vcpus[0]
    rig.dispatcher.on_entry_stop(tid, rig.trap())
    assert rig.reg("rip") == SLOT + 48
    rig.dispatcher.drain()  # the fake's step runs the one-byte copy up to its int3
    assert len(rig.stub.sent(b"vCont;s")) == 1 and posts == [PROBE + 1]
    assert rig.reg("rip") == PROBE + 1 and rig.reg("eflags") & IF
    assert rig.dispatcher.ctlblk[tid].status is KprobeStatus.IDLE


def test_an_emulated_jump_resumes_at_its_target_without_a_step(rig: Rig) -> None:
    order: list[str] = []
    kp = Kprobe(addr=PROBE, pre_handler=lambda kp, regs: order.append("pre"),
                post_handler=lambda kp, regs: order.append(f"post {regs.ip:#x}"))  # fmt: skip
    rig.table.probe(b"\xeb\x10", kp)  # jmp +0x10
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert order == ["pre", f"post {PROBE + 0x12:#x}"]
    assert rig.reg("rip") == PROBE + 0x12 and rig.reg("rsp") == CONTEXT_SP and rig.reg("eflags") == FLAGS
    assert not rig.stub.sent(b"vCont;s")


def test_a_pre_handler_that_moves_ip_skips_the_instruction(rig: Rig) -> None:
    def skip(kp: Kprobe, regs: PtRegs) -> int:
        regs.ip, regs.ax = PROBE + 0x40, 0xDEAD
        return 1

    rig.table.probe(b"\x55", Kprobe(addr=PROBE, pre_handler=skip))
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert rig.reg("rip") == PROBE + 0x40 and rig.reg("rax") == 0xDEAD and rig.reg("rsp") == CONTEXT_SP
    assert not rig.stub.sent(b"vCont;s")


def test_a_failing_handler_is_counted_reported_and_the_hit_still_resumes(rig: Rig) -> None:
    faults: list[str] = []

    def bad(kp: Kprobe, regs: PtRegs) -> None:
        raise RuntimeError("handler bug")

    kp = Kprobe(addr=PROBE, pre_handler=bad, fault_handler=lambda kp, regs, exc: faults.append(str(exc)))
    rig.table.probe(b"\x55", kp)
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert kp.nhit == 1 and kp.nfaults == 1 and faults == ["handler bug"]
    assert kp.errors == [f"pre_handler of {kp.where()} raised RuntimeError: handler bug"]
    assert rig.handlers.errors.lines == kp.errors
    assert rig.reg("rip") in (SLOT, SLOT + 48)


def test_a_disabled_probe_counts_nothing_and_its_instruction_still_runs(rig: Rig) -> None:
    kp = Kprobe(addr=PROBE, pre_handler=lambda kp, regs: pytest.fail("disabled"), disabled=True)
    rig.table.probe(b"\x55", kp)
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert kp.nhit == 0 and rig.reg("rip") in (SLOT, SLOT + 48)


def test_a_hit_while_the_vcpu_handles_a_probe_only_counts_nmissed(rig: Rig) -> None:
    kp = Kprobe(addr=PROBE, pre_handler=lambda kp, regs: pytest.fail("re-entered"))
    rig.table.probe(b"\x55", kp)
    tid = rig.dispatcher.machine.vcpus[0]
    rig.dispatcher.ctlblk[tid].status = KprobeStatus.HIT_ACTIVE
    rig.dispatcher.on_entry_stop(tid, rig.trap())
    assert kp.nmissed == 1 and kp.nhit == 0
    assert rig.dispatcher.ctlblk[tid].status is KprobeStatus.HIT_ACTIVE  # the outer hit still owns it


def test_an_int3_removed_after_it_trapped_backs_up_to_the_original_instruction(rig: Rig) -> None:
    rig.table.touched.add(PROBE)  # ours once, no longer armed: the text holds the original byte again
    rig.mem.fill(PROBE, b"\x55")
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    assert rig.reg("rip") == PROBE and rig.reg("rsp") == CONTEXT_SP and rig.reg("eflags") == FLAGS
    assert rig.dispatcher.passed_through == 0


def test_somebody_elses_int3_passes_through_to_the_guest(rig: Rig) -> None:
    rig.mem.fill(PROBE + 0x100, b"\xcc")
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap(PROBE + 0x100))
    assert rig.dispatcher.passed_through == 1 and rig.dispatcher.ntraps == 0
    assert not rig.writes() and len(rig.stub.sent(b"vCont;s")) == 1  # off the breakpoint on the entry


def test_every_stop_on_the_int3_entry_is_for_kprobe_int3_handler(rig: Rig) -> None:
    # exc_int3 is the #BP vector's alone (a fault enters at a vector of its own): x86 reads no syndrome, and
    # tells its probes' int3s from the one after a trap-stepped copy, and from others', by address.
    assert ARCH.traps.kprobe_break_hook(rig.trap()) is BreakHook.KPROBE
    assert ARCH.traps.kprobe_break_hook(rig.trap(PROBE + 0x100, cs=0x33)) is BreakHook.KPROBE


def test_a_user_mode_int3_is_never_ours(rig: Rig) -> None:
    rig.table.probe(b"\x55", Kprobe(addr=PROBE, pre_handler=lambda kp, regs: pytest.fail("user mode")))
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap(cs=0x33))
    assert rig.dispatcher.passed_through == 1 and not rig.writes()


def test_a_trampoline_resumes_where_its_handler_says(rig: Rig) -> None:
    tramp = SLOT + 0x800
    calls: list[tuple[int, int]] = []
    resumed: list[int] = []

    def returned(pt: PtRegs) -> tuple[int, Callable[[], None]]:
        calls.append((pt.ip, pt.sp))
        pt.ax = 0x1234  # a return probe may change the return value
        return PROBE + 0x99, lambda: resumed.append(rig.reg("rip"))

    rig.table.trampolines[tramp] = returned
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap(tramp))
    assert calls == [(tramp, CONTEXT_SP)] and resumed == [PROBE + 0x99]  # run once the registers are written
    assert rig.reg("rip") == PROBE + 0x99 and rig.reg("rax") == 0x1234 and rig.reg("rsp") == CONTEXT_SP


def test_each_resume_is_one_register_write(rig: Rig) -> None:
    rig.table.probe(b"\x55", Kprobe(addr=PROBE))
    rig.dispatcher.on_entry_stop(rig.dispatcher.machine.vcpus[0], rig.trap())
    # Into the slot (rsp, eflags, rip together), boosted or to the int3 after the copy.
    assert len(rig.writes()) == 1


def test_the_watchpoint_hook_gives_the_trapped_context_its_registers_back(rig: Rig) -> None:
    """Stopped inside poke_int3_handler with the trap's pt_regs at rdi: the resume restores every register."""
    safe, ptregs = ENTRY + 0x40, STACK - 0x200
    rig.dispatcher.watch_safe = frozenset({safe})
    seen: list[int] = []
    rig.table.probe(b"\x55", Kprobe(addr=PROBE, pre_handler=lambda kp, regs: seen.append(regs.bx)))
    values = dict.fromkeys(PT_REGS_ORDER, 0) | {"rbx": 0xB0B, "r12": 0xC12, "rip": PROBE + 1, "cs": 0x10,
                                                 "eflags": FLAGS, "rsp": CONTEXT_SP, "ss": 0x18}  # fmt: skip
    rig.mem.fill(ptregs, struct.pack(f"<{len(PT_REGS_ORDER)}Q", *(values[n] for n in PT_REGS_ORDER)))
    for name, value in (("rip", safe), ("rdi", ptregs), ("rbx", 1), ("r12", 2)):
        rig.stub.vcpus[0].set(name, value)
    rig.dispatcher.on_watch_stop(
        rig.dispatcher.machine.vcpus[0], rig.gdb.read_registers(rig.dispatcher.machine.vcpus[0])
    )
    assert seen == [0xB0B]
    assert rig.reg("rbx") == 0xB0B and rig.reg("r12") == 0xC12 and rig.reg("rsp") == CONTEXT_SP
    assert rig.reg("rip") in (SLOT, SLOT + 48)


def test_the_watchpoint_hook_ignores_other_reads_of_the_watched_word(rig: Rig) -> None:
    rig.dispatcher.watch_safe = frozenset({ENTRY + 0x40})
    rig.stub.vcpus[0].set("rip", ENTRY + 0x80)  # text_poke_bp's own read, elsewhere
    rig.stub.requests.clear()
    rig.dispatcher.on_watch_stop(
        rig.dispatcher.machine.vcpus[0], rig.gdb.read_registers(rig.dispatcher.machine.vcpus[0])
    )
    assert not rig.writes() and rig.dispatcher.ntraps == 0

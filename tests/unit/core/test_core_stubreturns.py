"""Return probes on stub breakpoints (qprobe.core.stubreturns) on the toy architecture.

The entry probe hands its registers over; the return address is read from the
stack and gets a stub breakpoint, nothing is written into the guest; a vCPU
reaching it fires the handler only for the call whose key and stack pointer
match; abandoned frames are dropped, instances bounded, breakpoints shared
per address and removed with their last instance.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakearch import ADDI, BTI, NOP, RET, STACK, STACK_PHYS, STACK_SIZE, TEXT_PHYS, TEXT_SIZE, Rig, insn

from qprobe.core.kprobe import Kprobe, Kretprobe, KretprobeInstance
from qprobe.core.kretprobe import KretprobeManager
from qprobe.core.listing import list_probes
from qprobe.core.stubreturns import StubReturn, StubReturnInstance, StubReturns
from qprobe.vmm.gdbremote import BREAK_HW

A, B = "p1.1", "p1.2"
TOP = STACK + STACK_SIZE - 0x100


class World:
    """A rig with a callee whose entry is a stub probe feeding StubReturns, and two call sites."""

    def __init__(self, maxactive: int = 4) -> None:
        self.rig = Rig()
        t = self.rig.t
        self.callee = t.function("toy_callee", insn(ADDI, 1), insn(NOP))
        self.caller = t.function("toy_caller", insn(NOP), insn(NOP), insn(NOP), insn(NOP))
        self.returns = StubReturns(self.rig.km.stubs, self.rig.km.arch)
        self.seen: list[tuple[int, int, int, Any]] = []  # (ret_addr, sp at the return, r0, data)
        self.rp = StubReturn(key=lambda regs: regs.r3, ret_handler=self._ret, maxactive=maxactive)
        self.returns.register(self.rp)
        self.entries: list[StubReturnInstance | None] = []
        self.entry = Kprobe(addr=self.callee, anywhere=True, pre_handler=self._entry)
        self.rig.km.register_kprobe(self.entry)
        self.text = bytes(t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE])

    def _entry(self, _kp: Kprobe, regs: Any) -> int:
        self.entries.append(self.returns.entered(self.rp, regs, data=len(self.entries)))
        return 0

    def _ret(self, inst: StubReturnInstance, regs: Any) -> None:
        self.seen.append((inst.ret_addr, regs.sp, regs.r0, inst.data))

    def stop(self, tid: str, pc: int, **regs: int) -> dict[str, int]:
        """The VM stopped with ``tid`` on ``pc`` (a stub breakpoint there): what the stop loop does."""
        cpu = self.rig.t.regs(tid)
        cpu.update(pc=pc, **regs)
        self.rig.t.machine.stop_handlers[pc](tid, dict(cpu))
        return self.rig.t.regs(tid)

    def call(self, tid: str, ret_addr: int, sp: int, task: int) -> None:
        """``tid`` calls the callee from ``ret_addr - 4`` with stack pointer ``sp``: the return address in ``lr``."""
        self.stop(tid, self.callee, sp=sp, r3=task, lr=ret_addr)

    def ret(self, tid: str, ret_addr: int, sp: int, task: int, r0: int) -> dict[str, int]:
        """``tid`` returned to ``ret_addr`` with ``sp`` (a stub breakpoint there)."""
        return self.stop(tid, ret_addr, sp=sp, r3=task, r0=r0)

    def breakpoints(self) -> set[int]:
        return {addr for addr, kind, _ in self.rig.t.cpu.breakpoints if kind == BREAK_HW} - {self.callee}

    def text_unchanged(self) -> bool:
        return bytes(self.rig.t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE]) == self.text


@pytest.fixture
def w() -> World:
    return World()


def test_a_return_is_caught_at_its_return_address_with_nothing_written(w: World) -> None:
    site = w.caller + 4
    stack = bytes(w.rig.t.mem.ram[STACK_PHYS : STACK_PHYS + STACK_SIZE])
    w.call(A, site, TOP, task=7)
    assert w.breakpoints() == {site} and w.text_unchanged()
    # The stack and the link register are as the call left them: the real return address, no trampoline's.
    assert w.rig.t.regs(A)["lr"] == site
    assert bytes(w.rig.t.mem.ram[STACK_PHYS : STACK_PHYS + STACK_SIZE]) == stack
    assert "return site" not in list_probes(w.rig.km)  # an internal probe, in no listing
    after = w.ret(A, site, TOP, task=7, r0=42)
    assert w.seen == [(site, TOP, 42, 0)] and w.rp.nreturns == 1 and w.rp.live == []
    assert after["pc"] == site + 4  # the instruction at the return address ran in place
    assert w.breakpoints() == set() and site not in w.rig.t.machine.stop_handlers and w.text_unchanged()


def test_only_the_call_with_the_same_key_and_stack_pointer_fires(w: World) -> None:
    site = w.caller + 4
    w.call(A, site, TOP, task=7)
    w.ret(B, site, TOP, task=8, r0=1)  # another task passing the same instruction
    w.ret(A, site, TOP - 0x40, task=7, r0=2)  # the same task there with another frame
    assert w.seen == [] and len(w.rp.live) == 1 and w.breakpoints() == {site}
    w.ret(A, site, TOP, task=7, r0=3)
    assert w.seen == [(site, TOP, 3, 0)]


def test_recursive_calls_returning_to_one_address_match_by_stack_pointer(w: World) -> None:
    site = w.callee + 4  # the callee calls itself: both calls return into it
    w.call(A, site, TOP, task=7)
    w.call(A, site, TOP - 0x20, task=7)
    assert w.breakpoints() == {site} and len(w.returns.sites[site].instances) == 2  # one breakpoint, two users
    w.ret(A, site, TOP - 0x20, task=7, r0=1)  # the inner one
    assert w.seen == [(site, TOP - 0x20, 1, 1)] and w.breakpoints() == {site}
    w.ret(A, site, TOP, task=7, r0=2)
    assert w.seen[-1] == (site, TOP, 2, 0) and w.breakpoints() == set()


def test_a_return_drops_the_same_key_s_abandoned_deeper_frames_only(w: World) -> None:
    outer, inner, other = w.caller + 4, w.caller + 8, w.caller + 12
    w.call(A, outer, TOP, task=7)
    w.call(B, other, TOP - 0x200, task=8)  # another task's call, deeper in its own stack
    w.call(A, inner, TOP - 0x40, task=7)  # never returns: unwound past
    assert w.breakpoints() == {outer, inner, other}
    w.ret(A, outer, TOP, task=7, r0=5)
    assert w.seen == [(outer, TOP, 5, 0)]
    assert [i.ret_addr for i in w.rp.live] == [other] and w.breakpoints() == {other}
    w.ret(B, other, TOP - 0x200, task=8, r0=6)
    assert w.seen[-1] == (other, TOP - 0x200, 6, 1) and w.breakpoints() == set()


def test_two_probes_on_one_function_both_see_the_return() -> None:
    w = World()
    second: list[int] = []
    rp2 = StubReturn(key=lambda regs: regs.r3, ret_handler=lambda inst, regs: second.append(regs.r0), maxactive=4)
    w.returns.register(rp2)
    w.rig.km.register_kprobe(Kprobe(addr=w.callee, anywhere=True,
                                    pre_handler=lambda kp, regs: w.returns.entered(rp2, regs) and 0))  # fmt: skip
    site = w.caller + 4
    w.call(A, site, TOP, task=7)
    assert len(w.returns.sites[site].instances) == 2 and w.breakpoints() == {site}
    w.ret(A, site, TOP, task=7, r0=9)
    assert [s[2] for s in w.seen] == [9] and second == [9] and w.breakpoints() == set()


def test_a_user_stub_probe_on_the_return_address_shares_its_breakpoint(w: World) -> None:
    site = w.caller + 4
    hits: list[int] = []
    kp = Kprobe(addr=site, anywhere=True, pre_handler=lambda k, regs: hits.append(regs.r0) or 0)
    w.rig.km.register_kprobe(kp)
    w.call(A, site, TOP, task=7)
    after = w.ret(A, site, TOP, task=7, r0=4)
    assert hits == [4] and w.seen == [(site, TOP, 4, 0)] and after["pc"] == site + 4
    # The instruction (a NOP) performed once for both, by the host: no step.
    assert (A, site) not in w.rig.t.cpu.steps and w.rig.km.stubs.points[site].emulated == 1
    assert w.breakpoints() == {site}  # still the user's probe
    w.rig.km.unregister_kprobe(kp)
    assert w.breakpoints() == set()


def test_calls_past_maxactive_are_missed() -> None:
    w = World(maxactive=2)
    for i in range(3):
        w.call(A, w.caller + 4, TOP - 0x40 * i, task=7)
    assert w.entries[2] is None and w.rp.nmissed == 1 and len(w.rp.live) == 2


def test_unregister_drops_the_calls_in_flight_and_their_breakpoints(w: World) -> None:
    w.call(A, w.caller + 4, TOP, task=7)
    w.call(B, w.caller + 8, TOP - 0x400, task=8)
    w.returns.unregister(w.rp)
    assert w.rp.live == [] and w.breakpoints() == set() and w.returns.by_key == {}
    w.call(A, w.caller + 4, TOP, task=7)
    assert w.entries[-1] is None and w.breakpoints() == set()  # unregistered: no new instance


def test_an_instance_the_caller_discards_leaves_no_breakpoint(w: World) -> None:
    w.call(A, w.caller + 4, TOP, task=7)
    inst = w.entries[0]
    assert inst is not None
    w.returns.discard(inst)
    w.returns.discard(inst)  # twice is harmless
    assert w.breakpoints() == set() and w.rp.live == []


def test_an_anywhere_kretprobe_sees_its_return_value_with_the_stack_untouched() -> None:
    rig = Rig()
    t = rig.t
    callee = t.function("toy_callee", insn(BTI), insn(ADDI, 1), insn(RET))
    site = t.function("toy_caller", insn(NOP), insn(NOP)) + 4
    rpm = KretprobeManager(rig.km)
    seen: list[tuple[int, int, int]] = []
    entered: list[int] = []

    def entry(ri: KretprobeInstance, regs: Any) -> int:
        entered.append(regs.r0)
        ri.data[:8] = regs.r0.to_bytes(8, "little")
        return 1 if regs.r0 == 99 else 0  # declines that call

    def handler(ri: KretprobeInstance, regs: Any) -> None:
        seen.append((ri.ret_addr, int.from_bytes(ri.data, "little"), regs.r0))

    rp = Kretprobe("toy_callee", anywhere=True, entry_handler=entry, data_size=8, maxactive=2, handler=handler)
    rpm.register_kretprobe(rp)
    assert rpm.trampoline == 0 and "r  toy_callee+0x4    [ANYWHERE]" in list_probes(rig.km)
    text = bytes(t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE])

    def stop(pc: int, **regs: int) -> None:
        cpu = t.regs(A)
        cpu.update(pc=pc, **regs)
        t.machine.stop_handlers[pc](A, dict(cpu))

    stop(callee + 4, sp=TOP, r0=99, lr=site)  # declined: no return site
    assert [a for a, kind, _ in t.cpu.breakpoints if kind == BREAK_HW] == [callee + 4]
    stop(callee + 4, sp=TOP, r0=10, lr=site)
    assert t.regs(A)["r0"] == 11  # the ADDI after the probe ran in place
    assert t.regs(A)["lr"] == site and len(rpm.live_instances(rp)) == 1  # the return address as the call left it
    stop(site, sp=TOP, r0=11)
    assert seen == [(site, 10, 11)] and entered == [99, 10] and rp.nreturns == 1 and rp.nhit == 2
    assert rpm.live_instances(rp) == [] and bytes(t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE]) == text
    rpm.unregister_kretprobe(rp)
    assert t.cpu.breakpoints == [] and t.machine.stop_handlers == {}


def test_retiring_freed_text_flags_its_probes_gone_and_forgets_calls_returning_there(w: World) -> None:
    site = w.caller + 4
    w.call(A, site, TOP, task=7)
    freed = {w.callee, site}  # the callee and its caller's text go (an __init function, its caller too)
    w.returns.retire(freed.__contains__)
    retired = w.rig.km.stubs.retire(freed.__contains__)
    assert retired == 1 and w.entry.gone and w.entry.nhit == 1  # kill_kprobe: the count kept
    assert w.rig.t.cpu.breakpoints == [] and w.rp.live == [] and w.returns.sites == {}
    assert list_probes(w.rig.km).endswith("[ANYWHERE][GONE]\n")
    w.rig.km.unregister_kprobe(w.entry)  # a gone probe still unregisters
    assert list_probes(w.rig.km) == ""

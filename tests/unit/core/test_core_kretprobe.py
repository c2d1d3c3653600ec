"""Return probes held by the host (qprobe.core.kretprobe) on the toy architecture.

A toy function is called by putting a return address in its link register
(as arm64's ``bl``), or with ``stack_return`` on a toy stack (as x86's
``call``), and running the vCPU through it: the entry's breakpoint takes an
instance and puts the trampoline's address where the return address was, the
function's RET goes to the trampoline, whose breakpoint pairs the return with
its instance by the call's frame (its stack pointer at entry).  Tasks are told
apart by the register that holds ``current`` (``cur``, as arm64's SP_EL0).
"""

from __future__ import annotations

from typing import Any

import pytest
from fakearch import ADDI, BTI, ENTRY, IRQ, NOP, RET, STACK, TEXT_PHYS, TEXT_SIZE, Rig, insn

from qprobe.core.kprobe import Kretprobe, KretprobeInstance
from qprobe.core.kretprobe import KretprobeManager
from qprobe.errors import InvalidProbe, ProbeError

A, B = "p1.1", "p1.2"
CALLER = 0xFFFF_8000_0000_9000  # return addresses: in text, never executed here


class Calls(Rig):
    def __init__(self, stack_return: bool = False) -> None:
        super().__init__(stack_return)
        self.stack_return = stack_return
        self.callee = self.t.function("toy_callee", insn(BTI), insn(ADDI, 1), insn(NOP), insn(RET))
        self.t.function("toy_noreturn", insn(NOP), insn(NOP))
        self.rpm = KretprobeManager(self.km)
        self.text = bytes(self.t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE])

    def enter(self, tid: str, sp: int, ret: int, task: int) -> None:
        """``tid`` (running task ``task``) calls toy_callee from ``ret`` with stack pointer ``sp``: up to its RET."""
        if self.stack_return:
            self.t.mem.write(sp, ret.to_bytes(8, "little"))
        self.run(tid, self.callee, sp=sp, cur=task, r0=0, lr=0 if self.stack_return else ret)
        while self.t.mem.read(self.t.regs(tid)["pc"], 1)[0] != RET:
            self.step(tid)

    def leave(self, tid: str) -> int:
        """``tid`` executes the RET (and the trampoline's breakpoint, if it returns there); where it goes on."""
        self.step(tid)
        if self.t.regs(tid)["pc"] == self.rpm.trampoline:
            self.step(tid)
        return self.t.regs(tid)["pc"]

    def return_address(self, tid: str, sp: int) -> int:
        """Where the call of ``tid`` entered with stack pointer ``sp`` returns to now."""
        return self.t.mem.read_u64(sp) if self.stack_return else self.t.regs(tid)["lr"]


@pytest.fixture(params=["link-register", "stack"])
def calls(request: pytest.FixtureRequest) -> Calls:
    return Calls(stack_return=request.param == "stack")


@pytest.fixture
def stack_calls() -> Calls:
    """Calls whose return address is on the stack, where the host can read whether it is still in use."""
    return Calls(stack_return=True)


def slot(n: int) -> int:
    return STACK + 0x1000 * (n + 1) - 8


def test_a_return_runs_the_handler_with_the_return_value_and_goes_back_to_the_caller(calls: Calls) -> None:
    seen: list[tuple[int, int, int, int]] = []

    def handler(ri: KretprobeInstance, regs: Any) -> None:
        seen.append((ri.ret_addr, ri.frame, regs.r0, regs.ip))

    rp = Kretprobe("toy_callee", handler=handler, maxactive=4)
    calls.rpm.register_kretprobe(rp)
    assert rp.kp.resolved == calls.callee + 4  # past the landing pad
    calls.enter(A, slot(0), CALLER, task=1)
    assert calls.return_address(A, slot(0)) == calls.rpm.trampoline  # the return address, swapped
    assert (len(rp.live), len(rp.free)) == (1, 3)
    assert calls.leave(A) == CALLER
    assert seen == [(CALLER, slot(0), 1, calls.rpm.trampoline)]
    assert (rp.nhit, rp.nreturns, rp.nmissed) == (1, 1, 0)
    assert (len(rp.live), len(rp.free), calls.rpm.by_frame) == (0, 4, {})
    # A stack patch is forgotten once consumed: the journal holds the entry's breakpoint only.
    assert [p.what for p in calls.t.machine.journal.patches.values()] == ["int3"]


def test_maxactive_bounds_the_calls_in_flight_and_the_rest_count_as_missed(calls: Calls) -> None:
    returns: list[tuple[int, int]] = []
    rp = Kretprobe("toy_callee", handler=lambda ri, regs: returns.append((ri.ret_addr, ri.task.task)),
                   maxactive=2)  # fmt: skip
    calls.rpm.register_kretprobe(rp)
    # Three tasks in the function at once (two vCPUs, one of them preempted): only two are probed.
    calls.enter(A, slot(0), CALLER + 0, task=10)
    calls.enter(B, slot(1), CALLER + 4, task=11)
    first = dict(calls.t.regs(A))  # A switches to a third task, which calls it too
    calls.t.regs(A).update(pc=calls.callee + 4)
    calls.enter(A, slot(2), CALLER + 8, task=12)
    assert (rp.nhit, rp.nmissed, len(rp.live)) == (3, 1, 2)
    assert calls.return_address(A, slot(2)) == CALLER + 8  # the missed call keeps its return address
    assert calls.leave(A) == CALLER + 8
    assert returns == []
    # The others return out of order, each to its own caller with its own instance.
    calls.t.regs(A).update(pc=calls.callee + 12, sp=slot(0), lr=first["lr"], cur=first["cur"])
    assert calls.leave(B) == CALLER + 4
    assert calls.leave(A) == CALLER + 0
    assert returns == [(CALLER + 4, 11), (CALLER + 0, 10)]
    assert (rp.nreturns, len(rp.free)) == (2, 2)


def test_an_instance_whose_call_cannot_return_is_reclaimed_instead_of_missing(stack_calls: Calls) -> None:
    calls = stack_calls
    rp = Kretprobe("toy_callee", maxactive=1)
    calls.rpm.register_kretprobe(rp)
    calls.enter(A, slot(0), CALLER, task=1)
    calls.t.mem.write(slot(0), bytes(8))  # the task exited inside the function: its stack is reused
    calls.t.regs(A).update(pc=calls.callee + 4)
    calls.enter(A, slot(1), CALLER + 4, task=2)
    assert (rp.nhit, rp.nmissed, list(rp.live)) == (2, 0, [slot(1)])
    assert calls.leave(A) == CALLER + 4


def test_entry_handler_shares_data_with_the_handler_and_can_leave_a_call_unprobed(calls: Calls) -> None:
    got: list[bytes] = []

    def entry(ri: KretprobeInstance, regs: Any) -> int:
        if regs.sp == slot(1):
            return 1  # not this call
        ri.data[:] = regs.sp.to_bytes(8, "little")
        return 0

    rp = Kretprobe("toy_callee", handler=lambda ri, regs: got.append(bytes(ri.data)), entry_handler=entry,
                   maxactive=1, data_size=8)  # fmt: skip
    calls.rpm.register_kretprobe(rp)
    calls.enter(B, slot(1), CALLER + 4, task=2)
    assert (len(rp.free), calls.return_address(B, slot(1))) == (1, CALLER + 4)  # the instance went back unused
    assert calls.leave(B) == CALLER + 4
    calls.enter(A, slot(0), CALLER, task=1)
    assert calls.leave(A) == CALLER
    assert got == [slot(0).to_bytes(8, "little")]
    assert rp.free[0].data == bytearray(8)  # cleared for the next call


def test_a_returns_journal_record_stays_until_its_vcpu_is_sent_to_the_real_return_address(
    stack_calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Killed in between, the next qprobe finds a vCPU on the trampoline: only the record sends it back.
    calls = stack_calls
    calls.rpm.register_kretprobe(Kretprobe("toy_callee"))
    calls.enter(A, slot(0), CALLER, task=1)
    journal, cpu = calls.km.machine.journal, calls.t.cpu
    (retaddr,) = (p.phys for p in journal.patches.values() if p.what == "retaddr")
    held: list[bool] = []
    write = cpu.write_registers

    def write_registers(tid: str, values: dict[str, int]) -> None:
        held.append(retaddr in journal.patches)
        write(tid, values)

    monkeypatch.setattr(cpu, "write_registers", write_registers)
    assert calls.leave(A) == CALLER
    assert held == [True] and retaddr not in journal.patches


def test_unregistering_puts_back_the_return_address_of_every_call_in_flight(stack_calls: Calls) -> None:
    calls = stack_calls
    rp = Kretprobe("toy_callee", handler=lambda ri, regs: pytest.fail("handler after unregister"))
    calls.rpm.register_kretprobe(rp)
    calls.enter(A, slot(0), CALLER, task=1)
    assert calls.km.regs.fix_return(slot(0) + 8, calls.rpm.trampoline) == CALLER  # what an unwinder sees meanwhile
    calls.rpm.unregister_kretprobe(rp)
    assert calls.t.mem.read_u64(slot(0)) == CALLER
    assert calls.leave(A) == CALLER
    assert (rp.registered, rp.live, calls.rpm.registered) == (False, {}, set())
    assert calls.text_unchanged()


def test_a_call_in_flight_through_a_link_register_returns_unreported_after_unregistering() -> None:
    # The kernel's way where the return address cannot be put back: the trampoline sends the return on.
    calls = Calls(stack_return=False)
    rp = Kretprobe("toy_callee", handler=lambda ri, regs: pytest.fail("handler after unregister"))
    calls.rpm.register_kretprobe(rp)
    calls.enter(A, slot(0), CALLER, task=1)
    assert calls.km.regs.fix_return(slot(0), calls.rpm.trampoline) == CALLER  # what an unwinder sees meanwhile
    calls.rpm.unregister_kretprobe(rp)
    assert calls.t.regs(A)["lr"] == calls.rpm.trampoline  # where the function may have saved it already
    assert calls.leave(A) == CALLER
    assert (rp.registered, rp.live, rp.nreturns, calls.rpm.by_frame) == (False, {}, 0, {})
    assert calls.text_unchanged()


def test_the_last_return_probe_gone_with_no_call_in_flight_takes_the_trampoline_and_the_trap_hook(
    calls: Calls,
) -> None:
    rp = Kretprobe("toy_callee")
    calls.rpm.register_kretprobe(rp)
    calls.enter(A, slot(0), CALLER, task=1)
    trampoline = calls.rpm.trampoline
    assert calls.leave(A) == CALLER and calls.km.dispatcher.hooked
    calls.rpm.unregister_kretprobe(rp)
    assert trampoline not in calls.km.slots.trampolines and calls.rpm.trampoline == 0
    assert not calls.km.dispatcher.hooked  # no guest trap stops the VM any more
    calls.rpm.register_kretprobe(rp)  # and a new one makes its own
    calls.enter(A, slot(0), CALLER, task=1)
    assert calls.leave(A) == CALLER and rp.nreturns == 2  # its counts go on


def test_a_call_in_flight_keeps_the_trampoline_after_the_last_return_probe_goes() -> None:
    calls = Calls(stack_return=False)
    rp = Kretprobe("toy_callee")
    calls.rpm.register_kretprobe(rp)
    calls.enter(A, slot(0), CALLER, task=1)
    calls.rpm.unregister_kretprobe(rp)
    assert calls.rpm.trampoline in calls.km.slots.trampolines and calls.km.dispatcher.hooked
    assert calls.leave(A) == CALLER


def test_a_return_through_the_trampoline_with_no_instance_is_an_error(calls: Calls) -> None:
    rp = Kretprobe("toy_callee")
    calls.rpm.register_kretprobe(rp)
    calls.t.regs(A).update(pc=calls.rpm.trampoline, sp=slot(3) + calls.km.arch.ret_pops, psr=IRQ)
    calls.t.cpu.execute(A)
    assert calls.t.regs(A)["pc"] == ENTRY
    with pytest.raises(ProbeError, match=f"no instance for the frame {slot(3):#x}"):
        calls.km.dispatcher.on_entry_stop(A, dict(calls.t.regs(A)))


@pytest.mark.parametrize(
    ("where", "error", "words"),
    [
        ({"symbol_name": "toy_callee", "offset": 8}, InvalidProbe, "not a function entry"),
        ({"symbol_name": "toy_noreturn"}, ProbeError, "does not return to its caller"),
    ],
)
def test_refused_return_probes_leave_nothing_behind(calls: Calls, where: dict[str, Any], error: type,
                                                    words: str) -> None:  # fmt: skip
    rp = Kretprobe(**where)
    with pytest.raises(error, match=words):
        calls.rpm.register_kretprobe(rp)
    assert (rp.registered, calls.km.points, calls.rpm.registered) == (False, {}, set())
    assert calls.text_unchanged()


def test_default_maxactive_is_the_kernels(calls: Calls) -> None:
    rp = Kretprobe("toy_callee")
    calls.rpm.register_kretprobe(rp)
    assert len(rp.free) == max(10, 2 * len(calls.km.machine.vcpus))


def test_registering_a_registered_return_probe_is_einval_and_leaves_its_calls_alone(calls: Calls) -> None:
    returns: list[int] = []
    rp = Kretprobe("toy_callee", handler=lambda ri, regs: returns.append(ri.ret_addr), maxactive=2)
    calls.rpm.register_kretprobe(rp)
    calls.enter(A, slot(0), CALLER, task=1)
    with pytest.raises(InvalidProbe, match="already registered"):
        calls.rpm.register_kretprobe(rp)
    assert (len(rp.live), len(rp.free)) == (1, 1)  # still maxactive instances in all
    assert calls.leave(A) == CALLER
    assert returns == [CALLER]  # the call in flight still returns through the handler
    assert (rp.registered, len(rp.free)) == (True, 2)


def test_an_entry_whose_stack_cannot_be_read_keeps_its_instance(stack_calls: Calls) -> None:
    calls = stack_calls
    rp = Kretprobe("toy_callee", maxactive=1)
    calls.rpm.register_kretprobe(rp)
    calls.run(A, calls.callee, sp=0xFFFF_9000_0000_0000)  # BTI: its sp is not mapped
    calls.step(A)  # the entry's breakpoint: the return address cannot be read
    assert (rp.nhit, rp.kp.nfaults, len(rp.live)) == (1, 1, 0)
    assert "MemoryFault" in rp.kp.errors[0]
    assert len(rp.free) == 1  # the instance is not lost: the next call is probed
    calls.enter(B, slot(1), CALLER, task=2)
    assert (rp.nmissed, len(rp.live)) == (0, 1)
    assert calls.leave(B) == CALLER

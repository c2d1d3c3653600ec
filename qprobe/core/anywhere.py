"""Probes anywhere in kernel text, on the gdbstub's own breakpoints: nothing is written into the guest.

The kernel refuses probes on its blacklist (``NOKPROBE_SYMBOL``, ``noinstr`` and
entry text, the int3, debug and NMI paths) because its handlers run in the guest,
on an int3 they would re-enter.  A stub breakpoint traps nothing in the guest: QEMU
stops the VM with the vCPU on the probed instruction, the handlers run on the
host, and the vCPU single-steps the instruction where it is (QEMU's single-step
passes over its own breakpoints), so the probe works in any context: before
``swapgs`` on a system call's entry, in an NMI, in the #BP handler itself.  An
instruction the architecture emulates for its kprobes (a branch, a call, a
return) or a no-op (x86's ``__fentry__`` site at a function's start) is
performed by the host instead of stepped.  Each stop on a breakpoint or a step
makes QEMU 7.2 throw away all its translated code, which the guest then
translates again: a hit costs one such stop, or two with the step, whatever the
host does, and a workload that runs much code between hits pays most; there is
no optimization.

The breakpoints are gdb's hardware kind (``Z1``): under TCG QEMU checks them as it
translates and writes nothing (as for ``Z0``, without a limit); under KVM they are
debug registers, four of them, where ``Z0`` would write an int3 into the text.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qprobe.arch import Arch
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import KPROBE_FLAG_GONE, Kprobe
from qprobe.core.regs import PtRegs
from qprobe.core.taskmem import TaskMemory
from qprobe.errors import InvalidProbe, TargetError
from qprobe.vmm.machine import Machine


class InternalProbe(Kprobe):
    """A stub probe of qprobe's own (a return site, a boot milestone): in no listing, no user's."""


@dataclass
class StubPoint:
    """One address with a stub breakpoint, and the probes on it (the kernel's aggregate probe)."""

    addr: int
    where: str
    probes: list[Kprobe] = field(default_factory=list)
    steps: int = 0  # hits whose instruction was stepped in place
    emulated: int = 0  # hits whose instruction the host performed (no step: a step's stop flushes QEMU's code)
    armed: bool = False  # its breakpoint is in the stub: some probe on it is enabled


class StubProbes:
    """The probes armed with stub breakpoints; every method runs on the stop loop."""

    def __init__(self, machine: Machine, arch: Arch, handlers: Handlers,
                 make_regs: Callable[[Mapping[str, int], str], PtRegs],
                 step: Callable[[str, int], dict[str, int]]) -> None:  # fmt: skip
        """``step(tid, ip)`` single-steps a vCPU's instruction at ``ip`` and gives the registers after it."""
        self.machine = machine
        self.arch = arch
        self.handlers = handlers
        self.make_regs = make_regs
        self.step = step
        self.points: dict[int, StubPoint] = {}

    def register(self, kp: Kprobe, addr: int, where: str) -> None:
        point = self.points.get(addr)
        if point is None:
            if addr in self.machine.stop_handlers:
                # The int3 hook's breakpoint (or the clock's): qprobe's own stops there mean something else.
                raise InvalidProbe(f"{where} is where qprobe hears of its own traps: it cannot be probed, "
                                   "even anywhere (EINVAL)")  # fmt: skip
            point = StubPoint(addr, where)
        point.probes.append(kp)
        try:
            self.sync(point)
        except TargetError as exc:
            point.probes.remove(kp)
            raise InvalidProbe(f"{where}: the gdbstub refused a breakpoint there ({exc}); under KVM "
                               "there are four") from None  # fmt: skip
        self.points[addr] = point

    def unregister(self, kp: Kprobe) -> None:
        point = self.points[kp.resolved]
        point.probes.remove(kp)
        self.sync(point)
        if not point.probes:
            del self.points[point.addr]

    def sync(self, point: StubPoint, enabled: bool = True) -> None:
        """The breakpoint in the stub while some probe on it is enabled (and ``enabled``: debugfs kprobes/enabled),
        out otherwise, so a disabled probe costs the guest nothing."""
        want = enabled and any(not kp.disabled and not kp.gone for kp in point.probes)
        if want and not point.armed:
            self.machine.insert_stub_breakpoint(point.addr)
            self.machine.stop_handlers[point.addr] = self._hit
            point.armed = True
        elif not want and point.armed:
            self.machine.stop_handlers.pop(point.addr, None)
            self.machine.remove_stub_breakpoint(point.addr)
            point.armed = False

    def retire(self, gone: Callable[[int], bool]) -> int:
        """``kill_kprobe`` for the probes at addresses ``gone`` says are no longer text (freed __init text):
        flagged GONE, listed so, their counts kept, their breakpoints out.  How many."""
        n = 0
        for point in list(self.points.values()):
            if gone(point.addr):
                for kp in point.probes:
                    kp.flags |= KPROBE_FLAG_GONE
                    n += 1
                self.sync(point)
        return n

    def remove_all(self) -> None:
        for point in list(self.points.values()):
            for kp in list(point.probes):
                self.unregister(kp)
                kp.registered = False

    def _hit(self, tid: str, regs: dict[str, int]) -> None:
        """The VM stopped on a probed instruction: the handlers, then the instruction run in place."""
        point = self.points.get(self.arch.ip(regs))
        if point is None:
            return
        active = [kp for kp in point.probes if not kp.disabled and not kp.gone]
        pt = self._regs(regs, tid)
        if self.handlers.pre(active, pt):  # a pre_handler moved ip and asked to skip the instruction
            self._write(tid, pt)
            return
        self._write(tid, pt)
        pt.mark_clean()
        post = copy.copy(pt)  # the emulation's own: one that faults part way leaves it to the step
        if self.arch.arch_emulate_in_place(post, TaskMemory(self.machine, post)):
            point.emulated += 1
        else:
            post = self._regs(self.step(tid, pt.ip), tid)
            post.mark_clean()
            point.steps += 1
        self.handlers.post(active, post)
        self._write(tid, post)

    def _regs(self, values: Mapping[str, int], tid: str) -> PtRegs:
        # Before swapgs on a kernel entry the per-CPU base is in the other GS register: the handlers'
        # current task and per-CPU reads need the kernel's.
        return self.make_regs({**values, self.arch.registers.percpu_base: self.arch.percpu_base(values)}, tid)

    def _write(self, tid: str, pt: PtRegs) -> None:
        changed = pt.dirty()
        if changed:
            self.machine.gdb.write_registers(tid, changed)


__all__ = ["InternalProbe", "StubPoint", "StubProbes"]

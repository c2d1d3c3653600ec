"""The kprobes' code in the scratch area and how long it must outlive them: the kernel's kprobe_insn_slots.

Out-of-line copies, detours and the kretprobe trampolines run in the scratch area.  After a probe goes,
a vCPU, an interrupted context or (on a fully preemptible kernel) a preempted task may still be inside
its code, or on its way from there back into kernel text.  The kernel marks such a slot dirty and frees
it after an RCU-tasks grace period (``free_insn_slot``, ``collect_garbage_slots``); qprobe never reuses
one while the area is mapped, and unmaps the area only once nothing can run in it: a grace period with
no probe armed, the vCPUs still inside stepped out, and on a fully preemptible kernel no sleeping task's
stack pointing into it (qprobe.kernel.preempted).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from qprobe.arch import Arch
from qprobe.core.regs import PtRegs
from qprobe.errors import ProbeError
from qprobe.kernel.preempted import wait_preempted_out
from qprobe.vmm.machine import Machine
from qprobe.vmm.scratch import ScratchArea

__all__ = ["InsnSlots", "Trampoline"]

# An int3 in the scratch area that is not a probe (a kretprobe trampoline's): given the
# registers at the trap (sp and flags as before the int3), it runs its handlers and returns the ip to resume at,
# and what to run once the vCPU's registers that resume there are written (None: nothing).
Trampoline = Callable[[PtRegs], tuple[int, Callable[[], None] | None]]


class InsnSlots:
    """What of the scratch area the kprobes' code holds, for as long as it is mapped (stop loop)."""

    def __init__(self, machine: Machine, arch: Arch, scratch: ScratchArea, fully_preemptible: bool = False) -> None:
        self.machine = machine
        self.arch = arch
        self.scratch = scratch
        # Boosting lets a vCPU run the slot copy freely; an interrupt there leaves an
        # interrupted context inside the slot.  Without forced preemption that context
        # resumes as soon as the interrupt returns, which the grace period in
        # wait_out() covers; on a fully preemptible kernel it could sleep there, so
        # the slots (never reused while the area is mapped) outlive every sleeping task
        # whose stack points into the area, and a jump whose region a boosted copy returns
        # into waits for the same (JumpCheck.preempted_in and why_not, qprobe.kernel.preempted),
        # where the kernel waits for an RCU-tasks grace period.
        self.fully_preemptible = fully_preemptible
        self.dirty: list[int] = []  # boosted slots and detours, never reused while the area is mapped
        # Where code in the scratch area jumps back into kernel text (boosted slots, detours), for as
        # long as the area is mapped: a vCPU or an interrupted context may still be on its way there.
        # address -> when it was last resumed to: time.monotonic() of a boosted hit, inf for a detour.
        self.resume_targets: dict[int, float] = {}
        # int3s in the scratch area that are not probes: the kretprobe trampoline.
        self.trampolines: dict[int, Trampoline] = {}

    def quarantine(self, addr: int) -> None:
        """``free_insn_slot`` of a dirty slot: code a context may still run, kept until the area goes."""
        self.dirty.append(addr)

    def free(self, addr: int, dirty: bool) -> None:
        if dirty:
            self.quarantine(addr)
        else:
            self.scratch.free(addr)

    def wait_out(self, grace: float, preempted_in: Callable[[int, int], str | None]) -> str | None:
        """With every probe disarmed, let each context that could resume in the area leave it.

        The VM runs for ``grace`` seconds, so that a context interrupted inside
        a boosted copy has returned to it and left it.  On a fully preemptible
        kernel a task preempted in a detour sleeps with its ip there for as long
        as the scheduler likes: the area goes only once no task's stack points
        into it (``preempted_in(start, end)`` says which does).  What still
        holds the area after ``PREEMPTED_WAIT``, else None.
        """
        scratch = self.scratch
        if self.dirty and scratch.mapped:
            time.sleep(grace)
        if not self.fully_preemptible:
            return None

        def held_in_scratch() -> str | None:
            return preempted_in(scratch.base, scratch.base + scratch.mapped_size)

        return wait_preempted_out(lambda: self.machine.call(held_in_scratch) if scratch.mapped else None,
                                  lambda: time.sleep(grace))  # fmt: skip

    def evacuate(self) -> None:
        """Step every vCPU whose ip is inside the scratch area until it is out (stop loop)."""
        gdb = self.machine.gdb
        for tid in self.machine.vcpus:
            for _ in range(100_000):  # a vCPU in the optimized stub spins until served
                ip = self.arch.ip(gdb.read_registers(tid))
                if not self.scratch.contains(ip) or ip in self.trampolines:
                    break
                gdb.step(tid)
            else:
                raise ProbeError(f"vCPU {tid} did not leave the scratch area")

    def unmapped(self) -> None:
        """The area is gone: nothing in it can run, or be jumped back from, any more."""
        self.dirty.clear()
        self.resume_targets.clear()

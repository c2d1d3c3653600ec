"""kprobe_fault_handler(): a copy run out of line took an exception, and the guest must take it at the probe.

The kernel's handler, for a fault while a vCPU is in KPROBE_HIT_SS, ends the
hit (the post_handlers do not run), puts the probe's state back and points
the exception's return address at the probed instruction, so that the
exception tables, the fault's handling and an oops report all see the text,
not the slot.  The architecture moves the return address
(``arch_fault_fixup``): x86's is in the exception frame, in memory.  Where it
cannot (arm64's ELR_EL1, a system register QEMU 7.2's stub does not write),
the core has the guest take the same exception again at the probed address:
the vCPU goes back to the context the copy ran in, at the probed instruction,
and runs the original instruction there, in place, once, while every other
vCPU is stopped; a deterministic fault recurs with ELR_EL1 at the probe, as
the kernel's own fix-up leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qprobe.arch import Arch, TrapHook
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe
from qprobe.core.point import KprobeCtlblk, KprobeStatus, ProbePoint
from qprobe.core.regs import PtRegs, RegsSource
from qprobe.core.taskmem import TaskMemory
from qprobe.errors import ProbeError
from qprobe.vmm.machine import Machine


class CopyFaults:
    """The fault path of a hit (stop-loop thread): a stepped copy's, or a trap-stepped copy's heard on the entry."""

    def __init__(self, machine: Machine, arch: Arch, handlers: Handlers, regs: RegsSource,
                 ctlblk: Mapping[str, KprobeCtlblk], step: Callable[[str, int], dict[str, int]]) -> None:  # fmt: skip
        """``step``: the dispatcher's single-step of a vCPU at an address (retried when it ran nothing)."""
        self.machine = machine
        self.arch = arch
        self.handlers = handlers
        self.regs = regs
        self.ctlblk = ctlblk
        self.step = step

    def on_entry(self, tid: str, regs: dict[str, int]) -> bool:
        """Whether a stop on the trap entry that is no breakpoint of ours is the fault of the copy ``tid`` was
        trap-stepping (the kernel's KPROBE_HIT_SS): then the hit is over and the guest takes the fault."""
        ctl = self.ctlblk[tid]
        point = ctl.point
        if point is None:
            return False
        trap = self.arch.traps.decode_trap(TrapHook.ENTRY, regs, self.machine.mem.read)
        if self.arch.arch_slot_resume(point.prep.slot_addr, point.addr, trap.addr, trap.flags) is None:
            return False  # taken somewhere else than in the copy
        active = ctl.active
        ctl.status, ctl.point, ctl.active = KprobeStatus.IDLE, None, []
        if not self.fixup(point, tid, self.regs.make_regs(trap.regs, tid), active, trap.restore):
            return True  # the guest took it again at the probe: the vCPU is on the vector's first instruction
        self.machine.gdb.step(tid)  # off the entry's breakpoint, into the kernel's handler
        return True

    def fixup(self, point: ProbePoint, tid: str, post: PtRegs, active: list[Kprobe],
              restore: Mapping[str, int] | None = None) -> bool:  # fmt: skip
        """The copy raised an exception: make the guest see it at the original address.  ``post``: the vCPU's
        registers as the exception left them (with ``restore``, those of the context it was taken in).

        Returns False when the exception was taken again at the probe (the vCPU moved on from where it was).
        """
        fixed = self.arch.arch_fault_fixup(point.prep, post, TaskMemory(self.machine, post))
        if fixed:
            if post.dirty():
                self.machine.gdb.write_registers(tid, post.dirty())
        else:
            self.machine.gdb.write_registers(tid, {**(restore or {}), **post.dirty()})
            self._in_place(tid, point)
        post.mark_clean()
        exc = ProbeError(f"the out-of-line copy of {point.where} faulted (guest exception at {post.symbolize()})")
        for kp in active:
            kp.nfaults += 1
            self.handlers.fault(kp, post, exc)
        return fixed

    def _in_place(self, tid: str, point: ProbePoint) -> None:
        """The original instruction run once at the probed address, under the breakpoint, every vCPU stopped.

        Not journaled: a qprobe killed in between leaves the original text, which is what the journal's
        entry for the breakpoint restores anyway.
        """
        brk = point.int3
        if brk is not None:
            self.machine.write_phys(brk.phys, brk.old)
        try:
            self.step(tid, point.addr)
        finally:
            if brk is not None:
                self.machine.write_phys(brk.phys, brk.new)


__all__ = ["CopyFaults"]

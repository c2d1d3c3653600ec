"""The trap path, top to bottom: a VM stop becomes handlers and one :class:`~qprobe.arch.Resume`.

The host hears of a guest breakpoint through a hook (see ``install``): a
breakpoint on the #BP entry, or a read watchpoint inside the kernel's #BP
handler where it has the trap's pt_regs in hand.  Every stop then goes the
same way, as ``kprobe_int3_handler`` does in the kernel:

1. ``on_entry_stop`` or ``on_watch_stop``: the stop loop's callback for the
   hook; somebody else's trap passes through, and so does any other exception
   that stops on an entry it shares with the breakpoint (arm64's one vector for
   every synchronous exception: ``arch.traps.kprobe_break_hook`` tells them apart).
2. ``arch.traps.decode_trap`` (called there): the trapped context, as before the
   breakpoint ran.
3. ``_handle``: a kretprobe trampoline, a probe removed since the trap, a
   re-entered vCPU (only ``nmissed`` counts), or the probe's pre_handlers
   (``Handlers.pre``, the one place handlers run), then
   ``arch.arch_setup_resume`` decides: emulated, boosted, run out of line to
   the breakpoint after the copy (a trap-step), or single-stepped.
4. ``apply``: the one place a vCPU's registers are written to resume it.
   A trap-step's second trap comes back through the hook (``_after_trap_step``,
   the kernel's resume_singlestep() and kprobe_post_process()); a host
   single-step comes back here at once (``_after_singlestep``): the
   post_handlers, and the ip mapped back from the slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from qprobe.arch import Arch, BreakHook, Resume, ResumeKind, Trap, TrapHook
from qprobe.core.copyfault import CopyFaults
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe
from qprobe.core.point import KprobeCtlblk, KprobeStatus, ProbePoint
from qprobe.core.regs import PtRegs, RegsSource
from qprobe.core.slots import InsnSlots
from qprobe.core.table import ProbeTable
from qprobe.core.taskmem import TaskMemory
from qprobe.errors import ProbeError
from qprobe.kernel.features import find_watch_site, trap_entry
from qprobe.kernel.program import KernelData
from qprobe.vmm.gdbremote import WATCH_READ
from qprobe.vmm.machine import Machine

log = logging.getLogger("qprobe.kprobes")
MAX_STEP_RETRIES = 1 << 16
# A trap's probe point, the probes whose handlers ran, the resume, and what to run once it is written.
Handled = tuple[ProbePoint | None, list[Kprobe], Resume, Callable[[], None] | None]


class Dispatcher:
    """Owns the int3 hook and turns each trap into handlers and one resume (stop-loop thread)."""

    def __init__(self, machine: Machine, kernel: KernelData, arch: Arch, table: ProbeTable, slots: InsnSlots,
                 handlers: Handlers, regs: RegsSource) -> None:  # fmt: skip
        """``table``: the probe table a trap's address is looked up in; ``slots``: the trampolines it runs, and
        where boosted copies jump back to (it notes each one); ``regs``: the handlers' pt_regs."""
        self.machine = machine
        self.kernel = kernel
        self.arch = arch
        self.table = table
        self.regs = regs
        self.slots = slots
        self.handlers = handlers
        self.ctlblk: dict[str, KprobeCtlblk] = {tid: KprobeCtlblk() for tid in machine.vcpus}
        self.int3_entry = trap_entry(kernel.symbols, arch)
        self.hooked = False
        # The hook: a watchpoint on the read the arch's breakpoint handler makes (x86: poke_int3_handler's)
        # when found (watch_refs set), else a breakpoint on the entry.  A watchpoint stop costs the guest
        # no re-translation, a breakpoint stop does (see the arch's TrapWatch.site).
        self.watch_int3 = True
        self.watch_refs, self.watch_safe = 0, frozenset[int]()
        self.passed_through = 0  # stops on the entry the guest's own handler took: not ours, or no breakpoint
        self.stale_int3 = 0  # traps on int3s already gone from the text, run again after a step
        self.ntraps = 0  # int3 traps dispatched (each one a VM stop)
        self.boost = True  # hits may run the copy freely (may_boost); the slots they ran stay (InsnSlots)
        self.faults = CopyFaults(machine, arch, handlers, regs, self.ctlblk, self.step)

    # -- the hook -------------------------------------------------------------------------
    def install(self, watch_only: bool = False) -> None:
        """Hear of every guest int3: a read watchpoint in the #BP handler if it can be found, else a breakpoint.

        ``watch_only``: the hook only where it is the watchpoint, which no user-mode trap reaches (the in-guest
        uprobes' int3s stop nothing), kept then to the end like any watchpoint hook: with no probe of ours
        in the text it still steps away a stale int3 of the guest's own text_poke_bp (``_stale_int3``).
        """
        if self.hooked:
            return
        site = find_watch_site(self.kernel, self.arch) if self.watch_int3 else None
        if site is not None:
            self.watch_refs, self.watch_safe = site
            self.machine.gdb.insert_breakpoint(self.watch_refs, WATCH_READ, 4)
            self.machine.watch_handlers[self.watch_refs] = self.on_watch_stop
            self.machine.after_stop = self.lost_traps
        elif watch_only:
            return
        else:
            self.machine.gdb.insert_breakpoint(self.int3_entry)
            self.machine.stop_handlers[self.int3_entry] = self.on_entry_stop
        self.hooked = True

    def remove(self, final: bool = False) -> None:
        """Remove the hook once nothing of ours can trap.

        The watchpoint hook hears of a trap some thirty instructions after the
        int3 ran, so it stays until the end (``final``), after its grace
        period: a vCPU between an int3 we have just removed and the watched
        read must still be sent back to the original instruction.
        """
        if not self.hooked or self.slots.trampolines or (self.watch_refs and not final):
            return
        self.drain()
        if self.watch_refs:
            self.machine.gdb.remove_breakpoint(self.watch_refs, WATCH_READ, 4)
            del self.machine.watch_handlers[self.watch_refs]
            self.machine.after_stop = None
            self.watch_refs, self.watch_safe = 0, frozenset()
        else:
            self.machine.gdb.remove_breakpoint(self.int3_entry)
            del self.machine.stop_handlers[self.int3_entry]
        self.hooked = False

    def drain(self) -> None:
        """Finish every hit a vCPU is part way into, so the hook and the scratch area can go.

        A vCPU can be stopped on the #BP entry with one of our traps pending, or
        about to execute a trampoline's int3; left alone after the hook is
        gone, the guest's own #BP handler would see an int3 it does not know.
        """
        for tid in self.machine.vcpus:
            regs = self.machine.gdb.read_registers(tid)
            ip = self.arch.ip(regs)
            point, ts = self.ctlblk[tid].point, self.arch.trap_step
            if point is not None and ts is not None and ts.is_trap_step_start(point.prep, ip):
                regs = self.step(tid, ip)  # the copy, not run yet: up to its int3
                ip = self.arch.ip(regs)
            if self._trap_step_end(tid, ip):
                # At the int3 after the copy: finish the hit as its trap would have.
                self.apply(tid, self._after_trap_step(tid, Trap(ip, self.arch.sp(regs), self.arch.flags(regs), regs)))
            elif ip == self.int3_entry and not self.watch_refs:
                self.on_entry_stop(tid, regs)
            elif self.watch_refs and ip in self.watch_safe:
                self.on_watch_stop(tid, regs)
            elif ip in self.slots.trampolines:
                self._run(tid, Trap(ip, self.arch.sp(regs), self.arch.flags(regs), regs))

    def arriving(self, regs: Mapping[str, int]) -> int | None:
        """If a vCPU is stopped on the #BP entry with a trap still to dispatch, the trapped address."""
        if self.arch.ip(regs) != self.int3_entry or self.arch.traps.kprobe_break_hook(regs) is None:
            return None
        return self.arch.traps.decode_trap(TrapHook.ENTRY, regs, self.machine.mem.read).addr

    # -- 1. and 2. the stop, decoded --------------------------------------------------------------
    def on_entry_stop(self, tid: str, regs: dict[str, int]) -> None:
        """The breakpoint hook: the vCPU stopped on the #BP entry, the exception frame at its sp.

        Where the entry is shared with other exceptions (arm64's synchronous vector), a data abort, an
        undefined instruction or a BRK of BUG's stops here too: no trap of ours, whatever address it
        was taken at (a copy's fault, fixed up to the probe's address, comes back here), but the fault
        of a copy the vCPU is trap-stepping ends that hit (``CopyFaults``).
        """
        hook = self.arch.traps.kprobe_break_hook(regs)
        if hook is not None:
            trap = self.arch.traps.decode_trap(TrapHook.ENTRY, regs, self.machine.mem.read)
            if self._ours(tid, trap, hook=hook):
                self._dispatch(tid, trap)
                return
        elif self.faults.on_entry(tid, regs):
            return
        # Somebody else's trap or exception: the guest's own handler has it, its frame untouched.  A gdb
        # breakpoint sits on the entry; stepping executes its first instruction.
        self.passed_through += 1
        self.machine.gdb.step(tid)

    def on_watch_stop(self, tid: str, regs: dict[str, int]) -> None:
        """The watchpoint hook: the vCPU is inside poke_int3_handler, the trap's pt_regs in hand.

        Any other read of the watched word (text_poke_bp's own) and any int3
        not ours that is still in the text just continue, untouched.  For ours,
        every register goes back to the trapped context's with the resume; an
        int3 already gone from the text is run again as it is now.
        """
        if self.arch.ip(regs) not in self.watch_safe:
            return
        trap = self.arch.traps.decode_trap(TrapHook.WATCH, regs, self.machine.mem.read)
        if self._ours(tid, trap, removed=False):
            self._dispatch(tid, trap)
        elif not trap.user and self.machine.mem.read(trap.addr, len(self.arch.breakpoint)) != self.arch.breakpoint:
            self._stale_int3(tid, trap)

    def _stale_int3(self, tid: str, trap: Trap) -> None:
        """An int3 the text no longer holds (ours, removed, or the guest's): run what it holds now.

        The kernel's kprobe_int3_handler backs up over an int3 removed after it ran and
        re-executes the address.  QEMU 7.2 with MTTCG sometimes goes on executing a
        translated block that still holds an int3 the guest's text_poke_bp has replaced:
        backing up then re-executes that int3, forever (measured: a guest toggling its own
        trace events wedged so within minutes, with no probe of qprobe's in it at all; see
        docs/reliability.md).  qprobe backs up too, then single-steps: a step is a debug
        stop, and QEMU throws its translated code away on those (not on a watchpoint's).
        """
        self.stale_int3 += 1
        self.apply(tid, Resume(ResumeKind.CONTINUE, trap.addr, trap.sp, trap.flags), trap.restore)
        self.machine.gdb.step(tid)

    def lost_traps(self, handled: str | None) -> None:
        """Handle the traps of vCPUs that wait right after the watched read without a stop of their own.

        QEMU 7.2 reports one stop at a time: when a vCPU's debug stop comes
        together with another (a second vCPU's, or our own interrupt), it is
        dropped, and a watchpoint (unlike a breakpoint) does not fire again when
        that vCPU goes on.  So after every stop, any vCPU sitting right after
        the read is handled here (``handled``, whose stop was just dispatched,
        is not looked at again; if a dropped stop does come later, its ip has
        moved and it is ignored).
        """
        for tid in self.machine.vcpus:
            if tid == handled:
                continue
            regs = self.machine.gdb.read_registers(tid)
            if self.arch.ip(regs) in self.watch_safe:
                self.on_watch_stop(tid, regs)

    def _ours(self, tid: str, trap: Trap, removed: bool = True, hook: BreakHook = BreakHook.KPROBE) -> bool:
        """Whether the trap is one of our int3s (or, with ``removed``, was when the vCPU executed it).

        ``hook`` is the handler the kernel would run: a single-step breakpoint is ours only at the end of
        the trap-step its vCPU is part way into (kprobe_breakpoint_ss_handler's check).
        """
        if trap.user:
            return False
        if hook is BreakHook.KPROBE_SS:
            return self._trap_step_end(tid, trap.addr)
        if self._trap_step_end(tid, trap.addr):
            return True
        point = self.table.points.get(trap.addr)
        return trap.addr in self.slots.trampolines or (point is not None and point.armed) or (
            removed
            and trap.addr in self.table.touched
            and self.machine.mem.read(trap.addr, len(self.arch.breakpoint)) != self.arch.breakpoint)  # fmt: skip

    # -- 3. handle --------------------------------------------------------------------------------
    def _dispatch(self, tid: str, trap: Trap) -> None:
        self.ntraps += 1
        self._run(tid, trap)

    def _trap_step_end(self, tid: str, addr: int) -> bool:
        """Whether a trap at ``addr`` on ``tid`` is the second trap of the trap-step it is part way into."""
        point, ts = self.ctlblk[tid].point, self.arch.trap_step
        return point is not None and ts is not None and ts.is_trap_step_end(point.prep, addr)

    def _run(self, tid: str, trap: Trap) -> None:
        """Handle one decoded trap and resume the vCPU (twice for a single-step: into the slot, and back)."""
        ctl = self.ctlblk[tid]
        if self._trap_step_end(tid, trap.addr):
            self.apply(tid, self._after_trap_step(tid, trap), trap.restore)
            return
        status = ctl.status
        reentered = status is not KprobeStatus.IDLE
        ctl.status = KprobeStatus.HIT_ACTIVE
        try:
            point, active, resume, resumed = self._handle(tid, trap, reentered)
            after = self.apply(tid, resume, trap.restore)
            if resumed is not None:
                resumed()
            if resume.kind is ResumeKind.STEP:
                assert point is not None
                final = self._after_singlestep(point, tid, after, active)
                if final is not None:
                    self.apply(tid, final)
            elif resume.kind is ResumeKind.TRAP_STEP:
                # The kernel's KPROBE_HIT_SS: the vCPU runs the copy; its int3 comes back to _after_trap_step.
                assert point is not None and not reentered
                ctl.point, ctl.active = point, active
        finally:
            if reentered:
                ctl.status = status  # the outer hit still owns the vCPU
            else:
                ctl.status = KprobeStatus.HIT_SS if ctl.point is not None else KprobeStatus.IDLE

    def _handle(self, tid: str, trap: Trap, reentered: bool) -> Handled:
        """What the trap at ``trap.addr`` does (see ``Handled``)."""
        tramp = self.slots.trampolines.get(trap.addr)
        if tramp is not None:
            pt = self._regs(tid, trap)
            ip, resumed = tramp(pt)
            return None, [], Resume(ResumeKind.CONTINUE, ip, pt.sp, pt.flags, pt.dirty()), resumed
        point = self.table.points.get(trap.addr)
        if point is None or not point.armed:
            # Our int3 was removed after this vCPU executed it but before we saw
            # the trap: back up and run the original instruction (as the kernel does).
            return None, [], Resume(ResumeKind.CONTINUE, trap.addr, trap.sp, trap.flags), None
        pt = self._regs(tid, trap)
        if reentered:
            # A hit while this vCPU is handling a probe (an NMI inside a trap-stepped copy, say): counted
            # as missed, its instruction still runs, stepped by the host so the outer hit keeps the slot.
            for kp in point.probes:
                kp.nmissed += 1
            return point, [], self._setup(point, pt, [], trap_step=False), None
        active = point.active()
        if self.handlers.pre(active, pt):
            # A pre_handler changed ip and asked to skip the instruction.
            return point, active, Resume(ResumeKind.CONTINUE, pt.ip, pt.sp, pt.flags, pt.dirty()), None
        return point, active, self._setup(point, pt, active, trap_step=True), None

    def _regs(self, tid: str, trap: Trap) -> PtRegs:
        """The handlers' pt_regs: the state exactly as before the breakpoint."""
        pt = self.regs.make_regs(trap.regs, tid)
        pt.set_quietly("ip", trap.addr)
        pt.set_quietly("sp", trap.sp)
        pt.set_quietly("flags", trap.flags)
        return pt

    def may_boost(self, point: ProbePoint, active: list[Kprobe]) -> bool:
        """Whether a hit may run the copy freely (the arch still decides whether the instruction can).

        Not with a post_handler to run after the instruction, and not while
        the point waits to be optimized: the jump back would land inside the jump.  Those hits run
        the copy to the int3 after it (a trap-step) where it can: with
        interrupts off, nothing preempts the task there, and the optimizer
        waits for the vCPU to be back (``trap_step_returns``).
        """
        return self.boost and not point.optimizing and not any(kp.post_handler for kp in active)

    def _setup(self, point: ProbePoint, pt: PtRegs, active: list[Kprobe], trap_step: bool) -> Resume:
        """setup_singlestep: the arch decides from the prepared instruction (emulate, boost, trap-step or step).

        An architecture without the trap-step facet has every copy that runs out of line stepped by the host.
        """
        may_trap_step = trap_step and self.arch.trap_step is not None
        resume = self.arch.arch_setup_resume(point.prep, pt, TaskMemory(self.machine, pt),
                                             self.may_boost(point, active), may_trap_step)  # fmt: skip
        if resume.kind is ResumeKind.CONTINUE:  # emulated on the host: the instruction has run
            self.handlers.post(active, pt)
            return Resume(ResumeKind.CONTINUE, pt.ip, pt.sp, pt.flags, pt.dirty())
        if resume.kind is ResumeKind.BOOST:
            point.boosted += 1
            self.slots.resume_targets[resume.jump_back] = time.monotonic()
        elif resume.kind is ResumeKind.TRAP_STEP:
            point.trap_stepped += 1
        return resume

    def _after_trap_step(self, tid: str, trap: Trap) -> Resume:
        """The int3 after a trap-stepped copy: ip and IF back in the text, the post_handlers, the resume.

        The kernel's resume_singlestep() and kprobe_post_process().  Probes
        unregistered since the first trap get no post_handler call.
        """
        ctl = self.ctlblk[tid]
        point, active = ctl.point, ctl.active
        assert point is not None
        ctl.status, ctl.point, ctl.active = KprobeStatus.IDLE, None, []
        post = self._regs(tid, trap)
        assert self.arch.trap_step is not None  # a TRAP_STEP resume is only chosen with the facet
        self.arch.trap_step.arch_resume_trap_step(point.prep, post)
        post.mark_clean()
        self.handlers.post([kp for kp in active if kp.registered], post)
        return Resume(ResumeKind.CONTINUE, post.ip, post.sp, post.flags, post.dirty())

    def trap_step_returns(self) -> dict[str, int]:
        """vCPU -> the text address it goes back to, for every vCPU part way into a trap-step."""
        return {tid: ctl.point.addr + ctl.point.prep.length for tid, ctl in self.ctlblk.items()
                if ctl.point is not None}  # fmt: skip

    def in_slot(self, point: ProbePoint) -> bool:
        """Whether a vCPU is part way into a trap-step of ``point`` (its slot must stay)."""
        return any(ctl.point is point for ctl in self.ctlblk.values())

    def _after_singlestep(self, point: ProbePoint, tid: str, after: dict[str, int],
                          active: list[Kprobe]) -> Resume | None:  # fmt: skip
        """The copy was stepped: the post_handlers, and the resume in the original text (None after a fault)."""
        post = self.regs.make_regs(after, tid)
        prep = point.prep
        if self.arch.step_left_slot(prep, self.arch.ip(after)):
            self.faults.fixup(point, tid, post, active)
            return None  # the vCPU is at the exception's handler: nothing more to write
        self.arch.arch_resume_singlestep(prep, post, TaskMemory(self.machine, post))
        post.mark_clean()
        self.handlers.post(active, post)
        return Resume(ResumeKind.CONTINUE, post.ip, changed=post.dirty())

    # -- 4. the resume ---------------------------------------------------------------------------
    def apply(self, tid: str, resume: Resume, restore: Mapping[str, int] | None = None) -> dict[str, int]:
        """Write the vCPU's registers for ``resume`` (with ``restore`` under them); a STEP steps.

        Returns the registers after a single-step (empty otherwise).
        """
        self.machine.gdb.write_registers(tid, {**(restore or {}), **self.arch.resume_registers(resume)})
        if resume.kind is not ResumeKind.STEP:
            return {}
        return self.step(tid, resume.ip)

    def step(self, tid: str, ip: int) -> dict[str, int]:
        """Single-step the instruction at ``ip`` through the gdbstub; the registers after it."""
        gdb = self.machine.gdb
        for _ in range(MAX_STEP_RETRIES):
            gdb.step(tid)
            after = gdb.read_registers(tid)
            # QEMU with MTTCG sometimes reports a step that executed nothing, and a
            # rep-prefixed instruction stops after each iteration: step again.
            if self.arch.ip(after) != ip:
                return after
        raise ProbeError(f"single-step at {ip:#x} never left the slot")


__all__ = ["Dispatcher"]

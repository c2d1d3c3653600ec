"""The architecture-neutral kprobes core, host side: registration into the probe table, aggregation and arming.

Mirrors kernel/kprobes.c: ``register_kprobe`` resolves and checks
everything before it writes a byte (``_kprobe_addr``,
``check_kprobe_address_safe``), probes at one address share one int3 and one
out-of-line copy (the aggregate probe, ``aggr_pre_handler``), and a hit while
the same vCPU is already handling a probe only counts ``nmissed``.  The
traps themselves go through qprobe.core.dispatch; the probe table
(qprobe.core.table), the handlers' pt_regs and the architecture are the
objects qprobe.wiring hands in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from qprobe.arch import Arch
from qprobe.core.anywhere import StubProbes
from qprobe.core.dispatch import Dispatcher
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import KPROBE_FLAG_DISABLED, KPROBE_FLAG_GONE, Kprobe
from qprobe.core.optimizer import Optimizer
from qprobe.core.point import ProbePoint
from qprobe.core.regsmaker import RegsMaker
from qprobe.core.sites import ProbeSites
from qprobe.core.slots import InsnSlots
from qprobe.core.table import ProbeTable
from qprobe.core.text import KernelText
from qprobe.errors import (
    InvalidProbe,
    ProbeBusy,
    ProbeError,
    QprobeError,
    TargetError,
)
from qprobe.kernel.preempted import PREEMPTED_WAIT
from qprobe.kernel.program import KernelData
from qprobe.vmm.machine import Machine
from qprobe.vmm.scratch import ScratchArea

if TYPE_CHECKING:
    from qprobe.vmm.memory import SharedRam

log = logging.getLogger("qprobe.kprobes")


class KprobeManager:
    """Registers kprobes into the probe table and arms its points; every method that touches the guest runs
    on the stop loop."""

    def __init__(
        self,
        machine: Machine,
        kernel: KernelData,
        scratch: ScratchArea,
        arch: Arch,
        table: ProbeTable,
        regs: RegsMaker,
        ram: SharedRam | None = None,
        doorbell: str | None = None,
        fully_preemptible: bool = False,
    ) -> None:
        """``table``: the probe table, shared with the dispatcher and the optimizer; ``regs``: the handlers'
        pt_regs; ``ram`` and ``doorbell``: the shared RAM file and the doorbell socket jump optimization needs."""
        self.machine = machine
        self.arch = arch
        self.symbols = kernel.symbols
        self.scratch = scratch
        self.table = table
        self.regs = regs
        self.enabled = True  # debugfs kprobes/enabled
        # The kernel is booting and cannot take an int3 yet: probes go on stub breakpoints (switch_from_boot).
        self.booting = False
        self.text = KernelText(machine)  # the int3s and jumps of points, and the text under them
        self.sites = ProbeSites(machine, kernel, arch, self.text)  # where a probe goes, and where it may not
        self.slots = InsnSlots(machine, arch, scratch, fully_preemptible)  # what the scratch area's code outlives
        self.kernel = kernel  # the kernel's data through drgn
        self.handlers = Handlers()
        self.dispatcher = Dispatcher(machine, kernel, arch, table, self.slots, self.handlers, regs)
        self.stubs = StubProbes(machine, arch, self.handlers, regs.make_regs, self.dispatcher.step)
        self.optimizer = Optimizer(self, table, regs, ram, doorbell)

    @property
    def points(self) -> dict[int, ProbePoint]:
        """The probe table's points by address (for readers: the listing, the shell, events, tests)."""
        return self.table.points

    # -- registration ------------------------------------------------------------
    def register_kprobe(self, kp: Kprobe, optimize: bool = True) -> None:
        if kp.registered:
            raise InvalidProbe(f"{kp.where()} is already registered (EINVAL)")
        self.table.gone.pop(kp, None)
        self._at_boot(kp)
        try:
            kp.at = self.sites.kprobe_addr(kp)
            addr = self.sites.arming_address(kp)
            self.machine.call(lambda: self._register(kp, addr))
        except BaseException:
            self._refused_at_boot(kp)
            raise
        if optimize:
            self.optimizer.optimize_later([addr])

    def _at_boot(self, kp: Kprobe) -> None:
        """While the kernel boots, a probe not asked anywhere goes on a stub breakpoint, marked to move; one
        that was so during boot and is registered again after it (unregistered, or killed with its module's
        text) is what it was given as."""
        if kp.boot_stub and not self.booting:
            kp.anywhere = kp.boot_stub = False
        if self.booting and not kp.anywhere:
            kp.anywhere = kp.boot_stub = True

    @staticmethod
    def _refused_at_boot(kp: Kprobe) -> None:
        """A refused probe is left as it was given."""
        if kp.boot_stub and not kp.registered:
            kp.anywhere = kp.boot_stub = False

    def addresses(self) -> list[int]:
        """Every probed address, int3 or stub breakpoint, sorted (a jump must displace none of them)."""
        return sorted([*self.points, *self.stubs.points])

    def _register(self, kp: Kprobe, addr: int) -> None:
        if kp.registered:  # given twice in one batch: the kernel's check_kprobe_rereg
            raise InvalidProbe(f"{kp.where()} is already registered (EINVAL)")
        if kp.anywhere:
            self._register_anywhere(kp, addr)
            return
        if addr in self.stubs.points:
            raise InvalidProbe(f"{self.symbols.symbolize(addr)} has a probe anywhere=True: probe it so too "
                               "(EBUSY)")  # fmt: skip
        point = self.points.get(addr)
        for other in self.table.regions(addr):
            self.optimizer.unoptimize(other)
            self._sync(other)
        if point is None:
            where, fn_start, code = self.sites.check_kprobe_address_safe(addr)
            if self.optimizer.guest_blacklist.kprobes_in(addr, addr + 1):
                # Its int3 is refused below; a jump it has put there in place of the int3 is not seen in the text.
                raise ProbeBusy(f"the guest kernel's own kprobe is already at {where}")
            self.arch.check_boundary(code, fn_start, addr, self.text.patched(), where.split("+")[0])
            self.scratch.ensure_mapped()
            slot = self.scratch.alloc(self.arch.slot_size)
            try:
                prep = self.arch.arch_prepare_kprobe(self.text.original(addr, 16), addr, slot, where,
                                                     self.symbols.exception_table())  # fmt: skip
                if prep.copy:
                    self.scratch.write(slot, self.arch.arch_slot_code(prep))
            except BaseException:
                self.scratch.free(slot)
                raise
            point = ProbePoint(addr, where, prep)
            self.points[addr] = point
        point.probes.append(kp)
        kp.registered = True
        kp.addr = addr if kp.symbol_name is None else kp.addr
        kp.resolved = addr
        self._sync(point)

    def _register_anywhere(self, kp: Kprobe, addr: int) -> None:
        """A stub breakpoint: any instruction boundary of kernel text, the blacklist and reserved sites too."""
        where, start, code = self.sites.check_kprobe_address_safe(addr, anywhere=True)
        self.arch.check_boundary(code, start, addr, self.text.patched(), where.split("+")[0])
        if addr in self.points or self.table.regions(addr):
            raise InvalidProbe(f"{where} has an int3 or a jump of a probe: probe it with anywhere=False too "
                               "(EBUSY)")  # fmt: skip
        self.stubs.register(kp, addr, where)
        kp.registered = True
        kp.addr = addr if kp.symbol_name is None else kp.addr
        kp.resolved = addr

    def resync(self, kp: Kprobe, change: Callable[[], None] | None = None) -> None:
        """Re-arm a registered probe's point as its handlers, recorder or guest key now need.

        ``change``, if given, runs first in the same VM stop (so that no hit falls between it and the re-arm).
        """
        addr = kp.resolved

        def work() -> None:
            if change is not None:
                change()
            if kp.registered and addr in self.points:
                self._sync(self.points[addr])

        self.machine.call(work)
        if kp.registered and addr in self.points:
            self.optimizer.optimize_later([addr])

    def register_kprobes(self, kps: Iterable[Kprobe]) -> None:
        """All or nothing: on an error, the ones already registered are unregistered.

        Every int3 goes in during one VM stop, journaled as one batch; then one
        grace period and one more stop place every jump (the kernel's batched
        optimizer).
        """
        todo = list(kps)
        for kp in todo:
            if kp.registered:
                raise InvalidProbe(f"{kp.where()} is already registered (EINVAL)")

        def register_all() -> bool:
            done: list[Kprobe] = []
            with self.machine.journal.batch(), self.scratch.combined():
                try:
                    for kp, addr in zip(todo, addrs, strict=True):
                        self._register(kp, addr)
                        done.append(kp)
                except BaseException:
                    for kp in reversed(done):
                        self._unregister(kp)
                    raise
            return self.optimizer.enqueue(addrs)  # in the same stop

        for kp in todo:
            self.table.gone.pop(kp, None)
            self._at_boot(kp)
        try:
            for kp in todo:
                kp.at = self.sites.kprobe_addr(kp)
            addrs = [self.sites.arming_address(kp) for kp in todo]
            queued = self.machine.call(register_all)
        except BaseException:
            for kp in todo:
                self._refused_at_boot(kp)
            raise
        if queued:
            self.optimizer.kprobe_optimizer(addrs)

    def unregister_kprobe(self, kp: Kprobe) -> None:
        if not kp.registered:
            if self.table.gone.pop(kp, None) is not None:
                return  # killed with its text: nothing left to take out
            raise InvalidProbe(f"{kp.where()} is not registered")
        addr = kp.resolved
        self.machine.call(lambda: self._unregister(kp))
        if addr in self.points:  # the others there may be optimizable now
            self.optimizer.optimize_later([addr])

    def unregister_kprobes(self, kps: Iterable[Kprobe]) -> None:
        """Every registered (or killed) one of ``kps`` in one VM stop, journaled as one batch."""
        kps = list(kps)
        for kp in kps:
            self.table.gone.pop(kp, None)
        todo = [kp for kp in kps if kp.registered]

        def unregister_all() -> None:
            with self.machine.journal.batch():
                for kp in todo:
                    if kp.registered:  # not when given twice
                        self._unregister(kp)

        self.machine.call(unregister_all)
        # Points that other probes still share may be optimizable now.
        self.optimizer.optimize_later(sorted({kp.resolved for kp in todo if kp.resolved in self.points}))

    def kill_kprobe(self, kp: Kprobe) -> None:
        """``kill_kprobe``: the text under a registered ``kp`` is about to be freed.  Its original bytes go
        back now (nothing qprobe wrote may outlive the text); flagged GONE, its counts kept, listed until
        unregistered or registered again."""
        at = kp.at or kp.resolved
        # Flags as the kernel's list shows a killed probe (report_probe), and qprobe's own first.
        flags = ("[ANYWHERE]" if kp.anywhere else "") + "[GONE]" + ("[FTRACE]" if at != kp.resolved else "")
        line = (at, f"{self.symbols.symbolize(at)}    {flags}")
        self.unregister_kprobe(kp)
        kp.flags |= KPROBE_FLAG_GONE
        self.table.gone[kp] = line

    @contextmanager
    def reviving(self, kp: Kprobe) -> Iterator[None]:
        """A killed ``kp`` registered again in the block (its text is back): off the [GONE] list and its flag
        cleared; both back if the block fails, so that it stays listed as it was."""
        killed = self.table.gone.pop(kp, None)
        kp.flags &= ~KPROBE_FLAG_GONE
        try:
            yield
        except QprobeError:
            kp.flags |= KPROBE_FLAG_GONE
            if killed is not None:
                self.table.gone[kp] = killed
            raise

    def _unregister(self, kp: Kprobe) -> None:
        if kp.anywhere:
            self.stubs.unregister(kp)
            kp.registered = False
            return
        addr = kp.resolved
        point = self.points[addr]
        self.optimizer.sync_missed(point)
        point.probes.remove(kp)
        kp.registered = False
        self._sync(point)
        if not point.probes:
            if point.opt is not None:
                self.optimizer.unoptimize(point)
            del self.points[addr]
            self.slots.free(point.prep.slot_addr, dirty=bool(point.boosted) or self.dispatcher.in_slot(point))
        if not self.points:
            self.dispatcher.remove()

    def enable_kprobe(self, kp: Kprobe) -> None:
        self._set_disabled(kp, False)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self._set_disabled(kp, True)

    def _set_disabled(self, kp: Kprobe, disabled: bool) -> None:
        if not kp.registered:
            kp.flags = (kp.flags | KPROBE_FLAG_DISABLED) if disabled else (kp.flags & ~KPROBE_FLAG_DISABLED)
            return

        def change() -> None:
            kp.flags = (kp.flags | KPROBE_FLAG_DISABLED) if disabled else (kp.flags & ~KPROBE_FLAG_DISABLED)
            if kp.anywhere:
                self.stubs.sync(self.stubs.points[kp.resolved], self.enabled)
            else:
                self._sync(self.points[kp.resolved])

        self.machine.call(change)
        if not disabled and not kp.anywhere:
            self.optimizer.optimize_later([kp.resolved])  # as the kernel's arm_kprobe: int3 first, then the jump

    def set_enabled(self, on: bool) -> None:
        """debugfs kprobes/enabled: arm or disarm everything, keeping each probe's own state."""

        def change() -> None:
            self.enabled = on
            for point in self.points.values():
                self._sync(point)
            for stub in self.stubs.points.values():
                self.stubs.sync(stub, on)

        self.machine.call(change)
        if on:
            self.optimizer.optimize_later(list(self.points))

    def set_optimization(self, on: bool) -> None:
        """debug.kprobes_optimization: optimize every point that can be (the kernel's optimize_all_kprobes),
        or put every jump back to an int3 (unoptimize_all_kprobes)."""
        if on and not self.optimizer.available:
            raise TargetError(self.optimizer.unavailable)

        def change() -> None:
            self.optimizer.enabled = on
            for point in self.points.values():
                self._sync(point)

        self.machine.call(change)
        if on:
            self.optimizer.optimize_later(list(self.points))

    def switch_from_boot(self) -> list[int]:
        """Boot is done (stop loop, every vCPU stopped): the probes on stub breakpoints only because of boot
        (``boot_stub``) go to the int3 path where it accepts them; the addresses to optimize.

        The same Kprobe objects move, their counts go on.  Those the int3 path refuses stay stubs, listed
        [ANYWHERE]: blacklisted, on a jump-label or static-call site the kernel rewrites at run time, a
        notrace function's kprobe event (marked anywhere when defined), and retired (GONE) __init text.
        No hit is missed or counted twice: a stub hit is handled and its instruction stepped within the
        stop that reports it, so none is part way now, and nothing was on the int3 path yet.  A vCPU
        stopped on a stub's address has not run that instruction: it takes the int3, there or (past an
        __fentry__ site, see ProbeSites.arming_address) on the next instruction.  A vCPU stopped on that
        next instruction was counted at the stub: it runs the instruction before the int3 goes in.
        """
        self.booting = False
        moves: list[tuple[Kprobe, int, int]] = []
        for point in list(self.stubs.points.values()):
            for kp in point.probes:
                if not kp.boot_stub or kp.gone:
                    continue
                kp.anywhere = False
                new = self.sites.arming_address(kp)
                kp.anywhere = True
                if new == point.addr or new not in self.stubs.points:  # not onto another stub
                    moves.append((kp, point.addr, new))
        passed = {new for _kp, old, new in moves if new != old}
        for tid in self.machine.vcpus:
            ip = self.arch.ip(self.machine.gdb.read_registers(tid))
            if ip in passed:
                self.dispatcher.step(tid, ip)
        moved: list[int] = []
        with self.machine.journal.batch():
            for kp, _old, _new in moves:  # all off first: two probes of one address move together
                self.stubs.unregister(kp)
                kp.anywhere = kp.boot_stub = kp.registered = False
            for kp, old, new in moves:
                try:
                    self._register(kp, new)
                except QprobeError as exc:  # refused by the int3 path: back on its stub
                    log.debug("%s stays on a stub breakpoint: %s", kp.where(), exc)
                    kp.anywhere = kp.boot_stub = True
                    self._register_anywhere(kp, old)
                    continue
                moved.append(new)
        return sorted(set(moved))

    # -- arming (stop-loop thread) -----------------------------------------------
    def _sync(self, point: ProbePoint) -> None:
        if point.opt is not None:
            self.optimizer.sync_missed(point)  # count the hits so far for the probes as they were
        want = self.enabled and point.wants_arming()
        if point.opt is not None and (not want or self.optimizer.why_not_kept(point)):
            self.optimizer.unoptimize(point)
        if want and not point.armed:
            self.dispatcher.install()
            self.table.touched.add(point.addr)
            point.int3 = self.text.patch(point.addr, self.arch.breakpoint, "int3", point.prep.slot_addr)
        elif not want and point.int3 is not None:
            self.text.unpatch(point.int3)
            point.int3 = None

    def remove_all(self, grace: float = 0.1) -> None:
        """Unregister every probe, then unmap the scratch area (exit path).

        Between the two the VM runs for ``grace`` seconds with no probe armed,
        so that a context interrupted inside a boosted copy has returned to it
        and left it (``InsnSlots.wait_out``); vCPUs still inside the area are then stepped out.
        """

        def disarm() -> None:
            self.table.gone.clear()
            self.stubs.remove_all()
            for point in list(self.points.values()):
                for kp in list(point.probes):
                    self._unregister(kp)
            if self.dispatcher.hooked:
                self.dispatcher.drain()

        def unmap() -> None:
            if self.dispatcher.hooked:
                self.dispatcher.drain()  # a vCPU part way into a trap-step finishes it before any is stepped out
            self.slots.evacuate()
            self.optimizer.close()
            self.slots.trampolines.clear()
            self.dispatcher.remove(final=True)
            self.scratch.unmap()
            self.slots.unmapped()

        self.machine.call(disarm)
        held = self.slots.wait_out(grace, self.optimizer.check.preempted_in)
        if held is not None:  # the area stays mapped, with the undo journal for a later attach to unmap it
            self.optimizer.close()
            raise ProbeError(f"qprobe's scratch area stays mapped: after {PREEMPTED_WAIT:g} s {held}")
        self.machine.call(unmap)

"""When a hit happened: its time on the guest's trace clock, and its place among all hits."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qprobe.events.timeline import CycleOrder, Timeline
from qprobe.kernel.clock import NSEC_PER_SEC, StopClock, TraceClock

if TYPE_CHECKING:
    from qprobe.core.regs import PtRegs
    from qprobe.kernel.program import KernelData
    from qprobe.vmm.machine import Machine

log = logging.getLogger("qprobe")


class HitClock:
    """The guest's trace clock as events stamp their hits, found once, before the first event is armed."""

    def __init__(self, kernel: KernelData, machine: Machine, timeline: Timeline) -> None:
        self._kernel = kernel
        self._machine = machine
        self._timeline = timeline
        self.t0 = time.monotonic()  # event timestamps count from here when the guest's clock cannot be read
        self.note: str | None = None  # why event timestamps are the host's, once that is found
        self._guest: bool | None = None
        self._order = CycleOrder()
        self._cycles_hz = 1.0

    def host_only(self, note: str) -> None:
        """Time every hit by the host's clock, for ``note``'s reason (probes armed before the guest's clock ran)."""
        self.note, self._guest = note, False

    def start(self) -> None:
        """Find how event hits are timed, once (a VM stop at a clock read of the guest's, at most)."""
        if self._guest is not None:
            return
        self.trace_clock, self.stop_clock = TraceClock(self._kernel), StopClock(self._kernel, self._machine)
        self.note = self.trace_clock.unavailable() or self.stop_clock.unavailable()
        if self.note:
            log.warning("event timestamps are seconds since qprobe attached: %s", self.note)
        self._guest = self.note is None
        if self._guest:
            self._cycles_hz = self.stop_clock.rate() * NSEC_PER_SEC
            self._timeline.monotone = self.trace_clock.name == "global"

    def hit_time(self, regs: PtRegs, recorded: bool = False) -> tuple[float, float]:
        """When a hit happened: (seconds on the guest's trace clock, the hit's place among all hits).

        The first is what the guest's own trace prints for it.  The cycle counter's value (x86's
        TSC) comes from the hit itself where the guest read it (a detour's mailbox or ring entry,
        exact), else from the VM stop it is handled in (qprobe.kernel.clock.StopClock: to within
        the time QEMU takes to stop, some tens to hundreds of microseconds).  The place is that
        value in seconds: one counter for every vCPU under QEMU, so hits sort by it exactly, where the
        trace clock (a tick-based clock under TCG) can step between two conversions; a stop's
        estimate is kept in the order the host handled the hits (qprobe.events.timeline.CycleOrder),
        which ``recorded`` (the hit came late, from a ring record) tells it.  Seconds since
        qprobe attached, for both, if this guest's clock cannot be read (``note``).
        """
        if self._guest:
            cycles = regs.cycles
            if cycles is not None:
                cycles = self._order.exact(cycles, regs.vcpu, at_once=not recorded)
            else:
                cycles = self.stop_clock.cycles()  # from the arch's stop timer, good to the stop's latency
                if cycles is not None:
                    cycles = self._order.stop(cycles, regs.vcpu)
            if cycles is not None:
                return self.trace_clock.ns(cycles, regs.vcpu) / NSEC_PER_SEC, cycles / self._cycles_hz
        host = time.monotonic() - self.t0
        return host, host

    def record_times(self, records: Sequence[tuple[int, int]]) -> list[tuple[float, float]]:
        """``hit_time`` of each ring record (its cycle counter value as the detour read it, its vCPU's
        number), in order, no pt_regs made and the guest's clock state read once for the run."""
        if not self._guest:
            host = time.monotonic() - self.t0
            return [(host, host)] * len(records)
        exact = self._order.exact
        points = [(exact(cycles, vcpu, at_once=False), vcpu) for cycles, vcpu in records]
        hz = self._cycles_hz
        return [
            (ns / NSEC_PER_SEC, cycles / hz)
            for ns, (cycles, _) in zip(self.trace_clock.ns_many(points), points, strict=True)
        ]


__all__ = ["HitClock"]

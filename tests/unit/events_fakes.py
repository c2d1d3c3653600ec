"""What the events layer's record tests give an event for a host: a clock and the guest memory of its pt_regs."""

from __future__ import annotations

from types import SimpleNamespace

from qprobe.core.regs import PtRegs

MEM = SimpleNamespace(pgd=0x1000, pgd_of=lambda root: root, paging=SimpleNamespace(task_size_max=lambda: 1 << 47))


class Clock:
    """A ring record's time is its cycle counter's, whichever way it is asked."""

    def hit_time(self, regs: PtRegs, recorded: bool = False) -> tuple[float, float]:
        assert recorded and regs.cycles is not None
        return regs.cycles / 1e9 + regs.vcpu, regs.cycles / 1e9

    def record_times(self, records: list[tuple[int, int]]) -> list[tuple[float, float]]:
        return [(cycles / 1e9 + vcpu, cycles / 1e9) for cycles, vcpu in records]

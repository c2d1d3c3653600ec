"""The probe table: every int3 probe point by address, one for the whole target (the kernel's kprobe_table).

As in kernel/kprobes.c, one table is what registration fills and empties (qprobe.core.kprobes), what the
trap path looks a trap's address up in (qprobe.core.dispatch) and what the optimizer queues and checks
points of (qprobe.core.optimizer).  qprobe.wiring makes it and hands it to each of them.
"""

from __future__ import annotations

from qprobe.core.kprobe import Kprobe
from qprobe.core.point import ProbePoint


class ProbeTable:
    """The probe points by address, every address that ever held one of their int3s, and the killed probes."""

    def __init__(self) -> None:
        self.points: dict[int, ProbePoint] = {}
        # Every address we ever put an int3 at: a trap seen after its int3 went is still ours (Dispatcher._ours).
        self.touched: set[int] = set()
        # Probes killed with the text they were in (kill_kprobe: a module's text about to be freed): their
        # bytes are back, and they stay in the list, [GONE] with their counts, until unregistered or
        # registered again, as the kernel keeps them in its table.  Probe -> its line's address and the rest.
        self.gone: dict[Kprobe, tuple[int, str]] = {}

    def regions(self, addr: int) -> list[ProbePoint]:
        """Optimized points whose displaced instructions cover ``addr`` (other than at their start)."""
        return [p for p in self.points.values() if p.opt is not None and p.addr < addr < p.addr + p.opt.size]


__all__ = ["ProbeTable"]

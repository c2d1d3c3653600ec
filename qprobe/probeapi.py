"""The kprobes API of a Target, named as in <linux/kprobes.h>, and the debugfs kprobes switches.

``Target`` (qprobe.api) inherits it; every method hands the work to the probe tables
qprobe.wiring made for it (``kprobes``, ``kretprobes``, ``watchpoints``) and its stop loop (``machine``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.core.listing import list_probes
from qprobe.core.uprobe import Uprobe
from qprobe.core.watchpoint import Watchpoint
from qprobe.errors import TargetError

if TYPE_CHECKING:
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.uprobes import UprobeManager
    from qprobe.core.watchpoint import Watchpoints
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.memory import GuestMemory


class ProbeAPI:
    """register_kprobe and the rest, on the probe tables of the Target that inherits this."""

    kprobes: KprobeManager
    kretprobes: KretprobeManager
    uprobes: UprobeManager
    watchpoints: Watchpoints
    machine: Machine
    mem: GuestMemory

    def register_kprobe(self, kp: Kprobe) -> None:
        self.kprobes.register_kprobe(kp)

    def unregister_kprobe(self, kp: Kprobe) -> None:
        self.kprobes.unregister_kprobe(kp)

    def register_kprobes(self, kps: Iterable[Kprobe]) -> None:
        self.kprobes.register_kprobes(kps)

    def unregister_kprobes(self, kps: Iterable[Kprobe]) -> None:
        self.kprobes.unregister_kprobes(kps)

    def enable_kprobe(self, kp: Kprobe) -> None:
        self.kprobes.enable_kprobe(kp)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self.kprobes.disable_kprobe(kp)

    def register_uprobe(self, up: Uprobe) -> None:
        """uprobe_register(): the probe in every process that maps the file, now and later (and Uretprobes)."""
        self.uprobes.register_uprobe(up)

    def unregister_uprobe(self, up: Uprobe) -> None:
        self.uprobes.unregister_uprobe(up)

    def register_kretprobe(self, rp: Kretprobe) -> None:
        self.kretprobes.register_kretprobe(rp)

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        self.kretprobes.unregister_kretprobe(rp)

    def register_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        """All or nothing, as register_kprobes."""
        self.kretprobes.register_kretprobes(rps)

    def unregister_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        for rp in list(rps):
            if rp.registered:
                self.unregister_kretprobe(rp)

    def enable_kretprobe(self, rp: Kretprobe) -> None:
        self.kprobes.enable_kprobe(rp.kp)

    def disable_kretprobe(self, rp: Kretprobe) -> None:
        self.kprobes.disable_kprobe(rp.kp)

    def register_watchpoint(self, wp: Watchpoint) -> None:
        """Arm a data watchpoint (QEMU's, not the guest's debug registers)."""
        self.watchpoints.register_watchpoint(wp)

    def unregister_watchpoint(self, wp: Watchpoint) -> None:
        self.watchpoints.unregister_watchpoint(wp)

    def set_kprobes_enabled(self, on: bool) -> None:
        """debugfs ``kprobes/enabled``."""
        self.kprobes.set_enabled(on)

    def list_probes(self) -> str:
        """The debugfs kprobes/list format (nmissed of optimized probes synced when the VM is up)."""
        if not self.machine.alive:
            return list_probes(self.kprobes, sync=False)
        return self.machine.call(lambda: list_probes(self.kprobes))

    @property
    def kprobes_optimization(self) -> bool:
        """debug.kprobes_optimization: whether probes are jump-optimized when they can be."""
        return self.kprobes.optimizer.enabled

    def set_kprobes_optimization(self, on: bool) -> None:
        """Turn jump optimization on (optimizing what can be) or off (every probe back to an int3)."""
        opt = self.kprobes.optimizer
        if on and not opt.available:
            raise TargetError("jump optimization needs qprobe's own QEMU (a doorbell device and shared RAM)")

        def change() -> None:
            opt.enabled = on
            for point in self.kprobes.points.values():
                self.kprobes._sync(point)

        self.machine.call(change)
        if on:
            opt.queue.optimize_later(list(self.kprobes.points))

    def blacklist(self) -> list[str]:
        return [str(e) for e in self.kprobes.sites.blacklist]

    def text_snapshot(self, addrs: Iterable[int], size: int = 64) -> dict[int, bytes]:
        return {a: self.mem.read(a, size) for a in addrs}


__all__ = ["ProbeAPI"]

"""The kprobes API of a Target, named as in <linux/kprobes.h>, and the debugfs kprobes switches.

``Target`` (qprobe.api) forwards these methods to the :class:`ProbeAPI` it holds; every one hands the work
to the probe tables qprobe.wiring made (``kprobes``, ``kretprobes``, ``watchpoints``) and the stop loop
(``machine``), which it reads through :class:`Probing`, its narrow view of the target's parts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.core.listing import list_probes
from qprobe.core.uprobe import Uprobe
from qprobe.core.watchpoint import Watchpoint

if TYPE_CHECKING:
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.uprobes import UprobeManager
    from qprobe.core.watchpoint import Watchpoints
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.memory import GuestMemory


class Probing(Protocol):
    """What the kprobes API uses of a target's parts: the probe tables, the stop loop, guest memory."""

    @property
    def kprobes(self) -> KprobeManager: ...
    @property
    def kretprobes(self) -> KretprobeManager: ...
    @property
    def uprobes(self) -> UprobeManager: ...
    @property
    def watchpoints(self) -> Watchpoints: ...
    @property
    def machine(self) -> Machine: ...
    @property
    def mem(self) -> GuestMemory: ...


class ProbeAPI:
    """register_kprobe and the rest, on the probe tables of one target."""

    def __init__(self, parts: Probing) -> None:
        self.parts = parts

    def register_kprobe(self, kp: Kprobe) -> None:
        self.parts.kprobes.register_kprobe(kp)

    def unregister_kprobe(self, kp: Kprobe) -> None:
        self.parts.kprobes.unregister_kprobe(kp)

    def register_kprobes(self, kps: Iterable[Kprobe]) -> None:
        self.parts.kprobes.register_kprobes(kps)

    def unregister_kprobes(self, kps: Iterable[Kprobe]) -> None:
        self.parts.kprobes.unregister_kprobes(kps)

    def enable_kprobe(self, kp: Kprobe) -> None:
        self.parts.kprobes.enable_kprobe(kp)

    def disable_kprobe(self, kp: Kprobe) -> None:
        self.parts.kprobes.disable_kprobe(kp)

    def register_uprobe(self, up: Uprobe) -> None:
        """uprobe_register(): the probe in every process that maps the file, now and later (and Uretprobes)."""
        self.parts.uprobes.register_uprobe(up)

    def unregister_uprobe(self, up: Uprobe) -> None:
        self.parts.uprobes.unregister_uprobe(up)

    def register_kretprobe(self, rp: Kretprobe) -> None:
        self.parts.kretprobes.register_kretprobe(rp)

    def unregister_kretprobe(self, rp: Kretprobe) -> None:
        self.parts.kretprobes.unregister_kretprobe(rp)

    def register_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        """All or nothing, as register_kprobes."""
        self.parts.kretprobes.register_kretprobes(rps)

    def unregister_kretprobes(self, rps: Iterable[Kretprobe]) -> None:
        for rp in list(rps):
            if rp.registered:
                self.unregister_kretprobe(rp)

    def enable_kretprobe(self, rp: Kretprobe) -> None:
        self.parts.kprobes.enable_kprobe(rp.kp)

    def disable_kretprobe(self, rp: Kretprobe) -> None:
        self.parts.kprobes.disable_kprobe(rp.kp)

    def register_watchpoint(self, wp: Watchpoint) -> None:
        """Arm a data watchpoint (QEMU's, not the guest's debug registers)."""
        self.parts.watchpoints.register_watchpoint(wp)

    def unregister_watchpoint(self, wp: Watchpoint) -> None:
        self.parts.watchpoints.unregister_watchpoint(wp)

    def set_kprobes_enabled(self, on: bool) -> None:
        """debugfs ``kprobes/enabled``."""
        self.parts.kprobes.set_enabled(on)

    def list_probes(self) -> str:
        """The debugfs kprobes/list format (nmissed of optimized probes synced when the VM is up)."""
        if not self.parts.machine.alive:
            return list_probes(self.parts.kprobes, sync=False)
        return self.parts.machine.call(lambda: list_probes(self.parts.kprobes))

    @property
    def kprobes_optimization(self) -> bool:
        """debug.kprobes_optimization: whether probes are jump-optimized when they can be."""
        return self.parts.kprobes.optimizer.enabled

    def set_kprobes_optimization(self, on: bool) -> None:
        """Turn jump optimization on (optimizing what can be) or off (every probe back to an int3)."""
        self.parts.kprobes.set_optimization(on)

    def blacklist(self) -> list[str]:
        return [str(e) for e in self.parts.kprobes.sites.blacklist]

    def text_snapshot(self, addrs: Iterable[int], size: int = 64) -> dict[int, bytes]:
        return {a: self.parts.mem.read(a, size) for a in addrs}


__all__ = ["ProbeAPI", "Probing"]

"""A Target's parts, said once: what it was given, and what qprobe.wiring (and qprobe.bootprobes) make.

:class:`Parts` is the one place they are declared.  qprobe.wiring makes one per target and assigns the
parts it builds as it gets to them; the objects a Target is composed of (qprobe.probeapi, qprobe.eventapi,
qprobe.guest, qprobe.views, qprobe.lifetime) each read it through a narrow Protocol of their own, and
``Target`` (qprobe.api) shows its users the parts they read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qprobe.events.timeline import Timeline

if TYPE_CHECKING:
    from qprobe.arch import Arch
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.optimizer import Optimizer
    from qprobe.core.regsmaker import RegsMaker
    from qprobe.core.uprobes import UprobeManager
    from qprobe.core.watchpoint import Watchpoints
    from qprobe.events import TraceEvent
    from qprobe.events.clock import HitClock
    from qprobe.events.kprobe import KprobeBackend
    from qprobe.events.uprobe import UprobeBackend
    from qprobe.images import Image
    from qprobe.kernel.bootslide import BootSlide
    from qprobe.kernel.bootswitch import SwitchSlide
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.console import Console, GuestShell
    from qprobe.vmm.gdbmi import GdbMiRemote
    from qprobe.vmm.gdbremote import GdbRemote
    from qprobe.vmm.journal import Journal
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.memory import GuestMemory
    from qprobe.vmm.qemu import QemuProcess
    from qprobe.vmm.scratch import ScratchArea


@dataclass(eq=False, repr=False)  # repr would read parts not made yet
class Parts:
    """One target's parts.  From ``gdb`` on, a part is there once the wiring got as far as making it (an
    attach may fail before): until then the attribute is not set at all, as ``hasattr`` tells."""

    # What it was given and keeps.
    qemu: QemuProcess | None  # qprobe's own QEMU; None when attached to another
    address: str  # the gdbstub's
    image: Image | None = None  # set by boot(); None when attached to a foreign QEMU
    events: dict[str, TraceEvent] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)
    timings: dict[str, float] = field(default_factory=dict)
    console: Console | None = None  # the kernel's console: its log, and the oopses in it
    guest_shell: GuestShell | None = None  # the shell run() talks to (its own port, or the console)
    # What qprobe.wiring makes (and qprobe.bootprobes, as the kernel boots).
    gdb: GdbRemote | GdbMiRemote = field(init=False)
    arch: Arch = field(init=False)
    mem: GuestMemory = field(init=False)
    symbols: Symbols = field(init=False)
    slide: int = field(init=False)
    cmdline: str = field(init=False)
    journal: Journal = field(init=False)
    kernel: KernelData = field(init=False)
    recovered: int = field(init=False)  # what an earlier qprobe left undone, and this one undid
    machine: Machine = field(init=False)
    scratch: ScratchArea = field(init=False)
    regs_maker: RegsMaker = field(init=False)  # every handler's pt_regs
    kprobes: KprobeManager = field(init=False)
    optimizer: Optimizer = field(init=False)  # the kprobes' jumps, and the guest's rings and counters behind them
    kretprobes: KretprobeManager = field(init=False)
    uprobes: UprobeManager = field(init=False)
    kprobe_backend: KprobeBackend = field(init=False)  # what kprobe events hold probes by
    uprobe_backend: UprobeBackend = field(init=False)  # and uprobe events theirs
    clock: HitClock = field(init=False)  # when each event hit happened
    watchpoints: Watchpoints = field(init=False)
    boot_slide: BootSlide | SwitchSlide = field(init=False)  # boot-time probes only: how the slide was found


__all__ = ["Parts"]

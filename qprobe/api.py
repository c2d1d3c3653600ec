"""The Python API: ``qprobe.boot()`` / ``qprobe.attach()`` give a ``Target``.

::

    import qprobe
    with qprobe.boot("debian-cloud", smp=2) as t:
        kp = qprobe.Kprobe(symbol_name="ksys_lseek", pre_handler=lambda kp, regs: print(regs.si))
        t.register_kprobe(kp)
        print(t.run("workload lseek 3").output)
        t.unregister_kprobe(kp)

``Target`` is a façade: qprobe.wiring puts its parts (qprobe.parts) together (qprobe.bootprobes, for a kernel
probed from its first instruction) and the objects over them, and its methods hand the work to those
objects: ``guest`` (qprobe.guest: commands, waiting, records), ``views`` (qprobe.views: the running kernel
read), ``lifetime`` (qprobe.lifetime: its end), ``probe_api`` (qprobe.probeapi: the kprobes API) and
``event_api`` (qprobe.eventapi: the kprobe_events API).  It inherits nothing: the kprobes and kprobe_events
methods, and the parts its users read, are forwarded to the object that has them (qprobe.facade), and
cost the class no method of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from qprobe.bootprobes import BootProbing
from qprobe.eventapi import EventAPI
from qprobe.facade import Via, forward
from qprobe.probeapi import ProbeAPI
from qprobe.wiring import Wiring

if TYPE_CHECKING:
    import drgn

    from qprobe.arch import Arch
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.regs import PtRegs
    from qprobe.core.uprobes import UprobeManager
    from qprobe.events import TraceEvent
    from qprobe.events.clock import HitClock
    from qprobe.events.modules import ModuleNotifier
    from qprobe.events.timeline import Timeline
    from qprobe.fetch.dialect import Dialect
    from qprobe.guest import Guest
    from qprobe.images import Image
    from qprobe.kernel.bootslide import BootSlide
    from qprobe.kernel.bootswitch import SwitchSlide
    from qprobe.kernel.program import KernelData, Stack, Task
    from qprobe.kernel.symbols import Symbols
    from qprobe.lifetime import Lifetime
    from qprobe.parts import Parts
    from qprobe.views import KernelViews
    from qprobe.vmm.console import Console, GuestShell, RunResult
    from qprobe.vmm.gdbmi import GdbMiRemote
    from qprobe.vmm.gdbremote import GdbRemote
    from qprobe.vmm.journal import Journal
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.memory import GuestMemory
    from qprobe.vmm.qemu import QemuProcess

SESSION_FILE = "session.json"


@dataclass(frozen=True)
class BootPlan:
    """What a Target whose QEMU starts halted (-S) does before the kernel's first instruction."""

    arm: Callable[[Target], None]  # registers the boot-time probes (stub breakpoints: nothing else works yet)
    image: Path | None  # the kernel image QEMU boots: its KASLR alignment (None: not known)
    cmdline: str | None  # the kernel command line QEMU gives it (None: not known)
    unknown: str = ""  # why either is not known


class Target:
    """A running guest kernel under qprobe's control."""

    # The objects it is a façade over, which qprobe.wiring makes: each on the target's parts.
    parts: Parts
    lifetime: Lifetime
    guest: Guest
    views: KernelViews
    probe_api: ProbeAPI
    event_api: EventAPI
    boot_probing: BootProbing | None

    # -- the parts its users read (qprobe.parts says what each is) ----------------------
    qemu: Via[QemuProcess | None] = Via("parts")
    image: Via[Image | None] = Via("parts")
    events: Via[dict[str, TraceEvent]] = Via("parts")
    timeline: Via[Timeline] = Via("parts")
    timings: Via[dict[str, float]] = Via("parts")
    console: Via[Console | None] = Via("parts")
    guest_shell: Via[GuestShell | None] = Via("parts")
    gdb: Via[GdbRemote | GdbMiRemote] = Via("parts")
    arch: Via[Arch] = Via("parts")
    mem: Via[GuestMemory] = Via("parts")
    symbols: Via[Symbols] = Via("parts")
    slide: Via[int] = Via("parts")
    cmdline: Via[str] = Via("parts")
    journal: Via[Journal] = Via("parts")
    kernel: Via[KernelData] = Via("parts")
    recovered: Via[int] = Via("parts")
    machine: Via[Machine] = Via("parts")
    kprobes: Via[KprobeManager] = Via("parts")
    kretprobes: Via[KretprobeManager] = Via("parts")
    uprobes: Via[UprobeManager] = Via("parts")
    clock: Via[HitClock] = Via("parts")
    boot_slide: Via[BootSlide | SwitchSlide] = Via("parts")  # boot-time probes only: how the slide was found

    # -- the kprobes API (qprobe.probeapi), as <linux/kprobes.h> names it -------------
    register_kprobe = forward(ProbeAPI.register_kprobe, "probe_api")
    unregister_kprobe = forward(ProbeAPI.unregister_kprobe, "probe_api")
    register_kprobes = forward(ProbeAPI.register_kprobes, "probe_api")
    unregister_kprobes = forward(ProbeAPI.unregister_kprobes, "probe_api")
    enable_kprobe = forward(ProbeAPI.enable_kprobe, "probe_api")
    disable_kprobe = forward(ProbeAPI.disable_kprobe, "probe_api")
    register_uprobe = forward(ProbeAPI.register_uprobe, "probe_api")
    unregister_uprobe = forward(ProbeAPI.unregister_uprobe, "probe_api")
    register_kretprobe = forward(ProbeAPI.register_kretprobe, "probe_api")
    unregister_kretprobe = forward(ProbeAPI.unregister_kretprobe, "probe_api")
    register_kretprobes = forward(ProbeAPI.register_kretprobes, "probe_api")
    unregister_kretprobes = forward(ProbeAPI.unregister_kretprobes, "probe_api")
    enable_kretprobe = forward(ProbeAPI.enable_kretprobe, "probe_api")
    disable_kretprobe = forward(ProbeAPI.disable_kretprobe, "probe_api")
    register_watchpoint = forward(ProbeAPI.register_watchpoint, "probe_api")
    unregister_watchpoint = forward(ProbeAPI.unregister_watchpoint, "probe_api")
    set_kprobes_enabled = forward(ProbeAPI.set_kprobes_enabled, "probe_api")
    list_probes = forward(ProbeAPI.list_probes, "probe_api")
    kprobes_optimization: Via[bool] = Via("probe_api")  # read-only there
    set_kprobes_optimization = forward(ProbeAPI.set_kprobes_optimization, "probe_api")
    blacklist = forward(ProbeAPI.blacklist, "probe_api")
    text_snapshot = forward(ProbeAPI.text_snapshot, "probe_api")

    # -- the kprobe_events API (qprobe.eventapi) --------------------------------------
    add_event = forward(EventAPI.add_event, "event_api")
    add_events = forward(EventAPI.add_events, "event_api")
    ring_buffer = forward(EventAPI.ring_buffer, "event_api")
    remove_event = forward(EventAPI.remove_event, "event_api")
    remove_events = forward(EventAPI.remove_events, "event_api")
    user_file_kind = forward(EventAPI.user_file_kind, "event_api")
    resolve_user_symbol = forward(EventAPI.resolve_user_symbol, "event_api")
    user_elf = forward(EventAPI.user_elf, "event_api")
    dialect: Via[Dialect] = Via("event_api")
    ftrace_locations: Via[list[int]] = Via("event_api")
    modules: Via[ModuleNotifier] = Via("event_api")
    trace_events: Via[frozenset[tuple[str, str]]] = Via("event_api")

    def __init__(self, gdb_address: str, vmlinux: str | Path, *, ram: Path | None = None, ram_size: int = 0,
                 console: Path | None = None, qemu: QemuProcess | None = None,
                 boot_timeout: float = 60.0, doorbell: Path | None = None, shell: Path | None = None,
                 system_map: Path | None = None, transport: str = "rsp",
                 boot: BootPlan | None = None) -> None:  # fmt: skip
        """``boot``: the QEMU was started halted (-S); probe the kernel from its first instructions on."""
        wiring = Wiring(gdb_address, vmlinux, qemu=qemu, ram=ram, ram_size=ram_size, console=console,
                        boot_timeout=boot_timeout, doorbell=doorbell, shell=shell, system_map=system_map,
                        transport=transport)  # fmt: skip
        self.parts, self.lifetime = wiring.parts, wiring.lifetime
        self.guest, self.views = wiring.guest, wiring.views
        self.probe_api, self.event_api = wiring.probe_api, wiring.event_api
        self.boot_probing = None
        try:
            wiring.connect(boot is not None)
            if boot is None:
                wiring.attach_running()
            else:
                self.boot_probing = BootProbing(wiring, boot, lambda: boot.arm(self))
                self.boot_probing.boot()
        except BaseException as exc:
            cause = wiring.cause(exc)
            self.lifetime.attach_failed(cause)
            if cause is not exc:
                raise cause from None  # the stall is the cause all the same
            raise
        self.lifetime.register()

    # -- context manager -----------------------------------------------------------
    def __enter__(self) -> Target:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Remove every probe, detach, and stop our own QEMU."""
        self.lifetime.close()

    def interrupt_when_gone(self) -> AbstractContextManager[None]:
        """Within the block, the VM's death raises GoneInterrupt in the main thread at once, wherever it waits.

        For callers that wait on something other than the VM (a REPL's prompt, a test's sleep): the stop
        loop sees QEMU go within a fraction of a second and sends this process's main thread a SIGINT,
        which the handler set here turns into GoneInterrupt; any other SIGINT goes to the handler it
        replaced.  Outside the main thread (where signals cannot be handled) the block runs as it is.
        """
        return self.lifetime.interrupt_when_gone()

    def release_serial_ports(self) -> None:
        """Close the console and the guest shell's port (each of QEMU's takes one client at a time)."""
        self.lifetime.release_serial_ports()

    # -- guest interaction -----------------------------------------------------------
    def run(self, command: str, timeout: float = 60.0) -> RunResult:
        """Run a shell command in the guest; its output is exactly what it wrote (stdout and stderr).

        The guest's shell has a serial port of its own when qprobe booted the VM; the kernel's log goes to
        the console (``console``, ``oopses()``), never into a command's output.
        """
        return self.guest.run(command, timeout)

    def interrupt_guest(self) -> None:
        """Ctrl-C the guest shell's foreground command (as ``run`` started it)."""
        self.guest.interrupt()

    def oopses(self) -> list[str]:
        """The kernel's oops, BUG, WARNING and panic lines on its console since qprobe connected."""
        return self.guest.oopses()

    def wait(self, seconds: float | None = None) -> None:
        """Sleep while the VM runs: ``seconds`` (None: until interrupted), or until it is gone (TargetGone).

        A VM that dies (QEMU killed, a panic with panic=-1, a reboot) is noticed within LIVENESS_POLL.
        """
        self.guest.wait(seconds)

    def sync(self) -> None:
        """Bring ``nhit``/``nmissed`` and event records up to date with what the guest did so far.

        In-guest counters and record rings are otherwise folded every 20 ms; ``run()`` calls
        this when the command is done, so counts read right after it are exact.
        """
        self.guest.sync()

    @property
    def records_lossy(self) -> bool:
        """What a full record ring does with a hit: make the hitting vCPU wait until the host has drained it
        (False, the default: no trace line lost), or drop the record and count it lost (True, as perf's and
        bpftrace's rings do)."""
        return self.guest.records_lossy

    @records_lossy.setter
    def records_lossy(self, on: bool) -> None:
        self.guest.records_lossy = on

    @property
    def records_buffer_size_kb(self) -> int:
        """Each CPU's record ring, in KiB (ftrace's ``buffer_size_kb``): the burst of records a vCPU holds
        before it waits (or, lossy, drops).  Set before the first recorded probe; the ring is the largest power
        of two of entries that fits, the rings half the scratch area at most.  1024 (4096 records) by default."""
        return self.guest.records_buffer_size_kb

    @records_buffer_size_kb.setter
    def records_buffer_size_kb(self, kb: int) -> None:
        self.guest.records_buffer_size_kb = kb

    def record_waits(self) -> int:
        """Hits that found their CPU's record ring full and waited for the host to drain it."""
        return self.guest.record_waits()

    # -- the running kernel ----------------------------------------------------------
    def read(self, addr: int | str, size: int) -> bytes:
        """Kernel virtual memory, read from shared RAM without stopping the VM."""
        return self.views.read(addr, size)

    def registers(self, vcpu: int = 0) -> dict[str, int]:
        return self.views.registers(vcpu)

    @property
    def vcpus(self) -> int:
        return self.views.vcpus

    def stack_trace(self, vcpu: int = 0) -> tuple[dict[str, int], Stack | None]:
        """A vCPU's registers and, when it is in the kernel, its kernel stack (None in user mode).

        Read with every vCPU stopped, so that the stack does not change under the unwinder.
        """
        return self.views.stack_trace(vcpu)

    def gdb_command(self, command: str) -> str | None:
        """A gdb CLI command on the live gdbstub and what it printed; None unless the transport is gdb's.

        gdb may only talk to the stub while the VM is stopped: it runs on the stop loop.
        """
        return self.views.gdb_command(command)

    @property
    def prog(self) -> drgn.Program:
        """The running guest kernel as a drgn ``Program``, created on first use and kept.

        drgn's helpers work on it while probes stay armed, reading guest RAM
        as it is at the moment of the read (in a handler: as it is at the hit,
        the hitting vCPU waits)::

            from drgn.helpers.linux.pid import for_each_task
            comms = [t.comm.string_() for t in for_each_task(target.prog)]
        """
        return self.views.prog

    def var(self, name: str) -> drgn.Object:
        """A kernel variable as a drgn ``Object`` (``target.var("jiffies").value_()``), typed by the debug info.

        A per-CPU variable is its offset, as in C: ``drgn.helpers.linux.percpu.per_cpu(var, cpu)``.
        """
        return self.views.var(name)

    def current(self, regs: PtRegs) -> drgn.Object:
        """The task a handler interrupted, as drgn's ``struct task_struct *`` (``current.comm.string_()``)."""
        return self.views.current(regs)

    def current_task(self, regs: PtRegs) -> Task:
        """A snapshot of the task a handler interrupted: pid, tgid and comm as Python values."""
        return self.views.current_task(regs)


__all__ = ["SESSION_FILE", "BootPlan", "Target"]

"""A target without a VM for the shell's unit tests: real Symbols and kprobe_events parsing, fake hits."""

from __future__ import annotations

import contextlib
import io
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import drgn

from qprobe.arch import ArchBlacklist
from qprobe.arch.x86_64.arch import X86_64
from qprobe.core.blacklist import Blacklist
from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.core.point import ProbePoint
from qprobe.errors import ProbeError, TargetError
from qprobe.events import EventHit, KprobeEvent, TraceEvent, Wildcard
from qprobe.events.timeline import Timeline
from qprobe.events.uprobe import UprobeTraceEvent
from qprobe.fetch import (
    Definition,
    ProbeEvent,
    UprobeEvent,
    check_event,
    format_event,
    parse_definition,
    parse_event,
    parse_uprobe_event,
)
from qprobe.fetch.dialect import Dialect
from qprobe.kernel.program import Stack
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.usyntax import resolve_uprobe_symbols
from qprobe.kernel.vmlinux import Section
from qprobe.shell import Shell
from qprobe.vmm.console import RunResult

TEXT = 0xFFFFFFFF81000000
BANNER = TEXT + 0x1000000
SYMS = [
    ("_stext", TEXT, 0, "other"),
    ("vfs_read", TEXT + 0x1000, 0x1B0, "func"),
    ("vfs_readv", TEXT + 0x1200, 0x100, "func"),
    ("vfs_write", TEXT + 0x1400, 0x1C0, "func"),
    ("ksys_read", TEXT + 0x1600, 0xE0, "func"),
    ("__x64_sys_getppid", TEXT + 0x1800, 0x40, "func"),
    ("linux_banner", BANNER, 0x80, "object"),
]


class FakeProbes:
    def __init__(self, symbols: Symbols) -> None:
        self.enabled = True
        self.points: dict[int, ProbePoint] = {}
        self.optimizer = None  # no jump optimization: every hit reaches the host
        self.sites = FakeSites(symbols)


class FakeSites:
    def __init__(self, symbols: Symbols) -> None:
        self.blacklist = Blacklist(symbols, ArchBlacklist(()))  # the fake symbols list nothing
        self.reserved = None


class FakeTarget:
    """What the shell uses of qprobe.api.Target; ``run("workload getppid N")`` fires N hits of every event."""

    vcpus = 2
    arch = X86_64()

    def __init__(self) -> None:
        sections = [Section(".text", TEXT, 0x2000, 0x1000, True), Section(".rodata", BANNER, 0x1000, 0x3000, False)]
        self.symbols = Symbols(Path("/nonexistent/vmlinux"), "00" * 20, SYMS, sections)
        self.events: dict[str, TraceEvent] = {}
        self.timeline = Timeline()
        self.kprobes = FakeProbes(self.symbols)
        # What kprobe events hold their probes by: no jump optimization, so nothing is counted in the guest.
        self.kprobe_backend = SimpleNamespace(can_count_in_guest=False, trampoline=None)
        self.uprobe_backend = SimpleNamespace(function_name=lambda path, offset: "qpt_target", records_in_guest=False)
        self.kernel = SimpleNamespace(read_task=lambda regs: SimpleNamespace(comm="swapper/0", pid=0))
        self.interrupts = 0  # Ctrl-Cs sent to the guest's foreground command
        self.slide = 0
        self.optimizable = True  # False: as when attached to a QEMU qprobe did not start
        self.optimization_calls: list[bool] = []
        self.gdb_console: Callable[[str], str] | None = None  # the gdb transport's CLI, when there is one
        self.memory = {BANNER: b"Linux version 6.1.0-56-cloud-amd64 (debian-kernel@lists.debian.org)\x00"}
        self.enabled_calls: list[bool] = []
        self.ran: list[str] = []
        self.unsynced: list[TraceEvent] = []

    # events
    def add_event(self, definition: str | Definition | ProbeEvent, callback: object = None) -> TraceEvent:
        if isinstance(definition, str):
            definition = parse_definition(definition)
        if isinstance(definition, Definition) and definition.is_uprobe:  # as the target resolves and parses it
            uev = parse_uprobe_event(resolve_uprobe_symbols(definition, self.resolve_user_symbol), self.dialect)
            assert isinstance(uev, UprobeEvent)
            ute = UprobeTraceEvent(self, uev, callback)  # type: ignore[arg-type]
            ute.make_probe()
            self.events[ute.name] = ute
            return ute
        exists = {"symbol_exists": lambda n: n in self.symbols, "dialect": self.dialect}
        ev = (
            check_event(definition, **exists)
            if isinstance(definition, ProbeEvent)
            else parse_event(definition, **exists)
        )
        assert isinstance(ev, ProbeEvent)
        te = KprobeEvent(self, ev, callback)  # type: ignore[arg-type]
        te.probe = Kprobe(symbol_name=ev.symbol or "vfs_read", offset=ev.offset)
        te.probe.at = te.probe.resolved = self.symbols.address(te.probe.symbol_name) + ev.offset  # as registered
        self.events[te.name] = te
        return te

    def add_events(self, definition: str | Definition, callback: object = None, filter: str | None = None) -> Wildcard:
        raise ProbeError("the shell's fake target arms no wildcard events")

    def resolve_user_symbol(self, path: str, spec: str) -> int:
        if path != "/bin/uprog" or spec != "qpt_target":
            raise ProbeError(f"{path} has no function {spec!r}")
        return 0x1A50

    def interrupt_guest(self) -> None:
        self.interrupts += 1

    def record_waits(self) -> int:
        return 0

    def wait(self, seconds: float | None = None) -> None:
        time.sleep(seconds or 0)

    def interrupt_when_gone(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def remove_events(self, events: list[TraceEvent]) -> None:
        for te in events:
            self.remove_event(te)

    def remove_event(self, te: TraceEvent | str) -> None:
        name = te if isinstance(te, str) else te.name
        if name not in self.events:
            raise ProbeError("no such event")
        del self.events[name]

    def fire(self, te: TraceEvent, comm: str = "workload", pid: int = 42, cpu: int = 0, **args: str) -> None:
        hit = EventHit(
            event=te.definition.event,
            cpu=cpu,
            pid=pid,
            comm=comm,
            ts=1.5,
            addr=TEXT + 0x1800,
            symbol="__x64_sys_getppid+0x0",
            args=dict(args),
            body="(__x64_sys_getppid+0x0/0x40)",
        )
        te.nhit += 1
        if te.probe is not None:  # the probe's own count, which the guest keeps for every hit
            te.probe.nhit += 1
        te.hits.append(hit)
        if te.callback is not None:
            te.callback(hit)

    def list_probes(self) -> str:
        return "".join(f"{TEXT + 0x1800:016x}  k  {te.definition.probe_point}+0x0\n" for te in self.events.values())

    def set_kprobes_enabled(self, on: bool) -> None:
        self.kprobes.enabled = on
        self.enabled_calls.append(on)

    def enable_kprobe(self, kp: Kprobe) -> None:
        kp.flags &= ~2

    def disable_kprobe(self, kp: Kprobe) -> None:
        kp.flags |= 2

    def enable_kretprobe(self, rp: Kretprobe) -> None:
        self.enable_kprobe(rp.kp)

    def disable_kretprobe(self, rp: Kretprobe) -> None:
        self.disable_kprobe(rp.kp)

    def set_kprobes_optimization(self, on: bool) -> None:
        if on and not self.optimizable:
            raise TargetError("jump optimization needs qprobe's own QEMU (a doorbell device and shared RAM)")
        self.optimization_calls.append(on)

    @property
    def ftrace_locations(self) -> list[int]:
        return []

    @property
    def dialect(self) -> Dialect:
        return Dialect(registers=frozenset(self.arch.registers.pt_regs))  # a kernel's: its architecture's %REG

    @property
    def modules(self) -> SimpleNamespace:
        return SimpleNamespace(loaded=list)  # no modules

    @property
    def prog(self) -> drgn.Program:
        return drgn.Program()  # nothing loaded: no kernel behind the fake

    def blacklist(self) -> list[str]:
        return ["0xffffffff81e00000-0xffffffff81e00040\tasm_exc_int3"]

    # memory and guest
    def read(self, addr: int, size: int) -> bytes:
        for base, data in self.memory.items():
            if base <= addr and addr + size <= base + len(data) + 0x100:
                return (data + bytes(0x100))[addr - base : addr - base + size]
        raise TargetError(f"cannot read {addr:#x}: not mapped")

    def registers(self, vcpu: int = 0) -> dict[str, int]:
        return {"rax": 1, "rbx": (1 << 64) - 2, "rip": TEXT + 0x1010, "eflags": 0x246, "cs": 0x33, "rsp": 0x7FFC0}

    def stack_trace(self, vcpu: int = 0) -> tuple[dict[str, int], Stack | None]:
        return self.registers(vcpu), None  # in user mode: no kernel stack

    def gdb_command(self, command: str) -> str | None:
        return None if self.gdb_console is None else self.gdb_console(command)

    def sync(self) -> None:
        """Hits the guest made that reach the host only when it drains the record rings (``unsynced``)."""
        pending, self.unsynced = self.unsynced, []
        for te in pending:
            self.fire(te)

    def run(self, command: str, timeout: float = 60.0) -> RunResult:
        self.ran.append(command)
        if command.startswith("interrupted "):  # Ctrl-C while it runs, its last hits still in the guest's ring
            self.unsynced += [te for te in self.events.values() for _ in range(int(command.split()[1]))]
            raise KeyboardInterrupt
        m = re.fullmatch(r"workload (\w+) (\d+)(?: (\d+))?(?: lose (\d+))?", command)
        if m is None:
            return RunResult(command, f"sh: {command.split()[0]}: not found", 127)
        n = int(m.group(2))
        for te in list(self.events.values()):
            for i in range(n):
                self.fire(te, count=str(int(m.group(3) or 0) or i))
            if m.group(4) and te.probe is not None:  # hits the guest made that no record reached (a full ring)
                te.probe.nmissed += int(m.group(4))
                te.probe.nlost += int(m.group(4))
        return RunResult(command, f"workload mode={m.group(1)} n={n} pid=42 ret=1 errors=0", 0)


def make_shell(target: FakeTarget | None = None) -> tuple[Shell, FakeTarget, io.StringIO]:
    target = target or FakeTarget()
    out = io.StringIO()
    return Shell(target, out=out), target, out  # type: ignore[arg-type]


def listing(te: TraceEvent) -> str:
    return format_event(te.definition)

"""The kprobe_events API of a Target: definitions armed as events, and the kernel facts their language needs.

``Target`` (qprobe.api) forwards these names to the :class:`EventAPI` it holds.  The work is qprobe.events',
on the EventAPI as their registry (qprobe.events.define.EventRegistry): it reads the target's parts it
hands on to events (``arch``, ``symbols``, the backends...) through :class:`Eventing`, never the Target.
"""

from __future__ import annotations

import functools
import logging
import shlex
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from qprobe.errors import InvalidProbe, ProbeError, QprobeError, SymbolError
from qprobe.events.modules import ModuleNotifier
from qprobe.facade import Via
from qprobe.kernel.btf import module_btfs
from qprobe.kernel.features import thread_size
from qprobe.kernel.tracefs import ftrace_locations, probe_dialect, trace_event_names
from qprobe.kernel.userelf import UserElf

log = logging.getLogger("qprobe")

if TYPE_CHECKING:
    from qprobe.arch import Arch
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.uprobes import UprobeManager
    from qprobe.events import EventHit, TraceEvent, Wildcard
    from qprobe.events.clock import HitClock
    from qprobe.events.kprobe import KprobeBackend
    from qprobe.events.samples import SampleCb
    from qprobe.events.timeline import Timeline
    from qprobe.events.uprobe import UprobeBackend
    from qprobe.fetch import Definition, ProbeEvent, UprobeEvent
    from qprobe.fetch.dialect import Dialect
    from qprobe.fetch.uevent import FileKind
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.console import GuestShell, RunResult
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.memory import GuestMemory


class Eventing(Protocol):
    """What the kprobe_events API uses of a target's parts: what events use at a hit and are armed through,
    the stop loop and probe tables (modules followed), and the guest's shell (files read in)."""

    events: dict[str, TraceEvent]
    arch: Arch
    symbols: Symbols
    timeline: Timeline
    kernel: KernelData
    mem: GuestMemory
    clock: HitClock
    kprobe_backend: KprobeBackend
    uprobe_backend: UprobeBackend
    machine: Machine
    kprobes: KprobeManager
    kretprobes: KretprobeManager
    uprobes: UprobeManager

    @property
    def guest_shell(self) -> GuestShell | None: ...


class EventAPI:
    """add_event and the rest, on one target's parts; the registry its events are defined in and hit through."""

    # What events and the module notifier read of their registry: the parts', as they are when read.
    events: Via[dict[str, TraceEvent]] = Via("parts")
    arch: Via[Arch] = Via("parts")
    symbols: Via[Symbols] = Via("parts")
    timeline: Via[Timeline] = Via("parts")
    kernel: Via[KernelData] = Via("parts")
    mem: Via[GuestMemory] = Via("parts")
    clock: Via[HitClock] = Via("parts")
    kprobe_backend: Via[KprobeBackend] = Via("parts")
    uprobe_backend: Via[UprobeBackend] = Via("parts")
    machine: Via[Machine] = Via("parts")
    kprobes: Via[KprobeManager] = Via("parts")
    kretprobes: Via[KretprobeManager] = Via("parts")

    def __init__(self, parts: Eventing, run: Callable[[str], RunResult]) -> None:
        """``run``: a command in the guest's shell (Target.run), to read in a file the host does not see."""
        self.parts = parts
        self.run = run

    @functools.cached_property
    def dialect(self) -> Dialect:
        """What this kernel's kprobe_events accepts beyond 6.1.0's and how it words errors (from vmlinux)."""
        try:
            stack = thread_size(self.kernel)
        except QprobeError:
            stack = None  # $stackN and $argN are refused, naming the unknown THREAD_SIZE
        return probe_dialect(
            self.symbols, self.arch.registers.regoffset_table, stack, lambda: module_btfs(self.kernel.prog)
        )

    @functools.cached_property
    def ftrace_locations(self) -> list[int]:
        """Every ``__fentry__`` site ftrace manages (from vmlinux), sorted; kprobe events need one in their function."""
        return ftrace_locations(self.symbols)

    @functools.cached_property
    def modules(self) -> ModuleNotifier:
        """The guest's loaded modules, followed from the first probe on one (``start()``)."""
        return ModuleNotifier(self)

    @functools.cached_property
    def trace_events(self) -> frozenset[tuple[str, str]]:
        """(system, name) of the guest kernel's trace events, read once through drgn (module events load later)."""
        try:
            return trace_event_names(self.kernel.prog)
        except SymbolError:  # a vmlinux without debug info: no names to check against, as before they were read
            return frozenset()

    def user_file_kind(self, path: str) -> FileKind:
        """What the kernel's ``kern_path`` would find at a guest path: ``regular``, ``other`` or ``missing``.

        The host sees only the guest's dentry cache; a path not in it is looked up once by the guest's shell
        (``ls``), as the kernel's own lookup would read it from the disk.
        """
        files = self.parts.uprobes.files
        kind = self.machine.call(lambda: files.file_kind(path))
        if kind == "missing" and self.parts.guest_shell is not None and path.startswith("/"):
            self.run(f"ls -d {shlex.quote(path)} >/dev/null 2>&1")
            kind = self.machine.call(lambda: files.file_kind(path))
        return kind

    def resolve_user_symbol(self, path: str, spec: str) -> int:
        """The file offset of ``SYMBOL[+OFFS]`` in the guest's ELF file ``path`` (from its symbol tables), or of
        ``SYMBOL@impl[+OFFS]`` (the implementation the guest's loader picked for an indirect function).

        The file is read from the guest's page cache; pages not there are read in once by the guest's shell.
        """
        self.user_elf(path)  # read in, if need be
        return self.parts.uprobes.resolve(path, spec)

    def user_elf(self, path: str) -> UserElf:
        """The guest's ELF file ``path``, as its page cache holds it (read in by the guest's shell if need be)."""
        if self.user_file_kind(path) != "regular":
            raise InvalidProbe(f"{path}: no regular file in the guest (ENOENT)")
        try:
            return self.parts.uprobes.elf(path)
        except InvalidProbe:
            if self.parts.guest_shell is None:
                raise
        self.run(f"cat {shlex.quote(path)} >/dev/null")
        return self.parts.uprobes.elf(path)

    def add_event(
        self,
        definition: str | Definition | ProbeEvent | UprobeEvent,
        callback: Callable[[EventHit], None] | None = None,
        filter: str | None = None,
        anywhere: bool = False,
    ) -> TraceEvent:
        """Arm a kprobe_events or uprobe_events definition (``p:ev vfs_read count=%dx``, ``p:ev /bin/prog:0x1136``,
        ``p:ev /bin/prog:main``); hits go to ``callback`` and ``.hits``.

        A definition a front end parsed already (``qprobe.fetch.parse_definition``, or ``parse_event``)
        is checked with this kernel's symbols rather than parsed again.

        ``filter`` is an ftrace event filter (``count > 100 && comm == "cat"``): hits it rejects are
        only counted (``.filtered``).  ``anywhere`` arms it with a stub breakpoint, which also reaches
        the kernel's blacklist (``Kprobe(anywhere=True)``).
        """
        from qprobe.events.define import add_event

        self.clock.start()
        return add_event(self, definition, callback, filter, anywhere)  # in self.events, or appended to its event

    def ring_buffer(self, definition: str | Definition | ProbeEvent | UprobeEvent, sample_cb: SampleCb) -> TraceEvent:
        """Arm a kprobe_events or uprobe_events definition whose hits go to ``sample_cb`` in batches, off the record
        rings: libbpf's ``ring_buffer__new(map, sample_cb)`` consumer, the handler running later, in another context.

        The optimized probe's detour records each hit (its registers, pid, comm, time) in its CPU's ring
        and returns; the collector thread drains the rings every few milliseconds (at once when one fills)
        and calls ``sample_cb(samples)`` with each run of the event's hits as ``qprobe.events.Samples``
        (columns: ``cpu``, ``pid``, ``comm``, ``ts``, ``args[name]``; iterate for rows).  Nothing waits on
        the handler while it keeps up; when it does not, the rings fill and the hitting vCPU waits for the
        drain (``record_waits()``), or with ``records_lossy`` the records are dropped and counted (``lost``).
        Hits the host takes at once (before the probe's jump is placed) come as batches of one, on the stop
        loop's thread rather than the collector's: a handler that keeps state across calls locks it.

        For counting, filtering, histograms and logging: the hit ran on long before the handler sees it, so
        what must stop the guest (fault injection, writing registers) takes ``add_event``'s callback or a
        kprobe's ``pre_handler``.  The definition must be one the guest records: an entry probe whose arguments
        read registers or ``$comm`` (a uprobe event's return too, ``$retval`` among them: the guest kernel's own
        uprobe records the user registers, where it has CONFIG_UPROBES and qprobe runs its QEMU).  What the handler
        raises is caught, counted (``probe.nfaults``, ``probe.errors``) and reported; the probe stays armed and
        later batches still come.  ``remove_event`` disarms it.
        """
        from qprobe.events.define import add_event

        self.clock.start()
        return add_event(self, definition, sample_cb=sample_cb)

    def add_events(
        self,
        definition: str | Definition | ProbeEvent,
        callback: Callable[[EventHit], None] | None = None,
        filter: str | None = None,
        anywhere: bool = False,
    ) -> Wildcard:
        """Arm a definition on a glob (``p:vfs vfs_* fd=%di``): one event per function that can be probed.

        The events are ``vfs/vfs_read``, ``vfs/vfs_write``...; ``.refused`` says why the other matches were not.
        """
        from qprobe.events.define import add_events

        self.clock.start()
        return add_events(self, definition, callback, filter, anywhere)

    def remove_event(self, event: TraceEvent | str) -> None:
        """Disarm an event given as returned by add_event, as ``GRP/EVENT``, ``EVENT`` or ``-:EVENT``."""
        self.remove_events([event])

    def remove_events(self, events: Iterable[TraceEvent | str]) -> None:
        """Disarm events, every entry probe of them in one VM stop (as ``add_events`` armed them).

        An event removes the probes appended to it too; one already removed (with the event it was
        appended to, say) is left alone.
        """
        from qprobe.events.define import remove_events

        by_id: dict[int, TraceEvent] = {}  # each event once, in the order given
        for event in events:
            if isinstance(event, str):
                name = event.removeprefix("-:")
                matches = [te for key, te in self.events.items() if key == name or key.split("/")[1] == name]
                if not matches:
                    raise ProbeError(f"no such event {name!r} (ENOENT)")
                event = matches[0]
            by_id.setdefault(id(event), event)
        todo = list(by_id.values())
        firsts = {id(te) for te in todo if self.events.get(te.name) is te}

        def removed_alone(te: TraceEvent) -> bool:  # appended to an event that stays
            first = self._appended_to(te)
            return first is not None and id(first) not in firsts

        live = [te for te in todo if id(te) in firsts or removed_alone(te)]
        self.timeline.flush()
        remove_events(live)  # each first's every probe, an appended one's own
        for te in live:
            if id(te) in firsts:
                del self.events[te.name]
            else:
                first = self._appended_to(te)
                assert first is not None
                first.appended.remove(te)

    def _appended_to(self, te: TraceEvent) -> TraceEvent | None:
        """The registered event ``te`` was appended to (the kernel's append rule), if any."""
        first = self.events.get(te.name)
        return first if first is not None and te in first.appended else None


__all__ = ["EventAPI", "Eventing"]

"""The uprobe kind of event: a uprobe_events definition on a file of the guest, armed as a Uprobe.

:class:`UprobeBackend` is all the events see of the core's uprobes (the target holds one as
``uprobe_backend``); :class:`UprobeTraceEvent` makes its probe from its definition
(:class:`qprobe.fetch.UprobeEvent`) and records each hit as trace_uprobe.c would print it:
``name: (0x401136) a=1``, a return ``name: (0x4011a0 <- 0x401136) ret=2``.

An event whose arguments all come from the registers (or are ``$comm``) is recorded in the guest where it
can be: the guest kernel's own uprobes call a handler of qprobe's that writes the hit's user registers into
the record rings (qprobe.core.uguest), and the lines are made from the records off the ring, no VM stop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qprobe.arch.inguest import KeySpec, MapSlot
from qprobe.core.uprobe import Uprobe, Uretprobe
from qprobe.core.uprobes import UprobeManager
from qprobe.errors import InvalidProbe
from qprobe.events.context import HostContext
from qprobe.events.event import TraceEvent, host_keys
from qprobe.events.hit import EventHit
from qprobe.events.inguest import EVENT_KEYS, guest_key, in_guest
from qprobe.events.lines import InOrderLines, line_run
from qprobe.events.recordfmt import arg_column, arg_texts
from qprobe.events.registry import EventHost
from qprobe.events.samples import Samples
from qprobe.fetch import UprobeContext, format_uprobe_event, format_uprobe_hit
from qprobe.fetch.record import record_length

if TYPE_CHECKING:
    from qprobe.arch.inguest import MapKey
    from qprobe.core.kprobe import GuestRecord
    from qprobe.core.regs import PtRegs
    from qprobe.fetch import UprobeEvent
    from qprobe.fetch.args import Value


class UprobeBackend:
    """The uprobes of uprobe events, on the target's uprobe table."""

    def __init__(self, uprobes: UprobeManager) -> None:
        self._uprobes = uprobes

    def register(self, events: Sequence[TraceEvent]) -> None:
        """All or nothing."""
        done: list[Uprobe] = []
        try:
            for te in events:
                if isinstance(te, UprobeTraceEvent) and te.probe is not None:
                    self._uprobes.register_uprobe(te.probe)
                    done.append(te.probe)
        except BaseException:
            for up in done:
                self._uprobes.unregister_uprobe(up)
            raise

    def unregister(self, events: Sequence[TraceEvent]) -> None:
        for te in events:
            if isinstance(te, UprobeTraceEvent) and te.probe is not None and te.probe.registered:
                self._uprobes.unregister_uprobe(te.probe)

    @property
    def counts_in_guest(self) -> bool:
        """Whether a probe that only counts is the guest kernel's own here (qprobe.core.uguest)."""
        guest = self._uprobes.guest
        return guest is not None and guest.unavailable is None

    def swap(self, out: Uprobe, into: Uprobe) -> None:
        """``out`` unregistered and ``into`` registered; ``out`` back if ``into`` cannot be."""
        self._uprobes.unregister_uprobe(out)
        try:
            self._uprobes.register_uprobe(into)
        except BaseException:
            self._uprobes.register_uprobe(out)
            raise

    @property
    def records_in_guest(self) -> bool:
        """Whether a probe's hits can be recorded into the rings by the guest kernel's own uprobes here."""
        return self.records_unavailable is None

    @property
    def records_unavailable(self) -> str | None:
        """Why they cannot (None: they can)."""
        guest = self._uprobes.guest
        return "qprobe has no guest calls here" if guest is None else guest.records_unavailable

    def record_regs(self, values: dict[str, int], cpu: int) -> PtRegs:
        """pt_regs of a hit recorded on the ``cpu``-th vCPU (its user registers, as the kernel passed them)."""
        return self._uprobes.regs.make_regs(values, self._uprobes.machine.vcpus[cpu])

    def keyed_counts(self, up: Uprobe) -> dict[MapKey, MapSlot]:
        guest = self._uprobes.guest
        return guest.keyed_counts(up) if guest is not None else {}

    def make_regs(self, values: dict[str, int], tid: int) -> PtRegs:
        return self._uprobes.regs.make_regs(values, str(tid))

    def function_name(self, path: str, offset: int) -> str:
        """The name of the function of ``path`` that holds file byte ``offset`` (``path:0xOFFS`` if none does)."""
        try:
            elf = self._uprobes.elf(path)
        except Exception:  # a file whose ELF cannot be read names no function
            return f"{path}:{offset:#x}"
        return elf.function_at(offset) or f"{path}:{offset:#x}"


class UprobeHost(EventHost, Protocol):
    """What a uprobe event uses of its target: the host's view and the uprobe backend."""

    uprobe_backend: UprobeBackend


class _UserContext(HostContext):
    """A uprobe hit's FetchContext: the user-mode registers, and where the probed file is mapped."""

    def __init__(self, host: EventHost, regs: PtRegs, retval: int | None, base: int, comm: str | None) -> None:
        super().__init__(host, regs, retval, comm)  # ``comm``: a record's (its task's, read in the guest)
        self._base = base

    def file_address(self, offset: int) -> int:
        """translate_user_vaddr: the probed address, less the probe's file offset, plus ``offset``."""
        return self._base + offset


@dataclass
class UprobeTraceEvent(TraceEvent):
    """A uprobe_events definition on a file of the guest, armed as a Uprobe (``r``: a Uretprobe)."""

    host: UprobeHost
    probe: Uprobe | None = None
    # While a map is folded in the guest: the probe that counts in the event's probe's place, and the map.
    counting: Uprobe | None = None
    guest_map: tuple[tuple[str, ...], str | None, bool] | None = None

    @property
    def udef(self) -> UprobeEvent:
        return self.definition  # type: ignore[return-value]

    @property
    def backend(self) -> UprobeBackend:
        return self.host.uprobe_backend

    def make_probe(self) -> None:
        ev = self.udef
        recordable = in_guest(ev, self.host.arch.registers, returns=True)
        if self.backend.records_in_guest and recordable:
            self.probe = (Uretprobe if ev.is_return else Uprobe)(ev.path, ev.offset, in_guest=True)
            self.probe.recorder = self._guest_records
        elif self.sample_cb is not None:
            why = self.backend.records_unavailable if recordable else "an argument is read from memory at the hit"
            raise InvalidProbe(f"{ev.text}: a ring handler takes an event the guest records, and {why}")
        elif ev.is_return:
            self.probe = Uretprobe(ev.path, ev.offset, ret_handler=self._returned)
        else:
            self.probe = Uprobe(ev.path, ev.offset, handler=self._hit)

    @property
    def registered(self) -> bool:
        return self.probe is not None and self.probe.registered

    @property
    def nmissed(self) -> int:
        return self.probe.nmissed if self.probe is not None else 0

    @property
    def lost(self) -> int:
        return self.probe.nlost if self.probe is not None else 0  # recorded hits a full ring dropped

    @property
    def maxactive(self) -> int:
        return 0

    @property
    def function_name(self) -> str:
        ev = self.udef
        return self.backend.function_name(ev.path, ev.offset)

    def listing(self) -> str:
        """The lines ``cat uprobe_events`` shows for the event, one per probe."""
        return "\n".join(format_uprobe_event(te.udef) for te in self.probes() if isinstance(te, UprobeTraceEvent))

    def can_count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        return self._guest_spec(keys, value, hist) is not None

    def count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        """Fold hits in the guest: the event's probe taken out, and in its place one the guest kernel's uprobes
        call to count (a key of registers, ``$comm``, ``$pid`` or ``$cpu``: a keyed one, for entries), until
        ``stop_counting_in_guest`` puts it back.  A hit in between the two is neither (a process already
        running; a command run for the map starts after)."""
        spec = self._guest_spec(keys, value, hist)
        if spec is None or self.probe is None:
            return False
        ev = self.udef
        counting = (Uretprobe if ev.is_return else Uprobe)(ev.path, ev.offset, in_guest=True)
        counting.guest_key = spec if spec.parts or spec.value is not None else None
        self.backend.swap(self.probe, counting)
        self.counting, self.guest_map = counting, (tuple(keys), value, hist)
        return True

    def stop_counting_in_guest(self) -> dict[tuple[str | int, ...], MapSlot]:
        counting, backend = self.counting, self.backend
        if counting is None or self.guest_map is None or self.probe is None:
            return {}
        raw = backend.keyed_counts(counting) if counting.guest_key is not None else {}
        backend.swap(counting, self.probe)
        if counting.guest_key is None:  # a count: the consumer's own (a return event's hits are returns)
            n = counting.nreturns if self.udef.is_return else counting.nhit
            raw = {(): MapSlot(n)} if n else {}
        self.nhit += sum(slot.count for slot in raw.values())
        keys, _value, hist = self.guest_map
        self.counting = self.guest_map = None
        return host_keys(self, raw, keys, hist, backend.make_regs)

    def _guest_spec(self, keys: Sequence[str], value: str | None, hist: bool) -> KeySpec | None:
        """The key a consumer in the guest folds by, or None where only the host can."""
        if self.filter is not None or not self.registered or not self.backend.counts_in_guest:
            return None
        if value is None and not hist and set(keys) <= set(EVENT_KEYS):
            return KeySpec(())  # the same for every hit: a count
        return guest_key(self.definition, keys, value, hist, self.host.arch.registers)

    def _hit(self, up: Uprobe, regs: PtRegs) -> None:
        self._record(regs, regs.ip, None, None)

    def _returned(self, up: Uprobe, func: int, regs: PtRegs) -> None:
        self._record(regs, regs.ip, func, regs.return_value())

    def _guest_records(self, records: list[GuestRecord]) -> None:
        """A run of hits the guest recorded, each as the handler would have taken it (its ip the probed address,
        or for a return the return address and ``func`` the probed one).

        Made in bulk, as a recorded kprobe's are (each argument's column of text read from the records, the
        lines of a printer's run made together), where every hit's record has one length; else hit by hit.
        """
        if self.sample_cb is not None:
            self._ring_samples(records)
            return
        host, ev = self.host, self.udef
        limit = host.kernel.event_length_limit()
        if limit is not None and (any(a.type.string for a in ev.args) or record_length(ev, [0] * len(ev.args)) > limit):
            self._records_one_by_one(records)
            return
        layout, context, returns = host.arch.registers, self._record_context(), ev.is_return
        columns = [arg_texts(a, layout, context)(records) for a in ev.args]
        times = host.clock.record_times([(rec.values["cycles"], rec.cpu) for rec in records])
        ip_name, flags = layout.gdb_name[layout.ip], layout.gdb_name[layout.flags]
        names, irqs_off = [a.name for a in ev.args], layout.irqs_disabled_flags
        callback = self.callback
        if isinstance(callback, InOrderLines) and self.filter is None:  # a printer's: the run as lines, in bulk
            start = 0
            for stop in range(1, len(records) + 1):  # each stretch of one place (one head) is one LineRun
                if stop < len(records) and _place(records[stop], ip_name) == _place(records[start], ip_name):
                    continue
                head = _head(*_place(records[start], ip_name), returns)
                part = [column[start:stop] for column in columns]
                run = line_run(ev.event, head, names, records[start:stop], part, times[start:stop], flags, irqs_off)
                self.nhit += len(run)
                host.timeline.push_run(run, functools.partial(callback.lines, run))
                start = stop
            return
        labels = [f" {n}=" for n in names]
        rows = list(zip(*columns, strict=True)) if columns else [()] * len(records)
        with host.timeline.batch():  # one hand-on for the run, its callbacks' pushes included
            for rec, texts, (ts, order) in zip(records, rows, times, strict=True):
                ip, func = _place(rec, ip_name)
                body = _head(ip, func, returns) + "".join([label + t for label, t in zip(labels, texts, strict=True)])
                self._emit(EventHit(ev.event, rec.cpu, rec.pid, rec.comm, ts, ip, f"{ip:#x}",
                                    dict(zip(names, texts, strict=True)), body, irqs_off(rec.values[flags]),
                                    f"{func:#x}" if returns else None, self.numbers, self.strings, order))  # fmt: skip

    def _records_one_by_one(self, records: list[GuestRecord]) -> None:
        """``_guest_records`` for a definition whose records differ in length: each hit as the stop path's."""
        make_regs, returns = self.backend.record_regs, self.udef.is_return
        with self.host.timeline.batch():  # one hand-on for the run
            for rec in records:
                regs = make_regs(rec.values, rec.cpu)
                if returns:
                    self._record(regs, regs.ip, rec.func, regs.return_value(), (rec.pid, rec.comm))
                else:
                    self._record(regs, regs.ip, None, None, (rec.pid, rec.comm))

    def _ring_samples(self, records: list[GuestRecord]) -> None:
        """A run drained from the ring, to the ring handler as one batch of columns (no line, no EventHit).

        Counted before the handler runs: a batch it raised on was delivered, and is counted in ``probe.nfaults``.
        """
        sample_cb = self.sample_cb
        assert sample_cb is not None
        layout, context, clock = self.host.arch.registers, self._record_context(), self.host.clock

        def times() -> list[float]:  # only when the handler reads ``ts``
            return [ts for ts, _order in clock.record_times([(rec.values["cycles"], rec.cpu) for rec in records])]

        args = {a.name: arg_column(a, layout, context)(records) for a in self.udef.args}
        self.nhit += len(records)
        sample_cb(Samples(self.udef.event, [rec.cpu for rec in records], [rec.pid for rec in records],
                          [rec.comm for rec in records], times, args))  # fmt: skip

    def _record_context(self) -> Callable[[GuestRecord], UprobeContext]:
        """An argument's context in a recorded hit, where it is not read from the record as it is."""
        make_regs, returns = self.backend.record_regs, self.udef.is_return

        def context(rec: GuestRecord) -> UprobeContext:
            regs = make_regs(rec.values, rec.cpu)
            return self._context(regs, regs.return_value() if returns else None, rec.comm, regs.ip,
                                 rec.func if returns else None, None)  # fmt: skip

        return context

    def _context(self, regs: PtRegs, retval: int | None, comm: str | None, ip: int, func: int | None,
                 entry: dict[int, int] | None) -> UprobeContext:  # fmt: skip
        probed = ip if func is None else func
        return UprobeContext(_UserContext(self.host, regs, retval, probed - self.udef.offset, comm))

    def _body(self, values: list[Value], ip: int, func: int | None) -> str:
        return format_uprobe_hit(self.udef, values, ip, func)

    def _symbolize(self, addr: int) -> str:
        return f"{addr:#x}"


def _place(rec: GuestRecord, ip_name: str) -> tuple[int, int]:
    """Where a record's hit was: its ip, and a return's function."""
    return rec.values[ip_name], rec.func


def _head(ip: int, func: int, returns: bool) -> str:
    """trace_uprobe.c's ``(0x401136)``, a return's ``(0x4011a0 <- 0x401136)``."""
    return f"({ip:#x} <- {func:#x})" if returns else f"({ip:#x})"


__all__ = ["UprobeBackend", "UprobeHost", "UprobeTraceEvent"]

"""One kprobe_events definition armed on a target, whatever its probe kind: its hits, counts and filter.

A probe kind subclasses :class:`TraceEvent` (kprobes and kretprobes:
:class:`qprobe.events.kprobe.KprobeEvent`) to make its probe from the
definition, count what its probe counts, and say how its handler sees the hit;
the hit itself (fetching the arguments, formatting, filtering, handing it on
in the guest's order) is this module's, the same for every kind.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from qprobe.events.context import HostContext, symbol_lookup
from qprobe.events.hit import EventHit
from qprobe.events.samples import SampleCb, Samples
from qprobe.fetch import ProbeEvent, format_event, format_hit
from qprobe.fetch.context import U64_MASK
from qprobe.fetch.filter import EventFilter
from qprobe.fetch.record import record_length

if TYPE_CHECKING:
    from qprobe.arch.inguest import MapKey, MapSlot
    from qprobe.core.kprobe import Kprobe, Kretprobe
    from qprobe.core.regs import PtRegs
    from qprobe.core.uprobe import Uprobe
    from qprobe.events.registry import EventHost
    from qprobe.fetch.args import Value
    from qprobe.fetch.context import FetchContext
    from qprobe.fetch.uevent import UprobeEvent

    MakeRegs = Callable[[dict[str, int], int], PtRegs]  # gdbstub registers and a vCPU -> a hit's pt_regs


class ProbeBackend(Protocol):
    """Where a probe kind's events get their probes armed and disarmed (qprobe.events.kprobe.KprobeBackend)."""

    def register(self, events: Sequence[TraceEvent]) -> None: ...  # all or nothing
    def unregister(self, events: Sequence[TraceEvent]) -> None: ...


@dataclass
class TraceEvent:
    """A kprobe_events definition armed on a target (a probe kind's subclass holds the probe)."""

    host: EventHost
    definition: ProbeEvent
    callback: Callable[[EventHit], None] | None = None
    keep: int = 100_000  # hits kept in ``hits``; older ones fall out, counted in ``evicted``
    hits: collections.deque[EventHit] = field(default_factory=collections.deque)
    evicted: int = 0  # hits delivered (to the callback too) that fell out of ``hits`` since
    nhit: int = 0
    errors: list[str] = field(default_factory=list)
    filter: EventFilter | None = None
    host_filtered: int = 0  # hits the filter rejected on the host (the rest were rejected in the guest)
    oversized: int = 0  # hits whose record is longer than the guest's ring buffer takes: no line (fetch.record)
    appended: list[TraceEvent] = field(default_factory=list)  # later probes of the same event
    probe: Kprobe | Kretprobe | Uprobe | None = None  # make_probe's; a kind's subclass narrows it to its own
    # A ring handler (qprobe.events.samples) instead of ``callback`` and ``hits``: every hit goes to it in batches.
    sample_cb: SampleCb | None = None

    # -- what a probe kind answers ------------------------------------------------------------
    @property
    def backend(self) -> ProbeBackend:
        """Where this event's probe is registered."""
        raise NotImplementedError

    def make_probe(self) -> None:
        """The event's probe, made anew from its definition, not yet registered."""
        raise NotImplementedError

    @property
    def registered(self) -> bool:
        """Whether the event's probe is armed (an event of a module not loaded yet has none)."""
        raise NotImplementedError

    @property
    def nmissed(self) -> int:
        raise NotImplementedError

    @property
    def lost(self) -> int:
        """Hits whose records never reached the host: dropped in the guest on a full ring (a lossy one, or one
        the host stopped draining), counted in nmissed too.  A hit delivered and later fallen out of ``hits``
        is not lost but ``evicted``."""
        raise NotImplementedError

    @property
    def guest_filtered(self) -> int:
        """Hits the filter rejected in the guest (by an optimized probe's detour)."""
        return 0

    @property
    def maxactive(self) -> int:
        """A return probe's instance count as the kernel lists it (the default resolved), else 0."""
        return self.definition.maxactive

    @property
    def function_name(self) -> str:
        """``$func`` of every hit of this event: the probed function's name, as ``EventHit.function`` gives it."""
        raise NotImplementedError

    def use_host_handler(self, on: bool) -> None:
        """While on, every hit runs the Python handler at the hit (to unwind its stack, say), never a record."""

    def count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        """Fold hits into a map in guest RAM instead of recording them, where the kind can; False if not."""
        return False

    def stop_counting_in_guest(self) -> dict[tuple[str | int, ...], MapSlot]:
        """End ``count_in_guest``: the hits folded in the guest, by key."""
        return {}

    def _fetch_ip(self, ip: int, func: int | None) -> int:
        """``%ip`` as the kind's handler sees it for a hit at ``ip``."""
        return ip

    def _syscall_nr(self, func: int | None) -> int:
        """pt_regs' system call number (``RegisterLayout.syscall_nr``) as the kind's handler's pt_regs hold it."""
        return U64_MASK

    def _return_trampoline(self) -> int | None:
        """The address a return probe's hits show for a return that went through its trampoline."""
        return None

    def _context(self, regs: PtRegs, retval: int | None, comm: str | None, ip: int, func: int | None,
                 entry: dict[int, int] | None) -> FetchContext:  # fmt: skip
        """What the definition's fetch arguments read at this hit (a kernel probe's: kernel-mode pt_regs)."""
        ctx = HostContext(self.host, regs, retval, comm, ip=self._fetch_ip(ip, func), entry=entry)
        ctx.syscall_nr = self._syscall_nr(func)
        return ctx

    def _body(self, values: list[Value], ip: int, func: int | None) -> str:
        """The hit's trace line after ``name: `` (print_kprobe_event, print_kretprobe_event)."""
        return format_hit(self.definition, values, ip, func, lookup=symbol_lookup(self.host),
                          trampoline=self._return_trampoline())  # fmt: skip

    def _symbolize(self, addr: int) -> str:
        return self.host.symbols.symbolize(addr)

    # -- the same for every kind --------------------------------------------------------------
    @functools.cached_property
    def numbers(self) -> frozenset[str]:
        """The arguments whose values are integers (JSON gives them as numbers)."""
        return self.definition.integer_args

    @functools.cached_property
    def strings(self) -> frozenset[str]:
        """The arguments whose values are strings (JSON gives them without ftrace's quotes)."""
        return self.definition.string_args

    def probes(self) -> list[TraceEvent]:
        """This definition and every one appended to the event, in the order they were added."""
        return [self, *self.appended]

    @property
    def name(self) -> str:
        return f"{self.definition.group}/{self.definition.event}"

    @property
    def filtered(self) -> int:
        """Hits the filter rejected: on the host, or in the guest by an optimized probe's detour."""
        return self.host_filtered + self.guest_filtered

    def listing(self) -> str:
        """The lines ``cat kprobe_events`` shows for the event, one per probe."""
        return "\n".join(format_event(te.definition, te.maxactive) for te in self.probes())

    def _record(
        self, regs: PtRegs, ip: int, func: int | None, retval: int | None,
        task: tuple[int, str] | None = None, entry: dict[int, int] | None = None,
    ) -> None:  # fmt: skip
        """One hit at ``ip`` (a probe's address, or a return probe's real return address, ``func`` its function)."""
        host = self.host
        recorded = task is not None  # only a ring record brings its task
        ctx = self._context(regs, retval, None if task is None else task[1], ip, func, entry)
        values: list[Value] = self.definition.evaluate(ctx)
        limit = host.kernel.event_length_limit()
        if self.sample_cb is None and limit is not None and record_length(self.definition, values) > limit:
            self.oversized += 1  # the kernel's ring buffer refuses the record: no line, as the guest's own
            return
        if task is None:
            current = host.kernel.snapshot(regs=regs.task_regs)
            # Without the kernel's types (a vmlinux without DWARF) the task is unknown: ftrace's "<...>".
            task = (current.pid, current.comm) if current is not None else (-1, "<...>")
        pid, comm = task
        ts, order = host.clock.hit_time(regs, recorded=recorded)
        if self.sample_cb is not None:  # a hit the host took at once (before the jump was placed): a batch of one
            self.nhit += 1
            args = {a.name: [v] for a, v in zip(self.definition.args, values, strict=True)}
            self.sample_cb(Samples(self.definition.event, [regs.vcpu], [pid], [comm], [ts], args))
            return
        body = self._body(values, ip, func)
        hit = EventHit(
            event=self.definition.event, cpu=regs.vcpu, pid=pid, comm=comm,
            ts=ts, order=order, addr=ip,
            symbol=self._symbolize(ip),
            func=None if func is None else self._symbolize(func),
            args={a.name: a.format_value(v) for a, v in zip(self.definition.args, values, strict=True)},
            body=body, irqs_off=host.arch.registers.irqs_disabled_flags(regs.flags), numbers=self.numbers,
            strings=self.strings,
        )  # fmt: skip
        self._emit(hit)

    def _emit(self, hit: EventHit) -> None:
        """A hit made: filtered, counted, kept in the guest's order, and handed to the callback."""
        if self.filter is not None and not self.filter(
            {**hit.args, "common_pid": hit.pid, "pid": hit.pid, "comm": hit.comm, "cpu": hit.cpu}
        ):
            self.host_filtered += 1
            return
        self.nhit += 1
        # Kept in ``hits`` in the guest's order of hits across every event; its time as the guest's clock prints.
        self.host.timeline.push(hit.order, functools.partial(_keep, self, hit), hit)
        callback = self.callback
        if callback is not None and not isinstance(callback, InOrder):
            callback(hit)  # at the hit, like a kernel handler; an InOrder one once the timeline lets it go


@dataclass(frozen=True)
class InOrder:
    """A callback that takes each hit once the timeline lets it go, in the guest's order of hits across every
    event, rather than at the hit: a printer's (``add_event(definition, InOrder(print_line))``).  What it
    raises is reported and counted as a timeline's callback's is; the hits after it still go out."""

    fn: Callable[[EventHit], None]

    def __call__(self, hit: EventHit) -> None:
        self.fn(hit)


def _keep(te: TraceEvent, hit: EventHit) -> None:
    """``hit`` in ``te.hits``, older ones falling out (a partial of this, not a closure: fewer objects a hit),
    and to an InOrder callback: the timeline's turn for the hit, taken once for both."""
    if len(te.hits) >= te.keep:
        te.hits.popleft()
        te.evicted += 1
    te.hits.append(hit)
    if isinstance(te.callback, InOrder):
        te.callback(hit)


def event_filter(ev: ProbeEvent | UprobeEvent, text: str) -> EventFilter:
    """An ftrace filter over ``ev``'s arguments; raises FetchArgError (with a column) naming the problem."""
    return EventFilter(text, numeric={a.name for a in ev.args if not a.type.string},
                       strings={a.name for a in ev.args if a.type.string})  # fmt: skip


def host_keys(
    te: TraceEvent, raw: Mapping[MapKey, MapSlot], keys: Sequence[str], hist: bool, make_regs: MakeRegs
) -> dict[tuple[str | int, ...], MapSlot]:
    """An in-guest map's slots by key, its parts as the host formats them (``keys``' order, the hist()
    bucket last with ``hist``): ``$func`` and ``$event`` the host's, an argument's text as a hit with its
    register holding the word shows it."""
    args = {a.name: a for a in te.definition.args}
    layout = te.host.arch.registers
    general = [layout.gdb_name[r] for r in layout.general]
    rest = {layout.gdb_name[r]: 0 for r in (layout.ip, layout.sp, layout.flags)}

    def formatted(name: str, word: int) -> str:
        regs = make_regs({**dict.fromkeys(general, word), **rest}, 0)
        return args[name].format_value(args[name].evaluate(HostContext(te.host, regs, None)))

    out: dict[tuple[str | int, ...], MapSlot] = {}
    for decoded, slot in raw.items():
        it = iter(decoded)  # the parts the guest computed, in keys' order
        parts: list[str | int] = []
        for name in (*keys, *(("$hist",) if hist else ())):
            if name in ("$func", "$event"):
                parts.append(te.function_name if name == "$func" else te.definition.event)
            elif name in ("$comm", "$pid", "$cpu", "$hist"):
                parts.append(next(it))
            else:
                word = next(it)
                assert isinstance(word, int)
                parts.append(formatted(name, word))
        key = tuple(parts)
        old = out.get(key)
        out[key] = slot if old is None else old.merge(slot)
    return out


__all__ = ["InOrder", "ProbeBackend", "TraceEvent", "event_filter", "host_keys"]

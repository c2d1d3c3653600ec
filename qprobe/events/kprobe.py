"""The kprobe kind of event: a definition on kernel text, armed as a kprobe (or a kretprobe for ``r``).

:class:`KprobeBackend` is all the events see of the core's probe tables (the
target holds one as ``kprobe_backend``); :class:`KprobeEvent` makes its probe
from its definition, and records a hit from any of the probe's paths: the int3
or stub-breakpoint handler, an optimized probe's ring record, or a return.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qprobe.core.kprobe import Kprobe, Kretprobe, KretprobeInstance
from qprobe.errors import InvalidProbe, QprobeError
from qprobe.events.context import RecordContext, symbol_lookup
from qprobe.events.event import TraceEvent, host_keys
from qprobe.events.hit import EventHit
from qprobe.events.inguest import guest_filter, guest_key, in_guest
from qprobe.events.lines import InOrderLines, line_run
from qprobe.events.recordfmt import arg_column, arg_texts
from qprobe.events.registry import EventHost
from qprobe.events.samples import Samples
from qprobe.fetch import print_ip_sym
from qprobe.fetch.context import U64_MASK
from qprobe.fetch.expr import Arg, Deref
from qprobe.fetch.record import record_length

if TYPE_CHECKING:
    from qprobe.arch.inguest import KeySpec, MapKey, MapSlot
    from qprobe.core.kprobe import GuestRecord
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.regs import PtRegs
    from qprobe.core.regsmaker import RegsMaker
    from qprobe.core.sites import ProbeSites
    from qprobe.fetch import ProbeEvent


class KprobeBackend:
    """The kprobes and kretprobes of kprobe events, on the target's probe tables."""

    def __init__(self, kprobes: KprobeManager, kretprobes: KretprobeManager, regs: RegsMaker) -> None:
        self._kprobes = kprobes
        self._kretprobes = kretprobes
        self._regs = regs

    @property
    def booting(self) -> bool:
        """The kernel is booting: probes go on stub breakpoints, those not asked anywhere until boot is done."""
        return self._kprobes.booting

    def register(self, events: Sequence[TraceEvent]) -> None:
        """All or nothing: the kprobes in one batch (one grace period places every jump), then the kretprobes.

        One event's probe is registered alone, so its refusal is the core's own error.
        """
        probes = [te.probe for te in events if isinstance(te, KprobeEvent) and te.probe is not None]
        if not probes:
            return
        if len(probes) == 1:
            self.register_probe(probes[0])
            return
        kps = [p for p in probes if isinstance(p, Kprobe)]
        self._kprobes.register_kprobes(kps)
        try:
            self._kretprobes.register_kretprobes([p for p in probes if isinstance(p, Kretprobe)])
        except BaseException:
            self._kprobes.unregister_kprobes(kps)
            raise

    def register_probe(self, probe: Kprobe | Kretprobe) -> None:
        if isinstance(probe, Kretprobe):
            self._kretprobes.register_kretprobe(probe)
        else:
            self._kprobes.register_kprobe(probe)

    def unregister(self, events: Sequence[TraceEvent]) -> None:
        """The entry probes in one batch (one VM stop for any number), then the return probes."""
        probes = [te.probe for te in events if isinstance(te, KprobeEvent)]
        self._kprobes.unregister_kprobes([p for p in probes if isinstance(p, Kprobe)])
        for p in probes:
            if isinstance(p, Kretprobe):
                self._kretprobes.unregister_kretprobe(p)

    def resync(self, kp: Kprobe, change: Callable[[], None] | None = None) -> None:
        """Apply ``change`` to ``kp`` in a VM stop and put its point's code back in line with it."""
        self._kprobes.resync(kp, change)

    def make_regs(self, values: Mapping[str, int], cpu: int) -> PtRegs:
        """The pt_regs of a hit recorded on vCPU number ``cpu`` with these register values."""
        return self._regs.make_regs_on(values, cpu)

    @property
    def can_count_in_guest(self) -> bool:
        """Whether probes can be jump-optimized here, which folding hits in guest RAM needs."""
        return self._kprobes.optimizer is not None

    def keyed_counts(self, kp: Kprobe, spec: KeySpec) -> dict[MapKey, MapSlot]:
        """``kp``'s in-guest map so far (in the VM stop ``resync`` makes: see KprobeEvent.stop_counting_in_guest)."""
        point, opt = self._kprobes.points.get(kp.resolved), self._kprobes.optimizer
        return opt.keyed_counts(point, spec) if point is not None and opt is not None else {}

    def default_maxactive(self) -> int:
        return self._kretprobes.default_maxactive()

    @property
    def trampoline(self) -> int | None:
        """The kretprobe trampoline's address (None before the first return probe)."""
        return self._kretprobes.trampoline or None

    @property
    def sites(self) -> ProbeSites:
        """Where probes may go (the blacklist, the sites the kernel rewrites), as the kernel is now."""
        return self._kprobes.sites

    def entry_skip(self, func: int) -> int:
        """Bytes after a function's entry that still count as its entry (an ``endbr64``)."""
        return self.sites.entry_skip(func)


class KprobeHost(EventHost, Protocol):
    """What a kprobe event uses of its target: the host's view and the kprobe backend."""

    kprobe_backend: KprobeBackend


@dataclass
class KprobeEvent(TraceEvent):
    """A kprobe_events definition on kernel text, armed as a kprobe or (``r``) a kretprobe."""

    host: KprobeHost
    probe: Kprobe | Kretprobe | None = None
    in_guest: bool = False  # recorded by an optimized probe's detour when it can be (see in_guest())
    guest_map: tuple[tuple[str, ...], str | None, bool] | None = None  # count_in_guest's keys, value, hist
    anywhere: bool = False  # armed with stub breakpoints (Kprobe(anywhere=True)), also when its module loads

    @property
    def backend(self) -> KprobeBackend:
        return self.host.kprobe_backend

    def make_probe(self) -> None:
        ev = self.definition
        layout = self.host.arch.registers
        if self.sample_cb is not None and (self.anywhere or not in_guest(ev, layout)):
            raise InvalidProbe(f"{self.name}: a ring handler takes what an optimized probe records in "
                               "the guest: an entry probe reading registers or $comm, not anywhere")  # fmt: skip
        if ev.is_return:
            saved = entry_args(ev)  # fetched at the entry, as the kernel's trace_kprobe_entry_handler does
            self.probe = Kretprobe(symbol_name=ev.symbol, addr=ev.addr if ev.symbol is None else None,
                                   offset=ev.offset, maxactive=ev.maxactive, handler=self._kretprobe_hit,
                                   data_size=8 * len(saved),
                                   entry_handler=self._kretprobe_entry if saved else None,
                                   anywhere=self.anywhere)  # fmt: skip
            return
        kp = Kprobe(symbol_name=ev.symbol, addr=ev.addr if ev.symbol is None else None, offset=ev.offset,
                    pre_handler=self._kprobe_hit, anywhere=self.anywhere)  # fmt: skip
        self.in_guest = False
        if in_guest(ev, layout) and not self.anywhere:  # a stub breakpoint is never jump-optimized
            self.in_guest = True
            kp.recorder = self._recorder
            if self.filter is not None:
                # Rejected in the detour, before the ring; the host filter still runs (the int3 path).
                kp.guest_filter = guest_filter(ev, self.filter, layout)
        self.probe = kp

    @property
    def kprobe(self) -> Kprobe | None:
        """The entry kprobe: the probe itself, or a return probe's."""
        return self.probe.kp if isinstance(self.probe, Kretprobe) else self.probe

    @property
    def registered(self) -> bool:
        return self.probe is not None and self.probe.registered

    @property
    def nmissed(self) -> int:
        return self.probe.nmissed if self.probe is not None else 0

    @property
    def lost(self) -> int:
        return self.kprobe.nlost if self.kprobe is not None else 0

    @property
    def guest_filtered(self) -> int:
        return self.probe.nfiltered if isinstance(self.probe, Kprobe) else 0

    @property
    def maxactive(self) -> int:
        if isinstance(self.probe, Kretprobe):
            return self.probe.maxactive or self.backend.default_maxactive()
        return self.definition.maxactive

    @property
    def function_name(self) -> str:
        kp = self.kprobe
        assert kp is not None, "an event is armed before it is hit"
        return self.host.symbols.symbolize(kp.at).split("+", 1)[0]

    def _fetch_ip(self, ip: int, func: int | None) -> int:
        """What the kernel's handler sees: in a kprobe the probe's address plus the arch's
        ``kprobe_ip_offset`` (x86: + 1, the int3 has run; its optimized and ftrace-based probes set
        the same), and the real return address in a return probe."""
        return ip + self.host.arch.kprobe_ip_offset if func is None else ip

    def _syscall_nr(self, func: int | None) -> int:
        # -1 as the int3 entry and the kretprobe trampoline leave it; 0 in a probe the kernel would run
        # from ftrace (one qprobe moved off an __fentry__ site), whose pt_regs come from ftrace_regs_caller.
        probe = self.probe if isinstance(self.probe, Kprobe) else None
        return 0 if func is None and probe is not None and probe.at != probe.resolved else U64_MASK

    def _return_trampoline(self) -> int | None:
        return self.backend.trampoline

    def _kprobe_hit(self, kp: Kprobe, regs: PtRegs) -> int:
        self._record(regs, kp.at, None, None)
        return 0

    def use_host_handler(self, on: bool) -> None:
        if isinstance(self.probe, Kprobe) and self.in_guest:
            self.probe.recorder = None if on else self._recorder
            self.backend.resync(self.probe)

    def count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        """Fold hits into a map in guest RAM instead of recording them: counted by ``keys``, and
        ``value``'s sum, min and max kept (its hist() bucket the key's last part with ``hist``).

        For an event recorded in the guest, with no filter, whose key parts are ``$comm``,
        ``$pid``, ``$cpu``, ``$func``, ``$event`` or integers taken from registers, and whose
        value is such an integer; otherwise returns False and changes nothing.  Hits the host
        still sees (before the jump is placed, or while it cannot be) reach ``callback`` as
        usual; ``stop_counting_in_guest`` returns the rest.
        """
        kp = self.probe
        spec = self._guest_spec(keys, value, hist)
        if spec is None or not isinstance(kp, Kprobe):
            return False
        self.guest_map = (tuple(keys), value, hist)
        self.backend.resync(kp, lambda: setattr(kp, "guest_key", spec))
        return True

    def can_count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        """Whether ``count_in_guest`` with these arguments would fold the hits in guest RAM (changes nothing)."""
        return self._guest_spec(keys, value, hist) is not None

    def _guest_spec(self, keys: Sequence[str], value: str | None, hist: bool) -> KeySpec | None:
        """The in-guest map's key for ``count_in_guest``, or None where the detour cannot fold these hits."""
        if self.filter is not None or not isinstance(self.probe, Kprobe) or not self.backend.can_count_in_guest:
            return None
        return guest_key(self.definition, keys, value, hist, self.host.arch.registers)

    def stop_counting_in_guest(self) -> dict[tuple[str | int, ...], MapSlot]:
        """End ``count_in_guest``: the hits folded in the guest, by key (its parts as the host formats them,
        the hist() bucket last with ``hist``)."""
        kp, backend = self.probe, self.backend
        if not isinstance(kp, Kprobe) or kp.guest_key is None or self.guest_map is None:
            return {}
        spec = kp.guest_key
        raw: dict[MapKey, MapSlot] = {}

        def take() -> None:  # in the stop that puts the recording detour back: no hit is lost in between
            raw.update(backend.keyed_counts(kp, spec))
            kp.guest_key = None

        backend.resync(kp, take)
        self.nhit += sum(slot.count for slot in raw.values())
        keys, _value, hist = self.guest_map
        self.guest_map = None
        return host_keys(self, raw, keys, hist, backend.make_regs)

    @property
    def _recorder(self) -> Callable[[list[GuestRecord]], None]:
        """What takes the runs of records drained from the rings: the ring handler, or the trace lines."""
        return self._ring_records if self.sample_cb is not None else self._guest_records

    def _record_context(self) -> Callable[[GuestRecord], RecordContext]:
        """The fetch context of each record of a run (what a run's records share found once)."""
        assert isinstance(self.probe, Kprobe)
        host, layout, make_regs = self.host, self.host.arch.registers, self.backend.make_regs
        fetch_ip, syscall_nr, task_size_max = (
            self._fetch_ip(self.probe.at, None),
            self._syscall_nr(None),
            host.mem.paging.task_size_max(),
        )

        def context(rec: GuestRecord) -> RecordContext:
            return RecordContext(host, rec, layout, fetch_ip, syscall_nr, task_size_max, make_regs)

        return context

    def _ring_records(self, records: list[GuestRecord]) -> None:
        """A run drained from the ring, to the ring handler as one batch of columns (no line, no EventHit).

        Counted before the handler runs: a batch it raised on was delivered, and is counted in ``probe.nfaults``.
        """
        sample_cb = self.sample_cb
        assert sample_cb is not None
        layout, context, clock = self.host.arch.registers, self._record_context(), self.host.clock

        def times() -> list[float]:  # when the handler reads ``ts``: a third of a batch's cost otherwise
            return [ts for ts, _order in clock.record_times([(rec.values["cycles"], rec.cpu) for rec in records])]

        args = {a.name: arg_column(a, layout, context)(records) for a in self.definition.args}
        self.nhit += len(records)
        sample_cb(Samples(self.definition.event, [rec.cpu for rec in records], [rec.pid for rec in records],
                          [rec.comm for rec in records], times, args))  # fmt: skip

    def _guest_records(self, records: list[GuestRecord]) -> None:
        """The same hits, recorded in the guest by an optimized probe's detour: a run drained from its ring.

        The line ``_record`` would make for each, from what the run shares found once (the probe's
        symbol and place, how each argument reads a record) and each record's registers read where they are.
        A hit whose record the guest's ring buffer would refuse leaves no line, as in ``_record``: a
        definition without strings has one length for every hit; one with strings is measured a hit,
        its values evaluated as ``_record`` evaluates them.
        """
        assert isinstance(self.probe, Kprobe)
        host, ev, ip = self.host, self.definition, self.probe.at
        limit = host.kernel.event_length_limit()
        measured = limit is not None and any(a.type.string for a in ev.args)
        if limit is not None and not measured and record_length(ev, [0] * len(ev.args)) > limit:
            self.oversized += len(records)
            return
        layout = host.arch.registers
        symbol = self._symbolize(ip)
        head = f"({print_ip_sym(ip, symbol_lookup(host), True, self._return_trampoline())})"
        context = self._record_context()

        if measured:  # the kept records and their arguments' texts, from the values their length was taken of
            kept, rows = [], []
            for rec in records:
                values = ev.evaluate(context(rec))
                if limit is not None and record_length(ev, values) > limit:
                    self.oversized += 1
                    continue
                kept.append(rec)
                rows.append(tuple(a.format_value(v) for a, v in zip(ev.args, values, strict=True)))
            columns = [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in ev.args]
        else:
            kept, columns = records, [arg_texts(a, layout, context)(records) for a in ev.args]
        names = [a.name for a in ev.args]
        flags, irqs_disabled_flags = layout.gdb_name[layout.flags], layout.irqs_disabled_flags
        times = host.clock.record_times([(rec.values["cycles"], rec.cpu) for rec in kept])
        callback = self.callback
        if isinstance(callback, InOrderLines) and self.filter is None:  # a printer's: the run as lines, in bulk
            run = line_run(ev.event, head, names, kept, columns, times, flags, irqs_disabled_flags)
            self.nhit += len(run)
            host.timeline.push_run(run, functools.partial(callback.lines, run))
            return
        labels = [f" {n}=" for n in names]
        numbers, strings, event = self.numbers, self.strings, ev.event
        rows = list(zip(*columns, strict=True)) if columns else [()] * len(kept)
        with host.timeline.batch():  # one hand-on for the run, its callbacks' pushes included
            for rec, texts, (ts, order) in zip(kept, rows, times, strict=True):
                args = dict(zip(names, texts, strict=True))
                body = head + "".join([label + t for label, t in zip(labels, texts, strict=True)])
                self._emit(EventHit(event, rec.cpu, rec.pid, rec.comm, ts, ip, symbol, args, body,
                                    irqs_disabled_flags(rec.values[flags]), None, numbers, strings, order))  # fmt: skip

    def _kretprobe_entry(self, ri: KretprobeInstance, regs: PtRegs) -> int:
        """``store_trace_entry_data``: the arguments a return probe's ``$argN`` fetch, saved at the entry."""
        for i, n in enumerate(entry_args(self.definition)):
            try:
                value = regs.arg(n)
            except QprobeError:
                value = 0  # regs_get_kernel_argument: 0 where the stack slot cannot be read
            ri.data[8 * i : 8 * i + 8] = (value & U64_MASK).to_bytes(8, "little")
        return 0

    def _kretprobe_hit(self, ri: KretprobeInstance, regs: PtRegs) -> None:
        func = self.probe.kp.at  # type: ignore[union-attr]
        saved = {n: int.from_bytes(ri.data[8 * i : 8 * i + 8], "little")
                 for i, n in enumerate(entry_args(self.definition))}  # fmt: skip
        self._record(regs, ri.ret_addr, func, regs.return_value(), entry=saved)


def entry_args(ev: ProbeEvent) -> list[int]:
    """The argument numbers a return probe's ``$argN`` (or BTF parameter) fetches, in order, each once."""
    out: list[int] = []
    for a in ev.args:
        node = a.expr
        while isinstance(node, Deref):
            node = node.inner
        if isinstance(node, Arg) and node.n not in out:
            out.append(node.n)
    return out


__all__ = ["KprobeBackend", "KprobeEvent", "KprobeHost", "entry_args"]

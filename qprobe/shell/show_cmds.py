"""The shell's commands that print hits: ``show`` (live, or those kept since boot) and ``format`` (how
``show`` prints an event's hits, as bpftrace's printf)."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .collect import Tap
from .event_cmds import select_events
from .parse import ShellUsageError, parse_collect
from .printf import parse_printf

if TYPE_CHECKING:
    from qprobe.events import EventHit, TraceEvent

    from .context import Handler, ShellContext
    from .guest_cmds import GuestCommands
    from .printf import HitFormat


def kept_hits(shell: ShellContext, events: list[TraceEvent]) -> list[tuple[TraceEvent, EventHit]]:
    """Every hit the events have kept, in the guest's order of hits (those still in the guest's record
    rings drained first); what they did not keep is said."""
    shell.target.sync()
    shell.target.timeline.flush()
    kept: list[tuple[TraceEvent, EventHit]] = []
    evicted = unkept = 0
    for te in events:
        for one in te.probes():
            hits = one.hits.copy()  # one C call: the stop loop may keep another hit meanwhile
            kept += [(te, hit) for hit in hits]
            evicted += one.evicted
            unkept += max(0, one.nhit - len(hits) - one.evicted)
    if evicted:
        shell.note(f"{evicted} older hits fell out of what the events keep (the last {events[0].keep} each): "
                   "not in here")  # fmt: skip
    if unkept:
        shell.note(f"{unkept} hits were counted in guest RAM without a record: not in here")
    kept.sort(key=lambda pair: pair[1].order)
    return kept


class ShowCommands:
    """show and format."""

    def __init__(self, shell: ShellContext, guest: GuestCommands) -> None:
        self.shell = shell
        self.guest = guest

    def handlers(self) -> dict[str, Handler]:
        return {"show": self.cmd_show, "format": self.cmd_format}

    def cmd_show(self, rest: str) -> None:
        spec = parse_collect(rest, verb="show", allow_key=False)
        events = select_events(self.shell.target, spec.events)
        if spec.since_boot:
            self._show_kept(events)
            return
        hits: queue.SimpleQueue[EventHit] = queue.SimpleQueue()

        def drain() -> None:
            while True:
                try:
                    hit = hits.get_nowait()
                except queue.Empty:
                    return
                self._print_hit(hit, formats)

        formats = self._formats(events)
        ready = f"showing {', '.join(te.name for te in events)}; Ctrl-C to stop"
        timeline = self.shell.target.timeline  # lines come out in the guest's order of hits, whatever their path
        with Tap(events, lambda te, hit, stack: timeline.push(hit.order, lambda: hits.put(hit))):
            result = self.guest.watch(spec, drain, ready)
        timeline.flush()
        drain()
        self.guest.report_run(result)

    def _show_kept(self, events: list[TraceEvent]) -> None:
        """``show ... since boot``: the hits already made, as ``show`` prints hits as they come."""
        formats = self._formats(events)
        kept = kept_hits(self.shell, events)
        for _te, hit in kept:
            self._print_hit(hit, formats)
        if not kept:
            self.shell.note("no hits")

    def _formats(self, events: list[TraceEvent]) -> dict[str, HitFormat]:
        """The printf of each event that has one, by the event's name as its hits give it."""
        return {te.definition.event: self.shell.formats[te.name] for te in events if te.name in self.shell.formats}

    def _print_hit(self, hit: EventHit, formats: dict[str, HitFormat]) -> None:
        """One hit as an ftrace line, or as its event's printf says."""
        fmt = formats.get(hit.event)
        if fmt is None:
            self.shell.out.line(hit.line())
        else:
            self.shell.out.write(fmt(hit.escaped() if self.shell.out.terminal else hit), escaped=True)

    def cmd_format(self, rest: str) -> None:
        quote = rest.find('"')
        names, text = (rest[:quote].split(), rest[quote:]) if quote >= 0 else (rest.split(), "")
        if not names:
            raise ShellUsageError('usage: format EVENT... ["FMT", VALUE, ...]')
        events = select_events(self.shell.target, names)
        if not text:
            for te in events:
                self.shell.formats.pop(te.name, None)
            self.shell.note(f"{', '.join(te.name for te in events)}: ftrace lines")
            return
        fmt = parse_printf(text)
        for te in events:
            self._check_names_of(fmt.names(), te)
            fmt.check_types(te.numbers)
        for te in events:
            self.shell.formats[te.name] = fmt
        self.shell.note(f"{', '.join(te.name for te in events)}: printf {text}")

    def _check_names_of(self, names: Sequence[str], te: TraceEvent) -> None:
        have = [a.name for a in te.definition.args]
        for name in names:
            if name not in have:
                raise ShellUsageError(f"{te.name} has no argument {name!r} ({', '.join(have) or 'no arguments'})")


__all__ = ["ShowCommands", "kept_hits"]

"""The shell's event commands: definitions in the kprobe_events, uprobe_events, perf probe and bpftrace
languages, and enabling, disabling, filtering and listing the events they add."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qprobe.core.kprobe import Kretprobe
from qprobe.core.uprobe import Uprobe
from qprobe.errors import FetchArgError, ProbeError
from qprobe.fetch import Definition, DeleteEvent, is_glob, parse_definition, parse_event
from qprobe.fetch import messages as M

from .parse import ShellUsageError

if TYPE_CHECKING:
    from qprobe.events import TraceEvent

    from .context import Handler, ShellContext
    from .target import ShellTarget


def select_events(target: ShellTarget, patterns: Sequence[str]) -> list[TraceEvent]:
    """Events by name, ``GRP/EVENT``, group or glob; all of them for no pattern."""
    events = list(target.events.values())
    if not patterns:
        if not events:
            raise ProbeError("no events yet: add one, e.g.  p:myread vfs_read count=%dx:u64")
        return events
    chosen: list[TraceEvent] = []
    for pat in patterns:
        pat = pat.removeprefix("-:")
        hits = [te for te in events if fnmatch.fnmatchcase(te.name, pat)
                or fnmatch.fnmatchcase(te.definition.event, pat) or te.definition.group == pat]  # fmt: skip
        if not hits:
            raise ProbeError(f"no such event {pat!r} (ENOENT); `events` lists them")
        chosen += [te for te in hits if te not in chosen]
    return chosen


def _is_event(target: ShellTarget, word: str) -> bool:
    try:
        select_events(target, [word])
    except ProbeError:
        return False
    return True


class EventCommands:
    """Adding and removing events (``p:``, ``r:``, ``-:``, ``perf``, ``uprobe:``), and enable, disable,
    filter and events."""

    def __init__(self, shell: ShellContext) -> None:
        self.shell = shell

    def handlers(self) -> dict[str, Handler]:
        return {"enable": self.cmd_enable, "disable": self.cmd_disable, "events": self.cmd_events,
                "filter": self.cmd_filter, "perf": self.cmd_perf}  # fmt: skip

    def definition(self, text: str) -> None:
        """``p:...``/``r:...`` adds an event, ``-:...`` removes events, as a write to kprobe_events (or to
        uprobe_events, for a probe point on a guest path: ``p:ev /bin/prog:func``).  The text is parsed
        once: what follows takes the parsed form."""
        definition = parse_definition(text)
        if definition.is_uprobe:
            self.uprobe(definition)
            return
        # add_event checks its symbols and suggests names
        ev = parse_event(definition, dialect=self.shell.target.dialect)
        if isinstance(ev, DeleteEvent):
            gone = [te for te in list(self.shell.target.events.values()) if ev.matches(te.definition)]
            if not gone:
                raise ProbeError(f"no event matches {definition.head!r} (ENOENT)")
            self.shell.target.remove_events(gone)
            for te in gone:
                self.shell.armed.pop(te.name, None)
                self.shell.note(f"removed {te.name} ({te.nhit} hits)")
            return
        if ev.symbol is not None and is_glob(ev.symbol):
            self.wildcard(definition)
            return
        name = f"{ev.group}/{ev.event}"
        if name in self.shell.target.events:
            head = definition.head
            raise FetchArgError(M.EVENT_EXIST, text, head.index(":") + 1 if ":" in head else 0)
        te = self.shell.target.add_event(ev)  # checked with the kernel's symbols there, not parsed again
        self.shell.armed[te.name] = time.monotonic()
        args = f" with {' '.join(a.name for a in ev.args)}" if ev.args else ""
        kind = "return probe" if ev.is_return else "probe"
        self.shell.out.parts(("added ", None), (te.name, "event"), (f"  ({kind} on {ev.probe_point}{args})", "note"))

    def uprobe(self, definition: Definition) -> None:
        """A uprobe_events line: its symbol resolved in the guest's file and its line checked there."""
        name = self._new_event_name(definition)
        if name is not None and name in self.shell.target.events:
            raise FetchArgError(M.EVENT_EXIST, definition.text, definition.text.index(":") + 1)
        te = self.shell.target.add_event(definition)
        self.shell.armed[te.name] = time.monotonic()
        ev = te.definition
        args = f" with {' '.join(a.name for a in ev.args)}" if ev.args else ""
        kind = "return probe" if ev.is_return else "probe"
        where = f"{ev.probe_point} ({te.function_name})"
        self.shell.out.parts(("added ", None), (te.name, "event"), (f"  (user-space {kind} on {where}{args})", "note"))

    @staticmethod
    def _new_event_name(definition: Definition) -> str | None:
        """``GRP/EVENT`` a ``p:[GRP/]EVENT`` head names (uprobe events' group is ``uprobes``); None if unnamed."""
        name = definition.name
        if not name:
            return None
        return name if "/" in name else f"uprobes/{name}"

    def user_form(self, text: str) -> None:
        """perf's ``perf -x PATH DEF`` or bpftrace's ``uprobe:PATH:FUNC [BUILTIN...]``, shown as the
        uprobe_events line it writes, then added."""
        from qprobe.frontend import user_form_line

        line = user_form_line(text, self.shell.target.resolve_user_symbol, self.shell.target.arch.registers,
                              lambda line: self.shell.note(f"writing event: {line}"))  # fmt: skip
        self.uprobe(parse_definition(line))

    def wildcard(self, definition: Definition) -> None:
        """``p:vfs vfs_*``: one event per function that can be probed, in group ``vfs``; the refusals counted."""
        found = self.shell.target.add_events(definition)
        now = time.monotonic()
        for te in found.events:
            self.shell.armed[te.name] = now
        groups = sorted({te.definition.group for te in found.events})
        self.shell.out.parts(("added ", None), (f"{len(found.events)} events", "event"),
                             (f"  ({' '.join(g + '/*' for g in groups)}: one per function matching {found.pattern})",
                              "note"))  # fmt: skip
        if found.refused:
            self.shell.note(f"{len(found.refused)} not probed: "
                            + "; ".join(f"{name} ({why})" for name, why in found.refused.items()))  # fmt: skip

    def _set_event(self, rest: str, on: bool) -> None:
        if not rest:
            raise ShellUsageError(f"usage: {'enable' if on else 'disable'} EVENT...")
        for te in select_events(self.shell.target, rest.split()):
            probe = te.probe
            if probe is None:
                continue
            if isinstance(probe, Uprobe):
                raise ShellUsageError(f"{te.name}: a uprobe event is armed while it exists (-:{te.name} removes it)")
            if isinstance(probe, Kretprobe):
                (self.shell.target.enable_kretprobe if on else self.shell.target.disable_kretprobe)(probe)
            else:
                (self.shell.target.enable_kprobe if on else self.shell.target.disable_kprobe)(probe)
            self.shell.note(f"{te.name} {'enabled' if on else 'disabled'}")

    def cmd_filter(self, rest: str) -> None:
        """ftrace's ``events/GRP/EVENT/filter``: set (``EXPR``), clear (``0``) or show (nothing) a filter."""
        words = rest.split()
        names: list[str] = []
        for w in words:  # the events, then the expression (which may start with a name, so: known events only)
            if _is_event(self.shell.target, w):
                names.append(w)
            else:
                break
        if not names:
            raise ShellUsageError("usage: filter EVENT... [EXPR | 0]")
        text = rest.split(None, len(names))[len(names)] if len(words) > len(names) else ""
        events = select_events(self.shell.target, names)
        if not text:
            for te in events:
                self.shell.out.line(f"{te.name}: {te.filter.text if te.filter is not None else 'none'}")
            return
        from qprobe.events import event_filter

        for te in events:
            for one in te.probes():  # the probes appended to the event too: it is one event
                one.filter = None if text.strip() == "0" else event_filter(one.definition, text)
            self.shell.note(f"{te.name}: {'no filter' if te.filter is None else 'filter ' + te.filter.text}")

    def cmd_enable(self, rest: str) -> None:
        self._set_event(rest, True)

    def cmd_disable(self, rest: str) -> None:
        self._set_event(rest, False)

    def cmd_events(self, rest: str) -> None:
        for te in list(self.shell.target.events.values()):
            self.shell.out.line(te.listing())

    def cmd_perf(self, rest: str) -> None:
        """A perf probe definition: resolved on the host, shown as ``perf probe -v`` shows it, then added
        (``-x PATH``: a program's function, resolved in the guest's file)."""
        from qprobe.frontend import is_kernel_perf, perf_to_kprobe_events

        text = f"perf {rest}"
        if not is_kernel_perf(text):
            self.user_form(text)
            return
        (line,) = perf_to_kprobe_events([text], self.shell.target.symbols, self.shell.target.arch)
        self.shell.note(f"writing event: {line}")
        self.definition(line)


__all__ = ["EventCommands", "select_events"]

"""The shell's commands: ``Shell(target, out).execute(line)`` writes what the line asks for.

The prompt loop (``qprobe.shell.prompt``) only reads lines and hands them
here, so every command runs the same from a terminal, a script or a test.
An error is printed as one line (a bad definition also gets a caret under
the column the kernel would point at) and the shell goes on; Ctrl-C ends
the command that is running, never the shell or the VM.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from qprobe.core.kprobe import Kretprobe
from qprobe.core.uprobe import Uprobe
from qprobe.errors import FetchArgError, ProbeError, QprobeError
from qprobe.events.define import is_uprobe
from qprobe.events.funcs import Probeability, is_glob, render_funcs
from qprobe.fetch import DeleteEvent, parse_event
from qprobe.fetch import messages as M

from . import inspect_cmds as insp
from .collect import Aggregation, Collector, Tap, check_argument
from .output import Output
from .parse import (
    Call,
    Collect,
    ShellUsageError,
    is_bpftrace_uprobe,
    is_definition,
    parse_collect,
    split_call,
    split_command,
)
from .printf import HitFormat, parse_printf
from .render import render_table

if TYPE_CHECKING:
    from qprobe.events import EventHit, TraceEvent
    from qprobe.vmm.console import RunResult

    from .target import ShellTarget

log = logging.getLogger("qprobe.shell")
RUN_TIMEOUT = 3600.0

# name -> (usage, one-line summary); the order is the order of `help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "p": ("p[:[GRP/]EVENT] SYMBOL[+OFFS]|ADDR [NAME=FETCHARG[:TYPE]]...", "add a kprobe event (kprobe_events syntax)"),
    "r": ("r[MAXACTIVE][:[GRP/]EVENT] SYMBOL [NAME=FETCHARG[:TYPE]]...", "add a return probe event ($retval)"),
    "-:": ("-:[GRP/]EVENT", "remove an event"),
    "p PATH": (
        "p|r[:[GRP/]EVENT] PATH:SYMBOL[+OFFS]|PATH:OFFSET[%return] [NAME=FETCHARG[:TYPE]]...",
        "add a uprobe event on a guest program or library (uprobe_events syntax, symbols from its ELF)",
    ),
    "uprobe:": (
        "uprobe:PATH:FUNC[+OFFS]|uretprobe:PATH:FUNC [arg0 ... retval comm]",
        "add a uprobe event as bpftrace names it, fetching the builtins listed (count by arg0 then works)",
    ),
    "perf": (
        "perf [-x PATH] [EVENT=]FUNC[:RLN|+OFFS|%return]|SRC:ALN [VAR[->F|.F|[N]][:TYPE]]...",
        "add an event in perf probe's language, variables resolved from vmlinux's DWARF (-x PATH: a uprobe on "
        "a guest program's function, registers and memory fetched)",
    ),
    "enable": ("enable EVENT...", "arm events (globs allowed)"),
    "disable": ("disable EVENT...", "disarm events, keeping them"),
    "list": ("list", "probes as debugfs kprobes/list shows them"),
    "events": ("events", "event definitions as kprobe_events shows them"),
    "enabled": ("enabled [0|1]", "the global arm knob (debugfs kprobes/enabled)"),
    "optimization": ("optimization 0|1", "jump optimization (debug.kprobes-optimization)"),
    "blacklist": ("blacklist", "what cannot be probed (debugfs kprobes/blacklist)"),
    "show": (
        "show [EVENT...] [for SECONDS | run CMD | since boot]",
        "print hits live as ftrace lines until Ctrl-C (since boot: the hits kept so far)",
    ),
    "stats": ("stats", "hits, nmissed and hits/s per event and probe"),
    "filter": (
        "filter EVENT... [EXPR | 0]",
        "an ftrace event filter ('count >= 4096 && comm == \"cat\"', as events/*/filter takes it): hits it "
        "rejects are only counted; 0 removes it, no EXPR shows it",
    ),
    "format": (
        'format EVENT... ["FMT", VALUE, ...]',
        "how show prints the events' hits: bpftrace's printf "
        "($comm $pid $cpu $event $func $ts $addr, argument names); no FMT: ftrace lines again",
    ),
    "count": (
        "count [EVENT...] [by KEY[, KEY...]] [every S] [for S | run CMD | since boot]",
        "count hits like bpftrace's @[key] = count()",
    ),
    "sum()": ("sum(VALUE) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]", "@[key] = sum(value)"),
    "avg()": ("avg(VALUE) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]", "@[key] = avg(value)"),
    "min()": ("min(VALUE) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]", "@[key] = min(value)"),
    "max()": ("max(VALUE) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]", "@[key] = max(value)"),
    "stats()": (
        "stats(VALUE) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]",
        "@[key] = stats(value): count, average, total",
    ),
    "hist()": (
        "hist(VALUE) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]",
        "log2 histogram of a numeric value, like hist()",
    ),
    "hist": ("hist EVENT by VALUE [every S] [for S | run CMD | since boot]", "the same as hist(VALUE) EVENT"),
    "lhist()": (
        "lhist(VALUE, MIN, MAX, STEP) [EVENT...] [by KEY, ...] [every S] [for S | run CMD | since boot]",
        "linear histogram, like lhist()",
    ),
    "funcs": ("funcs [GLOB...]", "kernel functions matching, and why qprobe cannot probe the ones it cannot"),
    "sym": ("sym NAME|GLOB", "a symbol's address, size and type"),
    "addr": ("addr ADDR", "the symbol+offset of an address"),
    "x": ("x ADDR|SYM[+OFF] [LEN]", "hex dump of kernel memory, like xxd"),
    "regs": ("regs [CPU]", "a vCPU's registers"),
    "bt": ("bt [CPU]", "a vCPU's kernel stack (drgn's, with inlined calls and file:line)"),
    "drgn": ("drgn", "drgn's interactive mode on the live guest, `prog` bound (Ctrl-D returns)"),
    "run": ("run CMD", "run a command in the guest, with its output and exit status"),
    "py": ("py", "a Python REPL with `target` and `qprobe` bound (Ctrl-D returns)"),
    "load": ("load FILE.py", "run a file of Python API handlers with `target` in its globals"),
    "gdb": ("gdb CMD", "a gdb command (static ones on vmlinux without a live gdb transport)"),
    "clear": ("clear", "clear the screen"),
    "help": ("help [CMD]", "this list, or one command's usage"),
    "quit": ("quit", "remove every probe and leave (also Ctrl-D)"),
}
KEY_HELP = (
    "KEY: an argument name, $comm, $pid, $cpu, $func, $event or $stack, several joined by commas (by $comm, "
    "fd); VALUE: a numeric argument, $pid or $cpu. A map of one event, keyed by nothing or $comm, $pid, $cpu, $func, "
    "$event and integer register arguments, of an integer register value, is folded in guest RAM at each hit; a "
    "count of several events by nothing, $func or $event is each probe's own hit count (as kprobe_profile's): "
    "exact, never lost; other maps come from the records the guest writes at each hit; "
    "$stack and arguments read from memory stop the vCPU at each hit for the host to compute. since boot: the map "
    "of the hits already made, as each event keeps them (its last 100000; with qprobe shell --boot, from "
    "start_kernel on)"
)
ALIASES = {"exit": "quit", "q": "quit", "?": "help", "ls": "list", "count()": "count"}  # bpftrace's count()


class Shell:
    """Commands on one target.  ``execute`` never raises for a user error; ``done`` is set by ``quit``."""

    def __init__(self, target: ShellTarget, out: TextIO | None = None, *, color: bool | None = None,
                 interactive: bool = False, prompt: str = "qprobe> ") -> None:  # fmt: skip
        self.target = target
        self.out = Output(out, color)
        self.interactive = interactive  # the typed line is on screen: a caret can go right under it
        self.prompt = prompt
        self.done = False
        self.armed: dict[str, float] = {}  # event or probe -> when the shell first saw it armed
        self.loaded: dict[str, dict[str, object]] = {}  # load FILE -> its globals
        self.interact: Callable[..., None] | None = None  # code.interact, replaceable in tests
        self.probeability: Probeability | None = None  # the function list, built on first use
        self.formats: dict[str, HitFormat] = {}  # event name -> how `show` prints its hits
        self.handlers: dict[str, Callable[[str], None]] = {
            "enable": self.cmd_enable, "disable": self.cmd_disable, "list": self.cmd_list,
            "events": self.cmd_events, "enabled": self.cmd_enabled, "optimization": self.cmd_optimization,
            "blacklist": self.cmd_blacklist, "show": self.cmd_show, "stats": self.cmd_stats,
            "count": self.cmd_count, "hist": self.cmd_hist, "run": self.cmd_run, "help": self.cmd_help,
            "quit": self.cmd_quit, "funcs": self.cmd_funcs, "format": self.cmd_format, "filter": self.cmd_filter,
            "clear": self.cmd_clear, "perf": self.cmd_perf,
            "sym": lambda rest: insp.cmd_sym(self, rest), "addr": lambda rest: insp.cmd_addr(self, rest),
            "x": lambda rest: insp.cmd_x(self, rest), "regs": lambda rest: insp.cmd_regs(self, rest),
            "bt": lambda rest: insp.cmd_bt(self, rest), "py": lambda rest: insp.cmd_py(self, rest),
            "drgn": lambda rest: insp.cmd_drgn(self, rest),
            "load": lambda rest: insp.cmd_load(self, rest), "gdb": lambda rest: insp.cmd_gdb(self, rest),
        }  # fmt: skip

    # -- the entry point ------------------------------------------------------------------
    def execute(self, line: str) -> None:
        """Run one line; every error becomes one printed line."""
        try:
            self._execute(line)
        except FetchArgError as exc:
            self._caret(line, exc)
        except QprobeError as exc:
            self.error(str(exc))
        except KeyboardInterrupt:
            self.out.line("interrupted", "note")
        except Exception as exc:  # a bug must not end the session that holds the probes
            log.debug("command %r failed", line, exc_info=True)
            self.error(f"{type(exc).__name__}: {exc}")
        self.out.flush()

    def _execute(self, line: str) -> None:
        if is_definition(line):
            self.definition(line.strip())
            return
        if is_bpftrace_uprobe(line):
            self.user_form(line.strip())
            return
        call = split_call(line)
        if call is not None:
            self.call(*call)
            return
        cmd, rest = split_command(line)
        if not cmd:
            return
        cmd = ALIASES.get(cmd, cmd)
        handler = self.handlers.get(cmd)
        if handler is None:
            close = difflib.get_close_matches(cmd, [*self.handlers, *ALIASES], n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(close[:3])}?)" if close else ""
            raise ShellUsageError(f"unknown command {cmd!r}{hint}; `help` lists them")
        handler(rest)

    # -- output helpers -----------------------------------------------------------------------
    def error(self, text: str) -> None:
        """One line, whatever the message: a multi-line one is joined."""
        one = " | ".join(part.strip() for part in str(text).splitlines() if part.strip())
        self.out.line(f"error: {one}", "error")

    def note(self, text: str) -> None:
        self.out.line(text, "note")

    def _write_now(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _caret(self, line: str, exc: FetchArgError) -> None:
        lead = len(line) - len(line.lstrip())
        if self.interactive and exc.text == line.strip():
            # The definition is on screen right above: one line, the caret under the column.
            self.out.parts((" " * (len(self.prompt) + lead + exc.column) + "^ ", "caret"), (exc.explained, "error"))
            return
        self.out.line(exc.text or line.strip())
        self.out.parts((" " * exc.column + "^ ", "caret"), (exc.explained, "error"))

    # -- events ----------------------------------------------------------------------------------
    def definition(self, text: str) -> None:
        """``p:...``/``r:...`` adds an event, ``-:...`` removes events, as a write to kprobe_events (or to
        uprobe_events, for a probe point on a guest path: ``p:ev /bin/prog:func``)."""
        if is_uprobe(text):
            self.uprobe(text)
            return
        ev = parse_event(text, dialect=self.target.dialect)  # add_event checks its symbols and suggests names
        if isinstance(ev, DeleteEvent):
            gone = [te for te in list(self.target.events.values()) if ev.matches(te.definition)]
            if not gone:
                raise ProbeError(f"no event matches {text.split()[0]!r} (ENOENT)")
            self.target.remove_events(gone)
            for te in gone:
                self.armed.pop(te.name, None)
                self.note(f"removed {te.name} ({te.nhit} hits)")
            return
        if ev.symbol is not None and is_glob(ev.symbol):
            self.wildcard(text)
            return
        name = f"{ev.group}/{ev.event}"
        if name in self.target.events:
            head = text.split()[0]
            raise FetchArgError(M.EVENT_EXIST, text, head.index(":") + 1 if ":" in head else 0)
        te = self.target.add_event(ev)  # checked with the kernel's symbols there, not parsed again
        self.armed[te.name] = time.monotonic()
        args = f" with {' '.join(a.name for a in ev.args)}" if ev.args else ""
        kind = "return probe" if ev.is_return else "probe"
        self.out.parts(("added ", None), (te.name, "event"), (f"  ({kind} on {ev.probe_point}{args})", "note"))

    def uprobe(self, text: str) -> None:
        """A uprobe_events line: its symbol resolved in the guest's file and its line checked there."""
        name = self._new_event_name(text)
        if name is not None and name in self.target.events:
            raise FetchArgError(M.EVENT_EXIST, text, text.index(":") + 1)
        te = self.target.add_event(text)
        self.armed[te.name] = time.monotonic()
        ev = te.definition
        args = f" with {' '.join(a.name for a in ev.args)}" if ev.args else ""
        kind = "return probe" if ev.is_return else "probe"
        where = f"{ev.probe_point} ({te.function_name})"
        self.out.parts(("added ", None), (te.name, "event"), (f"  (user-space {kind} on {where}{args})", "note"))

    @staticmethod
    def _new_event_name(text: str) -> str | None:
        """``GRP/EVENT`` a ``p:[GRP/]EVENT`` head names (uprobe events' group is ``uprobes``); None if unnamed."""
        head = text.split(None, 1)[0]
        if ":" not in head or not head.split(":", 1)[1]:
            return None
        name = head.split(":", 1)[1]
        return name if "/" in name else f"uprobes/{name}"

    def user_form(self, text: str) -> None:
        """perf's ``perf -x PATH DEF`` or bpftrace's ``uprobe:PATH:FUNC [BUILTIN...]``, shown as the
        uprobe_events line it writes, then added."""
        from qprobe.kernel.usyntax import user_form_definition

        line = user_form_definition(text, self.target.resolve_user_symbol)
        self.note(f"writing event: {line}")
        self.uprobe(line)

    def wildcard(self, text: str) -> None:
        """``p:vfs vfs_*``: one event per function that can be probed, in group ``vfs``; the refusals counted."""
        found = self.target.add_events(text)
        now = time.monotonic()
        for te in found.events:
            self.armed[te.name] = now
        groups = sorted({te.definition.group for te in found.events})
        self.out.parts(("added ", None), (f"{len(found.events)} events", "event"),
                       (f"  ({' '.join(g + '/*' for g in groups)}: one per function matching {found.pattern})",
                        "note"))  # fmt: skip
        if found.refused:
            self.note(f"{len(found.refused)} not probed: "
                      + "; ".join(f"{name} ({why})" for name, why in found.refused.items()))  # fmt: skip

    def select(self, patterns: Sequence[str]) -> list[TraceEvent]:
        """Events by name, ``GRP/EVENT``, group or glob; all of them for no pattern."""
        events = list(self.target.events.values())
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

    def _set_event(self, rest: str, on: bool) -> None:
        if not rest:
            raise ShellUsageError(f"usage: {'enable' if on else 'disable'} EVENT...")
        for te in self.select(rest.split()):
            probe = te.probe
            if probe is None:
                continue
            if isinstance(probe, Uprobe):
                raise ShellUsageError(f"{te.name}: a uprobe event is armed while it exists (-:{te.name} removes it)")
            if isinstance(probe, Kretprobe):
                (self.target.enable_kretprobe if on else self.target.disable_kretprobe)(probe)
            else:
                (self.target.enable_kprobe if on else self.target.disable_kprobe)(probe)
            self.note(f"{te.name} {'enabled' if on else 'disabled'}")

    def cmd_filter(self, rest: str) -> None:
        """ftrace's ``events/GRP/EVENT/filter``: set (``EXPR``), clear (``0``) or show (nothing) a filter."""
        words = rest.split()
        names: list[str] = []
        for w in words:  # the events, then the expression (which may start with a name, so: known events only)
            if self._is_event(w):
                names.append(w)
            else:
                break
        if not names:
            raise ShellUsageError("usage: filter EVENT... [EXPR | 0]")
        text = rest.split(None, len(names))[len(names)] if len(words) > len(names) else ""
        events = self.select(names)
        if not text:
            for te in events:
                self.out.line(f"{te.name}: {te.filter.text if te.filter is not None else 'none'}")
            return
        from qprobe.events import event_filter

        for te in events:
            for one in te.probes():  # the probes appended to the event too: it is one event
                one.filter = None if text.strip() == "0" else event_filter(one.definition, text)
            self.note(f"{te.name}: {'no filter' if te.filter is None else 'filter ' + te.filter.text}")

    def _is_event(self, word: str) -> bool:
        try:
            self.select([word])
        except ProbeError:
            return False
        return True

    def cmd_enable(self, rest: str) -> None:
        self._set_event(rest, True)

    def cmd_disable(self, rest: str) -> None:
        self._set_event(rest, False)

    def cmd_list(self, rest: str) -> None:
        self.out.write(self.target.list_probes())

    def cmd_events(self, rest: str) -> None:
        for te in list(self.target.events.values()):
            self.out.line(te.listing())

    def cmd_enabled(self, rest: str) -> None:
        if not rest:
            self.out.line("1" if self.target.kprobes.enabled else "0")
            return
        if rest not in ("0", "1"):
            raise ShellUsageError("usage: enabled [0|1]")
        self.target.set_kprobes_enabled(rest == "1")

    def cmd_optimization(self, rest: str) -> None:
        if rest not in ("0", "1"):
            raise ShellUsageError("usage: optimization 0|1")
        self.target.set_kprobes_optimization(rest == "1")

    def cmd_blacklist(self, rest: str) -> None:
        for line in self.target.blacklist():
            self.out.line(line)

    def cmd_funcs(self, rest: str) -> None:
        if self.probeability is None:
            self.probeability = Probeability.of_target(self.target)
        text, summary, _ = render_funcs(self.probeability, rest.split())
        self.out.write(text)
        self.note(summary)

    def cmd_perf(self, rest: str) -> None:
        """A perf probe definition: resolved on the host, shown as ``perf probe -v`` shows it, then added
        (``-x PATH``: a program's function, resolved in the guest's file)."""
        from qprobe.kernel.perfprobe import perf_to_kprobe

        if rest.split()[:1] == ["-x"]:
            self.user_form(f"perf {rest}")
            return

        (found,) = perf_to_kprobe([f"perf {rest}"], self.target.symbols, self.target.arch)
        self.note(f"writing event: {found.definition}")
        self.definition(found.definition)

    # -- statistics -------------------------------------------------------------------------------
    def cmd_stats(self, rest: str) -> None:
        now = time.monotonic()
        rows: list[tuple[object, ...]] = []
        mine: set[int] = set()
        for name, te in list(self.target.events.items()):
            probe = te.probe
            if probe is not None:
                mine.add(id(probe.kp if isinstance(probe, Kretprobe) else probe))
            since = self.armed.setdefault(name, now)
            rows.append((name, te.nhit, te.nmissed, te.lost, _rate(te.nhit, now - since)))
        for point in list(self.target.kprobes.points.values()):
            for kp in list(point.probes):
                if id(kp) in mine:
                    continue
                kind = "kretprobe" if kp.kretprobe is not None else "kprobe"
                since = self.armed.setdefault(f"{kind}@{id(kp)}", now)
                rows.append((f"{kind} {point.where}", kp.nhit, kp.nmissed, "-", _rate(kp.nhit, now - since)))
        if not rows:
            self.note("no events or probes")
            return
        self.out.write(render_table(("EVENT", "HITS", "NMISSED", "LOST", "HITS/S"), rows))
        waited = self.target.record_waits()
        if waited:
            self.note(f"{waited} hits found their CPU's record ring full and waited for qprobe to drain it "
                      "(none was lost for it)")  # fmt: skip

    # -- watching -------------------------------------------------------------------------------------
    def cmd_show(self, rest: str) -> None:
        spec = parse_collect(rest, verb="show", allow_key=False)
        events = self.select(spec.events)
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
                fmt = formats.get(hit.event)
                if fmt is None:
                    self.out.line(hit.line())
                else:
                    self.out.write(fmt(hit.escaped() if self.out.terminal else hit), escaped=True)

        formats = {te.definition.event: self.formats[te.name] for te in events if te.name in self.formats}
        ready = f"showing {', '.join(te.name for te in events)}; Ctrl-C to stop"
        timeline = self.target.timeline  # lines come out in the guest's order of hits, whatever their path
        with Tap(events, lambda te, hit, stack: timeline.push(hit.order, lambda: hits.put(hit))):
            result = self._watch(spec, drain, ready)
        timeline.flush()
        drain()
        self._report_run(result)

    def _kept(self, events: list[TraceEvent]) -> list[tuple[TraceEvent, EventHit]]:
        """Every hit the events have kept, in the guest's order of hits (those still in the guest's record
        rings drained first); what they did not keep is said."""
        self.target.sync()
        self.target.timeline.flush()
        kept: list[tuple[TraceEvent, EventHit]] = []
        evicted = unkept = 0
        for te in events:
            for one in te.probes():
                hits = one.hits.copy()  # one C call: the stop loop may keep another hit meanwhile
                kept += [(te, hit) for hit in hits]
                evicted += one.evicted
                unkept += max(0, one.nhit - len(hits) - one.evicted)
        if evicted:
            self.note(f"{evicted} older hits fell out of what the events keep (the last {events[0].keep} each): "
                      "not in here")  # fmt: skip
        if unkept:
            self.note(f"{unkept} hits were counted in guest RAM without a record: not in here")
        kept.sort(key=lambda pair: pair[1].order)
        return kept

    def _show_kept(self, events: list[TraceEvent]) -> None:
        """``show ... since boot``: the hits already made, as ``show`` prints hits as they come."""
        formats = {te.definition.event: self.formats[te.name] for te in events if te.name in self.formats}
        kept = self._kept(events)
        for _te, hit in kept:
            fmt = formats.get(hit.event)
            if fmt is None:
                self.out.line(hit.line())
            else:
                self.out.write(fmt(hit.escaped() if self.out.terminal else hit), escaped=True)
        if not kept:
            self.note("no hits")

    def cmd_format(self, rest: str) -> None:
        quote = rest.find('"')
        names, text = (rest[:quote].split(), rest[quote:]) if quote >= 0 else (rest.split(), "")
        if not names:
            raise ShellUsageError('usage: format EVENT... ["FMT", VALUE, ...]')
        events = self.select(names)
        if not text:
            for te in events:
                self.formats.pop(te.name, None)
            self.note(f"{', '.join(te.name for te in events)}: ftrace lines")
            return
        fmt = parse_printf(text)
        for te in events:
            self._check_names_of(fmt.names(), te)
            fmt.check_types(te.numbers)
        for te in events:
            self.formats[te.name] = fmt
        self.note(f"{', '.join(te.name for te in events)}: printf {text}")

    def _check_names_of(self, names: Sequence[str], te: TraceEvent) -> None:
        have = [a.name for a in te.definition.args]
        for name in names:
            if name not in have:
                raise ShellUsageError(f"{te.name} has no argument {name!r} ({', '.join(have) or 'no arguments'})")

    def cmd_count(self, rest: str) -> None:
        spec = parse_collect(rest, verb="count")
        events = self.select(spec.events)
        agg = Aggregation("count", spec.keys, by_event=not spec.keys and len(events) > 1)
        self._aggregate(spec, events, agg)

    def cmd_hist(self, rest: str) -> None:
        """``hist EVENT by VALUE``: a histogram of VALUE (the form before ``hist(VALUE)``)."""
        spec = parse_collect(rest, verb="hist", need_key=True)
        if len(spec.events) != 1 or len(spec.keys) != 1:
            raise ShellUsageError("usage: hist EVENT by VALUE, or hist(VALUE) [EVENT...] [by KEY, ...]")
        value = spec.keys[0]
        if value in ("$comm", "$stack"):
            raise ShellUsageError(f"hist needs a numeric value, not {value} (try: count EVENT by {value})")
        spec.keys = ()
        events = self.select(spec.events)
        self._check_names(value, events)
        self._aggregate(spec, events, Aggregation("hist", value=value))

    def call(self, call: Call, rest: str) -> None:
        """``sum(VALUE) [EVENT...] [by KEY, ...]`` and the other map functions of a value."""
        spec = parse_collect(rest, verb=call.func)
        events = self.select(spec.events)
        self._check_names(call.value, events)
        self._aggregate(spec, events, Aggregation(call.func, spec.keys, call.value, bounds=call.bounds))

    def _check_names(self, name: str, events: list[TraceEvent]) -> None:
        check_argument(name, [(te.name, te.definition) for te in events], "; `help count` lists the keys")

    def _aggregate(self, spec: Collect, events: list[TraceEvent], agg: Aggregation) -> None:
        for key in spec.keys:
            self._check_names(key, events)
        if spec.since_boot:
            if "$stack" in spec.keys:
                raise ShellUsageError("$stack is unwound while the vCPU is stopped at a hit: not for hits "
                                      "already made (since boot)")  # fmt: skip
            for te, hit in self._kept(events):
                agg.add(te, hit)
            if not agg.print_and_clear(self.out.write):
                self.note("no hits")
            if agg.skipped:
                self.note(f"({agg.skipped} of {agg.total} values of {agg.value} were not numbers)")
            return
        every = spec.every
        due = [time.monotonic() + every] if every is not None else []

        def poll() -> None:  # every S: print the map and clear it, as an interval probe's print(@); clear(@)
            if due and time.monotonic() >= due[0]:
                due[0] += every or 0
                agg.print_and_clear(self._write_now)

        collector = Collector(events, agg, every=every)
        with collector:
            # Said (in _watch) once every hit is counted and a Ctrl-C ends the count, not its set-up.
            what = ", ".join(te.name for te in events) + (f" by {', '.join(spec.keys)}" if spec.keys else "")
            value = f"{agg.kind}({agg.value}) of " if agg.value is not None else "counting "
            ready = f"{value}{what}{f' every {every:g} s' if every else ''}; Ctrl-C to stop"
            result = self._watch(spec, poll, ready)
        self._report_run(result)
        if not agg.print_and_clear(self.out.write) and every is None:
            self.note("no hits")
        if agg.skipped:
            self.note(f"({agg.skipped} of {agg.total} values of {agg.value} were not numbers)")
        if collector.missed:
            # Hits the guest made but nobody counted: records dropped on a full lossy ring, or hits missed
            # while the same vCPU was already in a probe.  The counts above are short by that many.
            self.out.write(f"@lost: {collector.missed}\n")
            self.note(f"{collector.missed} hits were lost (full record rings or missed probes): "
                      "the counts above miss them")  # fmt: skip

    def _watch(self, spec: Collect, poll: Callable[[], None], ready: str) -> RunResult | QprobeError | None:
        """Until Ctrl-C, for ``spec.seconds``, or while ``spec.command`` runs in the guest.

        A watch until Ctrl-C prints ``ready`` (which says so) once a Ctrl-C ends the watch:
        one typed as soon as it shows must not interrupt the set-up before it instead.
        ``poll`` (printing hits, for ``show``) runs every 0.1 s.  The guest command
        runs on this thread, so that Ctrl-C interrupts its wait and frees the console
        at once (and is passed on to the guest); ``poll`` then runs on a helper thread.
        Returns the command's result, or the error it raised.
        """
        if spec.command is not None:
            stop = threading.Event()

            def poller() -> None:
                while not stop.wait(0.1):
                    poll()

            helper = threading.Thread(target=poller, name="qprobe-shell-poll", daemon=True)
            helper.start()
            result: RunResult | QprobeError | None = None
            try:
                result = self.target.run(spec.command, timeout=RUN_TIMEOUT)
            except KeyboardInterrupt:
                self.interrupt_guest()
                # run() drains the record rings when the command ends; an interrupted one did not.
                self.target.sync()
                self.out.line("")
                self.note("interrupted: sent ^C to the guest command")
            except QprobeError as exc:
                result = exc
            finally:
                stop.set()
                helper.join()
            poll()
            return result
        deadline = None if spec.seconds is None else time.monotonic() + spec.seconds
        try:
            if deadline is None:
                self.note(ready)
            while True:
                poll()
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    break
                self.target.wait(left)  # a VM that dies ends the watch at once
        except KeyboardInterrupt:
            self.out.line("")
        self.target.sync()  # the hits still in the guest's record rings when the count ends (time up or Ctrl-C)
        poll()
        return None

    def _report_run(self, result: RunResult | QprobeError | None) -> None:
        if isinstance(result, QprobeError):
            self.error(str(result))
        elif result is not None:
            self._print_run(result)

    def interrupt_guest(self) -> None:
        """Ctrl-C the guest's foreground command (the guest shell's port is its controlling tty)."""
        try:
            self.target.interrupt_guest()
        except QprobeError:
            pass

    # -- the guest ---------------------------------------------------------------------------------
    def cmd_run(self, rest: str) -> None:
        if not rest:
            raise ShellUsageError("usage: run CMD")
        try:
            result = self.target.run(rest, timeout=RUN_TIMEOUT)
        except KeyboardInterrupt:
            self.interrupt_guest()
            self.out.line("")
            self.note("interrupted: sent ^C to the guest command")
            return
        self._print_run(result)

    def _print_run(self, result: RunResult) -> None:
        if result.output:
            self.out.write(result.output if result.output.endswith("\n") else result.output + "\n")
        self.out.line(f"exit status {result.status}", "note" if result.status == 0 else "error")

    # -- the shell itself ---------------------------------------------------------------------------
    def cmd_help(self, rest: str) -> None:
        if rest:
            name = ALIASES.get(rest, rest)
            name = "p" if is_definition(name) and name.startswith("p") else name
            name = "r" if is_definition(name) and name.startswith("r") else name
            if name not in COMMANDS and f"{name}()" in COMMANDS:
                name = f"{name}()"
            if name not in COMMANDS:
                raise ShellUsageError(f"no command {rest!r}; `help` lists them")
            usage, summary = COMMANDS[name]
            self.out.parts((usage, "header"))
            self.out.line(f"  {summary}")
            if name in ("count", "hist") or name.endswith("()"):
                self.out.line(f"  {KEY_HELP}")
            return
        width = max(len(u) for u, _ in COMMANDS.values())
        for usage, summary in COMMANDS.values():
            self.out.parts((f"{usage:<{width}}  ", "header"), (summary, "note"))
        self.note(f"{KEY_HELP}.  Ctrl-C stops a command; Ctrl-D leaves, removing every probe.")

    def cmd_clear(self, rest: str) -> None:
        self.out.console.clear()  # rich writes the terminal's clear sequence only to a terminal

    def cmd_quit(self, rest: str) -> None:
        self.done = True


def _rate(hits: int, seconds: float) -> str:
    return f"{hits / seconds:.2f}" if seconds > 0 else "0.00"

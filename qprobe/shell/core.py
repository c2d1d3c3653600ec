"""The shell: ``Shell(target, out).execute(line)`` writes what the line asks for.

The prompt loop (``qprobe.shell.prompt``) only reads lines and hands them
here, so every command runs the same from a terminal, a script or a test.
``Shell`` owns the state that outlives a command and routes each command word
to its group: events (event_cmds), the probe table (probe_cmds), printing
hits (show_cmds), maps (map_cmds), the guest (guest_cmds) and the kernel
(inspect_cmds).  An error is printed as one line (a bad definition also gets
a caret under the column the kernel would point at) and the shell goes on;
Ctrl-C ends the command that is running, never the shell or the VM.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from qprobe.errors import FetchArgError, QprobeError

from .event_cmds import EventCommands
from .guest_cmds import GuestCommands
from .inspect_cmds import InspectCommands
from .map_cmds import MapCommands
from .mapsyntax import map_line
from .output import Output
from .parse import ShellUsageError, is_bpftrace_uprobe, is_definition, split_call, split_command
from .probe_cmds import ProbeCommands
from .show_cmds import ShowCommands

if TYPE_CHECKING:
    from qprobe.events.funcs import Probeability

    from .context import CommandGroup, Handler
    from .printf import HitFormat
    from .target import ShellTarget

log = logging.getLogger("qprobe.shell")

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
    "fd); VALUE: a numeric argument, $pid or $cpu. bpftrace's spellings too: @NAME[KEY, ...] = count() EVENT... "
    "(the same as count EVENT... by KEY, ...), sum(), avg() and the rest. A map keyed by nothing or $comm, $pid, "
    "$cpu, $func, $event and integer register arguments, of an integer register value, is folded in guest RAM at "
    "each hit, each event's own; where a probe cannot, a count by nothing, $func or $event is each probe's own hit "
    "count (as kprobe_profile's): exact, never lost; other maps come from the records the guest writes at each hit; "
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
        guest = GuestCommands(self)
        self.event_commands = EventCommands(self)  # also the lines that define events
        self.map_commands = MapCommands(self, guest)  # also the lines that call a map function
        groups: list[CommandGroup] = [self.event_commands, ProbeCommands(self), ShowCommands(self, guest),
                                      self.map_commands, guest, InspectCommands(self)]  # fmt: skip
        self.handlers: dict[str, Handler] = {"help": self.cmd_help, "clear": self.cmd_clear, "quit": self.cmd_quit}
        for group in groups:
            self.handlers.update(group.handlers())

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
            self.event_commands.definition(line.strip())
            return
        if is_bpftrace_uprobe(line):
            self.event_commands.user_form(line.strip())
            return
        named = map_line(line)  # bpftrace's spellings: @NAME[KEY, ...] = FUNC(...), count()
        if named is not None:
            self.map_commands.named(*named)
            return
        call = split_call(line)
        if call is not None:
            self.map_commands.call(*call)
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

    def _caret(self, line: str, exc: FetchArgError) -> None:
        lead = len(line) - len(line.lstrip())
        if self.interactive and exc.text == line.strip():
            # The definition is on screen right above: one line, the caret under the column.
            self.out.parts((" " * (len(self.prompt) + lead + exc.column) + "^ ", "caret"), (exc.explained, "error"))
            return
        self.out.line(exc.text or line.strip())
        self.out.parts((" " * exc.column + "^ ", "caret"), (exc.explained, "error"))

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

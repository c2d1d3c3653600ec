"""The interactive loop: prompt_toolkit with history, completion of commands, events and symbols.

Symbol completion searches a sorted list with ``bisect`` (the kernel has
~116k symbols: a linear scan per keystroke would lag), capped at a few
hundred candidates.  Without a terminal on stdin the loop reads lines and
runs them (``qprobe shell < script``).
"""

from __future__ import annotations

import bisect
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError

from .core import ALIASES, COMMANDS, Shell
from .parse import SPECIAL_KEYS, is_definition

if TYPE_CHECKING:
    from prompt_toolkit.completion import CompleteEvent, Completion
    from prompt_toolkit.document import Document

    from qprobe.arch import RegisterLayout

    from .target import ShellTarget

PROMPT = "qprobe> "
MAX_COMPLETIONS = 300
SYMBOL_COMMANDS = frozenset({"sym", "addr", "x"})
EVENT_COMMANDS = frozenset({"enable", "disable", "show", "count", "hist"})
VAR_HINTS = ("$retval", "$comm", "$stack", "$stack0", "$arg1", "$arg2", "$arg3", "$arg4", "$arg5", "$arg6")


class SymbolIndex:
    """Sorted names; ``complete(prefix)`` is two binary searches and a slice."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = sorted(names)

    def complete(self, prefix: str, limit: int = MAX_COMPLETIONS) -> list[str]:
        lo = bisect.bisect_left(self.names, prefix)
        # Every name that starts with prefix sorts before prefix + the highest code point.
        hi = bisect.bisect_left(self.names, prefix + "\U0010ffff", lo)
        return self.names[lo : min(hi, lo + limit)]


def fetch_hints(registers: RegisterLayout) -> tuple[str, ...]:
    """What a fetch argument's value may be: the variables, the registers the architecture passes a function's
    arguments and return value in, its stack pointer, and memory at the first two arguments (on x86_64:
    ``%di`` ... ``%r9``, ``%ax``, ``%sp``, ``+0(%di)``, ``+0(%si):string``)."""
    first, second = registers.arg_regs[:2]
    # Each once, in that order: an architecture may return in its first argument register (arm64's x0).
    regs = dict.fromkeys((*registers.arg_regs, registers.retval, registers.sp))
    return (*VAR_HINTS, *(f"%{r}" for r in regs), f"+0(%{first})", f"+0(%{second}):string",
            f"+0(%{second}):ustring")  # fmt: skip


def words_before_cursor(text: str) -> tuple[list[str], str]:
    """(finished words, the word being typed)."""
    words = text.split()
    if not text or text[-1].isspace():
        return words, ""
    return words[:-1], words[-1]


def candidates(shell: Shell, index: SymbolIndex | None, text: str) -> list[str]:
    """What may complete the last word of ``text``: pure, for tests and for the completer."""
    done, word = words_before_cursor(text)
    events = [te.definition.event for te in list(shell.target.events.values())]
    if not done:
        if word.startswith("-:"):
            return [f"-:{e}" for e in events if f"-:{e}".startswith(word)]
        names = [c for c in (*COMMANDS, *ALIASES) if c not in ("p", "r", "-:")]
        return sorted(c for c in names if c.startswith(word))
    head = ALIASES.get(done[0], done[0])
    if is_definition(done[0]):
        if len(done) == 1 and index is not None:
            return index.complete(word) if "+" not in word else []
        name, eq, value = word.rpartition("=")
        if eq:
            return [f"{name}={h}" for h in fetch_hints(shell.target.arch.registers) if h.startswith(value)]
        return []
    if head in SYMBOL_COMMANDS and len(done) == 1 and index is not None:
        return index.complete(word) if "+" not in word else []
    if head == "help" and len(done) == 1:
        return sorted(c for c in COMMANDS if c.startswith(word))
    if head in ("regs", "bt") and len(done) == 1:
        return [str(i) for i in range(shell.target.vcpus) if str(i).startswith(word)]
    if head in EVENT_COMMANDS:
        if done[-1] in ("for", "run"):
            return []
        if done[-1] == "by":
            keys: list[str] = []
            for te in list(shell.target.events.values()):
                if te.definition.event in done[1:] or te.name in done[1:]:
                    keys += [a.name for a in te.definition.args if a.name not in keys]
            return [k for k in (*keys, *SPECIAL_KEYS) if k.startswith(word)]
        if "run" in done:
            return []
        extra = ["by", "for", "run"] if head in ("count", "hist", "show") and len(done) > 1 else []
        return [c for c in (*events, *extra) if c.startswith(word) and c not in done]
    return []


def _completer(shell: Shell) -> object:
    from prompt_toolkit.completion import Completer, Completion, PathCompleter

    class ShellCompleter(Completer):
        def __init__(self) -> None:
            self.index: SymbolIndex | None = None
            self.paths = PathCompleter(expanduser=True)

        def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
            text = document.text_before_cursor
            done, word = words_before_cursor(text)
            if done and done[0] == "load":
                from prompt_toolkit.document import Document as Doc

                yield from self.paths.get_completions(Doc(word, len(word)), complete_event)
                return
            if self.index is None:
                self.index = SymbolIndex(shell.target.symbols.names())
            for c in candidates(shell, self.index, text):
                yield Completion(c, start_position=-len(word))

    return ShellCompleter()


def history_path() -> Path:
    from qprobe.paths import cache_dir

    return cache_dir() / "shell_history"


def run_shell(target: ShellTarget, shell: Shell | None = None, *, banner: bool = True) -> int:
    """Read lines until ``quit`` or Ctrl-D; the caller closes the target (removing every probe)."""
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    shell = shell or Shell(target, interactive=interactive, prompt=PROMPT)
    shell.interactive = interactive
    if not interactive:
        for line in sys.stdin:
            shell.execute(line.rstrip("\n"))
            if shell.done:
                break
        return 0
    shell.prompt = PROMPT
    # Ctrl-C stops a command, as the banner says, even where the shell was started with SIGINT
    # ignored (``cmd &`` from a script, nohup): an interactive shell takes it back, as bash does.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    from prompt_toolkit import PromptSession
    from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
    from prompt_toolkit.history import FileHistory

    session: PromptSession[str] = PromptSession(
        history=FileHistory(str(history_path())), completer=_completer(shell),  # type: ignore[arg-type]
        auto_suggest=AutoSuggestFromHistory(), complete_while_typing=True,
    )  # fmt: skip
    if banner:
        shell.note("qprobe shell: `help` lists commands, Tab completes, Ctrl-C stops a command, Ctrl-D quits")
    gone: list[QprobeError] = []

    def watch() -> None:
        """A VM that dies while the prompt waits for a line ends the shell at once, not at the next command."""
        try:
            target.wait()
        except QprobeError as exc:
            gone.append(exc)
            app, loop = session.app, session.app.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(lambda: app.exit(exception=EOFError) if app.is_running else None)

    threading.Thread(target=watch, name="qprobe-shell-liveness", daemon=True).start()
    while not shell.done and not gone:
        try:
            line = session.prompt(PROMPT)
        except KeyboardInterrupt:
            continue
        except EOFError:
            break
        try:
            shell.execute(line)
        except KeyboardInterrupt:  # a second Ctrl-C while a command was cleaning up
            shell.note("interrupted")
    if gone:
        raise gone[0]
    return 0

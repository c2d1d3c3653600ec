"""Guest text reaches a terminal with its control characters shown, never acted on: a process named
``ESC]0;...BEL ESC[2J`` must not retitle and clear the user's terminal (ps shows them the same way)."""

from __future__ import annotations

import io

from qprobe.events import EventHit
from qprobe.fetch import terminal_safe
from qprobe.shell.output import Output
from qprobe.shell.printf import parse_printf

HOSTILE = "\x1b]0;owned\x07\x1b[2J\rx\x9b"


def test_terminal_safe_shows_every_control_but_tab_and_newline() -> None:
    assert terminal_safe(f"a{HOSTILE}\tb\n") == "a\\x1b]0;owned\\x07\\x1b[2J\\x0dx\\x9b\tb\n"
    assert terminal_safe("é ü workload") == "é ü workload"


def _hit() -> EventHit:
    return EventHit("rd", 0, 42, f"w{HOSTILE}", 1.0, 0x1000, "ksys_read+0x0", {"s": f'"{HOSTILE}"'},
                    f'(ksys_read+0x0/0x90) s="{HOSTILE}"')  # fmt: skip


def test_a_hit_escaped_for_a_terminal() -> None:
    line = _hit().escaped().line()
    assert "\x1b" not in line and "\x07" not in line and "w\\x1b]0;owned\\x07" in line
    assert _hit().line().count("\x1b") == 4  # a pipe gets the bytes as ftrace prints them


def test_the_shell_escapes_on_a_terminal_only_and_keeps_the_users_printf_escapes() -> None:
    tty = io.StringIO()
    Output(tty, color=True).write(f"@[{HOSTILE}]: 1\n")
    assert "\x07" not in tty.getvalue() and "\\x1b]0;owned\\x07" in tty.getvalue()
    pipe = io.StringIO()
    Output(pipe, color=False).write(f"@[{HOSTILE}]: 1\n")
    assert "\x1b]0;owned" in pipe.getvalue() and "\\x" not in pipe.getvalue()  # as rich writes to a file
    # The user's \e colours a printf line; the guest's comm in it is escaped before it is formatted.
    fmt = parse_printf('"\\e[31m%s\\e[0m\\n", comm')
    tty = io.StringIO()
    Output(tty, color=True).write(fmt(_hit().escaped()), escaped=True)
    assert "\x1b[31m" in tty.getvalue() and "\x07" not in tty.getvalue()
